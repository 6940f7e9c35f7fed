//! The ZMQ side of KV events: a PUB socket sending `[topic, seq u64 BE, payload]` per scheduler
//! step, and a ROUTER socket answering replay requests `[b"", start_seq]` with the buffered batches
//! `[topic, seq, payload]` and then `[b"", END_SEQ, b""]` (vLLM ≥ 0.26 framing).

use std::collections::VecDeque;
use std::net::SocketAddr;

use bytes::Bytes;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use zeromq::{Socket, SocketRecv, SocketSend, ZmqMessage};

use crate::config::EventEncoding;
use crate::kv_events::{encode_batch, KvEvent};

pub const END_SEQ: [u8; 8] = [0xff; 8];

pub struct PublisherConfig {
    pub topic: String,
    pub encoding: EventEncoding,
    pub dp_rank: u32,
    pub buffer_steps: usize,
    pub garbage_rate: f64,
    pub seed: u64,
}

/// Bound endpoints, as `tcp://host:port`.
#[derive(Clone, Debug)]
pub struct Endpoints {
    pub publish: SocketAddr,
    pub replay: SocketAddr,
}

fn endpoint_addr(ep: &zeromq::Endpoint) -> anyhow::Result<SocketAddr> {
    match ep {
        zeromq::Endpoint::Tcp(host, port) => {
            let ip: std::net::IpAddr = host.to_string().parse()?;
            Ok(SocketAddr::new(ip, *port))
        }
        other => anyhow::bail!("unexpected endpoint {other}"),
    }
}

/// Binds both sockets, then runs the publisher until `cancel` fires or the batch channel closes.
pub async fn start(
    cfg: PublisherConfig,
    publish: SocketAddr,
    replay: SocketAddr,
    rx: mpsc::UnboundedReceiver<Vec<KvEvent>>,
    cancel: CancellationToken,
) -> anyhow::Result<(Endpoints, tokio::task::JoinHandle<()>)> {
    let mut pub_sock = zeromq::PubSocket::new();
    let ep = pub_sock
        .bind(&format!("tcp://{publish}"))
        .await
        .map_err(|e| anyhow::anyhow!("binding KV-event PUB socket on {publish}: {e}"))?;
    let mut router = zeromq::RouterSocket::new();
    let rep = router
        .bind(&format!("tcp://{replay}"))
        .await
        .map_err(|e| anyhow::anyhow!("binding KV-event replay socket on {replay}: {e}"))?;
    let endpoints = Endpoints {
        publish: endpoint_addr(&ep)?,
        replay: endpoint_addr(&rep)?,
    };
    let task = tokio::spawn(run(cfg, pub_sock, router, rx, cancel));
    Ok((endpoints, task))
}

async fn run(
    cfg: PublisherConfig,
    mut pub_sock: zeromq::PubSocket,
    router: zeromq::RouterSocket,
    mut rx: mpsc::UnboundedReceiver<Vec<KvEvent>>,
    cancel: CancellationToken,
) {
    let topic = Bytes::from(cfg.topic.clone().into_bytes());
    let mut buffer: VecDeque<(u64, Bytes)> = VecDeque::new();
    let mut seq: u64 = 0;
    let mut rng = fastrand::Rng::with_seed(cfg.seed ^ 0x6172_6261_6765);
    let (mut r_tx, mut r_rx) = router.split();
    loop {
        tokio::select! {
            _ = cancel.cancelled() => break,
            batch = rx.recv() => {
                let Some(events) = batch else { break };
                if cfg.garbage_rate > 0.0 && rng.f64() < cfg.garbage_rate {
                    let _ = pub_sock.send(garbage(&mut rng, &topic, seq)).await;
                }
                let ts = std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map(|d| d.as_secs_f64())
                    .unwrap_or(0.0);
                let payload = Bytes::from(encode_batch(ts, &events, cfg.dp_rank, cfg.encoding));
                let msg = frames(&[topic.clone(), Bytes::copy_from_slice(&seq.to_be_bytes()), payload.clone()]);
                if let Err(e) = pub_sock.send(msg).await {
                    tracing::warn!(error = %e, "KV-event publish failed");
                }
                buffer.push_back((seq, payload));
                if buffer.len() > cfg.buffer_steps {
                    buffer.pop_front();
                }
                seq += 1;
            }
            req = r_rx.recv() => {
                let Ok(req) = req else { continue };
                let frames_in = req.into_vec();
                // [identity, b"", start_seq] from a DEALER; [identity, start_seq] from a REQ-less peer.
                let Some(identity) = frames_in.first().cloned() else { continue };
                let start = frames_in.last().and_then(|f| <[u8; 8]>::try_from(f.as_ref()).ok()).map(u64::from_be_bytes);
                let Some(start) = start else {
                    tracing::debug!("ignoring malformed replay request");
                    continue;
                };
                for (s, payload) in buffer.iter().filter(|(s, _)| *s >= start) {
                    let m = frames(&[identity.clone(), Bytes::new(), topic.clone(), Bytes::copy_from_slice(&s.to_be_bytes()), payload.clone()]);
                    if r_tx.send(m).await.is_err() {
                        break;
                    }
                }
                let end = frames(&[identity, Bytes::new(), Bytes::new(), Bytes::from_static(&END_SEQ), Bytes::new()]);
                let _ = r_tx.send(end).await;
            }
        }
    }
    // Dropping the sockets unbinds them.
    drop(pub_sock);
    drop(r_tx);
    drop(r_rx);
}

fn frames(parts: &[Bytes]) -> ZmqMessage {
    ZmqMessage::try_from(parts.to_vec()).expect("non-empty frame list")
}

/// Malformed messages a robust subscriber must skip. They never consume a sequence number, so the
/// real stream stays gap-free.
fn garbage(rng: &mut fastrand::Rng, topic: &Bytes, next_seq: u64) -> ZmqMessage {
    let junk: Vec<u8> = (0..rng.usize(1..48)).map(|_| rng.u8(..)).collect();
    match rng.u8(0..4) {
        // Two frames instead of three.
        0 => frames(&[topic.clone(), Bytes::from(junk)]),
        // Short sequence frame.
        1 => frames(&[
            topic.clone(),
            Bytes::from_static(b"\x00\x01"),
            Bytes::from(junk),
        ]),
        // Reserved msgpack byte 0xc1: never valid.
        2 => frames(&[
            topic.clone(),
            Bytes::copy_from_slice(&next_seq.saturating_sub(1).to_be_bytes()),
            Bytes::from_static(b"\xc1\xc1"),
        ]),
        // Valid msgpack, wrong shape (a map instead of the batch array).
        _ => frames(&[
            topic.clone(),
            Bytes::copy_from_slice(&next_seq.saturating_sub(1).to_be_bytes()),
            Bytes::from_static(b"\x81\xa1a\x01"),
        ]),
    }
}
