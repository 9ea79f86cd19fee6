//! The reconciler's hands: the one way it changes the machine is through
//! the driver, under the same per-volume lock a CSI call takes, with the
//! same idempotent steps a repeated NodeStageVolume or NodeUnstageVolume
//! would run. So a repair can never fight a call, and a repair interrupted
//! by a crash is finished like any other interrupted stage.

use std::sync::Arc;

use super::proto::volume_capability::access_mode::Mode;
use super::validate::{Access, AccessType};
use super::Driver;
use crate::state::actual::Action;
use crate::state::reconcile::{Acted, ReconcileConfig, Reconciler, Volumes};
use crate::volumes::filesystem::FsKind;
use crate::volumes::{attach, AccessKind, AttachKind, MountOptions, StagePhase, StagedVolume};

/// The driver, as the reconciler sees it.
pub struct DriverVolumes(pub Arc<Driver>);

impl Driver {
    /// Starts the reconciler over this driver's volumes: looks at every
    /// volume once (finishing what a crash interrupted) before it returns,
    /// then follows the events. Every record change is passed on to it, and
    /// NodeGetVolumeStats reads its published verdicts.
    pub fn start_reconciler(self: &Arc<Self>, config: ReconcileConfig) -> std::io::Result<Reconciler> {
        // nbd devices first: a device whose server died with the last agent
        // gets fresh sockets before the first pass looks at its mount (and
        // before Probe answers ready); the pass re-stages the ones gone.
        for (id, healed) in self.heal_nbd() {
            tracing::debug!(volume = %id, ?healed, "nbd start walk");
        }
        let store = self.records.store().clone();
        let r = Reconciler::start(config, Arc::new(DriverVolumes(self.clone())), self.mounts.clone(), store)?;
        let notify = r.notifier();
        self.records.on_change(move |id| notify.volume(id));
        let _ = self.health.set(r.view().clone());
        self.resume_shares();
        Ok(r)
    }
}

impl Volumes for DriverVolumes {
    fn record(&self, id: &str) -> Option<StagedVolume> {
        self.0.records.get(id)
    }

    fn ids(&self) -> Vec<String> {
        self.0.records.ids()
    }

    fn orphans(&self, remove: bool) -> Vec<String> {
        self.orphan_devices(remove)
    }

    fn act(&self, id: &str, action: Action) -> Acted {
        let Some(_guard) = self.0.locks.try_lock_for_repair(id) else { return Acted::Busy };
        // Read again under the lock: a call may have changed it since.
        let Some(rec) = self.0.records.get(id) else { return Acted::Done };
        let result = match action {
            Action::None => return Acted::Intact,
            Action::FinishUnstage if rec.phase == StagePhase::Unstaging => self.0.finish_unstage(&rec),
            Action::FinishUnstage => return Acted::Intact,
            Action::Restage if rec.phase == StagePhase::Staged && self.0.stage_intact(&rec).unwrap_or(false) => return Acted::Intact,
            Action::Restage => self.restage(&rec),
        };
        match result {
            Ok(()) => Acted::Done,
            Err(e) => Acted::Failed(e.to_string()),
        }
    }
}

impl DriverVolumes {
    /// Loop devices serving pool images with no staged record. A stage
    /// records its intent before it attaches, so a device without one was
    /// made by something else or left by a crash before the store existed.
    fn orphan_devices(&self, remove: bool) -> Vec<String> {
        let d = &self.0;
        let mut out = Vec::new();
        for (att, image) in attach::serving_images_in(d.pool.dir()) {
            let id = image.file_name().and_then(|n| n.to_str()).and_then(|n| n.strip_suffix(".img")).unwrap_or("");
            if d.records.get(id).is_some_and(|r| r.loop_number.is_none_or(|n| n == att.number)) {
                continue;
            }
            let mounted: Vec<String> = {
                let table = d.mounts.read().unwrap_or_else(|e| e.into_inner());
                table.on_device(att.dev).map(|m| m.mount_point_path().display().to_string()).collect()
            };
            let mut what = format!("{} serves {} with no record", att.path().display(), image.display());
            if !mounted.is_empty() {
                what.push_str(&format!(", mounted at {}", mounted.join(", ")));
            } else if remove {
                // Under the volume's lock, so a stage cannot be starting.
                if let Some(_g) = d.locks.try_lock_for_repair(id) {
                    if d.records.get(id).is_none() {
                        match attach::detach(att.number, &image) {
                            Ok(()) => what.push_str(" (detached)"),
                            Err(e) => what.push_str(&format!(" (detach failed: {e})")),
                        }
                    }
                }
            }
            out.push(what);
        }
        out
    }

    fn restage(&self, rec: &StagedVolume) -> super::Result<()> {
        let d = &self.0;
        // A mount over a directory between the kubelet root and the staging
        // path puts the path inside someone else's filesystem: mounting the
        // volume there would act on what is not volring's.
        let at = rec.staged_at();
        {
            let table = d.mounts.read().unwrap_or_else(|e| e.into_inner());
            for dir in at.ancestors().skip(1).take_while(|p| p.starts_with(&d.config.kubelet_root) && *p != d.config.kubelet_root) {
                if table.top_at(dir.as_os_str().as_encoded_bytes()).is_some() {
                    return Err(super::Error::FailedPrecondition(format!(
                        "{} is covered by a mount at {}; not repairing under it",
                        at.display(),
                        dir.display()
                    )));
                }
            }
        }
        // Never a second device on one image: a device serving the image
        // that the record does not name is not volring's to mount over.
        let named = attach::of_record(rec);
        if named.is_none() && rec.phase == StagePhase::Staged && rec.attach == AttachKind::Nbd {
            if let Some(n) = attach::nbd_backed_by(&rec.volume_id).first() {
                return Err(super::Error::FailedPrecondition(format!(
                    "/dev/nbd{n} carries the volume id but the record names {:?}; not attaching a second device",
                    rec.nbd_index
                )));
            }
        }
        if named.is_none() && rec.phase == StagePhase::Staged {
            if let Some(other) = attach::find_backed_by(&rec.image).first() {
                return Err(super::Error::FailedPrecondition(format!(
                    "the image is served by {} which the record does not name; not attaching a second device",
                    other.path().display()
                )));
            }
        }
        let requested = match &rec.access {
            AccessKind::Mount { fs_type, .. } if !fs_type.is_empty() => Some(fs_type.clone()),
            AccessKind::Mount { .. } => d.pool.get(&rec.volume_id).and_then(|m| m.fs_type),
            AccessKind::Block => None,
        };
        let access = access_of(rec, requested.as_deref())?;
        d.stage_locked(rec.clone(), Some(rec), &access, requested.as_deref())
    }
}

/// The capability a staged record was staged with.
fn access_of(rec: &StagedVolume, fs: Option<&str>) -> super::Result<Access> {
    let mode = if rec.read_only { Mode::SingleNodeReaderOnly } else { Mode::SingleNodeWriter };
    let access = match &rec.access {
        AccessKind::Block => AccessType::Block,
        AccessKind::Mount { flags, .. } => {
            let fs = FsKind::parse(fs.unwrap_or("")).ok_or_else(|| super::Error::Internal(format!("recorded fs_type {fs:?}")))?;
            let options = MountOptions::parse(flags, rec.read_only).map_err(super::Error::Internal)?;
            AccessType::Mount { fs, flags: flags.clone(), options }
        }
    };
    Ok(Access { access, mode })
}
