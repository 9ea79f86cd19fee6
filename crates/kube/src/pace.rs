//! How fast the updater asks: a token bucket (QPS and burst), how many
//! requests it keeps in flight (found by AIMD from the server's push-back),
//! and the per-object backoff.

use std::sync::Mutex;
use std::time::Duration;

use tokio::time::Instant;

use super::updater::{lock, UpdaterConfig};

/// The token bucket.
pub(super) struct Gate {
    qps: f64,
    burst: f64,
    state: Mutex<(f64, Instant)>,
}

impl Gate {
    pub(super) fn new(qps: f64, burst: u32) -> Self {
        let burst = f64::from(burst.max(1));
        Self { qps: qps.max(0.001), burst, state: Mutex::new((burst, Instant::now())) }
    }

    /// A gate that never waits (a sink with no rate limit).
    pub(super) fn open() -> Self {
        Self { qps: f64::INFINITY, burst: f64::INFINITY, state: Mutex::new((f64::INFINITY, Instant::now())) }
    }

    /// Waits for a token.
    pub(super) async fn pass(&self) {
        if self.qps.is_infinite() {
            return;
        }
        loop {
            let wait = {
                let mut s = lock(&self.state);
                let (tokens, last) = &mut *s;
                let now = Instant::now();
                *tokens = (*tokens + (now - *last).as_secs_f64() * self.qps).min(self.burst);
                *last = now;
                if *tokens >= 1.0 {
                    *tokens -= 1.0;
                    return;
                }
                Duration::from_secs_f64((1.0 - *tokens) / self.qps)
            };
            tokio::time::sleep(wait).await;
        }
    }
}

/// What a push-back (429, 503) did to the [`Limit`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum PushBack {
    /// The limit was halved.
    Cut,
    /// The request was sent before the last change of the limit: it tells
    /// nothing about the limit now, and does not cut again.
    Stale,
    /// The request was sent with one in flight, the floor: the server
    /// refuses even that, so the next request waits the Retry-After.
    AtFloor,
}

/// How many requests may be in flight: additive increase, multiplicative
/// decrease. A push-back halves it (floor 1), once per round: requests
/// already in flight when it was cut were sent at the old limit, and their
/// push-backs are not counted again. It grows by one each `grow_every` in
/// which at least `limit` requests sent at the current limit succeeded and
/// none was pushed back, up to `max`.
#[derive(Debug)]
pub(super) struct Limit {
    max: usize,
    limit: usize,
    /// Changes with the limit; each request carries the one it was sent at.
    epoch: u64,
    successes: usize,
    since: Instant,
    grow_every: Duration,
}

impl Limit {
    pub(super) fn new(max: usize, grow_every: Duration, now: Instant) -> Self {
        let max = max.max(1);
        Self { max, limit: max, epoch: 0, successes: 0, since: now, grow_every }
    }

    pub(super) fn get(&self) -> usize {
        self.limit
    }

    pub(super) fn epoch(&self) -> u64 {
        self.epoch
    }

    fn set(&mut self, limit: usize, now: Instant) {
        self.limit = limit.clamp(1, self.max);
        self.epoch += 1;
        self.successes = 0;
        self.since = now;
    }

    /// A request sent at `epoch` was answered 429 or 503.
    pub(super) fn pushed_back(&mut self, epoch: u64, now: Instant) -> PushBack {
        if epoch != self.epoch {
            return PushBack::Stale;
        }
        if self.limit == 1 {
            self.set(1, now);
            return PushBack::AtFloor;
        }
        self.set(self.limit / 2, now);
        PushBack::Cut
    }

    /// A request sent at `epoch` succeeded.
    pub(super) fn succeeded(&mut self, epoch: u64, now: Instant) {
        if epoch != self.epoch {
            return;
        }
        self.successes += 1;
        if self.limit < self.max && self.successes >= self.limit && now - self.since >= self.grow_every {
            self.set(self.limit + 1, now);
        }
    }

    /// Back to `limit` (what it was before an outage: a server that did
    /// not answer at all said nothing about how much it can take).
    pub(super) fn restore(&mut self, limit: usize, now: Instant) {
        if limit != self.limit {
            self.set(limit, now);
        }
    }
}

/// Exponential backoff with ±25 % jitter (so objects retried together do
/// not stay in step).
pub(super) fn backoff(c: &UpdaterConfig, attempts: u32) -> Duration {
    let base = c.backoff_min.saturating_mul(1u32 << attempts.min(16)).min(c.backoff_max);
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.subsec_nanos()).unwrap_or(0);
    let jitter = 0.75 + f64::from(nanos % 1000) / 2000.0;
    base.mul_f64(jitter).min(c.backoff_max)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_push_back_halves_once_per_round_down_to_one() {
        let t0 = Instant::now();
        let mut l = Limit::new(8, Duration::from_secs(1), t0);
        let sent = l.epoch();
        assert_eq!(l.pushed_back(sent, t0), PushBack::Cut);
        assert_eq!(l.get(), 4);
        // The other requests sent at 8 were pushed back too: not cut again.
        assert_eq!(l.pushed_back(sent, t0), PushBack::Stale);
        assert_eq!(l.get(), 4);
        for want in [2, 1] {
            assert_eq!(l.pushed_back(l.epoch(), t0), PushBack::Cut);
            assert_eq!(l.get(), want);
        }
        assert_eq!(l.pushed_back(l.epoch(), t0), PushBack::AtFloor);
        assert_eq!(l.get(), 1, "the floor");
    }

    #[test]
    fn it_grows_by_one_per_window_of_successes_up_to_the_max() {
        let t0 = Instant::now();
        let sec = Duration::from_secs(1);
        let mut l = Limit::new(3, sec, t0);
        l.pushed_back(l.epoch(), t0);
        assert_eq!(l.get(), 1);
        // Successes within the window do not grow it yet.
        for _ in 0..10 {
            l.succeeded(l.epoch(), t0 + sec / 2);
        }
        assert_eq!(l.get(), 1);
        l.succeeded(l.epoch(), t0 + sec);
        assert_eq!(l.get(), 2);
        // Now two successes and another window.
        l.succeeded(l.epoch(), t0 + sec * 2);
        assert_eq!(l.get(), 2, "one success at a limit of two");
        let stale = l.epoch() - 1;
        l.succeeded(stale, t0 + sec * 2);
        assert_eq!(l.get(), 2, "a success sent at the old limit does not count");
        l.succeeded(l.epoch(), t0 + sec * 2);
        assert_eq!(l.get(), 3);
        for i in 0..10 {
            l.succeeded(l.epoch(), t0 + sec * (3 + i));
        }
        assert_eq!(l.get(), 3, "never past the max");
        l.pushed_back(l.epoch(), t0);
        l.restore(3, t0);
        assert_eq!(l.get(), 3);
    }
}
