//! [`UringCore`]: one io_uring and the table of what its operations hold.
//!
//! Every io_uring in the crate (a ring thread's reactor, a batch reader, an
//! NBD server ring) is one of these, so all of them share one rule for the
//! memory the kernel may touch: it lives in the op table, under the op's
//! user_data, until the op's last completion has been reaped. Dropping the
//! core — on a clean stop, an early return, or while a panic unwinds —
//! cancels every op, waits (bounded) for their last completions, and only
//! then lets what they held be freed. What the kernel has not let go of by
//! the deadline is leaked on purpose: counted and logged.

use std::collections::VecDeque;
use std::io;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use io_uring::{cqueue, opcode, squeue, types, IoUring};

use super::ops::{is_reserved, OpTable, Reaped, CANCEL_ALL, IGNORED};

/// Completions one reap's buffer keeps room for when its ring is idle.
const KEPT_CQES: usize = 256;

static LEAKED_OPS: AtomicU64 = AtomicU64::new(0);

#[cfg(test)]
/// Operations (with their buffers) this process gave up on because the
/// kernel still held them when their ring was dropped.
pub(crate) fn leaked_ops() -> u64 {
    LEAKED_OPS.load(Ordering::Relaxed)
}

/// A ring and its op table; `T` is what one op holds.
///
/// Never more entries are in the kernel than its completion queue holds
/// (as firecracker does): an entry counts from when it is queued until its
/// last completion is reaped, and one that would go past the cap waits in
/// a backlog, in order, until completions make room. A burst of
/// completions then always fits the queue; nothing relies on the kernel's
/// overflow list.
pub(super) struct UringCore<T> {
    ring: IoUring,
    ops: OpTable<T>,
    cqes: Vec<cqueue::Entry>,
    /// How long dropping waits for cancelled ops to end.
    cancel_wait: Duration,
    /// Entries queued or submitted whose last completion is not reaped yet.
    in_kernel: usize,
    /// Most entries in the kernel at once.
    cap: usize,
    /// Entries waiting for room under the cap, oldest first.
    backlog: VecDeque<squeue::Entry>,
    /// Completions of backlogged ops cancelled before they reached the
    /// kernel: (user_data, result), delivered at the next reap.
    unsent: Vec<(u64, i32)>,
    /// Calls of `io_uring_enter` so far (submits and waits).
    enters: u64,
}

/// What a ring has waiting, short of waiting for it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Pending {
    /// Completions to reap.
    Completions,
    /// Task work the kernel queued for this thread (`IORING_SQ_TASKRUN`,
    /// kept by a ring made with `TASKRUN_FLAG`): an enter with GETEVENTS
    /// runs it, which may post completions.
    TaskWork,
    Nothing,
}

impl<T> UringCore<T> {
    pub(super) fn new(ring: IoUring, cancel_wait: Duration) -> Self {
        let cap = ring.params().cq_entries() as usize;
        Self {
            ring,
            ops: OpTable::with_capacity(64),
            cqes: Vec::with_capacity(KEPT_CQES),
            cancel_wait,
            in_kernel: 0,
            cap,
            backlog: VecDeque::new(),
            unsent: Vec::new(),
            enters: 0,
        }
    }

    /// Keeps `headroom` completion slots free of the cap, for completions
    /// that do not end an entry (a multishot receive's, one per buffer).
    pub(super) fn with_headroom(mut self, headroom: usize) -> Self {
        let cq = self.ring.params().cq_entries() as usize;
        self.cap = cq.saturating_sub(headroom).max(cq / 2).max(1);
        self
    }

    #[cfg(test)]
    /// Entries in the kernel now (never more than the cap).
    pub(super) fn in_kernel(&self) -> usize {
        self.in_kernel
    }

    /// Whether one more entry would go to the kernel at once, not to the
    /// backlog.
    pub(super) fn has_room(&self) -> bool {
        self.in_kernel < self.cap && self.backlog.is_empty()
    }

    /// Entries waiting for room under the cap.
    pub(super) fn backlogged(&self) -> usize {
        self.backlog.len()
    }

    /// Whether the kernel holds completions the queue had no room for.
    #[cfg(test)]
    pub(super) fn cq_overflowed(&mut self) -> bool {
        self.ring.submission().cq_overflow()
    }

    /// The kernel's probe of the operations it supports.
    pub(super) fn probe(&self) -> io::Result<io_uring::Probe> {
        let mut probe = io_uring::Probe::new();
        self.ring.submitter().register_probe(&mut probe)?;
        Ok(probe)
    }

    /// The ring itself, for what is registered before it is enabled.
    pub(super) fn ring(&self) -> &IoUring {
        &self.ring
    }

    /// For registering files and buffers.
    pub(super) fn submitter(&self) -> io_uring::Submitter<'_> {
        self.ring.submitter()
    }

    pub(super) fn ops(&self) -> &OpTable<T> {
        &self.ops
    }

    /// Queues `sqe`, handing what is queued to the kernel when the
    /// submission queue is full.
    ///
    /// # Safety
    /// Every pointer in `sqe` must stay valid until the operation's last
    /// completion: it points into the payload of the op its user_data names
    /// (which this core keeps until then), or at memory that outlives the
    /// core. A sqe with a reserved user_data must point at no memory.
    pub(super) unsafe fn push(&mut self, sqe: &squeue::Entry) -> io::Result<()> {
        if self.in_kernel >= self.cap || !self.backlog.is_empty() {
            self.backlog.push_back(sqe.clone());
            return Ok(());
        }
        // SAFETY: forwarded from the caller.
        unsafe { self.push_now(sqe) }
    }

    /// Queues `sqe` for the kernel, handing what is queued over when the
    /// submission queue is full.
    ///
    /// # Safety
    /// As [`UringCore::push`].
    unsafe fn push_now(&mut self, sqe: &squeue::Entry) -> io::Result<()> {
        loop {
            // SAFETY: the caller vouches for the pointers in `sqe`.
            if unsafe { self.ring.submission().push(sqe) }.is_ok() {
                self.in_kernel += 1;
                return Ok(());
            }
            self.enters += 1;
            self.ring.submit()?;
        }
    }

    /// Moves backlogged entries to the kernel while there is room.
    fn flush_backlog(&mut self) {
        while self.in_kernel < self.cap {
            let Some(sqe) = self.backlog.pop_front() else { return };
            // SAFETY: it was pushed under `push`'s contract, and what it
            // points into is still held by its op in the table.
            if let Err(e) = unsafe { self.push_now(&sqe) } {
                tracing::warn!(error = %e, "ring submit failed; backlogged operations wait");
                self.backlog.push_front(sqe);
                return;
            }
        }
    }

    /// Records `op` and queues the sqe `build` makes from it and its user_data.
    ///
    /// # Safety
    /// As [`UringCore::push`]: the sqe may point into `op` (which moves into
    /// the table, so only into memory `op` owns on the heap, never into `op`
    /// itself) or at memory that outlives the core.
    pub(super) unsafe fn start(&mut self, op: T, build: impl FnOnce(&mut T, u64) -> squeue::Entry) -> io::Result<u64> {
        // SAFETY: forwarded from the caller.
        unsafe { self.try_start(op, build) }.map_err(|(e, _)| e)
    }

    /// [`UringCore::start`] that gives the op back when it could not be queued.
    ///
    /// # Safety
    /// As [`UringCore::start`].
    pub(super) unsafe fn try_start(&mut self, op: T, build: impl FnOnce(&mut T, u64) -> squeue::Entry) -> Result<u64, (io::Error, T)> {
        let ud = self.ops.insert(op);
        let op = self.ops.get_mut(ud).expect("just inserted");
        let sqe = build(op, ud);
        // SAFETY: forwarded from the caller.
        match unsafe { self.push(&sqe) } {
            Ok(()) => Ok(ud),
            // The queue was full and the kernel refused a submit: the sqe is
            // not queued, so nothing refers to the op.
            Err(e) => Err((e, self.ops.remove(ud).expect("just inserted"))),
        }
    }

    /// Asks the kernel to end the op `ud` (its last completion still comes).
    pub(super) fn cancel(&mut self, ud: u64) -> io::Result<()> {
        if !self.ops.contains(ud) {
            return Ok(());
        }
        // Not in the kernel yet: it ends here, as if the kernel had cancelled it.
        if let Some(i) = self.backlog.iter().position(|e| e.get_user_data() == ud) {
            self.backlog.remove(i);
            self.unsent.push((ud, -libc::ECANCELED));
            return Ok(());
        }
        // SAFETY: a cancel request points at no memory.
        unsafe { self.push(&opcode::AsyncCancel::new(ud).build().user_data(IGNORED)) }
    }

    /// Submits what is queued; waits for `want` completions, at most `timeout`.
    /// Timeouts, signals and a full completion queue are not errors.
    pub(super) fn submit_and_wait(&mut self, want: usize, timeout: Option<Duration>) -> io::Result<()> {
        self.enters += 1;
        let r = match timeout {
            None => self.ring.submit_and_wait(want),
            Some(t) => {
                let ts = types::Timespec::from(t);
                self.ring.submitter().submit_with_args(want, &types::SubmitArgs::new().timespec(&ts))
            }
        };
        quiet(r)
    }

    /// Calls of `io_uring_enter` so far: what a request costs in kernel
    /// entries, against the requests served.
    pub(super) fn enters(&self) -> u64 {
        self.enters
    }

    /// Whether entries wait in the submission queue for the next enter.
    pub(super) fn queued(&mut self) -> bool {
        !self.ring.submission().is_empty()
    }

    /// What is waiting to be reaped, read from the rings' shared memory
    /// without a system call.
    pub(super) fn pending(&mut self) -> Pending {
        if !self.unsent.is_empty() || !self.ring.completion().is_empty() {
            Pending::Completions
        } else if self.ring.submission().taskrun() {
            Pending::TaskWork
        } else {
            Pending::Nothing
        }
    }

    /// `submit_with_args` with caller-made arguments (min_wait).
    pub(super) fn submit_with_args(&mut self, want: usize, args: &types::SubmitArgs<'_, '_>) -> io::Result<()> {
        self.enters += 1;
        quiet(self.ring.submitter().submit_with_args(want, args))
    }

    /// For an idle ring: gives back the op table's and the completion
    /// buffer's room past what steady work needs (see [`OpTable::shrink`]).
    /// Returns the bytes freed.
    pub(super) fn trim(&mut self) -> usize {
        let mut freed = self.ops.shrink();
        if self.cqes.capacity() > KEPT_CQES {
            freed += (self.cqes.capacity() - KEPT_CQES) * std::mem::size_of::<cqueue::Entry>();
            self.cqes = Vec::with_capacity(KEPT_CQES);
        }
        if self.backlog.is_empty() && self.backlog.capacity() > 0 {
            freed += self.backlog.capacity() * std::mem::size_of::<squeue::Entry>();
            self.backlog = VecDeque::new();
        }
        freed
    }

    /// Matches every available completion to its op. Completions of
    /// reserved user_data come out with `last: None` and are the caller's to
    /// recognise; stale ones are dropped (and counted by the table).
    pub(super) fn reap(&mut self, out: &mut Vec<Reaped<T>>) {
        let mut cqes = std::mem::take(&mut self.cqes);
        cqes.extend(self.ring.completion());
        let ended = cqes.iter().filter(|c| !cqueue::more(c.flags())).count();
        self.in_kernel = self.in_kernel.saturating_sub(ended);
        let unsent = std::mem::take(&mut self.unsent).into_iter().map(|(ud, res)| (ud, res, 0));
        for (ud, res, flags) in unsent.chain(cqes.drain(..).map(|c| (c.user_data(), c.result(), c.flags()))) {
            let more = cqueue::more(flags);
            if is_reserved(ud) {
                out.push(Reaped { user_data: ud, res, flags, more, last: None });
            } else if let Some(r) = self.ops.complete(ud, res, flags, more) {
                out.push(r);
            }
        }
        self.cqes = cqes;
        self.flush_backlog();
    }

    /// Cancels every op and waits up to the core's deadline for their last
    /// completions, releasing what each held as it ends. Returns how many
    /// the kernel still holds (their payloads are leaked, never freed).
    pub(super) fn shutdown(&mut self) -> usize {
        if self.ops.is_empty() {
            return 0;
        }
        // Ops queued but not yet submitted go in first, so the cancel finds
        // them (or they end at once). One request cancels them all (5.19+);
        // where the kernel refuses it, each op is cancelled by user_data.
        // Backlogged ops never reached the kernel: they end here.
        for sqe in std::mem::take(&mut self.backlog) {
            self.unsent.push((sqe.get_user_data(), -libc::ECANCELED));
        }
        let _ = self.ring.submit();
        let any = opcode::AsyncCancel2::new(types::CancelBuilder::any()).build().user_data(CANCEL_ALL);
        // SAFETY: a cancel request points at no memory. Past the cap if
        // need be: the ring is going, and the cap keeps headroom.
        if unsafe { self.push_now(&any) }.is_err() {
            self.cancel_each();
        }
        let deadline = Instant::now() + self.cancel_wait;
        let mut reaped = Vec::new();
        while !self.ops.is_empty() {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                break;
            }
            if let Err(e) = self.submit_and_wait(1, Some(left.min(Duration::from_millis(20)))) {
                tracing::warn!(error = %e, "ring failed while waiting for cancelled operations");
                break;
            }
            reaped.clear();
            self.reap(&mut reaped);
            if reaped.iter().any(|r| r.user_data == CANCEL_ALL && r.res == -libc::EINVAL) {
                self.cancel_each();
            }
        }
        reaped.clear();
        let left = self.ops.leak_all();
        if left > 0 {
            LEAKED_OPS.fetch_add(left as u64, Ordering::Relaxed);
            tracing::warn!(operations = left, "ring dropped while the kernel still holds operations; leaking their memory");
        }
        left
    }
}

impl<T> UringCore<T> {
    fn cancel_each(&mut self) {
        for ud in self.ops.user_datas() {
            if self.cancel(ud).is_err() {
                break;
            }
        }
    }
}

fn quiet(r: io::Result<usize>) -> io::Result<()> {
    match r {
        Ok(_) => Ok(()),
        Err(e) if matches!(e.raw_os_error(), Some(libc::ETIME) | Some(libc::EINTR) | Some(libc::EBUSY)) => Ok(()),
        Err(e) => Err(e),
    }
}

impl<T> Drop for UringCore<T> {
    /// The Drop contract: nothing an op holds is freed while the kernel may
    /// still use it.
    fn drop(&mut self) {
        self.shutdown();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsRawFd;

    #[test]
    fn dropping_cancels_and_reaps_reads_in_flight() {
        let (r, _w) = rustix::pipe::pipe_with(rustix::pipe::PipeFlags::CLOEXEC).unwrap();
        let mut core = UringCore::new(IoUring::new(8).unwrap(), Duration::from_secs(2));
        for _ in 0..4 {
            // SAFETY: the sqe points into the payload's heap buffer.
            unsafe {
                core.start(vec![0u8; 64], |buf, ud| opcode::Read::new(types::Fd(r.as_raw_fd()), buf.as_mut_ptr(), 64).build().user_data(ud))
            }
            .unwrap();
        }
        core.submit_and_wait(0, None).unwrap();
        assert_eq!(core.ops().len(), 4);
        let before = leaked_ops();
        assert_eq!(core.shutdown(), 0, "every read was cancelled and reaped");
        assert!(core.ops().is_empty());
        assert_eq!(leaked_ops(), before);
    }
}
