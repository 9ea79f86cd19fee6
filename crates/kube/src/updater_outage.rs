//! Whether the API server answers, as the updater's loop sees it: a state
//! machine of two states. While it answers, requests go out up to the
//! in-flight limit (held back for a while after a 429 at the limit's
//! floor); once a request gets no answer or a 5xx, it is down and one
//! probe at a time goes out, further apart after each failed one, until a
//! request is answered again.

use std::time::Duration;

use tokio::time::Instant;

use super::UpdaterConfig;

/// The server stopped answering: one probe at a time until it does.
#[derive(Debug)]
pub(super) struct Down {
    /// The in-flight limit before, restored when a probe succeeds.
    pub(super) limit_before: usize,
    /// Between failed probes: backoff_min doubling to probe_max.
    gap: Duration,
    pub(super) since: Instant,
    /// When the last request failed.
    last_failure: Instant,
    /// A probe is on its way.
    probing: bool,
    /// The hold of the answering state, kept for when it answers again.
    hold_until: Option<Instant>,
}

impl Down {
    fn next_probe(&self) -> Instant {
        self.last_failure + self.gap
    }
}

#[derive(Debug)]
pub(super) enum Server {
    /// Requests go out at the limit; none starts before `hold_until` (a
    /// 429 at the floor).
    Answering {
        hold_until: Option<Instant>,
    },
    Down(Down),
}

impl Default for Server {
    fn default() -> Self {
        Server::Answering { hold_until: None }
    }
}

impl Server {
    /// When requests may start again, if not now: the next probe of a
    /// server that is down, or the end of a hold.
    pub(super) fn blocked_until(&self, now: Instant) -> Option<Instant> {
        let until = match self {
            Server::Down(d) => Some(d.next_probe()),
            Server::Answering { hold_until } => *hold_until,
        };
        until.filter(|t| *t > now)
    }

    /// When a backed-off key first due at `first` is due: its own time, or
    /// while the server is down the time of the next probe at the latest
    /// (it is pulled forward to probe with), never before it.
    pub(super) fn next_due(&self, first: Instant, probe_max: Duration) -> Instant {
        match self {
            Server::Down(d) => first.min(d.last_failure + probe_max).max(d.next_probe()),
            Server::Answering { .. } => first,
        }
    }

    /// Whether one more request may start now, with `running` on their way
    /// and `limit` allowed.
    pub(super) fn may_start(&self, running: usize, limit: usize, now: Instant) -> bool {
        match self {
            Server::Down(d) => running == 0 && !d.probing && now >= d.next_probe(),
            Server::Answering { hold_until } => running < limit && hold_until.is_none_or(|h| now >= h),
        }
    }

    /// A request starts: true when it is the probe of a server that is down.
    pub(super) fn start(&mut self) -> bool {
        match self {
            Server::Down(d) => {
                d.probing = true;
                true
            }
            Server::Answering { .. } => false,
        }
    }

    /// A request's job was lost (it panicked): its probe is over.
    pub(super) fn lost(&mut self) {
        if let Server::Down(d) = self {
            d.probing = false;
        }
    }

    /// Even one request at a time is too many: none starts for `wait`.
    pub(super) fn hold(&mut self, now: Instant, wait: Duration) {
        let h = match self {
            Server::Down(d) => &mut d.hold_until,
            Server::Answering { hold_until } => hold_until,
        };
        *h = Some(h.map_or(now, |h| h.max(now)).max(now + wait));
    }

    /// A request got an answer (success, or any status but 5xx): the
    /// server answers. The outage it ended, if it was down.
    pub(super) fn answered(&mut self) -> Option<Down> {
        let Server::Down(d) = self else { return None };
        let hold_until = d.hold_until;
        match std::mem::replace(self, Server::Answering { hold_until }) {
            Server::Down(d) => Some(d),
            Server::Answering { .. } => None,
        }
    }

    /// A request got no answer, or a 5xx: the server is down (probe it),
    /// or still down (the next probe waits longer, up to `probe_max`).
    /// `limit` is the in-flight limit now, `probe` whether it was a probe.
    pub(super) fn failed(&mut self, probe: bool, limit: usize, now: Instant, config: &UpdaterConfig) {
        let first_gap = config.backoff_min.min(config.probe_max);
        match self {
            Server::Answering { hold_until } => {
                tracing::warn!("publisher: the API server does not answer; probing it");
                let hold_until = *hold_until;
                *self =
                    Server::Down(Down { limit_before: limit, gap: first_gap, since: now, last_failure: now, probing: false, hold_until });
            }
            Server::Down(d) => {
                if probe {
                    d.probing = false;
                    d.gap = (d.gap * 2).clamp(first_gap, config.probe_max.max(first_gap));
                }
                d.last_failure = now;
            }
        }
    }
}
