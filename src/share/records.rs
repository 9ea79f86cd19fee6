//! The node's shares, kept in its store (`STATE_DIR/state.redb`) beside
//! the objects the publisher keeps there, under `NfsShare/<volume id>`.
//!
//! Why recorded: an export's id must survive agent restarts (ganesha's file
//! handles carry it; a new id makes every client's handles stale), and a
//! restarted agent re-exports what it exported before from these records.

use std::path::PathBuf;

use super::Error;
use crate::state::store::{Change, Store};

const PREFIX: &str = "NfsShare/";

/// One exported volume.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ShareRecord {
    pub volume_id: String,
    pub export_id: u16,
    /// The staged filesystem exported.
    pub path: PathBuf,
    /// The path clients mount.
    pub pseudo: String,
    /// `host:port` clients reach the server on.
    pub server: String,
}

pub(super) fn load(store: &Store) -> Result<Vec<ShareRecord>, Error> {
    let rows = store.published_under(PREFIX).map_err(|e| Error::Store(e.to_string()))?;
    let mut out = Vec::with_capacity(rows.len());
    for (key, bytes) in rows {
        match serde_json::from_slice::<ShareRecord>(&bytes) {
            Ok(r) if key.strip_prefix(PREFIX) == Some(r.volume_id.as_str()) => out.push(r),
            // Left in place for the operator; never exported.
            Ok(_) | Err(_) => tracing::warn!(key, "share record does not decode; ignored"),
        }
    }
    Ok(out)
}

pub(super) fn put(store: &Store, r: &ShareRecord) -> Result<(), Error> {
    let bytes = serde_json::to_vec(r).map_err(|e| Error::Store(e.to_string()))?;
    let key = format!("{PREFIX}{}", r.volume_id);
    store.apply(&[Change::PutPublished(&key, &bytes)]).map_err(|e| Error::Store(e.to_string()))
}

pub(super) fn remove(store: &Store, volume_id: &str) -> Result<(), Error> {
    let key = format!("{PREFIX}{volume_id}");
    store.apply(&[Change::RemovePublished(&key)]).map_err(|e| Error::Store(e.to_string()))
}

/// A shared volume another node serves, mounted here over NFS.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct MountRecord {
    pub volume_id: String,
    pub staging_path: PathBuf,
    pub remote: super::client::Remote,
    pub read_only: bool,
    /// The NFS mount's device (`major:minor` of its anonymous superblock),
    /// once mounted: what tells the volume's own mount from anything else
    /// at its paths.
    pub dev: Option<(u32, u32)>,
    /// Targets it is published at, and whether read-only.
    #[serde(default)]
    pub published: std::collections::BTreeMap<PathBuf, bool>,
}

const MOUNT_PREFIX: &str = "NfsMount/";

pub(super) fn get_mount(store: &Store, volume_id: &str) -> Result<Option<MountRecord>, Error> {
    let key = format!("{MOUNT_PREFIX}{volume_id}");
    let Some(bytes) = store.published(&key).map_err(|e| Error::Store(e.to_string()))? else { return Ok(None) };
    match serde_json::from_slice::<MountRecord>(&bytes) {
        Ok(r) if r.volume_id == volume_id => Ok(Some(r)),
        _ => Err(Error::Store(format!("{key} does not decode"))),
    }
}

pub(super) fn put_mount(store: &Store, r: &MountRecord) -> Result<(), Error> {
    let bytes = serde_json::to_vec(r).map_err(|e| Error::Store(e.to_string()))?;
    let key = format!("{MOUNT_PREFIX}{}", r.volume_id);
    store.apply(&[Change::PutPublished(&key, &bytes)]).map_err(|e| Error::Store(e.to_string()))
}

pub(super) fn remove_mount(store: &Store, volume_id: &str) -> Result<(), Error> {
    let key = format!("{MOUNT_PREFIX}{volume_id}");
    store.apply(&[Change::RemovePublished(&key)]).map_err(|e| Error::Store(e.to_string()))
}

/// The export id for `volume_id`: the one it has, else the smallest free.
pub(super) fn export_id(have: &[ShareRecord], volume_id: &str) -> Result<u16, Error> {
    if let Some(r) = have.iter().find(|r| r.volume_id == volume_id) {
        return Ok(r.export_id);
    }
    let used: std::collections::BTreeSet<u16> = have.iter().map(|r| r.export_id).collect();
    (1..=u16::MAX).find(|i| !used.contains(i)).ok_or_else(|| Error::Config("every export id is in use".into()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(id: &str, n: u16) -> ShareRecord {
        ShareRecord { volume_id: id.into(), export_id: n, path: "/x".into(), pseudo: format!("/{id}"), server: "h:1".into() }
    }

    #[test]
    fn ids_kept_and_reused() {
        let have = vec![rec("a", 1), rec("b", 3)];
        assert_eq!(export_id(&have, "b").unwrap(), 3);
        assert_eq!(export_id(&have, "c").unwrap(), 2);
        assert_eq!(export_id(&[], "c").unwrap(), 1);
    }

    #[test]
    fn store_round_trip() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(&dir.path().join("s.redb")).unwrap();
        put(&store, &rec("a", 1)).unwrap();
        put(&store, &rec("b", 2)).unwrap();
        // A record under the wrong key is not trusted.
        let bad = serde_json::to_vec(&rec("c", 3)).unwrap();
        store.apply(&[Change::PutPublished("NfsShare/d", &bad)]).unwrap();
        assert_eq!(load(&store).unwrap(), vec![rec("a", 1), rec("b", 2)]);
        remove(&store, "a").unwrap();
        assert_eq!(load(&store).unwrap(), vec![rec("b", 2)]);
    }
}
