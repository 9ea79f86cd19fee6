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
//! - A POLLPRI with no credit is decided at the end of the ring turn it
//!   came in: the caller reads what the fanotify fd holds (its event is
//!   queued by then, or is still in a read the ring has in flight, whose
//!   completion the check then waits for) and asks
//!   [`RemountDetector::decide`], which resyncs if it is still unpaired.
//!   Waiting longer only lets a remounted mount go before it is read: a
//!   mount remounted read-only and unmounted 1-2 ms later was reported
//!   `rw` in most rounds while the check waited 2 ms (issue 27).
//! - A POLLPRI paid by a credit carried from an earlier turn may be that
//!   event's own late POLLPRI, or a later change that came as the credit
//!   was left over (signals coalesce: an umount and a move read together,
//!   one POLLPRI). Its verdict asks the caller to read the mounts its
//!   events read lately once more, which shows a remount right after the
//!   mount (issue 27's `mount; mount -o remount,ro`).
//!
//! A remount of another mount coalesced with other changes into one
//! POLLPRI can still be paired wrongly; the periodic resync bounds that
//! case.

/// At most this many POLLPRIs wait for pairing; beyond it, resync anyway.
const MAX_WAITING: usize = 1024;

/// Ring turns a credit survives without a POLLPRI: the turn it came in and
/// the next one (where its own POLLPRI is, at the latest).
pub(super) const EXPIRE_TURNS: u32 = 2;

pub(super) struct RemountDetector {
    /// Credits of events read in this ring turn.
    fresh: u64,
    /// Credits of events read in earlier turns.
    carried: u64,
    /// Ring turns ended since credits last came or paid for a POLLPRI.
    idle_turns: u32,
    /// POLLPRIs still waiting for a credit.
    waiting: usize,
}

/// What the caller must do after telling the detector something.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Verdict {
    Nothing,
    /// At the end of this ring turn, read what the fanotify fd holds and
    /// then call `decide`.
    Check,
    /// Paid by an event read in an earlier turn: the POLLPRI may be a later
    /// change of a mount read then (a remount right after its mount). At
    /// the end of this turn, read the mounts attached lately again.
    Recheck,
    /// Re-read the table: a change went unexplained.
    Resync,
}

impl RemountDetector {
    pub(super) fn new() -> Self {
        Self { fresh: 0, carried: 0, idle_turns: 0, waiting: 0 }
    }

    /// `n` fanotify mount events were read.
    pub(super) fn fanotify(&mut self, n: u64) {
        if n == 0 {
            return;
        }
        let paid = (self.waiting as u64).min(n);
        self.waiting -= paid as usize;
        self.fresh += n - paid;
        self.idle_turns = 0;
    }

    /// mountinfo signalled a change. A credit carried from an earlier turn
    /// pays first: its event's own POLLPRI, late, is the likelier, and if
    /// it is a remount instead, the mount that event read is read again.
    pub(super) fn table_changed(&mut self) -> Verdict {
        if self.carried > 0 {
            self.carried -= 1;
            self.idle_turns = 0;
            return Verdict::Recheck;
        }
        if self.fresh > 0 {
            self.fresh -= 1;
            self.idle_turns = 0;
            return Verdict::Nothing;
        }
        if self.waiting >= MAX_WAITING {
            self.waiting = 0;
            return Verdict::Resync;
        }
        self.waiting += 1;
        Verdict::Check
    }

    /// POLLPRIs are waiting for a credit (a check is due).
    pub(super) fn waiting(&self) -> bool {
        self.waiting > 0
    }

    /// The ring finished a turn. True while credits are left: the caller
    /// then makes sure another turn comes (a timer), so they expire on an
    /// idle ring too.
    pub(super) fn end_of_turn(&mut self) -> bool {
        self.carried += std::mem::take(&mut self.fresh);
        if self.carried == 0 {
            return false;
        }
        self.idle_turns += 1;
        if self.idle_turns >= EXPIRE_TURNS {
            self.carried = 0;
        }
        self.carried > 0
    }

    /// The caller has read what the fanotify fd held: a POLLPRI still
    /// unpaired is a change fanotify does not report.
    pub(super) fn decide(&mut self) -> Verdict {
        if std::mem::take(&mut self.waiting) > 0 {
            Verdict::Resync
        } else {
            Verdict::Nothing
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pairs_in_either_order() {
        let mut d = RemountDetector::new();
        // POLLPRI first; its event is read by the check at the end of the turn.
        assert_eq!(d.table_changed(), Verdict::Check);
        d.fanotify(1);
        assert_eq!(d.decide(), Verdict::Nothing);
        assert!(!d.end_of_turn());
        // fanotify and its POLLPRI in the same turn.
        d.fanotify(1);
        assert_eq!(d.table_changed(), Verdict::Nothing);
        assert!(!d.end_of_turn());
        // fanotify first, POLLPRI in the next turn: paired, and the mount
        // the event read is read again (the POLLPRI may be its remount).
        d.fanotify(1);
        assert!(d.end_of_turn());
        assert_eq!(d.table_changed(), Verdict::Recheck);
        assert!(!d.end_of_turn());
        assert_eq!(d.decide(), Verdict::Nothing);
    }

    /// Issue 27: a mount, read in one turn, remounted before its own POLLPRI
    /// (coalesced with an earlier one) came: the remount's POLLPRI is paid by
    /// the leftover credit, and only a second read of the mount shows it.
    #[test]
    fn a_credit_from_an_earlier_turn_asks_for_a_second_look() {
        let mut d = RemountDetector::new();
        // Two events (an umount and a move), one POLLPRI for both.
        assert_eq!(d.table_changed(), Verdict::Check);
        d.fanotify(2);
        assert_eq!(d.decide(), Verdict::Nothing);
        d.end_of_turn();
        // The next mount: its POLLPRI is paid by the leftover credit.
        assert_eq!(d.table_changed(), Verdict::Recheck);
        d.fanotify(1);
        d.end_of_turn();
        // Its remount: paid by the mount's own credit, read a turn ago.
        assert_eq!(d.table_changed(), Verdict::Recheck);
        // A credit of this turn pays without a second look (its mount is
        // read after the POLLPRI), but an older one is spent first.
        d.fanotify(1);
        assert_eq!(d.table_changed(), Verdict::Nothing);
        d.fanotify(1);
        d.end_of_turn();
        d.fanotify(1);
        assert_eq!(d.table_changed(), Verdict::Recheck);
        assert_eq!(d.table_changed(), Verdict::Nothing);
    }

    #[test]
    fn a_lone_pollpri_is_a_remount() {
        let mut d = RemountDetector::new();
        d.fanotify(1);
        assert_eq!(d.table_changed(), Verdict::Nothing);
        d.end_of_turn();
        // The remount: nothing pairs with it, and the fanotify fd is empty.
        assert_eq!(d.table_changed(), Verdict::Check);
        assert!(d.waiting());
        assert_eq!(d.decide(), Verdict::Resync);
        assert!(!d.waiting());
        assert_eq!(d.decide(), Verdict::Nothing, "decided once");
    }

    #[test]
    fn leftover_credits_expire_after_quiet_turns() {
        let mut d = RemountDetector::new();
        // A tree unmount: four events, one POLLPRI.
        d.fanotify(4);
        assert_eq!(d.table_changed(), Verdict::Nothing);
        assert!(d.end_of_turn(), "credits left: the caller keeps the ring turning");
        // The expiry timer's turn, with no POLLPRI.
        assert!(!d.end_of_turn());
        // A remount later must not spend the stale credits.
        assert_eq!(d.table_changed(), Verdict::Check);
        assert_eq!(d.decide(), Verdict::Resync);
    }

    /// The ring thread was descheduled for a long time between the fanotify
    /// read and the POLLPRI of the same change (one turn apart), and between
    /// a POLLPRI and the read of its event: neither is a remount, as no
    /// wall time is counted.
    #[test]
    fn a_late_ring_thread_pairs_all_the_same() {
        let mut d = RemountDetector::new();
        d.fanotify(1);
        d.end_of_turn();
        assert_eq!(d.table_changed(), Verdict::Recheck);
        d.end_of_turn();
        assert_eq!(d.table_changed(), Verdict::Check);
        // The check reads the fanotify fd before it decides.
        d.fanotify(1);
        assert_eq!(d.decide(), Verdict::Nothing);
    }

    #[test]
    fn a_storm_never_resyncs() {
        let mut d = RemountDetector::new();
        let mut resyncs = 0;
        for i in 0..1000u64 {
            // Orders and turn boundaries as the ring may see them; a check
            // reads the fanotify fd (where the kernel has queued the event
            // by then) before it decides.
            let mut v = match i % 4 {
                0 => {
                    let v = d.table_changed();
                    d.fanotify(1);
                    v
                }
                1 => {
                    d.fanotify(1);
                    d.end_of_turn();
                    d.table_changed()
                }
                2 => {
                    // Two changes, one POLLPRI (coalesced), one read.
                    let v = d.table_changed();
                    d.fanotify(2);
                    v
                }
                _ => {
                    d.fanotify(1);
                    d.table_changed()
                }
            };
            if v == Verdict::Check {
                v = d.decide();
            }
            d.end_of_turn();
            resyncs += (v == Verdict::Resync) as u32;
        }
        assert_eq!(resyncs, 0);
    }
}
