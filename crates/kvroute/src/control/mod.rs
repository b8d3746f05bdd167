//! The router's shared state and its lifecycle, off the request path.
//!
//! [`router`] holds the [`router::Router`] every handler shares and registers and removes workers;
//! [`registry`] is the worker and model-group table with per-rank load and the health state
//! machine; [`worker_source`] feeds it from the static list or Kubernetes engine discovery;
//! [`engine_metrics`] reads vLLM engines' own load from their `/metrics`;
//! [`readiness`] gates `/readyz` ([`gates`] holds the built-in gates); [`metrics`] is the Prometheus registry. All of it runs on the
//! control runtime: the data plane only reads it.

pub mod engine_metrics;
pub mod gates;
pub mod metrics;
pub mod readiness;
pub mod registry;
pub mod router;
pub mod worker_source;
