//! kvroute-kv: the router's KV plane.
//!
//! It turns engine KV-event streams into one prefix index per model:
//! * [`discovery`]: where a worker publishes (SGLang `/server_info`, or a template for vLLM);
//! * [`transport`]: ZMQ SUB and replay DEALER behind a small trait, framing and size limits only;
//! * `subscriber`: one background task per rank that connects, decodes and forwards;
//! * [`rank_state`]: the pure per-rank sequencing machine (duplicates, gaps, restarts, replay);
//! * `pump`: the single writer of each model's index, executing the machine's decisions;
//! * [`plane`]: the [`KvPlane`] handle the router uses;
//! * [`engine_loads`]: the engines' own load reports, laid out for the routing path's reads;
//! * [`bootstrap`]: what the plane and the service's peer-bootstrap task say to each other.
//!
//! Sockets live in subscriber and replay tasks; exactly one task per model (the pump) writes that
//! model's index, so the index needs no write-side locking protocol beyond its own shard locks.

pub mod bootstrap;
pub mod discovery;
pub mod engine_loads;
pub mod metrics;
pub mod plane;
mod pump;
pub mod rank_state;
pub mod status;
mod subscriber;
#[doc(hidden)]
pub mod testing;
pub mod transport;

pub use bootstrap::{
    BOOTSTRAP_EVENTS_CAPACITY, BootstrapEvent, GraftDisposition, GraftReceipt, GraftTarget,
};
pub use discovery::{
    DP_SIZE_MAX, DiscoveryError, KvEventsConfig, WorkerInfo, fetch_worker_info,
    kv_config_from_template,
};
pub use plane::{KvPlane, KvPlaneConfig, KvPlaneError, ModelView};
pub use pump::{
    GRAFT_DEFERRED_ACTIONS_MAX, GRAFT_DEFERRED_MAX_BYTES, GRAFT_MSGS_BETWEEN_SLICES_MAX,
    GRAFTS_QUEUED_MAX, PUMP_CHANNEL_CAPACITY, SIDE_MAP_PREGROW_ENTRIES_MIN,
    SIDE_MAP_PREGROW_SPACING_MS,
};
pub use status::BootstrapState;
pub use status::RankKey;
pub use status::{RankStatus, SubscriberState};
