//! Many reads in one go, waited for on the calling thread: the stat
//! collector's per-device reads and the signature probes.
//!
//! A `BatchReader` is its own small io_uring, set up for a single issuer
//! with deferred task work (the completions are reaped by the same thread
//! that submits, so the kernel needs no interrupts to deliver them). The
//! caller hands a slice of reads; they go to the kernel in as few
//! submissions as the queue depth allows and the call returns when all have
//! completed or the deadline passed. A read still in flight at the deadline
//! (a hung device) is cancelled; if the kernel still holds it, its buffer is
//! leaked rather than freed under the kernel, and its result says so.

use std::io;
use std::os::fd::{AsRawFd, BorrowedFd};
use std::time::{Duration, Instant};

use io_uring::{cqueue, opcode, types, IoUring};

use super::{Backend, BackendChoice};

/// One read of a batch.
pub struct BatchRead<'a> {
    pub fd: BorrowedFd<'a>,
    pub offset: u64,
    /// Read into its whole length; the filled part is `..result`.
    pub buf: Vec<u8>,
    pub result: io::Result<usize>,
}

impl<'a> BatchRead<'a> {
    pub fn new(fd: BorrowedFd<'a>, offset: u64, buf: Vec<u8>) -> Self {
        Self { fd, offset, buf, result: Ok(0) }
    }

    /// The bytes read (empty after an error).
    pub fn data(&self) -> &[u8] {
        match self.result {
            Ok(n) => &self.buf[..n.min(self.buf.len())],
            Err(_) => &[],
        }
    }
}

pub struct BatchReader {
    ring: Option<IoUring>,
}

/// user_data of cancel requests (never an index into the batch).
const CANCEL: u64 = u64::MAX;

impl BatchReader {
    /// `depth`: how many reads are in flight at once.
    pub fn new(choice: BackendChoice, depth: u32) -> io::Result<Self> {
        if choice == BackendChoice::Epoll {
            return Ok(Self { ring: None });
        }
        let build = |defer: bool| {
            let mut b = IoUring::builder();
            b.setup_clamp();
            if defer {
                b.setup_single_issuer().setup_defer_taskrun();
            }
            b.build(depth.max(1))
        };
        // DEFER_TASKRUN needs 6.1; older kernels get a plain ring.
        match build(true).or_else(|_| build(false)) {
            Ok(r) => Ok(Self { ring: Some(r) }),
            Err(e) if choice == BackendChoice::IoUring => Err(e),
            Err(_) => Ok(Self { ring: None }),
        }
    }

    pub fn backend(&self) -> Backend {
        if self.ring.is_some() {
            Backend::IoUring
        } else {
            Backend::Epoll
        }
    }

    /// Performs every read in `reads`, each result in its entry. Returns an
    /// error only when the ring itself fails.
    pub fn read_all(&mut self, reads: &mut [BatchRead<'_>], timeout: Duration) -> io::Result<()> {
        let Some(ring) = self.ring.as_mut() else {
            for r in reads.iter_mut() {
                r.result = rustix::io::pread(r.fd, &mut r.buf, r.offset).map_err(io::Error::from);
            }
            return Ok(());
        };
        let deadline = Instant::now() + timeout;
        let mut done = vec![false; reads.len()];
        let mut next = 0;
        let mut outstanding = 0usize;
        while next < reads.len() || outstanding > 0 {
            while next < reads.len() {
                let r = &mut reads[next];
                let len = u32::try_from(r.buf.len()).unwrap_or(u32::MAX);
                let sqe =
                    opcode::Read::new(types::Fd(r.fd.as_raw_fd()), r.buf.as_mut_ptr(), len).offset(r.offset).build().user_data(next as u64);
                // SAFETY: the buffer and fd belong to `reads`, which outlives
                // this call; a read not complete at return has its buffer
                // leaked below, never freed while the kernel may write it.
                if unsafe { ring.submission().push(&sqe) }.is_err() {
                    break;
                }
                next += 1;
                outstanding += 1;
            }
            let now = Instant::now();
            if now >= deadline {
                break;
            }
            let ts = types::Timespec::from(deadline - now);
            match ring.submitter().submit_with_args(1, &types::SubmitArgs::new().timespec(&ts)) {
                Ok(_) => {}
                Err(e) if matches!(e.raw_os_error(), Some(libc::ETIME) | Some(libc::EINTR) | Some(libc::EBUSY)) => {}
                Err(e) => return Err(e),
            }
            outstanding -= reap(ring, reads, &mut done);
        }
        if outstanding > 0 {
            self.abandon(reads, &mut done);
        }
        Ok(())
    }

    /// Cancels what is still in flight after the deadline, and gives up on
    /// whatever the kernel will not let go of.
    fn abandon(&mut self, reads: &mut [BatchRead<'_>], done: &mut [bool]) {
        let ring = self.ring.as_mut().expect("only called with a ring");
        for (i, _) in done.iter().enumerate().filter(|(_, d)| !**d) {
            let sqe = opcode::AsyncCancel::new(i as u64).build().user_data(CANCEL);
            // SAFETY: a cancel request points at no memory.
            while unsafe { ring.submission().push(&sqe) }.is_err() {
                if ring.submit().is_err() {
                    break;
                }
            }
        }
        let until = Instant::now() + Duration::from_millis(100);
        while done.iter().any(|d| !d) && Instant::now() < until {
            let ts = types::Timespec::from(Duration::from_millis(10));
            let _ = ring.submitter().submit_with_args(1, &types::SubmitArgs::new().timespec(&ts));
            reap(ring, reads, done);
        }
        for (r, _) in reads.iter_mut().zip(done.iter()).filter(|(_, d)| !**d) {
            std::mem::forget(std::mem::take(&mut r.buf));
            r.result = Err(io::Error::new(io::ErrorKind::TimedOut, "read did not complete before the deadline"));
        }
    }
}

/// Records completions; returns how many reads completed.
fn reap(ring: &mut IoUring, reads: &mut [BatchRead<'_>], done: &mut [bool]) -> usize {
    let mut n = 0;
    for cqe in ring.completion() {
        let i = cqe.user_data();
        if i == CANCEL || cqueue::more(cqe.flags()) {
            continue;
        }
        let Some(r) = reads.get_mut(i as usize) else { continue };
        if done[i as usize] {
            continue;
        }
        done[i as usize] = true;
        n += 1;
        let res = cqe.result();
        r.result = if res < 0 { Err(io::Error::from_raw_os_error(-res)) } else { Ok(res as usize) };
    }
    n
}
