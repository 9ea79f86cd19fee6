//! The io_uring engine of the reactor: a [`UringCore`] of reactor ops plus
//! the multishot poll on the mailbox eventfd.

use std::io;
use std::os::fd::{AsRawFd, RawFd};
use std::time::Duration;

use io_uring::{opcode, types, IoUring};

use super::core::UringCore;
use super::ops::{Reaped, WAKE};
use super::reactor::{Op, Pending};
use super::Token;

/// How long dropping the reactor waits for cancelled ops.
const CANCEL_WAIT: Duration = Duration::from_millis(500);

pub(super) struct UringEngine {
    core: UringCore<Op>,
    wake: RawFd,
}

impl UringEngine {
    pub(super) fn new(wake: RawFd) -> io::Result<Self> {
        let ring = IoUring::builder().setup_clamp().build(256)?;
        let mut e = Self { core: UringCore::new(ring, CANCEL_WAIT), wake };
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

    pub(super) fn in_flight(&self) -> usize {
        self.core.ops().len()
    }

    pub(super) fn token(&self, ud: u64) -> Option<Token> {
        self.core.ops().get(ud).map(|op| op.token)
    }

    pub(super) fn submit(&mut self, op: Op) -> io::Result<()> {
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
                }
                .user_data(ud)
            })
        };
        r.map(|_| ())
    }

    pub(super) fn wait(&mut self, out: &mut Vec<Reaped<Op>>) -> io::Result<()> {
        self.core.submit_and_wait(1, None)?;
        let start = out.len();
        self.core.reap(out);
        if out[start..].iter().any(|c| c.user_data == WAKE && !c.more) {
            // The kernel ended the wakeup poll: arm a fresh one.
            self.arm_wake()?;
        }
        Ok(())
    }
}
