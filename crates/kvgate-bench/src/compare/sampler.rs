//! Samples every worker's `vllm:num_requests_running` during a run, for the load-over-time plot
//! and the max/mean load column. A sample that fails (worker busy, slow scrape) is recorded as
//! missing rather than zero, so it does not fake an idle worker.

use std::sync::Arc;
use std::time::Duration;

use serde::Serialize;
use std::sync::Mutex;
use tokio::task::JoinHandle;
use tokio::time::Instant;

use super::http;

/// One sampling round: seconds since the start of the run, running requests per worker.
#[derive(Debug, Clone, Serialize)]
pub struct Sample {
    pub t: f64,
    pub running: Vec<Option<f64>>,
}

/// Sum of a gauge's samples across label sets in Prometheus text (`None` if absent).
pub fn gauge_sum(text: &str, name: &str) -> Option<f64> {
    let mut found = None;
    for line in text.lines() {
        let Some(rest) = line.strip_prefix(name) else {
            continue;
        };
        let rest = match rest.as_bytes().first() {
            Some(b'{') => match rest.find('}') {
                Some(end) => &rest[end + 1..],
                None => continue,
            },
            Some(b' ') | Some(b'\t') => rest,
            _ => continue, // a longer name with this prefix
        };
        if let Some(v) = rest
            .split_whitespace()
            .next()
            .and_then(|v| v.parse::<f64>().ok())
        {
            *found.get_or_insert(0.0) += v;
        }
    }
    found
}

/// A background sampler; `finish` stops it and returns the samples.
pub struct Sampler {
    samples: Arc<Mutex<Vec<Sample>>>,
    task: JoinHandle<()>,
}

impl Sampler {
    pub fn start(worker_urls: Vec<String>, every: Duration) -> Self {
        let samples = Arc::new(Mutex::new(Vec::new()));
        let out = samples.clone();
        let task = tokio::spawn(async move {
            let start = Instant::now();
            let mut tick = tokio::time::interval(every);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
            loop {
                tick.tick().await;
                let t = start.elapsed().as_secs_f64();
                let polls = worker_urls.iter().cloned().map(|u| async move {
                    let (status, body) = http::get(&format!("{u}/metrics")).await.ok()?;
                    if !status.is_success() {
                        return None;
                    }
                    gauge_sum(
                        std::str::from_utf8(&body).ok()?,
                        "vllm:num_requests_running",
                    )
                });
                let running = futures_join_all(polls).await;
                if let Ok(mut v) = out.lock() {
                    v.push(Sample { t, running });
                }
            }
        });
        Self { samples, task }
    }

    pub async fn finish(self) -> Vec<Sample> {
        self.task.abort();
        let _ = self.task.await;
        let v = self.samples.lock().map(|v| v.clone()).unwrap_or_default();
        v
    }
}

/// Runs the polls concurrently (one short task each) so one slow worker does not delay the
/// others' samples; results keep the workers' order.
async fn futures_join_all<F, T>(futs: impl Iterator<Item = F>) -> Vec<Option<T>>
where
    F: std::future::Future<Output = Option<T>> + Send + 'static,
    T: Send + 'static,
{
    let handles: Vec<JoinHandle<Option<T>>> = futs.map(tokio::spawn).collect();
    let mut out = Vec::with_capacity(handles.len());
    for h in handles {
        out.push(h.await.ok().flatten());
    }
    out
}

/// Time-averaged running requests per worker, over the samples where that worker answered.
pub fn mean_per_worker(samples: &[Sample], workers: usize) -> Vec<f64> {
    (0..workers)
        .map(|w| {
            let vals: Vec<f64> = samples
                .iter()
                .filter_map(|s| s.running.get(w).copied().flatten())
                .collect();
            if vals.is_empty() {
                0.0
            } else {
                vals.iter().sum::<f64>() / vals.len() as f64
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gauge_sum_adds_label_sets_and_ignores_longer_names() {
        let text = "# HELP vllm:num_requests_running x\n# TYPE vllm:num_requests_running gauge\n\
                    vllm:num_requests_running{model_name=\"m\",engine=\"0\"} 3.0\n\
                    vllm:num_requests_running{model_name=\"m\",engine=\"1\"} 2\n\
                    vllm:num_requests_running_total 99\n\
                    vllm:num_requests_waiting 7\n";
        assert_eq!(gauge_sum(text, "vllm:num_requests_running"), Some(5.0));
        assert_eq!(gauge_sum(text, "vllm:num_requests_waiting"), Some(7.0));
        assert_eq!(gauge_sum(text, "vllm:absent"), None);
    }

    #[test]
    fn means_skip_missing_samples() {
        let s = vec![
            Sample {
                t: 0.0,
                running: vec![Some(2.0), None],
            },
            Sample {
                t: 1.0,
                running: vec![Some(4.0), Some(1.0)],
            },
        ];
        assert_eq!(mean_per_worker(&s, 2), vec![3.0, 1.0]);
    }
}
