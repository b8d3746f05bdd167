//! The fleet end-to-end harness: `kvroute-sim` engines and `kvroute` router replicas as separate
//! OS processes on loopback, driven and observed only through their real sockets, so a scenario
//! proves what a deployment would see (issue 16). It is a library, not test-only helpers, so
//! benchmarks and the demo can reuse the same processes, drivers and canonical views.
//!
//! What is in it: [`bins`] (where the binaries come from), [`engine`] (a `kvroute-sim` process and
//! its `/control/*` API), [`router`] (a `kvroute` replica and the views it exposes), [`view`] (the
//! canonical, sorted comparison of indexes with the engines' true caches), [`fleet`] (the set of
//! processes, convergence and the surge-only rolling update), [`traffic`] (the event driver and
//! the client), [`proxy`] (a TCP proxy that can be cut: the partition), [`fakes`] (siblings that
//! misbehave), [`wait`] (the one way to wait), [`soak`] (a long run under load and faults, with
//! end-of-run checks; the `kvroute-soak` binary).
//!
//! # Anti-flake rules
//!
//! Every scenario built on this harness follows them; they are why it can run ten times in a row
//! on a loaded 2-core machine without a retry:
//!
//! 1. **Events are driven by explicit control requests, not timers.** A KV event exists because
//!    the harness asked an engine to store a chain (`POST /control/store`), to withhold a batch
//!    (`/control/drop_next`), to restart its publisher, or because the harness's client sent a
//!    request; no engine publishes on its own. Pacing a driver with an interval only spaces those
//!    requests out; it never stands in for a state having been reached.
//! 2. **Views are compared only after every replica's cursor has provably reached each engine's
//!    `last_seq`** ([`fleet::Fleet::settle`]): the engines' truth (blocks and `last_seq`, read
//!    under each rank's lock in one `GET /control/cache`) is read once the drivers stopped, every
//!    replica's `/internal/kv_cursors` must reach it, and the truth is read again afterwards to
//!    prove nothing was published meanwhile.
//! 3. **Nothing asserts on a transient mid-rollout state.** During a rollout the harness only
//!    waits (for `/readyz`, for a process to exit) and counts; assertions run on the settled end
//!    state, plus end-of-run totals (client failures, outcomes once every rank is terminal).
//! 4. **Views are compared canonically**: sets of (rank, block hash, parent hash, engine hash,
//!    tiers) in sorted maps, never in the order an export or an engine happens to list them.
//! 5. **Every wait has a timeout and a message** saying what was awaited and what was last seen
//!    ([`wait::wait_until`]). There is no `sleep` waiting for a state anywhere: a condition is
//!    polled until a named deadline (`..._MS`).
//!
//! Scenarios in one test process are serialised by [`fleet::scenario_lock`]: on two cores, two
//! fleets of processes at once would turn the timing bounds (ready before the deadline, settled
//! well before it) into a measure of the machine's load instead of the router.

pub mod bins;
pub mod engine;
pub mod fakes;
pub mod fleet;
pub mod http;
pub mod logs;
pub mod proxy;
pub mod router;
pub mod soak;
pub mod traffic;
pub mod view;
pub mod wait;

pub use engine::{SimOptions, SimProcess};
pub use fleet::{Fleet, scenario_lock};
pub use router::{RankStatus, RouterOptions, RouterProcess};
pub use view::IndexView;
pub use wait::wait_until;
