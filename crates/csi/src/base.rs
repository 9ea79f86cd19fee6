//! What every part of the driver reads: the configuration, the kubelet
//! root, the pool, the staged records, the volume locks and the mount
//! table the agent keeps current. Each part (controller, stager,
//! publisher, stats, shares, exports, healer) holds it shared; the state a
//! part alone changes lives in the part.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};

use super::owned::{Expect, Found, Root};
use super::proto::{CapacityRange, Topology};
use super::{validate, CsiConfig, Error, Result, VolumeGuard, VolumeLocks, TOPOLOGY_KEY};
use volring_mounts::MountTable;
use volring_volumes::{attach, ImagePool, StagedRecords, StagedVolume};

pub(crate) struct Base {
    pub(crate) config: CsiConfig,
    pub(crate) root: Root,
    pub(crate) pool: ImagePool,
    pub(crate) records: StagedRecords,
    pub(crate) locks: VolumeLocks,
    /// Kept current by the agent from the mount watcher's events.
    pub(crate) mounts: Arc<RwLock<MountTable>>,
}

impl Base {
    /// Takes the volume's lock or answers Aborted. A repair the reconciler
    /// is making is waited for (up to 30 s), not reported.
    pub(crate) fn lock(&self, id: &str) -> Result<VolumeGuard> {
        self.locks
            .lock_for_call(id, std::time::Duration::from_secs(30))
            .ok_or_else(|| Error::Aborted(format!("an operation on volume {id} is already in progress")))
    }

    /// A request's path, checked to lie inside the kubelet root.
    pub(crate) fn path(&self, p: &str, what: &str) -> Result<PathBuf> {
        self.root.path(p, what)
    }

    pub(crate) fn topology(&self) -> Topology {
        Topology { segments: HashMap::from([(TOPOLOGY_KEY.to_string(), self.config.node_id.clone())]) }
    }

    /// True when `t` names this node (and nothing this node lacks).
    pub(crate) fn is_here(&self, t: &Topology) -> bool {
        t.segments.iter().all(|(k, v)| k == TOPOLOGY_KEY && *v == self.config.node_id)
    }

    /// True when the staged volume is still what its record says: attached
    /// to its image and its own device mounted where it was staged.
    pub(crate) fn stage_intact(&self, r: &StagedVolume) -> Result<bool> {
        let Some(att) = attach::of_record(r) else { return Ok(false) };
        Ok(matches!(self.root.look(&r.staged_at(), Some(Expect::of(r, &att)))?, Found::Ours(_)))
    }

    /// NotFound for a volume this node has never heard of — answered before
    /// any other field is judged, as the spec's tables order it.
    pub(crate) fn known(&self, id: &str) -> Result<()> {
        if self.pool.get(id).is_none() && !self.records.contains(id) {
            return Err(Error::NotFound(format!("volume {id} does not exist")));
        }
        Ok(())
    }

    /// A stats call's `volume_path`, checked as every request path is; one
    /// the driver would refuse as an argument is a path volume `id` cannot
    /// be at, so NotFound (the caller checked it is not empty).
    pub(crate) fn stats_path(&self, id: &str, p: &str) -> Result<PathBuf> {
        self.path(p, "volume_path").map_err(|e| match e {
            Error::InvalidArgument(why) => Error::NotFound(format!("volume {id} is not at {p:?}: {why}")),
            e => e,
        })
    }

    /// The staged record of `id`, if `path` is its staging path or one of
    /// its targets; NotFound otherwise (unknown volume, or not there).
    pub(crate) fn located(&self, id: &str, path: &Path) -> Result<StagedVolume> {
        let rec = self.records.get(id).ok_or_else(|| match self.pool.get(id) {
            None => Error::NotFound(format!("volume {id} does not exist")),
            Some(_) => Error::NotFound(format!("volume {id} is not staged on this node")),
        })?;
        if rec.staging_path != path && !rec.published.contains_key(path) {
            return Err(Error::NotFound(format!("volume {id} is not at {}", path.display())));
        }
        Ok(rec)
    }

    /// Grows volume `id`'s image (now `have` bytes) to what `range` asks,
    /// if it asks for more; returns the size it has then.
    pub(crate) fn grow_image(&self, id: &str, range: &CapacityRange, have: u64) -> Result<u64> {
        if range.required_bytes.max(0) as u64 <= have {
            return Ok(have);
        }
        let size = validate::capacity(Some(range), have, self.max_volume_size())?;
        Ok(self.pool.grow(id, size)?.size_bytes)
    }

    /// The largest volume CreateVolume accepts and GetCapacity advertises:
    /// the pool filesystem's largest file, under volring's own ceiling.
    pub(crate) fn max_volume_size(&self) -> u64 {
        self.pool.max_image_bytes().min(validate::MAX_SIZE)
    }
}
