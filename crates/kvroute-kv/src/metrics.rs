//! Prometheus series of the KV plane, registered once on the router's registry.
//!
//! Counters are plane-wide (labelled by event type or outcome only), because per-rank counters
//! would multiply series by fleet size for little diagnostic gain: per-rank detail is served by
//! `KvPlane::rank_states`. Only the two things an operator reads per rank (subscriber state,
//! carried blocks per tier) are per-rank gauges, and their series are deleted with the worker.
//! Bootstrap holds are gauged per model, the unit that owns a pump and its memory.

use prometheus::{
    Histogram, HistogramOpts, IntCounter, IntCounterVec, IntGaugeVec, Opts, Registry,
};

#[derive(Clone)]
pub struct KvMetrics {
    pub events_applied: IntCounterVec,
    pub batches_applied: IntCounter,
    pub duplicate_batches: IntCounter,
    pub lost_batches: IntCounter,
    pub replays: IntCounterVec,
    pub publisher_restarts: IntCounter,
    pub decode_errors: IntCounter,
    pub malformed_messages: IntCounter,
    pub block_size_mismatch: IntCounter,
    pub skipped_blocks: IntCounterVec,
    pub subscriber_state: IntGaugeVec,
    pub carried_blocks: IntGaugeVec,
    pub bootstrap_outcomes: IntCounterVec,
    pub bootstrap_held_batches: IntGaugeVec,
    pub bootstrap_held_bytes: IntGaugeVec,
    pub grafts: IntCounterVec,
    pub graft_slice_seconds: Histogram,
}

/// Bucket bounds of the graft slice histogram, in seconds: a slice is meant to take a few
/// milliseconds, and the interesting tail is how close it comes to the 50 ms live-apply budget.
pub const GRAFT_SLICE_BUCKETS_SECONDS: [f64; 10] = [
    0.000_5, 0.001, 0.002, 0.004, 0.008, 0.016, 0.032, 0.050, 0.100, 0.250,
];

pub const TIER_LABELS: [&str; 4] = ["device", "host", "disk", "external"];
/// Position of the device tier in [`TIER_LABELS`] and in `RankStats::tier_blocks` (the index
/// counts tier `i` under bit `1 << i`).
pub const DEVICE_TIER: usize = kvroute_index::TIER_DEVICE.trailing_zeros() as usize;

impl KvMetrics {
    pub fn register(registry: &Registry) -> prometheus::Result<Self> {
        let m = Self {
            events_applied: IntCounterVec::new(
                Opts::new(
                    "kvroute_kv_events_applied_total",
                    "Engine KV events applied to the index, by event type.",
                ),
                &["type"],
            )?,
            batches_applied: IntCounter::new(
                "kvroute_kv_batches_applied_total",
                "Engine event batches applied to the index.",
            )?,
            duplicate_batches: IntCounter::new(
                "kvroute_kv_duplicate_batches_total",
                "Batches dropped because their seq was at or below the rank's cursor.",
            )?,
            lost_batches: IntCounter::new(
                "kvroute_kv_lost_batches_total",
                "Batches never received nor recovered by replay (sequence gaps left unfilled).",
            )?,
            replays: IntCounterVec::new(
                Opts::new(
                    "kvroute_kv_replays_total",
                    "Replay requests, by outcome (repaired, incomplete, failed).",
                ),
                &["outcome"],
            )?,
            publisher_restarts: IntCounter::new(
                "kvroute_kv_publisher_restarts_total",
                "Engine publisher restarts detected (sequence went back); the rank was cleared.",
            )?,
            decode_errors: IntCounter::new(
                "kvroute_kv_decode_errors_total",
                "Payloads that failed to decode (dropped; the gap is then handled as lost or replayed).",
            )?,
            malformed_messages: IntCounter::new(
                "kvroute_kv_malformed_messages_total",
                "ZMQ messages with the wrong frame shape or an oversized frame (dropped).",
            )?,
            block_size_mismatch: IntCounter::new(
                "kvroute_block_size_mismatch_total",
                "Workers refused because their KV block size differs from their model's.",
            )?,
            skipped_blocks: IntCounterVec::new(
                Opts::new(
                    "kvroute_kv_skipped_blocks_total",
                    "Blocks named by applied events that the index did not take, by reason: block_size and token_count (the engine's events do not fit the model's block size: the rank stays blind to its cache), unknown_parent (a store under a prefix the router never saw, as after a start mid-stream), unknown_medium, shard_full, unknown_removed.",
                ),
                &["reason"],
            )?,
            subscriber_state: IntGaugeVec::new(
                Opts::new(
                    "kvroute_kv_subscriber_state",
                    "Per-rank subscriber state: 0 connecting, 1 connected, 2 disconnected, 3 replaying, 4 stopped.",
                ),
                &["worker", "dp_rank"],
            )?,
            carried_blocks: IntGaugeVec::new(
                Opts::new(
                    "kvroute_kv_carried_blocks",
                    "Blocks the index says a rank holds, by storage tier.",
                ),
                &["worker", "dp_rank", "tier"],
            )?,
            bootstrap_outcomes: IntCounterVec::new(
                Opts::new(
                    "kvroute_kv_bootstrap_outcomes_total",
                    "Rank bootstraps settled, by outcome (warm, warm_unwitnessed, gap, uncovered, abandoned, overflow, publisher_reset, rejected, from_origin, empty, from_engine_replay).",
                ),
                &["outcome"],
            )?,
            bootstrap_held_batches: IntGaugeVec::new(
                Opts::new(
                    "kvroute_kv_bootstrap_held_batches",
                    "Live batches held back from the index by bootstrapping ranks (held, or queued behind a running graft).",
                ),
                &["model"],
            )?,
            bootstrap_held_bytes: IntGaugeVec::new(
                Opts::new(
                    "kvroute_kv_bootstrap_held_bytes",
                    "Estimated bytes of the live batches held back from the index by bootstrapping ranks.",
                ),
                &["model"],
            )?,
            grafts: IntCounterVec::new(
                Opts::new(
                    "kvroute_kv_grafts_total",
                    "Snapshot grafts, by result (completed, rejected, failed, abandoned).",
                ),
                &["result"],
            )?,
            graft_slice_seconds: Histogram::with_opts(
                HistogramOpts::new(
                    "kvroute_kv_graft_slice_seconds",
                    "Duration of one graft slice on the pump (live batches of other ranks wait at most about one slice).",
                )
                .buckets(GRAFT_SLICE_BUCKETS_SECONDS.to_vec()),
            )?,
        };
        registry.register(Box::new(m.events_applied.clone()))?;
        registry.register(Box::new(m.batches_applied.clone()))?;
        registry.register(Box::new(m.duplicate_batches.clone()))?;
        registry.register(Box::new(m.lost_batches.clone()))?;
        registry.register(Box::new(m.replays.clone()))?;
        registry.register(Box::new(m.publisher_restarts.clone()))?;
        registry.register(Box::new(m.decode_errors.clone()))?;
        registry.register(Box::new(m.malformed_messages.clone()))?;
        registry.register(Box::new(m.block_size_mismatch.clone()))?;
        registry.register(Box::new(m.skipped_blocks.clone()))?;
        registry.register(Box::new(m.subscriber_state.clone()))?;
        registry.register(Box::new(m.carried_blocks.clone()))?;
        registry.register(Box::new(m.bootstrap_outcomes.clone()))?;
        registry.register(Box::new(m.bootstrap_held_batches.clone()))?;
        registry.register(Box::new(m.bootstrap_held_bytes.clone()))?;
        registry.register(Box::new(m.grafts.clone()))?;
        registry.register(Box::new(m.graft_slice_seconds.clone()))?;
        Ok(m)
    }

    /// Drops every per-rank series of a removed rank, so a departed worker leaves no stale gauge.
    pub fn forget_rank(&self, worker: &str, dp_rank: u32) {
        let rank = dp_rank.to_string();
        let _ = self
            .subscriber_state
            .remove_label_values(&[worker, rank.as_str()]);
        for tier in TIER_LABELS {
            let _ = self
                .carried_blocks
                .remove_label_values(&[worker, rank.as_str(), tier]);
        }
    }
}
