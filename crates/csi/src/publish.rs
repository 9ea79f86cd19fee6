//! Node service, publish and unpublish: the staged volume bound onto a pod's
//! target, and taken off it again — only ever the volume's own mount.

use std::os::fd::{AsFd, OwnedFd};
use std::path::Path;

use rustix::mount::MountFlags;

use super::owned::{path_error, Expect, Found};
use super::proto::*;
use super::validate::{self, Access, AccessType};
use std::sync::Arc;

use super::base::Base;
use super::share::Shares;
use super::share_client::NfsClient;
use super::{Error, Result};
use volring_volumes::beneath::Node;
use volring_volumes::{attach, mounting, AccessKind, StagePhase, StagedVolume};

/// Node service, publish and unpublish.
pub(crate) struct Publisher {
    base: Arc<Base>,
    shares: Arc<Shares>,
    nfs: Arc<NfsClient>,
}

impl Publisher {
    pub(crate) fn new(base: Arc<Base>, shares: Arc<Shares>, nfs: Arc<NfsClient>) -> Self {
        Self { base, shares, nfs }
    }

    pub(crate) fn node_publish(&self, req: NodePublishVolumeRequest) -> Result<NodePublishVolumeResponse> {
        validate::volume_id(&req.volume_id)?;
        let staging = self.base.path(&req.staging_target_path, "staging_target_path")?;
        let target = self.base.path(&req.target_path, "target_path")?;
        let access = validate::capability(req.volume_capability.as_ref())?;
        let id = req.volume_id.as_str();
        let _guard = self.base.lock(id)?;
        if let Some(done) = self.nfs.publish(id, &staging, &target, req.readonly || access.read_only())? {
            return Ok(done);
        }
        // A remote volume is known here by its staged record only.
        if self.base.pool.get(id).is_none() && !self.base.records.contains(id) {
            return Err(Error::NotFound(format!("volume {id} does not exist")));
        }
        // As at the stage, by the pool's record (a volume another node
        // holds was checked against its context when it was staged).
        self.shares.created_for(id, &access, None)?;
        let (mut rec, expect, source) = self.staged_source(id, &staging, &target, &access)?;
        let read_only = req.readonly || access.read_only() || rec.read_only;
        // Intent first: the target is recorded before it is made, so after a
        // crash from here on unpublish finds the record and removes the
        // target this call made (the spec asks the SP to delete what it
        // created there). A call that fails before binding takes it back.
        let prior = rec.published.get(&target).copied();
        if prior.is_none() {
            rec.published.insert(target.clone(), read_only);
            self.base.records.put(&rec)?;
        }
        let forget = |rec: &mut StagedVolume| {
            if prior.is_none() {
                rec.published.remove(&target);
                if let Err(e) = self.base.records.put(rec) {
                    tracing::error!(volume = id, error = %e, "could not take back a publish intent");
                }
            }
        };
        let (target_fd, node) = match self.make_target(&rec.access, &target) {
            Ok(m) => m,
            Err(e) => {
                forget(&mut rec);
                return Err(e);
            }
        };
        volring_volumes::fault::point("publish:target");
        if node.mount_root {
            let answer = match prior {
                Some(was) if expect.holds(&node) && was == read_only => return Ok(NodePublishVolumeResponse {}),
                Some(was) if expect.holds(&node) => format!("volume {id} is published at {} with readonly={was}", target.display()),
                _ => format!("something else is mounted at {}", target.display()),
            };
            forget(&mut rec);
            return Err(Error::AlreadyExists(answer));
        }
        if prior.is_some_and(|was| was != read_only) {
            rec.published.insert(target.clone(), read_only);
            self.base.records.put(&rec)?;
        }
        volring_volumes::fault::point("publish:bind");
        let flags = match &access.access {
            AccessType::Mount { options, .. } => options.per_mount(),
            AccessType::Block => MountFlags::empty(),
        } | if read_only { MountFlags::RDONLY } else { MountFlags::empty() };
        if let Err(e) = mounting::bind(source.as_fd(), target_fd.as_fd(), flags) {
            rec.published.remove(&target);
            let _ = self.base.records.put(&rec);
            return Err(Error::Internal(format!("bind on {}: {e}", target.display())));
        }
        volring_volumes::fault::point("publish:bound");
        tracing::info!(volume = id, target = %target.display(), read_only, "published");
        Ok(NodePublishVolumeResponse {})
    }

    /// The volume's staged record, what its mounts must be, and its own
    /// staging mount (proven so on the descriptor the bind is made from),
    /// after the checks a publish to `target` needs: staged at `staging`
    /// for the same kind of access, and no overlap between the two paths.
    fn staged_source(&self, id: &str, staging: &Path, target: &Path, access: &Access) -> Result<(StagedVolume, Expect, OwnedFd)> {
        let not_staged = || Error::FailedPrecondition(format!("volume {id} is not staged at {}", staging.display()));
        let rec =
            self.base.records.get(id).filter(|r| r.phase == StagePhase::Staged && r.staging_path == staging).ok_or_else(not_staged)?;
        if access.is_mount() != matches!(rec.access, AccessKind::Mount { .. }) {
            return Err(Error::FailedPrecondition(format!("volume {id} was staged for {} access", kind_name(&rec.access))));
        }
        if target == staging || target.starts_with(staging) || staging.starts_with(target) {
            return Err(Error::InvalidArgument("target_path and staging_target_path overlap".into()));
        }
        let att = attach::of_record(&rec).ok_or_else(not_staged)?;
        let expect = Expect::of(&rec, &att);
        match self.base.root.look(&rec.staged_at(), Some(expect))? {
            Found::Ours(fd) => Ok((rec, expect, fd)),
            _ => Err(Error::FailedPrecondition(format!("volume {id} is no longer mounted at {}; stage it again", staging.display()))),
        }
    }

    /// Creates the publish target beneath the kubelet root (a directory for
    /// a mount, a file for a block device) and states it on its descriptor.
    fn make_target(&self, access: &AccessKind, target: &Path) -> Result<(OwnedFd, Node)> {
        let fd = match access {
            AccessKind::Mount { .. } => self.base.root.beneath.create_dirs(target),
            AccessKind::Block => self.base.root.beneath.create_file(target),
        }
        .map_err(|e| path_error(e, target))?;
        let node = volring_volumes::beneath::stat(fd.as_fd()).map_err(|e| Error::Internal(format!("statx {}: {e}", target.display())))?;
        Ok((fd, node))
    }

    /// Takes the volume's own mounts off a target it was published at, then
    /// the target itself. A path the volume was never published at is not
    /// touched: NotFound when something is mounted there (another volume's
    /// target), OK when nothing is (a repeated call).
    pub(crate) fn node_unpublish(&self, req: NodeUnpublishVolumeRequest) -> Result<NodeUnpublishVolumeResponse> {
        validate::volume_id(&req.volume_id)?;
        let target = self.base.path(&req.target_path, "target_path")?;
        let id = req.volume_id.as_str();
        let _guard = self.base.lock(id)?;
        if let Some(done) = self.nfs.unpublish(id, &target)? {
            return Ok(done);
        }
        let rec = self.base.records.get(id);
        if rec.is_none() && self.base.pool.get(id).is_none() {
            return Err(Error::NotFound(format!("volume {id} does not exist")));
        }
        let Some(mut rec) = rec.filter(|r| r.published.contains_key(&target)) else {
            return match self.base.root.look(&target, None)? {
                Found::Missing | Found::Unmounted => Ok(NodeUnpublishVolumeResponse {}),
                Found::Ours(_) | Found::Foreign(_) => Err(Error::NotFound(format!("volume {id} is not published at {}", target.display()))),
            };
        };
        let expect = attach::of_record(&rec).map(|a| Expect::of(&rec, &a));
        self.base.root.unmount_ours(id, &target, expect)?;
        volring_volumes::fault::point("unpublish:unmounted");
        self.base.root.beneath.remove(&target).map_err(|e| Error::Internal(format!("remove {}: {e}", target.display())))?;
        volring_volumes::fault::point("unpublish:removed");
        rec.published.remove(&target);
        self.base.records.put(&rec)?;
        volring_volumes::fault::point("unpublish:done");
        tracing::info!(volume = id, target = %target.display(), "unpublished");
        Ok(NodeUnpublishVolumeResponse {})
    }
}

fn kind_name(k: &AccessKind) -> &'static str {
    match k {
        AccessKind::Block => "block",
        AccessKind::Mount { .. } => "mount",
    }
}
