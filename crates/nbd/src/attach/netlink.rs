//! The nbd genl family, through the one entry `volring_sys` gives for it,
//! and the multicast listener for its LINK_DEAD notices.

use std::time::Duration;

use super::Error;
use volring_sys::{NbdNetlink, NbdNetlinkError};

impl From<NbdNetlinkError> for Error {
    /// A missing module is the error a caller acts on; the rest keep the
    /// step that failed.
    fn from(e: NbdNetlinkError) -> Self {
        match e {
            NbdNetlinkError::NoFamily => Error::FamilyNotFound,
            NbdNetlinkError::Kernel { op, source } => Error::Kernel { op, source },
            NbdNetlinkError::Malformed(what) => Error::Malformed(what),
        }
    }
}

/// The nbd family's multicast group: the kernel announces there each
/// device whose every connection died (NBD_CMD_LINK_DEAD), which is when
/// the device waits for a RECONFIGURE with fresh sockets.
pub struct LinkDeadListener {
    sock: NbdNetlink,
}

impl LinkDeadListener {
    /// [`Error::FamilyNotFound`] when the nbd module is not loaded.
    pub fn open() -> Result<Self, Error> {
        Ok(LinkDeadListener { sock: NbdNetlink::open(true)? })
    }

    /// The next dead device's index, waiting at most `timeout`.
    pub fn recv_timeout(&mut self, timeout: Duration) -> Result<Option<u32>, Error> {
        Ok(self.sock.next_link_dead(timeout)?)
    }
}
