//! The CSI node calls for a shared volume that another node holds: the
//! volume is mounted over NFS at the staging path (`volring_share::client`)
//! and bound onto targets from there. Its record lives with the shares in
//! the node's store, apart from the staged records the reconciler repairs:
//! there is no device here to re-attach.

use std::os::fd::AsFd;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use rustix::mount::MountFlags;

use super::base::Base;
use super::fence::Fence;
use super::owned::{path_error, Expect, Found};
use super::proto::*;
use super::share::EndpointLookup;
use super::validate::Access;
use super::{Error, Result};
use volring_mounts::DevNum;
use volring_share::{client, MountRecord, ShareSide};
use volring_volumes::mounting;

/// How long a stats call waits for the NFS server before it reports the
/// volume abnormal (a hard mount whose server is away blocks statfs).
const STATS_WAIT: Duration = Duration::from_secs(5);
/// Statfs probes still blocked on an absent server, at most; beyond that a
/// stats call answers abnormal at once rather than leave another thread.
const MAX_BLOCKED_PROBES: usize = 4;
static BLOCKED_PROBES: AtomicUsize = AtomicUsize::new(0);

/// `NFS_SUPER_MAGIC` (linux/magic.h): what statfs says of an NFS mount,
/// the check that a staging path holds the volume's NFS mount.
const NFS_SUPER_MAGIC: i64 = 0x6969;

fn share_err(e: volring_share::Error) -> Error {
    Error::Internal(e.to_string())
}

fn dev(r: &MountRecord) -> Option<Expect> {
    r.dev.map(|(major, minor)| Expect::Filesystem(DevNum { major, minor }))
}

/// The node's side of shared volumes another node serves: NFS mounts at
/// staging paths and binds of them on targets.
pub(crate) struct NfsClient {
    base: Arc<Base>,
    side: Arc<ShareSide>,
    fence: Arc<Fence>,
    /// How NodeStage finds a shared volume's published endpoint (set by
    /// the agent when it has a cluster).
    endpoint_lookup: OnceLock<EndpointLookup>,
}

impl NfsClient {
    pub(crate) fn new(base: Arc<Base>, side: Arc<ShareSide>, fence: Arc<Fence>) -> Self {
        Self { base, side, fence, endpoint_lookup: OnceLock::new() }
    }

    fn nfs_record(&self, id: &str) -> Result<Option<MountRecord>> {
        self.side.mount_record(id).map_err(share_err)
    }

    /// NodeStage of a shared volume this node does not hold, when its
    /// context names the export; `None` when the stage is not such a one.
    /// A volume in this node's pool that another node holds through the
    /// nbd export (its NFS server moved there, `fence`) is such a one too:
    /// this node's pods reach it over NFS like everyone else's.
    pub(crate) fn stage(
        &self,
        id: &str,
        staging: &Path,
        access: &Access,
        context: &std::collections::HashMap<String, String>,
    ) -> Result<Option<NodeStageVolumeResponse>> {
        let served_elsewhere = matches!(self.fence.holder(id), Some(super::fence::Holder::Remote { .. }));
        if !access.shared() || (self.base.pool.get(id).is_some() && !served_elsewhere) {
            return Ok(None);
        }
        // The nbd export named and no NFS server: this node takes the
        // volume over (a moved share's new server, docs/shared-volumes.md's sequence):
        // staged through the export like any remote volume, then exported.
        if !context.contains_key(volring_share::CTX_SERVER) && context.contains_key(super::nbd_export::CONTEXT_URI) {
            return Ok(None);
        }
        let Some(remote) = client::remote(context).map_err(|e| Error::InvalidArgument(e.to_string()))? else { return Ok(None) };
        // In a cluster: the Service's endpoint, which follows the server.
        let remote = self.published_remote(id, context, remote)?;
        if let Some(r) = self.nfs_record(id)? {
            if r.staging_path != staging {
                return Err(Error::FailedPrecondition(format!("volume {id} is already staged at {}", r.staging_path.display())));
            }
            if r.remote != remote || r.read_only != access.read_only() {
                return Err(Error::AlreadyExists(format!("volume {id} is staged from {} with other options", r.remote)));
            }
            if matches!(self.base.root.look(staging, dev(&r))?, Found::Ours(_)) {
                return Ok(Some(NodeStageVolumeResponse {}));
            }
        }
        // The intent first: an unstage after a crash finds what to undo.
        let mut rec = MountRecord {
            volume_id: id.to_string(),
            staging_path: staging.to_path_buf(),
            remote: remote.clone(),
            read_only: access.read_only(),
            dev: None,
            published: Default::default(),
        };
        self.side.set_mount_record(id, Some(&rec)).map_err(share_err)?;
        let dir = self.base.root.beneath.create_dirs(staging).map_err(|e| path_error(e, staging))?;
        let node = volring_volumes::beneath::stat(dir.as_fd()).map_err(|e| Error::Internal(format!("statx {}: {e}", staging.display())))?;
        if node.mount_root {
            return Err(Error::FailedPrecondition(format!("{} already holds a mount; volring does not stage over it", staging.display())));
        }
        let source = remote.to_string();
        mounting::mount_filesystem(Path::new(&source), dir.as_fd(), "nfs4", &remote.options(access.read_only()))
            .map_err(|e| Error::Internal(format!("mount {source} (NFSv4) on {}: {e}", staging.display())))?;
        drop(dir);
        let mounted = self
            .base
            .root
            .beneath
            .open_path(staging)
            .map_err(|e| path_error(e, staging))?
            .ok_or_else(|| Error::Internal("staging path vanished".into()))?;
        let node =
            volring_volumes::beneath::stat(mounted.as_fd()).map_err(|e| Error::Internal(format!("statx {}: {e}", staging.display())))?;
        rec.dev = Some((node.dev.major, node.dev.minor));
        self.side.set_mount_record(id, Some(&rec)).map_err(share_err)?;
        tracing::info!(volume = id, source, path = %staging.display(), "staged over NFS");
        Ok(Some(NodeStageVolumeResponse {}))
    }

    /// NodeUnstage of a volume mounted over NFS; `None` when it is not one.
    pub(crate) fn unstage(&self, id: &str, staging: &Path) -> Result<Option<NodeUnstageVolumeResponse>> {
        let Some(r) = self.nfs_record(id)? else { return Ok(None) };
        if r.staging_path != staging {
            return Err(Error::NotFound(format!("volume {id} is not staged at {}", staging.display())));
        }
        for t in r.published.keys() {
            if matches!(self.base.root.look(t, dev(&r))?, Found::Ours(_)) {
                return Err(Error::FailedPrecondition(format!("volume {id} is still published at {}", t.display())));
            }
        }
        if r.dev.is_some() {
            self.base.root.unmount_ours(id, staging, dev(&r))?;
        } else if let Found::Foreign(_) = self.base.root.look(staging, None)? {
            // A crash between the mount and recording its device: the NFS
            // mount at the staging path is this stage's own.
            self.unmount_if_nfs(id, staging)?;
        }
        self.side.set_mount_record(id, None).map_err(share_err)?;
        tracing::info!(volume = id, "unstaged (NFS)");
        Ok(Some(NodeUnstageVolumeResponse {}))
    }

    fn unmount_if_nfs(&self, id: &str, p: &Path) -> Result<()> {
        let Some(fd) = self.base.root.beneath.open_path(p).map_err(|e| path_error(e, p))? else { return Ok(()) };
        let st = rustix::fs::fstatfs(&fd).map_err(|e| Error::Internal(format!("statfs {}: {e}", p.display())))?;
        if st.f_type != NFS_SUPER_MAGIC {
            return Err(Error::FailedPrecondition(format!("{} holds a mount that is not volume {id}'s NFS mount", p.display())));
        }
        let node = volring_volumes::beneath::stat(fd.as_fd()).map_err(|e| Error::Internal(format!("statx {}: {e}", p.display())))?;
        drop(fd);
        self.base.root.unmount_ours(id, p, Some(Expect::Filesystem(node.dev)))
    }

    /// NodePublish of a volume mounted over NFS: its staging mount bound
    /// onto the target. `None` when it is not one.
    pub(crate) fn publish(&self, id: &str, staging: &Path, target: &Path, read_only: bool) -> Result<Option<NodePublishVolumeResponse>> {
        let Some(mut r) = self.nfs_record(id)? else { return Ok(None) };
        let not_staged = || Error::FailedPrecondition(format!("volume {id} is not staged at {}", staging.display()));
        if r.staging_path != staging || r.dev.is_none() {
            return Err(not_staged());
        }
        if target == staging || target.starts_with(staging) || staging.starts_with(target) {
            return Err(Error::InvalidArgument("target_path and staging_target_path overlap".into()));
        }
        let expect = dev(&r);
        let Found::Ours(source) = self.base.root.look(staging, expect)? else { return Err(not_staged()) };
        let read_only = read_only || r.read_only;
        let fd = self.base.root.beneath.create_dirs(target).map_err(|e| path_error(e, target))?;
        let node = volring_volumes::beneath::stat(fd.as_fd()).map_err(|e| Error::Internal(format!("statx {}: {e}", target.display())))?;
        if node.mount_root {
            return match r.published.get(target) {
                Some(&was) if expect.is_some_and(|x| x.holds(&node)) && was == read_only => Ok(Some(NodePublishVolumeResponse {})),
                _ => Err(Error::AlreadyExists(format!("something else is mounted at {}", target.display()))),
            };
        }
        r.published.insert(target.to_path_buf(), read_only);
        self.side.set_mount_record(id, Some(&r)).map_err(share_err)?;
        let flags = if read_only { MountFlags::RDONLY } else { MountFlags::empty() };
        mounting::bind(source.as_fd(), fd.as_fd(), flags).map_err(|e| Error::Internal(format!("bind on {}: {e}", target.display())))?;
        tracing::info!(volume = id, target = %target.display(), read_only, "published (NFS)");
        Ok(Some(NodePublishVolumeResponse {}))
    }

    /// NodeUnpublish of a volume mounted over NFS; `None` when it is not one.
    pub(crate) fn unpublish(&self, id: &str, target: &Path) -> Result<Option<NodeUnpublishVolumeResponse>> {
        let Some(mut r) = self.nfs_record(id)? else { return Ok(None) };
        if !r.published.contains_key(target) {
            return match self.base.root.look(target, None)? {
                Found::Missing | Found::Unmounted => Ok(Some(NodeUnpublishVolumeResponse {})),
                _ => Err(Error::NotFound(format!("volume {id} is not published at {}", target.display()))),
            };
        }
        self.base.root.unmount_ours(id, target, dev(&r))?;
        self.base.root.beneath.remove(target).map_err(|e| Error::Internal(format!("remove {}: {e}", target.display())))?;
        r.published.remove(target);
        self.side.set_mount_record(id, Some(&r)).map_err(share_err)?;
        Ok(Some(NodeUnpublishVolumeResponse {}))
    }

    /// NodeGetVolumeStats of a volume mounted over NFS: the export's usage,
    /// and abnormal when the path is not the NFS mount or the server does
    /// not answer in time. `None` when it is not one.
    pub(crate) fn stats(&self, id: &str, volume_path: &str) -> Result<Option<NodeGetVolumeStatsResponse>> {
        let Some(r) = self.nfs_record(id)? else { return Ok(None) };
        let path = self.base.stats_path(id, volume_path)?;
        let path = path.as_path();
        if r.staging_path != path && !r.published.contains_key(path) {
            return Err(Error::NotFound(format!("volume {id} is not at {}", path.display())));
        }
        let mut usage = Vec::new();
        let problem = match probe(path.to_path_buf()) {
            Err(why) => Some(why),
            Ok(s) if s.f_type != NFS_SUPER_MAGIC => Some(format!("{} is not the volume's NFS mount", path.display())),
            Ok(s) => {
                let f = s.frsize;
                usage.push(VolumeUsage {
                    total: (s.blocks * f) as i64,
                    available: (s.bavail * f) as i64,
                    used: (s.blocks.saturating_sub(s.bfree) * f) as i64,
                    unit: volume_usage::Unit::Bytes as i32,
                });
                usage.push(VolumeUsage {
                    total: s.files as i64,
                    available: s.ffree as i64,
                    used: s.files.saturating_sub(s.ffree) as i64,
                    unit: volume_usage::Unit::Inodes as i32,
                });
                None
            }
        };
        let message = match &problem {
            Some(p) => format!("{p} (NFS from {})", r.remote),
            None => format!("mounted over NFS from {}", r.remote),
        };
        Ok(Some(NodeGetVolumeStatsResponse { usage, volume_condition: Some(VolumeCondition { abnormal: problem.is_some(), message }) }))
    }

    /// Sets how NodeStage of a shared volume another node holds finds the
    /// endpoint published on its PVC (in a cluster; without one the
    /// context's `nfsServer` is mounted).
    pub(crate) fn set_endpoint_lookup(&self, f: EndpointLookup) {
        let _ = self.endpoint_lookup.set(f);
    }

    /// The server a shared volume's NodeStage mounts: the endpoint
    /// published on the PVC the context names, when this node can read
    /// it; else the context's own (`remote`). Published but not yet:
    /// UNAVAILABLE, and kubelet retries.
    fn published_remote(
        &self,
        id: &str,
        context: &std::collections::HashMap<String, String>,
        mut remote: volring_share::client::Remote,
    ) -> Result<volring_share::client::Remote> {
        let (Some(lookup), Some((ns, name))) = (self.endpoint_lookup.get(), volring_share::pvc_in_context(context)) else {
            return Ok(remote);
        };
        let endpoint = lookup(id, &ns, &name)
            .map_err(|e| Error::Unavailable(format!("volume {id}: reading the NFS endpoint of PVC {ns}/{name}: {e}")))?
            .ok_or_else(|| {
                Error::Unavailable(format!("volume {id}: the owning node has not published the NFS endpoint on PVC {ns}/{name} yet"))
            })?;
        remote.server = endpoint.parse().map_err(|_| {
            Error::FailedPrecondition(format!("volume {id}: PVC {ns}/{name} names the NFS endpoint {endpoint:?}, not address:port"))
        })?;
        Ok(remote)
    }
}

struct Probe {
    f_type: i64,
    frsize: u64,
    blocks: u64,
    bfree: u64,
    bavail: u64,
    files: u64,
    ffree: u64,
}

/// statfs of `path` on a thread, waited for at most [`STATS_WAIT`].
fn probe(path: PathBuf) -> std::result::Result<Probe, String> {
    if BLOCKED_PROBES.load(Ordering::Acquire) >= MAX_BLOCKED_PROBES {
        return Err("earlier statfs calls are still waiting for the NFS server".into());
    }
    BLOCKED_PROBES.fetch_add(1, Ordering::AcqRel);
    let (tx, rx) = std::sync::mpsc::channel();
    let shown = path.display().to_string();
    let spawned = std::thread::Builder::new().name("nfs-statfs".into()).spawn(move || {
        let r = rustix::fs::statfs(&path).and_then(|t| rustix::fs::statvfs(&path).map(|v| (t, v)));
        BLOCKED_PROBES.fetch_sub(1, Ordering::AcqRel);
        let _ = tx.send(r);
    });
    if let Err(e) = spawned {
        BLOCKED_PROBES.fetch_sub(1, Ordering::AcqRel);
        return Err(format!("statfs thread: {e}"));
    }
    match rx.recv_timeout(STATS_WAIT) {
        Ok(Ok((t, v))) => Ok(Probe {
            f_type: t.f_type,
            frsize: v.f_frsize,
            blocks: v.f_blocks,
            bfree: v.f_bfree,
            bavail: v.f_bavail,
            files: v.f_files,
            ffree: v.f_ffree,
        }),
        Ok(Err(e)) => Err(format!("statfs {shown}: {e}")),
        Err(_) => Err(format!("the NFS server did not answer statfs of {shown} within {} s", STATS_WAIT.as_secs())),
    }
}
