//! The batched, coalescing updater: the agent says what an object should
//! be now, as often as it likes; the updater writes each object's latest
//! state at most once per window, and only when it differs from what it
//! knows is stored.
//!
//! Why each part is there:
//! - Coalescing happens at the door: [`Updater::submit`] replaces the
//!   object's pending state in a map keyed by object, so memory is bounded
//!   by the number of objects, not of changes, and the agent never waits.
//! - One LIST per kind at start (this node's label) seeds what is stored:
//!   a restart with nothing changed writes nothing, and objects of devices
//!   that are gone are marked Inactive (or deleted).
//! - A token bucket bounds the rate; the requests in flight are bounded by
//!   a limit found from the server's push-back (AIMD, see `pace::Limit`):
//!   a 429 or 503 halves it (floor 1) and it grows back by one per second
//!   of successes, up to `concurrency`. The throttled object alone waits
//!   its Retry-After; the rest go on at the lower limit (only at the floor,
//!   where even one request is refused, does the next request wait too).
//! - Other 5xx back off per object (200 ms doubling to 30 s), a 409
//!   re-reads that object once and retries, and a refusal (4xx) is counted
//!   and dropped: sending it again would be refused again.
//! - A server that stops answering (5xx, connection errors) is probed, not
//!   hammered: while it is down one request at a time goes out, at most
//!   `probe_max` (1 s) apart, and when a probe is answered every object
//!   that was backing off for the outage is due at once, so the queue
//!   drains as soon as the server is back instead of each object waiting
//!   out its own backoff.
//! - What others do to this node's objects is followed by a watch (label
//!   selected, with bookmarks, resumed where it was; a LIST when the
//!   server no longer has that history, and every `resync`): an object
//!   deleted or changed behind the agent's back (a status edited, its
//!   node label removed) is written again as the agent last wanted it,
//!   one window later. The watch also shows the agent's own writes, one
//!   part at a time and maybe late, so what it sees is only a hint: when
//!   the window is over and it still differs from what the agent wrote,
//!   one GET says what is stored, and only what differs is written.
//! - Every loop turn costs what changed, not what exists: ready keys sit in
//!   a queue, backed-off keys in a timer heap; stale queue entries are
//!   skipped by generation. Retries (due from the heap) are written at
//!   once; new changes wait for their window.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::Notify;
use tokio::time::Instant;

#[path = "updater_follow.rs"]
mod follow;
#[path = "updater_job.rs"]
mod job;
#[path = "updater_outage.rs"]
mod outage;
#[path = "updater_worker.rs"]
mod worker;
use worker::Worker;

use super::objects::{Key, Kind, Object};
pub(crate) use super::sink::{Part, Seen, Sink, SinkError, Watched};
pub(crate) use super::stats::{Stats, StatsSnapshot};

/// What to do with the objects of devices that are gone.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum GonePolicy {
    /// Keep them, marked Inactive.
    #[default]
    MarkInactive,
    Delete,
}

#[derive(Debug, Clone)]
pub struct UpdaterConfig {
    pub node: String,
    /// Changes inside one window become one write per object.
    pub window: Duration,
    /// A flush happens when this many objects are ready, window or not.
    pub batch: usize,
    /// Requests in flight at once, at most (fewer while the server pushes
    /// back).
    pub concurrency: usize,
    /// The in-flight limit grows by one per this much time of successes.
    pub grow_every: Duration,
    /// While the server is down, probes go at most this far apart.
    pub(crate) probe_max: Duration,
    /// Watch this node's objects and repair what others change (when the
    /// sink can be watched).
    pub(crate) watch: bool,
    /// The watch's full LIST, however it goes.
    pub resync: Duration,
    pub qps: f64,
    pub burst: u32,
    pub backoff_min: Duration,
    pub(crate) backoff_max: Duration,
    pub gone: GonePolicy,
    /// `/dev` paths of devices present whose stable id could not be read
    /// at start: their stored objects are not retired by the first diff.
    pub unread_paths: HashSet<String>,
    /// Where the updater counts: counters made by whoever reads them
    /// (`/metrics`, a test) before the start, so they hold them from then
    /// on; `None`: a fresh set for this updater alone (a clone of the
    /// config shares what is given here).
    pub stats: Option<Arc<Stats>>,
}

impl UpdaterConfig {
    pub fn new(node: &str) -> Self {
        Self {
            node: node.to_string(),
            window: Duration::from_secs(1),
            batch: 500,
            concurrency: 4,
            grow_every: Duration::from_secs(1),
            probe_max: Duration::from_secs(1),
            watch: true,
            resync: Duration::from_secs(600),
            qps: 20.0,
            burst: 40,
            backoff_min: Duration::from_millis(200),
            backoff_max: Duration::from_secs(30),
            gone: GonePolicy::MarkInactive,
            unread_paths: HashSet::new(),
            stats: None,
        }
    }
}

fn bump(a: &AtomicU64) {
    a.fetch_add(1, Ordering::Relaxed);
}

/// What should become of an object.
#[derive(Debug, Clone)]
enum Want {
    Put(Object),
    /// Its device is gone.
    Retire,
    /// Stored under a superseded name: deleted whatever the gone policy.
    Remove,
    /// Someone else changed it (the watch saw it): written again as last
    /// wanted, if it still differs when its turn comes.
    Repair,
}

/// The door: changes wait here, one per object, until the loop takes them.
#[derive(Default)]
struct Inbox {
    changes: HashMap<Key, Want>,
    /// What the watch saw, in order.
    seen: Vec<Seen>,
    /// Full LISTs of the watch (a resync): every object of a kind.
    listed: Vec<(Kind, Vec<Object>)>,
    /// When a shutdown must be over.
    stop: Option<Instant>,
}

struct Shared {
    inbox: Mutex<Inbox>,
    wake: Notify,
    stats: Arc<Stats>,
    stopping: AtomicBool,
}

/// The running updater.
pub struct Updater {
    shared: Arc<Shared>,
    task: tokio::task::JoinHandle<()>,
}

impl Updater {
    /// Starts the updater, counting into `config.stats`. `initial` is
    /// everything this node has now: the first LIST is diffed against it,
    /// and this node's stored objects missing from it are retired.
    pub fn start<S: Sink>(sink: Arc<S>, config: UpdaterConfig, initial: Vec<Object>) -> Updater {
        let stats = config.stats.clone().unwrap_or_default();
        let shared = Arc::new(Shared { inbox: Mutex::new(Inbox::default()), wake: Notify::new(), stats, stopping: AtomicBool::new(false) });
        let worker = Worker::new(sink, shared.clone(), config);
        let task = tokio::spawn(worker.run(initial));
        Updater { shared, task }
    }

    /// The object's state now; replaces any pending state of it.
    pub fn submit(&self, obj: Object) {
        self.handle().submit(obj);
    }

    /// The object's device is gone: mark it Inactive (or delete it).
    pub(crate) fn retire(&self, key: Key) {
        self.handle().retire(key);
    }

    /// A handle that submits to this updater, for a task of its own (the
    /// StorageNode's follower).
    pub(crate) fn handle(&self) -> Submitter {
        Submitter { shared: self.shared.clone() }
    }

    /// Writes what is pending now, without waiting for the window, within
    /// `deadline`; what is left then is counted as abandoned.
    pub async fn shutdown(self, deadline: Duration) -> StatsSnapshot {
        let at = Instant::now() + deadline;
        lock(&self.shared.inbox).stop = Some(at);
        self.shared.stopping.store(true, Ordering::Relaxed);
        self.shared.wake.notify_one();
        let mut task = self.task;
        // The worker stops itself at the deadline; a request that hangs
        // past it (a stuck connection) is cut a little later.
        if tokio::time::timeout_at(at + Duration::from_millis(500), &mut task).await.is_err() {
            task.abort();
            tracing::warn!("publisher did not stop by its deadline; stopped");
        }
        self.shared.stats.snapshot()
    }
}

/// Submits to a running updater; cheap to clone. Once the updater has
/// stopped, what is submitted is dropped.
#[derive(Clone)]
pub(crate) struct Submitter {
    shared: Arc<Shared>,
}

impl Submitter {
    /// See [`Updater::submit`].
    pub(crate) fn submit(&self, obj: Object) {
        self.put(obj.key.clone(), Want::Put(obj));
    }

    /// See [`Updater::retire`].
    pub(crate) fn retire(&self, key: Key) {
        self.put(key, Want::Retire);
    }

    fn put(&self, key: Key, want: Want) {
        bump(&self.shared.stats.submitted);
        let replaced = lock(&self.shared.inbox).changes.insert(key, want).is_some();
        if replaced {
            bump(&self.shared.stats.coalesced);
        }
        self.shared.wake.notify_one();
    }
}

pub(super) fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}
