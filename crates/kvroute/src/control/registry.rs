//! Workers, the model groups they form, their ranks' router-side load, and their health.
//!
//! A worker is one engine URL serving one model with `dp_size` data-parallel ranks; a RANK
//! (worker, dp_rank) is what the router routes to. Workers are grouped by served model; each group
//! has its own tokenizer and block size (the index is per model inside the KV plane).
//!
//! The registry is read on every request and written only on membership changes, so it is a
//! `RwLock` around maps of `Arc`s: a request clones the `Arc<ModelGroup>` it needs and drops the
//! lock before any await. Per-rank load counters are atomics so dispatch never takes a lock.
//!
//! Health is an explicit state machine per worker ([`Health`]); see [`HealthState::on_event`] for
//! every transition. Passive failures (connection errors while proxying) and active checks
//! (`GET /health`) both feed it.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use parking_lot::{Mutex, RwLock};

use crate::routing::tokenize::ModelTokenizer;

pub type WorkerId = u64;

/// Router-side load of one rank: what the router itself has sent and not yet seen finish.
#[derive(Debug, Default)]
pub struct RankLoad {
    pub in_flight: AtomicI64,
    /// Estimated prompt tokens still to be prefilled: added at dispatch, removed when the first
    /// response byte arrives (the engine has finished prefill by then).
    pub queued_prefill_tokens: AtomicI64,
    pub dispatched_total: AtomicU64,
    /// When (on [`clock_us`]) the rank should be done with the prefill work the router sent it,
    /// were that work done one request after another at the cost model's rate: a virtual finish
    /// time, advanced at each dispatch from `max(now, itself)`. `queued_prefill_tokens` alone
    /// charges a dispatched prompt in full until its first byte comes back, so a request
    /// arriving 50 ms into a 57 ms prefill was charged 57 ms of waiting; the backlog decays as
    /// time passes, and the cost model takes the smaller of the two estimates.
    pub prefill_busy_until_us: AtomicU64,
    /// Prefill work (us, by the cost model) this router has ever sent the rank: a counter its
    /// siblings difference between two frames to learn how much work it added, whatever frames
    /// they missed (`crate::peer::load_share`).
    pub prefill_dispatched_us: AtomicU64,
    /// The rank's ONE prefill queue as this router knows it: its own work and the work its
    /// siblings reported sending, merged on one virtual clock. This, not a sum of per-router
    /// backlogs, is what the cost model reads: each router's own virtual clock drains as if the
    /// rank worked only for it, so with N routers feeding a rank the sum of their backlogs
    /// drains N times faster than the rank does, and a busy rank looks idle. Without siblings
    /// it equals `prefill_busy_until_us`.
    pub fleet_prefill_busy_until_us: AtomicU64,
    /// The siblings' bookings on this rank (`crate::peer::load_share`): written only by the
    /// load-share aggregator, read by the cost model next to the router's own counters.
    pub sibling_in_flight: AtomicI64,
    pub sibling_queued_prefill_tokens: AtomicI64,
    /// Requests this replica placed on the rank for a sibling as the owner of a cold prompt
    /// (`crate::peer::cold_owner`), counted until the siblings' summed bookings on the rank rise
    /// by as much (the sibling's own booking has reached this replica: the load-share aggregator
    /// hands the count over) or [`crate::peer::cold_owner::placed_booking_ms`] passes. Read by
    /// this replica's cost model only, never shared: the sibling shares the real booking.
    pub placed_in_flight: AtomicI64,
    pub placed_queued_prefill_tokens: AtomicI64,
    /// vLLM's running and waiting requests on this rank from its `/metrics`, and when (on
    /// [`clock_us`], 0 = never) they were read (see `crate::control::engine_metrics`).
    pub engine_metrics_running: AtomicU64,
    pub engine_metrics_waiting: AtomicU64,
    pub engine_metrics_at_us: AtomicU64,
    /// The rank's KV cache capacity in tokens from vLLM's `vllm:cache_config_info`
    /// (`num_gpu_blocks` x `block_size`), 0 = not known; engine configuration, so it does not
    /// age like the gauges.
    pub engine_metrics_capacity_tokens: AtomicU64,
    /// This rank's `kvroute_in_flight_requests` series, looked up by its labels once (first
    /// dispatch) instead of formatting and hashing them on every attempt.
    pub in_flight_gauge: std::sync::OnceLock<prometheus::IntGauge>,
}

/// A single server's queue on a virtual clock: work sent to an idle rank starts now, work sent
/// to a busy one starts when the queued work ends.
fn queue_after(busy_until_us: &AtomicU64, now_us: u64, work_us: u64) {
    let _ = busy_until_us.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |until| {
        Some(until.max(now_us).saturating_add(work_us))
    });
}

/// Microseconds on the router's monotonic clock (its zero is the clock's first use).
pub fn clock_us() -> u64 {
    static EPOCH: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();
    EPOCH.get_or_init(Instant::now).elapsed().as_micros() as u64
}

impl RankLoad {
    /// Adds `work_us` of this router's prefill to the rank's virtual queues at `now_us`.
    pub fn reserve_prefill(&self, now_us: u64, work_us: u64) {
        queue_after(&self.prefill_busy_until_us, now_us, work_us);
        queue_after(&self.fleet_prefill_busy_until_us, now_us, work_us);
        self.prefill_dispatched_us
            .fetch_add(work_us, std::sync::atomic::Ordering::Relaxed);
    }

    /// Adds `work_us` a sibling reported sending the rank to the merged queue at `now_us`.
    pub fn queue_sibling_prefill(&self, now_us: u64, work_us: u64) {
        queue_after(&self.fleet_prefill_busy_until_us, now_us, work_us);
    }

    /// Prefill time of THIS router's work still queued on the rank at `now_us` (what it shares).
    pub fn prefill_backlog_us(&self, now_us: u64) -> u64 {
        self.prefill_busy_until_us
            .load(std::sync::atomic::Ordering::Relaxed)
            .saturating_sub(now_us)
    }

    /// Prefill time still queued on the rank at `now_us`, this router's and its siblings' work
    /// on one clock (what the cost model charges).
    pub fn fleet_prefill_backlog_us(&self, now_us: u64) -> u64 {
        self.fleet_prefill_busy_until_us
            .load(std::sync::atomic::Ordering::Relaxed)
            .saturating_sub(now_us)
    }
}

/// Health of a worker. Routable: `Healthy`, and `Ejected` once its cool-down has passed (a
/// half-open probe: the next request or check decides).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Health {
    /// Registered but no successful contact yet.
    Pending,
    Healthy,
    /// Too many consecutive passive failures; not routed to before `until`.
    Ejected {
        until: Instant,
    },
    /// The active health check failed.
    Down,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HealthEvent {
    RequestOk,
    RequestFailed,
    CheckOk,
    CheckFailed,
}

#[derive(Debug, Clone)]
pub struct HealthState {
    pub health: Health,
    pub consecutive_failures: u32,
    pub last_change: Instant,
}

impl HealthState {
    pub fn new(now: Instant) -> Self {
        HealthState {
            health: Health::Pending,
            consecutive_failures: 0,
            last_change: now,
        }
    }

    pub fn routable(&self, now: Instant) -> bool {
        match self.health {
            Health::Healthy => true,
            Health::Ejected { until } => now >= until,
            Health::Pending | Health::Down => false,
        }
    }

    /// The transition function. `eject_after` consecutive failures eject for `cooldown`.
    pub fn on_event(
        &mut self,
        ev: HealthEvent,
        now: Instant,
        eject_after: u32,
        cooldown: Duration,
    ) {
        let next = match (self.health, ev) {
            (_, HealthEvent::RequestOk) => {
                self.consecutive_failures = 0;
                Health::Healthy
            }
            (Health::Ejected { until }, HealthEvent::CheckOk) if now < until => {
                // A passing /health does not cut an ejection short: the engine answered health
                // but failed real requests.
                Health::Ejected { until }
            }
            (_, HealthEvent::CheckOk) => {
                self.consecutive_failures = 0;
                Health::Healthy
            }
            (Health::Ejected { until }, HealthEvent::RequestFailed) if now < until => {
                Health::Ejected { until }
            }
            (_, HealthEvent::RequestFailed) => {
                self.consecutive_failures += 1;
                if self.consecutive_failures >= eject_after.max(1) {
                    Health::Ejected {
                        until: now + cooldown,
                    }
                } else {
                    self.health
                }
            }
            (Health::Ejected { until }, HealthEvent::CheckFailed) if now < until => {
                Health::Ejected { until }
            }
            (_, HealthEvent::CheckFailed) => Health::Down,
        };
        if next != self.health {
            self.last_change = now;
            self.health = next;
        }
    }

    pub fn label(&self, now: Instant) -> &'static str {
        match self.health {
            Health::Pending => "pending",
            Health::Healthy => "healthy",
            Health::Ejected { until } if now >= until => "ejected_cooldown_over",
            Health::Ejected { .. } => "ejected",
            Health::Down => "down",
        }
    }
}

pub struct Worker {
    pub id: WorkerId,
    pub url: String,
    pub model: String,
    pub dp_size: u32,
    pub ranks: Vec<Arc<RankLoad>>,
    pub health: Mutex<HealthState>,
    /// Where the KV config came from: "server_info", "flags" or "none".
    pub kv_source: &'static str,
    /// Why the KV plane is not indexing this worker, if it is not.
    pub kv_attach_error: Mutex<Option<String>>,
    /// False while the worker was registered without reaching it (`URL@model` of an engine that
    /// was down); the health loop then discovers and attaches its KV events once it answers.
    pub discovered: std::sync::atomic::AtomicBool,
    /// The model's context length as this engine stated it at registration.
    pub context_length: Option<usize>,
}

impl Worker {
    pub fn routable(&self, now: Instant) -> bool {
        self.health.lock().routable(now)
    }
}

pub struct ModelGroup {
    pub name: String,
    pub tokenizer: Option<Arc<ModelTokenizer>>,
    pub block_size: usize,
    pub workers: Vec<Arc<Worker>>,
    /// Position of each worker in `workers`, by URL: the routing path hands the index's
    /// per-rank matches to its candidates through it, in one lookup per matching rank instead
    /// of a scan of every candidate (which cost O(matching ranks x ranks) per request).
    pub worker_positions: HashMap<String, usize>,
    /// Longest prompt, in tokens, a request may carry: the smallest of `--max-prompt-tokens`
    /// and the context lengths the group's engines state. A longer prompt cannot be served by
    /// any of them, so it is refused before it is routed or forwarded.
    pub prompt_tokens_max: Option<PromptTokensMax>,
}

/// A prompt-token limit and where it comes from (said in the 400 a client gets).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PromptTokensMax {
    pub tokens: usize,
    pub source: &'static str,
}

impl ModelGroup {
    fn with_workers(
        name: String,
        tokenizer: Option<Arc<ModelTokenizer>>,
        block_size: usize,
        workers: Vec<Arc<Worker>>,
        flag: Option<usize>,
    ) -> ModelGroup {
        let engines = workers
            .iter()
            .filter_map(|w| w.context_length)
            .min()
            .map(|tokens| PromptTokensMax {
                tokens,
                source: "the engines' stated context length",
            });
        let flag = flag.map(|tokens| PromptTokensMax {
            tokens,
            source: "--max-prompt-tokens",
        });
        let prompt_tokens_max = match (flag, engines) {
            (Some(f), Some(e)) => Some(if f.tokens <= e.tokens { f } else { e }),
            (f, e) => f.or(e),
        };
        let mut worker_positions = HashMap::with_capacity(workers.len());
        for (position, w) in workers.iter().enumerate() {
            // A URL is one worker; should it appear twice, the first keeps it, as a scan did.
            worker_positions.entry(w.url.clone()).or_insert(position);
        }
        ModelGroup {
            name,
            tokenizer,
            block_size,
            workers,
            worker_positions,
            prompt_tokens_max,
        }
    }
}

#[derive(Default)]
struct Inner {
    workers: BTreeMap<WorkerId, Arc<Worker>>,
    models: BTreeMap<String, Arc<ModelGroup>>,
}

pub struct Registry {
    inner: RwLock<Inner>,
    next_id: AtomicU64,
    /// `--max-prompt-tokens`, applied to every model group.
    prompt_tokens_max_flag: Option<usize>,
}

#[derive(Debug, thiserror::Error)]
pub enum RegistryError {
    #[error("worker {0} is already registered")]
    Duplicate(String),
}

impl Default for Registry {
    fn default() -> Self {
        Registry::new(None)
    }
}

/// What an engine stated about itself at registration, beyond its model name.
#[derive(Debug, Clone, Copy)]
pub struct EngineFacts {
    pub dp_size: u32,
    pub block_size: usize,
    /// "server_info", "flags" or "none".
    pub kv_source: &'static str,
    pub context_length: Option<usize>,
}

impl Registry {
    /// An empty registry; `prompt_tokens_max_flag` is `--max-prompt-tokens`.
    pub fn new(prompt_tokens_max_flag: Option<usize>) -> Self {
        Registry {
            inner: RwLock::new(Inner::default()),
            next_id: AtomicU64::new(1),
            prompt_tokens_max_flag,
        }
    }

    /// Adds a worker; the group's tokenizer/block size come from the first worker of the model.
    pub fn add(
        &self,
        url: &str,
        model: &str,
        facts: EngineFacts,
        tokenizer: Option<Arc<ModelTokenizer>>,
    ) -> Result<Arc<Worker>, RegistryError> {
        let EngineFacts {
            dp_size,
            block_size,
            kv_source,
            context_length,
        } = facts;
        let mut inner = self.inner.write();
        if inner.workers.values().any(|w| w.url == url) {
            return Err(RegistryError::Duplicate(url.to_string()));
        }
        let worker = Arc::new(Worker {
            id: self.next_id.fetch_add(1, Ordering::Relaxed),
            url: url.to_string(),
            model: model.to_string(),
            dp_size: dp_size.max(1),
            ranks: (0..dp_size.max(1))
                .map(|_| Arc::new(RankLoad::default()))
                .collect(),
            health: Mutex::new(HealthState::new(Instant::now())),
            kv_source,
            kv_attach_error: Mutex::new(None),
            discovered: std::sync::atomic::AtomicBool::new(true),
            context_length,
        });
        inner.workers.insert(worker.id, worker.clone());
        let flag = self.prompt_tokens_max_flag;
        let group = match inner.models.get(model) {
            Some(g) => ModelGroup::with_workers(
                g.name.clone(),
                g.tokenizer.clone(),
                g.block_size,
                g.workers.iter().cloned().chain([worker.clone()]).collect(),
                flag,
            ),
            None => ModelGroup::with_workers(
                model.to_string(),
                tokenizer,
                block_size,
                vec![worker.clone()],
                flag,
            ),
        };
        inner.models.insert(model.to_string(), Arc::new(group));
        Ok(worker)
    }

    pub fn remove(&self, id: WorkerId) -> Option<Arc<Worker>> {
        let mut inner = self.inner.write();
        let worker = inner.workers.remove(&id)?;
        if let Some(g) = inner.models.get(&worker.model).cloned() {
            let workers: Vec<_> = g.workers.iter().filter(|w| w.id != id).cloned().collect();
            if workers.is_empty() {
                inner.models.remove(&worker.model);
            } else {
                inner.models.insert(
                    worker.model.clone(),
                    Arc::new(ModelGroup::with_workers(
                        g.name.clone(),
                        g.tokenizer.clone(),
                        g.block_size,
                        workers,
                        self.prompt_tokens_max_flag,
                    )),
                );
            }
        }
        Some(worker)
    }

    pub fn model(&self, name: &str) -> Option<Arc<ModelGroup>> {
        self.inner.read().models.get(name).cloned()
    }

    /// The model a request without `model` goes to: the only one, if exactly one exists.
    pub fn sole_model(&self) -> Option<Arc<ModelGroup>> {
        let inner = self.inner.read();
        if inner.models.len() == 1 {
            inner.models.values().next().cloned()
        } else {
            None
        }
    }

    pub fn models(&self) -> Vec<Arc<ModelGroup>> {
        self.inner.read().models.values().cloned().collect()
    }

    pub fn workers(&self) -> Vec<Arc<Worker>> {
        self.inner.read().workers.values().cloned().collect()
    }

    pub fn worker(&self, id: WorkerId) -> Option<Arc<Worker>> {
        self.inner.read().workers.get(&id).cloned()
    }

    pub fn by_url(&self, url: &str) -> Option<Arc<Worker>> {
        self.inner
            .read()
            .workers
            .values()
            .find(|w| w.url == url)
            .cloned()
    }

    pub fn healthy_count(&self) -> usize {
        let now = Instant::now();
        self.inner
            .read()
            .workers
            .values()
            .filter(|w| w.routable(now))
            .count()
    }
}

#[cfg(test)]
mod rank_load_tests {
    use super::*;

    #[test]
    fn the_prefill_backlog_queues_work_after_the_previous_finish_and_decays_with_time() {
        let load = RankLoad::default();
        load.reserve_prefill(1_000, 500);
        assert_eq!(load.prefill_backlog_us(1_000), 500);
        // Sent while the first is still running: it starts after the first finishes.
        load.reserve_prefill(1_200, 500);
        assert_eq!(load.prefill_backlog_us(1_200), 800);
        assert_eq!(load.prefill_backlog_us(1_900), 100);
        assert_eq!(load.prefill_backlog_us(5_000), 0, "drained, never negative");
        // An idle rank's next work starts now, not at the old finish time.
        load.reserve_prefill(10_000, 300);
        assert_eq!(load.prefill_backlog_us(10_000), 300);
        assert_eq!(
            load.prefill_dispatched_us.load(Ordering::Relaxed),
            1_300,
            "every reservation counts in the dispatched total, drained or not"
        );
        assert_eq!(
            load.fleet_prefill_backlog_us(10_000),
            300,
            "no sibling: same queue"
        );
    }

    #[test]
    fn sibling_work_queues_behind_ours_on_one_clock_so_the_rank_drains_at_its_own_pace() {
        let load = RankLoad::default();
        // Two routers each send 50 ms at t=0: the rank is busy until 100 ms.
        load.reserve_prefill(0, 50_000);
        load.queue_sibling_prefill(0, 50_000);
        assert_eq!(load.prefill_backlog_us(25_000), 25_000, "ours alone");
        assert_eq!(
            load.fleet_prefill_backlog_us(25_000),
            75_000,
            "two separately draining backlogs would say 50 ms here"
        );
        assert_eq!(load.fleet_prefill_backlog_us(100_000), 0);
        // Sibling work reported while the rank is idle starts at the report.
        load.queue_sibling_prefill(200_000, 10_000);
        assert_eq!(load.fleet_prefill_backlog_us(205_000), 5_000);
        assert_eq!(load.prefill_backlog_us(205_000), 0, "not ours");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const COOL: Duration = Duration::from_millis(100);

    #[test]
    fn a_new_worker_is_pending_and_not_routable_until_contact() {
        let now = Instant::now();
        let mut s = HealthState::new(now);
        assert!(!s.routable(now));
        s.on_event(HealthEvent::CheckOk, now, 3, COOL);
        assert_eq!(s.health, Health::Healthy);
        assert!(s.routable(now));
    }

    #[test]
    fn n_consecutive_request_failures_eject_and_a_success_in_between_resets_the_count() {
        let now = Instant::now();
        let mut s = HealthState::new(now);
        s.on_event(HealthEvent::RequestOk, now, 3, COOL);
        s.on_event(HealthEvent::RequestFailed, now, 3, COOL);
        s.on_event(HealthEvent::RequestFailed, now, 3, COOL);
        s.on_event(HealthEvent::RequestOk, now, 3, COOL);
        s.on_event(HealthEvent::RequestFailed, now, 3, COOL);
        s.on_event(HealthEvent::RequestFailed, now, 3, COOL);
        assert_eq!(s.health, Health::Healthy);
        s.on_event(HealthEvent::RequestFailed, now, 3, COOL);
        assert_eq!(s.health, Health::Ejected { until: now + COOL });
        assert!(!s.routable(now));
        assert!(s.routable(now + COOL), "cool-down over: half-open");
    }

    #[test]
    fn a_passing_health_check_does_not_cut_an_ejection_short() {
        let now = Instant::now();
        let mut s = HealthState::new(now);
        s.on_event(HealthEvent::RequestFailed, now, 1, COOL);
        s.on_event(HealthEvent::CheckOk, now, 1, COOL);
        assert!(matches!(s.health, Health::Ejected { .. }));
        s.on_event(HealthEvent::CheckOk, now + COOL, 1, COOL);
        assert_eq!(s.health, Health::Healthy);
    }

    #[test]
    fn a_failed_check_takes_a_worker_down_and_a_passing_one_brings_it_back() {
        let now = Instant::now();
        let mut s = HealthState::new(now);
        s.on_event(HealthEvent::CheckOk, now, 3, COOL);
        s.on_event(HealthEvent::CheckFailed, now, 3, COOL);
        assert_eq!(s.health, Health::Down);
        assert!(!s.routable(now));
        s.on_event(HealthEvent::CheckOk, now, 3, COOL);
        assert_eq!(s.health, Health::Healthy);
    }

    #[test]
    fn every_state_and_event_pair_has_the_documented_transition() {
        let now = Instant::now();
        let until = now + COOL;
        let states = [
            ("pending", Health::Pending),
            ("healthy", Health::Healthy),
            ("ejected", Health::Ejected { until }),
            ("down", Health::Down),
        ];
        // (from, event, expected) with eject_after = 1, evaluated at `now` (cool-down running).
        let table: &[(&str, HealthEvent, Health)] = &[
            ("pending", HealthEvent::RequestOk, Health::Healthy),
            (
                "pending",
                HealthEvent::RequestFailed,
                Health::Ejected { until },
            ),
            ("pending", HealthEvent::CheckOk, Health::Healthy),
            ("pending", HealthEvent::CheckFailed, Health::Down),
            ("healthy", HealthEvent::RequestOk, Health::Healthy),
            (
                "healthy",
                HealthEvent::RequestFailed,
                Health::Ejected { until },
            ),
            ("healthy", HealthEvent::CheckOk, Health::Healthy),
            ("healthy", HealthEvent::CheckFailed, Health::Down),
            ("ejected", HealthEvent::RequestOk, Health::Healthy),
            (
                "ejected",
                HealthEvent::RequestFailed,
                Health::Ejected { until },
            ),
            ("ejected", HealthEvent::CheckOk, Health::Ejected { until }),
            (
                "ejected",
                HealthEvent::CheckFailed,
                Health::Ejected { until },
            ),
            ("down", HealthEvent::RequestOk, Health::Healthy),
            (
                "down",
                HealthEvent::RequestFailed,
                Health::Ejected { until },
            ),
            ("down", HealthEvent::CheckOk, Health::Healthy),
            ("down", HealthEvent::CheckFailed, Health::Down),
        ];
        assert_eq!(table.len(), states.len() * 4, "every pair is listed");
        for (from, ev, want) in table {
            let start = states.iter().find(|(n, _)| n == from).unwrap().1;
            let mut s = HealthState {
                health: start,
                consecutive_failures: 0,
                last_change: now,
            };
            s.on_event(*ev, now, 1, COOL);
            assert_eq!(s.health, *want, "{from} + {ev:?}");
        }
        // Once the cool-down is over, an ejected worker's next failure or failed check counts
        // again instead of being absorbed.
        let mut s = HealthState {
            health: Health::Ejected { until },
            consecutive_failures: 1,
            last_change: now,
        };
        s.on_event(HealthEvent::CheckFailed, until, 1, COOL);
        assert_eq!(s.health, Health::Down);
        let mut s = HealthState {
            health: Health::Ejected { until },
            consecutive_failures: 1,
            last_change: now,
        };
        s.on_event(HealthEvent::RequestFailed, until, 1, COOL);
        assert_eq!(
            s.health,
            Health::Ejected {
                until: until + COOL
            }
        );
    }

    fn facts(dp_size: u32, context_length: Option<usize>) -> EngineFacts {
        EngineFacts {
            dp_size,
            block_size: 16,
            kv_source: "none",
            context_length,
        }
    }

    #[test]
    fn a_groups_prompt_limit_is_the_smallest_of_the_flag_and_its_engines_context_lengths() {
        let limit = |r: &Registry| r.model("m").unwrap().prompt_tokens_max;
        let r = Registry::new(None);
        let a = r.add("http://a", "m", facts(1, None), None).unwrap();
        assert_eq!(limit(&r), None, "nobody states a limit");
        let b = r.add("http://b", "m", facts(1, Some(8_192)), None).unwrap();
        let c = r.add("http://c", "m", facts(1, Some(4_096)), None).unwrap();
        assert_eq!(limit(&r).map(|l| l.tokens), Some(4_096));
        r.remove(c.id);
        assert_eq!(
            limit(&r).map(|l| l.tokens),
            Some(8_192),
            "recomputed on removal"
        );
        let _ = (a, b);
        let r = Registry::new(Some(1_000));
        r.add("http://a", "m", facts(1, Some(4_096)), None).unwrap();
        assert_eq!(
            limit(&r),
            Some(PromptTokensMax {
                tokens: 1_000,
                source: "--max-prompt-tokens"
            })
        );
        let r = Registry::new(Some(10_000));
        r.add("http://a", "m", facts(1, Some(4_096)), None).unwrap();
        assert_eq!(limit(&r).map(|l| l.tokens), Some(4_096));
    }

    #[test]
    fn removing_the_last_worker_of_a_model_removes_the_model() {
        let r = Registry::default();
        let a = r.add("http://a", "m", facts(2, None), None).unwrap();
        let b = r.add("http://b", "m", facts(1, None), None).unwrap();
        assert!(r.add("http://a", "m", facts(1, None), None).is_err());
        assert_eq!(r.model("m").unwrap().workers.len(), 2);
        assert_eq!(a.ranks.len(), 2);
        r.remove(a.id);
        assert_eq!(r.model("m").unwrap().workers.len(), 1);
        r.remove(b.id);
        assert!(r.model("m").is_none());
        assert!(r.sole_model().is_none());
    }
}
