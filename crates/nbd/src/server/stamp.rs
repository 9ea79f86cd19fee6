//! When the kernel's coarse wall clock moves, as far as user space can
//! tell: the clock file times are stamped with.
//!
//! A buffered write moves the file's modification and change times to the
//! kernel's coarse clock (`CLOCK_REALTIME_COARSE`), which moves once per
//! scheduler tick. A write that would have to move them is refused
//! RWF_NOWAIT (on xfs the stamp is a logged change), so io_uring hands it
//! to a worker, which then holds the inode's lock while it writes; every
//! write the ring sends meanwhile is refused too. On xfs 4 connections ×
//! QD8 sent one write in 15 to the workers, in bursts of about 30 at every
//! tick. The ring therefore does a write blocking itself when the clock
//! has moved since the file's last stamp (`inline::WritePath`), and for
//! that it has to know when the clock moves:
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
//! every [`RELEARN`] ticks, so a clock that was set or drifted is followed.
//! A wrong guess costs only CPU: a write done blocking that needed no stamp,
//! or one handed to a worker as without this.

/// How long before the tick is due a reading counts as near it: longer
/// than a loop turn of the ring (the time between deciding how a write
/// goes and submitting it). One write in 20 at a 4 ms tick; a quarter of
/// the period at most, for a fast tick.
pub(super) const WINDOW: u64 = 200_000;
/// Ticks after which the period and the trail are learnt afresh.
pub(super) const RELEARN: u32 = 1024;

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
    /// New coarse values seen since the last relearning.
    seen: u32,
}

impl Ticks {
    /// Reads both clocks (from the vDSO: no system call).
    pub(super) fn read(&mut self) -> Reading {
        let coarse = nanos(rustix::time::ClockId::RealtimeCoarse);
        let fine = nanos(rustix::time::ClockId::Realtime);
        self.observe(coarse, fine)
    }

    /// Learns from one reading of both clocks, in ns.
    pub(super) fn observe(&mut self, coarse: u64, fine: u64) -> Reading {
        let lead = fine.saturating_sub(coarse);
        if coarse != self.last {
            self.seen += 1;
            if self.seen >= RELEARN {
                self.seen = 0;
                self.period = None;
                self.trail = None;
            }
            // A clock set backwards teaches nothing about the period.
            if self.last != 0 && coarse > self.last {
                let step = coarse - self.last;
                self.period = Some(self.period.map_or(step, |p| p.min(step)));
            }
            self.trail = Some(self.trail.map_or(lead, |t| t.min(lead)));
            self.last = coarse;
        }
        let near_tick = match (self.period, self.trail) {
            (Some(period), Some(trail)) => lead + WINDOW.min(period / 4) >= period + trail,
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
    fn a_clock_set_backwards_is_learnt_again() {
        let mut t = Ticks::default();
        run(&mut t, 1000 * MS, 1020 * MS);
        // Set back by a second: no step is learnt from it, and the
        // readings go on.
        let r = t.observe(15 * MS, 16 * MS + 100_000);
        assert_eq!(r.coarse, 15 * MS);
        assert_eq!(t.period, Some(4 * MS));
    }

    #[test]
    fn period_and_trail_are_learnt_afresh_every_relearn_ticks() {
        let mut t = Ticks::default();
        // A small step once (a clock set forward by 1 ms)...
        t.observe(4 * MS, 4 * MS + 500_000);
        t.observe(5 * MS, 5 * MS + 500_000);
        assert_eq!(t.period, Some(MS));
        // ...is forgotten after RELEARN ticks of 4 ms.
        let mut coarse = 8 * MS;
        for _ in 0..RELEARN {
            t.observe(coarse, coarse + MS);
            coarse += 4 * MS;
        }
        assert_eq!(t.period, Some(4 * MS));
        assert_eq!(t.trail, Some(MS));
    }

    #[test]
    fn read_gives_the_coarse_clock() {
        let mut t = Ticks::default();
        let r = t.read();
        let coarse = nanos(rustix::time::ClockId::RealtimeCoarse);
        assert!(r.coarse <= coarse && coarse - r.coarse < 1_000 * MS);
    }
}
