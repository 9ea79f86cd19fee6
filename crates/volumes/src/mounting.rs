//! CSI mount flags to mount attributes, and the few mount operations staging
//! needs — all through descriptors (see `volumes::beneath`), none by path.
//!
//! Mount flags come from the CO (a StorageClass's `mountOptions`), so they
//! are parsed, not passed through: the generic ones become `MS_*` bits, the
//! rest become the filesystem's data string, and flags that would change
//! what kind of mount is made (`bind`, `remount`, `move`...) are refused.

use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::path::Path;

use rustix::mount::{
    fsconfig_create, fsconfig_set_flag, fsconfig_set_string, fsmount, fsopen, move_mount, open_tree, FsMountFlags, FsOpenFlags,
    MountAttrFlags, MountFlags, MoveMountFlags, OpenTreeFlags, UnmountFlags,
};

/// The spec's limit for all mount flags together.
pub(crate) const MAX_FLAGS_LEN: usize = 4096;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MountOptions {
    pub flags: MountFlags,
    /// Filesystem-specific options, comma-joined.
    pub data: String,
}

impl MountOptions {
    /// Parses CSI mount flags (each entry may itself hold several, comma
    /// separated). `read_only` adds `ro` whatever the flags say.
    pub fn parse(entries: &[String], read_only: bool) -> Result<Self, String> {
        let total: usize = entries.iter().map(|e| e.len() + 1).sum();
        if total > MAX_FLAGS_LEN {
            return Err(format!("mount flags are {total} bytes; at most {MAX_FLAGS_LEN}"));
        }
        let mut o = MountOptions { flags: MountFlags::empty(), data: String::new() };
        let mut data = Vec::new();
        for opt in entries.iter().flat_map(|e| e.split(',')).filter(|s| !s.is_empty()) {
            if let Some(bad) = opt.chars().find(|c| !c.is_ascii_graphic() || *c == '\\') {
                return Err(format!("mount flag {opt:?} has the character {bad:?}"));
            }
            match opt {
                "defaults" | "rw" | "auto" | "noauto" | "nouser" | "_netdev" => {}
                "ro" => o.flags |= MountFlags::RDONLY,
                "nosuid" => o.flags |= MountFlags::NOSUID,
                "nodev" => o.flags |= MountFlags::NODEV,
                "noexec" => o.flags |= MountFlags::NOEXEC,
                "noatime" => o.flags |= MountFlags::NOATIME,
                "nodiratime" => o.flags |= MountFlags::NODIRATIME,
                "relatime" => o.flags |= MountFlags::RELATIME,
                "strictatime" => o.flags |= MountFlags::STRICTATIME,
                "lazytime" => o.flags |= MountFlags::LAZYTIME,
                "sync" => o.flags |= MountFlags::SYNCHRONOUS,
                "dirsync" => o.flags |= MountFlags::DIRSYNC,
                "bind" | "rbind" | "remount" | "move" | "make-shared" | "make-private" | "make-slave" | "make-unbindable" | "loop" => {
                    return Err(format!("mount flag {opt:?} is not allowed"))
                }
                other => data.push(other),
            }
        }
        if read_only {
            o.flags |= MountFlags::RDONLY;
        }
        o.data = data.join(",");
        Ok(o)
    }

    /// Adds a filesystem option (e.g. xfs's `nouuid`) unless present.
    pub fn with_data(mut self, opt: &str) -> Self {
        if !self.data.split(',').any(|o| o == opt) {
            if !self.data.is_empty() {
                self.data.push(',');
            }
            self.data.push_str(opt);
        }
        self
    }

    /// The flags that apply per mount point (and so to a bind mount).
    pub fn per_mount(&self) -> MountFlags {
        self.flags
            & (MountFlags::RDONLY
                | MountFlags::NOSUID
                | MountFlags::NODEV
                | MountFlags::NOEXEC
                | MountFlags::NOATIME
                | MountFlags::NODIRATIME
                | MountFlags::RELATIME
                | MountFlags::STRICTATIME)
    }
}

/// Mounts `fs_type` from `device` onto the directory `target` refers to,
/// with the new mount API: the superblock is configured on an fs context
/// (each data option one `fsconfig` call, so an option cannot smuggle
/// another), made into a detached mount with its per-mount flags already
/// set, and only then attached to `target` by descriptor. The kernel's own
/// message for a refused option or a damaged filesystem is returned with
/// the error.
pub fn mount_filesystem(device: &Path, target: BorrowedFd<'_>, fs_type: &str, o: &MountOptions) -> io::Result<()> {
    let fs = fsopen(fs_type, FsOpenFlags::FSOPEN_CLOEXEC)?;
    let configured = (|| -> io::Result<()> {
        fsconfig_set_string(&fs, "source", device)?;
        for (bit, name) in [
            (MountFlags::RDONLY, "ro"),
            (MountFlags::SYNCHRONOUS, "sync"),
            (MountFlags::DIRSYNC, "dirsync"),
            (MountFlags::LAZYTIME, "lazytime"),
        ] {
            if o.flags.contains(bit) {
                fsconfig_set_flag(&fs, name)?;
            }
        }
        for opt in o.data.split(',').filter(|s| !s.is_empty()) {
            match opt.split_once('=') {
                Some((k, v)) => fsconfig_set_string(&fs, k, v)?,
                None => fsconfig_set_flag(&fs, opt)?,
            }
        }
        fsconfig_create(&fs)?;
        Ok(())
    })();
    if let Err(e) = configured {
        return Err(with_kernel_message(e, &fs));
    }
    let (set, _) = attributes(o.flags);
    let mnt = fsmount(&fs, FsMountFlags::FSMOUNT_CLOEXEC, MountAttrFlags::from_bits_retain(set as u32))?;
    attach_onto(&mnt, target)
}

/// Attaches the detached mount `mnt` onto what `target` refers to, and
/// proves it landed there. `move_mount` to a descriptor whose directory
/// someone covered with a mount since it was opened (and judged empty) does
/// not fail: the kernel puts the new mount on top of that other mount. So
/// the mount `target` lies in is taken before, and the new mount's parent
/// (mountinfo, by the new mount's own id) must be that very mount after;
/// when it is not, the new mount is taken off again (lazily: this
/// descriptor still holds it) and the attach fails — never left over what
/// is not volring's.
fn attach_onto(mnt: &OwnedFd, target: BorrowedFd<'_>) -> io::Result<()> {
    use rustix::fs::{statx, AtFlags, StatxFlags};
    // A mount's root (a stack the caller means to make) is that mount:
    // the new one's parent must be it.
    let at = statx(target, "", AtFlags::EMPTY_PATH, StatxFlags::MNT_ID)?;
    move_mount(mnt, "", target, "", MoveMountFlags::MOVE_MOUNT_F_EMPTY_PATH | MoveMountFlags::MOVE_MOUNT_T_EMPTY_PATH)?;
    let new_id = statx(mnt, "", AtFlags::EMPTY_PATH, StatxFlags::MNT_ID)?.stx_mnt_id;
    let parent = parent_of(new_id);
    if parent.as_ref().is_ok_and(|p| *p == Some(at.stx_mnt_id)) {
        return Ok(());
    }
    let off = rustix::mount::unmount(format!("/proc/self/fd/{}", mnt.as_raw_fd()).as_str(), UnmountFlags::DETACH);
    let why = match parent {
        Ok(p) => format!(
            "something was mounted there while volring attached its mount (it landed on mount {p:?}, not on {}); {}",
            at.stx_mnt_id,
            match off {
                Ok(()) => "taken off again, nothing left over it".to_string(),
                Err(e) => format!("taking it off again failed: {e}"),
            }
        ),
        Err(e) => format!("could not tell where the new mount landed ({e}); taken off again"),
    };
    Err(io::Error::new(io::ErrorKind::ResourceBusy, why))
}

/// The parent of mount `id`, by the kernel's mountinfo (this thread's
/// mount namespace: a thread may have one of its own).
fn parent_of(id: u64) -> io::Result<Option<u64>> {
    let mut info = Vec::new();
    volring_mounts::read_mountinfo(std::fs::File::open("/proc/thread-self/mountinfo")?, &mut info)?;
    let parent = volring_mounts::mountinfo_lines(&info).flatten().find(|m| u64::from(m.id) == id).map(|m| u64::from(m.parent));
    Ok(parent)
}

/// Bind-mounts what `source` refers to (a mount's root, or a device node)
/// onto what `target` refers to. The clone is made detached, gets `flags`
/// (read-only and the like) while still detached, and is attached last, so
/// it is never visible with the wrong flags.
pub fn bind(source: BorrowedFd<'_>, target: BorrowedFd<'_>, flags: MountFlags) -> io::Result<()> {
    let tree = open_tree(source, "", OpenTreeFlags::OPEN_TREE_CLONE | OpenTreeFlags::OPEN_TREE_CLOEXEC | OpenTreeFlags::AT_EMPTY_PATH)?;
    let (set, clear) = attributes(flags);
    if set != 0 || clear != 0 {
        volring_sys::mount_api::mount_setattr(tree.as_fd(), set, clear)?;
    }
    attach_onto(&tree, target)
}

/// Unmounts what is mounted on entry `name` of the open directory `parent`
/// (the top mount there). The parent was resolved once, beneath the root;
/// the kernel walks only `name` from it, without following a symlink. The
/// caller judges the entry with `Beneath::entry` first
/// and holds no descriptor inside the mount (that would keep it busy).
pub fn unmount_entry(parent: BorrowedFd<'_>, name: &std::ffi::OsStr) -> io::Result<()> {
    let mut path = std::path::PathBuf::from(format!("/proc/self/fd/{}", parent.as_raw_fd()));
    path.push(name);
    rustix::mount::unmount(&path, UnmountFlags::NOFOLLOW)?;
    Ok(())
}

/// `MS_*` per-mount flags as `MOUNT_ATTR_*` bits to set and to clear (an
/// atime mode replaces the old one, so the atime field is cleared first).
fn attributes(flags: MountFlags) -> (u64, u64) {
    let mut set = MountAttrFlags::empty();
    for (bit, attr) in [
        (MountFlags::RDONLY, MountAttrFlags::MOUNT_ATTR_RDONLY),
        (MountFlags::NOSUID, MountAttrFlags::MOUNT_ATTR_NOSUID),
        (MountFlags::NODEV, MountAttrFlags::MOUNT_ATTR_NODEV),
        (MountFlags::NOEXEC, MountAttrFlags::MOUNT_ATTR_NOEXEC),
        (MountFlags::NODIRATIME, MountAttrFlags::MOUNT_ATTR_NODIRATIME),
        (MountFlags::NOATIME, MountAttrFlags::MOUNT_ATTR_NOATIME),
        (MountFlags::STRICTATIME, MountAttrFlags::MOUNT_ATTR_STRICTATIME),
    ] {
        if flags.contains(bit) {
            set |= attr;
        }
    }
    let atime = flags.intersects(MountFlags::NOATIME | MountFlags::STRICTATIME | MountFlags::RELATIME);
    let clear = if atime { MountAttrFlags::MOUNT_ATTR__ATIME } else { MountAttrFlags::empty() };
    (set.bits() as u64, clear.bits() as u64)
}

/// Adds the fs context's log (the kernel's reason, e.g. "Structure needs
/// cleaning" or an unknown option's name) to an error.
fn with_kernel_message(e: io::Error, fs: &OwnedFd) -> io::Error {
    let mut buf = [0u8; 512];
    let mut said = Vec::new();
    // The log holds at most a few messages; each read returns one.
    for _ in 0..4 {
        match rustix::io::read(fs, &mut buf) {
            Ok(n) if n > 0 => said.push(String::from_utf8_lossy(&buf[..n]).trim().to_string()),
            _ => break,
        }
    }
    if said.is_empty() {
        return e;
    }
    io::Error::new(e.kind(), format!("{e} ({})", said.join("; ")))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(v: &[&str], ro: bool) -> Result<MountOptions, String> {
        MountOptions::parse(&v.iter().map(|s| s.to_string()).collect::<Vec<_>>(), ro)
    }

    #[test]
    fn generic_flags_become_bits_the_rest_data() {
        let o = parse(&["noatime,nodev", "discard", "errors=remount-ro"], true).unwrap();
        assert_eq!(o.flags, MountFlags::NOATIME | MountFlags::NODEV | MountFlags::RDONLY);
        assert_eq!(o.data, "discard,errors=remount-ro");
        assert_eq!(o.clone().with_data("nouuid").with_data("nouuid").data, "discard,errors=remount-ro,nouuid");
        assert_eq!(o.per_mount(), MountFlags::NOATIME | MountFlags::NODEV | MountFlags::RDONLY);
    }

    #[test]
    fn refuses_what_changes_the_mount_kind_or_smuggles_bytes() {
        assert!(parse(&["bind"], false).is_err());
        assert!(parse(&["remount,ro"], false).is_err());
        assert!(parse(&["a b"], false).is_err());
        assert!(parse(&["x\n"], false).is_err());
        assert!(parse(&[&"a".repeat(5000)], false).is_err());
        assert_eq!(parse(&[], false).unwrap(), MountOptions { flags: MountFlags::empty(), data: String::new() });
    }
}
