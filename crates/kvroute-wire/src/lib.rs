//! kvroute-wire: what engines and replicas put on the wire, as typed Rust values.
//!
//! Two families live here, both pure data plus codecs (no sockets, no async), so the decoder can be
//! fuzzed, benchmarked and golden-tested on bytes alone:
//!
//! * engine KV-event batches ([`EventBatch`]): decoded from every msgpack shape SGLang and vLLM
//!   emit or have emitted (array or map batch; map-tagged or array-tagged events; signed, unsigned
//!   or 32-byte block hashes), and encoded again in each of those shapes for the simulated engine;
//! * the index snapshot data model ([`snapshot`]), which `kvroute-index` exports into and restores
//!   from, and which the service later serialises for `/internal/kv_snapshot`.
//!
//! Every length read from the wire is checked against a named limit before anything is
//! allocated for it, so a hostile 5-byte header cannot ask for gigabytes.

pub mod decode;
pub mod encode;
pub mod event;
pub mod snapshot;

pub use decode::{
    DecodeError, EVENTS_PER_BATCH_MAX, HASHES_PER_EVENT_MAX, Location, NESTING_DEPTH_MAX,
    PAYLOAD_MAX_BYTES, STRING_MAX_BYTES, TOKENS_PER_EVENT_MAX, decode_batch, decode_load_stat,
};
pub use encode::{
    Encoding, encode_batch, encode_batch_into, encode_load_stat, encoded_extra_key_digest,
};
pub use event::*;
