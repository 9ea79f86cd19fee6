//! What this node has staged, remembered on disk.
//!
//! kubelet may call NodeUnstageVolume long after the agent that staged the
//! volume has restarted: the loop device number, the staging path and the
//! published targets must outlive the process. Each volume's record is one
//! small file written crash-safe; the record is written *before* each step
//! that changes the machine (an intent), so a crash mid-stage leaves a record
//! that says what may need undoing.
//!
//! A record that cannot be read back is quarantined (see [`super::persist`])
//! rather than failing the open: one bad file must not stop the node serving
//! every other volume.

use std::collections::{BTreeMap, HashMap};
use std::fs;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use serde::{Deserialize, Serialize};

use super::persist::{self, remove_durable, sweep_temporaries, write_atomic, Quarantined};
use super::pool::read_small;
use super::Error;

/// How the volume is consumed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "kind")]
pub enum AccessKind {
    Block,
    Mount { fs_type: String, flags: Vec<String> },
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
    /// Published target paths, each with whether it is read-only.
    #[serde(default)]
    pub published: BTreeMap<PathBuf, bool>,
}

impl StagedVolume {
    /// For block volumes, the file under the staging directory the device is
    /// bound onto; for mount volumes, the staging directory itself.
    pub fn staged_at(&self) -> PathBuf {
        match self.access {
            AccessKind::Block => self.staging_path.join(&self.volume_id),
            AccessKind::Mount { .. } => self.staging_path.clone(),
        }
    }
}

pub struct StagedRecords {
    dir: PathBuf,
    records: Mutex<HashMap<String, StagedVolume>>,
    quarantined: Vec<Quarantined>,
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

impl StagedRecords {
    /// Opens (creating if needed) the records in `dir`; an unreadable record
    /// is moved to `dir/quarantine/` and logged, and the rest are served.
    pub fn open(dir: &Path) -> Result<Self, Error> {
        fs::create_dir_all(dir).map_err(Error::io("create state directory", dir))?;
        sweep_temporaries(dir).map_err(Error::io("clean state directory", dir))?;
        let mut records = HashMap::new();
        for id in record_ids(dir).map_err(Error::io("list staged records", dir))? {
            let name = format!("{id}{SUFFIX}");
            let path = dir.join(&name);
            match read_record(&path, &id) {
                Ok(r) => {
                    records.insert(r.volume_id.clone(), r);
                }
                Err(reason) => {
                    let q = persist::quarantine(dir, &name, &reason).map_err(Error::io("quarantine staged record", &path))?;
                    tracing::error!(record = %path.display(), moved_to = %q.path.display(), %reason,
                        "unreadable staged record quarantined; whatever it staged (loop device, mounts) is no longer tracked");
                }
            }
        }
        let quarantined = persist::quarantined(dir).map_err(Error::io("list quarantined records", dir))?;
        Ok(Self { dir: dir.to_path_buf(), records: Mutex::new(records), quarantined })
    }

    /// The records moved to `quarantine/` (by this run or earlier ones).
    pub fn quarantined(&self) -> Vec<Quarantined> {
        self.quarantined.clone()
    }

    /// The quarantined record of volume `id`, if there is one: the volume
    /// may still be attached and mounted with nothing tracking it.
    pub fn quarantined_record(&self, id: &str) -> Option<Quarantined> {
        self.quarantined.iter().find(|q| q.volume_id() == Some(id)).cloned()
    }

    pub fn get(&self, id: &str) -> Option<StagedVolume> {
        self.lock().get(id).cloned()
    }

    pub fn contains(&self, id: &str) -> bool {
        self.lock().contains_key(id)
    }

    pub fn len(&self) -> usize {
        self.lock().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn all(&self) -> Vec<StagedVolume> {
        self.lock().values().cloned().collect()
    }

    /// Durably records `r` (replacing the volume's previous record).
    pub fn put(&self, r: &StagedVolume) -> Result<(), Error> {
        let bytes = serde_json::to_vec_pretty(r).expect("a staged record serialises");
        write_atomic(&self.dir, &format!("{}{SUFFIX}", r.volume_id), &bytes).map_err(Error::io("write staged record", &self.dir))?;
        self.lock().insert(r.volume_id.clone(), r.clone());
        Ok(())
    }

    pub fn remove(&self, id: &str) -> Result<(), Error> {
        remove_durable(&self.dir, &format!("{id}{SUFFIX}")).map_err(Error::io("remove staged record", &self.dir))?;
        self.lock().remove(id);
        Ok(())
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, StagedVolume>> {
        self.records.lock().unwrap_or_else(|e| e.into_inner())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
            published: BTreeMap::new(),
        };
        recs.put(&r).unwrap();
        r.loop_number = Some(7);
        r.phase = StagePhase::Staged;
        r.published.insert("/var/lib/kubelet/p".into(), true);
        recs.put(&r).unwrap();
        let again = StagedRecords::open(d.path()).unwrap();
        assert_eq!(again.get("pvc-1"), Some(r.clone()));
        again.remove("pvc-1").unwrap();
        assert!(StagedRecords::open(d.path()).unwrap().is_empty());
        // An unreadable record (or one naming another volume) is quarantined;
        // the good one is still served.
        recs.put(&r).unwrap();
        fs::write(d.path().join("torn.json"), b"{\"volume_id\": ").unwrap();
        fs::write(d.path().join("alias.json"), serde_json::to_vec(&r).unwrap()).unwrap();
        let again = StagedRecords::open(d.path()).unwrap();
        assert_eq!(again.all(), vec![r]);
        let q: Vec<_> = again.quarantined().into_iter().map(|q| q.name).collect();
        assert_eq!(q, ["alias.json", "torn.json"]);
        assert!(again.quarantined_record("torn").is_some() && d.path().join("quarantine/torn.json").exists());
    }
}
