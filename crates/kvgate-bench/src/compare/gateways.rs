//! The gateways of one table row: one `kvgate serve` child in front of the fleet, or N replicas
//! of it (`--replicas`, the entry's `replicas=N`), either sharing state over NATS (`[cluster]`)
//! or each on its own (`cluster=false`). Also what is read from the gateways' own `/metrics`,
//! summed over the replicas: requests served and the cluster's sync lag.

use std::path::Path;
use std::time::Duration;

use serde::Serialize;

use super::children::{self, ChildGuard};
use super::policy_spec::PolicySpec;
use super::{http, CompareArgs, Fleet};

/// What a row's replicas share: the NATS URL and a subject prefix of their own.
pub struct ClusterLink<'a> {
    pub nats_url: &'a str,
    /// Distinct per row, so the replicas of two rows never hear each other.
    pub subject_prefix: String,
}

/// Running `kvgate serve` children of one row.
pub struct Gateways {
    guards: Vec<ChildGuard>,
    /// `http://127.0.0.1:PORT` of each replica, in order.
    pub urls: Vec<String>,
    pub cluster: bool,
}

impl Gateways {
    /// Starts `replicas` gateways for `spec` and waits until each is ready and, in a cluster,
    /// until each has heard from all its peers (so the first requests are already shared).
    pub async fn start(
        exe: &Path,
        fleet: &Fleet,
        spec: &PolicySpec,
        a: &CompareArgs,
        log_dir: &Path,
        replicas: usize,
        cluster: Option<ClusterLink<'_>>,
    ) -> anyhow::Result<Self> {
        let mut gws = Gateways {
            guards: Vec::with_capacity(replicas),
            urls: Vec::with_capacity(replicas),
            cluster: cluster.is_some(),
        };
        let started = async {
            let ports = children::free_ports(replicas)?;
            for (i, port) in ports.into_iter().enumerate() {
                let name = if replicas == 1 {
                    format!("serve-{}", spec.file_stem())
                } else {
                    format!("serve-{}-r{i}", spec.file_stem())
                };
                let listen = format!("127.0.0.1:{port}");
                let extra = cluster
                    .as_ref()
                    .map(|c| cluster_toml(c, &format!("r{i}"), &spec.cluster_keys));
                let args = serve_args(&listen, fleet, spec, a, log_dir, &name, extra)?;
                gws.guards
                    .push(ChildGuard::spawn(exe, &args, &name, log_dir)?);
                gws.urls.push(format!("http://{listen}"));
            }
            for (g, url) in gws.guards.iter_mut().zip(&gws.urls) {
                g.wait_http_ok(&format!("{url}/ready"), Duration::from_secs(60))
                    .await?;
            }
            if let Some(c) = &cluster {
                gws.wait_peers(c.nats_url, Duration::from_secs(30)).await?;
            }
            anyhow::Ok(())
        }
        .await;
        match started {
            Ok(()) => Ok(gws),
            Err(e) => {
                gws.stop().await;
                Err(e)
            }
        }
    }

    /// Until every replica's `kvgate_cluster_peers` counts all the others; fails at once if a
    /// replica exits meanwhile.
    async fn wait_peers(&mut self, nats_url: &str, timeout: Duration) -> anyhow::Result<()> {
        let want = (self.urls.len() - 1) as f64;
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let mut lagging = None;
            for (g, url) in self.guards.iter_mut().zip(&self.urls) {
                g.check_alive()?;
                let peers = scrape(url)
                    .await
                    .ok()
                    .and_then(|m| sample_sum(&m, "kvgate_cluster_peers"));
                if lagging.is_none() && !peers.is_some_and(|p| p >= want) {
                    lagging = Some((url.clone(), peers.unwrap_or(0.0), g.log.clone()));
                }
            }
            let Some((url, peers, log)) = lagging else {
                return Ok(());
            };
            anyhow::ensure!(
                tokio::time::Instant::now() < deadline,
                "the gateway at {url} heard from {peers} of its {want} peers within {timeout:?} \
                 (NATS at {nats_url}; log: {})",
                log.display()
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Requests each replica finished (`kvgate_requests_total`, every label), `None` where its
    /// `/metrics` could not be read.
    pub async fn requests_served(&self) -> Vec<Option<u64>> {
        let mut out = Vec::with_capacity(self.urls.len());
        for url in &self.urls {
            let n = scrape(url)
                .await
                .ok()
                .and_then(|m| sample_sum(&m, "kvgate_requests_total"));
            out.push(n.map(|n| n as u64));
        }
        out
    }

    /// `kvgate_cluster_sync_lag_seconds` summed over the replicas (None without the cluster).
    pub async fn sync_lag(&self) -> Option<LagHistogram> {
        if !self.cluster {
            return None;
        }
        let mut total = LagHistogram::default();
        for url in &self.urls {
            if let Ok(m) = scrape(url).await {
                total.add(&LagHistogram::parse(&m, "kvgate_cluster_sync_lag_seconds"));
            }
        }
        Some(total)
    }

    /// Kills and reaps every replica.
    pub async fn stop(self) {
        for g in self.guards {
            g.stop().await;
        }
    }
}

async fn scrape(base: &str) -> anyhow::Result<String> {
    let (status, body) = http::get(&format!("{base}/metrics")).await?;
    anyhow::ensure!(status.is_success(), "{base}/metrics answered {status}");
    Ok(String::from_utf8_lossy(&body).into_owned())
}

/// The sum of every sample of `name` (any labels) in a Prometheus text exposition; None when
/// there is none.
pub fn sample_sum(text: &str, name: &str) -> Option<f64> {
    let mut sum = None;
    for line in text.lines() {
        let Some(rest) = line.strip_prefix(name) else {
            continue;
        };
        if !(rest.starts_with(' ') || rest.starts_with('{')) {
            continue;
        }
        if let Some(v) = rest.rsplit(' ').next().and_then(|v| v.parse::<f64>().ok()) {
            *sum.get_or_insert(0.0) += v;
        }
    }
    sum
}

/// A Prometheus histogram as scraped: cumulative bucket counts by upper bound, sum and count.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct LagHistogram {
    /// (`le` as exposed, e.g. "0.005" or "+Inf", cumulative count), in exposition order.
    pub buckets: Vec<(String, u64)>,
    pub sum_s: f64,
    pub count: u64,
}

impl LagHistogram {
    pub fn parse(text: &str, name: &str) -> Self {
        let mut h = Self::default();
        let bucket = format!("{name}_bucket{{");
        for line in text.lines() {
            let Some(v) = line.rsplit(' ').next().and_then(|v| v.parse::<f64>().ok()) else {
                continue;
            };
            if let Some(rest) = line.strip_prefix(&bucket) {
                if let Some(le) = rest.split("le=\"").nth(1).and_then(|r| r.split('"').next()) {
                    h.buckets.push((le.to_owned(), v as u64));
                }
            } else if line.starts_with(&format!("{name}_sum ")) {
                h.sum_s = v;
            } else if line.starts_with(&format!("{name}_count ")) {
                h.count = v as u64;
            }
        }
        h
    }

    /// Adds another replica's histogram (same buckets; a bucket only one side has is kept).
    pub fn add(&mut self, other: &Self) {
        for (le, n) in &other.buckets {
            match self.buckets.iter_mut().find(|(l, _)| l == le) {
                Some((_, m)) => *m += n,
                None => self.buckets.push((le.clone(), *n)),
            }
        }
        self.sum_s += other.sum_s;
        self.count += other.count;
    }

    pub fn mean_ms(&self) -> Option<f64> {
        (self.count > 0).then(|| self.sum_s / self.count as f64 * 1e3)
    }

    /// The upper bound (ms) of the bucket holding quantile `q`: the quantile is at most this.
    /// None when empty or when it falls in the `+Inf` bucket.
    pub fn quantile_bound_ms(&self, q: f64) -> Option<f64> {
        if self.count == 0 {
            return None;
        }
        let rank = (q * self.count as f64).ceil() as u64;
        self.buckets
            .iter()
            .find(|(_, n)| *n >= rank)
            .and_then(|(le, _)| le.parse::<f64>().ok().filter(|v| v.is_finite()))
            .map(|s| s * 1e3)
    }
}

fn q(s: &str) -> String {
    // A JSON string is a valid TOML basic string.
    serde_json::Value::String(s.to_owned()).to_string()
}

/// The `[cluster]` table of one replica.
fn cluster_toml(c: &ClusterLink<'_>, replica_id: &str, keys: &[(String, String)]) -> String {
    let mut t = format!(
        "\n[cluster]\nnats_url = {}\nreplica_id = {}\nsubject_prefix = {}\n",
        q(c.nats_url),
        q(replica_id),
        q(&c.subject_prefix)
    );
    for (k, v) in keys {
        t.push_str(&format!("{k} = {v}\n"));
    }
    t
}

/// Arguments for one `kvgate serve` in front of the fleet. With every worker's KV-event endpoint
/// known (and not `--approx-index`), the workers go into a generated config file so the gateway
/// subscribes to their events (exact index); otherwise `--worker` flags (approximate index). The
/// spec's routing keys and the replica's `[cluster]` table (`extra`) go into the same file
/// (`NAME.toml` in `dir`).
pub fn serve_args(
    listen: &str,
    fleet: &Fleet,
    spec: &PolicySpec,
    a: &CompareArgs,
    dir: &Path,
    name: &str,
    extra: Option<String>,
) -> anyhow::Result<Vec<String>> {
    let mut args: Vec<String> = vec![
        "serve".into(),
        "--listen".into(),
        listen.into(),
        "--policy".into(),
        spec.policy.clone(),
    ];
    let events: Option<Vec<&String>> = fleet.kv_events.iter().map(Option::as_ref).collect();
    let events = events.filter(|_| !a.approx_index);
    let mut toml = String::new();
    let no_roles = vec![None; fleet.urls.len()];
    let roles = if spec.unified {
        &no_roles
    } else {
        &fleet.roles
    };
    match &events {
        Some(events) => {
            toml = workers_toml(
                &fleet.urls,
                events,
                roles,
                &a.traffic.model,
                a.fleet.bootstrap_on_http_port,
            )
        }
        None => {
            anyhow::ensure!(
                !a.fleet.bootstrap_on_http_port,
                "--bootstrap-on-http-port needs the workers' KV-event endpoints (--worker-kv-events)"
            );
            for (w, role) in fleet.urls.iter().zip(roles) {
                args.push(match role.as_deref() {
                    Some("prefill") => "--prefill-worker".into(),
                    Some("decode") => "--decode-worker".into(),
                    _ => "--worker".into(),
                });
                args.push(w.clone());
            }
            args.push("--model".into());
            args.push(a.traffic.model.clone());
        }
    }
    toml.push_str(&spec.routing_toml());
    toml.push_str(extra.as_deref().unwrap_or_default());
    if !toml.is_empty() {
        let path = dir.join(format!("{name}.toml"));
        std::fs::write(&path, toml)
            .map_err(|e| anyhow::anyhow!("cannot write {}: {e}", path.display()))?;
        args.push("--config".into());
        args.push(path.to_string_lossy().into_owned());
    }
    args.push("--block-size".into());
    args.push(a.fleet.block_size.to_string());
    // The per-request log line goes to stdout, which nobody reads here.
    args.push("--no-request-log".into());
    args.extend(a.serve_args.iter().cloned());
    Ok(args)
}

/// `[[workers]]` tables with KV-event endpoints (flags still set listen/policy/block size).
pub fn workers_toml(
    urls: &[String],
    events: &[&String],
    roles: &[Option<String>],
    model: &str,
    bootstrap_on_http_port: bool,
) -> String {
    let mut t = String::from("# Generated by kvgate bench compare.\n");
    for (i, (u, e)) in urls.iter().zip(events).enumerate() {
        t.push_str(&format!(
            "\n[[workers]]\nurl = {}\nname = \"sim-{i}\"\nmodels = [{}]\nkv_events = {}\n",
            q(u),
            q(model),
            q(e)
        ));
        if let Some(Some(r)) = roles.get(i) {
            t.push_str(&format!("role = {}\n", q(r)));
            let port = u.rsplit(':').next().and_then(|p| p.parse::<u16>().ok());
            if let (true, "prefill", Some(port)) = (bootstrap_on_http_port, r.as_str(), port) {
                t.push_str(&format!("bootstrap_port = {port}\n"));
            }
        }
    }
    t
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn workers_and_cluster_tables() {
        let t = workers_toml(
            &["http://a:1".into()],
            &[&"tcp://a:2".to_string()],
            &[None],
            "m",
            false,
        );
        assert!(t.contains("[[workers]]\nurl = \"http://a:1\"\nname = \"sim-0\"\nmodels = [\"m\"]\nkv_events = \"tcp://a:2\"\n"), "{t}");
        assert!(!t.contains("role"), "{t}");
        let t = workers_toml(
            &["http://a:1".into(), "http://b:1".into()],
            &[&"tcp://a:2".to_string(), &"tcp://b:2".to_string()],
            &[Some("prefill".into()), Some("decode".into())],
            "m",
            false,
        );
        assert!(
            t.contains("kv_events = \"tcp://a:2\"\nrole = \"prefill\"\n"),
            "{t}"
        );
        assert!(
            t.contains("kv_events = \"tcp://b:2\"\nrole = \"decode\"\n"),
            "{t}"
        );
        assert!(!t.contains("bootstrap_port"), "{t}");
        let t = workers_toml(
            &["http://a:18001".into(), "http://b:18002".into()],
            &[&"tcp://a:2".to_string(), &"tcp://b:2".to_string()],
            &[Some("prefill".into()), Some("decode".into())],
            "m",
            true,
        );
        assert!(
            t.contains("role = \"prefill\"\nbootstrap_port = 18001\n"),
            "{t}"
        );
        assert_eq!(t.matches("bootstrap_port").count(), 1, "{t}");
        let c = ClusterLink {
            nats_url: "nats://127.0.0.1:4222",
            subject_prefix: "kvgate-bench-7-1".into(),
        };
        assert_eq!(
            cluster_toml(&c, "r1", &[]),
            "\n[cluster]\nnats_url = \"nats://127.0.0.1:4222\"\nreplica_id = \"r1\"\nsubject_prefix = \"kvgate-bench-7-1\"\n"
        );
        assert!(
            cluster_toml(&c, "r1", &[("provisional_window_ms".into(), "0".into())])
                .ends_with("subject_prefix = \"kvgate-bench-7-1\"\nprovisional_window_ms = 0\n")
        );
    }

    #[test]
    fn metrics_are_summed_and_the_lag_quantile_bounded() {
        let a = "# HELP kvgate_requests Requests.\n\
                 kvgate_requests_total{model=\"m\",worker=\"w0\",status=\"200\"} 3\n\
                 kvgate_requests_total{model=\"m\",worker=\"w1\",status=\"429\"} 2\n\
                 kvgate_requests_totally 100\n\
                 kvgate_cluster_sync_lag_seconds_sum 0.004\n\
                 kvgate_cluster_sync_lag_seconds_count 4\n\
                 kvgate_cluster_sync_lag_seconds_bucket{le=\"0.001\"} 3\n\
                 kvgate_cluster_sync_lag_seconds_bucket{le=\"0.005\"} 4\n\
                 kvgate_cluster_sync_lag_seconds_bucket{le=\"+Inf\"} 4\n";
        assert_eq!(sample_sum(a, "kvgate_requests_total"), Some(5.0));
        assert_eq!(sample_sum(a, "kvgate_cluster_peers"), None);
        let mut h = LagHistogram::parse(a, "kvgate_cluster_sync_lag_seconds");
        assert_eq!(h.count, 4);
        assert_eq!(h.quantile_bound_ms(0.5), Some(1.0));
        assert_eq!(h.quantile_bound_ms(0.99), Some(5.0));
        let b = "kvgate_cluster_sync_lag_seconds_sum 2.0\n\
                 kvgate_cluster_sync_lag_seconds_count 4\n\
                 kvgate_cluster_sync_lag_seconds_bucket{le=\"0.001\"} 0\n\
                 kvgate_cluster_sync_lag_seconds_bucket{le=\"0.005\"} 0\n\
                 kvgate_cluster_sync_lag_seconds_bucket{le=\"+Inf\"} 4\n";
        h.add(&LagHistogram::parse(b, "kvgate_cluster_sync_lag_seconds"));
        assert_eq!(h.count, 8);
        assert_eq!(h.buckets[1], ("0.005".to_string(), 4));
        // Half the samples are above every finite bound: the p99 is not bounded.
        assert_eq!(h.quantile_bound_ms(0.99), None);
        assert_eq!(h.quantile_bound_ms(0.5), Some(5.0));
        assert!((h.mean_ms().unwrap() - 2004.0 / 8.0).abs() < 1e-9);
        assert_eq!(LagHistogram::default().quantile_bound_ms(0.5), None);
    }
}
