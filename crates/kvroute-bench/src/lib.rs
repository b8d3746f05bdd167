//! Benchmark tooling for side-by-side router comparisons (`bench/side_by_side.sh`).
//!
//! The load generator lives here as a library so its pieces (the latency histogram, the
//! schedule, the report) are testable without sockets, and the binary stays a thin CLI. It is
//! deliberately independent of the router crates: it must measure kvroute and its peers through
//! exactly the same client code.

pub mod histogram;
pub mod load;
