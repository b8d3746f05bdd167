//! Prometheus series of the KV plane, registered once on the router's registry.
//!
//! Counters are plane-wide (labelled by event type or outcome only), because per-rank counters
//! would multiply series by fleet size for little diagnostic gain: per-rank detail is served by
//! `KvPlane::rank_states`. Only the two things an operator reads per rank (subscriber state,
//! carried blocks per tier) are per-rank gauges, and their series are deleted with the worker.

use prometheus::{IntCounter, IntCounterVec, IntGaugeVec, Opts, Registry};

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
    pub subscriber_state: IntGaugeVec,
    pub carried_blocks: IntGaugeVec,
}

pub const TIER_LABELS: [&str; 4] = ["device", "host", "disk", "external"];

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
        registry.register(Box::new(m.subscriber_state.clone()))?;
        registry.register(Box::new(m.carried_blocks.clone()))?;
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
