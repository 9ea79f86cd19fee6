//! A ring's per-tick diagnostic: what its completions were and what each
//! connection is waiting for, logged at debug level under the target
//! `volring::nbd::ring` (e.g. `RUST_LOG=volring::nbd::ring=debug`).
//!
//! A server that stops reading a socket shows no error of its own; this
//! says, tick by tick, whether the ring turned, which operations completed
//! and with what, and why each connection is or is not being read. The
//! counters are a few additions per completion, so they are always kept.

use super::conn::{Conn, Phase};
use super::token::Token;
use super::worker::Worker;

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
pub(super) fn describe(i: usize, c: &Conn) -> String {
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
pub(super) fn trace_to_stderr() -> bool {
    std::env::var_os("VOLRING_NBD_RING_TRACE").is_some_and(|v| !v.is_empty())
}

impl Worker {
    /// Logs this tick's completions and every connection's state (debug
    /// level, target `volring::nbd::ring`, or stderr, see
    /// [`trace_to_stderr`]), then starts the next tick's count.
    pub(super) fn log_tick(&mut self, turns: u64, empty_turns: u64) {
        let s = std::mem::take(&mut self.tick_stats);
        if !self.trace_stderr && !tracing::enabled!(target: "volring::nbd::ring", tracing::Level::DEBUG) {
            return;
        }
        let conns: Vec<String> = self.conns.iter().enumerate().filter_map(|(i, c)| c.as_ref().map(|c| describe(i, c))).take(8).collect();
        let line = format!(
            "ring={} turns={turns} empty_turns={empty_turns} recv_data={} recv_bytes={} recv_ended={} enobufs={} \
             recv_cancelled={} recv_eof={} recv_other={} recv_arms={} direct_ok={} direct_other={} sends={} send_errors={} \
             file_ok={} file_errors={} last_error={:?} bufs_by_kind={:?} in_flight={} armed_recvs={} recv_taken={} stale={} \
             recv_counts={:?} budget_used={} releases={} waiters={} dirty={} recovering={} direct_receive={} conns={conns:?}",
            self.id,
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
            self.ring.in_flight(),
            self.ring.armed_recvs(),
            self.ring.recv_taken(),
            self.ring.stale_completions(),
            self.ring.recv_counts(),
            self.budget.used(),
            self.budget.releases(),
            self.server_waiters.len(),
            self.dirty.len(),
            self.recv_recovering,
            self.direct_receive,
        );
        if self.trace_stderr {
            eprintln!("NBD ring tick {line}");
        }
        tracing::debug!(target: "volring::nbd::ring", "NBD ring tick {line}");
    }
}
