//! End-to-end tests of the control plane: hot reload, the admin API, API keys and TLS.

#[path = "helpers/support.rs"]
mod support;

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use kvgate_gateway::mock::MockWorker;
use kvgate_gateway::{Gateway, StartOptions};
use support::*;

fn models_of(j: &serde_json::Value) -> Vec<String> {
    j["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["id"].as_str().unwrap().to_string())
        .collect()
}

#[tokio::test]
async fn config_file_reload_swaps_workers_without_dropping_streams() {
    let a = MockWorker::builder()
        .models(&["m-a"])
        .tokens(30)
        .itl(Duration::from_millis(10))
        .spawn()
        .await
        .unwrap();
    let b = MockWorker::builder()
        .models(&["m-b"])
        .spawn()
        .await
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("kvgate.toml");
    let file = |url: &str| {
        format!("[server]\nlisten = \"127.0.0.1:0\"\nreload_poll_ms = 20\nrequest_log = false\n[upstream]\nmonitor = false\n[[workers]]\nurl = \"{url}\"\n")
    };
    std::fs::write(&path, file(&a.url())).unwrap();
    let cfg = kvgate_gateway::Config::from_file(&path).unwrap();
    let gw = Gateway::start(StartOptions {
        epp: false,
        config: cfg,
        config_path: Some(path.clone()),
        overrides: Arc::new(|_| {}),
    })
    .await
    .unwrap();
    let c = client();
    assert_eq!(
        models_of(&get(&c, &format!("{}/v1/models", gw.url())).await.json()),
        ["m-a"]
    );

    // A 300 ms stream on worker a, in flight across the reload that removes a.
    let (c2, url) = (c.clone(), format!("{}/v1/chat/completions", gw.url()));
    let stream = tokio::spawn(async move {
        post(
            &c2,
            &url,
            r#"{"model":"m-a","stream":true,"messages":[{"role":"user","content":"x"}]}"#,
        )
        .await
    });
    assert!(eventually(PATIENCE, || a.active_streams() == 1).await);

    // A bad file is rejected and the running config stays.
    std::fs::write(&path, "[routing]\nno_such_key = 1\n").unwrap();
    assert!(
        eventually(PATIENCE, || gw
            .app
            .metrics
            .render()
            .contains("kvgate_config_reloads_total{reason=\"error\"} 1"))
        .await
    );
    assert_eq!(
        models_of(&get(&c, &format!("{}/v1/models", gw.url())).await.json()),
        ["m-a"]
    );

    std::fs::write(&path, file(&b.url())).unwrap();
    poll_until(
        PATIENCE,
        "the reload to pick up the new worker list",
        || async {
            models_of(&get(&c, &format!("{}/v1/models", gw.url())).await.json()) == ["m-b"]
        },
    )
    .await;
    let r = stream.await.unwrap();
    assert_eq!(r.status, 200);
    assert!(
        r.text().ends_with("data: [DONE]\n\n"),
        "in-flight stream completed across the reload"
    );
    let r = post(
        &c,
        &format!("{}/v1/chat/completions", gw.url()),
        r#"{"model":"m-a","messages":[{"role":"user","content":"x"}]}"#,
    )
    .await;
    assert_openai_error(&r, 404);
    gw.shutdown().await;
}

#[tokio::test]
async fn admin_api_state_drain_remove_add() {
    let a = MockWorker::builder().spawn().await.unwrap();
    let b = MockWorker::builder().spawn().await.unwrap();
    let mut cfg = config_for(&[&a, &b], "round_robin");
    cfg.upstream.monitor = false;
    cfg.admin.listen = Some("127.0.0.1:0".parse().unwrap());
    cfg.admin.key = Some("adm".into());
    cfg.workers[0].name = Some("a".into());
    cfg.workers[1].name = Some("b".into());
    let gw = gateway(cfg).await;
    let admin = format!("http://{}", gw.admin_addr.unwrap());
    let c = client();
    let call = |method: &str, path: &str, key: Option<&str>, body: &str| {
        let mut r = http::Request::builder()
            .method(method)
            .uri(format!("{admin}{path}"));
        if let Some(k) = key {
            r = r.header("authorization", format!("Bearer {k}"));
        }
        r.body(Full::new(Bytes::from(body.to_string()))).unwrap()
    };
    assert_eq!(
        send(&c, call("GET", "/admin/state", None, "")).await.status,
        401
    );
    assert_eq!(
        send(&c, call("GET", "/admin/state", Some("wrong"), ""))
            .await
            .status,
        401
    );
    let st = send(&c, call("GET", "/admin/state", Some("adm"), ""))
        .await
        .json();
    assert_eq!(st["workers"].as_array().unwrap().len(), 2);
    for key in [
        "healthy",
        "breaker",
        "inflight",
        "active_blocks",
        "index_blocks",
    ] {
        assert!(st["workers"][0].get(key).is_some(), "{key} in {st}");
    }
    assert!(st.get("index_entries").is_some());

    assert_eq!(
        send(&c, call("POST", "/admin/workers/a/drain", Some("adm"), ""))
            .await
            .status,
        200
    );
    for i in 0..4 {
        post(
            &c,
            &format!("{}/v1/chat/completions", gw.url()),
            chat_body("s", &i.to_string(), false),
        )
        .await;
    }
    assert_eq!(
        (a.completions(), b.completions()),
        (0, 4),
        "drained worker gets no new requests"
    );

    assert_eq!(
        send(&c, call("DELETE", "/admin/workers/b", Some("adm"), ""))
            .await
            .status,
        200
    );
    let r = post(
        &c,
        &format!("{}/v1/chat/completions", gw.url()),
        chat_body("s", "x", false),
    )
    .await;
    assert_openai_error(&r, 503);

    let d = MockWorker::builder().spawn().await.unwrap();
    let add = format!(r#"{{"url":"{}","name":"d"}}"#, d.url());
    assert_eq!(
        send(&c, call("POST", "/admin/workers", Some("adm"), &add))
            .await
            .status,
        200
    );
    let bad = send(
        &c,
        call(
            "POST",
            "/admin/workers",
            Some("adm"),
            r#"{"url":"http://x:1","bogus":1}"#,
        ),
    )
    .await;
    assert_eq!(bad.status, 400, "{}", bad.text());
    let r = post(
        &c,
        &format!("{}/v1/chat/completions", gw.url()),
        chat_body("s", "x", false),
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(d.completions(), 1);
    gw.shutdown().await;
}

#[tokio::test]
async fn api_keys_rate_limits_and_worker_credentials() {
    let w = MockWorker::builder().spawn().await.unwrap();
    let mut cfg = config_for(&[&w], "kv");
    cfg.upstream.monitor = false;
    cfg.workers[0].api_key = Some("worker-secret".into());
    cfg.auth.keys = vec![
        kvgate_gateway::config::ApiKeyConfig {
            key: "sk-one".into(),
            name: None,
            rate_per_s: None,
            burst: None,
            priority: None,
            tenant: None,
        },
        kvgate_gateway::config::ApiKeyConfig {
            key: "sk-slow".into(),
            name: None,
            rate_per_s: Some(0.01),
            burst: Some(1.0),
            priority: None,
            tenant: None,
        },
    ];
    let gw = gateway(cfg).await;
    let c = client();
    let req = |key: Option<&str>| {
        let mut r = http::Request::post(format!("{}/v1/chat/completions", gw.url()))
            .header("content-type", "application/json");
        if let Some(k) = key {
            r = r.header("authorization", format!("Bearer {k}"));
        }
        r.body(Full::new(Bytes::from(chat_body("s", "u", false))))
            .unwrap()
    };
    assert_openai_error(&send(&c, req(None)).await, 401);
    assert_openai_error(&send(&c, req(Some("sk-wrong"))).await, 401);
    assert_eq!(send(&c, req(Some("sk-one"))).await.status, 200);
    assert_eq!(send(&c, req(Some("sk-slow"))).await.status, 200);
    let r = send(&c, req(Some("sk-slow"))).await;
    assert_openai_error(&r, 429);
    assert!(r.headers.contains_key("retry-after"));
    let got = w.received();
    assert_eq!(got.len(), 2);
    assert!(
        got.iter()
            .all(|r| r.headers["authorization"] == "Bearer worker-secret"),
        "client keys never reach workers"
    );
    let m = get(&c, &format!("{}/v1/models", gw.url())).await;
    assert_eq!(m.status, 401, "/v1/models needs a key too");
    assert_eq!(get(&c, &format!("{}/health", gw.url())).await.status, 200);
    gw.shutdown().await;
}

#[tokio::test]
async fn tls_termination() {
    let w = MockWorker::builder().spawn().await.unwrap();
    let fixtures = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures");
    let mut cfg = config_for(&[&w], "kv");
    cfg.upstream.monitor = false;
    cfg.server.tls = Some(kvgate_gateway::config::TlsConfig {
        cert: fixtures.join("cert.pem"),
        key: fixtures.join("key.pem"),
    });
    let gw = gateway(cfg).await;

    let mut roots = rustls::RootCertStore::empty();
    let pem = std::fs::read(fixtures.join("cert.pem")).unwrap();
    for cert in rustls_pemfile::certs(&mut &pem[..]) {
        roots.add(cert.unwrap()).unwrap();
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let cc = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots)
        .with_no_client_auth();
    let cc = Arc::new(cc);
    let connector = tokio_rustls::TlsConnector::from(cc.clone());
    let tcp = tokio::net::TcpStream::connect(gw.addr).await.unwrap();
    let name = rustls::pki_types::ServerName::try_from("localhost").unwrap();
    let tls = connector.connect(name, tcp).await.expect("TLS handshake");
    let (mut sender, conn) =
        hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(tls))
            .await
            .unwrap();
    tokio::spawn(conn);
    let req = http::Request::post("/v1/chat/completions")
        .header("host", "localhost")
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(chat_body("s", "u", false))))
        .unwrap();
    let resp = sender.send_request(req).await.unwrap();
    assert_eq!(resp.status(), 200);
    // A stream on the same connection (kvgate's HTTP/1.1 loop over TLS, chunked).
    let req = http::Request::post("/v1/chat/completions")
        .header("host", "localhost")
        .body(Full::new(Bytes::from(chat_body("s", "u", true))))
        .unwrap();
    let resp = sender.send_request(req).await.unwrap();
    assert_eq!(resp.status(), 200);
    assert_eq!(resp.headers()["transfer-encoding"], "chunked");
    let body = resp.into_body().collect().await.unwrap().to_bytes();
    assert!(body.ends_with(b"data: [DONE]\n\n"), "{body:?}");
    // ALPN h2: hyper's HTTP/2 server.
    let mut cc2 = (*cc).clone();
    cc2.alpn_protocols = vec![b"h2".to_vec()];
    let tcp = tokio::net::TcpStream::connect(gw.addr).await.unwrap();
    let name = rustls::pki_types::ServerName::try_from("localhost").unwrap();
    let tls = tokio_rustls::TlsConnector::from(Arc::new(cc2))
        .connect(name, tcp)
        .await
        .expect("TLS handshake");
    assert_eq!(tls.get_ref().1.alpn_protocol(), Some(&b"h2"[..]));
    let (mut h2, conn) = hyper::client::conn::http2::handshake(
        hyper_util::rt::TokioExecutor::new(),
        hyper_util::rt::TokioIo::new(tls),
    )
    .await
    .unwrap();
    tokio::spawn(conn);
    let req = http::Request::post(format!(
        "https://localhost:{}/v1/chat/completions",
        gw.addr.port()
    ))
    .body(Full::new(Bytes::from(chat_body("s", "u", false))))
    .unwrap();
    let resp = h2.send_request(req).await.unwrap();
    assert_eq!(resp.status(), 200);
    assert_eq!(resp.version(), http::Version::HTTP_2);
    // Plain HTTP on the TLS port fails.
    let plain = tokio::time::timeout(
        Duration::from_secs(5),
        client().request(
            http::Request::get(format!("{}/health", gw.url()))
                .body(Full::new(Bytes::new()))
                .unwrap(),
        ),
    )
    .await
    .unwrap();
    assert!(plain.is_err());
    gw.shutdown().await;
}

#[tokio::test]
async fn graceful_shutdown_drains_in_flight_streams() {
    let w = MockWorker::builder()
        .tokens(20)
        .itl(Duration::from_millis(10))
        .spawn()
        .await
        .unwrap();
    let mut cfg = config_for(&[&w], "kv");
    cfg.upstream.monitor = false;
    let gw = gateway(cfg).await;
    let (c, url) = (client(), format!("{}/v1/chat/completions", gw.url()));
    let stream = tokio::spawn(async move { post(&c, &url, chat_body("s", "u", true)).await });
    assert!(eventually(PATIENCE, || w.active_streams() == 1).await);
    let addr = gw.addr;
    gw.shutdown().await;
    let r = stream.await.unwrap();
    assert_eq!(r.status, 200);
    assert!(
        r.text().ends_with("data: [DONE]\n\n"),
        "stream finished before shutdown completed"
    );
    assert!(
        tokio::net::TcpStream::connect(addr).await.is_err(),
        "listener closed"
    );
}

#[tokio::test]
async fn https_workers() {
    let w = MockWorker::builder().tokens(3).spawn().await.unwrap();
    let fixtures = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures");
    // The "https worker": a TLS-terminating gateway in front of the mock (its certificate names
    // localhost and 127.0.0.1).
    let mut front = config_for(&[&w], "round_robin");
    front.upstream.monitor = false;
    front.server.tls = Some(kvgate_gateway::config::TlsConfig {
        cert: fixtures.join("cert.pem"),
        key: fixtures.join("key.pem"),
    });
    let front = gateway(front).await;
    let https_url = format!("https://127.0.0.1:{}", front.addr.port());

    // Trusting that certificate: models discovered, health probed and requests proxied over TLS.
    let mut cfg = config_for(&[], "kv");
    cfg.workers
        .push(kvgate_gateway::config::WorkerConfig::from_url(&https_url));
    cfg.upstream.ca_file = Some(fixtures.join("cert.pem"));
    let gw = gateway(cfg).await;
    let c = client();
    let url = format!("{}/v1/chat/completions", gw.url());
    let ready = format!("{}/ready", gw.url());
    poll_until(
        PATIENCE,
        "the worker's models discovered over https",
        || async { get(&c, &ready).await.status == 200 },
    )
    .await;
    for i in 0..3 {
        let r = post(&c, &url, chat_body("s", &format!("u{i}"), false)).await;
        assert_eq!(r.status, 200, "{}", r.text());
        assert_eq!(r.json()["object"], "chat.completion");
    }
    let r = post(&c, &url, chat_body("s", "stream", true)).await;
    assert_eq!(r.status, 200);
    assert!(r.text().ends_with("data: [DONE]\n\n"), "{}", r.text());
    assert_eq!(
        w.received().len(),
        4,
        "every request reached the worker behind TLS"
    );
    // The health checker reaches it over TLS too: a successful probe is counted, and it stays
    // routable.
    let probed_ok = |gw: &kvgate_gateway::Gateway| {
        gw.app.fleet.export_monitors();
        gw.app.metrics.render().lines().any(|l| {
            l.starts_with("kvgate_worker_health_checks_total{")
                && l.contains("result=\"ok\"")
                && !l.ends_with(" 0")
        })
    };
    assert!(
        eventually(PATIENCE, || probed_ok(&gw)).await,
        "no successful health probe over TLS"
    );
    assert_eq!(get(&c, &ready).await.status, 200);
    gw.shutdown().await;

    // Not trusting it (a CA file without that certificate): the handshake fails, the client gets
    // a 502 in the OpenAI shape that says why.
    let system = std::path::Path::new("/etc/ssl/certs/ca-certificates.crt");
    if system.is_file() {
        let mut cfg = config_for(&[], "kv");
        let mut wc = kvgate_gateway::config::WorkerConfig::from_url(&https_url);
        wc.models = vec!["mock-model".into()];
        cfg.workers.push(wc);
        cfg.upstream.monitor = false;
        cfg.upstream.ca_file = Some(system.to_path_buf());
        let gw = gateway(cfg).await;
        let r = post(
            &c,
            &format!("{}/v1/chat/completions", gw.url()),
            chat_body("s", "x", false),
        )
        .await;
        let e = assert_openai_error(&r, 502);
        assert!(
            e["message"].as_str().unwrap().contains("TLS handshake"),
            "{e}"
        );
        gw.shutdown().await;
    }

    // A CA file that cannot be used stops the gateway at start, naming the key.
    let mut cfg = config_for(&[], "kv");
    cfg.workers
        .push(kvgate_gateway::config::WorkerConfig::from_url(&https_url));
    cfg.upstream.ca_file = Some(fixtures.join("key.pem"));
    let err = Gateway::start(cfg)
        .await
        .err()
        .expect("bad CA file refused");
    assert!(format!("{err:#}").contains("upstream.ca_file"), "{err:#}");
    front.shutdown().await;
}

/// `role = "auto"` across reloads: a detected role lives in the worker's state, so a reload keeps
/// it (no unroutable window); a worker a reload switches to `auto` gets its monitor restarted to
/// ask, and is not routed until it has answered.
#[tokio::test]
async fn auto_roles_survive_reloads_and_a_switch_to_auto_asks_the_worker() {
    // Mock workers have no /server_info (404): they announce no mode, so they serve as `both`.
    let a = MockWorker::builder().models(&["m"]).spawn().await.unwrap();
    let b = MockWorker::builder().models(&["m"]).spawn().await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("kvgate.toml");
    let file = |policy: &str, b_role: &str| {
        format!(
            "[server]\nlisten = \"127.0.0.1:0\"\nrequest_log = false\n[upstream]\nhealth_interval_ms = 50\n\
             [routing]\npolicy = \"{policy}\"\n\
             [[workers]]\nurl = \"{}\"\nrole = \"auto\"\n[[workers]]\nurl = \"{}\"\nrole = \"{b_role}\"\n",
            a.url(),
            b.url()
        )
    };
    std::fs::write(&path, file("round_robin", "decode")).unwrap();
    let overrides: kvgate_gateway::reload::Overrides = Arc::new(|_| {});
    let gw = Gateway::start(StartOptions {
        epp: false,
        config: kvgate_gateway::Config::from_file(&path).unwrap(),
        config_path: None,
        overrides: overrides.clone(),
    })
    .await
    .unwrap();
    let roles = || {
        let f = gw.app.fleet.registry.snapshot();
        (f.workers[0].role(), f.workers[1].role())
    };
    use kvgate_gateway::config::WorkerRole::{Both, Decode};
    assert!(eventually(PATIENCE, || roles() == (Some(Both), Some(Decode))).await);

    std::fs::write(&path, file("least_loaded", "decode")).unwrap();
    kvgate_gateway::reload::reload(&gw.app, &path, &overrides).unwrap();
    assert_eq!(
        roles(),
        (Some(Both), Some(Decode)),
        "kept across the reload"
    );

    std::fs::write(&path, file("least_loaded", "auto")).unwrap();
    kvgate_gateway::reload::reload(&gw.app, &path, &overrides).unwrap();
    assert!(
        eventually(PATIENCE, || roles() == (Some(Both), Some(Both))).await,
        "b asked once switched to auto: {:?}",
        roles()
    );
    let c = client();
    for _ in 0..4 {
        let r = post(
            &c,
            &format!("{}/v1/chat/completions", gw.url()),
            r#"{"model":"m","messages":[{"role":"user","content":"x"}]}"#,
        )
        .await;
        assert_eq!(r.status, 200, "{}", r.text());
    }
    assert_eq!(a.completions() + b.completions(), 4);
    gw.shutdown().await;
}

/// `[flow_control]` reloads: new classes and weights apply to the next request; a bad section
/// (two classes with one priority) is refused and the running policy stays.
#[tokio::test]
async fn flow_control_reloads_and_a_bad_section_keeps_the_running_one() {
    let w = MockWorker::builder().models(&["m"]).spawn().await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("kvgate.toml");
    let file = |flow: &str| {
        format!(
            "[server]\nlisten = \"127.0.0.1:0\"\nrequest_log = false\n{flow}\n[[workers]]\nurl = \"{}\"\n",
            w.url()
        )
    };
    std::fs::write(&path, file("")).unwrap();
    let overrides: kvgate_gateway::reload::Overrides = Arc::new(|_| {});
    let gw = Gateway::start(StartOptions {
        epp: false,
        config: kvgate_gateway::Config::from_file(&path).unwrap(),
        config_path: None,
        overrides: overrides.clone(),
    })
    .await
    .unwrap();
    let adm = gw.app.fleet.router.admission().clone();
    assert!(!adm.policy().enabled);
    assert_eq!(&*adm.policy().class(5).name, "default");
    std::fs::write(
        &path,
        file(
            "[flow_control]\nenabled = true\n[flow_control.tenants]\nteam-a = 2.0\n\
             [[flow_control.classes]]\nname = \"interactive\"\npriority = 5\n\
             [[flow_control.classes]]\nname = \"batch\"\npriority = 0\n",
        ),
    )
    .unwrap();
    kvgate_gateway::reload::reload(&gw.app, &path, &overrides).unwrap();
    assert!(adm.policy().enabled);
    assert_eq!(&*adm.policy().class(5).name, "interactive");
    assert_eq!(adm.policy().weight(Some("team-a")), 2.0);
    std::fs::write(
        &path,
        file(
            "[flow_control]\nenabled = true\n[[flow_control.classes]]\nname = \"a\"\npriority = 1\n\
             [[flow_control.classes]]\nname = \"b\"\npriority = 1\n",
        ),
    )
    .unwrap();
    let e = kvgate_gateway::reload::reload(&gw.app, &path, &overrides).unwrap_err();
    assert!(e.contains("two classes with priority 1"), "{e}");
    assert_eq!(&*adm.policy().class(5).name, "interactive", "kept");
    // Requests flow with the reloaded policy.
    let r = post(
        &client(),
        &format!("{}/v1/chat/completions", gw.url()),
        r#"{"model":"m","messages":[{"role":"user","content":"hi"}]}"#,
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.text());
    gw.shutdown().await;
}
