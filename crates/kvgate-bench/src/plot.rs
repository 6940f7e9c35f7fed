//! SVG plots (plotters): TTFT CDF per policy, and per-worker running requests over time (one panel
//! per policy).

use std::path::Path;

use plotters::prelude::*;

use crate::compare::sampler::Sample;

fn err(e: impl std::fmt::Display) -> anyhow::Error {
    anyhow::anyhow!("plot: {e}")
}

/// Empirical CDF points of `values` (sorted copy): (value, fraction ≤ value).
pub fn cdf(values: &[f64]) -> Vec<(f64, f64)> {
    let mut v: Vec<f64> = values.iter().copied().filter(|x| x.is_finite()).collect();
    v.sort_by(f64::total_cmp);
    let n = v.len() as f64;
    v.iter()
        .enumerate()
        .map(|(i, &x)| (x, (i + 1) as f64 / n))
        .collect()
}

/// TTFT CDF, one line per policy (values in ms).
pub fn ttft_cdf(path: &Path, series: &[(String, Vec<f64>)]) -> anyhow::Result<()> {
    let curves: Vec<(&str, Vec<(f64, f64)>)> =
        series.iter().map(|(n, v)| (n.as_str(), cdf(v))).collect();
    // Clip the x axis at the largest p99 so one policy's tail does not flatten everyone else.
    let xmax = curves
        .iter()
        .filter_map(|(_, c)| {
            c.get(((c.len() as f64) * 0.99) as usize)
                .or(c.last())
                .map(|p| p.0)
        })
        .fold(1.0f64, f64::max)
        * 1.05;
    let root = SVGBackend::new(path, (900, 560)).into_drawing_area();
    root.fill(&WHITE).map_err(err)?;
    let mut chart = ChartBuilder::on(&root)
        .caption(
            "TTFT CDF (x clipped at the largest p99)",
            ("sans-serif", 20),
        )
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(50)
        .build_cartesian_2d(0f64..xmax, 0f64..1f64)
        .map_err(err)?;
    chart
        .configure_mesh()
        .x_desc("TTFT (ms)")
        .y_desc("fraction of requests")
        .draw()
        .map_err(err)?;
    for (i, (name, pts)) in curves.into_iter().enumerate() {
        let color = Palette99::pick(i).to_rgba();
        chart
            .draw_series(LineSeries::new(
                pts.into_iter().filter(|p| p.0 <= xmax),
                color.stroke_width(2),
            ))
            .map_err(err)?
            .label(name)
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2))
            });
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::LowerRight)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()
        .map_err(err)?;
    root.present().map_err(err)?;
    Ok(())
}

/// Running requests per worker over time: one panel per policy, one line per worker.
pub fn worker_load(path: &Path, series: &[(String, Vec<Sample>)]) -> anyhow::Result<()> {
    let n = series.len().max(1);
    let root = SVGBackend::new(path, (900, 260 * n as u32)).into_drawing_area();
    root.fill(&WHITE).map_err(err)?;
    let ymax = series
        .iter()
        .flat_map(|(_, s)| s.iter().flat_map(|x| x.running.iter().flatten().copied()))
        .fold(1.0f64, f64::max)
        * 1.1;
    let tmax = series
        .iter()
        .flat_map(|(_, s)| s.iter().map(|x| x.t))
        .fold(1.0f64, f64::max);
    for (panel, (name, samples)) in root.split_evenly((n, 1)).iter().zip(series) {
        let mut chart = ChartBuilder::on(panel)
            .caption(
                format!("{name}: running requests per worker"),
                ("sans-serif", 16),
            )
            .margin(8)
            .x_label_area_size(30)
            .y_label_area_size(40)
            .build_cartesian_2d(0f64..tmax, 0f64..ymax)
            .map_err(err)?;
        chart.configure_mesh().x_desc("s").draw().map_err(err)?;
        let workers = samples.iter().map(|s| s.running.len()).max().unwrap_or(0);
        for w in 0..workers {
            let color = Palette99::pick(w).to_rgba();
            let pts = samples
                .iter()
                .filter_map(|s| s.running.get(w).copied().flatten().map(|v| (s.t, v)));
            chart
                .draw_series(LineSeries::new(pts, color))
                .map_err(err)?;
        }
    }
    root.present().map_err(err)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cdf_is_sorted_and_ends_at_one() {
        assert_eq!(
            cdf(&[3.0, 1.0, 2.0, f64::NAN]),
            vec![(1.0, 1.0 / 3.0), (2.0, 2.0 / 3.0), (3.0, 1.0)]
        );
        assert!(cdf(&[]).is_empty());
    }

    #[test]
    fn plots_render_to_svg() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("cdf.svg");
        ttft_cdf(
            &p,
            &[
                ("kv".into(), vec![1.0, 2.0, 5.0]),
                ("round_robin".into(), vec![3.0, 9.0]),
            ],
        )
        .unwrap();
        let svg = std::fs::read_to_string(&p).unwrap();
        assert!(
            svg.starts_with("<svg") && svg.contains("round_robin"),
            "{}",
            &svg[..200.min(svg.len())]
        );
        let p = dir.path().join("load.svg");
        let s = vec![
            Sample {
                t: 0.0,
                running: vec![Some(1.0), Some(2.0)],
            },
            Sample {
                t: 1.0,
                running: vec![Some(3.0), None],
            },
        ];
        worker_load(&p, &[("kv".into(), s.clone()), ("least_loaded".into(), s)]).unwrap();
        assert!(std::fs::read_to_string(&p)
            .unwrap()
            .contains("least_loaded"));
    }
}
