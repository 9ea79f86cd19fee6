//! Many reads at once, waited for on the calling thread: the stat
//! collector's per-device reads and the signature probes.
//!
//! One algorithm, two faces. [`BatchReader`] is its own small io_uring (for
//! callers without a ring: the scan's probes, benches); a ring thread's
//! [`Reactor`](super::Reactor) runs the same batches on the ring it already
//! has ([`ReadBatch`]), so a thread never holds two rings — the stat
//! collector samples through its reactor. Either way the reads go to the
//! kernel in as few submissions as the queue allows, never more at once than
//! the ring has room for, and the call returns when all have completed or
//! the deadline passed. Completions of the ring's other ops that arrive
//! meanwhile (a timer, the mailbox) are kept for the ring's next wait.
//!
//! While a read is in flight its buffer belongs to the ring's op table (it
//! is moved out of the [`BatchRead`] and back on completion). A read still
//! in flight at the deadline (a hung device) is cancelled; if the kernel
//! does not let go at once, its result says it timed out, its buffer stays
//! in the table, and its completion — whenever it comes, in a later batch
//! or a later wait of the reactor — frees the buffer and nothing else: the
//! op's generation-tagged user_data and its batch number cannot match a
//! read of a newer batch. Dropping the ring follows the core's contract
//! (cancel, wait, leak what the kernel still holds).
//!
//! The fds are only borrowed: every read is submitted before the call
//! returns, and the kernel holds its own reference to the file from then on.

use std::io;
use std::os::fd::{AsRawFd, BorrowedFd};
use std::time::{Duration, Instant};

use io_uring::{opcode, types};

use super::core::UringCore;
use super::ops::{Reaped, IGNORED};
use super::setup::RingSetup;
use super::BackendChoice;

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

/// Something that performs a batch of reads on the calling thread: a
/// standalone [`BatchReader`], or a ring thread's reactor (from inside its
/// driver), so code that samples can run on either.
pub trait ReadBatch {
    /// Performs every read in `reads`, each result in its entry, waiting at
    /// most `timeout` (reads still in flight then time out). Returns an
    /// error only when the ring itself fails (reads not done then say so).
    fn read_batch(&mut self, reads: &mut [BatchRead<'_>], timeout: Duration) -> io::Result<()>;
}

/// A ring of its own for batches of reads (io_uring, or `pread` where the
/// kernel forbids it).
pub struct BatchReader {
    core: Option<UringCore<BatchOp>>,
    /// Reads in flight at once (the submission queue's size).
    depth: usize,
    batches: Batches,
}

/// A read in flight: where its result goes, and its buffer.
pub(crate) struct BatchOp {
    batch: u64,
    index: usize,
    buf: Vec<u8>,
}

/// What an op table holds, for batch reads to run through it: the batch
/// reader's table holds only reads, the reactor's wraps them among its ops.
pub(crate) trait HoldsBatchOp: Sized {
    fn from_batch(op: BatchOp) -> Self;
    /// The read, or the op back when it is another kind.
    fn into_batch(self) -> Result<BatchOp, Self>;
}

impl HoldsBatchOp for BatchOp {
    fn from_batch(op: BatchOp) -> Self {
        op
    }

    fn into_batch(self) -> Result<BatchOp, Self> {
        Ok(self)
    }
}

/// How long a deadline waits for cancelled reads.
const CANCEL_WAIT: Duration = Duration::from_millis(100);

impl BatchReader {
    /// `depth`: how many reads are in flight at once.
    pub fn new(choice: BackendChoice, depth: u32) -> io::Result<Self> {
        let none = Self { core: None, depth: 0, batches: Batches::default() };
        if choice == BackendChoice::Epoll {
            return Ok(none);
        }
        // DEFER_TASKRUN needs 6.1; older kernels get a plain ring.
        match RingSetup::new(depth).build() {
            Ok((r, _)) => {
                let depth = r.params().sq_entries() as usize;
                Ok(Self { core: Some(UringCore::new(r, CANCEL_WAIT)), depth, ..none })
            }
            Err(e) if choice == BackendChoice::IoUring => Err(e),
            Err(_) => Ok(none),
        }
    }

    /// Queues a no-op carrying `user_data`: a completion the next batch sees.
    #[cfg(test)]
    fn inject_completion(&mut self, user_data: u64) {
        let core = self.core.as_mut().expect("a ring");
        // SAFETY: a no-op points at no memory.
        unsafe { core.push(&opcode::Nop::new().build().user_data(user_data)) }.unwrap();
    }
}

impl ReadBatch for BatchReader {
    fn read_batch(&mut self, reads: &mut [BatchRead<'_>], timeout: Duration) -> io::Result<()> {
        let Some(core) = self.core.as_mut() else {
            pread_all(reads);
            return Ok(());
        };
        // Only reads and cancel requests are in this ring: nothing else to keep.
        let mut others = Vec::new();
        self.batches.run(core, self.depth, reads, timeout, &mut others)
    }
}

/// The fallback: each read with `pread`, now.
pub(crate) fn pread_all(reads: &mut [BatchRead<'_>]) {
    for r in reads.iter_mut() {
        r.result = rustix::io::pread(r.fd, &mut r.buf, r.offset).map_err(io::Error::from);
    }
}

/// The batch numbering of one ring: reads of an older batch still in its
/// table are abandoned ones.
#[derive(Default)]
pub(crate) struct Batches {
    /// Number of the current batch.
    batch: u64,
    /// Completions of abandoned reads that arrived after their batch.
    late: u64,
    #[cfg(test)]
    last_user_data: u64,
}

impl Batches {
    /// An abandoned read ended outside a batch: its buffer is free now.
    pub(crate) fn late_completion(&mut self) {
        self.late += 1;
    }

    /// Runs one batch on `core`, at most `depth` reads in flight and never
    /// past the core's cap (so no read waits in its backlog, unsubmitted,
    /// when the call returns). Completions of `core`'s other ops go to
    /// `others`, for the ring's next wait.
    pub(crate) fn run<T: HoldsBatchOp>(
        &mut self,
        core: &mut UringCore<T>,
        depth: usize,
        reads: &mut [BatchRead<'_>],
        timeout: Duration,
        others: &mut Vec<Reaped<T>>,
    ) -> io::Result<()> {
        self.batch += 1;
        let mut run = Run { batch: self.batch, pending: vec![None; reads.len()], outstanding: 0, late: 0 };
        let deadline = Instant::now() + timeout;
        let mut next = 0;
        let mut reaped = Vec::new();
        let result = 'batch: loop {
            while next < reads.len() && run.outstanding < depth.max(1) && core.has_room() {
                let r = &mut reads[next];
                let (fd, offset, len) = (r.fd.as_raw_fd(), r.offset, u32::try_from(r.buf.len()).unwrap_or(u32::MAX));
                let mut buf = std::mem::take(&mut r.buf);
                let ptr = buf.as_mut_ptr();
                let op = T::from_batch(BatchOp { batch: run.batch, index: next, buf });
                // SAFETY: the sqe points into the read's heap buffer (moving
                // the Vec into the table does not move its heap memory), which
                // the core keeps until the read's last completion. The fd is
                // only borrowed, but every read is submitted before this call
                // returns, and the kernel holds its own reference to the file
                // from then on.
                let started =
                    unsafe { core.try_start(op, |_, ud| opcode::Read::new(types::Fd(fd), ptr, len).offset(offset).build().user_data(ud)) };
                match started {
                    Ok(ud) => {
                        #[cfg(test)]
                        {
                            self.last_user_data = ud;
                        }
                        run.pending[next] = Some(ud);
                        run.outstanding += 1;
                        next += 1;
                    }
                    Err((e, op)) => {
                        if let Ok(op) = op.into_batch() {
                            reads[op.index].buf = op.buf;
                        }
                        break 'batch Err(e);
                    }
                }
            }
            if next == reads.len() && run.outstanding == 0 {
                break Ok(());
            }
            let now = Instant::now();
            if now >= deadline {
                break Ok(());
            }
            if let Err(e) = core.submit_and_wait(1, Some(deadline - now)) {
                break Err(e);
            }
            reaped.clear();
            core.reap(&mut reaped);
            run.settle(&mut reaped, reads, others);
        };
        if run.outstanding > 0 {
            run.abandon(core, reads, others);
        }
        // Not submitted: the ring failed, or it had no room (other ops and
        // reads the kernel still holds fill its cap) until the deadline.
        let (kind, why) = match result {
            Err(_) => (io::ErrorKind::Other, "read not submitted: the ring failed"),
            Ok(()) => (io::ErrorKind::TimedOut, "read not submitted: no room in the ring before the deadline"),
        };
        for r in &mut reads[next..] {
            r.result = Err(io::Error::new(kind, why));
        }
        self.late += run.late;
        // Whatever is queued goes to the kernel now, while the fds are open.
        result.and(core.submit_and_wait(0, None))
    }
}

/// One batch's reads in flight.
struct Run {
    batch: u64,
    /// user_data of each read still in flight.
    pending: Vec<Option<u64>>,
    outstanding: usize,
    late: u64,
}

impl Run {
    /// Puts each finished read's buffer and result back in its entry;
    /// completions of other ops go to `others`.
    fn settle<T: HoldsBatchOp>(&mut self, reaped: &mut Vec<Reaped<T>>, reads: &mut [BatchRead<'_>], others: &mut Vec<Reaped<T>>) {
        for c in reaped.drain(..) {
            let Reaped { user_data, res, flags, more, last } = c;
            let Some(op) = last else {
                // A cancel request's completion is nobody's; the rest (the
                // mailbox's poll, a multishot's) are the ring's.
                if user_data != IGNORED {
                    others.push(Reaped { user_data, res, flags, more, last: None });
                }
                continue;
            };
            let op = match op.into_batch() {
                Ok(op) => op,
                Err(other) => {
                    others.push(Reaped { user_data, res, flags, more, last: Some(other) });
                    continue;
                }
            };
            if op.batch != self.batch {
                // An abandoned read of an earlier batch ended: its buffer is
                // free now, and its result belongs to nobody.
                self.late += 1;
                continue;
            }
            let r = &mut reads[op.index];
            r.buf = op.buf;
            r.result = if res < 0 { Err(io::Error::from_raw_os_error(-res)) } else { Ok(res as usize) };
            self.pending[op.index] = None;
            self.outstanding -= 1;
        }
    }

    /// Cancels what is still in flight after the deadline and waits a
    /// little; reads the kernel still holds keep their buffers in the table.
    fn abandon<T: HoldsBatchOp>(&mut self, core: &mut UringCore<T>, reads: &mut [BatchRead<'_>], others: &mut Vec<Reaped<T>>) {
        let late: Vec<usize> = self.pending.iter().enumerate().filter(|(_, p)| p.is_some()).map(|(i, _)| i).collect();
        for ud in self.pending.iter().flatten() {
            if core.cancel(*ud).is_err() {
                break;
            }
        }
        let until = Instant::now() + CANCEL_WAIT;
        let mut reaped = Vec::new();
        while self.outstanding > 0 {
            let left = until.saturating_duration_since(Instant::now());
            if left.is_zero() || core.submit_and_wait(1, Some(left.min(Duration::from_millis(10)))).is_err() {
                break;
            }
            core.reap(&mut reaped);
            self.settle(&mut reaped, reads, others);
        }
        // Cancelled, or still held by the kernel: either way it timed out.
        for i in late {
            let cancelled = matches!(&reads[i].result, Err(e) if e.raw_os_error() == Some(libc::ECANCELED));
            if cancelled || self.pending[i].is_some() {
                reads[i].result = Err(io::Error::new(io::ErrorKind::TimedOut, "read did not complete before the deadline"));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsFd;

    #[test]
    fn a_stale_completion_from_an_earlier_batch_does_not_finish_a_new_read() {
        let mut reader = BatchReader::new(BackendChoice::IoUring, 8).unwrap();
        let (quiet, _quiet_w) = rustix::pipe::pipe_with(rustix::pipe::PipeFlags::CLOEXEC).unwrap();
        let mut first = [BatchRead::new(quiet.as_fd(), 0, vec![0; 16])];
        reader.read_batch(&mut first, Duration::from_millis(10)).unwrap();
        assert_eq!(first[0].result.as_ref().unwrap_err().kind(), io::ErrorKind::TimedOut);
        // The abandoned read's completion arrives during the next batch (as
        // it does when a hung device lets go late), ahead of the new read's.
        reader.inject_completion(reader.batches.last_user_data);
        let (r, w) = rustix::pipe::pipe_with(rustix::pipe::PipeFlags::CLOEXEC).unwrap();
        rustix::io::write(&w, b"fresh").unwrap();
        let mut second = [BatchRead::new(r.as_fd(), 0, vec![0; 16])];
        reader.read_batch(&mut second, Duration::from_secs(5)).unwrap();
        assert_eq!(second[0].data(), b"fresh", "the new read's result is its own");
    }

    #[test]
    fn abandoned_reads_keep_their_buffer_until_the_kernel_lets_go() {
        let mut reader = BatchReader::new(BackendChoice::IoUring, 8).unwrap();
        let (quiet, _w) = rustix::pipe::pipe_with(rustix::pipe::PipeFlags::CLOEXEC).unwrap();
        let mut reads = [BatchRead::new(quiet.as_fd(), 0, vec![0; 16]), BatchRead::new(quiet.as_fd(), 0, vec![0; 16])];
        reader.read_batch(&mut reads, Duration::from_millis(10)).unwrap();
        for r in &reads {
            assert_eq!(r.result.as_ref().unwrap_err().kind(), io::ErrorKind::TimedOut);
        }
        let core = reader.core.as_ref().unwrap();
        assert!(core.ops().is_empty(), "pipe reads cancel at once: reaped, buffers handed back");
        assert!(reads.iter().all(|r| r.buf.len() == 16));
    }
}
