//! One encoding of a snapshot body, streamed to every requester that joins it in time.
//!
//! The producer encodes onto the socket instead of into a buffer, so that no side holds a body
//! whole (at 1,024 ranks one is 0.57 GB) and the consumer decodes while the producer encodes.
//! Encoding per request would make N siblings booting at once (a scale-up) cost N encodes of the
//! same export on a router that is also serving traffic; a tee keeps it at one:
//! * The encoder (on the blocking pool) cuts its output into chunks of
//!   [`SNAPSHOT_STREAM_CHUNK_BYTES`] and hands each to every reader's channel of
//!   [`SNAPSHOT_STREAM_CHUNKS_IN_FLIGHT_MAX`] chunks. It goes at the pace of its slowest reader:
//!   a reader that takes no chunk within the stall limit is dropped (its body is cut), so one
//!   stopped client can neither pin the encoder nor hold back the others.
//! * The chunks sent so far are kept as a replay while they total at most
//!   [`SNAPSHOT_STREAM_JOIN_WINDOW_BYTES`]: a requester that comes while the replay is whole
//!   joins the running encoding (replay first, then live). Past the window the replay is dropped
//!   and later requesters start their own encoding; a body that ends within the window stays as
//!   the replay, so small bodies are encoded once per export, like a cache.
//! * Joining and publishing take the same lock, and a chunk enters the replay in the same
//!   critical section as the list of readers it is sent to is read: a joiner gets every chunk
//!   exactly once, from the replay or from its channel, never from both or neither.
//! * A body that stops early is CUT (the item stream ends in an error, which aborts the transfer),
//!   never ended cleanly: a client must never take a prefix for a whole body. A reader that never
//!   sees [`BodyPiece::End`] therefore reports the cut itself, whatever stopped the encoder.

use std::collections::VecDeque;
use std::io::Write;
use std::time::Duration;

use bytes::Bytes;
use futures::Stream;
use parking_lot::Mutex;
use tokio::sync::mpsc;

/// Bytes per chunk the encoder hands to the socket.
pub const SNAPSHOT_STREAM_CHUNK_BYTES: usize = 256 * 1024;
/// Chunks queued between the encoder and each reader's socket (2 MiB): enough to keep the
/// socket busy while the encoder works, little enough that a slow client holds back the encoder.
pub const SNAPSHOT_STREAM_CHUNKS_IN_FLIGHT_MAX: usize = 8;
/// Longest wait for a reader to take the next chunk before it is dropped. A consumer decodes a
/// chunk in milliseconds; this is for clients that stopped.
pub const SNAPSHOT_STREAM_STALL_MS_MAX: u64 = 10_000;
/// Largest replay kept for requesters that join a running encoding, and the largest body kept
/// once encoded. Past it a body is never held whole.
pub const SNAPSHOT_STREAM_JOIN_WINDOW_BYTES: usize = 64 << 20;

/// Most readers one running encoding feeds; a requester past it starts its own encoding (and is
/// told to retry when every export slot is taken).
pub const SNAPSHOT_STREAM_READERS_MAX: usize = 64;

/// Why a body stopped before its end.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BodyCut {
    #[error("the encoded snapshot passes the limit of {limit_bytes} bytes")]
    TooLarge { limit_bytes: usize },
    #[error("the client took no chunk for {stall_ms} ms")]
    Stalled { stall_ms: u64 },
    #[error("every client hung up")]
    Gone,
    #[error("encoding the snapshot failed: {0}")]
    Failed(String),
}

impl BodyCut {
    /// The metric label of a body cut for this reason.
    pub fn label(&self) -> &'static str {
        match self {
            BodyCut::TooLarge { .. } => "too_large",
            BodyCut::Stalled { .. } => "client_stalled",
            BodyCut::Gone => "client_gone",
            BodyCut::Failed(_) => "error",
        }
    }
}

/// One piece of a body on its way from the encoder to a reader.
enum BodyPiece {
    Chunk(Bytes),
    /// The encoding is whole: the body may end.
    End,
    /// The encoding stopped: the body must be cut, not ended.
    Cut(BodyCut),
}

/// How a reader's body goes on after the chunks it already holds.
enum Tail {
    Live(mpsc::Receiver<BodyPiece>),
    /// The encoding had ended when the reader joined.
    Ended,
}

/// One reader's body: the chunks it already holds, then its tail.
pub struct EncodedBody {
    ready: VecDeque<Bytes>,
    tail: Tail,
}

impl EncodedBody {
    /// Waits until the body's first chunk is here, or returns why there will be none. The
    /// producer answers only after this, so a refusal found before the first byte is still a
    /// status code.
    pub async fn first_chunk(&mut self) -> Result<(), BodyCut> {
        if !self.ready.is_empty() {
            return Ok(());
        }
        let Tail::Live(pieces) = &mut self.tail else {
            return Err(BodyCut::Failed("the encoding ended without a byte".into()));
        };
        match pieces.recv().await {
            Some(BodyPiece::Chunk(chunk)) => {
                self.ready.push_back(chunk);
                Ok(())
            }
            Some(BodyPiece::Cut(reason)) => Err(reason),
            Some(BodyPiece::End) | None => {
                Err(BodyCut::Failed("the encoding ended without a byte".into()))
            }
        }
    }

    /// The body as a stream for the HTTP layer: ends after the encoder's last chunk, and yields
    /// an error (which aborts the transfer) if the encoder stopped before it.
    pub fn into_stream(self) -> impl Stream<Item = Result<Bytes, std::io::Error>> + Send + 'static {
        futures::stream::unfold(Some(self), |body| async move {
            let mut body = body?;
            if let Some(chunk) = body.ready.pop_front() {
                return Some((Ok(chunk), Some(body)));
            }
            let Tail::Live(pieces) = &mut body.tail else {
                return None;
            };
            let cut = match pieces.recv().await {
                Some(BodyPiece::Chunk(chunk)) => return Some((Ok(chunk), Some(body))),
                Some(BodyPiece::End) => return None,
                Some(BodyPiece::Cut(reason)) => reason.to_string(),
                None => "the snapshot encoder stopped before the body's end".to_string(),
            };
            Some((Err(std::io::Error::other(cut)), None))
        })
    }
}

struct TeeState {
    join_window_bytes: usize,
    /// Every chunk sent so far, while they fit the join window; dropped past it.
    replay: Vec<Bytes>,
    replay_bytes: usize,
    joinable: bool,
    readers: Vec<mpsc::Sender<BodyPiece>>,
    /// Set when the encoding ended whole (a reader joining after it gets replay + end).
    ended_whole: bool,
}

/// One running (or, for a small body, finished) encoding and its readers.
pub struct BodyTee {
    state: Mutex<TeeState>,
}

impl BodyTee {
    /// A new encoding's tee, joinable until its replay passes `join_window_bytes`
    /// ([`SNAPSHOT_STREAM_JOIN_WINDOW_BYTES`] in service).
    pub fn new(join_window_bytes: usize) -> Self {
        BodyTee {
            state: Mutex::new(TeeState {
                join_window_bytes,
                replay: Vec::new(),
                replay_bytes: 0,
                joinable: true,
                readers: Vec::new(),
                ended_whole: false,
            }),
        }
    }

    /// A reader of this encoding from its first byte, or `None` once that can no longer be given
    /// (the replay passed the window, or the encoding was cut) or the encoding already feeds
    /// [`SNAPSHOT_STREAM_READERS_MAX`] readers.
    pub fn join(&self) -> Option<EncodedBody> {
        let mut state = self.state.lock();
        if !state.joinable || state.readers.len() >= SNAPSHOT_STREAM_READERS_MAX {
            return None;
        }
        let ready = state.replay.iter().cloned().collect();
        if state.ended_whole {
            return Some(EncodedBody {
                ready,
                tail: Tail::Ended,
            });
        }
        let (pieces_tx, pieces) = mpsc::channel(SNAPSHOT_STREAM_CHUNKS_IN_FLIGHT_MAX);
        state.readers.push(pieces_tx);
        Some(EncodedBody {
            ready,
            tail: Tail::Live(pieces),
        })
    }
}

/// What the encoder reports of one finished body.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BodyReport {
    pub body_bytes: usize,
    /// Readers dropped on the way because they stalled or hung up.
    pub readers_stalled: usize,
    pub readers_gone: usize,
}

/// The encoder's output end: counts bytes against the limit, cuts them into chunks and
/// publishes each to the tee's readers. A write fails once the limit is passed or no reader is
/// left to take chunks; `fault` says which, because the encoder reports only that its writer
/// failed.
pub struct TeeWriter {
    tee: std::sync::Arc<BodyTee>,
    chunk: Vec<u8>,
    written_bytes: usize,
    max_bytes: usize,
    runtime: tokio::runtime::Handle,
    stall: Duration,
    fault: Option<BodyCut>,
    report: BodyReport,
}

impl TeeWriter {
    /// Must be created inside the runtime (it keeps its handle) and written to from the blocking
    /// pool, where blocking on that handle is allowed.
    pub fn new(tee: std::sync::Arc<BodyTee>, max_bytes: usize, stall: Duration) -> Self {
        TeeWriter {
            tee,
            chunk: Vec::with_capacity(SNAPSHOT_STREAM_CHUNK_BYTES),
            written_bytes: 0,
            max_bytes,
            runtime: tokio::runtime::Handle::current(),
            stall,
            fault: None,
            report: BodyReport {
                body_bytes: 0,
                readers_stalled: 0,
                readers_gone: 0,
            },
        }
    }

    /// Sends `piece` to every reader in `readers`, waiting at most the stall limit for each, and
    /// detaches the readers that stalled or hung up.
    fn send_to(&mut self, readers: Vec<mpsc::Sender<BodyPiece>>, piece: impl Fn() -> BodyPiece) {
        let stall = self.stall;
        let outcomes = self.runtime.block_on(futures::future::join_all(
            readers
                .iter()
                .map(|reader| tokio::time::timeout(stall, reader.send(piece()))),
        ));
        let mut dropped = Vec::new();
        for (reader, outcome) in readers.into_iter().zip(outcomes) {
            match outcome {
                Ok(Ok(())) => {}
                Ok(Err(_)) => {
                    self.report.readers_gone += 1;
                    dropped.push(reader);
                }
                Err(_) => {
                    self.report.readers_stalled += 1;
                    dropped.push(reader);
                }
            }
        }
        if !dropped.is_empty() {
            // Dropping the sender is the cut: the reader never sees `End`.
            self.tee
                .state
                .lock()
                .readers
                .retain(|r| !dropped.iter().any(|d| d.same_channel(r)));
        }
    }

    fn publish_chunk(&mut self) -> std::io::Result<()> {
        let chunk = Bytes::from(std::mem::replace(
            &mut self.chunk,
            Vec::with_capacity(SNAPSHOT_STREAM_CHUNK_BYTES),
        ));
        let readers = {
            let mut state = self.tee.state.lock();
            if state.joinable {
                state.replay_bytes += chunk.len();
                if state.replay_bytes <= state.join_window_bytes {
                    state.replay.push(chunk.clone());
                } else {
                    state.joinable = false;
                    state.replay = Vec::new();
                }
            }
            state.readers.clone()
        };
        self.send_to(readers, || BodyPiece::Chunk(chunk.clone()));
        let state = self.tee.state.lock();
        if state.readers.is_empty() && !state.joinable {
            drop(state);
            self.fault = Some(if self.report.readers_stalled > 0 {
                BodyCut::Stalled {
                    stall_ms: self.stall.as_millis() as u64,
                }
            } else {
                BodyCut::Gone
            });
            return Err(std::io::Error::other("no reader is left"));
        }
        Ok(())
    }

    /// Ends the body: after `encoded` (the encoder's own result), sends what is left and the end
    /// marker, or cuts every reader's body with the reason. Returns the report, or the reason.
    /// `settle` runs once the outcome and the body's size are known and BEFORE any reader can
    /// learn the outcome: what it records (the producer's too-large verdict, the cut's count) is
    /// then in place for every request made after a client saw its body end.
    pub fn finish(
        mut self,
        encoded: Result<(), kvroute_snapshot::SnapshotEncodeError>,
        settle: impl FnOnce(&Result<(), BodyCut>, usize),
    ) -> (BodyReport, Result<(), BodyCut>) {
        let mut outcome = match (encoded, self.fault.take()) {
            // The writer's own reason comes first: the encoder only saw its writer fail.
            (_, Some(fault)) => Err(fault),
            (Err(e), None) => Err(BodyCut::Failed(e.to_string())),
            (Ok(()), None) => Ok(()),
        };
        if outcome.is_ok() && !self.chunk.is_empty() && self.publish_chunk().is_err() {
            outcome = Err(self.fault.take().unwrap_or(BodyCut::Gone));
        }
        settle(&outcome, self.written_bytes);
        let readers = {
            let mut state = self.tee.state.lock();
            match &outcome {
                Ok(()) => state.ended_whole = true,
                Err(_) => {
                    state.joinable = false;
                    state.replay = Vec::new();
                }
            }
            std::mem::take(&mut state.readers)
        };
        match &outcome {
            Ok(()) => self.send_to(readers, || BodyPiece::End),
            Err(reason) => {
                let reason = reason.clone();
                self.send_to(readers, || BodyPiece::Cut(reason.clone()));
            }
        }
        self.report.body_bytes = self.written_bytes;
        (self.report, outcome)
    }
}

impl Write for TeeWriter {
    fn write(&mut self, data: &[u8]) -> std::io::Result<usize> {
        let mut rest = data;
        while !rest.is_empty() {
            let room = SNAPSHOT_STREAM_CHUNK_BYTES - self.chunk.len();
            let (now, later) = rest.split_at(room.min(rest.len()));
            // Judged per piece, so every whole chunk under the limit leaves before the cut.
            if self.written_bytes + now.len() > self.max_bytes {
                self.fault = Some(BodyCut::TooLarge {
                    limit_bytes: self.max_bytes,
                });
                return Err(std::io::Error::other("snapshot byte limit exceeded"));
            }
            self.written_bytes += now.len();
            self.chunk.extend_from_slice(now);
            rest = later;
            if self.chunk.len() == SNAPSHOT_STREAM_CHUNK_BYTES {
                self.publish_chunk()?;
            }
        }
        Ok(data.len())
    }

    /// Chunks leave when full or at the end: the encoder's own flushes would only make small
    /// writes on the socket.
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures::StreamExt;
    use std::sync::Arc;

    /// A body whose bytes name their position (mod a prime that does not divide the chunk
    /// size), so a chunk read twice, missed or reordered shows.
    fn numbered_body(len: usize) -> Vec<u8> {
        (0..len).map(|i| (i % 251) as u8).collect()
    }

    async fn drain(body: EncodedBody) -> (Vec<u8>, Option<std::io::Error>) {
        let mut stream = std::pin::pin!(body.into_stream());
        let mut bytes = Vec::new();
        while let Some(piece) = stream.next().await {
            match piece {
                Ok(chunk) => bytes.extend_from_slice(&chunk),
                Err(e) => return (bytes, Some(e)),
            }
        }
        (bytes, None)
    }

    /// Writes `body` through a tee writer on the blocking pool, in uneven pieces.
    fn encode(
        tee: &Arc<BodyTee>,
        body: Vec<u8>,
        stall: Duration,
    ) -> tokio::task::JoinHandle<(BodyReport, Result<(), BodyCut>)> {
        let mut out = TeeWriter::new(tee.clone(), usize::MAX, stall);
        tokio::task::spawn_blocking(move || {
            let written = body
                .chunks(100_003)
                .try_for_each(|piece| out.write_all(piece));
            out.finish(
                written.map_err(kvroute_snapshot::SnapshotEncodeError::Io),
                |_, _| {},
            )
        })
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn every_joiner_within_the_window_reads_the_whole_body_exactly_once() {
        let body = numbered_body(40 * SNAPSHOT_STREAM_CHUNK_BYTES + 123);
        let mut joined_late = 0;
        for round in 0..20u64 {
            let tee = Arc::new(BodyTee::new(usize::MAX));
            let first = tee.join().expect("a new tee can be joined");
            let encoder = encode(&tee, body.clone(), Duration::from_secs(10));
            let mut readers = vec![tokio::spawn(drain(first))];
            for joiner in 0..8u64 {
                tokio::time::sleep(Duration::from_micros(50 * (round + joiner))).await;
                let late = tee.join().expect("the window is unbounded");
                joined_late += usize::from(!late.ready.is_empty());
                readers.push(tokio::spawn(drain(late)));
            }
            for (i, reader) in readers.into_iter().enumerate() {
                let (bytes, fault) = reader.await.unwrap();
                assert!(fault.is_none(), "round {round}, reader {i}: {fault:?}");
                assert!(
                    bytes == body,
                    "round {round}, reader {i}: {} of {} bytes, or out of order",
                    bytes.len(),
                    body.len()
                );
            }
            let (report, outcome) = encoder.await.unwrap();
            assert_eq!(outcome, Ok(()));
            assert_eq!(report.body_bytes, body.len());
        }
        assert!(
            joined_late > 0,
            "no joiner came after the first chunk: the replay path was not exercised"
        );
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_reader_that_stalls_is_cut_and_the_others_read_on() {
        let body = numbered_body(20 * SNAPSHOT_STREAM_CHUNK_BYTES);
        let tee = Arc::new(BodyTee::new(SNAPSHOT_STREAM_CHUNK_BYTES));
        let stalled = tee.join().unwrap();
        let reading = tokio::spawn(drain(tee.join().unwrap()));
        let encoder = encode(&tee, body.clone(), Duration::from_millis(100));
        let (bytes, fault) = reading.await.unwrap();
        assert!(
            fault.is_none() && bytes == body,
            "{fault:?}, {} bytes",
            bytes.len()
        );
        let (report, outcome) = encoder.await.unwrap();
        assert_eq!(outcome, Ok(()));
        assert_eq!(report.readers_stalled, 1);
        let (held, fault) = drain(stalled).await;
        assert_eq!(
            held.len(),
            SNAPSHOT_STREAM_CHUNKS_IN_FLIGHT_MAX * SNAPSHOT_STREAM_CHUNK_BYTES
        );
        assert!(
            fault.is_some(),
            "a dropped reader's body must end in an error"
        );
    }

    #[test]
    fn a_running_encoding_feeds_at_most_the_reader_limit() {
        let tee = BodyTee::new(usize::MAX);
        let readers: Vec<EncodedBody> = (0..SNAPSHOT_STREAM_READERS_MAX)
            .map(|i| tee.join().unwrap_or_else(|| panic!("reader {i} refused")))
            .collect();
        assert!(tee.join().is_none(), "one reader past the limit joined");
        drop(readers);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn past_the_window_or_after_a_cut_nobody_can_join() {
        let tee = Arc::new(BodyTee::new(SNAPSHOT_STREAM_CHUNK_BYTES));
        let reader = tokio::spawn(drain(tee.join().unwrap()));
        let encoder = encode(
            &tee,
            numbered_body(3 * SNAPSHOT_STREAM_CHUNK_BYTES),
            Duration::from_secs(10),
        );
        assert_eq!(encoder.await.unwrap().1, Ok(()));
        assert!(reader.await.unwrap().1.is_none());
        assert!(tee.join().is_none(), "the replay passed the window");

        let tee = Arc::new(BodyTee::new(usize::MAX));
        let reader = tee.join().unwrap();
        let out = TeeWriter::new(tee.clone(), usize::MAX, Duration::from_secs(10));
        let cut = tokio::task::spawn_blocking(move || {
            out.finish(
                Err(kvroute_snapshot::SnapshotEncodeError::Io(
                    std::io::Error::other("disk on fire"),
                )),
                |_, _| {},
            )
        });
        assert!(matches!(cut.await.unwrap().1, Err(BodyCut::Failed(_))));
        assert!(tee.join().is_none(), "a cut encoding cannot be joined");
        let (_, fault) = drain(reader).await;
        assert!(fault.is_some_and(|e| e.to_string().contains("disk on fire")));
    }
}
