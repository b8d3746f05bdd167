//! The producer side of peer bootstrap: exports a model's index as a snapshot, caches it, and
//! encodes it once per wire variant.
//!
//! Consistency is the index's job: [`kvroute_index::IndexReader::export_snapshot`] reads every
//! rank's cursor BEFORE walking the shards and claims that pre-walk cursor as the rank's
//! watermark, even when the rank's stream moved on during the walk: its nodes hold every effect
//! up to the watermark plus part of the later ones, and a consumer that applies every batch above
//! the watermark in order converges (the proof is in `kvroute_index::snapshot`'s doc). A rank
//! whose stream restarted during the walk gets no cursor. This module adds what
//! only the service knows: `producer_ready` (the model has at least one rank with a cursor AND
//! this replica is ready), and how often the (costly) walk runs.
//!
//! Freshness and cost are shaped by three rules:
//! * An export is stamped with the instant taken BEFORE sampling starts, so its age is never
//!   understated. A request may reuse an export only if `arrival - stamp <= max_age_ms`, with the
//!   age measured from the request's arrival (waiting in a queue does not make data older in the
//!   client's eyes, but a request never receives data sampled before `arrival - max_age`).
//! * Single flight: concurrent requests that accept the same in-flight build join it instead of
//!   starting their own. The build (and each encoding) runs in a detached task on the blocking
//!   pool, so a client that gives up still leaves a finished export cached for the next one.
//! * At most [`SNAPSHOT_CONCURRENT_EXPORTS_MAX`] walks or encodes run at once; a request that
//!   would start one more is told to retry ([`ProduceError::Busy`] -> 503 + Retry-After).
//!
//! An export's encoded bytes are cached per (format, compression) as `Bytes`, so the HTTP layer
//! streams slices of one buffer and encoding happens once per export per variant. Encoding writes
//! through a byte-limited writer, so an export over `kv_snapshot_max_bytes` is refused as soon
//! as the limit is passed, without buffering the rest.

use std::collections::{HashMap, HashSet};
use std::io::Write;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use futures::FutureExt;
use futures::future::{BoxFuture, Shared};
use kvroute_index::IndexReader;
use kvroute_snapshot::{Compression, EncodeOptions};
use kvroute_wire::snapshot::{IndexSnapshot, RankCursor, RankRef, SNAPSHOT_FORMAT};
use parking_lot::Mutex;
use prometheus::{Histogram, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, Opts};
use tokio::sync::Semaphore;

/// Default `max_age_ms` of `GET /internal/kv_snapshot`: a cached export younger than this is
/// served again instead of walking the index.
pub const PRODUCER_CACHE_TTL_MS: u64 = 2_000;
/// Largest `max_age_ms` honoured; larger (absurd) values saturate to it.
pub const PRODUCER_MAX_AGE_MS_MAX: u64 = 24 * 60 * 60 * 1000;
/// Walks plus encodes allowed to run at once on the blocking pool.
pub const SNAPSHOT_CONCURRENT_EXPORTS_MAX: usize = 2;
/// `Retry-After` sent with a 503 when every export slot is busy.
pub const SNAPSHOT_BUSY_RETRY_AFTER_S: u64 = 1;

/// Wire format of an encoded export.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum SnapshotFormat {
    Json,
    Binary,
}

impl SnapshotFormat {
    pub fn label(self) -> &'static str {
        match self {
            SnapshotFormat::Json => "json",
            SnapshotFormat::Binary => "binary",
        }
    }
}

/// Why no snapshot bytes could be produced.
#[derive(Debug, Clone, thiserror::Error)]
pub enum ProduceError {
    #[error("every export slot is busy ({SNAPSHOT_CONCURRENT_EXPORTS_MAX} running); retry")]
    Busy,
    #[error("the encoded snapshot passes the limit of {limit_bytes} bytes")]
    TooLarge { limit_bytes: usize },
    #[error("encoding the snapshot failed: {0}")]
    Encode(String),
    #[error("the export task failed: {0}")]
    Task(String),
}

/// Metrics of the producer, registered on the router's registry.
#[derive(Clone)]
pub struct SnapshotMetrics {
    pub builds: IntCounter,
    pub cache_hits: IntCounter,
    pub bytes_served: IntCounterVec,
    pub export_seconds: HistogramVec,
    pub refused: IntCounterVec,
    pub encoded_bytes: Histogram,
}

impl SnapshotMetrics {
    pub fn new(registry: &prometheus::Registry) -> Result<Self, prometheus::Error> {
        let builds = IntCounter::new(
            "kvroute_snapshot_builds_total",
            "Index exports (shard walks) run for /internal/kv_snapshot",
        )?;
        let cache_hits = IntCounter::new(
            "kvroute_snapshot_cache_hits_total",
            "Snapshot requests served from an export that was cached or already being built",
        )?;
        let bytes_served = IntCounterVec::new(
            Opts::new(
                "kvroute_snapshot_bytes_served_total",
                "Snapshot body bytes sent, by format and compression",
            ),
            &["format", "compression"],
        )?;
        let export_seconds = HistogramVec::new(
            HistogramOpts::new(
                "kvroute_snapshot_export_duration_seconds",
                "Time to walk the index (stage=walk) or encode one variant (stage=encode)",
            )
            .buckets(vec![
                0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
            ]),
            &["stage"],
        )?;
        let refused = IntCounterVec::new(
            Opts::new(
                "kvroute_snapshot_refused_total",
                "Snapshot requests refused, by reason",
            ),
            &["reason"],
        )?;
        let encoded_bytes = Histogram::with_opts(
            HistogramOpts::new(
                "kvroute_snapshot_encoded_bytes",
                "Size of each encoded snapshot variant",
            )
            .buckets(prometheus::exponential_buckets(1024.0, 4.0, 12)?),
        )?;
        registry.register(Box::new(builds.clone()))?;
        registry.register(Box::new(cache_hits.clone()))?;
        registry.register(Box::new(bytes_served.clone()))?;
        registry.register(Box::new(export_seconds.clone()))?;
        registry.register(Box::new(refused.clone()))?;
        registry.register(Box::new(encoded_bytes.clone()))?;
        Ok(SnapshotMetrics {
            builds,
            cache_hits,
            bytes_served,
            export_seconds,
            refused,
            encoded_bytes,
        })
    }
}

type VariantKey = (SnapshotFormat, Compression);
type VariantCell = Arc<tokio::sync::OnceCell<Result<Bytes, ProduceError>>>;

/// One export of one model's index, with its encodings as they are requested.
pub struct Export {
    /// Taken before sampling started; the export's age is measured from here.
    pub stamp: Instant,
    pub snapshot: IndexSnapshot,
    variants: Mutex<HashMap<VariantKey, VariantCell>>,
}

impl Export {
    fn new(stamp: Instant, snapshot: IndexSnapshot) -> Self {
        Export {
            stamp,
            snapshot,
            variants: Mutex::new(HashMap::new()),
        }
    }

    /// Age as seen by a request that arrived at `arrival` (zero if sampled after it).
    pub fn age_at(&self, arrival: Instant) -> Duration {
        arrival.saturating_duration_since(self.stamp)
    }
}

/// Encodes `snapshot` as `format`/`compression`, refusing once more than `max_bytes` come out.
/// The binary format compresses inside its envelope (so its HMAC is checked before any
/// decompression); JSON is compressed as a whole, for `Content-Encoding`.
pub fn encode_variant(
    snapshot: &IndexSnapshot,
    format: SnapshotFormat,
    compression: Compression,
    mac_key: Option<&[u8]>,
    max_bytes: usize,
) -> Result<Bytes, ProduceError> {
    let mut out = LimitedWriter {
        buf: Vec::new(),
        max_bytes,
        exceeded: false,
    };
    let result = match format {
        SnapshotFormat::Binary => kvroute_snapshot::encode_binary(
            snapshot,
            &EncodeOptions {
                compression,
                mac_key,
            },
            &mut out,
        )
        .map(|_| ()),
        SnapshotFormat::Json => (|| {
            let mut w = kvroute_snapshot::CompressingWriter::new(
                std::io::BufWriter::with_capacity(
                    kvroute_snapshot::binary::BODY_CHUNK_BYTES,
                    &mut out,
                ),
                compression,
            )?;
            kvroute_snapshot::encode_json(snapshot, &mut w)?;
            w.finish()?.flush()?;
            Ok::<_, kvroute_snapshot::SnapshotEncodeError>(())
        })(),
    };
    if out.exceeded {
        return Err(ProduceError::TooLarge {
            limit_bytes: max_bytes,
        });
    }
    result.map_err(|e| ProduceError::Encode(e.to_string()))?;
    Ok(Bytes::from(out.buf))
}

struct LimitedWriter {
    buf: Vec<u8>,
    max_bytes: usize,
    exceeded: bool,
}

impl Write for LimitedWriter {
    fn write(&mut self, data: &[u8]) -> std::io::Result<usize> {
        if self.buf.len().saturating_add(data.len()) > self.max_bytes {
            self.exceeded = true;
            return Err(std::io::Error::other("snapshot byte limit exceeded"));
        }
        self.buf.extend_from_slice(data);
        Ok(data.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

type BuildFuture = Shared<BoxFuture<'static, Result<Arc<Export>, ProduceError>>>;

#[derive(Default)]
struct ModelSlot {
    /// Newest finished export.
    current: Option<Arc<Export>>,
    /// The build in flight, with its stamp (taken when it was started, before sampling).
    building: Option<(Instant, BuildFuture)>,
}

/// What the request asked for beyond the model.
#[derive(Debug, Clone, Copy)]
pub struct ExportRequest {
    pub arrival: Instant,
    pub max_age: Duration,
}

/// How the export that answered a request was obtained (for tests and logs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExportSource {
    Cached,
    JoinedBuild,
    Built,
}

/// Applies what this replica knows of each rank's history to an export, judged on both sides of
/// the walk (a rank whose history broke during it counts as broken), through one rule: a rank
/// is whole when this replica held its entire stream since the publisher's seq 0 both before
/// and after the walk.
/// * `empty_ranks` (the index's "ranks carrying nothing") keeps only whole ranks. A rank this
///   replica joined mid-stream, or lost batches of, may carry nothing here while its engine
///   holds blocks; naming it empty would let a booting sibling settle `empty` on a blind
///   replica's word.
/// * `partial_ranks` lists every rank with a cursor that is not whole: it joined the stream
///   mid-way, lost a batch, inherited a sibling's partial view, or is still proving a graft. A
///   consumer grafts such a rank as `warm_partial` and keeps looking for a sibling with the
///   whole history first; without the mark, a replica that was itself blind to a rank's past
///   would hand that blindness on as `warm`.
fn judge_histories(
    snapshot: &mut IndexSnapshot,
    complete_before: &HashSet<RankRef>,
    complete_after: &HashSet<RankRef>,
) {
    let whole: Vec<bool> = snapshot
        .ranks
        .iter()
        .map(|rank| complete_before.contains(rank) && complete_after.contains(rank))
        .collect();
    let is_whole = |r: u32| whole.get(r as usize).copied();
    snapshot.empty_ranks.retain(|&r| is_whole(r) == Some(true));
    snapshot.partial_ranks = snapshot
        .cursors
        .iter()
        .map(|c| c.rank)
        .filter(|&r| is_whole(r) == Some(false))
        .collect();
    snapshot.partial_ranks.sort_unstable();
}

/// The cached, single-flight snapshot producer of one router.
pub struct SnapshotProducer {
    slots: Mutex<HashMap<String, ModelSlot>>,
    permits: Arc<Semaphore>,
    pub metrics: SnapshotMetrics,
    mac_key: Option<Arc<[u8]>>,
    max_bytes: usize,
}

impl SnapshotProducer {
    pub fn new(metrics: SnapshotMetrics, mac_key: Option<Arc<[u8]>>, max_bytes: usize) -> Self {
        SnapshotProducer {
            slots: Mutex::new(HashMap::new()),
            permits: Arc::new(Semaphore::new(SNAPSHOT_CONCURRENT_EXPORTS_MAX)),
            metrics,
            mac_key,
            max_bytes,
        }
    }

    pub fn max_bytes(&self) -> usize {
        self.max_bytes
    }

    /// An export of `model` young enough for `req`: the cached one, the one being built, or a
    /// new one. `replica_ready` is evaluated only if a new build starts; `complete_ranks` (the
    /// ranks whose whole history the index holds) is asked before and after the walk.
    pub async fn export(
        self: &Arc<Self>,
        model: &str,
        reader: &IndexReader,
        req: ExportRequest,
        replica_ready: impl FnOnce() -> bool,
        complete_ranks: impl Fn() -> HashSet<RankRef> + Send + 'static,
    ) -> Result<(Arc<Export>, ExportSource), ProduceError> {
        let (future, source) = {
            let mut slots = self.slots.lock();
            let slot = slots.entry(model.to_string()).or_default();
            if let Some(current) = &slot.current
                && current.age_at(req.arrival) <= req.max_age
            {
                self.metrics.cache_hits.inc();
                return Ok((current.clone(), ExportSource::Cached));
            }
            match &slot.building {
                Some((stamp, fut))
                    if req.arrival.saturating_duration_since(*stamp) <= req.max_age =>
                {
                    self.metrics.cache_hits.inc();
                    (fut.clone(), ExportSource::JoinedBuild)
                }
                _ => {
                    let permit = self
                        .permits
                        .clone()
                        .try_acquire_owned()
                        .map_err(|_| ProduceError::Busy)?;
                    let stamp = Instant::now();
                    let fut = self.start_build(
                        model,
                        reader.clone(),
                        stamp,
                        permit,
                        replica_ready(),
                        complete_ranks,
                    );
                    slot.building = Some((stamp, fut.clone()));
                    (fut, ExportSource::Built)
                }
            }
        };
        let export = future.await?;
        Ok((export, source))
    }

    fn start_build(
        self: &Arc<Self>,
        model: &str,
        reader: IndexReader,
        stamp: Instant,
        permit: tokio::sync::OwnedSemaphorePermit,
        replica_ready: bool,
        complete_ranks: impl Fn() -> HashSet<RankRef> + Send + 'static,
    ) -> BuildFuture {
        self.metrics.builds.inc();
        let walk_seconds = self.metrics.export_seconds.with_label_values(&["walk"]);
        let model_name = model.to_string();
        let me = self.clone();
        let task = tokio::spawn(async move {
            let result = tokio::task::spawn_blocking(move || {
                let _permit = permit;
                let started = Instant::now();
                // Judged before the walk, like the cursors the export reads first.
                let has_cursor = index_has_cursor(&reader);
                let complete_before = complete_ranks();
                let (mut snapshot, report) = reader.export_snapshot_with_report();
                snapshot.producer_ready = replica_ready && has_cursor;
                let carrying_nothing = snapshot.empty_ranks.len();
                let complete_after = complete_ranks();
                judge_histories(&mut snapshot, &complete_before, &complete_after);
                walk_seconds.observe(started.elapsed().as_secs_f64());
                tracing::debug!(
                    model = %model_name,
                    nodes = snapshot.nodes.len(),
                    carried = snapshot.nodes.carried_blocks(),
                    cursors_advanced = report.cursors_advanced,
                    cursors_withheld = report.cursors_withheld,
                    empty_ranks = snapshot.empty_ranks.len(),
                    empty_unproven = carrying_nothing - snapshot.empty_ranks.len(),
                    partial_ranks = snapshot.partial_ranks.len(),
                    walk_ms = started.elapsed().as_millis() as u64,
                    "index exported"
                );
                (model_name, Arc::new(Export::new(stamp, snapshot)))
            })
            .await;
            let (model_name, export) = result.map_err(|e| ProduceError::Task(e.to_string()))?;
            me.install(&model_name, &export);
            Ok(export)
        });
        // The spawned task owns the work and installs its result; the shared future only
        // observes it, so a build every requester abandoned still lands in the cache.
        async move {
            task.await
                .map_err(|e| ProduceError::Task(e.to_string()))
                .and_then(|r| r)
        }
        .boxed()
        .shared()
    }

    /// Makes `export` the model's current one unless a newer one is there already, and clears
    /// the in-flight marker if it was this build.
    fn install(&self, model: &str, export: &Arc<Export>) {
        let mut slots = self.slots.lock();
        let slot = slots.entry(model.to_string()).or_default();
        if slot
            .current
            .as_ref()
            .is_none_or(|c| c.stamp <= export.stamp)
        {
            slot.current = Some(export.clone());
        }
        if slot
            .building
            .as_ref()
            .is_some_and(|(stamp, _)| *stamp <= export.stamp)
        {
            slot.building = None;
        }
    }

    /// The encoded bytes of `export` as `format`/`compression`, encoding them (once) if needed.
    /// Like builds, the encode runs in a detached task so it completes for the next requester.
    pub async fn encoded(
        &self,
        export: &Arc<Export>,
        format: SnapshotFormat,
        compression: Compression,
    ) -> Result<Bytes, ProduceError> {
        let cell = export
            .variants
            .lock()
            .entry((format, compression))
            .or_default()
            .clone();
        if let Some(done) = cell.get() {
            return done.clone();
        }
        let export = export.clone();
        let permits = self.permits.clone();
        let mac_key = self.mac_key.clone();
        let max_bytes = self.max_bytes;
        let encode_seconds = self.metrics.export_seconds.with_label_values(&["encode"]);
        let encoded_bytes = self.metrics.encoded_bytes.clone();
        let task = tokio::spawn(async move {
            cell.get_or_try_init(|| async move {
                // Busy is the one outcome not cached: it says nothing about the export.
                let permit = permits
                    .try_acquire_owned()
                    .map_err(|_| ProduceError::Busy)?;
                let encoded = tokio::task::spawn_blocking(move || {
                    let _permit = permit;
                    let started = Instant::now();
                    let out = encode_variant(
                        &export.snapshot,
                        format,
                        compression,
                        if format == SnapshotFormat::Binary {
                            mac_key.as_deref()
                        } else {
                            None
                        },
                        max_bytes,
                    );
                    encode_seconds.observe(started.elapsed().as_secs_f64());
                    if let Ok(b) = &out {
                        encoded_bytes.observe(b.len() as f64);
                    }
                    out
                })
                .await
                .map_err(|e| ProduceError::Task(e.to_string()))?;
                Ok::<_, ProduceError>(encoded)
            })
            .await
            .cloned()
        });
        task.await
            .map_err(|e| ProduceError::Task(e.to_string()))?
            .and_then(|r| r)
    }
}

/// `GET /internal/kv_cursors`: the rank table and cursors, nothing else.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct CursorTable {
    pub format: u32,
    pub hash_scheme: String,
    pub block_size: u32,
    pub ranks: Vec<RankRef>,
    /// `rank` is a position in `ranks`; ranks without a cursor are absent.
    pub cursors: Vec<RankCursor>,
}

/// Reads the cursor table straight from the index (cheap: one read lock on the rank table per
/// rank, no shard walk).
pub fn cursor_table(reader: &IndexReader) -> CursorTable {
    let mut ranks = Vec::new();
    let mut cursors = Vec::new();
    for (pos, (id, rank_ref)) in reader.ranks().into_iter().enumerate() {
        if let Some(c) = reader.rank_stats(id).and_then(|s| s.cursor) {
            cursors.push(RankCursor {
                rank: pos as u32,
                seq: c.seq,
                ts: c.ts,
            });
        }
        ranks.push(rank_ref);
    }
    CursorTable {
        format: SNAPSHOT_FORMAT,
        hash_scheme: kvroute_index::hash::HASH_SCHEME.to_string(),
        block_size: reader.config().block_size,
        ranks,
        cursors,
    }
}

/// True when at least one rank of the index has a cursor (the index has seen events).
pub fn index_has_cursor(reader: &IndexReader) -> bool {
    reader
        .ranks()
        .into_iter()
        .any(|(id, _)| reader.rank_stats(id).is_some_and(|s| s.cursor.is_some()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvroute_index::{IndexConfig, PrefixIndex};
    use kvroute_wire::snapshot::RankRef;

    fn producer() -> Arc<SnapshotProducer> {
        let metrics = SnapshotMetrics::new(&prometheus::Registry::new()).unwrap();
        Arc::new(SnapshotProducer::new(metrics, None, 1 << 20))
    }

    fn rank(n: u16) -> RankRef {
        RankRef {
            worker_url: format!("http://127.0.0.1:{n}"),
            dp_rank: 0,
        }
    }

    /// Every rank of [`reader`]'s index has its whole history.
    fn all_complete() -> HashSet<RankRef> {
        HashSet::from([rank(1)])
    }

    /// Exports an index of ranks 1-3, each with a cursor, and 4, without one, where `complete`
    /// are the ranks whose whole history this replica holds.
    async fn export_with_whole_histories(complete: &[u16]) -> Arc<Export> {
        let (mut w, r) = PrefixIndex::new(IndexConfig::new(4));
        for n in [1, 2, 3] {
            let id = w.add_rank(rank(n));
            w.set_cursor(id, Some((3, 1.5)));
        }
        w.add_rank(rank(4));
        let complete: HashSet<RankRef> = complete.iter().map(|&n| rank(n)).collect();
        let (export, _) = producer()
            .export("m", &r, request(0), || true, move || complete.clone())
            .await
            .unwrap();
        export
    }

    fn named<'a>(s: &'a IndexSnapshot, list: &[u32]) -> Vec<&'a RankRef> {
        list.iter().map(|&i| &s.ranks[i as usize]).collect()
    }

    #[tokio::test]
    async fn only_ranks_with_a_complete_history_are_named_empty() {
        let export = export_with_whole_histories(&[1, 3]).await;
        let s = &export.snapshot;
        assert_eq!(
            named(s, &s.empty_ranks),
            vec![&rank(1), &rank(3)],
            "rank 2 joined mid-stream; rank 4's history is unknown"
        );
    }

    #[tokio::test]
    async fn ranks_with_a_cursor_but_no_whole_history_are_listed_partial() {
        let export = export_with_whole_histories(&[1]).await;
        let s = &export.snapshot;
        // Rank 4 has no cursor: nothing to graft, so nothing to call partial.
        assert_eq!(named(s, &s.partial_ranks), vec![&rank(2), &rank(3)]);
    }

    /// Judged on both sides of the walk: a rank whose history broke during it (rank 2) is
    /// neither named empty nor left out of `partial_ranks`.
    #[test]
    fn a_rank_whose_history_broke_during_the_walk_is_neither_empty_nor_whole() {
        let cursor = |rank: u32, seq: i64| RankCursor { rank, seq, ts: 1.0 };
        let mut s = IndexSnapshot {
            format: SNAPSHOT_FORMAT,
            hash_scheme: String::new(),
            block_size: 4,
            producer_ready: true,
            ranks: vec![rank(1), rank(2)],
            cursors: vec![cursor(0, 4), cursor(1, 9)],
            empty_ranks: vec![0, 1, 7],
            partial_ranks: vec![],
            nodes: Default::default(),
        };
        let before = HashSet::from([rank(1), rank(2)]);
        let after = HashSet::from([rank(1)]);
        judge_histories(&mut s, &before, &after);
        assert_eq!(
            s.empty_ranks,
            vec![0],
            "rank 2 broke; index 7 names no rank"
        );
        assert_eq!(s.partial_ranks, vec![1], "rank 2 broke during the walk");
        judge_histories(&mut s, &before, &before);
        assert!(s.partial_ranks.is_empty(), "whole on both sides");
    }

    fn reader() -> IndexReader {
        let (mut w, r) = PrefixIndex::new(IndexConfig::new(4));
        let id = w.add_rank(RankRef {
            worker_url: "http://127.0.0.1:1".into(),
            dp_rank: 0,
        });
        w.set_cursor(id, Some((3, 1.5)));
        r
    }

    fn request(max_age_ms: u64) -> ExportRequest {
        ExportRequest {
            arrival: Instant::now(),
            max_age: Duration::from_millis(max_age_ms),
        }
    }

    #[tokio::test]
    async fn a_new_build_is_refused_as_busy_when_every_slot_is_taken() {
        let p = producer();
        let held = p
            .permits
            .clone()
            .try_acquire_many_owned(SNAPSHOT_CONCURRENT_EXPORTS_MAX as u32)
            .unwrap();
        let r = p
            .export("m", &reader(), request(0), || true, all_complete)
            .await;
        assert!(matches!(r, Err(ProduceError::Busy)), "{:?}", r.err());
        drop(held);
        let (export, source) = p
            .export("m", &reader(), request(0), || true, all_complete)
            .await
            .unwrap();
        assert_eq!(source, ExportSource::Built);
        assert!(export.snapshot.producer_ready);
        assert_eq!(p.metrics.builds.get(), 1);
    }

    #[tokio::test]
    async fn a_build_its_requester_abandoned_still_lands_in_the_cache() {
        let p = producer();
        // Poll once (starts the detached build), then drop the request.
        assert!(
            p.export("m", &reader(), request(0), || true, all_complete)
                .now_or_never()
                .is_none_or(|r| r.is_ok())
        );
        let deadline = Instant::now() + Duration::from_secs(5);
        while p.slots.lock().get("m").is_none_or(|s| s.current.is_none()) {
            assert!(
                Instant::now() < deadline,
                "the abandoned build never reached the cache"
            );
            tokio::task::yield_now().await;
        }
        let (_, source) = p
            .export("m", &reader(), request(60_000), || true, all_complete)
            .await
            .unwrap();
        assert_eq!(source, ExportSource::Cached);
        assert_eq!(p.metrics.builds.get(), 1);
    }

    #[tokio::test]
    async fn each_variant_is_encoded_once_per_export() {
        let p = producer();
        let (export, _) = p
            .export("m", &reader(), request(0), || false, all_complete)
            .await
            .unwrap();
        assert!(!export.snapshot.producer_ready, "replica not ready");
        let a = p
            .encoded(&export, SnapshotFormat::Binary, Compression::Zstd)
            .await
            .unwrap();
        let b = p
            .encoded(&export, SnapshotFormat::Binary, Compression::Zstd)
            .await
            .unwrap();
        assert_eq!(a.as_ptr(), b.as_ptr(), "second request re-encoded");
        assert_eq!(
            p.metrics
                .export_seconds
                .with_label_values(&["encode"])
                .get_sample_count(),
            1
        );
    }

    #[test]
    fn an_encoding_past_the_byte_limit_is_too_large() {
        let snap = reader().export_snapshot();
        let r = encode_variant(&snap, SnapshotFormat::Json, Compression::None, None, 16);
        assert!(matches!(r, Err(ProduceError::TooLarge { limit_bytes: 16 })));
        assert!(
            encode_variant(
                &snap,
                SnapshotFormat::Json,
                Compression::None,
                None,
                1 << 20
            )
            .is_ok()
        );
    }
}
