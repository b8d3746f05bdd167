//! KV-event publishing for one DP rank: sequence numbers, the replay buffer, and the ZeroMQ
//! sockets (PUB for events, ROUTER for replay, PUB for load stats), wire-compatible with the
//! engines' publishers.
//!
//! Sequencing is decided synchronously, under the rank's lock, by [`RankPublisher::publish`]:
//! the batch gets its seq, is encoded once, goes into the replay buffer and is handed to the PUB
//! writer task through a bounded queue in the same critical section. So seq order, replay-buffer
//! order and wire order are all the order of cache mutations, with no task reordering possible.
//! The socket tasks only move bytes.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use kvroute_wire::{Encoding, EventBatch, KvEvent, LoadStat, encode_batch, encode_load_stat};
use tokio::sync::{Notify, mpsc};
use tokio_util::sync::CancellationToken;
use zeromq::{PubSocket, RouterSocket, Socket, SocketRecv, SocketSend, ZmqMessage};

use crate::SimError;

/// Messages queued for a PUB writer before new ones are dropped (the engines' default `hwm`).
pub const PUB_QUEUE_MAX_MESSAGES: usize = 100_000;
/// Attempts at finding `dp_size` consecutive free ports when the OS picks them.
pub const PORT_PROBE_ATTEMPTS_MAX: usize = 64;
/// Lowest port a run of consecutive ports is probed from (past the well-known and most
/// registered services' ports).
pub const PORT_PROBE_LOW: u16 = 10_000;
/// The probe stays below this port: where Linux's default ephemeral range
/// (`net.ipv4.ip_local_port_range`) begins. Outgoing connections take their local ports from
/// that range, and a closed one holds its port in TIME_WAIT for a minute, so after a run with a
/// thousand connections (a 1,024-rank fleet's subscribers) a run of 64 free ports there is rare,
/// and `benches/plan_1024.rs`'s fleet (16 engines x 64 ranks) failed to start in several runs
/// made back to back. Below it only listeners hold ports.
pub const PORT_PROBE_HIGH: u16 = 32_768;
/// The seq of the replay end marker.
pub const END_SEQ: i64 = -1;
/// Topic of load-stat messages (SGLang's `LOAD_TOPIC`).
pub const LOAD_TOPIC: &str = "load";

/// Sequencing and replay state of one rank's KV publisher.
#[derive(Debug)]
pub struct RankPublisher {
    encoding: Encoding,
    topic: Bytes,
    dp_rank: u32,
    next_seq: i64,
    replay: VecDeque<(i64, Bytes)>,
    replay_max_batches: usize,
    /// Batches still to be sequenced and buffered but withheld from the PUB (test control).
    drop_next_batches: u64,
    pub_tx: mpsc::Sender<ZmqMessage>,
    /// Batches the PUB queue had no room for (a real engine's HWM drop).
    pub dropped_queue_full: u64,
}

impl RankPublisher {
    pub fn new(
        encoding: Encoding,
        topic: &str,
        dp_rank: u32,
        replay_max_batches: usize,
        pub_tx: mpsc::Sender<ZmqMessage>,
    ) -> Self {
        RankPublisher {
            encoding,
            topic: Bytes::copy_from_slice(topic.as_bytes()),
            dp_rank,
            next_seq: 0,
            replay: VecDeque::new(),
            replay_max_batches,
            drop_next_batches: 0,
            pub_tx,
            dropped_queue_full: 0,
        }
    }

    /// The seq of the last batch published, -1 before the first.
    pub fn last_seq(&self) -> i64 {
        self.next_seq - 1
    }

    /// Publishes `events` as one batch (nothing when empty) and returns its seq.
    pub fn publish(&mut self, events: Vec<KvEvent>) -> Option<i64> {
        if events.is_empty() {
            return None;
        }
        let events = if matches!(
            self.encoding,
            Encoding::Vllm | Encoding::VllmBytes | Encoding::VllmMap
        ) {
            coalesce_chains(events)
        } else {
            events
        };
        let batch = EventBatch {
            ts: SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map(|d| d.as_secs_f64())
                .unwrap_or(0.0),
            events,
            dp_rank: Some(self.dp_rank),
        };
        let payload = Bytes::from(encode_batch(&batch, self.encoding));
        let seq = self.next_seq;
        self.next_seq += 1;
        self.buffer(seq, payload.clone());
        if self.drop_next_batches > 0 {
            self.drop_next_batches -= 1;
        } else {
            let msg = three_frames(self.topic.clone(), seq, payload);
            if self.pub_tx.try_send(msg).is_err() {
                self.dropped_queue_full += 1;
            }
        }
        Some(seq)
    }

    fn buffer(&mut self, seq: i64, payload: Bytes) {
        if self.replay.len() >= self.replay_max_batches {
            self.replay.pop_front();
        }
        self.replay.push_back((seq, payload));
    }

    /// Withholds the next `n` batches from the PUB (they still get seqs and are replayable).
    pub fn drop_next(&mut self, n: u64) {
        self.drop_next_batches = self.drop_next_batches.saturating_add(n);
    }

    /// What a restarted engine process looks like: seq from 0 again, empty replay buffer.
    pub fn restart(&mut self) {
        self.next_seq = 0;
        self.replay.clear();
        self.drop_next_batches = 0;
    }

    /// Buffered batches with seq >= `start`, oldest first.
    pub fn replay_from(&self, start: i64) -> Vec<(i64, Bytes)> {
        let skip = self.replay.partition_point(|(seq, _)| *seq < start);
        self.replay.iter().skip(skip).cloned().collect()
    }

    pub fn topic(&self) -> Bytes {
        self.topic.clone()
    }
}

/// vLLM announces a run of new blocks as one `BlockStored` with several hashes (and removals
/// likewise); the cache produces one event per block, so merge runs that chain.
fn coalesce_chains(events: Vec<KvEvent>) -> Vec<KvEvent> {
    let mut out: Vec<KvEvent> = Vec::with_capacity(events.len());
    for ev in events {
        match (out.last_mut(), ev) {
            (Some(KvEvent::BlockStored(prev)), KvEvent::BlockStored(next))
                if prev.medium == next.medium
                    && prev.block_size == next.block_size
                    && next.parent_block_hash == prev.block_hashes.last().copied() =>
            {
                prev.block_hashes.extend(next.block_hashes);
                prev.token_ids.extend(next.token_ids);
            }
            (Some(KvEvent::BlockRemoved(prev)), KvEvent::BlockRemoved(next))
                if prev.medium == next.medium =>
            {
                prev.block_hashes.extend(next.block_hashes);
            }
            (_, ev) => out.push(ev),
        }
    }
    out
}

fn three_frames(topic: Bytes, seq: i64, payload: Bytes) -> ZmqMessage {
    let mut msg = ZmqMessage::from(topic);
    msg.push_back(Bytes::copy_from_slice(&seq.to_be_bytes()));
    msg.push_back(payload);
    msg
}

/// Binds `n` sockets of type `S` on consecutive ports starting at `base` (or, with base 0, at an
/// OS-chosen port with the next `n - 1` also free) and returns them with the first port.
pub async fn bind_consecutive<S: Socket>(
    host: &str,
    base: u16,
    n: usize,
    what: &str,
) -> Result<(Vec<S>, u16), SimError> {
    let attempts = if base == 0 {
        PORT_PROBE_ATTEMPTS_MAX
    } else {
        1
    };
    let mut last_err = String::new();
    // One rank needs no run of ports: the OS picks any free one. Several probe a random first
    // port below the ephemeral range ([`PORT_PROBE_HIGH`]).
    let probe_first = |attempt: usize| -> u16 {
        if base != 0 || n <= 1 || attempt + 1 == attempts {
            // The last attempt lets the OS choose, as a fleet with no room below would.
            return base;
        }
        let span = (PORT_PROBE_HIGH - PORT_PROBE_LOW) as usize;
        let room = span.saturating_sub(n).max(1);
        PORT_PROBE_LOW + rand::random_range(0..room) as u16
    };
    'attempt: for attempt in 0..attempts {
        let mut sockets = Vec::with_capacity(n);
        let start = probe_first(attempt);
        let mut first = start;
        for r in 0..n {
            let port = if r == 0 { start } else { first + r as u16 };
            let mut s = S::new();
            match s.bind(&format!("tcp://{host}:{port}")).await {
                Ok(zeromq::Endpoint::Tcp(_, bound)) => {
                    if r == 0 {
                        first = bound;
                        if first as usize + n > u16::MAX as usize {
                            last_err = format!("port {first} leaves no room for {n} ranks");
                            continue 'attempt;
                        }
                    }
                    sockets.push(s);
                }
                Ok(other) => {
                    return Err(SimError::Bind {
                        what: what.into(),
                        addr: format!("{host}:{port}"),
                        reason: format!("unexpected endpoint {other}"),
                    });
                }
                Err(e) => {
                    last_err = format!("{host}:{port}: {e}");
                    continue 'attempt;
                }
            }
        }
        return Ok((sockets, first));
    }
    Err(SimError::Bind {
        what: what.into(),
        addr: format!("{host}:{base}"),
        reason: last_err,
    })
}

/// Moves queued messages onto the PUB socket until cancelled.
pub async fn run_pub_writer(
    mut socket: PubSocket,
    mut rx: mpsc::Receiver<ZmqMessage>,
    cancel: CancellationToken,
) {
    loop {
        tokio::select! {
            _ = cancel.cancelled() => break,
            msg = rx.recv() => match msg {
                Some(msg) => {
                    if let Err(e) = socket.send(msg).await {
                        tracing::warn!(error = %e, "kv event PUB send failed");
                    }
                }
                None => break,
            },
        }
    }
    let _ = socket.close().await;
}

/// Serves replay requests `[identity, "", start_seq]` with `[identity, "", topic, seq, payload]`
/// per buffered batch then the `seq = -1` end marker. A malformed request gets only the end
/// marker, so a confused client finishes instead of waiting for its timeout.
pub async fn run_replay_server<F>(mut socket: RouterSocket, snapshot: F, cancel: CancellationToken)
where
    F: Fn(i64) -> (Bytes, Vec<(i64, Bytes)>) + Send + 'static,
{
    loop {
        let msg = tokio::select! {
            _ = cancel.cancelled() => break,
            msg = socket.recv() => msg,
        };
        let msg = match msg {
            Ok(m) => m,
            Err(e) => {
                tracing::debug!(error = %e, "replay ROUTER recv failed");
                continue;
            }
        };
        let frames = msg.into_vec();
        let Some(identity) = frames.first().cloned() else {
            continue;
        };
        // DEALER clients send ["", seq]; a REQ socket's envelope looks the same to us. The
        // start seq is the last frame either way.
        let start = frames
            .last()
            .filter(|_| frames.len() >= 2)
            .and_then(|f| <[u8; 8]>::try_from(f.as_ref()).ok())
            .map(i64::from_be_bytes);
        let (topic, batches) = match start {
            Some(start) => snapshot(start),
            None => {
                tracing::debug!(frames = frames.len(), "malformed replay request");
                (snapshot(i64::MAX).0, Vec::new())
            }
        };
        let reply = |seq: i64, payload: Bytes| {
            let mut m = ZmqMessage::from(identity.clone());
            m.push_back(Bytes::new());
            m.push_back(topic.clone());
            m.push_back(Bytes::copy_from_slice(&seq.to_be_bytes()));
            m.push_back(payload);
            m
        };
        for (seq, payload) in batches {
            if let Err(e) = socket.send(reply(seq, payload)).await {
                tracing::debug!(error = %e, "replay send failed");
                break;
            }
        }
        let _ = socket.send(reply(END_SEQ, Bytes::new())).await;
    }
    let _ = socket.close().await;
}

/// Publishes the rank's `LoadStat` every `interval` and whenever `changed` fires (at most once
/// per change burst: a notification arriving while sending is coalesced by `Notify`).
pub async fn run_load_publisher<F>(
    mut socket: PubSocket,
    stat: F,
    changed: Arc<Notify>,
    interval: Duration,
    cancel: CancellationToken,
) where
    F: Fn() -> LoadStat + Send + 'static,
{
    let mut seq: i64 = 0;
    let mut last: Option<LoadStat> = None;
    let mut ticker = tokio::time::interval(interval);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        let periodic = tokio::select! {
            _ = cancel.cancelled() => break,
            _ = ticker.tick() => true,
            _ = changed.notified() => false,
        };
        let now = stat();
        if !periodic && last == Some(now) {
            continue;
        }
        last = Some(now);
        let msg = three_frames(
            Bytes::from_static(LOAD_TOPIC.as_bytes()),
            seq,
            Bytes::from(encode_load_stat(&now)),
        );
        seq += 1;
        if let Err(e) = socket.send(msg).await {
            tracing::debug!(error = %e, "load PUB send failed");
        }
    }
    let _ = socket.close().await;
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvroute_wire::{BlockRemoved, BlockStored, EngineHash, Medium};

    #[tokio::test]
    async fn a_run_of_ports_the_os_may_pick_is_bound_below_the_ephemeral_range() {
        let (sockets, first) = bind_consecutive::<PubSocket>("127.0.0.1", 0, 8, "test PUB")
            .await
            .expect("eight consecutive ports are found");
        assert_eq!(sockets.len(), 8);
        assert!(
            (PORT_PROBE_LOW..PORT_PROBE_HIGH).contains(&first),
            "the run starts at {first}, outside {PORT_PROBE_LOW}..{PORT_PROBE_HIGH}"
        );
        // Every port of the run is held: a listener on any of them is refused.
        for r in 0..8u16 {
            let taken = std::net::TcpListener::bind(("127.0.0.1", first + r));
            assert!(taken.is_err(), "port {} of the run is not bound", first + r);
        }
        // One rank takes whatever port the OS gives.
        let (single, _) = bind_consecutive::<PubSocket>("127.0.0.1", 0, 1, "test PUB")
            .await
            .expect("one port is found");
        assert_eq!(single.len(), 1);
    }

    fn stored(hash: u64, parent: Option<u64>, medium: Medium) -> KvEvent {
        KvEvent::BlockStored(BlockStored {
            block_hashes: vec![EngineHash(hash)],
            parent_block_hash: parent.map(EngineHash),
            token_ids: vec![hash as u32; 2],
            block_size: 2,
            lora_id: None,
            lora_name: None,
            medium: Some(medium),
            extra_keys: vec![],
            group_idx: None,
        })
    }

    #[test]
    fn chained_stores_of_one_medium_coalesce_and_breaks_start_a_new_event() {
        let out = coalesce_chains(vec![
            stored(1, None, Medium::Device),
            stored(2, Some(1), Medium::Device),
            stored(3, Some(2), Medium::Host),
            stored(9, None, Medium::Device),
            KvEvent::BlockRemoved(BlockRemoved {
                block_hashes: vec![EngineHash(5)],
                medium: Some(Medium::Device),
                group_idx: None,
            }),
            KvEvent::BlockRemoved(BlockRemoved {
                block_hashes: vec![EngineHash(6)],
                medium: Some(Medium::Device),
                group_idx: None,
            }),
        ]);
        assert_eq!(out.len(), 4, "{out:?}");
        let KvEvent::BlockStored(first) = &out[0] else {
            panic!("{out:?}")
        };
        assert_eq!(first.block_hashes, vec![EngineHash(1), EngineHash(2)]);
        assert_eq!(first.token_ids, vec![1, 1, 2, 2]);
        let KvEvent::BlockRemoved(rm) = &out[3] else {
            panic!("{out:?}")
        };
        assert_eq!(rm.block_hashes, vec![EngineHash(5), EngineHash(6)]);
    }

    #[test]
    fn replay_from_returns_the_suffix_and_the_buffer_keeps_only_the_newest_batches() {
        let (tx, _rx) = mpsc::channel(16);
        let mut p = RankPublisher::new(Encoding::Sglang, "", 0, 3, tx);
        // Fill the buffer directly: encoding is another crate's job and tested there.
        for seq in 0..5 {
            p.buffer(seq, Bytes::from(vec![seq as u8]));
        }
        let seqs: Vec<i64> = p.replay_from(3).into_iter().map(|(s, _)| s).collect();
        assert_eq!(seqs, vec![3, 4]);
        let seqs: Vec<i64> = p.replay_from(0).into_iter().map(|(s, _)| s).collect();
        assert_eq!(seqs, vec![2, 3, 4]);
    }
}
