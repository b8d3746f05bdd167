//! What flows through a fleet during a scenario: KV events the harness asks engines to publish
//! ([`EventDriver`], through `POST /control/store`) and client requests through the routers
//! ([`Client`], round robin over a [`Rotation`] the rolling update edits like an Endpoints
//! object). Both run as tasks until stopped and report counts, so a scenario can assert on
//! totals at the end, never on a transient state mid-run.
//!
//! Chains are deterministic and come in families that share a prefix, so the indexes are trees
//! (shared nodes, branching) rather than disjoint lists, and a client's prompts hit prefixes the
//! engines already hold.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use serde_json::json;
use tokio::task::JoinHandle;

use crate::engine::SimProcess;
use crate::http::post_json;

/// Families of chains; chains of one family share their first [`FAMILY_PREFIX_BLOCKS`] blocks.
pub const FAMILIES_MAX: u32 = 8;
/// Blocks shared by every chain of a family.
pub const FAMILY_PREFIX_BLOCKS: usize = 2;
/// Blocks unique to each chain.
pub const CHAIN_TAIL_BLOCKS: usize = 2;
/// Token ids stay below this (inside any shipped vocabulary).
pub const TOKEN_ID_MAX: u32 = 30_000;
/// Upper bound on the batches one event driver publishes, so a scenario that forgets to stop it
/// still ends.
pub const EVENT_DRIVER_BATCHES_MAX: u64 = 100_000;
/// Upper bound on one client's requests, for the same reason.
pub const CLIENT_REQUESTS_MAX: u64 = 100_000;

/// The `i`-th chain of `block_size`-token blocks: family `i % FAMILIES_MAX`'s shared prefix,
/// then a tail unique to `i` (and to `salt`, so two drivers never produce the same chain).
pub fn chain(i: u64, salt: u32, block_size: usize) -> Vec<u32> {
    let family = (i % u64::from(FAMILIES_MAX)) as u32;
    let mut out = Vec::with_capacity((FAMILY_PREFIX_BLOCKS + CHAIN_TAIL_BLOCKS) * block_size);
    for t in 0..FAMILY_PREFIX_BLOCKS * block_size {
        out.push((1_000 + family * 997 + t as u32 * 13 + salt * 7_919) % TOKEN_ID_MAX);
    }
    for t in 0..CHAIN_TAIL_BLOCKS * block_size {
        let x = (i as u32)
            .wrapping_mul(2_654_435_761)
            .wrapping_add(t as u32 * 40_503)
            .wrapping_add(salt.wrapping_mul(97));
        out.push(x % TOKEN_ID_MAX);
    }
    out
}

/// A task storing one chain per step on every (engine, rank) of some sim processes in turn.
pub struct EventDriver {
    stop: Arc<AtomicBool>,
    published: Arc<AtomicU64>,
    task: JoinHandle<()>,
}

impl EventDriver {
    /// Starts storing chains, one control request at a time, one every `period_ms` (pacing only:
    /// each step is an explicit request, and its effect is checked later through `last_seq`).
    pub fn start(sims: Vec<Arc<SimProcess>>, salt: u32, period_ms: u64) -> EventDriver {
        let stop = Arc::new(AtomicBool::new(false));
        let published = Arc::new(AtomicU64::new(0));
        let (s, p) = (stop.clone(), published.clone());
        let task = tokio::spawn(async move {
            let targets: Vec<(usize, usize, usize)> = sims
                .iter()
                .enumerate()
                .flat_map(|(si, sim)| {
                    (0..sim.engines.len())
                        .flat_map(move |e| (0..sim.options.dp_size).map(move |r| (si, e, r)))
                })
                .collect();
            let mut tick = tokio::time::interval(Duration::from_millis(period_ms.max(1)));
            let mut i: u64 = 0;
            while !s.load(Ordering::Relaxed) && i < EVENT_DRIVER_BATCHES_MAX {
                tick.tick().await;
                let (si, e, r) = targets[(i as usize) % targets.len()];
                let sim = &sims[si];
                sim.store(e, r, &[chain(i, salt, sim.options.block_size)])
                    .await;
                p.fetch_add(1, Ordering::Relaxed);
                i += 1;
            }
        });
        EventDriver {
            stop,
            published,
            task,
        }
    }

    /// Stops after the step in progress; returns how many batches were published.
    pub async fn stop(self) -> u64 {
        self.stop.store(true, Ordering::Relaxed);
        self.task.await.expect("the event driver does not panic");
        self.published.load(Ordering::Relaxed)
    }

    pub fn published(&self) -> u64 {
        self.published.load(Ordering::Relaxed)
    }
}

/// The replicas a client may send to (public base URLs), edited by the rolling update the way
/// a Service's endpoints are: a replica enters once ready, and leaves BEFORE it is sent SIGTERM,
/// after the requests already sent to it have finished ([`Rotation::retire`]). That last part is
/// what a preStop delay buys in a real cluster: a router stops accepting at SIGTERM (as it
/// should), so a request routed to it just before would otherwise meet a closed listener.
#[derive(Clone, Default)]
pub struct Rotation(Arc<std::sync::Mutex<RotationState>>);

#[derive(Default)]
struct RotationState {
    bases: Vec<String>,
    in_flight: std::collections::HashMap<String, u64>,
}

/// A request's claim on a replica; releases it when dropped.
pub struct InFlight {
    rotation: Rotation,
    base: String,
}

impl Drop for InFlight {
    fn drop(&mut self) {
        if let Some(n) = self.rotation.lock().in_flight.get_mut(&self.base) {
            *n = n.saturating_sub(1);
        }
    }
}

/// How long [`Rotation::retire`] waits for a replica's requests in flight to finish.
pub const RETIRE_DRAIN_LIMIT_MS: u64 = 10_000;

impl Rotation {
    fn lock(&self) -> std::sync::MutexGuard<'_, RotationState> {
        // A panicking holder cannot leave the state half-edited (every edit is one call).
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn add(&self, base: &str) {
        self.lock().bases.push(base.to_string());
    }

    /// Takes `base` out of the rotation and waits until no request sent to it is in flight.
    pub async fn retire(&self, base: &str) {
        self.lock().bases.retain(|b| b != base);
        let what = format!("the requests in flight to {base} to finish");
        crate::wait::wait_until(&what, RETIRE_DRAIN_LIMIT_MS, || async {
            match self.lock().in_flight.get(base).copied().unwrap_or(0) {
                0 => Ok(()),
                n => Err(format!("{n} in flight")),
            }
        })
        .await;
    }

    /// The `i`-th pick of the round robin, counted in flight until the claim is dropped.
    fn checkout(&self, i: u64) -> Option<(String, InFlight)> {
        let mut st = self.lock();
        if st.bases.is_empty() {
            return None;
        }
        let base = st.bases[(i as usize) % st.bases.len()].clone();
        *st.in_flight.entry(base.clone()).or_default() += 1;
        drop(st);
        Some((
            base.clone(),
            InFlight {
                rotation: self.clone(),
                base,
            },
        ))
    }
}

/// End-of-run totals of a [`Client`].
#[derive(Debug, Clone, Default)]
pub struct ClientReport {
    pub ok: u64,
    /// Each failure: replica, and what happened.
    pub failures: Vec<String>,
}

/// A task sending completions (token-id prompts made of [`chain`]s) round robin over a rotation.
pub struct Client {
    stop: Arc<AtomicBool>,
    task: JoinHandle<ClientReport>,
}

impl Client {
    pub fn start(rotation: Rotation, model: &str, block_size: usize, period_ms: u64) -> Client {
        let stop = Arc::new(AtomicBool::new(false));
        let s = stop.clone();
        let model = model.to_string();
        let task = tokio::spawn(async move {
            let mut report = ClientReport::default();
            let mut tick = tokio::time::interval(Duration::from_millis(period_ms.max(1)));
            let mut i: u64 = 0;
            while !s.load(Ordering::Relaxed) && i < CLIENT_REQUESTS_MAX {
                tick.tick().await;
                let Some((base, _claim)) = rotation.checkout(i) else {
                    continue;
                };
                // Salt 0 and a small range of i: prompts repeat, so they hit cached prefixes.
                let prompt = chain(i % 32, 0, block_size);
                let body = json!({"model": model, "prompt": prompt, "max_tokens": 1});
                match post_json(&format!("{base}/v1/completions"), &body).await {
                    Ok((200, _)) => report.ok += 1,
                    Ok((status, v)) => report.failures.push(format!("{base}: {status} {v}")),
                    Err(e) => report.failures.push(format!("{base}: {e}")),
                }
                i += 1;
            }
            report
        });
        Client { stop, task }
    }

    pub async fn stop(self) -> ClientReport {
        self.stop.store(true, Ordering::Relaxed);
        self.task.await.expect("the client does not panic")
    }
}
