//! The producer side of peer bootstrap: exports a model's index as a snapshot, caches the
//! export, and streams an encoding of it to each requester.
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
//!   starting their own. The build runs in a detached task on the blocking pool, so a client
//!   that gives up still leaves a finished export cached for the next one.
//! * At most [`SNAPSHOT_CONCURRENT_EXPORTS_MAX`] walks or encodes run at once; a request that
//!   would start one more is told to retry ([`ProduceError::Busy`] -> 503 + Retry-After).
//!
//! An export is encoded straight onto the socket, never into a buffer held whole, and one
//! encoding serves every requester of the same variant that comes while it can still be
//! joined from its first byte ([`crate::peer::body_tee`] has the rules). The status code waits
//! for the first chunk: a refusal found before it (an export over `kv_snapshot_max_bytes`; every
//! small body is found whole before it) is still a 507. One found later can only cut the body,
//! and the export remembers the verdict, so the next request for it gets the 507 at once.

use std::collections::{HashMap, HashSet};
use std::io::Write;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use futures::FutureExt;
use futures::future::{BoxFuture, Shared};
use kvroute_index::IndexReader;
use kvroute_snapshot::{Compression, EncodeOptions};
use kvroute_wire::snapshot::{IndexSnapshot, RankCursor, RankRef, SNAPSHOT_FORMAT, SnapshotNodes};
use parking_lot::Mutex;
use prometheus::{Histogram, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, Opts};
use tokio::sync::Semaphore;

use crate::peer::body_tee::{BodyCut, BodyTee, EncodedBody, TeeWriter};
pub use crate::peer::body_tee::{
    SNAPSHOT_STREAM_CHUNK_BYTES, SNAPSHOT_STREAM_CHUNKS_IN_FLIGHT_MAX,
    SNAPSHOT_STREAM_JOIN_WINDOW_BYTES, SNAPSHOT_STREAM_STALL_MS_MAX,
};
use crate::peer::prefault::{self, Room};

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

impl From<BodyCut> for ProduceError {
    fn from(cut: BodyCut) -> Self {
        match cut {
            BodyCut::TooLarge { limit_bytes } => ProduceError::TooLarge { limit_bytes },
            BodyCut::Failed(reason) => ProduceError::Encode(reason),
            BodyCut::Stalled { .. } | BodyCut::Gone => ProduceError::Task(cut.to_string()),
        }
    }
}

/// Metrics of the producer, registered on the router's registry.
#[derive(Clone)]
pub struct SnapshotMetrics {
    pub builds: IntCounter,
    pub cache_hits: IntCounter,
    pub bytes_served: IntCounterVec,
    pub export_seconds: HistogramVec,
    pub refused: IntCounterVec,
    pub streams_cut: IntCounterVec,
    pub encodings_joined: IntCounter,
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
                "Time to walk the index (stage=walk), or to encode one body onto the socket, waiting on the client included (stage=encode)",
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
        let streams_cut = IntCounterVec::new(
            Opts::new(
                "kvroute_snapshot_streams_cut_total",
                "Snapshot bodies cut after their first chunk (encodings cut by the limit or an error; readers dropped because they stalled or hung up), by reason",
            ),
            &["reason"],
        )?;
        let encodings_joined = IntCounter::new(
            "kvroute_snapshot_encodings_joined_total",
            "Snapshot requests served by joining an encoding already running (or kept whole)",
        )?;
        let encoded_bytes = Histogram::with_opts(
            HistogramOpts::new(
                "kvroute_snapshot_encoded_bytes",
                "Size of each snapshot body encoded whole",
            )
            .buckets(prometheus::exponential_buckets(1024.0, 4.0, 12)?),
        )?;
        registry.register(Box::new(builds.clone()))?;
        registry.register(Box::new(cache_hits.clone()))?;
        registry.register(Box::new(bytes_served.clone()))?;
        registry.register(Box::new(export_seconds.clone()))?;
        registry.register(Box::new(refused.clone()))?;
        registry.register(Box::new(streams_cut.clone()))?;
        registry.register(Box::new(encodings_joined.clone()))?;
        registry.register(Box::new(encoded_bytes.clone()))?;
        Ok(SnapshotMetrics {
            builds,
            cache_hits,
            bytes_served,
            export_seconds,
            refused,
            streams_cut,
            encodings_joined,
            encoded_bytes,
        })
    }
}

type VariantKey = (SnapshotFormat, Compression);

/// One export of one model's index, with its encodings as they are requested.
pub struct Export {
    /// Taken before sampling started; the export's age is measured from here.
    pub stamp: Instant,
    pub snapshot: IndexSnapshot,
    /// What each requested variant is at: an encoding, or the verdict that it is too large.
    variants: Mutex<HashMap<VariantKey, Variant>>,
}

/// One wire variant of an export.
enum Variant {
    /// The newest encoding, joined while it can still give a body from its first byte.
    Encoding(Arc<BodyTee>),
    /// An encoding passed `kv_snapshot_max_bytes`: refused at once from then on (encoding is
    /// deterministic, so every later one would pass it too).
    TooLarge,
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

/// Writes `snapshot` as `format`/`compression` into `out`. The binary format compresses inside
/// its envelope (so its HMAC, made with `mac_key`, is checked before any decompression); JSON
/// is compressed as a whole, for `Content-Encoding`, and never signed.
pub fn encode_variant_into<W: Write>(
    snapshot: &IndexSnapshot,
    format: SnapshotFormat,
    compression: Compression,
    mac_key: Option<&[u8]>,
    out: &mut W,
) -> Result<(), kvroute_snapshot::SnapshotEncodeError> {
    match format {
        SnapshotFormat::Binary => kvroute_snapshot::encode_binary(
            snapshot,
            &EncodeOptions {
                compression,
                mac_key,
            },
            out,
        )
        .map(|_| ()),
        SnapshotFormat::Json => {
            let mut w = kvroute_snapshot::CompressingWriter::new(
                std::io::BufWriter::with_capacity(kvroute_snapshot::binary::BODY_CHUNK_BYTES, out),
                compression,
            )?;
            kvroute_snapshot::encode_json(snapshot, &mut w)?;
            w.finish()?.flush()?;
            Ok(())
        }
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
    /// [`SNAPSHOT_STREAM_STALL_MS_MAX`] and [`SNAPSHOT_STREAM_JOIN_WINDOW_BYTES`], smaller in
    /// this module's tests.
    stream_stall: Duration,
    stream_join_window_bytes: usize,
}

impl SnapshotProducer {
    pub fn new(metrics: SnapshotMetrics, mac_key: Option<Arc<[u8]>>, max_bytes: usize) -> Self {
        SnapshotProducer {
            slots: Mutex::new(HashMap::new()),
            permits: Arc::new(Semaphore::new(SNAPSHOT_CONCURRENT_EXPORTS_MAX)),
            metrics,
            mac_key,
            max_bytes,
            stream_stall: Duration::from_millis(SNAPSHOT_STREAM_STALL_MS_MAX),
            stream_join_window_bytes: SNAPSHOT_STREAM_JOIN_WINDOW_BYTES,
        }
    }

    pub fn max_bytes(&self) -> usize {
        self.max_bytes
    }

    /// One of the [`SNAPSHOT_CONCURRENT_EXPORTS_MAX`] slots a walk or an encoding holds while
    /// it runs, or `Busy`: a request never waits for one.
    fn take_slot(&self) -> Result<tokio::sync::OwnedSemaphorePermit, ProduceError> {
        self.permits
            .clone()
            .try_acquire_owned()
            .map_err(|_| ProduceError::Busy)
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
                    let permit = self.take_slot()?;
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
                let (mut snapshot, report, prefault) = export_prefaulted(&reader);
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
                    prefaulted_bytes = prefault.bytes_populated,
                    prefault_refused = prefault.calls_refused,
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

    /// A body of `export` as `format`/`compression`, returned once its first chunk is out (or
    /// the encode was refused before it): a reader of the running encoding of that variant if it
    /// can still be joined, else a new encoding, which holds an export slot until it ends.
    pub async fn stream_encoded(
        &self,
        export: &Arc<Export>,
        format: SnapshotFormat,
        compression: Compression,
    ) -> Result<EncodedBody, ProduceError> {
        let variant = (format, compression);
        let mut body = {
            let mut variants = export.variants.lock();
            let joined = match variants.get(&variant) {
                Some(Variant::TooLarge) => {
                    return Err(ProduceError::TooLarge {
                        limit_bytes: self.max_bytes,
                    });
                }
                Some(Variant::Encoding(tee)) => tee.join(),
                None => None,
            };
            match joined {
                Some(body) => {
                    self.metrics.encodings_joined.inc();
                    body
                }
                None => {
                    let permit = self.take_slot()?;
                    let tee = Arc::new(BodyTee::new(self.stream_join_window_bytes));
                    let body = tee.join().expect("a new encoding can be joined");
                    variants.insert(variant, Variant::Encoding(tee.clone()));
                    self.start_encoding(export.clone(), variant, tee, permit);
                    body
                }
            }
        };
        body.first_chunk().await?;
        Ok(body)
    }

    fn start_encoding(
        &self,
        export: Arc<Export>,
        (format, compression): VariantKey,
        tee: Arc<BodyTee>,
        permit: tokio::sync::OwnedSemaphorePermit,
    ) {
        let mut out = TeeWriter::new(tee, self.max_bytes, self.stream_stall);
        let mac_key = self.mac_key.clone();
        let metrics = self.metrics.clone();
        tokio::task::spawn_blocking(move || {
            let _permit = permit;
            let started = Instant::now();
            let encoded = encode_variant_into(
                &export.snapshot,
                format,
                compression,
                mac_key.as_deref(),
                &mut out,
            );
            let (report, outcome) = out.finish(encoded, |outcome, body_bytes| {
                // Before any reader sees its body cut: a client that asks again after its cut
                // must get the 507, and find the cut counted.
                let Err(reason) = outcome else {
                    return;
                };
                if let BodyCut::TooLarge { .. } = reason {
                    export
                        .variants
                        .lock()
                        .insert((format, compression), Variant::TooLarge);
                }
                // Readers that stalled or hung up are counted one by one below.
                let whole_encoding_cut =
                    matches!(reason, BodyCut::TooLarge { .. } | BodyCut::Failed(_));
                if whole_encoding_cut && body_bytes >= SNAPSHOT_STREAM_CHUNK_BYTES {
                    metrics
                        .streams_cut
                        .with_label_values(&[reason.label()])
                        .inc();
                    tracing::warn!(
                        format = format.label(),
                        body_bytes,
                        reason = %reason,
                        "snapshot encoding cut after its first chunk"
                    );
                }
            });
            for (label, readers) in [
                ("client_stalled", report.readers_stalled),
                ("client_gone", report.readers_gone),
            ] {
                metrics
                    .streams_cut
                    .with_label_values(&[label])
                    .inc_by(readers as u64);
            }
            if outcome.is_ok() {
                metrics
                    .export_seconds
                    .with_label_values(&["encode"])
                    .observe(started.elapsed().as_secs_f64());
                metrics.encoded_bytes.observe(report.body_bytes as f64);
            }
        });
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

/// The walk, into columns a helper thread makes resident from their far end while the walk fills
/// them from the front ([`crate::peer::prefault`]): on a host where first touches of memory are
/// slow, their page faults were half of the walk. The helper is stopped and joined when the walk
/// returns, before the columns can be freed.
fn export_prefaulted(
    reader: &IndexReader,
) -> (
    IndexSnapshot,
    kvroute_index::ExportReport,
    prefault::PrefaultReport,
) {
    // With headroom: the live stream keeps adding nodes, and columns the walk found too small
    // would be allocated again, unprefaulted.
    let (nodes, carriers) = reader.export_column_room();
    let columns = SnapshotNodes::with_capacity(nodes, carriers);
    let rooms = [
        Room::of(&columns.parent),
        Room::of(&columns.content_hash),
        Room::of(&columns.carrier_end),
        Room::of(&columns.carrier_rank),
        Room::of(&columns.carrier_tiers),
        Room::of(&columns.carrier_engine_hash),
    ];
    let stop = AtomicBool::new(false);
    std::thread::scope(|scope| {
        let helper = std::thread::Builder::new()
            .name("kvroute-prefault".into())
            .spawn_scoped(scope, || prefault::populate_from_back(&rooms, &stop));
        let (snapshot, report) = reader.export_snapshot_into(columns);
        stop.store(true, Ordering::Relaxed);
        let prefaulted = match helper {
            Ok(h) => h.join().unwrap_or_default(),
            // No thread to spare: the walk faults its pages in itself, as it always could.
            Err(_) => prefault::PrefaultReport::default(),
        };
        (snapshot, report, prefaulted)
    })
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

    /// An index of one rank (the one [`all_complete`] names) carrying `chains` chains of 100
    /// blocks: about 10 KiB of JSON per chain.
    fn reader_with_chains(chains: u32) -> IndexReader {
        use kvroute_wire::event::{BlockStored, EngineHash, KvEvent};
        let (mut w, r) = PrefixIndex::new(IndexConfig::new(4));
        let id = w.add_rank(rank(1));
        for chain in 0..chains {
            let hashes: Vec<EngineHash> = (0..100u64)
                .map(|b| EngineHash(u64::from(chain) * 1_000 + b + 1))
                .collect();
            let tokens: Vec<u32> = (0..400).map(|t| chain * 1_000 + t).collect();
            w.apply_event(
                id,
                &KvEvent::BlockStored(BlockStored::new(hashes, None, tokens, 4)),
            );
        }
        w.set_cursor(id, Some((3, 1.5)));
        r
    }

    fn producer_with(
        max_bytes: usize,
        stream_stall: Duration,
        stream_join_window_bytes: usize,
    ) -> Arc<SnapshotProducer> {
        let metrics = SnapshotMetrics::new(&prometheus::Registry::new()).unwrap();
        Arc::new(SnapshotProducer {
            stream_stall,
            stream_join_window_bytes,
            ..SnapshotProducer::new(metrics, None, max_bytes)
        })
    }

    /// Limits as in service.
    fn producer_as_served(max_bytes: usize) -> Arc<SnapshotProducer> {
        producer_with(
            max_bytes,
            Duration::from_millis(SNAPSHOT_STREAM_STALL_MS_MAX),
            SNAPSHOT_STREAM_JOIN_WINDOW_BYTES,
        )
    }

    /// Nobody can join an encoding past its first chunk: what a body larger than the join window
    /// does in service, on a body a unit test can afford.
    fn producer_joinable_for_one_chunk(stream_stall: Duration) -> Arc<SnapshotProducer> {
        producer_with(1 << 30, stream_stall, SNAPSHOT_STREAM_CHUNK_BYTES)
    }

    async fn export_of(p: &Arc<SnapshotProducer>, reader: &IndexReader) -> Arc<Export> {
        p.export("m", reader, request(0), || true, all_complete)
            .await
            .unwrap()
            .0
    }

    fn whole(export: &Export, format: SnapshotFormat, compression: Compression) -> Vec<u8> {
        let mut out = Vec::new();
        encode_variant_into(&export.snapshot, format, compression, None, &mut out).unwrap();
        out
    }

    /// A body of the uncompressed JSON variant, the largest for a given index.
    async fn json_body(p: &SnapshotProducer, export: &Arc<Export>) -> EncodedBody {
        p.stream_encoded(export, SnapshotFormat::Json, Compression::None)
            .await
            .expect("a JSON body")
    }

    /// Reads up to `chunks_max` chunks of a body; the error, if the body was cut, comes last.
    async fn read_chunks(
        stream: &mut (impl futures::Stream<Item = Result<bytes::Bytes, std::io::Error>> + Unpin),
        chunks_max: usize,
    ) -> (Vec<u8>, usize, Option<std::io::Error>) {
        use futures::StreamExt;
        let (mut bytes, mut chunks) = (Vec::new(), 0);
        while chunks < chunks_max {
            match stream.next().await {
                Some(Ok(chunk)) => {
                    bytes.extend_from_slice(&chunk);
                    chunks += 1;
                }
                Some(Err(e)) => return (bytes, chunks, Some(e)),
                None => break,
            }
        }
        (bytes, chunks, None)
    }

    async fn drain(body: EncodedBody) -> (Vec<u8>, usize, Option<std::io::Error>) {
        read_chunks(&mut std::pin::pin!(body.into_stream()), usize::MAX).await
    }

    async fn wait_for_every_slot_free(p: &SnapshotProducer) {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let free = p.permits.available_permits();
            if free == SNAPSHOT_CONCURRENT_EXPORTS_MAX {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "awaited {SNAPSHOT_CONCURRENT_EXPORTS_MAX} free export slots, saw {free}"
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    fn cut(p: &SnapshotProducer, reason: &str) -> u64 {
        p.metrics.streams_cut.with_label_values(&[reason]).get()
    }

    fn encodes_finished(p: &SnapshotProducer) -> u64 {
        p.metrics
            .export_seconds
            .with_label_values(&["encode"])
            .get_sample_count()
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_streamed_body_is_the_whole_encoding_in_chunks_and_a_small_one_is_kept() {
        let p = producer_as_served(1 << 30);
        let export = export_of(&p, &reader_with_chains(100)).await;
        let variants = [
            (SnapshotFormat::Json, Compression::None),
            (SnapshotFormat::Binary, Compression::None),
            (SnapshotFormat::Binary, Compression::Zstd),
        ];
        for (format, compression) in variants {
            let whole = whole(&export, format, compression);
            let body = p
                .stream_encoded(&export, format, compression)
                .await
                .unwrap();
            let (streamed, chunks, fault) = drain(body).await;
            assert!(fault.is_none(), "{format:?}/{compression:?}: {fault:?}");
            assert!(
                streamed == whole,
                "{format:?}/{compression:?}: bodies differ"
            );
            assert_eq!(
                chunks,
                whole.len().div_ceil(SNAPSHOT_STREAM_CHUNK_BYTES),
                "{format:?}/{compression:?}: {} bytes",
                whole.len()
            );
            if format == SnapshotFormat::Json {
                assert!(
                    chunks > 2,
                    "the JSON body must span several chunks: {chunks}"
                );
            }
        }
        wait_for_every_slot_free(&p).await;
        assert_eq!(encodes_finished(&p), 3);
        // Within the join window, a finished body is kept: asked again, nothing is encoded.
        let (format, compression) = variants[0];
        let again = p
            .stream_encoded(&export, format, compression)
            .await
            .unwrap();
        let (streamed, _, fault) = drain(again).await;
        assert!(fault.is_none() && streamed == whole(&export, format, compression));
        assert_eq!(encodes_finished(&p), 3);
        assert_eq!(p.metrics.encodings_joined.get(), 1);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_requester_that_comes_while_the_replay_is_whole_joins_the_running_encoding() {
        let p = producer_as_served(1 << 30);
        let export = export_of(&p, &reader_with_chains(400)).await;
        let first = json_body(&p, &export).await;
        // The first body is not read yet: the encoder is at most a few chunks in.
        let second = json_body(&p, &export).await;
        assert_eq!(p.metrics.encodings_joined.get(), 1);
        let (a, b) = tokio::join!(drain(first), drain(second));
        let expected = whole(&export, SnapshotFormat::Json, Compression::None);
        for (name, (bytes, _, fault)) in [("first", a), ("joiner", b)] {
            assert!(fault.is_none(), "{name}: {fault:?}");
            assert!(bytes == expected, "{name}: {} bytes", bytes.len());
        }
        wait_for_every_slot_free(&p).await;
        assert_eq!(encodes_finished(&p), 1, "one encoding served both");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn past_the_join_window_a_requester_starts_its_own_encoding() {
        let p =
            producer_joinable_for_one_chunk(Duration::from_millis(SNAPSHOT_STREAM_STALL_MS_MAX));
        let export = export_of(&p, &reader_with_chains(400)).await;
        let first = json_body(&p, &export).await;
        let mut first = std::pin::pin!(first.into_stream());
        // Taking the second chunk proves the encoder published it, past the one-chunk window.
        let (head, chunks, fault) = read_chunks(&mut first, 2).await;
        assert!(chunks == 2 && fault.is_none(), "{chunks} chunks, {fault:?}");
        let second = json_body(&p, &export).await;
        assert_eq!(p.metrics.encodings_joined.get(), 0);
        let ((tail, _, fault_a), (b, _, fault_b)) =
            tokio::join!(read_chunks(&mut first, usize::MAX), drain(second));
        let expected = whole(&export, SnapshotFormat::Json, Compression::None);
        assert!(
            fault_a.is_none() && fault_b.is_none(),
            "{fault_a:?} {fault_b:?}"
        );
        assert!([head, tail].concat() == expected, "first body differs");
        assert!(b == expected, "second body differs");
        wait_for_every_slot_free(&p).await;
        assert_eq!(encodes_finished(&p), 2);
    }

    #[tokio::test]
    async fn an_encoding_over_the_limit_before_its_first_chunk_is_refused_and_remembered() {
        let p = producer_as_served(16);
        let export = export_of(&p, &reader()).await;
        let r = p
            .stream_encoded(&export, SnapshotFormat::Json, Compression::None)
            .await;
        assert!(matches!(r, Err(ProduceError::TooLarge { limit_bytes: 16 })));
        assert_eq!(
            cut(&p, "too_large"),
            0,
            "nothing was sent, so nothing was cut"
        );
        wait_for_every_slot_free(&p).await;
        // With every slot taken, only a remembered verdict can answer.
        let _held = p
            .permits
            .clone()
            .try_acquire_many_owned(SNAPSHOT_CONCURRENT_EXPORTS_MAX as u32)
            .unwrap();
        let again = p
            .stream_encoded(&export, SnapshotFormat::Json, Compression::None)
            .await;
        assert!(matches!(again, Err(ProduceError::TooLarge { .. })));
        let other = p
            .stream_encoded(&export, SnapshotFormat::Binary, Compression::None)
            .await;
        assert!(
            matches!(other, Err(ProduceError::Busy)),
            "another variant is judged on its own"
        );
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_body_over_the_limit_after_its_first_chunk_is_cut_not_ended() {
        let p = producer_as_served(SNAPSHOT_STREAM_CHUNK_BYTES + 1);
        let export = export_of(&p, &reader_with_chains(100)).await;
        let body = p
            .stream_encoded(&export, SnapshotFormat::Json, Compression::None)
            .await
            .expect("the first chunk fits the limit");
        let (streamed, chunks, fault) = drain(body).await;
        assert_eq!(chunks, 1);
        assert_eq!(streamed.len(), SNAPSHOT_STREAM_CHUNK_BYTES);
        let fault = fault.expect("a body past the limit must end in an error, not cleanly");
        assert!(fault.to_string().contains("limit"), "{fault}");
        // Asked again as soon as the cut is seen: the verdict and the count are recorded before
        // the cut.
        assert_eq!(cut(&p, "too_large"), 1);
        let again = p
            .stream_encoded(&export, SnapshotFormat::Json, Compression::None)
            .await;
        assert!(
            matches!(again, Err(ProduceError::TooLarge { .. })),
            "the verdict is remembered for the export"
        );
        wait_for_every_slot_free(&p).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_client_that_hangs_up_frees_the_export_slot_once_nobody_can_join() {
        let p =
            producer_joinable_for_one_chunk(Duration::from_millis(SNAPSHOT_STREAM_STALL_MS_MAX));
        let export = export_of(&p, &reader_with_chains(400)).await;
        let body = json_body(&p, &export).await;
        drop(body);
        wait_for_every_slot_free(&p).await;
        assert_eq!(cut(&p, "client_gone"), 1);
        assert_eq!(
            encodes_finished(&p),
            0,
            "an abandoned encode is not a finished one"
        );
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_client_that_stops_reading_frees_the_export_slot_at_the_stall_limit() {
        let p = producer_joinable_for_one_chunk(Duration::from_millis(100));
        let export = export_of(&p, &reader_with_chains(400)).await;
        let body = json_body(&p, &export).await;
        // The body is held, never read: its channel fills and the encoder waits for room.
        wait_for_every_slot_free(&p).await;
        assert_eq!(cut(&p, "client_stalled"), 1);
        let (streamed, chunks, fault) = drain(body).await;
        assert!(
            fault.is_some(),
            "a stalled body must end in an error after its {chunks} chunks ({} bytes)",
            streamed.len()
        );
        assert_eq!(chunks, 1 + SNAPSHOT_STREAM_CHUNKS_IN_FLIGHT_MAX);
    }
}
