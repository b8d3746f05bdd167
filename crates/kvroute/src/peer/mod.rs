//! The sibling side of a replica: what other kvroute replicas ask of it, and what it asks of them.
//!
//! [`internal`] is the internal listener (its own port and bind address, optional bearer token)
//! that serves [`producer`]'s cached index snapshots and the cursor table; [`fetch`] is the
//! client a booting replica uses to pull a sibling's snapshot; [`bootstrap`] is the task that
//! makes a booting replica warm; [`load_share`] streams this replica's per-rank bookings to its
//! siblings and sums theirs into the cost model ([`load_frame`] is its wire format);
//! [`cold_owner`] lets the sibling that owns a cold prompt's prefix place it, and
//! [`owner_standings`] sets aside a sibling whose placement asks keep failing. Sibling DISCOVERY
//! is the `kvroute-discovery` crate; the
//! decisions of the bootstrap consumer (vetting, the sweep) are the pure `kvroute-bootstrap`
//! crate, and holding, grafting and splice proofs happen in the KV plane's pump.

pub mod body_tee;
pub mod bootstrap;
pub mod cold_owner;
pub mod fetch;
pub mod internal;
pub mod load_frame;
pub mod load_share;
pub mod load_share_tasks;
pub mod owner_standings;
pub mod prefault;
pub mod producer;
pub mod protocol;
