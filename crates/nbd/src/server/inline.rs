//! Buffered WRITEs done on the ring thread itself when the pool's file
//! system would otherwise make io_uring hand each one to a worker thread.
//!
//! io_uring completes a buffered write inline only when the file system
//! takes it without blocking (RWF_NOWAIT). xfs does; ext4 answers
//! EOPNOTSUPP, so io_uring passes every write to an io-wq worker — one
//! thread hand-off per write, and writes to one file served one after
//! another. For such a file a small write is cheaper as a plain blocking
//! `pwritev2` on the ring thread: it usually only copies into the page
//! cache. Per export and ring:
//!
//! - the first write is tried with RWF_NOWAIT; if the file system takes it,
//!   every write goes through the ring (where it completes inline anyway);
//! - if it answers EOPNOTSUPP, or EAGAIN [`PROBES`] times in a row and never
//!   succeeds, writes of at most [`INLINE_MAX`] are done blocking here;
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
//!   wants the CPU). The scheduler shares a contended CPU per thread: a ring
//!   doing every connection's writes itself gets one share, where a server
//!   with a thread per connection gets one per connection (4 connections ×
//!   QD8 writes under two CPU spinners: 0.24× nbdkit's throughput at the
//!   same CPU per write, benchmarks.md); io_uring's workers are threads of
//!   their own (1.35–1.7× the inline throughput there);
//! - FUA writes always go through the ring (a durable write waits on the
//!   device); replies are flushed every [`FLUSH_EVERY`] inline writes, so a
//!   burst does not hold its first replies back.
//!
//! Once writes go through the ring nothing is probed again: a file system
//! that takes RWF_NOWAIT writes has said it can, and io_uring itself hands
//! the odd write that would block to a worker.

use std::io::IoSlice;
use std::os::fd::BorrowedFd;
use std::time::{Duration, Instant};

use rustix::io::{Errno, ReadWriteFlags};

use crate::export::Export;
use crate::Error;

/// Largest write done blocking on the ring thread.
pub(super) const INLINE_MAX: u64 = 64 * 1024;
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
    /// The file system takes writes without blocking: io_uring does them.
    Ring,
    /// Small writes are done blocking on the ring thread.
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
    /// Writes routed inline since the file system last refused one.
    since_refusal: u32,
    /// Writes to route inline before trying RWF_NOWAIT again: as many as
    /// the probe's tries when it gives up, doubled by every refusal after,
    /// up to [`REPROBE_MAX`].
    gap: u32,
}

impl WritePath {
    pub(super) fn new(setting: InlineWrites) -> Self {
        let mode = match setting {
            InlineWrites::Auto => Mode::Probe { eagain: 0 },
            InlineWrites::Off => Mode::Ring,
        };
        WritePath { mode, since_refusal: 0, gap: FIRST_GAP }
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
            Mode::Ring | Mode::Backoff(_) => Route::Ring,
        }
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
    /// sleeping (the CPU is contended).
    pub(super) fn blocking_done(&mut self, took: Duration, slept: bool, preempted: bool, now: Instant) {
        if took > SLOW && (slept || preempted) {
            self.mode = Mode::Backoff(now + BACKOFF);
        }
    }

    /// Whether small writes are being done on the ring thread now.
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
}

impl RingInline {
    /// Does write `w` here if its export's write path says so: its result
    /// (bytes written or a negative errno); `None`: the caller submits it
    /// to the ring.
    pub(super) fn write(&mut self, path: &mut WritePath, w: InlineWrite<'_>, now: Instant) -> Option<i32> {
        let len = w.data.len() as u64;
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
                tracing::debug!(export = %w.export.name, "NBD writes: the file system blocks on them; small ones on the ring thread");
            }
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
            path.blocking_done(took, slept, preempted, now);
            if !path.inline_now() {
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_file_system_that_takes_nowait_writes_keeps_the_ring() {
        let now = Instant::now();
        let mut p = WritePath::new(InlineWrites::Auto);
        assert_eq!(p.route(4096, false, now), Route::Nowait);
        p.nowait_done(Ok(4096));
        assert_eq!(p.route(4096, false, now), Route::Ring);
        // Later answers of a nowait write change nothing once decided.
        p.nowait_done(Err(Errno::OPNOTSUPP));
        assert_eq!(p.route(4096, false, now), Route::Ring);
    }

    #[test]
    fn eopnotsupp_makes_small_writes_inline_and_large_or_fua_ones_ring() {
        let now = Instant::now();
        let mut p = WritePath::new(InlineWrites::Auto);
        // FUA writes never probe.
        assert_eq!(p.route(4096, true, now), Route::Ring);
        assert_eq!(p.route(1 << 20, false, now), Route::Nowait);
        p.nowait_done(Err(Errno::OPNOTSUPP));
        assert!(p.inline_now());
        assert_eq!(p.route(4096, false, now), Route::Blocking);
        assert_eq!(p.route(INLINE_MAX, false, now), Route::Blocking);
        assert_eq!(p.route(INLINE_MAX + 1, false, now), Route::Ring);
        assert_eq!(p.route(4096, true, now), Route::Ring);
    }

    #[test]
    fn eagain_every_time_gives_up_after_the_probes() {
        let now = Instant::now();
        let mut p = WritePath::new(InlineWrites::Auto);
        for _ in 0..PROBES - 1 {
            assert_eq!(p.route(4096, false, now), Route::Nowait);
            p.nowait_done(Err(Errno::AGAIN));
        }
        // An error that says nothing about blocking does not count.
        p.nowait_done(Err(Errno::NOSPC));
        assert_eq!(p.route(4096, false, now), Route::Nowait);
        p.nowait_done(Err(Errno::AGAIN));
        assert_eq!(p.route(4096, false, now), Route::Blocking);
    }

    #[test]
    fn a_streak_as_long_as_a_client_queue_keeps_the_ring() {
        // A loaded xfs refuses every write in flight while one of them
        // waits (4 connections x QD8: 32): none is done blocking here, and
        // the first write it takes keeps the ring for good.
        let mut p = WritePath::new(InlineWrites::Auto);
        let (tries, blocking, ring, _) = drive(&mut p, 32, |_| Err(Errno::AGAIN));
        assert_eq!((tries, blocking, ring), (32, 0, 32));
        assert!(!p.inline_now());
        let (_, blocking, _, _) = drive(&mut p, 1000, |i| if i % 10 == 0 { Err(Errno::AGAIN) } else { Ok(4096) });
        assert_eq!(blocking, 0);
        assert_eq!(p.route(4096, false, Instant::now()), Route::Ring);
    }

    #[test]
    fn a_success_after_eagains_keeps_the_ring() {
        let now = Instant::now();
        let mut p = WritePath::new(InlineWrites::Auto);
        p.nowait_done(Err(Errno::AGAIN));
        p.nowait_done(Err(Errno::AGAIN));
        p.nowait_done(Ok(512));
        assert_eq!(p.route(4096, false, now), Route::Ring);
    }

    #[test]
    fn a_slow_write_that_slept_backs_off_for_a_while() {
        let now = Instant::now();
        let mut p = WritePath::new(InlineWrites::Auto);
        p.nowait_done(Err(Errno::OPNOTSUPP));
        // Slow without sleeping and on the CPU (a long copy): stays inline.
        p.blocking_done(SLOW * 5, false, false, now);
        assert_eq!(p.route(4096, false, now), Route::Blocking);
        // Slept but fast: stays inline.
        p.blocking_done(SLOW / 2, true, false, now);
        assert_eq!(p.route(4096, false, now), Route::Blocking);
        // Slow and slept: the ring until the backoff ends, then inline again.
        p.blocking_done(SLOW * 2, true, false, now);
        assert!(!p.inline_now());
        assert_eq!(p.route(4096, false, now), Route::Ring);
        assert_eq!(p.route(4096, false, now + BACKOFF / 2), Route::Ring);
        assert_eq!(p.route(4096, false, now + BACKOFF), Route::Blocking);
        assert!(p.inline_now());
    }

    /// A ring thread preempted in the middle of its inline writes (a
    /// contended CPU) hands them to io_uring's workers for a while: more
    /// threads get more of a contended CPU than one does.
    #[test]
    fn a_slow_write_that_was_preempted_backs_off_for_a_while() {
        let now = Instant::now();
        let mut p = WritePath::new(InlineWrites::Auto);
        p.nowait_done(Err(Errno::OPNOTSUPP));
        // Preempted but fast: stays inline.
        p.blocking_done(SLOW / 2, false, true, now);
        assert_eq!(p.route(4096, false, now), Route::Blocking);
        p.blocking_done(SLOW * 2, false, true, now);
        assert!(!p.inline_now());
        assert_eq!(p.route(4096, false, now + BACKOFF / 2), Route::Ring);
        assert_eq!(p.route(4096, false, now + BACKOFF), Route::Blocking);
    }

    /// Off the CPU without a voluntary switch is preemption; with one, it
    /// is a sleep; on the CPU the whole time, neither.
    #[test]
    fn the_snapshot_tells_preemption_from_sleep() {
        let now = Instant::now();
        let s = Snapshot { turn: now, switches: Some(10), wall: now - SLOW * 3, cpu: Duration::from_millis(5) };
        // 3 ms or more of wall time, 0.5 ms of it on the CPU, no switch: preempted.
        assert_eq!(s.since(Some(10), Duration::from_micros(5_500)), (false, true));
        // The same with a voluntary switch: slept.
        assert_eq!(s.since(Some(11), Duration::from_micros(5_500)), (true, false));
        // On the CPU the whole time (a long copy): neither.
        assert_eq!(s.since(Some(10), Duration::from_secs(3600)), (false, false));
        // Switches unreadable: counted as a sleep, as before.
        assert_eq!(s.since(None, Duration::from_secs(3600)), (true, false));
    }

    #[test]
    fn off_never_probes_nor_inlines() {
        let now = Instant::now();
        let mut p = WritePath::new(InlineWrites::Off);
        assert_eq!(p.route(4096, false, now), Route::Ring);
        p.nowait_done(Err(Errno::OPNOTSUPP));
        assert_eq!(p.route(4096, false, now), Route::Ring);
        assert_eq!("auto".parse::<InlineWrites>().ok(), Some(InlineWrites::Auto));
        assert_eq!("off".parse::<InlineWrites>().ok(), Some(InlineWrites::Off));
        assert!("on".parse::<InlineWrites>().is_err());
    }

    /// Routes `writes` 4 KiB writes through `p` with the file system
    /// answering `answer` to each RWF_NOWAIT try; counts (tries, blocking,
    /// ring) and says after which write the path first went to the ring.
    fn drive(p: &mut WritePath, writes: u32, answer: impl Fn(u32) -> Result<usize, Errno>) -> (u32, u32, u32, Option<u32>) {
        let now = Instant::now();
        let (mut tries, mut blocking, mut ring, mut to_ring) = (0, 0, 0, None);
        for i in 0..writes {
            let route = match p.route(4096, false, now) {
                Route::Nowait => {
                    tries += 1;
                    let res = answer(i);
                    p.nowait_done(res);
                    if res.is_ok() {
                        continue;
                    }
                    p.refused(4096)
                }
                route => route,
            };
            match route {
                Route::Blocking => blocking += 1,
                Route::Ring => {
                    ring += 1;
                    to_ring.get_or_insert(i);
                }
                Route::Nowait => unreachable!("refused() never asks again"),
            }
        }
        (tries, blocking, ring, to_ring)
    }

    #[test]
    fn a_passing_eagain_streak_is_undone_at_the_next_try() {
        let mut p = WritePath::new(InlineWrites::Auto);
        // Loaded: the probe gives up, every refused write done here.
        let (tries, blocking, ring, _) = drive(&mut p, PROBES as u32, |_| Err(Errno::AGAIN));
        assert_eq!((tries, blocking, ring), (PROBES as u32, 1, PROBES as u32 - 1));
        assert!(p.inline_now());
        // The load is gone: after the first gap they go through the ring
        // again, and stay.
        let (tries, blocking, _, to_ring) = drive(&mut p, 100, |_| Ok(4096));
        assert_eq!((tries, blocking, to_ring), (1, FIRST_GAP, Some(FIRST_GAP + 1)));
        assert!(!p.inline_now());
        assert_eq!(p.route(4096, false, Instant::now()), Route::Ring);
    }

    #[test]
    fn a_late_success_is_found_within_reprobe_max_writes() {
        let mut p = WritePath::new(InlineWrites::Auto);
        // Long refused (ext4's answer), so the tries are as far apart as they get.
        drive(&mut p, 50 * REPROBE_MAX, |_| Err(Errno::OPNOTSUPP));
        assert_eq!(p.gap, REPROBE_MAX);
        // Then the file system takes them (the export's file moved, a kernel
        // that takes them): the ring again after at most REPROBE_MAX writes.
        let (tries, blocking, _, to_ring) = drive(&mut p, 3 * REPROBE_MAX, |_| Ok(4096));
        assert_eq!(tries, 1);
        assert!(blocking <= REPROBE_MAX, "{blocking} writes blocking before the next try");
        assert_eq!(to_ring, Some(blocking + 1));
    }

    #[test]
    fn a_file_system_that_never_takes_them_is_tried_rarely_but_for_ever() {
        let writes = 1_000_000;
        for refusal in [Errno::OPNOTSUPP, Errno::AGAIN] {
            let mut p = WritePath::new(InlineWrites::Auto);
            let (tries, blocking, ring, _) = drive(&mut p, writes, |_| Err(refusal));
            // Every write but the first few EAGAINs is done here, the
            // refused tries included: none is handed to a worker.
            assert_eq!(ring, if refusal == Errno::AGAIN { PROBES as u32 - 1 } else { 0 }, "{refusal:?}");
            assert_eq!(blocking + ring, writes);
            // Past the probe, at most 0.1% of writes pay a refused syscall...
            let probe = if refusal == Errno::AGAIN { PROBES as u32 } else { 1 };
            assert!((tries - probe) * 1000 <= writes, "{refusal:?}: {tries} tries in {writes} writes");
            // ...and the question is still asked once per REPROBE_MAX writes.
            assert!(tries >= writes / (REPROBE_MAX + 1), "{refusal:?}: {tries} tries in {writes} writes");
        }
    }

    #[test]
    fn the_gap_between_tries_doubles_up_to_the_cap() {
        let mut p = WritePath::new(InlineWrites::Auto);
        let now = Instant::now();
        assert_eq!(p.route(4096, false, now), Route::Nowait);
        p.nowait_done(Err(Errno::OPNOTSUPP));
        let mut gaps = Vec::new();
        let mut since = 0;
        for _ in 0..5 * REPROBE_MAX {
            match p.route(4096, false, now) {
                Route::Blocking => since += 1,
                Route::Nowait => {
                    gaps.push(since);
                    since = 0;
                    p.nowait_done(Err(Errno::OPNOTSUPP));
                }
                Route::Ring => panic!("a small write refused is done here"),
            }
        }
        assert_eq!(&gaps[..10], &[8, 16, 32, 64, 128, 256, 512, 1024, 1024, 1024]);
    }

    #[test]
    fn an_unanswered_try_is_asked_again_and_fua_writes_do_not_count() {
        let mut p = WritePath::new(InlineWrites::Auto);
        let now = Instant::now();
        p.nowait_done(Err(Errno::OPNOTSUPP));
        assert_eq!(p.route(4096, false, now), Route::Blocking);
        // FUA writes go through the ring and leave the count alone.
        for _ in 0..10 {
            assert_eq!(p.route(4096, true, now), Route::Ring);
        }
        for _ in 1..FIRST_GAP {
            assert_eq!(p.route(4096, false, now), Route::Blocking);
        }
        assert_eq!(p.route(4096, false, now), Route::Nowait);
        // The try never ran (no buffer, say): the next write tries.
        assert_eq!(p.route(1 << 20, false, now), Route::Nowait);
        // An error that says nothing about blocking waits longer too (no
        // file system failing every write is asked on every write)...
        p.nowait_done(Err(Errno::IO));
        assert!(p.inline_now());
        assert_eq!(p.gap, 2 * FIRST_GAP);
        // ...and a large write refused still goes through the ring.
        assert_eq!(p.refused(1 << 20), Route::Ring);
        assert_eq!(p.refused(4096), Route::Blocking);
    }

    #[test]
    fn no_tries_during_a_backoff() {
        let mut p = WritePath::new(InlineWrites::Auto);
        let now = Instant::now();
        p.nowait_done(Err(Errno::OPNOTSUPP));
        assert_eq!(p.route(4096, false, now), Route::Blocking);
        p.blocking_done(SLOW * 2, true, false, now);
        for _ in 0..10 {
            assert_eq!(p.route(4096, false, now), Route::Ring);
        }
        // After it, the count goes on where it was.
        for _ in 1..FIRST_GAP {
            assert_eq!(p.route(4096, false, now + BACKOFF), Route::Blocking);
        }
        assert_eq!(p.route(4096, false, now + BACKOFF), Route::Nowait);
        p.nowait_done(Ok(4096));
        assert_eq!(p.route(4096, false, now + BACKOFF), Route::Ring);
    }
}
