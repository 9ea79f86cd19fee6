//! The mount watcher: a ring thread that keeps the table and tells consumers
//! what changed.
//!
//! Two strategies, chosen at start:
//! - **fanotify** (6.15+): `FAN_MNT_ATTACH`/`FAN_MNT_DETACH` on the mount
//!   namespace name the ids that changed; `statmount` reads only those. A
//!   multishot POLLPRI on mountinfo catches what fanotify does not report
//!   (remounts): a POLLPRI that no fanotify event pairs with (see `remount`)
//!   triggers a resync. Queue overflow triggers a resync sent as one
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
use volring_ring::{self as ring, queue, BackendChoice, RingThread};

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
    /// How long a remount check (a POLLPRI no fanotify event has paired
    /// with) waits at most for a fanotify read the ring has in flight,
    /// whose events may explain it. With no read in flight it decides at
    /// once (see `remount`).
    pub remount_grace: Duration,
    /// Full resync period (fanotify mode); `None` disables it.
    pub resync_interval: Option<Duration>,
    /// Resolve each event's block devices through sysfs.
    pub resolve_devices: bool,
    /// Watch this mount namespace (e.g. `/proc/1/ns/mnt`) instead of the
    /// caller's. Only the ring thread joins it.
    pub namespace: Option<std::path::PathBuf>,
    /// How long the ring thread gathers fanotify events once a wait has
    /// begun, so a storm is handled (and handed to the consumer) once per
    /// window rather than once per event; see
    /// [`ring::Reactor::set_batch_window`]. Zero wakes for every event.
    /// Bounds the added latency of a change (fanotify strategy).
    pub batch_window: Duration,
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
            namespace: None,
            batch_window: Duration::from_millis(1),
        }
    }
}

/// Counters of one watcher, shared with metrics.
#[derive(Debug, Default)]
pub(super) struct Counters {
    pub(crate) deliveries: AtomicU64,
    pub mount_events: AtomicU64,
    pub(crate) fanotify_events: AtomicU64,
    pub(crate) statmount_calls: AtomicU64,
    /// Full re-reads by cause, indexed by [`ResyncCause`].
    pub resyncs: [AtomicU64; ResyncCause::ALL.len()],
    pub overflows: AtomicU64,
    pub(crate) lagged_batches: AtomicU64,
    pub(crate) parse_errors: AtomicU64,
    pub errors: AtomicU64,
}

/// A point-in-time copy of a watcher's counters.
#[derive(Debug, Clone, Serialize)]
pub struct WatcherStats {
    /// The strategy in use (never `Auto`).
    pub mode: WatchMode,
    pub backend: ring::Backend,
    pub cpu: Duration,
    pub(crate) deliveries: u64,
    pub mount_events: u64,
    pub(crate) fanotify_events: u64,
    pub(crate) statmount_calls: u64,
    /// Full re-reads of the table, whatever their cause.
    pub resyncs: u64,
    /// The same, by cause.
    pub resyncs_by: ResyncCounts,
    pub overflows: u64,
    pub(crate) lagged_batches: u64,
    pub(crate) parse_errors: u64,
    pub errors: u64,
}

/// Why the watcher re-read the whole table. Only [`ResyncCause::Overflow`]
/// means events were lost; the periodic resync runs on an idle node too, so
/// an alert on resyncs must tell the causes apart.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ResyncCause {
    /// fanotify's queue overflowed or its data could not be read: events
    /// were lost.
    Overflow,
    /// The periodic resync (`WatchConfig::resync_interval`).
    Periodic,
    /// A mountinfo change no fanotify event explained (a remount).
    Unpaired,
    /// Asked for through [`MountWatcher::resync`].
    Requested,
    /// The reparse strategy re-reads the table on every change.
    Reparse,
}

impl ResyncCause {
    pub(crate) const ALL: [ResyncCause; 5] = [Self::Overflow, Self::Periodic, Self::Unpaired, Self::Requested, Self::Reparse];

    /// The `reason` label value of `volring_mount_resyncs_total`.
    pub(crate) fn label(self) -> &'static str {
        match self {
            Self::Overflow => "overflow",
            Self::Periodic => "periodic",
            Self::Unpaired => "unpaired_remount",
            Self::Requested => "requested",
            Self::Reparse => "reparse",
        }
    }
}

/// Resync counts by cause.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct ResyncCounts {
    pub overflow: u64,
    pub periodic: u64,
    pub unpaired_remount: u64,
    pub requested: u64,
    pub reparse: u64,
}

impl ResyncCounts {
    /// Each cause's `reason` label (of `volring_mount_resyncs_total`) with
    /// its count.
    pub fn by_reason(&self) -> [(&'static str, u64); 5] {
        self.by_cause().map(|(cause, n)| (cause.label(), n))
    }

    /// Each cause with its count, in [`ResyncCause::ALL`]'s order.
    pub(crate) fn by_cause(&self) -> [(ResyncCause, u64); 5] {
        [
            (ResyncCause::Overflow, self.overflow),
            (ResyncCause::Periodic, self.periodic),
            (ResyncCause::Unpaired, self.unpaired_remount),
            (ResyncCause::Requested, self.requested),
            (ResyncCause::Reparse, self.reparse),
        ]
    }

    pub(crate) fn total(&self) -> u64 {
        self.by_cause().iter().map(|(_, n)| n).sum()
    }
}

impl Counters {
    pub(super) fn resynced(&self, cause: ResyncCause) {
        self.resyncs[cause as usize].fetch_add(1, Ordering::Relaxed);
    }
}

/// Commands from the async side.
#[derive(Debug)]
pub(crate) enum Command {
    /// Re-read the whole table now and report the differences.
    Resync,
}

/// The driver on the ring thread: one of the two strategies, chosen there,
/// inside the namespace it watches.
enum Strategy {
    Fanotify(Box<fanotify::FanotifyDriver>),
    Reparse(Box<reparse::ReparseDriver>),
}

impl Strategy {
    /// Joins the namespace if asked, picks the strategy, takes the snapshot.
    fn make(config: &WatchConfig, emitter: emitter::Emitter) -> Result<Self, Error> {
        if let Some(ns) = &config.namespace {
            volring_sys::ns::join_mount_namespace_on_this_thread(ns).map_err(|e| Error::Io("join mount namespace", e))?;
        }
        let use_fanotify = match config.mode {
            WatchMode::Fanotify => true,
            WatchMode::Reparse => false,
            WatchMode::Auto => match fanotify::support() {
                Ok(()) => true,
                Err(e) => {
                    tracing::warn!("{e}; watching mounts by re-reading mountinfo");
                    false
                }
            },
        };
        if use_fanotify {
            return Ok(Strategy::Fanotify(Box::new(fanotify::FanotifyDriver::new(config, emitter)?)));
        }
        Ok(Strategy::Reparse(Box::new(reparse::ReparseDriver::new(emitter)?)))
    }

    fn mode(&self) -> WatchMode {
        match self {
            Strategy::Fanotify(_) => WatchMode::Fanotify,
            Strategy::Reparse(_) => WatchMode::Reparse,
        }
    }

    fn table(&self) -> &MountTable {
        match self {
            Strategy::Fanotify(d) => d.table(),
            Strategy::Reparse(d) => d.table(),
        }
    }
}

impl ring::Driver for Strategy {
    type Command = Command;

    fn start(&mut self, ring: &mut ring::Reactor) -> std::io::Result<()> {
        match self {
            Strategy::Fanotify(d) => d.start(ring),
            Strategy::Reparse(d) => d.start(ring),
        }
    }

    fn on_command(&mut self, cmd: Command, ring: &mut ring::Reactor) -> ring::Flow {
        match self {
            Strategy::Fanotify(d) => d.on_command(cmd, ring),
            Strategy::Reparse(d) => d.on_command(cmd, ring),
        }
    }

    fn on_completion(&mut self, c: ring::Completion, ring: &mut ring::Reactor) -> ring::Flow {
        match self {
            Strategy::Fanotify(d) => d.on_completion(c, ring),
            Strategy::Reparse(d) => d.on_completion(c, ring),
        }
    }

    fn end_of_batch(&mut self, ring: &mut ring::Reactor) -> ring::Flow {
        match self {
            Strategy::Fanotify(d) => d.end_of_batch(ring),
            Strategy::Reparse(d) => d.end_of_batch(ring),
        }
    }
}

/// A running watcher.
pub struct MountWatcher {
    thread: RingThread<Strategy>,
    mode: WatchMode,
    counters: Arc<Counters>,
}

impl MountWatcher {
    /// Starts watching (this thread's mount namespace, or
    /// `config.namespace`). Returns the table as it was when watching began,
    /// and the queue every later change arrives on.
    pub fn start(config: WatchConfig) -> Result<(Self, MountTable, queue::Receiver<WatchEvent>), Error> {
        let counters = Arc::new(Counters::default());
        let (tx, rx) = queue::bounded(config.queue_capacity);
        let emitter = emitter::Emitter::new(tx, counters.clone(), config.resolve_devices);
        let (made_tx, made_rx) = std::sync::mpsc::sync_channel(1);
        let backend = config.backend;
        let make = move || {
            let s = Strategy::make(&config, emitter).map_err(std::io::Error::other)?;
            let _ = made_tx.send((s.mode(), s.table().clone()));
            Ok(s)
        };
        let thread = RingThread::spawn_with("volring-mounts", make, backend, 16).map_err(|e| match e.downcast::<Error>() {
            Ok(inner) => inner,
            Err(e) => Error::Io("start mount watcher", e),
        })?;
        let (mode, initial) = made_rx.recv().map_err(|_| Error::Io("start mount watcher", std::io::Error::other("no initial table")))?;
        Ok((Self { thread, mode, counters }, initial, rx))
    }

    /// `Ok` when this kernel (in the caller's mount namespace) has what
    /// `WatchMode::Fanotify` needs, else the `Error::Unsupported` saying what
    /// is missing; `WatchMode::Auto` falls back to reparse there.
    pub fn fanotify_support() -> Result<(), Error> {
        fanotify::support()
    }

    /// Asks for a full resync; false when the command queue is full (one is
    /// already pending then, which serves the same purpose).
    pub fn resync(&self) -> bool {
        self.thread.send(Command::Resync).is_ok()
    }

    pub fn stats(&self) -> WatcherStats {
        snapshot(self.mode, self.thread.backend(), self.thread.stats(), &self.counters)
    }

    /// Stops the ring thread and returns the final counters, read after the
    /// thread has ended so they include its last turns.
    pub fn stop(self) -> Result<WatcherStats, Error> {
        let (ring, backend) = (self.thread.stats().clone(), self.thread.backend());
        self.thread.stop().map_err(|e| Error::Io("mount watcher thread", e))?;
        Ok(snapshot(self.mode, backend, &ring, &self.counters))
    }
}

fn snapshot(mode: WatchMode, backend: ring::Backend, ring: &ring::RingStats, c: &Counters) -> WatcherStats {
    let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
    let by = |cause: ResyncCause| get(&c.resyncs[cause as usize]);
    let resyncs = ResyncCounts {
        overflow: by(ResyncCause::Overflow),
        periodic: by(ResyncCause::Periodic),
        unpaired_remount: by(ResyncCause::Unpaired),
        requested: by(ResyncCause::Requested),
        reparse: by(ResyncCause::Reparse),
    };
    WatcherStats {
        mode,
        backend,
        cpu: Duration::from_nanos(get(&ring.cpu_ns)),
        deliveries: get(&c.deliveries),
        mount_events: get(&c.mount_events),
        fanotify_events: get(&c.fanotify_events),
        statmount_calls: get(&c.statmount_calls),
        resyncs: resyncs.total(),
        resyncs_by: resyncs,
        overflows: get(&c.overflows),
        lagged_batches: get(&c.lagged_batches),
        parse_errors: get(&c.parse_errors),
        errors: get(&c.errors),
    }
}
