//! A ring's receiving side: receives armed and ended, received bytes into
//! handshake steps and admitted requests, connections paused by the
//! server's budget, and the receive pool's recovery when the kernel loses
//! buffers.

use std::io;

use super::budget::{Gate, Refusal};
use super::conn::{Blocked, Fed, Lend, Parsed, Phase, Rx, State};
use super::direct;
use super::exports::Attachments;
use super::output::Output;
use super::requests::Requests;
use super::shared::Shared;
use super::token::Token;
use crate::handshake::Outcome;
use volring_ring::{Cqe, Op};

/// A handshake stops being read while this many reply bytes wait to be
/// sent (a flood of NBD_OPT_LIST would otherwise queue without bound).
const HANDSHAKE_REPLIES: usize = 64 * 1024;

/// Where bytes to split into requests come from.
pub(super) enum Source {
    /// A provided receive buffer and its length.
    Recv(u16, usize),
    /// Bytes a paused connection had received and not taken.
    Owned(Vec<u8>),
}

/// The ring's receiving state.
pub(super) struct Receive {
    /// The kernel lost provided buffers: multishot receives are being ended
    /// so the pool can be handed over afresh; none is armed meanwhile.
    recovering: bool,
    /// Large payloads are received directly (cancelling the multishot
    /// receive first), and after one the next header alone; off for good
    /// on a ring whose kernel lost buffers, since those cancels are what
    /// lose them.
    direct: bool,
    /// Connections the server's budget stopped, woken when memory is released.
    waiters: Vec<u32>,
    /// The budget's release count when the waiters were last woken.
    waiters_seen: u64,
    /// Provided receive buffers writes in flight may be written from: a
    /// quarter of the pool. Past it payloads are copied out, so connections
    /// whose writes hang never keep the pool from receiving.
    lend_cap: u16,
    /// Direct receives of a payload in flight.
    direct_armed: usize,
    /// Payloads whose last bytes a direct receive took, since the ring began.
    direct_done: u64,
}

impl Receive {
    /// The receiving state of a ring whose receive pool has `pool` buffers.
    pub(super) fn new(pool: u16) -> Self {
        Receive {
            recovering: false,
            direct: true,
            waiters: Vec::new(),
            waiters_seen: 0,
            lend_cap: pool / 4,
            direct_armed: 0,
            direct_done: 0,
        }
    }

    pub(super) fn recovering(&self) -> bool {
        self.recovering
    }

    pub(super) fn direct(&self) -> bool {
        self.direct
    }

    /// While a large WRITE's payload is being received directly, the
    /// count of payloads so received to the end (it moves on as each one
    /// completes); None when no payload is on its way.
    pub(super) fn streaming(&self) -> Option<u64> {
        (self.direct_armed > 0).then_some(self.direct_done)
    }

    pub(super) fn waiting(&self) -> usize {
        self.waiters.len()
    }

    pub(super) fn on_recv(
        &mut self,
        sh: &mut Shared,
        out: &mut Output,
        reqs: &mut Requests,
        exports: &mut Attachments,
        ci: u32,
        c: Cqe<Token>,
    ) {
        let Some(conn) = sh.conns[ci as usize].as_mut() else {
            if let Some(bid) = c.recv_buf {
                sh.ring.recycle(bid);
            }
            return;
        };
        if !c.more {
            conn.rx = Rx::Idle;
            conn.socket_ops -= 1;
        }
        sh.mark(ci);
        let Some(bid) = c.recv_buf else {
            match c.result {
                0 => sh.begin_close(ci),
                r if r == -libc::ENOBUFS || r == -libc::ECANCELED => {} // re-armed after the batch
                r => {
                    tracing::debug!(error = %io::Error::from_raw_os_error(-r), "NBD receive failed");
                    sh.break_conn(ci);
                }
            }
            return;
        };
        let n = c.result.max(0) as usize;
        sh.senders.saw(ci);
        let conn = sh.conns[ci as usize].as_mut().expect("checked above");
        conn.last_activity = sh.now;
        let serving = matches!(conn.phase, Phase::Serving { .. });
        match conn.state {
            State::Reading if serving => {
                self.pump(sh, out, reqs, exports, ci, &Source::Recv(bid, n));
                // Writes made from it recycle it when the last one ends.
                if sh.conn_mut(ci).is_some_and(|c| c.keep_lent(bid)) {
                    return;
                }
            }
            // A handshake, or bytes that arrived before a pause took
            // effect: kept (and charged) until they can be taken.
            State::Reading | State::Paused(_) => {
                let (data, _) = sh.ring.received(bid, n);
                conn.inbuf.extend_from_slice(data);
                conn.sync_inbuf(&sh.budget);
                if conn.state == State::Reading {
                    sh.ring.recycle(bid);
                    return self.negotiate(sh, out, reqs, exports, ci);
                }
            }
            // Nothing more is read from a closing connection.
            _ => {}
        }
        sh.ring.recycle(bid);
    }

    /// Splits bytes into requests for connection `ci` and acts on each one
    /// before the next is admitted, so every buffer is charged before the
    /// next request is looked at. What is not taken stays in `inbuf`. The
    /// payload bytes it copied into WRITE buffers are counted.
    fn pump(&mut self, sh: &mut Shared, out: &mut Output, reqs: &mut Requests, exports: &mut Attachments, ci: u32, src: &Source) {
        self.split(sh, out, reqs, exports, ci, src);
        if let Some(c) = sh.conn_mut(ci) {
            c.depth = c.depth.max(std::mem::take(&mut c.split_requests));
        }
        let copied = sh.conn_mut(ci).map_or(0, |c| std::mem::take(&mut c.copied));
        if copied > 0 {
            sh.record_copied_write(ci, copied);
        }
    }

    fn split(&mut self, sh: &mut Shared, out: &mut Output, reqs: &mut Requests, exports: &mut Attachments, ci: u32, src: &Source) {
        let mut pos = 0;
        loop {
            // A WRITE may be written from the receive buffer itself while
            // the ring's pool keeps most buffers for receiving.
            let lend = match src {
                Source::Recv(bid, _) if sh.ring.stats().recv_lent < self.lend_cap => Some(Lend { bid: *bid, base: pos }),
                _ => None,
            };
            let Some(conn) = sh.conns[ci as usize].as_mut().filter(|c| c.state == State::Reading) else { return };
            let (data, bufs) = match src {
                Source::Recv(bid, n) => sh.ring.received(*bid, *n),
                Source::Owned(v) => (&v[..], sh.ring.buffers()),
            };
            if pos >= data.len() {
                return;
            }
            let gate = Gate { limits: &sh.limits, server: &sh.budget };
            match conn.feed(&data[pos..], bufs, gate, sh.now, lend) {
                Err(e) => {
                    tracing::debug!(error = %e, "NBD client broke the protocol; closing");
                    return sh.break_conn(ci);
                }
                Ok((used, fed)) => {
                    pos += used;
                    match fed {
                        Fed::Parsed(p) => {
                            conn.split_requests = conn.split_requests.saturating_add(1);
                            sh.active = true;
                            reqs.take_parsed(sh, out, exports, ci, p);
                        }
                        Fed::More | Fed::Closing => return,
                        Fed::Blocked(why) => {
                            conn.inbuf.extend_from_slice(&data[pos..]);
                            conn.sync_inbuf(&sh.budget);
                            conn.pause(Blocked::Refused(why));
                            if why == Refusal::Server && conn.server_wait.is_none() {
                                conn.server_wait = Some(sh.budget.releases());
                                self.waiters.push(ci);
                            }
                            sh.mark(ci);
                            return;
                        }
                    }
                }
            }
        }
    }

    /// Runs the handshake over what connection `ci` has received.
    fn negotiate(&mut self, sh: &mut Shared, out: &mut Output, reqs: &mut Requests, exports: &mut Attachments, ci: u32) {
        let scratch = &mut out.scratch;
        let Some(conn) = sh.conns[ci as usize].as_mut() else { return };
        let Phase::Handshake(hs) = &mut conn.phase else { return };
        scratch.clear();
        let mut pos = 0;
        let mut entered = None;
        let mut failed = false;
        loop {
            // Replies the client has not read stop the reading of options.
            let waiting = conn.account.held + scratch.len();
            if waiting >= HANDSHAKE_REPLIES {
                conn.pause(Blocked::Replies);
                break;
            }
            match hs.step(&conn.inbuf[pos..], exports.exports(), scratch) {
                Ok((used, outcome)) => {
                    pos += used;
                    match outcome {
                        Outcome::NeedMore => break,
                        Outcome::Continue => continue,
                        Outcome::Enter(n) => {
                            entered = Some(n);
                            break;
                        }
                        Outcome::End(_) => {
                            conn.drain();
                            break;
                        }
                    }
                }
                Err(e) => {
                    tracing::debug!(error = %e, "NBD handshake failed");
                    failed = true;
                    break;
                }
            }
        }
        conn.inbuf.drain(..pos);
        conn.sync_inbuf(&sh.budget);
        out.queue_scratch(sh, ci);
        out.shrink();
        if failed {
            return sh.break_conn(ci);
        }
        let Some(n) = entered else { return };
        let attached = match exports.attach(&mut sh.ring, n.export.clone()) {
            Ok(a) => a,
            Err(e) => {
                tracing::warn!(export = %n.name, error = %e, "NBD export could not be registered");
                n.export.release();
                return sh.break_conn(ci);
            }
        };
        let conn = sh.conns[ci as usize].as_mut().expect("present above");
        conn.phase = Phase::Serving { attached, style: n.style, base_allocation: n.base_allocation };
        tracing::debug!(export = %n.name, style = ?n.style, "NBD client entered transmission");
        let rest = std::mem::take(&mut conn.inbuf);
        conn.sync_inbuf(&sh.budget);
        if !rest.is_empty() {
            self.pump(sh, out, reqs, exports, ci, &Source::Owned(rest));
        }
    }

    /// A direct receive of connection `ci`'s payload completed with `res`.
    pub(super) fn on_recv_into(
        &mut self,
        sh: &mut Shared,
        out: &mut Output,
        reqs: &mut Requests,
        exports: &mut Attachments,
        ci: u32,
        res: i32,
    ) {
        self.direct_armed -= 1;
        let Some(c) = sh.conns[ci as usize].as_mut() else { return };
        c.rx = Rx::Idle;
        c.socket_ops -= 1;
        sh.mark(ci);
        match res {
            n if n > 0 => {
                sh.senders.saw(ci);
                let c = sh.conns[ci as usize].as_mut().expect("checked above");
                c.last_activity = sh.now;
                let Some(p) = c.payload.as_mut() else { return };
                p.filled += n as usize;
                if p.filled >= p.req.length as usize {
                    self.direct_done += 1;
                    let p = c.payload.take().expect("checked above");
                    sh.active = true;
                    reqs.take_parsed(sh, out, exports, ci, Parsed::Write(p));
                }
            }
            0 => sh.begin_close(ci),
            r if r == -libc::ECANCELED => {} // paused or closing; re-armed by service if wanted
            r => {
                tracing::debug!(error = %std::io::Error::from_raw_os_error(-r), "NBD receive failed");
                sh.break_conn(ci);
            }
        }
    }

    /// Paused → Reading: what it had received is taken first; reading
    /// resumes only if all of it fits.
    pub(super) fn resume(&mut self, sh: &mut Shared, out: &mut Output, reqs: &mut Requests, exports: &mut Attachments, ci: u32) {
        let Some(c) = sh.conns[ci as usize].as_mut() else { return };
        if matches!(c.phase, Phase::Serving { .. }) {
            let rest = std::mem::take(&mut c.inbuf);
            if !rest.is_empty() {
                sh.senders.saw(ci);
            }
            c.sync_inbuf(&sh.budget);
            self.pump(sh, out, reqs, exports, ci, &Source::Owned(rest));
        } else {
            self.negotiate(sh, out, reqs, exports, ci);
        }
    }

    /// Keeps a receive armed on a connection being read: a multishot one,
    /// (for the rest of a large payload) a direct one, which ends the
    /// multishot one first, or (after a large WRITE) one of the next
    /// header alone. While the pool is being handed over no receive from
    /// it is armed; a direct receive may start or run on (it uses no pool
    /// buffer, and cancelling one would cut a payload in two). True when
    /// it armed one.
    pub(super) fn keep_receiving(&mut self, sh: &mut Shared, ci: u32) -> bool {
        let Some(c) = sh.conns[ci as usize].as_mut() else { return false };
        let wants_direct = self.direct && direct::wants_direct(c);
        let header = if self.direct { direct::header_rest(c) } else { None };
        match c.rx {
            Rx::Idle if wants_direct || !self.recovering => {
                let armed = if wants_direct {
                    direct::arm(&mut sh.ring, ci, c).map(Rx::Direct)
                } else if let Some(len) = header {
                    direct::arm_header(&mut sh.ring, ci, c, len).map(Rx::Header)
                } else {
                    sh.ring.submit(Token::Recv(ci), Op::RecvMulti { socket: c.socket }).map(Rx::Multishot)
                };
                match armed {
                    Ok(rx) => {
                        if matches!(rx, Rx::Direct(_)) {
                            self.direct_armed += 1;
                        }
                        c.rx = rx;
                        c.socket_ops += 1;
                        return true;
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "NBD receive could not be armed");
                        sh.break_conn(ci);
                    }
                }
            }
            // After a large WRITE whose payload the multishot receive took
            // (too little was left to receive directly) it is ended too,
            // or it would take the next WRITE's head as well.
            Rx::Multishot(op) if wants_direct || self.recovering || header.is_some() => {
                c.rx = Rx::Cancelling;
                let _ = sh.ring.cancel(op);
            }
            Rx::Header(op) if self.recovering => {
                c.rx = Rx::Cancelling;
                let _ = sh.ring.cancel(op);
            }
            _ => {}
        }
        false
    }

    /// After a batch: connections the server's budget stopped are woken
    /// if memory was released, and a pool the kernel lost buffers of
    /// starts being handed over afresh.
    pub(super) fn after_batch(&mut self, sh: &mut Shared) {
        if !self.waiters.is_empty() && sh.budget.releases() != self.waiters_seen {
            self.wake_waiters(sh);
        }
        if sh.ring.stats().recv_pool_lost && !self.recovering {
            self.begin_recovery(sh);
        }
    }

    /// Memory was released somewhere: connections the server's budget
    /// stopped try their next request again.
    pub(super) fn wake_waiters(&mut self, sh: &mut Shared) {
        self.waiters_seen = sh.budget.releases();
        for ci in std::mem::take(&mut self.waiters) {
            if let Some(c) = sh.conns[ci as usize].as_mut() {
                c.server_wait = None;
                sh.mark(ci);
            }
        }
    }

    /// The kernel lost provided buffers (see `IoRingStats::recv_pool_lost`):
    /// every receive from the pool is ended, and none is armed until the
    /// pool has been handed over afresh.
    fn begin_recovery(&mut self, sh: &mut Shared) {
        self.recovering = true;
        if self.direct {
            self.direct = false;
            tracing::warn!(
                "the kernel lost NBD receive buffers when a multishot receive was cancelled; \
                 large writes are no longer received directly on this ring"
            );
        }
        for c in sh.conns.iter_mut().flatten() {
            if let Rx::Multishot(op) | Rx::Header(op) = c.rx {
                c.rx = Rx::Cancelling;
                let _ = sh.ring.cancel(op);
            }
        }
    }

    /// Once no receive from the pool is armed any more, the pool goes back to
    /// the kernel whole and every connection is read again.
    pub(super) fn finish_recovery(&mut self, sh: &mut Shared) {
        if !self.recovering || sh.ring.stats().armed_recvs != 0 {
            return;
        }
        match sh.ring.reset_recv_pool() {
            Ok(()) => tracing::warn!(resets = sh.ring.stats().recv_pool_resets, "NBD receive buffers handed to the kernel afresh"),
            Err(e) => tracing::error!(error = %e, "NBD receive buffers could not be handed over afresh"),
        }
        self.recovering = false;
        for ci in 0..sh.conns.len() as u32 {
            sh.mark(ci);
        }
    }

    /// Gives back the waiters' list of a past burst; returns the bytes freed.
    pub(super) fn trim(&mut self) -> usize {
        if self.waiters.is_empty() && self.waiters.capacity() > 1024 {
            let freed = self.waiters.capacity() * 4;
            self.waiters = Vec::new();
            return freed;
        }
        0
    }
}
