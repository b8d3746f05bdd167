//! kvroute-index: which engine rank holds which token blocks.
pub mod hash;
