//! Kubernetes discovery of engine pods: a kube-rs `watcher` on Pods selected by label, turned
//! into a stream of worker additions and removals for the router's worker registry. This module
//! holds the flags, the validated configuration, the events and the handle; the watch itself
//! (which needs the `k8s` feature) is [`crate::engine_pods`].
//!
//! Why it is shaped this way:
//! - Pods, not EndpointSlices: engines are often deployed without a Service, and the pod's own
//!   labels and annotations carry what the router needs (the served model, a non-default port).
//!   A pod is a worker only while it is `Running`, has a pod IP, has its `Ready` condition
//!   `True` and carries no `deletionTimestamp`: a pod being deleted keeps `Ready` for a while,
//!   but it is draining and must get no new requests.
//! - The output is a bounded stream of [`EngineEvent`] edits rather than complete sets, because
//!   the router's registry is edited worker by worker (the same way the admin API and the
//!   static `--worker-urls` list add workers); the source keeps the last published set itself
//!   and emits only differences against it.
//! - A relist (start-up, or after a 410 Gone) is buffered from `Init` to `InitDone` and then
//!   diffed against the published set, so a relist emits only what really changed while the
//!   watch was down; unchanged pods are never removed and re-added (which would reset their
//!   health and KV attachment in the router).
//! - Only the derived (url, model) of worker pods is kept, never whole Pod objects, so memory is
//!   bounded by [`TRACKED_ENGINE_PODS_MAX`] small entries.
//! - Errors are left to the watcher's default backoff; the last published set stays in force
//!   (an API server outage must not look like "every engine is gone").

use thiserror::Error;
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

/// Engine HTTP port used when a pod has no [`ENGINE_PORT_ANNOTATION`].
pub const DEFAULT_ENGINE_PORT: u16 = 8000;
/// Pod annotation whose value overrides the engine HTTP port for that pod.
pub const ENGINE_PORT_ANNOTATION: &str = "kvroute.io/port";
/// Namespace watched when neither the flag nor `POD_NAMESPACE` names one.
pub const DEFAULT_ENGINE_NAMESPACE: &str = "default";
/// Events buffered between the source and the router before the source waits (backpressure,
/// never loss: a dropped `Removed` would leave a dead worker routable).
pub const ENGINE_EVENT_CHANNEL_CAPACITY: usize = 1024;
/// Worker pods tracked at most; beyond this a selector is certainly wrong, and we refuse to grow.
pub const TRACKED_ENGINE_PODS_MAX: usize = 4096;
/// Terms accepted in `--selector`.
pub const SELECTOR_TERMS_MAX: usize = 32;
/// Longest label name part / label value Kubernetes accepts.
pub const LABEL_NAME_MAX_BYTES: usize = 63;
/// Longest label key prefix (a DNS subdomain) Kubernetes accepts.
pub const LABEL_PREFIX_MAX_BYTES: usize = 253;
/// Longest namespace name (a DNS label).
pub const NAMESPACE_MAX_BYTES: usize = 63;
/// Longest piece of bad input echoed back in an error or a log line.
const ECHOED_INPUT_MAX_CHARS: usize = 300;

/// Engine discovery flags (`#[command(flatten)]` them into the router's arguments).
#[derive(Debug, Clone, clap::Args)]
pub struct EngineDiscoveryArgs {
    /// Discover engine pods through the Kubernetes API (needs `--selector`).
    #[arg(long = "service-discovery", env = "KVROUTE_SERVICE_DISCOVERY")]
    pub service_discovery: bool,
    /// Label selector of the engine pods, `k=v` (also `k!=v`, `k`, `!k`); repeat the flag or
    /// separate terms with commas; all terms must hold.
    #[arg(long = "selector", env = "KVROUTE_SELECTOR", value_delimiter = ',')]
    pub selector: Vec<String>,
    /// Namespace whose pods are watched.
    #[arg(
        long = "service-discovery-namespace",
        env = "POD_NAMESPACE",
        default_value = DEFAULT_ENGINE_NAMESPACE
    )]
    pub service_discovery_namespace: String,
    /// Engine HTTP port; a pod's `kvroute.io/port` annotation overrides it.
    #[arg(
        long = "service-discovery-port",
        env = "KVROUTE_SERVICE_DISCOVERY_PORT",
        default_value_t = DEFAULT_ENGINE_PORT
    )]
    pub service_discovery_port: u16,
    /// Pod label whose value is the served model; without it the router asks each engine.
    #[arg(
        long = "service-discovery-model-label",
        env = "KVROUTE_SERVICE_DISCOVERY_MODEL_LABEL"
    )]
    pub service_discovery_model_label: Option<String>,
}

/// A validated engine discovery configuration.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EngineDiscoveryConfig {
    /// Normalised `labelSelector` (terms trimmed, comma joined), never empty.
    pub label_selector: String,
    pub namespace: String,
    pub default_port: u16,
    pub model_label: Option<String>,
}

/// An engine discovery configuration that cannot work.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum EngineDiscoveryConfigError {
    #[error(
        "--service-discovery needs at least one --selector term: without one every pod in the \
         namespace would become a worker"
    )]
    MissingSelector,
    #[error("{0} given without --service-discovery")]
    DiscoveryOff(&'static str),
    #[error("--selector term {term:?}: {why}")]
    InvalidSelectorTerm { term: String, why: &'static str },
    #[error("--selector has {count} terms, over the limit of {SELECTOR_TERMS_MAX}")]
    TooManySelectorTerms { count: usize },
    #[error("--service-discovery-namespace {namespace:?} is not a valid namespace name")]
    InvalidNamespace { namespace: String },
    #[error("--service-discovery-port must be in 1..=65535")]
    ZeroPort,
    #[error("--service-discovery-model-label {label:?}: {why}")]
    InvalidModelLabel { label: String, why: &'static str },
}

pub(crate) fn echo(raw: &str) -> String {
    raw.chars().take(ECHOED_INPUT_MAX_CHARS).collect()
}

impl EngineDiscoveryArgs {
    /// The validated configuration, `None` when discovery is off.
    pub fn to_config(&self) -> Result<Option<EngineDiscoveryConfig>, EngineDiscoveryConfigError> {
        let terms: Vec<&str> = self
            .selector
            .iter()
            .map(|t| t.trim())
            .filter(|t| !t.is_empty())
            .collect();
        if !self.service_discovery {
            if !terms.is_empty() {
                return Err(EngineDiscoveryConfigError::DiscoveryOff("--selector"));
            }
            if self.service_discovery_model_label.is_some() {
                return Err(EngineDiscoveryConfigError::DiscoveryOff(
                    "--service-discovery-model-label",
                ));
            }
            return Ok(None);
        }
        if terms.is_empty() {
            return Err(EngineDiscoveryConfigError::MissingSelector);
        }
        if terms.len() > SELECTOR_TERMS_MAX {
            return Err(EngineDiscoveryConfigError::TooManySelectorTerms { count: terms.len() });
        }
        for term in &terms {
            validate_selector_term(term).map_err(|why| {
                EngineDiscoveryConfigError::InvalidSelectorTerm {
                    term: echo(term),
                    why,
                }
            })?;
        }
        // An empty POD_NAMESPACE (a downward-API typo) means "not set", as for an absent one.
        let namespace = match self.service_discovery_namespace.trim() {
            "" => DEFAULT_ENGINE_NAMESPACE,
            namespace => namespace,
        };
        if !is_dns_label(namespace, NAMESPACE_MAX_BYTES) {
            return Err(EngineDiscoveryConfigError::InvalidNamespace {
                namespace: echo(namespace),
            });
        }
        if self.service_discovery_port == 0 {
            return Err(EngineDiscoveryConfigError::ZeroPort);
        }
        let model_label = match self.service_discovery_model_label.as_deref().map(str::trim) {
            None | Some("") => None,
            Some(label) => {
                validate_label_key(label).map_err(|why| {
                    EngineDiscoveryConfigError::InvalidModelLabel {
                        label: echo(label),
                        why,
                    }
                })?;
                Some(label.to_string())
            }
        };
        Ok(Some(EngineDiscoveryConfig {
            label_selector: terms.join(","),
            namespace: namespace.to_string(),
            default_port: self.service_discovery_port,
            model_label,
        }))
    }
}

/// Equality-based terms only: set-based ones (`k in (a,b)`) contain commas, which the flag
/// already uses to separate terms.
fn validate_selector_term(term: &str) -> Result<(), &'static str> {
    if let Some((key, value)) = term.split_once("!=") {
        validate_label_key(key.trim())?;
        return validate_label_value(value.trim());
    }
    if let Some((key, value)) = term.split_once("==").or_else(|| term.split_once('=')) {
        validate_label_key(key.trim())?;
        return validate_label_value(value.trim());
    }
    if let Some(key) = term.strip_prefix('!') {
        return validate_label_key(key.trim());
    }
    if term.contains(' ') || term.contains('(') {
        return Err("set-based terms (in, notin) are not supported; use k=v, k!=v, k or !k");
    }
    validate_label_key(term)
}

fn is_name_char(b: u8) -> bool {
    b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.')
}

/// A label name part or non-empty value: alphanumeric at both ends, `-_.` inside.
fn is_label_name(s: &str) -> bool {
    let bytes = s.as_bytes();
    !bytes.is_empty()
        && bytes.len() <= LABEL_NAME_MAX_BYTES
        && bytes.iter().all(|b| is_name_char(*b))
        && bytes.first().is_some_and(u8::is_ascii_alphanumeric)
        && bytes.last().is_some_and(u8::is_ascii_alphanumeric)
}

/// A lower-case DNS label (namespace names, prefix parts).
fn is_dns_label(s: &str, max_bytes: usize) -> bool {
    let bytes = s.as_bytes();
    !bytes.is_empty()
        && bytes.len() <= max_bytes
        && bytes
            .iter()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || *b == b'-')
        && bytes.first().is_some_and(|b| *b != b'-')
        && bytes.last().is_some_and(|b| *b != b'-')
}

fn validate_label_key(key: &str) -> Result<(), &'static str> {
    let (prefix, name) = match key.split_once('/') {
        Some((prefix, name)) => (Some(prefix), name),
        None => (None, key),
    };
    if let Some(prefix) = prefix {
        let valid = prefix.len() <= LABEL_PREFIX_MAX_BYTES
            && prefix
                .split('.')
                .all(|part| is_dns_label(part, LABEL_NAME_MAX_BYTES));
        if !valid {
            return Err("label key prefix must be a lower-case DNS subdomain");
        }
    }
    if !is_label_name(name) {
        return Err("label name must be 1-63 of [A-Za-z0-9-_.], alphanumeric at both ends");
    }
    Ok(())
}

fn validate_label_value(value: &str) -> Result<(), &'static str> {
    if value.is_empty() || is_label_name(value) {
        Ok(())
    } else {
        Err("label value must be 0-63 of [A-Za-z0-9-_.], alphanumeric at both ends")
    }
}

/// A change to the set of engine workers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EngineEvent {
    /// A new worker: `url` is `http://IP:PORT`; `model` comes from the model label, if any.
    Added { url: String, model: Option<String> },
    /// A worker that must get no more requests (pod gone, not ready, or being deleted).
    Removed { url: String },
}

/// What a worker pod contributes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DiscoveredEngine {
    pub url: String,
    pub model: Option<String>,
}

/// A running engine discovery source. Dropping it stops the task too.
#[derive(Debug)]
pub struct EngineDiscoveryHandle {
    cancel: CancellationToken,
    task: Option<JoinHandle<()>>,
    syncs: watch::Receiver<u64>,
}

impl EngineDiscoveryHandle {
    #[cfg(feature = "k8s")]
    pub(crate) fn new(
        cancel: CancellationToken,
        task: JoinHandle<()>,
        syncs: watch::Receiver<u64>,
    ) -> Self {
        Self {
            cancel,
            task: Some(task),
            syncs,
        }
    }

    /// Stops the source and waits until it sends no more events.
    pub async fn shutdown(mut self) {
        self.cancel.cancel();
        if let Some(task) = self.task.take()
            && let Err(e) = task.await
        {
            tracing::warn!(error = %e, "engine discovery task ended abnormally");
        }
    }

    pub fn is_finished(&self) -> bool {
        self.task.as_ref().is_none_or(JoinHandle::is_finished)
    }

    /// Completed (re)lists: 0 until the first list is in; each increment happens after every
    /// event that list caused has been queued on the channel. A consumer can wait for `>= 1`
    /// before declaring itself ready, knowing the initial workers are already in its queue.
    pub fn syncs(&self) -> watch::Receiver<u64> {
        self.syncs.clone()
    }
}

impl Drop for EngineDiscoveryHandle {
    fn drop(&mut self) {
        self.cancel.cancel();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        engines: EngineDiscoveryArgs,
    }

    fn parse(args: &[&str]) -> EngineDiscoveryArgs {
        let mut argv = vec!["kvroute"];
        argv.extend_from_slice(args);
        Cli::try_parse_from(argv).unwrap().engines
    }

    #[test]
    fn selector_terms_may_be_repeated_or_comma_separated() {
        let c = parse(&[
            "--service-discovery",
            "--selector",
            "app=engine, tier=gpu",
            "--selector",
            "!canary",
            "--service-discovery-namespace",
            "inference",
            "--service-discovery-port",
            "30000",
            "--service-discovery-model-label",
            "kvroute.io/model",
        ])
        .to_config()
        .unwrap()
        .unwrap();
        assert_eq!(c.label_selector, "app=engine,tier=gpu,!canary");
        assert_eq!(c.namespace, "inference");
        assert_eq!(c.default_port, 30000);
        assert_eq!(c.model_label.as_deref(), Some("kvroute.io/model"));
    }

    #[test]
    fn defaults_are_port_8000_and_the_pod_namespace_or_default() {
        let c = parse(&["--service-discovery", "--selector", "app=engine"])
            .to_config()
            .unwrap()
            .unwrap();
        assert_eq!(c.default_port, DEFAULT_ENGINE_PORT);
        let expected_namespace = std::env::var("POD_NAMESPACE")
            .ok()
            .filter(|n| !n.is_empty())
            .unwrap_or_else(|| DEFAULT_ENGINE_NAMESPACE.to_string());
        assert_eq!(c.namespace, expected_namespace);
        assert_eq!(c.model_label, None);
        assert_eq!(
            parse(&[]).to_config(),
            Ok(None),
            "discovery is off by default"
        );
    }

    #[test]
    fn bad_discovery_flags_are_typed_errors() {
        use EngineDiscoveryConfigError as E;
        let err = |args: &[&str]| parse(args).to_config().unwrap_err();
        assert_eq!(err(&["--service-discovery"]), E::MissingSelector);
        assert_eq!(
            err(&["--service-discovery", "--selector", " , "]),
            E::MissingSelector
        );
        assert_eq!(
            err(&["--selector", "app=engine"]),
            E::DiscoveryOff("--selector")
        );
        for bad in [
            "app in (a,b)",
            "-app=x",
            "app=bad value",
            "UPPER.example/x=y",
            "a/b/c=d",
        ] {
            let flag = format!("--selector={bad}");
            let args = ["--service-discovery", flag.as_str()];
            assert!(
                matches!(parse(&args).to_config(), Err(E::InvalidSelectorTerm { .. })),
                "{bad:?} was accepted"
            );
        }
        let many: Vec<String> = (0..=SELECTOR_TERMS_MAX)
            .map(|i| format!("k{i}=v"))
            .collect();
        let many = many.join(",");
        assert_eq!(
            err(&["--service-discovery", "--selector", &many]),
            E::TooManySelectorTerms {
                count: SELECTOR_TERMS_MAX + 1
            }
        );
        assert!(matches!(
            err(&[
                "--service-discovery",
                "--selector",
                "a=b",
                "--service-discovery-namespace",
                "Bad_NS"
            ]),
            E::InvalidNamespace { .. }
        ));
        assert_eq!(
            err(&[
                "--service-discovery",
                "--selector",
                "a=b",
                "--service-discovery-port",
                "0"
            ]),
            E::ZeroPort
        );
        assert!(matches!(
            err(&[
                "--service-discovery",
                "--selector",
                "a=b",
                "--service-discovery-model-label",
                "model label"
            ]),
            E::InvalidModelLabel { .. }
        ));
    }
}
