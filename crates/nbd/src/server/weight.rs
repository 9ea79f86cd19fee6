//! A ring thread's scheduler weight follows the connections it serves.
//!
//! The scheduler shares a contended CPU per runnable thread. A server with
//! a thread per connection (nbdkit, the bench's floor) gets one share per
//! busy connection; a ring carrying four busy connections got one share for
//! all four. Under two CPU spinners it served 4 connections × QD8 random
//! reads at 0.67-0.77× nbdkit's rate, and every request of the four waited
//! behind the ring's tick-long wake-ups (docs/benchmarks.md, issue 30).
//! With the ring thread reniced by hand to the weight of four threads the
//! same rows ran at 1.14-1.26× nbdkit (reads) and 1.13-1.36× (writes), at
//! a lower CPU cost per request than at nice 0 (the ring batched again).
//!
//! So each tick a ring counts its busy connections (those that sent
//! anything since the last tick) and asks for the weight of that many
//! threads: it lowers its nice, from the one it started with, by the level
//! whose weight is the largest not above `busy × 1024` ([`nice_for`], at
//! most 10 levels). A busy connection whose client had at least [`DEEP`]
//! requests in one receive since the last tick counts as two threads
//! ([`threads_for`]): a server with a pool of threads per connection
//! (nbdkit's default is 16) runs several at once for such a client. One
//! connection × QD32 4 KiB writes under two CPU spinners ran level with
//! nbdkit (0.91-1.08× by round) with the ring at one thread's weight, and
//! at 1.29-1.37× with it reniced by hand to two threads' (nice -3;
//! docs/benchmarks.md). (Large WRITEs received directly are not counted:
//! a deep client of those counts as one thread.)
//!
//! That is no more CPU than a thread-per-connection server takes for the
//! same clients (two per deep one, where nbdkit's pool may run sixteen),
//! and inside a cgroup (a pod) nice only divides the cgroup's own share
//! among its threads, so tenants in other cgroups lose nothing to it. On an
//! idle CPU the weight changes nothing.
//!
//! A ring starved of CPU asks for more than that: a boost of
//! [`MAX_BOOST`] threads' worth on top of its busy connections ([`Boost`]),
//! taken at once on a starved tick (`starve::Served`, or a starved spell of
//! 20 ms windows), held while it waits more than a tenth of the time, and
//! dropped after [`CALM_TICKS`] ticks in a row in which it waited less.
//! Under steady contention it is held until its connections go quiet (at
//! nice -10 the QD1 ring still waited about 15 % of the time: between).
//! All or nothing, because a boost given back a thread a tick settled a
//! level short (nice -9 after one calm tick) where a QD1 ring served 21k
//! writes against 36k at -10 in the same set. So a starved
//! ring takes more than a thread-per-connection server's share; like the
//! rest of the rule, only against threads of its own cgroup.
//!
//! Why: `perf sched` of QD1 writes under two pinned spinners: at nice 0 the
//! ring waited more than 0.5 ms 355 times in 2 s, 761 ms in all, about 2 ms
//! each (a spinner runs on until the next tick); at nice -10, 7 times and
//! 16.5 ms. Our reading, not a trace of the scheduler: a thread that
//! serves every request of a client runs a little and sleeps a little, and
//! wakes still owing for its last run (EEVDF keeps that lag across a short
//! sleep), so it may not preempt a spinner; a thread of nbdkit's pool has
//! slept through fifteen requests. At once, because a boost doubled tick by
//! tick took a second to come, and in the bench's rounds of 3 s (a ring
//! quiet between its rounds drops its boost) xfs QD1 writes stayed at
//! 0.79x nbdkit. With it the bench's QD1 rows under two spinners ran at
//! 1.22-1.79x nbdkit, where the build before this pass ran at 0.52-1.01x
//! in the same run (docs/benchmarks.md, twelfth pass). A ring is judged
//! starved only when it waits for its CPU; a quiet ring (no busy
//! connection) drops the boost at once.
//!
//! Lowering a thread's nice needs CAP_SYS_NICE (or an RLIMIT_NICE that
//! allows it): a refused level is tried one higher, and the ring remembers
//! the lowest it was allowed.

use std::io;

use super::starve::Served;

/// The kernel's load weight of nice levels 0 down to -10
/// (`sched_prio_to_weight` in kernel/sched/core.c); nice 0 is 1024, and
/// each level is about 1.25× the one above it.
const WEIGHTS: [u32; 11] = [1024, 1277, 1586, 1991, 2501, 3121, 3906, 4904, 6100, 7620, 9548];

/// The most a ring lowers its nice by (from nice 0: the weight of about
/// nine threads). A ring busier than that is better split into more rings
/// (`threads`).
pub(super) const LOWEST_NICE: i32 = -10;

/// The nice whose weight is the largest not above `busy` threads' worth
/// (0 for none or one).
pub(super) fn nice_for(busy: usize) -> i32 {
    let target = (busy as u64).saturating_mul(1024);
    let level = WEIGHTS.iter().rposition(|&w| u64::from(w) <= target).unwrap_or(0);
    (-(level as i32)).max(LOWEST_NICE)
}

/// Requests one receive must carry for its connection to count as two
/// threads: a client that keeps this many in flight at once.
pub(super) const DEEP: u16 = 4;

/// The threads' worth of one connection at a tick: none unless it was
/// active since the last one; two if its client had at least [`DEEP`]
/// requests in one receive meanwhile (`depth`).
pub(super) fn threads_for(active: bool, depth: u16) -> usize {
    match (active, depth >= DEEP) {
        (false, _) => 0,
        (true, false) => 1,
        (true, true) => 2,
    }
}

/// The threads' worth a starved ring adds to its busy connections': with
/// one connection, the weight of [`LOWEST_NICE`].
pub(super) const MAX_BOOST: usize = 9;

/// Well-served ticks in a row after which a boosted ring drops its boost
/// (a second at the default tick).
pub(super) const CALM_TICKS: u8 = 4;

/// A ring's extra weight for being starved of CPU (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Boost {
    Off,
    /// Since a starved tick; `calm`: well-served ticks in a row since.
    On {
        calm: u8,
    },
}

impl Boost {
    /// The boost after a tick with `busy` connections, served `served`.
    fn after(self, busy: usize, served: Served) -> Boost {
        match (self, busy, served) {
            (_, 0, _) => Boost::Off,
            (_, _, Served::Starved) => Boost::On { calm: 0 },
            (Boost::On { calm }, _, Served::Well) if calm + 1 >= CALM_TICKS => Boost::Off,
            (Boost::On { calm }, _, Served::Well) => Boost::On { calm: calm + 1 },
            (Boost::On { .. }, _, Served::Between) => Boost::On { calm: 0 },
            (Boost::Off, _, _) => Boost::Off,
        }
    }

    /// Threads' worth it adds.
    fn threads(self) -> usize {
        match self {
            Boost::Off => 0,
            Boost::On { .. } => MAX_BOOST,
        }
    }
}

/// The lowest nice Linux has.
const MIN_NICE: i32 = -20;

/// Where a ring's weight stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Weight {
    /// The rule is off: the thread keeps `base`, the nice it started with.
    Off { base: i32 },
    /// The ring follows its busy connections down from `base`, the nice it
    /// started with (an agent run under `nice` keeps its place): `now` is
    /// the nice it set last, `floor` the lowest the system has allowed so
    /// far. A refusal raises the floor, so an RLIMIT_NICE that allows a few
    /// levels is used within its range, and going back up (which needs no
    /// privilege) always works. `boost`: threads' worth added while the
    /// ring is starved of CPU (see the module docs).
    Following { base: i32, now: i32, floor: i32, boost: Boost },
}

impl Weight {
    pub(super) fn new(on: bool, base: i32) -> Self {
        if on {
            Weight::Following { base, now: base, floor: MIN_NICE, boost: Boost::Off }
        } else {
            Weight::Off { base }
        }
    }

    /// The nice the ring thread runs at, as far as this rule knows (what
    /// `/metrics` shows as `volring_nbd_ring_nice`).
    pub(super) fn nice(self) -> i32 {
        match self {
            Weight::Off { base } => base,
            Weight::Following { now, .. } => now,
        }
    }

    /// Follows `busy` connections, and how the ring was `served` by its
    /// CPU since the last tick, on the calling thread (the ring's own);
    /// `set` is the system call, a parameter so the rule is testable. A
    /// refused level is tried one higher, up to where the ring is now.
    pub(super) fn follow(&mut self, busy: usize, served: Served, mut set: impl FnMut(i32) -> io::Result<()>) {
        let Weight::Following { base, now, floor, boost } = self else { return };
        *boost = boost.after(busy, served);
        let mut want = (*base + nice_for(busy + boost.threads())).max(*floor).max(MIN_NICE);
        while want != *now {
            match set(want) {
                Ok(()) => *now = want,
                Err(e) if want < *now => {
                    if *floor == MIN_NICE {
                        tracing::info!(
                            error = %e,
                            nice = want,
                            "NBD ring cannot take the full weight it asks for (needs CAP_SYS_NICE); it goes as low as allowed"
                        );
                    }
                    *floor = want + 1;
                    want += 1;
                }
                Err(e) => {
                    tracing::warn!(error = %e, nice = want, "NBD ring cannot raise its nice back");
                    return;
                }
            }
        }
    }
}

/// The calling thread's own nice (where its ring's weight starts from).
pub(super) fn own_nice() -> i32 {
    rustix::process::getpriority_process(Some(rustix::thread::gettid())).unwrap_or(0)
}

/// Sets the calling ring thread's nice, and its io_uring workers' (Linux's
/// setpriority applies to one thread when given its id).
///
/// The workers do the ring's blocking file operations for the same
/// connections (a write the file system would block on, a read offloaded
/// while the ring is starved), so they take its weight too. A worker starts
/// with the nice of the ring at that moment, but one started earlier keeps
/// its own: with only the ring reniced, 4 × QD8 writes under two spinners
/// stayed at 0.85× nbdkit, while a ring reniced before its workers started
/// ran them at 1.10-1.20×. A worker that exits meanwhile is skipped.
pub(super) fn set_own_nice(nice: i32) -> io::Result<()> {
    let me = rustix::thread::gettid();
    rustix::process::setpriority_process(Some(me), nice)?;
    let worker = format!("iou-wrk-{}\n", me.as_raw_nonzero());
    // The ring's own nice is set: a scan that fails changes nothing of it.
    let tasks = match std::fs::read_dir("/proc/self/task") {
        Ok(tasks) => tasks,
        Err(e) => {
            tracing::debug!(error = %e, "NBD ring cannot list its io_uring workers to renice them");
            return Ok(());
        }
    };
    for task in tasks.flatten() {
        let is_worker = std::fs::read_to_string(task.path().join("comm")).is_ok_and(|c| c == worker);
        let tid = task.file_name().to_str().and_then(|t| t.parse().ok()).and_then(rustix::process::Pid::from_raw);
        if let (true, Some(tid)) = (is_worker, tid) {
            let _ = rustix::process::setpriority_process(Some(tid), nice);
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_weight_is_as_many_threads_as_busy_connections_and_never_more() {
        assert_eq!(nice_for(0), 0);
        assert_eq!(nice_for(1), 0);
        // 2 threads = 2048: nice -3 (1991); -4 (2501) would be more.
        assert_eq!(nice_for(2), -3);
        assert_eq!(nice_for(3), -4);
        assert_eq!(nice_for(4), -6);
        assert_eq!(nice_for(8), -9);
        assert_eq!(nice_for(10), LOWEST_NICE);
        assert_eq!(nice_for(10_000), LOWEST_NICE);
        for busy in 1..12usize {
            let level = (-nice_for(busy)) as usize;
            assert!(u64::from(WEIGHTS[level]) <= busy as u64 * 1024, "{busy} connections");
        }
    }

    /// A connection is worth a thread when active, two when its client
    /// keeps at least DEEP requests in flight; one deep connection gives a
    /// ring two threads' weight.
    #[test]
    fn a_deep_connection_counts_as_two_threads() {
        assert_eq!(threads_for(false, 100), 0);
        assert_eq!(threads_for(true, 0), 1);
        assert_eq!(threads_for(true, DEEP - 1), 1);
        assert_eq!(threads_for(true, DEEP), 2);
        assert_eq!(nice_for(threads_for(true, 32)), -3);
    }

    #[test]
    fn a_ring_sets_its_nice_only_when_it_changes() {
        let mut calls = Vec::new();
        let mut w = Weight::new(true, 0);
        for busy in [1, 4, 4, 2, 0] {
            w.follow(busy, Served::Well, |n| {
                calls.push(n);
                Ok(())
            });
        }
        assert_eq!(calls, [-6, -3, 0]);
        assert_eq!(w.nice(), 0);
        w.follow(3, Served::Well, |_| Ok(()));
        assert_eq!(w.nice(), -4);

        let mut off = Weight::new(false, 5);
        off.follow(8, Served::Well, |_| panic!("the rule is off"));
        assert_eq!(off.nice(), 5);
    }

    /// An agent started under `nice 10` keeps its place: the weight is
    /// counted from there, and a quiet ring goes back there.
    #[test]
    fn the_weight_counts_from_the_nice_the_ring_started_with() {
        let mut w = Weight::new(true, 10);
        w.follow(4, Served::Well, |n| if n == 4 { Ok(()) } else { panic!("set {n}") });
        assert_eq!(w.nice(), 4);
        w.follow(0, Served::Well, |n| if n == 10 { Ok(()) } else { panic!("set {n}") });
        assert_eq!(w.nice(), 10);
        // Never below Linux's lowest.
        let mut low = Weight::new(true, -15);
        low.follow(8, Served::Well, |_| Ok(()));
        assert_eq!(low.nice(), MIN_NICE);
    }

    /// An RLIMIT_NICE that allows down to -4: the ring goes as low as
    /// that, comes back to 0 when quiet, and goes to -4 again at once.
    #[test]
    fn a_refused_level_is_tried_higher_and_the_ring_still_comes_back() {
        let allowed = |n: i32| if n >= -4 { Ok(()) } else { Err(io::Error::from_raw_os_error(libc::EACCES)) };
        let mut tried = Vec::new();
        let mut w = Weight::new(true, 0);
        w.follow(8, Served::Well, |n| {
            tried.push(n);
            allowed(n)
        });
        assert_eq!(tried, [-9, -8, -7, -6, -5, -4]);
        assert_eq!(w, Weight::Following { base: 0, now: -4, floor: -4, boost: Boost::Off });
        w.follow(0, Served::Well, allowed);
        assert_eq!(w.nice(), 0);
        let mut tried = Vec::new();
        w.follow(4, Served::Well, |n| {
            tried.push(n);
            allowed(n)
        });
        assert_eq!((tried, w.nice()), (vec![-4], -4));
        // No privilege at all: the ring stays where it started.
        let mut none = Weight::new(true, 0);
        none.follow(8, Served::Well, |n| if n < 0 { Err(io::Error::from_raw_os_error(libc::EPERM)) } else { Ok(()) });
        assert_eq!(none, Weight::Following { base: 0, now: 0, floor: 0, boost: Boost::Off });
        none.follow(8, Served::Well, |_| panic!("asked below its floor"));
    }

    /// A starved tick takes the whole boost (one QD1 connection: nice -10);
    /// a tick between holds it and restarts the calm count; CALM_TICKS
    /// well-served ticks in a row drop it; a ring with no busy connection
    /// drops it at once. On a machine where the ring is never starved the
    /// boost never starts.
    #[test]
    fn a_starved_ring_takes_the_boost_and_drops_it_after_a_calm_second() {
        /// The nice after each tick of `ticks` (busy connections, service).
        fn nices(w: &mut Weight, ticks: &[(usize, Served)]) -> Vec<i32> {
            ticks
                .iter()
                .map(|&(busy, served)| {
                    w.follow(busy, served, |_| Ok(()));
                    w.nice()
                })
                .collect()
        }
        let (starved, between, well) = ((1, Served::Starved), (1, Served::Between), (1, Served::Well));
        let mut w = Weight::new(true, 0);
        assert_eq!(nices(&mut w, &[starved]), [LOWEST_NICE]);
        assert_eq!(w, Weight::Following { base: 0, now: LOWEST_NICE, floor: MIN_NICE, boost: Boost::On { calm: 0 } });
        assert_eq!(nices(&mut w, &[well, well, well, between, well, well, well]), [LOWEST_NICE; 7], "a tick between restarts the count");
        assert_eq!(nices(&mut w, &[well]), [0], "the fourth calm tick in a row drops it");
        assert_eq!(nices(&mut w, &[starved, well, well, starved, well, well, well]), [LOWEST_NICE; 7], "a starved tick restarts the count");
        assert_eq!(nices(&mut w, &[well]), [0]);
        assert_eq!(nices(&mut w, &[well, between]), [0, 0], "off stays off until starved");
        assert_eq!(nices(&mut w, &[starved, (0, Served::Starved), well]), [LOWEST_NICE, 0, 0], "no busy connection: no boost");
        let mut quiet = Weight::new(true, 0);
        for _ in 0..10 {
            quiet.follow(4, Served::Well, |_| Ok(()));
        }
        assert_eq!(quiet.nice(), -6, "never starved: busy connections' weight only");
    }
}
