//! The byte transport of engine KV events: a live subscription per rank and a replay request,
//! behind the small [`KvSource`] trait, implemented with the pure-Rust `zeromq` crate.
//!
//! The trait exists so the ZMQ library can be swapped (the libzmq binding is the known fallback)
//! without touching the pump or the subscriber tasks. Everything here is framing only: frames are
//! checked for shape and size (named limits) and handed on as `(seq, payload)`; decoding the
//! msgpack payload happens in the caller's task, never in the pump.
//!
//! `zeromq` 0.7 facts this module is shaped around: `connect` waits until the peer accepts (so it
//! runs only inside background tasks, bounded per attempt and retried), a connected SUB reconnects
//! and re-sends its subscription by itself, and its monitor reports each (re)connection, which is
//! how the caller learns that batches may have been missed (slow joiner, reconnect).

use std::future::Future;
use std::time::Duration;

use bytes::Bytes;
use futures::StreamExt;
use zeromq::{Socket, SocketEvent, SocketOptions, SocketRecv, SocketSend, ZmqMessage};

mod frames;
pub use frames::{FrameError, TOPIC_MAX_BYTES, parse_live_frames, parse_replay_frames};

/// Upper bound of one SUB connect attempt; attempts repeat until the caller gives up, so this only
/// bounds how stale the library's internal connect backoff can get.
pub const SUB_CONNECT_ATTEMPT_TIMEOUT_MS: u64 = 2_000;
/// Pause after a failed connect attempt or a receive error, so a dead endpoint does not spin.
pub const SUB_RETRY_PAUSE_MS: u64 = 100;
/// Whole-replay budget: connect, request and every answer frame until the end marker.
pub const REPLAY_TIMEOUT_MS: u64 = 2_000;
/// Most batches taken from one replay answer (engines buffer 10,000 by default).
pub const REPLAY_BATCHES_MAX: usize = 16_384;
/// Most payload bytes taken from one replay answer.
pub const REPLAY_TOTAL_MAX_BYTES: usize = 256 * 1024 * 1024;
/// The seq of a replay answer's end marker.
pub const REPLAY_END_SEQ: i64 = -1;

#[derive(Debug, thiserror::Error)]
pub enum TransportError {
    #[error("zmq: {0}")]
    Zmq(#[from] zeromq::ZmqError),
    #[error("replay timed out after {timeout_ms} ms with nothing received")]
    ReplayTimeout { timeout_ms: u64 },
    #[error("replay answer malformed: {0}")]
    ReplayFrame(FrameError),
    #[error("replay answer exceeded {limit}")]
    ReplayTooLarge { limit: &'static str },
}

/// One thing that happened on a live subscription.
#[derive(Debug, Clone, PartialEq)]
pub enum SourceEvent {
    /// The SUB (re)connected to the publisher; anything published while it was away is missed.
    Connected,
    Disconnected,
    Message {
        seq: i64,
        payload: Bytes,
    },
    /// A message whose frames were the wrong shape or size; it was dropped.
    Malformed(FrameError),
}

/// A live subscription to one publisher.
pub trait KvSubscription: Send + 'static {
    /// The next event; cancel-safe (used inside `select!`).
    fn next_event(&mut self) -> impl Future<Output = SourceEvent> + Send;
}

/// Connects subscriptions and performs replays.
pub trait KvSource: Send + Sync + 'static {
    type Subscription: KvSubscription;

    /// Resolves once connected and subscribed to `topic`; retries until then (cancel by dropping
    /// the future). The subscription reports its first connection as [`SourceEvent::Connected`].
    fn subscribe(
        &self,
        endpoint: &str,
        topic: &str,
    ) -> impl Future<Output = Self::Subscription> + Send;

    /// Asks the replay ROUTER at `endpoint` for batches `from_seq..`, stopping early at the first
    /// seq `>= stop_before`. A timeout after some batches arrived yields those batches.
    fn replay(
        &self,
        endpoint: &str,
        from_seq: i64,
        stop_before: Option<i64>,
    ) -> impl Future<Output = Result<Vec<(i64, Bytes)>, TransportError>> + Send;
}

/// The `zeromq`-crate implementation.
#[derive(Debug, Clone, Default)]
pub struct ZmqSource;

pub struct ZmqSubscription {
    socket: zeromq::SubSocket,
    monitor: futures::channel::mpsc::Receiver<SocketEvent>,
    /// Set once the monitor stream ended, so the select below stops polling a finished stream
    /// (which would be ready forever and starve the receive branch).
    monitor_ended: bool,
}

impl KvSubscription for ZmqSubscription {
    async fn next_event(&mut self) -> SourceEvent {
        loop {
            tokio::select! {
                biased;
                ev = self.monitor.next(), if !self.monitor_ended => match ev {
                    Some(SocketEvent::Connected(..)) => return SourceEvent::Connected,
                    Some(SocketEvent::Disconnected(..)) => return SourceEvent::Disconnected,
                    Some(_) => {}
                    None => self.monitor_ended = true,
                },
                msg = self.socket.recv() => match msg {
                    Ok(msg) => {
                        let frames = msg.into_vec();
                        return match parse_live_frames(&frames) {
                            Ok((seq, payload)) => SourceEvent::Message { seq, payload },
                            Err(e) => SourceEvent::Malformed(e),
                        };
                    }
                    Err(e) => {
                        // The socket reconnects by itself; pausing keeps a dead peer from spinning.
                        tracing::debug!(error = %e, "SUB receive error");
                        tokio::time::sleep(Duration::from_millis(SUB_RETRY_PAUSE_MS)).await;
                    }
                },
            }
        }
    }
}

impl KvSource for ZmqSource {
    type Subscription = ZmqSubscription;

    async fn subscribe(&self, endpoint: &str, topic: &str) -> ZmqSubscription {
        loop {
            let mut opts = SocketOptions::default();
            opts.connect_timeout(Duration::from_millis(SUB_CONNECT_ATTEMPT_TIMEOUT_MS));
            let mut socket = zeromq::SubSocket::with_options(opts);
            let monitor = socket.monitor();
            // Subscribing before connecting makes the subscription part of the handshake, so no
            // window exists where the socket is connected but filters everything out.
            let subscribed = socket.subscribe(topic).await;
            let connected = match subscribed {
                Ok(()) => socket.connect(endpoint).await,
                Err(e) => Err(e),
            };
            match connected {
                Ok(()) => {
                    return ZmqSubscription {
                        socket,
                        monitor,
                        monitor_ended: false,
                    };
                }
                Err(e) => {
                    tracing::debug!(%endpoint, error = %e, "SUB connect attempt failed; retrying");
                    tokio::time::sleep(Duration::from_millis(SUB_RETRY_PAUSE_MS)).await;
                }
            }
        }
    }

    async fn replay(
        &self,
        endpoint: &str,
        from_seq: i64,
        stop_before: Option<i64>,
    ) -> Result<Vec<(i64, Bytes)>, TransportError> {
        let deadline = tokio::time::Instant::now() + Duration::from_millis(REPLAY_TIMEOUT_MS);
        let mut opts = SocketOptions::default();
        opts.connect_timeout(Duration::from_millis(REPLAY_TIMEOUT_MS));
        let mut dealer = zeromq::DealerSocket::with_options(opts);
        let timeout = || TransportError::ReplayTimeout {
            timeout_ms: REPLAY_TIMEOUT_MS,
        };
        tokio::time::timeout_at(deadline, dealer.connect(endpoint))
            .await
            .map_err(|_| timeout())??;
        let mut request = ZmqMessage::from(Bytes::new());
        request.push_back(Bytes::copy_from_slice(&from_seq.to_be_bytes()));
        tokio::time::timeout_at(deadline, dealer.send(request))
            .await
            .map_err(|_| timeout())??;
        let mut batches = Vec::new();
        let mut total_bytes = 0usize;
        loop {
            let msg = match tokio::time::timeout_at(deadline, dealer.recv()).await {
                Ok(msg) => msg?,
                Err(_) if batches.is_empty() => return Err(timeout()),
                // Partial answer: the caller counts the rest lost.
                Err(_) => break,
            };
            let (seq, payload) =
                parse_replay_frames(&msg.into_vec()).map_err(TransportError::ReplayFrame)?;
            if seq == REPLAY_END_SEQ || stop_before.is_some_and(|s| seq >= s) {
                break;
            }
            if batches.len() >= REPLAY_BATCHES_MAX {
                return Err(TransportError::ReplayTooLarge {
                    limit: "REPLAY_BATCHES_MAX",
                });
            }
            total_bytes += payload.len();
            if total_bytes > REPLAY_TOTAL_MAX_BYTES {
                return Err(TransportError::ReplayTooLarge {
                    limit: "REPLAY_TOTAL_MAX_BYTES",
                });
            }
            batches.push((seq, payload));
        }
        Ok(batches)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvroute_wire::PAYLOAD_MAX_BYTES;

    fn b(x: &[u8]) -> Bytes {
        Bytes::copy_from_slice(x)
    }

    #[test]
    fn live_frames_need_topic_seq_and_payload() {
        let ok = parse_live_frames(&[b(b"kv"), b(&7i64.to_be_bytes()), b(b"p")]).unwrap();
        assert_eq!(ok, (7, b(b"p")));
        assert_eq!(
            parse_live_frames(&[b(b"kv"), b(b"p")]),
            Err(FrameError::FrameCount {
                expected: "3 (topic, seq, payload)",
                got: 2
            })
        );
        assert_eq!(
            parse_live_frames(&[b(b""), b(&[1, 2, 3]), b(b"p")]),
            Err(FrameError::SeqWidth { got: 3 })
        );
    }

    #[test]
    fn oversized_payloads_are_refused_before_decoding() {
        let big = Bytes::from(vec![0u8; PAYLOAD_MAX_BYTES + 1]);
        assert!(matches!(
            parse_live_frames(&[b(b""), b(&0i64.to_be_bytes()), big]),
            Err(FrameError::PayloadTooLarge { .. })
        ));
    }

    #[test]
    fn replay_frames_accept_with_and_without_topic() {
        let seq = b(&5i64.to_be_bytes());
        assert_eq!(
            parse_replay_frames(&[b(b""), b(b"kv"), seq.clone(), b(b"p")]).unwrap(),
            (5, b(b"p"))
        );
        assert_eq!(
            parse_replay_frames(&[b(b""), seq.clone(), b(b"p")]).unwrap(),
            (5, b(b"p"))
        );
        let end = parse_replay_frames(&[b(b""), b(b""), b(&(-1i64).to_be_bytes()), b(b"")]);
        assert_eq!(end.unwrap().0, REPLAY_END_SEQ);
        assert!(parse_replay_frames(&[b(b"")]).is_err());
    }
}
