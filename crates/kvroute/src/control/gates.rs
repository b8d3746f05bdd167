//! The router's built-in readiness gates and the list `/readyz` evaluates.
//!
//! Separate from [`super::readiness`] (the gate trait and its evaluation, which the config
//! refers to for extra gates) so that module stays a leaf: these gates read the [`Router`],
//! which itself is built from the config.

use std::sync::Arc;

use crate::control::readiness::ReadinessGate;
use crate::control::router::Router;

/// Built-in readiness gate: at least one healthy worker is registered.
pub struct HealthyWorkerGate(pub Arc<Router>);

impl ReadinessGate for HealthyWorkerGate {
    fn name(&self) -> &str {
        "healthy_worker"
    }
    fn check(&self) -> Result<(), String> {
        match self.0.registry.healthy_count() {
            0 => {
                let registered = self.0.registry.workers().len();
                let retrying = self.0.registrations_retrying.list();
                Err(match retrying.first() {
                    None => format!("0 of {registered} registered workers are healthy"),
                    Some(first) => format!(
                        "0 of {registered} registered workers are healthy; {} more failed to register and are retried (/workers), {}: {}",
                        retrying.len(),
                        first.url,
                        first.last_error
                    ),
                })
            }
            _ => Ok(()),
        }
    }
}

/// The built-in gates followed by the configured extra ones; shared by `/readyz` and the
/// internal listener's `producer_ready`.
pub fn readiness_gates(router: &Arc<Router>) -> Arc<Vec<Arc<dyn ReadinessGate>>> {
    let mut gates: Vec<Arc<dyn ReadinessGate>> = vec![Arc::new(HealthyWorkerGate(router.clone()))];
    if let Some(bootstrap) = &router.bootstrap {
        gates.push(Arc::new(bootstrap.gate()));
    }
    gates.extend(router.config.extra_readiness_gates.iter().cloned());
    Arc::new(gates)
}
