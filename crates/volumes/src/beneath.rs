//! Paths from requests, resolved once beneath a root directory and then acted
//! on only through the descriptor the resolution gave.
//!
//! kubelet hands the driver paths inside other pods' directories, and a
//! tenant can rename or swap components of those paths while a call runs (a
//! directory exchanged with a symlink to `/` in a loop, say). Checking a path
//! and then passing the same string to mount(2) resolves it twice; the second
//! walk may land somewhere else. Here every walk is one `openat2` from the
//! root's descriptor with `RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS |
//! RESOLVE_NO_MAGICLINKS`: the kernel refuses any symlink and any step out of
//! the root, atomically. Directories are created one component at a time,
//! each relative to the descriptor of its parent. What the caller gets back
//! is a descriptor; mounting onto it, statting it and unmounting it
//! (`volumes::mounting`) never look at the path string again.

use std::io;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::path::{Component, Path, PathBuf};

use rustix::fs::{AtFlags, FileType, Mode, OFlags, ResolveFlags, StatxAttributes, StatxFlags};

use volring_mounts::DevNum;

const RESOLVE: ResolveFlags = ResolveFlags::BENEATH.union(ResolveFlags::NO_SYMLINKS).union(ResolveFlags::NO_MAGICLINKS);
/// kubelet creates pod directories 0750; the driver creates the same.
const DIR_MODE: u32 = 0o750;
/// Directories deeper than this below the root are refused (a bound on the
/// component-by-component walk; kubelet's deepest path is about 10).
const MAX_DEPTH: usize = 64;

/// A root directory, held open.
pub struct Beneath {
    root: OwnedFd,
    path: PathBuf,
}

/// What a descriptor refers to, from one `statx` of the descriptor itself.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Node {
    pub kind: Kind,
    /// The device of the filesystem it is in.
    pub dev: DevNum,
    /// For a device node, the device it is.
    pub rdev: DevNum,
    /// True when it is the root of a mount (something is mounted here).
    pub mount_root: bool,
    /// The mount's id as /proc/self/mountinfo gives it.
    pub mnt_id: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Dir,
    File,
    BlockDevice,
    Other,
}

impl Beneath {
    /// Opens `root` (following symlinks in the root's own path, which the
    /// operator chose; nothing below it may be a symlink).
    pub fn open(root: &Path) -> io::Result<Self> {
        let root_fd = rustix::fs::open(root, OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC, Mode::empty())?;
        Ok(Self { root: root_fd, path: root.to_path_buf() })
    }

    /// The normal components of `p` below the root; `p` must be the root
    /// itself or lie below it (lexically: requests are validated first).
    fn components<'a>(&self, p: &'a Path) -> io::Result<Vec<&'a std::ffi::OsStr>> {
        let rel = p.strip_prefix(&self.path).map_err(|_| io::Error::from_raw_os_error(libc::EXDEV))?;
        let mut out = Vec::new();
        for c in rel.components() {
            match c {
                Component::Normal(n) => out.push(n),
                Component::CurDir => {}
                _ => return Err(io::Error::from_raw_os_error(libc::EXDEV)),
            }
        }
        if out.len() > MAX_DEPTH {
            return Err(io::Error::from_raw_os_error(libc::ENAMETOOLONG));
        }
        Ok(out)
    }

    /// Opens `p` as an `O_PATH` descriptor; `None` when it does not exist.
    /// ELOOP (a symlink on the way) and EXDEV (a way out of the root) are
    /// errors.
    pub fn open_path(&self, p: &Path) -> io::Result<Option<OwnedFd>> {
        let rel: PathBuf = self.components(p)?.iter().collect();
        let rel = if rel.as_os_str().is_empty() { Path::new(".") } else { rel.as_path() };
        match rustix::fs::openat2(&self.root, rel, OFlags::PATH | OFlags::NOFOLLOW | OFlags::CLOEXEC, Mode::empty(), RESOLVE) {
            Ok(fd) => Ok(Some(fd)),
            Err(rustix::io::Errno::NOENT) => Ok(None),
            Err(e) => Err(e.into()),
        }
    }

    /// Opens directory `p`, creating it and its missing parents, each one
    /// relative to its parent's descriptor. ENOTDIR when a component (or
    /// `p`) exists and is not a directory.
    pub fn create_dirs(&self, p: &Path) -> io::Result<OwnedFd> {
        let mut dir = rustix::fs::openat2(&self.root, ".", OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC, Mode::empty(), RESOLVE)?;
        for name in self.components(p)? {
            match rustix::fs::mkdirat(&dir, name, Mode::from_raw_mode(DIR_MODE)) {
                Ok(()) | Err(rustix::io::Errno::EXIST) => {}
                Err(e) => return Err(e.into()),
            }
            dir = rustix::fs::openat2(
                &dir,
                name,
                OFlags::PATH | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
                Mode::empty(),
                RESOLVE,
            )?;
        }
        Ok(dir)
    }

    /// Opens regular file `p` (creating it, and its parent directories, when
    /// missing) as an `O_PATH` descriptor. A device node already bound onto
    /// `p` is returned as it is (the caller checks whose it is).
    ///
    /// Whatever is already at `p` is never opened for anything but
    /// `O_PATH`: `O_EXCL` makes the create fail on an existing name rather
    /// than open it for writing (which would hang on a FIFO, and open a
    /// device node someone put there). No caller needs to know whether
    /// the file was created here, so that is not said.
    pub fn create_file(&self, p: &Path) -> io::Result<OwnedFd> {
        let (parent, name) = self.parent_of(p)?;
        let parent = self.create_dirs(&parent)?;
        let flags = OFlags::CREATE | OFlags::EXCL | OFlags::WRONLY | OFlags::CLOEXEC;
        match rustix::fs::openat2(&parent, &name, flags, Mode::from_raw_mode(0o640), RESOLVE) {
            Ok(_) | Err(rustix::io::Errno::EXIST) => {}
            Err(e) => return Err(e.into()),
        }
        let fd = rustix::fs::openat2(&parent, &name, OFlags::PATH | OFlags::NOFOLLOW | OFlags::CLOEXEC, Mode::empty(), RESOLVE)?;
        match stat(fd.as_fd())?.kind {
            Kind::File | Kind::BlockDevice => Ok(fd),
            Kind::Dir => Err(io::Error::from_raw_os_error(libc::EISDIR)),
            Kind::Other => Err(io::Error::from_raw_os_error(libc::EINVAL)),
        }
    }

    /// Removes `p` (an empty directory or a file) unless something is
    /// mounted on it; a missing `p` is not an error. The name is removed
    /// from its parent's descriptor, so a swapped parent cannot redirect it.
    pub fn remove(&self, p: &Path) -> io::Result<()> {
        let (parent, name) = self.parent_of(p)?;
        let Some(parent) = self.open_path(&parent)? else { return Ok(()) };
        let st = match rustix::fs::statx(&parent, &name, AtFlags::SYMLINK_NOFOLLOW, StatxFlags::TYPE) {
            Ok(s) => s,
            Err(rustix::io::Errno::NOENT) => return Ok(()),
            Err(e) => return Err(e.into()),
        };
        if st.stx_attributes.contains(StatxAttributes::MOUNT_ROOT) {
            return Err(io::Error::from_raw_os_error(libc::EBUSY));
        }
        let flags = if FileType::from_raw_mode(st.stx_mode.into()) == FileType::Directory { AtFlags::REMOVEDIR } else { AtFlags::empty() };
        match rustix::fs::unlinkat(&parent, &name, flags) {
            Ok(()) | Err(rustix::io::Errno::NOENT) => Ok(()),
            Err(e) => Err(e.into()),
        }
    }

    /// `p`'s parent directory, opened beneath the root, `p`'s last
    /// component, and what that entry is now (judged from the parent,
    /// `stat_entry`): for acting on the mount at `p` without holding a
    /// descriptor inside it (one would keep it busy). `None` when the parent
    /// or the entry does not exist.
    pub fn entry(&self, p: &Path) -> io::Result<Option<(OwnedFd, std::ffi::OsString, Node)>> {
        let (parent, name) = self.parent_of(p)?;
        let Some(fd) = self.open_path(&parent)? else { return Ok(None) };
        Ok(stat_entry(fd.as_fd(), &name)?.map(|node| (fd, name, node)))
    }

    fn parent_of(&self, p: &Path) -> io::Result<(PathBuf, std::ffi::OsString)> {
        let comps = self.components(p)?;
        let (name, up) = comps.split_last().ok_or_else(|| io::Error::from_raw_os_error(libc::EBUSY))?;
        let mut parent = self.path.clone();
        parent.extend(up);
        Ok((parent, name.to_os_string()))
    }
}

/// `statx` of the descriptor itself (no path walk).
pub fn stat(fd: BorrowedFd<'_>) -> io::Result<Node> {
    match rustix::fs::statx(fd, "", AtFlags::EMPTY_PATH, StatxFlags::BASIC_STATS | StatxFlags::MNT_ID) {
        Ok(s) => Ok(node(&s)),
        Err(rustix::io::Errno::IO) => stat_refused(fd),
        Err(e) => Err(e.into()),
    }
}

/// `statx` of one entry of an open directory, not following a symlink (but
/// crossing into what is mounted on it, as any lookup does). `None` when
/// there is no such entry.
fn stat_entry(dir: BorrowedFd<'_>, name: &std::ffi::OsStr) -> io::Result<Option<Node>> {
    match rustix::fs::statx(dir, name, AtFlags::SYMLINK_NOFOLLOW, StatxFlags::BASIC_STATS | StatxFlags::MNT_ID) {
        Ok(s) => Ok(Some(node(&s))),
        Err(rustix::io::Errno::NOENT) => Ok(None),
        Err(rustix::io::Errno::IO) => {
            let fd = rustix::fs::openat(dir, name, OFlags::PATH | OFlags::NOFOLLOW | OFlags::CLOEXEC, Mode::empty())?;
            stat_refused(fd.as_fd()).map(Some)
        }
        Err(e) => Err(e.into()),
    }
}

/// What `statx` would have said of `fd` on a filesystem that refuses it.
/// One that shut itself down (xfs after a failed metadata write) answers
/// EIO to every getattr, its root's included, so a failed volume could be
/// neither recognised nor unmounted. Its mount still says what it is: the
/// descriptor's mount id (from fdinfo) names the mountinfo line with the
/// device. Only a mount's root can be reached by a walk into such a
/// filesystem (crossing the mount point asks it nothing; any name below
/// would need its failing lookup), and the line's mount point must be the
/// descriptor's own path too, or EIO stands.
fn stat_refused(fd: BorrowedFd<'_>) -> io::Result<Node> {
    use std::os::fd::AsRawFd;
    use std::os::unix::ffi::OsStrExt;
    let refused = || io::Error::from_raw_os_error(libc::EIO);
    let fdinfo = std::fs::read_to_string(format!("/proc/self/fdinfo/{}", fd.as_raw_fd()))?;
    let mnt_id: u32 = fdinfo.lines().find_map(|l| l.strip_prefix("mnt_id:")?.trim().parse().ok()).ok_or_else(refused)?;
    let path = std::fs::read_link(format!("/proc/self/fd/{}", fd.as_raw_fd()))?;
    let mut info = Vec::new();
    volring_mounts::read_mountinfo(std::fs::File::open("/proc/self/mountinfo")?, &mut info)?;
    let m = volring_mounts::mountinfo_lines(&info).flatten().find(|m| m.id == mnt_id).ok_or_else(refused)?;
    if volring_mounts::unescape(m.mount_point).as_ref() != path.as_os_str().as_bytes() {
        return Err(refused());
    }
    // O_DIRECTORY is checked on the dentry, without asking the filesystem.
    let dir = rustix::fs::openat(fd, ".", OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC, Mode::empty()).is_ok();
    Ok(Node {
        kind: if dir { Kind::Dir } else { Kind::Other },
        dev: m.dev,
        rdev: DevNum::default(),
        mount_root: true,
        mnt_id: mnt_id.into(),
    })
}

fn node(s: &rustix::fs::Statx) -> Node {
    let kind = match FileType::from_raw_mode(s.stx_mode.into()) {
        FileType::Directory => Kind::Dir,
        FileType::RegularFile => Kind::File,
        FileType::BlockDevice => Kind::BlockDevice,
        _ => Kind::Other,
    };
    Node {
        kind,
        dev: DevNum { major: s.stx_dev_major, minor: s.stx_dev_minor },
        rdev: DevNum { major: s.stx_rdev_major, minor: s.stx_rdev_minor },
        mount_root: s.stx_attributes.contains(StatxAttributes::MOUNT_ROOT),
        mnt_id: s.stx_mnt_id,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refuses_symlinks_and_escapes_and_creates_beneath() {
        let d = tempfile::tempdir().unwrap();
        let root = d.path().join("root");
        std::fs::create_dir(&root).unwrap();
        let b = Beneath::open(&root).unwrap();
        let fd = b.create_dirs(&root.join("a/b/c")).unwrap();
        assert_eq!(stat(fd.as_fd()).unwrap().kind, Kind::Dir);
        assert!(root.join("a/b/c").is_dir());
        // A symlink anywhere below the root is refused, also one that stays inside.
        std::os::unix::fs::symlink(d.path(), root.join("out")).unwrap();
        std::os::unix::fs::symlink("a", root.join("in")).unwrap();
        for p in ["out/x", "in/b"] {
            assert!(b.open_path(&root.join(p)).is_err(), "{p}");
        }
        for p in ["out", "in"] {
            // A trailing symlink comes back as the link itself, never its target.
            let fd = b.open_path(&root.join(p)).unwrap().unwrap();
            assert_eq!(stat(fd.as_fd()).unwrap().kind, Kind::Other, "{p}");
            assert!(b.create_dirs(&root.join(p)).is_err(), "{p}");
            assert!(b.create_dirs(&root.join(p).join("y")).is_err(), "{p}");
            assert!(b.create_file(&root.join(p)).is_err(), "{p}");
        }
        assert!(!d.path().join("x").exists() && !d.path().join("y").exists());
        assert!(b.open_path(&d.path().join("elsewhere")).is_err());
        assert!(b.open_path(&root.join("nope")).unwrap().is_none());
        // Files, and a file where a directory is wanted.
        let f = b.create_file(&root.join("a/f")).unwrap();
        assert_eq!(stat(f.as_fd()).unwrap().kind, Kind::File);
        assert_eq!(b.create_dirs(&root.join("a/f")).err().and_then(|e| e.raw_os_error()), Some(libc::ENOTDIR));
        assert!(b.create_file(&root.join("a/b")).is_err());
        b.remove(&root.join("a/f")).unwrap();
        b.remove(&root.join("a/f")).unwrap();
        b.remove(&root.join("a/b/c")).unwrap();
        assert!(!root.join("a/b/c").exists() && root.join("a/b").exists());
        // The symlink itself is removed, never what it points at.
        b.remove(&root.join("out")).unwrap();
        assert!(d.path().join("root").exists());
    }

    /// An existing file, or a FIFO (held open for reading, so that the old
    /// write-open would not hang this test), is looked at through `O_PATH`
    /// only: inotify sees no descriptor open for writing closed on either.
    #[test]
    fn create_file_never_opens_what_is_there_for_writing() {
        use rustix::fs::inotify;
        let d = tempfile::tempdir().unwrap();
        let b = Beneath::open(d.path()).unwrap();
        std::fs::write(d.path().join("file"), b"kept").unwrap();
        rustix::fs::mknodat(rustix::fs::CWD, d.path().join("fifo"), FileType::Fifo, Mode::from_raw_mode(0o600), 0).unwrap();
        let reader = rustix::fs::open(d.path().join("fifo"), OFlags::RDONLY | OFlags::NONBLOCK | OFlags::CLOEXEC, Mode::empty()).unwrap();
        let watch = inotify::init(inotify::CreateFlags::NONBLOCK | inotify::CreateFlags::CLOEXEC).unwrap();
        for name in ["file", "fifo"] {
            inotify::add_watch(&watch, d.path().join(name), inotify::WatchFlags::CLOSE_WRITE | inotify::WatchFlags::MODIFY).unwrap();
        }
        let f = b.create_file(&d.path().join("file")).unwrap();
        assert_eq!(stat(f.as_fd()).unwrap().kind, Kind::File);
        assert_eq!(b.create_file(&d.path().join("fifo")).err().and_then(|e| e.raw_os_error()), Some(libc::EINVAL));
        let mut buf = [std::mem::MaybeUninit::uninit(); 1024];
        let mut events = inotify::Reader::new(&watch, &mut buf);
        match events.next() {
            Err(rustix::io::Errno::AGAIN) => {}
            other => panic!("opened for writing: {:?}", other.map(|e| e.events())),
        }
        assert_eq!(std::fs::read(d.path().join("file")).unwrap(), b"kept");
        drop(reader);
    }
}
