//! Telling a remount from an attach or detach, with the two signals the
//! kernel gives: mountinfo's POLLPRI fires for every change of the table,
//! fanotify reports only attach and detach. So a POLLPRI that no fanotify
//! event pairs with is a remount (or another change fanotify is silent
//! about), and only then is the table re-read.
//!
//! The two signals arrive in either order, so each fanotify event is a credit
//! that a POLLPRI arriving within `grace` may spend, and a POLLPRI with no
//! credit waits up to `grace` for one. Credits expire after `grace` so that a
//! tree unmount (many events, one POLLPRI) cannot hide a remount that
//! follows later. A remount within `grace` of other changes can still be
//! paired wrongly; the periodic resync bounds that case.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

/// At most this many POLLPRIs wait for pairing; beyond it, resync anyway.
const MAX_WAITING: usize = 1024;

pub(super) struct RemountDetector {
    grace: Duration,
    credits: u64,
    credits_at: Instant,
    /// Arrival times of POLLPRIs still waiting for a credit, oldest first.
    waiting: VecDeque<Instant>,
}

/// What the caller must do after telling the detector something.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Verdict {
    Nothing,
    /// Call `expire` again after this long.
    CheckAfter(Duration),
    /// Re-read the table: a change went unexplained.
    Resync,
}

impl RemountDetector {
    pub(super) fn new(grace: Duration, now: Instant) -> Self {
        Self { grace, credits: 0, credits_at: now, waiting: VecDeque::new() }
    }

    fn live_credits(&mut self, now: Instant) -> u64 {
        if now.saturating_duration_since(self.credits_at) > self.grace {
            self.credits = 0;
        }
        self.credits
    }

    /// `n` fanotify mount events were handled at `now`.
    pub(super) fn fanotify(&mut self, n: u64, now: Instant) {
        let mut credits = self.live_credits(now) + n;
        while credits > 0 && self.waiting.pop_front().is_some() {
            credits -= 1;
        }
        self.credits = credits;
        self.credits_at = now;
    }

    /// mountinfo signalled a change at `now`.
    pub(super) fn table_changed(&mut self, now: Instant) -> Verdict {
        if self.live_credits(now) > 0 {
            self.credits -= 1;
            return Verdict::Nothing;
        }
        if self.waiting.len() >= MAX_WAITING {
            self.waiting.clear();
            return Verdict::Resync;
        }
        self.waiting.push_back(now);
        if self.waiting.len() == 1 {
            Verdict::CheckAfter(self.grace)
        } else {
            Verdict::Nothing
        }
    }

    /// The check timer fired at `now`.
    pub(super) fn expire(&mut self, now: Instant) -> Verdict {
        match self.waiting.front() {
            None => Verdict::Nothing,
            Some(&t) if now.saturating_duration_since(t) >= self.grace => {
                self.waiting.clear();
                Verdict::Resync
            }
            Some(&t) => Verdict::CheckAfter(self.grace - now.saturating_duration_since(t)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const G: Duration = Duration::from_millis(2);

    fn at(base: Instant, us: u64) -> Instant {
        base + Duration::from_micros(us)
    }

    #[test]
    fn pairs_in_either_order() {
        let t = Instant::now();
        let mut d = RemountDetector::new(G, t);
        // POLLPRI first, fanotify after.
        assert_eq!(d.table_changed(at(t, 0)), Verdict::CheckAfter(G));
        d.fanotify(1, at(t, 30));
        assert_eq!(d.expire(at(t, 2000)), Verdict::Nothing);
        // fanotify first, POLLPRI after.
        d.fanotify(1, at(t, 3000));
        assert_eq!(d.table_changed(at(t, 3040)), Verdict::Nothing);
        assert_eq!(d.expire(at(t, 6000)), Verdict::Nothing);
    }

    #[test]
    fn a_lone_pollpri_is_a_remount() {
        let t = Instant::now();
        let mut d = RemountDetector::new(G, t);
        d.fanotify(1, at(t, 0));
        assert_eq!(d.table_changed(at(t, 10)), Verdict::Nothing);
        // The remount: nothing pairs with it.
        assert_eq!(d.table_changed(at(t, 500)), Verdict::CheckAfter(G));
        assert_eq!(d.expire(at(t, 1500)), Verdict::CheckAfter(Duration::from_micros(1000)));
        assert_eq!(d.expire(at(t, 2500)), Verdict::Resync);
    }

    #[test]
    fn leftover_credits_expire() {
        let t = Instant::now();
        let mut d = RemountDetector::new(G, t);
        // A tree unmount: four events, one POLLPRI.
        d.fanotify(4, at(t, 0));
        assert_eq!(d.table_changed(at(t, 20)), Verdict::Nothing);
        // A remount 10 ms later must not spend the stale credits.
        assert_eq!(d.table_changed(at(t, 10_000)), Verdict::CheckAfter(G));
        assert_eq!(d.expire(at(t, 12_000)), Verdict::Resync);
    }

    #[test]
    fn a_storm_never_resyncs() {
        let t = Instant::now();
        let mut d = RemountDetector::new(G, t);
        let mut resyncs = 0;
        for i in 0..1000u64 {
            let base = i * 20;
            // Alternate orders, as the ring may see them.
            let v = if i % 2 == 0 {
                let v = d.table_changed(at(t, base));
                d.fanotify(1, at(t, base + 5));
                v
            } else {
                d.fanotify(1, at(t, base));
                d.table_changed(at(t, base + 5))
            };
            resyncs += (v == Verdict::Resync) as u32;
        }
        resyncs += (d.expire(at(t, 1_000_000)) == Verdict::Resync) as u32;
        assert_eq!(resyncs, 0);
    }
}
