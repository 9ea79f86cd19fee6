//! One ring thread: its loop, its connections, sends, timeouts and closes.

use std::collections::HashMap;
use std::io;
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::mpsc::SyncSender;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::budget::{Gate, Limits, Refusal, ServerBudget};
use super::conn::{Attached, Blocked, Conn, Fed, Part, Phase, Splicing};
use super::requests::Req;
use super::{Command, Mailbox, ServerConfig};
use crate::nbd::export::{Export, Exports};
use crate::nbd::handshake::{self, Outcome};
use crate::nbd::stats::{Kind, Pending};
use crate::ring::buffers::{BufId, Buffers};
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
/// A handshake stops being read while this many reply bytes wait to be
/// sent (a flood of NBD_OPT_LIST would otherwise queue without bound).
const HANDSHAKE_REPLIES: usize = 64 * 1024;
/// Small replies are gathered into buffers of this size.
const SMALL_BUF: usize = 4096;
/// Rounds of servicing dirty connections in one loop turn.
const SERVICE_ROUNDS: usize = 8;
/// lseek calls (hole checks, BLOCK_STATUS) one loop turn may make; past
/// it holes are answered as data, which the protocol allows.
pub(super) const SEEKS_PER_TURN: u32 = 128;

/// Where bytes to split into requests come from.
enum Source {
    /// A provided receive buffer and its length.
    Recv(u16, usize),
    /// Bytes a paused connection had received and not taken.
    Owned(Vec<u8>),
}

pub(super) struct Context {
    pub id: usize,
    pub config: ServerConfig,
    pub exports: Arc<Exports>,
    pub mailboxes: Arc<Vec<Mailbox>>,
    /// Listeners this ring accepts on (ring 0 only).
    pub listeners: Vec<i32>,
    pub budget: Arc<ServerBudget>,
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
    pub(super) stats: HashMap<u64, (Arc<Export>, Pending)>,
    next_ring: usize,
    stop_at: Option<Instant>,
    pub(super) now: Instant,
    tick: Duration,
    limits: Limits,
    pub(super) budget: Arc<ServerBudget>,
    /// Connections the server's budget stopped, woken when memory is released.
    server_waiters: Vec<u32>,
    waiters_seen: u64,
    /// lseek calls left in this loop turn.
    pub(super) seeks_left: u32,
    /// A request arrived since the last tick (an idle ring trims its memory).
    pub(super) active: bool,
    /// A buffer of zeroes that WRITE_ZEROES writes from when the file cannot
    /// zero a range itself; shared, never written after it is made.
    pub(super) zeroes: Option<BufId>,
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
        let tick = (ctx.config.handshake_timeout / 4).clamp(Duration::from_millis(50), Duration::from_millis(250));
        ring.timeout(token(K_TICK, 0), tick)?;
        let limits = Limits { conn_bytes: ctx.config.max_queued_bytes, conn_requests: ctx.config.max_requests.max(1) };
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
            stats: HashMap::new(),
            next_ring: 0,
            stop_at: None,
            now: Instant::now(),
            tick,
            limits,
            budget: ctx.budget,
            server_waiters: Vec::new(),
            waiters_seen: 0,
            seeks_left: SEEKS_PER_TURN,
            active: false,
            zeroes: None,
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
            if !self.dirty.is_empty() {
                // Connections are still to be looked at: do not sleep.
                self.ring.submit_and_wait(0, None)?;
            } else if busy && !self.config.batch_wait.is_zero() {
                self.ring.submit_and_wait_batch(BATCH, self.config.batch_wait)?;
            } else {
                self.ring.submit_and_wait(1, None)?;
            }
            self.now = Instant::now();
            self.seeks_left = SEEKS_PER_TURN;
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

    /// Copies `self.scratch` onto connection `ci`'s outgoing stream:
    /// appended to the last small-reply buffer when it has room, so a
    /// stream of small replies costs its bytes, not a buffer each.
    pub(super) fn queue_scratch(&mut self, ci: u32) {
        let n = self.scratch.len();
        let Some(c) = self.conns[ci as usize].as_mut().filter(|c| !c.broken) else { return };
        if n == 0 {
            return;
        }
        let bufs = self.ring.buffers_mut();
        if let (Some(tail), Some(Part::Buf(b, _, end))) = (c.tail, c.out.last_mut()) {
            if *b == tail && *end + n <= bufs.len(tail) {
                if let Some(dst) = bufs.get_mut(tail) {
                    dst[*end..*end + n].copy_from_slice(&self.scratch);
                    *end += n;
                    self.mark(ci);
                    return;
                }
            }
        }
        let b = bufs.alloc_heap(n.max(SMALL_BUF));
        let cost = Buffers::cost_of(bufs.len(b));
        if let Some(dst) = bufs.get_mut(b) {
            dst[..n].copy_from_slice(&self.scratch);
        }
        c.account.charge(&self.budget, cost, cost);
        c.tail = Some(b);
        c.out.push(Part::Buf(b, 0, n));
        self.mark(ci);
    }

    /// Queues a reply part for the next send of connection `ci`; the
    /// buffer was charged to the connection when it was allocated.
    pub(super) fn queue(&mut self, ci: u32, buf: BufId, start: usize, end: usize) {
        match self.conns[ci as usize].as_mut() {
            Some(c) if !c.broken => c.out.push(Part::Buf(buf, start, end)),
            Some(c) => {
                let cost = Buffers::cost_of(self.ring.buffers().len(buf));
                c.account.release(&self.budget, cost, cost);
                self.ring.buffers_mut().free(buf);
            }
            None => self.ring.buffers_mut().free(buf),
        }
        self.mark(ci);
    }

    /// Queues a file range to be spliced into connection `ci`'s stream; it
    /// counts against the connection's limit until it is in the socket.
    pub(super) fn queue_splice(&mut self, ci: u32, file: u32, offset: u64, len: u64, started: Instant) {
        if let Some(c) = self.conns[ci as usize].as_mut().filter(|c| !c.broken) {
            c.out.push(Part::Splice { file, offset, len, started });
            c.account.charge(&self.budget, len as usize, 0);
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
            c.account.release(&self.budget, n as usize, 0);
            c.last_send_progress = self.now;
        }
        let (pipe, file, offset, left, in_pipe, socket) = (sp.pipe, sp.file, sp.offset, sp.left, sp.in_pipe, c.socket);
        let (len, started) = (sp.len, sp.started);
        let next = if in_pipe > 0 {
            self.ring.splice_out(token(K_SPLICE_OUT, ci), pipe, socket, in_pipe)
        } else if left > 0 {
            let chunk = left.min(crate::ring::io_ring::PIPE_SIZE as u64) as u32;
            self.ring.splice_in(token(K_SPLICE_IN, ci), file, offset, pipe, chunk)
        } else {
            let c = self.conns[ci as usize].as_mut().expect("checked above");
            c.splice = None;
            self.ring.put_pipe(pipe, true);
            // A spliced READ is timed until its last byte is in the socket.
            self.record(ci, Kind::Read, len, true, started);
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
        if serving && conn.paused.is_none() {
            self.pump(ci, &Source::Recv(bid, n));
            self.ring.recycle(bid);
            return;
        }
        // A handshake, or bytes that arrived before a pause took effect:
        // kept (and charged) until they can be taken.
        let (data, _) = self.ring.received(bid, n);
        conn.inbuf.extend_from_slice(data);
        conn.sync_inbuf(&self.budget);
        self.ring.recycle(bid);
        if !serving && conn.paused.is_none() {
            self.negotiate(ci);
        }
    }

    /// Splits bytes into requests for connection `ci` and acts on each one
    /// before the next is admitted, so every buffer is charged before the
    /// next request is looked at. What is not taken stays in `inbuf`.
    fn pump(&mut self, ci: u32, src: &Source) {
        let mut pos = 0;
        loop {
            let Some(conn) = self.conns[ci as usize].as_mut().filter(|c| !c.broken) else { return };
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
                            conn.paused = Some(Blocked::Refused(why));
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
    fn negotiate(&mut self, ci: u32) {
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
                conn.paused = Some(Blocked::Replies);
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
            if res < 0 || sent >= len {
                sent = sent.saturating_sub(len);
                let cost = Buffers::cost_of(bufs.len(b));
                conn.account.release(&self.budget, cost, cost);
                if conn.tail == Some(b) {
                    conn.tail = None;
                }
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
        drop_parts(c, self.ring.buffers_mut(), &self.budget);
        self.mark(ci);
    }

    fn after_batch(&mut self) {
        if !self.server_waiters.is_empty() && self.budget.releases() != self.waiters_seen {
            self.wake_server_waiters();
        }
        // Servicing a connection can queue replies on it (or free memory
        // for another): a few rounds, and the loop does not sleep on the rest.
        for _ in 0..SERVICE_ROUNDS {
            if self.dirty.is_empty() {
                break;
            }
            let mut dirty = std::mem::take(&mut self.dirty);
            for ci in dirty.drain(..) {
                self.service(ci);
            }
            if self.dirty.is_empty() {
                self.dirty = dirty;
            }
        }
        for (export, pending) in self.stats.values_mut() {
            export.stats.fold(pending);
        }
    }

    /// Memory was released somewhere: connections the server's budget
    /// stopped try their next request again.
    fn wake_server_waiters(&mut self) {
        self.waiters_seen = self.budget.releases();
        for ci in std::mem::take(&mut self.server_waiters) {
            if let Some(c) = self.conns[ci as usize].as_mut() {
                c.server_wait = None;
                self.mark(ci);
            }
        }
    }

    /// Brings connection `ci` up to date: backpressure, receive, send, close.
    fn service(&mut self, ci: u32) {
        let Some(c) = self.conns[ci as usize].as_mut() else { return };
        c.dirty = false;
        if let Some(why) = c.paused.filter(|_| !c.closing && !c.broken) {
            let ready = match why {
                Blocked::Refused(Refusal::Conn) => c.account.drained_enough(&self.limits),
                Blocked::Refused(Refusal::Server) => c.server_wait.is_none(),
                Blocked::Replies => c.out.is_empty() && !c.send_in_flight,
            };
            if ready {
                // What it had received is taken first; reading resumes
                // only if all of it fits.
                c.paused = None;
                if matches!(c.phase, Phase::Serving { .. }) {
                    let rest = std::mem::take(&mut c.inbuf);
                    c.sync_inbuf(&self.budget);
                    self.pump(ci, &Source::Owned(rest));
                } else {
                    self.negotiate(ci);
                }
            }
        }
        let Some(c) = self.conns[ci as usize].as_mut() else { return };
        let want_recv = !c.closing && c.paused.is_none();
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
            if let Part::Splice { file, offset, len, started } = c.out[0] {
                c.out.remove(0);
                let begun = self.ring.take_pipe().and_then(|pipe| {
                    let chunk = len.min(crate::ring::io_ring::PIPE_SIZE as u64) as u32;
                    match self.ring.splice_in(token(K_SPLICE_IN, ci), file, offset, pipe, chunk) {
                        Ok(_) => Ok(pipe),
                        Err(e) => {
                            self.ring.put_pipe(pipe, true);
                            Err(e)
                        }
                    }
                });
                match begun {
                    Ok(pipe) => {
                        c.splice = Some(Splicing { pipe, file, offset, left: len, in_pipe: 0, len, started });
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
            drop_parts(c, self.ring.buffers_mut(), &self.budget);
        }
        let drained = c.account.requests == 0 && c.splice.is_none() && (c.broken || (c.out.is_empty() && !c.send_in_flight));
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
        drop_parts(&mut c, self.ring.buffers_mut(), &self.budget);
        // Whatever is left (the payload buffer, unread bytes) goes back.
        c.account.close(&self.budget);
        if let Phase::Serving { attached, .. } = &c.phase {
            let export = attached.export.clone();
            export.release();
            self.detach(&export);
        }
    }

    /// A ring with nothing to do gives memory back: cached buffers, the
    /// allocator's free pages, and request slots of a past burst.
    fn trim(&mut self) {
        self.ring.buffers_mut().trim();
        if self.free_reqs.len() == self.reqs.len() && self.reqs.capacity() > 1024 {
            self.reqs = Vec::new();
            self.free_reqs = Vec::new();
        }
    }

    fn on_tick(&mut self) {
        if let Err(e) = self.ring.timeout(token(K_TICK, 0), self.tick) {
            tracing::error!(error = %e, "NBD ring lost its timer");
        }
        if !self.server_waiters.is_empty() {
            self.wake_server_waiters();
        }
        if !std::mem::take(&mut self.active) {
            self.trim();
        }
        let now = self.now;
        let (hs, idle, stall) = (self.config.handshake_timeout, self.config.idle_timeout, self.config.stall_timeout);
        let grace_over = self.stop_at.is_some_and(|at| now > at + STOP_GRACE);
        for i in 0..self.conns.len() {
            let Some(c) = self.conns[i].as_ref() else { continue };
            let handshaking = matches!(c.phase, Phase::Handshake(_));
            let stalled = (c.send_in_flight || c.splice.is_some() || !c.out.is_empty()) && now.duration_since(c.last_send_progress) > stall;
            let idle_out = idle.is_some_and(|t| c.account.requests == 0 && c.out.is_empty() && now.duration_since(c.last_activity) > t);
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
fn drop_parts(c: &mut Conn, bufs: &mut Buffers, budget: &ServerBudget) {
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
