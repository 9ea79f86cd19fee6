//! A ring's sending side: replies queued on a connection, sends and
//! splices, and what they hold against the connection's budget.

use std::io;
use std::time::Instant;

use super::conn::{Part, Splicing, State, Tx};
use super::shared::Shared;
use super::token::Token;
use crate::stats::Kind;
use crate::wire::{self, cmd, ReplyBody, Request};
use volring_ring::{BufId, Buffers, Op};

/// Most parts one sendmsg carries (IOV_MAX).
const MAX_SEND_PARTS: usize = 1024;
/// Small replies are gathered into buffers of this size.
const SMALL_BUF: usize = 4096;

/// The reply being encoded, before it is copied onto a connection's stream,
/// and the connections whose sends of this loop turn end as they are
/// handed to the kernel.
#[derive(Default)]
pub(super) struct Output {
    pub scratch: Vec<u8>,
    /// Connections given an `at_once` send this turn (see [`Output::settled`]).
    pub sent_at_once: Vec<u32>,
}

impl Output {
    /// Copies `self.scratch` onto connection `ci`'s outgoing stream:
    /// appended to the last small-reply buffer when it has room, so a
    /// stream of small replies costs its bytes, not a buffer each.
    pub(super) fn queue_scratch(&mut self, sh: &mut Shared, ci: u32) {
        let n = self.scratch.len();
        let Some(c) = sh.conns[ci as usize].as_mut().filter(|c| c.state.sends()) else { return };
        if n == 0 {
            return;
        }
        let bufs = sh.ring.buffers();
        if let (Some(tail), Some(Part::Buf(b, _, end))) = (c.tail, c.out.last_mut()) {
            if *b == tail && *end + n <= bufs.len(tail) {
                if let Some(dst) = bufs.get_mut(tail) {
                    dst[*end..*end + n].copy_from_slice(&self.scratch);
                    *end += n;
                    sh.mark(ci);
                    return;
                }
            }
        }
        let b = bufs.alloc_heap(n.max(SMALL_BUF));
        let cost = Buffers::cost_of(bufs.len(b));
        if let Some(dst) = bufs.get_mut(b) {
            dst[..n].copy_from_slice(&self.scratch);
        }
        c.account.charge(&sh.budget, cost, cost);
        c.tail = Some(b);
        c.out.push(Part::Buf(b, 0, n));
        sh.mark(ci);
    }

    /// Queues a reply part for the next send of connection `ci`; the
    /// buffer was charged to the connection when it was allocated.
    pub(super) fn queue(&mut self, sh: &mut Shared, ci: u32, buf: BufId, start: usize, end: usize) {
        match sh.conns[ci as usize].as_mut() {
            Some(c) if c.state.sends() => c.out.push(Part::Buf(buf, start, end)),
            Some(c) => {
                let cost = Buffers::cost_of(sh.ring.buffers().len(buf));
                c.account.release(&sh.budget, cost, cost);
                sh.ring.buffers().free(buf);
            }
            None => sh.ring.buffers().free(buf),
        }
        sh.mark(ci);
    }

    /// Queues a file range to be spliced into connection `ci`'s stream; it
    /// counts against the connection's limit until it is in the socket.
    pub(super) fn queue_splice(&mut self, sh: &mut Shared, ci: u32, file: u32, offset: u64, len: u64, started: Instant) {
        if let Some(c) = sh.conns[ci as usize].as_mut().filter(|c| c.state.sends()) {
            c.out.push(Part::Splice { file, offset, len, started });
            c.account.charge(&sh.budget, len as usize, 0);
        }
        sh.mark(ci);
    }

    /// Starts the next send of connection `ci` when nothing is leaving
    /// its socket: the buffers queued first (up to IOV_MAX in one
    /// sendmsg), or the splice of a file range.
    pub(super) fn send_next(&mut self, sh: &mut Shared, ci: u32) {
        let Some(c) = sh.conns[ci as usize].as_mut() else { return };
        if !matches!(c.tx, Tx::Idle) || c.out.is_empty() || !c.state.sends() {
            return;
        }
        if let Part::Splice { file, offset, len, started } = c.out[0] {
            c.out.remove(0);
            let begun =
                sh.ring.take_pipe().and_then(|pipe| match sh.ring.submit(Token::SpliceIn(ci), Op::SpliceIn { file, offset, pipe, len }) {
                    Ok(_) => Ok(pipe),
                    Err(e) => {
                        sh.ring.put_pipe(pipe, true);
                        Err(e)
                    }
                });
            match begun {
                Ok(pipe) => {
                    c.tx = Tx::Splicing(Splicing { pipe, file, offset, left: len, in_pipe: 0, len, started });
                    c.socket_ops += 1;
                    c.last_send_progress = sh.now;
                }
                Err(e) => {
                    tracing::warn!(error = %e, "NBD splice could not start");
                    sh.break_conn(ci);
                }
            }
            return;
        }
        let n = c.out.iter().take(MAX_SEND_PARTS).take_while(|p| matches!(p, Part::Buf(..))).count();
        c.sending.extend(c.out.drain(..n).map(|p| match p {
            Part::Buf(b, s, e) => (b, s, e),
            Part::Splice { .. } => unreachable!("counted only buffers"),
        }));
        // Sent at once (MSG_DONTWAIT): it ends in the enter that submits it,
        // and the ring may sleep past its completion in that same enter
        // (see `Output::settled`). A socket found full gets a send that
        // waits for room, so a slow reader costs no retries.
        let at_once = !c.socket_full;
        let settling = sh.ring.stats().settling;
        match sh.ring.submit(Token::Send(ci), Op::Send { socket: c.socket, parts: &c.sending, at_once }) {
            Ok(_) => {
                // Only a send the ring took at once (not one queued behind
                // a full ring as an ordinary send) is on the list.
                if sh.ring.stats().settling > settling {
                    self.sent_at_once.push(ci);
                }
                c.tx = Tx::Sending;
                c.socket_ops += 1;
                c.last_send_progress = sh.now;
            }
            Err(e) => {
                tracing::warn!(error = %e, "NBD send could not be submitted");
                let parts: Vec<_> = c.sending.drain(..).map(|(b, s, e)| Part::Buf(b, s, e)).collect();
                c.out.splice(0..0, parts);
                sh.break_conn(ci);
            }
        }
    }

    pub(super) fn on_splice(&mut self, sh: &mut Shared, ci: u32, into_pipe: bool, res: i32) {
        let Some(c) = sh.conns[ci as usize].as_mut() else { return };
        c.socket_ops -= 1;
        let sends = c.state.sends();
        let Tx::Splicing(sp) = &mut c.tx else { return };
        if res <= 0 || !sends {
            // The header promised these bytes: without them the stream is lost.
            if res < 0 && sends {
                tracing::warn!(error = %io::Error::from_raw_os_error(-res), "NBD splice failed; dropping the connection");
            }
            sh.ring.put_pipe(sp.pipe, false);
            c.tx = Tx::Idle;
            return sh.break_conn(ci);
        }
        let n = res as u32;
        if into_pipe {
            sp.in_pipe += n;
            sp.left -= u64::from(n);
            sp.offset += u64::from(n);
        } else {
            sp.in_pipe -= n;
            c.account.release(&sh.budget, n as usize, 0);
            c.last_send_progress = sh.now;
        }
        let (pipe, file, offset, left, in_pipe, socket) = (sp.pipe, sp.file, sp.offset, sp.left, sp.in_pipe, c.socket);
        let (len, started) = (sp.len, sp.started);
        let next = if in_pipe > 0 {
            sh.ring.submit(Token::SpliceOut(ci), Op::SpliceOut { pipe, socket, len: in_pipe })
        } else if left > 0 {
            sh.ring.submit(Token::SpliceIn(ci), Op::SpliceIn { file, offset, pipe, len: left })
        } else {
            let c = sh.conns[ci as usize].as_mut().expect("checked above");
            c.tx = Tx::Idle;
            sh.ring.put_pipe(pipe, true);
            // A spliced READ is timed until its last byte is in the socket.
            sh.record(ci, Kind::Read, len, true, started);
            sh.mark(ci);
            return;
        };
        let c = sh.conns[ci as usize].as_mut().expect("checked above");
        match next {
            Ok(_) => c.socket_ops += 1,
            Err(e) => {
                tracing::warn!(error = %e, "NBD splice could not be submitted");
                c.tx = Tx::Idle;
                sh.ring.put_pipe(pipe, in_pipe == 0);
                sh.break_conn(ci);
            }
        }
    }

    pub(super) fn on_send(&mut self, sh: &mut Shared, ci: u32, res: i32) {
        let Some(conn) = sh.conns[ci as usize].as_mut() else { return };
        conn.socket_ops -= 1;
        conn.tx = Tx::Idle;
        // An at-once send found no room: nothing went, and the same parts
        // go again in a send that waits (only such a send ends EAGAIN).
        let full = res == -libc::EAGAIN;
        let res = if full { 0 } else { res };
        let asked: usize = conn.sending.iter().map(|(_, s, e)| e - s).sum();
        conn.socket_full = full || (res >= 0 && (res as usize) < asked);
        let mut sent = res.max(0) as usize;
        if sent > 0 {
            conn.last_send_progress = sh.now;
        }
        let bufs = sh.ring.buffers();
        let mut keep: Vec<Part> = Vec::new();
        // Released once for the whole send: the server's budget is shared
        // by every ring, and a send of 32 replies would otherwise update it
        // 64 times.
        let mut freed = 0;
        for (b, start, end) in conn.sending.drain(..) {
            let len = end - start;
            if res < 0 || sent >= len {
                sent = sent.saturating_sub(len);
                freed += Buffers::cost_of(bufs.len(b));
                if conn.tail == Some(b) {
                    conn.tail = None;
                }
                bufs.free(b);
            } else {
                keep.push(Part::Buf(b, start + sent, end));
                sent = 0;
            }
        }
        conn.account.release(&sh.budget, freed, freed);
        if !keep.is_empty() {
            keep.append(&mut conn.out);
            conn.out = keep;
        }
        if res < 0 {
            sh.break_conn(ci);
        }
        sh.mark(ci);
    }

    /// How many completions the ring may sleep past in its next wait: the
    /// `at_once` sends it will submit (each ends in that very enter, see
    /// `IoRingStats::settling`), provided nothing waits on any of them.
    /// A connection waits on its send when more replies are queued behind
    /// it, or when it is closing (its shutdown follows the send); a paused
    /// connection or a starved server waits on the memory a send frees, and
    /// operations backlogged behind the ring's cap on the room the
    /// completions make. Then it is 0, and the ring wakes for the sends as
    /// before. A send that goes short is not foreseen: the worker bounds
    /// the sleep (`SETTLED_SLEEP`).
    ///
    /// Why: a lone request's reply would otherwise cost an enter of its
    /// own (submit, reap the send at once, then enter again to sleep).
    pub(super) fn settled(&self, sh: &Shared, waiters: usize) -> usize {
        let ring = sh.ring.stats();
        // Operations waiting for room in the kernel go in only as completions
        // are reaped: the sends' completions are needed at once.
        if ring.settling == 0 || ring.backlogged > 0 || waiters > 0 || sh.budget.under_pressure() {
            return 0;
        }
        let quiet = |&ci: &u32| sh.conn(ci).is_none_or(|c| c.state == State::Reading && c.out.is_empty());
        if self.sent_at_once.iter().all(quiet) {
            ring.settling
        } else {
            0
        }
    }

    /// Encodes a reply without bulk data, counts it and queues it.
    pub(super) fn reply_small(&mut self, sh: &mut Shared, ci: u32, req: &Request, body: ReplyBody<'_>, started: Instant) {
        let ok = matches!(body, ReplyBody::Ack | ReplyBody::Extents { .. } | ReplyBody::Hole { .. });
        let bytes = if matches!(req.kind, cmd::READ | cmd::WRITE) && ok { req.length } else { 0 };
        sh.record(ci, kind_of(req.kind), bytes, ok, started);
        let style = match sh.conn(ci).map_or(wire::HeaderStyle::Simple, |c| c.style()) {
            // With structured replies the spec allows a simple reply to
            // anything but a READ, and a payload-less ack loses nothing by
            // it. libnbd without extended headers (before 1.18, Debian
            // 12's 1.14) receives a reply's first 16 bytes and then, if the
            // magic says structured, the rest: a structured ack cost it a
            // second recv per WRITE (1.74-1.81 per 1 MiB write, against
            // nbdkit's simple acks 0.90-0.95; docs/benchmarks.md).
            wire::HeaderStyle::Structured if matches!(body, ReplyBody::Ack) && req.kind != cmd::READ => wire::HeaderStyle::Simple,
            style => style,
        };
        self.scratch.clear();
        wire::encode_small_reply(style, req.cookie, req.offset, body, &mut self.scratch);
        self.queue_scratch(sh, ci);
    }

    /// A scratch grown large by a burst (a long LIST) is let go.
    pub(super) fn shrink(&mut self) {
        if self.scratch.capacity() > 1 << 20 {
            self.scratch = Vec::with_capacity(4096);
        }
    }
}

fn kind_of(command: u16) -> Kind {
    match command {
        cmd::READ => Kind::Read,
        cmd::WRITE => Kind::Write,
        cmd::FLUSH => Kind::Flush,
        cmd::TRIM => Kind::Trim,
        cmd::WRITE_ZEROES => Kind::Zero,
        _ => Kind::Other,
    }
}

#[cfg(test)]
mod tests {
    use std::io::{Read, Write};
    use std::os::fd::AsRawFd;
    use std::os::unix::net::UnixStream;
    use std::sync::Arc;

    use super::*;
    use crate::server::budget::{Limits, ServerBudget};
    use crate::server::conn::Conn;
    use volring_ring::{IoRing, IoRingConfig};

    fn shared() -> Shared {
        let cfg = IoRingConfig {
            sq_entries: 16,
            cq_entries: 32,
            files: 4,
            arena_slots: 1,
            arena_slot_size: 4096,
            heap_cache: 0,
            recv_bufs: 4,
            recv_buf_size: 4096,
        };
        let ring = IoRing::new(&cfg).expect("io_uring");
        Shared::new(ring, Limits { conn_bytes: 1 << 20, conn_requests: 8 }, Arc::new(ServerBudget::new(1 << 20)))
    }

    /// Hands what is queued to the kernel and reaps the send's completion
    /// if it ended; `None` if it is still waiting.
    fn send_result(sh: &mut Shared, ci: u32) -> Option<i32> {
        sh.ring.submit_and_wait(0, None).expect("submit");
        let mut cqes = Vec::new();
        sh.ring.complete(&mut cqes);
        cqes.iter().find(|c| c.token == Token::Send(ci)).map(|c| c.result)
    }

    /// A reply sent at once into a full socket ends EAGAIN: nothing of it
    /// is lost or freed, the connection stays up, and the reply goes again
    /// in a send that waits for room; when the client reads, it arrives
    /// whole, after everything that filled the socket.
    #[test]
    fn a_reply_that_found_the_socket_full_goes_again_and_waits() {
        let mut sh = shared();
        let (mut peer, ours) = UnixStream::pair().unwrap();
        ours.set_nonblocking(true).unwrap();
        let mut filler = 0usize;
        while let Ok(n) = (&ours).write(&[7u8; 4096]) {
            filler += n;
            assert!(filler < 64 << 20, "the socket never filled");
        }
        let socket = sh.ring.register_file(ours.as_raw_fd()).unwrap();
        let ci = sh.insert(Conn::new(socket, sh.now));
        let mut out = Output::default();
        out.scratch.extend_from_slice(b"the reply");
        out.queue_scratch(&mut sh, ci);
        out.send_next(&mut sh, ci);
        assert_eq!((out.sent_at_once.as_slice(), sh.ring.stats().settling), (&[ci][..], 1), "the first send goes at once");
        let res = send_result(&mut sh, ci).expect("an at-once send ends in its submit");
        assert_eq!(res, -libc::EAGAIN);
        out.on_send(&mut sh, ci, res);
        let c = sh.conn(ci).expect("the connection stays");
        assert!(c.state == State::Reading && c.socket_full && matches!(c.tx, Tx::Idle), "state {:?}", c.state);
        assert!(matches!(c.out.as_slice(), [Part::Buf(_, 0, 9)]), "the reply is queued again, whole");

        out.sent_at_once.clear();
        out.send_next(&mut sh, ci);
        assert!(out.sent_at_once.is_empty() && sh.ring.stats().settling == 0, "the second send waits for room");
        assert_eq!(send_result(&mut sh, ci), None, "and it does");
        peer.set_read_timeout(Some(std::time::Duration::from_secs(10))).unwrap();
        let reader = std::thread::spawn(move || {
            let mut all = vec![0u8; filler + 9];
            peer.read_exact(&mut all).map(|_| all)
        });
        // A timer bounds each wait below: its completion comes regardless.
        sh.ring.submit(Token::Tick, Op::Timeout { after: std::time::Duration::from_secs(10) }).unwrap();
        let res = (0..100).find_map(|_| {
            sh.ring.submit_and_wait(1, None).expect("wait");
            let mut cqes = Vec::new();
            sh.ring.complete(&mut cqes);
            assert!(cqes.iter().all(|c| c.token != Token::Tick), "the send did not end within 10 s");
            cqes.iter().find(|c| c.token == Token::Send(ci)).map(|c| c.result)
        });
        assert_eq!(res, Some(9), "the waiting send ends once the client reads");
        out.on_send(&mut sh, ci, 9);
        let c = sh.conn(ci).expect("the connection stays");
        assert!(c.out.is_empty() && !c.socket_full, "sent; the next send goes at once again");
        let all = reader.join().unwrap().expect("the client read everything");
        assert!(all[..filler].iter().all(|&b| b == 7) && &all[filler..] == b"the reply");
    }
}
