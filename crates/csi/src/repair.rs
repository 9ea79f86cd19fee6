//! The reconciler's hands: the one way it changes the machine is through
//! the driver, under the same per-volume lock a CSI call takes, with the
//! same idempotent steps a repeated NodeStageVolume or NodeUnstageVolume
//! would run. So a repair can never fight a call, and a repair interrupted
//! by a crash is finished like any other interrupted stage.

use std::sync::Arc;

use super::base::Base;
use super::node::Stager;
use super::owned::{Expect, Found};
use super::proto::volume_capability::access_mode::Mode;
use super::validate::{Access, AccessType};
use volring_volumes::filesystem::FsKind;
use volring_volumes::mounting::MountOptions;
use volring_volumes::{attach, AccessKind, AttachKind, StagePhase, StagedVolume};
use volring_volumes::{Acted, Volumes};
use volring_volumes::{Action, AtPath, Proof, VolumeActual};

/// The driver, as the reconciler sees it: the stager's steps under the
/// repair lock.
pub(crate) struct Repairs {
    stager: Arc<Stager>,
}

impl Volumes for Repairs {
    fn record(&self, id: &str) -> Option<StagedVolume> {
        self.base().records.get(id)
    }

    fn ids(&self) -> Vec<String> {
        self.base().records.ids()
    }

    fn orphans(&self, remove: bool) -> Vec<String> {
        self.orphan_devices(remove)
    }

    fn prove(&self, rec: &StagedVolume) -> Proof {
        self.proof(rec)
    }

    fn act(&self, id: &str, action: Action) -> Acted {
        let Some(_guard) = self.base().locks.try_lock_for_repair(id) else { return Acted::Busy };
        // Read again under the lock: a call may have changed it since.
        let Some(rec) = self.base().records.get(id) else { return Acted::Done };
        // A device someone is taking away is neither re-mounted (its I/O
        // fails) nor replaced (the image would have two) until it is gone.
        if let attach::DeviceProof::Unsettled(why) = attach::prove(&rec) {
            return Acted::Unsettled(why);
        }
        let result = match action {
            Action::None => return Acted::Intact,
            Action::FinishUnstage if rec.phase == StagePhase::Unstaging => self.stager.finish_unstage(&rec),
            Action::FinishUnstage => return Acted::Intact,
            Action::Restage if rec.phase == StagePhase::Staged && self.base().stage_intact(&rec).unwrap_or(false) => return Acted::Intact,
            Action::Restage => {
                volring_volumes::fault::pause("reconcile:decided");
                self.restage(&rec)
            }
        };
        match result {
            Ok(()) if action == Action::Restage => {
                // A shared volume's export must follow the new mount.
                if let Err(e) = self.stager.shares.side().refresh(id, &rec.staged_at()) {
                    tracing::error!(volume = id, error = %e, "the NFS export does not serve the repaired mount");
                }
                Acted::Done
            }
            Ok(()) => Acted::Done,
            Err(e) => Acted::Failed(e.to_string()),
        }
    }
}

impl Repairs {
    pub(crate) fn new(stager: Arc<Stager>) -> Self {
        Self { stager }
    }

    fn base(&self) -> &Base {
        &self.stager.base
    }

    /// What is really there for `rec` now: its device asked what backs it,
    /// its staging path and targets opened beneath the kubelet root and
    /// judged by `statx` (the same rule every node call acts by), and
    /// whether a mount covers the way to the staging path.
    fn proof(&self, rec: &StagedVolume) -> Proof {
        let device = match attach::prove(rec) {
            attach::DeviceProof::Ours(a) => Some(a),
            attach::DeviceProof::Gone => None,
            attach::DeviceProof::Unsettled(why) => return Proof::Unsettled(why),
        };
        let expect = device.map(|a| Expect::of(rec, &a));
        let at = |p: &std::path::Path| match self.base().root.look(p, expect) {
            Ok(Found::Missing | Found::Unmounted) => Ok(AtPath::Missing),
            Ok(Found::Ours(_)) => Ok(AtPath::Ours),
            Ok(Found::Foreign(_)) => Ok(AtPath::Foreign),
            Err(e) => Err(format!("{}: {e}", p.display())),
        };
        let seen = (|| {
            let staging = at(&rec.staged_at())?;
            let targets = rec.published.keys().map(|t| Ok((t.clone(), at(t)?))).collect::<Result<_, String>>()?;
            let covered = self.base().root.covering_mount(&rec.staged_at()).map_err(|e| e.to_string())?;
            Ok::<_, String>(Proof::Seen { actual: VolumeActual { device, staging, targets }, covered })
        })();
        seen.unwrap_or_else(Proof::Unsettled)
    }

    /// Loop devices serving pool images with no staged record. A stage
    /// records its intent before it attaches, so a device without one was
    /// made by something else or left by a crash before the store existed.
    fn orphan_devices(&self, remove: bool) -> Vec<String> {
        let d = self.base();
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
            // The table says where it is mounted; the kernel says whether
            // anything holds it now. Detached only when both say nothing
            // does and the device still serves that very image.
            let claimed = if mounted.is_empty() && remove { attach::claimed(&att.path()) } else { Ok(false) };
            if !mounted.is_empty() {
                what.push_str(&format!(", mounted at {}", mounted.join(", ")));
            } else if !matches!(claimed, Ok(false)) {
                what.push_str(match claimed {
                    Ok(_) => ", held by a mount or another exclusive opener the mount table does not show yet",
                    Err(_) => ", not detached: could not tell whether anything holds it",
                });
            } else if remove && !matches!(attach::prove_loop(att.number, &image), attach::DeviceProof::Ours(_)) {
                what.push_str(" (changing; not detached)");
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
        let d = self.base();
        // A mount over a directory between the kubelet root and the staging
        // path puts the path inside someone else's filesystem: mounting the
        // volume there would act on what is not volring's. Asked of the
        // kernel now, under the lock: the table may not have the mount yet.
        let at = rec.staged_at();
        if let Some(dir) = d.root.covering_mount(&at)? {
            return Err(super::Error::FailedPrecondition(format!(
                "{} is covered by a mount at {}; not repairing under it",
                at.display(),
                dir.display()
            )));
        }
        // Never a second device on one image: a device serving the image
        // that the record does not name is not volring's to mount over.
        let named = attach::of_record(rec);
        if named.is_none() && rec.phase == StagePhase::Staged && rec.attach == AttachKind::Nbd {
            if let Some(a) = attach::serving(AttachKind::Nbd, &rec.image, &rec.volume_id).first() {
                return Err(super::Error::FailedPrecondition(format!(
                    "/dev/nbd{} carries the volume id but the record names {:?}; not attaching a second device",
                    a.number, rec.nbd_index
                )));
            }
        }
        if named.is_none() && rec.phase == StagePhase::Staged {
            if let Some(other) = attach::serving(AttachKind::Loop, &rec.image, &rec.volume_id).first() {
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
        self.stager.stage_locked(rec.clone(), Some(rec), &access, requested.as_deref())
    }
}

/// The capability a staged record was staged with.
fn access_of(rec: &StagedVolume, fs: Option<&str>) -> super::Result<Access> {
    let mode = if rec.read_only { Mode::SingleNodeReaderOnly } else { Mode::SingleNodeWriter };
    let access = match &rec.access {
        AccessKind::Block => AccessType::Block,
        AccessKind::Mount { flags, .. } => {
            let fs = fs.unwrap_or("").parse::<FsKind>().map_err(|()| super::Error::Internal(format!("recorded fs_type {fs:?}")))?;
            let options = MountOptions::parse(flags, rec.read_only).map_err(super::Error::Internal)?;
            AccessType::Mount { fs, flags: flags.clone(), options }
        }
    };
    Ok(Access { access, mode })
}
