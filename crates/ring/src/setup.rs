//! The one way a ring is made, for every io_uring in the crate: the
//! reactor's (mount watcher, hot-plug, the stat collector: its timer, mailbox
//! and batched reads), the batch reader's (the probes) and the NBD server's.
//!
//! Each asks for `SINGLE_ISSUER | DEFER_TASKRUN` (6.1+: the kernel runs
//! completion work only when the ring's thread waits, instead of
//! interrupting it) and gets a plain ring where the kernel refuses; the
//! NBD server's also asks for its completion queue's size, SUBMIT_ALL,
//! COOP_TASKRUN and TASKRUN_FLAG (5.19+), and for the ring to start disabled, so its restrictions
//! are in place before any operation can be submitted.

use std::io;
use std::sync::Once;

use io_uring::IoUring;

/// Sizes of one [`IoRing`](super::io_ring::IoRing).
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
            // Room for a multishot receive on every fixed-file slot (an
            // idle connection's only op) and the I/O of busy ones: ops in
            // flight are capped at what the completion queue holds.
            cq_entries: 32768,
            files: 16384,
            arena_slots: 64,
            arena_slot_size: 128 * 1024,
            heap_cache: 64 << 20,
            recv_bufs: 128,
            recv_buf_size: 64 * 1024,
        }
    }
}

/// How to make one ring.
#[derive(Debug, Clone, Copy)]
pub(crate) struct RingSetup {
    /// Submission queue entries (clamped to the kernel's maximum).
    pub entries: u32,
    /// Completion queue entries; the kernel's default (twice `entries`) if `None`.
    pub cq_entries: Option<u32>,
    /// SUBMIT_ALL, COOP_TASKRUN and TASKRUN_FLAG: a server's ring.
    pub server: bool,
    /// Made disabled (R_DISABLED): enabled once restrictions are registered.
    pub disabled: bool,
}

impl RingSetup {
    pub(crate) fn new(entries: u32) -> Self {
        RingSetup { entries, cq_entries: None, server: false, disabled: false }
    }

    /// The ring, and whether it defers task work.
    pub(crate) fn build(&self) -> io::Result<(IoUring, bool)> {
        let build = |defer: bool| {
            let mut b = IoUring::builder();
            b.setup_clamp();
            if let Some(cq) = self.cq_entries {
                b.setup_cqsize(cq);
            }
            if self.server {
                // TASKRUN_FLAG: the ring says in shared memory when task work is
                // queued for it, so a poll sees a request without a system call.
                b.setup_submit_all().setup_coop_taskrun().setup_taskrun_flag();
            }
            if self.disabled {
                b.setup_r_disabled();
            }
            if defer {
                b.setup_single_issuer().setup_defer_taskrun();
            }
            b.build(self.entries.max(1))
        };
        match build(true) {
            Ok(ring) => Ok((ring, true)),
            Err(first) => {
                static ONCE: Once = Once::new();
                ONCE.call_once(
                    || tracing::info!(error = %first, "io_uring refuses SINGLE_ISSUER|DEFER_TASKRUN (before 6.1); rings are plain ones"),
                );
                Ok((build(false)?, false))
            }
        }
    }
}

/// The kernel pins registered buffers and, for a process without
/// CAP_IPC_LOCK, counts them against RLIMIT_MEMLOCK: over it, ENOMEM. Said
/// as that (not as a kernel too old for io_uring).
pub(crate) fn pinned_memory(e: io::Error, iovecs: &[libc::iovec]) -> io::Error {
    if e.raw_os_error() != Some(libc::ENOMEM) {
        return e;
    }
    let bytes: usize = iovecs.iter().map(|v| v.iov_len).sum();
    let limit = rustix::process::getrlimit(rustix::process::Resource::Memlock)
        .current
        .map_or("unlimited".to_string(), |n| format!("{} KiB", n >> 10));
    io::Error::new(
        io::ErrorKind::OutOfMemory,
        format!(
            "registering the ring's {} KiB of I/O buffers: ENOMEM, pinned memory over RLIMIT_MEMLOCK (ulimit -l: {limit}) \
             for a process without CAP_IPC_LOCK: raise the limit (ulimit -l, systemd LimitMEMLOCK=) or run as root",
            bytes >> 10
        ),
    )
}

/// Raises this process's soft RLIMIT_NOFILE to its hard limit (once is
/// enough; later calls change nothing) and returns the soft limit.
pub(crate) fn raise_nofile_limit() -> u32 {
    use rustix::process::{getrlimit, setrlimit, Resource};
    let mut limit = getrlimit(Resource::Nofile);
    if limit.current != limit.maximum {
        limit.current = limit.maximum;
        let _ = setrlimit(Resource::Nofile, limit);
        limit = getrlimit(Resource::Nofile);
    }
    limit.current.map_or(u32::MAX, |n| u32::try_from(n).unwrap_or(u32::MAX))
}
