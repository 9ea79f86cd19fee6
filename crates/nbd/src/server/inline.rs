//! Buffered WRITEs done on the ring thread itself when the pool's file
//! system would otherwise make io_uring hand each one to a worker thread.
//!
//! io_uring completes a buffered write inline only when the file system
//! takes it without blocking (RWF_NOWAIT). xfs does; ext4 answers
//! EOPNOTSUPP, so io_uring passes every write to an io-wq worker — one
//! thread hand-off per write, and writes to one file served one after
//! another. For such a file a write up to a large request's size is
//! cheaper as a plain blocking `pwritev2` on the ring thread: it usually
//! only copies into the page cache. Per export and ring:
//!
//! - the first write is tried with RWF_NOWAIT; if the file system takes it,
//!   every write goes through the ring (where it completes inline anyway);
//! - if it answers EOPNOTSUPP, or EAGAIN [`PROBES`] times in a row and never
//!   succeeds, writes of at most [`INLINE_MAX`] are done blocking here,
//!   those over [`STAMP_MAX`] only while no other connection of the ring
//!   sent requests lately and the ring is not in a spell of being starved
//!   of CPU (`InlineWrite::large_out`);
//! - EAGAIN alone is weak evidence: xfs answers it whenever the write would
//!   wait (dirty-page throttling, or the inode lock held by an io-wq worker
//!   that waits there), and those answers come in streaks as long as the
//!   requests in flight: at 4 connections x QD8, 8 in a row at the start of
//!   a run sent xfs inline in some runs and not others, and inline cost it
//!   5.2 µs of server CPU per 4 KiB write against 4.6 through the ring.
//!   [`PROBES`] is longer than such a streak;
//! - that refusal is not final: a file system that refused under a passing
//!   load would otherwise keep its writes off the ring for good. One write
//!   is tried with RWF_NOWAIT again after [`FIRST_GAP`] writes, then twice
//!   as many, and so on up to
//!   [`REPROBE_MAX`]: a short streak is undone soon, a file system that
//!   never takes them pays one refused syscall (no I/O: the file system
//!   refuses before it starts) in [`REPROBE_MAX`] writes, and a success
//!   sends writes back through the ring;
//! - a blocking write that took over [`SLOW`] and slept (the thread's
//!   voluntary context switches rose: it waited on the disk, writeback or a
//!   lock) sends writes back to the ring for [`BACKOFF`], so one slow
//!   device does not stall every connection of the ring;
//! - so does one that took over [`SLOW`] because the ring thread was
//!   preempted (it was off the CPU that long without sleeping: other work
//!   wants the CPU) while the ring served several requests at once
//!   (`starve::at_once`). The scheduler shares a contended CPU per thread:
//!   a ring doing every connection's writes itself gets one share, where a
//!   server with a thread per connection gets one per connection (4
//!   connections × QD8 writes under two CPU spinners: 0.24× nbdkit's
//!   throughput at the same CPU per write, benchmarks.md); io_uring's
//!   workers are threads of their own (1.35–1.7× the inline throughput
//!   there). A lone write's worker would be preempted the same, so a lone
//!   preempted write does not back off (a QD1 client beside a spinner
//!   backed off four times in 5 s, a second each time, so its writes went
//!   to a worker for most of the run);
//! - a ring in a spell of being starved of CPU (`starve`: several 20 ms
//!   windows in a row in which it waited for its CPU) that serves several
//!   requests at once (`starve::at_once`: an inline write leaves the
//!   ring's table at once, so its turns and the client's receives count
//!   too) does no blocking write itself either: io_uring hands them to its
//!   workers, threads of their own, which write while the ring parses and
//!   replies for the rest. A lone write stays here, as a lone read does:
//!   through a worker it costs a hand-off each way and there is nothing to
//!   overlap it with. One connection × QD1 4 KiB writes to ext4, the
//!   server held to a CPU with a spinner on it: 2.8-3.5 context switches
//!   and 2.9-3.6 `io_uring_enter`s per write through the workers, 1.0-2.2
//!   and 2.1-2.5 kept here, and 14-15 % less server CPU per write in
//!   medians of 8 rounds (benchmarks.md, tenth pass; unpinned, the
//!   throughput of such runs spreads too widely to show a difference
//!   either way);
//! - FUA writes always go through the ring (a durable write waits on the
//!   device); replies are flushed every [`FLUSH_EVERY`] inline writes, so a
//!   burst does not hold its first replies back.
//!
//! Once writes go through the ring nothing is probed again: a file system
//! that takes RWF_NOWAIT writes has said it can, and io_uring itself hands
//! the odd write that would block to a worker. One kind of write would
//! block there all the time: the one that has to move the file's times,
//! once per tick of the kernel's coarse clock. Such a write is done
//! blocking here (see the `stamp` module), and backs off after a slow one
//! that slept (not after a preempted one: see
//! [`WritePath::blocking_done`]).

use std::collections::HashMap;
use std::io::IoSlice;
use std::os::fd::BorrowedFd;
use std::time::{Duration, Instant};

use rustix::io::{Errno, ReadWriteFlags};

use super::stamp::{Reading, Ticks};
use crate::export::Export;
use crate::wire::{cmd, cmd_flags as cf, Request};
use crate::Error;

/// Largest write done blocking on the ring thread for a file system that
/// refuses RWF_NOWAIT (ext4, or any that [`PROBES`] EAGAINs sent inline): a
/// request of the kernel nbd client's default largest size (1,280 KiB) is
/// within it. Such a write holds the ring for its copy into the page cache
/// (150-200 µs per MiB on ext4 here), as an RWF_NOWAIT write through the
/// ring holds it on xfs. Through a worker it cost a hand-off and the
/// worker's share of the ring's CPU, and the ring, contended by its own
/// worker, did not poll while the next payload streamed in: pinned, 1 MiB
/// writes at queue depth 8 on ext4 went from 3.6-4.0k to 4.4-4.6k a second,
/// with 0.1-1.5 context switches per write against 3.7-5.0. Beside another
/// client the copy holds that client's requests back: a 4 KiB reader at
/// queue depth 1, one ring on one CPU, did 0.84-0.90x the reads it did
/// beside the worker path; and on a CPU contended by two spinners the ring
/// alone did 0.83-0.91x the writes it did with a worker, a thread with a
/// CPU share of its own whose copy overlaps the ring's receive of the next
/// payload. So a write over [`STAMP_MAX`] is done here only while its
/// connection is the ring's lone sender and the ring is not in a starved
/// spell ([`InlineWrite::large_out`]);
/// otherwise it goes to a worker, which the scheduler also preempts for
/// the ring when another client's request comes (docs/benchmarks.md,
/// sixteenth pass).
pub(super) const INLINE_MAX: u64 = 2 << 20;
/// Largest write through the ring done blocking here for the file's time
/// stamp (see [`WritePath::route_ring`]), beyond which one may be left to
/// io_uring's workers ([`in_workers`]), and the largest done blocking here
/// while another connection of the ring sends requests or the ring is in a
/// starved spell ([`InlineWrite::large_out`]).
pub(super) const STAMP_MAX: u64 = 64 * 1024;
/// A blocking write slower than this that slept turns inline writes off.
pub(super) const SLOW: Duration = Duration::from_millis(1);
/// How long writes go back to the ring after a slow one.
pub(super) const BACKOFF: Duration = Duration::from_secs(1);
/// EAGAINs in a row, with no success, that make the probe give up on the
/// ring: longer than a streak a loaded xfs gives (about the requests in
/// flight), short enough that a file system that refuses every write costs
/// few io-wq hand-offs before writes are done here.
pub(super) const PROBES: u16 = 128;
/// Writes done blocking before the first RWF_NOWAIT try after a refusal.
pub(super) const FIRST_GAP: u32 = 8;
/// Most writes done blocking between two RWF_NOWAIT tries once the file
/// system refused: bounds both the refused syscalls a file system that
/// never takes them costs (one in this many writes) and how long writes
/// stay off the ring after a refusal that has passed.
pub(super) const REPROBE_MAX: u32 = 1024;
/// Inline writes between two flushes of the connection's replies.
pub(super) const FLUSH_EVERY: u32 = 8;

/// Whether buffered writes may be done on the ring thread.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum InlineWrites {
    /// Decided per export by probing the file system (see the module docs).
    #[default]
    Auto,
    /// Every write goes through io_uring.
    Off,
}

impl std::str::FromStr for InlineWrites {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self, Error> {
        match s {
            "auto" => Ok(InlineWrites::Auto),
            "off" => Ok(InlineWrites::Off),
            _ => Err(Error::Setting { what: "NBD inline-writes mode", value: s.to_string(), why: "expected auto or off" }),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    /// Not known yet: the next write is tried with RWF_NOWAIT.
    Probe { eagain: u16 },
    /// The file system takes writes without blocking: io_uring does them,
    /// but for those that move the file's times.
    Ring,
    /// Inline writes are turned off: io_uring does every one.
    Off,
    /// Writes up to [`INLINE_MAX`] are done blocking on the ring thread.
    Inline,
    /// Inline, and a write was handed out to be tried with RWF_NOWAIT again;
    /// until its answer comes, the next write is tried too.
    Reprobe,
    /// Inline, but a write was slow: through the ring until then.
    Backoff(Instant),
}

/// How one write is done.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Route {
    Ring,
    /// pwritev2 with RWF_NOWAIT; if refused, where [`WritePath::refused`] says.
    Nowait,
    /// Blocking pwritev2 on the ring thread.
    Blocking,
}

/// One export's write path on one ring. Pure: the worker reports what the
/// file system did and asks where the next write goes.
#[derive(Debug, Clone)]
pub(super) struct WritePath {
    mode: Mode,
    /// Writes routed inline since the file system last refused one
    /// (counted as routed even when the ring then left one to a worker:
    /// `large_out`, or `offload`).
    since_refusal: u32,
    /// Writes to route inline before trying RWF_NOWAIT again: as many as
    /// the probe's tries when it gives up, doubled by every refusal after,
    /// up to [`REPROBE_MAX`].
    gap: u32,
    /// The coarse clock as last told by [`WritePath::clock`].
    clock: Reading,
    /// As last told by [`WritePath::clock`]: the ring has a write of this
    /// export in flight that io_uring's workers may do (large, FUA,
    /// zeroes, trims).
    workers_write: bool,
    /// The coarse clock when a write through the ring's path was last done
    /// blocking here to move the file's times (see `WritePath::route_ring`).
    stamped: u64,
    /// Writes through the ring are not done blocking for a time stamp
    /// until then: one such write was slow.
    stamp_backoff: Option<Instant>,
}

impl WritePath {
    pub(super) fn new(setting: InlineWrites) -> Self {
        let mode = match setting {
            InlineWrites::Auto => Mode::Probe { eagain: 0 },
            InlineWrites::Off => Mode::Off,
        };
        let clock = Reading { coarse: 0, near_tick: false };
        WritePath { mode, since_refusal: 0, gap: FIRST_GAP, clock, workers_write: false, stamped: 0, stamp_backoff: None }
    }

    /// Whether writes go through the ring (but for the time stamps, which
    /// [`WritePath::route`] decides from the clock).
    pub(super) fn through_ring(&self) -> bool {
        self.mode == Mode::Ring
    }

    /// Tells the path the coarse clock now (see the `stamp` module), and
    /// whether the ring has a write in flight in io_uring's workers.
    pub(super) fn clock(&mut self, clock: Reading, workers_write: bool) {
        self.clock = clock;
        self.workers_write = workers_write;
    }

    pub(super) fn route(&mut self, len: u64, fua: bool, now: Instant) -> Route {
        if let Mode::Backoff(until) = self.mode {
            if now < until {
                return Route::Ring;
            }
            self.mode = Mode::Inline;
        }
        match self.mode {
            _ if fua => Route::Ring,
            Mode::Probe { .. } | Mode::Reprobe => Route::Nowait,
            Mode::Inline if self.since_refusal >= self.gap => {
                self.mode = Mode::Reprobe;
                Route::Nowait
            }
            Mode::Inline => {
                self.since_refusal += 1;
                self.refused(len)
            }
            Mode::Ring => self.route_ring(len, now),
            Mode::Backoff(_) | Mode::Off => Route::Ring,
        }
    }

    /// A write to a file whose writes io_uring takes without blocking is
    /// done blocking here when it may have to move the file's times: the
    /// first one after the coarse clock moved, and every one while the
    /// clock is about to move (see the `stamp` module). Through the ring,
    /// io_uring would hand it to a worker that holds the inode's lock
    /// meanwhile, and every write of the turn after it would follow it.
    /// Not while a write of this export that a worker may do (see
    /// [`in_workers`]) is submitted and not complete: the worker may hold
    /// the inode's lock (and sleep in dirty-page throttling with it), and
    /// the ring thread would wait for it.
    fn route_ring(&mut self, len: u64, now: Instant) -> Route {
        if len > STAMP_MAX || self.workers_write {
            return Route::Ring;
        }
        if let Some(until) = self.stamp_backoff {
            if now < until {
                return Route::Ring;
            }
            self.stamp_backoff = None;
        }
        if self.clock.near_tick {
            return Route::Blocking;
        }
        if self.clock.coarse == self.stamped {
            return Route::Ring;
        }
        self.stamped = self.clock.coarse;
        Route::Blocking
    }

    /// Where a write of `len` goes once its RWF_NOWAIT try was refused and
    /// reported: done blocking here if that is what the answer decided,
    /// rather than one more hand-off to a worker.
    pub(super) fn refused(&self, len: u64) -> Route {
        if self.mode == Mode::Inline && len <= INLINE_MAX {
            Route::Blocking
        } else {
            Route::Ring
        }
    }

    /// What a RWF_NOWAIT write answered: `Ok` (some bytes written) or its
    /// errno. True when the answer changed how writes are done.
    pub(super) fn nowait_done(&mut self, res: Result<usize, Errno>) -> bool {
        let before = self.mode;
        self.mode = match (self.mode, res) {
            (Mode::Probe { .. } | Mode::Reprobe, Ok(_)) => Mode::Ring,
            (Mode::Probe { .. }, Err(Errno::OPNOTSUPP)) => Mode::Inline,
            (Mode::Probe { eagain }, Err(Errno::AGAIN)) if eagain + 1 >= PROBES => Mode::Inline,
            (Mode::Probe { eagain }, Err(Errno::AGAIN)) => Mode::Probe { eagain: eagain + 1 },
            // Not an answer about blocking (ENOSPC, EIO...): ask again.
            (Mode::Probe { eagain }, Err(_)) => Mode::Probe { eagain },
            // Refused again, or no answer about blocking: wait longer
            // before the next try either way, so the tries stay rare.
            (Mode::Reprobe, Err(_)) => {
                self.since_refusal = 0;
                self.gap = (self.gap * 2).min(REPROBE_MAX);
                Mode::Inline
            }
            // Nothing was asked: decided already.
            (mode, _) => mode,
        };
        matches!((before, self.mode), (Mode::Probe { .. }, Mode::Inline) | (Mode::Probe { .. } | Mode::Reprobe, Mode::Ring))
    }

    /// A blocking write took `took`; `slept` if the thread waited
    /// meanwhile, `preempted` if it was off the CPU over [`SLOW`] without
    /// sleeping (the CPU is contended), `lone` if the ring served fewer than
    /// `starve::MIN_IN_FLIGHT` requests at once (`starve::at_once`). True
    /// when that sent writes back to the ring for [`BACKOFF`]: a write over
    /// [`SLOW`] that slept, or that was preempted while the ring served
    /// several. A lone write gains nothing from a worker: the worker is
    /// preempted as the ring was, and adds a hand-off each way (one
    /// connection × QD1 writes beside a spinner backed off four times in
    /// 5 s, a second each time; benchmarks.md, tenth pass). On a ring path
    /// only one that slept (it waited for dirty-page throttling, the
    /// journal, or the inode's lock held by a write in a worker): a stamp
    /// per tick is little of a contended CPU's share.
    /// Waiting behind the few writes that went to a worker (a burst of 30
    /// is about 300 µs) is not enough: backing off for it would send the
    /// stamps back to the workers, and the bursts with them.
    pub(super) fn blocking_done(&mut self, took: Duration, slept: bool, preempted: bool, lone: bool, now: Instant) -> bool {
        if took <= SLOW {
            return false;
        }
        match self.mode {
            Mode::Ring if slept => self.stamp_backoff = Some(now + BACKOFF),
            Mode::Ring | Mode::Off => return false,
            _ if slept || (preempted && !lone) => self.mode = Mode::Backoff(now + BACKOFF),
            _ => return false,
        }
        true
    }

    /// Whether writes up to [`INLINE_MAX`] are being done on the ring thread now.
    #[cfg(test)]
    pub(super) fn inline_now(&self) -> bool {
        self.mode == Mode::Inline
    }
}

/// A ring's side of inline writes: for telling whether a write slept or
/// was preempted.
#[derive(Debug, Default)]
pub(super) struct RingInline {
    /// Read at the first inline write of a loop turn.
    snapshot: Option<Snapshot>,
    /// Inline writes since the replies were last flushed.
    unflushed: u32,
    /// When the coarse clock moves, learnt from its readings.
    ticks: Ticks,
    /// The coarse clock read at the first write through a ring path in a
    /// loop turn.
    clock: Option<(Instant, Reading)>,
    /// Submissions to the kernel so far (loop turns, and flushes within one).
    turn: u64,
    /// Per export: writes that io_uring's workers may do (large or FUA
    /// ones, zeroings, trims) queued since the last submission, and
    /// submitted before it, whose completions have not come yet. For the
    /// submitted ones a worker may hold the file's inode lock (see
    /// `WritePath::route_ring`); the queued ones hold nothing yet.
    in_workers: HashMap<u64, (u32, u32)>,
}

/// The thread's state when a turn's inline writes began.
#[derive(Debug, Clone, Copy)]
struct Snapshot {
    turn: Instant,
    /// Voluntary context switches so far (`None`: unreadable).
    switches: Option<u64>,
    /// When it was taken, and the thread's CPU time then: the wall time
    /// since, less the CPU time since, is how long the thread was off the CPU.
    wall: Instant,
    cpu: Duration,
}

impl Snapshot {
    fn take(turn: Instant) -> Snapshot {
        let switches = volring_sys::thread_voluntary_switches().ok();
        Snapshot { turn, switches, wall: Instant::now(), cpu: volring_sys::thread_cpu_time() }
    }

    /// Whether the thread slept since, and whether it was off the CPU for
    /// over [`SLOW`] without sleeping.
    fn since(&self, switches: Option<u64>, cpu: Duration) -> (bool, bool) {
        let slept = match (self.switches, switches) {
            (Some(before), Some(after)) => after > before,
            _ => true,
        };
        let off_cpu = self.wall.elapsed().saturating_sub(cpu.saturating_sub(self.cpu));
        (slept, !slept && off_cpu > SLOW)
    }
}

/// One write the ring may do here: its export, the descriptor it goes
/// through, its bytes and where they go.
pub(super) struct InlineWrite<'a> {
    pub export: &'a Export,
    pub fd: BorrowedFd<'a>,
    pub data: &'a [u8],
    pub offset: u64,
    pub fua: bool,
    /// A write that would block goes to io_uring's workers: the ring is
    /// starved of CPU and serving several requests at once (see
    /// `starve::ReadPath::offload_writes`).
    pub offload: bool,
    /// The ring serves fewer than `starve::MIN_IN_FLIGHT` requests at
    /// once: a preempted write of it does not back off
    /// ([`WritePath::blocking_done`]).
    pub lone: bool,
    /// A write over [`STAMP_MAX`] is left to io_uring's workers: another
    /// connection of the ring sent requests since the tick before last
    /// (`Senders`), or the ring is in a spell of being starved of CPU
    /// (`starve::ReadPath::starved_spell`); see [`INLINE_MAX`].
    pub large_out: bool,
}

impl RingInline {
    /// Everything queued for the ring has been submitted to the kernel (a
    /// new loop turn, or a flush within one).
    pub(super) fn submitted_all(&mut self) {
        for (queued, submitted) in self.in_workers.values_mut() {
            *submitted += std::mem::take(queued);
        }
        self.in_workers.retain(|_, &mut counts| counts != (0, 0));
        self.turn += 1;
        // What was queued has left: the next flush is due after as many
        // writes again (a lone write a turn never forces one).
        self.unflushed = 0;
    }

    /// A write of export `export` that the workers may do was queued for
    /// the ring: the mark to hand back to [`RingInline::landed`] when its
    /// completion comes.
    pub(super) fn queued(&mut self, export: u64) -> (u64, u64) {
        self.in_workers.entry(export).or_default().0 += 1;
        (export, self.turn)
    }

    /// The completion of what [`RingInline::queued`] marked came.
    pub(super) fn landed(&mut self, (export, turn): (u64, u64)) {
        if let Some((queued, submitted)) = self.in_workers.get_mut(&export) {
            let count = if turn == self.turn { queued } else { submitted };
            *count = count.saturating_sub(1);
        }
    }

    /// The ring has no request in flight: nothing it queued can be in a
    /// worker. A count left over would keep that export's stamps off.
    pub(super) fn all_landed(&mut self) {
        debug_assert!(self.in_workers.values().all(|&c| c == (0, 0)), "{:?}", self.in_workers);
        self.in_workers.clear();
    }

    /// Does write `w` here if its export's write path says so: its result
    /// (bytes written or a negative errno); `None`: the caller submits it
    /// to the ring.
    pub(super) fn write(&mut self, path: &mut WritePath, w: InlineWrite<'_>, now: Instant) -> Option<i32> {
        let len = w.data.len() as u64;
        if path.through_ring() {
            let clock = match self.clock {
                Some((turn, clock)) if turn == now => clock,
                _ => self.clock.insert((now, self.ticks.read())).1,
            };
            let in_workers = self.in_workers.get(&w.export.id).is_some_and(|&(_, submitted)| submitted > 0);
            path.clock(clock, in_workers);
        }
        let route = path.route(len, w.fua, now);
        if route == Route::Ring {
            return None;
        }
        if route == Route::Nowait {
            let res = rustix::io::pwritev2(w.fd, &[IoSlice::new(w.data)], w.offset, ReadWriteFlags::NOWAIT);
            let changed = path.nowait_done(res);
            if let Ok(n) = res {
                if changed {
                    tracing::debug!(export = %w.export.name, "NBD writes: the file system takes them without blocking; through the ring");
                }
                return Some(n as i32);
            }
            // Refused: this very write is done here if that is what the
            // answer decided (not one hand-off to a worker).
            if path.refused(len) != Route::Blocking {
                return None;
            }
            if changed {
                tracing::debug!(export = %w.export.name, up_to = INLINE_MAX, "NBD writes: the file system blocks on them; on the ring thread");
            }
        }
        if len > STAMP_MAX && w.large_out {
            return None;
        }
        // A ring path's time stamp is written here even then: through the
        // ring it would take the turn's writes to the workers with it, and
        // here it costs the ring what an RWF_NOWAIT write through the ring
        // does (that one is written in the ring's own system call too).
        if w.offload && !path.through_ring() {
            w.export.stats.offloaded_writes.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            return None;
        }
        let snapshot = match self.snapshot {
            Some(s) if s.turn == now => s,
            _ => *self.snapshot.insert(Snapshot::take(now)),
        };
        let t0 = Instant::now();
        let res = rustix::io::pwritev2(w.fd, &[IoSlice::new(w.data)], w.offset, ReadWriteFlags::empty());
        let took = t0.elapsed();
        if took > SLOW {
            let (slept, preempted) = snapshot.since(volring_sys::thread_voluntary_switches().ok(), volring_sys::thread_cpu_time());
            self.snapshot = Some(Snapshot::take(now));
            if path.blocking_done(took, slept, preempted, w.lone, now) {
                tracing::debug!(export = %w.export.name, took_us = took.as_micros() as u64, slept, preempted, "NBD writes: a blocking write slept or was preempted; through the ring for a while");
            }
        }
        w.export.stats.inline_writes.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        self.unflushed += 1;
        Some(res.map_or_else(|e| -e.raw_os_error(), |n| n as i32))
    }

    /// Whether the replies of the writes done here should leave now (every
    /// [`FLUSH_EVERY`] of them), so a burst does not hold its first back.
    pub(super) fn flush_due(&mut self) -> bool {
        if self.unflushed < FLUSH_EVERY {
            return false;
        }
        self.unflushed = 0;
        true
    }
}

/// Whether io_uring's workers may do request `r`'s writing, holding the
/// file's inode lock for as long as it takes: writes over [`STAMP_MAX`]
/// or durable ones (io_uring tries a large buffered one RWF_NOWAIT first),
/// and the zeroing and trimming `fallocate`s. Counted whatever the file's
/// mode, which only keeps more stamps off. (A small
/// write refused RWF_NOWAIT goes to a worker too, but it is short, and
/// counting those would keep the stamps that prevent them off.)
pub(super) fn in_workers(r: &Request) -> bool {
    match r.kind {
        cmd::WRITE => r.length > STAMP_MAX || r.has(cf::FUA),
        cmd::WRITE_ZEROES | cmd::TRIM => true,
        _ => false,
    }
}

#[cfg(test)]
#[path = "inline_tests.rs"]
mod tests;
