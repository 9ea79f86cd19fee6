//! Reading the kernel's mount table: `listmount`/`statmount`, or mountinfo.

use std::io;
use std::os::fd::AsFd;

use super::mount::Mount;
use super::statmount::{decode, FULL_MASK};
use super::table::MountTable;
use super::Error;
use volring_sys::mount_api;

/// Reads mounts with `statmount`, reusing its id list and reply buffer.
#[derive(Default)]
pub(crate) struct Statmounter {
    ids: Vec<u64>,
    buf: Vec<u8>,
}

impl Statmounter {
    /// True when this kernel has `listmount` and `statmount` (6.8+).
    pub(crate) fn supported() -> bool {
        mount_api::listmount_available()
    }

    /// One mount by unique id; `None` when it has left the namespace.
    pub(crate) fn stat(&mut self, id: u64) -> Result<Option<Mount>, Error> {
        match mount_api::statmount(id, FULL_MASK, &mut self.buf) {
            Ok(()) => decode(&self.buf).map(Some),
            Err(e) if e.raw_os_error() == Some(libc::ENOENT) => Ok(None),
            Err(e) => Err(Error::Io("statmount", e)),
        }
    }

    /// The whole table. Mounts that vanish between list and stat are skipped:
    /// they are gone, and the snapshot describes the moment after.
    pub(crate) fn snapshot(&mut self) -> Result<MountTable, Error> {
        let mut ids = std::mem::take(&mut self.ids);
        let r = mount_api::listmount_all(&mut ids).map_err(|e| Error::Io("listmount", e));
        let mut table = MountTable::with_capacity(ids.len());
        if r.is_ok() {
            // Newest first: a mount just made (and just remounted) is the
            // likeliest to be gone before the last statmount of a large
            // table, so it is looked at before the older ones.
            for &id in ids.iter().rev() {
                if let Some(m) = self.stat(id)? {
                    table.insert(std::sync::Arc::new(m));
                }
            }
        }
        self.ids = ids;
        r.map(|()| table)
    }
}

/// Reads a whole mountinfo file from offset 0 into `buf` (cleared first).
pub fn read_mountinfo(fd: impl AsFd, buf: &mut Vec<u8>) -> io::Result<()> {
    buf.clear();
    let fd = fd.as_fd();
    loop {
        if buf.capacity() - buf.len() < 16 * 1024 {
            buf.reserve(64 * 1024);
        }
        let offset = buf.len() as u64;
        let n = rustix::io::pread(fd, rustix::buffer::spare_capacity(&mut *buf), offset)?;
        if n == 0 {
            return Ok(());
        }
    }
}

/// The mount table of the calling thread's namespace, from the best source.
pub fn load(prefer_statmount: bool) -> Result<(MountTable, Vec<super::parse::LineError>), Error> {
    if prefer_statmount && Statmounter::supported() {
        return Ok((Statmounter::default().snapshot()?, Vec::new()));
    }
    let f = std::fs::File::open("/proc/thread-self/mountinfo").map_err(|e| Error::Io("open mountinfo", e))?;
    let mut buf = Vec::new();
    read_mountinfo(&f, &mut buf).map_err(|e| Error::Io("read mountinfo", e))?;
    Ok(MountTable::from_mountinfo(&buf))
}
