//! What the updater writes through: the API server ([`super::kube_sink`])
//! or the node's store ([`super::embedded_sink`]), and how a write fails,
//! sorted by what the updater must do about it.

use std::future::Future;
use std::time::Duration;

use super::objects::{Key, Kind, Object};

/// Which part of an object a write sets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Part {
    /// Labels and spec (server-side apply of the object).
    Main,
    /// The status subresource.
    Status,
}

/// How a sink failed, as the updater must react to it.
#[derive(Debug, Clone, thiserror::Error)]
pub enum SinkError {
    /// 429: the server takes fewer requests at once; this one is sent
    /// again after `retry_after`.
    #[error("throttled; retry after {retry_after:?}")]
    Throttled { retry_after: Duration },
    /// 503: the server is overloaded or not serving (starting, behind a
    /// balancer with no ready backend); `retry_after` when it said.
    #[error("unavailable (503){}: {message}", retry_after.map(|d| format!("; retry after {d:?}")).unwrap_or_default())]
    Overloaded { retry_after: Option<Duration>, message: String },
    /// 409 (or 404 on a write): what the updater thinks is stored is wrong.
    #[error("conflict: {0}")]
    Conflict(String),
    /// Other 5xx, timeouts, connection errors: back off and retry.
    #[error("unavailable: {0}")]
    Unavailable(String),
    /// Any other 4xx: retrying would be refused again.
    #[error("refused: {0}")]
    Refused(String),
}

/// What a watch saw happen to one of this node's objects.
#[derive(Debug, Clone, PartialEq)]
pub enum Seen {
    /// Created or changed: as it is stored now.
    Put(Object),
    /// Deleted, or no longer labelled for this node.
    Gone(Key),
}

/// How a watch ended without an error.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Watched {
    /// The stream ended (its timeout): resume from the version reached.
    Ended,
    /// The version to resume from is older than the server keeps (410):
    /// list again.
    Expired,
}

/// Where objects go: the API server, or the node's embedded store.
pub trait Sink: Send + Sync + 'static {
    /// Whether the updater paces its requests (QPS and burst): an API
    /// server's rate limit. The node's own store has none and is written
    /// as fast as it commits.
    const PACED: bool = true;

    /// Every object of `kind` labelled for `node`.
    fn list(&self, kind: Kind, node: &str) -> impl Future<Output = Result<Vec<Object>, SinkError>> + Send;
    fn get(&self, key: &Key) -> impl Future<Output = Result<Option<Object>, SinkError>> + Send;
    fn write(&self, obj: &Object, part: Part) -> impl Future<Output = Result<(), SinkError>> + Send;
    fn delete(&self, key: &Key) -> impl Future<Output = Result<(), SinkError>> + Send;

    /// [`Sink::list`], with the version a [`Sink::watch`] resumes from
    /// (None: the sink has no watch; nobody else writes to it).
    fn list_versioned(&self, kind: Kind, node: &str) -> impl Future<Output = Result<(Vec<Object>, Option<String>), SinkError>> + Send {
        async move { Ok((self.list(kind, node).await?, None)) }
    }

    /// Follows the changes to `kind`'s objects labelled for `node` after
    /// `version`, handing each to `seen` and moving `version` on as it
    /// goes, until the stream ends.
    fn watch<'a>(
        &'a self,
        kind: Kind,
        node: &'a str,
        version: &'a mut String,
        seen: &'a (dyn Fn(Seen) + Send + Sync),
    ) -> impl Future<Output = Result<Watched, SinkError>> + Send + 'a {
        let _ = (kind, node, version, seen);
        async { Err(SinkError::Refused("this sink cannot be watched".into())) }
    }
}
