//! kvroute-kv: the KV plane (placeholder until its module tree lands).
