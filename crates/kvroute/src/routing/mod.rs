//! Which rank serves a request: the decision and everything it reads.
//!
//! [`plan`] is the entry point of the routing step: it resolves the model group, asks [`kv`] (the
//! only door to the KV plane and the index) for each rank's cached prefix depth, extends it with
//! [`pending`] prefixes, and lets [`policy`] order the ranks by the cost model. [`tokenize`] turns
//! chat messages into the token ids those steps hash, and [`text_bound`] proves a text too long
//! to tokenize from its length alone. [`prediction`] checks the depth predicted
//! for the chosen rank against the cached tokens the engine reports in its answer. Nothing here
//! does network I/O on the request path; the KV plane is fed by the control runtime.

pub mod kv;
pub mod pending;
pub mod plan;
pub mod policy;
pub mod prediction;
pub mod text_bound;
pub mod tokenize;
