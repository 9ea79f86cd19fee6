//! CSI mount flags to mount(2), and the few mount operations staging needs.
//!
//! Mount flags come from the CO (a StorageClass's `mountOptions`), so they
//! are parsed, not passed through: the generic ones become `MS_*` bits, the
//! rest become the filesystem's data string, and flags that would change
//! what kind of mount is made (`bind`, `remount`, `move`...) are refused.

use std::io;
use std::path::Path;

use rustix::mount::{MountFlags, UnmountFlags};

/// The spec's limit for all mount flags together.
pub const MAX_FLAGS_LEN: usize = 4096;

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

pub fn mount_filesystem(device: &Path, target: &Path, fs_type: &str, o: &MountOptions) -> io::Result<()> {
    let data = std::ffi::CString::new(o.data.as_str()).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
    rustix::mount::mount(device, target, fs_type, o.flags, Some(data.as_c_str()))?;
    Ok(())
}

/// Bind-mounts `source` on `target`, then applies `flags` (read-only and the
/// like) with a remount: a bind mount ignores them when first made.
pub fn bind(source: &Path, target: &Path, flags: MountFlags) -> io::Result<()> {
    rustix::mount::mount_bind(source, target)?;
    if !flags.is_empty() {
        if let Err(e) = rustix::mount::mount_remount(target, MountFlags::BIND | flags, "") {
            let _ = rustix::mount::unmount(target, UnmountFlags::empty());
            return Err(e.into());
        }
    }
    Ok(())
}

/// Unmounts `target`; false when nothing was mounted there.
pub fn unmount(target: &Path) -> io::Result<bool> {
    match rustix::mount::unmount(target, UnmountFlags::NOFOLLOW) {
        Ok(()) => Ok(true),
        Err(rustix::io::Errno::INVAL) | Err(rustix::io::Errno::NOENT) => Ok(false),
        Err(e) => Err(e.into()),
    }
}

/// True when `path` is the root of a mount (asks the kernel about this one
/// path; no table is read).
pub fn is_mount_point(path: &Path) -> io::Result<bool> {
    use rustix::fs::{statx, AtFlags, StatxAttributes, StatxFlags, CWD};
    match statx(CWD, path, AtFlags::SYMLINK_NOFOLLOW, StatxFlags::BASIC_STATS) {
        Ok(s) => Ok(s.stx_attributes.contains(StatxAttributes::MOUNT_ROOT)),
        Err(rustix::io::Errno::NOENT) => Ok(false),
        Err(e) => Err(e.into()),
    }
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
