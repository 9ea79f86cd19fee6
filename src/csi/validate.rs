//! Request validation: pure functions over the fields of CSI requests.
//!
//! Everything a CO sends is checked here before anything touches the
//! machine, and the checks are the fuzz target's subject. A path that is
//! relative, holds `..`, or leaves the kubelet root is refused outright:
//! normalising `..` away would turn a hostile request into a valid one.

use std::path::{Path, PathBuf};

use super::proto::volume_capability::{access_mode::Mode, AccessType as ProtoAccessType};
use super::proto::{CapacityRange, VolumeCapability};
use super::{Error, Result};
use crate::volumes::{FsKind, MountOptions};

pub const MAX_ID_LEN: usize = 128;
pub const MAX_PATH_LEN: usize = 4096;
/// The size of a volume created without a capacity range.
pub const DEFAULT_SIZE: u64 = 1 << 30;
/// The largest image volring creates (ext4 with 4 KiB blocks tops out at
/// 16 TiB without the 64bit feature; the pool is sparse either way).
pub const MAX_SIZE: u64 = 64 << 40;
const MIB: u64 = 1 << 20;

/// Volume ids name files in the pool and state directories, so they are
/// restricted to a charset that cannot name anything else.
pub fn volume_id(id: &str) -> Result<()> {
    safe_name(id, "volume_id")
}

/// Volume names become ids (CreateVolume is idempotent by name), so the same
/// rules apply; Kubernetes names (`pvc-<uid>`) pass.
pub fn volume_name(name: &str) -> Result<()> {
    safe_name(name, "name")
}

fn safe_name(s: &str, what: &str) -> Result<()> {
    if s.is_empty() {
        return Err(Error::InvalidArgument(format!("{what} is required")));
    }
    if s.len() > MAX_ID_LEN {
        return Err(Error::InvalidArgument(format!("{what} is {} bytes; at most {MAX_ID_LEN}", s.len())));
    }
    if s.starts_with(['.', '-']) {
        return Err(Error::InvalidArgument(format!("{what} {s:?} must not start with '.' or '-'")));
    }
    if let Some(c) = s.chars().find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-'))) {
        return Err(Error::InvalidArgument(format!("{what} {s:?} has the character {c:?}; allowed are A-Z a-z 0-9 . _ -")));
    }
    Ok(())
}

/// Checks that `p` is an absolute path with no `..`, strictly inside
/// `root`, and returns it normalised (`//` and `.` removed).
pub fn path_under(p: &str, root: &Path, what: &str) -> Result<PathBuf> {
    let out = absolute(p, what)?;
    if out == root || !out.starts_with(root) {
        return Err(Error::InvalidArgument(format!("{what} {p:?} is not inside {}", root.display())));
    }
    Ok(out)
}

/// Checks that `p` is an absolute path with no `..` and returns it
/// normalised.
pub fn absolute(p: &str, what: &str) -> Result<PathBuf> {
    if p.is_empty() {
        return Err(Error::InvalidArgument(format!("{what} is required")));
    }
    if p.len() > MAX_PATH_LEN {
        return Err(Error::InvalidArgument(format!("{what} is {} bytes; at most {MAX_PATH_LEN}", p.len())));
    }
    if p.contains('\0') {
        return Err(Error::InvalidArgument(format!("{what} holds a NUL byte")));
    }
    if !p.starts_with('/') {
        return Err(Error::InvalidArgument(format!("{what} {p:?} is not absolute")));
    }
    let mut out = PathBuf::from("/");
    for c in p.split('/') {
        match c {
            "" | "." => {}
            ".." => return Err(Error::InvalidArgument(format!("{what} {p:?} contains '..'"))),
            c => out.push(c),
        }
    }
    Ok(out)
}

/// How a validated capability asks for the volume.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AccessType {
    Block,
    Mount { fs: FsKind, flags: Vec<String>, options: MountOptions },
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Access {
    pub access: AccessType,
    pub mode: Mode,
}

impl Access {
    /// A reader-only access mode: the volume is attached and mounted
    /// read-only.
    pub fn read_only(&self) -> bool {
        matches!(self.mode, Mode::SingleNodeReaderOnly | Mode::MultiNodeReaderOnly)
    }

    pub fn is_mount(&self) -> bool {
        matches!(self.access, AccessType::Mount { .. })
    }
}

/// Validates one capability. Volumes live on one node, so multi-node access
/// modes cannot be honoured and are refused.
pub fn capability(cap: Option<&VolumeCapability>) -> Result<Access> {
    let cap = cap.ok_or_else(|| Error::InvalidArgument("volume_capability is required".into()))?;
    let mode = cap.access_mode.as_ref().ok_or_else(|| Error::InvalidArgument("volume_capability.access_mode is required".into()))?;
    let mode = Mode::try_from(mode.mode).map_err(|_| Error::InvalidArgument(format!("unknown access mode {}", mode.mode)))?;
    match mode {
        Mode::SingleNodeWriter | Mode::SingleNodeReaderOnly | Mode::SingleNodeSingleWriter | Mode::SingleNodeMultiWriter => {}
        Mode::Unknown => return Err(Error::InvalidArgument("volume_capability.access_mode is required".into())),
        m => return Err(Error::InvalidArgument(format!("access mode {} is not supported: volumes are node-local", m.as_str_name()))),
    }
    let read_only = matches!(mode, Mode::SingleNodeReaderOnly);
    let access = match &cap.access_type {
        None => return Err(Error::InvalidArgument("volume_capability needs block or mount".into())),
        Some(ProtoAccessType::Block(_)) => AccessType::Block,
        Some(ProtoAccessType::Mount(m)) => {
            let fs = FsKind::parse(&m.fs_type)
                .ok_or_else(|| Error::InvalidArgument(format!("fs_type {:?} is not supported (ext4 or xfs)", m.fs_type)))?;
            if !m.volume_mount_group.is_empty() {
                return Err(Error::InvalidArgument("volume_mount_group is not supported".into()));
            }
            let options = MountOptions::parse(&m.mount_flags, read_only).map_err(Error::InvalidArgument)?;
            AccessType::Mount { fs, flags: m.mount_flags.clone(), options }
        }
    };
    Ok(Access { access, mode })
}

/// Validates a non-empty list of capabilities.
pub fn capabilities(caps: &[VolumeCapability]) -> Result<Vec<Access>> {
    if caps.is_empty() {
        return Err(Error::InvalidArgument("volume_capabilities is required".into()));
    }
    caps.iter().map(|c| capability(Some(c))).collect()
}

/// The size to create: `required` (or the default) raised to `min`, rounded
/// up to a MiB, and never above `limit`; OutOfRange when no size fits.
pub fn capacity(range: Option<&CapacityRange>, min: u64) -> Result<u64> {
    let (req, lim) = range.map(|r| (r.required_bytes, r.limit_bytes)).unwrap_or((0, 0));
    if req < 0 || lim < 0 {
        return Err(Error::InvalidArgument("capacity_range values must not be negative".into()));
    }
    let (req, lim) = (req as u64, lim as u64);
    if lim > 0 && req > lim {
        return Err(Error::InvalidArgument(format!("required_bytes {req} exceeds limit_bytes {lim}")));
    }
    let want = match (req, lim) {
        (0, 0) => DEFAULT_SIZE,
        (0, l) => DEFAULT_SIZE.min(l),
        (r, _) => r,
    }
    .max(min);
    if lim > 0 && want > lim {
        return Err(Error::OutOfRange(format!("limit_bytes {lim} is below the smallest volume, {min} bytes")));
    }
    let mut size = want.div_ceil(MIB).saturating_mul(MIB);
    if lim > 0 && size > lim {
        size = lim / 4096 * 4096;
        if size < want {
            return Err(Error::OutOfRange(format!("no 4 KiB-aligned size between {want} and {lim} bytes")));
        }
    }
    if size > MAX_SIZE {
        return Err(Error::OutOfRange(format!("{size} bytes is above the largest volume, {MAX_SIZE} bytes")));
    }
    Ok(size)
}

#[cfg(test)]
mod tests {
    use super::super::proto::volume_capability::{AccessMode, BlockVolume, MountVolume};
    use super::*;

    fn cap(mode: Mode, access: Option<ProtoAccessType>) -> VolumeCapability {
        VolumeCapability { access_type: access, access_mode: Some(AccessMode { mode: mode as i32 }) }
    }

    fn mount(fs: &str, flags: &[&str]) -> Option<ProtoAccessType> {
        Some(ProtoAccessType::Mount(MountVolume {
            fs_type: fs.into(),
            mount_flags: flags.iter().map(|s| s.to_string()).collect(),
            volume_mount_group: String::new(),
        }))
    }

    #[test]
    fn ids() {
        assert!(volume_id("pvc-0b5c2a8e-1d4f-4a4e-9f0e-3f1c2d3e4f5a").is_ok());
        for bad in ["", "../etc", "a/b", ".hidden", "-x", "a b", "ä", &"x".repeat(129)] {
            assert!(matches!(volume_id(bad), Err(Error::InvalidArgument(_))), "{bad:?}");
        }
    }

    #[test]
    fn paths() {
        let root = Path::new("/var/lib/kubelet");
        assert_eq!(path_under("/var/lib/kubelet//pods/./x/", root, "p").unwrap(), Path::new("/var/lib/kubelet/pods/x"));
        for bad in [
            "",
            "relative/x",
            "/var/lib/kubelet/../../etc",
            "/var/lib/kubelet",
            "/var/lib/kubeletx/a",
            "/etc/passwd",
            "/var/lib/kubelet/a\0b",
        ] {
            assert!(matches!(path_under(bad, root, "p"), Err(Error::InvalidArgument(_))), "{bad:?}");
        }
    }

    #[test]
    fn capabilities_checked() {
        let ok = capability(Some(&cap(Mode::SingleNodeWriter, mount("xfs", &["noatime"])))).unwrap();
        assert!(ok.is_mount() && !ok.read_only());
        let ro = capability(Some(&cap(Mode::SingleNodeReaderOnly, Some(ProtoAccessType::Block(BlockVolume {}))))).unwrap();
        assert!(ro.read_only() && !ro.is_mount());
        assert!(capability(None).is_err());
        assert!(capability(Some(&cap(Mode::SingleNodeWriter, None))).is_err());
        assert!(capability(Some(&cap(Mode::Unknown, mount("", &[])))).is_err());
        assert!(capability(Some(&cap(Mode::MultiNodeMultiWriter, mount("", &[])))).is_err());
        assert!(capability(Some(&cap(Mode::SingleNodeWriter, mount("vfat", &[])))).is_err());
        assert!(capability(Some(&cap(Mode::SingleNodeWriter, mount("ext4", &["bind"])))).is_err());
        assert!(capabilities(&[]).is_err());
        let weird = VolumeCapability { access_type: mount("", &[]), access_mode: Some(AccessMode { mode: 99 }) };
        assert!(capability(Some(&weird)).is_err());
    }

    #[test]
    fn sizes() {
        let r = |req, lim| Some(CapacityRange { required_bytes: req, limit_bytes: lim });
        assert_eq!(capacity(None, 16 * MIB).unwrap(), DEFAULT_SIZE);
        assert_eq!(capacity(r(1, 0).as_ref(), 16 * MIB).unwrap(), 16 * MIB);
        assert_eq!(capacity(r((100 * MIB + 1) as i64, 0).as_ref(), 0).unwrap(), 101 * MIB);
        // Rounding would pass the limit: the limit, 4 KiB aligned, is taken.
        assert_eq!(capacity(r((100 * MIB + 1) as i64, (100 * MIB + 8192) as i64).as_ref(), 0).unwrap(), 100 * MIB + 8192);
        assert!(matches!(capacity(r(0, (8 * MIB) as i64).as_ref(), 16 * MIB), Err(Error::OutOfRange(_))));
        assert!(matches!(capacity(r(-1, 0).as_ref(), 0), Err(Error::InvalidArgument(_))));
        assert!(matches!(capacity(r(10, 5).as_ref(), 0), Err(Error::InvalidArgument(_))));
        assert!(matches!(capacity(r(i64::MAX, 0).as_ref(), 0), Err(Error::OutOfRange(_))));
        assert_eq!(capacity(r(0, (2 * MIB) as i64).as_ref(), MIB).unwrap(), 2 * MIB);
    }
}
