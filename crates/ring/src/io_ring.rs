//! [`IoRing`]: the io_uring engine of a network server's ring thread.
//!
//! The generic [`super::Reactor`] serves watchers that poll and read a few
//! files; a server needs more: multishot accept, multishot receive into
//! provided buffers, vectored sends, reads and writes of registered files
//! from registered buffers, and thousands of operations in flight. This
//! type owns every byte and descriptor those operations touch until their
//! last completion, so the driver above it needs no `unsafe`: it names
//! buffers by [`BufId`] and sockets and images by their fixed-file slot.
//!
//! Its ops live in a [`UringCore`] (see the module docs of [`super`] for
//! the op life cycle and the Drop contract); the buffer arena and the
//! receive pool are shared by many ops, so when the core reports ops the
//! kernel would not let go of, they are leaked with them.
//!
//! It needs a 6.0+ kernel (multishot receive, provided buffer rings, sparse
//! file tables); [`IoRing::new`] fails cleanly when any of that is missing.
//! What it may submit is in `allowed.rs`.
//!
//! Every submitter stays in this file: each pushes an SQE whose buffers and
//! descriptors the same op table must own until the last completion, and
//! keeping them beside that table is what lets a reader check each
//! `// SAFETY:` against the table's rules in one place. The splice pipes'
//! pool (`pipes.rs`), and the sizes and rlimit helpers of `new`
//! (`setup.rs`), live apart.

use std::io;
use std::mem::ManuallyDrop;
use std::os::fd::RawFd;
use std::time::{Duration, Instant};

use io_uring::{cqueue, opcode, squeue, types};

use super::allowed::{missing_opcode, restrictions, MissingOpcode};
use super::buffers::{BufId, Buffers, RecvPool};
use super::core::{Pending, UringCore};
use super::io_op::{BufSlice, Cqe, IoRingStats, Op as Sqe, OpId, PipeId};
use super::ops::Reaped;
use super::pipes::{PipePool, PIPE_SIZE};
use super::setup::{pinned_memory, raise_nofile_limit, IoRingConfig, RingSetup};

/// What an operation holds until its last completion.
enum Held {
    Nothing,
    Pipe(u32),
    Buf(BufId),
    /// Bytes of this provided receive buffer, lent to a write.
    Lent(u16),
    Send {
        bufs: Vec<BufId>,
        iov: Vec<libc::iovec>,
        msg: Box<libc::msghdr>,
        /// Counted in `IoRing::settling` until it ends.
        at_once: bool,
    },
    Timeout(
        #[allow(dead_code)] // only kept alive for the kernel
        Box<types::Timespec>,
    ),
    /// A close of this fixed slot: the slot is free once it completes.
    Close(u32),
    /// A receive from the provided buffers (multishot or once), armed when the
    /// ring had handed out `epoch` buffers and the driver held none
    /// (`idle`).
    Recv {
        epoch: u64,
        idle: bool,
    },
}

struct Op<T> {
    token: T,
    held: Held,
}

/// How long dropping the ring waits for cancelled ops.
const CANCEL_WAIT: Duration = Duration::from_secs(2);

/// The ring, its registered resources and its in-flight table.
pub struct IoRing<T: Copy = u64> {
    /// First field: dropped before the memory below (which `Drop` leaks
    /// instead when the core could not end every op).
    core: UringCore<Op<T>>,
    bufs: ManuallyDrop<Buffers>,
    recv: ManuallyDrop<RecvPool>,
    free_files: Vec<u32>,
    /// Spare vectors for sends, so a send allocates nothing in steady state.
    spare_iov: Vec<Vec<libc::iovec>>,
    spare_bufs: Vec<Vec<BufId>>,
    reaped: Vec<Reaped<Op<T>>>,
    pipes: PipePool,
    /// The kernel refused `min_wait_usec` once (before 6.12): not asked again.
    no_min_wait: bool,
    /// Receives from the provided buffers (multishot or once) armed and
    /// not ended.
    armed_recvs: usize,
    /// Completions that carried a provided buffer, since the ring was made.
    recv_epoch: u64,
    /// The kernel said its provided buffers ran out while it should have
    /// held them all: it lost some (see [`IoRingStats::recv_pool_lost`]).
    recv_lost: bool,
    /// Times the receive pool was handed to the kernel afresh.
    recv_resets: u64,
    /// The receive pool's pages went back to the kernel at a trim and no
    /// receive has been armed since (see [`IoRing::trim`]).
    recv_discarded: bool,
    /// Sends queued `at_once` and not yet reaped ([`IoRingStats::settling`]).
    settling: usize,
}

/// Completion slots kept free of the cap on entries in the kernel, beyond
/// one per provided buffer: for the other multishot completions (accepts,
/// the mailbox's poll) that can come in one burst.
const CQ_HEADROOM: usize = 256;

impl<T: Copy> IoRing<T> {
    /// Makes the ring: disabled until the operations it needs have been
    /// probed (a `MissingOpcode` error names the first one the kernel
    /// lacks), its buffers and file table registered, and its restrictions
    /// (`IoRing::OPCODES` only, and no other registration than the ring
    /// itself makes) registered.
    ///
    /// The first ring also pins the process allocator's mmap and trim
    /// thresholds, for every thread of the process (see
    /// `allocator::pin_thresholds`): without that, [`IoRing::trim`] could
    /// not give a burst's memory back.
    pub fn new(cfg: &IoRingConfig) -> io::Result<Self> {
        crate::allocator::pin_thresholds();
        // DEFER_TASKRUN (6.1) runs completions only when this thread asks:
        // fewer interruptions of the ring thread. Older kernels get the rest.
        let setup = RingSetup { entries: cfg.sq_entries, cq_entries: Some(cfg.cq_entries), server: true, disabled: true };
        let (ring, _) = setup.build()?;
        // Known from the ring's features, not only from an EINVAL: an enter
        // that also submits reports how many it submitted and drops the
        // error, so a refused min_wait would not wait at all (before 6.12).
        let no_min_wait = !ring.params().is_feature_min_timeout();
        let core = UringCore::new(ring, CANCEL_WAIT).with_headroom(usize::from(cfg.recv_bufs) + CQ_HEADROOM);
        let probe = core.probe()?;
        if let Some(name) = missing_opcode(|code| probe.is_supported(code)) {
            return Err(io::Error::new(io::ErrorKind::Unsupported, MissingOpcode { name }));
        }
        let ring = core.ring();
        let bufs = Buffers::new(cfg.arena_slots, cfg.arena_slot_size, cfg.heap_cache)?;
        let iovecs = bufs.arena_iovecs();
        // SAFETY: the arena mapping outlives the ring: `Drop` unregisters or
        // leaks it, and the iovecs describe exactly that mapping.
        unsafe { ring.submitter().register_buffers(&iovecs).map_err(|e| pinned_memory(e, &iovecs))? };
        // The kernel refuses a file table larger than RLIMIT_NOFILE: raise the
        // soft limit to the hard one, and fit the table under what is left.
        let files = cfg.files.min(raise_nofile_limit().saturating_sub(64).max(64));
        ring.submitter().register_files_sparse(files)?;
        let recv = RecvPool::new(cfg.recv_bufs, cfg.recv_buf_size, 0)?;
        // SAFETY: the ring memory belongs to `recv`, which lives as long as
        // the ring (dropped after it, or leaked with it).
        unsafe { ring.submitter().register_buf_ring_with_flags(recv.ring_addr(), recv.entries(), recv.group, 0)? };
        ring.submitter().register_restrictions(&mut restrictions())?;
        ring.submitter().register_enable_rings()?;
        Ok(Self {
            core,
            bufs: ManuallyDrop::new(bufs),
            recv: ManuallyDrop::new(recv),
            free_files: (0..files).rev().collect(),
            spare_iov: Vec::new(),
            spare_bufs: Vec::new(),
            reaped: Vec::with_capacity(1024),
            pipes: PipePool::default(),
            no_min_wait,
            armed_recvs: 0,
            recv_epoch: 0,
            recv_lost: false,
            recv_resets: 0,
            recv_discarded: false,
            settling: 0,
        })
    }

    /// The ring's buffers, to fill, read and free between operations.
    pub fn buffers(&mut self) -> &mut Buffers {
        &mut self.bufs
    }

    /// A snapshot of the ring's diagnostics (see [`IoRingStats`]).
    pub fn stats(&self) -> IoRingStats {
        IoRingStats {
            in_flight: self.core.ops().len(),
            armed_recvs: self.armed_recvs,
            recv_taken: self.recv.taken(),
            recv_lent: self.recv.lent(),
            recv_pool_lost: self.recv_lost,
            stale_completions: self.core.ops().stale(),
            recv_counts: self.recv.counts,
            recv_pool_resets: self.recv_resets,
            settling: self.settling,
            enters: self.core.enters(),
            backlogged: self.core.backlogged(),
        }
    }

    #[cfg(test)]
    /// Entries in the kernel now (capped by what the completion queue
    /// holds), and those waiting for room.
    pub(crate) fn in_kernel(&self) -> (usize, usize) {
        (self.core.in_kernel(), self.core.backlogged())
    }

    /// The bytes a receive put in provided buffer `bid`, next to the
    /// buffers (to copy a write's payload straight into its own buffer).
    pub fn received(&mut self, bid: u16, len: usize) -> (&[u8], &mut Buffers) {
        (self.recv.data(bid, len), &mut self.bufs)
    }

    /// Hands a provided buffer back to the kernel (a buffer that is not
    /// out, or already back, is ignored).
    pub fn recycle(&mut self, bid: u16) {
        self.recv.recycle(bid);
    }

    /// Puts `fd` into a fixed-file slot (the ring takes its own reference,
    /// so the caller may close `fd` afterwards).
    pub fn register_file(&mut self, fd: RawFd) -> io::Result<u32> {
        let slot = self.free_files.pop().ok_or_else(|| io::Error::from_raw_os_error(libc::ENFILE))?;
        match self.core.submitter().register_files_update(slot, &[fd]) {
            Ok(_) => Ok(slot),
            Err(e) => {
                self.free_files.push(slot);
                Err(e)
            }
        }
    }

    /// Empties a fixed-file slot at once (for images: their operations have
    /// ended; sockets go through `IoRing::close_file`).
    pub fn unregister_file(&mut self, slot: u32) -> io::Result<()> {
        self.core.submitter().register_files_update(slot, &[-1])?;
        self.free_files.push(slot);
        Ok(())
    }

    fn start(&mut self, token: T, held: Held, build: impl FnOnce(u64) -> squeue::Entry) -> io::Result<OpId> {
        // SAFETY: every pointer in the sqe refers to memory the op holds
        // until its last completion (buffers lent and marked busy, provided
        // buffers lent and kept from the kernel until then, boxed
        // iovecs/msghdr/timespec), to the arena or receive pool (which
        // outlive the core, or are leaked with its ops), or to nothing.
        match unsafe { self.core.try_start(Op { token, held }, |_, ud| build(ud)) } {
            Ok(ud) => Ok(OpId(ud)),
            Err((e, op)) => {
                self.release(op.held);
                Err(e)
            }
        }
    }

    /// Queues `op` under `token` (see [`Op`](crate::Op) for what each
    /// does); its completions carry the token. Fails at once, holding
    /// nothing, when a buffer or pipe it names is stale or the table is full.
    pub fn submit(&mut self, token: T, op: Sqe<'_>) -> io::Result<OpId> {
        match op {
            Sqe::AcceptMulti { listener } => self.accept_multi(token, listener),
            Sqe::PollMulti { fd, events } => self.poll_multi(token, fd, events),
            Sqe::RecvMulti { socket } => self.recv_multi(token, socket),
            Sqe::RecvOnce { socket, len } => self.recv_once(token, socket, len),
            Sqe::RecvInto { socket, into } => self.recv_into(token, socket, into),
            Sqe::Send { socket, parts, at_once } => self.send(token, socket, parts, at_once),
            Sqe::Read { file, into, offset, in_worker: false } => self.read(token, file, into, offset),
            Sqe::Read { file, into, offset, in_worker: true } => self.read_async(token, file, into, offset),
            Sqe::Write { file, from, offset, dsync } => self.write(token, file, from, offset, dsync),
            Sqe::WriteReceived { file, from, offset, dsync } => self.write_received(token, file, from, offset, dsync),
            Sqe::Fsync { file, data_only } => self.fsync(token, file, data_only),
            Sqe::Fallocate { file, mode, offset, len } => self.fallocate(token, file, mode, offset, len),
            Sqe::Fadvise { file, offset, len, advice } => self.fadvise(token, file, offset, len, advice),
            Sqe::Shutdown { socket } => self.shutdown(token, socket),
            Sqe::Close { socket } => self.close_file(token, socket),
            Sqe::Timeout { after } => self.timeout(token, after),
            Sqe::SpliceIn { file, offset, pipe, len } => self.splice_in(token, file, offset, pipe, len.min(PIPE_SIZE as u64) as u32),
            Sqe::SpliceOut { pipe, socket, len } => self.splice_out(token, pipe, socket, len),
        }
    }

    /// Accepts connections on `listener` until cancelled; each completion's
    /// result is a new (close-on-exec) fd.
    fn accept_multi(&mut self, token: T, listener: RawFd) -> io::Result<OpId> {
        self.start(token, Held::Nothing, |ud| opcode::AcceptMulti::new(types::Fd(listener)).flags(libc::SOCK_CLOEXEC).build().user_data(ud))
    }

    /// Waits for `events` on `fd` until cancelled.
    fn poll_multi(&mut self, token: T, fd: RawFd, events: u32) -> io::Result<OpId> {
        self.start(token, Held::Nothing, |ud| opcode::PollAdd::new(types::Fd(fd), events).multi(true).build().user_data(ud))
    }

    /// Receives on a fixed socket into provided buffers until cancelled, the
    /// peer closes, or the pool runs dry (ENOBUFS: arm again after recycling).
    fn recv_multi(&mut self, token: T, socket: u32) -> io::Result<OpId> {
        self.recv_from_pool(token, |group| opcode::RecvMulti::new(types::Fixed(socket), group).build())
    }

    /// Receives once, at most `len` bytes, into a provided buffer (counted
    /// and watched for a lost pool with the multishot receives).
    fn recv_once(&mut self, token: T, socket: u32, len: u32) -> io::Result<OpId> {
        self.recv_from_pool(token, |group| {
            opcode::Recv::new(types::Fixed(socket), std::ptr::null_mut(), len).buf_group(group).build().flags(squeue::Flags::BUFFER_SELECT)
        })
    }

    /// Starts a receive that picks its buffers from the pool (`build` gets
    /// the pool's group).
    fn recv_from_pool(&mut self, token: T, build: impl FnOnce(u16) -> squeue::Entry) -> io::Result<OpId> {
        let group = self.recv.group;
        // Buffers held only by writes (lent) cannot explain an ENOBUFS: the
        // driver caps them below the pool, so they count as none held.
        let held = Held::Recv { epoch: self.recv_epoch, idle: self.recv.taken() == self.recv.lent() };
        // Counted before it starts: a start that fails releases what the op
        // held, and that release takes the count down again. Counted after,
        // a failed start took one off that was never added: the count read
        // 0 with a receive still armed, which `trim` relies on not to drop
        // the pool's pages under it.
        self.armed_recvs += 1;
        self.recv_discarded = false;
        self.start(token, held, |ud| build(group).user_data(ud))
    }

    /// Hands the kernel a fresh ring of every provided buffer the driver
    /// does not hold. Only when no receive from the pool is armed: a receive
    /// holds no buffer once it has ended (its last completion returns
    /// any), so a buffer the kernel lost is referenced by nothing and can
    /// be given again; an armed one might still pick from the old ring.
    pub fn reset_recv_pool(&mut self) -> io::Result<()> {
        if self.armed_recvs != 0 {
            return Err(io::Error::new(io::ErrorKind::WouldBlock, "receives from the pool still armed"));
        }
        self.core.submitter().unregister_buf_ring(self.recv.group)?;
        self.recv.refill();
        // SAFETY: the ring memory belongs to `recv`, which lives as long as
        // the ring (dropped after it, or leaked with it).
        unsafe { self.core.submitter().register_buf_ring_with_flags(self.recv.ring_addr(), self.recv.entries(), self.recv.group, 0)? };
        self.recv_lost = false;
        self.recv_resets += 1;
        Ok(())
    }

    /// Receives from a fixed socket straight into `buf[start..end]` with
    /// MSG_WAITALL (see [`Op::RecvInto`](crate::Op::RecvInto)).
    fn recv_into(&mut self, token: T, socket: u32, (buf, start, end): BufSlice) -> io::Result<OpId> {
        let (ptr, len, _) = self.bufs.lend(buf, start, end).ok_or_else(stale)?;
        self.start(token, Held::Buf(buf), |ud| {
            opcode::Recv::new(types::Fixed(socket), ptr, len).flags(libc::MSG_WAITALL).build().user_data(ud)
        })
    }

    /// Sends `parts` (buffer, start, end) in order with one sendmsg; see
    /// [`Op::Send`](crate::Op::Send) for `at_once`.
    fn send(&mut self, token: T, socket: u32, parts: &[BufSlice], at_once: bool) -> io::Result<OpId> {
        let mut iov = self.spare_iov.pop().unwrap_or_default();
        let mut bufs = self.spare_bufs.pop().unwrap_or_default();
        iov.clear();
        bufs.clear();
        for &(id, start, end) in parts {
            let Some((ptr, len, _)) = self.bufs.lend(id, start, end) else {
                for b in bufs.drain(..) {
                    self.bufs.give_back(b);
                }
                return Err(io::Error::new(io::ErrorKind::InvalidInput, "send of a stale buffer or range"));
            };
            iov.push(libc::iovec { iov_base: ptr.cast(), iov_len: len as usize });
            bufs.push(id);
        }
        // SAFETY: msghdr is a plain C struct for which all-zero is valid.
        let mut msg: Box<libc::msghdr> = Box::new(unsafe { std::mem::zeroed() });
        msg.msg_iov = iov.as_mut_ptr();
        msg.msg_iovlen = iov.len();
        let msg_ptr: *const libc::msghdr = &*msg;
        // Only straight into the kernel does it end during the next submit.
        let at_once = at_once && self.core.has_room();
        let flags = libc::MSG_NOSIGNAL | if at_once { libc::MSG_DONTWAIT } else { 0 };
        // Counted before it starts: a send that cannot start is released,
        // which takes it off again.
        self.settling += usize::from(at_once);
        self.start(token, Held::Send { bufs, iov, msg, at_once }, |ud| {
            opcode::SendMsg::new(types::Fixed(socket), msg_ptr).flags(flags as u32).build().user_data(ud)
        })
    }

    /// Reads `file` at `offset` into `buf[start..end]`.
    fn read(&mut self, token: T, file: u32, slice: BufSlice, offset: u64) -> io::Result<OpId> {
        self.read_with(token, file, slice, offset, squeue::Flags::empty())
    }

    /// Reads like [`read`](Self::read), but in one of io_uring's worker
    /// threads (IOSQE_ASYNC; see [`Op::Read`](crate::Op::Read)'s `in_worker`).
    fn read_async(&mut self, token: T, file: u32, slice: BufSlice, offset: u64) -> io::Result<OpId> {
        self.read_with(token, file, slice, offset, squeue::Flags::ASYNC)
    }

    fn read_with(&mut self, token: T, file: u32, (buf, start, end): BufSlice, offset: u64, flags: squeue::Flags) -> io::Result<OpId> {
        let (ptr, len, index) = self.bufs.lend(buf, start, end).ok_or_else(stale)?;
        self.start(token, Held::Buf(buf), |ud| match index {
            Some(i) => opcode::ReadFixed::new(types::Fixed(file), ptr, len, i).offset(offset).build().flags(flags).user_data(ud),
            None => opcode::Read::new(types::Fixed(file), ptr, len).offset(offset).build().flags(flags).user_data(ud),
        })
    }

    /// Writes `buf[start..end]` to `file` at `offset`; `dsync` makes it
    /// durable before it completes (RWF_DSYNC: the FUA of a file).
    fn write(&mut self, token: T, file: u32, (buf, start, end): BufSlice, offset: u64, dsync: bool) -> io::Result<OpId> {
        let (ptr, len, index) = self.bufs.lend(buf, start, end).ok_or_else(stale)?;
        let flags = if dsync { libc::RWF_DSYNC } else { 0 };
        self.start(token, Held::Buf(buf), |ud| match index {
            Some(i) => opcode::WriteFixed::new(types::Fixed(file), ptr, len, i).offset(offset).rw_flags(flags).build().user_data(ud),
            None => opcode::Write::new(types::Fixed(file), ptr, len).offset(offset).rw_flags(flags).build().user_data(ud),
        })
    }

    /// Writes bytes `start..end` of provided buffer `bid` to `file` at
    /// `offset` (see [`Op::WriteReceived`](crate::Op::WriteReceived)).
    fn write_received(
        &mut self,
        token: T,
        file: u32,
        (bid, start, end): (u16, usize, usize),
        offset: u64,
        dsync: bool,
    ) -> io::Result<OpId> {
        let (ptr, len) = self.recv.lend(bid, start, end).ok_or_else(stale)?;
        let flags = if dsync { libc::RWF_DSYNC } else { 0 };
        self.start(token, Held::Lent(bid), |ud| {
            opcode::Write::new(types::Fixed(file), ptr, len).offset(offset).rw_flags(flags).build().user_data(ud)
        })
    }

    /// fdatasync (or fsync) of `file`.
    fn fsync(&mut self, token: T, file: u32, data_only: bool) -> io::Result<OpId> {
        let flags = if data_only { types::FsyncFlags::DATASYNC } else { types::FsyncFlags::empty() };
        self.start(token, Held::Nothing, |ud| opcode::Fsync::new(types::Fixed(file)).flags(flags).build().user_data(ud))
    }

    fn fallocate(&mut self, token: T, file: u32, mode: i32, offset: u64, len: u64) -> io::Result<OpId> {
        self.start(token, Held::Nothing, |ud| {
            opcode::Fallocate::new(types::Fixed(file), len).offset(offset).mode(mode).build().user_data(ud)
        })
    }

    fn fadvise(&mut self, token: T, file: u32, offset: u64, len: u32, advice: i32) -> io::Result<OpId> {
        self.start(token, Held::Nothing, |ud| {
            opcode::Fadvise::new(types::Fixed(file), len as _, advice).offset(offset).build().user_data(ud)
        })
    }

    /// shutdown(2) both ways: wakes a pending receive with 0 and fails sends.
    fn shutdown(&mut self, token: T, socket: u32) -> io::Result<OpId> {
        self.start(token, Held::Nothing, |ud| opcode::Shutdown::new(types::Fixed(socket), libc::SHUT_RDWR).build().user_data(ud))
    }

    /// Closes a fixed socket; the slot is reusable once this completes.
    fn close_file(&mut self, token: T, socket: u32) -> io::Result<OpId> {
        self.start(token, Held::Close(socket), |ud| opcode::Close::new(types::Fixed(socket)).build().user_data(ud))
    }

    /// Completes once after `after` (result -ETIME).
    fn timeout(&mut self, token: T, after: Duration) -> io::Result<OpId> {
        let ts = Box::new(types::Timespec::from(after));
        let p: *const types::Timespec = &*ts;
        self.start(token, Held::Timeout(ts), |ud| opcode::Timeout::new(p).build().user_data(ud))
    }

    /// An empty pipe for one splice sequence; give it back with `put_pipe`.
    pub fn take_pipe(&mut self) -> io::Result<PipeId> {
        self.pipes.take()
    }

    /// Returns a pipe; `empty` says whether everything put in it was
    /// spliced out (a pipe with leftovers is closed, never reused).
    pub fn put_pipe(&mut self, pipe: PipeId, empty: bool) {
        self.pipes.put(pipe, empty);
    }

    /// Moves up to `len` bytes of `file` at `offset` into `pipe` (page
    /// references, no copy, for files in the page cache).
    fn splice_in(&mut self, token: T, file: u32, offset: u64, pipe: PipeId, len: u32) -> io::Result<OpId> {
        let fd = self.pipes.acquire(pipe, true).ok_or_else(stale)?;
        self.start(token, Held::Pipe(pipe.0), |ud| {
            opcode::Splice::new(types::Fixed(file), offset as i64, types::Fd(fd), -1, len).build().user_data(ud)
        })
    }

    /// Moves up to `len` bytes from `pipe` into a fixed socket.
    fn splice_out(&mut self, token: T, pipe: PipeId, socket: u32, len: u32) -> io::Result<OpId> {
        let fd = self.pipes.acquire(pipe, false).ok_or_else(stale)?;
        self.start(token, Held::Pipe(pipe.0), |ud| {
            opcode::Splice::new(types::Fd(fd), -1, types::Fixed(socket), -1, len).build().user_data(ud)
        })
    }

    /// Asks the kernel to end `op` (its completion still arrives).
    pub fn cancel(&mut self, op: OpId) -> io::Result<()> {
        self.core.cancel(op.0)
    }

    /// Submits what is queued, then polls for up to `window` (at most a
    /// second) for work instead of sleeping: true when a completion is
    /// ready to reap. Between looks it yields its CPU, so a task that
    /// shares the CPU (a client on the same core) runs rather than waits.
    /// Task work the kernel queued for this thread is run as soon as it is
    /// seen (the ring flags it: see `RingSetup`, which asks for
    /// `TASKRUN_FLAG`), and with `most` longer than `window` each such run
    /// (a MSG_WAITALL receive took what had arrived and is not done)
    /// starts the window again, up to `most` in all: a streaming payload
    /// is only task work until it is whole. That needs DEFER_TASKRUN
    /// (Linux 6.1); before it the kernel runs the work on its own.
    ///
    /// Why: a ring that sleeps is woken by the next request, and where an
    /// idle CPU halts (a virtual machine) that wake-up costs more than a
    /// cached 4 KiB read. The caller decides when a poll pays.
    pub fn poll_for(&mut self, window: Duration, most: Duration) -> io::Result<bool> {
        // An enter only to hand over what is queued: with nothing queued
        // the look below costs no system call (task work is seen by its flag).
        if self.core.queued() {
            self.core.submit_and_wait(0, None)?;
        }
        // A poll is short by nature: never past a second.
        let window = window.min(Duration::from_secs(1));
        let start = Instant::now();
        let end = start + most.max(window).min(Duration::from_secs(1));
        let mut deadline = start + window;
        loop {
            match self.core.pending() {
                Pending::Completions => return Ok(true),
                // An enter without a wait runs it (the flag makes the
                // submitter add GETEVENTS).
                Pending::TaskWork => {
                    self.core.submit_and_wait(0, None)?;
                    deadline = Instant::now() + window;
                }
                Pending::Nothing => std::thread::yield_now(),
            }
            if Instant::now() >= deadline.min(end) {
                return Ok(self.core.pending() == Pending::Completions);
            }
        }
    }

    /// Submits what is queued and waits for `want` completions (0: none,
    /// only submit). With `batch`, the wait for all `want` lasts at most
    /// that long: it gathers a burst of requests into one loop turn when
    /// traffic is heavy, and bounds a sleep past completions the caller
    /// does not need at once (the NBD server's at-once sends). It is
    /// io_uring's min_wait (Linux 6.12+), which with no other timeout ends
    /// the wait when the window passes; older kernels get an ordinary
    /// timeout of the window, which does the same. So a batch wait may
    /// also end empty (see `Reactor::set_batch_window`, which adds one
    /// because its rings idle); the server asks for one only after a busy
    /// turn, where an empty turn costs one more loop.
    pub fn submit_and_wait(&mut self, want: usize, batch: Option<Duration>) -> io::Result<()> {
        let Some(min_wait) = batch else { return self.core.submit_and_wait(want, None) };
        if self.no_min_wait {
            return self.core.submit_and_wait(want, Some(min_wait));
        }
        let args = types::SubmitArgs::new().min_wait_usec(min_wait.as_micros().min(u128::from(u32::MAX)) as u32);
        match self.core.submit_with_args(want, &args) {
            Ok(()) => Ok(()),
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {
                self.no_min_wait = true;
                self.core.submit_and_wait(want, Some(min_wait))
            }
            Err(e) => Err(e),
        }
    }

    /// Submits and waits for at least `min` completions, or until
    /// `timeout` passes (the unit tests' bounded waits).
    #[cfg(test)]
    pub(crate) fn submit_and_wait_for(&mut self, min: usize, timeout: Option<Duration>) -> io::Result<()> {
        self.core.submit_and_wait(min, timeout)
    }

    /// Gives back what a past burst left behind: the spare send vectors
    /// (one per send that was in flight at once, each as long as its
    /// longest send), an oversized completion scratch, the op table's slots
    /// past its highest live op, cached buffers, and then the allocator's
    /// free pages. For a ring with nothing to do.
    /// `freed_elsewhere`: bytes its owner freed outside the ring (request
    /// tables, vectors of a past burst), so the allocator is asked for its
    /// free pages even when the ring itself freed nothing.
    ///
    /// With no receive from the pool armed, the pool's pages go back too:
    /// the kernel picks buffers round the whole pool, so any stream of
    /// receives leaves every buffer resident (the NBD server's 8 MiB pool:
    /// 29 MiB resident once the bench's hostile clients had left, against
    /// 19 MiB before they came, and 21-23 MiB with the pool given back).
    /// Only then: a receive armed meanwhile could write a buffer as its
    /// page is dropped, and lose those bytes.
    pub fn trim(&mut self, freed_elsewhere: usize) {
        if self.armed_recvs == 0 && !self.recv_discarded {
            match self.recv.discard_pages() {
                Ok(discarded) => self.recv_discarded = discarded,
                Err(e) => tracing::debug!(error = %e, "receive pool pages not given back"),
            }
        }
        let iov: usize = self.spare_iov.iter().map(|v| v.capacity() * std::mem::size_of::<libc::iovec>()).sum();
        let ids: usize = self.spare_bufs.iter().map(|v| v.capacity() * std::mem::size_of::<BufId>()).sum();
        let mut freed = freed_elsewhere + iov + ids + self.core.trim();
        self.spare_iov = Vec::new();
        self.spare_bufs = Vec::new();
        if self.reaped.capacity() > 1024 {
            freed += self.reaped.capacity() * std::mem::size_of::<Reaped<Op<T>>>();
            self.reaped = Vec::with_capacity(1024);
        }
        self.bufs.note_freed(freed);
        self.bufs.trim();
    }

    /// Moves every available completion into `out`, releasing what finished
    /// operations held.
    ///
    /// A multishot op's completions that come in one reap with its last one
    /// are delivered under its token too: the core took the op out of the
    /// table when it matched the last one, so their token is found on it,
    /// later in the same batch. (Dropping them lost the bytes a receive had
    /// taken and its buffers with them: the pool seemed held by the driver,
    /// and every later receive ended ENOBUFS at once.)
    pub fn complete(&mut self, out: &mut Vec<Cqe<T>>) {
        let mut reaped = std::mem::take(&mut self.reaped);
        self.core.reap(&mut reaped);
        for i in 0..reaped.len() {
            let (user_data, res, flags, more) = (reaped[i].user_data, reaped[i].res, reaped[i].flags, reaped[i].more);
            let token = match reaped[i].last.as_ref() {
                Some(op) => op.token,
                None => match self.core.ops().get(user_data) {
                    Some(op) => op.token,
                    None => match reaped[i + 1..].iter().find_map(|r| r.last.as_ref().filter(|_| r.user_data == user_data)) {
                        Some(op) => op.token,
                        None => continue, // cancel requests
                    },
                },
            };
            let recv_buf = cqueue::buffer_select(flags);
            if let Some(bid) = recv_buf {
                self.recv.mark_taken(bid);
                self.recv_epoch += 1;
            }
            if let Some(op) = reaped[i].last.take() {
                if let Held::Recv { epoch, idle } = op.held {
                    if res == -libc::ENOBUFS && idle && epoch == self.recv_epoch {
                        self.recv_lost = true;
                    }
                }
                self.release(op.held);
            }
            out.push(Cqe { token, result: res, more, recv_buf });
        }
        reaped.clear();
        self.reaped = reaped;
    }

    /// Gives back what an ended (or never submitted) op held.
    fn release(&mut self, held: Held) {
        match held {
            Held::Nothing | Held::Timeout(_) => {}
            Held::Recv { .. } => self.armed_recvs -= 1,
            Held::Buf(id) => self.bufs.give_back(id),
            Held::Lent(bid) => self.recv.give_back(bid),
            Held::Send { mut bufs, iov, msg, at_once } => {
                self.settling -= usize::from(at_once);
                for id in bufs.drain(..) {
                    self.bufs.give_back(id);
                }
                drop(msg);
                self.spare_iov.push(iov);
                self.spare_bufs.push(bufs);
            }
            Held::Close(file) => self.free_files.push(file),
            Held::Pipe(i) => self.pipes.release(i),
        }
    }
}

fn stale() -> io::Error {
    io::Error::new(io::ErrorKind::InvalidInput, "stale buffer or range outside it")
}

impl<T: Copy> Drop for IoRing<T> {
    /// Ends every operation before the memory they use goes away; if the
    /// kernel will not let go in time, the arena and receive pool are
    /// leaked with the ops, never freed under it.
    fn drop(&mut self) {
        if self.core.shutdown() > 0 {
            return;
        }
        // SAFETY: no op is in flight any more (the core reaped every one),
        // so the kernel touches neither the arena nor the receive pool; both
        // are dropped once, here, and not used after.
        unsafe {
            ManuallyDrop::drop(&mut self.bufs);
            ManuallyDrop::drop(&mut self.recv);
        }
    }
}

#[cfg(test)]
#[path = "io_ring_tests.rs"]
mod tests;
