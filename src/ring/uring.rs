//! The io_uring engine of the reactor.

use std::io;
use std::os::fd::{AsRawFd, BorrowedFd, OwnedFd};
use std::sync::Arc;
use std::time::Duration;

use io_uring::{cqueue, opcode, squeue, types, IoUring};

use super::{RawCompletion, WAKE_SLOT};

pub(super) struct UringEngine {
    ring: IoUring,
    /// The command eventfd, kept open while its multishot poll lives.
    wake: Arc<OwnedFd>,
    /// Timespecs must stay put until their timeout completes; boxed per slot.
    timespecs: std::collections::HashMap<u64, Box<types::Timespec>>,
}

impl UringEngine {
    pub(super) fn new(wake: &Arc<OwnedFd>) -> io::Result<Self> {
        let ring = IoUring::builder().setup_clamp().build(256)?;
        let mut e = Self { ring, wake: wake.clone(), timespecs: Default::default() };
        // Probe that multishot poll works (5.13+), on the eventfd we need anyway.
        e.arm_wake()?;
        e.ring.submit()?;
        Ok(e)
    }

    fn push(&mut self, sqe: squeue::Entry) -> io::Result<()> {
        loop {
            // SAFETY: every pointer inside `sqe` (read buffers, timespecs)
            // refers to memory the reactor keeps alive in its in-flight table
            // until the operation's final completion; fds are held by Arc.
            if unsafe { self.ring.submission().push(&sqe) }.is_ok() {
                return Ok(());
            }
            // Queue full: hand what is queued to the kernel and try again.
            self.ring.submit()?;
        }
    }

    pub(super) fn poll(&mut self, slot: u64, fd: BorrowedFd<'_>, events: u32) -> io::Result<()> {
        let sqe = opcode::PollAdd::new(types::Fd(fd.as_raw_fd()), events).multi(true).build().user_data(slot);
        self.push(sqe)
    }

    pub(super) fn read(&mut self, slot: u64, fd: BorrowedFd<'_>, buf: &mut Vec<u8>, offset: Option<u64>) -> io::Result<()> {
        let len = u32::try_from(buf.len()).unwrap_or(u32::MAX);
        let sqe =
            opcode::Read::new(types::Fd(fd.as_raw_fd()), buf.as_mut_ptr(), len).offset(offset.unwrap_or(u64::MAX)).build().user_data(slot);
        self.push(sqe)
    }

    pub(super) fn timeout(&mut self, slot: u64, after: Duration) -> io::Result<()> {
        let ts = Box::new(types::Timespec::from(after));
        let sqe = opcode::Timeout::new(&*ts as *const types::Timespec).build().user_data(slot);
        self.timespecs.insert(slot, ts);
        self.push(sqe)
    }

    pub(super) fn wait(&mut self, out: &mut Vec<RawCompletion>) -> io::Result<()> {
        match self.ring.submit_and_wait(1) {
            Ok(_) => {}
            Err(e) if e.raw_os_error() == Some(libc::EBUSY) => {} // CQ full: drain first
            Err(e) => return Err(e),
        }
        let cqes: Vec<cqueue::Entry> = self.ring.completion().collect();
        for cqe in cqes {
            let slot = cqe.user_data();
            let more = cqueue::more(cqe.flags());
            if !more {
                self.timespecs.remove(&slot);
            }
            if slot == WAKE_SLOT && !more {
                // Re-arm the command wakeup; the reactor never sees this slot's end.
                self.arm_wake()?;
            }
            out.push(RawCompletion { slot, res: cqe.result(), more });
        }
        Ok(())
    }

    fn arm_wake(&mut self) -> io::Result<()> {
        let fd = types::Fd(self.wake.as_raw_fd());
        self.push(opcode::PollAdd::new(fd, libc::POLLIN as u32).multi(true).build().user_data(WAKE_SLOT))
    }

    /// Cancels `slots` and waits briefly for their final completions. Returns
    /// the slots whose operations the kernel may still be holding.
    pub(super) fn cancel_all(&mut self, slots: &[u64]) -> Vec<u64> {
        let mut left: std::collections::HashSet<u64> = slots.iter().copied().collect();
        for &slot in slots {
            let sqe = opcode::AsyncCancel::new(slot).build().user_data(WAKE_SLOT - 1);
            if self.push(sqe).is_err() {
                return left.into_iter().collect();
            }
        }
        let deadline = std::time::Instant::now() + Duration::from_millis(500);
        while !left.is_empty() && std::time::Instant::now() < deadline {
            let ts = types::Timespec::from(Duration::from_millis(10));
            let args = types::SubmitArgs::new().timespec(&ts);
            let _ = self.ring.submitter().submit_with_args(1, &args);
            for cqe in self.ring.completion() {
                if !cqueue::more(cqe.flags()) {
                    left.remove(&cqe.user_data());
                }
            }
        }
        left.into_iter().collect()
    }
}
