//! kvroute's hand-written HTTP/1.1 data path, in two layers.
//!
//! - [`framing`]: pure HTTP/1.1 message framing (request and response heads, chunked bodies,
//!   writing heads and chunks). Bytes in, decisions out: no I/O, no async, so every rule is unit-
//!   and property-tested on its own, and it is the layer the fuzz targets drive.
//! - [`client`]: the pooled keep-alive client that carries routed requests to engines, written on
//!   the caller's own task with [`framing`] (no connection task, no channel).
//!
//! A crate of its own so the framing can be tested and fuzzed without the router, and so nothing
//! from the general HTTP stack (axum, hyper) leaks into the bytes-level rules. The server half of
//! the data path (accepting client connections, handing anything the framing does not take to
//! hyper) lives with the router, which owns the routes.

pub mod client;
pub mod framing;
