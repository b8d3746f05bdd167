//! The names of the internal protocol between sibling replicas: endpoint paths and response
//! headers. A leaf module, so the listener that serves them and the client that asks for them
//! (and the bootstrap task above the client) share one definition without depending on each
//! other.

/// Path of the snapshot endpoint.
pub const KV_SNAPSHOT_PATH: &str = "/internal/kv_snapshot";
/// Path of the cursor table endpoint.
pub const KV_CURSORS_PATH: &str = "/internal/kv_cursors";
/// Response header naming the compression inside a binary snapshot's envelope.
pub const SNAPSHOT_COMPRESSION_HEADER: &str = "x-kvroute-snapshot-compression";
/// Response header: age of the served export at the request's arrival, in milliseconds.
pub const SNAPSHOT_AGE_HEADER: &str = "x-kvroute-snapshot-age-ms";
