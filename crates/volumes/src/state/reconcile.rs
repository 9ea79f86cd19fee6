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
//!
//! The mount table only says where to look. It is as old as the last batch
//! the watcher handed over (up to `--mount-batch-us`, more under load), so
//! a drift it shows is proven through descriptors before it is reported or
//! acted on ([`Volumes::prove`], [`actual::check`]); when the kernel shows
//! something the table does not yet, the volume waits for the watcher
//! (looked at again after a few milliseconds, doubling) and its verdict
//! only loses what the kernel has already disproved.

use std::collections::{HashMap, HashSet};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError, Sender};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use super::actual::{self, Action, Checked, HealthView, Proof, Repair, VolumeHealth};
use super::history::{RepairHistory, RepairResult};
use crate::store::{Change, Store};
use crate::{StagePhase, StagedVolume};
use volring_mounts::MountTable;

/// What the reconciler acts through: the desired records and the one place
/// that may change the machine for a volume (the CSI driver, under the
/// volume's lock).
pub trait Volumes: Send + Sync + 'static {
    fn record(&self, id: &str) -> Option<StagedVolume>;
    fn ids(&self) -> Vec<String>;
    fn act(&self, id: &str, action: Action) -> Acted;
    /// What is really there for the volume now, asked of the kernel through
    /// descriptors and the device itself, not read from the mount table.
    fn prove(&self, rec: &StagedVolume) -> Proof;
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
    /// Under the lock, the kernel showed the volume between states (its
    /// device being detached): nothing was done; look again once it
    /// settles.
    Unsettled(String),
    Failed(String),
}

/// What a look at one volume came to.
enum Outcome {
    Verdict(VolumeHealth),
    /// A CSI call holds it.
    Busy,
    /// The kernel and the table disagree: no verdict, no action, a look
    /// again soon.
    Lagging,
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

/// What changed, as the reconciler is told it ([`Notifier::tell`]).
pub enum Changed {
    /// Mounts at these paths appeared, went or changed.
    Paths(Vec<PathBuf>),
    /// A block device (kernel name, `loop3`) changed or went.
    Device(String),
    /// A volume's desired record changed.
    Volume(String),
    /// Look at every volume now.
    Resync,
}

enum Msg {
    Changed(Changed),
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
    /// Queues `what` for the reconciler's next pass (an empty path list is
    /// nothing to look at and is dropped).
    pub fn tell(&self, what: Changed) {
        if !matches!(&what, Changed::Paths(p) if p.is_empty()) {
            let _ = self.0.send(Msg::Changed(what));
        }
    }
}

/// How long a volume a CSI call holds waits before it is looked at again.
const BUSY_RETRY: Duration = Duration::from_millis(200);
/// The first wait after a failed repair; each failure doubles it.
const RETRY_FIRST: Duration = Duration::from_millis(500);
/// The first wait for the watcher to catch up with the kernel (its batch
/// window is a millisecond); each look that still disagrees doubles it...
const LAG_FIRST: Duration = Duration::from_millis(5);
/// ...up to this.
const LAG_MAX: Duration = Duration::from_millis(500);
/// A disagreement older than this is not lag: the kernel's word decides.
const LAG_LIMIT: Duration = Duration::from_secs(10);

/// A volume waiting for the watcher to catch up.
struct Lag {
    since: Instant,
    pause: Duration,
    next: Instant,
    warned: bool,
}

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
    /// Volumes whose table view the kernel contradicted: looked at again
    /// when the watcher should have caught up.
    lagging: HashMap<String, Lag>,
    /// The last repairs, kept in the store for `volring status`.
    history: RepairHistory,
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
            store: store.clone(),
            view,
            stats,
            by_path: HashMap::new(),
            by_device: HashMap::new(),
            keys: HashMap::new(),
            startup: false,
            failed: HashMap::new(),
            lagging: HashMap::new(),
            history: RepairHistory::load(&store),
        }
    }

    fn run(mut self, rx: Receiver<Msg>) {
        let mut next_resync = Instant::now() + self.config.resync;
        let mut busy: HashSet<String> = HashSet::new();
        loop {
            let retry = self.failed.values().map(|(_, at)| *at).chain(self.lagging.values().map(|l| l.next)).min();
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
            dirty.extend(self.lagging.iter().filter(|(_, l)| l.next <= now).map(|(id, _)| id.clone()));
            // Everything queued meanwhile joins this pass.
            for m in first.into_iter().chain(rx.try_iter()) {
                match m {
                    Msg::Changed(Changed::Paths(ps)) => dirty.extend(ps.iter().filter_map(|p| self.by_path.get(p).cloned())),
                    Msg::Changed(Changed::Device(d)) => dirty.extend(self.by_device.get(&d).cloned()),
                    Msg::Changed(Changed::Volume(id)) => {
                        dirty.insert(id);
                    }
                    Msg::Changed(Changed::Resync) => resync = true,
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
                self.lagging.remove(&id);
                if self.view.get(&id).is_some() {
                    self.view.remove(&id);
                }
                continue;
            };
            self.index(&rec);
            let health = match self.assess_and_act(&rec) {
                Outcome::Verdict(h) => h,
                Outcome::Busy => {
                    busy.insert(id);
                    continue;
                }
                // The verdict stays what it was until the table agrees.
                Outcome::Lagging => continue,
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
        self.history.flush(&self.store);
        self.stats.record_pass(start.elapsed(), n);
        busy
    }

    /// The verdict on one volume after acting on it, or why there is none
    /// yet.
    ///
    /// The table only says where to look: a drift it shows is proven
    /// through descriptors ([`Volumes::prove`]) before it is reported or
    /// acted on, and when the kernel shows something else the volume waits
    /// for the watcher to catch up ([`Outcome::Lagging`]) — a table one
    /// batch window old must never decide a re-mount, a re-attach or a
    /// report.
    fn assess_and_act(&mut self, rec: &StagedVolume) -> Outcome {
        let id = rec.volume_id.as_str();
        let observed = actual::observe(rec, &read(&self.table));
        let (mut drift, mut action) = actual::assess(rec, &observed);
        let mut blocked = None;
        if rec.phase == StagePhase::Staged && !drift.is_empty() {
            let proof = self.volumes.prove(rec);
            // Disagreeing for longer than any watcher lags is a table that
            // misses something (a mount it cannot see): the kernel's word
            // alone decides then, still proven, never the table's.
            let table_view = match (&proof, self.lag_expired(id)) {
                (Proof::Seen { actual, .. }, true) => actual.clone(),
                _ => observed,
            };
            match actual::check(rec, &table_view, &proof) {
                Checked::Lagging(why) => {
                    self.lag(id, why);
                    return self.disproved(rec, &proof);
                }
                Checked::Confirmed { drift: d, action: a, blocked: b } => (drift, action, blocked) = (d, a, b),
            }
        }
        self.lagging.remove(id);
        if !self.startup && rec.phase != StagePhase::Staged {
            action = Action::None;
        }
        let previous = self.view.get(id);
        let mut health = VolumeHealth { drift, last_repair: previous.as_ref().and_then(|p| p.last_repair.clone()), repair_error: None };
        if (action == Action::None && blocked.is_none()) || !self.config.repair {
            return Outcome::Verdict(health);
        }
        if self.failed.get(id).is_some_and(|(_, at)| *at > Instant::now()) {
            health.repair_error = previous.and_then(|p| p.repair_error.clone());
            return Outcome::Verdict(health);
        }
        let acted = match blocked {
            Some(why) => Acted::Failed(why),
            None => self.volumes.act(id, action),
        };
        match acted {
            Acted::Busy => Outcome::Busy,
            Acted::Unsettled(why) => {
                self.lag(id, why);
                Outcome::Lagging
            }
            Acted::Intact => {
                self.failed.remove(id);
                health.drift.retain(|d| !matches!(d, actual::Drift::DeviceDetached | actual::Drift::StagingMissing));
                Outcome::Verdict(health)
            }
            Acted::Done => self.repaired(id, action, health),
            Acted::Failed(e) => {
                self.stats.repairs_failed.fetch_add(1, Ordering::Relaxed);
                let attempts = self.failed.get(id).map_or(1, |(n, _)| n + 1);
                let backoff = (RETRY_FIRST * 2u32.saturating_pow(attempts.min(16) - 1)).min(self.config.resync);
                tracing::error!(volume = %id, ?action, error = %e, attempts, retry_in = ?backoff, "repair failed");
                self.failed.insert(id.to_string(), (attempts, Instant::now() + backoff));
                self.history.record(now_unix(), id, action, health.drift.clone(), RepairResult::Failed { error: e.clone() });
                health.repair_error = Some(e);
                Outcome::Verdict(health)
            }
        }
    }

    /// After a repair of volume `id`: counted, logged and put in its
    /// history, and its drift is what is proven there now.
    fn repaired(&mut self, id: &str, action: Action, mut health: VolumeHealth) -> Outcome {
        self.failed.remove(id);
        self.stats.repairs_done.fetch_add(1, Ordering::Relaxed);
        tracing::warn!(volume = %id, ?action, drift = ?health.drift, "repaired");
        let what = std::mem::take(&mut health.drift);
        self.history.record(now_unix(), id, action, what.clone(), RepairResult::Repaired);
        health.last_repair = Some(Repair { what, at_unix: now_unix() });
        // What is there now, after the repair: proven, since the
        // table has not seen the repair's own mount yet.
        match self.volumes.record(id) {
            Some(r) => match self.volumes.prove(&r) {
                Proof::Seen { actual, .. } => health.drift = actual::assess(&r, &actual).0,
                Proof::Unsettled(why) => self.lag(id, why),
            },
            None => {
                self.unindex(id);
                self.view.remove(id);
                return Outcome::Verdict(VolumeHealth::default());
            }
        }
        Outcome::Verdict(health)
    }

    /// While the table lags nothing new is reported, but what the kernel
    /// (or the record: the volume is staged now) has already disproved of
    /// the last verdict goes — a stage that finished a moment ago must not
    /// stay "interrupted" until the watcher hears of its mount.
    fn disproved(&self, rec: &StagedVolume, proof: &Proof) -> Outcome {
        let Some(prev) = self.view.get(&rec.volume_id) else { return Outcome::Lagging };
        let shown = match proof {
            Proof::Seen { actual, .. } => Some(actual::assess(rec, actual).0),
            Proof::Unsettled(_) => None,
        };
        let still: Vec<actual::Drift> = prev
            .drift
            .iter()
            .filter(|d| !matches!(d, actual::Drift::Interrupted { .. }) && shown.as_ref().is_none_or(|s| s.contains(d)))
            .cloned()
            .collect();
        if still == prev.drift {
            return Outcome::Lagging;
        }
        Outcome::Verdict(VolumeHealth { drift: still, ..VolumeHealth::clone(&prev) })
    }

    /// Marks `id` as waiting for the watcher: it is looked at again after a
    /// pause that starts at [`LAG_FIRST`] and doubles up to [`LAG_MAX`].
    fn lag(&mut self, id: &str, why: String) {
        let now = Instant::now();
        let entry = self.lagging.entry(id.to_string()).or_insert(Lag { since: now, pause: LAG_FIRST, next: now, warned: false });
        entry.next = now + entry.pause;
        entry.pause = (entry.pause * 2).min(LAG_MAX);
        if !entry.warned && now.duration_since(entry.since) >= LAG_LIMIT {
            entry.warned = true;
            tracing::warn!(volume = %id, %why, waited = ?now.duration_since(entry.since),
                "the mount table still disagrees with the kernel; deciding from what the kernel shows");
        } else {
            tracing::debug!(volume = %id, %why, "the kernel shows something the mount table does not yet; waiting for the watcher");
        }
    }

    /// Whether `id` has waited for the watcher longer than it ever lags.
    fn lag_expired(&self, id: &str) -> bool {
        self.lagging.get(id).is_some_and(|l| l.since.elapsed() >= LAG_LIMIT)
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
