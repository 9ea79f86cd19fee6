//! Probe, format and grow the filesystem on a volume's device.
//!
//! The rule that protects data: format only a device whose first 68 KiB are
//! all zero. A known filesystem is used as it is; anything else (a partition
//! table, LUKS, swap, unknown bytes) is refused, never overwritten.

use std::fs::File;
use std::io::Write;
use std::os::fd::{AsRawFd, BorrowedFd};
use std::os::unix::fs::FileExt;
use std::path::Path;

use volring_devices::probe_reads;

use super::{run, Error};

/// The filesystems volring formats.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FsKind {
    Ext4,
    Xfs,
}

/// A CSI `fs_type` or StorageClass `fsType`; `""` means the default, ext4.
/// Anything else is refused (the caller says why in its own terms).
impl std::str::FromStr for FsKind {
    type Err = ();
    fn from_str(s: &str) -> Result<Self, ()> {
        match s {
            "" | "ext4" => Ok(FsKind::Ext4),
            "xfs" => Ok(FsKind::Xfs),
            _ => Err(()),
        }
    }
}

/// The filesystem's name as mkfs and mount(2) know it.
impl std::fmt::Display for FsKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FsKind {
    pub(crate) fn as_str(self) -> &'static str {
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
    /// pick 1 KiB, which caps how far the volume can later grow). xfs gets
    /// 4 KiB sectors whatever the device says: mkfs.xfs takes the sector
    /// size from the device it formats (512 B on a loop device), and the
    /// kernel refuses to mount an xfs whose sector size is smaller than
    /// the device's logical block size — the 4 KiB of an nbd device on
    /// another node, where the volume moves to (issue 17).
    pub(crate) fn mkfs_command(self, device: &str) -> (&'static str, Vec<String>) {
        match self {
            FsKind::Ext4 => (
                "mkfs.ext4",
                ["-F", "-q", "-b", "4096", "-m", "0", "-E", "lazy_itable_init=1,lazy_journal_init=1,nodiscard", device]
                    .map(String::from)
                    .to_vec(),
            ),
            FsKind::Xfs => ("mkfs.xfs", ["-f", "-q", "-K", "-s", "size=4096", device].map(String::from).to_vec()),
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

/// Classifies the first [`PROBE_LEN`](volring_devices::PROBE_LEN) bytes of a device (pure), as if they
/// were all of it.
#[cfg(test)]
fn classify(head: &[u8]) -> Content {
    let read = |offset: u64, len: usize| Ok::<_, std::convert::Infallible>(head[offset as usize..][..len].to_vec());
    classify_probed(probe_reads(head.len() as u64, 512, read).unwrap_or_else(|never| match never {}))
}

/// Classifies what [`probe_reads`] found on a device's head and tail
/// (pure): blank only when no signature matched and every byte read is zero.
pub(crate) fn classify_probed((found, all_zero): (volring_devices::Content, bool)) -> Content {
    if let Some(fs) = found.filesystem {
        return match fs.fstype.as_str() {
            t @ ("ext2" | "ext3" | "ext4" | "xfs" | "btrfs") => Content::Filesystem(t),
            other => Content::Other(other.to_string()),
        };
    }
    if let Some(t) = found.table {
        return Content::Other(format!("a {:?} partition table", t.table).to_lowercase());
    }
    if all_zero {
        Content::Blank
    } else {
        Content::Other("data of an unknown kind".to_string())
    }
}

/// Reads and classifies the start and the end of `device` (md 0.90/1.0
/// superblocks and ZFS labels live at the end).
pub fn probe_device(device: &Path) -> Result<Content, Error> {
    let f = File::open(device).map_err(Error::io("open for probe", device))?;
    let size = std::io::Seek::seek(&mut &f, std::io::SeekFrom::End(0)).map_err(Error::io("size for probe", device))?;
    // A device that reads as nothing is not a blank device: a loop device
    // being torn down (detached while mounted, cleared at the unmount)
    // reports size 0 and short reads for a moment, and "blank" is the one
    // answer that leads to mkfs. Only a device read in full can be blank.
    if size == 0 {
        return Err(Error::Precondition(format!("{} reports a size of 0 (being detached?); not probed", device.display())));
    }
    let probed = probe_reads(size, 512, |offset, len| {
        let mut buf = vec![0u8; len];
        let mut got = 0;
        while got < buf.len() {
            match f.read_at(&mut buf[got..], offset + got as u64).map_err(Error::io("read for probe", device))? {
                0 => {
                    return Err(Error::Precondition(format!(
                        "{} ended at {} while {size} bytes were reported (being detached?); not probed",
                        device.display(),
                        offset + got as u64
                    )))
                }
                n => got += n,
            }
        }
        Ok(buf)
    })?;
    Ok(classify_probed(probed))
}

pub fn format(kind: FsKind, device: &Path) -> Result<(), Error> {
    let dev = device.to_string_lossy();
    let (program, args) = kind.mkfs_command(&dev);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    run(program, &args)
}

/// Grows a mounted filesystem to fill its device. `mount` is a descriptor
/// of the filesystem's root (`O_PATH` will do) that the caller has proven
/// to be the volume's own mount: the grow acts on that mount, never on
/// whatever a path names by the time a helper opens it.
///
/// resize2fs is given the device, which cannot change under it: the
/// mount holds the loop device open, so it stays bound to the volume's
/// image. (It still picks a mount point of that device from the mount
/// table and opens it by path; only EXT4_IOC_RESIZE_FS issued on `mount`
/// itself would pin that open too.)
pub fn grow(fs_type: &str, device: &Path, mount: BorrowedFd<'_>) -> Result<(), Error> {
    match fs_type {
        // The kernel grows a mounted ext4 only for CAP_SYS_RESOURCE
        // (resize2fs then just says "Permission denied").
        "ext2" | "ext3" | "ext4" if !can_resize_ext4() => {
            Err(Error::Precondition("growing a mounted ext4 filesystem needs CAP_SYS_RESOURCE, which the agent does not have".into()))
        }
        "ext2" | "ext3" | "ext4" => run("resize2fs", &[&device.to_string_lossy()]),
        "xfs" => grow_xfs(device, mount),
        other => Err(Error::Precondition(format!("cannot grow a {other} filesystem"))),
    }
}

/// xfs_growfs looks its argument up in a mount table (by `realpath`) and
/// then opens the *table's* directory string: handed a path, or even
/// `/proc/self/fd/N`, it acts on whatever is mounted at that path by then.
/// So it is handed a table of one line of our own (`-t`, a memfd) whose
/// directory is this process's descriptor of the proven mount, through
/// `/proc/<pid>/fd/N`: its `open` of that string follows the magic link
/// to the very mount (no descriptor needs to be inherited, so none leaks
/// into helpers other threads start meanwhile).
fn grow_xfs(device: &Path, mount: BorrowedFd<'_>) -> Result<(), Error> {
    // This process as the /proc the helper will read names it (which need
    // not be getpid()'s number when /proc belongs to another pid namespace).
    let me = std::fs::read_link("/proc/self").map_err(Error::io("readlink", "/proc/self"))?;
    let fds = format!("/proc/{}/fd", me.display());
    let dir = format!("{fds}/{}", mount.as_raw_fd());
    let table = rustix::fs::memfd_create("volring-xfs-growfs-mtab", rustix::fs::MemfdFlags::CLOEXEC).map_err(|e| Error::Io {
        what: "memfd for xfs_growfs",
        path: device.into(),
        source: e.into(),
    })?;
    let mut table = std::fs::File::from(table);
    table
        .write_all(format!("{} {dir} xfs rw 0 0\n", mntent_escape(&device.to_string_lossy())).as_bytes())
        .map_err(Error::io("write the mount table for xfs_growfs", device))?;
    run("xfs_growfs", &["-t", &format!("{fds}/{}", table.as_raw_fd()), "-d", &dir])
}

/// A mount table field as getmntent(3) reads it: space, tab, newline and
/// backslash as octal escapes.
fn mntent_escape(field: &str) -> String {
    let mut out = String::with_capacity(field.len());
    for c in field.chars() {
        match c {
            ' ' => out.push_str("\\040"),
            '\t' => out.push_str("\\011"),
            '\n' => out.push_str("\\012"),
            '\\' => out.push_str("\\134"),
            c => out.push(c),
        }
    }
    out
}

/// True when this process may grow a mounted ext4 filesystem.
pub(crate) fn can_resize_ext4() -> bool {
    rustix::thread::capabilities(None).is_ok_and(|c| c.effective.contains(rustix::thread::CapabilitySet::SYS_RESOURCE))
}

#[cfg(test)]
mod tests {
    use super::*;
    use volring_devices::PROBE_LEN;

    #[test]
    fn a_device_that_reads_as_nothing_is_never_blank() {
        // A loop device being cleared reports size 0: "blank" would mean
        // mkfs over a volume's data once it is attached again.
        let dir = tempfile::tempdir().unwrap();
        let empty = dir.path().join("empty");
        std::fs::write(&empty, b"").unwrap();
        assert!(matches!(probe_device(&empty), Err(Error::Precondition(_))), "{:?}", probe_device(&empty));
        let zeros = dir.path().join("zeros");
        std::fs::File::create(&zeros).unwrap().set_len(1 << 20).unwrap();
        assert_eq!(probe_device(&zeros).unwrap(), Content::Blank);
    }

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

    /// With another xfs mounted over the volume's mount point after the
    /// mount was proven, the grow acts on the proven mount: the volume's
    /// filesystem fills its device, the one on top is left as it was. (Run
    /// on a thread of its own in a private mount namespace; the loop
    /// devices clear themselves once that namespace's mounts are gone.)
    #[test]
    fn xfs_grow_acts_on_the_proven_mount_not_on_its_path() {
        use rustix::fs::{fstatfs, open, statfs, Mode, OFlags};
        use std::os::fd::AsFd;
        use volring_sys::loopdev::{LoopDevice, LoopOptions};
        let test = std::thread::spawn(|| {
            volring_sys::ns::enter_private_mount_namespace().unwrap();
            let d = tempfile::tempdir().unwrap();
            // Two 300 MiB filesystems, on devices of 400 and 500 MiB.
            let device = |name: &str, size: u64| {
                let path = d.path().join(name);
                File::create(&path).unwrap().set_len(size).unwrap();
                run("mkfs.xfs", &["-q", "-d", "size=300m", &path.to_string_lossy()]).unwrap();
                let file = File::options().read(true).write(true).open(&path).unwrap();
                LoopDevice::attach(file.as_fd(), &LoopOptions { autoclear: true, ..Default::default() }).unwrap()
            };
            let (ours, other) = (device("ours.img", 400 << 20), device("other.img", 500 << 20));
            let at = d.path().join("m");
            std::fs::create_dir(&at).unwrap();
            let dir = |p: &Path| open(p, OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC, Mode::empty()).unwrap();
            let nouuid = crate::mounting::MountOptions { flags: rustix::mount::MountFlags::empty(), data: "nouuid".into() };
            crate::mounting::mount_filesystem(&ours.path(), dir(&at).as_fd(), "xfs", &nouuid).unwrap();
            let proven = dir(&at);
            // The swap: another filesystem at the same path, on top.
            crate::mounting::mount_filesystem(&other.path(), dir(&at).as_fd(), "xfs", &nouuid).unwrap();
            let (ours_before, other_before) = (fstatfs(&proven).unwrap().f_blocks, statfs(&at).unwrap().f_blocks);
            assert_eq!(ours_before, other_before, "both start at 300 MiB");
            grow("xfs", &ours.path(), proven.as_fd()).unwrap();
            let (ours_after, other_after) = (fstatfs(&proven).unwrap().f_blocks, statfs(&at).unwrap().f_blocks);
            assert_eq!(other_after, other_before, "the filesystem mounted on top was grown");
            assert!(ours_after > ours_before + (80 << 20) / 4096, "the proven mount did not grow: {ours_before} -> {ours_after} blocks");
            drop(proven);
            for _ in 0..2 {
                rustix::mount::unmount(&at, rustix::mount::UnmountFlags::DETACH).unwrap();
            }
        });
        if let Err(panic) = test.join() {
            std::panic::resume_unwind(panic);
        }
    }

    #[test]
    fn mount_table_fields_are_escaped_as_getmntent_reads_them() {
        assert_eq!(mntent_escape("/dev/loop7"), "/dev/loop7");
        assert_eq!(mntent_escape("/a b\tc\nd\\e"), "/a\\040b\\011c\\012d\\134e");
    }

    #[test]
    fn fs_kinds() {
        assert_eq!("".parse::<FsKind>().ok(), Some(FsKind::Ext4));
        assert_eq!("xfs".parse::<FsKind>().ok(), Some(FsKind::Xfs));
        assert_eq!("vfat".parse::<FsKind>().ok(), None);
        let (p, a) = FsKind::Xfs.mkfs_command("/dev/loop3");
        assert_eq!(p, "mkfs.xfs");
        assert_eq!(a.last().map(String::as_str), Some("/dev/loop3"));
        assert!(a.windows(2).any(|w| w == ["-s", "size=4096"]), "xfs mountable on 4 KiB-sector devices: {a:?}");
    }
}
