//! SIGINT and SIGTERM stop the agent; SIGHUP is logged and ignored
//! (nothing of `volring node` is reloadable).

use tokio::signal::unix::{signal, Signal, SignalKind};

use super::component::Components;
use super::TARGET;

/// SIGTERM and SIGHUP, taken at the agent's first line: one that comes
/// during the start is acted on once the agent is ready.
pub(super) struct Signals {
    term: Signal,
    hup: Signal,
}

impl Signals {
    pub(crate) fn take() -> std::io::Result<Self> {
        Ok(Self { term: signal(SignalKind::terminate())?, hup: signal(SignalKind::hangup())? })
    }

    /// From now on (the agent is ready) SIGINT and SIGTERM stop it. SIGINT
    /// is taken only now: during the start it ends the process as usual.
    pub(crate) fn follow(self, parts: &Components) {
        let Signals { mut term, mut hup } = self;
        let stopping = parts.stopping().clone();
        parts.tasks().spawn(async move {
            loop {
                tokio::select! {
                    _ = hup.recv() => tracing::info!(target: TARGET, "SIGHUP: volring node has nothing to reload; ignored"),
                    _ = tokio::signal::ctrl_c() => break,
                    _ = term.recv() => break,
                    // Stopping for another reason: nothing left to listen for.
                    _ = stopping.asked() => return,
                }
            }
            stopping.stop();
        });
    }
}
