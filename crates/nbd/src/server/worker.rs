//! One ring thread: its loop, what each completion is handed to, its
//! commands, its connections' states moved on after each batch, and its
//! timers (timeouts, eviction, trimming).
//!
//! The worker owns the parts and passes each what it needs: `Shared` (the
//! ring, the connections, the budget), `Receive`, `Output`, `Requests`,
//! `Attachments`, `Acceptor` and `Diagnostics`, each in its own file with
//! its own methods. None of them knows the worker.

use std::io;
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::atomic::Ordering;
use std::sync::mpsc::SyncSender;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::accept::Acceptor;
use super::budget::{Limits, ServerBudget};
use super::conn::{Conn, Phase, State, Tx};
use super::diag::Diagnostics;
use super::exports::Attachments;
use super::idle::{self, IdlePoll};
use super::output::Output;
use super::receive::Receive;
use super::requests::Requests;
use super::shared::{drop_parts, Shared};
use super::token::Token;
use super::weight::{self, Weight};
use super::{Command, Control, ServerConfig};
use crate::export::Exports;
use crate::handshake;
use crate::stats::RingCounters;
use volring_ring::Mailbox;
use volring_ring::{Cqe, IoRing, Op};

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
/// The longest a ring sleeps past the completions of its at-once sends
/// (see `Output::settled`) before it looks at them. Such a send may have
/// been short, the socket nearly full; the rest of that reply goes only once
/// the ring has seen it, and io_uring arms no wait for an at-once send.
/// Without the bound the rest waited for the next event, the tick at worst
/// (up to 250 ms; the review's trace). A client at queue depth 1 sends its
/// next request well within it; a longer gap costs one more wake-up.
const SETTLED_SLEEP: Duration = Duration::from_millis(1);
/// When the server is starved, a connection holding memory that neither
/// sent nor received anything for this long may be dropped to make room.
const EVICT_AFTER: Duration = Duration::from_secs(1);

pub(super) struct Context {
    pub id: usize,
    pub config: ServerConfig,
    pub exports: Arc<Exports>,
    pub mailboxes: Arc<Vec<Mailbox<Command>>>,
    pub control: Arc<Control>,
    /// Listeners this ring accepts on (ring 0 only).
    pub listeners: Vec<i32>,
    pub budget: Arc<ServerBudget>,
    /// This ring's counters for `/metrics` (see `Worker::publish`).
    pub counters: Arc<RingCounters>,
}

pub(super) struct Worker {
    id: usize,
    config: ServerConfig,
    sh: Shared,
    rx: Receive,
    out: Output,
    reqs: Requests,
    exports: Attachments,
    accept: Acceptor,
    diag: Diagnostics,
    mailboxes: Arc<Vec<Mailbox<Command>>>,
    control: Arc<Control>,
    /// The export removals this ring has acted on.
    removals_seen: u64,
    stop_at: Option<Instant>,
    tick: Duration,
    /// The server's starvation count when this ring last looked.
    starved_seen: u64,
    idle: IdlePoll,
    /// The ring thread's scheduler weight, following its busy connections.
    weight: Weight,
    /// When the last tick ran: a connection active since then is busy (a
    /// late tick, as on a starved ring, still counts its whole interval).
    last_tick: Instant,
    counters: Arc<RingCounters>,
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
        let (idle_poll, ring_weight) = (ctx.config.idle_poll, ctx.config.ring_weight);
        ring.submit(Token::Wake, Op::PollMulti { fd: ctx.mailboxes[ctx.id].as_raw_fd(), events: libc::POLLIN as u32 })?;
        let tick = (ctx.config.handshake_timeout / 4).clamp(Duration::from_millis(50), Duration::from_millis(250));
        ring.submit(Token::Tick, Op::Timeout { after: tick })?;
        let limits = Limits { conn_bytes: ctx.config.max_queued_bytes, conn_requests: ctx.config.max_requests.max(1) };
        let mut accept = Acceptor::new(ctx.listeners);
        accept.arm_all(&mut ring)?;
        Ok(Worker {
            id: ctx.id,
            sh: Shared::new(ring, limits, ctx.budget),
            rx: Receive::new(ctx.config.ring.recv_bufs),
            out: Output { scratch: Vec::with_capacity(4096), sent_at_once: Vec::new() },
            reqs: Requests::new(ctx.config.offload_reads),
            exports: Attachments::new(ctx.exports, ctx.config.inline_writes),
            accept,
            diag: Diagnostics::default(),
            removals_seen: ctx.control.removals(),
            mailboxes: ctx.mailboxes,
            control: ctx.control,
            config: ctx.config,
            stop_at: None,
            tick,
            starved_seen: 0,
            idle: IdlePoll::new(idle_poll),
            weight: Weight::new(ring_weight, weight::own_nice()),
            last_tick: Instant::now(),
            counters: ctx.counters,
        })
    }

    fn run(&mut self) -> io::Result<()> {
        let mut cqes: Vec<Cqe<Token>> = Vec::with_capacity(1024);
        let mut busy = false;
        loop {
            // After a busy turn, wait a little for a burst instead of
            // waking for each request; a quiet ring wakes at the first one.
            if !self.sh.dirty.is_empty() {
                // Connections are still to be looked at: do not sleep.
                self.sh.ring.submit_and_wait(0, None)?;
            } else if busy && !self.config.batch_wait.is_zero() {
                self.sh.ring.submit_and_wait(BATCH, Some(self.config.batch_wait))?;
            } else {
                self.idle()?;
            }
            self.sh.now = Instant::now();
            self.reqs.new_turn(self.sh.now);
            cqes.clear();
            self.sh.ring.complete(&mut cqes);
            // The enter above ended this list's sends; the turn makes its own.
            self.out.sent_at_once.clear();
            self.diag.turn(&cqes);
            busy = cqes.len() >= BUSY_TURN;
            for c in cqes.drain(..) {
                self.idle.moved(c.token.socket_bytes(c.result));
                self.on_cqe(c);
            }
            self.after_batch();
            if let Some(at) = self.stop_at {
                if self.sh.live == 0 || self.sh.now > at + STOP_GRACE * 2 {
                    return Ok(());
                }
            }
        }
    }

    /// Nothing to do: polls for as long as the bytes of a large WRITE's
    /// payload keep coming, or for a moment if the last idle gap was short
    /// and the ring waits only on its clients (see `idle`), then sleeps
    /// until a completion comes. A ring that would not poll (contended for
    /// its CPU, or with the poll off) sleeps past the completions of the
    /// replies it sends at once in that sleep (see `Output::settled`), for
    /// at most [`SETTLED_SLEEP`]; any other wakes for them, as before, and
    /// may poll the next gap.
    fn idle(&mut self) -> io::Result<()> {
        let started = Instant::now();
        let ring = self.sh.ring.stats();
        let own_work = !idle::waits_on_clients(ring.in_flight, ring.armed_recvs, self.accept.armed());
        // A ring boosted for being starved (`weight`) polls as any ring
        // whose windows are not starved: holding its poll back cost it more
        // CPU per request, not less (23.5 against 19.7 µs per QD1 write,
        // spinners pinned, builds that also differed in the boost's
        // trigger; docs/benchmarks.md, twelfth pass).
        let contended = self.reqs.contended();
        // A large WRITE's payload on its way in: polled while its bytes
        // keep coming, so the ring and its client stream (see `idle`).
        let streaming = self.rx.streaming();
        let stream_window = self.idle.stream_window(streaming, contended, started);
        if let Some(window) = stream_window {
            let found = self.sh.ring.poll_for(window, idle::MAX_STREAM_POLL)?;
            self.diag.polled(found);
            self.idle.stream_polled(streaming, found);
            if found {
                self.idle.ended(started.elapsed());
                return Ok(());
            }
        }
        // After a poll for a payload that found nothing, the ring sleeps.
        let polled = match self.idle.window(contended || own_work).filter(|_| stream_window.is_none()) {
            Some(window) => {
                let found = self.sh.ring.poll_for(window, window)?;
                self.diag.polled(found);
                found
            }
            None => false,
        };
        if !polled {
            // Only where no poll would follow: on a quiet machine the wake-up
            // for the sends is what measures the next gap as short and arms
            // the poll (sleeping past them, the gap took in the ring's own
            // wake-up and the poll stayed off: 35.2k against 39.8k QD1 xfs
            // writes, pinned).
            let past = if contended || !self.idle.enabled() { self.out.settled(&self.sh, self.rx.waiting()) } else { 0 };
            // The bound ends the wait once it passes (min_wait, or an
            // ordinary timeout before Linux 6.12).
            self.sh.ring.submit_and_wait(1 + past, (past > 0).then_some(SETTLED_SLEEP))?;
        }
        self.idle.ended(started.elapsed());
        Ok(())
    }

    fn on_cqe(&mut self, c: Cqe<Token>) {
        let (sh, out, reqs, exports) = (&mut self.sh, &mut self.out, &mut self.reqs, &mut self.exports);
        match c.token {
            Token::Wake => self.on_wake(c.more),
            Token::Accept(i) => {
                let rings = self.mailboxes.len();
                if let Some((fd, target)) = self.accept.on_accept(&mut sh.ring, i as usize, &c, self.stop_at.is_some(), rings) {
                    if target == self.id {
                        self.adopt(fd);
                    } else if let Err(Command::Adopt(fd)) = self.mailboxes[target].send(Command::Adopt(fd)) {
                        // That ring is far behind: this one serves the client (a ring never waits).
                        self.adopt(fd);
                    }
                }
            }
            Token::Tick => {
                // Before the tick's diagnostic line takes the tick's counts.
                self.publish();
                self.on_tick();
            }
            Token::Recv(ci) => self.rx.on_recv(sh, out, reqs, exports, ci, c),
            Token::RecvInto(ci) => self.rx.on_recv_into(sh, out, reqs, exports, ci, c.result),
            Token::Send(ci) => out.on_send(sh, ci, c.result),
            Token::SpliceIn(ci) => out.on_splice(sh, ci, true, c.result),
            Token::SpliceOut(ci) => out.on_splice(sh, ci, false, c.result),
            Token::Req(ri) => reqs.on_done(sh, out, ri, c.result),
            Token::Shutdown(ci) => {
                if let Some(conn) = sh.conn_mut(ci) {
                    conn.socket_ops -= 1;
                }
                sh.mark(ci);
            }
            Token::Close(ci) => self.on_closed(ci),
        }
    }

    /// The mailbox's eventfd: sockets to adopt, and what the server's
    /// control says (a stop, export removals).
    fn on_wake(&mut self, more: bool) {
        let mailbox = &self.mailboxes[self.id];
        mailbox.clear_wakeup();
        if self.control.stopping() && self.stop_at.is_none() {
            self.stop();
        }
        let removals = self.control.removals();
        if removals != self.removals_seen {
            self.removals_seen = removals;
            self.drop_removed_exports();
        }
        while let Some(Command::Adopt(fd)) = self.mailboxes[self.id].recv() {
            self.adopt(fd);
        }
        if !more {
            let mailboxes = self.mailboxes.clone();
            if let Err(e) =
                self.sh.ring.submit(Token::Wake, Op::PollMulti { fd: mailboxes[self.id].as_raw_fd(), events: libc::POLLIN as u32 })
            {
                tracing::error!(error = %e, "NBD ring lost its command wakeup");
            }
        }
    }

    /// Stops accepting and closes every connection once its requests are answered.
    fn stop(&mut self) {
        self.stop_at = Some(self.sh.now);
        self.accept.cancel_all(&mut self.sh.ring);
        for i in 0..self.sh.conns.len() as u32 {
            if self.sh.conn(i).is_some() {
                self.sh.begin_close(i);
            }
        }
    }

    /// Closes the connections to exports the server no longer has (once
    /// their requests are answered).
    fn drop_removed_exports(&mut self) {
        for i in 0..self.sh.conns.len() as u32 {
            let gone = self.sh.conn(i).and_then(|c| c.attached()).is_some_and(|a| a.export.is_removed());
            if gone {
                self.sh.begin_close(i);
            }
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
        let socket = match self.sh.ring.register_file(fd.as_raw_fd()) {
            Ok(s) => s,
            Err(e) => {
                tracing::warn!(error = %e, "NBD connection refused: no fixed-file slot");
                return;
            }
        };
        drop(fd);
        let ci = self.sh.insert(Conn::new(socket, self.sh.now));
        self.out.scratch.clear();
        self.out.scratch.extend_from_slice(&handshake::greeting());
        self.out.queue_scratch(&mut self.sh, ci);
    }

    fn after_batch(&mut self) {
        self.rx.after_batch(&mut self.sh);
        // Servicing a connection can queue replies on it (or free memory
        // for another): a few rounds, and the loop does not sleep on the rest.
        for _ in 0..SERVICE_ROUNDS {
            if self.sh.dirty.is_empty() {
                break;
            }
            let mut dirty = std::mem::take(&mut self.sh.dirty);
            for ci in dirty.drain(..) {
                self.service(ci);
            }
            if self.sh.dirty.is_empty() {
                self.sh.dirty = dirty;
            }
        }
        self.rx.finish_recovery(&mut self.sh);
        self.sh.fold_stats();
    }

    /// Brings connection `ci` up to date: what its state asks for now
    /// (receive armed or not, the next send, the shutdown, the close). A
    /// move to a later state is acted on in the same call.
    fn service(&mut self, ci: u32) {
        let Some(c) = self.sh.conns[ci as usize].as_mut() else { return };
        c.dirty = false;
        if c.resume_if_ready(&self.sh.limits) {
            self.rx.resume(&mut self.sh, &mut self.out, &mut self.reqs, &mut self.exports, ci);
        }
        let sh = &mut self.sh;
        loop {
            let Some(c) = sh.conns[ci as usize].as_mut() else { return };
            let state = c.state;
            match state {
                State::Reading => {
                    if self.rx.keep_receiving(sh, ci) {
                        self.diag.tick.recv_arms += 1;
                    }
                    self.out.send_next(sh, ci);
                }
                State::Paused(_) => {
                    sh.stop_receiving(ci);
                    self.out.send_next(sh, ci);
                }
                State::Draining => {
                    sh.stop_receiving(ci);
                    self.out.send_next(sh, ci);
                    sh.shut_down_if_drained(ci);
                }
                State::Broken => {
                    if !c.out.is_empty() {
                        drop_parts(c, sh.ring.buffers(), &sh.budget);
                    }
                    sh.stop_receiving(ci);
                    sh.shut_down_if_drained(ci);
                }
                State::ShuttingDown => sh.close_socket(ci),
                State::Closing => {}
            }
            if sh.conn(ci).is_none_or(|c| c.state == state) {
                return;
            }
        }
    }

    /// Closing → gone: the socket's close completed; what the connection
    /// held goes back and its slot is free.
    fn on_closed(&mut self, ci: u32) {
        let Some(mut c) = self.sh.remove(ci) else { return };
        if let Some(buf) = c.payload.take().and_then(|p| p.buf) {
            self.sh.ring.buffers().free(buf);
        }
        // Its writes have ended, and each recycled the receive buffer it kept.
        debug_assert!(c.lent.is_empty(), "a closed connection still keeps receive buffers: {:?}", c.lent);
        drop_parts(&mut c, self.sh.ring.buffers(), &self.sh.budget);
        // Whatever is left (the payload buffer, unread bytes) goes back.
        c.account.close(&self.sh.budget);
        if let Phase::Serving { attached, .. } = &c.phase {
            let export = attached.export.clone();
            export.release_after(c.disconnected);
            self.exports.detach(&mut self.sh, &export);
        }
    }

    /// A ring with nothing to do gives memory back: cached buffers, the
    /// allocator's free pages, and request slots of a past burst.
    ///
    /// Everything is dropped before the ring trims (which ends in
    /// malloc_trim), or what was dropped last would stay resident.
    fn trim(&mut self) {
        let sh = &mut self.sh;
        let mut freed = self.reqs.trim();
        // Only when no list still names a slot: `dirty` and the waiters
        // index `conns` directly.
        let unnamed = sh.dirty.is_empty() && self.rx.waiting() == 0;
        if sh.live == 0 && unnamed && sh.conns.capacity() > 1024 {
            freed += sh.conns.capacity() * std::mem::size_of::<Option<Conn>>() + sh.free_conns.capacity() * 4;
            sh.conns = Vec::new();
            sh.free_conns = Vec::new();
        }
        if sh.dirty.is_empty() && sh.dirty.capacity() > 1024 {
            freed += sh.dirty.capacity() * 4;
            sh.dirty = Vec::new();
        }
        freed += self.rx.trim();
        // Closed connections freed their vectors: worth a malloc_trim too.
        freed += std::mem::take(&mut sh.closed_since_trim) * std::mem::size_of::<Conn>();
        sh.ring.trim(freed);
    }

    /// The server refused a light connection: drops the heaviest of this
    /// ring's connections that holds memory and has made no progress (sent
    /// or received nothing) for [`EVICT_AFTER`]: a client that reads no
    /// replies, or announced a WRITE and sends no payload.
    fn evict_one(&mut self) {
        let now = self.sh.now;
        let heaviest = (0..self.sh.conns.len())
            .filter_map(|i| {
                let c = self.sh.conns[i].as_ref().filter(|c| c.state.sends() && c.account.mem > 0)?;
                let quiet = now.saturating_duration_since(c.last_activity.max(c.last_send_progress));
                (quiet >= EVICT_AFTER).then_some((c.account.mem, i))
            })
            .max();
        if let Some((mem, i)) = heaviest {
            tracing::warn!(held = mem, "NBD server out of memory budget: dropping its heaviest stalled connection");
            self.sh.break_conn(i as u32);
        }
    }

    /// Publishes what the ring counts about itself for `/metrics`: once
    /// per tick, so the ring's path touches no shared cache line per
    /// completion or per idle poll.
    fn publish(&self) {
        let (c, t) = (&self.counters, &self.diag.tick);
        c.idle_polls_found.fetch_add(u64::from(t.polls_found), Ordering::Relaxed);
        c.idle_polls_missed.fetch_add(u64::from(t.polls_missed), Ordering::Relaxed);
        c.starved_windows.store(self.reqs.starved_windows(), Ordering::Relaxed);
        c.offloading_reads.store(self.reqs.offloading(), Ordering::Relaxed);
        let pool = self.sh.ring.stats();
        c.recv_buffers_held.store(u32::from(pool.recv_taken), Ordering::Relaxed);
        c.recv_buffers_lent.store(u32::from(pool.recv_lent), Ordering::Relaxed);
        c.enters.store(pool.enters, Ordering::Relaxed);
    }

    fn on_tick(&mut self) {
        if let Err(e) = self.sh.ring.submit(Token::Tick, Op::Timeout { after: self.tick }) {
            tracing::error!(error = %e, "NBD ring lost its timer");
        }
        self.diag.on_tick(self.id, &self.sh, &self.rx);
        if self.rx.waiting() > 0 {
            self.rx.wake_waiters(&mut self.sh);
        }
        if !std::mem::take(&mut self.sh.active) {
            self.trim();
        }
        let starved = self.sh.budget.starved();
        if starved != self.starved_seen {
            self.starved_seen = starved;
            self.evict_one();
        }
        let now = self.sh.now;
        let (hs, idle, stall) = (self.config.handshake_timeout, self.config.idle_timeout, self.config.stall_timeout);
        let grace_over = self.stop_at.is_some_and(|at| now > at + STOP_GRACE);
        let mut busy = 0;
        let since = std::mem::replace(&mut self.last_tick, now);
        for i in 0..self.sh.conns.len() {
            let Some(c) = self.sh.conns[i].as_mut() else { continue };
            let handshaking = matches!(c.phase, Phase::Handshake(_));
            c.last_depth = std::mem::take(&mut c.depth);
            busy += weight::threads_for(!handshaking && c.last_activity >= since, c.last_depth);
            let stalled = (!matches!(c.tx, Tx::Idle) || !c.out.is_empty()) && now.duration_since(c.last_send_progress) > stall;
            let idle_out = idle.is_some_and(|t| c.account.requests == 0 && c.out.is_empty() && now.duration_since(c.last_activity) > t);
            if (handshaking && now.duration_since(c.since) > hs) || stalled || grace_over {
                tracing::debug!(handshaking, stalled, "NBD connection timed out");
                self.sh.break_conn(i as u32);
            } else if idle_out {
                self.sh.begin_close(i as u32);
            }
        }
        self.sh.senders.tick();
        let served = self.reqs.served_since_tick(now);
        self.weight.follow(busy, served, weight::set_own_nice);
        self.counters.nice.store(self.weight.nice(), Ordering::Relaxed);
    }
}
