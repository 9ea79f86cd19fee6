//! The reconciler: converges the actual state of each volume on its desired
//! state, on every batch of mount and device events and on a periodic
//! resync.
//!
//! It runs on its own thread and is told *which* volumes may have changed:
//! a mount event names a path, a device event a loop device, a CSI call a
//! volume id; an index maps each to its volume, so the cost of an event is
//! the cost of the volumes it touches, not of every volume on the node. The
//! periodic resync looks at every volume.
//!
//! It acts only on what volring owns: a staging mount that vanished or a
//! loop device detached behind its back is restored with the stage's own
//! idempotent steps, and an operation a crash interrupted is finished.
//! Published targets are kubelet's: their drift is reported, never
//! repaired. Acting takes the same per-volume lock a CSI call takes (a
//! volume a call is working on is left to the call, and looked at again).

use std::collections::{HashMap, HashSet};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError, Sender};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use super::actual::{self, Action, HealthView, Repair, VolumeHealth};
use super::store::{Change, Store};
use crate::mounts::MountTable;
use crate::volumes::StagedVolume;

/// What the reconciler acts through: the desired records and the one place
/// that may change the machine for a volume (the CSI driver, under the
/// volume's lock).
pub trait Volumes: Send + Sync + 'static {
    fn record(&self, id: &str) -> Option<StagedVolume>;
    fn ids(&self) -> Vec<String>;
    fn act(&self, id: &str, action: Action) -> Acted;
    /// Devices and mounts under volring's paths that no record explains,
    /// described; removed too when `remove` (only what nothing holds).
    fn orphans(&self, remove: bool) -> Vec<String>;
}

/// How an attempt to act went.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Acted {
    Done,
    /// Proven intact when looked at under the lock (the table had not
    /// caught up yet): nothing was done.
    Intact,
    /// A CSI call holds the volume: look again shortly.
    Busy,
    Failed(String),
}

#[derive(Debug, Clone)]
pub struct ReconcileConfig {
    /// Every volume is looked at this often (besides on events).
    pub resync: Duration,
    /// Repair what can be repaired (false: only report drift).
    pub repair: bool,
    /// Detach loop devices serving pool images that no record explains
    /// (false: only report them).
    pub remove_orphans: bool,
}

impl Default for ReconcileConfig {
    fn default() -> Self {
        Self { resync: Duration::from_secs(60), repair: true, remove_orphans: false }
    }
}

/// Upper bounds of the pass-duration histogram's buckets, microseconds:
/// a pass over one volume takes tens of microseconds, a startup pass over
/// 10,000 about 0.2 s, a pass that waits on a stuck mount much longer.
pub const PASS_BUCKETS_US: [u64; 8] = [100, 1_000, 10_000, 100_000, 1_000_000, 10_000_000, 60_000_000, 600_000_000];

/// Counters and a duration histogram, for `/metrics`; all lock-free but
/// the orphan list, which only a resync writes.
#[derive(Default)]
pub struct ReconcileStats {
    pub passes: AtomicU64,
    pub repairs_done: AtomicU64,
    pub repairs_failed: AtomicU64,
    /// Volumes looked at, all passes together.
    pub volumes_assessed: AtomicU64,
    /// What the last resync found that no record explains.
    pub orphans: Mutex<Vec<String>>,
    /// Passes per duration bucket ([`PASS_BUCKETS_US`], then one past the
    /// last bound), not cumulative.
    pub pass_buckets: [AtomicU64; PASS_BUCKETS_US.len() + 1],
    /// All passes' durations together, microseconds.
    pub pass_sum_us: AtomicU64,
}

impl ReconcileStats {
    fn record_pass(&self, d: Duration, volumes: usize) {
        self.passes.fetch_add(1, Ordering::Relaxed);
        self.volumes_assessed.fetch_add(volumes as u64, Ordering::Relaxed);
        let us = u64::try_from(d.as_micros()).unwrap_or(u64::MAX);
        let bucket = PASS_BUCKETS_US.iter().position(|&b| us <= b).unwrap_or(PASS_BUCKETS_US.len());
        self.pass_buckets[bucket].fetch_add(1, Ordering::Relaxed);
        self.pass_sum_us.fetch_add(us, Ordering::Relaxed);
    }
}

enum Msg {
    Paths(Vec<PathBuf>),
    Device(String),
    Volume(String),
    Resync,
    Stop,
}

/// A handle to the running reconciler.
pub struct Reconciler {
    tx: Sender<Msg>,
    thread: Option<std::thread::JoinHandle<()>>,
    view: Arc<HealthView>,
    stats: Arc<ReconcileStats>,
}

impl Reconciler {
    /// Looks at every volume once, acting as needed, on the caller's thread
    /// (the agent does this before it answers Probe ready), then starts the
    /// thread that follows the events.
    pub fn start(
        config: ReconcileConfig,
        volumes: Arc<dyn Volumes>,
        table: Arc<RwLock<MountTable>>,
        store: Arc<Store>,
    ) -> std::io::Result<Self> {
        let view = Arc::new(HealthView::default());
        let stats = Arc::new(ReconcileStats::default());
        let mut core = Core::new(config, volumes, table, store, view.clone(), stats.clone());
        core.startup = true;
        core.pass(core.volumes.ids().into_iter().collect());
        core.look_for_orphans();
        core.startup = false;
        let (tx, rx) = std::sync::mpsc::channel();
        let thread = std::thread::Builder::new().name("reconciler".into()).spawn(move || core.run(rx))?;
        Ok(Self { tx, thread: Some(thread), view, stats })
    }

    /// A sender the agent and the CSI records use to say what changed.
    pub fn notifier(&self) -> Notifier {
        Notifier(self.tx.clone())
    }

    pub fn view(&self) -> &Arc<HealthView> {
        &self.view
    }

    pub fn stats(&self) -> &Arc<ReconcileStats> {
        &self.stats
    }

    pub fn stop(mut self) {
        let _ = self.tx.send(Msg::Stop);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Drop for Reconciler {
    fn drop(&mut self) {
        let _ = self.tx.send(Msg::Stop);
    }
}

/// Tells the reconciler what changed. Cheap to clone; never blocks.
#[derive(Clone)]
pub struct Notifier(Sender<Msg>);

impl Notifier {
    /// Mounts at these paths appeared, went or changed.
    pub fn paths(&self, paths: Vec<PathBuf>) {
        if !paths.is_empty() {
            let _ = self.0.send(Msg::Paths(paths));
        }
    }

    /// A block device (kernel name, `loop3`) changed or went.
    pub fn device(&self, name: &str) {
        let _ = self.0.send(Msg::Device(name.to_string()));
    }

    /// A volume's desired record changed.
    pub fn volume(&self, id: &str) {
        let _ = self.0.send(Msg::Volume(id.to_string()));
    }

    /// Look at every volume now.
    pub fn resync(&self) {
        let _ = self.0.send(Msg::Resync);
    }
}

/// How long a volume a CSI call holds waits before it is looked at again.
const BUSY_RETRY: Duration = Duration::from_millis(200);
/// The first wait after a failed repair; each failure doubles it.
const RETRY_FIRST: Duration = Duration::from_millis(500);

/// The reconciler's state, owned by its thread.
struct Core {
    config: ReconcileConfig,
    volumes: Arc<dyn Volumes>,
    table: Arc<RwLock<MountTable>>,
    store: Arc<Store>,
    view: Arc<HealthView>,
    stats: Arc<ReconcileStats>,
    /// Staging and target paths → volume.
    by_path: HashMap<PathBuf, String>,
    /// Loop device name → volume.
    by_device: HashMap<String, String>,
    /// Each volume's indexed keys, to take them out when it changes.
    keys: HashMap<String, (Vec<PathBuf>, Option<String>)>,
    /// The first pass after start: a record in the middle of an operation
    /// is what a crash left, and is finished. Later, such a record is a call
    /// that failed and said so to the CO, which retries it: reported only.
    startup: bool,
    /// Volumes whose repair failed: how many times in a row, and when to
    /// try again (backing off from half a second up to the resync period).
    failed: HashMap<String, (u32, Instant)>,
}

impl Core {
    fn new(
        config: ReconcileConfig,
        volumes: Arc<dyn Volumes>,
        table: Arc<RwLock<MountTable>>,
        store: Arc<Store>,
        view: Arc<HealthView>,
        stats: Arc<ReconcileStats>,
    ) -> Self {
        // Verdicts stored by an earlier run, so an unchanged one is not
        // written again.
        if let Ok(health) = store.health() {
            view.set_many(health.into_iter().filter_map(|(id, b)| Some((id, serde_json::from_slice(&b).ok()?))).collect());
        }
        Self {
            config,
            volumes,
            table,
            store,
            view,
            stats,
            by_path: HashMap::new(),
            by_device: HashMap::new(),
            keys: HashMap::new(),
            startup: false,
            failed: HashMap::new(),
        }
    }

    fn run(mut self, rx: Receiver<Msg>) {
        let mut next_resync = Instant::now() + self.config.resync;
        let mut busy: HashSet<String> = HashSet::new();
        loop {
            let retry = self.failed.values().map(|(_, at)| *at).min();
            let mut wake = retry.map_or(next_resync, |r| r.min(next_resync));
            if !busy.is_empty() {
                wake = wake.min(Instant::now() + BUSY_RETRY);
            }
            let wait = wake.saturating_duration_since(Instant::now());
            let mut dirty: HashSet<String> = std::mem::take(&mut busy);
            let mut resync = false;
            let first = match rx.recv_timeout(wait) {
                Ok(m) => Some(m),
                Err(RecvTimeoutError::Timeout) => None,
                Err(RecvTimeoutError::Disconnected) => return,
            };
            resync |= first.is_none() && Instant::now() >= next_resync;
            let now = Instant::now();
            dirty.extend(self.failed.iter().filter(|(_, (_, at))| *at <= now).map(|(id, _)| id.clone()));
            // Everything queued meanwhile joins this pass.
            for m in first.into_iter().chain(rx.try_iter()) {
                match m {
                    Msg::Paths(ps) => dirty.extend(ps.iter().filter_map(|p| self.by_path.get(p).cloned())),
                    Msg::Device(d) => dirty.extend(self.by_device.get(&d).cloned()),
                    Msg::Volume(id) => {
                        dirty.insert(id);
                    }
                    Msg::Resync => resync = true,
                    Msg::Stop => return,
                }
            }
            if resync {
                next_resync = Instant::now() + self.config.resync;
                self.look_for_orphans();
                dirty.extend(self.volumes.ids());
                dirty.extend(self.keys.keys().cloned());
            }
            if !dirty.is_empty() {
                busy = self.pass(dirty);
            }
        }
    }

    /// Looks at `ids`, acts where needed, publishes and stores the verdicts
    /// that changed (in one transaction). Returns the volumes a CSI call
    /// held.
    fn pass(&mut self, ids: HashSet<String>) -> HashSet<String> {
        let start = Instant::now();
        let n = ids.len();
        let mut busy = HashSet::new();
        let mut changed: Vec<(String, VolumeHealth)> = Vec::new();
        let mut publish = Vec::new();
        for id in ids {
            let Some(rec) = self.volumes.record(&id) else {
                self.unindex(&id);
                self.failed.remove(&id);
                if self.view.get(&id).is_some() {
                    self.view.remove(&id);
                }
                continue;
            };
            self.index(&rec);
            let health = match self.assess_and_act(&rec) {
                Some(h) => h,
                None => {
                    busy.insert(id);
                    continue;
                }
            };
            let before = self.view.get(&id);
            if before.as_deref() != Some(&health) {
                let stored_before = before.as_deref().is_some_and(|h| *h != VolumeHealth::default());
                if health != VolumeHealth::default() || stored_before {
                    changed.push((id.clone(), health.clone()));
                }
                publish.push((id, health));
            }
        }
        self.view.set_many(publish);
        self.store_verdicts(&changed);
        self.stats.record_pass(start.elapsed(), n);
        busy
    }

    /// The verdict on one volume after acting on it; `None` when a CSI call
    /// holds it.
    fn assess_and_act(&mut self, rec: &StagedVolume) -> Option<VolumeHealth> {
        let observed = actual::observe(rec, &read(&self.table));
        let (drift, mut action) = actual::assess(rec, &observed);
        if !self.startup && rec.phase != crate::volumes::StagePhase::Staged {
            action = Action::None;
        }
        let previous = self.view.get(&rec.volume_id);
        let mut health = VolumeHealth { drift, last_repair: previous.as_ref().and_then(|p| p.last_repair.clone()), repair_error: None };
        if action == Action::None || !self.config.repair {
            return Some(health);
        }
        if self.failed.get(&rec.volume_id).is_some_and(|(_, at)| *at > Instant::now()) {
            health.repair_error = previous.and_then(|p| p.repair_error.clone());
            return Some(health);
        }
        match self.volumes.act(&rec.volume_id, action) {
            Acted::Busy => None,
            Acted::Intact => {
                self.failed.remove(&rec.volume_id);
                health.drift.retain(|d| !matches!(d, actual::Drift::DeviceDetached | actual::Drift::StagingMissing));
                Some(health)
            }
            Acted::Done => {
                self.failed.remove(&rec.volume_id);
                self.stats.repairs_done.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(volume = %rec.volume_id, ?action, drift = ?health.drift, "repaired");
                let what = std::mem::take(&mut health.drift);
                health.last_repair = Some(Repair { what, at_unix: now_unix() });
                // What is there now, after the repair.
                match self.volumes.record(&rec.volume_id) {
                    Some(r) => health.drift = actual::assess(&r, &actual::observe(&r, &read(&self.table))).0,
                    None => {
                        self.unindex(&rec.volume_id);
                        self.view.remove(&rec.volume_id);
                        return Some(VolumeHealth::default());
                    }
                }
                Some(health)
            }
            Acted::Failed(e) => {
                self.stats.repairs_failed.fetch_add(1, Ordering::Relaxed);
                let attempts = self.failed.get(&rec.volume_id).map_or(1, |(n, _)| n + 1);
                let backoff = (RETRY_FIRST * 2u32.saturating_pow(attempts.min(16) - 1)).min(self.config.resync);
                tracing::error!(volume = %rec.volume_id, ?action, error = %e, attempts, retry_in = ?backoff, "repair failed");
                self.failed.insert(rec.volume_id.clone(), (attempts, Instant::now() + backoff));
                health.repair_error = Some(e);
                Some(health)
            }
        }
    }

    fn look_for_orphans(&self) {
        let found = self.volumes.orphans(self.config.remove_orphans);
        let mut known = self.stats.orphans.lock().unwrap_or_else(|e| e.into_inner());
        for o in found.iter().filter(|o| !known.contains(o)) {
            tracing::warn!(orphan = %o, removed = self.config.remove_orphans, "no record explains this");
        }
        *known = found;
    }

    fn store_verdicts(&self, changed: &[(String, VolumeHealth)]) {
        if changed.is_empty() {
            return;
        }
        let bytes: Vec<(&str, Vec<u8>)> =
            changed.iter().map(|(id, h)| (id.as_str(), serde_json::to_vec(h).expect("a verdict serialises"))).collect();
        let changes: Vec<Change<'_>> = bytes.iter().map(|(id, b)| Change::PutHealth(id, b)).collect();
        if let Err(e) = self.store.apply(&changes) {
            tracing::error!(error = %e, "could not store the reconciler's verdicts");
        }
    }

    fn index(&mut self, rec: &StagedVolume) {
        let mut paths: Vec<PathBuf> = vec![rec.staged_at(), rec.staging_path.clone()];
        paths.extend(rec.published.keys().cloned());
        let device = rec.device_name();
        if self.keys.get(&rec.volume_id).is_some_and(|(p, d)| *p == paths && *d == device) {
            return;
        }
        self.unindex(&rec.volume_id);
        for p in &paths {
            self.by_path.insert(p.clone(), rec.volume_id.clone());
        }
        if let Some(d) = &device {
            self.by_device.insert(d.clone(), rec.volume_id.clone());
        }
        self.keys.insert(rec.volume_id.clone(), (paths, device));
    }

    fn unindex(&mut self, id: &str) {
        if let Some((paths, device)) = self.keys.remove(id) {
            for p in paths {
                if self.by_path.get(&p).is_some_and(|v| v == id) {
                    self.by_path.remove(&p);
                }
            }
            if let Some(d) = device {
                if self.by_device.get(&d).is_some_and(|v| v == id) {
                    self.by_device.remove(&d);
                }
            }
        }
    }
}

fn read(t: &RwLock<MountTable>) -> std::sync::RwLockReadGuard<'_, MountTable> {
    t.read().unwrap_or_else(|e| e.into_inner())
}

fn now_unix() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0)
}
