//! [`RingThread`]: a std thread that owns one [`Reactor`] and runs one
//! [`Driver`] on it, fed through a [`Mailbox`].

use std::io;
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;

use super::mailbox::Mailbox;
use super::{Backend, BackendChoice, Completion, Flow, Reactor};

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

/// Counters a ring thread keeps about itself (for metrics and benches).
#[derive(Debug, Default)]
pub struct RingStats {
    /// CPU time of the ring thread: refreshed after a loop turn once a
    /// millisecond of wall time has passed since the last refresh (so it
    /// may lag by what the thread ran in that millisecond), and exact once
    /// the thread has ended.
    pub cpu_ns: AtomicU64,
    pub completions: AtomicU64,
    pub wakeups: AtomicU64,
    pub commands: AtomicU64,
}

/// A running ring thread and the way in to its driver.
pub struct RingThread<D: Driver> {
    mailbox: Arc<Mailbox<D::Command>>,
    stop: Arc<AtomicBool>,
    stats: Arc<RingStats>,
    backend: Backend,
    join: Option<JoinHandle<io::Result<D>>>,
}

impl<D: Driver> RingThread<D> {
    /// Starts a new thread named `name`, builds the driver there with `make`
    /// (so a driver can be made where it runs: in another namespace, say)
    /// and returns once the driver's `start` has run, with its error if
    /// `make` or `start` failed. A driver made beforehand is passed as
    /// `move || Ok(driver)`.
    pub fn spawn_with<F>(name: &str, make: F, choice: BackendChoice, command_capacity: usize) -> io::Result<Self>
    where
        F: FnOnce() -> io::Result<D> + Send + 'static,
    {
        let mailbox = Arc::new(Mailbox::new(command_capacity)?);
        let stop = Arc::new(AtomicBool::new(false));
        let stats = Arc::new(RingStats::default());
        let (ready_tx, ready_rx) = std::sync::mpsc::sync_channel(1);
        let (m, s, st) = (mailbox.clone(), stop.clone(), stats.clone());
        let join = std::thread::Builder::new().name(name.to_string()).spawn(move || run(make, choice, m, s, st, ready_tx))?;
        match ready_rx.recv() {
            Ok(backend) => Ok(Self { mailbox, stop, stats, backend, join: Some(join) }),
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
    /// mailbox is full so the caller decides (retry, drop with a count, fail).
    pub fn send(&self, cmd: D::Command) -> Result<(), D::Command> {
        self.mailbox.send(cmd)
    }

    /// Stops the loop, joins the thread and returns the driver.
    pub fn stop(mut self) -> io::Result<D> {
        self.stop.store(true, Ordering::Release);
        self.mailbox.wake();
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
            self.mailbox.wake();
            let _ = join.join();
        }
    }
}

fn cpu_now(stats: &RingStats) {
    stats.cpu_ns.store(volring_sys::thread_cpu_time().as_nanos() as u64, Ordering::Relaxed);
}

/// How often a busy ring thread refreshes [`RingStats::cpu_ns`]. The
/// thread's CPU clock is a real syscall that takes the run-queue lock (12%
/// of a mount storm's samples when read every turn); the monotonic clock
/// that paces it is read in the vDSO.
const CPU_READ_EVERY: std::time::Duration = std::time::Duration::from_millis(1);

/// The loop. The reactor is a local: however this function is left — a
/// stop, an error, a panic in the driver unwinding through it — dropping
/// the reactor cancels and reaps its ops before their buffers are freed.
fn run<D: Driver>(
    make: impl FnOnce() -> io::Result<D>,
    choice: BackendChoice,
    mailbox: Arc<Mailbox<D::Command>>,
    stop: Arc<AtomicBool>,
    stats: Arc<RingStats>,
    ready: std::sync::mpsc::SyncSender<Backend>,
) -> io::Result<D> {
    let mut driver = make()?;
    let mut reactor = Reactor::new(choice, mailbox.as_raw_fd())?;
    driver.start(&mut reactor)?;
    cpu_now(&stats);
    let _ = ready.send(reactor.backend());
    let mut completions = Vec::with_capacity(256);
    let mut flow = Flow::Continue;
    let mut cpu_read_at = std::time::Instant::now();
    while flow == Flow::Continue && !stop.load(Ordering::Acquire) {
        let mut woken = false;
        completions.clear();
        if let Err(e) = reactor.wait(&mut completions, &mut woken) {
            if e.kind() != io::ErrorKind::Interrupted {
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
            mailbox.clear_wakeup();
            while flow == Flow::Continue {
                let Some(cmd) = mailbox.recv() else { break };
                stats.commands.fetch_add(1, Ordering::Relaxed);
                flow = driver.on_command(cmd, &mut reactor);
            }
        }
        if flow == Flow::Continue {
            flow = driver.end_of_batch(&mut reactor);
        }
        let now = std::time::Instant::now();
        if now.duration_since(cpu_read_at) >= CPU_READ_EVERY {
            cpu_read_at = now;
            cpu_now(&stats);
        }
    }
    drop(reactor);
    cpu_now(&stats);
    Ok(driver)
}
