//! Images to loop devices and back.
//!
//! Devices are attached without autoclear: a staged volume must stay
//! attached when the agent restarts. So that a device found later really is
//! ours, every lookup compares the kernel's record of the backing file with
//! the image path before trusting a number.

use std::fs::OpenOptions;
use std::os::fd::AsFd;
use std::path::{Path, PathBuf};

use crate::devices::sysfs::parse_devnum;
use crate::mounts::DevNum;
use crate::sys::loopdev::{LoopDevice, LoopOptions};

use super::Error;

/// A loop device serving one image.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Attachment {
    pub number: u32,
    pub dev: DevNum,
}

impl Attachment {
    pub fn path(&self) -> PathBuf {
        PathBuf::from(format!("/dev/loop{}", self.number))
    }
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
    Ok(Attachment { number, dev })
}

/// The device `/dev/loop<number>` if it is attached to `image`.
pub fn existing(number: u32, image: &Path) -> Option<Attachment> {
    (backing_file(number)?.as_path() == image).then(|| device_number(number).ok().map(|dev| Attachment { number, dev }))?
}

/// Every loop device attached to `image` (normally none or one; more only
/// after a crash between attaching and recording the number).
pub fn find_backed_by(image: &Path) -> Vec<Attachment> {
    loop_numbers().filter_map(|n| existing(n, image)).collect()
}

/// Numbers of loop devices whose backing file lies below `dir` (cleanup of
/// test and bench runs).
pub fn find_backed_by_prefix(dir: &Path) -> Vec<u32> {
    loop_numbers().filter(|&n| backing_file(n).is_some_and(|b| b.starts_with(dir))).collect()
}

/// The numbers of every loop device the kernel has (attached or not).
fn loop_numbers() -> impl Iterator<Item = u32> {
    std::fs::read_dir("/sys/block")
        .into_iter()
        .flatten()
        .filter_map(|e| e.ok()?.file_name().to_str()?.strip_prefix("loop")?.parse::<u32>().ok())
}

/// Detaches `/dev/loop<number>` if it is still attached to `image`; a device
/// already detached (or reused for something else) is left alone.
pub fn detach(number: u32, image: &Path) -> Result<(), Error> {
    if existing(number, image).is_none() {
        return Ok(());
    }
    let dev = LoopDevice::open(number).map_err(Error::io("open loop device", format!("/dev/loop{number}")))?;
    match dev.detach() {
        Err(e) if e.raw_os_error() == Some(libc::ENXIO) => Ok(()),
        r => r.map_err(Error::io("detach loop device", format!("/dev/loop{number}"))),
    }
}

/// Makes the device see its image's new size; returns the size in bytes.
pub fn refresh_capacity(a: &Attachment) -> Result<u64, Error> {
    let dev = LoopDevice::open(a.number).map_err(Error::io("open loop device", a.path()))?;
    dev.refresh_capacity().map_err(Error::io("refresh loop capacity", a.path()))?;
    size_bytes(a.number)
}

pub fn size_bytes(number: u32) -> Result<u64, Error> {
    let p = format!("/sys/block/loop{number}/size");
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
    parse_devnum(s.trim()).ok_or_else(|| Error::Corrupt { path: p.into(), detail: format!("dev {s:?}") })
}
