//! Ring 0's multishot accepts on the listeners, and where each accepted
//! socket goes: the rings in turn.

use std::io;
use std::os::fd::OwnedFd;

use super::token::Token;
use volring_ring::{Cqe, IoRing, Op, OpId};

pub(super) struct Acceptor {
    /// Listeners this ring accepts on (ring 0 only).
    listeners: Vec<i32>,
    /// The accept armed on each listener.
    accepts: Vec<Option<OpId>>,
    /// The ring the next accepted socket goes to.
    next_ring: usize,
}

impl Acceptor {
    pub(super) fn new(listeners: Vec<i32>) -> Self {
        Acceptor { accepts: vec![None; listeners.len()], listeners, next_ring: 0 }
    }

    /// Accepts armed now (each an operation that waits on clients).
    pub(super) fn armed(&self) -> usize {
        self.accepts.iter().filter(|a| a.is_some()).count()
    }

    /// Arms a multishot accept on every listener.
    pub(super) fn arm_all(&mut self, ring: &mut IoRing<Token>) -> io::Result<()> {
        for i in 0..self.listeners.len() {
            self.arm(ring, i)?;
        }
        Ok(())
    }

    fn arm(&mut self, ring: &mut IoRing<Token>, i: usize) -> io::Result<()> {
        self.accepts[i] = Some(ring.submit(Token::Accept(i as u32), Op::AcceptMulti { listener: self.listeners[i] })?);
        Ok(())
    }

    /// An accept completion on listener `li`: the accept is armed again if
    /// it ended (unless the ring is stopping); returns the accepted socket
    /// and the ring (of `rings`) it goes to.
    pub(super) fn on_accept(
        &mut self,
        ring: &mut IoRing<Token>,
        li: usize,
        c: &Cqe<Token>,
        stopping: bool,
        rings: usize,
    ) -> Option<(OwnedFd, usize)> {
        if !c.more {
            self.accepts[li] = None;
            if !stopping {
                if let Err(e) = self.arm(ring, li) {
                    tracing::error!(error = %e, "NBD accept could not be re-armed");
                }
            }
        }
        let Some(fd) = c.accepted_fd() else {
            if c.result != -libc::ECANCELED {
                tracing::warn!(error = %io::Error::from_raw_os_error(-c.result), "NBD accept failed");
            }
            return None;
        };
        let target = self.next_ring % rings;
        self.next_ring = self.next_ring.wrapping_add(1);
        Some((fd, target))
    }

    /// Stops accepting (the server is stopping).
    pub(super) fn cancel_all(&mut self, ring: &mut IoRing<Token>) {
        for op in self.accepts.iter_mut().filter_map(Option::take) {
            let _ = ring.cancel(op);
        }
    }
}
