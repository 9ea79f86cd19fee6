//! A device served by another node's export over TCP: each connection is
//! a TCP socket to the export URI, negotiated by [`crate::client`]
//! with the export's secret and handed to the kernel.
//!
//! When the owning node's server goes away the kernel sees the sockets
//! close, queues I/O for the dead-connection timeout and announces
//! LINK_DEAD; [`RemoteAttachment::refresh`] (retried until the server is
//! back) gives the device fresh sockets and the queued I/O completes.

use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
use std::os::fd::{AsFd, OwnedFd};
use std::time::Duration;

use super::control::{ConnectSpec, NbdControl};
use super::Error;
use crate::client::{self, ExportDetails};
use crate::remote::{wire_name, ExportUri, Secret};
use crate::wire::tx;

/// How long a TCP connect and one negotiation may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// Where a remote device's sockets go. `Debug` does not show the secret.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RemoteSource {
    pub uri: ExportUri,
    pub secret: Secret,
    /// This node's name, given to the owning node with each connection so
    /// its fence holds the volume for this node alone (`None`: no name).
    pub client: Option<String>,
}

/// A device this process keeps connected to a remote export.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RemoteAttachment {
    pub index: u32,
    pub source: RemoteSource,
    pub backend_id: String,
    /// Sockets given to the kernel (1 unless the export allows several).
    pub connections: usize,
    pub details: ExportDetails,
}

fn resolve(uri: &ExportUri) -> Result<Vec<SocketAddr>, Error> {
    let addrs: Vec<_> = uri.authority().to_socket_addrs().map_err(Error::io(format!("resolve {}", uri.authority())))?.collect();
    if addrs.is_empty() {
        return Err(Error::Io { what: format!("resolve {}", uri.authority()), source: std::io::ErrorKind::NotFound.into() });
    }
    Ok(addrs)
}

/// One TCP socket to the export, negotiated; ready for the kernel.
fn connect_one(addrs: &[SocketAddr], source: &RemoteSource) -> Result<(OwnedFd, ExportDetails), Error> {
    let mut last = None;
    for a in addrs {
        match TcpStream::connect_timeout(a, CONNECT_TIMEOUT) {
            Ok(mut s) => {
                s.set_nodelay(true).map_err(Error::io("TCP_NODELAY"))?;
                let d =
                    client::negotiate(&mut s, &wire_name(&source.uri.export, &source.secret, source.client.as_deref()), CONNECT_TIMEOUT)?;
                // The kernel's driver waits on the socket itself: no timeouts of ours.
                s.set_read_timeout(None).and_then(|_| s.set_write_timeout(None)).map_err(Error::io("clear socket timeout"))?;
                return Ok((OwnedFd::from(s), d));
            }
            Err(e) => last = Some(Error::Io { what: format!("connect {a} ({})", source.uri), source: e }),
        }
    }
    Err(last.unwrap_or(Error::Invalid("no address to connect to".into())))
}

/// Up to `wanted` negotiated sockets: one first, then more only if the
/// export says connections share one view (CAN_MULTI_CONN).
pub fn connected_sockets(source: &RemoteSource, wanted: usize) -> Result<(Vec<OwnedFd>, ExportDetails), Error> {
    if wanted == 0 {
        return Err(Error::Invalid("at least one connection".into()));
    }
    let addrs = resolve(&source.uri)?;
    let (first, details) = connect_one(&addrs, source)?;
    let n = if details.tx_flags & tx::CAN_MULTI_CONN != 0 { wanted } else { 1 };
    let mut out = vec![first];
    for _ in 1..n {
        let (s, d) = connect_one(&addrs, source)?;
        if d.size != details.size || d.tx_flags != details.tx_flags {
            return Err(Error::Invalid("connections of one export disagree on its size or flags".into()));
        }
        out.push(s);
    }
    Ok((out, details))
}

/// Lets the export go on negotiated sockets the kernel never took (an
/// attach that failed after the negotiation): each is sent NBD_CMD_DISC
/// before it closes. The owning node keeps a volume held by this node
/// while its connections merely drop (a consumer away comes back), and
/// lets it go on DISC — so an attach that failed must say it, or the
/// volume would stay fenced there. Best effort: a socket that cannot take
/// the 28 bytes leaves the volume held, the safe side.
pub fn let_go(sockets: Vec<OwnedFd>) {
    use crate::wire::{cmd, encode_request, HeaderStyle, Request};
    use std::io::Write;
    let mut disc = Vec::with_capacity(28);
    encode_request(&Request { flags: 0, kind: cmd::DISC, cookie: 0, offset: 0, length: 0 }, HeaderStyle::Simple, &mut disc);
    for s in sockets {
        let mut stream = TcpStream::from(s);
        let _ = stream.set_write_timeout(Some(CONNECT_TIMEOUT));
        if let Err(e) = stream.write_all(&disc) {
            tracing::warn!(error = %e, "could not tell the export this node lets it go");
        }
        let _ = stream.shutdown(std::net::Shutdown::Write);
    }
}

impl RemoteAttachment {
    /// Connects a device to sockets from [`connected_sockets`] (made
    /// before the caller took the control lock), carrying `backend_id`.
    pub fn connect(
        control: &mut NbdControl,
        source: &RemoteSource,
        backend_id: &str,
        sockets: Vec<OwnedFd>,
        details: ExportDetails,
        tune: impl FnOnce(&mut ConnectSpec),
    ) -> Result<Self, Error> {
        let mut spec = ConnectSpec::for_export(&details, backend_id);
        tune(&mut spec);
        let fds: Vec<_> = sockets.iter().map(|s| s.as_fd()).collect();
        let index = control.connect(&spec, &fds)?;
        let connections = sockets.len();
        // The kernel holds its own references to the sockets now.
        drop(sockets);
        Ok(RemoteAttachment { index, source: source.clone(), backend_id: backend_id.to_string(), connections, details })
    }

    /// Gives a device (connected by this or an earlier process) fresh
    /// sockets, refusing one whose backend is not `backend_id`.
    pub fn reconnect(
        control: &mut NbdControl,
        index: u32,
        source: &RemoteSource,
        backend_id: &str,
        sockets: Vec<OwnedFd>,
        details: ExportDetails,
    ) -> Result<Self, Error> {
        let fds: Vec<_> = sockets.iter().map(|s| s.as_fd()).collect();
        control.reconfigure(index, backend_id, None, &fds)?;
        let connections = sockets.len();
        drop(sockets);
        Ok(RemoteAttachment { index, source: source.clone(), backend_id: backend_id.to_string(), connections, details })
    }

    /// After LINK_DEAD: fresh sockets to the export (which may have come
    /// back in another process, or grown) replace the dead ones.
    pub fn refresh_with(&mut self, control: &mut NbdControl, sockets: Vec<OwnedFd>, details: ExportDetails) -> Result<(), Error> {
        let fds: Vec<_> = sockets.iter().map(|s| s.as_fd()).collect();
        let size = (details.size != self.details.size && self.details.size != 0).then_some(details.size);
        control.reconfigure(self.index, &self.backend_id, size, &fds)?;
        self.details = details;
        Ok(())
    }
}
