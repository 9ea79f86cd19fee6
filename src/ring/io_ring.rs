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
//! It needs a 6.0+ kernel (multishot receive, provided buffer rings, sparse
//! file tables); [`IoRing::new`] fails cleanly when any of that is missing.

use std::io;
use std::os::fd::{AsRawFd, RawFd};
use std::time::Duration;

use io_uring::{cqueue, opcode, squeue, types, IoUring};

use super::buffers::{BufId, Buffers, RecvPool};

/// A byte range of a buffer: id, start, end.
pub type BufSlice = (BufId, usize, usize);

/// A submitted operation, for cancelling it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OpId(u32);

/// One completion, with the driver's token.
#[derive(Debug, Clone, Copy)]
pub struct Cqe {
    pub token: u64,
    /// Bytes, a new fd, or a negative errno.
    pub result: i32,
    /// A multishot operation stays armed.
    pub more: bool,
    /// The provided buffer a receive landed in; hand it back with `recycle`.
    pub recv_buf: Option<u16>,
}

impl Cqe {
    /// The descriptor an accept completion carries, now owned by the caller.
    pub fn accepted_fd(&self) -> Option<std::os::fd::OwnedFd> {
        use std::os::fd::FromRawFd;
        // SAFETY: a successful accept completion's result is a descriptor the
        // kernel just installed for this process; nothing else refers to it.
        (self.result >= 0).then(|| unsafe { std::os::fd::OwnedFd::from_raw_fd(self.result) })
    }
}

/// Sizes of one ring.
#[derive(Debug, Clone)]
pub struct IoRingConfig {
    pub sq_entries: u32,
    pub cq_entries: u32,
    /// Fixed-file slots (sockets and images).
    pub files: u32,
    pub arena_slots: u32,
    pub arena_slot_size: usize,
    pub heap_cache: usize,
    /// Provided receive buffers: a power of two, each `recv_buf_size` bytes.
    pub recv_bufs: u16,
    pub recv_buf_size: usize,
}

impl Default for IoRingConfig {
    fn default() -> Self {
        Self {
            sq_entries: 1024,
            cq_entries: 8192,
            files: 16384,
            arena_slots: 64,
            arena_slot_size: 128 * 1024,
            heap_cache: 64 << 20,
            recv_bufs: 128,
            recv_buf_size: 64 * 1024,
        }
    }
}

/// A pipe for splicing file pages into a socket without copying them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PipeId(u32);

struct Pipe {
    read: std::os::fd::OwnedFd,
    write: std::os::fd::OwnedFd,
    busy: u32,
    /// Given back while busy: closed (if dirty) or pooled at the last completion.
    returned: Option<bool>,
}

/// What an operation holds until its last completion.
enum Held {
    Nothing,
    Pipe(u32),
    Buf(BufId),
    Send {
        bufs: Vec<BufId>,
        iov: Vec<libc::iovec>,
        msg: Box<libc::msghdr>,
    },
    Timeout(
        #[allow(dead_code)] // only kept alive for the kernel
        Box<types::Timespec>,
    ),
    /// A close of this fixed slot: the slot is free once it completes.
    Close(u32),
}

struct Op {
    token: u64,
    held: Held,
    live: bool,
}

/// user_data of operations whose completions nobody waits for (cancels).
const IGNORED: u64 = u64::MAX;

/// The ring, its registered resources and its in-flight table.
pub struct IoRing {
    ring: IoUring,
    ops: Vec<Op>,
    free_ops: Vec<u32>,
    bufs: Buffers,
    recv: RecvPool,
    free_files: Vec<u32>,
    /// Spare vectors for sends, so a send allocates nothing in steady state.
    spare_iov: Vec<Vec<libc::iovec>>,
    spare_bufs: Vec<Vec<BufId>>,
    cqes: Vec<cqueue::Entry>,
    pipes: Vec<Option<Pipe>>,
    idle_pipes: Vec<u32>,
    /// The kernel refused `min_wait_usec` once (before 6.12): not asked again.
    no_min_wait: bool,
    in_flight: usize,
}

/// Capacity asked of each splice pipe (the unprivileged maximum).
pub const PIPE_SIZE: usize = 1 << 20;

impl IoRing {
    pub fn new(cfg: &IoRingConfig) -> io::Result<Self> {
        let build = |defer: bool| {
            let mut b = IoUring::builder();
            b.setup_cqsize(cfg.cq_entries).setup_clamp().setup_submit_all().setup_coop_taskrun();
            if defer {
                b.setup_single_issuer().setup_defer_taskrun();
            }
            b.build(cfg.sq_entries)
        };
        // DEFER_TASKRUN (6.1) runs completions only when this thread asks:
        // fewer interruptions of the ring thread. Older kernels get the rest.
        let ring = build(true).or_else(|_| build(false))?;
        let bufs = Buffers::new(cfg.arena_slots, cfg.arena_slot_size, cfg.heap_cache)?;
        let iovecs = bufs.arena_iovecs();
        // SAFETY: the arena mapping outlives the ring: `Drop` unregisters or
        // leaks it, and the iovecs describe exactly that mapping.
        unsafe { ring.submitter().register_buffers(&iovecs)? };
        // The kernel refuses a file table larger than RLIMIT_NOFILE: raise the
        // soft limit to the hard one, and fit the table under what is left.
        let files = cfg.files.min(raise_nofile_limit().saturating_sub(64).max(64));
        ring.submitter().register_files_sparse(files)?;
        let recv = RecvPool::new(cfg.recv_bufs, cfg.recv_buf_size, 0)?;
        // SAFETY: the ring memory belongs to `recv`, which lives as long as
        // the ring (dropped after it, or leaked with it).
        unsafe { ring.submitter().register_buf_ring_with_flags(recv.ring_addr(), recv.entries(), recv.group, 0)? };
        Ok(Self {
            ring,
            ops: Vec::with_capacity(1024),
            free_ops: Vec::new(),
            bufs,
            recv,
            free_files: (0..files).rev().collect(),
            spare_iov: Vec::new(),
            spare_bufs: Vec::new(),
            cqes: Vec::with_capacity(1024),
            pipes: Vec::new(),
            idle_pipes: Vec::new(),
            no_min_wait: false,
            in_flight: 0,
        })
    }

    pub fn buffers(&self) -> &Buffers {
        &self.bufs
    }

    pub fn buffers_mut(&mut self) -> &mut Buffers {
        &mut self.bufs
    }

    /// Operations submitted and not yet finished.
    pub fn in_flight(&self) -> usize {
        self.in_flight
    }

    /// The bytes a receive put in provided buffer `bid`, next to the
    /// buffers (to copy a write's payload straight into its own buffer).
    pub fn received(&mut self, bid: u16, len: usize) -> (&[u8], &mut Buffers) {
        (self.recv.data(bid, len), &mut self.bufs)
    }

    /// Hands a provided buffer back to the kernel.
    pub fn recycle(&mut self, bid: u16) {
        self.recv.recycle(bid);
    }

    /// Puts `fd` into a fixed-file slot (the ring takes its own reference,
    /// so the caller may close `fd` afterwards).
    pub fn register_file(&mut self, fd: RawFd) -> io::Result<u32> {
        let slot = self.free_files.pop().ok_or_else(|| io::Error::from_raw_os_error(libc::ENFILE))?;
        match self.ring.submitter().register_files_update(slot, &[fd]) {
            Ok(_) => Ok(slot),
            Err(e) => {
                self.free_files.push(slot);
                Err(e)
            }
        }
    }

    /// Empties a fixed-file slot at once (for images: their operations have
    /// ended; sockets go through [`IoRing::close_file`]).
    pub fn unregister_file(&mut self, slot: u32) -> io::Result<()> {
        self.ring.submitter().register_files_update(slot, &[-1])?;
        self.free_files.push(slot);
        Ok(())
    }

    fn op(&mut self, token: u64, held: Held) -> u32 {
        self.in_flight += 1;
        let op = Op { token, held, live: true };
        match self.free_ops.pop() {
            Some(i) => {
                self.ops[i as usize] = op;
                i
            }
            None => {
                self.ops.push(op);
                self.ops.len() as u32 - 1
            }
        }
    }

    fn push(&mut self, sqe: squeue::Entry) -> io::Result<()> {
        loop {
            // SAFETY: every pointer in `sqe` refers to memory held in the op
            // table (buffers marked busy, boxed iovecs/msghdr/timespec) until
            // the operation's last completion.
            if unsafe { self.ring.submission().push(&sqe) }.is_ok() {
                return Ok(());
            }
            self.ring.submit()?;
        }
    }

    fn start(&mut self, token: u64, held: Held, build: impl FnOnce(u64) -> squeue::Entry) -> io::Result<OpId> {
        let slot = self.op(token, held);
        let sqe = build(u64::from(slot));
        if let Err(e) = self.push(sqe) {
            self.finish(slot);
            return Err(e);
        }
        Ok(OpId(slot))
    }

    /// Accepts connections on `listener` until cancelled; each completion's
    /// result is a new (close-on-exec) fd.
    pub fn accept_multi(&mut self, token: u64, listener: RawFd) -> io::Result<OpId> {
        self.start(token, Held::Nothing, |ud| opcode::AcceptMulti::new(types::Fd(listener)).flags(libc::SOCK_CLOEXEC).build().user_data(ud))
    }

    /// Waits for `events` on `fd` until cancelled.
    pub fn poll_multi(&mut self, token: u64, fd: &impl AsRawFd, events: u32) -> io::Result<OpId> {
        let fd = fd.as_raw_fd();
        self.start(token, Held::Nothing, |ud| opcode::PollAdd::new(types::Fd(fd), events).multi(true).build().user_data(ud))
    }

    /// Receives on a fixed socket into provided buffers until cancelled, the
    /// peer closes, or the pool runs dry (ENOBUFS: arm again after recycling).
    pub fn recv_multi(&mut self, token: u64, socket: u32) -> io::Result<OpId> {
        let group = self.recv.group;
        self.start(token, Held::Nothing, |ud| opcode::RecvMulti::new(types::Fixed(socket), group).build().user_data(ud))
    }

    /// Sends `parts` (buffer, start, end) in order with one sendmsg.
    pub fn send(&mut self, token: u64, socket: u32, parts: &[BufSlice]) -> io::Result<OpId> {
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
        self.start(token, Held::Send { bufs, iov, msg }, |ud| {
            opcode::SendMsg::new(types::Fixed(socket), msg_ptr).flags(libc::MSG_NOSIGNAL as u32).build().user_data(ud)
        })
    }

    /// Reads `file` at `offset` into `buf[start..end]`.
    pub fn read(&mut self, token: u64, file: u32, (buf, start, end): BufSlice, offset: u64) -> io::Result<OpId> {
        let (ptr, len, index) = self.bufs.lend(buf, start, end).ok_or_else(stale)?;
        self.start(token, Held::Buf(buf), |ud| match index {
            Some(i) => opcode::ReadFixed::new(types::Fixed(file), ptr, len, i).offset(offset).build().user_data(ud),
            None => opcode::Read::new(types::Fixed(file), ptr, len).offset(offset).build().user_data(ud),
        })
    }

    /// Writes `buf[start..end]` to `file` at `offset`; `dsync` makes it
    /// durable before it completes (RWF_DSYNC: the FUA of a file).
    pub fn write(&mut self, token: u64, file: u32, (buf, start, end): BufSlice, offset: u64, dsync: bool) -> io::Result<OpId> {
        let (ptr, len, index) = self.bufs.lend(buf, start, end).ok_or_else(stale)?;
        let flags = if dsync { libc::RWF_DSYNC } else { 0 };
        self.start(token, Held::Buf(buf), |ud| match index {
            Some(i) => opcode::WriteFixed::new(types::Fixed(file), ptr, len, i).offset(offset).rw_flags(flags).build().user_data(ud),
            None => opcode::Write::new(types::Fixed(file), ptr, len).offset(offset).rw_flags(flags).build().user_data(ud),
        })
    }

    /// fdatasync (or fsync) of `file`.
    pub fn fsync(&mut self, token: u64, file: u32, data_only: bool) -> io::Result<OpId> {
        let flags = if data_only { types::FsyncFlags::DATASYNC } else { types::FsyncFlags::empty() };
        self.start(token, Held::Nothing, |ud| opcode::Fsync::new(types::Fixed(file)).flags(flags).build().user_data(ud))
    }

    pub fn fallocate(&mut self, token: u64, file: u32, mode: i32, offset: u64, len: u64) -> io::Result<OpId> {
        self.start(token, Held::Nothing, |ud| {
            opcode::Fallocate::new(types::Fixed(file), len).offset(offset).mode(mode).build().user_data(ud)
        })
    }

    pub fn fadvise(&mut self, token: u64, file: u32, offset: u64, len: u32, advice: i32) -> io::Result<OpId> {
        self.start(token, Held::Nothing, |ud| {
            opcode::Fadvise::new(types::Fixed(file), len as _, advice).offset(offset).build().user_data(ud)
        })
    }

    /// shutdown(2) both ways: wakes a pending receive with 0 and fails sends.
    pub fn shutdown(&mut self, token: u64, socket: u32) -> io::Result<OpId> {
        self.start(token, Held::Nothing, |ud| opcode::Shutdown::new(types::Fixed(socket), libc::SHUT_RDWR).build().user_data(ud))
    }

    /// Closes a fixed socket; the slot is reusable once this completes.
    pub fn close_file(&mut self, token: u64, socket: u32) -> io::Result<OpId> {
        self.start(token, Held::Close(socket), |ud| opcode::Close::new(types::Fixed(socket)).build().user_data(ud))
    }

    /// Completes once after `after` (result -ETIME).
    pub fn timeout(&mut self, token: u64, after: Duration) -> io::Result<OpId> {
        let ts = Box::new(types::Timespec::from(after));
        let p: *const types::Timespec = &*ts;
        self.start(token, Held::Timeout(ts), |ud| opcode::Timeout::new(p).build().user_data(ud))
    }

    /// An empty pipe for one splice sequence; give it back with `put_pipe`.
    pub fn take_pipe(&mut self) -> io::Result<PipeId> {
        if let Some(i) = self.idle_pipes.pop() {
            return Ok(PipeId(i));
        }
        let (read, write) = rustix::pipe::pipe_with(rustix::pipe::PipeFlags::CLOEXEC)?;
        // A larger pipe moves a whole 1 MiB read in one splice; if the
        // system refuses, the default size only means more splices.
        let _ = rustix::pipe::fcntl_setpipe_size(&write, PIPE_SIZE);
        self.pipes.push(Some(Pipe { read, write, busy: 0, returned: None }));
        Ok(PipeId(self.pipes.len() as u32 - 1))
    }

    /// Returns a pipe; `empty` says whether everything put in it was
    /// spliced out (a pipe with leftovers is closed, never reused).
    pub fn put_pipe(&mut self, pipe: PipeId, empty: bool) {
        let Some(Some(p)) = self.pipes.get_mut(pipe.0 as usize) else { return };
        if p.busy > 0 {
            p.returned = Some(empty);
            return;
        }
        self.retire_pipe(pipe.0, empty);
    }

    fn retire_pipe(&mut self, i: u32, empty: bool) {
        if empty {
            if let Some(Some(p)) = self.pipes.get_mut(i as usize) {
                p.returned = None;
            }
            self.idle_pipes.push(i);
        } else {
            self.pipes[i as usize] = None;
        }
    }

    fn pipe_fd(&mut self, pipe: PipeId, write_end: bool) -> io::Result<RawFd> {
        let p = self.pipes.get_mut(pipe.0 as usize).and_then(Option::as_mut).ok_or_else(stale)?;
        p.busy += 1;
        Ok(if write_end { p.write.as_raw_fd() } else { p.read.as_raw_fd() })
    }

    /// Moves up to `len` bytes of `file` at `offset` into `pipe` (page
    /// references, no copy, for files in the page cache).
    pub fn splice_in(&mut self, token: u64, file: u32, offset: u64, pipe: PipeId, len: u32) -> io::Result<OpId> {
        let fd = self.pipe_fd(pipe, true)?;
        self.start(token, Held::Pipe(pipe.0), |ud| {
            opcode::Splice::new(types::Fixed(file), offset as i64, types::Fd(fd), -1, len).build().user_data(ud)
        })
    }

    /// Moves up to `len` bytes from `pipe` into a fixed socket.
    pub fn splice_out(&mut self, token: u64, pipe: PipeId, socket: u32, len: u32) -> io::Result<OpId> {
        let fd = self.pipe_fd(pipe, false)?;
        self.start(token, Held::Pipe(pipe.0), |ud| {
            opcode::Splice::new(types::Fd(fd), -1, types::Fixed(socket), -1, len).build().user_data(ud)
        })
    }

    /// Asks the kernel to end `op` (its completion still arrives).
    pub fn cancel(&mut self, op: OpId) -> io::Result<()> {
        if !self.ops.get(op.0 as usize).is_some_and(|o| o.live) {
            return Ok(());
        }
        self.push(opcode::AsyncCancel::new(u64::from(op.0)).build().user_data(IGNORED))
    }

    /// Submits what is queued and waits for at least `min` completions, or
    /// until `timeout` passes.
    pub fn submit_and_wait(&mut self, min: usize, timeout: Option<Duration>) -> io::Result<()> {
        let r = match timeout {
            None => self.ring.submit_and_wait(min),
            Some(t) => {
                let ts = types::Timespec::from(t);
                let args = types::SubmitArgs::new().timespec(&ts);
                self.ring.submitter().submit_with_args(min, &args)
            }
        };
        match r {
            Ok(_) => Ok(()),
            Err(e) if matches!(e.raw_os_error(), Some(libc::ETIME) | Some(libc::EINTR) | Some(libc::EBUSY)) => Ok(()),
            Err(e) => Err(e),
        }
    }

    /// Submits, then waits for `want` completions for at most `min_wait`
    /// (and for the first one as long as it takes): gathers a burst of
    /// requests into one loop turn when traffic is heavy (Linux 6.12+; on
    /// older kernels it waits for the first completion only).
    pub fn submit_and_wait_batch(&mut self, want: usize, min_wait: Duration) -> io::Result<()> {
        if self.no_min_wait {
            return self.submit_and_wait(1, None);
        }
        let args = types::SubmitArgs::new().min_wait_usec(min_wait.as_micros().min(u128::from(u32::MAX)) as u32);
        match self.ring.submitter().submit_with_args(want, &args) {
            Ok(_) => Ok(()),
            Err(e) if matches!(e.raw_os_error(), Some(libc::ETIME) | Some(libc::EINTR) | Some(libc::EBUSY)) => Ok(()),
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {
                self.no_min_wait = true;
                self.submit_and_wait(1, None)
            }
            Err(e) => Err(e),
        }
    }

    /// Moves every available completion into `out`, releasing what finished
    /// operations held.
    pub fn complete(&mut self, out: &mut Vec<Cqe>) {
        let mut entries = std::mem::take(&mut self.cqes);
        entries.extend(self.ring.completion());
        for e in entries.drain(..) {
            let ud = e.user_data();
            if ud == IGNORED {
                continue;
            }
            let slot = ud as u32;
            let Some(op) = self.ops.get(slot as usize).filter(|o| o.live) else { continue };
            let token = op.token;
            let more = cqueue::more(e.flags());
            let recv_buf = cqueue::buffer_select(e.flags());
            if !more {
                self.finish(slot);
            }
            out.push(Cqe { token, result: e.result(), more, recv_buf });
        }
        self.cqes = entries;
    }

    fn finish(&mut self, slot: u32) {
        let op = &mut self.ops[slot as usize];
        if !op.live {
            return;
        }
        op.live = false;
        self.in_flight -= 1;
        match std::mem::replace(&mut op.held, Held::Nothing) {
            Held::Nothing | Held::Timeout(_) => {}
            Held::Buf(id) => self.bufs.give_back(id),
            Held::Send { mut bufs, iov, msg } => {
                for id in bufs.drain(..) {
                    self.bufs.give_back(id);
                }
                drop(msg);
                self.spare_iov.push(iov);
                self.spare_bufs.push(bufs);
            }
            Held::Close(file) => self.free_files.push(file),
            Held::Pipe(i) => {
                if let Some(Some(p)) = self.pipes.get_mut(i as usize) {
                    p.busy -= 1;
                    if let (0, Some(empty)) = (p.busy, p.returned) {
                        self.retire_pipe(i, empty);
                    }
                }
            }
        }
        self.free_ops.push(slot);
    }
}

/// Raises this process's soft RLIMIT_NOFILE to its hard limit (once is
/// enough; later calls change nothing) and returns the soft limit.
fn raise_nofile_limit() -> u32 {
    use rustix::process::{getrlimit, setrlimit, Resource};
    let mut limit = getrlimit(Resource::Nofile);
    if limit.current != limit.maximum {
        limit.current = limit.maximum;
        let _ = setrlimit(Resource::Nofile, limit);
        limit = getrlimit(Resource::Nofile);
    }
    limit.current.map_or(u32::MAX, |n| u32::try_from(n).unwrap_or(u32::MAX))
}

fn stale() -> io::Error {
    io::Error::new(io::ErrorKind::InvalidInput, "stale buffer or range outside it")
}

impl Drop for IoRing {
    /// Ends every operation before the memory they use goes away; if the
    /// kernel will not let go in time, the memory is leaked, never freed
    /// under it.
    fn drop(&mut self) {
        if self.in_flight > 0 {
            let _ = self.push(opcode::AsyncCancel2::new(types::CancelBuilder::any()).build().user_data(IGNORED));
            let deadline = std::time::Instant::now() + Duration::from_secs(2);
            let mut out = Vec::new();
            while self.in_flight > 0 && std::time::Instant::now() < deadline {
                let _ = self.submit_and_wait(1, Some(Duration::from_millis(20)));
                out.clear();
                self.complete(&mut out);
            }
        }
        if self.in_flight > 0 {
            tracing::warn!(in_flight = self.in_flight, "ring ended with operations the kernel still holds; leaking their memory");
            let bufs = std::mem::replace(&mut self.bufs, Buffers::new(1, 4096, 0).expect("tiny arena"));
            std::mem::forget(bufs);
            let recv = std::mem::replace(&mut self.recv, RecvPool::new(1, 4096, 0).expect("tiny pool"));
            std::mem::forget(recv);
            let ops = std::mem::take(&mut self.ops);
            std::mem::forget(ops);
        }
    }
}
