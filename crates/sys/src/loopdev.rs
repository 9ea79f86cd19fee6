//! Loop devices through `/dev/loop-control` and `LOOP_CONFIGURE`.
//!
//! `losetup` is a process per device and a scan of sysfs each time; the
//! stat benches attach 4,096 devices and the CSI node attaches one per
//! volume, so both use the ioctls directly. `LOOP_CONFIGURE` (5.8+) sets the
//! backing file, offset, size limit, flags and block size in one call, so a
//! device is never seen half set up.

use std::fs::{File, OpenOptions};
use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::path::PathBuf;

const LOOP_CLR_FD: libc::c_ulong = 0x4C01;
const LOOP_GET_STATUS64: libc::c_ulong = 0x4C05;
const LOOP_SET_CAPACITY: libc::c_ulong = 0x4C07;
const LOOP_CONFIGURE: libc::c_ulong = 0x4C0A;
const LOOP_CTL_REMOVE: libc::c_ulong = 0x4C81;
const LOOP_CTL_GET_FREE: libc::c_ulong = 0x4C82;

const LO_FLAGS_READ_ONLY: u32 = 1;
const LO_FLAGS_AUTOCLEAR: u32 = 4;
const LO_FLAGS_PARTSCAN: u32 = 8;
const LO_FLAGS_DIRECT_IO: u32 = 16;

/// `struct loop_info64` from `<linux/loop.h>`.
#[repr(C)]
struct LoopInfo64 {
    device: u64,
    inode: u64,
    rdevice: u64,
    offset: u64,
    sizelimit: u64,
    number: u32,
    encrypt_type: u32,
    encrypt_key_size: u32,
    flags: u32,
    file_name: [u8; 64],
    crypt_name: [u8; 64],
    encrypt_key: [u8; 32],
    init: [u64; 2],
}

/// `struct loop_config` from `<linux/loop.h>`.
#[repr(C)]
struct LoopConfig {
    fd: u32,
    block_size: u32,
    info: LoopInfo64,
    reserved: [u64; 8],
}

/// How to attach a backing file.
#[derive(Debug, Clone, Default)]
pub struct LoopOptions {
    pub read_only: bool,
    /// Detach when the last open of the device closes: a crashed holder
    /// leaves no device behind.
    pub autoclear: bool,
    /// Let the kernel scan the device for partitions.
    pub partscan: bool,
    pub direct_io: bool,
    pub offset: u64,
    /// 0: to the end of the file.
    pub size_limit: u64,
    /// 0: the kernel's default (512).
    pub block_size: u32,
}

/// An attached loop device, open. Dropping it closes the fd (which detaches
/// the device when it was attached with `autoclear`); [`LoopDevice::detach`]
/// detaches explicitly.
#[derive(Debug)]
pub struct LoopDevice {
    number: u32,
    fd: OwnedFd,
}

impl LoopDevice {
    /// Attaches `backing` to a free loop device. Another process may take the
    /// free device between asking and configuring; that is retried.
    pub fn attach(backing: BorrowedFd<'_>, opts: &LoopOptions) -> io::Result<Self> {
        let control = OpenOptions::new().read(true).write(true).open("/dev/loop-control")?;
        let mut last = io::Error::other("no free loop device");
        for _ in 0..16 {
            // SAFETY: LOOP_CTL_GET_FREE takes no argument and returns a number.
            let n = unsafe { libc::ioctl(control.as_raw_fd(), LOOP_CTL_GET_FREE) };
            if n < 0 {
                return Err(io::Error::last_os_error());
            }
            let path = PathBuf::from(format!("/dev/loop{n}"));
            let dev = match OpenOptions::new().read(true).write(!opts.read_only).open(&path) {
                Ok(f) => f,
                // devtmpfs may not have made the node yet.
                Err(e) if e.kind() == io::ErrorKind::NotFound => {
                    last = e;
                    std::thread::sleep(std::time::Duration::from_millis(1));
                    continue;
                }
                Err(e) => return Err(e),
            };
            match configure(dev.as_fd(), backing, opts) {
                Ok(()) => return Ok(Self { number: n as u32, fd: dev.into() }),
                Err(e) if e.raw_os_error() == Some(libc::EBUSY) => last = e,
                Err(e) => return Err(e),
            }
        }
        Err(last)
    }

    /// Opens the existing device `/dev/loop<number>` (attached or not), to
    /// resize or detach a device attached by an earlier process.
    pub fn open(number: u32) -> io::Result<Self> {
        let dev = OpenOptions::new().read(true).write(true).open(format!("/dev/loop{number}"))?;
        Ok(Self { number, fd: dev.into() })
    }

    pub fn number(&self) -> u32 {
        self.number
    }

    pub fn path(&self) -> PathBuf {
        PathBuf::from(format!("/dev/loop{}", self.number))
    }

    /// Makes the device re-read its backing file's size (after the file grew).
    pub fn refresh_capacity(&self) -> io::Result<()> {
        // SAFETY: LOOP_SET_CAPACITY takes no argument.
        if unsafe { libc::ioctl(self.fd.as_raw_fd(), LOOP_SET_CAPACITY, 0) } < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }

    /// Detaches the device now (it is gone once the last opener closes).
    pub fn detach(self) -> io::Result<()> {
        detach_fd(self.fd.as_fd())
    }
}

/// What the kernel says backs a loop device: the backing file's device
/// and inode (so a caller can tell the very file, not just a path that
/// may since name another one) and whether it was told to detach when its
/// last opener closes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LoopStatus {
    /// The backing file's device, (major, minor).
    pub backing_dev: (u32, u32),
    pub backing_inode: u64,
    pub autoclear: bool,
}

/// `LOOP_GET_STATUS64` on the loop device open at `dev`; `None` when
/// nothing is attached (ENXIO).
pub fn status(dev: BorrowedFd<'_>) -> io::Result<Option<LoopStatus>> {
    let mut info = std::mem::MaybeUninit::<LoopInfo64>::zeroed();
    // SAFETY: `info` is a zeroed `struct loop_info64` that lives across the
    // call; the kernel fills it in.
    if unsafe { libc::ioctl(dev.as_raw_fd(), LOOP_GET_STATUS64, info.as_mut_ptr()) } < 0 {
        let e = io::Error::last_os_error();
        return if e.raw_os_error() == Some(libc::ENXIO) { Ok(None) } else { Err(e) };
    }
    // SAFETY: all-zero bytes are a valid `LoopInfo64` (integers and byte
    // arrays only), and the kernel wrote a whole one on success.
    let info = unsafe { info.assume_init() };
    Ok(Some(LoopStatus {
        backing_dev: decode_dev(info.device),
        backing_inode: info.inode,
        autoclear: info.flags & LO_FLAGS_AUTOCLEAR != 0,
    }))
}

/// The kernel's `new_encode_dev` layout (what `lo_device` carries),
/// decoded: minor's low byte in bits 0–7, major in 8–19, minor's rest from
/// bit 20.
fn decode_dev(d: u64) -> (u32, u32) {
    let major = ((d >> 8) & 0xfff) as u32;
    let minor = ((d & 0xff) | ((d >> 12) & 0xfff00)) as u32;
    (major, minor)
}

fn configure(dev: BorrowedFd<'_>, backing: BorrowedFd<'_>, opts: &LoopOptions) -> io::Result<()> {
    let mut flags = 0;
    for (on, bit) in [
        (opts.read_only, LO_FLAGS_READ_ONLY),
        (opts.autoclear, LO_FLAGS_AUTOCLEAR),
        (opts.partscan, LO_FLAGS_PARTSCAN),
        (opts.direct_io, LO_FLAGS_DIRECT_IO),
    ] {
        if on {
            flags |= bit;
        }
    }
    let config = LoopConfig {
        fd: backing.as_raw_fd() as u32,
        block_size: opts.block_size,
        info: LoopInfo64 {
            device: 0,
            inode: 0,
            rdevice: 0,
            offset: opts.offset,
            sizelimit: opts.size_limit,
            number: 0,
            encrypt_type: 0,
            encrypt_key_size: 0,
            flags,
            file_name: [0; 64],
            crypt_name: [0; 64],
            encrypt_key: [0; 32],
            init: [0; 2],
        },
        reserved: [0; 8],
    };
    // SAFETY: `config` is a fully initialised `struct loop_config` that lives
    // across the call; the kernel only reads it.
    if unsafe { libc::ioctl(dev.as_raw_fd(), LOOP_CONFIGURE, &config as *const LoopConfig) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Detaches whatever backs the loop device open at `dev`.
pub(crate) fn detach_fd(dev: BorrowedFd<'_>) -> io::Result<()> {
    // SAFETY: LOOP_CLR_FD takes no argument.
    if unsafe { libc::ioctl(dev.as_raw_fd(), LOOP_CLR_FD, 0) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Removes the (detached) device `/dev/loop<number>` from the kernel, so a
/// run that made thousands leaves none behind. EBUSY while still attached.
pub fn remove(number: u32) -> io::Result<()> {
    let control: File = OpenOptions::new().read(true).write(true).open("/dev/loop-control")?;
    // SAFETY: LOOP_CTL_REMOVE takes the device number by value.
    if unsafe { libc::ioctl(control.as_raw_fd(), LOOP_CTL_REMOVE, number as libc::c_ulong) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::decode_dev;

    #[test]
    fn lo_device_decodes_as_the_kernel_encodes() {
        assert_eq!(decode_dev(0x801), (8, 1));
        // major 259, minor 256: the minor's high bits live above the major.
        assert_eq!(decode_dev(256 << 12 | 259 << 8), (259, 256));
        assert_eq!(decode_dev((0xabcde_u64 & !0xff) << 12 | 0xfff << 8 | 0xde), (0xfff, 0xabcde));
    }
}
