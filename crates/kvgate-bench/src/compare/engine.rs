//! Where a row's TTFT went at the engines: the workers' own histograms read before and after the
//! row (every worker summed), as means per request. `vllm:request_queue_time_seconds` (waiting for
//! a slot or KV memory, after the engine took the request in) and
//! `vllm:request_prefill_time_seconds` (scheduled → first token) come from vLLM and the sim;
//! `kvgate_sim_step_wait_seconds` (arrival → the engine taking the request in between two steps:
//! the wait for the step in progress) from the sim only. A worker that exports none of them
//! leaves the row without a split.

use serde::Serialize;

use super::gateways::sample_sum;

/// Sums and counts of the three histograms over the fleet at one moment.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct EngineTimes {
    step_wait: (f64, f64),
    queue: (f64, f64),
    prefill: (f64, f64),
}

/// A row's means per request, in ms (None: no worker exported that histogram).
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct EngineSplit {
    pub step_wait_ms: Option<f64>,
    pub queue_ms: Option<f64>,
    pub prefill_ms: Option<f64>,
}

impl EngineTimes {
    /// From `/metrics` texts (any labels summed).
    pub fn parse(texts: &[String]) -> Self {
        let pair = |name: &str| {
            texts.iter().fold((0.0, 0.0), |(s, n), t| {
                (
                    s + sample_sum(t, &format!("{name}_sum")).unwrap_or(0.0),
                    n + sample_sum(t, &format!("{name}_count")).unwrap_or(0.0),
                )
            })
        };
        Self {
            step_wait: pair("kvgate_sim_step_wait_seconds"),
            queue: pair("vllm:request_queue_time_seconds"),
            prefill: pair("vllm:request_prefill_time_seconds"),
        }
    }

    /// Reads every worker's `/metrics` now; None if one cannot be read.
    pub async fn read(urls: &[String]) -> Option<Self> {
        let mut texts = Vec::with_capacity(urls.len());
        for u in urls {
            let (status, body) = super::http::get(&format!("{u}/metrics")).await.ok()?;
            if !status.is_success() {
                return None;
            }
            texts.push(String::from_utf8_lossy(&body).into_owned());
        }
        Some(Self::parse(&texts))
    }

    /// Means per request of what happened between `before` and `self`.
    pub fn since(&self, before: &Self) -> EngineSplit {
        let mean = |a: (f64, f64), b: (f64, f64)| {
            let n = a.1 - b.1;
            (n > 0.0).then(|| (a.0 - b.0) / n * 1e3)
        };
        EngineSplit {
            step_wait_ms: mean(self.step_wait, before.step_wait),
            queue_ms: mean(self.queue, before.queue),
            prefill_ms: mean(self.prefill, before.prefill),
        }
    }
}

impl EngineSplit {
    pub fn is_empty(&self) -> bool {
        self.step_wait_ms.is_none() && self.queue_ms.is_none() && self.prefill_ms.is_none()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn text(step: (f64, u64), queue: (f64, u64), prefill: (f64, u64)) -> String {
        let l = "{engine=\"0\",model_name=\"m\"}";
        format!(
            "kvgate_sim_step_wait_seconds_sum{l} {}\nkvgate_sim_step_wait_seconds_count{l} {}\n\
             vllm:request_queue_time_seconds_sum{l} {}\nvllm:request_queue_time_seconds_count{l} {}\n\
             vllm:request_prefill_time_seconds_sum{l} {}\nvllm:request_prefill_time_seconds_count{l} {}\n",
            step.0, step.1, queue.0, queue.1, prefill.0, prefill.1
        )
    }

    #[test]
    fn a_rows_split_is_the_mean_of_what_the_fleet_added_during_it() {
        let before = EngineTimes::parse(&[
            text((0.5, 10), (1.0, 10), (2.0, 10)),
            text((0.0, 0), (0.0, 0), (0.0, 0)),
        ]);
        // 20 more requests over two workers: 0.24 s of step waits, 0.1 s queued, 0.6 s prefill.
        let after = EngineTimes::parse(&[
            text((0.64, 20), (1.05, 20), (2.4, 20)),
            text((0.1, 10), (0.05, 10), (0.2, 10)),
        ]);
        let s = after.since(&before);
        assert!((s.step_wait_ms.unwrap() - 12.0).abs() < 1e-9);
        assert!((s.queue_ms.unwrap() - 5.0).abs() < 1e-9);
        assert!((s.prefill_ms.unwrap() - 30.0).abs() < 1e-9);
    }

    #[test]
    fn workers_without_the_histograms_leave_no_split() {
        let t = EngineTimes::parse(&["vllm:num_requests_running 1\n".to_string()]);
        assert!(t.since(&t).is_empty());
        // vLLM exports queue and prefill time but not the sim's step wait.
        let before = EngineTimes::parse(&[text((0.0, 0), (1.0, 10), (2.0, 10))
            .lines()
            .filter(|l| !l.starts_with("kvgate_sim"))
            .collect::<Vec<_>>()
            .join("\n")]);
        let after = EngineTimes::parse(&[text((0.0, 0), (2.0, 20), (3.0, 20))
            .lines()
            .filter(|l| !l.starts_with("kvgate_sim"))
            .collect::<Vec<_>>()
            .join("\n")]);
        let s = after.since(&before);
        assert_eq!(s.step_wait_ms, None);
        assert_eq!(s.queue_ms, Some(100.0));
        assert_eq!(s.prefill_ms, Some(100.0));
    }
}
