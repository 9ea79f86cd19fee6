//! The desired state rebuilt from the kernel, for when the store is lost
//! (`state.redb` removed) or damaged (set aside): the kernel is the actual
//! state, and what it shows of a staged volume is enough to serve it again
//! — where it can be proven, and only there.
//!
//! A volume is found by its device, never by a name: a loop device whose
//! backing file is a pool image by device and inode (`LOOP_GET_STATUS64`),
//! an nbd device whose backend identifier (sysfs `backend`) is a pool
//! volume's id. Its mounts are the mounts under the kubelet root that are
//! that device's, each opened beneath the root and judged by `statx` of the
//! descriptor (a filesystem mount: the root of a mount on the device; a
//! block volume: the device node bound onto a file). The staging mount is
//! the one outside kubelet's `pods/` directory (kubelet's global mount;
//! for a block volume, a file named after the volume in the staging
//! directory); publish targets are those under `pods/`. Anything else — a
//! device mounted nowhere, two staging candidates, a filesystem mount and a
//! bound node of one device, two devices on one image — is not guessed at:
//! it is reported and left alone.

use std::collections::{BTreeMap, HashMap};
use std::os::fd::AsFd;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

use serde::Serialize;

use crate::attach::Attachment;
use crate::beneath::{self, Beneath, Kind};
use crate::staged::{AccessKind, AttachKind, StagePhase, StagedVolume};

/// What the kernel shows, read into records.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Found {
    /// Records proven from the kernel, for volumes that have none.
    pub adopted: Vec<StagedVolume>,
    /// What the kernel shows of pool volumes that could not be proven to be
    /// a staged volume, each described; left alone.
    pub refused: Vec<String>,
}

/// One mount under the kubelet root, as mountinfo lists it and the
/// descriptor proves it.
struct Seen {
    path: PathBuf,
    node: beneath::Node,
    read_only: bool,
    fs_type: String,
}

/// Reads the kernel: every device serving an image in `pool_dir`, and its
/// mounts under `kubelet_root`. Volumes for which `has_record` is true are
/// skipped (their records stand). Changes nothing.
pub fn from_kernel(pool_dir: &Path, kubelet_root: &Path, has_record: &dyn Fn(&str) -> bool) -> Found {
    let mut out = Found::default();
    let images = pool_images(pool_dir);
    // Devices by volume.
    let mut devices: BTreeMap<String, Vec<Attachment>> = BTreeMap::new();
    for (n, (dev, ino)) in loop_backings() {
        if let Some(id) = images.get(&(dev, ino)) {
            match crate::attach::prove_loop(n, &pool_dir.join(format!("{id}{}", crate::pool::IMAGE))) {
                crate::attach::DeviceProof::Ours(a) => devices.entry(id.clone()).or_default().push(a),
                crate::attach::DeviceProof::Unsettled(why) => out.refused.push(format!("/dev/loop{n} serves {id}'s image but {why}")),
                // Backed by the image's inode under another name: a
                // hard link or a renamed file; not proven ours.
                crate::attach::DeviceProof::Gone => {
                    out.refused.push(format!("/dev/loop{n} is backed by {id}'s image's inode under another path; not adopted"))
                }
            }
        }
    }
    let ids: std::collections::HashSet<&String> = images.values().collect();
    for (n, backend) in nbd_backends() {
        if ids.contains(&backend) {
            match crate::attach::nbd_existing(n, &backend) {
                Some(a) => devices.entry(backend).or_default().push(a),
                None => out.refused.push(format!("/dev/nbd{n} carried {backend} but changed while read")),
            }
        } else {
            out.refused.push(format!(
                "/dev/nbd{n} carries backend {backend:?}, not a volume of this node's pool (a remote volume's export cannot be proven from the kernel); not adopted"
            ));
        }
    }
    let mounts = mounts_under(kubelet_root);
    for (id, atts) in devices {
        if has_record(&id) {
            continue;
        }
        if atts.len() != 1 {
            let names: Vec<String> = atts.iter().map(|a| a.path().display().to_string()).collect();
            out.refused.push(format!("{id}: served by {} devices ({}); not adopted", names.len(), names.join(", ")));
            continue;
        }
        match adopt(&id, atts[0], pool_dir, kubelet_root, &mounts) {
            Ok(r) => out.adopted.push(r),
            Err(why) => out.refused.push(format!("{id} on {}: {why}", atts[0].path().display())),
        }
    }
    out
}

fn adopt(id: &str, att: Attachment, pool_dir: &Path, root: &Path, mounts: &[Seen]) -> Result<StagedVolume, String> {
    let fs: Vec<&Seen> = mounts.iter().filter(|m| m.node.kind == Kind::Dir && m.node.dev == att.dev).collect();
    let blk: Vec<&Seen> = mounts.iter().filter(|m| m.node.kind == Kind::BlockDevice && m.node.rdev == att.dev).collect();
    let pods = root.join("pods");
    let (access, staging, staged_at, targets) = match (fs.is_empty(), blk.is_empty()) {
        (true, true) => {
            return Err("attached but mounted nowhere under the kubelet root (an interrupted stage, or an orphan); not adopted".into())
        }
        (false, false) => return Err("both mounted as a filesystem and bound as a device node; not adopted".into()),
        (false, true) => {
            let (targets, staging): (Vec<&Seen>, Vec<&Seen>) = fs.into_iter().partition(|m| m.path.starts_with(&pods));
            let [s] = staging.as_slice() else { return Err(candidates(&staging)) };
            (AccessKind::Mount { fs_type: s.fs_type.clone(), flags: Vec::new() }, s.path.clone(), *s, targets)
        }
        (true, false) => {
            let (targets, staging): (Vec<&Seen>, Vec<&Seen>) = blk.into_iter().partition(|m| m.path.starts_with(&pods));
            let [s] = staging.as_slice() else { return Err(candidates(&staging)) };
            if s.path.file_name().map(|n| n.as_bytes()) != Some(id.as_bytes()) {
                return Err(format!("the device node is bound at {}, not at a file named after the volume; not adopted", s.path.display()));
            }
            let dir = s.path.parent().ok_or("a bound node with no parent")?.to_path_buf();
            (AccessKind::Block, dir, *s, targets)
        }
    };
    Ok(StagedVolume {
        volume_id: id.to_string(),
        image: pool_dir.join(format!("{id}{}", crate::pool::IMAGE)),
        staging_path: staging,
        access,
        read_only: staged_at.read_only,
        phase: StagePhase::Staged,
        loop_number: (att.kind == AttachKind::Loop).then_some(att.number),
        attach: att.kind,
        nbd_index: (att.kind == AttachKind::Nbd).then_some(att.number),
        published: targets.iter().map(|t| (t.path.clone(), t.read_only)).collect(),
        remote: None,
    })
}

fn candidates(staging: &[&Seen]) -> String {
    if staging.is_empty() {
        return "mounted only under pods/ (publish targets with no staging mount); not adopted".into();
    }
    let paths: Vec<String> = staging.iter().map(|m| m.path.display().to_string()).collect();
    format!("{} mounts outside pods/ could each be the staging mount ({}); not adopted", paths.len(), paths.join(", "))
}

/// Pool images by the (device, inode) of the file.
fn pool_images(dir: &Path) -> HashMap<Backing, String> {
    let mut out = HashMap::new();
    for e in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        let name = e.file_name();
        let Some(id) = name.to_str().and_then(|n| n.strip_suffix(crate::pool::IMAGE)).filter(|n| !n.starts_with('.')) else { continue };
        let Ok(st) = rustix::fs::statx(rustix::fs::CWD, e.path(), rustix::fs::AtFlags::SYMLINK_NOFOLLOW, rustix::fs::StatxFlags::INO)
        else {
            continue;
        };
        out.insert(((st.stx_dev_major, st.stx_dev_minor), st.stx_ino), id.to_string());
    }
    out
}

/// A backing file: its filesystem's device (major, minor) and its inode.
type Backing = ((u32, u32), u64);

/// Every attached loop device and its backing file's (device, inode), as
/// the device itself says.
fn loop_backings() -> Vec<(u32, Backing)> {
    let mut out = Vec::new();
    for e in std::fs::read_dir("/sys/block").into_iter().flatten().flatten() {
        let Some(n) = e.file_name().to_str().and_then(|s| s.strip_prefix("loop")).and_then(|s| s.parse::<u32>().ok()) else { continue };
        let Ok(f) = std::fs::File::open(format!("/dev/loop{n}")) else { continue };
        if let Ok(Some(s)) = volring_sys::loopdev::status(f.as_fd()) {
            out.push((n, (s.backing_dev, s.backing_inode)));
        }
    }
    out.sort();
    out
}

/// Every nbd device with a backend identifier, and the identifier.
fn nbd_backends() -> Vec<(u32, String)> {
    let mut out = Vec::new();
    for e in std::fs::read_dir("/sys/block").into_iter().flatten().flatten() {
        let Some(n) = e.file_name().to_str().and_then(|s| s.strip_prefix("nbd")).and_then(|s| s.parse::<u32>().ok()) else { continue };
        if let Some(b) = volring_nbd::attach::read_backend(Path::new("/sys/block"), n) {
            out.push((n, b));
        }
    }
    out.sort();
    out
}

/// The mounts under `root` (mountinfo says where to look), each opened
/// beneath the root and judged by its descriptor: only a mount's root is
/// kept. The read-only flag and the filesystem type come from mountinfo.
fn mounts_under(root: &Path) -> Vec<Seen> {
    let Ok(beneath) = Beneath::open(root) else { return Vec::new() };
    let real = std::fs::canonicalize(root).unwrap_or_else(|_| root.to_path_buf());
    let mut info = Vec::new();
    let Ok(f) = std::fs::File::open("/proc/thread-self/mountinfo") else { return Vec::new() };
    if volring_mounts::read_mountinfo(f, &mut info).is_err() {
        return Vec::new();
    }
    let mut by_path: BTreeMap<PathBuf, (bool, String)> = BTreeMap::new();
    for m in volring_mounts::mountinfo_lines(&info).flatten() {
        let point = PathBuf::from(std::ffi::OsStr::from_bytes(&volring_mounts::unescape(m.mount_point)));
        let Ok(rel) = point.strip_prefix(&real) else { continue };
        if rel.as_os_str().is_empty() {
            continue;
        }
        let ro = m.options.split(|&b| b == b',').any(|o| o == b"ro");
        // The last line for a path is its top mount.
        by_path.insert(root.join(rel), (ro, String::from_utf8_lossy(m.fs_type).into_owned()));
    }
    let mut out = Vec::new();
    for (path, (read_only, fs_type)) in by_path {
        let Ok(Some(fd)) = beneath.open_path(&path) else { continue };
        let Ok(node) = beneath::stat(fd.as_fd()) else { continue };
        if node.mount_root {
            out.push(Seen { path, node, read_only, fs_type });
        }
    }
    out
}
