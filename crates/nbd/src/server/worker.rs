//! One ring thread: its loop, its connections, sends, timeouts and closes.

use std::collections::HashMap;
use std::io;
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::mpsc::SyncSender;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::budget::{Limits, ServerBudget};
use super::conn::{Conn, Phase, Rx, State, Tx};
use super::input::Source;
use super::output::drop_parts;
use super::requests::Req;
use super::token::Token;
use super::{Command, Mailbox, ServerConfig};
use crate::export::{Export, Exports};
use crate::handshake;
use crate::stats::Pending;
use volring_ring::buffers::BufId;
use volring_ring::io_ring::{Cqe, IoRing, OpId};

/// Send buffer asked for each connection.
const SEND_BUFFER: usize = 4 << 20;
/// Completions a busy ring waits for (at most `batch_wait`) before a turn.
const BATCH: usize = 8;
/// A turn with at least this many completions counts as busy.
const BUSY_TURN: usize = 4;
/// How long a stopping ring waits for connections to drain before it cuts them.
const STOP_GRACE: Duration = Duration::from_secs(5);
/// Rounds of servicing dirty connections in one loop turn.
const SERVICE_ROUNDS: usize = 8;
/// lseek calls (hole checks, BLOCK_STATUS) one loop turn may make; past
/// it holes are answered as data, which the protocol allows.
pub(super) const SEEKS_PER_TURN: u32 = 128;
/// When the server is starved, a connection holding memory that neither
/// sent nor received anything for this long may be dropped to make room.
const EVICT_AFTER: Duration = Duration::from_secs(1);

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
pub(super) struct Registered {
    pub(super) file: u32,
    pub(super) buffered: Option<u32>,
    pub(super) users: u32,
    /// How this export's buffered writes are done on this ring.
    pub(super) writes: super::inline::WritePath,
}

/// Loop turns of a ring between two ticks: a ring that turns without
/// completions (or with only receives ending ENOBUFS) this often is
/// spinning on something, and says on what.
#[derive(Default)]
pub(super) struct SpinWatch {
    turns: u64,
    empty_turns: u64,
    reported: Option<Instant>,
}

/// Empty turns per tick (50–250 ms) past which a ring reports itself
/// spinning: a healthy ring turns without completions only while it still
/// has connections to look at, a few times per burst; under TCG a turn
/// takes tens of microseconds, so the mark sits well below a tick's worth.
const SPIN_TURNS: u64 = 2_000;

pub(super) struct Worker {
    pub(super) id: usize,
    pub(super) config: ServerConfig,
    pub(super) ring: IoRing<Token>,
    pub(super) exports: Arc<Exports>,
    pub(super) mailboxes: Arc<Vec<Mailbox>>,
    pub(super) listeners: Vec<i32>,
    pub(super) accepts: Vec<Option<OpId>>,
    pub(super) conns: Vec<Option<Conn>>,
    pub(super) free_conns: Vec<u32>,
    pub(super) live: usize,
    pub(super) reqs: Vec<Option<Req>>,
    pub(super) free_reqs: Vec<u32>,
    pub(super) registered: HashMap<u64, Registered>,
    pub(super) dirty: Vec<u32>,
    pub(super) scratch: Vec<u8>,
    pub(super) stats: HashMap<u64, (Arc<Export>, Pending)>,
    pub(super) next_ring: usize,
    pub(super) stop_at: Option<Instant>,
    pub(super) now: Instant,
    pub(super) tick: Duration,
    pub(super) limits: Limits,
    pub(super) budget: Arc<ServerBudget>,
    /// Connections the server's budget stopped, woken when memory is released.
    pub(super) server_waiters: Vec<u32>,
    pub(super) waiters_seen: u64,
    /// The server's starvation count when this ring last looked.
    pub(super) starved_seen: u64,
    /// lseek calls left in this loop turn.
    pub(super) seeks_left: u32,
    /// A request arrived since the last tick (an idle ring trims its memory).
    pub(super) active: bool,
    /// A buffer of zeroes that WRITE_ZEROES writes from when the file cannot
    /// zero a range itself; shared, never written after it is made.
    pub(super) zeroes: Option<BufId>,
    pub(super) inline: super::inline::RingInline,
    /// The kernel lost provided buffers: multishot receives are being ended
    /// so the pool can be handed over afresh; none is armed meanwhile.
    pub(super) recv_recovering: bool,
    /// Large payloads are received directly (cancelling the multishot
    /// receive first); off for good on a ring whose kernel lost buffers,
    /// since those cancels are what lose them.
    pub(super) direct_receive: bool,
    /// Loop turns since the last tick, for noticing a ring that spins.
    pub(super) spin: SpinWatch,
    /// Connections closed since the last trim.
    pub(super) closed_since_trim: usize,
    /// Completions since the last tick, for the debug diagnostic.
    pub(super) tick_stats: super::diag::TickStats,
    /// Ticks are printed to stderr too (see `diag::trace_to_stderr`).
    pub(super) trace_stderr: bool,
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
        ring.poll_multi(Token::Wake, &ctx.mailboxes[ctx.id].wake, libc::POLLIN as u32)?;
        let tick = (ctx.config.handshake_timeout / 4).clamp(Duration::from_millis(50), Duration::from_millis(250));
        ring.timeout(Token::Tick, tick)?;
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
            starved_seen: 0,
            seeks_left: SEEKS_PER_TURN,
            active: false,
            zeroes: None,
            inline: Default::default(),
            recv_recovering: false,
            direct_receive: true,
            spin: SpinWatch::default(),
            closed_since_trim: 0,
            tick_stats: Default::default(),
            trace_stderr: super::diag::trace_to_stderr(),
        };
        for i in 0..w.listeners.len() {
            w.arm_accept(i)?;
        }
        Ok(w)
    }

    fn arm_accept(&mut self, i: usize) -> io::Result<()> {
        let fd = self.listeners[i];
        self.accepts[i] = Some(self.ring.accept_multi(Token::Accept(i as u32), fd)?);
        Ok(())
    }

    fn run(&mut self) -> io::Result<()> {
        let mut cqes: Vec<Cqe<Token>> = Vec::with_capacity(1024);
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
            self.spin.turns += 1;
            // A turn whose only completions are receives that ended on an
            // empty pool (re-armed at once) did nothing either.
            if cqes.iter().all(|c| matches!(c.token, Token::Recv(_)) && c.result == -libc::ENOBUFS && !c.more) {
                self.spin.empty_turns += 1;
            }
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

    fn on_cqe(&mut self, c: Cqe<Token>) {
        self.tick_stats.count(c.token, c.result, c.more, c.recv_buf.is_some());
        match c.token {
            Token::Wake => {
                let mut drain = [0u8; 8];
                let _ = rustix::io::read(&self.mailboxes[self.id].wake, &mut drain);
                while let Some(cmd) = self.mailboxes[self.id].queue.pop() {
                    self.on_command(cmd);
                }
                if !c.more {
                    let mailboxes = self.mailboxes.clone();
                    if let Err(e) = self.ring.poll_multi(Token::Wake, &mailboxes[self.id].wake, libc::POLLIN as u32) {
                        tracing::error!(error = %e, "NBD ring lost its command wakeup");
                    }
                }
            }
            Token::Accept(i) => self.on_accept(i as usize, c),
            Token::Tick => self.on_tick(),
            Token::Recv(ci) => self.on_recv(ci, c),
            Token::RecvInto(ci) => self.on_recv_into(ci, c.result),
            Token::Send(ci) => self.on_send(ci, c.result),
            Token::Req(ri) => self.on_request_done(ri, c.result),
            Token::Shutdown(index) => {
                if let Some(conn) = self.conns[index as usize].as_mut() {
                    conn.socket_ops -= 1;
                }
                self.mark(index);
            }
            Token::Close(ci) => self.on_closed(ci),
            Token::SpliceIn(ci) => self.on_splice(ci, true, c.result),
            Token::SpliceOut(ci) => self.on_splice(ci, false, c.result),
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

    fn on_accept(&mut self, li: usize, c: Cqe<Token>) {
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

    pub(super) fn mark(&mut self, ci: u32) {
        if let Some(c) = self.conns[ci as usize].as_mut() {
            if !c.dirty {
                c.dirty = true;
                self.dirty.push(ci);
            }
        }
    }

    /// No more requests are read; the connection closes once its requests
    /// are answered and sent.
    pub(super) fn begin_close(&mut self, ci: u32) {
        if let Some(c) = self.conns[ci as usize].as_mut() {
            c.drain();
        }
        self.mark(ci);
    }

    /// The socket is unusable: drop queued replies and close at once.
    pub(super) fn break_conn(&mut self, ci: u32) {
        let Some(c) = self.conns[ci as usize].as_mut() else { return };
        c.break_off();
        drop_parts(c, self.ring.buffers_mut(), &self.budget);
        self.mark(ci);
    }

    fn after_batch(&mut self) {
        if !self.server_waiters.is_empty() && self.budget.releases() != self.waiters_seen {
            self.wake_server_waiters();
        }
        if self.ring.recv_pool_lost() && !self.recv_recovering {
            self.begin_recv_recovery();
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
        if self.recv_recovering && self.ring.armed_recvs() == 0 {
            self.finish_recv_recovery();
        }
        for (export, pending) in self.stats.values_mut() {
            export.stats.fold(pending);
        }
    }

    /// The kernel lost provided buffers (see `IoRing::recv_pool_lost`):
    /// every multishot receive of the ring is ended, and none is armed
    /// until the pool has been handed over afresh.
    fn begin_recv_recovery(&mut self) {
        self.recv_recovering = true;
        if self.direct_receive {
            self.direct_receive = false;
            tracing::warn!(
                ring = self.id,
                "the kernel lost NBD receive buffers when a multishot receive was cancelled; \
                 large writes are no longer received directly on this ring"
            );
        }
        for ci in 0..self.conns.len() {
            let Some(c) = self.conns[ci].as_mut() else { continue };
            if let Rx::Multishot(op) = c.rx {
                c.rx = Rx::Cancelling;
                let _ = self.ring.cancel(op);
            }
        }
    }

    /// No multishot receive is armed any more: the pool goes back to the
    /// kernel whole and every connection is read again.
    fn finish_recv_recovery(&mut self) {
        match self.ring.reset_recv_pool() {
            Ok(()) => {
                tracing::warn!(ring = self.id, resets = self.ring.recv_pool_resets(), "NBD receive buffers handed to the kernel afresh")
            }
            Err(e) => tracing::error!(ring = self.id, error = %e, "NBD receive buffers could not be handed over afresh"),
        }
        self.recv_recovering = false;
        for ci in 0..self.conns.len() as u32 {
            self.mark(ci);
        }
    }

    /// Reports (at most every 10 s) a ring that turned more than
    /// [`SPIN_TURNS`] times since the last tick without completions, with
    /// what its connections are waiting for.
    fn check_spin(&mut self) {
        let spin = std::mem::take(&mut self.spin.empty_turns);
        let turns = std::mem::take(&mut self.spin.turns);
        self.log_tick(turns, spin);
        if spin < SPIN_TURNS || self.spin.reported.is_some_and(|at| self.now.duration_since(at) < Duration::from_secs(10)) {
            return;
        }
        self.spin.reported = Some(self.now);
        let conns: Vec<String> = self
            .conns
            .iter()
            .enumerate()
            .filter_map(|(i, c)| c.as_ref().map(|c| (i, c)))
            .take(8)
            .map(|(i, c)| {
                format!(
                    "#{i} serving={} state={:?} rx={:?} tx={} out={} ops={} payload={} dirty={}",
                    matches!(c.phase, Phase::Serving { .. }),
                    c.state,
                    c.rx,
                    c.tx.name(),
                    c.out.len(),
                    c.socket_ops,
                    c.payload.is_some(),
                    c.dirty
                )
            })
            .collect();
        tracing::warn!(
            ring = self.id,
            turns,
            empty_turns = spin,
            dirty = self.dirty.len(),
            live = self.live,
            in_flight = self.ring.in_flight(),
            armed_recvs = self.ring.armed_recvs(),
            recv_taken = self.ring.recv_taken(),
            recovering = self.recv_recovering,
            conns = ?conns,
            "NBD ring is spinning: many loop turns without a completion"
        );
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

    /// Brings connection `ci` up to date: what its state asks for now
    /// (receive armed or not, the next send, the shutdown, the close). A
    /// move to a later state is acted on in the same call.
    pub(super) fn service(&mut self, ci: u32) {
        let Some(c) = self.conns[ci as usize].as_mut() else { return };
        c.dirty = false;
        if c.resume_if_ready(&self.limits) {
            self.resumed(ci);
        }
        loop {
            let Some(c) = self.conns[ci as usize].as_mut() else { return };
            let state = c.state;
            match state {
                State::Reading => {
                    self.keep_receiving(ci);
                    self.send_next(ci);
                }
                State::Paused(_) => {
                    self.stop_receiving(ci);
                    self.send_next(ci);
                }
                State::Draining => {
                    self.stop_receiving(ci);
                    self.send_next(ci);
                    self.shut_down_if_drained(ci);
                }
                State::Broken => {
                    if !c.out.is_empty() {
                        drop_parts(c, self.ring.buffers_mut(), &self.budget);
                    }
                    self.stop_receiving(ci);
                    self.shut_down_if_drained(ci);
                }
                State::ShuttingDown => self.close_socket(ci),
                State::Closing => {}
            }
            if self.conns[ci as usize].as_ref().is_none_or(|c| c.state == state) {
                return;
            }
        }
    }

    /// Paused → Reading: what it had received is taken first; reading
    /// resumes only if all of it fits.
    fn resumed(&mut self, ci: u32) {
        let Some(c) = self.conns[ci as usize].as_mut() else { return };
        if matches!(c.phase, Phase::Serving { .. }) {
            let rest = std::mem::take(&mut c.inbuf);
            c.sync_inbuf(&self.budget);
            self.pump(ci, &Source::Owned(rest));
        } else {
            self.negotiate(ci);
        }
    }

    /// Keeps a receive armed on a connection being read: a multishot one,
    /// or (for the rest of a large payload) a direct one, which ends the
    /// multishot one first. While the pool is being handed over no
    /// multishot receive is armed; a direct receive may start or run on
    /// (it uses no pool buffer, and cancelling one would cut a payload in two).
    fn keep_receiving(&mut self, ci: u32) {
        let Some(c) = self.conns[ci as usize].as_mut() else { return };
        let direct = self.direct_receive && super::direct::wants_direct(c);
        match c.rx {
            Rx::Idle if direct || !self.recv_recovering => {
                let armed =
                    if direct { super::direct::arm(&mut self.ring, ci, c) } else { self.ring.recv_multi(Token::Recv(ci), c.socket) };
                match armed {
                    Ok(op) => {
                        c.rx = if direct { Rx::Direct(op) } else { Rx::Multishot(op) };
                        c.socket_ops += 1;
                        self.tick_stats.recv_arms += 1;
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "NBD receive could not be armed");
                        self.break_conn(ci);
                    }
                }
            }
            Rx::Multishot(op) if direct || self.recv_recovering => {
                c.rx = Rx::Cancelling;
                let _ = self.ring.cancel(op);
            }
            _ => {}
        }
    }

    /// Ends the receive armed on connection `ci`, if any.
    fn stop_receiving(&mut self, ci: u32) {
        let Some(c) = self.conns[ci as usize].as_mut() else { return };
        if let Rx::Multishot(op) | Rx::Direct(op) = c.rx {
            c.rx = Rx::Cancelling;
            let _ = self.ring.cancel(op);
        }
    }

    /// Draining or Broken → ShuttingDown, once drained (see `Conn::drained`):
    /// the receive is ended and the socket shut down, which also wakes a
    /// splice stuck on a full socket with an error.
    fn shut_down_if_drained(&mut self, ci: u32) {
        let Some(c) = self.conns[ci as usize].as_mut().filter(|c| c.drained()) else { return };
        c.state = State::ShuttingDown;
        self.stop_receiving(ci);
        let c = self.conns[ci as usize].as_mut().expect("present above");
        if self.ring.shutdown(Token::Shutdown(ci), c.socket).is_ok() {
            c.socket_ops += 1;
        }
    }

    /// ShuttingDown → Closing once no socket operation is left.
    fn close_socket(&mut self, ci: u32) {
        let Some(c) = self.conns[ci as usize].as_mut().filter(|c| c.socket_ops == 0) else { return };
        match self.ring.close_file(Token::Close(ci), c.socket) {
            Ok(_) => c.state = State::Closing,
            Err(e) => tracing::warn!(error = %e, "NBD socket close could not be submitted"),
        }
    }

    fn on_closed(&mut self, ci: u32) {
        let Some(mut c) = self.conns[ci as usize].take() else { return };
        self.free_conns.push(ci);
        self.live -= 1;
        self.closed_since_trim += 1;
        if let Some(p) = c.payload.take() {
            self.ring.buffers_mut().free(p.buf);
        }
        drop_parts(&mut c, self.ring.buffers_mut(), &self.budget);
        // Whatever is left (the payload buffer, unread bytes) goes back.
        c.account.close(&self.budget);
        if let Phase::Serving { attached, .. } = &c.phase {
            let export = attached.export.clone();
            export.release_after(c.disconnected);
            self.detach(&export);
        }
    }

    /// A ring with nothing to do gives memory back: cached buffers, the
    /// allocator's free pages, and request slots of a past burst.
    ///
    /// Everything is dropped before the ring trims (which ends in
    /// malloc_trim), or what was dropped last would stay resident.
    fn trim(&mut self) {
        let mut freed = 0;
        if self.free_reqs.len() == self.reqs.len() && self.reqs.capacity() > 1024 {
            freed += self.reqs.capacity() * std::mem::size_of::<Option<Req>>() + self.free_reqs.capacity() * 4;
            self.reqs = Vec::new();
            self.free_reqs = Vec::new();
        }
        // Only when no list still names a slot: `dirty` and the waiters
        // index `conns` directly.
        let unnamed = self.dirty.is_empty() && self.server_waiters.is_empty();
        if self.live == 0 && unnamed && self.conns.capacity() > 1024 {
            freed += self.conns.capacity() * std::mem::size_of::<Option<Conn>>() + self.free_conns.capacity() * 4;
            self.conns = Vec::new();
            self.free_conns = Vec::new();
        }
        if self.dirty.is_empty() && self.dirty.capacity() > 1024 {
            freed += self.dirty.capacity() * 4;
            self.dirty = Vec::new();
        }
        if self.server_waiters.is_empty() && self.server_waiters.capacity() > 1024 {
            freed += self.server_waiters.capacity() * 4;
            self.server_waiters = Vec::new();
        }
        // Closed connections freed their vectors: worth a malloc_trim too.
        freed += std::mem::take(&mut self.closed_since_trim) * std::mem::size_of::<Conn>();
        self.ring.buffers_mut().note_freed(freed);
        self.ring.trim();
    }

    /// The server refused a light connection: drops the heaviest of this
    /// ring's connections that holds memory and has made no progress (sent
    /// or received nothing) for [`EVICT_AFTER`]: a client that reads no
    /// replies, or announced a WRITE and sends no payload.
    fn evict_one(&mut self) {
        let now = self.now;
        let heaviest = (0..self.conns.len())
            .filter_map(|i| {
                let c = self.conns[i].as_ref().filter(|c| c.state.sends() && c.account.mem > 0)?;
                let quiet = now.saturating_duration_since(c.last_activity.max(c.last_send_progress));
                (quiet >= EVICT_AFTER).then_some((c.account.mem, i))
            })
            .max();
        if let Some((mem, i)) = heaviest {
            tracing::warn!(held = mem, "NBD server out of memory budget: dropping its heaviest stalled connection");
            self.break_conn(i as u32);
        }
    }

    fn on_tick(&mut self) {
        if let Err(e) = self.ring.timeout(Token::Tick, self.tick) {
            tracing::error!(error = %e, "NBD ring lost its timer");
        }
        self.check_spin();
        if !self.server_waiters.is_empty() {
            self.wake_server_waiters();
        }
        if !std::mem::take(&mut self.active) {
            self.trim();
        }
        let starved = self.budget.starved();
        if starved != self.starved_seen {
            self.starved_seen = starved;
            self.evict_one();
        }
        let now = self.now;
        let (hs, idle, stall) = (self.config.handshake_timeout, self.config.idle_timeout, self.config.stall_timeout);
        let grace_over = self.stop_at.is_some_and(|at| now > at + STOP_GRACE);
        for i in 0..self.conns.len() {
            let Some(c) = self.conns[i].as_ref() else { continue };
            let handshaking = matches!(c.phase, Phase::Handshake(_));
            let stalled = (!matches!(c.tx, Tx::Idle) || !c.out.is_empty()) && now.duration_since(c.last_send_progress) > stall;
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
