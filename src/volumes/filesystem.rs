//! Probe, format and grow the filesystem on a volume's device.
//!
//! The rule that protects data: format only a device whose first 68 KiB are
//! all zero. A known filesystem is used as it is; anything else (a partition
//! table, LUKS, swap, unknown bytes) is refused, never overwritten.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::Path;

use crate::devices::probe::{probe, PROBE_LEN};

use super::{run, Error};

/// The filesystems volring formats.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FsKind {
    Ext4,
    Xfs,
}

impl FsKind {
    /// `""` means the default, ext4.
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "" | "ext4" => Some(FsKind::Ext4),
            "xfs" => Some(FsKind::Xfs),
            _ => None,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            FsKind::Ext4 => "ext4",
            FsKind::Xfs => "xfs",
        }
    }

    /// The smallest volume the filesystem can be made on (mkfs.xfs refuses
    /// less than 300 MiB).
    pub fn min_size(self) -> u64 {
        match self {
            FsKind::Ext4 => 16 << 20,
            FsKind::Xfs => 300 << 20,
        }
    }

    /// The mkfs command line. Tuned for large, sparse volumes: no discard
    /// pass (the image is already sparse; discarding terabytes takes
    /// minutes), lazy inode-table and journal init for ext4 (formatting is
    /// then seconds at any size), no root reserve (a volume is not a root
    /// filesystem), and 4 KiB blocks even on small volumes (mke2fs would
    /// pick 1 KiB, which caps how far the volume can later grow).
    pub fn mkfs_command(self, device: &str) -> (&'static str, Vec<String>) {
        match self {
            FsKind::Ext4 => (
                "mkfs.ext4",
                ["-F", "-q", "-b", "4096", "-m", "0", "-E", "lazy_itable_init=1,lazy_journal_init=1,nodiscard", device]
                    .map(String::from)
                    .to_vec(),
            ),
            FsKind::Xfs => ("mkfs.xfs", ["-f", "-q", "-K", device].map(String::from).to_vec()),
        }
    }
}

/// What a device holds, as far as staging is concerned.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Content {
    /// All zero where signatures live: safe to format.
    Blank,
    /// A filesystem, by blkid's name.
    Filesystem(&'static str),
    /// Something that must not be formatted over.
    Other(String),
}

/// Classifies the first [`PROBE_LEN`] bytes of a device (pure).
pub fn classify(head: &[u8]) -> Content {
    let found = probe(head, 512);
    if let Some(fs) = found.filesystem {
        return match fs.fstype.as_str() {
            t @ ("ext2" | "ext3" | "ext4" | "xfs" | "btrfs") => Content::Filesystem(t),
            other => Content::Other(other.to_string()),
        };
    }
    if let Some(t) = found.table {
        return Content::Other(format!("a {:?} partition table", t.table).to_lowercase());
    }
    if head.iter().all(|&b| b == 0) {
        Content::Blank
    } else {
        Content::Other("data of an unknown kind".to_string())
    }
}

/// Reads and classifies the start of `device`.
pub fn probe_device(device: &Path) -> Result<Content, Error> {
    let f = File::open(device).map_err(Error::io("open for probe", device))?;
    let mut head = vec![0u8; PROBE_LEN];
    let mut got = 0;
    while got < head.len() {
        match f.read_at(&mut head[got..], got as u64).map_err(Error::io("read for probe", device))? {
            0 => break,
            n => got += n,
        }
    }
    head.truncate(got);
    Ok(classify(&head))
}

pub fn format(kind: FsKind, device: &Path) -> Result<(), Error> {
    let dev = device.to_string_lossy();
    let (program, args) = kind.mkfs_command(&dev);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    run(program, &args)
}

/// Grows a mounted filesystem to fill its device: resize2fs works on the
/// device, xfs_growfs on the mount point.
pub fn grow(fs_type: &str, device: &Path, mounted_at: &Path) -> Result<(), Error> {
    match fs_type {
        // The kernel grows a mounted ext4 only for CAP_SYS_RESOURCE
        // (resize2fs then just says "Permission denied").
        "ext2" | "ext3" | "ext4" if !can_resize_ext4() => {
            Err(Error::Precondition("growing a mounted ext4 filesystem needs CAP_SYS_RESOURCE, which the agent does not have".into()))
        }
        "ext2" | "ext3" | "ext4" => run("resize2fs", &[&device.to_string_lossy()]),
        "xfs" => run("xfs_growfs", &["-d", &mounted_at.to_string_lossy()]),
        other => Err(Error::Precondition(format!("cannot grow a {other} filesystem"))),
    }
}

/// True when this process may grow a mounted ext4 filesystem.
pub fn can_resize_ext4() -> bool {
    rustix::thread::capabilities(None).is_ok_and(|c| c.effective.contains(rustix::thread::CapabilitySet::SYS_RESOURCE))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn formats_only_blank_devices() {
        assert_eq!(classify(&vec![0; PROBE_LEN]), Content::Blank);
        assert_eq!(classify(&[]), Content::Blank);
        let mut junk = vec![0; PROBE_LEN];
        junk[4000] = 1;
        assert!(matches!(classify(&junk), Content::Other(_)));
        let mut xfs = vec![0; PROBE_LEN];
        xfs[..4].copy_from_slice(b"XFSB");
        // A bare magic without a plausible superblock is not xfs: still refused.
        assert!(matches!(classify(&xfs), Content::Other(_) | Content::Filesystem("xfs")));
    }

    #[test]
    fn fs_kinds() {
        assert_eq!(FsKind::parse(""), Some(FsKind::Ext4));
        assert_eq!(FsKind::parse("xfs"), Some(FsKind::Xfs));
        assert_eq!(FsKind::parse("vfat"), None);
        let (p, a) = FsKind::Xfs.mkfs_command("/dev/loop3");
        assert_eq!(p, "mkfs.xfs");
        assert_eq!(a.last().map(String::as_str), Some("/dev/loop3"));
    }
}
