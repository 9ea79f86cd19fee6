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
use std::path::{Path, PathBuf};

use super::{Error, Result};
use volring_mounts::DevNum;
use volring_volumes::attach::Attachment;
use volring_volumes::beneath::{self, Beneath, Kind, Node};
use volring_volumes::{mounting, AccessKind, StagedVolume};

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

/// The kubelet root: every path from a request is checked to lie inside
/// it, resolved beneath it once and acted on through the descriptor.
pub(crate) struct Root {
    /// As configured (absolute).
    dir: PathBuf,
    /// As the kernel resolves it (it may be a symlink).
    real: PathBuf,
    /// Held open: paths are opened beneath it.
    pub(crate) beneath: Beneath,
}

impl Root {
    /// Makes (if need be) and opens the kubelet root `dir`; it must be absolute.
    pub(crate) fn open(dir: &Path) -> Result<Self> {
        let dir = super::validate::absolute(&dir.to_string_lossy(), "kubelet root")?;
        std::fs::create_dir_all(&dir).map_err(|e| Error::Internal(format!("kubelet root: {e}")))?;
        let real = std::fs::canonicalize(&dir).map_err(|e| Error::Internal(format!("kubelet root: {e}")))?;
        let beneath = Beneath::open(&dir).map_err(|e| Error::Internal(format!("kubelet root {}: {e}", dir.display())))?;
        Ok(Self { dir, real, beneath })
    }

    pub(crate) fn dir(&self) -> &Path {
        &self.dir
    }

    /// A request's path `p` (field `what`), validated and inside the root.
    pub(crate) fn path(&self, p: &str, what: &str) -> Result<PathBuf> {
        let p = super::validate::path_under(p, &self.dir, what)?;
        self.contained(&p)?;
        Ok(p)
    }

    /// Checks a validated path against symlinks: its deepest existing
    /// ancestor, resolved by the kernel, must still be inside the root.
    fn contained(&self, p: &Path) -> Result<()> {
        let mut probe = p;
        loop {
            match std::fs::canonicalize(probe) {
                Ok(real) if real.starts_with(&self.real) => return Ok(()),
                Ok(real) => {
                    return Err(Error::InvalidArgument(format!("{} resolves to {}, outside the kubelet root", p.display(), real.display())))
                }
                Err(_) => match probe.parent() {
                    Some(parent) => probe = parent,
                    None => return Err(Error::InvalidArgument(format!("{} is not inside the kubelet root", p.display()))),
                },
            }
        }
    }

    /// The directory between the kubelet root and `at` (exclusive of both)
    /// that is a mount's root now, if one is: opened beneath the root and
    /// asked by `statx`, nearest the root first.
    pub(crate) fn covering_mount(&self, at: &Path) -> Result<Option<PathBuf>> {
        let root = &self.dir;
        let mut dirs: Vec<&Path> = at.ancestors().skip(1).take_while(|p| p.starts_with(root) && *p != root).collect();
        dirs.reverse();
        for dir in dirs {
            match self.look(dir, None)? {
                Found::Missing => return Ok(None),
                Found::Unmounted => {}
                Found::Ours(_) | Found::Foreign(_) => return Ok(Some(dir.to_path_buf())),
            }
        }
        Ok(None)
    }

    /// Opens `p` beneath the kubelet root and says whose mount is there.
    /// `expect` is `None` when the volume has no device (nothing can be its).
    pub(crate) fn look(&self, p: &Path, expect: Option<Expect>) -> Result<Found> {
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
    pub(crate) fn device_node(&self, p: &Path, dev: DevNum) -> Result<Option<OwnedFd>> {
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
    pub(crate) fn unmount_ours(&self, id: &str, p: &Path, expect: Option<Expect>) -> Result<()> {
        for _ in 0..MAX_STACKED {
            let Some((parent, name, node)) = self.beneath.entry(p).map_err(|e| path_error(e, p))? else { return Ok(()) };
            match node {
                n if !n.mount_root => return Ok(()),
                n if expect.is_some_and(|x| x.holds(&n)) => {
                    mounting::unmount_entry(parent.as_fd(), &name).map_err(|e| Error::Internal(format!("unmount {}: {e}", p.display())))?
                }
                n => {
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
