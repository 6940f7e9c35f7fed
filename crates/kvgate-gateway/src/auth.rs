//! Client API keys: `Authorization: Bearer <key>` or `x-api-key: <key>`, compared in constant time against every
//! configured key, with an optional per-key token-bucket rate limit. Worker credentials are separate
//! (`workers[].api_key`) and client keys are never forwarded when auth is on.

use std::time::{Duration, Instant};

use http::HeaderMap;
use parking_lot::Mutex;
use subtle::ConstantTimeEq;

use crate::config::AuthConfig;
use crate::error::{ErrorKind, GatewayError};

pub struct Auth {
    keys: Vec<Key>,
}

struct Key {
    secret: Vec<u8>,
    bucket: Option<Mutex<Bucket>>,
    /// Cluster mode: this key's id on the wire (a hash, never the key) and the requests admitted
    /// here since the last report to peers.
    id: u64,
    used: std::sync::atomic::AtomicU32,
}

struct Bucket {
    rate: f64,
    burst: f64,
    tokens: f64,
    last: Instant,
}

impl Bucket {
    /// Take one token; on failure return how long until one is available.
    fn take(&mut self, now: Instant) -> Result<(), Duration> {
        let dt = now.saturating_duration_since(self.last).as_secs_f64();
        self.last = now;
        self.tokens = (self.tokens + dt * self.rate).min(self.burst);
        if self.tokens >= 1.0 {
            self.tokens -= 1.0;
            Ok(())
        } else {
            Err(Duration::from_secs_f64((1.0 - self.tokens) / self.rate))
        }
    }

    /// Peers admitted `n` requests of this key: take them from our bucket too, so the key's rate
    /// holds across replicas. Floored at -burst so a burst of reports cannot lock a key out for
    /// longer than one refill of the bucket.
    fn charge(&mut self, n: u32, now: Instant) {
        let dt = now.saturating_duration_since(self.last).as_secs_f64();
        self.last = now;
        self.tokens = (self.tokens + dt * self.rate).min(self.burst);
        self.tokens = (self.tokens - f64::from(n)).max(-self.burst);
    }
}

/// A key's id on the cluster wire: a seeded 64-bit hash of the secret (the key itself never
/// leaves the replica).
fn key_id(secret: &[u8]) -> u64 {
    xxhash_rust::xxh3::xxh3_64_with_seed(secret, 0x6b76_6761_7465_6b65)
}

impl Auth {
    pub fn from_config(cfg: &AuthConfig) -> Self {
        let now = crate::clock::now();
        Auth {
            keys: cfg
                .keys
                .iter()
                .map(|k| Key {
                    id: key_id(k.key.as_bytes()),
                    used: Default::default(),
                    secret: k.key.as_bytes().to_vec(),
                    bucket: k.rate_per_s.map(|rate| {
                        let burst = k.burst.unwrap_or(rate.max(1.0)).max(1.0);
                        Mutex::new(Bucket {
                            rate,
                            burst,
                            tokens: burst,
                            last: now,
                        })
                    }),
                })
                .collect(),
        }
    }

    pub fn enabled(&self) -> bool {
        !self.keys.is_empty()
    }

    /// Check the request's key and rate limit.
    pub fn check(&self, headers: &HeaderMap, now: Instant) -> Result<(), GatewayError> {
        if self.keys.is_empty() {
            return Ok(());
        }
        // `Authorization: Bearer` (OpenAI SDKs, anthropic ≥ 2.x) or `x-api-key` (Anthropic
        // clients): either carries one of our keys.
        let presented = headers
            .get(http::header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| {
                v.strip_prefix("Bearer ")
                    .or_else(|| v.strip_prefix("bearer "))
            })
            .or_else(|| headers.get("x-api-key").and_then(|v| v.to_str().ok()))
            .map(str::trim);
        let Some(presented) = presented else {
            return Err(GatewayError::new(
                ErrorKind::Unauthorized,
                "missing API key: send 'Authorization: Bearer <key>' or 'x-api-key: <key>'",
            ));
        };
        // Compare against every key without early exit, so timing does not reveal which matched.
        let mut found: Option<&Key> = None;
        for k in &self.keys {
            if bool::from(k.secret.as_slice().ct_eq(presented.as_bytes())) && found.is_none() {
                found = Some(k);
            }
        }
        let Some(key) = found else {
            return Err(GatewayError::new(
                ErrorKind::Unauthorized,
                "invalid API key",
            ));
        };
        if let Some(b) = &key.bucket {
            if let Err(retry_after) = b.lock().take(now) {
                return Err(GatewayError::new(
                    ErrorKind::RateLimited { retry_after },
                    "rate limit exceeded for this API key",
                ));
            }
            key.used.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
        Ok(())
    }

    /// Cluster mode: requests admitted per rate-limited key since the last call (key id, count).
    pub fn take_usage(&self) -> Vec<(u64, u32)> {
        self.keys
            .iter()
            .filter(|k| k.bucket.is_some())
            .filter_map(|k| {
                let n = k.used.swap(0, std::sync::atomic::Ordering::Relaxed);
                (n > 0).then_some((k.id, n))
            })
            .collect()
    }

    /// Cluster mode: a peer admitted `n` requests of the key with id `key`.
    pub fn charge_peer(&self, key: u64, n: u32, now: Instant) {
        for k in &self.keys {
            if let (true, Some(b)) = (k.id == key, &k.bucket) {
                b.lock().charge(n, now);
            }
        }
    }
}

/// Constant-time equality for the admin key.
pub fn key_matches(headers: &HeaderMap, key: &str) -> bool {
    headers
        .get(http::header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .is_some_and(|p| bool::from(p.trim().as_bytes().ct_eq(key.as_bytes())))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::ApiKeyConfig;

    fn hdr(v: &str) -> HeaderMap {
        let mut h = HeaderMap::new();
        h.insert(http::header::AUTHORIZATION, v.parse().unwrap());
        h
    }

    #[test]
    fn keys_and_rate_limit() {
        let auth = Auth::from_config(&AuthConfig {
            keys: vec![
                ApiKeyConfig {
                    key: "sk-a".into(),
                    name: None,
                    rate_per_s: None,
                    burst: None,
                },
                ApiKeyConfig {
                    key: "sk-b".into(),
                    name: None,
                    rate_per_s: Some(1.0),
                    burst: Some(2.0),
                },
            ],
        });
        let t = crate::clock::now();
        assert!(auth.check(&HeaderMap::new(), t).is_err());
        assert!(auth.check(&hdr("Bearer nope"), t).is_err());
        assert!(auth.check(&hdr("Bearer sk-a"), t).is_ok());
        assert!(auth.check(&hdr("Bearer sk-b"), t).is_ok());
        assert!(auth.check(&hdr("Bearer sk-b"), t).is_ok());
        let e = auth.check(&hdr("Bearer sk-b"), t).unwrap_err();
        assert_eq!(e.status(), http::StatusCode::TOO_MANY_REQUESTS);
        assert!(auth
            .check(&hdr("Bearer sk-b"), t + Duration::from_millis(1100))
            .is_ok());
        assert!(!Auth::from_config(&AuthConfig::default()).enabled());
    }

    /// Cluster mode: peers' reported usage drains our bucket, and our own admissions are
    /// reported once (by key id, never the key).
    #[test]
    fn peers_usage_is_charged_and_own_usage_reported() {
        let cfg = AuthConfig {
            keys: vec![ApiKeyConfig {
                key: "sk-c".into(),
                name: None,
                rate_per_s: Some(10.0),
                burst: Some(10.0),
            }],
        };
        let auth = Auth::from_config(&cfg);
        let t = crate::clock::now();
        assert!(auth.check(&hdr("Bearer sk-c"), t).is_ok());
        assert!(auth.check(&hdr("Bearer sk-c"), t).is_ok());
        let id = key_id(b"sk-c");
        assert_eq!(auth.take_usage(), vec![(id, 2)]);
        assert!(auth.take_usage().is_empty());
        // A peer admitted 8 of this key in the same instant: the burst of 10 is spent.
        auth.charge_peer(id, 8, t);
        auth.charge_peer(id ^ 1, 100, t); // another key's id changes nothing here
        let e = auth.check(&hdr("Bearer sk-c"), t).unwrap_err();
        assert_eq!(e.status(), http::StatusCode::TOO_MANY_REQUESTS);
        // Without the peer's usage the same key still had 8 requests left.
        let alone = Auth::from_config(&cfg);
        for _ in 0..3 {
            assert!(alone.check(&hdr("Bearer sk-c"), t).is_ok());
        }
        // A flood of peer reports is floored at -burst: one refill (2 s at 10/s) frees the key.
        auth.charge_peer(id, 10_000, t);
        assert!(auth
            .check(&hdr("Bearer sk-c"), t + Duration::from_millis(2100))
            .is_ok());
    }
}
