//! A ring's receiving side: received bytes into handshake steps and
//! admitted requests, and the exports a connection attaches to.

use std::io;
use std::os::fd::AsRawFd;
use std::sync::Arc;

use super::budget::{Gate, Refusal};
use super::conn::{Attached, Blocked, Fed, Phase, Rx, State};
use super::token::Token;
use super::worker::{Registered, Worker};
use crate::export::Export;
use crate::handshake::Outcome;
use volring_ring::io_ring::Cqe;

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

impl Worker {
    pub(super) fn on_recv(&mut self, ci: u32, c: Cqe<Token>) {
        let Some(conn) = self.conns[ci as usize].as_mut() else {
            if let Some(bid) = c.recv_buf {
                self.ring.recycle(bid);
            }
            return;
        };
        if !c.more {
            conn.rx = Rx::Idle;
            conn.socket_ops -= 1;
        }
        self.mark(ci);
        let Some(bid) = c.recv_buf else {
            match c.result {
                0 => self.begin_close(ci),
                r if r == -libc::ENOBUFS || r == -libc::ECANCELED => {} // re-armed after the batch
                r => {
                    tracing::debug!(error = %io::Error::from_raw_os_error(-r), "NBD receive failed");
                    self.break_conn(ci);
                }
            }
            return;
        };
        let n = c.result.max(0) as usize;
        let conn = self.conns[ci as usize].as_mut().expect("checked above");
        conn.last_activity = self.now;
        let serving = matches!(conn.phase, Phase::Serving { .. });
        match conn.state {
            State::Reading if serving => self.pump(ci, &Source::Recv(bid, n)),
            // A handshake, or bytes that arrived before a pause took
            // effect: kept (and charged) until they can be taken.
            State::Reading | State::Paused(_) => {
                let (data, _) = self.ring.received(bid, n);
                conn.inbuf.extend_from_slice(data);
                conn.sync_inbuf(&self.budget);
                if conn.state == State::Reading {
                    self.ring.recycle(bid);
                    return self.negotiate(ci);
                }
            }
            // Nothing more is read from a closing connection.
            _ => {}
        }
        self.ring.recycle(bid);
    }

    /// Splits bytes into requests for connection `ci` and acts on each one
    /// before the next is admitted, so every buffer is charged before the
    /// next request is looked at. What is not taken stays in `inbuf`.
    pub(super) fn pump(&mut self, ci: u32, src: &Source) {
        let mut pos = 0;
        loop {
            let Some(conn) = self.conns[ci as usize].as_mut().filter(|c| c.state == State::Reading) else { return };
            let (data, bufs) = match src {
                Source::Recv(bid, n) => self.ring.received(*bid, *n),
                Source::Owned(v) => (&v[..], self.ring.buffers_mut()),
            };
            if pos >= data.len() {
                return;
            }
            let gate = Gate { limits: &self.limits, server: &self.budget };
            match conn.feed(&data[pos..], bufs, gate, self.now) {
                Err(e) => {
                    tracing::debug!(error = %e, "NBD client broke the protocol; closing");
                    return self.break_conn(ci);
                }
                Ok((used, fed)) => {
                    pos += used;
                    match fed {
                        Fed::Parsed(p) => {
                            self.active = true;
                            self.take_parsed(ci, p);
                        }
                        Fed::More | Fed::Closing => return,
                        Fed::Blocked(why) => {
                            conn.inbuf.extend_from_slice(&data[pos..]);
                            conn.sync_inbuf(&self.budget);
                            conn.pause(Blocked::Refused(why));
                            if why == Refusal::Server && conn.server_wait.is_none() {
                                conn.server_wait = Some(self.budget.releases());
                                self.server_waiters.push(ci);
                            }
                            self.mark(ci);
                            return;
                        }
                    }
                }
            }
        }
    }

    /// Runs the handshake over what connection `ci` has received.
    pub(super) fn negotiate(&mut self, ci: u32) {
        let Worker { conns, exports, scratch, .. } = self;
        let Some(conn) = conns[ci as usize].as_mut() else { return };
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
            match hs.step(&conn.inbuf[pos..], &**exports, scratch) {
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
        conn.sync_inbuf(&self.budget);
        self.queue_scratch(ci);
        if self.scratch.capacity() > 1 << 20 {
            self.scratch = Vec::with_capacity(4096);
        }
        if failed {
            return self.break_conn(ci);
        }
        let Some(n) = entered else { return };
        let attached = match self.attach(n.export.clone()) {
            Ok(a) => a,
            Err(e) => {
                tracing::warn!(export = %n.name, error = %e, "NBD export could not be registered");
                n.export.release();
                return self.break_conn(ci);
            }
        };
        let conn = self.conns[ci as usize].as_mut().expect("present above");
        conn.phase = Phase::Serving { attached, style: n.style, base_allocation: n.base_allocation };
        tracing::debug!(export = %n.name, style = ?n.style, "NBD client entered transmission");
        let rest = std::mem::take(&mut conn.inbuf);
        conn.sync_inbuf(&self.budget);
        if !rest.is_empty() {
            self.pump(ci, &Source::Owned(rest));
        }
    }

    /// Registers an export's descriptors in this ring (once per export).
    fn attach(&mut self, export: Arc<Export>) -> io::Result<Attached> {
        if let Some(r) = self.registered.get_mut(&export.id) {
            r.users += 1;
            return Ok(Attached { export, file: r.file, buffered: r.buffered });
        }
        let file = self.ring.register_file(export.file().as_raw_fd())?;
        let buffered = match export.buffered() {
            Some(fd) => match self.ring.register_file(fd.as_raw_fd()) {
                Ok(s) => Some(s),
                Err(e) => {
                    let _ = self.ring.unregister_file(file);
                    return Err(e);
                }
            },
            None => None,
        };
        let writes = super::inline::WritePath::new(self.config.inline_writes);
        self.registered.insert(export.id, Registered { file, buffered, users: 1, writes });
        Ok(Attached { export, file, buffered })
    }

    pub(super) fn detach(&mut self, export: &Export) {
        let Some(r) = self.registered.get_mut(&export.id) else { return };
        r.users -= 1;
        if r.users == 0 {
            // Nothing of this export stays on this ring: not its counters
            // (folded now), not its descriptors (a removed export's file
            // must not be held open here).
            if let Some((e, mut pending)) = self.stats.remove(&export.id) {
                e.stats.fold(&mut pending);
            }
            let r = self.registered.remove(&export.id).expect("present");
            let _ = self.ring.unregister_file(r.file);
            if let Some(b) = r.buffered {
                let _ = self.ring.unregister_file(b);
            }
        }
    }
}
