//! `listmount(2)` and `statmount(2)` (Linux 6.8+).
//!
//! The installed headers predate these calls, so the request layout and the
//! syscall numbers are defined here from the kernel's UAPI. The reply of
//! `statmount` is returned as raw bytes; decoding it is a pure function in
//! `mounts::statmount` so that it can be fuzzed, and the `STATMOUNT_*` mask
//! bits, which say what a reply holds, live with that decoder.

use std::io;

/// Syscall numbers. Calls added since 5.x share one number on every
/// architecture (include/uapi/asm-generic/unistd.h), so no per-arch table.
const SYS_STATMOUNT: libc::c_long = 457;
const SYS_LISTMOUNT: libc::c_long = 458;

/// `LSMT_ROOT`: list from the root of the caller's mount namespace.
pub(crate) const LSMT_ROOT: u64 = u64::MAX;

/// `struct mnt_id_req`, first published size (24 bytes).
#[repr(C)]
struct MntIdReq {
    size: u32,
    spare: u32,
    mnt_id: u64,
    param: u64,
}

impl MntIdReq {
    fn new(mnt_id: u64, param: u64) -> Self {
        Self { size: std::mem::size_of::<Self>() as u32, spare: 0, mnt_id, param }
    }
}

/// Lists the unique ids of every mount in the caller's namespace, in id order.
///
/// `out` is cleared and refilled; its capacity is reused across calls so a
/// periodic resync does not reallocate.
pub fn listmount_all(out: &mut Vec<u64>) -> io::Result<()> {
    const CHUNK: usize = 4096;
    out.clear();
    let mut last = 0u64;
    loop {
        let req = MntIdReq::new(LSMT_ROOT, last);
        out.reserve(CHUNK);
        let spare = out.spare_capacity_mut();
        // SAFETY: `req` is a valid, initialised mnt_id_req of the size it states;
        // the kernel writes at most CHUNK (<= spare.len()) u64 values into
        // `spare`, which is uninitialised capacity owned by `out`.
        let n = unsafe { libc::syscall(SYS_LISTMOUNT, &req as *const MntIdReq, spare.as_mut_ptr(), CHUNK, 0u32) };
        if n < 0 {
            return Err(io::Error::last_os_error());
        }
        let n = (n as usize).min(CHUNK);
        let len = out.len();
        // SAFETY: the kernel initialised the first `n` elements of the spare capacity.
        unsafe { out.set_len(len + n) };
        // A short reply is the end of the list; a full one may have more after `last`.
        match out.last() {
            Some(&id) if n == CHUNK => last = id,
            _ => return Ok(()),
        }
    }
}

/// True when the kernel has `listmount` (and so `statmount`): asks for one id.
pub fn listmount_available() -> bool {
    let req = MntIdReq::new(LSMT_ROOT, 0);
    let mut one = [0u64; 1];
    // SAFETY: `req` is valid; the kernel writes at most one u64 into `one`.
    let n = unsafe { libc::syscall(SYS_LISTMOUNT, &req as *const MntIdReq, one.as_mut_ptr(), 1usize, 0u32) };
    n >= 0
}

/// Fills `buf` with the `struct statmount` reply for `mnt_id`, growing it when
/// the kernel says the strings do not fit (EOVERFLOW). ENOENT means the mount is
/// no longer in this namespace.
pub fn statmount(mnt_id: u64, mask: u64, buf: &mut Vec<u8>) -> io::Result<()> {
    const MAX: usize = 1 << 20;
    if buf.capacity() < 4096 {
        buf.reserve(4096 - buf.len());
    }
    loop {
        buf.clear();
        let req = MntIdReq::new(mnt_id, mask);
        let cap = buf.capacity();
        // SAFETY: `req` is a valid mnt_id_req; the kernel writes at most `cap`
        // bytes into the allocation of `buf`, which has that capacity.
        let rc = unsafe { libc::syscall(SYS_STATMOUNT, &req as *const MntIdReq, buf.as_mut_ptr(), cap, 0u32) };
        if rc == 0 {
            // The reply states its own size in its first u32; never trust it
            // beyond the capacity we gave.
            // SAFETY: the kernel wrote at least the fixed header (it succeeded)
            // and at most `cap` bytes; we expose only what it reported, capped.
            let reported = unsafe { std::ptr::read_unaligned(buf.as_ptr() as *const u32) } as usize;
            // SAFETY: bytes up to min(reported, cap) were written by the kernel.
            unsafe { buf.set_len(reported.min(cap)) };
            return Ok(());
        }
        let err = io::Error::last_os_error();
        if err.raw_os_error() == Some(libc::EOVERFLOW) && cap < MAX {
            buf.reserve(cap * 2);
            continue;
        }
        return Err(err);
    }
}

const SYS_MOUNT_SETATTR: libc::c_long = 442;

/// `struct mount_attr` (first published size, 32 bytes).
#[repr(C)]
struct MountAttr {
    attr_set: u64,
    attr_clr: u64,
    propagation: u64,
    userns_fd: u64,
}

/// `mount_setattr(fd, "", AT_EMPTY_PATH, {attr_set, attr_clr})` (Linux 5.12+):
/// changes the per-mount flags (`MOUNT_ATTR_*`) of the mount `fd` refers to —
/// typically a detached tree from `open_tree(OPEN_TREE_CLONE)`, so a bind
/// mount is read-only before it is ever attached (no window in which it is
/// writable, as a bind followed by a remount has).
pub fn mount_setattr(fd: std::os::fd::BorrowedFd<'_>, attr_set: u64, attr_clr: u64) -> io::Result<()> {
    use std::os::fd::AsRawFd;
    let attr = MountAttr { attr_set, attr_clr, propagation: 0, userns_fd: 0 };
    // SAFETY: `fd` is a live descriptor for the duration of the call, the path
    // is a NUL-terminated empty string, and `attr` is a valid, initialised
    // mount_attr whose size is passed with it; the kernel only reads both.
    let rc = unsafe {
        libc::syscall(
            SYS_MOUNT_SETATTR,
            fd.as_raw_fd(),
            c"".as_ptr(),
            libc::AT_EMPTY_PATH as libc::c_uint,
            &attr as *const MountAttr,
            std::mem::size_of::<MountAttr>(),
        )
    };
    if rc < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}
