//! The updater's counters: what it was asked, what it wrote, and what the
//! sink pushed back. Read at any time (by `/metrics`, by tests, in the
//! agent's log line at shutdown) without taking the updater's lock.

use std::sync::atomic::{AtomicU64, Ordering};

use serde::Serialize;

/// Counters, readable at any time.
#[derive(Debug, Default)]
pub struct Stats {
    pub submitted: AtomicU64,
    /// Submissions that replaced a pending state of the same object.
    pub coalesced: AtomicU64,
    pub requests: AtomicU64,
    pub writes_main: AtomicU64,
    pub writes_status: AtomicU64,
    pub deletes: AtomicU64,
    /// Objects due for a write that equalled what is stored.
    pub unchanged: AtomicU64,
    pub throttled: AtomicU64,
    pub conflicts: AtomicU64,
    pub unavailable: AtomicU64,
    pub refused: AtomicU64,
    pub(crate) flushes: AtomicU64,
    /// Objects still pending when a shutdown's deadline passed.
    pub abandoned: AtomicU64,
    /// Objects waiting to be written or being written now (a gauge; set
    /// by the loop as it takes changes and as each write ends).
    pub queued: AtomicU64,
    /// Requests sent alone to a server that stopped answering.
    pub probes: AtomicU64,
    /// Objects written again because someone else changed or deleted them.
    pub repairs: AtomicU64,
    /// Requests allowed in flight now (a gauge: `concurrency`, less
    /// while the server pushes back).
    pub limit: AtomicU64,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct StatsSnapshot {
    pub submitted: u64,
    pub coalesced: u64,
    pub requests: u64,
    pub writes_main: u64,
    pub writes_status: u64,
    pub deletes: u64,
    pub unchanged: u64,
    pub throttled: u64,
    pub conflicts: u64,
    pub unavailable: u64,
    pub refused: u64,
    pub(crate) flushes: u64,
    pub abandoned: u64,
    pub queued: u64,
    pub probes: u64,
    pub repairs: u64,
    pub limit: u64,
}

impl Stats {
    pub(crate) fn snapshot(&self) -> StatsSnapshot {
        let g = |a: &AtomicU64| a.load(Ordering::Relaxed);
        StatsSnapshot {
            submitted: g(&self.submitted),
            coalesced: g(&self.coalesced),
            requests: g(&self.requests),
            writes_main: g(&self.writes_main),
            writes_status: g(&self.writes_status),
            deletes: g(&self.deletes),
            unchanged: g(&self.unchanged),
            throttled: g(&self.throttled),
            conflicts: g(&self.conflicts),
            unavailable: g(&self.unavailable),
            refused: g(&self.refused),
            flushes: g(&self.flushes),
            abandoned: g(&self.abandoned),
            queued: g(&self.queued),
            probes: g(&self.probes),
            repairs: g(&self.repairs),
            limit: g(&self.limit),
        }
    }
}
