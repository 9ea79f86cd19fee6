//! How fast the updater asks: a token bucket (QPS and burst), the pause a
//! 429's Retry-After asks of every request, and the per-object backoff.

use std::sync::Mutex;
use std::time::Duration;

use tokio::time::Instant;

use super::updater::{lock, UpdaterConfig};

/// The token bucket and the global pause a 429 asks for.
pub(super) struct Gate {
    qps: f64,
    burst: f64,
    state: Mutex<(f64, Instant, Instant)>,
}

impl Gate {
    pub(super) fn new(qps: f64, burst: u32) -> Self {
        let now = Instant::now();
        let burst = f64::from(burst.max(1));
        Self { qps: qps.max(0.001), burst, state: Mutex::new((burst, now, now)) }
    }

    /// Waits for a token and for any pause to end.
    pub(super) async fn pass(&self) {
        loop {
            let wait = {
                let mut s = lock(&self.state);
                let (tokens, last, paused_until) = &mut *s;
                let now = Instant::now();
                if now < *paused_until {
                    *paused_until - now
                } else {
                    *tokens = (*tokens + (now - *last).as_secs_f64() * self.qps).min(self.burst);
                    *last = now;
                    if *tokens >= 1.0 {
                        *tokens -= 1.0;
                        return;
                    }
                    Duration::from_secs_f64((1.0 - *tokens) / self.qps)
                }
            };
            tokio::time::sleep(wait).await;
        }
    }

    pub(super) fn pause(&self, d: Duration) {
        let mut s = lock(&self.state);
        s.2 = s.2.max(Instant::now() + d);
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
