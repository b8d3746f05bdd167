//! Test support: a fake Kubernetes API server for EndpointSlices and Pods, and condition
//! waiting.
//!
//! NO REAL API SERVER IS USED. None can run on the project's machines (no kube-apiserver,
//! k3s or kind in Debian, PyPI, npm or crates.io usable offline; envtest downloads
//! binaries), so the Kubernetes source is tested against this in-process fake on 127.0.0.1,
//! driven by the real kube-rs client and watcher. The fake implements the parts of the
//! list/watch protocol the watcher relies on, as the real server behaves:
//! - `GET /apis/discovery.k8s.io/v1/namespaces/{ns}/endpointslices` and
//!   `GET /api/v1/namespaces/{ns}/pods` return an `EndpointSliceList` / `PodList` whose
//!   `metadata.resourceVersion` is the store's current version (one version counter for all
//!   kinds, as etcd has);
//! - `?watch=true&resourceVersion=N` streams newline-delimited
//!   `{"type":"ADDED|MODIFIED|DELETED|BOOKMARK","object":...}` for every change with a
//!   version above N, first from history, then live;
//! - a watch from a version older than the compacted history gets HTTP 200 with one `ERROR`
//!   event carrying a `Status` with code 410 (reason `Expired`) and the stream ends, which is
//!   what forces a client to relist; [`FakeApiServer::expire_watches`] sends the same event to
//!   open streams;
//! - [`FakeApiServer::close_watches`] ends open streams cleanly (the server's watch timeout),
//!   which a client answers by re-watching from its last version without relisting;
//! - `labelSelector` (`k=v`, `k==v`, `k!=v`, `k`, `!k`, comma-joined) filters list and watch;
//!   as on the real server, a watch sees a MODIFIED that moves an object out of its selector
//!   as DELETED and one that moves it in as ADDED.
//!
//! Objects are stored as the JSON the client would receive; the fake does not run any
//! controller (no kubelet: a test sets a pod's phase, IP and Ready condition itself).
//! Pagination is not implemented: the list always returns everything with no `continue`,
//! which is a valid server answer for the small sets used here.

#![allow(dead_code)]

use std::collections::{BTreeMap, VecDeque};
use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::extract::{Path, Query, State};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use k8s_openapi::api::core::v1::{ObjectReference, Pod};
use k8s_openapi::api::discovery::v1::{Endpoint, EndpointConditions, EndpointPort, EndpointSlice};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use parking_lot::Mutex;
use serde_json::{Value, json};
use tokio::sync::broadcast;

/// Live events buffered per open watch before a slow test client is cut off.
const WATCH_BROADCAST_CAPACITY_EVENTS: usize = 1024;

/// The resource kinds the fake serves.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum ResourceKind {
    EndpointSlice,
    Pod,
}

impl ResourceKind {
    fn from_kind(kind: &str) -> Self {
        match kind {
            "EndpointSlice" => Self::EndpointSlice,
            "Pod" => Self::Pod,
            other => panic!("the fake API server does not serve {other}"),
        }
    }

    fn kind(self) -> &'static str {
        match self {
            Self::EndpointSlice => "EndpointSlice",
            Self::Pod => "Pod",
        }
    }

    fn api_version(self) -> &'static str {
        match self {
            Self::EndpointSlice => "discovery.k8s.io/v1",
            Self::Pod => "v1",
        }
    }

    fn plural(self) -> &'static str {
        match self {
            Self::EndpointSlice => "endpointslices.discovery.k8s.io",
            Self::Pod => "pods",
        }
    }
}

/// One stored change, as history keeps it and live watches receive it.
#[derive(Clone, Debug)]
struct Change {
    rv: u64,
    resource: ResourceKind,
    namespace: String,
    kind: &'static str,
    object: Value,
    /// The object before a MODIFIED, to tell whether it entered or left a watch's selector.
    previous: Option<Value>,
}

impl Change {
    /// How a watch with `selector` sees this change, if at all.
    fn seen_as(&self, selector: &Selector) -> Option<&'static str> {
        let now = selector.matches(&self.object);
        let before = self.previous.as_ref().map(|p| selector.matches(p));
        match (self.kind, before, now) {
            ("MODIFIED", Some(true), false) => Some("DELETED"),
            ("MODIFIED", Some(false), true) => Some("ADDED"),
            (_, _, true) => Some(self.kind),
            _ => None,
        }
    }
}

#[derive(Clone, Debug)]
enum WatchMsg {
    Event(Change),
    Bookmark { rv: u64 },
    Expire,
    Close,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RequestKind {
    List,
    Watch,
}

#[derive(Default)]
struct Store {
    rv: u64,
    /// (kind, namespace, name) -> object.
    objects: BTreeMap<(ResourceKind, String, String), Value>,
    history: Vec<Change>,
    /// Watches starting below this version get 410 Gone (their history is gone).
    compacted_through: u64,
    requests: Vec<(RequestKind, String)>,
    /// Answer every request 403 Forbidden, as with missing RBAC.
    forbidden: bool,
}

struct Shared {
    store: Mutex<Store>,
    live: broadcast::Sender<WatchMsg>,
}

/// The fake server; dropping it stops serving.
pub struct FakeApiServer {
    pub url: String,
    shared: Arc<Shared>,
    server: tokio::task::JoinHandle<()>,
}

impl Drop for FakeApiServer {
    fn drop(&mut self) {
        self.server.abort();
    }
}

#[derive(serde::Deserialize, Debug, Default)]
#[serde(rename_all = "camelCase")]
struct ListWatchQuery {
    watch: Option<String>,
    resource_version: Option<String>,
    label_selector: Option<String>,
}

impl FakeApiServer {
    pub async fn start() -> Self {
        let (live, _) = broadcast::channel(WATCH_BROADCAST_CAPACITY_EVENTS);
        let shared = Arc::new(Shared {
            store: Mutex::new(Store {
                rv: 1,
                ..Store::default()
            }),
            live,
        });
        let app = Router::new()
            .route(
                "/apis/discovery.k8s.io/v1/namespaces/{ns}/endpointslices",
                get(list_or_watch_endpointslices),
            )
            .route("/api/v1/namespaces/{ns}/pods", get(list_or_watch_pods))
            .with_state(shared.clone());
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let server = tokio::spawn(async move {
            axum::serve(listener, app).await.unwrap();
        });
        Self {
            url,
            shared,
            server,
        }
    }

    /// Creates or replaces an object (slice or pod) and notifies open watches (ADDED or
    /// MODIFIED).
    pub fn apply<K: FakeObject>(&self, object: &K) {
        self.apply_inner(object, true);
    }

    /// Deletes a slice and notifies open watches (DELETED).
    pub fn delete(&self, namespace: &str, name: &str) {
        self.delete_inner(ResourceKind::EndpointSlice, namespace, name, true);
    }

    /// Deletes a pod and notifies open watches (DELETED).
    pub fn delete_pod(&self, namespace: &str, name: &str) {
        self.delete_inner(ResourceKind::Pod, namespace, name, true);
    }

    /// Changes the store while no watch hears of it: the events a client misses while its
    /// watch is down. Pair with [`Self::compact`] so they cannot be replayed either.
    pub fn apply_unheard<K: FakeObject>(&self, object: &K) {
        self.apply_inner(object, false);
    }

    pub fn delete_unheard(&self, namespace: &str, name: &str) {
        self.delete_inner(ResourceKind::EndpointSlice, namespace, name, false);
    }

    pub fn delete_pod_unheard(&self, namespace: &str, name: &str) {
        self.delete_inner(ResourceKind::Pod, namespace, name, false);
    }

    /// Forgets history up to the current version (etcd compaction).
    pub fn compact(&self) {
        let mut store = self.shared.store.lock();
        store.compacted_through = store.rv;
        store.history.clear();
    }

    /// Sends every open watch an `ERROR` event with a 410 `Status`, then ends it.
    pub fn expire_watches(&self) {
        let _ = self.shared.live.send(WatchMsg::Expire);
    }

    /// Ends every open watch stream cleanly.
    pub fn close_watches(&self) {
        let _ = self.shared.live.send(WatchMsg::Close);
    }

    /// Sends a BOOKMARK at the current version to every open watch.
    pub fn bookmark(&self) {
        let rv = self.shared.store.lock().rv;
        let _ = self.shared.live.send(WatchMsg::Bookmark { rv });
    }

    /// Makes every request fail with 403 Forbidden (a ServiceAccount without the Role).
    pub fn set_forbidden(&self, forbidden: bool) {
        self.shared.store.lock().forbidden = forbidden;
    }

    /// Number of list / watch requests served so far.
    pub fn request_count(&self, kind: RequestKind) -> usize {
        let store = self.shared.store.lock();
        store.requests.iter().filter(|(k, _)| *k == kind).count()
    }

    pub fn requests(&self) -> Vec<(RequestKind, String)> {
        self.shared.store.lock().requests.clone()
    }

    /// Open watch streams right now.
    pub fn open_watches(&self) -> usize {
        self.shared.live.receiver_count()
    }

    fn apply_inner<K: FakeObject>(&self, object: &K, notify: bool) {
        let resource = ResourceKind::from_kind(K::KIND);
        let mut object = serde_json::to_value(object).unwrap();
        object["kind"] = json!(resource.kind());
        object["apiVersion"] = json!(resource.api_version());
        let namespace = object["metadata"]["namespace"]
            .as_str()
            .unwrap_or("default")
            .to_string();
        let name = object["metadata"]["name"].as_str().unwrap().to_string();
        let mut store = self.shared.store.lock();
        store.rv += 1;
        let rv = store.rv;
        object["metadata"]["namespace"] = json!(namespace);
        object["metadata"]["resourceVersion"] = json!(rv.to_string());
        let key = (resource, namespace.clone(), name);
        let previous = store.objects.insert(key, object.clone());
        let kind = if previous.is_some() {
            "MODIFIED"
        } else {
            "ADDED"
        };
        let change = Change {
            rv,
            resource,
            namespace,
            kind,
            object,
            previous,
        };
        store.history.push(change.clone());
        if notify {
            let _ = self.shared.live.send(WatchMsg::Event(change));
        }
    }

    fn delete_inner(&self, resource: ResourceKind, namespace: &str, name: &str, notify: bool) {
        let mut store = self.shared.store.lock();
        let key = (resource, namespace.to_string(), name.to_string());
        let Some(mut object) = store.objects.remove(&key) else {
            return;
        };
        store.rv += 1;
        let rv = store.rv;
        object["metadata"]["resourceVersion"] = json!(rv.to_string());
        let change = Change {
            rv,
            resource,
            namespace: namespace.to_string(),
            kind: "DELETED",
            object,
            previous: None,
        };
        store.history.push(change.clone());
        if notify {
            let _ = self.shared.live.send(WatchMsg::Event(change));
        }
    }
}

/// Objects the fake can store: the k8s-openapi types it serves.
pub trait FakeObject: serde::Serialize + k8s_openapi::Resource {}
impl FakeObject for EndpointSlice {}
impl FakeObject for Pod {}

async fn list_or_watch_endpointslices(
    State(shared): State<Arc<Shared>>,
    Path(namespace): Path<String>,
    Query(q): Query<ListWatchQuery>,
    uri: axum::http::Uri,
) -> Response {
    list_or_watch(shared, ResourceKind::EndpointSlice, namespace, q, uri)
}

async fn list_or_watch_pods(
    State(shared): State<Arc<Shared>>,
    Path(namespace): Path<String>,
    Query(q): Query<ListWatchQuery>,
    uri: axum::http::Uri,
) -> Response {
    list_or_watch(shared, ResourceKind::Pod, namespace, q, uri)
}

fn list_or_watch(
    shared: Arc<Shared>,
    resource: ResourceKind,
    namespace: String,
    q: ListWatchQuery,
    uri: axum::http::Uri,
) -> Response {
    let selector = match q.label_selector.as_deref().map(Selector::parse).transpose() {
        Ok(s) => s.unwrap_or_default(),
        Err(msg) => return status_response(StatusCode::BAD_REQUEST, "BadRequest", &msg),
    };
    let watching = q.watch.as_deref() == Some("true") || q.watch.as_deref() == Some("1");
    let kind = if watching {
        RequestKind::Watch
    } else {
        RequestKind::List
    };
    let mut store = shared.store.lock();
    store
        .requests
        .push((kind, uri.path_and_query().unwrap().to_string()));
    if store.forbidden {
        let plural = resource.plural();
        let msg = format!(
            "{plural} is forbidden: cannot list resource \"{plural}\" in namespace \"{namespace}\""
        );
        return status_response(StatusCode::FORBIDDEN, "Forbidden", &msg);
    }
    if !watching {
        let items: Vec<Value> = store
            .objects
            .iter()
            .filter(|((r, ns, _), obj)| *r == resource && *ns == namespace && selector.matches(obj))
            .map(|(_, obj)| obj.clone())
            .collect();
        let body = json!({
            "kind": format!("{}List", resource.kind()),
            "apiVersion": resource.api_version(),
            "metadata": {"resourceVersion": store.rv.to_string()},
            "items": items,
        });
        return (
            [(header::CONTENT_TYPE, "application/json")],
            body.to_string(),
        )
            .into_response();
    }
    // Without a version (or "0") the real server first sends a synthetic ADDED per object.
    let from_rv: Option<u64> = match q.resource_version.as_deref() {
        None | Some("") | Some("0") => None,
        Some(v) => match v.parse() {
            Ok(v) => Some(v),
            Err(_) => {
                return status_response(
                    StatusCode::BAD_REQUEST,
                    "BadRequest",
                    "invalid resourceVersion",
                );
            }
        },
    };
    let mut backlog: VecDeque<String> = VecDeque::new();
    let expired = from_rv.is_some_and(|rv| rv < store.compacted_through);
    match from_rv {
        Some(rv) if expired => backlog.push_back(expired_line(rv, store.compacted_through)),
        Some(from) => {
            for c in &store.history {
                if c.rv > from
                    && c.resource == resource
                    && c.namespace == namespace
                    && let Some(kind) = c.seen_as(&selector)
                {
                    backlog.push_back(event_line(kind, &c.object));
                }
            }
        }
        None => {
            for ((r, ns, _), obj) in &store.objects {
                if *r == resource && *ns == namespace && selector.matches(obj) {
                    backlog.push_back(event_line("ADDED", obj));
                }
            }
        }
    }
    // Subscribing under the store lock means no change can fall between backlog and live.
    let live = shared.live.subscribe();
    let last_rv = store.rv.max(from_rv.unwrap_or(0));
    drop(store);
    let state = WatchStream {
        backlog,
        live,
        resource,
        namespace,
        selector,
        last_rv,
        ended: expired,
    };
    let stream = futures::stream::unfold(state, next_watch_line);
    Response::builder()
        .header(header::CONTENT_TYPE, "application/json")
        .body(Body::from_stream(stream))
        .unwrap()
}

struct WatchStream {
    backlog: VecDeque<String>,
    live: broadcast::Receiver<WatchMsg>,
    resource: ResourceKind,
    namespace: String,
    selector: Selector,
    last_rv: u64,
    /// No live events follow the backlog (an expired watch).
    ended: bool,
}

async fn next_watch_line(mut s: WatchStream) -> Option<(Result<String, Infallible>, WatchStream)> {
    if let Some(line) = s.backlog.pop_front() {
        return Some((Ok(line), s));
    }
    if s.ended {
        return None;
    }
    loop {
        match s.live.recv().await {
            Ok(WatchMsg::Event(c)) => {
                if c.rv <= s.last_rv || c.resource != s.resource || c.namespace != s.namespace {
                    continue;
                }
                let Some(kind) = c.seen_as(&s.selector) else {
                    continue;
                };
                s.last_rv = c.rv;
                let line = event_line(kind, &c.object);
                return Some((Ok(line), s));
            }
            Ok(WatchMsg::Bookmark { rv }) => {
                let line = json!({
                    "type": "BOOKMARK",
                    "object": {
                        "kind": s.resource.kind(),
                        "apiVersion": s.resource.api_version(),
                        "metadata": {"resourceVersion": rv.to_string()},
                    }
                });
                return Some((Ok(format!("{line}\n")), s));
            }
            Ok(WatchMsg::Expire) => {
                s.ended = true;
                let line = expired_line(s.last_rv, s.last_rv + 1);
                return Some((Ok(line), s));
            }
            Ok(WatchMsg::Close) => return None,
            // The real server ends a watch it cannot keep up with; so do we.
            Err(broadcast::error::RecvError::Lagged(_)) => return None,
            Err(broadcast::error::RecvError::Closed) => return None,
        }
    }
}

fn event_line(kind: &str, object: &Value) -> String {
    format!("{}\n", json!({"type": kind, "object": object}))
}

fn expired_line(requested: u64, oldest: u64) -> String {
    let status = json!({
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": format!("too old resource version: {requested} ({oldest})"),
        "reason": "Expired",
        "code": 410,
    });
    format!("{}\n", json!({"type": "ERROR", "object": status}))
}

fn status_response(code: StatusCode, reason: &str, message: &str) -> Response {
    let body = json!({
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code.as_u16(),
    });
    (
        code,
        [(header::CONTENT_TYPE, "application/json")],
        body.to_string(),
    )
        .into_response()
}

/// Equality-based label selector, as `labelSelector` accepts it.
#[derive(Debug, Clone, Default)]
struct Selector {
    terms: Vec<Term>,
}

#[derive(Debug, Clone)]
enum Term {
    Eq(String, String),
    NotEq(String, String),
    Exists(String),
    NotExists(String),
}

impl Selector {
    fn parse(raw: &str) -> Result<Self, String> {
        let mut terms = Vec::new();
        for part in raw.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let term = if let Some((k, v)) = part.split_once("!=") {
                Term::NotEq(k.trim().into(), v.trim().into())
            } else if let Some((k, v)) = part.split_once("==") {
                Term::Eq(k.trim().into(), v.trim().into())
            } else if let Some((k, v)) = part.split_once('=') {
                Term::Eq(k.trim().into(), v.trim().into())
            } else if let Some(k) = part.strip_prefix('!') {
                Term::NotExists(k.trim().into())
            } else if part.contains(' ') || part.contains('(') {
                return Err(format!("unsupported selector term {part:?}"));
            } else {
                Term::Exists(part.into())
            };
            terms.push(term);
        }
        Ok(Self { terms })
    }

    fn matches(&self, object: &Value) -> bool {
        let labels = &object["metadata"]["labels"];
        let get = |k: &str| labels.get(k).and_then(Value::as_str);
        self.terms.iter().all(|t| match t {
            Term::Eq(k, v) => get(k) == Some(v.as_str()),
            Term::NotEq(k, v) => get(k) != Some(v.as_str()),
            Term::Exists(k) => get(k).is_some(),
            Term::NotExists(k) => get(k).is_none(),
        })
    }
}

/// One endpoint of a slice, as tests describe it.
#[derive(Debug, Clone)]
pub struct Ep {
    pub ip: &'static str,
    pub pod: &'static str,
    pub ready: Option<bool>,
    pub terminating: Option<bool>,
}

impl Ep {
    pub fn ready(ip: &'static str, pod: &'static str) -> Self {
        Self {
            ip,
            pod,
            ready: Some(true),
            terminating: Some(false),
        }
    }

    pub fn not_ready(mut self) -> Self {
        self.ready = Some(false);
        self
    }

    pub fn terminating(mut self) -> Self {
        self.ready = Some(false);
        self.terminating = Some(true);
        self
    }
}

/// An EndpointSlice of Service `service` in `namespace`, shaped as the endpoints controller
/// writes them: service-name label, named ports, endpoints with conditions and a Pod targetRef.
pub fn slice(namespace: &str, service: &str, name: &str, endpoints: &[Ep]) -> EndpointSlice {
    EndpointSlice {
        metadata: ObjectMeta {
            name: Some(name.to_string()),
            namespace: Some(namespace.to_string()),
            labels: Some(
                [
                    ("kubernetes.io/service-name", service),
                    (
                        "endpointslice.kubernetes.io/managed-by",
                        "endpointslice-controller.k8s.io",
                    ),
                ]
                .into_iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
            ),
            ..Default::default()
        },
        address_type: "IPv4".to_string(),
        endpoints: endpoints
            .iter()
            .map(|e| Endpoint {
                addresses: vec![e.ip.to_string()],
                conditions: Some(EndpointConditions {
                    ready: e.ready,
                    serving: e.ready,
                    terminating: e.terminating,
                }),
                target_ref: Some(ObjectReference {
                    kind: Some("Pod".to_string()),
                    name: Some(e.pod.to_string()),
                    namespace: Some(namespace.to_string()),
                    ..Default::default()
                }),
                ..Default::default()
            })
            .collect(),
        ports: Some(vec![
            EndpointPort {
                name: Some("http".to_string()),
                port: Some(8080),
                protocol: Some("TCP".to_string()),
                ..Default::default()
            },
            EndpointPort {
                name: Some("internal".to_string()),
                port: Some(8081),
                protocol: Some("TCP".to_string()),
                ..Default::default()
            },
        ]),
    }
}

/// Waits until `cond` holds for the registry's state, or fails naming what was awaited and
/// the last state seen.
pub async fn wait_for_state(
    rx: &mut tokio::sync::watch::Receiver<kvroute_discovery::PeerSnapshot>,
    what: &str,
    cond: impl Fn(&kvroute_discovery::PeerSnapshot) -> bool,
) -> kvroute_discovery::PeerSnapshot {
    const WAIT_DEADLINE_MS: u64 = 15_000;
    let outcome = tokio::time::timeout(
        Duration::from_millis(WAIT_DEADLINE_MS),
        rx.wait_for(|s| cond(s)),
    )
    .await
    .map(|r| r.map(|s| s.clone()));
    match outcome {
        Ok(Ok(s)) => s,
        _ => panic!(
            "timed out after {WAIT_DEADLINE_MS} ms waiting for {what}; last state seen: {:?}",
            *rx.borrow()
        ),
    }
}

/// Polls a non-registry condition (fake server counters) with a deadline.
pub async fn wait_until(what: &str, cond: impl Fn() -> Option<String>) {
    const WAIT_DEADLINE_MS: u64 = 15_000;
    const POLL_INTERVAL_MS: u64 = 5;
    let deadline = tokio::time::Instant::now() + Duration::from_millis(WAIT_DEADLINE_MS);
    loop {
        let seen = match cond() {
            None => return,
            Some(seen) => seen,
        };
        if tokio::time::Instant::now() > deadline {
            panic!("timed out after {WAIT_DEADLINE_MS} ms waiting for {what}; last seen: {seen}");
        }
        tokio::time::sleep(Duration::from_millis(POLL_INTERVAL_MS)).await;
    }
}

/// The peer URLs of a state, as strings.
pub fn urls(s: &kvroute_discovery::PeerSnapshot) -> Vec<String> {
    s.peers.iter().map(|p| p.to_string()).collect()
}

/// An engine pod as the kubelet reports it once its readiness probe passes: phase `Running`,
/// a pod IP and condition `Ready=True`. The fake runs no kubelet, so tests set these fields.
pub fn engine_pod(namespace: &str, name: &str, ip: &str, labels: &[(&str, &str)]) -> Pod {
    serde_json::from_value(json!({
        "metadata": {
            "name": name,
            "namespace": namespace,
            "uid": format!("uid-{namespace}-{name}"),
            "labels": labels.iter().map(|(k, v)| (k.to_string(), json!(v))).collect::<serde_json::Map<_, _>>(),
        },
        "spec": {"containers": [{"name": "engine", "image": "engine:latest"}]},
        "status": {
            "phase": "Running",
            "podIP": ip,
            "podIPs": [{"ip": ip}],
            "conditions": [
                {"type": "PodScheduled", "status": "True"},
                {"type": "Initialized", "status": "True"},
                {"type": "ContainersReady", "status": "True"},
                {"type": "Ready", "status": "True"},
            ],
        },
    }))
    .expect("a valid Pod")
}

/// The readiness probe failing: `Ready` and `ContainersReady` become `False`.
pub fn not_ready(mut pod: Pod) -> Pod {
    for c in pod
        .status
        .as_mut()
        .and_then(|s| s.conditions.as_mut())
        .into_iter()
        .flatten()
    {
        if c.type_ == "Ready" || c.type_ == "ContainersReady" {
            c.status = "False".to_string();
        }
    }
    pod
}

/// A pod just created: scheduled but not started, so no IP and no `Ready` condition.
pub fn pending(mut pod: Pod) -> Pod {
    if let Some(s) = pod.status.as_mut() {
        s.phase = Some("Pending".to_string());
        s.pod_ip = None;
        s.pod_ips = None;
        s.conditions = Some(vec![k8s_openapi::api::core::v1::PodCondition {
            type_: "PodScheduled".to_string(),
            status: "True".to_string(),
            ..Default::default()
        }]);
    }
    pod
}

/// Graceful deletion started: the API server sets `deletionTimestamp` (and the pod keeps its
/// `Ready` condition until the kubelet notices), then deletes the object after the grace period.
pub fn deleting(mut pod: Pod) -> Pod {
    pod.metadata.deletion_timestamp = Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
        k8s_openapi::jiff::Timestamp::UNIX_EPOCH,
    ));
    pod.metadata.deletion_grace_period_seconds = Some(30);
    pod
}

pub fn annotated(mut pod: Pod, key: &str, value: &str) -> Pod {
    pod.metadata
        .annotations
        .get_or_insert_default()
        .insert(key.to_string(), value.to_string());
    pod
}

pub fn labelled(mut pod: Pod, key: &str, value: &str) -> Pod {
    pod.metadata
        .labels
        .get_or_insert_default()
        .insert(key.to_string(), value.to_string());
    pod
}
