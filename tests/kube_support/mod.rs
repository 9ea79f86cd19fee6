//! A **stand-in** for the Kubernetes API server, in process, for the
//! publisher's tests. It is not a fake of volring: it serves the custom
//! resources' HTTP API with the real server's semantics as far as the
//! publisher can observe them:
//!
//! - LIST with `labelSelector` (equality terms, comma-joined), `limit` and
//!   an opaque `continue` token; a list carries `metadata.resourceVersion`.
//!   `fieldSelector` (`=`, `==`, `!=` terms) on `metadata.name` and on the
//!   fields the CRD volring installs lists as `selectableFields` (read from
//!   `volring_kube::objects`, as the API server reads the CRD), any other
//!   field a 400 "field label not supported", as the real server answers.
//! - GET, DELETE (200 with the object; 404 with a Status when absent).
//! - PATCH with `application/apply-patch+yaml` (server-side apply; bodies
//!   must be JSON, which is YAML): `fieldManager` is required (422 without),
//!   field ownership per top-level spec/status field and per label, a
//!   change to a field another manager owns is a 409 conflict unless
//!   `force=true`, fields the manager stops applying are removed, a
//!   `metadata.resourceVersion` in the body is a precondition (409 when
//!   stale), a no-op apply does not change the resourceVersion.
//! - WATCH (`watch.rs`): label-selected event streams with bookmarks,
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

mod cluster;
mod core;
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
        f(o);
        o["metadata"]["resourceVersion"] = json!(rv.to_string());
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

async fn handle(State(api): State<StandIn>, method: Method, uri: Uri, headers: HeaderMap, body: Bytes) -> Response {
    let path = uri.path().to_string();
    let query = uri.query().unwrap_or("").to_string();
    let started = Instant::now();
    let user_agent = headers.get(axum::http::header::USER_AGENT).map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned());
    let q = query_pairs(&query);
    if method == Method::GET && q.get("watch").is_some_and(|w| w == "true" || w == "1") {
        // Long-running: not counted by the max-in-flight filter.
        let plural = path.strip_prefix(PREFIX).filter(|p| !p.contains('/')).map(str::to_string);
        let resp = match plural {
            _ if api.flight.lock().unwrap().outage => unavailable(),
            Some(p) => watch::serve(&api, &p, &q),
            None => reply(
                StatusCode::METHOD_NOT_ALLOWED,
                status_body(StatusCode::METHOD_NOT_ALLOWED, "MethodNotAllowed", "watch not served here by the stand-in"),
            ),
        };
        let status = resp.status().as_u16();
        api.lock().log.push(Logged { at: Instant::now(), started, method, path, query, status, user_agent });
        return resp;
    }
    let mutating = !matches!(method, Method::GET | Method::HEAD | Method::OPTIONS);
    let admitted = {
        let mut f = api.flight.lock().unwrap();
        let (class_now, class_max) = if mutating { (f.mutating, f.max_mutating) } else { (f.readonly, f.max_readonly) };
        if f.outage {
            Err(unavailable())
        } else if class_max.is_some_and(|m| class_now >= m) {
            Err(too_many_requests())
        } else {
            f.now += 1;
            f.max = f.max.max(f.now);
            if mutating {
                f.mutating += 1;
            } else {
                f.readonly += 1;
            }
            Ok(f.hold)
        }
    };
    let hold = match admitted {
        Ok(hold) => hold,
        Err(resp) => {
            let status = resp.status().as_u16();
            api.lock().log.push(Logged { at: Instant::now(), started, method, path, query, status, user_agent });
            return resp;
        }
    };
    // Out of the count when served, or when the client gave up on it.
    let counted = InFlight { flight: api.flight.clone(), mutating };
    if !hold.is_zero() {
        tokio::time::sleep(hold).await;
    }
    drop(counted);
    let mut g = api.lock();
    let resp = serve(&mut g, &method, &path, &query, &headers, &body);
    let status = resp.status().as_u16();
    g.log.push(Logged { at: Instant::now(), started, method, path, query, status, user_agent });
    resp
}

/// One admitted request, counted in flight until dropped.
struct InFlight {
    flight: Arc<Mutex<Flight>>,
    mutating: bool,
}

impl Drop for InFlight {
    fn drop(&mut self) {
        let mut f = self.flight.lock().unwrap_or_else(|e| e.into_inner());
        f.now -= 1;
        if self.mutating {
            f.mutating -= 1;
        } else {
            f.readonly -= 1;
        }
    }
}

/// What kube-apiserver's max-in-flight filter answers a request over its
/// limit.
fn too_many_requests() -> Response {
    let code = StatusCode::TOO_MANY_REQUESTS;
    let mut body = status_body(code, "TooManyRequests", "Too many requests, please try again later.");
    body["details"] = json!({"retryAfterSeconds": 1});
    let mut r = reply(code, body);
    r.headers_mut().insert("retry-after", HeaderValue::from_static("1"));
    r
}

/// What a client reads while the server is down (no Retry-After).
fn unavailable() -> Response {
    let code = StatusCode::SERVICE_UNAVAILABLE;
    reply(code, status_body(code, "ServiceUnavailable", "the server is currently unable to handle the request"))
}

fn take_fault(g: &mut Inner, method: &Method, path: &str) -> Option<Fault> {
    let i = g.faults.iter().position(|f| f.method.as_ref().is_none_or(|m| m == method) && path.contains(&f.path_contains))?;
    let f = g.faults[i].clone();
    if g.faults[i].times <= 1 {
        g.faults.remove(i);
    } else {
        g.faults[i].times -= 1;
    }
    Some(f)
}

fn serve(g: &mut Inner, method: &Method, path: &str, query: &str, headers: &HeaderMap, body: &[u8]) -> Response {
    if let Some(f) = take_fault(g, method, path) {
        let code = StatusCode::from_u16(f.status).unwrap();
        let mut r = reply(code, status_body(code, "Injected", "injected by the test"));
        if let Some(s) = f.retry_after {
            r.headers_mut().insert("retry-after", HeaderValue::from_str(&s.to_string()).unwrap());
        }
        return r;
    }
    if let Some(r) = path.strip_prefix("/api/v1/").and_then(|rest| cluster::serve(g, method, rest, query)) {
        return r;
    }
    if let Some(rest) = path.strip_prefix("/api/v1/namespaces/") {
        let merge = headers.get("content-type").is_some_and(|v| v.as_bytes() == b"application/merge-patch+json");
        return core::serve(g, method, rest, &query_pairs(query), body, merge);
    }
    if let Some(rest) = path.strip_prefix("/apis/discovery.k8s.io/v1/namespaces/").filter(|r| r.split('/').nth(1) == Some("endpointslices"))
    {
        return core::serve(g, method, rest, &query_pairs(query), body, false);
    }
    if let Some(rest) = path.strip_prefix(STORAGE_PREFIX) {
        return storage(g, method, rest, query);
    }
    let Some(rest) = path.strip_prefix(PREFIX) else {
        return reply(
            StatusCode::NOT_FOUND,
            status_body(StatusCode::NOT_FOUND, "NotFound", "the server could not find the requested resource"),
        );
    };
    let parts: Vec<&str> = rest.split('/').collect();
    let q = query_pairs(query);
    match (method.clone(), parts.as_slice()) {
        (Method::GET, [plural]) => list(g, plural, &q),
        (Method::GET, [plural, name]) => match g.objects.get(&(plural.to_string(), name.to_string())) {
            Some(s) => reply(StatusCode::OK, s.obj.clone()),
            None => not_found(plural, name),
        },
        (Method::DELETE, [plural, name]) => match g.objects.remove(&(plural.to_string(), name.to_string())) {
            Some(s) => {
                g.rv += 1;
                watch::record(g, plural, Some(s.obj.clone()), None);
                reply(StatusCode::OK, s.obj)
            }
            None => not_found(plural, name),
        },
        (Method::PATCH, [plural, name]) => apply(g, plural, name, false, &q, headers, body),
        (Method::PATCH, [plural, name, "status"]) => apply(g, plural, name, true, &q, headers, body),
        _ => reply(
            StatusCode::METHOD_NOT_ALLOWED,
            status_body(StatusCode::METHOD_NOT_ALLOWED, "MethodNotAllowed", "not served by the stand-in"),
        ),
    }
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

/// storage.k8s.io/v1: LIST and GET of volumeattachments. Like the real
/// server, the only field selector a VolumeAttachment supports is
/// `metadata.name`; any other is a 400.
fn storage(g: &Inner, method: &Method, rest: &str, query: &str) -> Response {
    let parts: Vec<&str> = rest.split('/').collect();
    let q = query_pairs(query);
    match (method, parts.as_slice()) {
        (&Method::GET, ["volumeattachments"]) => {
            let fields = q.get("fieldSelector").cloned().unwrap_or_default();
            for term in fields.split(',').filter(|t| !t.is_empty()) {
                let field = term.split(['=', '!']).next().unwrap_or_default();
                if field != "metadata.name" {
                    let code = StatusCode::BAD_REQUEST;
                    return reply(code, status_body(code, "BadRequest", &format!("field label not supported: {field}")));
                }
            }
            list_of(g, "volumeattachments", "storage.k8s.io/v1", "VolumeAttachmentList", &q, &fields)
        }
        (&Method::GET, ["volumeattachments", name]) => match g.objects.get(&("volumeattachments".to_string(), name.to_string())) {
            Some(s) => reply(StatusCode::OK, s.obj.clone()),
            None => not_found("volumeattachments", name),
        },
        _ => reply(
            StatusCode::METHOD_NOT_ALLOWED,
            status_body(StatusCode::METHOD_NOT_ALLOWED, "MethodNotAllowed", "not served by the stand-in"),
        ),
    }
}

/// The fields each volring resource lets a LIST select by: `metadata.name`,
/// and what its CRD declares in `selectableFields`.
fn selectable(plural: &str) -> Vec<String> {
    use kube::CustomResourceExt;
    let crds = [volring_kube::objects::BlockDevice::crd(), volring_kube::objects::StorageNode::crd()];
    let crd = crds.iter().find(|c| c.spec.names.plural == plural);
    let declared = crd.into_iter().flat_map(|c| c.spec.versions.iter()).flat_map(|v| v.selectable_fields.iter().flatten());
    std::iter::once("metadata.name".to_string()).chain(declared.map(|f| f.json_path.trim_start_matches('.').to_string())).collect()
}

fn list(g: &Inner, plural: &str, q: &BTreeMap<String, String>) -> Response {
    let fields = q.get("fieldSelector").cloned().unwrap_or_default();
    let allowed = selectable(plural);
    for term in fields.split(',').filter(|t| !t.is_empty()) {
        let field = term.split(['=', '!']).next().unwrap_or_default();
        if !allowed.iter().any(|a| a == field) {
            let code = StatusCode::BAD_REQUEST;
            return reply(code, status_body(code, "BadRequest", &format!("field label not supported: {field}")));
        }
    }
    list_of(g, plural, "volring.io/v1alpha1", "List", q, &fields)
}

/// `fields`: `path=x`, `path==x`, `path!=x` terms (checked by the caller);
/// a path's value is compared as the API server does, as a string.
fn fields_match(obj: &Value, fields: &str) -> bool {
    fields.split(',').filter(|t| !t.is_empty()).all(|t| {
        let (path, want, equal) = match t.split_once("!=") {
            Some((p, v)) => (p, v, false),
            None => {
                let (p, v) = t.split_once('=').unwrap_or((t, ""));
                (p, v.trim_start_matches('='), true)
            }
        };
        let pointer = format!("/{}", path.replace('.', "/"));
        let have = match obj.pointer(&pointer) {
            Some(Value::String(s)) => s.clone(),
            Some(Value::Null) | None => String::new(),
            Some(v) => v.to_string(),
        };
        (have == want) == equal
    })
}

fn list_of(g: &Inner, plural: &str, api_version: &str, kind: &str, q: &BTreeMap<String, String>, fields: &str) -> Response {
    let selector = q.get("labelSelector").cloned().unwrap_or_default();
    let limit: usize = q.get("limit").and_then(|l| l.parse().ok()).filter(|&l| l > 0).unwrap_or(usize::MAX);
    let after = q.get("continue").cloned().unwrap_or_default();
    let mut items = Vec::new();
    let mut more = None;
    for ((p, name), s) in &g.objects {
        if p != plural
            || (!after.is_empty() && name.as_str() <= after.as_str())
            || !matches(&s.obj, &selector)
            || !fields_match(&s.obj, fields)
        {
            continue;
        }
        if items.len() == limit {
            more = Some(items.last().and_then(|i: &Value| i["metadata"]["name"].as_str()).unwrap_or_default().to_string());
            break;
        }
        items.push(s.obj.clone());
    }
    let mut meta = json!({"resourceVersion": g.rv.to_string()});
    if let Some(c) = more {
        meta["continue"] = json!(c);
    }
    reply(StatusCode::OK, json!({"apiVersion": api_version, "kind": kind, "metadata": meta, "items": items}))
}

fn fields_of(obj: &Value, top: &str) -> BTreeSet<String> {
    obj[top].as_object().map(|m| m.keys().map(|k| format!("{top}.{k}")).collect()).unwrap_or_default()
}

fn label_fields(obj: &Value) -> BTreeSet<String> {
    obj["metadata"]["labels"].as_object().map(|m| m.keys().map(|k| format!("label:{k}")).collect()).unwrap_or_default()
}

fn get_field<'a>(obj: &'a Value, f: &str) -> &'a Value {
    match f.strip_prefix("label:") {
        Some(k) => &obj["metadata"]["labels"][k],
        None => {
            let (top, k) = f.split_once('.').unwrap();
            &obj[top][k]
        }
    }
}

fn set_field(obj: &mut Value, f: &str, v: Option<Value>) {
    let (parent, k) = match f.strip_prefix("label:") {
        Some(k) => (&mut obj["metadata"]["labels"], k.to_string()),
        None => {
            let (top, k) = f.split_once('.').unwrap();
            (&mut obj[top], k.to_string())
        }
    };
    if !parent.is_object() {
        *parent = json!({});
    }
    let m = parent.as_object_mut().unwrap();
    match v {
        Some(v) => {
            m.insert(k, v);
        }
        None => {
            m.remove(&k);
        }
    }
}

fn apply(
    g: &mut Inner,
    plural: &str,
    name: &str,
    status: bool,
    q: &BTreeMap<String, String>,
    headers: &HeaderMap,
    body: &[u8],
) -> Response {
    let ct = headers.get("content-type").and_then(|v| v.to_str().ok()).unwrap_or("");
    if ct != "application/apply-patch+yaml" {
        let code = StatusCode::UNSUPPORTED_MEDIA_TYPE;
        return reply(code, status_body(code, "UnsupportedMediaType", &format!("the body of the request was in an unknown format ({ct})")));
    }
    let Some(manager) = q.get("fieldManager").filter(|m| !m.is_empty()).cloned() else {
        let code = StatusCode::UNPROCESSABLE_ENTITY;
        return reply(code, status_body(code, "Invalid", "PatchOptions.meta.k8s.io \"\" is invalid: fieldManager: Required value"));
    };
    let force = q.get("force").is_some_and(|f| f == "true");
    let Ok(patch) = serde_json::from_slice::<Value>(body) else {
        return reply(
            StatusCode::BAD_REQUEST,
            status_body(StatusCode::BAD_REQUEST, "BadRequest", "the stand-in reads JSON apply bodies only"),
        );
    };
    if patch["metadata"]["name"].as_str() != Some(name) || patch["apiVersion"] != "volring.io/v1alpha1" || patch["kind"].as_str().is_none()
    {
        let code = StatusCode::BAD_REQUEST;
        return reply(code, status_body(code, "BadRequest", "apiVersion, kind and metadata.name must match the URL"));
    }
    let validation = match validate::FieldValidation::of(q) {
        Ok(v) => v,
        Err(m) => return reply(StatusCode::BAD_REQUEST, status_body(StatusCode::BAD_REQUEST, "BadRequest", &m)),
    };
    let schema = validate::crd_schema(plural);
    let mut patch = patch;
    let unknown = schema.as_ref().map(|s| validate::unknown_custom(&patch, s)).unwrap_or_default();
    if !unknown.is_empty() && validation == validate::FieldValidation::Strict {
        let list: Vec<String> = unknown.iter().map(|f| format!("unknown field \"{f}\"")).collect();
        let code = StatusCode::BAD_REQUEST;
        return reply(code, status_body(code, "BadRequest", &format!("strict decoding error: {}", list.join(", "))));
    }
    validate::prune(&mut patch, &unknown);
    let kind = patch["kind"].as_str().unwrap_or_default().to_string();
    let label_errors = validate::labels(&patch);
    if !label_errors.is_empty() {
        return invalid(&format!("{kind}.volring.io"), name, &label_errors);
    }
    let key = (plural.to_string(), name.to_string());
    let original = g.objects.get(&key).map(|s| (s.obj.clone(), s.managers.clone()));
    let existing = g.objects.get(&key);
    if status && existing.is_none() {
        return not_found(plural, name);
    }
    if let (Some(want), Some(s)) = (patch["metadata"]["resourceVersion"].as_str(), existing) {
        if s.obj["metadata"]["resourceVersion"].as_str() != Some(want) {
            let code = StatusCode::CONFLICT;
            return reply(
                code,
                status_body(code, "Conflict", "the object has been modified; please apply your changes to the latest version"),
            );
        }
    }
    let mut stored = match g.objects.remove(&key) {
        Some(s) => s,
        None => {
            g.uid += 1;
            let obj = json!({"apiVersion": patch["apiVersion"], "kind": patch["kind"],
                "metadata": {"name": name, "uid": format!("uid-{}", g.uid), "creationTimestamp": "2026-01-01T00:00:00Z", "generation": 0}});
            Stored { obj, managers: BTreeMap::new() }
        }
    };
    // The fields this apply sets: the main endpoint ignores status, the
    // status endpoint everything but status.
    let applied: BTreeSet<String> =
        if status { fields_of(&patch, "status") } else { fields_of(&patch, "spec").into_iter().chain(label_fields(&patch)).collect() };
    let mut conflicts = Vec::new();
    for f in &applied {
        for (m, owned) in &stored.managers {
            if m != &manager && owned.contains(f) && get_field(&stored.obj, f) != get_field(&patch, f) {
                conflicts.push(format!("conflict with \"{m}\": {f}"));
            }
        }
    }
    if !conflicts.is_empty() && !force {
        g.objects.insert(key, stored);
        let code = StatusCode::CONFLICT;
        return reply(
            code,
            status_body(code, "Conflict", &format!("Apply failed with {} conflicts: {}", conflicts.len(), conflicts.join(", "))),
        );
    }
    let before = stored.obj.clone();
    let scope = |f: &String| if status { f.starts_with("status.") } else { !f.starts_with("status.") };
    let previously: BTreeSet<String> =
        stored.managers.get(&manager).map(|o| o.iter().filter(|f| scope(f)).cloned().collect()).unwrap_or_default();
    for f in &applied {
        set_field(&mut stored.obj, f, Some(get_field(&patch, f).clone()));
        for (m, owned) in stored.managers.iter_mut() {
            if m != &manager && get_field(&before, f) != get_field(&patch, f) {
                owned.remove(f);
            }
        }
    }
    for f in previously.difference(&applied) {
        if !stored.managers.iter().any(|(m, o)| m != &manager && o.contains(f)) {
            set_field(&mut stored.obj, f, None);
        }
    }
    // A part left empty by that, which no one owns a field of, goes too.
    for top in ["spec", "status"] {
        let owned = stored.managers.iter().any(|(m, o)| m != &manager && o.iter().any(|f| f.starts_with(&format!("{top}."))))
            || applied.iter().any(|f| f.starts_with(&format!("{top}.")));
        if !owned && stored.obj[top].as_object().is_some_and(|m| m.is_empty()) {
            stored.obj.as_object_mut().expect("an object").remove(top);
        }
    }
    let mine = stored.managers.entry(manager).or_default();
    mine.retain(|f| !scope(f));
    mine.extend(applied);
    stored.managers.retain(|_, o| !o.is_empty());
    let created = before.get("spec").is_none() && !status && before["metadata"]["resourceVersion"].is_null();
    // The object as it would be stored, against its CRD's schema.
    let mut errors = Vec::new();
    if let Some(schema) = &schema {
        for r in schema["required"].as_array().into_iter().flatten().filter_map(|r| r.as_str()) {
            if stored.obj.get(r).is_none() {
                errors.push(format!("{r}: Required value"));
            }
        }
        for part in ["spec", "status"] {
            if let Some(v) = stored.obj.get(part) {
                validate::against_schema(v, &schema["properties"][part], part, &mut errors);
            }
        }
    }
    if !errors.is_empty() {
        if let Some((obj, managers)) = original {
            g.objects.insert(key, Stored { obj, managers });
        }
        return invalid(&format!("{kind}.volring.io"), name, &errors);
    }
    if stored.obj != before || created {
        if stored.obj.get("spec") != before.get("spec") {
            let gen = stored.obj["metadata"]["generation"].as_u64().unwrap_or(0) + 1;
            stored.obj["metadata"]["generation"] = json!(gen);
        }
        g.rv += 1;
        stored.obj["metadata"]["resourceVersion"] = json!(g.rv.to_string());
        let was = (!created).then_some(before);
        watch::record(g, plural, was, Some(stored.obj.clone()));
    }
    let out = stored.obj.clone();
    g.objects.insert(key, stored);
    let mut r = reply(if created { StatusCode::CREATED } else { StatusCode::OK }, out);
    if validation == validate::FieldValidation::Warn {
        warn(&mut r, &unknown);
    }
    r
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
