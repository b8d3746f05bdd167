//! kvroute-bootstrap: what a booting replica decides while it pulls a warm sibling's index.
//!
//! A replica that starts beside warm siblings is blind to every block the engines already hold.
//! It holds each new rank's live batches, asks the siblings for a snapshot, grafts the snapshot
//! under the held stream and proves the splice by sequence numbers. The service does the moving
//! parts (HTTP fetches, timers, the pump); this crate holds every DECISION, as pure functions and
//! state machines over values, so each rule is unit- and property-tested without a socket or a
//! clock (time is always passed in as `now_ms`, a monotonic millisecond count of the caller's):
//!
//! * [`vet`]: the only bridge from a sibling's response bytes to a [`vet::VettedSnapshot`];
//!   every refusal is a typed [`vet::Rejection`], classed permanent or transient, and a rank is
//!   never taken as covered on the strength of silence.
//! * [`outcome`]: how a rank's bootstrap ended (the project's one outcome type; the transitions
//!   to it are `kvroute-kv`'s rank machine), and the incarnation that names one registration of
//!   a rank, so a verdict about a removed-and-re-added worker is ignored.
//! * [`sweep`]: the passes over siblings (sit-outs, freshness floors, self exclusion), the
//!   verdicts, the coordinator that runs one fleet-wide sweep at a time and releases every held
//!   rank exactly once, the per-fetch timeout math and the `/readyz` rule.

pub mod outcome;
pub mod sweep;
pub mod vet;

pub use outcome::{Incarnation, Outcome};
pub use sweep::{
    Admission, Coordinator, Delivery, Disposition, ExportStamp, FetchOrder, FetchResult,
    FetchTimeout, FetchTimeoutWarning, LateJoin, Obligation, PeerBook, PeerView, Progress,
    ReadinessHold, ReadinessInputs, ReadinessLatch, Release, Sweep, Tick, Ticket, Verdict,
    VerdictKind, fetch_timeout, readiness_hold,
};
pub use vet::{
    BodyEncoding, BodyMedia, Coverage, Expectations, Rejection, VettedSnapshot, decode_stream, vet,
    vet_decoded, vet_stream,
};
