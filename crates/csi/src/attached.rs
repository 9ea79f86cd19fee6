//! The node half of the in-cluster healer hook: the volumes the cluster
//! says are attached here (src/publisher/attachments.rs lists them) sorted
//! against the store, and those whose data path this agent serves (nbd)
//! and does not serve now handed to the healer ([`super::nbd`]).
//!
//! The store decides, never the cluster: a volume the store does not know
//! is reported, not attached; a loop-attached volume's data path is the
//! kernel's and needs no healer; an nbd volume the start walk already
//! reconnected is left alone.

use std::sync::Arc;

use super::base::Base;
use super::nbd::{Healed, NbdSide, REMOTE_WAIT};
use volring_volumes::AttachKind;

/// What the hand-over found, volume ids in the order given.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct AttachedCheck {
    /// nbd volumes handed to the healer, and what it did.
    pub healed: Vec<(String, Healed)>,
    /// nbd volumes this agent serves already.
    pub serving: Vec<String>,
    /// Loop-attached volumes: the kernel holds their data path.
    pub kernel: Vec<String>,
    /// nbd volumes not handed over: healing is off, or a CSI call or a
    /// repair holds the volume (it is being taken care of).
    pub skipped: Vec<String>,
    /// Attached here by the cluster's account, unknown to the store.
    pub unknown: Vec<String>,
}

/// The nbd healer's walks over staged records: once at start, and for
/// the volumes the cluster says are attached here.
pub(crate) struct Healer {
    base: Arc<Base>,
    pub(crate) nbd: Arc<NbdSide>,
}

impl Healer {
    pub(crate) fn new(base: Arc<Base>, nbd: Arc<NbdSide>) -> Self {
        Self { base, nbd }
    }

    /// The start walk over every staged nbd record, once per process: the
    /// agent runs it as soon as the store is open, and the reconciler's
    /// start runs it if nobody did, so it always precedes the first pass
    /// (and Probe's ready). Later calls return nothing.
    ///
    /// Local volumes are reconnected before it returns, first; remote ones
    /// all at once, waited for at most [`REMOTE_WAIT`] together: one still
    /// connecting is reported [`Healed::Pending`] and goes on in the
    /// background, so neither the CSI socket nor `/readyz` waits on another
    /// node (such a volume's condition is abnormal until it is reconnected).
    pub(crate) fn heal_nbd(&self) -> Vec<(String, Healed)> {
        if !self.nbd.first_walk() {
            return Vec::new();
        }
        let recs = self
            .base
            .records
            .all()
            .into_iter()
            .filter(|r| r.attach == AttachKind::Nbd && r.nbd_index.is_some())
            .filter_map(|r| self.base.locks.try_lock_for_repair(&r.volume_id).map(|g| (r, g)))
            .collect();
        self.nbd.heal_all(recs, REMOTE_WAIT)
    }

    /// Hands every volume in `ids` whose data path this agent owns and
    /// does not serve to the healer; sorts the rest.
    pub(crate) fn heal_attached(&self, ids: &[String]) -> AttachedCheck {
        let mut c = AttachedCheck::default();
        let mut handed = Vec::new();
        for id in ids {
            let Some(rec) = self.base.records.get(id) else {
                c.unknown.push(id.clone());
                continue;
            };
            if rec.attach != AttachKind::Nbd {
                c.kernel.push(id.clone());
                continue;
            }
            if rec.nbd_index.is_some_and(|i| self.nbd.serving(i)) {
                c.serving.push(id.clone());
                continue;
            }
            if !self.nbd.config().heal {
                c.skipped.push(id.clone());
                continue;
            }
            let Some(g) = self.base.locks.try_lock_for_repair(id) else {
                c.skipped.push(id.clone());
                continue;
            };
            handed.push((rec, g));
        }
        // Locals first, remotes at once (a hung owner holds up no other
        // volume): the start walk's own order and bounds.
        for (id, h) in self.nbd.heal_all(handed, REMOTE_WAIT) {
            tracing::info!(volume = %id, healed = ?h, "attached volume handed to the nbd healer");
            c.healed.push((id, h));
        }
        c
    }
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, RwLock};

    use super::*;
    use crate::{CsiConfig, Driver, Readiness};
    use volring_mounts::MountTable;
    use volring_volumes::{AccessKind, StagePhase, StagedVolume};

    fn rec(id: &str, attach: AttachKind, nbd_index: Option<u32>) -> StagedVolume {
        StagedVolume {
            volume_id: id.into(),
            image: format!("/p/{id}.img").into(),
            staging_path: format!("/k/s/{id}").into(),
            access: AccessKind::Mount { fs_type: "ext4".into(), flags: vec![] },
            read_only: false,
            phase: StagePhase::Staged,
            loop_number: None,
            published: Default::default(),
            attach,
            nbd_index,
            remote: None,
        }
    }

    /// A driver whose kubelet root, pool and store live under `dir`.
    fn driver_in(dir: &std::path::Path) -> Arc<Driver> {
        let mut c = CsiConfig::new(dir.join("csi.sock"), "n1".into());
        c.kubelet_root = dir.join("kubelet");
        c.pool_dir = dir.join("pool");
        c.state_dir = dir.join("state");
        Driver::new(c, Arc::new(RwLock::new(MountTable::default())), Readiness::default()).unwrap()
    }

    /// The healer is reached for the nbd volume (its device, an index no
    /// node has, is gone: the reconciler re-stages it), the loop volume is
    /// the kernel's, and the volume the store never recorded is reported.
    #[test]
    fn attached_volumes_are_sorted_against_the_store_and_nbd_ones_reach_the_healer() {
        let dir = tempfile::tempdir().unwrap();
        let d = driver_in(dir.path());
        d.base.records.put(&rec("nbd-1", AttachKind::Nbd, Some(1 << 20))).unwrap();
        d.base.records.put(&rec("loop-1", AttachKind::Loop, None)).unwrap();
        let ids = ["nbd-1", "loop-1", "ghost"].map(String::from);
        let got = d.heal_attached(&ids);
        assert_eq!(got.healed, vec![("nbd-1".to_string(), Healed::Gone)]);
        assert_eq!((got.kernel, got.unknown), (vec!["loop-1".to_string()], vec!["ghost".to_string()]));
        assert!(got.serving.is_empty() && got.skipped.is_empty());
    }

    /// The start walk runs once per process: the agent runs it as soon as
    /// the store is open, and the reconciler's start (which runs it too,
    /// for callers that did not) finds it done.
    #[test]
    fn the_start_walk_runs_once() {
        let dir = tempfile::tempdir().unwrap();
        let d = driver_in(dir.path());
        d.base.records.put(&rec("nbd-1", AttachKind::Nbd, Some(1 << 20))).unwrap();
        assert_eq!(d.heal_nbd(), vec![("nbd-1".to_string(), Healed::Gone)]);
        assert_eq!(d.heal_nbd(), vec![]);
    }
}
