//! Readiness as a list of gates.
//!
//! `/readyz` is ready only when every gate passes. The router's own gate is "at least one healthy
//! worker"; later features (peer bootstrap of the index) add their own gate through
//! `RouterConfig::extra_readiness_gates` instead of editing the handler, which is why readiness is
//! a trait object list and not a boolean.

/// One condition the router must satisfy before it reports ready.
pub trait ReadinessGate: Send + Sync {
    /// Short stable name shown in the `/readyz` body.
    fn name(&self) -> &str;
    /// `Ok(())` when satisfied, otherwise a human-readable reason.
    fn check(&self) -> Result<(), String>;
}

/// Result of evaluating every gate, as returned by `/readyz`.
#[derive(Debug, serde::Serialize)]
pub struct ReadinessReport {
    pub ready: bool,
    pub gates: Vec<GateReport>,
}

#[derive(Debug, serde::Serialize)]
pub struct GateReport {
    pub name: String,
    pub ok: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
}

pub fn evaluate(gates: &[std::sync::Arc<dyn ReadinessGate>]) -> ReadinessReport {
    let gates: Vec<GateReport> = gates
        .iter()
        .map(|g| {
            let result = g.check();
            GateReport {
                name: g.name().to_string(),
                ok: result.is_ok(),
                reason: result.err(),
            }
        })
        .collect();
    ReadinessReport {
        ready: gates.iter().all(|g| g.ok),
        gates,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    struct Fixed(&'static str, bool);
    impl ReadinessGate for Fixed {
        fn name(&self) -> &str {
            self.0
        }
        fn check(&self) -> Result<(), String> {
            if self.1 { Ok(()) } else { Err("closed".into()) }
        }
    }

    #[test]
    fn one_failing_gate_makes_the_router_not_ready() {
        let gates: Vec<Arc<dyn ReadinessGate>> =
            vec![Arc::new(Fixed("a", true)), Arc::new(Fixed("b", false))];
        let report = evaluate(&gates);
        assert!(!report.ready);
        assert_eq!(report.gates[1].reason.as_deref(), Some("closed"));
        let gates: Vec<Arc<dyn ReadinessGate>> = vec![Arc::new(Fixed("a", true))];
        assert!(evaluate(&gates).ready);
    }
}
