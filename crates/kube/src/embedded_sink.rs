//! With no cluster, the node's own store as the [`Sink`]: the same objects,
//! kept in the store's `published` table as the API would return them, so
//! `volring get` prints them kubectl-style and a restart's LIST finds them.
//!
//! Each write is one store transaction, run on the blocking pool (a commit
//! waits for the disk).

use std::sync::Arc;

use super::objects::{Key, Kind, Object, GROUP, VERSION};
use super::updater::{Part, Sink, SinkError};
use volring_volumes::store::{Change, Store};

pub struct EmbeddedSink {
    store: Arc<Store>,
}

impl EmbeddedSink {
    pub fn new(store: Arc<Store>) -> Self {
        Self { store }
    }
}

/// The store key of an object: `Kind/name`.
pub(crate) fn store_key(key: &Key) -> String {
    format!("{}/{}", key.kind.as_str(), key.name)
}

/// The object as the API would return it.
pub(crate) fn api_form(o: &Object) -> serde_json::Value {
    let mut v = serde_json::json!({
        "apiVersion": format!("{GROUP}/{VERSION}"),
        "kind": o.key.kind.as_str(),
        "metadata": {"name": o.key.name, "labels": o.labels},
        "spec": o.spec,
    });
    if !o.status.is_null() {
        v["status"] = o.status.clone();
    }
    v
}

async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, volring_volumes::store::Error> + Send + 'static,
) -> Result<T, SinkError> {
    match tokio::task::spawn_blocking(f).await {
        Ok(r) => r.map_err(|e| SinkError::Unavailable(e.to_string())),
        Err(e) => Err(SinkError::Unavailable(e.to_string())),
    }
}

fn decode(kind: Kind, bytes: &[u8]) -> Option<Object> {
    Object::from_api(kind, &serde_json::from_slice(bytes).ok()?)
}

impl Sink for EmbeddedSink {
    /// No API server stands behind the store: `--publish-qps` is not its
    /// limit, and a node without a cluster shows its objects at once.
    const PACED: bool = false;

    async fn list(&self, kind: Kind, node: &str) -> Result<Vec<Object>, SinkError> {
        let store = self.store.clone();
        let rows = blocking(move || store.published_under(&format!("{}/", kind.as_str()))).await?;
        Ok(rows.iter().filter_map(|(_, b)| decode(kind, b)).filter(|o| o.node() == Some(node)).collect())
    }

    async fn get(&self, key: &Key) -> Result<Option<Object>, SinkError> {
        let (store, k, kind) = (self.store.clone(), store_key(key), key.kind);
        Ok(blocking(move || store.published(&k)).await?.and_then(|b| decode(kind, &b)))
    }

    async fn write(&self, obj: &Object, part: Part) -> Result<(), SinkError> {
        let (store, name, obj) = (self.store.clone(), obj.key.name.clone(), obj.clone());
        blocking(move || {
            let k = store_key(&obj.key);
            let old = store.published(&k)?.and_then(|b| decode(obj.key.kind, &b));
            // The store is the same object model as the API: the main
            // write keeps the stored status, the status write the main part;
            // a status write to an object that is not there fails as the
            // API's would (404).
            let new = match (part, old) {
                (Part::Main, old) => Object { status: old.map(|o| o.status).unwrap_or(serde_json::Value::Null), ..obj },
                (Part::Status, Some(old)) => Object { status: obj.status, ..old },
                (Part::Status, None) => return Ok(false),
            };
            let bytes = serde_json::to_vec(&api_form(&new)).expect("an object serialises");
            store.apply(&[Change::PutPublished(&k, &bytes)])?;
            Ok(true)
        })
        .await?
        .then_some(())
        .ok_or_else(|| SinkError::Conflict(format!("{name} is not stored")))
    }

    async fn delete(&self, key: &Key) -> Result<(), SinkError> {
        let (store, k) = (self.store.clone(), store_key(key));
        blocking(move || store.apply(&[Change::RemovePublished(&k)])).await
    }
}
