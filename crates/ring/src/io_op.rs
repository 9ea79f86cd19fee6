//! The vocabulary of [`IoRing`](crate::IoRing): the operations it is asked for ([`Op`]),
//! the ids they name ([`PipeId`]), what comes back ([`Cqe`], [`OpId`]) and its diagnostics
//! ([`IoRingStats`]). The submitters themselves stay in `io_ring.rs`, beside
//! the op table that owns what they hand the kernel.

use std::os::fd::RawFd;
use std::time::Duration;

use super::buffers::BufId;

/// A byte range of a buffer: id, start, end.
pub(crate) type BufSlice = (BufId, usize, usize);

/// A submitted operation, for cancelling it: its generation-tagged
/// user_data, so cancelling an op that already ended can never hit the
/// newer op in its slot.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OpId(pub(crate) u64);

/// A pipe for splicing file pages into a socket without copying them: one
/// of the ring's (`IoRing::take_pipe`), named by the splice [`Op`]s.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PipeId(pub(crate) u32);

/// One completion, with the driver's token: whatever `Copy` value the
/// driver named the operation with (an enum of what it is for). The ring
/// keeps it in the op table beside the op, so it never has to fit into, or
/// be unpacked from, the kernel's `user_data`: that carries only the op
/// table's key and generation (see `ops`).
#[derive(Debug, Clone, Copy)]
pub struct Cqe<T = u64> {
    pub token: T,
    /// Bytes, a new fd, or a negative errno.
    pub result: i32,
    /// A multishot operation stays armed.
    pub more: bool,
    /// The provided buffer a receive landed in; hand it back with
    /// [`IoRing::recycle`](crate::IoRing::recycle).
    pub recv_buf: Option<u16>,
}

impl<T> Cqe<T> {
    /// The descriptor an accept completion carries, now owned by the caller.
    pub fn accepted_fd(&self) -> Option<std::os::fd::OwnedFd> {
        use std::os::fd::FromRawFd;
        // SAFETY: a successful accept completion's result is a descriptor the
        // kernel just installed for this process; nothing else refers to it.
        (self.result >= 0).then(|| unsafe { std::os::fd::OwnedFd::from_raw_fd(self.result) })
    }
}

/// One operation for [`IoRing::submit`](crate::IoRing::submit). `socket` and `file` are fixed-file
/// slots (from [`IoRing::register_file`](crate::IoRing::register_file)); buffer ranges are (buffer,
/// start, end) of the ring's [`Buffers`](crate::Buffers), lent to the
/// kernel until the op's last completion.
#[derive(Debug, Clone, Copy)]
pub enum Op<'a> {
    /// Accepts connections on `listener` until cancelled; each completion's
    /// result is a new (close-on-exec) fd ([`Cqe::accepted_fd`]).
    AcceptMulti { listener: RawFd },
    /// Waits for `events` (`poll(2)` bits) on `fd` until cancelled.
    PollMulti { fd: RawFd, events: u32 },
    /// Receives on a socket into provided buffers until cancelled, the peer
    /// closes, or the pool runs dry (ENOBUFS: arm again after recycling).
    RecvMulti { socket: u32 },
    /// Receives once, at most `len` bytes, into a provided buffer: exactly
    /// what the caller knows is coming before something it wants elsewhere
    /// (a request header before a payload that goes straight into its own
    /// buffer), so nothing after it lands in the pool.
    RecvOnce { socket: u32, len: u32 },
    /// Receives straight into `into`, waiting for all of it (MSG_WAITALL;
    /// short only on end of stream, an error or a cancel): a large payload
    /// lands where it is written from, without passing through the provided
    /// buffers.
    RecvInto { socket: u32, into: (BufId, usize, usize) },
    /// Sends `parts` in order with one sendmsg. `at_once`: only what the
    /// socket takes now (MSG_DONTWAIT), so the op ends during the submit
    /// that hands it to the kernel, with the bytes sent (maybe fewer than
    /// asked) or EAGAIN when the socket has no room: a caller that waits
    /// for the next event can wait past it (see [`IoRingStats::settling`]).
    /// Queued while the ring has no room (it would wait in the backlog),
    /// it is an ordinary send.
    Send { socket: u32, parts: &'a [(BufId, usize, usize)], at_once: bool },
    /// Reads `file` at `offset` into `into`; `in_worker` hands the read to
    /// one of io_uring's worker threads (IOSQE_ASYNC) rather than doing it
    /// inline in the submitting call, even from the page cache: a caller
    /// starved of CPU hands the copies to threads the scheduler gives
    /// shares of their own.
    Read { file: u32, into: (BufId, usize, usize), offset: u64, in_worker: bool },
    /// Writes `from` to `file` at `offset`; `dsync` makes it durable before
    /// it completes (RWF_DSYNC: the FUA of a file).
    Write { file: u32, from: (BufId, usize, usize), offset: u64, dsync: bool },
    /// Writes bytes `start..end` of provided receive buffer `buf` (one a
    /// receive completion handed over and the driver has not recycled) to
    /// `file` at `offset`: a small WRITE payload that arrived whole in one
    /// receive is written from where it landed, not copied out first. The
    /// buffer goes back to the kernel only once the write has ended, even
    /// if it is recycled before.
    WriteReceived { file: u32, from: (u16, usize, usize), offset: u64, dsync: bool },
    /// fdatasync (`data_only`) or fsync of `file`.
    Fsync { file: u32, data_only: bool },
    /// fallocate(2) of `file` with `mode` (punch hole, zero range).
    Fallocate { file: u32, mode: i32, offset: u64, len: u64 },
    /// posix_fadvise(2) of a range of `file`.
    Fadvise { file: u32, offset: u64, len: u32, advice: i32 },
    /// shutdown(2) both ways: wakes a pending receive with 0 and fails sends.
    Shutdown { socket: u32 },
    /// Closes a fixed socket; the slot is reusable once this completes.
    Close { socket: u32 },
    /// Completes once after `after` (result -ETIME).
    Timeout { after: Duration },
    /// Moves up to `len` bytes of `file` at `offset` into `pipe` (page
    /// references, no copy, for files in the page cache); at most what one
    /// pipe holds (1 MiB) per op: the result says how much moved.
    SpliceIn { file: u32, offset: u64, pipe: PipeId, len: u64 },
    /// Moves up to `len` bytes from `pipe` into a socket.
    SpliceOut { pipe: PipeId, socket: u32, len: u32 },
}

/// The ring's diagnostics at one moment: one snapshot rather than a getter
/// each, read by the NBD server's stall reports and its receive-pool
/// recovery.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IoRingStats {
    /// Operations submitted and not yet finished.
    pub in_flight: usize,
    /// Receives into the provided buffers (multishot or once) armed and
    /// not yet ended.
    pub armed_recvs: usize,
    /// Provided buffers the driver holds (handed out, not recycled).
    pub recv_taken: u16,
    /// Provided buffers a write in flight reads from ([`Op::WriteReceived`]):
    /// out of the kernel's hands until it ends.
    pub recv_lent: u16,
    /// Whether the kernel lost provided buffers: a receive armed while the
    /// driver held none ended with ENOBUFS before any buffer came back, so
    /// the kernel's ring was empty although every buffer had been given to
    /// it. Debian 12's 6.1 kernel does this when multishot receives are
    /// cancelled (seen: all 128 gone within ~400 receives while one was
    /// cancelled before every large write); without a remedy the pool
    /// drains and every connection of the ring stops being read. The
    /// remedy: end every multishot receive, then [`IoRing::reset_recv_pool`](crate::IoRing::reset_recv_pool).
    pub recv_pool_lost: bool,
    /// Completions that matched no live operation (late ones), since the
    /// ring was made (a late receive would strand its buffer).
    pub stale_completions: u64,
    /// The receive pool's counters: buffers handed out by completions,
    /// handed out while already out, recycled, recycled while not out.
    pub recv_counts: [u64; 4],
    /// Times the receive pool was handed to the kernel afresh.
    pub recv_pool_resets: u64,
    /// Sends queued `at_once` whose completion is not reaped yet: each
    /// posts it during the next submit (or already did), so a wait for
    /// `n` events beyond them is a wait for `n + settling` completions.
    pub settling: usize,
    /// Calls of `io_uring_enter` since the ring was made.
    pub enters: u64,
    /// Operations waiting for room under the ring's cap on entries in the
    /// kernel: they go in as completions are reaped.
    pub backlogged: usize,
}
