//! Choosing ranks for one request: resolve its model group, score every routable rank (the
//! index's per-rank prefix depth, pending prefixes and load, through the policy) and order them,
//! then (cache_aware) record the prompt's unconfirmed blocks as pending on the chosen rank.
//!
//! Synchronous and lock-light on purpose: the model group is an `Arc` snapshot, per-rank load is
//! atomics, and the prompt's block hashes and the pending walk live in a thread-local scratch, so
//! planning allocates nothing per request and holds nothing across an await. `/debug/route` plans
//! through the same code without recording, so looking never changes what the next request sees.

use std::cell::RefCell;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use crate::control::registry::{ModelGroup, Worker};
use crate::control::router::Router;
use crate::error::ApiError;
use crate::peer::cold_owner::{self, ColdDeferral, ColdPlacement};
use crate::peer::owner_standings::AskOutcome;
use crate::routing::pending::{RankKey, RankWalk};
use crate::routing::policy::{CacheRoom, Decision, EngineLoad, RankInput};

/// `first_candidate` of a worker that is not routable now (it has no candidates).
const NOT_ROUTABLE: usize = usize::MAX;

thread_local! {
    /// Per routing thread: the request's block hashes and the pending walk's per-rank state,
    /// reused so planning allocates neither.
    static PLAN_SCRATCH: RefCell<(Vec<u64>, Vec<RankWalk>)> = const { RefCell::new((Vec::new(), Vec::new())) };
}

/// One routable rank of the request's model.
///
/// The worker is named by its position in the plan's model group, not by a clone of its `Arc`:
/// a plan makes one candidate per rank, and cloning (then dropping) the worker's `Arc` for each
/// was two atomic writes per rank per request on counters every routing thread shares.
#[derive(Clone)]
pub struct RankCandidate {
    /// Position of the rank's worker in the plan's `model.workers`.
    pub worker_position: usize,
    pub dp_rank: u32,
    pub input: RankInput,
}

pub struct RoutePlan {
    pub model: Arc<ModelGroup>,
    pub candidates: Vec<RankCandidate>,
    pub decision: Decision,
    pub prompt_tokens: usize,
    pub indexed: bool,
    /// Set when the prompt is cold and another replica owns its prefix: nothing was recorded,
    /// and the caller asks the owner, then calls [`Router::settle_cold`].
    pub cold_deferral: Option<ColdDeferral>,
    /// The candidate whose prefill work the cold prompt's owner already queued on its own
    /// clock (and shares): dispatching there books the request, not the work again. `None`
    /// also when the owner queued no work (it found the prompt cached): the dispatch then
    /// books this replica's own estimate, as for any request.
    pub prefill_booked_by_owner: Option<usize>,
    /// How long this replica waited for the owner of its cold prompt (answered or not), in
    /// microseconds; `None` when nobody was asked. Named in `x-kvroute-decision`, because on a
    /// busy machine it is a visible part of the request's time to first token.
    pub owner_wait_us: Option<u64>,
}

/// Who places a cold prompt, when ownership is in force.
enum ColdRole {
    /// This replica owns it: it places it here, under the cold-placement lock.
    Mine,
    /// A sibling owns it: the plan is deferred to it.
    Theirs(kvroute_discovery::PeerUrl),
}

/// What a plan may change besides choosing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum PlanMode {
    /// The routing path: record the pending prefix, or defer a cold prompt to its owner.
    Route,
    /// `/debug/route`: change nothing.
    Preview,
    /// Placing a sibling's cold prompt as its owner: record, never defer again.
    Owner,
}

impl RoutePlan {
    pub fn chosen(&self) -> &RankCandidate {
        &self.candidates[self.decision.order[0]]
    }

    /// The worker serving candidate `c` of this plan.
    pub fn worker(&self, c: &RankCandidate) -> &Arc<Worker> {
        &self.model.workers[c.worker_position]
    }

    /// Compact one-line explanation for the `x-kvroute-decision` header.
    pub fn header_value(&self, policy: &str, idx: usize) -> String {
        let c = &self.candidates[idx];
        let s = &self.decision.scores[idx];
        let worker = self.worker(c);
        let mut value = format!(
            "policy={policy};reason={};worker={};url={};dp_rank={};matched_blocks={};prompt_tokens={};cost_ms={:.3};candidates={};pending_blocks={}",
            self.decision.reason,
            worker.id,
            worker.url,
            c.dp_rank,
            c.input.matched_blocks,
            self.prompt_tokens,
            s.cost_ms,
            self.candidates.len(),
            c.input.pending_blocks
        );
        if let Some(us) = self.owner_wait_us {
            use std::fmt::Write as _;
            // Cannot fail: writing to a String.
            let _ = write!(value, ";owner_wait_ms={:.3}", us as f64 / 1000.0);
        }
        value
    }
}

fn rank_key(group: &ModelGroup, c: &RankCandidate) -> RankKey {
    RankKey {
        worker: group.workers[c.worker_position].id,
        dp_rank: c.dp_rank,
    }
}

impl Router {
    /// The model group a request names (or the only one when it names none).
    pub fn resolve_model(&self, model: Option<&str>) -> Result<Arc<ModelGroup>, ApiError> {
        match model {
            Some(m) => self
                .registry
                .model(m)
                .ok_or_else(|| ApiError::UnknownModel(m.to_string())),
            None => self
                .registry
                .sole_model()
                .ok_or_else(|| ApiError::MissingField {
                    message: "'model' is required when the router serves several models (or none)"
                        .into(),
                    param: "model".into(),
                }),
        }
    }

    /// Scores every routable rank of `group` for `tokens` and orders them, and (cache_aware)
    /// records the prompt's blocks as pending on the chosen rank: the routing path.
    pub fn plan(&self, group: Arc<ModelGroup>, tokens: &[u32]) -> Result<RoutePlan, ApiError> {
        self.plan_inner(group, tokens, tokens.len(), PlanMode::Route)
    }

    /// [`Router::plan`] for a prompt of `prompt_tokens` tokens of which `tokens` are the first
    /// ones: a chat tokenized only in its head (`crate::routing::tokenize`), whose length the
    /// cost model reads as an estimate.
    pub fn plan_sized(
        &self,
        group: Arc<ModelGroup>,
        tokens: &[u32],
        prompt_tokens: usize,
    ) -> Result<RoutePlan, ApiError> {
        self.plan_inner(group, tokens, prompt_tokens, PlanMode::Route)
    }

    /// Plans a sibling's cold prompt as its owner (`crate::peer::cold_owner`): records the
    /// pending prefix on the chosen rank like the routing path, queues the prompt's prefill on
    /// that rank's clock as this replica's own work (its frames share it), counts the request
    /// in this replica's cost model for a few frame intervals (the sibling books and shares the
    /// request itself), and never defers to another owner.
    pub fn plan_as_owner(
        &self,
        group: Arc<ModelGroup>,
        tokens: &[u32],
        prompt_tokens: usize,
    ) -> Result<ColdPlacement, ApiError> {
        let plan = self.plan_inner(group, tokens, prompt_tokens, PlanMode::Owner)?;
        let chosen = plan.chosen();
        let worker = plan.worker(chosen);
        let uncached = plan.decision.scores[plan.decision.order[0]].uncached_tokens as i64;
        let prefill_booked_us = self.policy.prefill_work_us(uncached);
        if let Some(rank) = worker.ranks.get(chosen.dp_rank as usize) {
            rank.reserve_prefill(crate::control::registry::clock_us(), prefill_booked_us);
            cold_owner::book_placed(self, rank.clone(), uncached.max(0));
        }
        Ok(ColdPlacement {
            worker_url: worker.url.clone(),
            dp_rank: chosen.dp_rank,
            prefill_booked_us,
        })
    }

    /// Finishes a plan deferred to a cold prompt's owner: routes to the owner's rank when this
    /// replica can (`placement`), else keeps its own choice, then records and publishes the
    /// pending prefix as the routing path does; `waited` (the ask's time) goes to the decision
    /// header as `owner_wait_ms`. A plan with no deferral is left unchanged.
    pub fn settle_cold(
        &self,
        plan: &mut RoutePlan,
        placement: Option<&ColdPlacement>,
        waited: std::time::Duration,
    ) {
        let Some(deferral) = plan.cold_deferral.take() else {
            return;
        };
        plan.owner_wait_us = Some(u64::try_from(waited.as_micros()).unwrap_or(u64::MAX));
        self.cold_owner_standings.lock().record(
            &deferral.owner,
            if placement.is_some() {
                AskOutcome::Answered
            } else {
                AskOutcome::Failed
            },
            crate::control::registry::clock_us(),
        );
        let outcome = match placement {
            None => "owner_failed",
            Some(p) => {
                let at = plan.decision.order.iter().position(|&i| {
                    let c = &plan.candidates[i];
                    c.dp_rank == p.dp_rank && plan.worker(c).url == p.worker_url
                });
                match at {
                    Some(at) => {
                        let i = plan.decision.order.remove(at);
                        plan.decision.order.insert(0, i);
                        plan.decision.reason = "cold_owner";
                        plan.prefill_booked_by_owner = (p.prefill_booked_us > 0).then_some(i);
                        "owner_chose"
                    }
                    None => "owner_rank_unknown",
                }
            }
        };
        self.metrics
            .cold_placements
            .with_label_values(&[outcome])
            .inc();
        let chosen = plan.chosen().clone();
        self.record_pending_choice(&plan.model, &deferral.hashes, &chosen, Instant::now());
    }

    /// Extends the pending prefix of a prompt routed on its head (`routing::tokenize`) once its
    /// whole tokens are known: the blocks past the head become pending on the rank it was
    /// routed to, as if it had been tokenized whole on the path, so a copy of the same document
    /// that comes while its first prefill runs follows it there (with only the head pending,
    /// waiting behind that prefill looks dearer than computing it again elsewhere).
    pub fn extend_pending(&self, group: &ModelGroup, chosen: &RankCandidate, tokens: &[u32]) {
        if self.policy.kind != crate::routing::policy::PolicyKind::CacheAware
            || !self.pending.enabled()
        {
            return;
        }
        let mut hashes = Vec::new();
        crate::routing::kv::hash_blocks(tokens, group.block_size, &mut hashes);
        self.record_pending_choice(group, &hashes, chosen, Instant::now());
    }

    /// Records the prompt's blocks the chosen rank neither holds nor has pending, and offers
    /// them to the siblings' streams.
    fn record_pending_choice(
        &self,
        group: &ModelGroup,
        hashes: &[u64],
        chosen: &RankCandidate,
        now: Instant,
    ) {
        // Only blocks neither indexed nor already pending there: an existing entry is not
        // refreshed, because the request that made it is the one that will produce those
        // blocks, so its TTL is the right horizon (and a stream of requests for a prefix that
        // is never confirmed cannot keep it alive forever).
        self.pending.record(
            &group.name,
            hashes,
            chosen.input.matched_blocks as usize,
            rank_key(group, chosen),
            now,
            chosen.input.pending_blocks > 0,
        );
        // The same hint for the siblings (load sharing), so a cold prefix's next request
        // follows this one whichever replica it reaches.
        self.load_share.publish_pending(
            &group.name,
            &group.workers[chosen.worker_position].url,
            chosen.dp_rank,
            hashes
                .get(chosen.input.matched_blocks as usize..)
                .unwrap_or(&[]),
        );
    }

    /// Who places a prompt (`crate::peer::cold_owner`): `None` when it is not cold or ownership
    /// is not in force (off, this replica's name unknown, no siblings), else this replica or
    /// the sibling that owns it. Only a cold prompt reads the sibling set.
    fn cold_role(
        &self,
        prompt_tokens: usize,
        hashes: &[u64],
        best_held: usize,
    ) -> Option<ColdRole> {
        let scope = self.config.load_share.cold_owner;
        if scope == cold_owner::ColdOwnerScope::Off
            || !cold_owner::is_cold(best_held, hashes.len())
            || prompt_tokens > cold_owner::COLD_PLACE_TOKENS_MAX
        {
            return None;
        }
        let me = self.self_peer.get()?;
        let key = cold_owner::owner_key(scope, hashes)?;
        let siblings = self.cold_owner_candidates();
        if siblings.is_empty() {
            return None;
        }
        let owner = cold_owner::owner_of(key, me, &siblings);
        Some(if owner == me {
            ColdRole::Mine
        } else {
            ColdRole::Theirs(owner.clone())
        })
    }

    /// The siblings that may own a cold prompt: those in the registry that this replica hears
    /// (a fresh bookings stream, when load sharing is on) and has not set aside for failed asks
    /// (`crate::peer::owner_standings`). A sibling that is gone or silent owns nothing, so
    /// no prompt waits on it; every replica that stops hearing it drops it alike, and they
    /// agree on the next owner.
    fn cold_owner_candidates(&self) -> Vec<kvroute_discovery::PeerUrl> {
        let now_us = crate::control::registry::clock_us();
        let mut siblings = self.peers.snapshot().peers;
        if self.config.load_share.enabled {
            let stale_us = self.config.load_share.stale_ms.saturating_mul(1_000);
            let tables = self.load_share.tables.lock();
            siblings.retain(|s| tables.get(s).is_some_and(|t| t.is_fresh(now_us, stale_us)));
        }
        let standings = self.cold_owner_standings.lock();
        siblings.retain(|s| standings.askable(s, now_us));
        siblings
    }

    /// Like [`Router::plan`] but without side effects on routing state (no pending entries):
    /// for `/debug/route`, so inspecting a decision never changes the next one.
    pub fn plan_preview(
        &self,
        group: Arc<ModelGroup>,
        tokens: &[u32],
    ) -> Result<RoutePlan, ApiError> {
        self.plan_inner(group, tokens, tokens.len(), PlanMode::Preview)
    }

    /// [`Router::plan_preview`] for a prompt of `prompt_tokens` tokens of which `tokens` are
    /// the first ones (see [`Router::plan_sized`]).
    pub fn plan_preview_sized(
        &self,
        group: Arc<ModelGroup>,
        tokens: &[u32],
        prompt_tokens: usize,
    ) -> Result<RoutePlan, ApiError> {
        self.plan_inner(group, tokens, prompt_tokens, PlanMode::Preview)
    }

    fn plan_inner(
        &self,
        group: Arc<ModelGroup>,
        tokens: &[u32],
        prompt_tokens: usize,
        mode: PlanMode,
    ) -> Result<RoutePlan, ApiError> {
        // A prompt is never shorter than the tokens in hand (an estimate for a head may be).
        let prompt_tokens = prompt_tokens.max(tokens.len());
        let started = Instant::now();
        let now = started;
        let now_us = crate::control::registry::clock_us();
        let mut candidates = Vec::with_capacity(group.workers.len() * 2);
        // Where each worker's ranks start among the candidates (`NOT_ROUTABLE` when it has
        // none), so the index's per-rank matches find their candidate by position.
        let mut first_candidate = Vec::with_capacity(group.workers.len());
        // How old an engine's pushed load report may be and still be trusted over the siblings'
        // in-flight bookings: younger than one of their frames. Such a report has counted every
        // router's admitted requests AND already dropped the ones that finished, which a
        // sibling's bookings keep counting until its next frame: a conversation's next turn,
        // sent the moment its previous answer ended and reaching another replica, found that
        // answer still in flight on its own rank, and moved off its cached tail (three times as
        // often as one router moved such turns; docs/BENCHMARKS.md). What the report has not
        // seen yet are the siblings' dispatches still in transit, for the time an engine takes
        // to admit a request; an engine that reports only periodically sends reports older than
        // a frame, and the bookings count as before. Kept as an instant, so each rank costs one
        // comparison (a plan may read a thousand ranks).
        let engine_report_trusted_after =
            now.checked_sub(Duration::from_millis(self.config.load_share.interval_ms));
        for (position, w) in group.workers.iter().enumerate() {
            if !w.routable(now) {
                first_candidate.push(NOT_ROUTABLE);
                continue;
            }
            first_candidate.push(candidates.len());
            self.kv.with_engine_loads(&w.url, |pushed| {
                for (r, load) in w.ranks.iter().enumerate() {
                    let slot = pushed.get(r);
                    let reported = slot.and_then(|s| s.load());
                    let sibling_in_flight = siblings_in_flight_counted(
                        load.sibling_in_flight.load(Ordering::Relaxed),
                        reported.map(|report| report.received_at),
                        engine_report_trusted_after,
                    );
                    let pushed = reported.map(|report| EngineLoad::from(report.stat));
                    let queued_prefill_tokens =
                        load.queued_prefill_tokens.load(Ordering::Relaxed).max(0)
                            + load.sibling_queued_prefill_tokens.load(Ordering::Relaxed)
                            + load
                                .placed_queued_prefill_tokens
                                .load(Ordering::Relaxed)
                                .max(0);
                    candidates.push(RankCandidate {
                        worker_position: position,
                        dp_rank: r as u32,
                        input: RankInput {
                            matched_blocks: 0,
                            device_blocks: 0,
                            pending_blocks: 0,
                            // Own bookings plus the siblings' (0 without load sharing, or while
                            // the engine's own report is fresher, above): what the engine has
                            // queued from the whole fleet of routers, as far as we know.
                            in_flight: load.in_flight.load(Ordering::Relaxed).max(0)
                                + sibling_in_flight
                                + load.placed_in_flight.load(Ordering::Relaxed).max(0),
                            queued_prefill_tokens,
                            prefill_backlog_us: load.fleet_prefill_backlog_us(now_us) as f64,
                            engine: crate::control::engine_metrics::engine_load_given(
                                self, w, r as u32, now_us, pushed,
                            ),
                            cache_room_tokens: cache_room(
                                reported
                                    .map(|report| report.stat.max_total_num_tokens)
                                    .filter(|&tokens| tokens > 0)
                                    .unwrap_or_else(|| {
                                        load.engine_metrics_capacity_tokens.load(Ordering::Relaxed)
                                    }),
                                slot.and_then(|s| s.cached_device_blocks()),
                                group.block_size,
                                queued_prefill_tokens,
                            ),
                        },
                    });
                }
            });
        }
        if candidates.is_empty() {
            return Err(ApiError::NoHealthyWorker(format!(
                "no healthy worker serves model '{}'",
                group.name
            )));
        }
        let needs_match = self.policy.kind == crate::routing::policy::PolicyKind::CacheAware
            && !tokens.is_empty();
        let mut block_size = group.block_size;
        let mut indexed = false;
        let mut cold_deferral = None;
        // The deepest prefix an engine has CONFIRMED (its KV events), before pending blocks
        // extend it: what decides whether the prompt is new to the fleet (`peer::cold_owner`).
        let mut best_held = 0usize;
        let decision = PLAN_SCRATCH.with(|scratch| {
            let (hashes, walks) = &mut *scratch.borrow_mut();
            hashes.clear();
            if needs_match
                && let Some(bs) =
                    self.kv
                        .match_prefix(&group.name, tokens, hashes, |url, dp, hit| {
                            let at = group
                                .worker_positions
                                .get(url)
                                .map(|&w| (first_candidate[w], group.workers[w].ranks.len()));
                            if let Some((first, ranks)) = at
                                && first != NOT_ROUTABLE
                                && (dp as usize) < ranks
                            {
                                let c = &mut candidates[first + dp as usize];
                                c.input.matched_blocks = hit.matched_blocks;
                                c.input.device_blocks = hit.device_blocks;
                                best_held = best_held.max(hit.matched_blocks as usize);
                            }
                        })
            {
                block_size = bs;
                indexed = true;
            }
            let use_pending = needs_match && self.pending.enabled();
            if use_pending && !indexed {
                // No index for this model (no KV events): pending entries alone still keep a
                // cold burst together, hashed at the group's block size.
                crate::routing::kv::hash_blocks(tokens, block_size, hashes);
            }
            let role = (use_pending && mode == PlanMode::Route)
                .then(|| self.cold_role(prompt_tokens, hashes, best_held))
                .flatten();
            // A cold prompt this replica places (as a sibling's owner, or its own prompt that
            // it owns) is placed under one lock, from reading the pending table to recording in
            // it: two such placements at the same instant would otherwise both see the prefix
            // nowhere and start it on two ranks, which is what ownership exists to prevent.
            let placing_cold =
                use_pending && (mode == PlanMode::Owner || matches!(role, Some(ColdRole::Mine)));
            let _cold_placement = placing_cold.then(|| self.cold_placement_lock.lock());
            if use_pending && let Some(table) = self.pending.model(&group.name) {
                walks.clear();
                walks.extend(candidates.iter().map(|c| {
                    RankWalk::new(
                        rank_key(&group, c),
                        c.input.matched_blocks,
                        c.input.device_blocks,
                    )
                }));
                table.extend(hashes, self.pending.now_ms(now), walks);
                for (c, w) in candidates.iter_mut().zip(walks.iter()) {
                    c.input.matched_blocks = w.blocks;
                    c.input.device_blocks = w.device_blocks;
                    c.input.pending_blocks = w.pending_blocks();
                }
            }
            let inputs: Vec<RankInput> = candidates.iter().map(|c| c.input).collect();
            let decision = self.policy.decide(&inputs, prompt_tokens, block_size);
            if use_pending && mode != PlanMode::Preview {
                match role {
                    Some(ColdRole::Theirs(owner)) => {
                        cold_deferral = Some(ColdDeferral {
                            owner,
                            hashes: hashes.clone(),
                        })
                    }
                    _ => self.record_pending_choice(
                        &group,
                        hashes,
                        &candidates[decision.order[0]],
                        now,
                    ),
                }
            }
            decision
        });
        let policy = self.policy.kind.as_str();
        self.metrics
            .routing_latency
            .with_label_values(&[policy])
            .observe(started.elapsed().as_secs_f64());
        Ok(RoutePlan {
            model: group,
            candidates,
            decision,
            prompt_tokens,
            indexed,
            cold_deferral,
            prefill_booked_by_owner: None,
            owner_wait_us: None,
        })
    }

    /// Records a routed decision in the metrics (not done for `/debug/route`).
    pub fn record_decision(&self, plan: &RoutePlan) {
        let policy = self.policy.kind.as_str();
        self.metrics
            .decisions
            .with_label_values(&[policy, plan.decision.reason])
            .inc();
        self.metrics
            .matched_blocks
            .with_label_values(&[&plan.model.name])
            .observe(plan.chosen().input.matched_blocks as f64);
    }
}

/// The siblings' in-flight bookings on a rank as the plan counts them: none while the engine's
/// own pushed report arrived after `trusted_after` (one load-share frame interval ago; `None`
/// when the monotonic clock does not reach back that far, so no report can be older), all of
/// them otherwise (no report, or one as old as a frame). See `plan_inner` for why.
fn siblings_in_flight_counted(
    siblings_in_flight: i64,
    engine_report_received_at: Option<Instant>,
    trusted_after: Option<Instant>,
) -> i64 {
    match engine_report_received_at {
        Some(at) if trusted_after.is_none_or(|after| at > after) => 0,
        _ => siblings_in_flight,
    }
}

/// Tokens a rank's cache can still take before a prefill displaces a cached block: the
/// engine's capacity in tokens (`max_total_num_tokens` of its load report, else vLLM's
/// `vllm:cache_config_info` from its `/metrics`; 0 when it names none) less the blocks the
/// index knows it holds (absent while the index's view of the rank is incomplete,
/// `kvroute_kv::engine_loads`) and the prefill already on its way there, which will be cached
/// too. Unknown when either figure is: the cost model then charges every uncached token for a
/// displaced one, as if the cache were full.
fn cache_room(
    capacity_tokens: u64,
    cached_device_blocks: Option<u64>,
    block_size: usize,
    queued_prefill_tokens: i64,
) -> CacheRoom {
    let Some(held_blocks) = cached_device_blocks.filter(|_| capacity_tokens > 0) else {
        return CacheRoom::UNKNOWN;
    };
    let held = held_blocks as f64 * block_size as f64;
    CacheRoom::tokens(capacity_tokens as f64 - held - queued_prefill_tokens.max(0) as f64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_ranks_cache_room_is_its_capacity_less_what_it_holds_and_what_is_on_its_way() {
        assert_eq!(
            cache_room(65_536, Some(1_000), 16, 4_000).get(),
            Some(65_536.0 - 16_000.0 - 4_000.0)
        );
        assert_eq!(
            cache_room(65_536, Some(0), 16, 0).get(),
            Some(65_536.0),
            "an empty rank"
        );
        assert_eq!(
            cache_room(65_536, Some(4_096), 16, 500).get(),
            Some(0.0),
            "a full rank has no room, never less than none"
        );
        assert_eq!(
            cache_room(0, Some(0), 16, 0),
            CacheRoom::UNKNOWN,
            "an engine that names no capacity"
        );
        assert_eq!(
            cache_room(65_536, None, 16, 0),
            CacheRoom::UNKNOWN,
            "an index whose view of the rank is incomplete"
        );
    }

    #[test]
    fn an_engine_report_younger_than_a_frame_replaces_the_siblings_in_flight_and_an_older_one_does_not()
     {
        let now = Instant::now() + Duration::from_secs(10);
        let frame = Duration::from_millis(5);
        let after = now.checked_sub(frame);
        assert_eq!(siblings_in_flight_counted(4, Some(now), after), 0);
        assert_eq!(
            siblings_in_flight_counted(4, Some(now - Duration::from_micros(4_999)), after),
            0,
            "just younger than a frame: the engine has seen every finish the frame has"
        );
        assert_eq!(
            siblings_in_flight_counted(4, Some(now - frame), after),
            4,
            "as old as a frame: the siblings' bookings may be fresher"
        );
        assert_eq!(
            siblings_in_flight_counted(4, Some(now - Duration::from_secs(3)), after),
            4
        );
        assert_eq!(
            siblings_in_flight_counted(4, None, after),
            4,
            "an engine without a load feed"
        );
        assert_eq!(
            siblings_in_flight_counted(4, Some(now - Duration::from_secs(3)), None),
            0,
            "a clock that does not reach back a frame: every report is younger than one"
        );
    }
}
