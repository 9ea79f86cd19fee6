//! Admission control: what a connection and the whole server may hold.
//!
//! Every buffer a request needs is charged before it is allocated, one
//! request at a time as the bytes are split, so a burst cannot allocate
//! past the limits before anyone looks. Two amounts are kept per
//! connection: `held` (reply bytes queued or promised, spliced ones
//! included: what the per-connection limit bounds) and `mem` (memory
//! actually taken: buffers and unparsed bytes; what the server limit
//! bounds, summed over every ring in [`ServerBudget`]).
//!
//! Under pressure (more than three quarters of the server limit in use)
//! only light connections — holding at most 1/64 of the limit — get more:
//! the heaviest connections stop being read first, while a well-behaved
//! client with a few requests in flight is still served. When even a light
//! connection is refused (many hostile ones filled the rest), the server is
//! starved: each ring then drops its heaviest connection that has made no
//! progress for a while (see the worker's tick), so memory stays bounded
//! and new clients are still served.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

/// Per-connection and per-server limits.
#[derive(Debug, Clone, Copy)]
pub(super) struct Limits {
    pub conn_bytes: usize,
    pub conn_requests: u32,
}

/// Memory charged by every connection of one server, across rings.
#[derive(Debug)]
pub(super) struct ServerBudget {
    limit: usize,
    used: AtomicUsize,
    /// Bumped at every release: a ring retries connections the server
    /// refused once this moves.
    releases: AtomicU64,
    /// Bumped when a light connection is refused.
    starved: AtomicU64,
}

/// Which limit refused a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Refusal {
    /// The connection's own bytes or requests.
    Conn,
    /// The server's memory.
    Server,
}

impl ServerBudget {
    pub(crate) fn new(limit: usize) -> Self {
        Self { limit: limit.max(1), used: AtomicUsize::new(0), releases: AtomicU64::new(0), starved: AtomicU64::new(0) }
    }

    pub(crate) fn used(&self) -> usize {
        self.used.load(Ordering::Relaxed)
    }

    pub(crate) fn releases(&self) -> u64 {
        self.releases.load(Ordering::Relaxed)
    }

    /// How many times a light connection was refused.
    pub(crate) fn starved(&self) -> u64 {
        self.starved.load(Ordering::Relaxed)
    }

    pub(crate) fn charge(&self, n: usize) {
        if n > 0 {
            self.used.fetch_add(n, Ordering::Relaxed);
        }
    }

    pub(crate) fn release(&self, n: usize) {
        if n > 0 {
            let _ = self.used.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |u| Some(u.saturating_sub(n)));
            self.releases.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Whether only light connections are admitted now: a connection of
    /// any ring may be waiting for memory to come back.
    pub(crate) fn under_pressure(&self) -> bool {
        self.used() > self.pressure()
    }

    /// Above this, only light connections are admitted.
    fn pressure(&self) -> usize {
        self.limit / 4 * 3
    }

    /// What a connection may hold and still be admitted under pressure.
    fn light(&self) -> usize {
        self.limit / 64
    }

    /// Whether a connection holding `mem` may take `cost` more bytes.
    fn admits(&self, mem: usize, cost: usize) -> bool {
        if cost == 0 {
            return true;
        }
        let used = self.used();
        // Nothing charged anywhere: even a request larger than the limit
        // goes through (alone), or it could never be served.
        used == 0 || used + cost <= self.pressure() || (mem + cost <= self.light() && used + cost <= self.limit)
    }
}

/// What admission looks at: the limits and the server's budget.
#[derive(Clone, Copy)]
pub(super) struct Gate<'a> {
    pub limits: &'a Limits,
    pub server: &'a ServerBudget,
}

/// A connection's charges against its limits and the server's.
#[derive(Debug, Default)]
pub(super) struct Account {
    /// Reply bytes queued or promised (spliced ones included), and buffers.
    pub held: usize,
    /// Memory taken: buffers and unparsed received bytes.
    pub mem: usize,
    /// Requests taken and not yet answered.
    pub requests: u32,
}

impl Account {
    /// Whether one more request costing `held`/`mem` bytes may be taken now.
    pub(crate) fn admit(&self, gate: Gate<'_>, held: usize, mem: usize) -> Result<(), Refusal> {
        if self.requests >= gate.limits.conn_requests {
            return Err(Refusal::Conn);
        }
        // A connection holding nothing may take one request larger than
        // its limit (a 32 MiB WRITE with a smaller limit), or it would hang.
        if self.held > 0 && self.held + held > gate.limits.conn_bytes {
            return Err(Refusal::Conn);
        }
        if !gate.server.admits(self.mem, mem) {
            if self.mem + mem <= gate.server.light() {
                gate.server.starved.fetch_add(1, Ordering::Relaxed);
            }
            return Err(Refusal::Server);
        }
        Ok(())
    }

    /// Whether a connection stopped by its own limits may be read again:
    /// half of each drained, so it is not woken for every reply.
    pub(crate) fn drained_enough(&self, limits: &Limits) -> bool {
        self.held <= limits.conn_bytes / 2 && self.requests <= limits.conn_requests / 2
    }

    pub(crate) fn charge(&mut self, server: &ServerBudget, held: usize, mem: usize) {
        self.held += held;
        self.mem += mem;
        server.charge(mem);
    }

    pub(crate) fn release(&mut self, server: &ServerBudget, held: usize, mem: usize) {
        self.held = self.held.saturating_sub(held);
        let mem = mem.min(self.mem);
        self.mem -= mem;
        server.release(mem);
    }

    /// Gives back everything (the connection is gone).
    pub(crate) fn close(&mut self, server: &ServerBudget) {
        server.release(self.mem);
        *self = Account::default();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn heavy_connections_stop_first_under_pressure() {
        let limits = Limits { conn_bytes: 64 << 20, conn_requests: 512 };
        let server = ServerBudget::new(32 << 20);
        let gate = Gate { limits: &limits, server: &server };
        let mut heavy = Account::default();
        while heavy.admit(gate, 8192, 8192).is_ok() {
            heavy.charge(&server, 8192, 8192);
            assert!(heavy.mem <= 32 << 20);
        }
        assert_eq!(heavy.admit(gate, 8192, 8192), Err(Refusal::Server));
        assert!(server.used() <= 24 << 20, "the heavy one stops at the pressure mark");
        let light = Account::default();
        assert!(light.admit(gate, 8192, 8192).is_ok(), "a light connection is still served");
        assert_eq!(server.starved(), 0);
        // Many light connections fill the rest of the budget, and no more.
        let mut band: Vec<Account> = Vec::new();
        for _ in 0..1000 {
            let mut a = Account::default();
            while a.admit(gate, 8192, 8192).is_ok() {
                a.charge(&server, 8192, 8192);
            }
            band.push(a);
        }
        assert!(server.used() <= 32 << 20, "the budget holds");
        assert!(light.admit(gate, 8192, 8192).is_err() && server.starved() > 0, "a full budget starves light ones");
        for mut a in band {
            a.close(&server);
        }
        heavy.close(&server);
        assert_eq!(server.used(), 0);
    }

    #[test]
    fn connection_limits_count_requests_and_bytes() {
        let limits = Limits { conn_bytes: 1 << 20, conn_requests: 2 };
        let server = ServerBudget::new(1 << 30);
        let gate = Gate { limits: &limits, server: &server };
        let mut a = Account::default();
        assert!(a.admit(gate, 32 << 20, 32 << 20).is_ok(), "one oversized request when holding nothing");
        a.charge(&server, 600 << 10, 600 << 10);
        assert_eq!(a.admit(gate, 600 << 10, 0), Err(Refusal::Conn));
        a.release(&server, 600 << 10, 600 << 10);
        a.requests = 2;
        assert_eq!(a.admit(gate, 0, 0), Err(Refusal::Conn));
        a.requests = 1;
        assert!(a.drained_enough(&limits));
    }
}
