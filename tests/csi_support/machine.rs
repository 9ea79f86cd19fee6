//! What is on the machine, read without the agent: the mount table, loop
//! devices and their backing files (sysfs), filesystems and files — for
//! checking the agent black-box and for cleaning up after a test.

use std::path::{Path, PathBuf};

/// Every mount point below `dir`, deepest first.
pub fn mounts_under(dir: &Path) -> Vec<PathBuf> {
    let info = std::fs::read("/proc/thread-self/mountinfo").unwrap_or_default();
    let (table, _) = volring_mounts::MountTable::from_mountinfo(&info);
    let mut v: Vec<_> = table.iter().map(|m| m.mount_point_path().to_path_buf()).filter(|p| p.starts_with(dir)).collect();
    v.sort_by_key(|p| std::cmp::Reverse(p.components().count()));
    v
}

pub(super) fn unmount_under(dir: &Path) {
    for _ in 0..64 {
        let v = mounts_under(dir);
        if v.is_empty() {
            return;
        }
        for p in v {
            let _ = rustix::mount::unmount(&p, rustix::mount::UnmountFlags::DETACH);
        }
    }
}

/// Every attached loop device and its backing file, read from sysfs
/// (`/sys/block/loop*/loop/backing_file`; a deleted file reads with a
/// " (deleted)" suffix). Read here rather than through volring's own scan,
/// so a fault in that scan cannot hide a leak.
pub fn loop_backing_files() -> Vec<(u32, PathBuf)> {
    let mut out = Vec::new();
    for e in std::fs::read_dir("/sys/block").into_iter().flatten().flatten() {
        let Some(n) = e.file_name().to_str().and_then(|s| s.strip_prefix("loop")).and_then(|s| s.parse().ok()) else { continue };
        if let Ok(b) = std::fs::read_to_string(e.path().join("loop/backing_file")) {
            out.push((n, PathBuf::from(b.trim_end_matches('\n'))));
        }
    }
    out.sort();
    out
}

/// Loop devices whose backing file lies below `dir`.
pub fn loops_under(dir: &Path) -> Vec<u32> {
    loop_backing_files().into_iter().filter(|(_, b)| b.starts_with(dir)).map(|(n, _)| n).collect()
}

/// Loop devices backed by `image` (also once it is deleted).
pub fn loops_backed_by(image: &Path) -> Vec<u32> {
    let deleted = PathBuf::from(format!("{} (deleted)", image.display()));
    loop_backing_files().into_iter().filter(|(_, b)| b == image || *b == deleted).map(|(n, _)| n).collect()
}

pub(super) fn detach_loops_under(dir: &Path) {
    for n in loops_under(dir) {
        if let Ok(d) = volring_sys::loopdev::LoopDevice::open(n) {
            let _ = d.detach();
        }
    }
}

/// The device number (`st_rdev`) of `/dev/loop<n>`, from sysfs.
pub fn loop_dev(n: u32) -> Option<u64> {
    let s = std::fs::read_to_string(format!("/sys/block/loop{n}/dev")).ok()?;
    let (major, minor) = s.trim().split_once(':')?;
    Some(rustix::fs::makedev(major.parse().ok()?, minor.parse().ok()?))
}

/// The size of the filesystem mounted at `path` (statvfs).
pub fn fs_bytes(path: &str) -> std::io::Result<u64> {
    let s = rustix::fs::statvfs(path)?;
    Ok(s.f_blocks * s.f_frsize)
}

/// Calls `f` on every file below `dir`, `depth` levels deep at most.
pub fn files_under(dir: &Path, depth: u32, f: &mut dyn FnMut(&Path)) {
    for e in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        let p = e.path();
        f(&p);
        if depth > 0 && e.file_type().is_ok_and(|t| t.is_dir()) {
            files_under(&p, depth - 1, f);
        }
    }
}
