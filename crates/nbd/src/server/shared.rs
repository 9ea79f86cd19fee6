//! What every part of a ring thread works on: the io_uring, the table of
//! connections (and which of them to look at after this batch), the memory
//! budget, the clock of this loop turn and the counters not folded yet.
//!
//! The moves of a connection's life that need the ring (the shutdown, the
//! close) are here too; the others are `Conn`'s own.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

use super::budget::{Limits, ServerBudget};
use super::conn::{Conn, Part, Rx, State};
use super::token::Token;
use crate::export::Export;
use crate::stats::{Kind, Pending};
use volring_ring::Buffers;
use volring_ring::{IoRing, Op};

pub(super) struct Shared {
    pub ring: IoRing<Token>,
    pub conns: Vec<Option<Conn>>,
    pub free_conns: Vec<u32>,
    /// Connections in the table.
    pub live: usize,
    /// Connections to look at after this batch.
    pub dirty: Vec<u32>,
    /// Connections closed since the last trim.
    pub closed_since_trim: usize,
    pub limits: Limits,
    pub budget: Arc<ServerBudget>,
    /// When this loop turn began.
    pub now: Instant,
    /// A request arrived since the last tick (an idle ring trims its memory).
    pub active: bool,
    /// Each export's counters of this batch, folded after it.
    pub stats: HashMap<u64, (Arc<Export>, Pending)>,
    /// Which connections sent requests lately.
    pub senders: Senders,
}

/// Which connections sent request bytes lately, as far as a large write
/// needs to know (`inline::InlineWrite::large_out`): in constant time, however
/// many connections the ring has.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub(super) struct Senders {
    /// Since the last tick.
    now: Period,
    /// Between the two ticks before.
    before: Period,
}

/// The connections that sent in one period between ticks.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
struct Period {
    /// The first one.
    first: Option<u32>,
    /// Another one sent too.
    several: bool,
}

impl Period {
    fn other_than(self, ci: u32) -> bool {
        self.several || self.first.is_some_and(|first| first != ci)
    }
}

impl Senders {
    /// Connection `ci` sent request bytes (a header, a payload's part, or
    /// requests held while it was paused).
    pub(super) fn saw(&mut self, ci: u32) {
        match self.now.first {
            None => self.now.first = Some(ci),
            Some(first) if first != ci => self.now.several = true,
            Some(_) => {}
        }
    }

    /// Whether a connection other than `ci` sent since the tick before the
    /// last one.
    pub(super) fn others_than(&self, ci: u32) -> bool {
        self.now.other_than(ci) || self.before.other_than(ci)
    }

    /// A tick: what was seen since the last one becomes the period before.
    pub(super) fn tick(&mut self) {
        *self = Senders { now: Period::default(), before: self.now };
    }
}

impl Shared {
    pub(crate) fn new(ring: IoRing<Token>, limits: Limits, budget: Arc<ServerBudget>) -> Self {
        Shared {
            ring,
            conns: Vec::new(),
            free_conns: Vec::new(),
            live: 0,
            dirty: Vec::new(),
            closed_since_trim: 0,
            limits,
            budget,
            now: Instant::now(),
            active: false,
            stats: HashMap::new(),
            senders: Senders::default(),
        }
    }

    pub(crate) fn conn(&self, ci: u32) -> Option<&Conn> {
        self.conns[ci as usize].as_ref()
    }

    pub(crate) fn conn_mut(&mut self, ci: u32) -> Option<&mut Conn> {
        self.conns[ci as usize].as_mut()
    }

    /// Puts a new connection into a free slot.
    pub(crate) fn insert(&mut self, conn: Conn) -> u32 {
        let ci = match self.free_conns.pop() {
            Some(i) => i,
            None => {
                self.conns.push(None);
                self.conns.len() as u32 - 1
            }
        };
        self.conns[ci as usize] = Some(conn);
        self.live += 1;
        ci
    }

    /// Takes a closed connection out; its slot is free.
    pub(crate) fn remove(&mut self, ci: u32) -> Option<Conn> {
        let c = self.conns[ci as usize].take()?;
        self.free_conns.push(ci);
        self.live -= 1;
        self.closed_since_trim += 1;
        Some(c)
    }

    /// Queues connection `ci` to be looked at after this batch.
    pub(crate) fn mark(&mut self, ci: u32) {
        if let Some(c) = self.conns[ci as usize].as_mut() {
            if !c.dirty {
                c.dirty = true;
                self.dirty.push(ci);
            }
        }
    }

    /// No more requests are read; the connection closes once its requests
    /// are answered and sent.
    pub(crate) fn begin_close(&mut self, ci: u32) {
        if let Some(c) = self.conns[ci as usize].as_mut() {
            c.drain();
        }
        self.mark(ci);
    }

    /// The socket is unusable: drop queued replies and close at once.
    pub(crate) fn break_conn(&mut self, ci: u32) {
        let Some(c) = self.conns[ci as usize].as_mut() else { return };
        c.break_off();
        drop_parts(c, self.ring.buffers(), &self.budget);
        self.mark(ci);
    }

    /// Ends the receive armed on connection `ci`, if any.
    pub(crate) fn stop_receiving(&mut self, ci: u32) {
        let Some(c) = self.conns[ci as usize].as_mut() else { return };
        if let Rx::Multishot(op) | Rx::Direct(op) | Rx::Header(op) = c.rx {
            c.rx = Rx::Cancelling;
            let _ = self.ring.cancel(op);
        }
    }

    /// Draining or Broken → ShuttingDown, once drained (see `Conn::drained`):
    /// the receive is ended and the socket shut down, which also wakes a
    /// splice stuck on a full socket with an error.
    pub(crate) fn shut_down_if_drained(&mut self, ci: u32) {
        let Some(c) = self.conns[ci as usize].as_mut().filter(|c| c.drained()) else { return };
        c.state = State::ShuttingDown;
        self.stop_receiving(ci);
        let c = self.conns[ci as usize].as_mut().expect("present above");
        if self.ring.submit(Token::Shutdown(ci), Op::Shutdown { socket: c.socket }).is_ok() {
            c.socket_ops += 1;
        }
    }

    /// ShuttingDown → Closing once no socket operation is left.
    pub(crate) fn close_socket(&mut self, ci: u32) {
        let Some(c) = self.conns[ci as usize].as_mut().filter(|c| c.socket_ops == 0) else { return };
        match self.ring.submit(Token::Close(ci), Op::Close { socket: c.socket }) {
            Ok(_) => c.state = State::Closing,
            Err(e) => tracing::warn!(error = %e, "NBD socket close could not be submitted"),
        }
    }

    /// The export connection `ci` is attached to.
    pub(crate) fn export_of(&self, ci: u32) -> Option<Arc<Export>> {
        self.conn(ci).and_then(|c| c.attached()).map(|a| a.export.clone())
    }

    /// Counts a reply of connection `ci`'s export.
    pub(crate) fn record(&mut self, ci: u32, kind: Kind, bytes: u64, ok: bool, started: Instant) {
        let us = self.now.saturating_duration_since(started).as_micros() as u64;
        if let Some(pending) = self.pending_of(ci) {
            pending.record(kind, bytes, ok, us);
        }
    }

    /// Counts a READ of connection `ci`'s export handed to io_uring's
    /// workers.
    pub(crate) fn record_offloaded_read(&mut self, ci: u32) {
        if let Some(pending) = self.pending_of(ci) {
            pending.offloaded_read();
        }
    }

    /// Counts WRITE payload bytes of connection `ci`'s export copied out of
    /// where they were received.
    pub(crate) fn record_copied_write(&mut self, ci: u32, bytes: u64) {
        if let Some(pending) = self.pending_of(ci) {
            pending.copied_write(bytes);
        }
    }

    /// This batch's counters of connection `ci`'s export. The export's Arc
    /// is cloned only for its first request on this ring.
    fn pending_of(&mut self, ci: u32) -> Option<&mut Pending> {
        let id = self.conn(ci).and_then(|c| c.attached()).map(|a| a.export.id)?;
        if !self.stats.contains_key(&id) {
            let export = self.export_of(ci)?;
            self.stats.insert(id, (export, Default::default()));
        }
        self.stats.get_mut(&id).map(|(_, p)| p)
    }

    /// Folds this batch's counters into the exports'.
    pub(crate) fn fold_stats(&mut self) {
        for (export, pending) in self.stats.values_mut() {
            export.stats.fold(pending);
        }
    }
}

/// Frees every queued part of a connection that will send no more.
pub(super) fn drop_parts(c: &mut Conn, bufs: &mut Buffers, budget: &ServerBudget) {
    c.tail = None;
    for p in c.out.drain(..) {
        match p {
            Part::Buf(b, _, _) => {
                let cost = Buffers::cost_of(bufs.len(b));
                c.account.release(budget, cost, cost);
                bufs.free(b);
            }
            Part::Splice { len, .. } => c.account.release(budget, len as usize, 0),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::Senders;

    #[test]
    fn a_writer_alone_is_alone_until_another_connection_sends() {
        let mut s = Senders::default();
        assert!(!s.others_than(3), "nobody sent");
        s.saw(3);
        s.saw(3);
        assert!(!s.others_than(3), "only the writer sent");
        assert!(s.others_than(4), "for another connection, the writer is the other");
        s.saw(7);
        assert!(s.others_than(3), "a reader sent too");
        s.tick();
        assert!(s.others_than(3), "a tick later, the reader is still counted: it sent in the last period");
        s.saw(3);
        assert!(s.others_than(3));
        s.tick();
        s.saw(3);
        assert!(!s.others_than(3), "a whole period with the writer alone: alone again");
        s.saw(9);
        assert!(s.others_than(3), "at once when another sends");
    }

    #[test]
    fn a_lone_sender_of_the_period_before_still_counts() {
        let mut s = Senders::default();
        s.saw(7);
        s.tick();
        s.saw(3);
        assert!(s.others_than(3), "the reader sent alone in the period before: it may still wait");
        s.tick();
        assert!(!s.others_than(3), "two ticks without it: gone");
    }
}
