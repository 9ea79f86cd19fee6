//! What this node has staged: the desired state of every volume.
//!
//! kubelet may call NodeUnstageVolume long after the agent that staged the
//! volume has restarted: the loop device number, the staging path and the
//! published targets must outlive the process. The records live in the
//! node's store ([`crate::store`], `STATE_DIR/state.redb`); each is
//! written *before* the step that changes the machine (an intent), so a
//! crash mid-stage leaves a record that says what to finish or undo.
//!
//! Records from before the store (one JSON file per volume in
//! `STATE_DIR/staged/`) are imported at start and the files moved to
//! `staged/imported/`; a file that cannot be read is quarantined rather
//! than failing the open: one bad record must not stop the node serving
//! every other volume.

use std::collections::{BTreeMap, HashMap};
use std::fs;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use serde::{Deserialize, Serialize};

use super::persist::{self, sweep_temporaries, Quarantined};
use super::pool::read_small;
use super::Error;
use crate::store::{self, Change, QuarantinedRecord, Store};

/// How the volume is consumed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "kind")]
pub enum AccessKind {
    Block,
    Mount { fs_type: String, flags: Vec<String> },
}

/// What puts the volume's image on a block device: a loop device (the
/// default, and what every record from before the choice existed means) or
/// the kernel's nbd driver served by the agent's own NBD server, which lets
/// the agent restart under a mounted filesystem (the device queues I/O
/// until the restarted agent gives it fresh sockets).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AttachKind {
    #[default]
    Loop,
    Nbd,
}

/// The StorageClass parameter's value (`attach: loop|nbd`).
impl std::str::FromStr for AttachKind {
    type Err = ();
    fn from_str(s: &str) -> Result<Self, ()> {
        match s {
            "loop" => Ok(Self::Loop),
            "nbd" => Ok(Self::Nbd),
            _ => Err(()),
        }
    }
}

/// The parameter's value, which is also the kernel's device name prefix.
impl std::fmt::Display for AttachKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl AttachKind {
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Self::Loop => "loop",
            Self::Nbd => "nbd",
        }
    }
}

/// How far a stage got.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum StagePhase {
    /// About to attach a loop device (the number may not be recorded yet).
    Attaching,
    /// Attached and found blank; the agent's own mkfs is about to run (or
    /// was running when the agent died). Whatever the device holds now was
    /// written by that mkfs, so a retry may format it again; a device in any
    /// other phase is never formatted unless it is all zeros.
    Formatting,
    /// Attached; the filesystem or device node is being set up.
    Mounting,
    /// Complete.
    Staged,
    /// An unstage is taking the volume down (unmount, detach); a restarted
    /// agent finishes it.
    Unstaging,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StagedVolume {
    pub volume_id: String,
    pub image: PathBuf,
    pub staging_path: PathBuf,
    pub access: AccessKind,
    pub read_only: bool,
    pub phase: StagePhase,
    #[serde(default)]
    pub loop_number: Option<u32>,
    /// How the image is attached; `loop_number` is used for loop devices,
    /// `nbd_index` for nbd devices.
    #[serde(default)]
    pub attach: AttachKind,
    /// The `/dev/nbdN` serving the volume, once the kernel picked it (its
    /// backend identifier is the volume id, checked before any use).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub nbd_index: Option<u32>,
    /// Published target paths, each with whether it is read-only.
    #[serde(default)]
    pub published: BTreeMap<PathBuf, bool>,
    /// For an nbd volume another node holds: its export and secret, so a
    /// restarted agent can reconnect the device without the CO.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub remote: Option<RemoteExport>,
}

/// Where a remote nbd volume is served: the URI and the hex secret the
/// owning node checks. `Debug` does not show the secret.
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RemoteExport {
    pub uri: String,
    pub secret: String,
}

impl std::fmt::Debug for RemoteExport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RemoteExport").field("uri", &self.uri).finish_non_exhaustive()
    }
}

impl StagedVolume {
    /// The kernel's name of the device the record names (`loop3`, `nbd0`).
    pub fn device_name(&self) -> Option<String> {
        match self.attach {
            AttachKind::Loop => self.loop_number.map(|n| format!("loop{n}")),
            AttachKind::Nbd => self.nbd_index.map(|n| format!("nbd{n}")),
        }
    }

    /// For block volumes, the file under the staging directory the device is
    /// bound onto; for mount volumes, the staging directory itself.
    pub fn staged_at(&self) -> PathBuf {
        match self.access {
            AccessKind::Block => self.staging_path.join(&self.volume_id),
            AccessKind::Mount { .. } => self.staging_path.clone(),
        }
    }
}

/// Told the id of each record put or removed.
type ChangeHook = Box<dyn Fn(&str) + Send>;

/// How the store was found at open, when it was not simply there.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StoreLoss {
    /// No `state.redb` (a new node, or one removed): a new store was made.
    Missing,
    /// The file could not be read; it was set aside and a new one made.
    Damaged { detail: String, set_aside: PathBuf },
}

/// The cause, as a recovery records it: `missing`, or `damaged: <why>`.
impl std::fmt::Display for StoreLoss {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            StoreLoss::Missing => f.write_str("missing"),
            StoreLoss::Damaged { detail, .. } => write!(f, "damaged: {detail}"),
        }
    }
}

pub struct StagedRecords {
    store: Arc<Store>,
    /// Set when the store was missing or damaged at open: the caller
    /// rebuilds the records from the kernel (`recover`).
    loss: Option<StoreLoss>,
    records: Mutex<HashMap<String, StagedVolume>>,
    quarantined: Vec<Quarantined>,
    /// Told the id of every record that changed (the reconciler and the
    /// publisher's StorageNode listen).
    changed: Mutex<Vec<ChangeHook>>,
}

pub(crate) const SUFFIX: &str = ".json";

/// Reads and checks one staged record; the error says what is wrong.
pub(crate) fn read_record(path: &Path, id: &str) -> Result<StagedVolume, String> {
    let bytes = read_small(path)?;
    let r: StagedVolume = serde_json::from_slice(&bytes).map_err(|e| format!("not a staged record: {e}"))?;
    if r.volume_id != id {
        return Err(format!("names volume {:?}, not {id:?}", r.volume_id));
    }
    Ok(r)
}

/// The volume ids of the record files in `dir` (not the temporaries).
pub(crate) fn record_ids(dir: &Path) -> std::io::Result<Vec<String>> {
    let mut ids = Vec::new();
    for entry in fs::read_dir(dir)? {
        let entry = entry?;
        if !entry.file_type()?.is_file() {
            continue;
        }
        let Some(name) = entry.file_name().to_str().map(str::to_string) else { continue };
        if let Some(id) = name.strip_suffix(SUFFIX).filter(|_| !name.starts_with('.')) {
            ids.push(id.to_string());
        }
    }
    ids.sort();
    Ok(ids)
}

/// The directory of legacy per-volume JSON records inside the state directory.
pub(crate) const LEGACY_DIR: &str = "staged";

/// Where imported legacy records are moved.
const IMPORTED_DIR: &str = "imported";

impl StagedRecords {
    /// Opens (creating if needed) the store in `state_dir`, imports legacy
    /// JSON records found in `state_dir/staged/`, and loads every record. A
    /// record the store cannot decode is quarantined in the store; an
    /// unreadable legacy file is moved to `staged/quarantine/`.
    pub fn open(state_dir: &Path) -> Result<Self, Error> {
        fs::create_dir_all(state_dir).map_err(Error::io("create state directory", state_dir))?;
        let path = state_dir.join(store::FILE);
        let existed = std::fs::symlink_metadata(&path).is_ok();
        let (store, loss) = match Store::open_checked(&path) {
            Ok((s, _)) => (s, (!existed).then_some(StoreLoss::Missing)),
            Err(e) if e.is_damage() => {
                let to = store::set_aside(&path).map_err(Error::io("set aside the damaged store", &path))?;
                tracing::error!(store = %path.display(), set_aside = %to.display(), error = %e,
                    "THE NODE'S STORE IS DAMAGED: set aside (kept for the operator) and a new one made; the staged volumes are rebuilt from the kernel");
                let s = Store::open(&path).map_err(|e| Error::Corrupt { path: path.clone(), detail: e.to_string() })?;
                (s, Some(StoreLoss::Damaged { detail: e.to_string(), set_aside: to }))
            }
            Err(e) => return Err(Error::Corrupt { path: path.clone(), detail: e.to_string() }),
        };
        let store_err = |e: store::Error| Error::Corrupt { path: path.clone(), detail: e.to_string() };
        import_legacy(&store, &state_dir.join(LEGACY_DIR))?;
        let contents = store.contents().map_err(store_err)?;
        let mut in_store: Vec<Quarantined> = contents.quarantined.iter().map(|q| as_quarantined(&path, q)).collect();
        let mut records = HashMap::with_capacity(contents.volumes.len());
        for (id, bytes) in contents.volumes {
            match decode(&bytes, &id) {
                Ok(r) => {
                    records.insert(id, r);
                }
                Err(reason) => {
                    let q = QuarantinedRecord { id: id.clone(), reason, raw: String::from_utf8_lossy(&bytes).into_owned() };
                    store.apply(&[Change::Quarantine(&q)]).map_err(store_err)?;
                    in_store.push(as_quarantined(&path, &q));
                    tracing::error!(volume = %id, reason = %q.reason,
                        "undecodable staged record quarantined; whatever it staged (loop device, mounts) is no longer tracked");
                }
            }
        }
        let mut quarantined = quarantined_in(state_dir)?;
        quarantined.extend(in_store);
        Ok(Self { store: Arc::new(store), loss, records: Mutex::new(records), quarantined, changed: Mutex::new(Vec::new()) })
    }

    /// How the store was found at open, when it was missing or damaged.
    pub fn loss(&self) -> Option<&StoreLoss> {
        self.loss.as_ref()
    }

    /// Durably records what `found` (read from the kernel) proved, and the
    /// recovery itself (when, why, what was adopted and refused, for
    /// `volring status`), in one transaction. The cause is how the store
    /// was lost, or an operator's `volring recover --apply` when it was
    /// not. A volume that has a record already keeps it.
    pub fn adopt(&self, found: &crate::recover::Found) -> Result<Vec<String>, Error> {
        let recovery = store::Recovery {
            at: store::timestamp(),
            cause: self.loss.as_ref().map_or("operator: volring recover --apply".into(), StoreLoss::to_string),
            set_aside: match &self.loss {
                Some(StoreLoss::Damaged { set_aside, .. }) => Some(set_aside.clone()),
                _ => None,
            },
            adopted: found.adopted.iter().map(|r| r.volume_id.clone()).collect(),
            refused: found.refused.clone(),
        };
        let recs = &found.adopted;
        let fresh: Vec<(&StagedVolume, Vec<u8>)> = recs
            .iter()
            .filter(|r| !self.contains(&r.volume_id))
            .map(|r| (r, serde_json::to_vec(r).expect("a staged record serialises")))
            .collect();
        let mut changes: Vec<Change<'_>> = fresh.iter().map(|(r, b)| Change::PutVolume(&r.volume_id, b)).collect();
        changes.push(Change::PutRecovery(&recovery));
        self.store.apply(&changes).map_err(|e| self.error(e))?;
        let mut ids = Vec::new();
        {
            let mut map = self.lock();
            for (r, _) in &fresh {
                map.insert(r.volume_id.clone(), (*r).clone());
                ids.push(r.volume_id.clone());
            }
        }
        for id in &ids {
            self.notify(id);
        }
        Ok(ids)
    }

    /// The node's store (the reconciler keeps its verdicts there too).
    pub fn store(&self) -> &Arc<Store> {
        &self.store
    }

    /// Calls `f` (beside any listener added before) with the id of every
    /// record put or removed from now on.
    pub fn on_change(&self, f: impl Fn(&str) + Send + 'static) {
        self.changed.lock().unwrap_or_else(|e| e.into_inner()).push(Box::new(f));
    }

    /// The records quarantined (by this run or earlier ones; the unit
    /// tests read them).
    #[cfg(test)]
    fn quarantined(&self) -> Vec<Quarantined> {
        self.quarantined.clone()
    }

    /// The quarantined record of volume `id`, if there is one: the volume
    /// may still be attached and mounted with nothing tracking it.
    #[cfg(test)]
    fn quarantined_record(&self, id: &str) -> Option<Quarantined> {
        self.quarantined.iter().find(|q| q.volume_id() == Some(id)).cloned()
    }

    /// Whether this node knows of volume `id` at all: a record, or one
    /// quarantined because it could not be read (the volume may then still
    /// be attached and mounted with nothing tracking it).
    pub fn knows(&self, id: &str) -> bool {
        self.contains(id) || self.quarantined.iter().any(|q| q.volume_id() == Some(id))
    }

    pub fn get(&self, id: &str) -> Option<StagedVolume> {
        self.lock().get(id).cloned()
    }

    pub fn contains(&self, id: &str) -> bool {
        self.lock().contains_key(id)
    }

    pub fn all(&self) -> Vec<StagedVolume> {
        self.lock().values().cloned().collect()
    }

    /// The ids of every record.
    pub fn ids(&self) -> Vec<String> {
        self.lock().keys().cloned().collect()
    }

    /// Durably records `r` (replacing the volume's previous record).
    pub fn put(&self, r: &StagedVolume) -> Result<(), Error> {
        let bytes = serde_json::to_vec(r).expect("a staged record serialises");
        self.store.apply(&[Change::PutVolume(&r.volume_id, &bytes)]).map_err(|e| self.error(e))?;
        self.lock().insert(r.volume_id.clone(), r.clone());
        self.notify(&r.volume_id);
        Ok(())
    }

    /// Forgets volume `id` (and the reconciler's verdict on it) in one
    /// transaction.
    pub fn remove(&self, id: &str) -> Result<(), Error> {
        self.store.apply(&[Change::RemoveVolume(id), Change::RemoveHealth(id)]).map_err(|e| self.error(e))?;
        self.lock().remove(id);
        self.notify(id);
        Ok(())
    }

    fn notify(&self, id: &str) {
        for f in self.changed.lock().unwrap_or_else(|e| e.into_inner()).iter() {
            f(id);
        }
    }

    fn error(&self, e: store::Error) -> Error {
        Error::Corrupt { path: self.store.path().to_path_buf(), detail: e.to_string() }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, StagedVolume>> {
        self.records.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// Decodes one record from the store and checks it names volume `id`.
pub(crate) fn decode(bytes: &[u8], id: &str) -> Result<StagedVolume, String> {
    let r: StagedVolume = serde_json::from_slice(bytes).map_err(|e| format!("not a staged record: {e}"))?;
    if r.volume_id != id {
        return Err(format!("names volume {:?}, not {id:?}", r.volume_id));
    }
    Ok(r)
}

/// A record quarantined inside the store, as status and the CSI layer see it.
pub(crate) fn as_quarantined(store: &Path, q: &QuarantinedRecord) -> Quarantined {
    Quarantined {
        name: format!("{}{SUFFIX}", q.id),
        path: PathBuf::from(format!("{}#quarantine/{}", store.display(), q.id)),
        reason: q.reason.clone(),
    }
}

/// The legacy files quarantined under `state_dir/staged/quarantine/`.
fn quarantined_in(state_dir: &Path) -> Result<Vec<Quarantined>, Error> {
    let legacy = state_dir.join(LEGACY_DIR);
    persist::quarantined(&legacy).map_err(Error::io("list quarantined records", &legacy))
}

/// Imports the legacy JSON records in `dir` into the store, each file once:
/// all readable records go in one transaction (with each file's hash), and
/// only then are the files moved to `dir/imported/`. A crash in between
/// finds the hashes on the next start and only moves the files. A record
/// for a volume the store already holds is older than the store's and is
/// set aside, not imported.
fn import_legacy(store: &Store, dir: &Path) -> Result<(), Error> {
    if !dir.is_dir() {
        return Ok(());
    }
    sweep_temporaries(dir).map_err(Error::io("clean legacy record directory", dir))?;
    let ids = record_ids(dir).map_err(Error::io("list legacy staged records", dir))?;
    if ids.is_empty() {
        return Ok(());
    }
    let held: std::collections::HashSet<String> = store
        .contents()
        .map_err(|e| Error::Corrupt { path: store.path().to_path_buf(), detail: e.to_string() })?
        .volumes
        .into_iter()
        .map(|(id, _)| id)
        .collect();
    let mut puts: Vec<(String, Vec<u8>, String, u64)> = Vec::new();
    let mut done = Vec::new();
    for id in ids {
        let name = format!("{id}{SUFFIX}");
        let path = dir.join(&name);
        let bytes = match read_small(&path) {
            Ok(b) => b,
            Err(reason) => {
                quarantine_file(dir, &name, &reason)?;
                continue;
            }
        };
        let hash = store::fnv1a(&bytes);
        let seen = store.imported(&name).map_err(|e| Error::Corrupt { path: store.path().to_path_buf(), detail: e.to_string() })?;
        if seen == Some(hash) || held.contains(&id) {
            if seen != Some(hash) {
                tracing::warn!(record = %path.display(), "a legacy record for a volume the store already holds; set aside unread");
            }
            done.push(name);
            continue;
        }
        match read_record(&path, &id) {
            Ok(r) => {
                let canonical = serde_json::to_vec(&r).expect("a staged record serialises");
                puts.push((id, canonical, name, hash));
            }
            Err(reason) => quarantine_file(dir, &name, &reason)?,
        }
    }
    let mut changes = Vec::with_capacity(puts.len() * 2);
    for (id, bytes, name, hash) in &puts {
        changes.push(Change::PutVolume(id, bytes));
        changes.push(Change::Imported(name, *hash));
    }
    if !changes.is_empty() {
        store.apply(&changes).map_err(|e| Error::Corrupt { path: store.path().to_path_buf(), detail: e.to_string() })?;
        tracing::info!(records = puts.len(), from = %dir.display(), "imported legacy staged records into the store");
    }
    done.extend(puts.into_iter().map(|(_, _, name, _)| name));
    let imported = dir.join(IMPORTED_DIR);
    fs::create_dir_all(&imported).map_err(Error::io("create", &imported))?;
    for name in done {
        fs::rename(dir.join(&name), imported.join(&name)).map_err(Error::io("set aside imported record", dir.join(&name)))?;
    }
    persist::sync_dir(&imported).and_then(|_| persist::sync_dir(dir)).map_err(Error::io("sync", dir))?;
    Ok(())
}

fn quarantine_file(dir: &Path, name: &str, reason: &str) -> Result<(), Error> {
    let path = dir.join(name);
    let q = persist::quarantine(dir, name, reason).map_err(Error::io("quarantine staged record", &path))?;
    tracing::error!(record = %path.display(), moved_to = %q.path.display(), %reason,
        "unreadable staged record quarantined; whatever it staged (loop device, mounts) is no longer tracked");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn attach_kind_defaults_to_loop_and_round_trips() {
        // A record written before the attach kind existed is a loop volume.
        let old = br#"{"volume_id":"v","image":"/p/v.img","staging_path":"/k/s","access":{"kind":"block"},
            "read_only":false,"phase":"staged","loop_number":4}"#;
        let r = decode(old, "v").unwrap();
        assert_eq!((r.attach, r.nbd_index, r.device_name().as_deref()), (AttachKind::Loop, None, Some("loop4")));
        let mut n = r.clone();
        n.attach = AttachKind::Nbd;
        n.loop_number = None;
        n.nbd_index = Some(2);
        let bytes = serde_json::to_vec(&n).unwrap();
        assert!(String::from_utf8_lossy(&bytes).contains(r#""attach":"nbd","nbd_index":2"#));
        assert_eq!(decode(&bytes, "v").unwrap(), n);
        assert_eq!(n.device_name().as_deref(), Some("nbd2"));
        // A loop record carries no nbd_index field at all.
        assert!(!String::from_utf8_lossy(&serde_json::to_vec(&r).unwrap()).contains("nbd_index"));
        assert_eq!("nbd".parse::<AttachKind>().ok(), Some(AttachKind::Nbd));
        assert_eq!("loop".parse::<AttachKind>().ok(), Some(AttachKind::Loop));
        assert_eq!("NBD".parse::<AttachKind>().ok(), None);
        assert_eq!("".parse::<AttachKind>().ok(), None);
    }

    #[test]
    fn survives_reopen() {
        let d = tempfile::tempdir().unwrap();
        let recs = StagedRecords::open(d.path()).unwrap();
        let mut r = StagedVolume {
            volume_id: "pvc-1".into(),
            image: "/pool/pvc-1.img".into(),
            staging_path: "/var/lib/kubelet/s".into(),
            access: AccessKind::Mount { fs_type: "ext4".into(), flags: vec!["noatime".into()] },
            read_only: false,
            phase: StagePhase::Attaching,
            loop_number: None,
            attach: AttachKind::Loop,
            nbd_index: None,
            published: BTreeMap::new(),
            remote: None,
        };
        recs.put(&r).unwrap();
        r.loop_number = Some(7);
        r.phase = StagePhase::Staged;
        r.published.insert("/var/lib/kubelet/p".into(), true);
        recs.put(&r).unwrap();
        drop(recs);
        let again = StagedRecords::open(d.path()).unwrap();
        assert_eq!(again.get("pvc-1"), Some(r.clone()));
        again.remove("pvc-1").unwrap();
        drop(again);
        assert!(StagedRecords::open(d.path()).unwrap().ids().is_empty());
        let recs = StagedRecords::open(d.path()).unwrap();
        recs.put(&r).unwrap();
        drop(recs);
        // Legacy JSON records are imported once; an unreadable one (or one
        // naming another volume) is quarantined, and the good ones served.
        let legacy = d.path().join(LEGACY_DIR);
        fs::create_dir_all(&legacy).unwrap();
        let mut old = r.clone();
        old.volume_id = "pvc-old".into();
        fs::write(legacy.join("pvc-old.json"), serde_json::to_vec_pretty(&old).unwrap()).unwrap();
        fs::write(legacy.join("torn.json"), b"{\"volume_id\": ").unwrap();
        fs::write(legacy.join("alias.json"), serde_json::to_vec(&r).unwrap()).unwrap();
        // A legacy record of a volume the store holds is older: set aside.
        let mut stale = r.clone();
        stale.phase = StagePhase::Attaching;
        fs::write(legacy.join("pvc-1.json"), serde_json::to_vec(&stale).unwrap()).unwrap();
        let again = StagedRecords::open(d.path()).unwrap();
        let mut all = again.all();
        all.sort_by(|a, b| a.volume_id.cmp(&b.volume_id));
        assert_eq!(all, vec![r.clone(), old.clone()]);
        let q: Vec<_> = again.quarantined().into_iter().map(|q| q.name).collect();
        assert_eq!(q, ["alias.json", "torn.json"]);
        assert!(again.quarantined_record("torn").is_some() && legacy.join("quarantine/torn.json").exists());
        assert!(legacy.join("imported/pvc-old.json").exists() && !legacy.join("pvc-old.json").exists());
        // Imported once: a second open changes nothing.
        drop(again);
        let again = StagedRecords::open(d.path()).unwrap();
        assert_eq!(again.ids().len(), 2);
        // A record the store cannot decode is quarantined in the store.
        again.store().apply(&[Change::PutVolume("pvc-bad", b"\x00garbage")]).unwrap();
        drop(again);
        let again = StagedRecords::open(d.path()).unwrap();
        assert!(again.get("pvc-bad").is_none() && again.quarantined_record("pvc-bad").is_some());
        assert_eq!(again.ids().len(), 2);
    }
}
