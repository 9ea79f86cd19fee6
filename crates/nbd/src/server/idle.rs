//! Whether a quiet ring polls for a moment before it sleeps.
//!
//! A ring with nothing to do sleeps in `io_uring_enter`, and the next
//! request wakes it. Where an idle CPU halts, as on a virtual machine, that
//! wake-up costs more than serving a cached 4 KiB read: with one client at
//! queue depth 1, reads went from 14.4-15.0k to 18.2-21.5k IOPS when an
//! idle-class spinner merely kept the ring's CPU awake (docs/benchmarks.md).
//! So after a short idle gap, one a stream of requests leaves between a
//! reply and the next request, the ring polls for up to the window before
//! it sleeps. A gap longer than the window (the client paused, or there is
//! none) stops the polling until a short gap is seen again, so an idle
//! ring costs nothing. A ring contended for its CPU (a starved 20 ms
//! window, `starve`) never polls, because its polling would take CPU time
//! from whatever it shares the CPU with (a ring boosted for being starved,
//! `weight`, polls again once its windows are served);
//! nor does one waiting for its own operations rather than for a request,
//! nor one whose last busy spell moved more than [`SMALL_SPELL`] through
//! its sockets: against a 1 MiB request the wake-up is noise, and a ring
//! that polled between 1 MiB reads at queue depth 8 spent 1.87x the CPU
//! per read for the same throughput (the client's copying set the pace).

use std::time::Duration;

/// The default window: a little longer than the gap a client at queue
/// depth 1 leaves on this kind of machine (30-40 µs between a reply and the
/// next request), so a stream stays polled and a pause ends it at once.
pub(super) const DEFAULT_WINDOW: Duration = Duration::from_micros(50);

/// Socket bytes of a busy spell (from one idle gap to the next) up to
/// which the next gap may be polled: a few small requests and replies.
pub(super) const SMALL_SPELL: u64 = 256 << 10;

/// The longest window a ring takes (longer ones are cut to it).
const MAX_WINDOW: Duration = Duration::from_millis(10);

/// Operations a server ring always has in flight beside its receives and
/// accepts: the mailbox's poll and the tick.
const ALWAYS_ARMED: usize = 2;

/// Whether a ring with `in_flight` operations, `armed_recvs` of them
/// receives and `accepts` of them accepts, waits only on its clients:
/// anything more is its own work (a send the client drains, a file
/// operation, a splice), which it need not poll for.
pub(super) fn waits_on_clients(in_flight: usize, armed_recvs: usize, accepts: usize) -> bool {
    in_flight <= armed_recvs + accepts + ALWAYS_ARMED
}

/// A ring's polling rule; see the module docs.
#[derive(Debug)]
pub(super) struct IdlePoll {
    window: Duration,
    /// The last idle gap was no longer than the window.
    armed: bool,
    /// Socket bytes moved since the last idle gap ended.
    spell: u64,
}

impl IdlePoll {
    /// `window` zero: never poll.
    pub(super) fn new(window: Duration) -> Self {
        IdlePoll { window: window.min(MAX_WINDOW), armed: false, spell: 0 }
    }

    /// A completion moved `bytes` through a client's socket.
    pub(super) fn moved(&mut self, bytes: u64) {
        self.spell = self.spell.saturating_add(bytes);
    }

    /// Whether this ring ever polls (a window of zero: never).
    pub(super) fn enabled(&self) -> bool {
        !self.window.is_zero()
    }

    /// How long to poll before the sleep that comes now, if at all.
    /// `held_back`: the ring waits for its CPU (its polling would take CPU
    /// time from whoever shares it), or for its own operations rather than
    /// its clients (a send the client drains at its own pace).
    pub(super) fn window(&self, held_back: bool) -> Option<Duration> {
        (self.armed && !held_back && self.spell <= SMALL_SPELL && !self.window.is_zero()).then_some(self.window)
    }

    /// An idle gap ended after `gap` (the poll and the sleep together): a
    /// busy spell begins.
    pub(super) fn ended(&mut self, gap: Duration) {
        self.armed = gap <= self.window;
        self.spell = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const US: Duration = Duration::from_micros(1);

    #[test]
    fn a_quiet_ring_sleeps_until_a_short_gap_is_seen() {
        let mut p = IdlePoll::new(50 * US);
        assert_eq!(p.window(false), None, "no gap seen yet: sleep");
        p.ended(2_000_000 * US);
        assert_eq!(p.window(false), None, "after a long gap: sleep");
        p.ended(35 * US);
        assert_eq!(p.window(false), Some(50 * US), "a stream's gap: poll");
        p.ended(50 * US);
        assert_eq!(p.window(false), Some(50 * US), "a gap of the whole window still counts");
    }

    #[test]
    fn a_pause_longer_than_the_window_stops_the_polling() {
        let mut p = IdlePoll::new(50 * US);
        p.ended(30 * US);
        assert!(p.window(false).is_some());
        // The poll ran out and the ring slept: the gap was the window and more.
        p.ended(51 * US);
        assert_eq!(p.window(false), None);
    }

    #[test]
    fn a_spell_of_large_requests_is_not_polled_after() {
        let mut p = IdlePoll::new(50 * US);
        p.ended(20 * US);
        p.moved(4096 + 16);
        p.moved(32);
        assert_eq!(p.window(false), Some(50 * US), "a 4 KiB read and its request");
        p.moved(1 << 20);
        assert_eq!(p.window(false), None, "a 1 MiB reply: the wake-up is noise against it");
        p.ended(20 * US);
        assert_eq!(p.window(false), Some(50 * US), "each spell is weighed on its own");
        p.moved(SMALL_SPELL);
        assert!(p.window(false).is_some(), "up to the mark is small");
    }

    #[test]
    fn only_receives_accepts_the_mailbox_and_the_tick_are_waiting_on_clients() {
        assert!(waits_on_clients(2, 0, 0), "a ring with no connection");
        assert!(waits_on_clients(5, 2, 1), "ring 0 with two idle connections");
        assert!(!waits_on_clients(6, 2, 1), "and one send or file operation of its own");
        assert!(!waits_on_clients(3, 0, 0), "a connection's payload receive is not a multishot one");
    }

    #[test]
    fn a_window_past_the_longest_is_cut_to_it() {
        let mut p = IdlePoll::new(Duration::from_secs(3600));
        p.ended(Duration::ZERO);
        assert_eq!(p.window(false), Some(MAX_WINDOW));
    }

    #[test]
    fn a_held_back_ring_or_a_zero_window_never_polls() {
        let mut p = IdlePoll::new(50 * US);
        p.ended(10 * US);
        assert_eq!(p.window(true), None, "contended, or waiting for its own operations");
        assert_eq!(p.window(false), Some(50 * US), "held back once, armed still");
        let mut off = IdlePoll::new(Duration::ZERO);
        off.ended(Duration::ZERO);
        assert_eq!(off.window(false), None);
    }
}
