//! The mount watcher: a ring thread that keeps the table and tells consumers
//! what changed.
//!
//! Two strategies, chosen at start:
//! - **fanotify** (6.15+): `FAN_MNT_ATTACH`/`FAN_MNT_DETACH` on the mount
//!   namespace name the ids that changed; `statmount` reads only those. A
//!   multishot POLLPRI on mountinfo catches what fanotify does not report
//!   (remounts): a POLLPRI that no fanotify event follows within a short grace
//!   period triggers a resync. Queue overflow triggers a resync sent as one
//!   `resync` event.
//! - **reparse**: POLLPRI on mountinfo, re-read and diff the whole table —
//!   for kernels without these APIs, and as the baseline the benches beat.
//!
//! Neither the kernel's mountinfo poll nor fanotify reports a change of
//! propagation type alone (`mount --make-shared`; checked on 6.18), so a
//! periodic resync (default 30 s) bounds how stale that can be.

mod backlog;
mod emitter;
mod fanotify;
mod remount;
mod reparse;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use serde::Serialize;

use super::event::WatchEvent;
use super::table::MountTable;
use super::Error;
use crate::ring::{self, queue, BackendChoice, RingThread};

/// Which strategy to run.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum WatchMode {
    /// fanotify + statmount when the kernel has them, else reparse.
    #[default]
    Auto,
    Fanotify,
    Reparse,
}

#[derive(Debug, Clone)]
pub struct WatchConfig {
    pub mode: WatchMode,
    pub backend: BackendChoice,
    /// Capacity of the queue to the consumer, in deliveries.
    pub queue_capacity: usize,
    /// How long a POLLPRI waits for a fanotify event to explain it before it
    /// is taken for a remount and the table is re-read.
    pub remount_grace: Duration,
    /// Full resync period (fanotify mode); `None` disables it.
    pub resync_interval: Option<Duration>,
    /// Resolve each event's block devices through sysfs.
    pub resolve_devices: bool,
}

impl Default for WatchConfig {
    fn default() -> Self {
        Self {
            mode: WatchMode::Auto,
            backend: BackendChoice::Auto,
            queue_capacity: 4096,
            remount_grace: Duration::from_millis(2),
            resync_interval: Some(Duration::from_secs(30)),
            resolve_devices: true,
        }
    }
}

/// Counters of one watcher, shared with metrics.
#[derive(Debug, Default)]
pub struct Counters {
    pub deliveries: AtomicU64,
    pub mount_events: AtomicU64,
    pub fanotify_events: AtomicU64,
    pub statmount_calls: AtomicU64,
    pub resyncs: AtomicU64,
    pub overflows: AtomicU64,
    pub lagged_batches: AtomicU64,
    pub parse_errors: AtomicU64,
    pub errors: AtomicU64,
}

/// A point-in-time copy of a watcher's counters.
#[derive(Debug, Clone, Serialize)]
pub struct WatcherStats {
    pub mode: WatchMode,
    pub backend: ring::Backend,
    pub cpu: Duration,
    pub deliveries: u64,
    pub mount_events: u64,
    pub fanotify_events: u64,
    pub statmount_calls: u64,
    pub resyncs: u64,
    pub overflows: u64,
    pub lagged_batches: u64,
    pub parse_errors: u64,
    pub errors: u64,
}

/// Commands from the async side.
#[derive(Debug)]
pub enum Command {
    /// Re-read the whole table now and report the differences.
    Resync,
}

enum Thread {
    Fanotify(RingThread<fanotify::FanotifyDriver>),
    Reparse(RingThread<reparse::ReparseDriver>),
}

/// A running watcher.
pub struct MountWatcher {
    thread: Thread,
    counters: Arc<Counters>,
}

impl MountWatcher {
    /// Starts watching this thread's mount namespace. Returns the table as it
    /// was when watching began, and the queue every later change arrives on.
    pub fn start(config: WatchConfig) -> Result<(Self, MountTable, queue::Receiver<WatchEvent>), Error> {
        let counters = Arc::new(Counters::default());
        let (tx, rx) = queue::bounded(config.queue_capacity);
        let emitter = emitter::Emitter::new(tx, counters.clone(), config.resolve_devices);
        let use_fanotify = match config.mode {
            WatchMode::Fanotify => true,
            WatchMode::Reparse => false,
            WatchMode::Auto => fanotify::available(),
        };
        let spawn_err = |e| Error::Io("start mount watcher", e);
        let (thread, initial) = if use_fanotify {
            let driver = fanotify::FanotifyDriver::new(&config, emitter)?;
            let initial = driver.table().clone();
            (Thread::Fanotify(RingThread::spawn("volring-mounts", driver, config.backend, 16).map_err(spawn_err)?), initial)
        } else {
            if config.mode == WatchMode::Auto {
                tracing::warn!("fanotify mount events or statmount unavailable; watching mounts by re-reading mountinfo");
            }
            let driver = reparse::ReparseDriver::new(emitter)?;
            let initial = driver.table().clone();
            (Thread::Reparse(RingThread::spawn("volring-mounts", driver, config.backend, 16).map_err(spawn_err)?), initial)
        };
        Ok((Self { thread, counters }, initial, rx))
    }

    pub fn mode(&self) -> WatchMode {
        match self.thread {
            Thread::Fanotify(_) => WatchMode::Fanotify,
            Thread::Reparse(_) => WatchMode::Reparse,
        }
    }

    fn ring_stats(&self) -> (&Arc<ring::RingStats>, ring::Backend) {
        match &self.thread {
            Thread::Fanotify(t) => (t.stats(), t.backend()),
            Thread::Reparse(t) => (t.stats(), t.backend()),
        }
    }

    /// Asks for a full resync; false when the command queue is full (one is
    /// already pending then, which serves the same purpose).
    pub fn resync(&self) -> bool {
        match &self.thread {
            Thread::Fanotify(t) => t.send(Command::Resync).is_ok(),
            Thread::Reparse(t) => t.send(Command::Resync).is_ok(),
        }
    }

    pub fn stats(&self) -> WatcherStats {
        let (ring, backend) = self.ring_stats();
        let c = &*self.counters;
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        WatcherStats {
            mode: self.mode(),
            backend,
            cpu: Duration::from_nanos(get(&ring.cpu_ns)),
            deliveries: get(&c.deliveries),
            mount_events: get(&c.mount_events),
            fanotify_events: get(&c.fanotify_events),
            statmount_calls: get(&c.statmount_calls),
            resyncs: get(&c.resyncs),
            overflows: get(&c.overflows),
            lagged_batches: get(&c.lagged_batches),
            parse_errors: get(&c.parse_errors),
            errors: get(&c.errors),
        }
    }

    /// Stops the ring thread and returns the final counters.
    pub fn stop(self) -> Result<WatcherStats, Error> {
        let stats = self.stats();
        let r = match self.thread {
            Thread::Fanotify(t) => t.stop().map(|_| ()),
            Thread::Reparse(t) => t.stop().map(|_| ()),
        };
        r.map_err(|e| Error::Io("mount watcher thread", e))?;
        Ok(stats)
    }
}
