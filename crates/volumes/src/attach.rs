//! Images to loop devices and back.
//!
//! Devices are attached without autoclear: a staged volume must stay
//! attached when the agent restarts. So that a device found later really is
//! ours, every lookup compares the kernel's record of the backing file with
//! the image path before trusting a number.
//!
//! A detach is finished before [`detach`] returns. `LOOP_CLR_FD` on a device
//! someone else holds open (a `blkid`, a backup agent, a process that had
//! the device node open) does not detach it: the kernel only marks it
//! autoclear and tears it down when the last opener closes. So `detach`
//! waits, bounded, for the backing file to really be gone, and then removes
//! the device number from the kernel (`LOOP_CTL_REMOVE`), so a node that
//! cycles through thousands of volumes is not left with thousands of empty
//! loop devices.

use std::fs::OpenOptions;
use std::os::fd::AsFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use volring_mounts::DevNum;
use volring_sys::loopdev::{self, LoopDevice, LoopOptions};

use super::staged::{AttachKind, StagedVolume};
use super::Error;

/// A block device serving one image: `/dev/loop<number>` or
/// `/dev/nbd<number>`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Attachment {
    pub number: u32,
    pub dev: DevNum,
    pub kind: AttachKind,
}

impl Attachment {
    pub fn path(&self) -> PathBuf {
        PathBuf::from(format!("/dev/{self}"))
    }
}

/// The kernel's name of the device (`loop3`, `nbd0`).
impl std::fmt::Display for Attachment {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}{}", self.kind.as_str(), self.number)
    }
}

/// The device a staged record names, if it still serves the volume: a loop
/// device still backed by the image, or an nbd device still carrying the
/// volume id as its backend identifier.
pub fn of_record(rec: &StagedVolume) -> Option<Attachment> {
    match rec.attach {
        AttachKind::Loop => existing(rec.loop_number?, &rec.image),
        AttachKind::Nbd => nbd_existing(rec.nbd_index?, &rec.volume_id),
    }
}

/// A volume's device as the device itself says it is now, for decisions
/// that must not rest on a name alone (the reconciler's repairs).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DeviceProof {
    /// Attached to the volume's very image (for a loop device: the same
    /// file, by device and inode, not only the same path) and staying.
    Ours(Attachment),
    /// The record names no device, or it no longer serves the image.
    Gone,
    /// Between states: a loop device told to detach when its last opener
    /// closes (volring never sets that; someone is taking it away), or a
    /// device that could not be asked. Decide nothing until it settles.
    Unsettled(String),
}

/// Proves what serves the volume `rec` describes: a loop device by its
/// `LOOP_GET_STATUS64` record against the image's inode, an nbd device by
/// its backend identifier.
pub fn prove(rec: &StagedVolume) -> DeviceProof {
    match (rec.attach, rec.loop_number) {
        (AttachKind::Loop, Some(n)) => prove_loop(n, &rec.image),
        (AttachKind::Loop, None) => DeviceProof::Gone,
        (AttachKind::Nbd, _) => of_record(rec).map_or(DeviceProof::Gone, DeviceProof::Ours),
    }
}

/// [`prove`] for `/dev/loop<number>` and `image`. The sysfs path is only
/// the cheap first look: a path can name another file by now, so the
/// device's own record of its backing file's device and inode decides.
pub fn prove_loop(number: u32, image: &Path) -> DeviceProof {
    if backing_file(number).as_deref() != Some(image) {
        return DeviceProof::Gone;
    }
    let dev = match OpenOptions::new().read(true).custom_flags(libc::O_CLOEXEC).open(format!("/dev/loop{number}")) {
        Ok(f) => f,
        // Torn down between the sysfs read and the open.
        Err(e) if e.raw_os_error() == Some(libc::ENXIO) => return DeviceProof::Gone,
        Err(e) => return DeviceProof::Unsettled(format!("open /dev/loop{number}: {e}")),
    };
    let status = match loopdev::status(dev.as_fd()) {
        Ok(Some(s)) => s,
        Ok(None) => return DeviceProof::Gone,
        Err(e) => return DeviceProof::Unsettled(format!("/dev/loop{number} status: {e}")),
    };
    let file = match rustix::fs::statx(rustix::fs::CWD, image, rustix::fs::AtFlags::empty(), rustix::fs::StatxFlags::INO) {
        Ok(s) => s,
        Err(rustix::io::Errno::NOENT) => return DeviceProof::Gone,
        Err(e) => return DeviceProof::Unsettled(format!("statx {}: {e}", image.display())),
    };
    if status.backing_dev != (file.stx_dev_major, file.stx_dev_minor) || status.backing_inode != file.stx_ino {
        return DeviceProof::Gone;
    }
    if status.autoclear {
        return DeviceProof::Unsettled(format!("/dev/loop{number} is being detached"));
    }
    match device_number(number) {
        Ok(dev) => DeviceProof::Ours(Attachment { number, dev, kind: AttachKind::Loop }),
        Err(e) => DeviceProof::Unsettled(e.to_string()),
    }
}

/// Whether anything holds the block device node `p` (`/dev/loop3`,
/// `/dev/nbd0`) exclusively now: a mounted filesystem, a device-mapper or
/// md stack, another `O_EXCL` opener. The kernel answers an exclusive open
/// with EBUSY then; this asks it and closes at once. (A bind mount of the
/// device node holds nothing and is not seen here.)
pub fn claimed(p: &Path) -> Result<bool, Error> {
    match OpenOptions::new().read(true).custom_flags(libc::O_EXCL | libc::O_CLOEXEC).open(p) {
        Ok(_) => Ok(false),
        Err(e) if e.raw_os_error() == Some(libc::EBUSY) => Ok(true),
        Err(e) => Err(Error::io("open exclusively", p)(e)),
    }
}

/// `/dev/nbd<index>` if its backend identifier is `backend` (the kernel
/// removes the identifier when the device's configuration goes, so a torn
/// down or reused device never matches).
pub fn nbd_existing(index: u32, backend: &str) -> Option<Attachment> {
    let sys = Path::new("/sys/block");
    (volring_nbd::attach::read_backend(sys, index)?.as_str() == backend).then_some(())?;
    let p = format!("/sys/block/nbd{index}/dev");
    let dev = std::fs::read_to_string(p).ok()?.trim().parse().ok()?;
    Some(Attachment { number: index, dev, kind: AttachKind::Nbd })
}

/// Attaches `image`, with direct I/O when asked and the kernel accepts it
/// for this file (it refuses when the backing filesystem cannot do O_DIRECT
/// at the device's block size); falls back to buffered I/O.
pub fn attach(image: &Path, read_only: bool, direct_io: bool) -> Result<Attachment, Error> {
    let file = OpenOptions::new().read(true).write(!read_only).open(image).map_err(Error::io("open image", image))?;
    let mut opts = LoopOptions { read_only, direct_io, ..LoopOptions::default() };
    let dev = match LoopDevice::attach(file.as_fd(), &opts) {
        Err(e) if direct_io && e.raw_os_error() == Some(libc::EINVAL) => {
            opts.direct_io = false;
            LoopDevice::attach(file.as_fd(), &opts)
        }
        other => other,
    }
    .map_err(Error::io("attach loop device for", image))?;
    let number = dev.number();
    let dev = match device_number(number) {
        Ok(d) => d,
        Err(e) => {
            let _ = dev.detach();
            return Err(e);
        }
    };
    Ok(Attachment { number, dev, kind: AttachKind::Loop })
}

/// The device `/dev/loop<number>` if it is attached to `image`.
pub(crate) fn existing(number: u32, image: &Path) -> Option<Attachment> {
    (backing_file(number)?.as_path() == image)
        .then(|| device_number(number).ok().map(|dev| Attachment { number, dev, kind: AttachKind::Loop }))?
}

/// Every device of `kind` serving a volume, found by what the kernel says
/// backs it rather than by a recorded number: the loop devices attached to
/// `image`, the nbd devices carrying `volume_id` as their backend
/// identifier. Normally none or one; more only after a crash between
/// attaching and recording the number.
pub fn serving(kind: AttachKind, image: &Path, volume_id: &str) -> Vec<Attachment> {
    match kind {
        AttachKind::Loop => find_backed_by(image),
        AttachKind::Nbd => nbd_backed_by(volume_id),
    }
}

/// Every nbd device carrying `backend`.
fn nbd_backed_by(backend: &str) -> Vec<Attachment> {
    std::fs::read_dir("/sys/block")
        .into_iter()
        .flatten()
        .filter_map(|e| e.ok()?.file_name().to_str()?.strip_prefix("nbd")?.parse::<u32>().ok())
        .filter_map(|n| nbd_existing(n, backend))
        .collect()
}

/// Every loop device attached to `image`.
pub(crate) fn find_backed_by(image: &Path) -> Vec<Attachment> {
    loop_numbers().filter_map(|n| existing(n, image)).collect()
}

/// Every loop device serving an image file directly in `dir` (the pool),
/// with that image.
pub fn serving_images_in(dir: &Path) -> Vec<(Attachment, PathBuf)> {
    loop_numbers()
        .filter_map(|n| {
            let b = backing_file(n)?;
            (b.parent() == Some(dir)).then_some(())?;
            Some((Attachment { number: n, dev: device_number(n).ok()?, kind: AttachKind::Loop }, b))
        })
        .collect()
}

/// The numbers of every loop device the kernel has (attached or not).
fn loop_numbers() -> impl Iterator<Item = u32> {
    std::fs::read_dir("/sys/block")
        .into_iter()
        .flatten()
        .filter_map(|e| e.ok()?.file_name().to_str()?.strip_prefix("loop")?.parse::<u32>().ok())
}

/// How long a detach the kernel deferred (the device is held open
/// elsewhere) may take before [`detach`] gives up and says so.
pub(crate) const DETACH_WAIT: Duration = Duration::from_secs(5);

/// Detaches `/dev/loop<number>` if it is still attached to `image`, waits
/// until the kernel has really let go of the image, and removes the device;
/// a device already detached (or reused for something else) is left alone.
/// Fails with [`Error::Precondition`] when another opener keeps the device
/// past `DETACH_WAIT` (it detaches by itself when that opener closes; a
/// retry waits again).
pub fn detach(number: u32, image: &Path) -> Result<(), Error> {
    if existing(number, image).is_none() {
        return Ok(());
    }
    let dev = LoopDevice::open(number).map_err(Error::io("open loop device", format!("/dev/loop{number}")))?;
    // Consumes (closes) our descriptor: when we were the last opener the
    // kernel tears the device down right here.
    match dev.detach() {
        Err(e) if e.raw_os_error() == Some(libc::ENXIO) => {}
        r => r.map_err(Error::io("detach loop device", format!("/dev/loop{number}")))?,
    }
    if !wait_detached(number, image, Instant::now() + DETACH_WAIT) {
        return Err(Error::Precondition(format!(
            "/dev/loop{number} is held open by another process; the kernel detaches it from {} when that process closes it",
            image.display()
        )));
    }
    release(number);
    Ok(())
}

/// The devices still attached to `image`, after waiting (bounded by
/// `DETACH_WAIT`) for those whose detach is under way: volring attaches
/// without autoclear, so a device of ours with autoclear set is one that
/// was told to detach and waits for another opener to close it.
pub fn still_attached(image: &Path) -> Vec<Attachment> {
    let deadline = Instant::now() + DETACH_WAIT;
    let mut out = Vec::new();
    for a in find_backed_by(image) {
        if detaching(a.number) && wait_detached(a.number, image, deadline) {
            release(a.number);
        } else {
            out.push(a);
        }
    }
    out
}

/// Polls (1 ms, doubling to 50 ms) until `/dev/loop<number>` no longer
/// serves `image` or `deadline` passes; true when it no longer does.
fn wait_detached(number: u32, image: &Path, deadline: Instant) -> bool {
    let mut pause = Duration::from_millis(1);
    loop {
        if existing(number, image).is_none() {
            return true;
        }
        let now = Instant::now();
        if now >= deadline {
            return false;
        }
        std::thread::sleep(pause.min(deadline - now));
        pause = (pause * 2).min(Duration::from_millis(50));
    }
}

/// Whether the kernel was told to detach `/dev/loop<number>` when its last
/// opener closes (the autoclear flag).
fn detaching(number: u32) -> bool {
    std::fs::read_to_string(format!("/sys/block/loop{number}/loop/autoclear")).is_ok_and(|s| s.trim() == "1")
}

/// Removes the detached device `/dev/loop<number>` from the kernel. The
/// kernel refuses (EBUSY) while the device is attached or open: attached
/// means someone reused the number, so it is theirs; open while unattached
/// is a short-lived prober, waited out a few times before giving up (an
/// empty device left behind costs only a sysfs entry).
fn release(number: u32) {
    let mut pause = Duration::from_millis(1);
    for _ in 0..6 {
        match loopdev::remove(number) {
            Ok(()) => return,
            Err(e) if e.raw_os_error() == Some(libc::EBUSY) && backing_file(number).is_none() => {
                std::thread::sleep(pause);
                pause *= 2;
            }
            Err(e) => {
                tracing::debug!(device = number, error = %e, "loop device not removed");
                return;
            }
        }
    }
    tracing::debug!(device = number, "loop device still open by someone else; not removed");
}

/// Makes the device see its image's new size; returns the size in bytes.
pub fn refresh_capacity(a: &Attachment) -> Result<u64, Error> {
    let dev = LoopDevice::open(a.number).map_err(Error::io("open loop device", a.path()))?;
    dev.refresh_capacity().map_err(Error::io("refresh loop capacity", a.path()))?;
    size_bytes(a.number)
}

pub(crate) fn size_bytes(number: u32) -> Result<u64, Error> {
    sysfs_size(&format!("loop{number}"))
}

/// The size of the device in bytes, as the kernel sees it.
pub fn device_bytes(a: &Attachment) -> Result<u64, Error> {
    sysfs_size(&a.to_string())
}

fn sysfs_size(name: &str) -> Result<u64, Error> {
    let p = format!("/sys/block/{name}/size");
    let s = std::fs::read_to_string(&p).map_err(Error::io("read", &p))?;
    let sectors: u64 = s.trim().parse().map_err(|_| Error::Corrupt { path: p.into(), detail: format!("size {s:?}") })?;
    Ok(sectors * 512)
}

/// The kernel's path of the file behind `/dev/loop<number>`, if attached.
fn backing_file(number: u32) -> Option<PathBuf> {
    let s = std::fs::read_to_string(format!("/sys/block/loop{number}/loop/backing_file")).ok()?;
    Some(PathBuf::from(s.trim_end_matches('\n')))
}

fn device_number(number: u32) -> Result<DevNum, Error> {
    let p = format!("/sys/block/loop{number}/dev");
    let s = std::fs::read_to_string(&p).map_err(Error::io("read", &p))?;
    s.trim().parse().map_err(|_| Error::Corrupt { path: p.into(), detail: format!("dev {s:?}") })
}
