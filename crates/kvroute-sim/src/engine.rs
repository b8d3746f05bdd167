//! One simulated engine: its DP ranks (each a prefix cache plus a KV publisher behind one lock),
//! the scheduler (a slot semaphore per rank) and the timing model.
//!
//! A request's life, as in SGLang/vLLM: pick a rank (the router's hint, else least loaded), wait
//! for a running slot (and, with `--prefill-serial`, for the rank's single prefill turn; until
//! both are granted the request counts as waiting in the load stats, then as running), match
//! the prompt against the rank's cache (cached tokens), spend the prefill time on the uncached
//! part, then insert the prompt's blocks and publish the resulting events as ONE batch (the
//! engine's scheduler step), then decode at a fixed cost per token.
//! Cache mutation and publishing share the rank lock so the event stream is exactly the cache's
//! history; nothing awaits while holding it.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;

use kvroute_wire::LoadStat;
use parking_lot::Mutex;
use tokio::sync::{Notify, OwnedSemaphorePermit, Semaphore, mpsc};
use tokio_util::sync::CancellationToken;
use zeromq::{PubSocket, RouterSocket};

use crate::SimError;
use crate::cache::{CacheConfig, PrefixCache};
use crate::config::SimConfig;
use crate::publish::{
    PUB_QUEUE_MAX_MESSAGES, RankPublisher, bind_consecutive, run_load_publisher, run_pub_writer,
    run_replay_server,
};
use crate::tokenizer::TextModel;

/// Chains one `/control/store` call may insert, and tokens per chain, so a test helper cannot
/// ask for unbounded work.
pub const STORE_CHAINS_MAX: usize = 4096;

pub struct RankState {
    pub cache: PrefixCache,
    pub publisher: RankPublisher,
}

pub struct Rank {
    pub state: Mutex<RankState>,
    slots: Arc<Semaphore>,
    running: AtomicUsize,
    waiting: AtomicUsize,
    load_changed: Arc<Notify>,
    served: ServedCounters,
    /// Held for the whole prefill with `--prefill-serial`, so one rank prefills one request
    /// at a time.
    prefill_turn: tokio::sync::Mutex<()>,
    /// Requests in their prefill phase right now (observable serialization).
    prefilling: AtomicUsize,
}

/// What one rank has served since start: kept so a benchmark can tell how a router spread its
/// load over the ranks (and check the hit rate engine-side) without trusting the router.
#[derive(Default)]
struct ServedCounters {
    requests: AtomicU64,
    prompt_tokens: AtomicU64,
    cached_tokens: AtomicU64,
}

/// A snapshot of one rank's [`ServedCounters`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ServedStat {
    /// Requests admitted to a running slot and prefilled on this rank.
    pub requests: u64,
    pub prompt_tokens: u64,
    pub cached_tokens: u64,
}

impl Rank {
    fn load(&self) -> usize {
        self.running.load(Ordering::Relaxed) + self.waiting.load(Ordering::Relaxed)
    }
}

/// Actual ports of an engine (resolved when the OS chose them).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EnginePorts {
    pub http: u16,
    pub kv_base: u16,
    pub replay_base: u16,
    pub load_base: Option<u16>,
}

pub struct Engine {
    pub index: usize,
    pub cfg: Arc<SimConfig>,
    pub text: Arc<TextModel>,
    pub ranks: Vec<Arc<Rank>>,
    pub ports: Mutex<EnginePorts>,
    pub cancel: CancellationToken,
    /// Injected stalls (`/control/stall`).
    pub faults: crate::faults::Faults,
    next_rank: AtomicUsize,
    next_request_id: AtomicU64,
}

/// A request holding a running slot: decrements the rank's running count when dropped (also
/// when the client goes away mid-request and its future is dropped).
pub struct SlotGuard {
    rank: Arc<Rank>,
    _permit: OwnedSemaphorePermit,
}

impl Drop for SlotGuard {
    fn drop(&mut self) {
        self.rank.running.fetch_sub(1, Ordering::Relaxed);
        self.rank.load_changed.notify_one();
    }
}

/// Counts a request out of the prefill phase however it ends (also when a dropped client
/// drops the prefill future mid-sleep).
struct PrefillingGuard<'a>(&'a Rank);
impl Drop for PrefillingGuard<'_> {
    fn drop(&mut self) {
        self.0.prefilling.fetch_sub(1, Ordering::Relaxed);
    }
}

struct WaitingGuard<'a>(&'a Rank);
impl Drop for WaitingGuard<'_> {
    fn drop(&mut self) {
        self.0.waiting.fetch_sub(1, Ordering::Relaxed);
    }
}

/// The outcome of admission + prefill; decode continues while `slot` is held.
pub struct Prefilled {
    pub rank: usize,
    pub cached_tokens: usize,
    pub slot: SlotGuard,
}

impl Engine {
    /// Binds the engine's ZMQ sockets and starts its publisher tasks. `cfg` ports are the
    /// fleet's bases; engine `index` offsets them as documented in [`crate::config`].
    pub async fn start(
        index: usize,
        cfg: Arc<SimConfig>,
        text: Arc<TextModel>,
        cancel: CancellationToken,
    ) -> Result<Arc<Engine>, SimError> {
        let dp = cfg.dp_size;
        let offset = |base: u16| {
            if base == 0 {
                0
            } else {
                base + (index * dp) as u16
            }
        };
        let host = cfg.host.as_str();
        let (pubs, kv_base) =
            bind_consecutive::<PubSocket>(host, offset(cfg.kv_port_base), dp, "kv PUB").await?;
        let (routers, replay_base) = bind_consecutive::<RouterSocket>(
            host,
            offset(cfg.replay_port_base),
            dp,
            "replay ROUTER",
        )
        .await?;
        let (load_pubs, load_base) = if cfg.load_publish {
            let (s, b) =
                bind_consecutive::<PubSocket>(host, offset(cfg.load_port_base), dp, "load PUB")
                    .await?;
            (s, Some(b))
        } else {
            (Vec::new(), None)
        };

        let mut ranks = Vec::with_capacity(dp);
        let mut pub_rxs = Vec::with_capacity(dp);
        for r in 0..dp {
            let (tx, rx) = mpsc::channel(PUB_QUEUE_MAX_MESSAGES);
            pub_rxs.push(rx);
            ranks.push(Arc::new(Rank {
                state: Mutex::new(RankState {
                    cache: PrefixCache::new(CacheConfig {
                        block_size: cfg.block_size,
                        capacity_blocks: cfg.capacity_blocks,
                        host_capacity_blocks: cfg.host_capacity_blocks,
                        hash_seed: cfg.hash_seed.wrapping_add(index as u64),
                    }),
                    publisher: RankPublisher::new(
                        cfg.encoding(),
                        &cfg.topic,
                        r as u32,
                        cfg.replay_buffer_batches,
                        tx,
                    ),
                }),
                slots: Arc::new(Semaphore::new(cfg.max_running)),
                running: AtomicUsize::new(0),
                waiting: AtomicUsize::new(0),
                load_changed: Arc::new(Notify::new()),
                served: ServedCounters::default(),
                prefill_turn: tokio::sync::Mutex::new(()),
                prefilling: AtomicUsize::new(0),
            }));
        }
        let engine = Arc::new(Engine {
            index,
            cfg: cfg.clone(),
            text,
            ranks,
            ports: Mutex::new(EnginePorts {
                http: 0,
                kv_base,
                replay_base,
                load_base,
            }),
            cancel: cancel.clone(),
            faults: Default::default(),
            next_rank: AtomicUsize::new(0),
            next_request_id: AtomicU64::new(0),
        });
        for (socket, rx) in pubs.into_iter().zip(pub_rxs) {
            tokio::spawn(run_pub_writer(socket, rx, cancel.clone()));
        }
        for (r, socket) in routers.into_iter().enumerate() {
            let rank = engine.ranks[r].clone();
            tokio::spawn(run_replay_server(
                socket,
                move |start| {
                    let st = rank.state.lock();
                    (st.publisher.topic(), st.publisher.replay_from(start))
                },
                cancel.clone(),
            ));
        }
        for (r, socket) in load_pubs.into_iter().enumerate() {
            let weak = Arc::downgrade(&engine);
            let changed = engine.ranks[r].load_changed.clone();
            tokio::spawn(run_load_publisher(
                socket,
                move || weak.upgrade().map(|e| e.load_stat(r)).unwrap_or_default(),
                changed,
                Duration::from_millis(cfg.load_interval_ms),
                cancel.clone(),
            ));
        }
        Ok(engine)
    }

    pub fn dp_size(&self) -> usize {
        self.ranks.len()
    }

    pub fn next_request_id(&self) -> u64 {
        self.next_request_id.fetch_add(1, Ordering::Relaxed)
    }

    /// The hinted rank when given, else the least loaded (running + waiting), ties broken
    /// round-robin so an idle engine spreads requests over its ranks.
    pub fn pick_rank(&self, hint: Option<usize>) -> usize {
        if let Some(r) = hint {
            return r;
        }
        let n = self.ranks.len();
        let start = self.next_rank.fetch_add(1, Ordering::Relaxed) % n;
        (0..n)
            .map(|i| (start + i) % n)
            .min_by_key(|&r| self.ranks[r].load())
            .unwrap_or(0)
    }

    /// Simulated duration, scaled by `--speed`; `None` in `--instant` mode (do not sleep).
    pub fn delay(&self, micros: u64) -> Option<Duration> {
        if self.cfg.instant || micros == 0 {
            return None;
        }
        Some(Duration::from_secs_f64(
            micros as f64 / 1e6 / self.cfg.speed,
        ))
    }

    /// Admission, queueing and prefill of `tokens` on `rank`; the prompt's blocks are cached and
    /// announced when this returns.
    pub async fn prefill(&self, rank: usize, tokens: &[u32]) -> Prefilled {
        let r = self.ranks[rank].clone();
        r.waiting.fetch_add(1, Ordering::Relaxed);
        r.load_changed.notify_one();
        let waiting = WaitingGuard(&r);
        // The semaphore is never closed, so acquire cannot fail.
        let permit = r.slots.clone().acquire_owned().await;
        // Taken before matching, so a request that waited for its turn sees the blocks the
        // previous prefill on this rank just inserted. Until it has its turn the request is
        // still WAITING, as in SGLang, whose running count is the batch being computed: a
        // request queued behind another prompt's prefill is not running yet.
        let _turn = if self.cfg.prefill_serial {
            Some(r.prefill_turn.lock().await)
        } else {
            None
        };
        drop(waiting);
        r.running.fetch_add(1, Ordering::Relaxed);
        let slot = SlotGuard {
            rank: r.clone(),
            _permit: permit.expect("slot semaphore is never closed"),
        };
        r.load_changed.notify_one();

        r.prefilling.fetch_add(1, Ordering::Relaxed);
        let _prefilling = PrefillingGuard(&r);
        let bs = self.cfg.block_size;
        let keys = crate::cache::block_keys(tokens, bs);
        let m = r.state.lock().cache.match_prefix(&keys);
        let cached_tokens = m.cached_blocks * bs;
        let uncached = tokens.len().saturating_sub(cached_tokens) as u64;
        r.served.requests.fetch_add(1, Ordering::Relaxed);
        r.served
            .prompt_tokens
            .fetch_add(tokens.len() as u64, Ordering::Relaxed);
        r.served
            .cached_tokens
            .fetch_add(cached_tokens as u64, Ordering::Relaxed);
        let cost_us = self.cfg.overhead_us
            + uncached * self.cfg.prefill_us_per_token
            + (m.host_blocks * bs) as u64 * self.cfg.host_load_us_per_token;
        if let Some(d) = self.delay(cost_us) {
            tokio::time::sleep(d).await;
        }
        {
            let mut st = r.state.lock();
            let mut events = Vec::new();
            st.cache.insert(tokens, &keys, &mut events);
            st.publisher.publish(events);
        }
        r.load_changed.notify_one();
        Prefilled {
            rank,
            cached_tokens,
            slot,
        }
    }

    /// Inserts token chains as if prefilled and publishes the result now (one batch).
    pub fn store_chains(&self, rank: usize, chains: &[Vec<u32>]) -> i64 {
        let r = &self.ranks[rank];
        let mut st = r.state.lock();
        let mut events = Vec::new();
        for chain in chains {
            let keys = st.cache.block_keys(chain);
            st.cache.insert(chain, &keys, &mut events);
        }
        st.publisher.publish(events);
        r.load_changed.notify_one();
        st.publisher.last_seq()
    }

    /// Empties the rank's cache and announces `AllBlocksCleared`; returns its seq.
    pub fn flush(&self, rank: usize) -> i64 {
        let r = &self.ranks[rank];
        let mut st = r.state.lock();
        let mut events = Vec::new();
        st.cache.clear(&mut events);
        st.publisher.publish(events);
        r.load_changed.notify_one();
        st.publisher.last_seq()
    }

    pub fn drop_next(&self, rank: usize, batches: u64) {
        self.ranks[rank].state.lock().publisher.drop_next(batches);
    }

    /// Simulates an engine restart on one rank: seq back to 0, empty cache and replay buffer.
    pub fn restart_publisher(&self, rank: usize) {
        let r = &self.ranks[rank];
        let mut st = r.state.lock();
        st.cache.reset();
        st.publisher.restart();
        r.load_changed.notify_one();
    }

    pub fn last_seq(&self, rank: usize) -> i64 {
        self.ranks[rank].state.lock().publisher.last_seq()
    }

    /// Requests in their prefill phase on rank `rank` right now.
    pub fn prefilling(&self, rank: usize) -> usize {
        self.ranks[rank].prefilling.load(Ordering::Relaxed)
    }

    /// Requests and tokens rank `rank` has prefilled since the engine started.
    pub fn served_stat(&self, rank: usize) -> ServedStat {
        let s = &self.ranks[rank].served;
        ServedStat {
            requests: s.requests.load(Ordering::Relaxed),
            prompt_tokens: s.prompt_tokens.load(Ordering::Relaxed),
            cached_tokens: s.cached_tokens.load(Ordering::Relaxed),
        }
    }

    pub fn load_stat(&self, rank: usize) -> LoadStat {
        let r = &self.ranks[rank];
        let st = r.state.lock();
        let bs = self.cfg.block_size as u64;
        LoadStat {
            num_running_reqs: r.running.load(Ordering::Relaxed) as u64,
            num_waiting_reqs: r.waiting.load(Ordering::Relaxed) as u64,
            num_tokens: st.cache.device_blocks() as u64 * bs,
            max_total_num_tokens: st.cache.capacity_blocks() as u64 * bs,
            dp_rank: Some(rank as u32),
        }
    }
}
