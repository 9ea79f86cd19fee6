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
use volring_volumes::filesystem::FsKind;
use volring_volumes::mounting::MountOptions;

pub(crate) const MAX_ID_LEN: usize = 128;
pub(crate) const MAX_PATH_LEN: usize = 4096;
/// The size of a volume created without a capacity range.
pub(crate) const DEFAULT_SIZE: u64 = 1 << 30;
/// The largest volume volring creates whatever the pool's filesystem allows
/// (a policy ceiling; the filesystem's own limit, probed when the pool
/// opens, is often lower: ext4 with 4 KiB blocks holds files up to 16 TiB).
pub(crate) const MAX_SIZE: u64 = 64 << 40;
const MIB: u64 = 1 << 20;

/// Volume ids name files in the pool and state directories, so they are
/// restricted to a charset that cannot name anything else.
pub(crate) fn volume_id(id: &str) -> Result<()> {
    safe_name(id, "volume_id")
}

/// Volume names become ids (CreateVolume is idempotent by name), so the same
/// rules apply; Kubernetes names (`pvc-<uid>`) pass.
pub(crate) fn volume_name(name: &str) -> Result<()> {
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
pub(crate) fn path_under(p: &str, root: &Path, what: &str) -> Result<PathBuf> {
    let out = absolute(p, what)?;
    if out == root || !out.starts_with(root) {
        return Err(Error::InvalidArgument(format!("{what} {p:?} is not inside {}", root.display())));
    }
    Ok(out)
}

/// Checks that `p` is an absolute path with no `..` and returns it
/// normalised.
pub(crate) fn absolute(p: &str, what: &str) -> Result<PathBuf> {
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
pub(crate) enum AccessType {
    Block,
    Mount { fs: FsKind, flags: Vec<String>, options: MountOptions },
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Access {
    pub(crate) access: AccessType,
    pub(crate) mode: Mode,
}

impl Access {
    /// A reader-only access mode: the volume is attached and mounted
    /// read-only.
    pub(crate) fn read_only(&self) -> bool {
        matches!(self.mode, Mode::SingleNodeReaderOnly | Mode::MultiNodeReaderOnly)
    }

    pub(crate) fn is_mount(&self) -> bool {
        matches!(self.access, AccessType::Mount { .. })
    }

    /// A shared (ReadWriteMany) volume: the node holding it exports its
    /// staged filesystem over NFS and other nodes mount that export.
    pub(crate) fn shared(&self) -> bool {
        self.mode == Mode::MultiNodeMultiWriter
    }
}

/// Validates one capability. Volumes live on one node: the single-node
/// modes are served there, and MULTI_NODE_MULTI_WRITER is served to the
/// other nodes over NFS, which carries a filesystem, so only as a mount
/// volume. The other multi-node modes are refused.
pub(crate) fn capability(cap: Option<&VolumeCapability>) -> Result<Access> {
    let cap = cap.ok_or_else(|| Error::InvalidArgument("volume_capability is required".into()))?;
    let mode = cap.access_mode.as_ref().ok_or_else(|| Error::InvalidArgument("volume_capability.access_mode is required".into()))?;
    let mode = Mode::try_from(mode.mode).map_err(|_| Error::InvalidArgument(format!("unknown access mode {}", mode.mode)))?;
    match mode {
        Mode::SingleNodeWriter | Mode::SingleNodeReaderOnly | Mode::SingleNodeSingleWriter | Mode::SingleNodeMultiWriter => {}
        Mode::MultiNodeMultiWriter => {}
        Mode::Unknown => return Err(Error::InvalidArgument("volume_capability.access_mode is required".into())),
        m => {
            return Err(Error::InvalidArgument(format!(
            "access mode {} is not supported: volumes are node-local, and only MULTI_NODE_MULTI_WRITER mount volumes are shared (over NFS)",
            m.as_str_name()
        )))
        }
    }
    let read_only = matches!(mode, Mode::SingleNodeReaderOnly);
    let access = match &cap.access_type {
        None => return Err(Error::InvalidArgument("volume_capability needs block or mount".into())),
        Some(ProtoAccessType::Block(_)) if mode == Mode::MultiNodeMultiWriter => {
            return Err(Error::InvalidArgument(
                "MULTI_NODE_MULTI_WRITER needs a mount volume: shared volumes are exported over NFS, which carries a filesystem, not a block device"
                    .into(),
            ))
        }
        Some(ProtoAccessType::Block(_)) => AccessType::Block,
        Some(ProtoAccessType::Mount(m)) => {
            let fs = m
                .fs_type
                .parse::<FsKind>()
                .map_err(|()| Error::InvalidArgument(format!("fs_type {:?} is not supported (ext4 or xfs)", m.fs_type)))?;
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
pub(crate) fn capabilities(caps: &[VolumeCapability]) -> Result<Vec<Access>> {
    if caps.is_empty() {
        return Err(Error::InvalidArgument("volume_capabilities is required".into()));
    }
    caps.iter().map(|c| capability(Some(c))).collect()
}

/// Checks a capacity range on its own: the CSI spec says neither field
/// may be negative, and a range whose floor is above its ceiling is no
/// range (both INVALID_ARGUMENT, the spec's code for an invalid field).
pub(crate) fn capacity_range(r: &CapacityRange) -> Result<()> {
    if r.required_bytes < 0 || r.limit_bytes < 0 {
        return Err(Error::InvalidArgument("capacity_range values must not be negative".into()));
    }
    if r.limit_bytes > 0 && r.required_bytes > r.limit_bytes {
        return Err(Error::InvalidArgument(format!("required_bytes {} exceeds limit_bytes {}", r.required_bytes, r.limit_bytes)));
    }
    Ok(())
}

/// The size to create: `required` (or the default) raised to `min`, rounded
/// up to a MiB, and never above `limit`; OutOfRange when no size fits or the
/// size is above `max`, the largest volume this pool can hold.
pub(crate) fn capacity(range: Option<&CapacityRange>, min: u64, max: u64) -> Result<u64> {
    if let Some(r) = range {
        capacity_range(r)?;
    }
    let (req, lim) = range.map(|r| (r.required_bytes as u64, r.limit_bytes as u64)).unwrap_or((0, 0));
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
    if size > max {
        return Err(Error::OutOfRange(format!("{size} bytes is above the largest volume this node can hold, {max} bytes")));
    }
    Ok(size)
}

/// Version tag and separator of a ListVolumes token.
const TOKEN_PREFIX: &str = "vr1.";
/// The longest token [`list_token`] makes: prefix, hex id, dot, checksum.
pub(crate) const MAX_TOKEN_LEN: usize = TOKEN_PREFIX.len() + 2 * MAX_ID_LEN + 1 + 8;

/// The ListVolumes token that resumes after volume `last_id`:
/// `vr1.<id in lowercase hex>.<FNV-1a 32 of what precedes, 8 hex digits>`.
///
/// The CSI spec has a CO restart listing (ABORTED) on a token the plugin
/// did not issue; a versioned, checksummed token is recognisably volring's,
/// where a bare id would accept any id-shaped string. It is not a secret:
/// it only carries a position, which the CO may learn anyway.
pub(crate) fn list_token(last_id: &str) -> String {
    let mut t = String::with_capacity(MAX_TOKEN_LEN);
    t.push_str(TOKEN_PREFIX);
    for b in last_id.bytes() {
        t.push_str(&format!("{b:02x}"));
    }
    let sum = fnv1a32(t.as_bytes());
    t.push_str(&format!(".{sum:08x}"));
    t
}

/// The volume id a token from [`list_token`] resumes after; ABORTED (the
/// spec's code for an invalid `starting_token`) for anything else. Pure and
/// bounded: never allocates more than the id it returns.
pub(crate) fn parse_list_token(token: &str) -> Result<String> {
    let bad = |why: &str| Error::Aborted(format!("starting_token ({} bytes) is not one volring issued: {why}", token.len()));
    if token.len() > MAX_TOKEN_LEN {
        return Err(bad("too long"));
    }
    let (body, sum) = token.rsplit_once('.').ok_or_else(|| bad("no checksum"))?;
    let hex = body.strip_prefix(TOKEN_PREFIX).ok_or_else(|| bad("unknown version"))?;
    let lower_hex = |s: &str| s.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'));
    if sum.len() != 8 || !lower_hex(sum) || hex.len() % 2 != 0 || !lower_hex(hex) {
        return Err(bad("malformed"));
    }
    if u32::from_str_radix(sum, 16).ok() != Some(fnv1a32(body.as_bytes())) {
        return Err(bad("checksum mismatch"));
    }
    let bytes: Vec<u8> = hex.as_bytes().chunks(2).filter_map(|p| u8::from_str_radix(std::str::from_utf8(p).ok()?, 16).ok()).collect();
    let id = String::from_utf8(bytes).map_err(|_| bad("not text"))?;
    volume_id(&id).map_err(|_| bad("not a volume id"))?;
    Ok(id)
}

/// FNV-1a, 32 bits: a short checksum that tells a token volring issued from
/// a string that merely looks like one.
fn fnv1a32(bytes: &[u8]) -> u32 {
    bytes.iter().fold(0x811c_9dc5u32, |h, &b| (h ^ b as u32).wrapping_mul(0x0100_0193))
}

/// The `csi_request` fuzz target's entry: `data` is a selector byte and a
/// CSI request's bytes; the request is decoded and its fields validated the
/// way the calls do. Whatever arrives, validation answers without
/// panicking, and what it accepts keeps its promises: paths stay inside
/// the kubelet root with no `..`, sizes respect the range and the limits
/// (a broken promise panics, which the fuzzer reports).
pub fn fuzz_request(data: &[u8]) {
    use super::proto::{ControllerExpandVolumeRequest, CreateVolumeRequest, NodePublishVolumeRequest, NodeStageVolumeRequest};
    use prost::Message;
    use std::path::Component;
    const ROOT: &str = "/var/lib/kubelet";
    let path = |p: &str| {
        if let Ok(ok) = path_under(p, Path::new(ROOT), "path") {
            assert!(ok.starts_with(ROOT) && ok != Path::new(ROOT), "{p:?} -> {ok:?}");
            assert!(ok.components().all(|c| matches!(c, Component::RootDir | Component::Normal(_))), "{ok:?}");
        }
    };
    let id = |s: &str| {
        if volume_id(s).is_ok() {
            assert!(!s.is_empty() && s.len() <= MAX_ID_LEN && !s.contains('/') && s != "." && s != "..");
        }
    };
    let Some((&which, rest)) = data.split_first() else { return };
    match which % 4 {
        0 => {
            if let Ok(r) = NodeStageVolumeRequest::decode(rest) {
                id(&r.volume_id);
                path(&r.staging_target_path);
                let _ = capability(r.volume_capability.as_ref());
            }
        }
        1 => {
            if let Ok(r) = NodePublishVolumeRequest::decode(rest) {
                id(&r.volume_id);
                path(&r.staging_target_path);
                path(&r.target_path);
                if let Ok(a) = capability(r.volume_capability.as_ref()) {
                    let _ = (a.read_only(), a.is_mount());
                }
            }
        }
        2 => {
            if let Ok(r) = CreateVolumeRequest::decode(rest) {
                let _ = volume_name(&r.name);
                let _ = capabilities(&r.volume_capabilities);
                let min = 16 << 20;
                // A pool whose filesystem holds less than the policy ceiling
                // (ext4's 16 TiB), as well as one that holds more.
                let max = if which & 0x80 != 0 { (16 << 40) - (1 << 20) } else { MAX_SIZE };
                if let Ok(size) = capacity(r.capacity_range.as_ref(), min, max) {
                    assert!(size >= min && size <= max && size % 4096 == 0);
                    if let Some(c) = &r.capacity_range {
                        assert!(size >= c.required_bytes as u64);
                        assert!(c.limit_bytes == 0 || size <= c.limit_bytes as u64);
                    }
                }
            }
        }
        _ => {
            if let Ok(r) = ControllerExpandVolumeRequest::decode(rest) {
                id(&r.volume_id);
                if let Some(c) = &r.capacity_range {
                    if capacity_range(c).is_ok() {
                        assert!(c.required_bytes >= 0 && c.limit_bytes >= 0);
                    }
                }
                let _ = capacity(r.capacity_range.as_ref(), 0, MAX_SIZE);
            }
        }
    }
}

/// The `list_token` fuzz target's entry: whatever string a CO sends as a
/// ListVolumes `starting_token`, the parser answers without panicking,
/// accepts only what volring issued (a token it accepts is exactly the one
/// `list_token` makes for the id it yields), and every id's token parses
/// back to the id (a broken promise panics).
pub fn fuzz_list_token(s: &str) {
    if let Ok(id) = parse_list_token(s) {
        assert!(volume_id(&id).is_ok(), "{s:?} -> {id:?}");
        assert_eq!(list_token(&id), s, "tokens are canonical");
    }
    if volume_id(s).is_ok() {
        let t = list_token(s);
        assert!(t.len() <= MAX_TOKEN_LEN);
        assert_eq!(parse_list_token(&t).ok().as_deref(), Some(s));
    }
}

#[cfg(test)]
mod tests {
    use super::super::proto::volume_capability::{AccessMode, BlockVolume, MountVolume};
    use super::*;

    /// The fuzz entries' promises hold on a few fixed inputs (a run of the
    /// fuzzer tries many more).
    #[test]
    fn fuzz_entries_hold_on_samples() {
        for s in ["", "pvc-1", "vr1.", "vr1.70.00000000", "../x"] {
            fuzz_list_token(s);
        }
        fuzz_list_token(&list_token("pvc-1"));
        for which in 0u8..4 {
            fuzz_request(&[which]);
            // volume_id "a/b" (field 1), then a path "../x" (field 2).
            fuzz_request(&[which, 0x0a, 3, b'a', b'/', b'b', 0x12, 4, b'.', b'.', b'/', b'x']);
        }
    }

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
        // Shared volumes: a mount volume only; the other multi-node modes stay refused.
        let rwx = capability(Some(&cap(Mode::MultiNodeMultiWriter, mount("ext4", &[])))).unwrap();
        assert!(rwx.shared() && rwx.is_mount() && !rwx.read_only());
        assert!(!ok.shared());
        let block_rwx = capability(Some(&cap(Mode::MultiNodeMultiWriter, Some(ProtoAccessType::Block(BlockVolume {})))));
        assert!(
            matches!(&block_rwx, Err(Error::InvalidArgument(m)) if m.contains("MULTI_NODE_MULTI_WRITER") && m.contains("mount")),
            "{block_rwx:?}"
        );
        for m in [Mode::MultiNodeReaderOnly, Mode::MultiNodeSingleWriter] {
            assert!(matches!(capability(Some(&cap(m, mount("", &[])))), Err(Error::InvalidArgument(_))), "{m:?}");
        }
        assert!(capability(Some(&cap(Mode::SingleNodeWriter, mount("vfat", &[])))).is_err());
        assert!(capability(Some(&cap(Mode::SingleNodeWriter, mount("ext4", &["bind"])))).is_err());
        assert!(capabilities(&[]).is_err());
        let weird = VolumeCapability { access_type: mount("", &[]), access_mode: Some(AccessMode { mode: 99 }) };
        assert!(capability(Some(&weird)).is_err());
    }

    #[test]
    fn sizes() {
        let r = |req, lim| Some(CapacityRange { required_bytes: req, limit_bytes: lim });
        let capacity = |r: Option<&CapacityRange>, min| capacity(r, min, MAX_SIZE);
        assert_eq!(capacity(None, 16 * MIB).unwrap(), DEFAULT_SIZE);
        assert_eq!(capacity(r(1, 0).as_ref(), 16 * MIB).unwrap(), 16 * MIB);
        assert_eq!(capacity(r((100 * MIB + 1) as i64, 0).as_ref(), 0).unwrap(), 101 * MIB);
        // Rounding would pass the limit: the limit, 4 KiB aligned, is taken.
        assert_eq!(capacity(r((100 * MIB + 1) as i64, (100 * MIB + 8192) as i64).as_ref(), 0).unwrap(), 100 * MIB + 8192);
        assert!(matches!(capacity(r(0, (8 * MIB) as i64).as_ref(), 16 * MIB), Err(Error::OutOfRange(_))));
        assert!(matches!(capacity(r(-1, 0).as_ref(), 0), Err(Error::InvalidArgument(_))));
        assert!(matches!(capacity(r(0, -1).as_ref(), 0), Err(Error::InvalidArgument(_))));
        assert!(matches!(capacity(r(10, 5).as_ref(), 0), Err(Error::InvalidArgument(_))));
        assert!(matches!(capacity(r(i64::MAX, 0).as_ref(), 0), Err(Error::OutOfRange(_))));
        assert_eq!(capacity(r(0, (2 * MIB) as i64).as_ref(), MIB).unwrap(), 2 * MIB);
        // The pool's own ceiling is honoured.
        assert_eq!(super::capacity(r((16 * MIB) as i64, 0).as_ref(), 0, 16 * MIB).unwrap(), 16 * MIB);
        assert!(matches!(super::capacity(r((16 * MIB + 1) as i64, 0).as_ref(), 0, 16 * MIB), Err(Error::OutOfRange(_))));
    }

    #[test]
    fn list_tokens() {
        for id in ["a", "pvc-0b5c2a8e-1d4f-4a4e-9f0e-3f1c2d3e4f5a", &"z".repeat(MAX_ID_LEN)] {
            let t = list_token(id);
            assert!(t.len() <= MAX_TOKEN_LEN);
            assert_eq!(parse_list_token(&t).unwrap(), id);
        }
        let good = list_token("pvc-1");
        let flipped = format!("{}{}", &good[..good.len() - 1], if good.ends_with('0') { '1' } else { '0' });
        let upper = good.to_uppercase();
        let other_version = good.replacen("vr1.", "vr2.", 1);
        for bad in ["", "pvc-1", "vr1.", "vr1..", "vr1.7.00000000", &flipped, &upper, &other_version, &"vr1.".repeat(100)] {
            assert!(matches!(parse_list_token(bad), Err(Error::Aborted(_))), "{bad:?}");
        }
        // A checksummed token whose id is not a volume id is refused too.
        let mut sneaky = String::from(TOKEN_PREFIX);
        for b in b"../x" {
            sneaky.push_str(&format!("{b:02x}"));
        }
        let sum = fnv1a32(sneaky.as_bytes());
        assert!(parse_list_token(&format!("{sneaky}.{sum:08x}")).is_err());
    }
}
