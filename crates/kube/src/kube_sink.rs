//! The API server as a [`Sink`]: raw requests through kube's client (its
//! typed API hides the response headers, and a 429's Retry-After is what
//! tells how long to wait).
//!
//! Writes are server-side applies with the field manager `volring`, forced
//! (the agent is the one source of these facts); status goes through the
//! status subresource. LIST is paginated (500 a page) and filtered by this
//! node's label; so is WATCH, with bookmarks, resumed from the version
//! reached. Every response body is read with a bound.

use std::time::Duration;

use bytes::Bytes;
use http::{Method, Request, StatusCode};
use http_body_util::BodyExt;

use super::objects::{Key, Kind, Object, GROUP, NODE_LABEL, VERSION};
use super::sink::{Seen, Watched};
use super::updater::{Part, Sink, SinkError};

/// The field manager of every apply.
pub(crate) const FIELD_MANAGER: &str = "volring";
/// Objects per LIST page.
pub(crate) const PAGE: usize = 500;
/// The largest response body read (a page of 500 objects is far below).
pub(crate) const MAX_BODY: usize = 32 << 20;
/// A Retry-After longer than this is taken as this.
const MAX_RETRY_AFTER: Duration = Duration::from_secs(60);
/// A LIST that keeps handing out continue tokens is cut here.
const MAX_PAGES: usize = 10_000;
/// A watch asks the server to end it after at most this long (less a
/// jitter of up to a minute); it is resumed from where it was. Under the
/// client's read timeout (295 s), so a quiet stream ends by the server's
/// hand.
const WATCH_TIMEOUT: Duration = Duration::from_secs(290);

#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// No kubeconfig or service account was found, or it is unusable.
    #[error("no Kubernetes client configuration: {0}")]
    Config(#[from] kube::config::InferConfigError),
    /// The configuration was found but a client cannot be made from it
    /// (its TLS settings, say).
    #[error("no Kubernetes client from the configuration: {0}")]
    Client(#[from] kube::Error),
}

pub struct KubeSink {
    client: kube::Client,
    /// The API server's Warning headers logged so far (each once).
    warned: std::sync::Mutex<std::collections::HashSet<String>>,
}

impl KubeSink {
    /// A sink on `config`'s cluster, its requests naming this process's
    /// node ([`volring_devices::node_name`]) in their User-Agent; see
    /// [`KubeSink::connect`].
    pub fn new(config: kube::Config) -> Result<Self, Error> {
        Self::with_config(config, &volring_devices::node_name())
    }

    /// A sink for `node` (the agent's `--node-id`) on `config`'s cluster,
    /// or (`None`) on the one the process finds: a kubeconfig, else the
    /// pod's service account ([`KubeSink::detect`]). Every request carries
    /// the User-Agent `volring/<version> (<node>)`.
    pub async fn connect(node: &str, config: Option<kube::Config>) -> Result<Self, Error> {
        let config = match config {
            Some(c) => c,
            None => kube::Config::infer().await?,
        };
        Self::with_config(config, node)
    }

    /// The client's own retry layer is turned off: it would retry a 429
    /// inside one request, holding a slot while the updater's limit knows
    /// nothing of it. The updater does the retrying.
    fn with_config(mut config: kube::Config, node: &str) -> Result<Self, Error> {
        config.default_retry = false;
        volring_share::kube::identify(&mut config, node);
        let client = kube::Client::try_from(config)?;
        Ok(Self { client, warned: Default::default() })
    }

    /// True when the process runs in a pod (the service account's env).
    pub(crate) fn in_cluster() -> bool {
        std::env::var_os("KUBERNETES_SERVICE_HOST").is_some() && std::env::var_os("KUBERNETES_SERVICE_PORT").is_some()
    }

    /// Which cluster configuration [`KubeSink::connect`] would read, in its
    /// order (a kubeconfig first, then the pod's service account), as the
    /// log names it (`kubeconfig <path>`, `in-cluster service account`);
    /// `None` when there is neither, and the node's store stands in.
    pub fn detect() -> Option<impl std::fmt::Display> {
        cluster_source(std::env::var_os("KUBECONFIG").as_deref(), std::env::var_os("HOME").as_deref(), Self::in_cluster())
    }
}

/// Where a cluster's client configuration comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum ClusterSource {
    /// A kubeconfig file (from `KUBECONFIG`, or `~/.kube/config`).
    Kubeconfig(std::path::PathBuf),
    /// The pod's service account.
    InCluster,
}

impl std::fmt::Display for ClusterSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ClusterSource::Kubeconfig(p) => write!(f, "kubeconfig {}", p.display()),
            ClusterSource::InCluster => f.write_str("in-cluster service account"),
        }
    }
}

/// Pure part of [`KubeSink::detect`]: `KUBECONFIG` is a list of files of
/// which the first that exists counts (kubectl merges them; any one
/// present means a cluster was configured); without it `~/.kube/config`.
pub(crate) fn cluster_source(
    kubeconfig: Option<&std::ffi::OsStr>,
    home: Option<&std::ffi::OsStr>,
    in_cluster: bool,
) -> Option<ClusterSource> {
    let found = match kubeconfig.filter(|v| !v.is_empty()) {
        Some(list) => std::env::split_paths(list).find(|p| !p.as_os_str().is_empty() && p.is_file()),
        None => home.map(|h| std::path::Path::new(h).join(".kube/config")).filter(|p| p.is_file()),
    };
    match found {
        Some(p) => Some(ClusterSource::Kubeconfig(p)),
        None => in_cluster.then_some(ClusterSource::InCluster),
    }
}

impl KubeSink {
    /// Logs each distinct Warning the API server sends (an unknown field
    /// dropped because the installed CRD is older than the agent, say),
    /// once: they repeat on every write.
    fn log_warnings(&self, headers: &http::HeaderMap) {
        for w in headers.get_all("warning").iter().filter_map(|v| v.to_str().ok()) {
            let mut warned = super::updater::lock(&self.warned);
            if warned.len() < 100 && warned.insert(w.to_string()) {
                tracing::warn!(warning = w, "the API server warns");
            }
        }
    }

    /// GETs `uri` and reads the reply as JSON (for the LISTs that are not
    /// the updater's: the healer's VolumeAttachments).
    pub(super) async fn get_json(&self, uri: &str) -> Result<serde_json::Value, SinkError> {
        let (status, body) = self.call(Method::GET, uri, None).await?;
        if !status.is_success() {
            return Err(match status {
                StatusCode::GONE => SinkError::Unavailable(format!("list continue token expired ({status})")),
                _ => classify(status, &body),
            });
        }
        serde_json::from_slice(&body).map_err(|e| SinkError::Unavailable(format!("reply body: {e}")))
    }

    async fn call(&self, method: Method, uri: &str, body: Option<Vec<u8>>) -> Result<(StatusCode, Bytes), SinkError> {
        let mut req = Request::builder().method(method).uri(uri).header(http::header::ACCEPT, "application/json");
        if body.is_some() {
            req = req.header(http::header::CONTENT_TYPE, "application/apply-patch+yaml");
        }
        let req = req.body(kube::client::Body::from(body.unwrap_or_default())).map_err(|e| SinkError::Refused(e.to_string()))?;
        let resp = self.client.send(req).await.map_err(|e| SinkError::Unavailable(e.to_string()))?;
        let status = resp.status();
        self.log_warnings(resp.headers());
        let retry_after = resp.headers().get(http::header::RETRY_AFTER).and_then(|v| v.to_str().ok()).map(str::to_string);
        let body = http_body_util::Limited::new(resp.into_body(), MAX_BODY)
            .collect()
            .await
            .map_err(|e| SinkError::Unavailable(format!("reading the response: {e}")))?
            .to_bytes();
        if status == StatusCode::TOO_MANY_REQUESTS {
            return Err(SinkError::Throttled { retry_after: retry_after_of(retry_after.as_deref()) });
        }
        if status == StatusCode::SERVICE_UNAVAILABLE {
            let message = message_of(&body);
            return Err(SinkError::Overloaded { retry_after: retry_after.as_deref().map(|v| retry_after_of(Some(v))), message });
        }
        Ok((status, body))
    }
}

/// Retry-After in seconds (the API server sends seconds); absent or
/// unreadable: one second.
pub(crate) fn retry_after_of(v: Option<&str>) -> Duration {
    v.and_then(|s| s.trim().parse::<u64>().ok()).map_or(Duration::from_secs(1), Duration::from_secs).min(MAX_RETRY_AFTER)
}

/// A Status body's message, or the start of the body.
fn message_of(body: &[u8]) -> String {
    serde_json::from_slice::<serde_json::Value>(body)
        .ok()
        .and_then(|v| v.get("message").and_then(|m| m.as_str()).map(str::to_string))
        .unwrap_or_else(|| String::from_utf8_lossy(&body[..body.len().min(512)]).into_owned())
}

/// Maps a status other than success, 429 and 503 to how the updater reacts.
fn classify(status: StatusCode, body: &[u8]) -> SinkError {
    let text = format!("{status}: {}", message_of(body));
    match status {
        StatusCode::CONFLICT | StatusCode::NOT_FOUND => SinkError::Conflict(text),
        StatusCode::REQUEST_TIMEOUT => SinkError::Unavailable(text),
        s if s.is_server_error() => SinkError::Unavailable(text),
        _ => SinkError::Refused(text),
    }
}

fn base(kind: Kind) -> String {
    format!("/apis/{GROUP}/{VERSION}/{}", kind.plural())
}

/// Percent-encodes a query value (everything but unreserved characters).
pub(crate) fn query_escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b'~') {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

impl Sink for KubeSink {
    async fn list(&self, kind: Kind, node: &str) -> Result<Vec<Object>, SinkError> {
        Ok(self.list_versioned(kind, node).await?.0)
    }

    async fn list_versioned(&self, kind: Kind, node: &str) -> Result<(Vec<Object>, Option<String>), SinkError> {
        let selector = query_escape(&format!("{NODE_LABEL}={node}"));
        let mut out = Vec::new();
        let mut cont = String::new();
        for _ in 0..MAX_PAGES {
            let mut uri = format!("{}?labelSelector={selector}&limit={PAGE}", base(kind));
            if !cont.is_empty() {
                uri.push_str(&format!("&continue={}", query_escape(&cont)));
            }
            let (status, body) = self.call(Method::GET, &uri, None).await?;
            if !status.is_success() {
                // An expired continue token (410) means starting over.
                return Err(match status {
                    StatusCode::GONE => SinkError::Unavailable(format!("list continue token expired ({status})")),
                    _ => classify(status, &body),
                });
            }
            let v: serde_json::Value = serde_json::from_slice(&body).map_err(|e| SinkError::Unavailable(format!("list body: {e}")))?;
            if let Some(items) = v.get("items").and_then(|i| i.as_array()) {
                out.extend(items.iter().filter_map(|i| Object::from_api(kind, i)));
            }
            cont = v.pointer("/metadata/continue").and_then(|c| c.as_str()).unwrap_or_default().to_string();
            if cont.is_empty() {
                // Every page is of one snapshot: its version is the list's.
                let version = v.pointer("/metadata/resourceVersion").and_then(|r| r.as_str()).map(str::to_string);
                return Ok((out, version));
            }
        }
        Err(SinkError::Unavailable(format!("list of {} did not end after {MAX_PAGES} pages", kind.plural())))
    }

    async fn watch<'a>(
        &'a self,
        kind: Kind,
        node: &'a str,
        version: &'a mut String,
        seen: &'a (dyn Fn(Seen) + Send + Sync),
    ) -> Result<Watched, SinkError> {
        let selector = query_escape(&format!("{NODE_LABEL}={node}"));
        // Spread over a minute, so the nodes' watches do not all end (and
        // come back) at once.
        let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.subsec_nanos()).unwrap_or(0);
        let timeout = WATCH_TIMEOUT.as_secs() - u64::from(nanos % 60);
        let uri = format!(
            "{}?watch=true&allowWatchBookmarks=true&labelSelector={selector}&resourceVersion={}&timeoutSeconds={timeout}",
            base(kind),
            query_escape(version)
        );
        let req = Request::builder()
            .method(Method::GET)
            .uri(uri)
            .header(http::header::ACCEPT, "application/json")
            .body(kube::client::Body::empty())
            .map_err(|e| SinkError::Refused(e.to_string()))?;
        let resp = self.client.send(req).await.map_err(|e| SinkError::Unavailable(e.to_string()))?;
        let status = resp.status();
        if !status.is_success() {
            let retry_after = resp.headers().get(http::header::RETRY_AFTER).and_then(|v| v.to_str().ok()).map(str::to_string);
            let body = http_body_util::Limited::new(resp.into_body(), MAX_BODY).collect().await.map(|b| b.to_bytes()).unwrap_or_default();
            return match status {
                StatusCode::GONE => Ok(Watched::Expired),
                StatusCode::TOO_MANY_REQUESTS => Err(SinkError::Throttled { retry_after: retry_after_of(retry_after.as_deref()) }),
                StatusCode::SERVICE_UNAVAILABLE => Err(SinkError::Overloaded {
                    retry_after: retry_after.as_deref().map(|v| retry_after_of(Some(v))),
                    message: message_of(&body),
                }),
                _ => Err(classify(status, &body)),
            };
        }
        let mut body = resp.into_body();
        let mut buf: Vec<u8> = Vec::new();
        loop {
            let Some(frame) = body.frame().await else { return Ok(Watched::Ended) };
            let frame = frame.map_err(|e| SinkError::Unavailable(format!("watch stream: {e}")))?;
            let Ok(data) = frame.into_data() else { continue };
            buf.extend_from_slice(&data);
            while let Some(nl) = buf.iter().position(|&b| b == b'\n') {
                let line: Vec<u8> = buf.drain(..=nl).collect();
                if line.iter().all(u8::is_ascii_whitespace) {
                    continue;
                }
                if let Some(end) = watch_event(kind, &line, version, seen)? {
                    return Ok(end);
                }
            }
            if buf.len() > MAX_BODY {
                return Err(SinkError::Unavailable(format!("watch: an event of more than {MAX_BODY} bytes")));
            }
        }
    }

    async fn get(&self, key: &Key) -> Result<Option<Object>, SinkError> {
        let (status, body) = self.call(Method::GET, &format!("{}/{}", base(key.kind), key.name), None).await?;
        if status == StatusCode::NOT_FOUND {
            return Ok(None);
        }
        if !status.is_success() {
            return Err(match classify(status, &body) {
                // A 409 on a read is not a conflict the caller can resolve.
                SinkError::Conflict(m) => SinkError::Unavailable(m),
                e => e,
            });
        }
        let v: serde_json::Value = serde_json::from_slice(&body).map_err(|e| SinkError::Unavailable(format!("get body: {e}")))?;
        Ok(Object::from_api(key.kind, &v))
    }

    async fn write(&self, obj: &Object, part: Part) -> Result<(), SinkError> {
        let (path, body) = match part {
            Part::Main => (format!("{}/{}", base(obj.key.kind), obj.key.name), obj.main_body()),
            Part::Status => (format!("{}/{}/status", base(obj.key.kind), obj.key.name), obj.status_body()),
        };
        let uri = format!("{path}?fieldManager={FIELD_MANAGER}&force=true");
        let body = serde_json::to_vec(&body).expect("an object serialises");
        let (status, resp) = self.call(Method::PATCH, &uri, Some(body)).await?;
        if status.is_success() {
            Ok(())
        } else {
            Err(classify(status, &resp))
        }
    }

    async fn delete(&self, key: &Key) -> Result<(), SinkError> {
        let (status, body) = self.call(Method::DELETE, &format!("{}/{}", base(key.kind), key.name), None).await?;
        if status.is_success() || status == StatusCode::NOT_FOUND {
            Ok(())
        } else {
            Err(classify(status, &body))
        }
    }
}

/// Acts on one line of a watch stream: an object seen or gone, and the
/// version to resume from. `Some` ends the watch (410: the version is too
/// old); an unreadable line or an ERROR event is an error.
fn watch_event(kind: Kind, line: &[u8], version: &mut String, seen: &(dyn Fn(Seen) + Send + Sync)) -> Result<Option<Watched>, SinkError> {
    let ev: serde_json::Value = serde_json::from_slice(line).map_err(|e| SinkError::Unavailable(format!("watch event: {e}")))?;
    let obj = &ev["object"];
    let rv = obj.pointer("/metadata/resourceVersion").and_then(|r| r.as_str());
    match ev["type"].as_str().unwrap_or_default() {
        "ADDED" | "MODIFIED" => {
            if let Some(o) = Object::from_api(kind, obj) {
                seen(Seen::Put(o));
            }
        }
        "DELETED" => {
            if let Some(name) = obj.pointer("/metadata/name").and_then(|n| n.as_str()) {
                seen(Seen::Gone(Key { kind, name: name.to_string() }));
            }
        }
        "BOOKMARK" => {}
        "ERROR" => {
            if obj["code"].as_u64() == Some(410) {
                return Ok(Some(Watched::Expired));
            }
            let msg = obj["message"].as_str().unwrap_or("a watch ERROR event").to_string();
            return Err(SinkError::Unavailable(format!("watch: {msg}")));
        }
        other => return Err(SinkError::Unavailable(format!("watch: an event of type {other:?}"))),
    }
    if let Some(rv) = rv {
        *version = rv.to_string();
    }
    Ok(None)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn retry_after_is_seconds_bounded_with_a_default() {
        assert_eq!(retry_after_of(Some("3")), Duration::from_secs(3));
        assert_eq!(retry_after_of(Some("junk")), Duration::from_secs(1));
        assert_eq!(retry_after_of(None), Duration::from_secs(1));
        assert_eq!(retry_after_of(Some("86400")), MAX_RETRY_AFTER);
    }

    #[test]
    fn statuses_map_to_reactions() {
        assert!(matches!(classify(StatusCode::CONFLICT, b"{}"), SinkError::Conflict(_)));
        assert!(matches!(classify(StatusCode::SERVICE_UNAVAILABLE, b""), SinkError::Unavailable(_)));
        let e = classify(StatusCode::UNPROCESSABLE_ENTITY, br#"{"message":"spec.x: Invalid"}"#);
        assert!(matches!(&e, SinkError::Refused(m) if m.contains("spec.x: Invalid")));
    }

    #[test]
    fn a_kubeconfig_is_found_before_the_service_account() {
        let dir = tempfile::tempdir().unwrap();
        let cfg = dir.path().join("cfg");
        std::fs::write(&cfg, "apiVersion: v1\nkind: Config\n").unwrap();
        let missing = dir.path().join("missing");
        let list = std::env::join_paths([&missing, &cfg]).unwrap();
        assert_eq!(cluster_source(Some(&list), None, true), Some(ClusterSource::Kubeconfig(cfg.clone())));
        assert_eq!(cluster_source(Some(missing.as_os_str()), None, true), Some(ClusterSource::InCluster));
        assert_eq!(cluster_source(Some(missing.as_os_str()), None, false), None);
        std::fs::create_dir(dir.path().join(".kube")).unwrap();
        std::fs::copy(&cfg, dir.path().join(".kube/config")).unwrap();
        let home = Some(dir.path().as_os_str());
        assert_eq!(cluster_source(None, home, false), Some(ClusterSource::Kubeconfig(dir.path().join(".kube/config"))));
        assert_eq!(cluster_source(Some("".as_ref()), home, false), Some(ClusterSource::Kubeconfig(dir.path().join(".kube/config"))));
        assert_eq!(cluster_source(None, Some(missing.as_os_str()), false), None);
    }

    #[test]
    fn selectors_are_escaped() {
        assert_eq!(query_escape("volring.io/node=n 1"), "volring.io%2Fnode%3Dn%201");
    }
}
