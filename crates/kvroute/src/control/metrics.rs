//! Router metrics, registered in the one Prometheus registry shared with the KV plane.
//!
//! Handles are created once at start-up and cloned into the hot path (they are `Arc`s inside),
//! so recording costs an atomic add, never a registry lookup by name.

use prometheus::{
    Encoder, HistogramOpts, HistogramVec, IntCounterVec, IntGaugeVec, Opts, Registry, TextEncoder,
};

#[derive(Clone)]
pub struct Metrics {
    pub registry: Registry,
    pub requests: IntCounterVec,
    pub decisions: IntCounterVec,
    pub routing_latency: HistogramVec,
    /// Time to tokenize one request's text prompt or chat on its path, by `kind` (`prompt`,
    /// `chat`): apart from `routing_latency`, because on a long new document it is the larger
    /// part of what the router adds to the request (docs/BENCHMARKS.md, "Routing hot path").
    pub tokenize_latency: HistogramVec,
    pub matched_blocks: HistogramVec,
    pub in_flight: IntGaugeVec,
    pub upstream_failures: IntCounterVec,
    pub retries: IntCounterVec,
    /// Chat tokenizations by segment outcome: `hit` and `miss` per segment, `whole` per chat
    /// tokenized whole, `head` per chat routed on its head alone (`routing::tokenize`).
    pub tokenizer_cache: IntCounterVec,
    /// Text prompts (and chats) the router routed on load without tokenizing, by reason
    /// (`routing::tokenize::Untokenized`): `no_tokenizer`, `no_chat_template`, `text_too_long`
    /// (past `--tokenize-text-bytes-max`), `tokenize_failed`.
    pub untokenized_prompts: IntCounterVec,
    pub data_plane_connections: IntCounterVec,
    /// Client connections open on the public listener (what `--client-connections-max` caps).
    pub client_connections_open: prometheus::IntGauge,
    /// Client connections closed by the router, by reason: `cap` (answered 503 past the cap),
    /// `idle`, `head_timeout` and `body_timeout` (answered 408), `write_timeout`.
    pub client_connections_closed: IntCounterVec,
    /// Predicted minus engine-reported cached tokens of each finished request (cache_aware).
    pub prediction_error_tokens: HistogramVec,
    /// Finished requests by how their prediction compared: `exact`, `over`, `under`.
    pub predictions: IntCounterVec,
    /// 1 while a model's predictions persistently disagree with its engines' reports, by
    /// direction (`over`, `under`).
    pub prediction_mismatch: IntGaugeVec,
    /// Load-bookings frames by `result`: `sent` (to a sibling), `applied` (from one), `refused`
    /// (from one, and its stream was dropped).
    pub load_share_frames: IntCounterVec,
    /// Rendered conversation prefixes shared with siblings (`routing::tokenize`), by `result`:
    /// `sent` in a frame (once per stream), `lost` (a stream lagged the ring, or a frame would
    /// have been too long), `adopted` from a sibling (valid here; a prefix this replica already
    /// knew keeps its own rendering), `refused` (made with a tokenizer this replica does not
    /// hold, or invalid for it).
    pub shared_prefixes: IntCounterVec,
    /// Siblings whose bookings currently count (heard within `--load-share-stale-ms`).
    pub load_share_siblings: prometheus::IntGauge,
    /// Engine `/metrics` scrapes by `result`: `ok`, `no_vllm_gauges`, `failed`.
    pub engine_metrics_scrapes: IntCounterVec,
    /// Cold prompts placed by their owner replica (`crate::peer::cold_owner`), by `outcome`:
    /// `owner_chose` (this replica asked and took the owner's rank), `owner_rank_unknown` (the
    /// owner named a rank this replica cannot route to), `owner_failed` (no usable answer in
    /// time: placed here), `served` (this replica placed a sibling's cold prompt).
    pub cold_placements: IntCounterVec,
    /// How long a replica waited for a cold prompt's owner to answer (timeouts included).
    pub cold_placement_wait: prometheus::Histogram,
}

impl Metrics {
    pub fn new(registry: Registry) -> Result<Metrics, prometheus::Error> {
        let requests = IntCounterVec::new(
            Opts::new(
                "kvroute_requests_total",
                "Requests by route and final status code",
            ),
            &["route", "status"],
        )?;
        let decisions = IntCounterVec::new(
            Opts::new(
                "kvroute_routing_decisions_total",
                "Routing decisions by policy and reason",
            ),
            &["policy", "reason"],
        )?;
        let routing_latency = HistogramVec::new(
            HistogramOpts::new(
                "kvroute_routing_latency_seconds",
                "Time to hash, match and score one request (tokenizing is kvroute_tokenize_seconds)",
            )
            .buckets(vec![
                0.000_005, 0.000_01, 0.000_025, 0.000_05, 0.000_1, 0.000_25, 0.000_5, 0.001,
                0.002_5, 0.005, 0.01, 0.05,
            ]),
            &["policy"],
        )?;
        let tokenize_latency = HistogramVec::new(
            HistogramOpts::new(
                "kvroute_tokenize_seconds",
                "Time to tokenize one request's text prompt or chat, by kind",
            )
            .buckets(vec![
                0.000_01, 0.000_05, 0.000_1, 0.000_5, 0.001, 0.002_5, 0.005, 0.01, 0.025, 0.05,
                0.1, 0.25,
            ]),
            &["kind"],
        )?;
        let matched_blocks = HistogramVec::new(
            HistogramOpts::new(
                "kvroute_matched_blocks",
                "Prefix blocks already cached on the chosen rank",
            )
            .buckets(vec![
                0.0, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0,
            ]),
            &["model"],
        )?;
        let in_flight = IntGaugeVec::new(
            Opts::new(
                "kvroute_in_flight_requests",
                "Requests in flight per engine rank",
            ),
            &["worker_url", "dp_rank"],
        )?;
        let upstream_failures = IntCounterVec::new(
            Opts::new(
                "kvroute_upstream_failures_total",
                "Failed upstream attempts by kind",
            ),
            &["kind"],
        )?;
        let retries = IntCounterVec::new(
            Opts::new("kvroute_retries_total", "Requests re-sent to another rank"),
            &["route"],
        )?;
        let tokenizer_cache = IntCounterVec::new(
            Opts::new(
                "kvroute_tokenizer_cache_total",
                "Tokenizer segment cache lookups by outcome",
            ),
            &["outcome"],
        )?;
        let data_plane_connections = IntCounterVec::new(
            Opts::new(
                "kvroute_data_plane_connections_total",
                "Client connections handed to each data-plane thread",
            ),
            &["thread"],
        )?;
        registry.register(Box::new(requests.clone()))?;
        registry.register(Box::new(decisions.clone()))?;
        registry.register(Box::new(routing_latency.clone()))?;
        registry.register(Box::new(tokenize_latency.clone()))?;
        registry.register(Box::new(matched_blocks.clone()))?;
        registry.register(Box::new(in_flight.clone()))?;
        registry.register(Box::new(upstream_failures.clone()))?;
        registry.register(Box::new(retries.clone()))?;
        registry.register(Box::new(tokenizer_cache.clone()))?;
        let untokenized_prompts = IntCounterVec::new(
            Opts::new(
                "kvroute_untokenized_prompts_total",
                "Text prompts routed on load without tokenizing, by reason",
            ),
            &["reason"],
        )?;
        registry.register(Box::new(untokenized_prompts.clone()))?;
        let client_connections_open = prometheus::IntGauge::new(
            "kvroute_client_connections_open",
            "Client connections open on the public listener",
        )?;
        let client_connections_closed = IntCounterVec::new(
            Opts::new(
                "kvroute_client_connections_closed_total",
                "Client connections the router closed by its limits, by reason",
            ),
            &["reason"],
        )?;
        let prediction_error_tokens = HistogramVec::new(
            HistogramOpts::new(
                "kvroute_prediction_error_tokens",
                "Predicted minus engine-reported cached tokens per finished request",
            )
            .buckets(vec![
                -4096.0, -1024.0, -256.0, -64.0, -16.0, -1.0, 0.0, 15.0, 63.0, 255.0, 1023.0,
                4095.0,
            ]),
            &["model"],
        )?;
        let predictions = IntCounterVec::new(
            Opts::new(
                "kvroute_predictions_total",
                "Finished requests by prediction against the engine's report (a block or more off: over / under)",
            ),
            &["model", "worker", "result"],
        )?;
        let prediction_mismatch = IntGaugeVec::new(
            Opts::new(
                "kvroute_prediction_mismatch",
                "1 while a model's predicted and reported cached tokens disagree beyond the tolerance",
            ),
            &["model", "direction"],
        )?;
        let load_share_frames = IntCounterVec::new(
            Opts::new(
                "kvroute_load_share_frames_total",
                "Load-bookings frames sent to siblings, applied from them, or refused",
            ),
            &["result"],
        )?;
        let shared_prefixes = IntCounterVec::new(
            Opts::new(
                "kvroute_shared_prefixes_total",
                "Rendered conversation prefixes sent to siblings, adopted from them, lost or refused",
            ),
            &["result"],
        )?;
        let load_share_siblings = prometheus::IntGauge::new(
            "kvroute_load_share_siblings",
            "Siblings whose load bookings count in the cost model",
        )?;
        let engine_metrics_scrapes = IntCounterVec::new(
            Opts::new(
                "kvroute_engine_metrics_scrapes_total",
                "Scrapes of engines' /metrics for vLLM's running and waiting requests",
            ),
            &["result"],
        )?;
        let cold_placements = IntCounterVec::new(
            Opts::new(
                "kvroute_cold_placements_total",
                "Cold prompts placed by the replica that owns their prefix, by outcome",
            ),
            &["outcome"],
        )?;
        registry.register(Box::new(cold_placements.clone()))?;
        let cold_placement_wait = prometheus::Histogram::with_opts(
            HistogramOpts::new(
                "kvroute_cold_placement_wait_seconds",
                "Time a replica waited for the owner's placement of a cold prompt",
            )
            .buckets(vec![
                0.000_1, 0.000_25, 0.000_5, 0.001, 0.002_5, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
                1.0,
            ]),
        )?;
        registry.register(Box::new(cold_placement_wait.clone()))?;
        registry.register(Box::new(engine_metrics_scrapes.clone()))?;
        registry.register(Box::new(load_share_frames.clone()))?;
        registry.register(Box::new(shared_prefixes.clone()))?;
        registry.register(Box::new(load_share_siblings.clone()))?;
        registry.register(Box::new(prediction_error_tokens.clone()))?;
        registry.register(Box::new(predictions.clone()))?;
        registry.register(Box::new(prediction_mismatch.clone()))?;
        registry.register(Box::new(data_plane_connections.clone()))?;
        registry.register(Box::new(client_connections_open.clone()))?;
        registry.register(Box::new(client_connections_closed.clone()))?;
        Ok(Metrics {
            registry,
            requests,
            decisions,
            routing_latency,
            tokenize_latency,
            matched_blocks,
            in_flight,
            upstream_failures,
            retries,
            tokenizer_cache,
            untokenized_prompts,
            data_plane_connections,
            client_connections_open,
            client_connections_closed,
            prediction_error_tokens,
            predictions,
            prediction_mismatch,
            load_share_frames,
            shared_prefixes,
            load_share_siblings,
            engine_metrics_scrapes,
            cold_placements,
            cold_placement_wait,
        })
    }

    pub fn render(&self) -> String {
        let mut buf = Vec::new();
        let encoder = TextEncoder::new();
        if let Err(e) = encoder.encode(&self.registry.gather(), &mut buf) {
            tracing::warn!(error = %e, "metrics encoding failed");
        }
        String::from_utf8(buf).unwrap_or_default()
    }
}
