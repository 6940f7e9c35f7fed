//! One replay exchange: a DEALER sends `[b"", start_seq]` to the publisher's ROUTER and reads
//! batches until `END_SEQ`, within one deadline.

use std::time::Duration;

use bytes::Bytes;
use kvgate_protocol::kv_events::{decode_replay, replay_request, KvEventBatch, ReplayFrame};
use zeromq::{Socket, SocketRecv, SocketSend, ZmqMessage};

#[derive(Debug, thiserror::Error)]
pub enum ReplayError {
    #[error("replay timed out after {0:?}")]
    Timeout(Duration),
    #[error("zmq: {0}")]
    Zmq(#[from] zeromq::ZmqError),
    #[error("malformed replay reply: {0}")]
    Decode(#[from] kvgate_protocol::kv_events::KvEventError),
    #[error("replay reply holds more than {0} batches")]
    TooLong(usize),
    #[error("replay endpoint unreachable: {0}")]
    Unreachable(String),
}

/// Upper bound on batches accepted from one replay (vLLM buffers 10 000 steps by default).
const MAX_BATCHES: usize = 100_000;

/// Requests every buffered batch with seq ≥ `from`, in order.
pub async fn replay(
    endpoint: &str,
    from: u64,
    timeout: Duration,
) -> Result<Vec<KvEventBatch>, ReplayError> {
    tokio::time::timeout(timeout, exchange(endpoint, from))
        .await
        .map_err(|_| ReplayError::Timeout(timeout))?
}

async fn exchange(endpoint: &str, from: u64) -> Result<Vec<KvEventBatch>, ReplayError> {
    super::reachable(endpoint)
        .await
        .map_err(ReplayError::Unreachable)?;
    let mut sock = zeromq::DealerSocket::new();
    sock.connect(endpoint).await?;
    let req = vec![Bytes::new(), Bytes::copy_from_slice(&replay_request(from))];
    sock.send(ZmqMessage::try_from(req).map_err(|_| ReplayError::TooLong(0))?)
        .await?;
    let mut out = Vec::new();
    loop {
        let msg = sock.recv().await?;
        match decode_replay(&msg.into_vec())? {
            ReplayFrame::End => return Ok(out),
            ReplayFrame::Batch(b) => {
                if out.len() >= MAX_BATCHES {
                    return Err(ReplayError::TooLong(MAX_BATCHES));
                }
                out.push(b);
            }
        }
    }
}
