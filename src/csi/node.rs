//! Node service: stage (attach, format, mount), publish (bind), stats,
//! expand, and the reverse, each idempotent and undone on failure.

use std::path::{Path, PathBuf};

use rustix::mount::MountFlags;

use super::proto::volume_capability::AccessType as ProtoAccessType;
use super::proto::*;
use super::validate::{self, Access, AccessType};
use super::{Driver, Error, Result};
use crate::volumes::filesystem::{self, Content, FsKind};
use crate::volumes::mounting::{self, is_mount_point};
use crate::volumes::{attach, AccessKind, Attachment, StagePhase, StagedVolume};

/// A mount point is unmounted at most this many times over (stacked mounts).
const MAX_STACKED: usize = 8;

impl Driver {
    pub(super) fn node_stage(&self, req: NodeStageVolumeRequest) -> Result<NodeStageVolumeResponse> {
        validate::volume_id(&req.volume_id)?;
        let staging = self.path(&req.staging_target_path, "staging_target_path")?;
        let access = validate::capability(req.volume_capability.as_ref())?;
        let id = req.volume_id.as_str();
        let _guard = self.lock(id)?;
        let meta = self.pool.get(id).ok_or_else(|| Error::NotFound(format!("volume {id} does not exist")))?;
        let requested_fs = match req.volume_capability.as_ref().and_then(|c| c.access_type.as_ref()) {
            Some(ProtoAccessType::Mount(m)) if !m.fs_type.is_empty() => Some(m.fs_type.clone()),
            _ => meta.fs_type.clone(),
        };
        let prior = self.records.get(id);
        if let Some(r) = &prior {
            if r.staging_path != staging {
                return Err(Error::FailedPrecondition(format!("volume {id} is already staged at {}", r.staging_path.display())));
            }
            if !same_access(r, &access) {
                return Err(Error::AlreadyExists(format!("volume {id} is staged at {} with another capability", staging.display())));
            }
            if r.phase == StagePhase::Staged && self.stage_intact(r) {
                return Ok(NodeStageVolumeResponse {});
            }
            tracing::warn!(volume = id, phase = ?r.phase, "completing an interrupted or damaged stage");
        }
        let mut rec = prior.clone().unwrap_or_else(|| StagedVolume {
            volume_id: id.to_string(),
            image: self.pool.image_path(id),
            staging_path: staging.clone(),
            access: match &access.access {
                AccessType::Block => AccessKind::Block,
                AccessType::Mount { flags, .. } => {
                    AccessKind::Mount { fs_type: requested_fs.clone().unwrap_or_default(), flags: flags.clone() }
                }
            },
            read_only: access.read_only(),
            phase: StagePhase::Attaching,
            loop_number: None,
            published: Default::default(),
        });
        let mut undo = Rollback::default();
        let result = self.stage_steps(&mut rec, &access, requested_fs.as_deref(), &mut undo);
        if let Err(e) = result {
            undo.run();
            let restored = match &prior {
                Some(p) => self.records.put(p),
                None => self.records.remove(id),
            };
            if let Err(r) = restored {
                tracing::error!(volume = id, error = %r, "could not roll back the staged record");
            }
            return Err(e);
        }
        tracing::info!(volume = id, device = ?rec.loop_number, path = %staging.display(), "staged");
        Ok(NodeStageVolumeResponse {})
    }

    /// The stage proper. Each step records its intent first, so a crash at
    /// any point leaves a record saying what may need undoing.
    fn stage_steps(&self, rec: &mut StagedVolume, access: &Access, requested_fs: Option<&str>, undo: &mut Rollback) -> Result<()> {
        // A record still `Attaching` with no number is a stage that crashed
        // mid-attach: the device it may have made is found by its image
        // (a scan of every loop device, so only in that case).
        let leftover = rec.phase == StagePhase::Attaching && rec.loop_number.is_none() && self.records.contains(&rec.volume_id);
        rec.phase = StagePhase::Attaching;
        self.records.put(rec)?;
        let known = rec.loop_number.and_then(|n| attach::existing(n, &rec.image));
        let att = match known.or_else(|| leftover.then(|| attach::find_backed_by(&rec.image).first().copied()).flatten()) {
            Some(a) => a,
            None => {
                let a = attach::attach(&rec.image, rec.read_only, self.config.direct_io && self.pool.direct_io())?;
                undo.push(Undo::Detach(a.number, rec.image.clone()));
                a
            }
        };
        rec.loop_number = Some(att.number);
        rec.phase = StagePhase::Mounting;
        self.records.put(rec)?;
        let at = rec.staged_at();
        match &access.access {
            AccessType::Mount { options, .. } => {
                std::fs::create_dir_all(&at).map_err(|e| Error::Internal(format!("create {}: {e}", at.display())))?;
                if !mounted(&at)? {
                    let fs = self.ensure_filesystem(&att, requested_fs, rec.read_only)?;
                    rec.access = AccessKind::Mount { fs_type: fs.to_string(), flags: access_flags(access) };
                    let options = if fs == "xfs" { options.clone().with_data("nouuid") } else { options.clone() };
                    mounting::mount_filesystem(&att.path(), &at, fs, &options)
                        .map_err(|e| Error::Internal(format!("mount {} on {}: {e}", att.path().display(), at.display())))?;
                    undo.push(Undo::Unmount(at.clone()));
                }
            }
            AccessType::Block => {
                std::fs::create_dir_all(&rec.staging_path)
                    .map_err(|e| Error::Internal(format!("create {}: {e}", rec.staging_path.display())))?;
                create_file(&at)?;
                if !mounted(&at)? {
                    let flags = if rec.read_only { MountFlags::RDONLY } else { MountFlags::empty() };
                    mounting::bind(&att.path(), &at, flags)
                        .map_err(|e| Error::Internal(format!("bind {} on {}: {e}", att.path().display(), at.display())))?;
                    undo.push(Undo::Unmount(at.clone()));
                }
            }
        }
        rec.phase = StagePhase::Staged;
        self.records.put(rec)?;
        Ok(())
    }

    /// Finds the filesystem to mount, formatting a blank device. Never
    /// formats over anything that is not all zeros.
    fn ensure_filesystem(&self, att: &Attachment, requested: Option<&str>, read_only: bool) -> Result<&'static str> {
        match filesystem::probe_device(&att.path())? {
            Content::Filesystem(found) => match requested {
                Some(want) if want != found => {
                    Err(Error::FailedPrecondition(format!("the volume holds {found}; {want} was requested and volring does not reformat")))
                }
                _ => Ok(found),
            },
            Content::Other(what) => Err(Error::FailedPrecondition(format!("the volume holds {what}; refusing to format it"))),
            Content::Blank if read_only => Err(Error::FailedPrecondition("the volume is blank and the stage is read-only".into())),
            Content::Blank => {
                let kind =
                    FsKind::parse(requested.unwrap_or("")).ok_or_else(|| Error::InvalidArgument(format!("fs_type {requested:?}")))?;
                filesystem::format(kind, &att.path())?;
                tracing::info!(device = %att.path().display(), fs = kind.as_str(), "formatted");
                Ok(kind.as_str())
            }
        }
    }

    /// True when the staged volume is still what its record says: attached
    /// to its image and mounted where it was staged.
    fn stage_intact(&self, r: &StagedVolume) -> bool {
        r.loop_number.and_then(|n| attach::existing(n, &r.image)).is_some() && mounted(&r.staged_at()).unwrap_or(false)
    }

    pub(super) fn node_unstage(&self, req: NodeUnstageVolumeRequest) -> Result<NodeUnstageVolumeResponse> {
        validate::volume_id(&req.volume_id)?;
        let staging = self.path(&req.staging_target_path, "staging_target_path")?;
        let id = req.volume_id.as_str();
        let _guard = self.lock(id)?;
        let Some(mut rec) = self.records.get(id) else {
            if self.pool.get(id).is_none() {
                return Err(Error::NotFound(format!("volume {id} does not exist")));
            }
            return Ok(NodeUnstageVolumeResponse {});
        };
        if rec.staging_path != staging {
            return Err(Error::NotFound(format!("volume {id} is not staged at {}", staging.display())));
        }
        let before = rec.published.len();
        rec.published.retain(|t, _| mounted(t).unwrap_or(true));
        if let Some(t) = rec.published.keys().next() {
            return Err(Error::FailedPrecondition(format!("volume {id} is still published at {}", t.display())));
        }
        if rec.published.len() != before {
            self.records.put(&rec)?;
        }
        let at = rec.staged_at();
        unmount_all(&at)?;
        if matches!(rec.access, AccessKind::Block) {
            remove_path(&at)?;
        }
        match rec.loop_number {
            Some(n) => attach::detach(n, &rec.image)?,
            // A crash between attaching and recording the number leaves a
            // device only the image path can find.
            None => {
                for a in attach::find_backed_by(&rec.image) {
                    attach::detach(a.number, &rec.image)?;
                }
            }
        }
        self.records.remove(id)?;
        tracing::info!(volume = id, "unstaged");
        Ok(NodeUnstageVolumeResponse {})
    }

    pub(super) fn node_publish(&self, req: NodePublishVolumeRequest) -> Result<NodePublishVolumeResponse> {
        validate::volume_id(&req.volume_id)?;
        let staging = self.path(&req.staging_target_path, "staging_target_path")?;
        let target = self.path(&req.target_path, "target_path")?;
        let access = validate::capability(req.volume_capability.as_ref())?;
        let id = req.volume_id.as_str();
        let _guard = self.lock(id)?;
        if self.pool.get(id).is_none() {
            return Err(Error::NotFound(format!("volume {id} does not exist")));
        }
        let mut rec = self
            .records
            .get(id)
            .filter(|r| r.phase == StagePhase::Staged && r.staging_path == staging)
            .ok_or_else(|| Error::FailedPrecondition(format!("volume {id} is not staged at {}", staging.display())))?;
        if access.is_mount() != matches!(rec.access, AccessKind::Mount { .. }) {
            return Err(Error::FailedPrecondition(format!("volume {id} was staged for {} access", kind_name(&rec.access))));
        }
        if target == staging || target.starts_with(&staging) || staging.starts_with(&target) {
            return Err(Error::InvalidArgument("target_path and staging_target_path overlap".into()));
        }
        let read_only = req.readonly || access.read_only() || rec.read_only;
        if let Some(&was) = rec.published.get(&target) {
            if mounted(&target)? {
                if was != read_only {
                    return Err(Error::AlreadyExists(format!("volume {id} is published at {} with readonly={was}", target.display())));
                }
                return Ok(NodePublishVolumeResponse {});
            }
        }
        rec.published.insert(target.clone(), read_only);
        self.records.put(&rec)?;
        let flags = match &access.access {
            AccessType::Mount { options, .. } => options.per_mount(),
            AccessType::Block => MountFlags::empty(),
        } | if read_only { MountFlags::RDONLY } else { MountFlags::empty() };
        let made = match rec.access {
            AccessKind::Mount { .. } => {
                std::fs::create_dir_all(&target).map_err(|e| Error::Internal(format!("create {}: {e}", target.display())))
            }
            AccessKind::Block => create_file(&target),
        }
        .and_then(|()| {
            if mounted(&target)? {
                return Err(Error::AlreadyExists(format!("something else is mounted at {}", target.display())));
            }
            mounting::bind(&rec.staged_at(), &target, flags).map_err(|e| Error::Internal(format!("bind on {}: {e}", target.display())))
        });
        if let Err(e) = made {
            rec.published.remove(&target);
            let _ = self.records.put(&rec);
            return Err(e);
        }
        tracing::info!(volume = id, target = %target.display(), read_only, "published");
        Ok(NodePublishVolumeResponse {})
    }

    pub(super) fn node_unpublish(&self, req: NodeUnpublishVolumeRequest) -> Result<NodeUnpublishVolumeResponse> {
        validate::volume_id(&req.volume_id)?;
        let target = self.path(&req.target_path, "target_path")?;
        let id = req.volume_id.as_str();
        let _guard = self.lock(id)?;
        let rec = self.records.get(id);
        if rec.is_none() && self.pool.get(id).is_none() {
            return Err(Error::NotFound(format!("volume {id} does not exist")));
        }
        unmount_all(&target)?;
        remove_path(&target)?;
        if let Some(mut rec) = rec {
            if rec.published.remove(&target).is_some() {
                self.records.put(&rec)?;
                tracing::info!(volume = id, target = %target.display(), "unpublished");
            }
        }
        Ok(NodeUnpublishVolumeResponse {})
    }

    pub(super) fn node_stats(&self, req: NodeGetVolumeStatsRequest) -> Result<NodeGetVolumeStatsResponse> {
        validate::volume_id(&req.volume_id)?;
        let path = self.path(&req.volume_path, "volume_path")?;
        let id = req.volume_id.as_str();
        let rec = self.located(id, &path)?;
        let att = rec.loop_number.and_then(|n| attach::existing(n, &rec.image));
        let checked = if path == rec.staging_path { rec.staged_at() } else { path.clone() };
        let mut usage = Vec::new();
        let problem = match (&att, &rec.access) {
            (None, _) => Some("the loop device behind the volume is gone".to_string()),
            (Some(a), AccessKind::Mount { .. }) => match self.mounted_from(&checked, Some(a.dev)) {
                false => Some(format!("the volume is not mounted at {}", checked.display())),
                true => match rustix::fs::statvfs(&checked) {
                    Ok(s) => {
                        let (f, blocks) = (s.f_frsize, s.f_blocks);
                        usage.push(bytes_usage(blocks * f, s.f_bavail * f, (blocks - s.f_bfree.min(blocks)) * f));
                        usage.push(VolumeUsage {
                            total: s.f_files as i64,
                            available: s.f_ffree as i64,
                            used: s.f_files.saturating_sub(s.f_ffree) as i64,
                            unit: volume_usage::Unit::Inodes as i32,
                        });
                        None
                    }
                    Err(e) => Some(format!("statfs {}: {e}", checked.display())),
                },
            },
            (Some(a), AccessKind::Block) => {
                let size = attach::size_bytes(a.number)?;
                usage.push(bytes_usage(size, 0, size));
                (!self.mounted_from(&checked, None)).then(|| format!("the device is not bound at {}", checked.display()))
            }
        };
        let volume_condition = Some(VolumeCondition { abnormal: problem.is_some(), message: problem.unwrap_or_else(|| "healthy".into()) });
        Ok(NodeGetVolumeStatsResponse { usage, volume_condition })
    }

    pub(super) fn node_expand(&self, req: NodeExpandVolumeRequest) -> Result<NodeExpandVolumeResponse> {
        validate::volume_id(&req.volume_id)?;
        let path = self.path(&req.volume_path, "volume_path")?;
        if !req.staging_target_path.is_empty() {
            self.path(&req.staging_target_path, "staging_target_path")?;
        }
        if let Some(c) = &req.volume_capability {
            validate::capability(Some(c))?;
        }
        let id = req.volume_id.as_str();
        let _guard = self.lock(id)?;
        let rec = self.located(id, &path)?;
        let att = rec
            .loop_number
            .and_then(|n| attach::existing(n, &rec.image))
            .ok_or_else(|| Error::FailedPrecondition(format!("volume {id} has no loop device; stage it again")))?;
        let size = attach::refresh_capacity(&att)?;
        let required = req.capacity_range.as_ref().map_or(0, |r| r.required_bytes.max(0) as u64);
        if required > size {
            return Err(Error::OutOfRange(format!("volume {id} has {size} bytes; grow it with ControllerExpandVolume first")));
        }
        if let AccessKind::Mount { fs_type, .. } = &rec.access {
            if rec.read_only {
                return Err(Error::FailedPrecondition(format!("volume {id} is staged read-only; its filesystem cannot grow")));
            }
            filesystem::grow(fs_type, &att.path(), &rec.staging_path)?;
        }
        tracing::info!(volume = id, bytes = size, "expanded on the node");
        Ok(NodeExpandVolumeResponse { capacity_bytes: size as i64 })
    }

    pub(super) fn node_info(&self) -> NodeGetInfoResponse {
        NodeGetInfoResponse {
            node_id: self.config.node_id.clone(),
            max_volumes_per_node: self.config.max_volumes,
            accessible_topology: Some(self.topology()),
        }
    }

    /// The staged record of `id`, if `path` is its staging path or one of
    /// its targets; NotFound otherwise (unknown volume, or not there).
    fn located(&self, id: &str, path: &Path) -> Result<StagedVolume> {
        let rec = self.records.get(id).ok_or_else(|| match self.pool.get(id) {
            None => Error::NotFound(format!("volume {id} does not exist")),
            Some(_) => Error::NotFound(format!("volume {id} is not staged on this node")),
        })?;
        if rec.staging_path != path && !rec.published.contains_key(path) {
            return Err(Error::NotFound(format!("volume {id} is not at {}", path.display())));
        }
        Ok(rec)
    }

    /// Whether `path` is a mount point (of `dev`, when given), from the
    /// mount table the watcher keeps. A mount made a moment ago may not be
    /// in it yet, so a miss is confirmed with one statx of the path.
    fn mounted_from(&self, path: &Path, dev: Option<crate::mounts::DevNum>) -> bool {
        let table = self.mounts.read().unwrap_or_else(|e| e.into_inner());
        if let Some(m) = table.top_at(path.as_os_str().as_encoded_bytes()) {
            return dev.is_none_or(|d| m.dev == d);
        }
        drop(table);
        is_mount_point(path).unwrap_or(false)
    }
}

fn bytes_usage(total: u64, available: u64, used: u64) -> VolumeUsage {
    VolumeUsage { total: total as i64, available: available as i64, used: used as i64, unit: volume_usage::Unit::Bytes as i32 }
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

fn kind_name(k: &AccessKind) -> &'static str {
    match k {
        AccessKind::Block => "block",
        AccessKind::Mount { .. } => "mount",
    }
}

fn mounted(p: &Path) -> Result<bool> {
    is_mount_point(p).map_err(|e| Error::Internal(format!("statx {}: {e}", p.display())))
}

fn unmount_all(p: &Path) -> Result<()> {
    for _ in 0..MAX_STACKED {
        match mounting::unmount(p) {
            Ok(true) => continue,
            Ok(false) => return Ok(()),
            Err(e) => return Err(Error::Internal(format!("unmount {}: {e}", p.display()))),
        }
    }
    Err(Error::Internal(format!("{} is still mounted after {MAX_STACKED} unmounts", p.display())))
}

fn create_file(p: &Path) -> Result<()> {
    if let Some(parent) = p.parent() {
        std::fs::create_dir_all(parent).map_err(|e| Error::Internal(format!("create {}: {e}", parent.display())))?;
    }
    match std::fs::OpenOptions::new().create(true).truncate(false).write(true).open(p) {
        Ok(_) => Ok(()),
        Err(e) => Err(Error::Internal(format!("create {}: {e}", p.display()))),
    }
}

/// Removes a target (an empty directory or the file a device was bound to).
fn remove_path(p: &Path) -> Result<()> {
    let r = match std::fs::symlink_metadata(p) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => Err(e),
        Ok(m) if m.is_dir() => std::fs::remove_dir(p),
        Ok(_) => std::fs::remove_file(p),
    };
    r.map_err(|e| Error::Internal(format!("remove {}: {e}", p.display())))
}

/// What a failed stage must take back, newest first.
enum Undo {
    Unmount(PathBuf),
    Detach(u32, PathBuf),
}

#[derive(Default)]
struct Rollback(Vec<Undo>);

impl Rollback {
    fn push(&mut self, u: Undo) {
        self.0.push(u);
    }

    fn run(self) {
        for u in self.0.into_iter().rev() {
            let r = match &u {
                Undo::Unmount(p) => mounting::unmount(p).map(drop).map_err(|e| e.to_string()),
                Undo::Detach(n, image) => attach::detach(*n, image).map_err(|e| e.to_string()),
            };
            if let Err(e) = r {
                tracing::error!(error = %e, "rolling back a failed stage");
            }
        }
    }
}
