//! A device served by this process's own NBD server: each connection is a
//! socketpair, one end adopted by a ring of the server, the other
//! negotiated by [`crate::client`] and handed to the kernel.
//!
//! When the process dies the kernel sees every connection close, queues
//! I/O for the dead-connection timeout and announces LINK_DEAD; the next
//! process [`LocalAttachment::reattach`]es with fresh sockets and the
//! queued I/O completes.

use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::time::Duration;

use super::control::{ConnectSpec, NbdControl};
use super::Error;
use crate::client::{self, ExportDetails};
use crate::NbdServer;

/// How long one socketpair's negotiation may take (the server is in
/// this process: anything near this is a stuck ring).
const NEGOTIATE_TIMEOUT: Duration = Duration::from_secs(10);

/// A device this process serves.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LocalAttachment {
    pub index: u32,
    pub export: String,
    pub backend_id: String,
    pub connections: usize,
    pub details: ExportDetails,
}

/// `n` sockets negotiated on `export`, their server ends adopted by `server`.
pub fn connected_sockets(server: &NbdServer, export: &str, n: usize) -> Result<(Vec<OwnedFd>, ExportDetails), Error> {
    if n == 0 {
        return Err(Error::Invalid("at least one connection".into()));
    }
    let mut out = Vec::with_capacity(n);
    let mut details = None;
    for _ in 0..n {
        let (mut ours, theirs) = UnixStream::pair().map_err(Error::io("socketpair"))?;
        server.serve_connected(OwnedFd::from(theirs))?;
        let d = client::negotiate(&mut ours, export, NEGOTIATE_TIMEOUT)?;
        if details.is_some_and(|p: ExportDetails| p.size != d.size || p.tx_flags != d.tx_flags) {
            return Err(Error::Invalid("connections of one export disagree on its size or flags".into()));
        }
        details = Some(d);
        // The kernel's driver waits on the socket itself: no timeouts of ours.
        use rustix::net::sockopt::{set_socket_timeout, Timeout};
        for t in [Timeout::Recv, Timeout::Send] {
            set_socket_timeout(&ours, t, None).map_err(|e| Error::io("clear socket timeout")(e.into()))?;
        }
        out.push(OwnedFd::from(ours));
    }
    Ok((out, details.expect("n > 0")))
}

impl LocalAttachment {
    /// Connects a device (`spec.index`, or any free one) to `connections`
    /// sockets on `export`. `tune` adjusts the spec made from the export's
    /// negotiated size and flags (timeouts, index, client flags).
    pub fn attach(
        control: &mut NbdControl,
        server: &NbdServer,
        export: &str,
        backend_id: &str,
        connections: usize,
        tune: impl FnOnce(&mut ConnectSpec),
    ) -> Result<Self, Error> {
        let (sockets, details) = connected_sockets(server, export, connections)?;
        let mut spec = ConnectSpec::for_export(&details, backend_id);
        tune(&mut spec);
        let fds: Vec<_> = sockets.iter().map(|s| s.as_fd()).collect();
        let index = control.connect(&spec, &fds)?;
        // The kernel holds its own references to the sockets now.
        drop(sockets);
        Ok(LocalAttachment { index, export: export.to_string(), backend_id: backend_id.to_string(), connections, details })
    }

    /// Gives a device a previous process connected fresh sockets to this
    /// process's server, refusing one whose backend is not `backend_id`.
    pub fn reattach(
        control: &mut NbdControl,
        server: &NbdServer,
        index: u32,
        export: &str,
        backend_id: &str,
        connections: usize,
    ) -> Result<Self, Error> {
        let found = control.backend(index);
        super::control::check_found(index, backend_id, found)?;
        let (sockets, details) = connected_sockets(server, export, connections)?;
        let fds: Vec<_> = sockets.iter().map(|s| s.as_fd()).collect();
        control.reconfigure(index, backend_id, None, &fds)?;
        drop(sockets);
        Ok(LocalAttachment { index, export: export.to_string(), backend_id: backend_id.to_string(), connections, details })
    }

    /// After LINK_DEAD while this process lives: fresh sockets replace the
    /// dead ones (the kernel takes as many as it has dead connections).
    pub fn refresh(&mut self, control: &mut NbdControl, server: &NbdServer) -> Result<(), Error> {
        let (sockets, details) = connected_sockets(server, &self.export, self.connections)?;
        let fds: Vec<_> = sockets.iter().map(|s| s.as_fd()).collect();
        // A grown export is announced with its new size.
        let size = (details.size != self.details.size).then_some(details.size);
        control.reconfigure(self.index, &self.backend_id, size, &fds)?;
        self.details = details;
        Ok(())
    }

    /// Disconnects the device (its backend checked first: an index reused
    /// by another attachment is not torn down).
    pub fn detach(self, control: &mut NbdControl) -> Result<(), Error> {
        control.disconnect(self.index, Some(&self.backend_id))
    }
}
