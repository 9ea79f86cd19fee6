//! The ring thread on both engines: readiness, reads, timeouts, commands;
//! and the Drop contract: a ring that goes away with reads in flight (a
//! driver that panics, a start that fails) never frees a buffer the kernel
//! may still write.

// The poisoning allocator below (it detects a kernel write into a freed
// buffer) is the one place outside src/sys and src/ring that needs unsafe;
// each unsafe block still says why it is sound (clippy checks).
#![allow(unsafe_code)]

use std::alloc::{GlobalAlloc, Layout, System};
use std::collections::HashSet;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::sync::atomic::{AtomicI32, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use volring_ring::{queue, Backend, BackendChoice, Completion, Driver, Events, Flow, Reactor, ReactorOp, RingThread};

/// The longest a test waits for the ring thread (an event, a report): each
/// wait ends as soon as it arrives, so the bound only matters on a loaded CI
/// host and in the emulated 6.1 guest of tests/vm.rs.
const PATIENCE: Duration = Duration::from_secs(30);

const READY: u64 = 1;
const READ: u64 = 2;
const TIMER: u64 = 3;

/// Echoes what it reads from a pipe, and reports timer and commands.
struct Echo {
    pipe: Arc<OwnedFd>,
    out: queue::Sender<String>,
    reading: bool,
}

impl Echo {
    /// Hands one line to the test, waking it (a full queue drops the line).
    fn say(&mut self, line: String) {
        let _ = self.out.push(line);
        self.out.announce();
    }
}

impl Driver for Echo {
    type Command = String;

    fn start(&mut self, ring: &mut Reactor) -> std::io::Result<()> {
        ring.submit(READY, ReactorOp::Poll { fd: self.pipe.clone(), events: Events::IN })?;
        ring.submit(TIMER, ReactorOp::Timeout(Duration::from_millis(20)))
    }

    fn on_command(&mut self, cmd: String, _ring: &mut Reactor) -> Flow {
        if cmd == "stop" {
            return Flow::Stop;
        }
        self.say(format!("cmd:{cmd}"));
        Flow::Continue
    }

    fn on_completion(&mut self, c: Completion, ring: &mut Reactor) -> Flow {
        match c.token {
            READY if !self.reading => {
                self.reading = true;
                ring.submit(READ, ReactorOp::Read { fd: self.pipe.clone(), buf: vec![0; 64], offset: None }).expect("read queued");
            }
            READ => {
                self.reading = false;
                let buf = c.buf.expect("read returns its buffer");
                assert_eq!(buf.len(), 64, "the buffer comes back whole");
                let n = c.result.expect("read ok") as usize;
                self.say(format!("read:{}", String::from_utf8_lossy(&buf[..n])));
            }
            TIMER => {
                assert!(c.result.is_ok(), "a timeout that expires is not an error");
                self.say("timer".into());
            }
            _ => {}
        }
        Flow::Continue
    }
}

fn exercise(choice: BackendChoice, expect: Backend) {
    // Every test that makes a ring holds SERIAL: the in-flight tests tell
    // their ring's fd from the others' by number, and a ring closed by a
    // parallel test frees a number the next ring takes.
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let (r, w) = rustix::pipe::pipe_with(rustix::pipe::PipeFlags::CLOEXEC | rustix::pipe::PipeFlags::NONBLOCK).expect("pipe");
    let (tx, rx) = queue::bounded(16);
    let t0 = Instant::now();
    let ring = RingThread::spawn_with("test-ring", move || Ok(Echo { pipe: Arc::new(r), out: tx, reading: false }), choice, 4)
        .expect("ring starts");
    assert_eq!(ring.backend(), expect);
    assert_eq!(rx.recv_timeout(PATIENCE).as_deref(), Some("timer"));
    assert!(t0.elapsed() >= Duration::from_millis(20));
    rustix::io::write(&w, b"hello").expect("write");
    assert_eq!(rx.recv_timeout(PATIENCE).as_deref(), Some("read:hello"));
    rustix::io::write(&w, b"again").expect("write");
    assert_eq!(rx.recv_timeout(PATIENCE).as_deref(), Some("read:again"));
    ring.send("x".into()).expect("command queued");
    assert_eq!(rx.recv_timeout(PATIENCE).as_deref(), Some("cmd:x"));
    ring.send("stop".into()).expect("command queued");
    ring.stop().expect("stops cleanly");
    assert_eq!(rx.recv_timeout(Duration::from_millis(100)), None, "the driver is gone and said nothing more");
}

#[test]
fn io_uring_engine() {
    exercise(BackendChoice::IoUring, Backend::IoUring);
}

#[test]
fn epoll_engine() {
    exercise(BackendChoice::Epoll, Backend::Epoll);
}

#[test]
fn a_failing_driver_start_is_reported() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    struct Fails;
    impl Driver for Fails {
        type Command = ();
        fn start(&mut self, _: &mut Reactor) -> std::io::Result<()> {
            Err(std::io::Error::other("no"))
        }
        fn on_command(&mut self, _: (), _: &mut Reactor) -> Flow {
            Flow::Continue
        }
        fn on_completion(&mut self, _: Completion, _: &mut Reactor) -> Flow {
            Flow::Continue
        }
    }
    let err = RingThread::spawn_with("fails", || Ok(Fails), BackendChoice::Auto, 1).err().expect("start error");
    assert_eq!(err.to_string(), "no");
}

// ---------------------------------------------------------------------------
// The Drop contract, checked against the kernel itself.
//
// Buffers of the reads these tests leave in flight have sizes nothing else in
// this binary allocates. When one is freed, the allocator below poisons it and
// keeps it (never hands the memory out again), then writes to the pipe the read
// waits on, on the freeing thread. If the kernel still holds the read, it
// copies the bytes into the freed buffer as that write returns, and the poison
// shows it; if the ring ended the read first, the bytes stay in the pipe.
//
// The ring's fd is duplicated while the read is in flight, the way a child
// forked by another thread keeps it: closing the ring's own fd does not then
// end its operations, so only the ring's cancel-and-reap stands between the
// kernel and freed memory.

const PANIC_BUF: usize = 7919;
const START_BUF: usize = 7937;
const POISON: u8 = 0xa5;
const LATE: &[u8] = b"LATE";

struct Quarantine;

#[global_allocator]
static ALLOC: Quarantine = Quarantine;

static KEPT: [(AtomicUsize, AtomicUsize); 64] = [const { (AtomicUsize::new(0), AtomicUsize::new(0)) }; 64];
/// Per watched size: the write end of the pipe its read waits on (-1: none).
static WATCH: [(usize, AtomicI32); 2] = [(PANIC_BUF, AtomicI32::new(-1)), (START_BUF, AtomicI32::new(-1))];

// SAFETY: every block comes from `System` with the caller's layout, so it is
// as large and as aligned as asked; a block is either given back to `System`
// with the layout it was allocated with, or kept for good (leaked), which the
// contract allows. Nothing here allocates or unwinds.
unsafe impl GlobalAlloc for Quarantine {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: our caller upholds `GlobalAlloc::alloc`'s contract (a
        // non-zero size), the one `System.alloc` needs.
        unsafe { System.alloc(layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        // SAFETY: as in `alloc`: the caller's layout has a non-zero size.
        unsafe { System.alloc_zeroed(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        let Some((_, fd)) = WATCH.iter().find(|(size, _)| *size == layout.size()) else {
            // SAFETY: the caller guarantees `ptr` came from this allocator
            // with `layout`, and this allocator got every block it handed out
            // from `System` with that same layout.
            return unsafe { System.dealloc(ptr, layout) };
        };
        // Poisoned and kept: the test reads it later, nothing reuses it.
        // SAFETY: `ptr` is a live block of `layout.size()` bytes from this
        // allocator (the caller's contract) that nobody uses any more, so
        // writing all of its bytes stays in bounds and races with no one.
        unsafe { std::ptr::write_bytes(ptr, POISON, layout.size()) };
        if let Some((_, n)) = KEPT.iter().find(|(p, _)| p.compare_exchange(0, ptr as usize, Ordering::AcqRel, Ordering::Acquire).is_ok()) {
            n.store(layout.size(), Ordering::Release);
        }
        let fd = fd.load(Ordering::Acquire);
        if fd >= 0 {
            // Task work the kernel queued for this thread (the read's retry)
            // runs as these calls return to user space.
            // SAFETY: `write` reads `LATE.len()` bytes of a static; `fd` is a
            // plain number (if the test has closed it meanwhile, the call
            // fails with EBADF, touching no memory). `sched_yield` takes
            // nothing.
            unsafe {
                libc::write(fd, LATE.as_ptr().cast(), LATE.len());
                for _ in 0..3 {
                    libc::sched_yield();
                }
            }
        }
    }
}

/// Kept buffers of `size` whose poison something overwrote.
fn written_after_free(size: usize) -> usize {
    KEPT.iter()
        .filter(|(_, n)| n.load(Ordering::Acquire) == size)
        .filter(|(p, _)| {
            let p = p.load(Ordering::Acquire) as *const u8;
            // SAFETY: kept buffers are never given back to the system allocator.
            unsafe { std::slice::from_raw_parts(p, size) }.iter().any(|&b| b != POISON)
        })
        .count()
}

/// One Drop-contract test at a time: each watches the io_uring fds that
/// appear while its ring starts.
static SERIAL: Mutex<()> = Mutex::new(());

fn io_uring_fds() -> HashSet<i32> {
    std::fs::read_dir("/proc/self/fd")
        .map(|d| {
            d.flatten()
                .filter(|e| std::fs::read_link(e.path()).is_ok_and(|l| l.to_string_lossy().contains("io_uring")))
                .filter_map(|e| e.file_name().to_str()?.parse().ok())
                .collect()
        })
        .unwrap_or_default()
}

/// Duplicates the io_uring fds made since `before` (this ring's).
fn hold_new_rings(before: &HashSet<i32>) -> Vec<OwnedFd> {
    io_uring_fds()
        .difference(before)
        .filter_map(|&fd| {
            // SAFETY: the fd is open now (just listed) and only borrowed here.
            let fd = unsafe { std::os::fd::BorrowedFd::borrow_raw(fd) };
            fd.try_clone_to_owned().ok()
        })
        .collect()
}

/// A blocking pipe (io_uring completes reads of a non-blocking one with
/// EAGAIN at once instead of waiting) whose write end the allocator uses.
fn watched_pipe(size: usize) -> (Arc<OwnedFd>, OwnedFd) {
    let (r, w) = rustix::pipe::pipe_with(rustix::pipe::PipeFlags::CLOEXEC).expect("pipe");
    WATCH.iter().find(|(s, _)| *s == size).unwrap().1.store(w.as_raw_fd(), Ordering::Release);
    (Arc::new(r), w)
}

fn unwatch(size: usize) {
    WATCH.iter().find(|(s, _)| *s == size).unwrap().1.store(-1, Ordering::Release);
}

/// What is left in the pipe, without blocking.
fn left_in_pipe(r: &OwnedFd) -> Vec<u8> {
    let mut fds = [rustix::event::PollFd::new(r, rustix::event::PollFlags::IN)];
    let ready = rustix::event::poll(&mut fds, Some(&rustix::time::Timespec { tv_sec: 0, tv_nsec: 0 })).unwrap_or(0);
    if ready == 0 {
        return Vec::new();
    }
    let mut buf = [0u8; 64];
    let n = rustix::io::read(r.as_fd(), &mut buf).unwrap_or(0);
    buf[..n].to_vec()
}

const ARM: u64 = 10;
const QUEUED: u64 = 11;
const BOOM: u64 = 12;

/// Queues a read on a pipe nobody writes to, then panics on a later turn.
struct PanicsWithReadQueued {
    pipe: Arc<OwnedFd>,
    before: HashSet<i32>,
    held: std::sync::mpsc::Sender<Vec<OwnedFd>>,
}

impl Driver for PanicsWithReadQueued {
    type Command = ();

    fn start(&mut self, ring: &mut Reactor) -> std::io::Result<()> {
        ring.submit(ARM, ReactorOp::Timeout(Duration::from_millis(1)))
    }

    fn on_command(&mut self, _: (), _: &mut Reactor) -> Flow {
        Flow::Continue
    }

    fn on_completion(&mut self, c: Completion, ring: &mut Reactor) -> Flow {
        match c.token {
            ARM => {
                let _ = self.held.send(hold_new_rings(&self.before));
                ring.submit(QUEUED, ReactorOp::Read { fd: self.pipe.clone(), buf: vec![0; PANIC_BUF], offset: None }).expect("read queued");
                // The next wait hands the read to the kernel; the timer fires after.
                ring.submit(BOOM, ReactorOp::Timeout(Duration::from_millis(20))).expect("timer");
            }
            BOOM => {
                let _ = self.held.send(Vec::new());
                panic!("driver fails with a read in flight (expected by the test)")
            }
            _ => {}
        }
        Flow::Continue
    }
}

#[test]
fn a_driver_that_panics_with_a_read_in_flight_frees_its_buffer_only_after_the_kernel_let_go() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let (pipe, _w) = watched_pipe(PANIC_BUF);
    let (held_tx, held_rx) = std::sync::mpsc::channel();
    let before = io_uring_fds();
    let driver = PanicsWithReadQueued { pipe: pipe.clone(), before, held: held_tx };
    let ring = RingThread::spawn_with("test-panic", move || Ok(driver), BackendChoice::IoUring, 1).expect("ring starts");
    let held = held_rx.recv_timeout(PATIENCE).expect("the driver saw its ring");
    assert!(!held.is_empty(), "the ring's fd was found");
    held_rx.recv_timeout(PATIENCE).expect("the driver is about to panic");
    let err = ring.stop().err().expect("the driver panicked");
    assert_eq!(err.to_string(), "ring thread panicked");
    unwatch(PANIC_BUF);
    let written = written_after_free(PANIC_BUF);
    let left = left_in_pipe(&pipe);
    drop(held);
    assert_eq!(written, 0, "the kernel wrote into a read buffer after it was freed");
    assert_eq!(left, LATE, "the bytes written after the buffer was freed are still in the pipe");
}

/// Queues a read, then so many timers that the read reaches the kernel, and
/// fails its start.
struct FailsWithReadsInFlight {
    pipe: Arc<OwnedFd>,
    before: HashSet<i32>,
    held: std::sync::mpsc::Sender<Vec<OwnedFd>>,
}

impl Driver for FailsWithReadsInFlight {
    type Command = ();

    fn start(&mut self, ring: &mut Reactor) -> std::io::Result<()> {
        ring.submit(QUEUED, ReactorOp::Read { fd: self.pipe.clone(), buf: vec![0; START_BUF], offset: None })?;
        // More than any submission queue here holds: queueing them submits.
        for _ in 0..1024 {
            ring.submit(ARM, ReactorOp::Timeout(Duration::from_secs(3600)))?;
        }
        let _ = self.held.send(hold_new_rings(&self.before));
        Err(std::io::Error::other("start fails with reads in flight"))
    }

    fn on_command(&mut self, _: (), _: &mut Reactor) -> Flow {
        Flow::Continue
    }

    fn on_completion(&mut self, _: Completion, _: &mut Reactor) -> Flow {
        Flow::Continue
    }
}

#[test]
fn a_start_that_fails_with_reads_in_flight_frees_their_buffers_only_after_the_kernel_let_go() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let (pipe, _w) = watched_pipe(START_BUF);
    let (held_tx, held_rx) = std::sync::mpsc::channel();
    let before = io_uring_fds();
    let driver = FailsWithReadsInFlight { pipe: pipe.clone(), before, held: held_tx };
    let err = RingThread::spawn_with("test-start", move || Ok(driver), BackendChoice::IoUring, 1).err().expect("start fails");
    assert_eq!(err.to_string(), "start fails with reads in flight");
    unwatch(START_BUF);
    let held = held_rx.recv_timeout(PATIENCE).expect("the driver saw its ring");
    assert!(!held.is_empty(), "the ring's fd was found");
    let written = written_after_free(START_BUF);
    let left = left_in_pipe(&pipe);
    drop(held);
    assert_eq!(written, 0, "the kernel wrote into a read buffer after it was freed");
    assert_eq!(left, LATE, "the bytes written after the buffer was freed are still in the pipe");
}
