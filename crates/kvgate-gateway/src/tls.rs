//! TLS termination with rustls (ring provider): certificate chain and key from PEM files,
//! ALPN `h2` then `http/1.1`.

use std::sync::Arc;

use anyhow::Context;

use crate::config::TlsConfig;

pub fn acceptor(cfg: &TlsConfig) -> anyhow::Result<tokio_rustls::TlsAcceptor> {
    let certs = {
        let f = std::fs::File::open(&cfg.cert)
            .with_context(|| format!("opening TLS cert {}", cfg.cert.display()))?;
        rustls_pemfile::certs(&mut std::io::BufReader::new(f))
            .collect::<Result<Vec<_>, _>>()
            .with_context(|| format!("reading TLS cert {}", cfg.cert.display()))?
    };
    if certs.is_empty() {
        anyhow::bail!("TLS cert {} contains no certificate", cfg.cert.display());
    }
    let key = {
        let f = std::fs::File::open(&cfg.key)
            .with_context(|| format!("opening TLS key {}", cfg.key.display()))?;
        rustls_pemfile::private_key(&mut std::io::BufReader::new(f))
            .with_context(|| format!("reading TLS key {}", cfg.key.display()))?
            .with_context(|| format!("TLS key {} contains no private key", cfg.key.display()))?
    };
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut sc = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .context("TLS protocol versions")?
        .with_no_client_auth()
        .with_single_cert(certs, key)
        .context("TLS certificate/key mismatch or unsupported key")?;
    sc.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    Ok(tokio_rustls::TlsAcceptor::from(Arc::new(sc)))
}
