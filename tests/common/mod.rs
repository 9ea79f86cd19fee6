//! Helpers for tests that need the real kernel. Everything made here is
//! removed on drop, so also when a test panics.

#![allow(dead_code)]

pub mod load;

use std::path::{Path, PathBuf};
use std::process::Command;

use rustix::mount::{mount, unmount, MountFlags, UnmountFlags};

/// `Ok` when `ok`, else a test failure saying `what`.
pub fn check(ok: bool, what: impl Into<String>) -> Result<(), libtest_mimic::Failed> {
    if ok {
        Ok(())
    } else {
        Err(what.into().into())
    }
}

/// A scratch directory; every mount below it is lazily unmounted on drop,
/// deepest (newest) first, before the directory is removed.
pub struct Scratch {
    dir: Option<tempfile::TempDir>,
}

impl Scratch {
    pub fn new() -> Self {
        Self { dir: Some(tempfile::Builder::new().prefix("volring-test-").tempdir().expect("tempdir")) }
    }

    pub fn path(&self) -> &Path {
        self.dir.as_ref().expect("live").path()
    }

    /// A directory `name` inside the scratch dir (created).
    pub fn dir(&self, name: &str) -> PathBuf {
        let p = self.path().join(name);
        std::fs::create_dir_all(&p).expect("mkdir");
        p
    }

    /// Mounts a small tmpfs at `name`.
    pub fn tmpfs(&self, name: &str) -> PathBuf {
        let p = self.dir(name);
        tmpfs_at(&p);
        p
    }
}

pub fn tmpfs_at(p: &Path) {
    mount("tmpfs", p, "tmpfs", MountFlags::empty(), Some(c"size=1m")).unwrap_or_else(|e| panic!("mount tmpfs {}: {e}", p.display()));
}

pub fn umount(p: &Path) {
    unmount(p, UnmountFlags::empty()).unwrap_or_else(|e| panic!("umount {}: {e}", p.display()));
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let Some(dir) = self.dir.take() else { return };
        let root = dir.path().as_os_str().as_encoded_bytes().to_vec();
        let mut prefix = root.clone();
        prefix.push(b'/');
        // Bounded: each pass removes at least one mount or stops.
        for _ in 0..10_000 {
            let info = std::fs::read("/proc/thread-self/mountinfo").unwrap_or_default();
            let (table, _) = volring_mounts::MountTable::from_mountinfo(&info);
            let mut under: Vec<_> = table
                .iter()
                .filter(|m| m.mount_point() == root.as_slice() || m.mount_point().starts_with(&prefix))
                .map(|m| (m.id, m.mount_point_path().to_path_buf()))
                .collect();
            if under.is_empty() {
                break;
            }
            under.sort();
            let (_, p) = under.pop().expect("non-empty");
            if unmount(&p, UnmountFlags::DETACH).is_err() {
                break;
            }
        }
        let _ = dir.close();
    }
}

/// A loop device over a sparse file; detached on drop.
pub struct LoopDevice {
    dev: Option<volring_sys::loopdev::LoopDevice>,
    path: String,
    _file: tempfile::NamedTempFile,
}

impl LoopDevice {
    /// A loop device over a sparse file of `size` bytes, attached with
    /// autoclear: it goes away when the test is done with it, even if the
    /// test process is killed.
    pub fn new(size: u64) -> Self {
        Self::with_partscan(size, false)
    }

    /// With `partscan`, the kernel makes partition devices for a table.
    pub fn with_partscan(size: u64, partscan: bool) -> Self {
        use std::os::fd::AsFd;
        let file = tempfile::Builder::new().prefix("volring-img-").tempfile().expect("image file");
        file.as_file().set_len(size).expect("truncate");
        let opts = volring_sys::loopdev::LoopOptions { autoclear: true, partscan, ..Default::default() };
        let dev = volring_sys::loopdev::LoopDevice::attach(file.as_file().as_fd(), &opts).expect("attach loop device");
        Self { path: dev.path().display().to_string(), dev: Some(dev), _file: file }
    }

    pub fn path(&self) -> &str {
        &self.path
    }

    pub fn name(&self) -> &str {
        self.path.trim_start_matches("/dev/")
    }

    /// Detaches now (the device stays busy while something else holds it).
    pub fn detach(mut self) {
        if let Some(d) = self.dev.take() {
            d.detach().expect("detach");
        }
    }

    pub fn mkfs(&self, fs: &str) {
        self.mkfs_with(fs, &[]);
    }

    pub fn mkfs_with(&self, fs: &str, extra: &[&str]) {
        let mut args: Vec<&str> = match fs {
            "xfs" | "btrfs" => vec!["-q", "-f"],
            "swap" => vec![],
            _ => vec!["-q", "-F"],
        };
        args.extend_from_slice(extra);
        let prog = if fs == "swap" { "mkswap".to_string() } else { format!("mkfs.{fs}") };
        let out = Command::new(&prog).args(&args).arg(&self.path).output().expect("mkfs");
        assert!(out.status.success(), "{prog}: {}", String::from_utf8_lossy(&out.stderr));
    }
}

impl Drop for LoopDevice {
    fn drop(&mut self) {
        // Autoclear detaches once the last user is gone; detaching
        // explicitly as well covers a holder that closes later.
        if let Some(d) = self.dev.take() {
            let _ = d.detach();
        }
    }
}

/// Runs libtest-mimic trials inside a private mount namespace, one at a time
/// (they share the namespace, so their events must not interleave).
pub fn run_in_private_namespace(trials: Vec<libtest_mimic::Trial>) -> ! {
    volring_sys::ns::enter_private_mount_namespace().expect("private mount namespace (run as root)");
    let mut args = libtest_mimic::Arguments::from_args();
    args.test_threads = Some(1);
    libtest_mimic::run(&args, trials).exit()
}

/// A log line without its terminal colour codes (`ESC [ ... m`).
pub fn without_colours(line: &str) -> String {
    let mut out = String::with_capacity(line.len());
    let mut chars = line.chars();
    while let Some(c) = chars.next() {
        if c == '\x1b' {
            chars.by_ref().find(|&c| c == 'm');
        } else {
            out.push(c);
        }
    }
    out
}

/// Detaches every loop device whose backing file lies below `dir` (the
/// cleanup of a test that attached images there). Read from sysfs here,
/// not through volring's own scan, so a fault in that scan cannot hide a
/// leftover device.
pub fn detach_loops_under(dir: &Path) {
    for e in std::fs::read_dir("/sys/block").into_iter().flatten().flatten() {
        let Some(n) = e.file_name().to_str().and_then(|s| s.strip_prefix("loop")).and_then(|s| s.parse::<u32>().ok()) else { continue };
        let Ok(b) = std::fs::read_to_string(e.path().join("loop/backing_file")) else { continue };
        if Path::new(b.trim_end_matches('\n')).starts_with(dir) {
            if let Ok(d) = volring_sys::loopdev::LoopDevice::open(n) {
                let _ = d.detach();
            }
        }
    }
}
