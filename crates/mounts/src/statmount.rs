//! Decoding a `statmount(2)` reply into a [`Mount`] — pure, over bytes.
//!
//! Layout from include/uapi/linux/mount.h (`struct statmount`): a 512-byte
//! fixed part, then NUL-terminated strings addressed by offsets relative to
//! the end of the fixed part. The options are rendered the way mountinfo
//! writes them so that both sources give comparable tables.
//!
//! Strings are taken as the kernel gives them. The mount point, root, source
//! and subtype come back raw (the kernel undoes its own escaping of root and
//! source before replying), so unescaping them again would corrupt a name
//! that holds the text `\040`. Only the superblock options come back
//! octal-escaped, exactly as in mountinfo, and are unescaped like there.

use super::escape::unescape;
use super::mount::{DevNum, Field, Mount, MountBuilder, Propagation};
use super::Error;

/// `STATMOUNT_*` bits (include/uapi/linux/mount.h): what a request asks
/// for and a reply's `mask` says it holds; part of the reply's layout.
mod mask {
    pub(super) const SB_BASIC: u64 = 0x1;
    pub(super) const MNT_BASIC: u64 = 0x2;
    pub(super) const PROPAGATE_FROM: u64 = 0x4;
    pub(super) const MNT_ROOT: u64 = 0x8;
    pub(super) const MNT_POINT: u64 = 0x10;
    pub(super) const FS_TYPE: u64 = 0x20;
    pub(super) const MNT_OPTS: u64 = 0x80;
    pub(super) const FS_SUBTYPE: u64 = 0x100;
    pub(super) const SB_SOURCE: u64 = 0x200;
}

/// Everything the watcher asks for: all that a mountinfo line holds.
pub(crate) const FULL_MASK: u64 = mask::SB_BASIC
    | mask::MNT_BASIC
    | mask::PROPAGATE_FROM
    | mask::MNT_ROOT
    | mask::MNT_POINT
    | mask::FS_TYPE
    | mask::MNT_OPTS
    | mask::FS_SUBTYPE
    | mask::SB_SOURCE;

const FIXED: usize = 512;

const MOUNT_ATTR_RDONLY: u64 = 0x1;
const MOUNT_ATTR_NOSUID: u64 = 0x2;
const MOUNT_ATTR_NODEV: u64 = 0x4;
const MOUNT_ATTR_NOEXEC: u64 = 0x8;
const MOUNT_ATTR_ATIME: u64 = 0x70;
const MOUNT_ATTR_RELATIME: u64 = 0x0;
const MOUNT_ATTR_NOATIME: u64 = 0x10;
const MOUNT_ATTR_NODIRATIME: u64 = 0x80;
const MOUNT_ATTR_IDMAP: u64 = 0x0010_0000;
const MOUNT_ATTR_NOSYMFOLLOW: u64 = 0x0020_0000;

const MS_UNBINDABLE: u64 = 1 << 17;
const MS_SLAVE: u64 = 1 << 19;
const MS_SHARED: u64 = 1 << 20;

const SB_RDONLY: u32 = 0x1;
const SB_SYNCHRONOUS: u32 = 0x10;
const SB_DIRSYNC: u32 = 0x80;
const SB_LAZYTIME: u32 = 1 << 25;

fn u32_at(b: &[u8], off: usize) -> Result<u32, Error> {
    b.get(off..off + 4)
        .map(|s| u32::from_ne_bytes(s.try_into().expect("4 bytes")))
        .ok_or(Error::Statmount("reply shorter than its fixed part"))
}

fn u64_at(b: &[u8], off: usize) -> Result<u64, Error> {
    b.get(off..off + 8)
        .map(|s| u64::from_ne_bytes(s.try_into().expect("8 bytes")))
        .ok_or(Error::Statmount("reply shorter than its fixed part"))
}

/// The string at `str_off` (offset into the string area), or empty when the
/// kernel did not report `bit`.
fn string(b: &[u8], got: u64, bit: u64, str_off_at: usize) -> Result<&[u8], Error> {
    if got & bit == 0 {
        return Ok(b"");
    }
    let off = FIXED + u32_at(b, str_off_at)? as usize;
    let area = b.get(off..).ok_or(Error::Statmount("string offset past the end"))?;
    let end = area.iter().position(|&c| c == 0).ok_or(Error::Statmount("string not terminated"))?;
    Ok(&area[..end])
}

/// Per-mount options as mountinfo's `show_mnt_opts` writes them.
fn mount_options(attr: u64) -> String {
    let mut s = String::from(if attr & MOUNT_ATTR_RDONLY != 0 { "ro" } else { "rw" });
    let atime = attr & MOUNT_ATTR_ATIME;
    for (on, name) in [
        (attr & MOUNT_ATTR_NOSUID != 0, ",nosuid"),
        (attr & MOUNT_ATTR_NODEV != 0, ",nodev"),
        (attr & MOUNT_ATTR_NOEXEC != 0, ",noexec"),
        (atime == MOUNT_ATTR_NOATIME, ",noatime"),
        (attr & MOUNT_ATTR_NODIRATIME != 0, ",nodiratime"),
        (atime == MOUNT_ATTR_RELATIME, ",relatime"),
        (attr & MOUNT_ATTR_NOSYMFOLLOW != 0, ",nosymfollow"),
        (attr & MOUNT_ATTR_IDMAP != 0, ",idmapped"),
    ] {
        if on {
            s.push_str(name);
        }
    }
    s
}

/// Decodes one reply. `buf` is exactly what the kernel reported (its `size`).
pub fn decode(buf: &[u8]) -> Result<Mount, Error> {
    if buf.len() < FIXED {
        return Err(Error::Statmount("reply shorter than its fixed part"));
    }
    let got = u64_at(buf, 8)?;
    if got & mask::MNT_BASIC == 0 {
        return Err(Error::Statmount("no basic mount information"));
    }
    let dev = DevNum { major: u32_at(buf, 16)?, minor: u32_at(buf, 20)? };
    let sb_flags = u32_at(buf, 32)?;
    let id = u64_at(buf, 40)?;
    let parent = u64_at(buf, 48)?;
    let info_id = u32_at(buf, 56)?;
    let attr = u64_at(buf, 64)?;
    let prop = u64_at(buf, 72)?;
    let master = (prop & MS_SLAVE != 0).then_some(u64_at(buf, 88)?);
    let from = u64_at(buf, 96)?;
    let propagation = Propagation {
        shared: (prop & MS_SHARED != 0).then_some(u64_at(buf, 80)?),
        master,
        propagate_from: (got & mask::PROPAGATE_FROM != 0 && from != 0 && Some(from) != master).then_some(from),
        unbindable: prop & MS_UNBINDABLE != 0,
    };
    let root = string(buf, got, mask::MNT_ROOT, 104)?;
    let point = string(buf, got, mask::MNT_POINT, 108)?;
    let fs_type = string(buf, got, mask::FS_TYPE, 36)?;
    let subtype = string(buf, got, mask::FS_SUBTYPE, 120)?;
    let source = string(buf, got, mask::SB_SOURCE, 124)?;
    // The one string the kernel escapes (`seq_show_option`), as mountinfo does.
    let fs_opts = unescape(string(buf, got, mask::MNT_OPTS, 4)?);
    let options = mount_options(attr);

    let mut sup = String::from(if sb_flags & SB_RDONLY != 0 { "ro" } else { "rw" });
    for (bit, name) in [(SB_SYNCHRONOUS, ",sync"), (SB_DIRSYNC, ",dirsync"), (SB_LAZYTIME, ",lazytime")] {
        if sb_flags & bit != 0 {
            sup.push_str(name);
        }
    }

    let mut b = MountBuilder::with_capacity(
        root.len() + point.len() + options.len() + fs_type.len() + subtype.len() + source.len() + sup.len() + fs_opts.len() + 3,
    );
    b.push(Field::Root, root);
    b.push(Field::MountPoint, point);
    b.push(Field::Options, options.as_bytes());
    b.push(Field::FsType, fs_type);
    if !subtype.is_empty() {
        b.extend_last(b".");
        b.extend_last(subtype);
    }
    b.push(Field::Source, if got & mask::SB_SOURCE != 0 && !source.is_empty() { source } else { b"none" });
    b.push(Field::SuperOptions, sup.as_bytes());
    if !fs_opts.is_empty() {
        b.extend_last(b",");
        b.extend_last(&fs_opts);
    }
    Ok(b.finish(id, parent, Some(info_id), dev, propagation))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Builds a reply the way the kernel lays it out.
    fn reply(id: u64, point: &str, attr: u64, prop: u64, peer: u64, opts: &str) -> Vec<u8> {
        reply_with(id, b"/", point.as_bytes(), b"/dev/loop0", attr, prop, peer, opts.as_bytes())
    }

    #[allow(clippy::too_many_arguments)]
    fn reply_with(id: u64, root: &[u8], point: &[u8], source: &[u8], attr: u64, prop: u64, peer: u64, opts: &[u8]) -> Vec<u8> {
        let mut b = vec![0u8; FIXED];
        let mut strs = Vec::new();
        let mut put = |b: &mut Vec<u8>, at: usize, s: &[u8]| {
            b[at..at + 4].copy_from_slice(&(strs.len() as u32).to_ne_bytes());
            strs.extend_from_slice(s);
            strs.push(0);
        };
        put(&mut b, 4, opts);
        put(&mut b, 36, b"ext4");
        put(&mut b, 104, root);
        put(&mut b, 108, point);
        put(&mut b, 120, b"");
        put(&mut b, 124, source);
        let got = FULL_MASK;
        b[8..16].copy_from_slice(&got.to_ne_bytes());
        b[16..20].copy_from_slice(&7u32.to_ne_bytes());
        b[40..48].copy_from_slice(&id.to_ne_bytes());
        b[48..56].copy_from_slice(&1u64.to_ne_bytes());
        b[56..60].copy_from_slice(&33u32.to_ne_bytes());
        b[64..72].copy_from_slice(&attr.to_ne_bytes());
        b[72..80].copy_from_slice(&prop.to_ne_bytes());
        b[80..88].copy_from_slice(&peer.to_ne_bytes());
        b.extend_from_slice(&strs);
        let n = b.len() as u32;
        b[0..4].copy_from_slice(&n.to_ne_bytes());
        b
    }

    #[test]
    fn decodes_a_reply_like_mountinfo_would_show_it() {
        let r = reply(0x8000_0040, "/mnt/a\\040b", MOUNT_ATTR_RDONLY | MOUNT_ATTR_NOSUID, MS_SHARED, 5, "errors=remount-ro");
        let m = decode(&r).unwrap();
        assert_eq!(m.id, 0x8000_0040);
        assert_eq!(m.info_id, Some(33));
        assert_eq!(m.dev, DevNum { major: 7, minor: 0 });
        // statmount does not escape: this is a directory named `a\040b`.
        assert_eq!(m.mount_point(), b"/mnt/a\\040b");
        assert_eq!(m.options(), b"ro,nosuid,relatime");
        assert_eq!(m.fs_type(), b"ext4");
        assert_eq!(m.source(), b"/dev/loop0");
        assert_eq!(m.super_options(), b"rw,errors=remount-ro");
        assert_eq!(m.propagation.shared, Some(5));
    }

    /// The kernel returns mount point, root and source raw, and only the
    /// filesystem options octal-escaped (as mountinfo shows them).
    #[test]
    fn takes_names_raw_and_unescapes_only_fs_options() {
        let odd = b" sp\ttab\nnl\\bs\\040lit\xff";
        let with = |prefix: &[u8]| [prefix, odd].concat();
        let r = reply_with(7, &with(b"/sub"), &with(b"/mnt/p"), &with(b"src"), 0, 0, 0, b"lowerdir=/a\\040b\\134c");
        let m = decode(&r).unwrap();
        assert_eq!(m.root(), with(b"/sub"));
        assert_eq!(m.mount_point(), with(b"/mnt/p"));
        assert_eq!(m.source(), with(b"src"));
        assert_eq!(m.super_options(), b"rw,lowerdir=/a b\\c");
    }

    #[test]
    fn rejects_short_and_unterminated_replies() {
        assert!(decode(&[0u8; 100]).is_err());
        let mut r = reply(1, "/x", 0, 0, 0, "");
        r.truncate(r.len() - 1);
        assert!(decode(&r).is_err());
        let mut r = reply(1, "/x", 0, 0, 0, "");
        r[108..112].copy_from_slice(&u32::MAX.to_ne_bytes());
        assert!(decode(&r).is_err());
    }
}
