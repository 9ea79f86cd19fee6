//! A ring's per-tick diagnostic: what its completions were and what each
//! connection is waiting for, logged at debug level under the target
//! `volring::nbd::ring` (e.g. `RUST_LOG=volring::nbd::ring=debug`).
//!
//! A server that stops reading a socket shows no error of its own; this
//! says, tick by tick, whether the ring turned, which operations completed
//! and with what, and why each connection is or is not being read. The
//! counters are a few additions per completion, so they are always kept.

use super::conn::{Conn, Phase};
use std::time::{Duration, Instant};

use super::receive::Receive;
use super::shared::Shared;
use super::token::Token;
use volring_ring::Cqe;

/// Completions of one ring since its last tick, by kind and outcome.
#[derive(Default)]
pub(super) struct TickStats {
    /// Multishot receive completions that carried bytes.
    pub recv_data: u32,
    pub recv_bytes: u64,
    /// Multishot receives that ended (no F_MORE), by result.
    pub recv_ended: u32,
    pub recv_enobufs: u32,
    pub recv_cancelled: u32,
    pub recv_eof: u32,
    pub recv_other: u32,
    pub recv_arms: u32,
    pub direct_ok: u32,
    pub direct_other: u32,
    pub sends: u32,
    pub send_errors: u32,
    pub file_ok: u32,
    pub file_errors: u32,
    /// The last negative result and its operation.
    pub last_error: Option<(Token, i32)>,
    /// Completions that carried a provided buffer, by kind (see [`Token::KINDS`]).
    pub bufs_by_kind: [u32; Token::KINDS.len()],
    /// Idle polls that found work, and that ran out and slept (see `idle`).
    pub polls_found: u32,
    pub polls_missed: u32,
}

impl TickStats {
    pub(super) fn count(&mut self, token: Token, result: i32, more: bool, with_buf: bool) {
        if result < 0 {
            self.last_error = Some((token, result));
        }
        if with_buf {
            self.bufs_by_kind[token.kind()] += 1;
        }
        match token {
            Token::Recv(_) => {
                if with_buf {
                    self.recv_data += 1;
                    self.recv_bytes += result.max(0) as u64;
                }
                if !more {
                    self.recv_ended += 1;
                    match -result {
                        libc::ENOBUFS => self.recv_enobufs += 1,
                        libc::ECANCELED => self.recv_cancelled += 1,
                        0 if !with_buf => self.recv_eof += 1,
                        e if e > 0 => self.recv_other += 1,
                        _ => {}
                    }
                }
            }
            Token::RecvInto(_) if result > 0 => self.direct_ok += 1,
            Token::RecvInto(_) => self.direct_other += 1,
            Token::Send(_) if result >= 0 => self.sends += 1,
            Token::Send(_) => self.send_errors += 1,
            Token::Req(_) if result >= 0 => self.file_ok += 1,
            Token::Req(_) => self.file_errors += 1,
            _ => {}
        }
    }
}

/// One connection's state in a line.
fn describe(i: usize, c: &Conn) -> String {
    let payload = c.payload.as_ref().map(|p| format!("{}/{}", p.filled, p.req.length));
    format!(
        "#{i} serving={} state={:?} server_wait={:?} rx={:?} \
         held={} mem={} requests={} inbuf={} payload={:?} discard={} out={} tx={} ops={} dirty={}",
        matches!(c.phase, Phase::Serving { .. }),
        c.state,
        c.server_wait,
        c.rx,
        c.account.held,
        c.account.mem,
        c.account.requests,
        c.inbuf.len(),
        payload,
        c.discard,
        c.out.len(),
        c.tx.name(),
        c.socket_ops,
        c.dirty
    )
}

/// Whether ring ticks are also printed to stderr (`VOLRING_NBD_RING_TRACE`
/// set): for a server inside a process that installs no log subscriber,
/// such as a test binary.
fn trace_to_stderr() -> bool {
    std::env::var_os("VOLRING_NBD_RING_TRACE").is_some_and(|v| !v.is_empty())
}

/// Loop turns of a ring between two ticks: a ring that turns without
/// completions (or with only receives ending ENOBUFS) this often is
/// spinning on something, and says on what.
#[derive(Default)]
struct SpinWatch {
    turns: u64,
    empty_turns: u64,
    reported: Option<Instant>,
}

/// Empty turns per tick (50–250 ms) past which a ring reports itself
/// spinning: a healthy ring turns without completions only while it still
/// has connections to look at, a few times per burst; under TCG a turn
/// takes tens of microseconds, so the mark sits well below a tick's worth.
const SPIN_TURNS: u64 = 2_000;

/// What a ring counts about itself between ticks, and reports.
pub(super) struct Diagnostics {
    spin: SpinWatch,
    pub tick: TickStats,
    /// Ticks are printed to stderr too (see [`trace_to_stderr`]).
    trace_stderr: bool,
}

impl Default for Diagnostics {
    fn default() -> Self {
        Diagnostics { spin: SpinWatch::default(), tick: TickStats::default(), trace_stderr: trace_to_stderr() }
    }
}

impl Diagnostics {
    /// An idle poll ended, having `found` work or not.
    pub(super) fn polled(&mut self, found: bool) {
        if found {
            self.tick.polls_found += 1;
        } else {
            self.tick.polls_missed += 1;
        }
    }

    /// One loop turn and its completions.
    pub(super) fn turn(&mut self, cqes: &[Cqe<Token>]) {
        self.spin.turns += 1;
        // A turn whose only completions are receives that ended on an
        // empty pool (re-armed at once) did nothing either.
        if cqes.iter().all(|c| matches!(c.token, Token::Recv(_)) && c.result == -libc::ENOBUFS && !c.more) {
            self.spin.empty_turns += 1;
        }
        for c in cqes {
            self.tick.count(c.token, c.result, c.more, c.recv_buf.is_some());
        }
    }

    /// At each tick: the tick's line (see [`Diagnostics::log_tick`]) and a
    /// warning if the ring spins.
    pub(super) fn on_tick(&mut self, id: usize, sh: &Shared, rx: &Receive) {
        self.check_spin(id, sh, rx);
    }

    /// Reports (at most every 10 s) a ring that turned more than
    /// [`SPIN_TURNS`] times since the last tick without completions, with
    /// what its connections are waiting for.
    fn check_spin(&mut self, id: usize, sh: &Shared, rx: &Receive) {
        let spin = std::mem::take(&mut self.spin.empty_turns);
        let turns = std::mem::take(&mut self.spin.turns);
        self.log_tick(id, sh, rx, turns, spin);
        if spin < SPIN_TURNS || self.spin.reported.is_some_and(|at| sh.now.duration_since(at) < Duration::from_secs(10)) {
            return;
        }
        self.spin.reported = Some(sh.now);
        let conns: Vec<String> = sh
            .conns
            .iter()
            .enumerate()
            .filter_map(|(i, c)| c.as_ref().map(|c| (i, c)))
            .take(8)
            .map(|(i, c)| {
                format!(
                    "#{i} serving={} state={:?} rx={:?} tx={} out={} ops={} payload={} dirty={}",
                    matches!(c.phase, Phase::Serving { .. }),
                    c.state,
                    c.rx,
                    c.tx.name(),
                    c.out.len(),
                    c.socket_ops,
                    c.payload.is_some(),
                    c.dirty
                )
            })
            .collect();
        tracing::warn!(
            ring = id,
            turns,
            empty_turns = spin,
            dirty = sh.dirty.len(),
            live = sh.live,
            in_flight = sh.ring.stats().in_flight,
            armed_recvs = sh.ring.stats().armed_recvs,
            recv_taken = sh.ring.stats().recv_taken,
            recv_lent = sh.ring.stats().recv_lent,
            recovering = rx.recovering(),
            conns = ?conns,
            "NBD ring is spinning: many loop turns without a completion"
        );
    }

    /// Logs this tick's completions and every connection's state (debug
    /// level, target `volring::nbd::ring`, or stderr, see
    /// [`trace_to_stderr`]), then starts the next tick's count.
    fn log_tick(&mut self, id: usize, sh: &Shared, rx: &Receive, turns: u64, empty_turns: u64) {
        let s = std::mem::take(&mut self.tick);
        if !self.trace_stderr && !tracing::enabled!(target: "volring::nbd::ring", tracing::Level::DEBUG) {
            return;
        }
        let conns: Vec<String> = sh.conns.iter().enumerate().filter_map(|(i, c)| c.as_ref().map(|c| describe(i, c))).take(8).collect();
        let line = format!(
            "ring={} turns={turns} empty_turns={empty_turns} recv_data={} recv_bytes={} recv_ended={} enobufs={} \
             recv_cancelled={} recv_eof={} recv_other={} recv_arms={} direct_ok={} direct_other={} sends={} send_errors={} \
             file_ok={} file_errors={} last_error={:?} bufs_by_kind={:?} polls_found={} polls_missed={} in_flight={} armed_recvs={} recv_taken={} recv_lent={} stale={} \
             recv_counts={:?} budget_used={} releases={} waiters={} dirty={} recovering={} direct_receive={} conns={conns:?}",
            id,
            s.recv_data,
            s.recv_bytes,
            s.recv_ended,
            s.recv_enobufs,
            s.recv_cancelled,
            s.recv_eof,
            s.recv_other,
            s.recv_arms,
            s.direct_ok,
            s.direct_other,
            s.sends,
            s.send_errors,
            s.file_ok,
            s.file_errors,
            s.last_error,
            s.bufs_by_kind,
            s.polls_found,
            s.polls_missed,
            sh.ring.stats().in_flight,
            sh.ring.stats().armed_recvs,
            sh.ring.stats().recv_taken,
            sh.ring.stats().recv_lent,
            sh.ring.stats().stale_completions,
            sh.ring.stats().recv_counts,
            sh.budget.used(),
            sh.budget.releases(),
            rx.waiting(),
            sh.dirty.len(),
            rx.recovering(),
            rx.direct(),
        );
        if self.trace_stderr {
            eprintln!("NBD ring tick {line}");
        }
        tracing::debug!(target: "volring::nbd::ring", "NBD ring tick {line}");
    }
}
