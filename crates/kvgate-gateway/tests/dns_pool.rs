//! DNS worker pools end to end: `[[worker_pools]] dns = "localhost:PORT"` against in-process mock
//! workers on every loopback address `localhost` resolves to (127.0.0.1 and, where configured,
//! ::1). Requests reach the discovered workers, /admin/state lists them, and a reload that points
//! the pool at another port (or drops it) swaps (or removes) the workers.

#[path = "helpers/support.rs"]
mod support;

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::Full;
use kvgate_gateway::config::WorkerPoolConfig;
use kvgate_gateway::mock::{MockHandle, MockWorker};
use support::*;

/// Mock workers on one port of every address `localhost:port` resolves to. Retries with another
/// port when ::1 cannot take the port 127.0.0.1 got.
async fn localhost_workers() -> (u16, Vec<MockHandle>) {
    for _ in 0..20 {
        let v4 = MockWorker::builder().spawn().await.unwrap();
        let port = v4.addr.port();
        let addrs: BTreeSet<SocketAddr> = tokio::net::lookup_host(format!("localhost:{port}"))
            .await
            .unwrap()
            .collect();
        assert!(
            addrs.iter().all(|a| a.ip().is_loopback()),
            "localhost resolves to a non-loopback address: {addrs:?}"
        );
        let mut mocks = vec![v4];
        let mut ok = true;
        for a in addrs.iter().filter(|a| a.is_ipv6()) {
            match MockWorker::builder().addr(*a).spawn().await {
                Ok(m) => mocks.push(m),
                Err(_) => ok = false,
            }
        }
        if ok && addrs.iter().any(|a| a.is_ipv4()) {
            return (port, mocks);
        }
        for m in mocks {
            m.stop().await;
        }
    }
    panic!("no port free on every loopback address localhost resolves to");
}

fn pool(port: u16) -> WorkerPoolConfig {
    let mut cfg = kvgate_gateway::Config::from_toml(&format!(
        "[[worker_pools]]\ndns = \"localhost:{port}\"\nname = \"pool\"\nrefresh_s = 1\n"
    ))
    .unwrap();
    cfg.worker_pools.remove(0)
}

fn names_for(mocks: &[MockHandle]) -> BTreeSet<String> {
    mocks.iter().map(|m| format!("pool-{}", m.addr)).collect()
}

fn fleet_names(gw: &kvgate_gateway::Gateway) -> BTreeSet<String> {
    gw.app
        .fleet
        .registry
        .snapshot()
        .workers
        .iter()
        .map(|w| w.name.to_string())
        .collect()
}

#[tokio::test]
async fn dns_pool_workers_route_list_and_follow_reloads() {
    let (port, mocks) = localhost_workers().await;
    let mut cfg = config_for(&[], "round_robin");
    cfg.upstream.monitor = false;
    cfg.admin.listen = Some("127.0.0.1:0".parse().unwrap());
    cfg.admin.key = Some("adm".into());
    cfg.worker_pools.push(pool(port));
    let gw = gateway(cfg.clone()).await;

    // Discovered: one worker per resolved address, with its models from /v1/models.
    let want = names_for(&mocks);
    assert!(
        eventually(PATIENCE, || fleet_names(&gw) == want
            && gw
                .app
                .fleet
                .registry
                .snapshot()
                .pool("mock-model")
                .map(|p| p.workers.len())
                == Some(mocks.len()))
        .await,
        "fleet {:?}, want {want:?}",
        fleet_names(&gw)
    );

    // Requests route to them (round robin: every address gets its share).
    let c = client();
    let n = 4 * mocks.len();
    for i in 0..n {
        let r = post(
            &c,
            &format!("{}/v1/chat/completions", gw.url()),
            chat_body("s", &format!("hello {i}"), false),
        )
        .await;
        assert_eq!(r.status, 200, "{}", r.text());
    }
    let served: usize = mocks.iter().map(|m| m.completions()).sum();
    assert_eq!(served, n);
    assert!(mocks.iter().all(|m| m.completions() > 0));

    // The admin API lists them with their URLs.
    let admin = format!("http://{}/admin/state", gw.admin_addr.unwrap());
    let req = http::Request::get(&admin)
        .header("authorization", "Bearer adm")
        .body(Full::new(Bytes::new()))
        .unwrap();
    let st = send(&c, req).await.json();
    let listed: BTreeSet<(String, String)> = st["workers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|w| {
            (
                w["name"].as_str().unwrap().to_string(),
                w["url"].as_str().unwrap().to_string(),
            )
        })
        .collect();
    let expected: BTreeSet<(String, String)> = mocks
        .iter()
        .map(|m| (format!("pool-{}", m.addr), format!("http://{}", m.addr)))
        .collect();
    assert_eq!(listed, expected);

    // Reload pointing the pool at another port: the old addresses' workers go, the new come.
    let (port2, mocks2) = localhost_workers().await;
    let mut cfg2 = cfg.clone();
    cfg2.worker_pools = vec![pool(port2)];
    gw.app.apply_config(Arc::new(cfg2)).unwrap();
    let want2 = names_for(&mocks2);
    assert!(
        eventually(PATIENCE, || fleet_names(&gw) == want2
            && gw
                .app
                .fleet
                .registry
                .snapshot()
                .pool("mock-model")
                .map(|p| p.workers.len())
                == Some(mocks2.len()))
        .await,
        "fleet {:?}, want {want2:?}",
        fleet_names(&gw)
    );
    let r = post(
        &c,
        &format!("{}/v1/chat/completions", gw.url()),
        chat_body("s", "after reload", false),
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(mocks2.iter().map(|m| m.completions()).sum::<usize>(), 1);
    assert_eq!(mocks.iter().map(|m| m.completions()).sum::<usize>(), n);

    // Reload without the pool: its workers are removed at once, and stay removed.
    let mut cfg3 = cfg.clone();
    cfg3.worker_pools.clear();
    gw.app.apply_config(Arc::new(cfg3)).unwrap();
    assert!(fleet_names(&gw).is_empty());
    // "Stay removed" is a negative: watch the fleet through a window of a pool-sync period and a
    // refresh period and more (1 s each), so a watcher left running would have re-added them. A
    // busy machine can only make the window catch less, never fail the test.
    let window = tokio::time::Instant::now() + Duration::from_millis(2500);
    while tokio::time::Instant::now() < window {
        assert!(fleet_names(&gw).is_empty(), "{:?}", fleet_names(&gw));
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    gw.shutdown().await;
    for m in mocks.into_iter().chain(mocks2) {
        m.stop().await;
    }
}
