//! Which block devices a mount touches, named as node-disk-manager's change
//! handler needs them: major:minor resolved to kernel and /dev names via sysfs.

use std::os::unix::ffi::OsStrExt;

use super::event::BlockDevice;
use super::mount::{DevNum, Mount};

/// Resolves `dev` through `/sys/dev/block/<maj:min>`; the name is the link's
/// last component.
pub(crate) fn block_device(dev: DevNum) -> BlockDevice {
    let link = format!("/sys/dev/block/{}:{}", dev.major, dev.minor);
    let name = std::fs::read_link(link).ok().and_then(|p| p.file_name().map(|n| n.to_string_lossy().into_owned()));
    let path = name.as_ref().map(|n| format!("/dev/{n}"));
    BlockDevice { dev, name, path }
}

/// The block devices behind `m`. Anonymous superblocks (major 0: tmpfs,
/// proc, overlay, and btrfs, which hides its device this way) name none by
/// device number, so a `/dev/...` source is stat'ed for its device instead.
pub fn devices_of(m: &Mount) -> Vec<BlockDevice> {
    if m.dev.major != 0 {
        return vec![block_device(m.dev)];
    }
    let src = m.source();
    if src.starts_with(b"/dev/") {
        if let Ok(st) = rustix::fs::stat(std::ffi::OsStr::from_bytes(src)) {
            if rustix::fs::FileType::from_raw_mode(st.st_mode) == rustix::fs::FileType::BlockDevice {
                let dev = DevNum { major: rustix::fs::major(st.st_rdev), minor: rustix::fs::minor(st.st_rdev) };
                return vec![block_device(dev)];
            }
        }
    }
    Vec::new()
}
