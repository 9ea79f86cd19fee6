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

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use serde_json::json;
    use sha2::Digest;

    use super::*;
    use crate::{Updater, UpdaterConfig};
    use volring_volumes::store;

    /// A BlockDevice of `node` numbered `i`, whose status carries `gen`;
    /// its name and labels are the test's own (as tests/publisher_support
    /// makes them), not the crate's.
    fn bd(node: &str, i: usize, gen: usize) -> Object {
        let stable = format!("serial-test-{node}-{i}");
        let mut h = sha2::Sha256::new();
        h.update(node.as_bytes());
        h.update([0u8]);
        h.update(stable.as_bytes());
        let name = format!("bd-{}", h.finalize().iter().take(8).map(|b| format!("{b:02x}")).collect::<String>());
        Object {
            key: Key { kind: Kind::BlockDevice, name },
            labels: [("volring.io/node".to_string(), node.to_string()), ("volring.io/kind".to_string(), "blockdevice".to_string())].into(),
            spec: json!({"nodeName": node, "path": format!("/dev/sd{i}"), "stableId": stable,
                "capacity": {"storage": 1u64 << 30, "logicalSectorSize": 512, "physicalSectorSize": 4096},
                "details": {"deviceType": "disk", "driveType": "SSD", "removable": false, "readOnly": false},
                "devlinks": [], "partitioned": false}),
            status: json!({"state": "Active", "claimState": "Unclaimed", "mountPoints": [format!("/mnt/{gen}")], "holders": []}),
        }
    }

    /// Fast enough for a test; the defaults are what the agent uses.
    fn config(node: &str) -> UpdaterConfig {
        let mut c = UpdaterConfig::new(node);
        c.qps = 1000.0;
        c.burst = 1000;
        c.window = Duration::from_millis(300);
        c.backoff_min = Duration::from_millis(50);
        c
    }

    /// With no cluster the objects land in the node's store, in the API's
    /// form, and a restart with one device gone writes only that one.
    /// (Moved from tests/publisher/api.rs: it needs no API stand-in.)
    #[tokio::test]
    async fn with_no_cluster_the_objects_land_in_the_store_and_a_restart_writes_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(store::FILE);
        let objs: Vec<Object> = (0..20).map(|i| bd("n1", i, 3)).collect();
        {
            let store = Arc::new(Store::open(&path).unwrap());
            let up = Updater::start(Arc::new(EmbeddedSink::new(store)), config("n1"), vec![]);
            for g in 0..4 {
                for i in 0..20 {
                    up.submit(bd("n1", i, g));
                }
            }
            let stats = up.shutdown(Duration::from_secs(10)).await;
            assert_eq!((stats.writes_main, stats.writes_status), (20, 20));
        }
        let seen = Store::read_only(&path, true).unwrap().published;
        assert_eq!(seen.len(), 20);
        for o in &objs {
            // The store key is `Kind/name` (the test's own: `volring get` reads it).
            let key = format!("BlockDevice/{}", o.key.name);
            let (_, bytes) = seen.iter().find(|(k, _)| *k == key).expect("stored");
            let back = Object::from_api(Kind::BlockDevice, &serde_json::from_slice(bytes).unwrap()).unwrap();
            assert_eq!(&back, o);
        }
        let store = Arc::new(Store::open(&path).unwrap());
        let up = Updater::start(Arc::new(EmbeddedSink::new(store)), config("n1"), objs[..19].to_vec());
        let stats = up.shutdown(Duration::from_secs(10)).await;
        assert_eq!((stats.writes_main, stats.writes_status), (0, 1), "only the gone device is written: {stats:?}");
    }
}
