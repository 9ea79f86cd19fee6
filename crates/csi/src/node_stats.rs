//! Node service, the questions about a staged volume: its usage and
//! condition, growing its filesystem, and the node's own identity.
//!
//! Stats are answered from one descriptor of the path: `statx` proves it is
//! the root of the volume's own mount (and the watcher's table, when it has
//! that mount, must agree), and `fstatvfs` on the same descriptor measures
//! it. After an unmount the path shows the parent filesystem; that is
//! reported as the volume being gone, never measured as the volume.

use std::os::fd::{AsFd, OwnedFd};
use std::path::Path;

use super::owned::{Expect, Found};
use super::proto::*;
use super::validate;
use std::sync::{Arc, OnceLock};

use super::base::Base;
use super::nbd::NbdSide;
use super::share_client::NfsClient;
use super::{Error, Expansion, Result};
use volring_mounts::DevNum;
use volring_volumes::attach::{self, Attachment};
use volring_volumes::beneath::Node;
use volring_volumes::filesystem;
use volring_volumes::{AccessKind, StagedVolume};
use volring_volumes::{Drift, HealthView, VolumeHealth};

/// Node service, the questions about a staged volume and its growth.
pub(crate) struct Stats {
    base: Arc<Base>,
    nbd: Arc<NbdSide>,
    nfs: Arc<NfsClient>,
    /// The reconciler's published verdicts, once it runs.
    pub(crate) health: OnceLock<Arc<HealthView>>,
}

impl Stats {
    pub(crate) fn new(base: Arc<Base>, nbd: Arc<NbdSide>, nfs: Arc<NfsClient>) -> Self {
        Self { base, nbd, nfs, health: OnceLock::new() }
    }

    pub(crate) fn node_stats(&self, req: NodeGetVolumeStatsRequest) -> Result<NodeGetVolumeStatsResponse> {
        // The spec's one error here is NOT_FOUND, "does not exist on the
        // specified volume_path"; a missing field is still the caller's
        // error, and answered first. So: no id or no path, InvalidArgument;
        // an unknown id, NotFound; and any path that is not the volume's,
        // NotFound — a malformed one (relative, `..`, outside the kubelet
        // root) included, as no volume is ever there.
        validate::volume_id(&req.volume_id)?;
        if req.volume_path.is_empty() {
            return Err(Error::InvalidArgument("volume_path is required".into()));
        }
        let id = req.volume_id.as_str();
        if let Some(r) = self.nfs.stats(id, &req.volume_path)? {
            return Ok(r);
        }
        self.base.known(id)?;
        let path = self.base.stats_path(id, &req.volume_path)?;
        // kubelet asks a raw block volume's stats at its own bind of the
        // device volring published (`<root>/plugins/kubernetes.io/csi/
        // volumeDevices/<pv>/dev/<podUID>`), a path no record names: that
        // path is the volume's when it is a device node of the volume's
        // attached device (loop or nbd), proven on one descriptor opened
        // beneath the kubelet root (`device_node`), which is kept. Reporting
        // it reports nothing the caller does not already reach there.
        // Anything else stays NotFound.
        let (rec, device) = self.locate(id, &path)?;
        let checked = if path == rec.staging_path { rec.staged_at() } else { path.clone() };
        let att = attach::of_record(&rec);
        let mut usage = Vec::new();
        let problem = match att {
            None => Some("the loop device behind the volume is gone".to_string()),
            Some(a) => {
                let expect = Expect::of(&rec, &a);
                let found = match device {
                    Some((fd, rdev)) if rdev == a.dev => Found::Ours(fd),
                    // The volume's device changed since the proof a moment ago.
                    Some(_) => return Err(Error::NotFound(format!("volume {id} is not at {}", path.display()))),
                    None => self.base.root.look(&checked, Some(expect))?,
                };
                match found {
                    Found::Missing => Some(format!("{} does not exist", checked.display())),
                    Found::Unmounted => Some(format!("the volume is not mounted at {}", checked.display())),
                    Found::Foreign(n) => Some(format!("{} holds device {}, not the volume's {}", checked.display(), n.dev, a.dev)),
                    Found::Ours(fd) => self.measure(&rec, &a, fd, &checked, &mut usage)?,
                }
            }
        };
        let volume_condition = Some(self.condition(id, &rec, &checked, problem, att.as_ref()));
        Ok(NodeGetVolumeStatsResponse { usage, volume_condition })
    }

    /// The volume's record for `path`, and the device node proven there
    /// when `path` is kubelet's own bind of a raw block volume (see
    /// `node_stats`); NotFound when neither.
    fn locate(&self, id: &str, path: &Path) -> Result<(StagedVolume, Option<(OwnedFd, DevNum)>)> {
        match self.base.located(id, path) {
            Ok(rec) => Ok((rec, None)),
            Err(Error::NotFound(why)) => {
                let not_here = || Error::NotFound(why.clone());
                let rec = self.base.records.get(id).filter(|r| matches!(r.access, AccessKind::Block)).ok_or_else(not_here)?;
                let dev = attach::of_record(&rec).ok_or_else(not_here)?.dev;
                let fd = self.base.root.device_node(path, dev)?.ok_or_else(not_here)?;
                Ok((rec, Some((fd, dev))))
            }
            Err(e) => Err(e),
        }
    }

    /// Measures the volume through `fd` (its own mount root or device node)
    /// into `usage`; `Some` says why the volume is not usable there.
    fn measure(
        &self,
        rec: &StagedVolume,
        a: &Attachment,
        fd: OwnedFd,
        checked: &Path,
        usage: &mut Vec<VolumeUsage>,
    ) -> Result<Option<String>> {
        let problem = match self.table_disagrees(checked, &fd) {
            Some(why) => Some(why),
            None => match &rec.access {
                AccessKind::Block => {
                    let size = attach::device_bytes(a)?;
                    usage.push(bytes_usage(size, 0, size));
                    None
                }
                AccessKind::Mount { .. } => match rustix::fs::fstatvfs(&fd) {
                    Ok(s) => {
                        let (f, blocks) = (s.f_frsize, s.f_blocks);
                        usage.push(bytes_usage(blocks * f, s.f_bavail * f, (blocks - s.f_bfree.min(blocks)) * f));
                        usage.push(VolumeUsage {
                            total: s.f_files as i64,
                            available: s.f_ffree as i64,
                            used: s.f_files.saturating_sub(s.f_ffree) as i64,
                            unit: volume_usage::Unit::Inodes as i32,
                        });
                        shut_down(fd.as_fd(), checked)
                    }
                    Err(e) => Some(format!("statfs {}: {e}", checked.display())),
                },
            },
        };
        Ok(problem)
    }

    /// The volume's condition: `problem` found at the path, what the device
    /// says and the reconciler's verdict on the volume as a whole.
    fn condition(
        &self,
        id: &str,
        rec: &StagedVolume,
        checked: &Path,
        problem: Option<String>,
        att: Option<&Attachment>,
    ) -> VolumeCondition {
        // The device may be there and mounted and still serve nothing: an
        // nbd connection that is dead, an ext4 that shut itself down after
        // an I/O error (the mount table still says rw then).
        let problem = match (problem, att.and_then(|a| self.device_problem(a))) {
            (Some(p), Some(d)) => Some(format!("{p}; {d}")),
            (p, d) => p.or(d),
        };
        // The path was proven above; the reconciler adds what it knows of
        // the volume as a whole (its staging mount and device, a failed or
        // a past repair).
        let verdict = self.health.get().and_then(|v| v.get(id));
        let proven = Proven {
            staging: problem.is_none() && *checked == rec.staged_at(),
            device: problem.is_none(),
            settled: rec.phase == volring_volumes::StagePhase::Staged,
        };
        let problem = match (problem, verdict.as_deref().and_then(|h| volume_problem_beside(h, proven))) {
            (Some(p), Some(v)) => Some(format!("{p}; {v}")),
            (p, v) => p.or(v),
        };
        let message = match (&problem, verdict.as_deref().and_then(|h| h.last_repair.as_ref())) {
            (Some(p), _) => p.clone(),
            (None, Some(r)) => format!("healthy; repaired at unix time {} ({r})", r.at_unix),
            (None, None) => "healthy".into(),
        };
        VolumeCondition { abnormal: problem.is_some(), message }
    }

    /// What is wrong below the mount: the nbd connection, or ext4's own
    /// error count (`/sys/fs/ext4/<device>/errors_count`).
    fn device_problem(&self, a: &Attachment) -> Option<String> {
        let fs_errors =
            ext4_errors(&a.to_string()).filter(|&n| n > 0).map(|n| format!("ext4 on {} recorded {n} errors", a.path().display()));
        match (self.nbd.problem(a), fs_errors) {
            (Some(n), Some(f)) => Some(format!("{n}; {f}")),
            (n, f) => n.or(f),
        }
    }

    /// The watcher's table, where it knows the mount `fd` is the root of
    /// (same mount id), must agree with the descriptor about the device that
    /// mount is of. (It may not know it yet: a mount made a moment ago is
    /// proven by the descriptor alone.)
    fn table_disagrees(&self, path: &Path, fd: &std::os::fd::OwnedFd) -> Option<String> {
        let node: Node = volring_volumes::beneath::stat(fd.as_fd()).ok()?;
        let table = self.base.mounts.read().unwrap_or_else(|e| e.into_inner());
        let m = table.top_at(path.as_os_str().as_encoded_bytes())?;
        (m.info_id.map(u64::from) == Some(node.mnt_id) && m.dev != node.dev)
            .then(|| format!("the mount table says mount {} at {} is of device {}, not {}", node.mnt_id, path.display(), m.dev, node.dev))
    }

    pub(crate) fn node_expand(&self, req: NodeExpandVolumeRequest) -> Result<NodeExpandVolumeResponse> {
        validate::volume_id(&req.volume_id)?;
        let id = req.volume_id.as_str();
        self.base.known(id)?;
        let path = self.base.path(&req.volume_path, "volume_path")?;
        if !req.staging_target_path.is_empty() {
            self.base.path(&req.staging_target_path, "staging_target_path")?;
        }
        if let Some(c) = &req.volume_capability {
            validate::capability(Some(c))?;
        }
        if let Some(r) = &req.capacity_range {
            validate::capacity_range(r)?;
        }
        let _guard = self.base.lock(id)?;
        let rec = self.base.located(id, &path)?;
        let att = attach::of_record(&rec)
            .ok_or_else(|| Error::FailedPrecondition(format!("volume {id} has no {} device; stage it again", rec.attach)))?;
        if let (Expansion::Node, Some(range)) = (self.base.config.expansion, &req.capacity_range) {
            // This node holds the image: grow it here (the controller does
            // not offer expansion in this mode). Growing an image is
            // idempotent (the pool's own `pool.expand.*` fault points cover
            // a crash inside it), so a retry only refreshes the device and
            // grows the filesystem.
            let have = self.base.pool.get(id).ok_or_else(|| Error::NotFound(format!("volume {id} does not exist")))?;
            self.base.grow_image(id, range, have.size_bytes)?;
        }
        let size = self.nbd.refresh_device(&rec, &att)?;
        volring_volumes::fault::point("node_expand:refreshed");
        let required = req.capacity_range.as_ref().map_or(0, |r| r.required_bytes.max(0) as u64);
        if required > size {
            return Err(Error::OutOfRange(format!("volume {id} has {size} bytes; grow it with ControllerExpandVolume first")));
        }
        if let AccessKind::Mount { fs_type, .. } = &rec.access {
            if rec.read_only {
                return Err(Error::FailedPrecondition(format!("volume {id} is staged read-only; its filesystem cannot grow")));
            }
            // Grow only what is provably the volume's own staging mount,
            // through the descriptor that proved it (a mount swapped in at
            // the path afterwards is not grown).
            let Found::Ours(mount) = self.base.root.look(&rec.staged_at(), Some(Expect::of(&rec, &att)))? else {
                return Err(Error::FailedPrecondition(format!(
                    "volume {id} is not mounted at {}; stage it again",
                    rec.staging_path.display()
                )));
            };
            volring_volumes::fault::point("node_expand:grow");
            filesystem::grow(fs_type, &att.path(), mount.as_fd())?;
            volring_volumes::fault::point("node_expand:grown");
        }
        tracing::info!(volume = id, bytes = size, "expanded on the node");
        Ok(NodeExpandVolumeResponse { capacity_bytes: size as i64 })
    }

    pub(crate) fn node_info(&self) -> NodeGetInfoResponse {
        NodeGetInfoResponse {
            node_id: self.base.config.node_id.clone(),
            max_volumes_per_node: self.base.config.max_volumes,
            accessible_topology: Some(self.base.topology()),
        }
    }
}

fn bytes_usage(total: u64, available: u64, used: u64) -> VolumeUsage {
    VolumeUsage { total: total as i64, available: available as i64, used: used as i64, unit: volume_usage::Unit::Bytes as i32 }
}

/// ext4's error count for device `name` (`None` when it has no ext4 mounted).
fn ext4_errors(name: &str) -> Option<u64> {
    std::fs::read_to_string(format!("/sys/fs/ext4/{name}/errors_count")).ok()?.trim().parse().ok()
}

/// Why the filesystem at `root` refuses I/O although it is mounted where it
/// should be, if it does. A filesystem that shut itself down (xfs after a
/// failed metadata write or `xfs_io -x -c shutdown`; ext4 after
/// EXT4_IOC_SHUTDOWN) still answers statfs and /proc/mounts still says
/// `rw`, and xfs has no sysfs counter like ext4's errors_count; but its
/// open(2) fails with EIO for everything, its root directory included
/// (xfs_file_open checks the shutdown flag first). Opening the root afresh
/// through the proven `O_PATH` descriptor asks exactly that, reads nothing
/// and writes nothing.
fn shut_down(root: std::os::fd::BorrowedFd<'_>, path: &Path) -> Option<String> {
    use rustix::fs::{Mode, OFlags};
    match rustix::fs::openat(root, ".", OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC | OFlags::NOFOLLOW, Mode::empty()) {
        Ok(_) => None,
        Err(rustix::io::Errno::IO) => Some(format!("the filesystem at {} has shut down (open: I/O error)", path.display())),
        // Anything else (EACCES under an LSM, EMFILE) says nothing about the
        // filesystem; statfs above already answered.
        Err(_) => None,
    }
}

/// What a condition proved of a volume just now, through a descriptor.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct Proven {
    /// The staging path holds a mount of the volume's own device.
    staging: bool,
    /// The volume's device is attached (a path holds a mount of it).
    device: bool,
    /// The volume's record says it is staged now, no operation in flight:
    /// a verdict that saw a call mid-way ("interrupted") is older than it.
    settled: bool,
}

/// What the reconciler's verdict `h` says is wrong with the volume as a
/// whole — its device, its staging mount, an unfinished operation, a failed
/// repair — leaving out its targets (a question about a target is answered
/// for that target), less what the condition has just proven by
/// descriptor: a verdict is as old as the last mount event the reconciler
/// saw, and a stage that re-mounted the volume a moment ago must not be
/// reported as "staging mount gone" until that event lands.
fn volume_problem_beside(h: &VolumeHealth, proven: Proven) -> Option<String> {
    let stale = |d: &Drift| match d {
        Drift::StagingMissing | Drift::StagingForeign => proven.staging,
        Drift::DeviceDetached => proven.device,
        Drift::TargetMissing { .. } | Drift::TargetForeign { .. } => true,
        Drift::Interrupted { .. } => proven.settled,
    };
    let whole = VolumeHealth {
        drift: h.drift.iter().filter(|d| !stale(d)).cloned().collect(),
        last_repair: None,
        repair_error: h.repair_error.clone(),
    };
    whole.problem()
}

#[cfg(test)]
mod tests {
    use super::*;
    use volring_volumes::StagePhase;

    #[test]
    fn an_interrupted_verdict_is_older_than_a_staged_record() {
        let h = VolumeHealth { drift: vec![Drift::Interrupted { phase: StagePhase::Mounting }], ..Default::default() };
        assert!(volume_problem_beside(&h, Proven::default()).is_some_and(|p| p.contains("interrupted")));
        assert_eq!(volume_problem_beside(&h, Proven { settled: true, ..Default::default() }), None);
    }
}
