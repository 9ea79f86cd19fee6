//! The nbd genl family's commands on one socket, and the multicast
//! listener for its LINK_DEAD notices.

use std::time::Duration;

use super::Error;
use volring_sys::genetlink::GenlSocket;
use volring_sys::nlmsg::{self, DeviceStatus, Family, NbdCmd, NbdConfig};

/// A socket that knows the nbd family's id.
pub(crate) struct NbdNetlink {
    sock: GenlSocket,
    family: Family,
}

fn resolve(sock: &mut GenlSocket) -> Result<Family, Error> {
    match sock.resolve_family(nlmsg::NBD_FAMILY) {
        Ok(f) => Ok(f),
        Err(e) if e.raw_os_error() == Some(libc::ENOENT) => Err(Error::FamilyNotFound),
        Err(source) => Err(Error::Kernel { op: "CTRL_CMD_GETFAMILY nbd", source }),
    }
}

impl NbdNetlink {
    /// [`Error::FamilyNotFound`] when the nbd module is not loaded.
    pub(crate) fn open() -> Result<Self, Error> {
        let mut sock = GenlSocket::open().map_err(Error::io("genetlink socket"))?;
        let family = resolve(&mut sock)?;
        Ok(NbdNetlink { sock, family })
    }

    /// NBD_CMD_CONNECT; the device index the kernel chose (or was given).
    pub(crate) fn connect(&mut self, config: &NbdConfig) -> Result<u32, Error> {
        let id = self.family.id;
        let replies = self
            .sock
            .transact(|seq| nlmsg::nbd_request(id, NbdCmd::Connect, config, seq))
            .map_err(|source| Error::Kernel { op: "NBD_CMD_CONNECT", source })?;
        let reply = replies.first().ok_or(Error::Malformed("CONNECT without a reply"))?;
        Ok(nlmsg::parse_connect_reply(reply)?)
    }

    /// NBD_CMD_RECONFIGURE: the given sockets replace dead ones (the kernel
    /// ignores sockets beyond the dead ones).
    pub(crate) fn reconfigure(&mut self, config: &NbdConfig) -> Result<(), Error> {
        if config.index.is_none() {
            return Err(Error::Invalid("reconfigure needs an index".into()));
        }
        let id = self.family.id;
        self.sock
            .transact(|seq| nlmsg::nbd_request(id, NbdCmd::Reconfigure, config, seq))
            .map_err(|source| Error::Kernel { op: "NBD_CMD_RECONFIGURE", source })?;
        Ok(())
    }

    pub(crate) fn disconnect(&mut self, index: u32) -> Result<(), Error> {
        let id = self.family.id;
        self.sock
            .transact(|seq| nlmsg::nbd_request(id, NbdCmd::Disconnect, &NbdConfig { index: Some(index), ..Default::default() }, seq))
            .map_err(|source| Error::Kernel { op: "NBD_CMD_DISCONNECT", source })?;
        Ok(())
    }

    /// NBD_CMD_STATUS of one device, or of every device the driver has.
    pub(crate) fn status(&mut self, index: Option<u32>) -> Result<Vec<DeviceStatus>, Error> {
        let id = self.family.id;
        let replies = self
            .sock
            .transact(|seq| nlmsg::nbd_request(id, NbdCmd::Status, &NbdConfig { index, ..Default::default() }, seq))
            .map_err(|source| Error::Kernel { op: "NBD_CMD_STATUS", source })?;
        let mut out = Vec::new();
        for r in &replies {
            out.extend(nlmsg::parse_status_reply(r)?);
        }
        Ok(out)
    }
}

/// The nbd family's multicast group: the kernel announces there each
/// device whose every connection died (NBD_CMD_LINK_DEAD), which is when
/// the device waits for a RECONFIGURE with fresh sockets.
pub struct LinkDeadListener {
    sock: GenlSocket,
}

impl LinkDeadListener {
    pub fn open() -> Result<Self, Error> {
        let mut sock = GenlSocket::open().map_err(Error::io("genetlink socket"))?;
        let family = resolve(&mut sock)?;
        let group = family
            .groups
            .iter()
            .find(|(n, _)| n == nlmsg::NBD_MCAST_GROUP)
            .map(|(_, id)| *id)
            .ok_or(Error::Malformed("nbd family without its multicast group"))?;
        sock.add_membership(group).map_err(|source| Error::Kernel { op: "join nbd_mc_group", source })?;
        Ok(LinkDeadListener { sock })
    }

    /// The next dead device's index, waiting at most `timeout`.
    pub fn recv_timeout(&mut self, timeout: Duration) -> Result<Option<u32>, Error> {
        let deadline = std::time::Instant::now() + timeout;
        loop {
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            let Some(dgram) = self.sock.recv(Some(left)).map_err(Error::io("receive nbd notice"))? else {
                return Ok(None);
            };
            if let Some(index) = link_dead_index(dgram)? {
                return Ok(Some(index));
            }
            if left.is_zero() {
                return Ok(None);
            }
        }
    }
}

/// The device a LINK_DEAD datagram names (other messages: `None`).
pub fn link_dead_index(dgram: &[u8]) -> Result<Option<u32>, Error> {
    Ok(nlmsg::parse_link_dead(dgram)?)
}
