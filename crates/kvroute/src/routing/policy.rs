//! Routing policies and the cache-aware cost model.
//!
//! Every policy turns a list of routable rank candidates into an ORDER (best first): the first is
//! the choice, the rest are the retry targets if the first cannot be reached. Unroutable ranks
//! (unhealthy, ejected) are filtered out before a policy ever sees them, so no policy can pick one.
//!
//! Cost model of `cache_aware`: the estimated time to first token on a rank, in milliseconds,
//!
//! ```text
//! uncached  = prompt_tokens - device_hit_tokens - offloaded_hit_tokens * (1 - offloaded_fraction)
//! held_elsewhere = uncached tokens another rank holds (the fleet's deepest match past this one's)
//! displaced = held_elsewhere + max(0, uncached - held_elsewhere - cache_room_tokens)
//!             (= uncached when the room is unknown)
//! queued_us = min(queued_prefill_tokens * prefill_cost_us_per_token, prefill_backlog_us)
//! cost_ms   = ( (uncached + displaced * eviction_cost_fraction) * prefill_cost_us_per_token
//!             + queued_us + in_flight * decode_penalty_us_per_request ) / 1000
//! ```
//!
//! where hit tokens come from the rank's contiguous matched prefix (blocks * block size; blocks in
//! a host/disk tier count as partially paid; blocks pending on the rank, routed there but not yet
//! confirmed by KV events, count as device blocks), `queued_prefill_tokens` is the router's estimate of
//! prompt tokens it sent to the rank that have not started answering, `prefill_backlog_us` is the
//! same work on a virtual clock (each dispatch adds its prefill time after the rank's previous
//! virtual finish time), so work sent long enough ago stops counting even before its first byte
//! is seen, and `in_flight` is the larger
//! of the router's own count and the engine-reported running + waiting requests (the engine sees
//! traffic from other routers; the router sees its own dispatches before the engine reports them).
//! The router's count includes its siblings' shared bookings unless the engine pushed a report
//! within the last load-share frame interval (`Router::plan`: such a report has already dropped
//! requests that a sibling's last frame still holds).
//! `eviction_cost_fraction` charges each uncached token for the cached block its insertion
//! displaces once the rank's cache is full (see [`CostWeights::eviction_cost_fraction`]); it is
//! not time the request waits, so the prefill work booked on the rank leaves it out. A prompt's
//! NEW tokens (cached on no rank) displace nothing while they fit the rank's free room
//! (`RankInput::cache_room_tokens`, known when the engine names its capacity and the index
//! counts the rank's whole cache): without that, a rank nobody had used yet looked as full as
//! the others, a new prompt went to a warm rank for the few shared blocks it holds, and ranks
//! stayed empty while the others evicted conversations still running (docs/BENCHMARKS.md, "Long
//! conversations against the peers"). Tokens another rank already holds are charged whatever
//! the room: a second copy of them takes room new content would use, and pricing it as free
//! sent the demo's opening burst to cold copies of system prompts that one rank was already
//! prefilling.
//! With `temperature_ms = 0` the cheapest rank wins (exact ties broken at random so equal cold
//! ranks share load); otherwise a rank is drawn with probability proportional to
//! `exp(-(cost_ms - min_cost_ms) / temperature_ms)`.
//!
//! Bounded-load guard (see [`within_load_bound`]): before that choice, ranks whose in-flight
//! requests (this one included) exceed `load_bound_factor` x the mean per rank plus
//! `load_bound_slack_requests` are set aside while any rank is within the bound; they stay in
//! the order as retry targets. The guard exists because the cost model's errors on a rank under
//! cache pressure reinforce themselves (see the function's comment); it never decides among
//! ranks that are all within it.

use std::sync::atomic::{AtomicU64, Ordering};

use clap::ValueEnum;
use parking_lot::Mutex;
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};

/// Routing policy selected by `--policy`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum PolicyKind {
    CacheAware,
    RoundRobin,
    Random,
    PowerOfTwo,
    LeastLoad,
}

impl PolicyKind {
    pub fn as_str(self) -> &'static str {
        match self {
            PolicyKind::CacheAware => "cache_aware",
            PolicyKind::RoundRobin => "round_robin",
            PolicyKind::Random => "random",
            PolicyKind::PowerOfTwo => "power_of_two",
            PolicyKind::LeastLoad => "least_load",
        }
    }

    pub const ALL: [PolicyKind; 5] = [
        PolicyKind::CacheAware,
        PolicyKind::RoundRobin,
        PolicyKind::Random,
        PolicyKind::PowerOfTwo,
        PolicyKind::LeastLoad,
    ];
}

/// Weights of the cache-aware cost model (see `policy` for the formula).
#[derive(Debug, Clone, Copy)]
pub struct CostWeights {
    /// Estimated prefill time per uncached prompt token, in microseconds.
    pub prefill_cost_us_per_token: f64,
    /// Estimated delay one in-flight (decoding) request adds to a new request's first token, in
    /// microseconds.
    pub decode_penalty_us_per_request: f64,
    /// Fraction of a full prefill a block found only in a host/disk tier still costs (loading it
    /// back is cheaper than recomputing, but not free).
    pub offloaded_block_cost_fraction: f64,
    /// Share of a token's prefill charged ON TOP for each uncached token: once a rank's cache
    /// is full, every block a prefill inserts displaces a cached one, and some of those are
    /// the tails of conversations still running there, whose next turns then recompute them
    /// (and displace others in turn). The model otherwise prices a cold placement at its own
    /// compute only, and under cache pressure moves conversations and opens new ones onto
    /// busy caches more often than pays. Charged only for the tokens past the rank's free room
    /// when that is known (`RankInput::cache_room_tokens`). 0 = ignore displacement.
    pub eviction_cost_fraction: f64,
    /// Softmax temperature over the cost in milliseconds; 0 picks the argmin.
    pub temperature_ms: f64,
    /// Bounded-load guard: a rank whose in-flight requests (this one included) would exceed
    /// `load_bound_factor` x the fleet's mean plus `load_bound_slack_requests` is not chosen
    /// first while another rank is within the bound, whatever its cache. 0 = no guard.
    pub load_bound_factor: f64,
    /// Requests a rank may carry above `load_bound_factor` x the mean (affinity is nearly free at
    /// low load: a second request sharing a prefix should still land with the first).
    pub load_bound_slack_requests: f64,
}

impl Default for CostWeights {
    fn default() -> Self {
        CostWeights {
            prefill_cost_us_per_token: 50.0,
            decode_penalty_us_per_request: 2_000.0,
            offloaded_block_cost_fraction: 0.3,
            eviction_cost_fraction: DEFAULT_EVICTION_COST_FRACTION,
            temperature_ms: 0.0,
            load_bound_factor: DEFAULT_LOAD_BOUND_FACTOR,
            load_bound_slack_requests: DEFAULT_LOAD_BOUND_SLACK_REQUESTS,
        }
    }
}

/// Default bounded-load factor: a rank may carry twice the mean in-flight load (plus the slack)
/// before the cache stops being allowed to pull more work onto it. Chosen on the demo's mixed
/// load (docs/BENCHMARKS.md): 2.0 removed the herding rounds and kept the median hit rate; 1.5
/// also removed them but cost hit rate.
pub const DEFAULT_LOAD_BOUND_FACTOR: f64 = 2.0;
/// Default slack of the bound, in requests: on an idle fleet a rank can still take a second
/// request sharing its prefix (with 8 ranks a third waits until the fleet's mean load rises),
/// so light traffic keeps its affinity and the guard acts only on real imbalance.
pub const DEFAULT_LOAD_BOUND_SLACK_REQUESTS: f64 = 2.0;
/// Default `eviction_cost_fraction`: chosen on the demo's mixed load, whose caches hold about
/// half its working set (docs/BENCHMARKS.md, "Displacement in the cost model"): 0.3 raised the
/// hit rate by about a point and cut p90 TTFT with one router and with four, and left the
/// long-conversation and uniform workloads within their noise.
pub const DEFAULT_EVICTION_COST_FRACTION: f64 = 0.3;
/// Largest accepted `--eviction-cost-fraction`.
pub const EVICTION_COST_FRACTION_MAX: f64 = 10.0;
/// Largest accepted `--load-bound-factor` (beyond it the guard can never act).
pub const LOAD_BOUND_FACTOR_MAX: f64 = 1_000.0;
/// Largest accepted `--load-bound-slack-requests`.
pub const LOAD_BOUND_SLACK_REQUESTS_MAX: f64 = 1_000_000.0;

/// Retries a request may make after its first choice (`--max-retries` is refused above it).
pub const RETRIES_MAX: u32 = 16;
/// Up to this many ranks a decision's order lists them all (`/debug/route` shows each rank's
/// place); beyond, the first choice and the [`RETRIES_MAX`] cheapest others.
pub const ORDER_FULL_RANKS_MAX: usize = 64;
/// A rank whose cost exceeds the cheapest by more than this many temperatures gets probability
/// 0 without computing `exp`: its weight (< e^-40, about 4e-18) is below what an f64 sum with
/// the cheapest rank's weight of 1 can hold.
const NEGLIGIBLE_WEIGHT_EXPONENT: f64 = 40.0;

/// Engine-reported queue depth of one rank (from the KV plane's LoadStat feed).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct EngineLoad {
    pub running: u64,
    pub waiting: u64,
}

impl From<kvroute_wire::LoadStat> for EngineLoad {
    fn from(stat: kvroute_wire::LoadStat) -> Self {
        EngineLoad {
            running: stat.num_running_reqs,
            waiting: stat.num_waiting_reqs,
        }
    }
}

/// What a policy knows about one routable rank.
#[derive(Debug, Clone, Copy)]
pub struct RankInput {
    /// Contiguous prefix blocks the rank holds or will hold: the index's match extended by the
    /// rank's pending blocks (see `crate::routing::pending`); the cost model reads this.
    pub matched_blocks: u32,
    pub device_blocks: u32,
    /// The part of `matched_blocks` that only pending entries vouch for (display and metrics).
    pub pending_blocks: u32,
    pub in_flight: i64,
    pub queued_prefill_tokens: i64,
    /// The rank's queued prefill by virtual time (`RankLoad::prefill_backlog_us`): caps the
    /// token-based queue estimate, which ignores how long ago that work was sent.
    /// `f64::INFINITY` = no cap.
    pub prefill_backlog_us: f64,
    pub engine: Option<EngineLoad>,
    /// Tokens the rank's cache can still take before a prefill displaces a cached block, when
    /// its capacity and occupancy are known (`Router::plan`); [`CacheRoom::UNKNOWN`] otherwise,
    /// and every uncached token displaces one.
    pub cache_room_tokens: CacheRoom,
}

/// A rank's free cache room in tokens, or unknown. Four bytes, which fit `RankInput`'s padding,
/// so a rank's input stays one cache line (64 bytes, asserted in a test): the scoring loop
/// reads a thousand of them per request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CacheRoom(u32);

impl CacheRoom {
    pub const UNKNOWN: CacheRoom = CacheRoom(u32::MAX);

    /// A known room of `tokens` (clamped to 0 and to the largest value it can hold, about four
    /// billion tokens, far past any engine's cache).
    pub fn tokens(tokens: f64) -> CacheRoom {
        CacheRoom(tokens.clamp(0.0, (u32::MAX - 1) as f64) as u32)
    }

    pub fn get(self) -> Option<f64> {
        (self != CacheRoom::UNKNOWN).then_some(self.0 as f64)
    }
}

impl RankInput {
    pub fn effective_in_flight(&self) -> f64 {
        let router = self.in_flight.max(0) as f64;
        match self.engine {
            Some(e) => router.max((e.running + e.waiting) as f64),
            None => router,
        }
    }
}

#[derive(Debug, Clone, Copy, serde::Serialize)]
pub struct RankScore {
    pub uncached_tokens: f64,
    pub cost_ms: f64,
    pub probability: f64,
    /// False when cache_aware's bounded-load guard set the rank aside for the first choice
    /// (see [`within_load_bound`]); always true for the other policies.
    pub within_load_bound: bool,
}

#[derive(Debug, Clone)]
pub struct Decision {
    /// Indices into the candidate list, best first.
    pub order: Vec<usize>,
    pub reason: &'static str,
    /// One per candidate (cost model for cache_aware; load-only cost for the others).
    pub scores: Vec<RankScore>,
}

pub struct Policy {
    pub kind: PolicyKind,
    pub weights: CostWeights,
    round_robin_next: AtomicU64,
    rng: Mutex<StdRng>,
}

/// Milliseconds per microsecond: costs are converted by a multiplication, which the scoring loop
/// over a thousand ranks pays for far less than a division.
const MS_PER_US: f64 = 1e-3;

/// The cost model (see the module comment) for one rank, given the deepest match any rank of
/// the fleet has for the prompt (`fleet_matched_blocks`). Uncached tokens that another rank
/// already holds are charged for displacement whatever the rank's free room: a second copy of
/// blocks the fleet holds takes room that new content would use. Only the prompt's new tokens
/// (cached nowhere) fill a rank's free room for free.
// Inlined into `decide`'s scoring loop: as a call, `policy.decide` over 1,024 ranks took
// 16-17 us instead of 11-12 us (docs/BENCHMARKS.md, routing hot path).
#[inline]
pub fn score_in_fleet(
    input: &RankInput,
    prompt_tokens: usize,
    block_size: usize,
    fleet_matched_blocks: u32,
    w: &CostWeights,
) -> RankScore {
    let bs = block_size as f64;
    let device = input.device_blocks.min(input.matched_blocks) as f64 * bs;
    let offloaded = (input.matched_blocks.saturating_sub(input.device_blocks)) as f64 * bs;
    let uncached =
        (prompt_tokens as f64 - device - offloaded * (1.0 - w.offloaded_block_cost_fraction))
            .max(0.0);
    let displaced = displaced_tokens(
        input,
        prompt_tokens,
        block_size,
        fleet_matched_blocks,
        uncached,
    );
    let queued_us = (input.queued_prefill_tokens.max(0) as f64 * w.prefill_cost_us_per_token)
        .min(input.prefill_backlog_us.max(0.0));
    let cost_us = uncached * w.prefill_cost_us_per_token
        + displaced * w.prefill_cost_us_per_token * w.eviction_cost_fraction
        + queued_us
        + input.effective_in_flight() * w.decode_penalty_us_per_request;
    RankScore {
        uncached_tokens: uncached,
        cost_ms: cost_us * MS_PER_US,
        probability: 0.0,
        within_load_bound: true,
    }
}

/// Of a rank's `uncached` tokens for a prompt, those charged for a cached block they displace
/// (see [`score_in_fleet`]): all of them when the rank's room is unknown; else the ones another
/// rank holds (past this rank's match, up to the fleet's deepest) plus the new ones past the
/// room.
#[inline]
pub fn displaced_tokens(
    input: &RankInput,
    prompt_tokens: usize,
    block_size: usize,
    fleet_matched_blocks: u32,
    uncached: f64,
) -> f64 {
    let Some(room) = input.cache_room_tokens.get() else {
        return uncached;
    };
    let bs = block_size as f64;
    let held_elsewhere = (fleet_matched_blocks.saturating_sub(input.matched_blocks) as f64 * bs)
        .min(prompt_tokens as f64 - input.matched_blocks as f64 * bs)
        .clamp(0.0, uncached);
    let new = uncached - held_elsewhere;
    held_elsewhere + (new - room).max(0.0)
}

impl Policy {
    pub fn new(kind: PolicyKind, weights: CostWeights, seed: Option<u64>) -> Policy {
        let rng = match seed {
            Some(s) => StdRng::seed_from_u64(s),
            None => StdRng::from_os_rng(),
        };
        Policy {
            kind,
            weights,
            round_robin_next: AtomicU64::new(0),
            rng: Mutex::new(rng),
        }
    }

    /// Orders `ranks` (all routable) for a prompt of `prompt_tokens` tokens. `ranks` must not be
    /// empty.
    /// The prefill time (us) the cost model books on a rank for `uncached_tokens`: what a
    /// dispatch queues on the rank's virtual clock, and what a cold prompt's owner queues for
    /// the sibling that routes it.
    pub fn prefill_work_us(&self, uncached_tokens: i64) -> u64 {
        (uncached_tokens.max(0) as f64 * self.weights.prefill_cost_us_per_token) as u64
    }

    pub fn decide(&self, ranks: &[RankInput], prompt_tokens: usize, block_size: usize) -> Decision {
        // Every pass over the ranks costs a few microseconds in a 1,024-rank fleet, so the
        // cache-aware path makes as few as it can: scoring sums the load the guard needs, one
        // pass marks the guard and gathers every figure the choice and its reason read
        // (`CostSummary`), one draws the choice, one lists the retries.
        let n = ranks.len();
        let mut scores: Vec<RankScore> = Vec::with_capacity(n);
        let mut in_flight_total = 0.0;
        // What another rank holds decides how much of a prefill duplicates the fleet's cache
        // (`score_in_fleet`); only a rank with a known free room reads it.
        let fleet_matched_blocks = ranks.iter().map(|r| r.matched_blocks).max().unwrap_or(0);
        for r in ranks {
            scores.push(score_in_fleet(
                r,
                prompt_tokens,
                block_size,
                fleet_matched_blocks,
                &self.weights,
            ));
            in_flight_total += r.effective_in_flight();
        }
        let mut rng = self.rng.lock();
        let (order, reason) = match self.kind {
            PolicyKind::CacheAware => {
                let bound = load_bound_given(in_flight_total, n, &self.weights);
                let mut summary = CostSummary::new();
                for (s, r) in scores.iter_mut().zip(ranks) {
                    if let Some(bound) = bound {
                        s.within_load_bound = within_bound(r, bound);
                    }
                    summary.add(s, r.matched_blocks);
                }
                let first = self.pick_cache_aware(&mut scores, &summary, &mut rng);
                let order = order_with_first(first, n, |i| scores[i].cost_ms);
                let best_match = summary.max_matched_blocks;
                // Some rank the guard set aside is cheaper than the choice.
                let cheaper_set_aside = summary.min_set_aside < scores[first].cost_ms;
                let reason = if prompt_tokens == 0 {
                    "no_tokens"
                } else if cheaper_set_aside && scores[first].within_load_bound {
                    // A cheaper rank exists but the guard set it aside (when every rank is
                    // over the bound the guard stepped aside and the choice is over it too).
                    "load_bound"
                } else if best_match == 0 {
                    "cold"
                } else if ranks[first].matched_blocks == best_match {
                    // Only pending entries put the choice ahead: the prefix is still being
                    // prefilled there.
                    if ranks[first].pending_blocks > 0 {
                        "pending_hit"
                    } else {
                        "cache_hit"
                    }
                } else if displaced_tokens(
                    &ranks[first],
                    prompt_tokens,
                    block_size,
                    fleet_matched_blocks,
                    scores[first].uncached_tokens,
                ) < scores[first].uncached_tokens
                {
                    // A shallower match whose free cache room spared it the displacement
                    // charge (its load may have helped too).
                    "room_over_cache"
                } else {
                    "load_over_cache"
                };
                (order, reason)
            }
            PolicyKind::RoundRobin => {
                let start =
                    (self.round_robin_next.fetch_add(1, Ordering::Relaxed) % n as u64) as usize;
                ((0..n).map(|i| (start + i) % n).collect(), "round_robin")
            }
            PolicyKind::Random => {
                let mut order: Vec<usize> = (0..n).collect();
                order.shuffle(&mut *rng);
                (order, "random")
            }
            PolicyKind::PowerOfTwo => {
                let a = rng.random_range(0..n);
                let b = if n > 1 {
                    (a + 1 + rng.random_range(0..n - 1)) % n
                } else {
                    a
                };
                let load = |i: usize| {
                    ranks[i].effective_in_flight() * 1e9 + ranks[i].queued_prefill_tokens as f64
                };
                let first = if load(b) < load(a) { b } else { a };
                (order_with_first(first, n, load), "power_of_two")
            }
            PolicyKind::LeastLoad => {
                let load = |i: usize| {
                    ranks[i].effective_in_flight() * 1e9 + ranks[i].queued_prefill_tokens as f64
                };
                let min = (0..n).map(load).fold(f64::INFINITY, f64::min);
                let ties: Vec<usize> = (0..n).filter(|&i| load(i) == min).collect();
                let first = ties[rng.random_range(0..ties.len())];
                (order_with_first(first, n, load), "least_load")
            }
        };
        if self.kind != PolicyKind::CacheAware {
            for (i, s) in scores.iter_mut().enumerate() {
                s.probability = if i == order[0] { 1.0 } else { 0.0 };
            }
        }
        Decision {
            order,
            reason,
            scores,
        }
    }

    /// Fills in probabilities and draws the first choice among the ranks within the load bound
    /// (all of them when none is).
    fn pick_cache_aware(
        &self,
        scores: &mut [RankScore],
        summary: &CostSummary,
        rng: &mut StdRng,
    ) -> usize {
        let any_within = summary.any_within;
        let eligible = |s: &RankScore| !any_within || s.within_load_bound;
        let (min, ties) = if any_within {
            (summary.min_within, summary.ties_within)
        } else {
            (summary.min_all, summary.ties_all)
        };
        let t = self.weights.temperature_ms;
        if t <= 0.0 {
            if ties == 0 {
                // No comparable cost (every eligible one is NaN): the first eligible rank, never
                // an empty draw.
                return scores.iter().position(eligible).unwrap_or(0);
            }
            // The drawn tie is found by its place among the ties: the same draw as indexing a
            // list of them, without building the list per request.
            let share = 1.0 / ties as f64;
            let drawn = rng.random_range(0..ties);
            let mut chosen = 0;
            let mut seen = 0;
            for (i, s) in scores.iter_mut().enumerate() {
                if eligible(s) && s.cost_ms <= min {
                    s.probability = share;
                    if seen == drawn {
                        chosen = i;
                    }
                    seen += 1;
                }
            }
            return chosen;
        }
        let mut total = 0.0;
        for s in scores.iter_mut() {
            let exponent = (s.cost_ms - min) / t;
            s.probability = if eligible(s) && exponent <= NEGLIGIBLE_WEIGHT_EXPONENT {
                (-exponent).exp()
            } else {
                0.0
            };
            total += s.probability;
        }
        for s in scores.iter_mut() {
            s.probability /= total;
        }
        let mut x = rng.random::<f64>();
        for (i, s) in scores.iter().enumerate() {
            if x < s.probability {
                return i;
            }
            x -= s.probability;
        }
        scores.len() - 1
    }
}

/// Which ranks may be chosen first under the bounded-load guard: a rank is within the bound when
/// its in-flight requests plus this one stay at or below `load_bound_factor` x the mean in-flight
/// per rank (this request counted) plus `load_bound_slack_requests`. All true when the guard is
/// off.
///
/// Why a guard on top of the cost model: the model's queue estimate is a prediction, and on an
/// engine under cache pressure it errs in the direction that feeds itself: the prefix a rank
/// holds at routing time is evicted by the work queued ahead before the request's turn comes, so
/// the rank is slower than predicted exactly when it is most attractive. A conversation's
/// growing history then ties it ever harder to that rank, and a popular tenant ends up on one
/// rank (what both peers' cache_aware do to a mixed load). Bounding each rank's share of the
/// in-flight work relative to the mean (consistent hashing with bounded loads, Mirrokni et al.)
/// caps that failure whatever its cause, and leaves the cost model in charge everywhere else.
pub fn within_load_bound(ranks: &[RankInput], w: &CostWeights) -> Vec<bool> {
    match load_bound(ranks, w) {
        None => vec![true; ranks.len()],
        Some(bound) => ranks.iter().map(|r| within_bound(r, bound)).collect(),
    }
}

/// The guard's rule for one rank: its in-flight requests, this one included, stay at or below
/// `bound`.
fn within_bound(r: &RankInput, bound: f64) -> bool {
    r.effective_in_flight() + 1.0 <= bound
}

/// The in-flight bound of [`within_load_bound`], `None` when the guard is off.
fn load_bound(ranks: &[RankInput], w: &CostWeights) -> Option<f64> {
    let total: f64 = ranks.iter().map(RankInput::effective_in_flight).sum();
    load_bound_given(total, ranks.len(), w)
}

/// [`load_bound`] from the fleet's summed in-flight requests (`total`, over `ranks` ranks).
fn load_bound_given(total: f64, ranks: usize, w: &CostWeights) -> Option<f64> {
    if w.load_bound_factor <= 0.0 || ranks < 2 {
        return None;
    }
    let mean_with_this = (total + 1.0) / ranks as f64;
    Some(w.load_bound_factor * mean_with_this + w.load_bound_slack_requests.max(0.0))
}

/// What cache_aware's choice and its reason read of all the ranks' scores, gathered in one
/// pass: the cheapest cost (and how many ranks tie at it) within the load bound and overall,
/// the cheapest rank the guard set aside, and the deepest match.
struct CostSummary {
    any_within: bool,
    min_within: f64,
    ties_within: usize,
    min_all: f64,
    ties_all: usize,
    min_set_aside: f64,
    max_matched_blocks: u32,
}

impl CostSummary {
    fn new() -> Self {
        CostSummary {
            any_within: false,
            min_within: f64::INFINITY,
            ties_within: 0,
            min_all: f64::INFINITY,
            ties_all: 0,
            min_set_aside: f64::INFINITY,
            max_matched_blocks: 0,
        }
    }

    fn add(&mut self, s: &RankScore, matched_blocks: u32) {
        // A running minimum with its count of ties: a cheaper cost restarts the count, an equal
        // one adds to it (a cost of infinity ties with the starting minimum and is counted, as
        // a list of the ranks at the minimum would have held it).
        fn take(min: &mut f64, ties: &mut usize, cost: f64) {
            if cost < *min {
                *min = cost;
                *ties = 1;
            } else if cost == *min {
                *ties += 1;
            }
        }
        take(&mut self.min_all, &mut self.ties_all, s.cost_ms);
        if s.within_load_bound {
            self.any_within = true;
            take(&mut self.min_within, &mut self.ties_within, s.cost_ms);
        } else {
            self.min_set_aside = self.min_set_aside.min(s.cost_ms);
        }
        self.max_matched_blocks = self.max_matched_blocks.max(matched_blocks);
    }
}

/// `first`, then every other index by ascending `key`.
/// The first choice, then the other ranks cheapest first. Up to [`ORDER_FULL_RANKS_MAX`] ranks
/// every rank is listed; beyond, only the [`RETRIES_MAX`] cheapest others, found by selection
/// rather than a full sort: a request never reaches further down the order than its retries,
/// and sorting a thousand ranks would cost more than the rest of the decision.
fn order_with_first(first: usize, n: usize, key: impl Fn(usize) -> f64) -> Vec<usize> {
    let by_key = |a: &(f64, usize), b: &(f64, usize)| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1));
    let keep = RETRIES_MAX as usize;
    let rest: Vec<(f64, usize)> = if n > ORDER_FULL_RANKS_MAX && n - 1 > keep {
        // The `keep` cheapest, kept sorted as they are found: most ranks lose one comparison
        // against the current last and are never stored, where collecting all of them and
        // selecting cost a thousand-entry list per request.
        // Indices are visited in increasing order, so a cost equal to the last kept one loses
        // on the index: one plain comparison turns away almost every rank (NaN until `keep`
        // are kept, which no comparison passes).
        let mut best: Vec<(f64, usize)> = Vec::with_capacity(keep + 1);
        let mut worst_kept_cost = f64::NAN;
        for i in (0..n).filter(|&i| i != first) {
            let cost = key(i);
            if cost >= worst_kept_cost {
                continue;
            }
            let item = (cost, i);
            if best.len() == keep && by_key(&item, &best[keep - 1]).is_ge() {
                continue;
            }
            let at = best.partition_point(|b| by_key(b, &item).is_lt());
            best.insert(at, item);
            best.truncate(keep);
            if best.len() == keep {
                worst_kept_cost = best[keep - 1].0;
            }
        }
        best
    } else {
        let mut all: Vec<(f64, usize)> = (0..n)
            .filter(|&i| i != first)
            .map(|i| (key(i), i))
            .collect();
        all.sort_unstable_by(by_key);
        all
    };
    let mut order = Vec::with_capacity(rest.len() + 1);
    order.push(first);
    order.extend(rest.into_iter().map(|(_, i)| i));
    order
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use rand::Rng;

    /// The order as the policy defined it before it kept only the cheapest retries by
    /// insertion: every other rank sorted by (cost, index), cut to the retries past
    /// `ORDER_FULL_RANKS_MAX` ranks.
    fn reference_order(first: usize, costs: &[f64]) -> Vec<usize> {
        let mut rest: Vec<(f64, usize)> = (0..costs.len())
            .filter(|&i| i != first)
            .map(|i| (costs[i], i))
            .collect();
        rest.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)));
        if costs.len() > ORDER_FULL_RANKS_MAX {
            rest.truncate(RETRIES_MAX as usize);
        }
        std::iter::once(first)
            .chain(rest.into_iter().map(|(_, i)| i))
            .collect()
    }

    proptest! {
        // Costs drawn from a few values so ties (broken by index) are common.
        #[test]
        fn the_order_lists_the_same_ranks_as_a_full_sort_at_every_fleet_size(
            costs in prop::collection::vec(prop::sample::select(vec![0.5, 1.0, 1.0, 2.0, 7.25, 30.0]), 1..300),
            first_pick in any::<prop::sample::Index>(),
        ) {
            let first = first_pick.index(costs.len());
            prop_assert_eq!(
                order_with_first(first, costs.len(), |i| costs[i]),
                reference_order(first, &costs)
            );
        }

    }

    proptest! {
        // The decision against its rules written out in full (eligible = within the bound
        // unless no rank is; the draw, which counts ties instead of listing them, picks for a
        // seed the rank a list of the eligible ranks at the minimum would; every tie gets the
        // same probability; the retries are a full sort), on fleets below and above the
        // full-order limit, cold ones with hundreds of ties among them, with the guard off,
        // loose (the default), and so tight that no rank is within it.
        #[test]
        fn the_decision_draws_among_its_eligible_ties_and_orders_the_rest_as_a_full_sort(
            ranks in prop::collection::vec(
                (prop::sample::select(vec![0u32, 0, 4, 8]), prop::sample::select(vec![0i64, 0, 1, 3, 12])),
                1..300,
            ),
            factor in prop::sample::select(vec![0.0, 0.3, 2.0]),
            seed in any::<u64>(),
        ) {
            let inputs: Vec<RankInput> = ranks.iter().map(|&(m, l)| loaded(m, l)).collect();
            let weights = CostWeights {
                load_bound_factor: factor,
                load_bound_slack_requests: if factor < 1.0 { 0.0 } else { 2.0 },
                ..CostWeights::default()
            };
            let p = Policy::new(PolicyKind::CacheAware, weights, Some(seed));
            let d = p.decide(&inputs, 8 * 16, 16);
            let bound = load_bound(&inputs, &weights);
            let within: Vec<bool> = inputs
                .iter()
                .map(|r| bound.is_none_or(|b| r.effective_in_flight() + 1.0 <= b))
                .collect();
            let any_within = within.iter().any(|&w| w);
            let eligible: Vec<usize> = (0..inputs.len()).filter(|&i| !any_within || within[i]).collect();
            let min = eligible.iter().map(|&i| d.scores[i].cost_ms).fold(f64::INFINITY, f64::min);
            let ties: Vec<usize> = eligible.iter().copied().filter(|&i| d.scores[i].cost_ms <= min).collect();
            let mut rng = StdRng::seed_from_u64(seed);
            prop_assert_eq!(d.order[0], ties[rng.random_range(0..ties.len())]);
            let costs: Vec<f64> = d.scores.iter().map(|s| s.cost_ms).collect();
            prop_assert_eq!(&d.order, &reference_order(d.order[0], &costs));
            for (i, s) in d.scores.iter().enumerate() {
                prop_assert_eq!(s.within_load_bound, within[i]);
                let expected = if ties.contains(&i) { 1.0 / ties.len() as f64 } else { 0.0 };
                prop_assert!((s.probability - expected).abs() < 1e-12);
            }
        }
    }

    fn idle(matched: u32) -> RankInput {
        RankInput {
            matched_blocks: matched,
            device_blocks: matched,
            pending_blocks: 0,
            in_flight: 0,
            queued_prefill_tokens: 0,
            prefill_backlog_us: f64::INFINITY,
            engine: None,
            cache_room_tokens: CacheRoom::UNKNOWN,
        }
    }

    /// [`score_in_fleet`] for a rank whose match no other rank exceeds (nothing it would
    /// prefill is cached elsewhere).
    fn score(
        input: &RankInput,
        prompt_tokens: usize,
        block_size: usize,
        w: &CostWeights,
    ) -> RankScore {
        score_in_fleet(input, prompt_tokens, block_size, input.matched_blocks, w)
    }

    /// Round weights for the displacement tests: 0.1 ms a token, half of that per displaced one.
    fn displacement_weights() -> CostWeights {
        CostWeights {
            prefill_cost_us_per_token: 100.0,
            eviction_cost_fraction: 0.5,
            ..CostWeights::default()
        }
    }

    fn policy(kind: PolicyKind) -> Policy {
        Policy::new(kind, CostWeights::default(), Some(1))
    }

    fn loaded(matched: u32, in_flight: i64) -> RankInput {
        RankInput {
            in_flight,
            ..idle(matched)
        }
    }

    fn guarded(factor: f64, slack: f64) -> Policy {
        let weights = CostWeights {
            load_bound_factor: factor,
            load_bound_slack_requests: slack,
            ..CostWeights::default()
        };
        Policy::new(PolicyKind::CacheAware, weights, Some(1))
    }

    #[test]
    fn past_the_full_order_limit_the_order_is_the_choice_then_the_cheapest_retry_targets() {
        let p = policy(PolicyKind::CacheAware);
        // Rank i has i blocks of a 200-block prompt cached: cost falls with i.
        let ranks: Vec<RankInput> = (0..200u32).map(|i| idle(i % 100)).collect();
        let d = p.decide(&ranks, 200 * 16, 16);
        assert_eq!(d.order.len(), 1 + RETRIES_MAX as usize);
        assert_eq!(d.scores.len(), 200, "every rank is still scored");
        let first = d.order[0];
        let mut others: Vec<usize> = (0..200).filter(|&i| i != first).collect();
        others.sort_by(|&a, &b| {
            d.scores[a]
                .cost_ms
                .total_cmp(&d.scores[b].cost_ms)
                .then(a.cmp(&b))
        });
        assert_eq!(&d.order[1..], &others[..RETRIES_MAX as usize]);
        // Within the limit every rank is listed.
        let small: Vec<RankInput> = (0..ORDER_FULL_RANKS_MAX as u32).map(idle).collect();
        assert_eq!(
            p.decide(&small, 64 * 16, 16).order.len(),
            ORDER_FULL_RANKS_MAX
        );
    }

    #[test]
    fn the_load_bound_sends_work_away_from_a_cached_rank_past_its_share() {
        // A 4,096-token prompt fully cached on rank 0, which carries 10 requests: by the cost
        // model alone (10 x 2 ms against 4,096 x 50 us of prefill) rank 0 still wins.
        let ranks = [loaded(256, 10), idle(0), idle(0), idle(0)];
        let unguarded = guarded(0.0, 0.0).decide(&ranks, 4096, 16);
        assert_eq!(unguarded.order[0], 0);
        assert_eq!(unguarded.reason, "cache_hit");
        // Mean with this request 11/4; bound 2 x 2.75 + 2 = 7.5 < 11: rank 0 is out.
        assert_eq!(
            within_load_bound(&ranks, &guarded(2.0, 2.0).weights),
            vec![false, true, true, true]
        );
        let d = guarded(2.0, 2.0).decide(&ranks, 4096, 16);
        assert_ne!(d.order[0], 0, "scores {:?}", d.scores);
        assert_eq!(d.reason, "load_bound");
        assert_eq!(d.scores[0].probability, 0.0);
        assert!(!d.scores[0].within_load_bound && d.scores[1].within_load_bound);
        assert!(
            d.order.contains(&0),
            "the bounded rank stays a retry target"
        );
    }

    #[test]
    fn at_low_load_the_bound_leaves_affinity_alone() {
        // Rank 0 holds the prefix and carries 2 requests: mean with this one 3/4, bound
        // 2 x 0.75 + 2 = 3.5 >= 3, so requests sharing a prefix still land together.
        let ranks = [loaded(8, 2), idle(0), idle(0), idle(0)];
        assert!(within_load_bound(&ranks, &guarded(2.0, 2.0).weights)[0]);
        let d = guarded(2.0, 2.0).decide(&ranks, 128, 16);
        assert_eq!(d.order[0], 0);
        assert_eq!(d.reason, "cache_hit");
        // On an idle fleet of 8 a rank takes a second request (bound 2 x 2/8 + 2 = 2.5 >= 2) but
        // not a third (2 x 3/8 + 2 = 2.75 < 3), as the slack's documentation says.
        let mut eight = vec![idle(0); 8];
        eight[0] = loaded(8, 1);
        assert!(within_load_bound(&eight, &guarded(2.0, 2.0).weights)[0]);
        eight[0] = loaded(8, 2);
        assert!(!within_load_bound(&eight, &guarded(2.0, 2.0).weights)[0]);
    }

    #[test]
    fn when_no_rank_is_within_the_bound_the_cost_model_decides_alone() {
        // A factor below 1 with no slack can put every rank over the bound; the guard then
        // steps aside instead of refusing to route.
        let ranks = [loaded(8, 5), loaded(0, 5)];
        assert_eq!(
            within_load_bound(&ranks, &guarded(0.5, 0.0).weights),
            vec![false, false]
        );
        let d = guarded(0.5, 0.0).decide(&ranks, 128, 16);
        assert_eq!(d.order[0], 0);
        assert_eq!(d.reason, "cache_hit");
        // A single rank is always within its own bound.
        assert_eq!(
            within_load_bound(&[loaded(0, 50)], &guarded(2.0, 0.0).weights),
            vec![true]
        );
    }

    #[test]
    fn cache_aware_prefers_the_rank_holding_the_prefix_when_loads_are_equal() {
        let d = policy(PolicyKind::CacheAware).decide(&[idle(0), idle(6), idle(2)], 128, 16);
        assert_eq!(d.order, vec![1, 2, 0]);
        assert_eq!(d.reason, "cache_hit");
        assert!(d.scores[1].cost_ms < d.scores[2].cost_ms);
    }

    #[test]
    fn a_choice_won_by_pending_blocks_is_reported_as_a_pending_hit() {
        let mut pending = idle(6);
        pending.pending_blocks = 4;
        let d = policy(PolicyKind::CacheAware).decide(&[idle(2), pending], 128, 16);
        assert_eq!(d.order[0], 1);
        assert_eq!(d.reason, "pending_hit");
    }

    #[test]
    fn cache_aware_leaves_a_cached_rank_that_is_overloaded() {
        let mut busy = idle(8);
        busy.in_flight = 50;
        let d = policy(PolicyKind::CacheAware).decide(&[busy, idle(0)], 128, 16);
        assert_eq!(d.order[0], 1);
        assert_eq!(d.reason, "load_over_cache");
    }

    #[test]
    fn engine_reported_load_counts_when_it_exceeds_the_routers_own() {
        let mut a = idle(0);
        a.engine = Some(EngineLoad {
            running: 10,
            waiting: 5,
        });
        assert_eq!(a.effective_in_flight(), 15.0);
        let d = policy(PolicyKind::CacheAware).decide(&[a, idle(0)], 64, 16);
        assert_eq!(d.order[0], 1);
    }

    #[test]
    fn only_the_tokens_past_a_ranks_free_room_are_charged_for_displacement() {
        let w = displacement_weights();
        let cost = |room: Option<f64>| {
            score(
                &RankInput {
                    cache_room_tokens: room.map_or(CacheRoom::UNKNOWN, CacheRoom::tokens),
                    ..idle(0)
                },
                1_000,
                16,
                &w,
            )
            .cost_ms
        };
        // 1,000 uncached tokens at 0.1 ms each, plus half of that for each displaced token.
        assert_eq!(cost(None), 150.0, "unknown room: every token displaces");
        assert_eq!(cost(Some(0.0)), 150.0, "a full cache");
        assert_eq!(cost(Some(600.0)), 120.0, "400 tokens past the room");
        assert_eq!(cost(Some(1_000.0)), 100.0, "the prompt fits");
        assert_eq!(cost(Some(1e9)), 100.0, "an empty cache");
        assert_eq!(cost(Some(-5.0)), 150.0, "a room below zero is none");
    }

    #[test]
    fn a_copy_of_what_another_rank_holds_is_charged_whatever_the_room() {
        let w = displacement_weights();
        let empty = RankInput {
            cache_room_tokens: CacheRoom::tokens(1e9),
            ..idle(0)
        };
        let displaced = |input: &RankInput, fleet_matched: u32| {
            let uncached = score(input, 1_000, 16, &w).uncached_tokens;
            displaced_tokens(input, 1_000, 16, fleet_matched, uncached)
        };
        assert_eq!(displaced(&empty, 0), 0.0, "all new: the room takes it");
        assert_eq!(score_in_fleet(&empty, 1_000, 16, 0, &w).cost_ms, 100.0);
        assert_eq!(displaced(&empty, 32), 512.0, "32 blocks another rank holds");
        let half_elsewhere = score_in_fleet(&empty, 1_000, 16, 32, &w).cost_ms;
        assert!((half_elsewhere - (100.0 + 512.0 * 0.05)).abs() < 1e-9);
        assert_eq!(
            displaced(&empty, 1_000),
            1_000.0,
            "a match past the prompt's end counts the prompt only"
        );
        let holding_some = RankInput {
            cache_room_tokens: CacheRoom::tokens(1e9),
            ..idle(16)
        };
        assert_eq!(score(&holding_some, 1_000, 16, &w).uncached_tokens, 744.0);
        assert_eq!(
            displaced(&holding_some, 32),
            256.0,
            "only the 16 blocks past its own match are held elsewhere"
        );
        let unknown = RankInput {
            cache_room_tokens: CacheRoom::UNKNOWN,
            ..empty
        };
        assert_eq!(
            displaced(&unknown, 32),
            1_000.0,
            "an unknown room: every uncached token"
        );
    }

    #[test]
    fn a_room_is_four_bytes_that_clamp_and_never_read_as_unknown() {
        assert_eq!(CacheRoom::tokens(-5.0).get(), Some(0.0));
        assert_eq!(CacheRoom::tokens(1e30).get(), Some((u32::MAX - 1) as f64));
        assert_eq!(CacheRoom::UNKNOWN.get(), None);
        assert_eq!(
            std::mem::size_of::<RankInput>(),
            64,
            "one cache line per rank in the scoring loop"
        );
    }

    #[test]
    fn a_burst_of_one_cold_prompt_stays_on_the_rank_prefilling_it_however_empty_the_others() {
        // Rank 0 is prefilling the prompt's whole opening (pending, 64 blocks); rank 1 is empty
        // and idle. A second copy on rank 1 would duplicate the 1,024 tokens.
        let prefilling = RankInput {
            pending_blocks: 64,
            in_flight: 1,
            queued_prefill_tokens: 1_024,
            prefill_backlog_us: 51_200.0,
            cache_room_tokens: CacheRoom::tokens(4_096.0),
            ..idle(64)
        };
        let empty = RankInput {
            cache_room_tokens: CacheRoom::tokens(5_120.0),
            ..idle(0)
        };
        let d = policy(PolicyKind::CacheAware).decide(&[prefilling, empty], 1_100, 16);
        assert_eq!(d.order[0], 0, "{:?}", d.scores);
        assert_eq!(d.reason, "pending_hit");
    }

    #[test]
    fn a_new_prompt_fills_an_empty_rank_before_it_displaces_a_full_ranks_conversations() {
        // Rank 0 is full and holds the prompt's shared opening (32 blocks, 512 tokens); rank 1
        // is empty. With both rooms unknown the shared opening wins; once rank 1's room is
        // known, what the prompt would evict on rank 0 outweighs the opening it would reuse.
        let prompt_tokens = 12_000;
        let full_with_opening = RankInput {
            cache_room_tokens: CacheRoom::tokens(0.0),
            ..idle(32)
        };
        let empty = RankInput {
            cache_room_tokens: CacheRoom::tokens(65_536.0),
            ..idle(0)
        };
        let p = policy(PolicyKind::CacheAware);
        let unknown = |r: RankInput| RankInput {
            cache_room_tokens: CacheRoom::UNKNOWN,
            ..r
        };
        let d = p.decide(
            &[unknown(full_with_opening), unknown(empty)],
            prompt_tokens,
            16,
        );
        assert_eq!(d.order[0], 0, "rooms unknown: the shared opening decides");
        let d = p.decide(&[full_with_opening, empty], prompt_tokens, 16);
        assert_eq!(
            d.order[0], 1,
            "the empty rank, whose room holds the whole prompt"
        );
        assert_eq!(d.reason, "room_over_cache");
    }

    #[test]
    fn queued_prefill_is_charged_only_as_long_as_its_virtual_backlog() {
        let w = CostWeights::default();
        let queued = RankInput {
            queued_prefill_tokens: 1_000,
            ..idle(0)
        };
        let full = score(&queued, 64, 16, &w).cost_ms;
        let decayed = score(
            &RankInput {
                prefill_backlog_us: 5_000.0,
                ..queued
            },
            64,
            16,
            &w,
        )
        .cost_ms;
        let drained = score(
            &RankInput {
                prefill_backlog_us: 0.0,
                ..queued
            },
            64,
            16,
            &w,
        )
        .cost_ms;
        let cold = score(&idle(0), 64, 16, &w).cost_ms;
        assert!(
            (full - cold - 1_000.0 * w.prefill_cost_us_per_token / 1000.0).abs() < 1e-9,
            "no backlog cap: the whole token estimate counts ({full} vs {cold})"
        );
        assert!(
            (decayed - cold - 5.0).abs() < 1e-9,
            "the backlog caps the queue at 5 ms ({decayed} vs {cold})"
        );
        assert!(
            (drained - cold).abs() < 1e-9,
            "a drained backlog charges nothing"
        );
    }

    #[test]
    fn displacement_is_charged_on_uncached_tokens_and_never_on_the_queue() {
        let none = CostWeights {
            eviction_cost_fraction: 0.0,
            ..CostWeights::default()
        };
        let half = CostWeights {
            eviction_cost_fraction: 0.5,
            ..CostWeights::default()
        };
        // 64 uncached tokens at 50 us: 3.2 ms of compute, 1.6 ms more for what they displace.
        let cold_none = score(&idle(0), 64, 16, &none).cost_ms;
        let cold_half = score(&idle(0), 64, 16, &half).cost_ms;
        assert!((cold_none - 3.2).abs() < 1e-9, "{cold_none}");
        assert!((cold_half - 4.8).abs() < 1e-9, "{cold_half}");
        // Fully cached behind a queue of 100 tokens: the queue is time, not insertion.
        let queued = RankInput {
            queued_prefill_tokens: 100,
            ..idle(4)
        };
        let queued_none = score(&queued, 64, 16, &none);
        let queued_half = score(&queued, 64, 16, &half);
        assert_eq!(queued_none.uncached_tokens, 0.0);
        assert!((queued_none.cost_ms - queued_half.cost_ms).abs() < 1e-12);
        assert!(
            (queued_half.cost_ms - 5.0).abs() < 1e-9,
            "{}",
            queued_half.cost_ms
        );
    }

    #[test]
    fn charging_displacement_keeps_a_conversation_on_its_rank_through_a_queue_its_compute_alone_would_leave()
     {
        // Rank 0 holds 100 of the prompt's 120 blocks behind 90 ms of queued prefill; rank 1 is
        // idle and cold. Compute alone: 16 + 90 = 106 ms against 96 ms cold, so the
        // conversation moves, and its 1,920 tokens land in another full cache. With the
        // displacement charged at 0.3: 20.8 + 90 = 110.8 ms against 124.8 ms, so it stays.
        let holder = RankInput {
            queued_prefill_tokens: 1_800,
            ..idle(100)
        };
        let ranks = [holder, idle(0)];
        let with = |fraction: f64| {
            let w = CostWeights {
                eviction_cost_fraction: fraction,
                load_bound_factor: 0.0,
                ..CostWeights::default()
            };
            Policy::new(PolicyKind::CacheAware, w, Some(1)).decide(&ranks, 1_920, 16)
        };
        let moved = with(0.0);
        assert_eq!(moved.order[0], 1, "{:?}", moved.scores);
        assert_eq!(moved.reason, "load_over_cache");
        let stayed = with(0.3);
        assert_eq!(stayed.order[0], 0, "{:?}", stayed.scores);
        assert_eq!(stayed.reason, "cache_hit");
    }

    #[test]
    fn offloaded_blocks_are_worth_less_than_device_blocks() {
        let w = CostWeights::default();
        let device = score(&idle(4), 64, 16, &w);
        let offloaded = score(
            &RankInput {
                device_blocks: 0,
                ..idle(4)
            },
            64,
            16,
            &w,
        );
        let cold = score(&idle(0), 64, 16, &w);
        assert!(device.cost_ms < offloaded.cost_ms && offloaded.cost_ms < cold.cost_ms);
    }

    #[test]
    fn positive_temperature_spreads_choices_and_zero_temperature_does_not() {
        let ranks = [idle(1), idle(0)];
        let mut w = CostWeights {
            temperature_ms: 1000.0,
            ..CostWeights::default()
        };
        let hot = Policy::new(PolicyKind::CacheAware, w, Some(3));
        let picks: std::collections::HashSet<usize> = (0..200)
            .map(|_| hot.decide(&ranks, 32, 16).order[0])
            .collect();
        assert_eq!(
            picks.len(),
            2,
            "a huge temperature must sometimes pick the costlier rank"
        );
        w.temperature_ms = 0.0;
        let cold = Policy::new(PolicyKind::CacheAware, w, Some(3));
        assert!((0..200).all(|_| cold.decide(&ranks, 32, 16).order[0] == 0));
    }

    #[test]
    fn round_robin_cycles_through_every_rank() {
        let p = policy(PolicyKind::RoundRobin);
        let firsts: Vec<usize> = (0..6)
            .map(|_| p.decide(&[idle(0); 3], 0, 16).order[0])
            .collect();
        assert_eq!(firsts, vec![0, 1, 2, 0, 1, 2]);
    }

    #[test]
    fn least_load_and_power_of_two_avoid_the_loaded_rank() {
        let mut busy = idle(0);
        busy.in_flight = 3;
        let d = policy(PolicyKind::LeastLoad).decide(&[busy, idle(0)], 0, 16);
        assert_eq!(d.order, vec![1, 0]);
        let p = policy(PolicyKind::PowerOfTwo);
        // With two ranks both are always sampled, so the idle one must win every time.
        assert!((0..50).all(|_| p.decide(&[busy, idle(0)], 0, 16).order[0] == 1));
    }

    #[test]
    fn every_order_is_a_permutation_of_the_candidates() {
        for kind in PolicyKind::ALL {
            let p = policy(kind);
            let d = p.decide(&[idle(0), idle(1), idle(2), idle(3)], 64, 16);
            let mut o = d.order.clone();
            o.sort();
            assert_eq!(o, vec![0, 1, 2, 3], "{kind:?}");
        }
    }
}
