//! Telling a remount from an attach or detach, with the two signals the
//! kernel gives: mountinfo's POLLPRI fires for every change of the table,
//! fanotify reports only attach and detach. So a POLLPRI that no fanotify
//! event pairs with is a remount (or another change fanotify is silent
//! about), and only then is the table re-read.
//!
//! The two signals arrive in either order, and a late ring thread (a loaded
//! node) can see them any time apart, so pairing does not count wall time
//! between them:
//! - A fanotify event is a credit. The kernel wakes mountinfo's pollers
//!   before it queues the fanotify event of the same change, so once the
//!   event is in hand its POLLPRI is at most one ring turn away. Credits
//!   left over ([`EXPIRE_TURNS`] ring turns with no POLLPRI to pay) expire,
//!   so that a tree unmount (many events, one POLLPRI) cannot hide a remount
//!   that follows later. The caller makes sure an idle ring still turns (a
//!   timer while credits are left; see [`RemountDetector::end_of_turn`]).
//! - A POLLPRI with no credit waits: after `grace` the caller reads what the
//!   fanotify fd holds (its event may be queued and not yet read) and only
//!   then asks [`RemountDetector::expire`], which resyncs if it is still
//!   unpaired.
//!
//! A remount coalesced with other changes into one POLLPRI can still be
//! paired wrongly; the periodic resync bounds that case.

use std::time::{Duration, Instant};

/// At most this many POLLPRIs wait for pairing; beyond it, resync anyway.
const MAX_WAITING: usize = 1024;

/// Ring turns a credit survives without a POLLPRI: the turn it came in and
/// the next one (where its own POLLPRI is, at the latest).
pub(super) const EXPIRE_TURNS: u32 = 2;

pub(super) struct RemountDetector {
    grace: Duration,
    credits: u64,
    /// Ring turns ended since credits last came or paid for a POLLPRI.
    idle_turns: u32,
    /// POLLPRIs still waiting for a credit.
    waiting: usize,
    /// When the oldest waiting POLLPRI arrived.
    waiting_since: Option<Instant>,
}

/// What the caller must do after telling the detector something.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Verdict {
    Nothing,
    /// Read the fanotify fd and call `expire` after this long.
    CheckAfter(Duration),
    /// Re-read the table: a change went unexplained.
    Resync,
}

impl RemountDetector {
    pub(super) fn new(grace: Duration) -> Self {
        Self { grace, credits: 0, idle_turns: 0, waiting: 0, waiting_since: None }
    }

    /// `n` fanotify mount events were read.
    pub(super) fn fanotify(&mut self, n: u64) {
        if n == 0 {
            return;
        }
        let paid = (self.waiting as u64).min(n);
        self.waiting -= paid as usize;
        if self.waiting == 0 {
            self.waiting_since = None;
        }
        self.credits += n - paid;
        self.idle_turns = 0;
    }

    /// mountinfo signalled a change at `now`.
    pub(super) fn table_changed(&mut self, now: Instant) -> Verdict {
        if self.credits > 0 {
            self.credits -= 1;
            self.idle_turns = 0;
            return Verdict::Nothing;
        }
        if self.waiting >= MAX_WAITING {
            self.waiting = 0;
            self.waiting_since = None;
            return Verdict::Resync;
        }
        self.waiting += 1;
        if self.waiting_since.is_none() {
            self.waiting_since = Some(now);
            Verdict::CheckAfter(self.grace)
        } else {
            Verdict::Nothing
        }
    }

    /// The ring finished a turn. True while credits are left: the caller
    /// then makes sure another turn comes (a timer), so they expire on an
    /// idle ring too.
    pub(super) fn end_of_turn(&mut self) -> bool {
        if self.credits == 0 {
            return false;
        }
        self.idle_turns += 1;
        if self.idle_turns >= EXPIRE_TURNS {
            self.credits = 0;
        }
        self.credits > 0
    }

    /// The check timer fired at `now`, and the caller has read what the
    /// fanotify fd held.
    pub(super) fn expire(&mut self, now: Instant) -> Verdict {
        match self.waiting_since {
            None => Verdict::Nothing,
            Some(t) if now.saturating_duration_since(t) >= self.grace => {
                self.waiting = 0;
                self.waiting_since = None;
                Verdict::Resync
            }
            Some(t) => Verdict::CheckAfter(self.grace - now.saturating_duration_since(t)),
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
        let mut d = RemountDetector::new(G);
        // POLLPRI first, fanotify after.
        assert_eq!(d.table_changed(at(t, 0)), Verdict::CheckAfter(G));
        d.fanotify(1);
        assert!(!d.end_of_turn());
        assert_eq!(d.expire(at(t, 2000)), Verdict::Nothing);
        // fanotify first, POLLPRI in the next turn.
        d.fanotify(1);
        assert!(d.end_of_turn());
        assert_eq!(d.table_changed(at(t, 3040)), Verdict::Nothing);
        assert!(!d.end_of_turn());
        assert_eq!(d.expire(at(t, 6000)), Verdict::Nothing);
    }

    #[test]
    fn a_lone_pollpri_is_a_remount() {
        let t = Instant::now();
        let mut d = RemountDetector::new(G);
        d.fanotify(1);
        assert_eq!(d.table_changed(at(t, 10)), Verdict::Nothing);
        d.end_of_turn();
        // The remount: nothing pairs with it.
        assert_eq!(d.table_changed(at(t, 500)), Verdict::CheckAfter(G));
        d.end_of_turn();
        assert_eq!(d.expire(at(t, 1500)), Verdict::CheckAfter(Duration::from_micros(1000)));
        assert_eq!(d.expire(at(t, 2500)), Verdict::Resync);
    }

    #[test]
    fn leftover_credits_expire_after_quiet_turns() {
        let t = Instant::now();
        let mut d = RemountDetector::new(G);
        // A tree unmount: four events, one POLLPRI.
        d.fanotify(4);
        assert_eq!(d.table_changed(at(t, 20)), Verdict::Nothing);
        assert!(d.end_of_turn(), "credits left: the caller keeps the ring turning");
        // The expiry timer's turn, with no POLLPRI.
        assert!(!d.end_of_turn());
        // A remount later must not spend the stale credits.
        assert_eq!(d.table_changed(at(t, 10_000)), Verdict::CheckAfter(G));
        assert_eq!(d.expire(at(t, 12_000)), Verdict::Resync);
    }

    /// The ring thread was descheduled for 50 ms between the fanotify read
    /// and the POLLPRI of the same change (one turn apart), and for 50 ms
    /// between a POLLPRI and the read of its event: neither is a remount.
    /// (The wall-clock detector resynced in both cases.)
    #[test]
    fn a_late_ring_thread_pairs_all_the_same() {
        let t = Instant::now();
        let mut d = RemountDetector::new(G);
        d.fanotify(1);
        d.end_of_turn();
        assert_eq!(d.table_changed(at(t, 50_000)), Verdict::Nothing);
        d.end_of_turn();
        assert_eq!(d.table_changed(at(t, 60_000)), Verdict::CheckAfter(G));
        d.end_of_turn();
        // The check fires 50 ms late; the caller reads the fanotify fd first.
        d.fanotify(1);
        assert_eq!(d.expire(at(t, 110_000)), Verdict::Nothing);
    }

    #[test]
    fn a_storm_never_resyncs() {
        let t = Instant::now();
        let mut d = RemountDetector::new(G);
        let mut resyncs = 0;
        for i in 0..1000u64 {
            // Alternate orders and turn boundaries, as the ring may see them,
            // with arbitrary gaps in wall time.
            let now = at(t, i * 5_000);
            let v = match i % 3 {
                0 => {
                    let v = d.table_changed(now);
                    d.fanotify(1);
                    v
                }
                1 => {
                    d.fanotify(1);
                    d.end_of_turn();
                    d.table_changed(now)
                }
                _ => {
                    let v = d.table_changed(now);
                    d.end_of_turn();
                    d.fanotify(1);
                    v
                }
            };
            d.end_of_turn();
            resyncs += (v == Verdict::Resync) as u32;
            resyncs += (d.expire(at(t, i * 5_000 + 4_000)) == Verdict::Resync) as u32;
        }
        assert_eq!(resyncs, 0);
    }
}
