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
//! anything in the last tick) and asks for the weight of that many
//! threads: the nice level whose weight is the largest not above
//! `busy × 1024`, never below [`LOWEST_NICE`]. That is no more CPU than a
//! thread-per-connection server takes for the same clients, and inside a
//! cgroup (a pod) nice only divides the cgroup's own share among its
//! threads, so tenants in other cgroups lose nothing to it. On an idle CPU
//! the weight changes nothing.
//!
//! Lowering a thread's nice needs CAP_SYS_NICE (or an RLIMIT_NICE that
//! allows it): a ring refused once keeps the nice it has and stops asking.

use std::io;

/// The kernel's load weight of nice levels 0 down to -10
/// (`sched_prio_to_weight` in kernel/sched/core.c); nice 0 is 1024, and
/// each level is about 1.25× the one above it.
const WEIGHTS: [u32; 11] = [1024, 1277, 1586, 1991, 2501, 3121, 3906, 4904, 6100, 7620, 9548];

/// The lowest nice a ring asks for: the weight of about nine threads. A
/// ring busier than that is better split into more rings (`threads`).
pub(super) const LOWEST_NICE: i32 = -10;

/// The nice whose weight is the largest not above `busy` threads' worth
/// (0 for none or one).
pub(super) fn nice_for(busy: usize) -> i32 {
    let target = (busy as u64).saturating_mul(1024);
    let level = WEIGHTS.iter().rposition(|&w| u64::from(w) <= target).unwrap_or(0);
    (-(level as i32)).max(LOWEST_NICE)
}

/// Where a ring's weight stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Weight {
    /// The rule is off: the thread keeps the nice it was started with.
    Off,
    /// The nice this ring set last (0 until it first raised it).
    Following(i32),
    /// The system refused a lower nice; the ring stays where it was.
    Refused(i32),
}

impl Weight {
    pub(super) fn new(on: bool) -> Self {
        if on {
            Weight::Following(0)
        } else {
            Weight::Off
        }
    }

    /// The nice the ring thread runs at, as far as this rule knows (what
    /// `/metrics` shows as `volring_nbd_ring_nice`).
    pub(super) fn nice(self) -> i32 {
        match self {
            Weight::Off => 0,
            Weight::Following(n) | Weight::Refused(n) => n,
        }
    }

    /// Follows `busy` connections on the calling thread (the ring's own);
    /// `set` is the system call, a parameter so the rule is testable.
    pub(super) fn follow(&mut self, busy: usize, set: impl FnOnce(i32) -> io::Result<()>) {
        let Weight::Following(now) = *self else { return };
        let want = nice_for(busy);
        if want == now {
            return;
        }
        match set(want) {
            Ok(()) => *self = Weight::Following(want),
            Err(e) => {
                tracing::info!(
                    error = %e,
                    nice = want,
                    "NBD ring cannot take the weight of its busy connections (needs CAP_SYS_NICE); it keeps its nice"
                );
                *self = Weight::Refused(now);
            }
        }
    }
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
    for task in std::fs::read_dir("/proc/self/task")?.flatten() {
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

    #[test]
    fn a_ring_sets_its_nice_only_when_it_changes_and_stops_after_a_refusal() {
        let mut calls = Vec::new();
        let mut w = Weight::new(true);
        for busy in [1, 4, 4, 2, 0] {
            w.follow(busy, |n| {
                calls.push(n);
                Ok(())
            });
        }
        assert_eq!(calls, [-6, -3, 0]);
        assert_eq!(w, Weight::Following(0));

        w.follow(4, |_| Err(io::Error::from_raw_os_error(libc::EACCES)));
        assert_eq!(w, Weight::Refused(0));
        w.follow(8, |_| panic!("asked again after a refusal"));
        assert_eq!(w, Weight::Refused(0));
        assert_eq!(w.nice(), 0);
        let mut w = Weight::new(true);
        w.follow(3, |_| Ok(()));
        assert_eq!(w.nice(), -4);

        let mut off = Weight::new(false);
        off.follow(8, |_| panic!("the rule is off"));
        assert_eq!(off, Weight::Off);
    }
}
