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
//! directly (`direct`), the ring polls even with its own operations in
//! flight and after a large spell, for as long as the payload's bytes keep
//! coming, the window starting again at each arrival, for at most
//! [`MAX_STREAM_POLL`] at a time. A poll that ends without any completion
//! (a pause longer than the window, or the limit) is the last until a
//! payload received directly completes, and none is made once
//! [`STREAM_STALL`] passed without one completing (other connections'
//! completions may keep ending the polls early), so a client trickling a
//! payload or stopping halfway costs the ring a few polls, not a CPU.
//! Without it the ring and its client take turns: a client may have only
//! its send buffer (about 214 KiB here) in the socket, fills it in about
//! 20 µs while the sleeping ring is still being woken (an idle CPU of this
//! virtual machine takes about 20 µs to wake, as the ftrace of one run
//! showed), and sleeps; the ring drains it and sleeps; and each of the five
//! turns of a 1 MiB payload pays both wake-ups. Awake, the ring takes the
//! bytes as they come and the client never finds the socket full: pinned,
//! 1 MiB writes at queue depth 8 on xfs went from 4.36 to 7.27 GB/s (the
//! floor server: 5.88) at 0.95x the server CPU per write; unpinned the same
//! row gained 1.19x for 1.27x the CPU per write (docs/benchmarks.md,
//! fifteenth pass). A ring contended for its CPU does not poll here either.

use std::time::{Duration, Instant};

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
/// bytes come (a client trickling them would otherwise keep it going): a
/// poll that reaches it ends without a completion, so it is the last until
/// a payload completes.
pub(super) const MAX_STREAM_POLL: Duration = Duration::from_millis(1);

/// No poll for a payload once this long passed without a payload received
/// directly completing: a 1 MiB payload streams in within a fraction of a
/// millisecond, and a client that stopped halfway is not polled for while
/// other connections' completions keep ending the polls early.
pub(super) const STREAM_STALL: Duration = Duration::from_millis(5);

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
    /// without a completion: no such poll again until the count moves on.
    stream_missed: Option<u64>,
    /// That count as last seen, and when it was first seen at that value.
    stream_seen: Option<(u64, Instant)>,
}

impl IdlePoll {
    /// `window` zero: never poll.
    pub(super) fn new(window: Duration) -> Self {
        IdlePoll { window: window.min(MAX_WINDOW), armed: false, spell: 0, stream_missed: None, stream_seen: None }
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

    /// How long to poll, window after window while bytes keep coming (at
    /// most [`MAX_STREAM_POLL`] in all), before the sleep that comes at
    /// `now` when a large WRITE's payload is being received directly
    /// (`streaming`: the count of payloads received directly so far);
    /// never for a `contended` ring, with the poll off, after a poll that
    /// missed until a payload completes, or [`STREAM_STALL`] after the last
    /// one did. The last spell's size and gap do not matter: the payload's
    /// next bytes are on their way.
    pub(super) fn stream_window(&mut self, streaming: Option<u64>, contended: bool, now: Instant) -> Option<Duration> {
        let done = streaming?;
        let since = match self.stream_seen {
            Some((seen, since)) if seen == done => since,
            _ => {
                self.stream_seen = Some((done, now));
                now
            }
        };
        let stalled = now.saturating_duration_since(since) > STREAM_STALL;
        let missed = self.stream_missed == Some(done);
        (!missed && !stalled && !contended && !self.window.is_zero()).then_some(self.window.min(MAX_STREAM_POLL))
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
        let now = Instant::now();
        let mut p = IdlePoll::new(50 * US);
        p.ended(2_000_000 * US);
        p.moved(1 << 20);
        assert_eq!(p.window(false), None, "a long gap and a large spell: the idle rule sleeps");
        assert_eq!(p.stream_window(Some(0), false, now), Some(50 * US), "but a payload still coming is polled for");
        assert_eq!(p.stream_window(None, false, now), None, "nothing on its way: the idle rule decides");
        assert_eq!(p.stream_window(Some(0), true, now), None, "a contended ring never polls");
        assert_eq!(IdlePoll::new(Duration::ZERO).stream_window(Some(0), false, now), None, "the poll is off");
        let mut long = IdlePoll::new(MAX_WINDOW);
        assert_eq!(long.stream_window(Some(0), false, now), Some(MAX_STREAM_POLL), "a window past the limit is cut to it");
    }

    #[test]
    fn a_poll_that_missed_its_payload_is_the_last_until_one_completes() {
        let now = Instant::now();
        let mut p = IdlePoll::new(50 * US);
        p.stream_polled(Some(3), true);
        assert_eq!(p.stream_window(Some(3), false, now), Some(50 * US), "a poll that ended in a completion: poll again");
        p.stream_polled(Some(3), false);
        assert_eq!(p.stream_window(Some(3), false, now), None, "a pause or a trickle: sleep through the rest");
        p.ended(10 * US);
        assert_eq!(p.stream_window(Some(3), false, now), None, "however the ring woke");
        assert_eq!(p.stream_window(Some(4), false, now), Some(50 * US), "a payload completed: the next one is polled for");
        assert_eq!(p.stream_window(None, false, now), None);
    }

    #[test]
    fn a_payload_that_stalls_is_not_polled_for_while_other_work_ends_the_polls() {
        let start = Instant::now();
        let mut p = IdlePoll::new(50 * US);
        assert!(p.stream_window(Some(7), false, start).is_some());
        p.stream_polled(Some(7), true);
        let later = start + STREAM_STALL;
        assert!(p.stream_window(Some(7), false, later).is_some(), "up to the mark, polls that found other work go on");
        let past = later + US;
        assert_eq!(p.stream_window(Some(7), false, past), None, "no payload completed for that long: sleep");
        assert!(p.stream_window(Some(8), false, past).is_some(), "one completed: poll again");
        assert_eq!(p.stream_window(Some(8), false, past + STREAM_STALL + US), None, "measured from that completion");
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
