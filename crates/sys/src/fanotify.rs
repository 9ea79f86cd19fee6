//! fanotify mount events on a mount namespace (Linux 6.15+).
//!
//! Constants come from include/uapi/linux/fanotify.h of 6.15; the installed
//! headers are older. Decoding the events is a pure function in
//! `mounts::fanotify`, which keeps the event record's own constants (the
//! overflow bit, the mount info record's type); the two event bits
//! ([`MountEvents`]) are here because the mark asks for them too.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

const FAN_CLASS_NOTIF: libc::c_uint = 0x0;
const FAN_CLOEXEC: libc::c_uint = 0x1;
const FAN_NONBLOCK: libc::c_uint = 0x2;
const FAN_REPORT_MNT: libc::c_uint = 0x4000;
const FAN_MARK_ADD: libc::c_uint = 0x1;
const FAN_MARK_MNTNS: libc::c_uint = 0x110;

bitflags::bitflags! {
    /// The mount event bits of an event's mask, which the mark asks for.
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    pub struct MountEvents: u64 {
        /// A mount was attached to the namespace (mount, bind, move target).
        const ATTACH = 0x0100_0000;
        /// A mount was detached from the namespace (umount, move source).
        const DETACH = 0x0200_0000;
    }
}

/// Opens a non-blocking fanotify group that reports attach and detach of every
/// mount in the caller's current mount namespace.
pub fn watch_mount_namespace() -> io::Result<OwnedFd> {
    // SAFETY: plain syscall with integer flags; returns a new fd or -1.
    let fd = unsafe { libc::fanotify_init(FAN_CLASS_NOTIF | FAN_CLOEXEC | FAN_NONBLOCK | FAN_REPORT_MNT, libc::O_RDONLY as libc::c_uint) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `fd` was just returned by fanotify_init and is owned by nobody else.
    let group = unsafe { OwnedFd::from_raw_fd(fd) };
    let ns = std::fs::File::open("/proc/thread-self/ns/mnt")?;
    // SAFETY: both fds are open for the duration of the call; the path is NULL,
    // which FAN_MARK_MNTNS requires (the namespace is named by the dirfd).
    let rc = unsafe {
        libc::fanotify_mark(group.as_raw_fd(), FAN_MARK_ADD | FAN_MARK_MNTNS, MountEvents::all().bits(), ns.as_raw_fd(), std::ptr::null())
    };
    if rc < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(group)
}
