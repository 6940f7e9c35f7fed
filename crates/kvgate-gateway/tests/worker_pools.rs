//! Discovered pools beyond DNS: llm-d endpoints files and Kubernetes InferencePools.
//!
//! The InferencePool watcher runs against `mock::kube::MockKube`, a scripted API server speaking
//! the list and watch JSON streams (initial lists, ADDED/MODIFIED/DELETED, bookmarks, a 410 Gone,
//! dropped connections, error statuses). The gateway suites then run both kinds of pool in a
//! whole gateway: requests reach the discovered workers, members come and go through the
//! registry (ids reused, metric series dropped), and failures are counted.

#[path = "helpers/support.rs"]
mod support;

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use kvgate_gateway::config::{Config, WorkerPoolConfig};
use kvgate_gateway::mock::kube::MockKube;
use kvgate_gateway::mock::{MockHandle, MockWorker};
use kvgate_gateway::worker_pools::kube::{self, Settings};
use kvgate_gateway::worker_pools::{Event, Report};
use support::*;
use tokio_util::sync::CancellationToken;

const V1: &str = "inference.networking.k8s.io";
const V1ALPHA2: &str = "inference.networking.x-k8s.io";

fn recorder() -> (Report, Arc<Mutex<Vec<Event>>>) {
    let seen = Arc::new(Mutex::new(Vec::new()));
    let s = seen.clone();
    (Arc::new(move |e| s.lock().unwrap().push(e)), seen)
}

/// The last member set reported, as `ip:port` strings.
fn last_members(seen: &Mutex<Vec<Event>>) -> Option<Vec<String>> {
    seen.lock().unwrap().iter().rev().find_map(|e| match e {
        Event::Members(m) => Some(m.iter().map(|m| m.addr.to_string()).collect()),
        Event::Error(_) => None,
    })
}

fn errors(seen: &Mutex<Vec<Event>>, kind: &str) -> usize {
    seen.lock()
        .unwrap()
        .iter()
        .filter(|e| matches!(e, Event::Error(k) if *k == kind))
        .count()
}

fn settings(api: &MockKube, group: &str, token: &Path) -> Settings {
    let mut cfg = Config::from_toml(&format!(
        "[[worker_pools]]\ninference_pool = \"llama\"\nnamespace = \"ml\"\ninference_pool_group = \"{group}\"\napi_server = \"{}\"\ntoken_file = \"{}\"\n",
        api.url(),
        token.display()
    ))
    .unwrap();
    let mut s = Settings::from_pool(&cfg.worker_pools.remove(0));
    s.backoff_min = Duration::from_millis(20);
    s.backoff_max = Duration::from_millis(200);
    s
}

async fn members_become(seen: &Mutex<Vec<Event>>, want: &[&str]) {
    let want: Vec<String> = want.iter().map(|s| s.to_string()).collect();
    assert!(
        eventually(PATIENCE, || last_members(seen).as_ref() == Some(&want)).await,
        "members {:?}, want {want:?}",
        last_members(seen)
    );
}

fn lists(api: &MockKube, what: &str) -> usize {
    api.requests()
        .iter()
        .filter(|(p, _)| p.contains(what) && !p.contains("watch=1"))
        .count()
}

#[tokio::test]
async fn inference_pool_watch_follows_pods_through_failures() {
    let api = MockKube::start(V1, "v1", "ml").await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let token = dir.path().join("token");
    std::fs::write(&token, "tok-1\n").unwrap();
    let app = [("app", "vllm")];
    api.set_pool(MockKube::pool_v1("llama", &app, &[8000]));
    api.set_pool(MockKube::pool_v1("other-pool", &[("app", "x")], &[1]));
    api.put_pod(MockKube::pod("p0", &app, "10.0.0.1", true));
    api.put_pod(MockKube::pod("p1", &app, "10.0.0.2", false));
    api.put_pod(MockKube::pod("p2", &[("app", "other")], "10.0.0.3", true));
    api.put_pod(MockKube::pod("p3", &app, "", false));

    let (report, seen) = recorder();
    let stop = CancellationToken::new();
    let task = tokio::spawn(kube::watch(
        settings(&api, V1, &token),
        report,
        stop.clone(),
    ));

    // The initial lists: Ready pods with an IP, at the target port.
    members_become(&seen, &["10.0.0.1:8000"]).await;
    assert!(
        eventually(PATIENCE, || api.watching(true) == 1
            && api.watching(false) == 1)
        .await
    );
    let (path, auth) = api.requests()[0].clone();
    assert!(
        path.contains("fieldSelector=metadata.name%3Dllama"),
        "{path}"
    );
    assert_eq!(auth.as_deref(), Some("Bearer tok-1"));
    assert!(api
        .requests()
        .iter()
        .any(|(p, _)| p.starts_with("/api/v1/namespaces/ml/pods?labelSelector=app%3Dvllm")));

    // Watch events: a pod turns Ready, another is relabelled into the selector (ADDED), one gets
    // an IP and Ready, one turns unready (leaves).
    api.put_pod(MockKube::pod("p1", &app, "10.0.0.2", true));
    members_become(&seen, &["10.0.0.1:8000", "10.0.0.2:8000"]).await;
    api.put_pod(MockKube::pod("p2", &app, "10.0.0.3", true));
    api.put_pod(MockKube::pod("p3", &app, "10.0.0.4", true));
    members_become(
        &seen,
        &[
            "10.0.0.1:8000",
            "10.0.0.2:8000",
            "10.0.0.3:8000",
            "10.0.0.4:8000",
        ],
    )
    .await;
    api.put_pod(MockKube::pod("p0", &app, "10.0.0.1", false));
    members_become(&seen, &["10.0.0.2:8000", "10.0.0.3:8000", "10.0.0.4:8000"]).await;
    // Relabelled out of the selector: the API server sends DELETED.
    api.put_pod(MockKube::pod("p3", &[("app", "gone")], "10.0.0.4", true));
    members_become(&seen, &["10.0.0.2:8000", "10.0.0.3:8000"]).await;

    // A bookmark moves the version on; a dropped connection resumes the watch from the last
    // version seen (no new list), and what changed meanwhile is replayed.
    let pod_lists = lists(&api, "/pods");
    api.bookmark();
    api.drop_watches();
    api.delete_pod("p1");
    members_become(&seen, &["10.0.0.3:8000"]).await;
    assert!(eventually(PATIENCE, || api.watching(true) == 1).await);
    assert_eq!(
        lists(&api, "/pods"),
        pod_lists,
        "a dropped watch resumes, no relist"
    );
    let resumed = api
        .requests()
        .iter()
        .rev()
        .find(|(p, _)| p.contains("/pods") && p.contains("watch=1"))
        .unwrap()
        .0
        .clone();
    assert!(resumed.contains("allowWatchBookmarks=true"), "{resumed}");
    assert!(!resumed.contains("resourceVersion=0&"), "{resumed}");

    // 410 Gone: the history is compacted; the watcher lists again and carries on from there.
    api.expire();
    api.put_pod(MockKube::pod("p0", &app, "10.0.0.1", true));
    members_become(&seen, &["10.0.0.1:8000", "10.0.0.3:8000"]).await;
    assert!(eventually(PATIENCE, || errors(&seen, "gone") >= 1).await);
    assert!(lists(&api, "/pods") > pod_lists, "410 relists");

    // API errors back off and recover; a rotated token is used on the next connection.
    std::fs::write(&token, "tok-2\n").unwrap();
    api.fail_next(3, 500);
    api.end_watches();
    api.put_pod(MockKube::pod("p5", &app, "10.0.0.5", true));
    members_become(&seen, &["10.0.0.1:8000", "10.0.0.3:8000", "10.0.0.5:8000"]).await;
    assert!(errors(&seen, "api") >= 1);
    assert_eq!(
        api.requests().last().unwrap().1.as_deref(),
        Some("Bearer tok-2")
    );

    // The pool's selector and ports change: the pods are listed again with the new selector.
    api.put_pod(MockKube::pod(
        "q0",
        &[("app", "vllm"), ("tier", "b")],
        "10.0.1.1",
        true,
    ));
    api.set_pool(MockKube::pool_v1(
        "llama",
        &[("app", "vllm"), ("tier", "b")],
        &[8000, 8001],
    ));
    members_become(&seen, &["10.0.1.1:8000", "10.0.1.1:8001"]).await;

    // Another pool's changes are not ours; the pool deleted: no members; created again: back.
    api.set_pool(MockKube::pool_v1("other-pool", &[("app", "vllm")], &[2]));
    api.delete_pool("llama");
    members_become(&seen, &[]).await;
    api.set_pool(MockKube::pool_v1("llama", &app, &[9000]));
    members_become(
        &seen,
        &[
            "10.0.0.1:9000",
            "10.0.0.3:9000",
            "10.0.0.5:9000",
            "10.0.1.1:9000",
        ],
    )
    .await;

    // A bad object is counted and does not stop the watch.
    api.set_pool(MockKube::pool_v1("llama", &[], &[9000]));
    assert!(eventually(PATIENCE, || errors(&seen, "invalid_object") >= 1).await);
    api.put_pod(MockKube::pod("p6", &app, "10.0.0.6", true));
    members_become(
        &seen,
        &[
            "10.0.0.1:9000",
            "10.0.0.3:9000",
            "10.0.0.5:9000",
            "10.0.0.6:9000",
            "10.0.1.1:9000",
        ],
    )
    .await;

    stop.cancel();
    tokio::time::timeout(PATIENCE, task).await.unwrap().unwrap();
    api.stop().await;
}

#[tokio::test]
async fn v1alpha2_pools_and_a_missing_crd() {
    let api = MockKube::start(V1ALPHA2, "v1alpha2", "ml").await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let token = dir.path().join("token");
    std::fs::write(&token, "t").unwrap();
    api.set_pool(MockKube::pool_v1alpha2("llama", &[("app", "vllm")], 8000));
    api.put_pod(MockKube::pod("p0", &[("app", "vllm")], "fd00::1", true));
    let (report, seen) = recorder();
    let stop = CancellationToken::new();
    let task = tokio::spawn(kube::watch(
        settings(&api, V1ALPHA2, &token),
        report,
        stop.clone(),
    ));
    members_become(&seen, &["[fd00::1]:8000"]).await;
    stop.cancel();
    task.await.unwrap();

    // Asked for v1 where only v1alpha2 is served: 404s, counted, retried, no members.
    let (report, seen) = recorder();
    let stop = CancellationToken::new();
    let task = tokio::spawn(kube::watch(
        settings(&api, V1, &token),
        report,
        stop.clone(),
    ));
    assert!(eventually(PATIENCE, || errors(&seen, "api") >= 2).await);
    assert_eq!(last_members(&seen), None);
    stop.cancel();
    task.await.unwrap();
    api.stop().await;
}

#[tokio::test]
async fn an_https_api_server_with_its_ca() {
    let fixtures = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures");
    let tls = kvgate_gateway::config::TlsConfig {
        cert: fixtures.join("cert.pem"),
        key: fixtures.join("key.pem"),
    };
    let api = MockKube::start_with(V1, "v1", "ml", Some(&tls))
        .await
        .unwrap();
    assert!(api.url().starts_with("https://127.0.0.1:"));
    let dir = tempfile::tempdir().unwrap();
    let token = dir.path().join("token");
    std::fs::write(&token, "t").unwrap();
    api.set_pool(MockKube::pool_v1("llama", &[("app", "vllm")], &[8000]));
    api.put_pod(MockKube::pod("p0", &[("app", "vllm")], "10.0.0.1", true));

    // Trusting the server's certificate (the service account's ca.crt in a pod): members.
    let mut s = settings(&api, V1, &token);
    s.ca_file = Some(fixtures.join("cert.pem"));
    let (report, seen) = recorder();
    let stop = CancellationToken::new();
    let task = tokio::spawn(kube::watch(s.clone(), report, stop.clone()));
    members_become(&seen, &["10.0.0.1:8000"]).await;
    stop.cancel();
    task.await.unwrap();

    // Trusting another CA (the system bundle): the handshake fails, counted, no members.
    s.ca_file = None;
    let system = [
        "/etc/ssl/certs/ca-certificates.crt",
        "/etc/pki/tls/certs/ca-bundle.crt",
    ]
    .into_iter()
    .map(Path::new)
    .find(|p| p.is_file());
    if let Some(system) = system {
        s.ca_file = Some(system.to_path_buf());
        let (report, seen) = recorder();
        let stop = CancellationToken::new();
        let task = tokio::spawn(kube::watch(s, report, stop.clone()));
        assert!(eventually(PATIENCE, || errors(&seen, "api") >= 2).await);
        assert_eq!(last_members(&seen), None);
        stop.cancel();
        task.await.unwrap();
    }
    api.stop().await;
}

/// Mock workers on one port of several loopback addresses (pods have one IP each and share the
/// pool's target port).
async fn workers_on_loopback(n: u8) -> (u16, Vec<MockHandle>) {
    'again: for _ in 0..20 {
        let first = MockWorker::builder().spawn().await.unwrap();
        let port = first.addr.port();
        let mut ws = vec![first];
        for i in 2..=n {
            let a: SocketAddr = format!("127.0.0.{i}:{port}").parse().unwrap();
            match MockWorker::builder().addr(a).spawn().await {
                Ok(w) => ws.push(w),
                Err(_) => {
                    for w in ws {
                        w.stop().await;
                    }
                    continue 'again;
                }
            }
        }
        return (port, ws);
    }
    panic!("no port free on {n} loopback addresses");
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

fn names(prefix: &str, ws: &[&MockHandle]) -> BTreeSet<String> {
    ws.iter().map(|w| format!("{prefix}-{}", w.addr)).collect()
}

fn pool_entry(toml: &str) -> WorkerPoolConfig {
    Config::from_toml(toml).unwrap().worker_pools.remove(0)
}

async fn metrics(gw: &kvgate_gateway::Gateway) -> String {
    get(&client(), &format!("{}/metrics", gw.url()))
        .await
        .text()
}

async fn chat_ok(gw: &kvgate_gateway::Gateway, n: usize) {
    let c = client();
    for i in 0..n {
        let r = post(
            &c,
            &format!("{}/v1/chat/completions", gw.url()),
            chat_body("s", &format!("hello {i}"), false),
        )
        .await;
        assert_eq!(r.status, 200, "{}", r.text());
    }
}

fn write_endpoints(path: &Path, ws: &[&MockHandle]) {
    let mut s = String::from("# written by the test\nendpoints:\n");
    for (i, w) in ws.iter().enumerate() {
        s.push_str(&format!(
            "  - name: vllm-{i}\n    address: \"{}\"\n    port: \"{}\"\n    labels:\n      model: mock-model\n",
            w.addr.ip(),
            w.addr.port()
        ));
    }
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, s).unwrap();
    std::fs::rename(&tmp, path).unwrap();
}

#[tokio::test]
async fn endpoints_file_pool_in_a_gateway() {
    let (_, ws) = workers_on_loopback(3).await;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("endpoints.yaml");
    write_endpoints(&path, &[&ws[0]]);
    let mut cfg = config_for(&[], "round_robin");
    cfg.upstream.monitor = false;
    cfg.worker_pools.push(pool_entry(&format!(
        "[[worker_pools]]\nfile = \"{}\"\nname = \"eps\"\nrefresh_s = 1\nmodels = [\"mock-model\"]\n",
        path.display()
    )));
    let gw = gateway(cfg).await;

    assert!(eventually(PATIENCE, || fleet_names(&gw) == names("eps", &[&ws[0]])).await);
    chat_ok(&gw, 2).await;
    assert_eq!(ws[0].completions(), 2);

    write_endpoints(&path, &[&ws[0], &ws[1]]);
    assert!(
        eventually(PATIENCE, || fleet_names(&gw)
            == names("eps", &[&ws[0], &ws[1]]))
        .await
    );
    chat_ok(&gw, 4).await;
    assert!(ws[1].completions() > 0);

    // A bad version: logged, counted, the last good members stay.
    std::fs::write(
        &path,
        "endpoints:\n  - name: a\n    address: 10.0.0.1\n    port: \"99999\"\n",
    )
    .unwrap();
    let invalid = "kvgate_pool_discovery_errors_total{pool=\"eps\",kind=\"invalid\"} 1";
    let mut text = String::new();
    for _ in 0..100 {
        text = metrics(&gw).await;
        if text.contains(invalid) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(text.contains(invalid), "{text}");
    assert_eq!(fleet_names(&gw), names("eps", &[&ws[0], &ws[1]]));
    assert!(
        text.contains("kvgate_pool_members{pool=\"eps\"} 2"),
        "{text}"
    );
    let series0 = format!("kvgate_inflight_requests{{worker=\"eps-{}\"}}", ws[0].addr);
    assert!(text.contains(&series0), "{text}");

    // Fixed, with worker 0 gone: it leaves with its series; worker 2, added next, takes its id
    // (the fleet has forgotten worker 0 and nothing holds it).
    let id0 = gw.app.fleet.registry.snapshot().workers[0].id;
    write_endpoints(&path, &[&ws[1]]);
    assert!(eventually(PATIENCE, || fleet_names(&gw) == names("eps", &[&ws[1]])).await);
    write_endpoints(&path, &[&ws[1], &ws[2]]);
    assert!(
        eventually(PATIENCE, || fleet_names(&gw)
            == names("eps", &[&ws[1], &ws[2]]))
        .await
    );
    let f = gw.app.fleet.registry.snapshot();
    let w2 = f.workers.iter().find(|w| w.cfg.url == ws[2].url()).unwrap();
    assert_eq!(w2.id, id0, "the removed worker's id is reused");
    drop(f);
    let (c0, c2) = (ws[0].completions(), ws[2].completions());
    chat_ok(&gw, 4).await;
    assert_eq!(
        ws[0].completions(),
        c0,
        "no request reaches a removed worker"
    );
    assert!(ws[2].completions() > c2);
    let text = metrics(&gw).await;
    assert!(
        !text.contains(&series0),
        "series of the removed worker: {text}"
    );
    assert!(
        text.contains("kvgate_pool_members{pool=\"eps\"} 2"),
        "{text}"
    );

    gw.shutdown().await;
    for w in ws {
        w.stop().await;
    }
}

#[tokio::test]
async fn inference_pool_in_a_gateway() {
    let (port, ws) = workers_on_loopback(3).await;
    let api = MockKube::start(V1, "v1", "ml").await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let token = dir.path().join("token");
    std::fs::write(&token, "tok").unwrap();
    let app = [("app", "vllm")];
    api.set_pool(MockKube::pool_v1("llama", &app, &[port]));
    api.put_pod(MockKube::pod("p0", &app, "127.0.0.1", true));
    api.put_pod(MockKube::pod("p1", &app, "127.0.0.2", true));
    api.put_pod(MockKube::pod("p2", &app, "127.0.0.3", false));
    let mut cfg = config_for(&[], "round_robin");
    cfg.upstream.monitor = false;
    cfg.worker_pools.push(pool_entry(&format!(
        "[[worker_pools]]\ninference_pool = \"llama\"\nnamespace = \"ml\"\napi_server = \"{}\"\ntoken_file = \"{}\"\nmodels = [\"mock-model\"]\n",
        api.url(),
        token.display()
    )));
    let gw = gateway(cfg).await;
    assert!(
        eventually(PATIENCE, || fleet_names(&gw)
            == names("llama", &[&ws[0], &ws[1]]))
        .await
    );
    chat_ok(&gw, 4).await;
    assert_eq!(ws[0].completions() + ws[1].completions(), 4);

    // p0 turns unready, p2 Ready: traffic moves.
    api.put_pod(MockKube::pod("p0", &app, "127.0.0.1", false));
    api.put_pod(MockKube::pod("p2", &app, "127.0.0.3", true));
    assert!(
        eventually(PATIENCE, || fleet_names(&gw)
            == names("llama", &[&ws[1], &ws[2]]))
        .await
    );
    let before = ws[0].completions();
    chat_ok(&gw, 4).await;
    assert_eq!(ws[0].completions(), before);
    assert!(ws[2].completions() > 0);
    let text = metrics(&gw).await;
    assert!(
        text.contains("kvgate_pool_members{pool=\"llama\"} 2"),
        "{text}"
    );

    // The API server goes away: the last members stay, failures are counted.
    api.stop().await;
    let mut text = String::new();
    for _ in 0..200 {
        text = metrics(&gw).await;
        if text.contains("kvgate_pool_discovery_errors_total{pool=\"llama\",kind=\"api\"}") {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(text.contains("kind=\"api\""), "{text}");
    assert_eq!(fleet_names(&gw), names("llama", &[&ws[1], &ws[2]]));
    chat_ok(&gw, 2).await;

    gw.shutdown().await;
    for w in ws {
        w.stop().await;
    }
}

#[tokio::test]
async fn a_member_removed_mid_request_releases_its_state_when_the_request_ends() {
    // A stream far longer than the test: it ends when the client leaves.
    let slow = MockWorker::builder()
        .ttft(Duration::from_millis(10))
        .itl(Duration::from_millis(20))
        .tokens(100_000)
        .spawn()
        .await
        .unwrap();
    let mut others = Vec::new();
    for _ in 0..3 {
        others.push(MockWorker::builder().spawn().await.unwrap());
    }
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("endpoints.json");
    write_endpoints(&path, &[&slow]);
    let mut cfg = config_for(&[], "round_robin");
    cfg.upstream.monitor = false;
    cfg.worker_pools.push(pool_entry(&format!(
        "[[worker_pools]]\nfile = \"{}\"\nname = \"eps\"\nrefresh_s = 1\nmodels = [\"mock-model\"]\n",
        path.display()
    )));
    let gw = gateway(cfg).await;
    assert!(eventually(PATIENCE, || fleet_names(&gw) == names("eps", &[&slow])).await);
    let slow_id = gw.app.fleet.registry.snapshot().workers[0].id;
    let slow_state = Arc::downgrade(&gw.app.fleet.registry.snapshot().workers[0].state);

    // A streamed request on the slow member; the member leaves the file meanwhile.
    let url = format!("{}/v1/chat/completions", gw.url());
    let req =
        tokio::spawn(async move { post(&client(), &url, chat_body("s", "long", true)).await });
    assert!(eventually(PATIENCE, || slow.active_streams() == 1).await);
    write_endpoints(&path, &[&others[0]]);
    assert!(eventually(PATIENCE, || fleet_names(&gw) == names("eps", &[&others[0]])).await);
    // While the request holds the removed member's state, its id is not given away.
    write_endpoints(&path, &[&others[0], &others[1]]);
    assert!(eventually(PATIENCE, || fleet_names(&gw).len() == 2).await);
    let id1 = gw.app.fleet.registry.snapshot().workers[1].id;
    assert_ne!(
        id1, slow_id,
        "an in-flight request still holds the removed worker"
    );
    assert_eq!(
        slow.active_streams(),
        1,
        "still streaming from the removed member"
    );

    // The client leaves: the gateway lets go of the removed member's state.
    req.abort();
    let _ = req.await;
    assert!(eventually(PATIENCE, || slow.active_streams() == 0).await);
    assert!(
        eventually(PATIENCE, || slow_state.strong_count() == 1).await,
        "holders of the removed worker's state: {}",
        slow_state.strong_count()
    );

    // Released: the next member takes the id, and no series of it is left.
    write_endpoints(&path, &[&others[0], &others[1], &others[2]]);
    assert!(eventually(PATIENCE, || fleet_names(&gw).len() == 3).await);
    let f = gw.app.fleet.registry.snapshot();
    let w2 = f
        .workers
        .iter()
        .find(|w| w.cfg.url == others[2].url())
        .unwrap();
    assert_eq!(
        w2.id, slow_id,
        "the ended request released the removed worker"
    );
    assert!(f
        .workers
        .iter()
        .all(|w| w.state.inflight.load(std::sync::atomic::Ordering::Relaxed) == 0));
    drop(f);
    let text = metrics(&gw).await;
    assert!(
        !text.contains(&format!(
            "kvgate_inflight_requests{{worker=\"eps-{}\"}}",
            slow.addr
        )),
        "{text}"
    );

    gw.shutdown().await;
    slow.stop().await;
    for w in others {
        w.stop().await;
    }
}
