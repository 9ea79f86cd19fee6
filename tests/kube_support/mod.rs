//! A **stand-in** for the Kubernetes API server, in process, for the
//! publisher's tests. It is not a fake of volring: it serves the custom
//! resources' HTTP API with the real server's semantics as far as the
//! publisher can observe them:
//!
//! - LIST (`routes.rs`, which routes every request) with `labelSelector`
//!   (equality terms, comma-joined), `limit` and an opaque `continue`
//!   token; a list carries `metadata.resourceVersion`.
//!   `fieldSelector` (`=`, `==`, `!=` terms) on `metadata.name` and on the
//!   fields the CRD volring installs lists as `selectableFields` (read from
//!   `volring_kube::crds_yaml`, as the API server reads the CRD), any other
//!   field a 400 "field label not supported", as the real server answers.
//! - GET, DELETE (200 with the object; 404 with a Status when absent).
//! - PATCH with `application/apply-patch+yaml` (server-side apply,
//!   `apply.rs`; bodies must be JSON, which is YAML): `fieldManager` is
//!   required (422 without), field ownership per top-level spec/status
//!   field and per label, a change to a field another manager owns is a
//!   409 conflict unless `force=true`, fields the manager stops applying
//!   are removed, a
//!   `metadata.resourceVersion` in the body is a precondition (409 when
//!   stale), a no-op apply does not change the resourceVersion.
//! - WATCH (`watch.rs`): label-selected event streams with bookmarks,
//!   of volring's resources and of a namespace's PVCs (`core.rs`),
//!   a resourceVersion to resume from, and 410 Expired once the history
//!   it needs is compacted.
//! - The status subresource: the main endpoint ignores `status`, the
//!   `/status` endpoint changes only `status` and answers 404 for an object
//!   that does not exist.
//! - VolumeAttachments (storage.k8s.io/v1), read-only: LIST (paginated,
//!   label selector, and `metadata.name` as the one field selector the real
//!   server allows on them: any other is a 400) and GET.
//! - What the real server refuses (`validate.rs`): loopback, link-local
//!   and unspecified Endpoints addresses, unknown fields under
//!   `fieldValidation=Strict` (dropped with a `Warning` header under the
//!   default `Warn`), volring objects that break their CRD's schema, label
//!   keys and values that are not valid. Not refused, because the real
//!   server does not refuse it either: a status apply without `status`
//!   (it drops the status fields that manager owned, as here).
//! - Injected failures: the next N matching requests answer 429 (with
//!   Retry-After), 500 or 409.
//! - A throttled server, as kube-apiserver's max-in-flight filter is with
//!   `--max-requests-inflight` / `--max-mutating-requests-inflight`: a
//!   request that arrives while that many of its class (mutating: POST,
//!   PUT, PATCH, DELETE; read-only: the rest) are in the server's hands is
//!   answered at once 429 TooManyRequests with `Retry-After: 1`, and is not
//!   held ([`StandIn::set_max_in_flight`]).
//! - An outage ([`StandIn::set_outage`]): while it lasts every request is
//!   answered 503 ServiceUnavailable without a Retry-After, as through a
//!   load balancer with no ready server behind it, or from a server still
//!   starting.
//!
//! Every request is logged (time, method, path, query, status, User-Agent)
//! so a test can count what the publisher asked for, and who asked. A hold knob keeps each request
//! for a while before it is served (a server's service time), and the
//! stand-in counts how many are in its hands at once, so a bound on
//! concurrency can be measured.

#![allow(dead_code)]

mod apply;
mod cluster;
mod core;
mod routes;
mod validate;
mod watch;

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, HeaderValue, Method, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use serde_json::{json, Value};

use apply::{fields_of, label_fields};
use routes::handle;

const PREFIX: &str = "/apis/volring.io/v1alpha1/";
/// Read-only: VolumeAttachments (seeded by the test, as the attacher would).
const STORAGE_PREFIX: &str = "/apis/storage.k8s.io/v1/";

/// One request as the stand-in saw it.
#[derive(Debug, Clone)]
pub struct Logged {
    /// When it was served (after any hold).
    pub at: Instant,
    /// When it reached the stand-in.
    pub started: Instant,
    pub method: Method,
    pub path: String,
    pub query: String,
    pub status: u16,
    /// The request's User-Agent header, if it had one.
    pub user_agent: Option<String>,
}

impl Logged {
    pub fn is_write(&self) -> bool {
        self.method == Method::PATCH && self.status < 300
    }
    pub fn is_status(&self) -> bool {
        self.path.ends_with("/status")
    }
    pub fn is_watch(&self) -> bool {
        self.method == Method::GET && query_pairs(&self.query).get("watch").is_some_and(|w| w == "true" || w == "1")
    }
}

/// A failure to answer instead of serving a request.
#[derive(Debug, Clone)]
pub struct Fault {
    pub status: u16,
    pub retry_after: Option<u64>,
    /// Only requests with this method (None: any).
    pub method: Option<Method>,
    /// Only requests whose path contains this.
    pub path_contains: String,
    /// How many requests it applies to.
    pub times: usize,
}

#[derive(Default)]
struct Stored {
    obj: Value,
    /// manager → the fields it owns ("spec.x", "status.y", "label:k").
    managers: BTreeMap<String, BTreeSet<String>>,
}

#[derive(Default)]
struct Inner {
    /// (plural, name) → object.
    objects: BTreeMap<(String, String), Stored>,
    /// The changes watches read, oldest first.
    events: VecDeque<watch::Event>,
    /// Watches from a version below this are told 410 Expired.
    compacted: u64,
    /// Woken at every change (and outage).
    changed: Arc<tokio::sync::Notify>,
    /// While true, watches receive nothing (and do not move on).
    watch_stall: bool,
    /// Bumped to end every watch stream.
    watch_generation: u64,
    /// How often a watch that asked for them gets a BOOKMARK (None: 1 s).
    bookmark_every: Option<std::time::Duration>,
    /// The highest resourceVersion each plural's watches were sent a
    /// BOOKMARK at.
    bookmarked: BTreeMap<String, u64>,
    rv: u64,
    uid: u64,
    log: Vec<Logged>,
    faults: VecDeque<Fault>,
    /// core/v1 namespaced objects (`core.rs`).
    core: BTreeMap<core::Key, Value>,
    /// Created core objects still invisible to this many GETs.
    core_hidden: BTreeMap<core::Key, usize>,
    /// How many GETs a created core object stays invisible to.
    core_lag: usize,
    next_cluster_ip: u32,
    /// Read-only PersistentVolumes and Pods (`cluster.rs`).
    cluster: cluster::Objects,
}

#[derive(Clone, Default)]
pub struct StandIn {
    inner: Arc<Mutex<Inner>>,
    flight: Arc<Mutex<Flight>>,
}

/// Requests in the stand-in's hands, and how long each is held.
#[derive(Default)]
struct Flight {
    hold: std::time::Duration,
    now: usize,
    max: usize,
    /// Of `now`: mutating requests, read-only requests.
    mutating: usize,
    readonly: usize,
    /// The max-in-flight limits (None: unlimited).
    max_mutating: Option<usize>,
    max_readonly: Option<usize>,
    /// Every request answered 503 while true.
    outage: bool,
}

/// The running stand-in: its address and its state.
pub struct Server {
    pub addr: SocketAddr,
    pub api: StandIn,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Server {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Server {
    pub async fn start() -> Server {
        let api = StandIn::default();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind 127.0.0.1");
        let addr = listener.local_addr().unwrap();
        let app = axum::Router::new().fallback(handle).with_state(api.clone());
        let task = tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        Server { addr, api, task }
    }

    /// A kube client configuration that talks to the stand-in.
    pub fn config(&self) -> kube::Config {
        kube::Config::new(format!("http://{}", self.addr).parse().unwrap())
    }
}

impl StandIn {
    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Holds every request this long before serving it.
    pub fn set_hold(&self, d: std::time::Duration) {
        self.flight.lock().unwrap().hold = d;
    }

    /// The most requests that were in the stand-in's hands at once.
    pub fn max_in_flight(&self) -> usize {
        self.flight.lock().unwrap().max
    }

    /// Forgets the most in flight so far (a test's next phase measures
    /// its own).
    pub fn reset_max_in_flight(&self) {
        let mut f = self.flight.lock().unwrap();
        f.max = f.now;
    }

    /// The max-in-flight filter: at most `readonly` read-only and
    /// `mutating` mutating requests in the server's hands at once; one
    /// beyond is answered 429 with `Retry-After: 1` (None: no limit).
    pub fn set_max_in_flight(&self, readonly: Option<usize>, mutating: Option<usize>) {
        let mut f = self.flight.lock().unwrap();
        (f.max_readonly, f.max_mutating) = (readonly, mutating);
    }

    /// Starts (true) or ends an outage: every request answered 503, and
    /// every watch stream ends.
    pub fn set_outage(&self, down: bool) {
        self.flight.lock().unwrap().outage = down;
        self.lock().changed.notify_waiters();
    }

    fn changed(&self) -> Arc<tokio::sync::Notify> {
        self.lock().changed.clone()
    }

    fn bookmark_every(&self) -> std::time::Duration {
        self.lock().bookmark_every.unwrap_or(std::time::Duration::from_secs(1))
    }

    /// How often watches get a BOOKMARK.
    pub fn set_bookmark_every(&self, d: std::time::Duration) {
        self.lock().bookmark_every = Some(d);
    }

    /// Forgets the history of changes, as etcd's compaction does: a watch
    /// resumed from before now is answered 410 Expired. Ends every watch
    /// stream (their clients resume from where they were).
    pub fn compact(&self) {
        let mut g = self.lock();
        g.events.clear();
        g.compacted = g.rv;
        g.watch_generation += 1;
        g.changed.notify_waiters();
    }

    /// While true, watches are sent nothing (a stalled stream).
    pub fn set_watch_stall(&self, stall: bool) {
        let mut g = self.lock();
        g.watch_stall = stall;
        g.changed.notify_waiters();
    }

    /// A restart of the API server: every connection drops (the watch
    /// streams end) and its watch cache starts again empty at the current
    /// resourceVersion, so a watch resumed from before it is answered 410
    /// Expired — what turns a restart into a LIST by every client that did
    /// not keep its version current with bookmarks. Requests are refused
    /// while [`StandIn::set_outage`] says so; call this in between.
    pub fn restart(&self) {
        self.compact();
    }

    /// The resourceVersion of the latest change.
    pub fn resource_version(&self) -> u64 {
        self.lock().rv
    }

    /// The highest resourceVersion `plural`'s watches were sent a BOOKMARK
    /// at (0: none yet).
    pub fn last_bookmark(&self, plural: &str) -> u64 {
        self.lock().bookmarked.get(plural).copied().unwrap_or(0)
    }

    /// Changes a stored object as another writer would (`kubectl edit`,
    /// `kubectl label`): a new resourceVersion, an event for watches.
    pub fn edit(&self, plural: &str, name: &str, f: impl FnOnce(&mut Value)) {
        let mut g = self.lock();
        g.rv += 1;
        let rv = g.rv;
        let key = (plural.to_string(), name.to_string());
        let s = g.objects.get_mut(&key).expect("the object to edit");
        let before = s.obj.clone();
        f(&mut s.obj);
        s.obj["metadata"]["resourceVersion"] = json!(rv.to_string());
        let after = s.obj.clone();
        watch::record(&mut g, plural, Some(before), Some(after));
    }

    /// Deletes a stored object as another client would.
    pub fn delete(&self, plural: &str, name: &str) {
        let mut g = self.lock();
        let s = g.objects.remove(&(plural.to_string(), name.to_string())).expect("the object to delete");
        g.rv += 1;
        watch::record(&mut g, plural, Some(s.obj), None);
    }

    pub fn inject(&self, f: Fault) {
        self.lock().faults.push_back(f);
    }

    pub fn log(&self) -> Vec<Logged> {
        self.lock().log.clone()
    }

    /// Forgets every object (and the log, and the history of changes).
    pub fn clear(&self) {
        let mut g = self.lock();
        g.objects.clear();
        g.log.clear();
        g.events.clear();
        g.compacted = g.rv;
    }

    /// A core/v1 object (`namespace`, `plural`, `name`).
    pub fn core_object(&self, namespace: &str, plural: &str, name: &str) -> Option<Value> {
        self.lock().core.get(&(namespace.to_string(), plural.to_string(), name.to_string())).cloned()
    }

    /// Stores a core/v1 object as another writer would have; returns it
    /// with its uid and resourceVersion.
    pub fn seed_core(&self, namespace: &str, plural: &str, obj: Value) -> Value {
        let body = serde_json::to_vec(&obj).unwrap();
        let mut g = self.lock();
        let r = core::serve(&mut g, &Method::POST, &format!("{namespace}/{plural}"), &BTreeMap::new(), &body, false);
        assert_eq!(r.status(), StatusCode::CREATED);
        g.core_hidden.clear();
        let name = obj["metadata"]["name"].as_str().unwrap().to_string();
        g.core[&(namespace.to_string(), plural.to_string(), name)].clone()
    }

    /// Changes a stored core/v1 object as another writer would (a new
    /// resourceVersion).
    pub fn edit_core(&self, namespace: &str, plural: &str, name: &str, f: impl FnOnce(&mut Value)) {
        let mut g = self.lock();
        g.rv += 1;
        let rv = g.rv;
        let o = g.core.get_mut(&(namespace.to_string(), plural.to_string(), name.to_string())).expect("the object to edit");
        let before = o.clone();
        f(o);
        o["metadata"]["resourceVersion"] = json!(rv.to_string());
        let after = o.clone();
        watch::record(&mut g, &core::watch_key(namespace, plural), Some(before), Some(after));
    }

    /// Stores a PersistentVolume or a Pod (read-only to clients: `cluster.rs`).
    pub fn seed_cluster(&self, plural: &str, obj: Value) {
        let mut g = self.lock();
        g.rv += 1;
        let key = cluster::key(plural, &obj);
        g.cluster.insert(key, obj);
    }

    /// Makes every core object created from now on invisible to the next
    /// `gets` GETs of it.
    pub fn set_create_lag(&self, gets: usize) {
        self.lock().core_lag = gets;
    }

    pub fn clear_log(&self) {
        self.lock().log.clear();
    }

    pub fn object(&self, plural: &str, name: &str) -> Option<Value> {
        self.lock().objects.get(&(plural.to_string(), name.to_string())).map(|s| s.obj.clone())
    }

    pub fn objects(&self, plural: &str) -> Vec<Value> {
        self.lock().objects.iter().filter(|((p, _), _)| p == plural).map(|(_, s)| s.obj.clone()).collect()
    }

    /// Stores an object as another writer would have (manager `other`).
    pub fn seed(&self, plural: &str, obj: Value) {
        let mut g = self.lock();
        g.rv += 1;
        g.uid += 1;
        let (rv, uid) = (g.rv, g.uid);
        let name = obj["metadata"]["name"].as_str().unwrap().to_string();
        let mut obj = obj;
        obj["metadata"]["resourceVersion"] = json!(rv.to_string());
        obj["metadata"]["uid"] = json!(format!("uid-{uid}"));
        let fields = fields_of(&obj, "spec").into_iter().chain(fields_of(&obj, "status")).chain(label_fields(&obj)).collect();
        let managers = [("other".to_string(), fields)].into();
        let before = g.objects.insert((plural.to_string(), name), Stored { obj: obj.clone(), managers }).map(|s| s.obj);
        watch::record(&mut g, plural, before, Some(obj));
    }
}

/// volring's CRDs, read once from what `volring crds` prints (as the API
/// server reads them once applied).
fn crds() -> &'static [k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition] {
    static CRDS: std::sync::OnceLock<Vec<k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition>> =
        std::sync::OnceLock::new();
    CRDS.get_or_init(|| {
        let docs: Vec<Value> = serde_saphyr::from_multiple(&volring_kube::crds_yaml()).expect("the CRDs are YAML");
        docs.into_iter().filter(|d| !d.is_null()).map(|d| serde_json::from_value(d).expect("a CRD")).collect()
    })
}

/// An object as the API server returns it (apiVersion, kind, name,
/// labels, spec, and status when it has one): how a test seeds the
/// stand-in with what a publisher wrote before. Built from the CRD's group
/// and version as the stand-in knows them, not borrowed from the
/// publisher, so a publisher that wrote another form would be seen.
pub fn api_form(o: &volring_kube::Object) -> Value {
    let kind = match o.key.kind {
        volring_kube::Kind::BlockDevice => "BlockDevice",
        volring_kube::Kind::StorageNode => "StorageNode",
    };
    let mut v = json!({
        "apiVersion": "volring.io/v1alpha1",
        "kind": kind,
        "metadata": {"name": o.key.name, "labels": o.labels},
        "spec": o.spec,
    });
    if !o.status.is_null() {
        v["status"] = o.status.clone();
    }
    v
}

fn status_body(code: StatusCode, reason: &str, message: &str) -> Value {
    json!({"kind": "Status", "apiVersion": "v1", "status": "Failure", "message": message, "reason": reason, "code": code.as_u16()})
}

fn reply(code: StatusCode, body: Value) -> Response {
    let mut r = (code, serde_json::to_vec(&body).unwrap()).into_response();
    r.headers_mut().insert("content-type", HeaderValue::from_static("application/json"));
    r
}

fn query_pairs(q: &str) -> BTreeMap<String, String> {
    q.split('&')
        .filter(|p| !p.is_empty())
        .map(|p| {
            let (k, v) = p.split_once('=').unwrap_or((p, ""));
            (unescape(k), unescape(v))
        })
        .collect()
}

fn unescape(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%' && i + 2 < b.len() {
            if let Some(v) = std::str::from_utf8(&b[i + 1..i + 3]).ok().and_then(|h| u8::from_str_radix(h, 16).ok()) {
                out.push(v);
                i += 3;
                continue;
            }
        }
        out.push(if b[i] == b'+' { b' ' } else { b[i] });
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// A volring resource's kind, from its plural.
fn kind_of(plural: &str) -> &'static str {
    match plural {
        "blockdevices" => "BlockDevice",
        "storagenodes" => "StorageNode",
        "volumeattachments" => "VolumeAttachment",
        _ => "Unknown",
    }
}

fn not_found(plural: &str, name: &str) -> Response {
    let msg = format!("{plural}.volring.io \"{name}\" not found");
    reply(StatusCode::NOT_FOUND, status_body(StatusCode::NOT_FOUND, "NotFound", &msg))
}

fn matches(obj: &Value, selector: &str) -> bool {
    selector.split(',').filter(|t| !t.is_empty()).all(|term| {
        let (k, v) = term.split_once('=').unwrap_or((term, ""));
        let v = v.trim_start_matches('=');
        obj["metadata"]["labels"][k].as_str() == Some(v)
    })
}

/// 422 Invalid, as apimachinery words it: `<what> "<name>" is invalid:
/// <error>` or `[<error>, ...]` for several.
fn invalid(what: &str, name: &str, errors: &[String]) -> Response {
    let list = if errors.len() == 1 { errors[0].clone() } else { format!("[{}]", errors.join(", ")) };
    let code = StatusCode::UNPROCESSABLE_ENTITY;
    reply(code, status_body(code, "Invalid", &format!("{what} \"{name}\" is invalid: {list}")))
}

/// A `Warning` header per unknown field dropped.
fn warn(r: &mut Response, unknown: &[String]) {
    for f in unknown {
        if let Ok(v) = HeaderValue::from_str(&format!("299 - \"unknown field \\\"{f}\\\"\"")) {
            r.headers_mut().append("warning", v);
        }
    }
}
