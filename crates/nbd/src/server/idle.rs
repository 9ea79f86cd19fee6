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
//!
//! A large WRITE's payload is the exception: while one is being received
//! directly (`direct`), the ring polls for as long as its bytes keep
//! coming, the window starting again at each arrival, for at most
//! [`STREAM_MOST`]. A poll that ends without the payload (a pause longer
//! than the window, or the limit) is the last until a payload received
//! directly is complete, so a client trickling a payload costs the ring
//! one such poll per payload, not a CPU. Without it the ring and its client take
//! turns: a client may have only its send buffer (about 214 KiB here) in
//! the socket, fills it in about 20 µs while the sleeping ring is still
//! being woken (an idle CPU of this virtual machine takes about 20 µs to
//! wake, as the ftrace of one run showed), and sleeps; the ring drains it
//! and sleeps; and each of the five turns of a 1 MiB payload pays both
//! wake-ups. Awake, the ring takes the bytes as they come and the client
//! never finds the socket full: 1 MiB writes at queue depth 8 went from
//! 4.1k to 7.2-7.5k a second against the floor server's 5.0k, for about
//! the same server CPU per write (docs/benchmarks.md, fifteenth pass). A
//! ring contended for its CPU does not poll here either.

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

/// The longest one poll during a large payload runs, however steadily its
/// bytes come (a client trickling them would otherwise keep it going):
/// past it the ring sleeps as any other, and polls again after its next
/// wake-up.
pub(super) const STREAM_MOST: Duration = Duration::from_millis(1);

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
    /// The count of payloads received directly when a poll for one ended
    /// without it: no such poll again until the count moves on.
    stream_missed: Option<u64>,
}

impl IdlePoll {
    /// `window` zero: never poll.
    pub(super) fn new(window: Duration) -> Self {
        IdlePoll { window: window.min(MAX_WINDOW), armed: false, spell: 0, stream_missed: None }
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

    /// How long to poll, window after window while bytes keep coming,
    /// before the sleep that comes now when a large WRITE's payload is
    /// being received directly (`streaming`: the count of payloads
    /// received directly so far); never for a `contended` ring, with the
    /// poll off, or after a poll that missed until a payload completes.
    /// The last spell's size and gap do not matter: the payload's next
    /// bytes are on their way.
    pub(super) fn stream_window(&self, streaming: Option<u64>, contended: bool) -> Option<Duration> {
        let missed = streaming.is_some() && streaming == self.stream_missed;
        (streaming.is_some() && !missed && !contended && !self.window.is_zero()).then_some(self.window)
    }

    /// A poll for a payload (`streaming` as for [`IdlePoll::stream_window`])
    /// ended; without a completion (`found` false) it was the last one
    /// until a payload completes.
    pub(super) fn stream_polled(&mut self, streaming: Option<u64>, found: bool) {
        if !found {
            self.stream_missed = streaming;
        }
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
    fn a_payload_on_its_way_is_polled_after_any_spell_or_gap() {
        let mut p = IdlePoll::new(50 * US);
        p.ended(2_000_000 * US);
        p.moved(1 << 20);
        assert_eq!(p.window(false), None, "a long gap and a large spell: the idle rule sleeps");
        assert_eq!(p.stream_window(Some(0), false), Some(50 * US), "but a payload still coming is polled for");
        assert_eq!(p.stream_window(None, false), None, "nothing on its way: the idle rule decides");
        assert_eq!(p.stream_window(Some(0), true), None, "a contended ring never polls");
        assert_eq!(IdlePoll::new(Duration::ZERO).stream_window(Some(0), false), None, "the poll is off");
    }

    #[test]
    fn a_poll_that_missed_its_payload_is_the_last_until_one_completes() {
        let mut p = IdlePoll::new(50 * US);
        p.stream_polled(Some(3), true);
        assert_eq!(p.stream_window(Some(3), false), Some(50 * US), "a poll that ended in a completion: poll again");
        p.stream_polled(Some(3), false);
        assert_eq!(p.stream_window(Some(3), false), None, "a pause or a trickle: sleep through the rest");
        p.ended(10 * US);
        assert_eq!(p.stream_window(Some(3), false), None, "however the ring woke");
        assert_eq!(p.stream_window(Some(4), false), Some(50 * US), "a payload completed: the next one is polled for");
        assert_eq!(p.stream_window(None, false), None);
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
