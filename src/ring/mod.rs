//! The ring thread: one `io_uring` instance owned by one std thread.
//!
//! A [`Driver`] (the mount watcher today; the stat collector and the NBD
//! server later) runs on that thread. It asks for operations through the
//! [`Reactor`] it is handed and is called back with every [`Completion`]. The
//! async side reaches the driver through a bounded lock-free queue plus an
//! eventfd the ring keeps a multishot poll on ([`RingThread::send`]); the
//! driver reaches the async side through [`queue`], which never blocks.
//!
//! Containers often forbid io_uring (seccomp, `kernel.io_uring_disabled`), so
//! the reactor probes at start and falls back to epoll plus plain syscalls,
//! saying so once in the log. Drivers cannot tell the two apart except by
//! [`Reactor::backend`].

pub mod batch;
pub mod buffers;
mod epoll;
pub mod io_ring;
pub mod queue;
mod uring;

use std::collections::HashMap;
use std::io;
use std::os::fd::{AsFd, OwnedFd};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Once};
use std::thread::JoinHandle;
use std::time::Duration;

use crossbeam_queue::ArrayQueue;

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

/// `poll(2)` event bits a driver may wait for.
pub mod events {
    pub const IN: u32 = libc::POLLIN as u32;
    pub const PRI: u32 = libc::POLLPRI as u32;
    pub const OUT: u32 = libc::POLLOUT as u32;
    pub const ERR: u32 = libc::POLLERR as u32;
    pub const HUP: u32 = libc::POLLHUP as u32;
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

/// Code that runs on a ring thread.
pub trait Driver: Send + 'static {
    /// Messages from the async side.
    type Command: Send + 'static;
    /// Called once on the ring thread before the loop starts.
    fn start(&mut self, ring: &mut Reactor) -> io::Result<()>;
    fn on_command(&mut self, cmd: Self::Command, ring: &mut Reactor) -> Flow;
    fn on_completion(&mut self, c: Completion, ring: &mut Reactor) -> Flow;
    /// Called after each batch of completions and commands, before the ring
    /// waits again: the place to do once what several completions asked for.
    fn end_of_batch(&mut self, _ring: &mut Reactor) -> Flow {
        Flow::Continue
    }
}

/// An operation the ring holds until its last completion: the fd stays open
/// and the buffer stays alive for exactly that long.
enum Pending {
    Poll { fd: Arc<OwnedFd>, events: u32 },
    Read { fd: Arc<OwnedFd>, buf: Vec<u8>, offset: Option<u64> },
    Timeout,
}

struct InFlight {
    token: Token,
    op: Pending,
}

#[allow(clippy::large_enum_variant)] // one per ring thread, made once: boxing buys nothing
enum Engine {
    Uring(uring::UringEngine),
    Epoll(epoll::EpollEngine),
}

/// The operation interface a driver gets: submit, and the ring delivers.
pub struct Reactor {
    engine: Engine,
    inflight: HashMap<u64, InFlight>,
    next_slot: u64,
}

/// Slot reserved for the command eventfd.
const WAKE_SLOT: u64 = u64::MAX;

impl Reactor {
    fn new(choice: BackendChoice, wake: &Arc<OwnedFd>) -> io::Result<Self> {
        let engine = match choice {
            BackendChoice::Epoll => Engine::Epoll(epoll::EpollEngine::new(wake)?),
            BackendChoice::IoUring => Engine::Uring(uring::UringEngine::new(wake)?),
            BackendChoice::Auto => match uring::UringEngine::new(wake) {
                Ok(e) => Engine::Uring(e),
                Err(err) => {
                    static ONCE: Once = Once::new();
                    ONCE.call_once(
                        || tracing::warn!(error = %err, "io_uring unavailable; ring threads fall back to epoll and plain syscalls"),
                    );
                    Engine::Epoll(epoll::EpollEngine::new(wake)?)
                }
            },
        };
        Ok(Self { engine, inflight: HashMap::new(), next_slot: 0 })
    }

    pub fn backend(&self) -> Backend {
        match self.engine {
            Engine::Uring(_) => Backend::IoUring,
            Engine::Epoll(_) => Backend::Epoll,
        }
    }

    fn slot(&mut self, token: Token, op: Pending) -> u64 {
        let slot = self.next_slot;
        self.next_slot = self.next_slot.wrapping_add(1) % WAKE_SLOT;
        self.inflight.insert(slot, InFlight { token, op });
        slot
    }

    /// Waits for `events` on `fd` until cancelled: one completion per
    /// readiness, re-armed by the ring if the kernel ends the multishot.
    pub fn poll(&mut self, token: Token, fd: Arc<OwnedFd>, events: u32) -> io::Result<()> {
        let slot = self.slot(token, Pending::Poll { fd, events });
        self.arm(slot)
    }

    /// Reads into `buf` (its whole length) at `offset`, or at the file
    /// position when `offset` is `None`.
    pub fn read(&mut self, token: Token, fd: Arc<OwnedFd>, buf: Vec<u8>, offset: Option<u64>) -> io::Result<()> {
        let slot = self.slot(token, Pending::Read { fd, buf, offset });
        self.arm(slot)
    }

    /// Completes once after `after`.
    pub fn timeout(&mut self, token: Token, after: Duration) -> io::Result<()> {
        let slot = self.slot(token, Pending::Timeout);
        let r = match &mut self.engine {
            Engine::Uring(e) => e.timeout(slot, after),
            Engine::Epoll(e) => {
                e.timeout(slot, after);
                Ok(())
            }
        };
        if r.is_err() {
            self.inflight.remove(&slot);
        }
        r
    }

    fn arm(&mut self, slot: u64) -> io::Result<()> {
        let Some(entry) = self.inflight.get_mut(&slot) else {
            return Ok(());
        };
        let r = match (&mut self.engine, &mut entry.op) {
            (Engine::Uring(e), Pending::Poll { fd, events }) => e.poll(slot, fd.as_fd(), *events),
            (Engine::Uring(e), Pending::Read { fd, buf, offset }) => e.read(slot, fd.as_fd(), buf, *offset),
            (Engine::Epoll(e), Pending::Poll { fd, events }) => e.poll(slot, fd.as_fd(), *events),
            (Engine::Epoll(e), Pending::Read { fd, buf, offset }) => {
                e.read(slot, fd.as_fd(), buf, *offset);
                Ok(())
            }
            (_, Pending::Timeout) => Ok(()),
        };
        if r.is_err() {
            self.inflight.remove(&slot);
        }
        r
    }

    /// Blocks until at least one event, then turns raw results into
    /// completions. `woken` is set when the command eventfd fired.
    fn wait(&mut self, out: &mut Vec<Completion>, woken: &mut bool) -> io::Result<()> {
        let mut raw = Vec::new();
        match &mut self.engine {
            Engine::Uring(e) => e.wait(&mut raw)?,
            Engine::Epoll(e) => e.wait(&mut raw)?,
        }
        for r in raw {
            if r.slot == WAKE_SLOT {
                *woken = true;
                continue;
            }
            self.finish(r, out)?;
        }
        Ok(())
    }

    fn finish(&mut self, r: RawCompletion, out: &mut Vec<Completion>) -> io::Result<()> {
        let Some(entry) = self.inflight.get(&r.slot) else {
            return Ok(());
        };
        let result = if r.res < 0 { Err(io::Error::from_raw_os_error(-r.res)) } else { Ok(r.res as u32) };
        match &entry.op {
            Pending::Poll { .. } => {
                let token = entry.token;
                match &result {
                    // The kernel ended the multishot (overflow, or the file said
                    // so): arm a fresh one.
                    Ok(_) if !r.more => self.arm(r.slot)?,
                    Err(_) => {
                        self.inflight.remove(&r.slot);
                    }
                    Ok(_) => {}
                }
                out.push(Completion { token, result, buf: None });
            }
            Pending::Read { .. } => {
                let entry = self.inflight.remove(&r.slot).expect("looked up above");
                let Pending::Read { buf, .. } = entry.op else { unreachable!() };
                out.push(Completion { token: entry.token, result, buf: Some(buf) });
            }
            Pending::Timeout => {
                let entry = self.inflight.remove(&r.slot).expect("looked up above");
                let result = match result {
                    Err(e) if e.raw_os_error() == Some(libc::ETIME) => Ok(0),
                    other => other,
                };
                out.push(Completion { token: entry.token, result, buf: None });
            }
        }
        Ok(())
    }

    /// Ends every operation before the ring goes away. Buffers of reads the
    /// kernel may still be writing are leaked rather than freed under it.
    fn shutdown(&mut self) {
        let slots: Vec<u64> = self.inflight.keys().copied().collect();
        match &mut self.engine {
            Engine::Uring(e) => {
                let left = e.cancel_all(&slots);
                for slot in slots {
                    if let Some(entry) = self.inflight.remove(&slot) {
                        if left.contains(&slot) {
                            std::mem::forget(entry);
                        }
                    }
                }
            }
            Engine::Epoll(_) => self.inflight.clear(),
        }
    }
}

/// A completion before it is matched to its operation.
struct RawCompletion {
    slot: u64,
    res: i32,
    more: bool,
}

/// Counters a ring thread keeps about itself (for metrics and benches).
#[derive(Debug, Default)]
pub struct RingStats {
    /// CPU time of the ring thread, updated after every loop turn.
    pub cpu_ns: AtomicU64,
    pub completions: AtomicU64,
    pub wakeups: AtomicU64,
    pub commands: AtomicU64,
}

/// A running ring thread and the way in to its driver.
pub struct RingThread<D: Driver> {
    commands: Arc<ArrayQueue<D::Command>>,
    wake: Arc<OwnedFd>,
    stop: Arc<AtomicBool>,
    stats: Arc<RingStats>,
    backend: Backend,
    join: Option<JoinHandle<io::Result<D>>>,
}

impl<D: Driver> RingThread<D> {
    /// Starts `driver` on a new thread named `name`. Returns once the driver's
    /// `start` has run, with its error if it failed.
    pub fn spawn(name: &str, driver: D, choice: BackendChoice, command_capacity: usize) -> io::Result<Self> {
        Self::spawn_with(name, move || Ok(driver), choice, command_capacity)
    }

    /// Like `spawn`, but builds the driver on the ring thread itself, for
    /// drivers that must be made where they run (in another namespace, say).
    pub fn spawn_with<F>(name: &str, make: F, choice: BackendChoice, command_capacity: usize) -> io::Result<Self>
    where
        F: FnOnce() -> io::Result<D> + Send + 'static,
    {
        let commands = Arc::new(ArrayQueue::new(command_capacity.max(1)));
        let wake = Arc::new(rustix::event::eventfd(0, rustix::event::EventfdFlags::CLOEXEC | rustix::event::EventfdFlags::NONBLOCK)?);
        let stop = Arc::new(AtomicBool::new(false));
        let stats = Arc::new(RingStats::default());
        let (ready_tx, ready_rx) = std::sync::mpsc::sync_channel(1);
        let (q, w, s, st) = (commands.clone(), wake.clone(), stop.clone(), stats.clone());
        let join = std::thread::Builder::new().name(name.to_string()).spawn(move || run(make, choice, q, w, s, st, ready_tx))?;
        match ready_rx.recv() {
            Ok(backend) => Ok(Self { commands, wake, stop, stats, backend, join: Some(join) }),
            // The thread ended during start: its result holds the original error.
            Err(_) => Err(match join.join() {
                Ok(Err(e)) => e,
                Ok(Ok(_)) => io::Error::other("ring thread ended during start"),
                Err(_) => io::Error::other("ring thread panicked during start"),
            }),
        }
    }

    pub fn backend(&self) -> Backend {
        self.backend
    }

    pub fn stats(&self) -> &Arc<RingStats> {
        &self.stats
    }

    /// Hands `cmd` to the driver without blocking; gives it back when the
    /// queue is full so the caller decides (retry, drop with a count, fail).
    pub fn send(&self, cmd: D::Command) -> Result<(), D::Command> {
        self.commands.push(cmd)?;
        wake(&self.wake);
        Ok(())
    }

    /// Stops the loop, joins the thread and returns the driver.
    pub fn stop(mut self) -> io::Result<D> {
        self.stop.store(true, Ordering::Release);
        wake(&self.wake);
        match self.join.take().expect("joined once").join() {
            Ok(r) => r,
            Err(_) => Err(io::Error::other("ring thread panicked")),
        }
    }
}

impl<D: Driver> Drop for RingThread<D> {
    fn drop(&mut self) {
        if let Some(join) = self.join.take() {
            self.stop.store(true, Ordering::Release);
            wake(&self.wake);
            let _ = join.join();
        }
    }
}

fn wake(fd: &OwnedFd) {
    // EAGAIN only when the counter is about to overflow: the ring is awake then.
    let _ = rustix::io::write(fd, &1u64.to_ne_bytes());
}

fn run<D: Driver>(
    make: impl FnOnce() -> io::Result<D>,
    choice: BackendChoice,
    commands: Arc<ArrayQueue<D::Command>>,
    wake_fd: Arc<OwnedFd>,
    stop: Arc<AtomicBool>,
    stats: Arc<RingStats>,
    ready: std::sync::mpsc::SyncSender<Backend>,
) -> io::Result<D> {
    let started = (|| {
        let mut driver = make()?;
        let mut reactor = Reactor::new(choice, &wake_fd)?;
        driver.start(&mut reactor)?;
        Ok::<_, io::Error>((driver, reactor))
    })();
    let (mut driver, mut reactor) = started?;
    stats.cpu_ns.store(crate::sys::thread_cpu_time().as_nanos() as u64, Ordering::Relaxed);
    let _ = ready.send(reactor.backend());
    let mut completions = Vec::with_capacity(256);
    let mut flow = Flow::Continue;
    while flow == Flow::Continue && !stop.load(Ordering::Acquire) {
        let mut woken = false;
        completions.clear();
        if let Err(e) = reactor.wait(&mut completions, &mut woken) {
            if e.kind() != io::ErrorKind::Interrupted {
                reactor.shutdown();
                return Err(e);
            }
        }
        stats.completions.fetch_add(completions.len() as u64, Ordering::Relaxed);
        for c in completions.drain(..) {
            if driver.on_completion(c, &mut reactor) == Flow::Stop {
                flow = Flow::Stop;
            }
        }
        if woken {
            stats.wakeups.fetch_add(1, Ordering::Relaxed);
            let mut drain = [0u8; 8];
            let _ = rustix::io::read(&*wake_fd, &mut drain);
            while flow == Flow::Continue {
                let Some(cmd) = commands.pop() else { break };
                stats.commands.fetch_add(1, Ordering::Relaxed);
                flow = driver.on_command(cmd, &mut reactor);
            }
        }
        if flow == Flow::Continue {
            flow = driver.end_of_batch(&mut reactor);
        }
        stats.cpu_ns.store(crate::sys::thread_cpu_time().as_nanos() as u64, Ordering::Relaxed);
    }
    reactor.shutdown();
    stats.cpu_ns.store(crate::sys::thread_cpu_time().as_nanos() as u64, Ordering::Relaxed);
    Ok(driver)
}
