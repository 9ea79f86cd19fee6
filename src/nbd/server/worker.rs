//! One ring thread: its loop, its connections, sends, timeouts and closes.

use std::collections::HashMap;
use std::io;
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::mpsc::SyncSender;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::conn::{Attached, Conn, Parsed, Part, Phase, Splicing};
use super::requests::Req;
use super::{Command, Mailbox, ServerConfig};
use crate::nbd::export::{Export, Exports};
use crate::nbd::handshake::{self, Outcome};
use crate::nbd::stats::Pending;
use crate::ring::io_ring::{Cqe, IoRing, OpId};

pub(super) const K_WAKE: u64 = 1;
pub(super) const K_ACCEPT: u64 = 2;
pub(super) const K_TICK: u64 = 3;
pub(super) const K_RECV: u64 = 4;
pub(super) const K_SEND: u64 = 5;
pub(super) const K_REQ: u64 = 6;
pub(super) const K_SHUTDOWN: u64 = 7;
pub(super) const K_CLOSE: u64 = 8;
pub(super) const K_SPLICE_IN: u64 = 9;
pub(super) const K_SPLICE_OUT: u64 = 10;

pub(super) fn token(kind: u64, index: u32) -> u64 {
    kind << 56 | u64::from(index)
}

/// Most parts one sendmsg carries (IOV_MAX).
const MAX_SEND_PARTS: usize = 1024;
/// Send buffer asked for each connection.
const SEND_BUFFER: usize = 4 << 20;
/// Completions a busy ring waits for (at most `batch_wait`) before a turn.
const BATCH: usize = 8;
/// A turn with at least this many completions counts as busy.
const BUSY_TURN: usize = 4;
/// How long a stopping ring waits for connections to drain before it cuts them.
const STOP_GRACE: Duration = Duration::from_secs(5);

pub(super) struct Context {
    pub id: usize,
    pub config: ServerConfig,
    pub exports: Arc<Exports>,
    pub mailboxes: Arc<Vec<Mailbox>>,
    /// Listeners this ring accepts on (ring 0 only).
    pub listeners: Vec<i32>,
}

/// An export's descriptors as registered in this ring.
struct Registered {
    file: u32,
    buffered: Option<u32>,
    users: u32,
}

pub(super) struct Worker {
    id: usize,
    config: ServerConfig,
    pub(super) ring: IoRing,
    exports: Arc<Exports>,
    mailboxes: Arc<Vec<Mailbox>>,
    listeners: Vec<i32>,
    accepts: Vec<Option<OpId>>,
    pub(super) conns: Vec<Option<Conn>>,
    free_conns: Vec<u32>,
    live: usize,
    pub(super) reqs: Vec<Option<Req>>,
    pub(super) free_reqs: Vec<u32>,
    registered: HashMap<u64, Registered>,
    dirty: Vec<u32>,
    pub(super) scratch: Vec<u8>,
    parsed: Vec<Parsed>,
    pub(super) stats: HashMap<u64, (Arc<Export>, Pending)>,
    next_ring: usize,
    stop_at: Option<Instant>,
    pub(super) now: Instant,
    tick: Duration,
}

pub(super) fn run(ctx: Context, ready: SyncSender<io::Result<()>>) {
    let mut w = match Worker::new(ctx) {
        Ok(w) => w,
        Err(e) => {
            let _ = ready.send(Err(e));
            return;
        }
    };
    let _ = ready.send(Ok(()));
    if let Err(e) = w.run() {
        tracing::error!(ring = w.id, error = %e, "NBD ring stopped on an error");
    }
}

impl Worker {
    fn new(ctx: Context) -> io::Result<Self> {
        let mut ring = IoRing::new(&ctx.config.ring)?;
        ring.poll_multi(token(K_WAKE, 0), &ctx.mailboxes[ctx.id].wake, libc::POLLIN as u32)?;
        let tick = (ctx.config.handshake_timeout / 4).clamp(Duration::from_millis(50), Duration::from_secs(1));
        ring.timeout(token(K_TICK, 0), tick)?;
        let mut w = Worker {
            id: ctx.id,
            config: ctx.config,
            ring,
            exports: ctx.exports,
            mailboxes: ctx.mailboxes,
            accepts: vec![None; ctx.listeners.len()],
            listeners: ctx.listeners,
            conns: Vec::new(),
            free_conns: Vec::new(),
            live: 0,
            reqs: Vec::new(),
            free_reqs: Vec::new(),
            registered: HashMap::new(),
            dirty: Vec::new(),
            scratch: Vec::with_capacity(4096),
            parsed: Vec::new(),
            stats: HashMap::new(),
            next_ring: 0,
            stop_at: None,
            now: Instant::now(),
            tick,
        };
        for i in 0..w.listeners.len() {
            w.arm_accept(i)?;
        }
        Ok(w)
    }

    fn arm_accept(&mut self, i: usize) -> io::Result<()> {
        let fd = self.listeners[i];
        self.accepts[i] = Some(self.ring.accept_multi(token(K_ACCEPT, i as u32), fd)?);
        Ok(())
    }

    fn run(&mut self) -> io::Result<()> {
        let mut cqes: Vec<Cqe> = Vec::with_capacity(1024);
        let mut busy = false;
        loop {
            // After a busy turn, wait a little for a burst instead of
            // waking for each request; a quiet ring wakes at the first one.
            if busy && !self.config.batch_wait.is_zero() {
                self.ring.submit_and_wait_batch(BATCH, self.config.batch_wait)?;
            } else {
                self.ring.submit_and_wait(1, None)?;
            }
            self.now = Instant::now();
            cqes.clear();
            self.ring.complete(&mut cqes);
            busy = cqes.len() >= BUSY_TURN;
            for c in cqes.drain(..) {
                self.on_cqe(c);
            }
            self.after_batch();
            if let Some(at) = self.stop_at {
                if self.live == 0 || self.now > at + STOP_GRACE * 2 {
                    return Ok(());
                }
            }
        }
    }

    fn on_cqe(&mut self, c: Cqe) {
        let kind = c.token >> 56;
        let index = c.token as u32;
        match kind {
            K_WAKE => {
                let mut drain = [0u8; 8];
                let _ = rustix::io::read(&self.mailboxes[self.id].wake, &mut drain);
                while let Some(cmd) = self.mailboxes[self.id].queue.pop() {
                    self.on_command(cmd);
                }
                if !c.more {
                    let mailboxes = self.mailboxes.clone();
                    if let Err(e) = self.ring.poll_multi(token(K_WAKE, 0), &mailboxes[self.id].wake, libc::POLLIN as u32) {
                        tracing::error!(error = %e, "NBD ring lost its command wakeup");
                    }
                }
            }
            K_ACCEPT => self.on_accept(index as usize, c),
            K_TICK => self.on_tick(),
            K_RECV => self.on_recv(index, c),
            K_SEND => self.on_send(index, c.result),
            K_REQ => self.on_request_done(index, c.result),
            K_SHUTDOWN => {
                if let Some(conn) = self.conns[index as usize].as_mut() {
                    conn.socket_ops -= 1;
                }
                self.mark(index);
            }
            K_CLOSE => self.on_closed(index),
            K_SPLICE_IN | K_SPLICE_OUT => self.on_splice(index, kind == K_SPLICE_IN, c.result),
            _ => {}
        }
    }

    fn on_command(&mut self, cmd: Command) {
        match cmd {
            Command::Adopt(fd) => self.adopt(fd),
            Command::DropExport(id) => {
                for i in 0..self.conns.len() {
                    let hit = self.conns[i].as_ref().and_then(|c| c.attached()).is_some_and(|a| a.export.id == id);
                    if hit {
                        self.begin_close(i as u32);
                    }
                }
            }
            Command::Stop => {
                self.stop_at = Some(self.now);
                for op in self.accepts.iter_mut().filter_map(Option::take) {
                    let _ = self.ring.cancel(op);
                }
                for i in 0..self.conns.len() {
                    if self.conns[i].is_some() {
                        self.begin_close(i as u32);
                    }
                }
            }
        }
    }

    fn on_accept(&mut self, li: usize, c: Cqe) {
        if !c.more {
            self.accepts[li] = None;
            if self.stop_at.is_none() {
                if let Err(e) = self.arm_accept(li) {
                    tracing::error!(error = %e, "NBD accept could not be re-armed");
                }
            }
        }
        let Some(fd) = c.accepted_fd() else {
            if c.result != -libc::ECANCELED {
                tracing::warn!(error = %io::Error::from_raw_os_error(-c.result), "NBD accept failed");
            }
            return;
        };
        let target = self.next_ring % self.mailboxes.len();
        self.next_ring = self.next_ring.wrapping_add(1);
        if target == self.id {
            self.adopt(fd);
        } else if let Err(Command::Adopt(fd)) = self.mailboxes[target].try_send(Command::Adopt(fd)) {
            // That ring is far behind: this one serves the client (a ring never waits).
            self.adopt(fd);
        }
    }

    /// Takes a socket into this ring: registered as a fixed file, greeted,
    /// and read from.
    fn adopt(&mut self, fd: OwnedFd) {
        if self.stop_at.is_some() {
            return;
        }
        // A deep send buffer lets a large read reach the client in fewer,
        // larger pieces (the default is about 200 KiB); without the
        // privilege to force it, the ordinary limit applies.
        if rustix::net::sockopt::set_socket_send_buffer_size_force(&fd, SEND_BUFFER).is_err() {
            let _ = rustix::net::sockopt::set_socket_send_buffer_size(&fd, SEND_BUFFER);
        }
        let socket = match self.ring.register_file(fd.as_raw_fd()) {
            Ok(s) => s,
            Err(e) => {
                tracing::warn!(error = %e, "NBD connection refused: no fixed-file slot");
                return;
            }
        };
        drop(fd);
        let ci = match self.free_conns.pop() {
            Some(i) => i,
            None => {
                self.conns.push(None);
                self.conns.len() as u32 - 1
            }
        };
        self.conns[ci as usize] = Some(Conn::new(socket, self.now));
        self.live += 1;
        self.scratch.clear();
        self.scratch.extend_from_slice(&handshake::greeting());
        self.queue_scratch(ci);
    }

    /// Copies `self.scratch` into a buffer and queues it on connection `ci`.
    pub(super) fn queue_scratch(&mut self, ci: u32) {
        if self.scratch.is_empty() {
            return;
        }
        let n = self.scratch.len();
        let b = self.ring.buffers_mut().alloc(n);
        if let Some(dst) = self.ring.buffers_mut().get_mut(b) {
            dst[..n].copy_from_slice(&self.scratch);
        }
        if let Some(c) = self.conns[ci as usize].as_mut() {
            c.held_bytes += self.ring.buffers().len(b);
        }
        self.queue(ci, b, 0, n);
    }

    /// Queues a reply part for the next send of connection `ci`.
    pub(super) fn queue(&mut self, ci: u32, buf: crate::ring::buffers::BufId, start: usize, end: usize) {
        match self.conns[ci as usize].as_mut() {
            Some(c) if !c.broken => c.out.push(Part::Buf(buf, start, end)),
            _ => self.ring.buffers_mut().free(buf),
        }
        self.mark(ci);
    }

    /// Queues a file range to be spliced into connection `ci`'s stream; it
    /// counts as held bytes until it is in the socket.
    pub(super) fn queue_splice(&mut self, ci: u32, file: u32, offset: u64, len: u64) {
        if let Some(c) = self.conns[ci as usize].as_mut().filter(|c| !c.broken) {
            c.out.push(Part::Splice { file, offset, len });
            c.held_bytes += len as usize;
        }
        self.mark(ci);
    }

    fn on_splice(&mut self, ci: u32, into_pipe: bool, res: i32) {
        let Some(c) = self.conns[ci as usize].as_mut() else { return };
        c.socket_ops -= 1;
        let Some(sp) = c.splice.as_mut() else { return };
        if res <= 0 || c.broken {
            // The header promised these bytes: without them the stream is lost.
            if res < 0 && !c.broken {
                tracing::warn!(error = %io::Error::from_raw_os_error(-res), "NBD splice failed; dropping the connection");
            }
            let sp = c.splice.take().expect("checked above");
            self.ring.put_pipe(sp.pipe, false);
            return self.break_conn(ci);
        }
        let n = res as u32;
        if into_pipe {
            sp.in_pipe += n;
            sp.left -= u64::from(n);
            sp.offset += u64::from(n);
        } else {
            sp.in_pipe -= n;
            c.held_bytes = c.held_bytes.saturating_sub(n as usize);
            c.last_send_progress = self.now;
        }
        let (pipe, file, offset, left, in_pipe, socket) = (sp.pipe, sp.file, sp.offset, sp.left, sp.in_pipe, c.socket);
        let next = if in_pipe > 0 {
            self.ring.splice_out(token(K_SPLICE_OUT, ci), pipe, socket, in_pipe)
        } else if left > 0 {
            let chunk = left.min(crate::ring::io_ring::PIPE_SIZE as u64) as u32;
            self.ring.splice_in(token(K_SPLICE_IN, ci), file, offset, pipe, chunk)
        } else {
            let c = self.conns[ci as usize].as_mut().expect("checked above");
            c.splice = None;
            self.ring.put_pipe(pipe, true);
            self.mark(ci);
            return;
        };
        let c = self.conns[ci as usize].as_mut().expect("checked above");
        match next {
            Ok(_) => c.socket_ops += 1,
            Err(e) => {
                tracing::warn!(error = %e, "NBD splice could not be submitted");
                c.splice = None;
                self.ring.put_pipe(pipe, in_pipe == 0);
                self.break_conn(ci);
            }
        }
    }

    pub(super) fn mark(&mut self, ci: u32) {
        if let Some(c) = self.conns[ci as usize].as_mut() {
            if !c.dirty {
                c.dirty = true;
                self.dirty.push(ci);
            }
        }
    }

    fn on_recv(&mut self, ci: u32, c: Cqe) {
        let Some(conn) = self.conns[ci as usize].as_mut() else {
            if let Some(bid) = c.recv_buf {
                self.ring.recycle(bid);
            }
            return;
        };
        if !c.more {
            conn.recv_op = None;
            conn.recv_cancelled = false;
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
        let (data, bufs) = self.ring.received(bid, n);
        let result = if serving {
            conn.feed(data, bufs, self.now, &mut self.parsed)
        } else {
            conn.inbuf.extend_from_slice(data);
            Ok(())
        };
        self.ring.recycle(bid);
        if let Err(e) = result {
            tracing::debug!(error = %e, "NBD client broke the protocol; closing");
            self.break_conn(ci);
        } else if !serving {
            self.negotiate(ci);
        }
        let mut parsed = std::mem::take(&mut self.parsed);
        for p in parsed.drain(..) {
            self.take_parsed(ci, p);
        }
        self.parsed = parsed;
    }

    /// Runs the handshake over what connection `ci` has received.
    fn negotiate(&mut self, ci: u32) {
        let Worker { conns, exports, scratch, .. } = self;
        let Some(conn) = conns[ci as usize].as_mut() else { return };
        let Phase::Handshake(hs) = &mut conn.phase else { return };
        scratch.clear();
        let mut pos = 0;
        let mut entered = None;
        let mut failed = false;
        loop {
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
                            conn.closing = true;
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
        self.queue_scratch(ci);
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
        if !rest.is_empty() {
            let bufs = self.ring.buffers_mut();
            if conn.feed(&rest, bufs, self.now, &mut self.parsed).is_err() {
                self.break_conn(ci);
            }
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
        self.registered.insert(export.id, Registered { file, buffered, users: 1 });
        Ok(Attached { export, file, buffered })
    }

    fn detach(&mut self, export: &Export) {
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

    fn on_send(&mut self, ci: u32, res: i32) {
        let Some(conn) = self.conns[ci as usize].as_mut() else { return };
        conn.socket_ops -= 1;
        conn.send_in_flight = false;
        let mut sent = res.max(0) as usize;
        if sent > 0 {
            conn.last_send_progress = self.now;
        }
        let bufs = self.ring.buffers_mut();
        let mut keep: Vec<Part> = Vec::new();
        for (b, start, end) in conn.sending.drain(..) {
            let len = end - start;
            if res < 0 {
                conn.held_bytes = conn.held_bytes.saturating_sub(bufs.len(b));
                bufs.free(b);
            } else if sent >= len {
                sent -= len;
                conn.held_bytes = conn.held_bytes.saturating_sub(bufs.len(b));
                bufs.free(b);
            } else {
                keep.push(Part::Buf(b, start + sent, end));
                sent = 0;
            }
        }
        if !keep.is_empty() {
            keep.append(&mut conn.out);
            conn.out = keep;
        }
        if res < 0 {
            self.break_conn(ci);
        }
        self.mark(ci);
    }

    /// No more requests are read; the connection closes once its requests
    /// are answered and sent.
    pub(super) fn begin_close(&mut self, ci: u32) {
        if let Some(c) = self.conns[ci as usize].as_mut() {
            c.closing = true;
        }
        self.mark(ci);
    }

    /// The socket is unusable: drop queued replies and close at once.
    fn break_conn(&mut self, ci: u32) {
        let Some(c) = self.conns[ci as usize].as_mut() else { return };
        c.closing = true;
        c.broken = true;
        drop_parts(c, self.ring.buffers_mut());
        self.mark(ci);
    }

    fn after_batch(&mut self) {
        let mut dirty = std::mem::take(&mut self.dirty);
        for ci in dirty.drain(..) {
            self.service(ci);
        }
        if self.dirty.is_empty() {
            self.dirty = dirty;
        }
        for (export, pending) in self.stats.values_mut() {
            export.stats.fold(pending);
        }
    }

    /// Brings connection `ci` up to date: backpressure, receive, send, close.
    fn service(&mut self, ci: u32) {
        let max_bytes = self.config.max_queued_bytes;
        let max_reqs = self.config.max_requests;
        let Some(c) = self.conns[ci as usize].as_mut() else { return };
        c.dirty = false;
        if !c.paused && (c.held_bytes > max_bytes || c.requests > max_reqs) {
            c.paused = true;
        } else if c.paused && c.held_bytes <= max_bytes / 2 && c.requests <= max_reqs / 2 {
            c.paused = false;
        }
        let want_recv = !c.closing && !c.paused;
        match (want_recv, c.recv_op) {
            (true, None) => match self.ring.recv_multi(token(K_RECV, ci), c.socket) {
                Ok(op) => {
                    c.recv_op = Some(op);
                    c.socket_ops += 1;
                }
                Err(e) => {
                    tracing::warn!(error = %e, "NBD receive could not be armed");
                    c.closing = true;
                    c.broken = true;
                }
            },
            (false, Some(op)) if !c.recv_cancelled => {
                c.recv_cancelled = true;
                let _ = self.ring.cancel(op);
            }
            _ => {}
        }
        if !c.send_in_flight && c.splice.is_none() && !c.out.is_empty() && !c.broken {
            if let Part::Splice { file, offset, len } = c.out[0] {
                c.out.remove(0);
                let started = self.ring.take_pipe().and_then(|pipe| {
                    let chunk = len.min(crate::ring::io_ring::PIPE_SIZE as u64) as u32;
                    match self.ring.splice_in(token(K_SPLICE_IN, ci), file, offset, pipe, chunk) {
                        Ok(_) => Ok(pipe),
                        Err(e) => {
                            self.ring.put_pipe(pipe, true);
                            Err(e)
                        }
                    }
                });
                match started {
                    Ok(pipe) => {
                        c.splice = Some(Splicing { pipe, file, offset, left: len, in_pipe: 0 });
                        c.socket_ops += 1;
                        c.last_send_progress = self.now;
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "NBD splice could not start");
                        c.broken = true;
                        c.closing = true;
                    }
                }
            } else {
                let n = c.out.iter().take(MAX_SEND_PARTS).take_while(|p| matches!(p, Part::Buf(..))).count();
                c.sending.extend(c.out.drain(..n).map(|p| match p {
                    Part::Buf(b, s, e) => (b, s, e),
                    Part::Splice { .. } => unreachable!("counted only buffers"),
                }));
                match self.ring.send(token(K_SEND, ci), c.socket, &c.sending) {
                    Ok(_) => {
                        c.send_in_flight = true;
                        c.socket_ops += 1;
                        c.last_send_progress = self.now;
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "NBD send could not be submitted");
                        let parts: Vec<_> = c.sending.drain(..).map(|(b, s, e)| Part::Buf(b, s, e)).collect();
                        c.out.splice(0..0, parts);
                        c.broken = true;
                    }
                }
            }
        }
        if c.broken && !c.out.is_empty() {
            drop_parts(c, self.ring.buffers_mut());
        }
        let drained = c.requests == 0 && c.splice.is_none() && (c.broken || (c.out.is_empty() && !c.send_in_flight));
        if c.closing && drained && !c.shutdown_sent {
            c.shutdown_sent = true;
            if let (Some(op), false) = (c.recv_op, c.recv_cancelled) {
                c.recv_cancelled = true;
                let _ = self.ring.cancel(op);
            }
            if self.ring.shutdown(token(K_SHUTDOWN, ci), c.socket).is_ok() {
                c.socket_ops += 1;
            }
        }
        if c.shutdown_sent && c.socket_ops == 0 && !c.close_sent {
            c.close_sent = true;
            if let Err(e) = self.ring.close_file(token(K_CLOSE, ci), c.socket) {
                tracing::warn!(error = %e, "NBD socket close could not be submitted");
                c.close_sent = false;
            }
        }
    }

    fn on_closed(&mut self, ci: u32) {
        let Some(mut c) = self.conns[ci as usize].take() else { return };
        self.free_conns.push(ci);
        self.live -= 1;
        if let Some(p) = c.payload.take() {
            self.ring.buffers_mut().free(p.buf);
        }
        drop_parts(&mut c, self.ring.buffers_mut());
        if let Phase::Serving { attached, .. } = &c.phase {
            let export = attached.export.clone();
            export.release();
            self.detach(&export);
        }
    }

    fn on_tick(&mut self) {
        if let Err(e) = self.ring.timeout(token(K_TICK, 0), self.tick) {
            tracing::error!(error = %e, "NBD ring lost its timer");
        }
        let now = self.now;
        let (hs, idle, stall) = (self.config.handshake_timeout, self.config.idle_timeout, self.config.stall_timeout);
        let grace_over = self.stop_at.is_some_and(|at| now > at + STOP_GRACE);
        for i in 0..self.conns.len() {
            let Some(c) = self.conns[i].as_ref() else { continue };
            let handshaking = matches!(c.phase, Phase::Handshake(_));
            let stalled = (c.send_in_flight || c.splice.is_some() || !c.out.is_empty()) && now.duration_since(c.last_send_progress) > stall;
            let idle_out = idle.is_some_and(|t| c.requests == 0 && c.out.is_empty() && now.duration_since(c.last_activity) > t);
            if (handshaking && now.duration_since(c.since) > hs) || stalled || grace_over {
                tracing::debug!(handshaking, stalled, "NBD connection timed out");
                self.break_conn(i as u32);
            } else if idle_out {
                self.begin_close(i as u32);
            }
        }
    }
}

/// Frees every queued part of a connection that will send no more.
fn drop_parts(c: &mut Conn, bufs: &mut crate::ring::buffers::Buffers) {
    for p in c.out.drain(..) {
        match p {
            Part::Buf(b, _, _) => {
                c.held_bytes = c.held_bytes.saturating_sub(bufs.len(b));
                bufs.free(b);
            }
            Part::Splice { len, .. } => c.held_bytes = c.held_bytes.saturating_sub(len as usize),
        }
    }
}
