//! Whose mount is at a path: the one rule every node call obeys before it
//! mounts on, unmounts or reports on a path from a request.
//!
//! A path is opened once beneath the kubelet root (`volumes::beneath`) and
//! judged by one `statx` of that descriptor: is it a mount's root, and is
//! what is mounted there the volume's own device? Only then is it acted on,
//! through the same descriptor. A mount that is not the volume's — another
//! volume's, a tenant's, the parent filesystem after an unmount — is never
//! unmounted and never reported as the volume.

use std::os::fd::{AsFd, OwnedFd};
use std::path::Path;

use super::{Driver, Error, Result};
use volring_mounts::DevNum;
use volring_volumes::beneath::{self, Kind, Node};
use volring_volumes::{mounting, AccessKind, Attachment, StagedVolume};

/// A mount point is unmounted at most this many times over (stacked mounts).
const MAX_STACKED: usize = 8;

/// What the volume's own mount looks like at one of its paths.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Expect {
    /// A directory: the root of the filesystem on this device (a staging
    /// mount, or a bind of it at a target).
    Filesystem(DevNum),
    /// A file: this block device node bound onto it.
    Device(DevNum),
}

impl Expect {
    /// What `rec`'s mounts look like while `att` serves it.
    pub(super) fn of(rec: &StagedVolume, att: &Attachment) -> Self {
        match rec.access {
            AccessKind::Block => Expect::Device(att.dev),
            AccessKind::Mount { .. } => Expect::Filesystem(att.dev),
        }
    }

    pub(super) fn holds(&self, n: &Node) -> bool {
        n.mount_root
            && match *self {
                Expect::Filesystem(dev) => n.kind == Kind::Dir && n.dev == dev,
                Expect::Device(dev) => n.kind == Kind::BlockDevice && n.rdev == dev,
            }
    }
}

/// What is at a path now.
pub(super) enum Found {
    /// The path does not exist.
    Missing,
    /// It exists and nothing is mounted on it.
    Unmounted,
    /// The volume's own mount.
    Ours(OwnedFd),
    /// Something else is mounted there.
    Foreign(Node),
}

impl Driver {
    /// Opens `p` beneath the kubelet root and says whose mount is there.
    /// `expect` is `None` when the volume has no device (nothing can be its).
    pub(super) fn look(&self, p: &Path, expect: Option<Expect>) -> Result<Found> {
        let Some(fd) = self.beneath.open_path(p).map_err(|e| path_error(e, p))? else { return Ok(Found::Missing) };
        let node = beneath::stat(fd.as_fd()).map_err(|e| Error::Internal(format!("statx {}: {e}", p.display())))?;
        Ok(if !node.mount_root {
            Found::Unmounted
        } else if expect.is_some_and(|x| x.holds(&node)) {
            Found::Ours(fd)
        } else {
            Found::Foreign(node)
        })
    }

    /// Opens `p` beneath the kubelet root and returns the descriptor when
    /// it is a device node of `dev`, bound there or not (kubelet's bind of
    /// a published raw block volume is one); `None` for anything else —
    /// a missing path, a symlink (never followed) or a step out of the
    /// root on the way, a file, a directory, another device.
    pub(super) fn device_node(&self, p: &Path, dev: DevNum) -> Result<Option<OwnedFd>> {
        let fd = match self.beneath.open_path(p) {
            Ok(Some(fd)) => fd,
            Ok(None) => return Ok(None),
            Err(e) if matches!(e.raw_os_error(), Some(libc::ELOOP | libc::EXDEV | libc::ENOTDIR | libc::ENAMETOOLONG)) => return Ok(None),
            Err(e) => return Err(Error::Internal(format!("{}: {e}", p.display()))),
        };
        let node = beneath::stat(fd.as_fd()).map_err(|e| Error::Internal(format!("statx {}: {e}", p.display())))?;
        Ok((node.kind == Kind::BlockDevice && node.rdev == dev).then_some(fd))
    }

    /// Unmounts the volume's own mounts at `p` (stacked ones too) and
    /// nothing else: a foreign mount on top stops it with
    /// FailedPrecondition, and is left where it is. Each round judges the
    /// entry from its parent's descriptor and unmounts through the same one.
    pub(super) fn unmount_ours(&self, id: &str, p: &Path, expect: Option<Expect>) -> Result<()> {
        for _ in 0..MAX_STACKED {
            let Some((parent, name)) = self.beneath.parent(p).map_err(|e| path_error(e, p))? else { return Ok(()) };
            let node = beneath::stat_entry(parent.as_fd(), &name).map_err(|e| path_error(e, p))?;
            match node {
                None => return Ok(()),
                Some(n) if !n.mount_root => return Ok(()),
                Some(n) if expect.is_some_and(|x| x.holds(&n)) => {
                    mounting::unmount_entry(parent.as_fd(), &name).map_err(|e| Error::Internal(format!("unmount {}: {e}", p.display())))?
                }
                Some(n) => {
                    return Err(Error::FailedPrecondition(format!(
                        "{} holds a mount of device {} that is not volume {id}'s; volring leaves it alone",
                        p.display(),
                        n.dev
                    )))
                }
            }
        }
        Err(Error::Internal(format!("{} is still mounted after {MAX_STACKED} unmounts", p.display())))
    }
}

/// A failure to resolve a request's path: a symlink on the way or a step
/// out of the root is the caller's error; anything else is ours.
pub(super) fn path_error(e: std::io::Error, p: &Path) -> Error {
    match e.raw_os_error() {
        Some(libc::ELOOP) | Some(libc::EXDEV) => {
            Error::InvalidArgument(format!("{} passes a symlink or leaves the kubelet root; volring does not follow it", p.display()))
        }
        Some(libc::ENOTDIR) => Error::InvalidArgument(format!("{} (or a directory on the way to it) is not a directory", p.display())),
        Some(libc::EISDIR) => Error::InvalidArgument(format!("{} is a directory; a block volume needs a file there", p.display())),
        _ => Error::Internal(format!("{}: {e}", p.display())),
    }
}
