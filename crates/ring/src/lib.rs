//! The ring layer: every io_uring in volring, and the epoll fallback, on
//! one core.
//!
//! # What the core owns
//! `core::UringCore` is one io_uring plus an `ops::OpTable`: a slab of
//! every operation handed to the kernel, each holding what the kernel may
//! touch (buffer, timespec, iovecs, the fd's `Arc`) until the op's last
//! completion. An op's `user_data` is its slab key plus a generation, so a
//! completion that arrives after its op ended (abandoned at a deadline,
//! cancelled in a race) matches nothing instead of the newer op in the same
//! slot. The epoll engine keeps its ops in the same kind of table.
//!
//! # Op life cycle
//! 1. *start*: the op goes into the table, its sqe (pointing only into the
//!    op's own heap memory) is queued under the table's user_data.
//! 2. *in flight*: the table owns the op; the user keeps only the
//!    user_data (its [`OpId`], or nothing). Cancelling asks the
//!    kernel to end it; the op stays in the table all the same.
//! 3. *reaped*: on the last completion (no `MORE` flag) the op leaves the
//!    table and what it held goes back to the user (a read's buffer) or is
//!    released (a send's buffers, a close's file slot).
//!
//! # The Drop contract
//! Dropping a core — a clean stop, an early `?`, a driver's panic
//! unwinding through a ring thread — cancels every op, waits (bounded: each
//! user picks its deadline) for their last completions, and only then frees
//! what they held. What the kernel still holds at the deadline is leaked on
//! purpose, counted and logged, never freed under it.
//! Memory shared by many ops (the NBD server's buffer arena and receive
//! pool) is leaked with them by its owner when the core reports leftovers.
//!
//! # Who uses what
//! - [`RingThread`] + [`Reactor`] (`reactor`, `uring`, `epoll`, `thread`):
//!   one std thread runs a [`Driver`] — the mount watcher, hot-plug, the
//!   stat collector — that polls, reads and sets timeouts. io_uring
//!   when the kernel allows it, else epoll and plain syscalls; drivers
//!   cannot tell them apart except by `Reactor::backend`. Its io_uring is
//!   made on that thread with `SINGLE_ISSUER | DEFER_TASKRUN` where the
//!   kernel allows, and a driver may set a batch window
//!   ([`Reactor::set_batch_window`]): the mount watcher handles a storm of
//!   fanotify events once a millisecond instead of once per event.
//! - [`ReadBatch`]: many reads at once, waited for on the calling
//!   thread. A ring thread's [`Reactor`] runs them on its own ring (the stat
//!   collector's samples: one ring per thread); [`BatchReader`] is a
//!   ring of its own for callers without one (device probes, benches).
//!   Both fall back to `pread`.
//! - [`IoRing`]: the NBD server's ring (multishot accept/receive, fixed
//!   files and buffers, splice), asked for each [`Op`]; io_uring only — the
//!   server refuses to start without it. [`Buffers`] holds its memory.
//!
//! # Hand-offs
//! Into a ring: a [`Mailbox`] (bounded lock-free queue + eventfd the ring
//! polls). Out of a ring: [`queue`] (bounded, never blocks the ring, with a
//! wakeup for async or thread consumers).
//!
//! Containers often forbid io_uring (seccomp, `kernel.io_uring_disabled`):
//! the reactor and the batch reader probe at start and fall back, saying so
//! once in the log.

#![warn(unreachable_pub)]

mod allocator;
mod allowed;
mod batch;
mod buffers;
mod core;
mod epoll;
mod io_op;
mod io_ring;
mod mailbox;
mod ops;
mod pipes;
pub mod queue;
mod reactor;
mod setup;
mod thread;
mod uring;

use std::io;

pub use batch::{BatchRead, BatchReader, ReadBatch};
pub use buffers::{BufId, Buffers};
pub use io_op::{Cqe, IoRingStats, Op, OpId, PipeId};
pub use io_ring::IoRing;
pub use mailbox::Mailbox;
pub use reactor::{Reactor, ReactorOp};
pub use setup::IoRingConfig;
pub use thread::{Driver, RingStats, RingThread};

/// A driver's name for one of its operations; comes back in the completion.
pub type Token = u64;

/// Which engine runs the reactor.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Backend {
    IoUring,
    Epoll,
}

/// What the caller wants: io_uring when the kernel allows it, or a forced choice.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum BackendChoice {
    #[default]
    Auto,
    IoUring,
    Epoll,
}

bitflags::bitflags! {
    /// `poll(2)` event bits: what a driver waits for with
    /// [`ReactorOp::Poll`]. A poll's completion carries the ready bits as
    /// the raw `u32` in [`Completion::result`] (`Events::from_bits_truncate`
    /// reads it).
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    pub struct Events: u32 {
        const IN = libc::POLLIN as u32;
        const PRI = libc::POLLPRI as u32;
        const OUT = libc::POLLOUT as u32;
        const ERR = libc::POLLERR as u32;
        const HUP = libc::POLLHUP as u32;
    }
}

/// The outcome of one operation.
#[derive(Debug)]
pub struct Completion {
    pub token: Token,
    /// Poll: the ready events. Read: bytes read. Timeout: 0.
    pub result: io::Result<u32>,
    /// The buffer of a read, handed back whole: `result` says how many bytes
    /// of it were read. (Not truncated, so the driver can reuse it without
    /// growing and zeroing it again.)
    pub buf: Option<Vec<u8>>,
}

/// What a driver tells the ring after handling a callback.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Flow {
    Continue,
    Stop,
}
