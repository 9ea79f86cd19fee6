//! What this node has staged, remembered on disk.
//!
//! kubelet may call NodeUnstageVolume long after the agent that staged the
//! volume has restarted: the loop device number, the staging path and the
//! published targets must outlive the process. Each volume's record is one
//! small file written crash-safe; the record is written *before* each step
//! that changes the machine (an intent), so a crash mid-stage leaves a record
//! that says what may need undoing.

use std::collections::{BTreeMap, HashMap};
use std::fs;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use serde::{Deserialize, Serialize};

use super::persist::{remove_durable, sweep_temporaries, write_atomic};
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
}

const SUFFIX: &str = ".json";

impl StagedRecords {
    pub fn open(dir: &Path) -> Result<Self, Error> {
        fs::create_dir_all(dir).map_err(Error::io("create state directory", dir))?;
        sweep_temporaries(dir).map_err(Error::io("clean state directory", dir))?;
        let mut records = HashMap::new();
        for entry in fs::read_dir(dir).map_err(Error::io("list staged records", dir))? {
            let path = entry.map_err(Error::io("list staged records", dir))?.path();
            if path.extension().is_some_and(|e| e == "json") {
                let bytes = fs::read(&path).map_err(Error::io("read staged record", &path))?;
                let r: StagedVolume =
                    serde_json::from_slice(&bytes).map_err(|e| Error::Corrupt { path: path.clone(), detail: e.to_string() })?;
                records.insert(r.volume_id.clone(), r);
            }
        }
        Ok(Self { dir: dir.to_path_buf(), records: Mutex::new(records) })
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
        assert_eq!(again.get("pvc-1"), Some(r));
        again.remove("pvc-1").unwrap();
        assert!(StagedRecords::open(d.path()).unwrap().is_empty());
    }
}
