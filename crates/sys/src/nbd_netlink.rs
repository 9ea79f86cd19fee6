//! The kernel nbd driver's generic netlink family on one socket: its
//! commands (CONNECT, RECONFIGURE, DISCONNECT, STATUS) answered through
//! [`GenlSocket::transact`], and its LINK_DEAD notices.
//!
//! The one entry the nbd crate needs from this layer: the socket, the
//! family lookup and the message framing ([`crate::nlmsg`]) stay behind it,
//! so the family's layout is spelled in one place.

use std::io;
use std::time::{Duration, Instant};

use crate::genetlink::GenlSocket;
use crate::nlmsg::{self, DeviceStatus, Malformed, NbdCmd, NbdConfig, NBD_FAMILY, NBD_MCAST_GROUP};

/// What can go wrong talking to the nbd family. The nbd crate tells a
/// missing module apart (it is the one a caller acts on); the rest names
/// the step that failed.
#[derive(Debug, thiserror::Error)]
pub enum NbdNetlinkError {
    /// The kernel has no "nbd" genl family: the module is not loaded.
    #[error("the kernel has no nbd netlink family")]
    NoFamily,
    /// A step the kernel refused, or the socket failed at.
    #[error("{op}: {source}")]
    Kernel { op: &'static str, source: io::Error },
    /// Bytes the kernel sent that do not parse, or an answer missing.
    #[error("malformed netlink message: {0}")]
    Malformed(&'static str),
}

impl From<Malformed> for NbdNetlinkError {
    fn from(m: Malformed) -> Self {
        NbdNetlinkError::Malformed(m.0)
    }
}

fn kernel(op: &'static str) -> impl FnOnce(io::Error) -> NbdNetlinkError {
    move |source| NbdNetlinkError::Kernel { op, source }
}

/// A genl socket that knows the nbd family's id.
pub struct NbdNetlink {
    sock: GenlSocket,
    family: u16,
}

impl NbdNetlink {
    /// Opens a socket and resolves the family ([`NbdNetlinkError::NoFamily`]
    /// when the nbd module is not loaded). With `notices`, the socket also
    /// joins the family's multicast group, where the kernel announces each
    /// device whose every connection died ([`NbdNetlink::next_link_dead`]).
    pub fn open(notices: bool) -> Result<Self, NbdNetlinkError> {
        let mut sock = GenlSocket::open().map_err(kernel("genetlink socket"))?;
        let family = match sock.resolve_family(NBD_FAMILY) {
            Ok(f) => f,
            Err(e) if e.raw_os_error() == Some(libc::ENOENT) => return Err(NbdNetlinkError::NoFamily),
            Err(source) => return Err(NbdNetlinkError::Kernel { op: "CTRL_CMD_GETFAMILY nbd", source }),
        };
        if notices {
            let group = family
                .groups
                .iter()
                .find(|(n, _)| n == NBD_MCAST_GROUP)
                .map(|(_, id)| *id)
                .ok_or(NbdNetlinkError::Malformed("nbd family without its multicast group"))?;
            sock.add_membership(group).map_err(kernel("join nbd_mc_group"))?;
        }
        Ok(NbdNetlink { sock, family: family.id })
    }

    /// Sends one command and collects the reply payloads.
    fn request(&mut self, cmd: NbdCmd, config: &NbdConfig, op: &'static str) -> Result<Vec<Vec<u8>>, NbdNetlinkError> {
        let id = self.family;
        self.sock.transact(|seq| nlmsg::nbd_request(id, cmd, config, seq)).map_err(kernel(op))
    }

    /// NBD_CMD_CONNECT; the device index the kernel chose (or was given).
    pub fn connect(&mut self, config: &NbdConfig) -> Result<u32, NbdNetlinkError> {
        let replies = self.request(NbdCmd::Connect, config, "NBD_CMD_CONNECT")?;
        let reply = replies.first().ok_or(NbdNetlinkError::Malformed("CONNECT without a reply"))?;
        Ok(nlmsg::parse_connect_reply(reply)?)
    }

    /// NBD_CMD_RECONFIGURE of the device `config.index` names: the given
    /// sockets replace dead ones (the kernel ignores sockets beyond the
    /// dead ones).
    pub fn reconfigure(&mut self, config: &NbdConfig) -> Result<(), NbdNetlinkError> {
        if config.index.is_none() {
            let source = io::Error::new(io::ErrorKind::InvalidInput, "reconfigure needs an index");
            return Err(NbdNetlinkError::Kernel { op: "NBD_CMD_RECONFIGURE", source });
        }
        self.request(NbdCmd::Reconfigure, config, "NBD_CMD_RECONFIGURE")?;
        Ok(())
    }

    /// NBD_CMD_DISCONNECT of one device.
    pub fn disconnect(&mut self, index: u32) -> Result<(), NbdNetlinkError> {
        self.request(NbdCmd::Disconnect, &NbdConfig { index: Some(index), ..Default::default() }, "NBD_CMD_DISCONNECT")?;
        Ok(())
    }

    /// NBD_CMD_STATUS of one device, or of every device the driver has.
    pub fn status(&mut self, index: Option<u32>) -> Result<Vec<DeviceStatus>, NbdNetlinkError> {
        let replies = self.request(NbdCmd::Status, &NbdConfig { index, ..Default::default() }, "NBD_CMD_STATUS")?;
        let mut out = Vec::new();
        for r in &replies {
            out.extend(nlmsg::parse_status_reply(r)?);
        }
        Ok(out)
    }

    /// The next dead device's index, waiting at most `timeout` (a socket
    /// opened with `notices`; others never hear of one).
    pub fn next_link_dead(&mut self, timeout: Duration) -> Result<Option<u32>, NbdNetlinkError> {
        let deadline = Instant::now() + timeout;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let Some(dgram) = self.sock.recv(Some(left)).map_err(kernel("receive nbd notice"))? else {
                return Ok(None);
            };
            if let Some(index) = nlmsg::parse_link_dead(dgram)? {
                return Ok(Some(index));
            }
            if left.is_zero() {
                return Ok(None);
            }
        }
    }
}
