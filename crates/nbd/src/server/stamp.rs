//! When the kernel's coarse wall clock moves, as far as user space can
//! tell: the clock file times are stamped with.
//!
//! A buffered write moves the file's modification and change times to the
//! kernel's coarse clock (`CLOCK_REALTIME_COARSE`), which moves once per
//! scheduler tick. A write that would have to move them is refused
//! RWF_NOWAIT, on every file system (the kernel does not update times
//! without blocking), so io_uring hands it to a worker, which then holds
//! the inode's lock while it writes; every write the ring sends meanwhile
//! is refused too. On xfs 4 connections × QD8 sent one write in 14 to the
//! workers, in bursts of about 30 at every tick. The ring therefore does a
//! write blocking itself when the clock has moved since the file's last
//! stamp (`inline::WritePath`), and for that it has to know when the clock
//! moves:
//!
//! - the vDSO's copy of the coarse clock moves a little after the kernel's
//!   own: a loop that read it before every RWF_NOWAIT write was refused in
//!   about a third of the ticks while its copy still showed the old tick;
//! - the ring decides how a turn's writes go before it submits them, and a
//!   tick that comes in between finds them queued.
//!
//! So a reading also says whether the tick is near: from [`WINDOW`] before
//! it is due until the vDSO shows it. The tick's period and phase are
//! learnt from the readings, as the kernel does not publish them: the
//! smallest step between two coarse readings is the period, and the
//! smallest lead of the fine clock over the coarse one at the first reading
//! of a new coarse value is how far the coarse clock trails just after a
//! tick; the next tick is due a period after that. Both are learnt again
//! after [`RELEARN`] of coarse time, so a clock that was set or drifted is
//! followed.
//!
//! Since Linux 6.13 (multigrain time stamps on xfs, ext4, btrfs) the time
//! the kernel stamps with can also move within a tick: a file whose times
//! were read (`stat`) is stamped with a finer time when it next changes,
//! and that raises the coarse time every file is stamped with. A write
//! that then needs a stamp goes to a worker, as every one did before. A
//! wrong guess the other way costs a write done blocking on the ring
//! thread that needed no stamp.

/// How long before the tick is due a reading counts as near it: longer
/// than a busy loop turn of the ring (the time between deciding how a
/// write goes and submitting it: tens of µs at 4 connections × QD8; a
/// longer turn only lets the odd tick through to a worker). One write in
/// 20 at a 4 ms tick; a quarter of the period at most, for a fast tick.
pub(super) const WINDOW: u64 = 200_000;
/// Coarse time (ns) after which the period and the trail are learnt afresh.
pub(super) const RELEARN: u64 = 4_000_000_000;
/// The shortest step taken for a period: no kernel ticks faster than
/// 1000 Hz; a shorter step is a clock set forward.
pub(super) const MIN_PERIOD: u64 = 900_000;

/// The coarse clock now, and whether it may be about to move.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Reading {
    /// `CLOCK_REALTIME_COARSE` in ns as the vDSO shows it.
    pub coarse: u64,
    /// The kernel's own coarse clock may move before, or has moved
    /// already while, `coarse` shows the old tick.
    pub near_tick: bool,
}

/// What the readings taught about the tick. Pure: [`Ticks::observe`]
/// takes the clocks' values; [`Ticks::read`] reads them.
#[derive(Debug, Default, Clone)]
pub(super) struct Ticks {
    /// The last coarse value seen.
    last: u64,
    /// The smallest step seen between two coarse values: the tick.
    period: Option<u64>,
    /// The smallest lead of the fine clock over a new coarse value.
    trail: Option<u64>,
    /// The coarse value at which learning last began afresh.
    since: u64,
}

impl Ticks {
    /// Reads both clocks (from the vDSO where the clock source allows).
    pub(super) fn read(&mut self) -> Reading {
        let coarse = nanos(rustix::time::ClockId::RealtimeCoarse);
        let fine = nanos(rustix::time::ClockId::Realtime);
        self.observe(coarse, fine)
    }

    /// Learns from one reading of both clocks, in ns.
    pub(super) fn observe(&mut self, coarse: u64, fine: u64) -> Reading {
        let lead = fine.saturating_sub(coarse);
        if coarse != self.last {
            // A clock set backwards, or read across a step, teaches nothing.
            let forward = coarse > self.last && lead > 0;
            if !forward || coarse.saturating_sub(self.since) >= RELEARN {
                self.since = coarse;
                self.period = None;
                self.trail = None;
            }
            let step = coarse.saturating_sub(self.last);
            // A small step forward is a clock set, not a tick: its lead
            // says nothing about the trail either.
            if forward && (self.last == 0 || step >= MIN_PERIOD) {
                if self.last != 0 {
                    self.period = Some(self.period.map_or(step, |p| p.min(step)));
                }
                self.trail = Some(self.trail.map_or(lead, |t| t.min(lead)));
            }
            self.last = coarse;
        }
        let near_tick = match (self.period, self.trail) {
            (Some(period), Some(trail)) => lead.saturating_add(WINDOW.min(period / 4)) >= period.saturating_add(trail),
            _ => false,
        };
        Reading { coarse, near_tick }
    }
}

fn nanos(clock: rustix::time::ClockId) -> u64 {
    let t = rustix::time::clock_gettime(clock);
    (t.tv_sec as u64).wrapping_mul(1_000_000_000).wrapping_add(t.tv_nsec as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: u64 = 1_000_000;

    /// A 4 ms tick whose coarse clock trails the fine one by 1 ms just
    /// after each tick, read every 100 µs.
    fn run(ticks: &mut Ticks, from: u64, to: u64) -> Vec<(u64, Reading)> {
        (from..to)
            .step_by(100_000)
            .map(|fine| {
                let coarse = (fine - MS) / (4 * MS) * (4 * MS);
                (fine, ticks.observe(coarse, fine))
            })
            .collect()
    }

    #[test]
    fn nothing_is_near_before_the_tick_is_learnt() {
        let mut t = Ticks::default();
        assert!(!t.observe(4 * MS, 5 * MS).near_tick);
        assert!(!t.observe(4 * MS, 7 * MS).near_tick, "one coarse value: no period yet");
    }

    #[test]
    fn the_window_opens_before_the_tick_and_closes_when_the_vdso_shows_it() {
        let mut t = Ticks::default();
        run(&mut t, 1000 * MS, 1020 * MS);
        for (fine, r) in run(&mut t, 1020 * MS, 1040 * MS) {
            // Ticks at fine = 1 ms past each 4 ms multiple.
            let to_next = 4 * MS - (fine - MS) % (4 * MS);
            assert_eq!(r.near_tick, to_next <= WINDOW, "at {fine}: {to_next} ns to the tick");
        }
    }

    #[test]
    fn a_late_vdso_keeps_the_window_open() {
        let mut t = Ticks::default();
        run(&mut t, 1000 * MS, 1020 * MS);
        // Past the tick's time, the coarse copy still shows the old tick.
        let stale = t.observe(1016 * MS, 1021 * MS + 20_000);
        assert!(stale.near_tick);
        assert_eq!(stale.coarse, 1016 * MS);
        let shown = t.observe(1020 * MS, 1021 * MS + 30_000);
        assert!(!shown.near_tick);
    }

    #[test]
    fn a_clock_set_backwards_is_learnt_afresh() {
        let mut t = Ticks::default();
        run(&mut t, 1000 * MS, 1020 * MS);
        assert_eq!(t.period, Some(4 * MS));
        // Set back by a second: what was learnt is dropped, and learnt
        // again from the ticks after.
        let r = t.observe(15 * MS, 16 * MS + 100_000);
        assert_eq!((r.coarse, r.near_tick), (15 * MS, false));
        assert_eq!(t.period, None);
        let mut coarse = 19 * MS;
        for _ in 0..3 {
            t.observe(coarse, coarse + MS);
            coarse += 4 * MS;
        }
        assert_eq!((t.period, t.trail), (Some(4 * MS), Some(MS)));
        assert!(t.observe(coarse - 4 * MS, coarse + 900_000).near_tick);
    }

    #[test]
    fn a_small_step_forward_is_not_taken_for_the_period() {
        let mut t = Ticks::default();
        run(&mut t, 1000 * MS, 1020 * MS);
        // Set forward by 0.1 ms between two ticks.
        t.observe(1016 * MS + 100_000, 1016 * MS + 150_000);
        assert_eq!((t.period, t.trail), (Some(4 * MS), Some(MS)));
    }

    #[test]
    fn period_and_trail_are_learnt_afresh_after_relearn() {
        let mut t = Ticks::default();
        // A late first reading after each tick (1.5 ms behind)...
        let mut coarse = 4 * MS;
        while coarse < RELEARN {
            t.observe(coarse, coarse + 3 * MS / 2);
            coarse += 4 * MS;
        }
        assert_eq!(t.trail, Some(3 * MS / 2));
        // ...and then a prompt one: taken at once (the smallest)...
        t.observe(coarse, coarse + MS);
        assert_eq!(t.trail, Some(MS));
        // ...while a trail that grew is followed once RELEARN has passed.
        let end = coarse + RELEARN + 8 * MS;
        while coarse < end {
            coarse += 4 * MS;
            t.observe(coarse, coarse + 2 * MS);
        }
        assert_eq!((t.period, t.trail), (Some(4 * MS), Some(2 * MS)));
    }

    #[test]
    fn read_gives_the_coarse_clock() {
        let mut t = Ticks::default();
        let before = nanos(rustix::time::ClockId::RealtimeCoarse);
        let r = t.read();
        let after = nanos(rustix::time::ClockId::RealtimeCoarse);
        assert!(r.coarse > 0);
        // Unless the clock was set between the reads.
        if before <= after {
            assert!(before <= r.coarse && r.coarse <= after, "{before} {} {after}", r.coarse);
        }
    }
}
