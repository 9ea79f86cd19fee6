//! Fault points: named places in a step that changes the machine where a
//! test can make the agent die at once, as a crash or the OOM killer would.
//!
//! `VOLRING_FAULT_POINT=name` (read once) makes [`point`]`("name")` send
//! SIGKILL to the agent's own process; `VOLRING_FAULT_POINT=name@N` waits for
//! the N-th time that point is reached (1-based). Nothing else reads the
//! variable, so an agent started without it pays one relaxed load per point.
//! The crash tests (tests/csi_recovery.rs and the state-of-world suite) walk
//! every point of an operation, kill there, restart and retry as kubelet does.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;

/// The armed point and the hit it fires on, if any.
fn armed() -> Option<&'static (String, u64)> {
    static ARMED: OnceLock<Option<(String, u64)>> = OnceLock::new();
    ARMED
        .get_or_init(|| {
            let v = std::env::var("VOLRING_FAULT_POINT").ok()?;
            match v.split_once('@') {
                Some((name, n)) => Some((name.to_string(), n.parse().ok().filter(|&n| n > 0)?)),
                None => Some((v, 1)),
            }
        })
        .as_ref()
}

/// Dies with SIGKILL here when this point is armed (see the module doc).
pub fn point(name: &str) {
    static HITS: AtomicU64 = AtomicU64::new(0);
    let Some((want, nth)) = armed() else { return };
    if want != name {
        return;
    }
    if HITS.fetch_add(1, Ordering::AcqRel) + 1 == *nth {
        tracing::error!(point = name, "fault point reached: killing the agent");
        let _ = rustix::process::kill_process(rustix::process::getpid(), rustix::process::Signal::KILL);
        // SIGKILL to oneself is delivered before kill(2) returns; should it
        // not be, abort rather than carry on past the point.
        std::process::abort();
    }
}
