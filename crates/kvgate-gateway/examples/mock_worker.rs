//! The gateway's mock OpenAI worker as a process, for the overhead benchmark (benches/overhead.sh):
//! `mock_worker 127.0.0.1:18001 [tokens] [threads]` answers instantly (no TTFT/ITL delay).

use std::time::Duration;

fn main() -> anyhow::Result<()> {
    let mut args = std::env::args().skip(1);
    let addr = args
        .next()
        .unwrap_or_else(|| "127.0.0.1:18001".into())
        .parse()?;
    let tokens: usize = args.next().map(|s| s.parse()).transpose()?.unwrap_or(16);
    let threads: usize = args.next().map(|s| s.parse()).transpose()?.unwrap_or(1);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(threads)
        .enable_all()
        .build()?;
    rt.block_on(async move {
        let w = kvgate_gateway::mock::MockWorker::builder()
            .addr(addr)
            .tokens(tokens)
            .record(false)
            .spawn()
            .await?;
        eprintln!("mock worker on {}", w.addr);
        loop {
            tokio::time::sleep(Duration::from_secs(3600)).await;
        }
    })
}
