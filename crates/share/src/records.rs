//! The node's shares, kept in its store (`STATE_DIR/state.redb`) beside
//! the objects the publisher keeps there, under `NfsShare/<volume id>`.
//!
//! Why recorded: an export's id must survive agent restarts (ganesha's file
//! handles carry it; a new id makes every client's handles stale), and a
//! restarted agent re-exports what it exported before from these records.

use std::path::PathBuf;

use super::Error;
use volring_volumes::store::{Change, Store};

const PREFIX: &str = "NfsShare/";

/// One exported volume.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct ShareRecord {
    pub(crate) volume_id: String,
    pub(crate) export_id: u16,
    /// The staged filesystem exported.
    pub(crate) path: PathBuf,
    /// The path clients mount.
    pub(crate) pseudo: String,
    /// `host:port` clients reach the server on.
    pub(crate) server: String,
    /// The nodes admitted to the export (node name → the address this
    /// server sees its connections from): the ones that staged the volume
    /// and made themselves known (`follow`). Kept across restarts, so a
    /// restarted agent admits its clients again at once.
    #[serde(default)]
    pub(crate) clients: std::collections::BTreeMap<String, String>,
    /// Root squash, from the volume's StorageClass (`nfsSquash`).
    #[serde(default)]
    pub(crate) squash: super::ganesha::Squash,
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

const ANNOUNCED_PREFIX: &str = "NfsAnnounced/";

/// Records that this node announced itself on PVC `pvc` to stage shared
/// volume `volume_id` from another node (`admit`), so its unstage — also
/// after an agent restart — takes the announcement off again.
pub(crate) fn put_announced(store: &Store, volume_id: &str, pvc: &(String, String)) -> Result<(), Error> {
    let bytes = serde_json::to_vec(pvc).map_err(|e| Error::Store(e.to_string()))?;
    store.apply(&[Change::PutPublished(&format!("{ANNOUNCED_PREFIX}{volume_id}"), &bytes)]).map_err(|e| Error::Store(e.to_string()))
}

/// The PVC recorded by [`put_announced`], if any.
pub(crate) fn get_announced(store: &Store, volume_id: &str) -> Option<(String, String)> {
    let bytes = store.published(&format!("{ANNOUNCED_PREFIX}{volume_id}")).ok()??;
    let (ns, name): (String, String) = serde_json::from_slice(&bytes).ok()?;
    super::pvc(&ns, &name)
}

pub(crate) fn remove_announced(store: &Store, volume_id: &str) -> Result<(), Error> {
    store.apply(&[Change::RemovePublished(&format!("{ANNOUNCED_PREFIX}{volume_id}"))]).map_err(|e| Error::Store(e.to_string()))
}

const RENOUNCE_PREFIX: &str = "NfsRenounce/";

/// Moves the announcement of `volume_id` (PVC `pvc`) to the ones still to
/// be taken off: the unstage finished, but the API server did not take the
/// PATCH (an outage). One write, so no crash leaves both or neither.
pub(crate) fn put_renounce_pending(store: &Store, volume_id: &str, pvc: &(String, String)) -> Result<(), Error> {
    let bytes = serde_json::to_vec(pvc).map_err(|e| Error::Store(e.to_string()))?;
    let pending = format!("{RENOUNCE_PREFIX}{volume_id}");
    let announced = format!("{ANNOUNCED_PREFIX}{volume_id}");
    store.apply(&[Change::PutPublished(&pending, &bytes), Change::RemovePublished(&announced)]).map_err(|e| Error::Store(e.to_string()))
}

/// An announcement this node may have left on a PVC.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Leftover {
    pub(crate) volume_id: String,
    pub(crate) pvc: (String, String),
    /// A renouncement the API server did not take (else: an announcement
    /// with no staged volume behind it).
    pub(crate) pending: bool,
}

/// What may be left on PVCs, by volume: each pending renouncement, and
/// each announcement with no staged volume behind it (no mount record: a
/// stage that never got that far). Records that do not decode, or name
/// what Kubernetes does not allow, are skipped.
pub(crate) fn leftovers(store: &Store) -> Result<Vec<Leftover>, Error> {
    let read = |prefix: &str| store.published_under(prefix).map_err(|e| Error::Store(e.to_string()));
    let decode = |prefix: &str, key: &str, bytes: &[u8]| {
        let id = key.strip_prefix(prefix)?.to_string();
        let (ns, name): (String, String) = serde_json::from_slice(bytes).ok()?;
        Some((id, super::pvc(&ns, &name)?))
    };
    let mut out: Vec<_> = read(RENOUNCE_PREFIX)?
        .into_iter()
        .filter_map(|(key, bytes)| decode(RENOUNCE_PREFIX, &key, &bytes))
        .map(|(volume_id, pvc)| Leftover { volume_id, pvc, pending: true })
        .collect();
    for (key, bytes) in read(ANNOUNCED_PREFIX)? {
        let Some((id, pvc)) = decode(ANNOUNCED_PREFIX, &key, &bytes) else { continue };
        if get_mount(store, &id)?.is_none() {
            out.push(Leftover { volume_id: id, pvc, pending: false });
        }
    }
    Ok(out)
}

/// Whether `volume_id` is still a leftover of the kind [`leftovers`] said:
/// still pending, or still announced with no mount record.
pub(crate) fn leftover(store: &Store, volume_id: &str, pending: bool) -> Result<bool, Error> {
    if pending {
        return is_renounce_pending(store, volume_id);
    }
    Ok(get_announced(store, volume_id).is_some() && get_mount(store, volume_id)?.is_none())
}

pub(crate) fn is_renounce_pending(store: &Store, volume_id: &str) -> Result<bool, Error> {
    Ok(store.published(&format!("{RENOUNCE_PREFIX}{volume_id}")).map_err(|e| Error::Store(e.to_string()))?.is_some())
}

pub(crate) fn remove_renounce_pending(store: &Store, volume_id: &str) -> Result<(), Error> {
    store.apply(&[Change::RemovePublished(&format!("{RENOUNCE_PREFIX}{volume_id}"))]).map_err(|e| Error::Store(e.to_string()))
}

const PVC_PREFIX: &str = "NfsPvc/";

/// Records the PVC (namespace, name) of shared volume `volume_id`, staged
/// here from another node's nbd export and exported here: the pool record
/// that names it elsewhere lives on the owning node, and this node's
/// Service loop needs it to point the PVC's Endpoints here. `None` (the
/// volume's unstage) removes the record.
pub fn record_pvc(store: &Store, volume_id: &str, pvc: Option<&(String, String)>) -> Result<(), Error> {
    let key = format!("{PVC_PREFIX}{volume_id}");
    let bytes = pvc.map(serde_json::to_vec).transpose().map_err(|e| Error::Store(e.to_string()))?;
    let change = match &bytes {
        Some(b) => Change::PutPublished(&key, b),
        None => Change::RemovePublished(&key),
    };
    store.apply(&[change]).map_err(|e| Error::Store(e.to_string()))
}

/// The PVC recorded by [`record_pvc`], if any (one that does not decode, or
/// names what Kubernetes does not allow, is none).
pub(crate) fn get_pvc(store: &Store, volume_id: &str) -> Option<(String, String)> {
    let bytes = store.published(&format!("{PVC_PREFIX}{volume_id}")).ok()??;
    let (ns, name): (String, String) = serde_json::from_slice(&bytes).ok()?;
    super::pvc(&ns, &name)
}

/// The export id for `volume_id`: the one it has, else the one its id
/// hashes to (1..=65535), or the next free one after it.
///
/// Why from the volume id and not the smallest free: ganesha's NFSv4 file
/// handles carry the export id, so when a volume's export moves to another
/// node (issue 17's failover, the data reached over NBD) its clients'
/// handles stay valid only if the new node gives it the same id — which a
/// node that knows nothing of the first one's other exports can only do by
/// computing it from the volume alone. (The handle also carries the
/// filesystem's id, which ganesha takes from the filesystem's UUID: it
/// travels with the image, see `ganesha`.) Two volumes whose ids collide on
/// one node differ, and then the moved one's handles go stale.
pub(super) fn export_id(have: &[ShareRecord], volume_id: &str) -> Result<u16, Error> {
    if let Some(r) = have.iter().find(|r| r.volume_id == volume_id) {
        return Ok(r.export_id);
    }
    let used: std::collections::BTreeSet<u16> = have.iter().map(|r| r.export_id).collect();
    let first = preferred_export_id(volume_id);
    (0..u32::from(u16::MAX))
        .map(|i| ((u32::from(first) - 1 + i) % u32::from(u16::MAX) + 1) as u16)
        .find(|i| !used.contains(i))
        .ok_or_else(|| Error::Config("every export id is in use".into()))
}

/// The export id volume `volume_id` gets on any node where it is free.
pub(crate) fn preferred_export_id(volume_id: &str) -> u16 {
    (volring_volumes::store::fnv1a(volume_id.as_bytes()) % u64::from(u16::MAX)) as u16 + 1
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(id: &str, n: u16) -> ShareRecord {
        ShareRecord {
            volume_id: id.into(),
            export_id: n,
            path: "/x".into(),
            pseudo: format!("/{id}"),
            server: "h:1".into(),
            clients: Default::default(),
            squash: Default::default(),
        }
    }

    #[test]
    fn ids_kept_and_the_same_on_every_node() {
        let have = vec![rec("a", 1), rec("b", 3)];
        assert_eq!(export_id(&have, "b").unwrap(), 3, "a recorded id is kept");
        let c = preferred_export_id("c");
        assert!(c >= 1);
        assert_eq!(export_id(&have, "c").unwrap(), c, "another node's other exports do not change it");
        assert_eq!(export_id(&[], "c").unwrap(), c);
        // Taken: the next free one, wrapping past 65535 to 1.
        assert_eq!(export_id(&[rec("x", c)], "c").unwrap(), if c == u16::MAX { 1 } else { c + 1 });
        let full: Vec<ShareRecord> = (1..=u16::MAX).map(|i| rec(&format!("v{i}"), i)).collect();
        assert!(export_id(&full[1..], "c").is_ok_and(|i| i == 1), "the one free id");
        assert!(export_id(&full, "c").is_err());
        assert_ne!(preferred_export_id("pvc-1"), preferred_export_id("pvc-2"));
    }

    /// An announcement an outage kept on the PVC moves to the pending ones
    /// in one write, and stays there until removed.
    #[test]
    fn a_failed_renounce_is_kept_until_done() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(&dir.path().join("state.redb")).unwrap();
        let pvc = ("apps".to_string(), "acl".to_string());
        put_announced(&store, "pvc-1", &pvc).unwrap();
        // Announced, not staged (no mount record): a leftover unless a
        // stage stands behind it.
        let left = |pending| vec![Leftover { volume_id: "pvc-1".into(), pvc: pvc.clone(), pending }];
        assert_eq!(leftovers(&store).unwrap(), left(false));
        assert!(leftover(&store, "pvc-1", false).unwrap());
        put_renounce_pending(&store, "pvc-1", &pvc).unwrap();
        assert_eq!(get_announced(&store, "pvc-1"), None);
        assert_eq!(leftovers(&store).unwrap(), left(true));
        assert!(is_renounce_pending(&store, "pvc-1").unwrap() && !leftover(&store, "pvc-1", false).unwrap());
        remove_renounce_pending(&store, "pvc-1").unwrap();
        assert!(leftovers(&store).unwrap().is_empty());
    }

    #[test]
    fn pvc_round_trip() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(&dir.path().join("s.redb")).unwrap();
        assert_eq!(get_pvc(&store, "v"), None);
        record_pvc(&store, "v", Some(&("apps".into(), "data".into()))).unwrap();
        assert_eq!(get_pvc(&store, "v"), Some(("apps".into(), "data".into())));
        record_pvc(&store, "w", Some(&("apps".into(), "../x".into()))).unwrap();
        assert_eq!(get_pvc(&store, "w"), None, "not a Kubernetes name");
        record_pvc(&store, "v", None).unwrap();
        assert_eq!(get_pvc(&store, "v"), None);
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
