//! Whether a ring thread is starved of CPU, and so whether its page-cache
//! READs, and the WRITEs it would do blocking itself (`inline`), are
//! handed to io_uring's workers.
//!
//! A READ of a cached page completes inline in the ring thread's own
//! `io_uring_enter`: the copy is the ring's work, and the ring is one
//! thread. On a contended CPU the scheduler shares per runnable thread, so
//! the ring gets one share for all its connections where a server with a
//! thread per connection gets one per connection; and a woken ring waits
//! up to a tick (4 ms at HZ=250) behind a spinner (`perf sched`: over half
//! of a loaded run spent runnable but not running, benchmarks.md). There
//! the reads go with IOSQE_ASYNC: io_uring's workers are threads of their
//! own, each with its share, and the ring keeps parsing and replying.
//!
//! A quiet ring keeps its reads inline: a hand-off costs a worker wake-up
//! per read, and inline is what makes one ring cheap per op.
//!
//! The evidence is the thread's run delay, the second field of
//! `/proc/thread-self/schedstat`: time spent runnable but not running.
//! Every [`WINDOW`] of wall time the ring compares it with the wall time
//! and its own CPU time ([`starved`]); [`STREAK`] starved windows in a row
//! send reads to the workers for [`OFFLOAD_FOR`], then windows are judged
//! inline again. One starved window is not enough: on a quiet machine a
//! busy ring now and then waits a tick behind a kernel thread or its own
//! runtime, and each such hiccup cost a second of hand-offs (1.21-1.26x
//! the CPU per read at QD32 and 4 x QD8, benchmarks.md); contention
//! starves window after window.
//! Windows with reads offloaded are not judged: the workers run on the
//! same CPUs, and a ring that waited behind its own workers would keep
//! offloading after the contention had gone.
//!
//! Windows are judged with `off` too: the setting decides only where
//! reads go, and the idle poll (`idle`) asks [`ReadPath::contended`] as
//! well. When `off` stopped the judging, a contended ring polled: under two
//! CPU spinners its QD1 reads fell from 11.8k to 0.8k IOPS (benchmarks.md).
//! With `always` every read is offloaded, so no window is judged (as in a
//! starved spell): a ring that waited behind its own workers would count as
//! contended on an idle machine.

use std::fs::File;
use std::time::{Duration, Instant};

use crate::Error;

/// Wall time over which the run delay is judged.
pub(super) const WINDOW: Duration = Duration::from_millis(20);
/// How long reads go to the workers after [`STREAK`] starved windows.
pub(super) const OFFLOAD_FOR: Duration = Duration::from_secs(1);
/// Starved windows in a row that make contention rather than a hiccup.
pub(super) const STREAK: u32 = 3;
/// A window counts as starved when the ring waited for the CPU at least
/// this fraction (1/n) of its wall time...
const DELAY_SHARE: u32 = 5;
/// ...and at least half as long as it ran (a ring busy on its CPU that
/// waited a little is served well)...
const DELAY_PER_CPU: u32 = 2;
/// ...and at least this long: a window with one short wait is not
/// contention.
const MIN_DELAY: Duration = Duration::from_millis(2);
/// Requests in flight on the ring (the read included) below which a read
/// stays inline even when starved: the ring must wake for the reply of a
/// lone read anyway, so a worker only adds a hand-off to its latency (QD1
/// reads at load 3: 1.33x the CPU per read and p99 545 against 208 µs).
/// With more in flight, the workers copy while the ring parses and replies.
/// The same bound keeps a lone blocking write on the ring
/// ([`ReadPath::offload_writes`]).
pub(super) const MIN_IN_FLIGHT: usize = 4;

/// How many requests a ring serves at once, as far as a write it is about
/// to start can tell ([`ReadPath::offload_writes`]): the most of those in
/// its table (`in_table`, the write included), those it admitted in this
/// loop turn or the one before (`admitted`), and the most its client sent
/// in one receive since the tick before the ring's last (`depth`, the
/// connection's: see `weight::threads_for`). An inline write leaves the
/// table before the next request is admitted, so the table alone never
/// shows a deep client of inline writes; its receives do, and the turns
/// show several clients of one request each. A QD1 client shows as one
/// every way.
pub(super) fn at_once(in_table: usize, admitted: Admitted, depth: u16) -> usize {
    in_table.max(admitted.recent()).max(usize::from(depth))
}

/// Requests (those that take a slot in the ring's table) a ring admitted
/// in its current loop turn and in the one before: see [`at_once`].
#[derive(Debug, Default, Clone, Copy)]
pub(super) struct Admitted {
    now: usize,
    before: usize,
}

impl Admitted {
    /// A request was admitted in this turn.
    pub(super) fn admit(&mut self) {
        self.now += 1;
    }

    /// A new loop turn begins.
    pub(super) fn turn(&mut self) {
        self.before = std::mem::take(&mut self.now);
    }

    /// The most admitted in this turn or the one before.
    pub(super) fn recent(self) -> usize {
        self.now.max(self.before)
    }
}

/// Whether page-cache reads may be handed to io_uring's workers.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum OffloadReads {
    /// When the ring thread is starved of CPU (see the module docs).
    #[default]
    Auto,
    /// Never: every read of a cached page is done by the ring thread.
    Off,
    /// Always (for tests and measurements).
    Always,
}

impl std::str::FromStr for OffloadReads {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self, Error> {
        match s {
            "auto" => Ok(OffloadReads::Auto),
            "off" => Ok(OffloadReads::Off),
            "always" => Ok(OffloadReads::Always),
            _ => Err(Error::Setting { what: "NBD offload-reads mode", value: s.to_string(), why: "expected auto, off or always" }),
        }
    }
}

/// How a ring thread was served by its CPU over one tick: what its weight
/// follows (see `weight`), beside its busy connections.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Served {
    /// Starved ([`starved`]): it waited for its CPU a fifth of the time.
    Starved,
    /// Neither: what the weight asked for stays.
    Between,
    /// It waited less than a tenth of the time.
    Well,
}

impl Served {
    /// How a span of `wall` time was served in which the thread ran `cpu`
    /// and waited `delay` runnable but not running. The gap between a
    /// fifth and a tenth keeps a weight that just ended a starvation from
    /// being given back at once (and the starvation from coming back).
    pub(super) fn judge(wall: Duration, cpu: Duration, delay: Duration) -> Self {
        if starved(wall, cpu, delay) {
            Served::Starved
        } else if delay * 10 < wall {
            Served::Well
        } else {
            Served::Between
        }
    }
}

/// Whether a window of `wall` time in which the thread ran `cpu` and
/// waited `delay` runnable but not running was starved of CPU.
pub(super) fn starved(wall: Duration, cpu: Duration, delay: Duration) -> bool {
    delay >= MIN_DELAY && delay * DELAY_SHARE >= wall && delay * DELAY_PER_CPU >= cpu
}

/// The thread's CPU time and run delay from the text of its
/// `/proc/.../schedstat` ("cpu_ns delay_ns timeslices"); `None` if it is
/// not that.
pub(super) fn parse_schedstat(text: &[u8]) -> Option<(Duration, Duration)> {
    let text = std::str::from_utf8(text).ok()?;
    let mut fields = text.split_ascii_whitespace().map(|f| f.parse::<u64>().ok());
    let cpu = fields.next()??;
    let delay = fields.next()??;
    Some((Duration::from_nanos(cpu), Duration::from_nanos(delay)))
}

/// One sample of the thread's schedstat.
#[derive(Debug, Clone, Copy)]
struct Sample {
    at: Instant,
    cpu: Duration,
    delay: Duration,
}

/// A ring's read path: whether its page-cache reads go to the workers now.
#[derive(Debug)]
pub(super) struct ReadPath {
    setting: OffloadReads,
    /// The ring thread's own schedstat, opened on that thread (`None`:
    /// unreadable: reads stay inline and the ring never counts as contended).
    stat: Option<File>,
    /// The start of the window being judged (`None`: reads are offloaded,
    /// or nothing was read yet).
    window: Option<Sample>,
    /// Reads go to the workers until then.
    offload_until: Option<Instant>,
    /// Starved windows in a row so far (reset by a served one).
    streak: u32,
    /// Windows judged starved so far (diagnostics and tests).
    pub starved_windows: u64,
    /// The sample taken at the ring's last tick ([`ReadPath::served_since_tick`]).
    at_tick: Option<Sample>,
}

impl ReadPath {
    /// The read path of the calling thread (a ring thread, as it starts).
    pub(super) fn new(setting: OffloadReads) -> Self {
        let stat = File::open("/proc/thread-self/schedstat").ok();
        ReadPath { setting, stat, window: None, offload_until: None, streak: 0, starved_windows: 0, at_tick: None }
    }

    /// How the thread was served by its CPU since the last call (the
    /// ring's last tick); starved in a starved spell. `Between` when there
    /// is nothing to compare (the first call, or no schedstat) or every
    /// read goes to the workers.
    pub(super) fn served_since_tick(&mut self, now: Instant) -> Served {
        // With every read in the workers the ring waits behind its own
        // workers; that is not contention (as for the windows, above).
        if self.setting == OffloadReads::Always {
            return Served::Between;
        }
        let end = self.sample(now);
        match (std::mem::replace(&mut self.at_tick, end), end) {
            // A starved spell says so within the tick, where the tick's own
            // account may still hold quiet time; one starved window does not.
            _ if self.starved_spell() => Served::Starved,
            (Some(start), Some(end)) => Served::judge(
                end.at.saturating_duration_since(start.at),
                end.cpu.saturating_sub(start.cpu),
                end.delay.saturating_sub(start.delay),
            ),
            _ => Served::Between,
        }
    }

    fn sample(&self, now: Instant) -> Option<Sample> {
        let mut buf = [0u8; 96];
        let n = rustix::io::pread(self.stat.as_ref()?, &mut buf, 0).ok()?;
        let (cpu, delay) = parse_schedstat(&buf[..n])?;
        Some(Sample { at: now, cpu, delay })
    }

    /// A new loop turn at `now`: ends a window that is over.
    pub(super) fn turn(&mut self, now: Instant) {
        if self.setting == OffloadReads::Always || self.stat.is_none() {
            return;
        }
        if let Some(until) = self.offload_until {
            if now < until {
                return;
            }
            self.offload_until = None;
            self.window = None;
            self.streak = 0;
        }
        match self.window {
            None => self.window = self.sample(now),
            Some(start) if now.saturating_duration_since(start.at) >= WINDOW => {
                let Some(end) = self.sample(now) else { return };
                self.judge(start, end);
            }
            Some(_) => {}
        }
    }

    /// Judges the window from `start` to `end`.
    fn judge(&mut self, start: Sample, end: Sample) {
        let wall = end.at.saturating_duration_since(start.at);
        let (cpu, delay) = (end.cpu.saturating_sub(start.cpu), end.delay.saturating_sub(start.delay));
        if !starved(wall, cpu, delay) {
            self.streak = 0;
            self.window = Some(end);
            return;
        }
        self.starved_windows += 1;
        self.streak += 1;
        if self.streak < STREAK {
            self.window = Some(end);
            return;
        }
        self.streak = 0;
        self.offload_until = Some(end.at + OFFLOAD_FOR);
        self.window = None;
        tracing::debug!(
            wall_us = wall.as_micros() as u64,
            cpu_us = cpu.as_micros() as u64,
            delay_us = delay.as_micros() as u64,
            "NBD ring starved of CPU: page-cache reads to io_uring's workers for a while"
        );
    }

    /// Whether the thread has been starved of CPU lately: a starved window
    /// is being counted toward a streak, or a streak ended less than
    /// [`OFFLOAD_FOR`] ago (with `Auto`, reads are offloaded meanwhile).
    pub(super) fn contended(&self) -> bool {
        self.streak > 0 || self.offload_until.is_some()
    }

    /// Whether a streak of starved windows ended less than [`OFFLOAD_FOR`]
    /// ago: contention, not a hiccup (one starved window, which
    /// [`ReadPath::contended`] counts too). Large writes go to io_uring's
    /// workers meanwhile (`inline::InlineWrite::large_out`): after a mere
    /// hiccup, a pinned ring's own worker would starve the windows that
    /// follow and make one.
    pub(super) fn starved_spell(&self) -> bool {
        self.offload_until.is_some()
    }

    /// Whether a write the ring would do blocking itself goes to io_uring's
    /// workers now (`inline`): in a spell of being starved of CPU (a streak
    /// ended less than [`OFFLOAD_FOR`] ago), with `auto` or `off`, and with
    /// the ring serving at least [`MIN_IN_FLIGHT`] requests at once
    /// (`concurrent`, from [`at_once`]). A worker is a thread of
    /// its own, with its own share of the contended CPU, so it writes while
    /// the ring parses and replies for the others; a lone write gains no
    /// such overlap, and the worker adds a hand-off each way, as for a lone
    /// read. With `always` (or no schedstat) no window is judged, so never.
    pub(super) fn offload_writes(&self, concurrent: usize) -> bool {
        self.offload_until.is_some() && concurrent >= MIN_IN_FLIGHT
    }

    /// Whether the ring is in a spell of handing page-cache reads to
    /// io_uring's workers (`Auto`: starved lately; `Always`: always), as
    /// `/metrics` shows it. In a starved spell a lone read still stays
    /// inline (see [`MIN_IN_FLIGHT`]).
    pub(super) fn offloading(&self) -> bool {
        match self.setting {
            OffloadReads::Always => true,
            OffloadReads::Off => false,
            OffloadReads::Auto => self.offload_until.is_some(),
        }
    }

    /// Whether a page-cache read goes to io_uring's workers now, with
    /// `in_flight` requests on the ring (this one included).
    pub(super) fn offload(&self, in_flight: usize) -> bool {
        match self.setting {
            OffloadReads::Always => true,
            OffloadReads::Off => false,
            OffloadReads::Auto => self.offload_until.is_some() && in_flight >= MIN_IN_FLIGHT,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);

    #[test]
    fn the_loaded_ring_of_the_benchmark_is_starved() {
        // perf sched, 4 x QD8 reads under two spinners: in 2 s the ring ran
        // 436 ms and waited 1,034 ms runnable.
        assert!(starved(2000 * MS, 436 * MS, 1034 * MS));
        // One window of it: 20 ms, 4 ms run, 10 ms waited (a tick and more).
        assert!(starved(20 * MS, 4 * MS, 10 * MS));
    }

    #[test]
    fn a_quiet_or_busy_but_served_ring_is_not() {
        // Alone on its CPU: no wait.
        assert!(!starved(20 * MS, 15 * MS, Duration::ZERO));
        // Sharing a CPU with the client now and then: waits, but little.
        assert!(!starved(20 * MS, 12 * MS, 3 * MS));
        // Waited a fifth of the window but ran far longer than it waited.
        assert!(!starved(20 * MS, 16 * MS, 4 * MS));
        // One short wait in a short window is not contention.
        assert!(!starved(5 * MS, MS / 2, 3 * MS / 2));
        // Idle: nothing ran, nothing waited.
        assert!(!starved(20 * MS, Duration::ZERO, Duration::ZERO));
    }

    /// The loaded QD1 ring of the twelfth pass (perf sched: 1,104 ms of
    /// run delay in 2 s, 498 ms run) was starved; at nice -10 it waited
    /// 295 ms and ran 678 ms: between, so its weight stays; a quiet ring
    /// is served well.
    #[test]
    fn a_tick_is_starved_between_or_served_well() {
        assert_eq!(Served::judge(2000 * MS, 498 * MS, 1104 * MS), Served::Starved);
        assert_eq!(Served::judge(2000 * MS, 678 * MS, 295 * MS), Served::Between);
        assert_eq!(Served::judge(250 * MS, 100 * MS, 20 * MS), Served::Well);
        assert_eq!(Served::judge(250 * MS, Duration::ZERO, Duration::ZERO), Served::Well);
        // Waited a fifth, but ran far longer than it waited: not starved.
        assert_eq!(Served::judge(250 * MS, 200 * MS, 50 * MS), Served::Between);
    }

    #[test]
    fn schedstat_is_parsed_and_junk_is_refused() {
        assert_eq!(parse_schedstat(b"455797 6134131 2\n"), Some((Duration::from_nanos(455_797), Duration::from_nanos(6_134_131))));
        assert_eq!(parse_schedstat(b"455797\n"), None);
        assert_eq!(parse_schedstat(b"a b c"), None);
        assert_eq!(parse_schedstat(b"\xff\xfe"), None);
        assert_eq!(parse_schedstat(b""), None);
    }

    fn path_at(setting: OffloadReads) -> ReadPath {
        ReadPath { setting, stat: None, window: None, offload_until: None, streak: 0, starved_windows: 0, at_tick: None }
    }

    fn sample(at: Instant, cpu_ms: u64, delay_ms: u64) -> Sample {
        Sample { at, cpu: Duration::from_millis(cpu_ms), delay: Duration::from_millis(delay_ms) }
    }

    #[test]
    fn a_starved_window_offloads_for_a_while_then_is_judged_inline_again() {
        let t0 = Instant::now();
        let mut p = path_at(OffloadReads::Auto);
        assert!(!p.offload(MIN_IN_FLIGHT));
        // A quiet window keeps reads inline, and the next window starts there.
        p.judge(sample(t0, 0, 0), sample(t0 + 20 * MS, 15, 0));
        assert!(!p.offload(MIN_IN_FLIGHT));
        assert_eq!(p.window.map(|s| s.at), Some(t0 + 20 * MS));
        // STREAK starved ones in a row send them to the workers until
        // OFFLOAD_FOR has passed.
        let mut at = t0 + 20 * MS;
        for i in 0..STREAK as u64 {
            assert!(!p.offload(MIN_IN_FLIGHT), "offloaded after {i} starved windows");
            p.judge(sample(at, 15 + 4 * i, 10 * i), sample(at + 20 * MS, 19 + 4 * i, 10 + 10 * i));
            at += 20 * MS;
        }
        assert!(p.offload(MIN_IN_FLIGHT));
        assert!(p.offloading(), "what /metrics shows of it");
        assert_eq!(p.starved_windows, u64::from(STREAK));
        // But not a lone read: the ring wakes for its reply either way.
        assert!(!p.offload(MIN_IN_FLIGHT - 1));
        assert!(!p.offload(1));
        // Without a schedstat to read, turns change nothing...
        p.turn(at + OFFLOAD_FOR / 2);
        assert!(p.offload(MIN_IN_FLIGHT));
        // ...but with one, the end of the offload starts a window inline.
        p.stat = File::open("/proc/thread-self/schedstat").ok();
        assert!(p.stat.is_some(), "this kernel has no /proc/thread-self/schedstat");
        p.turn(at + OFFLOAD_FOR);
        assert!(!p.offload(MIN_IN_FLIGHT));
        assert!(!p.offloading());
        assert!(p.window.is_some(), "a window starts once the offload ends");
    }

    /// A busy ring on a quiet machine waits a tick now and then (the
    /// quiet bench: one such window sent a second of reads to the workers,
    /// at 1.2x the CPU per read); only contention that lasts offloads.
    #[test]
    fn a_hiccup_between_served_windows_keeps_reads_inline() {
        let t0 = Instant::now();
        let mut p = path_at(OffloadReads::Auto);
        let mut at = t0;
        // Served, starved, served, starved twice, served: never STREAK in a row.
        for (i, starved) in [false, true, false, true, true, false, true].into_iter().enumerate() {
            let delay = if starved { 10 } else { 0 };
            p.judge(sample(at, 0, 0), sample(at + 20 * MS, 8, delay));
            assert!(!p.offload(MIN_IN_FLIGHT), "offloaded after window {i}");
            at += 20 * MS;
        }
        assert_eq!(p.starved_windows, 4);
    }

    /// `off` fixes where reads go, but the ring still judges its windows:
    /// the idle poll must know a contended ring (with `off` not looking, a
    /// contended ring polled and its QD1 reads under two spinners fell from
    /// 11.8k to 0.8k IOPS). `always` offloads every read and judges none.
    #[test]
    fn off_keeps_reads_inline_but_still_judges_contention() {
        let t0 = Instant::now();
        let mut off = ReadPath::new(OffloadReads::Off);
        let mut always = ReadPath::new(OffloadReads::Always);
        assert!(off.stat.is_some(), "this kernel has no /proc/thread-self/schedstat");
        off.turn(t0);
        assert!(off.window.is_some(), "off starts a window");
        always.turn(t0);
        assert!(always.window.is_none(), "always judges no window");
        off.turn(t0 + WINDOW * 2);
        assert!(!off.offload(MIN_IN_FLIGHT));
        assert!(always.offload(1));
        // A streak of starved windows makes `off` contended, and moves no read.
        let mut at = t0 + WINDOW * 3;
        for _ in 0..STREAK {
            off.judge(sample(at, 0, 0), sample(at + 20 * MS, 4, 10));
            at += 20 * MS;
        }
        assert!(off.contended(), "off after a starved streak");
        assert!(!off.offload(MIN_IN_FLIGHT));
        assert!(always.offload(1));
        assert!(!off.offloading() && always.offloading());
        assert_eq!("auto".parse::<OffloadReads>().ok(), Some(OffloadReads::Auto));
        assert_eq!("always".parse::<OffloadReads>().ok(), Some(OffloadReads::Always));
        assert!("on".parse::<OffloadReads>().is_err());
    }

    /// A starved ring hands a blocking write to io_uring's workers only
    /// when it serves several requests at once: a lone write stays on the
    /// ring (it went to a worker before: one connection × QD1 4 KiB writes
    /// to ext4 beside a spinner took 2.8-3.5 context switches per write
    /// that way, 1.0-2.2 kept on the ring; docs/benchmarks.md).
    #[test]
    fn a_starved_ring_keeps_a_lone_write_and_hands_several_to_the_workers() {
        let t0 = Instant::now();
        let mut p = path_at(OffloadReads::Auto);
        assert!(!p.offload_writes(MIN_IN_FLIGHT), "not starved: every write stays");
        let mut at = t0;
        for i in 0..u64::from(STREAK) {
            p.judge(sample(at, 4 * i, 10 * i), sample(at + 20 * MS, 4 + 4 * i, 10 + 10 * i));
            at += 20 * MS;
        }
        assert!(p.offload_writes(MIN_IN_FLIGHT));
        assert!(!p.offload_writes(MIN_IN_FLIGHT - 1), "a client of a few stays on the ring");
        assert!(!p.offload_writes(1), "a lone write stays on the ring");
        // `off` only keeps reads inline: a starved ring still offloads writes.
        let mut off = path_at(OffloadReads::Off);
        for i in 0..u64::from(STREAK) {
            off.judge(sample(at, 4 * i, 10 * i), sample(at + 20 * MS, 4 + 4 * i, 10 + 10 * i));
            at += 20 * MS;
        }
        assert!(off.offload_writes(MIN_IN_FLIGHT) && !off.offload_writes(1));
    }

    /// Inline writes leave the table at once: the turns still show a deep
    /// client, for the turn after the one it came in too, and a client of
    /// one request a turn shows as one.
    #[test]
    fn admitted_requests_count_this_turn_and_the_one_before() {
        let mut a = Admitted::default();
        assert_eq!(a.recent(), 0);
        for _ in 0..8 {
            a.admit();
        }
        assert_eq!(a.recent(), 8);
        a.turn();
        a.admit();
        assert_eq!(a.recent(), 8, "the turn before still counts");
        a.turn();
        assert_eq!(a.recent(), 1);
        for _ in 0..5 {
            a.turn();
            a.admit();
            assert_eq!(a.recent(), 1, "QD1: one a turn");
        }
        a.turn();
        a.turn();
        assert_eq!(a.recent(), 0);
    }

    /// What a write on a starved ring is judged by: a QD1 client is lone
    /// every way; a deep one shows in its receives even when the turns
    /// between its batches admitted nothing and its writes left the table;
    /// several clients of one request each show in the turns.
    #[test]
    fn a_deep_client_or_several_clients_count_as_several_at_once() {
        let mut quiet = Admitted::default();
        quiet.turn();
        quiet.admit();
        assert_eq!(at_once(1, quiet, 1), 1, "QD1");
        assert!(at_once(1, quiet, 1) < MIN_IN_FLIGHT);
        let (mut empty, deep_receive) = (Admitted::default(), 8);
        empty.turn();
        empty.turn();
        empty.admit();
        assert_eq!(at_once(1, empty, deep_receive), 8, "a deep client's receive");
        let mut several = Admitted::default();
        for _ in 0..4 {
            several.admit();
        }
        assert_eq!(at_once(1, several, 1), 4, "four QD1 clients in one turn");
        assert_eq!(at_once(5, quiet, 1), 5, "reads or worker writes in flight");
    }

    /// The thread's own schedstat reads back, again and again from the
    /// same descriptor, and its CPU time moves.
    #[test]
    fn the_thread_schedstat_is_read_again_from_one_descriptor() {
        let p = ReadPath::new(OffloadReads::Auto);
        let first = p.sample(Instant::now()).expect("a schedstat sample");
        let mut x = 0u64;
        for i in 0..2_000_000u64 {
            x = std::hint::black_box(x.wrapping_mul(31).wrapping_add(i));
        }
        let second = p.sample(Instant::now()).expect("a second sample");
        assert!(second.cpu > first.cpu, "{first:?} then {second:?}");
        assert!(second.delay >= first.delay);
    }
}
