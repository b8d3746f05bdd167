//! The router checking its own predictions against the engines' reports.
//!
//! The most common silent failure of a cache-aware router is a router whose idea of a prompt's
//! tokens differs from the engine's (another tokenizer or chat template, a missing BOS token, a
//! LoRA or cache-salt namespace): its index, built from the engines' events, then never matches
//! the prompts it hashes, it routes on load alone, and the fleet's hit rate quietly falls.
//! Engines say what they actually reused in every answer (`usage.prompt_tokens_details.
//! cached_tokens` on the OpenAI routes, `meta_info.cached_tokens` on SGLang's `/generate`), so
//! the router compares that with the depth it predicted for the rank it chose.
//!
//! Two pure pieces live here, the I/O-free half of the check:
//! * [`CachedTokensScanner`] finds the last `"cached_tokens": N` in a response body fed to it
//!   chunk by chunk, as the chunks pass through to the client: it never buffers the body or
//!   delays a byte, it keeps only a carry of [`SCAN_CARRY_BYTES`] between chunks (a key or a
//!   number split by a chunk boundary), and a search costs one SIMD substring scan per chunk.
//! * [`PredictionWindow`] keeps the last `window_requests` (predicted, reported) pairs of one
//!   model with running sums, and flags a MISMATCH when the two sums disagree by more than the
//!   tolerance (relative to the larger) while the larger averages at least one block per
//!   request; the flag clears with hysteresis (half the tolerance), so a model near the
//!   threshold does not flap. Both directions count: a router that hashes other tokens than the
//!   engine predicts nothing while engines report hits (under), a namespace the router ignores
//!   predicts hits the engine cannot have (over).

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;

use memchr::memmem;
use parking_lot::{Mutex, RwLock};

/// Bytes of a chunk kept for the next one: the key, its quotes, the colon, blanks and a
/// 20-digit number all fit.
pub const SCAN_CARRY_BYTES: usize = 48;
/// Longest run of digits read as a count (u64 has 20).
const CACHED_TOKENS_DIGITS_MAX: usize = 20;
const KEY: &[u8] = b"\"cached_tokens\"";
/// Built once: constructing a searcher costs more than searching a chunk.
static KEY_FINDER: std::sync::LazyLock<memmem::Finder<'static>> =
    std::sync::LazyLock::new(|| memmem::Finder::new(KEY));

/// Finds the last complete `"cached_tokens": N` of a body fed chunk by chunk.
#[derive(Debug, Default)]
pub struct CachedTokensScanner {
    carry: Vec<u8>,
    last: Option<u64>,
}

/// The value after a key that starts at `at` in `buf`: `Some(Some(n))` when complete,
/// `Some(None)` when the buffer ends inside it (more bytes may complete it), `None` when what
/// follows is not a count (e.g. `null`).
fn value_after(buf: &[u8], at: usize) -> Option<Option<u64>> {
    let mut i = at + KEY.len();
    while i < buf.len() && matches!(buf[i], b' ' | b'\t' | b'\r' | b'\n') {
        i += 1;
    }
    if i == buf.len() {
        return Some(None);
    }
    if buf[i] != b':' {
        return None;
    }
    i += 1;
    while i < buf.len() && matches!(buf[i], b' ' | b'\t' | b'\r' | b'\n') {
        i += 1;
    }
    let start = i;
    while i < buf.len() && buf[i].is_ascii_digit() && i - start < CACHED_TOKENS_DIGITS_MAX {
        i += 1;
    }
    if i == buf.len() {
        return Some(None);
    }
    if i == start {
        return None;
    }
    std::str::from_utf8(&buf[start..i])
        .ok()
        .and_then(|d| d.parse().ok())
        .map(Some)
}

impl CachedTokensScanner {
    /// Feeds the next chunk of the body.
    pub fn feed(&mut self, chunk: &[u8]) {
        let finder = &*KEY_FINDER;
        // Keys that straddle the previous chunk's end: search the carry joined to this chunk's
        // head (both short), and only at positions that start inside the carry.
        if !self.carry.is_empty() {
            let head = &chunk[..chunk.len().min(SCAN_CARRY_BYTES)];
            // On the stack: this runs for every chunk of every streamed answer.
            let mut joined_buf = [0u8; 2 * SCAN_CARRY_BYTES];
            let joined_len = self.carry.len() + head.len();
            joined_buf[..self.carry.len()].copy_from_slice(&self.carry);
            joined_buf[self.carry.len()..joined_len].copy_from_slice(head);
            let joined = &joined_buf[..joined_len];
            for at in finder.find_iter(joined) {
                if at >= self.carry.len() {
                    break;
                }
                if let Some(Some(v)) = value_after(joined, at) {
                    self.last = Some(v);
                }
            }
        }
        for at in finder.find_iter(chunk) {
            if let Some(Some(v)) = value_after(chunk, at) {
                self.last = Some(v);
            }
        }
        // The carry: this chunk's tail (with what is left of the old carry when the chunk is
        // shorter than a carry).
        if chunk.len() >= SCAN_CARRY_BYTES {
            self.carry.clear();
            self.carry
                .extend_from_slice(&chunk[chunk.len() - SCAN_CARRY_BYTES..]);
        } else {
            self.carry.extend_from_slice(chunk);
            let excess = self.carry.len().saturating_sub(SCAN_CARRY_BYTES);
            self.carry.drain(..excess);
        }
    }

    /// The last complete value seen so far.
    pub fn last(&self) -> Option<u64> {
        self.last
    }
}

/// How one request's prediction compared with the engine's report.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PredictionResult {
    /// Within one block of the report.
    Exact,
    /// Predicted at least a block more than the engine reused.
    Over,
    /// The engine reused at least a block more than predicted.
    Under,
}

impl PredictionResult {
    pub fn classify(predicted: u64, reported: u64, block_size: u64) -> PredictionResult {
        let block = block_size.max(1);
        if predicted >= reported.saturating_add(block) {
            PredictionResult::Over
        } else if reported >= predicted.saturating_add(block) {
            PredictionResult::Under
        } else {
            PredictionResult::Exact
        }
    }

    pub fn label(self) -> &'static str {
        match self {
            PredictionResult::Exact => "exact",
            PredictionResult::Over => "over",
            PredictionResult::Under => "under",
        }
    }
}

/// The check's settings (`--prediction-check-window`, `--prediction-check-tolerance`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PredictionCheckConfig {
    /// Requests with a report the check looks back over; 0 turns the check off.
    pub window_requests: usize,
    /// Disagreement between predicted and reported totals, as a fraction of the larger, above
    /// which the window flags a mismatch.
    pub tolerance: f64,
}

pub const DEFAULT_PREDICTION_CHECK_WINDOW: usize = 200;
pub const DEFAULT_PREDICTION_CHECK_TOLERANCE: f64 = 0.5;
/// Largest window accepted (each entry is 16 bytes).
pub const PREDICTION_CHECK_WINDOW_MAX: usize = 100_000;

impl Default for PredictionCheckConfig {
    fn default() -> Self {
        PredictionCheckConfig {
            window_requests: DEFAULT_PREDICTION_CHECK_WINDOW,
            tolerance: DEFAULT_PREDICTION_CHECK_TOLERANCE,
        }
    }
}

/// Which way a mismatched model's predictions go.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mismatch {
    /// Engines report far fewer cached tokens than predicted.
    Over,
    /// Engines report far more cached tokens than predicted (typically: the router's tokens
    /// never match the index, so it predicts nothing).
    Under,
}

impl Mismatch {
    pub fn label(self) -> &'static str {
        match self {
            Mismatch::Over => "over",
            Mismatch::Under => "under",
        }
    }
}

/// A change of a model's check state, for the log line and the gauge.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum CheckTransition {
    Raised {
        direction: Mismatch,
        predicted: u64,
        reported: u64,
    },
    Cleared {
        predicted: u64,
        reported: u64,
    },
}

/// One model's recent predictions and reports; see the module doc for the rule.
#[derive(Debug)]
pub struct PredictionWindow {
    config: PredictionCheckConfig,
    block_size: u64,
    entries: VecDeque<(u64, u64)>,
    predicted_sum: u64,
    reported_sum: u64,
    mismatch: Option<Mismatch>,
}

impl PredictionWindow {
    pub fn new(config: PredictionCheckConfig, block_size: usize) -> PredictionWindow {
        PredictionWindow {
            config: PredictionCheckConfig {
                window_requests: config.window_requests.min(PREDICTION_CHECK_WINDOW_MAX),
                tolerance: config.tolerance.clamp(0.0, 1.0),
            },
            block_size: block_size.max(1) as u64,
            entries: VecDeque::new(),
            predicted_sum: 0,
            reported_sum: 0,
            mismatch: None,
        }
    }

    pub fn mismatch(&self) -> Option<Mismatch> {
        self.mismatch
    }

    /// (requests, predicted, reported) over the window.
    pub fn totals(&self) -> (usize, u64, u64) {
        (self.entries.len(), self.predicted_sum, self.reported_sum)
    }

    /// Records one request; returns a transition when the model's state changed.
    pub fn record(&mut self, predicted: u64, reported: u64) -> Option<CheckTransition> {
        let window = self.config.window_requests;
        if window == 0 {
            return None;
        }
        if self.entries.len() == window
            && let Some((p, r)) = self.entries.pop_front()
        {
            self.predicted_sum -= p;
            self.reported_sum -= r;
        }
        self.entries.push_back((predicted, reported));
        self.predicted_sum += predicted;
        self.reported_sum += reported;
        if self.entries.len() < window {
            return None;
        }
        let (p, r) = (self.predicted_sum, self.reported_sum);
        let larger = p.max(r);
        // Below a block per request on both sides there is too little reuse to judge.
        let significant = larger >= self.block_size * window as u64;
        let disagreement = if larger == 0 {
            0.0
        } else {
            p.abs_diff(r) as f64 / larger as f64
        };
        match self.mismatch {
            None if significant && disagreement > self.config.tolerance => {
                let direction = if p > r {
                    Mismatch::Over
                } else {
                    Mismatch::Under
                };
                self.mismatch = Some(direction);
                Some(CheckTransition::Raised {
                    direction,
                    predicted: p,
                    reported: r,
                })
            }
            Some(_) if !significant || disagreement <= self.config.tolerance / 2.0 => {
                self.mismatch = None;
                Some(CheckTransition::Cleared {
                    predicted: p,
                    reported: r,
                })
            }
            _ => None,
        }
    }
}

/// Every model's window, created at the model's first report. Updated once per finished
/// request that carried a report (a read lock and a short mutex), never on the routing step.
#[derive(Debug, Default)]
pub struct PredictionChecks {
    config: PredictionCheckConfig,
    models: RwLock<HashMap<String, Arc<Mutex<PredictionWindow>>>>,
}

/// One model's check, as `/workers` shows it.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelCheckState {
    pub model: String,
    pub mismatch: Option<Mismatch>,
    pub requests: usize,
    pub predicted_tokens: u64,
    pub reported_tokens: u64,
}

impl PredictionChecks {
    pub fn new(config: PredictionCheckConfig) -> PredictionChecks {
        PredictionChecks {
            config,
            models: RwLock::new(HashMap::new()),
        }
    }

    pub fn record(
        &self,
        model: &str,
        block_size: usize,
        predicted: u64,
        reported: u64,
    ) -> Option<CheckTransition> {
        let found = self.models.read().get(model).cloned();
        let window = match found {
            Some(w) => w,
            None => self
                .models
                .write()
                .entry(model.to_string())
                .or_insert_with(|| {
                    Arc::new(Mutex::new(PredictionWindow::new(self.config, block_size)))
                })
                .clone(),
        };
        let mut w = window.lock();
        w.record(predicted, reported)
    }

    /// Every model's state, sorted by model.
    pub fn states(&self) -> Vec<ModelCheckState> {
        let mut out: Vec<ModelCheckState> = self
            .models
            .read()
            .iter()
            .map(|(model, w)| {
                let w = w.lock();
                let (requests, predicted_tokens, reported_tokens) = w.totals();
                ModelCheckState {
                    model: model.clone(),
                    mismatch: w.mismatch(),
                    requests,
                    predicted_tokens,
                    reported_tokens,
                }
            })
            .collect();
        out.sort_by(|a, b| a.model.cmp(&b.model));
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scan(chunks: &[&[u8]]) -> Option<u64> {
        let mut s = CachedTokensScanner::default();
        for c in chunks {
            s.feed(c);
        }
        s.last()
    }

    #[test]
    fn the_openai_usage_and_the_sglang_meta_info_forms_are_both_read() {
        let openai =
            br#"{"usage":{"prompt_tokens":300,"prompt_tokens_details":{"cached_tokens":256}}}"#;
        assert_eq!(scan(&[openai]), Some(256));
        let sglang = br#"{"text":"x","meta_info":{"prompt_tokens":40,"cached_tokens": 32,"e2e_latency":0.1}}"#;
        assert_eq!(scan(&[sglang]), Some(32));
        assert_eq!(scan(&[br#"{"usage":{"prompt_tokens":3}}"#]), None);
        assert_eq!(scan(&[br#"{"cached_tokens":null}"#]), None);
    }

    #[test]
    fn a_key_or_number_split_at_any_chunk_boundary_is_still_read() {
        let body = br#"data: {"choices":[]}\n\ndata: {"usage":{"prompt_tokens_details":{"cached_tokens":12345}}}\n\ndata: [DONE]\n\n"#;
        for cut in 1..body.len() {
            assert_eq!(
                scan(&[&body[..cut], &body[cut..]]),
                Some(12345),
                "cut at {cut}"
            );
        }
        // One byte at a time.
        let bytes: Vec<&[u8]> = body.chunks(1).collect();
        assert_eq!(scan(&bytes), Some(12345));
    }

    #[test]
    fn the_last_value_of_a_stream_wins() {
        let a = br#"data: {"meta_info":{"cached_tokens":16}}"#;
        let b = br#"data: {"meta_info":{"cached_tokens":32}}"#;
        assert_eq!(scan(&[a, b]), Some(32));
    }

    #[test]
    fn classification_needs_a_whole_block_of_difference() {
        use PredictionResult::*;
        assert_eq!(PredictionResult::classify(160, 160, 16), Exact);
        assert_eq!(PredictionResult::classify(160, 150, 16), Exact);
        assert_eq!(PredictionResult::classify(160, 144, 16), Over);
        assert_eq!(PredictionResult::classify(0, 16, 16), Under);
    }

    fn window(n: usize) -> PredictionWindow {
        PredictionWindow::new(
            PredictionCheckConfig {
                window_requests: n,
                tolerance: 0.5,
            },
            16,
        )
    }

    #[test]
    fn a_router_that_predicts_nothing_while_engines_reuse_much_raises_under_once() {
        let mut w = window(10);
        let mut raised = Vec::new();
        for _ in 0..30 {
            if let Some(t) = w.record(0, 256) {
                raised.push(t);
            }
        }
        assert_eq!(
            raised,
            vec![CheckTransition::Raised {
                direction: Mismatch::Under,
                predicted: 0,
                reported: 2_560
            }]
        );
        assert_eq!(w.mismatch(), Some(Mismatch::Under));
    }

    #[test]
    fn predictions_far_above_the_reports_raise_over() {
        let mut w = window(4);
        let t: Vec<_> = (0..4).filter_map(|_| w.record(320, 16)).collect();
        assert!(matches!(
            t[..],
            [CheckTransition::Raised {
                direction: Mismatch::Over,
                ..
            }]
        ));
    }

    #[test]
    fn agreeing_predictions_never_raise_and_a_partial_window_is_not_judged() {
        let mut w = window(50);
        for i in 0..49 {
            assert_eq!(w.record(0, 512), None, "window not full at {i}");
        }
        let mut w = window(50);
        for i in 0..1_000u64 {
            // Within the tolerance: the engine reuses a block less now and then.
            let reported = if i % 3 == 0 { 240 } else { 256 };
            assert_eq!(w.record(256, reported), None);
        }
        assert_eq!(w.mismatch(), None);
    }

    #[test]
    fn too_little_reuse_is_not_judged() {
        let mut w = window(10);
        for _ in 0..100 {
            // Less than a block per request on both sides.
            assert_eq!(w.record(0, 8), None);
        }
    }

    #[test]
    fn the_flag_clears_only_below_half_the_tolerance() {
        let mut w = window(4);
        for _ in 0..4 {
            w.record(0, 256);
        }
        assert_eq!(w.mismatch(), Some(Mismatch::Under));
        // Disagreement 40 %: under the tolerance, above half of it: stays raised.
        for _ in 0..4 {
            assert_eq!(w.record(150, 250), None);
        }
        assert_eq!(w.mismatch(), Some(Mismatch::Under));
        let cleared: Vec<_> = (0..4).filter_map(|_| w.record(256, 256)).collect();
        assert!(matches!(cleared[..], [CheckTransition::Cleared { .. }]));
        assert_eq!(w.mismatch(), None);
    }

    #[test]
    fn a_zero_window_turns_the_check_off() {
        let mut w = window(0);
        for _ in 0..10 {
            assert_eq!(w.record(0, 1_000), None);
        }
    }
}
