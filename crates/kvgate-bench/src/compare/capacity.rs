//! The fleet's KV capacity for the pooled-LRU oracle, as the workers report it: each worker's
//! `vllm:cache_config_info` on its `/metrics` (`num_gpu_blocks` summed over its engines, times its
//! `block_size`), falling back to `--num-gpu-blocks` (at the oracle's block size) with a printed
//! note for a worker that does not say. An external fleet (`--worker`) is then measured against
//! what it can really hold, not against this command's default.

use kvgate_protocol::prom_text::{self, VllmCacheConfig};
use serde::Serialize;

/// One worker's KV capacity and where the figure came from.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct WorkerCapacity {
    pub url: String,
    pub num_gpu_blocks: u64,
    pub block_size: u64,
    /// `cache_config_info` (the worker said) or `--num-gpu-blocks` (assumed).
    pub source: &'static str,
}

impl WorkerCapacity {
    /// From the worker's `/metrics` text (`None`: not fetched), or the fallback.
    pub fn from_metrics(
        url: &str,
        metrics: Option<&str>,
        fallback_blocks: u64,
        block_size: u64,
    ) -> Self {
        let reported = metrics
            .map(|text| VllmCacheConfig::read(&prom_text::parse(text)))
            .unwrap_or_default();
        match reported.num_gpu_blocks {
            Some(n) if n > 0 => WorkerCapacity {
                url: url.to_owned(),
                num_gpu_blocks: n,
                block_size: reported.block_size.map_or(block_size, u64::from),
                source: "cache_config_info",
            },
            _ => WorkerCapacity {
                url: url.to_owned(),
                num_gpu_blocks: fallback_blocks,
                block_size,
                source: "--num-gpu-blocks",
            },
        }
    }

    pub fn reported(&self) -> bool {
        self.source == "cache_config_info"
    }
}

/// Reads every worker's capacity (one `/metrics` GET each), printing a note for each worker that
/// does not report it.
pub async fn read(urls: &[String], fallback_blocks: u64, block_size: u64) -> Vec<WorkerCapacity> {
    let mut out = Vec::with_capacity(urls.len());
    for url in urls {
        let text = match super::http::get(&format!("{url}/metrics")).await {
            Ok((s, body)) if s.is_success() => Some(String::from_utf8_lossy(&body).into_owned()),
            _ => None,
        };
        let c = WorkerCapacity::from_metrics(url, text.as_deref(), fallback_blocks, block_size);
        if !c.reported() {
            eprintln!(
                "note: {url} reports no vllm:cache_config_info on /metrics; the capacity oracle \
                 assumes --num-gpu-blocks {fallback_blocks} blocks of {block_size} tokens there"
            );
        }
        out.push(c);
    }
    out
}

/// The fleet's capacity in blocks of the oracle's `block_size` (tokens pooled over workers whose
/// block sizes may differ).
pub fn pooled_blocks(workers: &[WorkerCapacity], block_size: u64) -> usize {
    let tokens: u64 = workers
        .iter()
        .map(|w| w.num_gpu_blocks.saturating_mul(w.block_size))
        .sum();
    usize::try_from(tokens / block_size.max(1)).unwrap_or(usize::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_cache_config_info_or_falls_back() {
        let text = "# TYPE vllm:cache_config_info gauge\n\
            vllm:cache_config_info{block_size=\"32\",engine=\"0\",num_gpu_blocks=\"100\"} 1.0\n\
            vllm:cache_config_info{block_size=\"32\",engine=\"1\",num_gpu_blocks=\"50\"} 1.0\n";
        let c = WorkerCapacity::from_metrics("http://a", Some(text), 2048, 16);
        assert_eq!(
            (c.num_gpu_blocks, c.block_size, c.reported()),
            (150, 32, true)
        );
        let none = WorkerCapacity::from_metrics("http://b", Some("sglang:x 1\n"), 2048, 16);
        assert_eq!(
            (none.num_gpu_blocks, none.block_size, none.reported()),
            (2048, 16, false)
        );
        let down = WorkerCapacity::from_metrics("http://c", None, 7, 16);
        assert_eq!((down.num_gpu_blocks, down.reported()), (7, false));
        // 150 blocks of 32 + 7 of 16 = 4912 tokens = 307 blocks of 16.
        assert_eq!(pooled_blocks(&[c, down], 16), 307);
    }

    /// Against a real `kvgate sim` worker (its vLLM metrics), and a URL where nobody listens.
    #[tokio::test]
    async fn reads_a_sim_workers_capacity() {
        let cfg = kvgate_sim::SimConfig::default()
            .block_size(32usize)
            .num_gpu_blocks(123usize);
        let any = "127.0.0.1:0".parse().unwrap();
        let sim = kvgate_sim::SimWorker::spawn(cfg, any, None).await.unwrap();
        let url = format!("http://{}", sim.http_addr());
        let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let nobody = format!("http://{}", closed.local_addr().unwrap());
        drop(closed);
        let got = read(&[url.clone(), nobody.clone()], 2048, 16).await;
        sim.shutdown().await;
        assert_eq!(
            got,
            [
                WorkerCapacity {
                    url,
                    num_gpu_blocks: 123,
                    block_size: 32,
                    source: "cache_config_info",
                },
                WorkerCapacity {
                    url: nobody,
                    num_gpu_blocks: 2048,
                    block_size: 16,
                    source: "--num-gpu-blocks",
                },
            ]
        );
        // 123 × 32 + 2048 × 16 tokens in blocks of 16.
        assert_eq!(pooled_blocks(&got, 16), 246 + 2048);
    }
}
