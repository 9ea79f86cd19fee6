//! Node service, stage and unstage: attach, format, mount — and the reverse —
//! each idempotent, recorded before it acts, and undone on failure.
//!
//! Every path is resolved once beneath the kubelet root and acted on through
//! its descriptor, and a mount found at a path is acted on only when it is
//! the volume's own device (`owned`). Publish lives in `publish`, stats and
//! expansion in `node_stats`.

use std::os::fd::{AsFd, OwnedFd};
use std::path::Path;

use rustix::mount::MountFlags;

use super::owned::{path_error, Expect, Found};
use super::proto::volume_capability::AccessType as ProtoAccessType;
use super::proto::*;
use super::validate::{self, Access, AccessType};
use std::sync::Arc;

use super::base::Base;
use super::fence::Fence;
use super::nbd::NbdSide;
use super::share::Shares;
use super::share_client::NfsClient;
use super::{Error, Result};
use volring_volumes::attach::{self, Attachment};
use volring_volumes::filesystem::{self, Content, FsKind};
use volring_volumes::{mounting, AccessKind, AttachKind, RemoteExport, StagePhase, StagedVolume};

/// Node service, stage and unstage; the reconciler's repairs come
/// through here too.
pub(crate) struct Stager {
    pub(crate) base: Arc<Base>,
    nbd: Arc<NbdSide>,
    fence: Arc<Fence>,
    pub(crate) shares: Arc<Shares>,
    nfs: Arc<NfsClient>,
}

impl Stager {
    pub(crate) fn new(base: Arc<Base>, nbd: Arc<NbdSide>, fence: Arc<Fence>, shares: Arc<Shares>, nfs: Arc<NfsClient>) -> Self {
        Self { base, nbd, fence, shares, nfs }
    }

    pub(crate) fn node_stage(&self, req: NodeStageVolumeRequest) -> Result<NodeStageVolumeResponse> {
        validate::volume_id(&req.volume_id)?;
        let staging = self.base.path(&req.staging_target_path, "staging_target_path")?;
        let access = validate::capability(req.volume_capability.as_ref())?;
        let id = req.volume_id.as_str();
        let _guard = self.base.lock(id)?;
        // By the pool's record, before the share paths (an RWX stage is
        // exported, or mounted over NFS when another node serves it).
        self.shares.created_for(id, &access, None)?;
        // A shared volume another node holds: mounted over NFS.
        if let Some(done) = self.nfs.stage(id, &staging, &access, &req.volume_context)? {
            return Ok(done);
        }
        // A volume this node holds is attached here (even when it is also
        // exported); one it does not hold, through the export its context
        // names.
        let meta = self.base.pool.get(id);
        let remote = match meta {
            Some(_) => None,
            None => Some(
                super::nbd_export::remote_from_context(id, &req.volume_context)?
                    .ok_or_else(|| Error::NotFound(format!("volume {id} does not exist")))?,
            ),
        };
        // One another node holds, by its context (after NotFound).
        if meta.is_none() {
            self.shares.created_for(id, &access, Some(&req.volume_context))?;
        }
        let requested_fs = requested_fs(&req, meta.as_ref());
        let kind = match &meta {
            Some(m) => attach_kind(&req.volume_context, &m.parameters)?,
            None => AttachKind::Nbd,
        };
        let prior = self.base.records.get(id);
        if let Some(r) = &prior {
            if r.staging_path != staging {
                return Err(Error::FailedPrecondition(format!("volume {id} is already staged at {}", r.staging_path.display())));
            }
            if !same_access(r, &access) {
                return Err(Error::AlreadyExists(format!("volume {id} is staged at {} with another capability", staging.display())));
            }
            if r.phase == StagePhase::Staged && self.base.stage_intact(r)? {
                self.shares.export_if_shared(id, &access, Some(&req.volume_context))?;
                return Ok(NodeStageVolumeResponse {});
            }
            tracing::warn!(volume = id, phase = ?r.phase, "completing an interrupted or damaged stage");
        }
        let rec = prior.clone().unwrap_or_else(|| self.new_record(id, &staging, &access, requested_fs.as_deref(), kind, remote));
        // A volume this node exports is staged here only while no other
        // node holds it through the export (`fence`); the holder is taken
        // before the record is first written and dropped again if the
        // stage leaves no record.
        let fenced = meta.as_ref().is_some_and(|m| m.nbd_secret.is_some());
        if fenced {
            self.fence.take_local(id)?;
        }
        let staged = self.stage_locked(rec, prior.as_ref(), &access, requested_fs.as_deref());
        if staged.is_err() && fenced && !self.base.records.contains(id) {
            if let Err(e) = self.fence.drop_local(id) {
                tracing::error!(volume = id, error = %e, "cannot drop the local holder of a stage that failed");
            }
        }
        staged?;
        // Exported from here though another node holds the pool record:
        // this node's Service loop needs the PVC the context names.
        if meta.is_none() && access.shared() && access.is_mount() && self.shares.side().enabled() {
            if let Some(pvc) = volring_share::pvc_in_context(&req.volume_context) {
                volring_share::record_pvc(self.base.records.store(), id, Some(&pvc))
                    .map_err(|e| Error::Internal(format!("record the PVC of volume {id}: {e}")))?;
            }
        }
        self.shares.export_if_shared(id, &access, Some(&req.volume_context))?;
        Ok(NodeStageVolumeResponse {})
    }

    /// The record a first stage of volume `id` starts from: nothing
    /// attached yet, nothing published.
    fn new_record(
        &self,
        id: &str,
        staging: &Path,
        access: &Access,
        requested_fs: Option<&str>,
        kind: AttachKind,
        remote: Option<RemoteExport>,
    ) -> StagedVolume {
        StagedVolume {
            volume_id: id.to_string(),
            image: self.base.pool.image_path(id),
            staging_path: staging.to_path_buf(),
            access: match &access.access {
                AccessType::Block => AccessKind::Block,
                AccessType::Mount { flags, .. } => {
                    AccessKind::Mount { fs_type: requested_fs.unwrap_or_default().to_string(), flags: flags.clone() }
                }
            },
            read_only: access.read_only(),
            phase: StagePhase::Attaching,
            loop_number: None,
            attach: kind,
            nbd_index: None,
            published: Default::default(),
            remote,
        }
    }

    /// Stages `rec` (the caller holds the volume's lock): the steps, and on
    /// failure their undoing and the record put back as it was (`prior`).
    /// The reconciler's repairs come through here too.
    pub(crate) fn stage_locked(
        &self,
        mut rec: StagedVolume,
        prior: Option<&StagedVolume>,
        access: &Access,
        requested_fs: Option<&str>,
    ) -> Result<()> {
        let id = rec.volume_id.clone();
        let mut undo = Rollback::default();
        let result = self.stage_steps(&mut rec, access, requested_fs, &mut undo);
        if let Err(e) = result {
            undo.run(self);
            let restored = match prior {
                // A stage that got as far as its own mkfs keeps that intent,
                // device released: the retry formats again rather than find
                // a half-written filesystem it may not touch.
                _ if rec.phase == StagePhase::Formatting => {
                    rec.loop_number = None;
                    rec.nbd_index = None;
                    self.base.records.put(&rec)
                }
                Some(p) => self.base.records.put(p),
                None => self.base.records.remove(&id),
            };
            if let Err(r) = restored {
                tracing::error!(volume = %id, error = %r, "could not roll back the staged record");
            }
            return Err(e);
        }
        tracing::info!(volume = %id, attach = rec.attach.to_string().as_str(), loop_device = ?rec.loop_number, nbd_device = ?rec.nbd_index, path = %rec.staging_path.display(), "staged");
        Ok(())
    }

    /// The stage proper. Each step records its intent first, so a crash at
    /// any point leaves a record saying what may need undoing or finishing.
    fn stage_steps(&self, rec: &mut StagedVolume, access: &Access, requested_fs: Option<&str>, undo: &mut Rollback) -> Result<()> {
        // A record with no device number is a stage that crashed mid-attach
        // (or failed in its mkfs): the device it may have made is found by
        // its image (a scan of every loop device, so only in that case).
        // The same when the volume's earlier record was quarantined: its
        // device may still be attached and mounted, and a second read-write
        // device on one image would corrupt it.
        let leftover = rec.phase != StagePhase::Staged
            && rec.loop_number.is_none()
            && rec.nbd_index.is_none()
            && self.base.records.knows(&rec.volume_id);
        // An owed mkfs stays owed until it has run.
        if rec.phase != StagePhase::Formatting {
            rec.phase = StagePhase::Attaching;
        }
        self.base.records.put(rec)?;
        volring_volumes::fault::point("stage:attach");
        let att = match rec.attach {
            AttachKind::Loop => self.loop_device(rec, leftover, undo)?,
            AttachKind::Nbd => self.nbd_device(rec, leftover, undo)?,
        };
        match att.kind {
            AttachKind::Loop => rec.loop_number = Some(att.number),
            AttachKind::Nbd => rec.nbd_index = Some(att.number),
        }
        self.base.records.put(rec)?;
        volring_volumes::fault::point("stage:attached");
        let at = rec.staged_at();
        match &access.access {
            AccessType::Mount { options, .. } => {
                let dir = self.base.root.beneath.create_dirs(&at).map_err(|e| path_error(e, &at))?;
                volring_volumes::fault::point("stage:path");
                if !self.holds_own_mount(rec, &at, Expect::Filesystem(att.dev), &dir)? {
                    let fs = self.ensure_filesystem(rec, &att, requested_fs)?;
                    rec.access = AccessKind::Mount { fs_type: fs.to_string(), flags: access_flags(access) };
                    rec.phase = StagePhase::Mounting;
                    self.base.records.put(rec)?;
                    volring_volumes::fault::point("stage:mount");
                    let options = if fs == "xfs" { options.clone().with_data("nouuid") } else { options.clone() };
                    volring_volumes::fault::pause("stage:premount");
                    self.still_unmounted(rec, &at, &dir)?;
                    mounting::mount_filesystem(&att.path(), dir.as_fd(), &fs, &options)
                        .map_err(|e| Error::Internal(format!("mount {} on {}: {e}", att.path().display(), at.display())))?;
                    undo.push(Undo::Unmount(at.clone(), Expect::Filesystem(att.dev)));
                    volring_volumes::fault::point("stage:mounted");
                }
            }
            AccessType::Block => {
                rec.phase = StagePhase::Mounting;
                self.base.records.put(rec)?;
                let file = self.base.root.beneath.create_file(&at).map_err(|e| path_error(e, &at))?;
                volring_volumes::fault::point("stage:path");
                if !self.holds_own_mount(rec, &at, Expect::Device(att.dev), &file)? {
                    let flags = if rec.read_only { MountFlags::RDONLY } else { MountFlags::empty() };
                    let device =
                        rustix::fs::open(att.path(), rustix::fs::OFlags::PATH | rustix::fs::OFlags::CLOEXEC, rustix::fs::Mode::empty())
                            .map_err(|e| Error::Internal(format!("open {}: {e}", att.path().display())))?;
                    volring_volumes::fault::point("stage:mount");
                    volring_volumes::fault::pause("stage:premount");
                    self.still_unmounted(rec, &at, &file)?;
                    mounting::bind(device.as_fd(), file.as_fd(), flags)
                        .map_err(|e| Error::Internal(format!("bind {} on {}: {e}", att.path().display(), at.display())))?;
                    undo.push(Undo::Unmount(at.clone(), Expect::Device(att.dev)));
                    volring_volumes::fault::point("stage:mounted");
                }
            }
        }
        rec.phase = StagePhase::Staged;
        self.base.records.put(rec)?;
        volring_volumes::fault::point("stage:staged");
        Ok(())
    }

    /// Whether `at` (opened as `fd`) already holds the volume's own mount.
    /// Anything else mounted there — another volume, a tenant's filesystem —
    /// fails the stage: the volume is never reported staged on a mount that
    /// is not its own, and that mount is not touched.
    fn holds_own_mount(&self, rec: &StagedVolume, at: &Path, expect: Expect, fd: &OwnedFd) -> Result<bool> {
        let node = volring_volumes::beneath::stat(fd.as_fd()).map_err(|e| Error::Internal(format!("statx {}: {e}", at.display())))?;
        if !node.mount_root {
            return Ok(false);
        }
        if expect.holds(&node) {
            return Ok(true);
        }
        Err(Error::FailedPrecondition(format!(
            "{} already holds a mount of device {} that is not volume {}'s; volring does not stage over it",
            at.display(),
            node.dev,
            rec.volume_id
        )))
    }

    /// Proves again, right before mounting, that the path still is what
    /// `fd` was opened on and judged empty: opened afresh beneath the
    /// kubelet root, it must be the same unmounted entry (same filesystem,
    /// same mount). A mount made there since (a tenant's, another agent's)
    /// stops the stage: volring never mounts over it. The mount itself
    /// then checks where it landed (`mounting`), for the last instant.
    fn still_unmounted(&self, rec: &StagedVolume, at: &Path, fd: &OwnedFd) -> Result<()> {
        let stat =
            |fd: &OwnedFd| volring_volumes::beneath::stat(fd.as_fd()).map_err(|e| Error::Internal(format!("statx {}: {e}", at.display())));
        let held = stat(fd)?;
        let now = match self.base.root.beneath.open_path(at).map_err(|e| path_error(e, at))? {
            Some(f) => Some(stat(&f)?),
            None => None,
        };
        match now {
            Some(n) if !n.mount_root && n.mnt_id == held.mnt_id && n.dev == held.dev => Ok(()),
            Some(n) => Err(Error::FailedPrecondition(format!(
                "something was mounted there while volring was about to mount volume {} on {} (device {} now); not mounting over it",
                rec.volume_id,
                at.display(),
                n.dev
            ))),
            None => Err(Error::FailedPrecondition(format!(
                "{} went away while volring was about to mount volume {} there",
                at.display(),
                rec.volume_id
            ))),
        }
    }

    /// Finds the filesystem to mount, formatting a blank device. Never
    /// formats over anything that is not all zeros — except what the agent's
    /// own interrupted mkfs left, which the `Formatting` intent vouches for.
    fn ensure_filesystem(&self, rec: &mut StagedVolume, att: &Attachment, requested: Option<&str>) -> Result<String> {
        let content = filesystem::probe_device(&att.path())?;
        let owed = rec.phase == StagePhase::Formatting;
        match content {
            Content::Filesystem(found) if !owed => match requested {
                Some(want) if want != found => {
                    Err(Error::FailedPrecondition(format!("the volume holds {found}; {want} was requested and volring does not reformat")))
                }
                _ => Ok(found.to_string()),
            },
            Content::Other(what) if !owed => Err(Error::FailedPrecondition(format!("the volume holds {what}; refusing to format it"))),
            _ if rec.read_only => Err(Error::FailedPrecondition("the volume is blank and the stage is read-only".into())),
            _ => {
                let kind =
                    requested.unwrap_or("").parse::<FsKind>().map_err(|()| Error::InvalidArgument(format!("fs_type {requested:?}")))?;
                if owed {
                    tracing::warn!(volume = %rec.volume_id, "an earlier mkfs of this volume did not finish; formatting again");
                }
                rec.phase = StagePhase::Formatting;
                self.base.records.put(rec)?;
                volring_volumes::fault::point("stage:mkfs");
                filesystem::format(kind, &att.path())?;
                volring_volumes::fault::point("stage:formatted");
                tracing::info!(device = %att.path().display(), fs = kind.to_string().as_str(), "formatted");
                Ok(kind.to_string())
            }
        }
    }

    pub(crate) fn node_unstage(&self, req: NodeUnstageVolumeRequest) -> Result<NodeUnstageVolumeResponse> {
        validate::volume_id(&req.volume_id)?;
        let staging = self.base.path(&req.staging_target_path, "staging_target_path")?;
        let id = req.volume_id.as_str();
        let _guard = self.base.lock(id)?;
        if let Some(done) = self.nfs.unstage(id, &staging)? {
            return Ok(done);
        }
        let Some(mut rec) = self.base.records.get(id) else {
            if self.base.pool.get(id).is_none() {
                return Err(Error::NotFound(format!("volume {id} does not exist")));
            }
            // No record (quarantined, or a store lost and not rebuilt for
            // it): the kernel still decides. OK only once nothing of the
            // volume is mounted at the staging path or attached.
            self.unstage_without_record(id, &staging)?;
            return Ok(NodeUnstageVolumeResponse {});
        };
        if rec.staging_path != staging {
            return Err(Error::NotFound(format!("volume {id} is not staged at {}", staging.display())));
        }
        let att = attach::of_record(&rec);
        let expect = att.map(|a| Expect::of(&rec, &a));
        // A target still counts while the volume's own mount is on it.
        let mut still = None;
        for t in rec.published.keys() {
            if matches!(self.base.root.look(t, expect)?, Found::Ours(_)) {
                still = Some(t.clone());
                break;
            }
        }
        if let Some(t) = still {
            return Err(Error::FailedPrecondition(format!("volume {id} is still published at {}", t.display())));
        }
        // The intent: a restarted agent finishes this unstage.
        rec.published.clear();
        rec.phase = StagePhase::Unstaging;
        self.base.records.put(&rec)?;
        volring_volumes::fault::point("unstage:intent");
        self.finish_unstage(&rec)?;
        Ok(NodeUnstageVolumeResponse {})
    }

    /// Takes a volume down whose record says `Unstaging` (the caller holds
    /// its lock): its own mount off the staging path, its device detached,
    /// its record removed — each step a no-op when already done.
    pub(crate) fn finish_unstage(&self, rec: &StagedVolume) -> Result<()> {
        let id = rec.volume_id.as_str();
        self.shares.unexport(id)?;
        let att = attach::of_record(rec);
        let expect = att.map(|a| Expect::of(rec, &a));
        let at = rec.staged_at();
        self.base.root.unmount_ours(id, &at, expect)?;
        volring_volumes::fault::point("unstage:unmounted");
        if matches!(rec.access, AccessKind::Block) {
            self.base.root.beneath.remove(&at).map_err(|e| Error::Internal(format!("remove {}: {e}", at.display())))?;
        }
        volring_volumes::fault::point("unstage:removed");
        match (rec.attach, rec.loop_number, rec.nbd_index) {
            (AttachKind::Loop, Some(n), _) => attach::detach(n, &rec.image)?,
            // A crash between attaching and recording the number leaves a
            // device only the image path can find.
            (AttachKind::Loop, None, _) => {
                for a in attach::serving(AttachKind::Loop, &rec.image, id) {
                    attach::detach(a.number, &rec.image)?;
                }
            }
            (AttachKind::Nbd, _, Some(n)) => self.nbd.detach(n, id)?,
            // The same for nbd: such a device carries the volume id.
            (AttachKind::Nbd, _, None) => {
                for a in attach::serving(AttachKind::Nbd, &rec.image, id) {
                    self.nbd.detach(a.number, id)?;
                }
            }
        }
        volring_volumes::fault::point("unstage:detached");
        self.base.records.remove(id)?;
        volring_volumes::fault::point("unstage:done");
        // Other nodes may have it now (a crash before this: the start walk
        // drops a local holder without a record).
        self.fence.drop_local(id)?;
        if rec.remote.is_some() && self.shares.side().enabled() {
            volring_share::record_pvc(self.base.records.store(), id, None)
                .map_err(|e| Error::Internal(format!("volume {id}'s PVC record: {e}")))?;
        }
        tracing::info!(volume = id, "unstaged");
        Ok(())
    }

    /// Unstages a volume that has no record (quarantined, or the store was
    /// lost): every device serving its image (a loop device backed by the
    /// image's very inode, an nbd device carrying the volume id) is taken
    /// off the staging path — only where it is that device's own mount, as
    /// a filesystem or as the bound block device — and detached, unless
    /// something still holds it (a publish target, another mount): then the
    /// unstage fails and nothing is detached. Never OK while the volume's
    /// mount or device is still there.
    fn unstage_without_record(&self, id: &str, staging: &Path) -> Result<()> {
        let image = self.base.pool.image_path(id);
        let mut devices: Vec<Attachment> = attach::serving(AttachKind::Loop, &image, id)
            .into_iter()
            .filter_map(|a| match attach::prove_loop(a.number, &image) {
                attach::DeviceProof::Ours(a) => Some(Ok(a)),
                attach::DeviceProof::Gone => None,
                attach::DeviceProof::Unsettled(why) => Some(Err(Error::Unavailable(format!("volume {id}'s device: {why}")))),
            })
            .collect::<Result<_>>()?;
        devices.extend(attach::serving(AttachKind::Nbd, &image, id));
        for a in &devices {
            self.base.root.unmount_ours(id, &staging.join(id), Some(Expect::Device(a.dev)))?;
            self.base.root.unmount_ours(id, staging, Some(Expect::Filesystem(a.dev)))?;
            if attach::claimed(&a.path())? {
                return Err(Error::FailedPrecondition(format!(
                    "volume {id} has no record and {} is still in use (mounted or held elsewhere, a publish target?); not detached",
                    a.path().display()
                )));
            }
            match a.kind {
                AttachKind::Loop => attach::detach(a.number, &image)?,
                AttachKind::Nbd => self.nbd.detach(a.number, id)?,
            }
        }
        if !devices.is_empty() {
            tracing::warn!(volume = id, devices = devices.len(), "unstaged a volume that has no record (from what the kernel shows)");
        }
        Ok(())
    }

    /// The volume's loop device: the recorded one, else one a crashed
    /// stage left on the image (`leftover`), else a new one (undone on a
    /// later failure).
    fn loop_device(&self, rec: &StagedVolume, leftover: bool, undo: &mut Rollback) -> Result<Attachment> {
        let known = attach::of_record(rec);
        match known.or_else(|| leftover.then(|| attach::serving(AttachKind::Loop, &rec.image, &rec.volume_id).first().copied()).flatten()) {
            Some(a) => Ok(a),
            None => {
                let a = attach::attach(&rec.image, rec.read_only, self.base.config.direct_io && self.base.pool.direct_io())?;
                undo.push(Undo::Detach(a.number, rec.image.clone()));
                Ok(a)
            }
        }
    }

    /// The nbd device for a stage: the recorded one when it still carries
    /// the volume id; after a crash between connecting and recording the
    /// index, the device carrying the volume id (given fresh sockets, its
    /// server died with that agent); else a new one.
    fn nbd_device(&self, rec: &StagedVolume, leftover: bool, undo: &mut Rollback) -> Result<Attachment> {
        let found = match rec.nbd_index {
            Some(n) => attach::nbd_existing(n, &rec.volume_id).map(|a| a.number),
            None if leftover => attach::serving(AttachKind::Nbd, &rec.image, &rec.volume_id).first().map(|a| a.number),
            None => None,
        };
        if let Some(n) = found {
            if !self.nbd.serving(n) {
                let mut named = rec.clone();
                named.nbd_index = Some(n);
                match self.nbd.heal(&named) {
                    crate::nbd::Healed::Failed(e) => return Err(Error::Internal(format!("reconnect /dev/nbd{n}: {e}"))),
                    crate::nbd::Healed::ImageGone(_) => {
                        return Err(Error::Internal(format!("reconnect /dev/nbd{n}: the image {} is gone", rec.image.display())))
                    }
                    _ => {}
                }
            }
            if let Some(a) = attach::nbd_existing(n, &rec.volume_id) {
                return Ok(a);
            }
        }
        let a = self.nbd.attach(rec)?;
        undo.push(Undo::NbdDetach(a.number, rec.volume_id.clone()));
        Ok(a)
    }
}

fn same_access(r: &StagedVolume, a: &Access) -> bool {
    let kind = match (&r.access, &a.access) {
        (AccessKind::Block, AccessType::Block) => true,
        (AccessKind::Mount { flags, .. }, AccessType::Mount { flags: want, .. }) => flags == want,
        _ => false,
    };
    kind && r.read_only == a.read_only()
}

fn access_flags(a: &Access) -> Vec<String> {
    match &a.access {
        AccessType::Mount { flags, .. } => flags.clone(),
        AccessType::Block => Vec::new(),
    }
}

/// The attach kind a stage asks for: the volume context's `attach` (what
/// CreateVolume returned), else the pool record's parameters; loop when
/// neither says.
fn attach_kind(
    context: &std::collections::HashMap<String, String>,
    params: &std::collections::BTreeMap<String, String>,
) -> Result<AttachKind> {
    match context.get(super::controller::PARAM_ATTACH).or_else(|| params.get(super::controller::PARAM_ATTACH)) {
        None => Ok(AttachKind::Loop),
        Some(v) => v.parse().map_err(|()| Error::InvalidArgument(format!("attach {v:?}: loop or nbd"))),
    }
}

/// What a failed stage must take back, newest first.
enum Undo {
    Unmount(std::path::PathBuf, Expect),
    Detach(u32, std::path::PathBuf),
    NbdDetach(u32, String),
}

#[derive(Default)]
struct Rollback(Vec<Undo>);

impl Rollback {
    fn push(&mut self, u: Undo) {
        self.0.push(u);
    }

    fn run(self, stager: &Stager) {
        for u in self.0.into_iter().rev() {
            let r = match &u {
                Undo::Unmount(p, expect) => stager.base.root.unmount_ours("(rollback)", p, Some(*expect)).map_err(|e| e.to_string()),
                Undo::Detach(n, image) => attach::detach(*n, image).map_err(|e| e.to_string()),
                Undo::NbdDetach(n, id) => stager.nbd.detach(*n, id).map_err(|e| e.to_string()),
            };
            if let Err(e) = r {
                tracing::error!(error = %e, "rolling back a failed stage");
            }
        }
    }
}

/// The filesystem a stage asks for: the capability's, else the volume's
/// own (its pool record, or the context of one another node holds).
fn requested_fs(req: &NodeStageVolumeRequest, meta: Option<&volring_volumes::VolumeMeta>) -> Option<String> {
    let default_fs = match meta {
        Some(m) => m.fs_type.clone(),
        None => req.volume_context.get(super::controller::PARAM_FS_TYPE).cloned(),
    };
    match req.volume_capability.as_ref().and_then(|c| c.access_type.as_ref()) {
        Some(ProtoAccessType::Mount(m)) if !m.fs_type.is_empty() => Some(m.fs_type.clone()),
        _ => default_fs,
    }
}
