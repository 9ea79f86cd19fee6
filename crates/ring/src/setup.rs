//! The one way a ring is made, for every io_uring in the crate: the
//! reactor's (mount watcher, hot-plug, the collector's timer), the batch
//! reader's (the collector's reads, the probes) and the NBD server's.
//!
//! Each asks for `SINGLE_ISSUER | DEFER_TASKRUN` (6.1+: the kernel runs
//! completion work only when the ring's thread waits, instead of
//! interrupting it) and gets a plain ring where the kernel refuses; the
//! NBD server's also asks for its completion queue's size, SUBMIT_ALL and
//! COOP_TASKRUN, and for the ring to start disabled, so its restrictions
//! are in place before any operation can be submitted.

use std::io;
use std::sync::Once;

use io_uring::IoUring;

/// How to make one ring.
#[derive(Debug, Clone, Copy)]
pub(crate) struct RingSetup {
    /// Submission queue entries (clamped to the kernel's maximum).
    pub entries: u32,
    /// Completion queue entries; the kernel's default (twice `entries`) if `None`.
    pub cq_entries: Option<u32>,
    /// SUBMIT_ALL and COOP_TASKRUN: a server's ring.
    pub server: bool,
    /// Made disabled (R_DISABLED): enabled once restrictions are registered.
    pub disabled: bool,
}

impl RingSetup {
    pub(crate) fn new(entries: u32) -> Self {
        RingSetup { entries, cq_entries: None, server: false, disabled: false }
    }

    /// The ring, and whether it defers task work.
    pub(crate) fn build(&self) -> io::Result<(IoUring, bool)> {
        let build = |defer: bool| {
            let mut b = IoUring::builder();
            b.setup_clamp();
            if let Some(cq) = self.cq_entries {
                b.setup_cqsize(cq);
            }
            if self.server {
                b.setup_submit_all().setup_coop_taskrun();
            }
            if self.disabled {
                b.setup_r_disabled();
            }
            if defer {
                b.setup_single_issuer().setup_defer_taskrun();
            }
            b.build(self.entries.max(1))
        };
        match build(true) {
            Ok(ring) => Ok((ring, true)),
            Err(first) => {
                static ONCE: Once = Once::new();
                ONCE.call_once(
                    || tracing::info!(error = %first, "io_uring refuses SINGLE_ISSUER|DEFER_TASKRUN (before 6.1); rings are plain ones"),
                );
                Ok((build(false)?, false))
            }
        }
    }
}
