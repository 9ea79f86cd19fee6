//! The io_uring engine of the reactor: a [`UringCore`] of reactor ops plus
//! the multishot poll on the mailbox eventfd.
//!
//! The ring is made on the thread that uses it, so it asks for
//! `SINGLE_ISSUER | DEFER_TASKRUN` (6.1+): the kernel then runs completion
//! work only when this thread waits, instead of interrupting it for each
//! event of a storm. A kernel that refuses (EINVAL) gets a plain ring.

use std::io;
use std::os::fd::{AsRawFd, RawFd};
use std::sync::Once;
use std::time::Duration;

use io_uring::{opcode, types, IoUring};

use super::batch::{BatchRead, Batches};
use super::core::UringCore;
use super::ops::{Reaped, WAKE};
use super::reactor::{Op, Pending};
use super::setup::RingSetup;
use super::Token;

/// How long dropping the reactor waits for cancelled ops.
const CANCEL_WAIT: Duration = Duration::from_millis(500);

/// Completions one batched wait gathers before its window ends early.
const BATCH_MAX: usize = 256;

/// The timeout of a batched wait. Without one, the kernel ends the wait
/// when the window ends even with nothing to reap (an idle ring would turn
/// every window); with it, after the window the wait lasts until the first
/// completion, bounded only by this.
const BATCH_IDLE_WAIT: Duration = Duration::from_secs(3600);

pub(super) struct UringEngine {
    core: UringCore<Op>,
    wake: RawFd,
    /// How long a wait gathers completions once it has begun (zero: it
    /// returns with the first).
    batch_window: Duration,
    /// The kernel honours `min_wait_usec` (6.12+).
    min_wait: bool,
    /// Reads of a batch in flight at once (the submission queue's size).
    batch_depth: usize,
}

/// Makes the reactor's ring: deferred task work when the kernel allows it
/// (the flag says whether it did).
pub(super) fn build_ring() -> io::Result<(IoUring, bool)> {
    RingSetup::new(256).build()
}

impl UringEngine {
    pub(super) fn new(wake: RawFd) -> io::Result<Self> {
        let (ring, deferred) = build_ring()?;
        let min_wait = ring.params().is_feature_min_timeout();
        tracing::debug!(deferred, min_wait, "reactor ring");
        let batch_depth = ring.params().sq_entries() as usize;
        let mut e = Self { core: UringCore::new(ring, CANCEL_WAIT), wake, batch_window: Duration::ZERO, min_wait, batch_depth };
        // Probe that multishot poll works (5.13+), on the eventfd we need anyway.
        e.arm_wake()?;
        e.core.submit_and_wait(0, None)?;
        Ok(e)
    }

    fn arm_wake(&mut self) -> io::Result<()> {
        let sqe = opcode::PollAdd::new(types::Fd(self.wake), libc::POLLIN as u32).multi(true).build().user_data(WAKE);
        // SAFETY: a poll points at no memory; the kernel holds its own
        // reference to the eventfd.
        unsafe { self.core.push(&sqe) }
    }

    /// See [`super::Reactor::set_batch_window`]. Where the kernel has no
    /// `min_wait_usec` the window is ignored (said once in the log): waits
    /// return with the first completion, as before.
    pub(super) fn set_batch_window(&mut self, window: Duration) {
        if !window.is_zero() && !self.min_wait {
            static ONCE: Once = Once::new();
            ONCE.call_once(|| tracing::info!("io_uring has no min_wait (before 6.12); ring threads wake for every completion"));
        }
        self.batch_window = window;
    }

    /// True when the kernel honours `min_wait_usec`.
    #[cfg(test)]
    pub(super) fn min_wait(&self) -> bool {
        self.min_wait
    }

    #[cfg(test)]
    pub(super) fn in_flight(&self) -> usize {
        self.core.ops().len()
    }

    pub(super) fn token(&self, ud: u64) -> Option<Token> {
        self.core.ops().get(ud).map(|op| op.token)
    }

    pub(super) fn submit(&mut self, op: Op) -> io::Result<()> {
        if !op.is_single() {
            return Err(io::Error::new(io::ErrorKind::InvalidInput, "batch reads start in their batch"));
        }
        // SAFETY: each sqe points only into heap memory the op owns (the read
        // buffer, the boxed timespec), which the core keeps until the op's
        // last completion; fds are kept open by the op's Arc.
        let r = unsafe {
            self.core.start(op, |op, ud| {
                match &mut op.pending {
                    Pending::Poll { fd, events } => opcode::PollAdd::new(types::Fd(fd.as_raw_fd()), *events).multi(true).build(),
                    Pending::Read { fd, buf, offset } => {
                        let len = u32::try_from(buf.len()).unwrap_or(u32::MAX);
                        opcode::Read::new(types::Fd(fd.as_raw_fd()), buf.as_mut_ptr(), len).offset(offset.unwrap_or(u64::MAX)).build()
                    }
                    Pending::Timeout { after, spec } => {
                        let ts = spec.insert(Box::new(types::Timespec::from(*after)));
                        opcode::Timeout::new(&**ts as *const types::Timespec).build()
                    }
                    // Refused above.
                    Pending::Batch(_) => opcode::Nop::new().build(),
                }
                .user_data(ud)
            })
        };
        r.map(|_| ())
    }

    /// Runs a batch of reads on this ring (see [`super::batch`]); other
    /// completions that come meanwhile go to `others`.
    pub(super) fn read_batch(
        &mut self,
        batches: &mut Batches,
        reads: &mut [BatchRead<'_>],
        timeout: Duration,
        others: &mut Vec<Reaped<Op>>,
    ) -> io::Result<()> {
        let start = others.len();
        let r = batches.run(&mut self.core, self.batch_depth, reads, timeout, others);
        if others[start..].iter().any(|c| c.user_data == WAKE && !c.more) {
            self.arm_wake()?;
        }
        r
    }

    /// Waits for a completion and reaps; when `out` already holds some
    /// (left by a batch of reads) only reaps what is there.
    pub(super) fn wait(&mut self, out: &mut Vec<Reaped<Op>>) -> io::Result<()> {
        if !out.is_empty() {
            self.core.submit_and_wait(0, None)?;
        } else if self.batch_window.is_zero() || !self.min_wait {
            self.core.submit_and_wait(1, None)?;
        } else {
            // Wait for BATCH_MAX completions during the window; once it has
            // passed, return with whatever is there (or with the first to
            // come). A storm is one turn per window, not one per event.
            let us = self.batch_window.as_micros().clamp(1, u128::from(u32::MAX)) as u32;
            let ts = types::Timespec::from(BATCH_IDLE_WAIT);
            self.core.submit_with_args(BATCH_MAX, &types::SubmitArgs::new().min_wait_usec(us).timespec(&ts))?;
        }
        let start = out.len();
        self.core.reap(out);
        if out[start..].iter().any(|c| c.user_data == WAKE && !c.more) {
            // The kernel ended the wakeup poll: arm a fresh one.
            self.arm_wake()?;
        }
        Ok(())
    }
}
