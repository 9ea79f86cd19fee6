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

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap, HashSet, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::Notify;
use tokio::task::JoinSet;
use tokio::time::Instant;

use super::objects::{Key, Kind, Object};
use super::pace::{backoff, Gate, Limit, PushBack};
pub use super::sink::{Part, Seen, Sink, SinkError, Watched};
pub use super::stats::{Stats, StatsSnapshot};

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
    pub probe_max: Duration,
    /// Watch this node's objects and repair what others change (when the
    /// sink can be watched).
    pub watch: bool,
    /// The watch's full LIST, however it goes.
    pub resync: Duration,
    pub qps: f64,
    pub burst: u32,
    pub backoff_min: Duration,
    pub backoff_max: Duration,
    pub gone: GonePolicy,
    /// `/dev` paths of devices present whose stable id could not be read
    /// at start: their stored objects are not retired by the first diff.
    pub unread_paths: HashSet<String>,
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
    /// Starts the updater. `initial` is everything this node has now: the
    /// first LIST is diffed against it, and this node's stored objects
    /// missing from it are retired.
    pub fn start<S: Sink>(sink: Arc<S>, config: UpdaterConfig, initial: Vec<Object>) -> Updater {
        Self::start_counting(sink, config, initial, Arc::default())
    }

    /// [`Updater::start`], counting into `stats` (made before the updater,
    /// so `/metrics` can hold them from its start).
    pub fn start_counting<S: Sink>(sink: Arc<S>, config: UpdaterConfig, initial: Vec<Object>, stats: Arc<Stats>) -> Updater {
        let shared = Arc::new(Shared { inbox: Mutex::new(Inbox::default()), wake: Notify::new(), stats, stopping: AtomicBool::new(false) });
        let gate = Arc::new(Gate::new(config.qps, config.burst));
        let limit = Limit::new(config.concurrency, config.grow_every, Instant::now());
        shared.stats.limit.store(limit.get() as u64, Ordering::Relaxed);
        let worker = Worker {
            sink,
            gate,
            shared: shared.clone(),
            known: HashMap::new(),
            desired: HashMap::new(),
            observed: HashMap::new(),
            versions: Vec::new(),
            pending: HashMap::new(),
            ready: VecDeque::new(),
            retry: VecDeque::new(),
            delayed: BinaryHeap::new(),
            next_gen: 0,
            window_ends: None,
            limit,
            hold_until: None,
            down: None,
            config,
        };
        let task = tokio::spawn(worker.run(initial));
        Updater { shared, task }
    }

    /// The object's state now; replaces any pending state of it.
    pub fn submit(&self, obj: Object) {
        self.handle().submit(obj);
    }

    /// The object's device is gone: mark it Inactive (or delete it).
    pub fn retire(&self, key: Key) {
        self.handle().retire(key);
    }

    /// A handle that submits to this updater, for a task of its own (the
    /// StorageNode's follower).
    pub fn handle(&self) -> Submitter {
        Submitter { shared: self.shared.clone() }
    }

    pub fn stats(&self) -> &Arc<Stats> {
        &self.shared.stats
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
pub struct Submitter {
    shared: Arc<Shared>,
}

impl Submitter {
    /// See [`Updater::submit`].
    pub fn submit(&self, obj: Object) {
        self.put(obj.key.clone(), Want::Put(obj));
    }

    /// See [`Updater::retire`].
    pub fn retire(&self, key: Key) {
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

struct Entry {
    want: Want,
    attempts: u32,
    gen: u64,
    /// The watch saw it differ from what was written: if it still does
    /// when its turn comes, read it before planning.
    recheck: bool,
    /// Backing off because the server did not answer (5xx, connection):
    /// due at once when it answers again.
    outage: bool,
}

/// The server stopped answering: one probe at a time until it does.
#[derive(Debug)]
struct Down {
    /// The in-flight limit before, restored when a probe succeeds.
    limit_before: usize,
    /// Between failed probes: backoff_min doubling to probe_max.
    gap: Duration,
    since: Instant,
    /// When the last request failed.
    last_failure: Instant,
    /// A probe is on its way.
    probing: bool,
}

impl Down {
    fn next_probe(&self) -> Instant {
        self.last_failure + self.gap
    }
}

struct Worker<S> {
    sink: Arc<S>,
    gate: Arc<Gate>,
    shared: Arc<Shared>,
    /// What the sink holds, as last read or written.
    known: HashMap<Key, Object>,
    /// What the agent last asked each object to be (puts only: a retired
    /// object that someone deletes is not brought back).
    desired: HashMap<Key, Object>,
    /// What the watch last saw of the desired objects (None: not there);
    /// a hint, behind or ahead of `known`.
    observed: HashMap<Key, Option<Object>>,
    /// Each kind's version from the initial LIST, for the watch.
    versions: Vec<(Kind, Option<String>)>,
    pending: HashMap<Key, Entry>,
    /// Keys changed, waiting for their window, with the generation they
    /// were queued at.
    ready: VecDeque<(Key, u64)>,
    /// Keys whose backoff is over: written without a window.
    retry: VecDeque<(Key, u64)>,
    /// Keys backing off, by when they are due.
    delayed: BinaryHeap<Reverse<(Instant, u64, Key)>>,
    next_gen: u64,
    window_ends: Option<Instant>,
    limit: Limit,
    /// No request starts before this (a 429 at the floor).
    hold_until: Option<Instant>,
    down: Option<Down>,
    config: UpdaterConfig,
}

/// How a job's requests went, for the limit and the outage.
#[derive(Debug, Clone, Copy)]
struct Sent {
    /// The limit's epoch it was sent at.
    epoch: u64,
    /// Sent as the probe of a server that was down.
    probe: bool,
}

/// What one object's job learned.
struct Outcome {
    key: Key,
    want: Want,
    attempts: u32,
    sent: Sent,
    /// What is stored now, as far as the job knows.
    stored: Option<Object>,
    error: Option<SinkError>,
    /// Something was written or deleted.
    wrote: bool,
    /// It was read first: the watch saw someone else's change.
    confirm: bool,
}

impl<S: Sink> Worker<S> {
    async fn run(mut self, initial: Vec<Object>) {
        if !self.initial_sync(initial).await {
            self.finish_abandoned();
            return;
        }
        let _followers = self.follow();
        let mut stop_at: Option<Instant> = None;
        loop {
            if stop_at.is_none() {
                stop_at = lock(&self.shared.inbox).stop;
            }
            self.take_inbox();
            self.shared.stats.queued.store(self.pending.len() as u64, Ordering::Relaxed);
            let now = Instant::now();
            self.take_due(now);
            let blocked = self.blocked_until(now);
            if let Some(deadline) = stop_at {
                if self.pending.is_empty() {
                    return;
                }
                if now >= deadline {
                    self.finish_abandoned();
                    return;
                }
                if blocked.is_none() {
                    let mut batch = self.take_batch(true);
                    batch.extend(self.take_batch(false));
                    if !batch.is_empty() {
                        let _ = tokio::time::timeout_at(deadline, self.flush(batch)).await;
                        continue;
                    }
                }
                // Everything left is backing off, or waits for a probe.
                let next = [blocked, self.next_due()].into_iter().flatten().min().map_or(deadline, |d| d.min(deadline));
                tokio::time::sleep_until(next).await;
                continue;
            }
            // Retries have waited already: written at once.
            if blocked.is_none() && !self.retry.is_empty() {
                let batch = self.take_batch(true);
                self.flush(batch).await;
                continue;
            }
            if self.ready.is_empty() {
                self.window_ends = None;
            } else if self.window_ends.is_none() {
                self.window_ends = Some(now + self.config.window);
            }
            let due = self.window_ends.is_some_and(|w| now >= w) || self.ready.len() >= self.config.batch;
            if due && blocked.is_none() {
                let batch = self.take_batch(false);
                // A change that comes during the flush starts a window of
                // its own; what a full batch left behind is due already.
                if self.ready.is_empty() {
                    self.window_ends = None;
                }
                self.flush(batch).await;
                continue;
            }
            let next = [self.window_ends.filter(|_| blocked.is_none()), self.next_due(), blocked].into_iter().flatten().min();
            let sleep = async {
                match next {
                    Some(t) => tokio::time::sleep_until(t).await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                _ = self.shared.wake.notified() => {}
                _ = sleep => {}
            }
        }
    }

    /// When requests may start again, if not now: the next probe of a
    /// server that is down, or the end of a hold (a 429 at the floor).
    fn blocked_until(&self, now: Instant) -> Option<Instant> {
        let until = match &self.down {
            Some(d) => Some(d.next_probe()),
            None => self.hold_until,
        };
        until.filter(|t| *t > now)
    }

    /// When the first backed-off key is due: its own time, or while the
    /// server is down the time of the next probe at the latest (it is
    /// pulled forward to probe with), never before it.
    fn next_due(&self) -> Option<Instant> {
        let first = self.delayed.peek().map(|Reverse((d, _, _))| *d)?;
        Some(match &self.down {
            Some(d) => first.min(d.last_failure + self.config.probe_max).max(d.next_probe()),
            None => first,
        })
    }

    /// Moves the keys whose backoff is over to the retry queue; while the
    /// server is down and nothing else waits, the first key to probe with.
    fn take_due(&mut self, now: Instant) {
        while let Some(Reverse((due, gen, key))) = self.delayed.peek() {
            if self.pending.get(key).is_none_or(|e| e.gen != *gen) {
                self.delayed.pop();
                continue;
            }
            let early = *due > now;
            if early && (!self.retry.is_empty() || self.next_due().is_none_or(|d| d > now)) {
                break;
            }
            let Reverse((_, gen, key)) = self.delayed.pop().expect("peeked");
            self.retry.push_back((key, gen));
            if early {
                break;
            }
        }
    }

    fn finish_abandoned(&self) {
        let left = self.pending.len() + lock(&self.shared.inbox).changes.len();
        if left > 0 {
            tracing::warn!(objects = left, "publisher stopped with objects unwritten");
        }
        self.shared.stats.abandoned.fetch_add(left as u64, Ordering::Relaxed);
        self.shared.stats.queued.store(0, Ordering::Relaxed);
    }

    /// LISTs this node's objects until it succeeds (or the agent stops),
    /// then queues `initial` and retires what is stored but not in it.
    async fn initial_sync(&mut self, initial: Vec<Object>) -> bool {
        let mut attempts = 0;
        for kind in Kind::ALL {
            loop {
                self.gate.pass().await;
                bump(&self.shared.stats.requests);
                match self.sink.list_versioned(kind, &self.config.node).await {
                    Ok((objs, version)) => {
                        self.known.extend(objs.into_iter().map(|o| (o.key.clone(), o)));
                        self.versions.push((kind, version));
                        break;
                    }
                    Err(e) => {
                        if self.shared.stopping.load(Ordering::Relaxed) {
                            return false;
                        }
                        // A server that is down is asked again at least
                        // every probe_max (one LIST at a time: a probe).
                        let wait = match &e {
                            SinkError::Throttled { retry_after } => {
                                bump(&self.shared.stats.throttled);
                                *retry_after
                            }
                            SinkError::Overloaded { retry_after: Some(ra), .. } => {
                                bump(&self.shared.stats.unavailable);
                                *ra
                            }
                            _ => {
                                bump(&self.shared.stats.unavailable);
                                backoff(&self.config, attempts).min(self.config.probe_max.max(self.config.backoff_min))
                            }
                        };
                        attempts += 1;
                        let waiting = lock(&self.shared.inbox).changes.len() + initial.len();
                        self.shared.stats.queued.store(waiting as u64, Ordering::Relaxed);
                        tracing::warn!(error = %e, kind = kind.as_str(), retry_in_ms = wait.as_millis() as u64, "publisher: initial list failed");
                        // Submissions wake the loop too, and the agent submits
                        // on every relink: only a shutdown ends the wait early.
                        if !self.wait_unless_stopping(wait).await {
                            return false;
                        }
                    }
                }
            }
        }
        let present: HashSet<Key> = initial.iter().map(|o| o.key.clone()).collect();
        let unread = |o: &Object| o.spec.get("path").and_then(|p| p.as_str()).is_some_and(|p| self.config.unread_paths.contains(p));
        let gone: Vec<(Key, bool)> = self
            .known
            .iter()
            .filter(|(k, o)| !present.contains(*k) && (o.superseded() || !unread(o)))
            .map(|(k, o)| (k.clone(), o.superseded()))
            .collect();
        for o in initial {
            self.enqueue(o.key.clone(), Want::Put(o));
        }
        for (k, superseded) in gone {
            self.enqueue(k, if superseded { Want::Remove } else { Want::Retire });
        }
        true
    }

    /// Sleeps `wait`; false when a shutdown began meanwhile.
    async fn wait_unless_stopping(&self, wait: Duration) -> bool {
        let until = Instant::now() + wait;
        loop {
            if self.shared.stopping.load(Ordering::Relaxed) {
                return false;
            }
            tokio::select! {
                _ = tokio::time::sleep_until(until) => return true,
                _ = self.shared.wake.notified() => {}
            }
        }
    }

    fn take_inbox(&mut self) {
        let (changes, seen, listed) = {
            let mut inbox = lock(&self.shared.inbox);
            (std::mem::take(&mut inbox.changes), std::mem::take(&mut inbox.seen), std::mem::take(&mut inbox.listed))
        };
        for (key, want) in changes {
            self.enqueue(key, want);
        }
        for s in seen {
            match s {
                Seen::Put(o) => self.observe(o.key.clone(), Some(o)),
                Seen::Gone(key) => self.observe(key, None),
            }
        }
        for (kind, objs) in listed {
            let mut now: HashMap<Key, Object> = objs.into_iter().map(|o| (o.key.clone(), o)).collect();
            let keys: Vec<Key> = self.desired.keys().filter(|k| k.kind == kind).cloned().collect();
            for key in keys {
                let state = now.remove(&key);
                self.observe(key, state);
            }
        }
    }

    /// The watch saw `key` stored as `state`: a desired object that
    /// differs from what the updater knows it wrote is queued for a repair
    /// (or, already queued, rechecked when its turn comes).
    fn observe(&mut self, key: Key, state: Option<Object>) {
        if !self.desired.contains_key(&key) {
            return;
        }
        let differs = state.as_ref() != self.known.get(&key);
        self.observed.insert(key.clone(), state);
        if !differs {
            return;
        }
        match self.pending.get_mut(&key) {
            Some(e) => e.recheck = true,
            None => {
                let gen = self.gen();
                self.pending.insert(key.clone(), Entry { want: Want::Repair, attempts: 0, gen, recheck: true, outage: false });
                self.ready.push_back((key, gen));
            }
        }
    }

    /// Keeps `desired` to the agent's latest want of `key`.
    fn note(&mut self, key: &Key, want: &Want) {
        match want {
            Want::Put(o) => {
                self.desired.insert(key.clone(), o.clone());
            }
            Want::Retire | Want::Remove => {
                self.desired.remove(key);
                self.observed.remove(key);
            }
            Want::Repair => {}
        }
    }

    /// Starts following this node's objects, one task per kind (when the
    /// sink can be watched); they stop when the returned value is dropped.
    fn follow(&self) -> Followers {
        if !self.config.watch {
            return Followers(Vec::new());
        }
        let tasks = self
            .versions
            .iter()
            .filter_map(|(kind, v)| Some((*kind, v.clone()?)))
            .map(|(kind, version)| {
                let (sink, shared, config) = (self.sink.clone(), self.shared.clone(), self.config.clone());
                tokio::spawn(follow(sink, shared, config, kind, version))
            })
            .collect();
        Followers(tasks)
    }

    /// Records the latest want of `key`; a key already pending keeps its
    /// place (or its backoff).
    fn enqueue(&mut self, key: Key, want: Want) {
        self.note(&key, &want);
        if let Some(e) = self.pending.get_mut(&key) {
            e.want = want;
            bump(&self.shared.stats.coalesced);
            return;
        }
        let gen = self.gen();
        self.pending.insert(key.clone(), Entry { want, attempts: 0, gen, recheck: false, outage: false });
        self.ready.push_back((key, gen));
    }

    fn gen(&mut self) -> u64 {
        self.next_gen += 1;
        self.next_gen
    }

    /// Up to a batch of the keys queued for retry (`retry`) or changed.
    fn take_batch(&mut self, retry: bool) -> Vec<(Key, Entry)> {
        let mut batch = Vec::new();
        while batch.len() < self.config.batch {
            let queue = if retry { &mut self.retry } else { &mut self.ready };
            let Some((key, gen)) = queue.pop_front() else { break };
            if self.pending.get(&key).is_some_and(|e| e.gen == gen) {
                let e = self.pending.remove(&key).expect("checked");
                batch.push((key, e));
            }
        }
        batch
    }

    /// Writes one batch, as many objects at a time as the limit allows
    /// (one, as a probe, while the server is down). What cannot start now
    /// and has nothing in flight to wait for (a probe's time, a hold) goes
    /// back to the front of the retry queue, for the loop to wait.
    async fn flush(&mut self, batch: Vec<(Key, Entry)>) {
        if batch.is_empty() {
            return;
        }
        bump(&self.shared.stats.flushes);
        let mut jobs = JoinSet::new();
        let mut todo: VecDeque<(Key, Entry)> = batch.into();
        loop {
            let now = Instant::now();
            while !todo.is_empty() {
                let may = match &self.down {
                    Some(d) => jobs.is_empty() && !d.probing && now >= d.next_probe(),
                    None => jobs.len() < self.limit.get() && self.hold_until.is_none_or(|h| now >= h),
                };
                if !may {
                    break;
                }
                let (key, mut entry) = todo.pop_front().expect("not empty");
                // Still not what was written, by the watch's latest: read it.
                let confirm = entry.recheck
                    && matches!(entry.want, Want::Put(_) | Want::Repair)
                    && self.observed.get(&key).is_some_and(|o| o.as_ref() != self.known.get(&key));
                let repair = matches!(entry.want, Want::Repair);
                if repair {
                    match self.desired.get(&key) {
                        Some(o) => entry.want = Want::Put(o.clone()),
                        None => continue,
                    }
                }
                let stored = self.known.get(&key).cloned();
                let plan = match (&entry.want, confirm) {
                    (Want::Put(o), true) => Some(Plan::Confirm(o.clone())),
                    (want, _) => plan(&key, want, stored.as_ref(), self.config.gone),
                };
                let Some(plan) = plan else {
                    if !repair {
                        bump(&self.shared.stats.unchanged);
                    }
                    continue;
                };
                let probe = match &mut self.down {
                    Some(d) => {
                        d.probing = true;
                        bump(&self.shared.stats.probes);
                        true
                    }
                    None => false,
                };
                let sent = Sent { epoch: self.limit.epoch(), probe };
                let (sink, gate, stats) = (self.sink.clone(), self.gate.clone(), self.shared.stats.clone());
                jobs.spawn(async move {
                    let (stored, error, wrote) = run_job(&*sink, &gate, &stats, &key, plan, stored).await;
                    Outcome { key, want: entry.want, attempts: entry.attempts, sent, stored, error, wrote, confirm }
                });
            }
            let waiting = self.pending.len() + todo.len() + jobs.len();
            self.shared.stats.queued.store(waiting as u64, Ordering::Relaxed);
            let Some(done) = jobs.join_next().await else {
                for (key, entry) in todo.into_iter().rev() {
                    self.retry.push_front((key.clone(), entry.gen));
                    self.pending.insert(key, entry);
                }
                break;
            };
            match done {
                Ok(o) => self.settle(o),
                Err(e) => {
                    tracing::error!(error = %e, "publisher job failed");
                    if let Some(d) = &mut self.down {
                        d.probing = false;
                    }
                }
            }
        }
    }

    fn settle(&mut self, o: Outcome) {
        match o.stored {
            Some(s) => self.known.insert(o.key.clone(), s),
            None => self.known.remove(&o.key),
        };
        if o.confirm && o.wrote {
            bump(&self.shared.stats.repairs);
            tracing::info!(object = %o.key.name, kind = o.key.kind.as_str(), "publisher: changed by someone else; written again");
        }
        let now = Instant::now();
        match &o.error {
            Some(SinkError::Unavailable(_) | SinkError::Overloaded { .. }) => self.failed(o.sent, now),
            e => self.answered(o.sent, e.is_none(), now),
        }
        match &o.error {
            None => self.limit.succeeded(o.sent.epoch, now),
            Some(SinkError::Throttled { retry_after }) => {
                if self.limit.pushed_back(o.sent.epoch, now) == PushBack::AtFloor {
                    // Even one request at a time is too many: the next waits too.
                    self.hold_until = Some(self.hold_until.map_or(now, |h| h.max(now)).max(now + *retry_after));
                }
            }
            Some(SinkError::Overloaded { .. }) => {
                self.limit.pushed_back(o.sent.epoch, now);
            }
            Some(_) => {}
        }
        self.shared.stats.limit.store(self.limit.get() as u64, Ordering::Relaxed);
        let Some(err) = o.error else { return };
        let (wait, outage) = match &err {
            SinkError::Refused(_) => {
                tracing::warn!(object = %o.key.name, kind = o.key.kind.as_str(), error = %err, "publisher: write refused; dropped");
                return;
            }
            SinkError::Throttled { retry_after } => (*retry_after, false),
            SinkError::Overloaded { retry_after, .. } => (retry_after.unwrap_or_else(|| backoff(&self.config, o.attempts)), true),
            SinkError::Unavailable(_) => (backoff(&self.config, o.attempts), true),
            SinkError::Conflict(_) => (backoff(&self.config, o.attempts), false),
        };
        tracing::debug!(object = %o.key.name, error = %err, retry_in_ms = wait.as_millis() as u64, "publisher: will retry");
        // A newer state that arrived meanwhile wins; it waits as long.
        let newer = lock(&self.shared.inbox).changes.remove(&o.key);
        if let Some(w) = &newer {
            self.note(&o.key, w);
        }
        let want = newer.unwrap_or(o.want);
        let gen = self.gen();
        self.pending.insert(o.key.clone(), Entry { want, attempts: o.attempts + 1, gen, recheck: false, outage });
        self.delayed.push(Reverse((now + wait, gen, o.key)));
    }

    /// A request got an answer (success, or any status but 5xx). A probe's
    /// answer ends an outage: every object backing off for it is due now,
    /// and (if it succeeded) the limit is what it was before.
    fn answered(&mut self, sent: Sent, ok: bool, now: Instant) {
        let Some(d) = self.down.take() else { return };
        if !sent.probe {
            // Sent before the outage began: the server answers, but the
            // objects that failed may have failed for themselves.
            return;
        }
        let mut released = 0;
        let keys: Vec<Key> = self.pending.iter().filter(|(_, e)| e.outage).map(|(k, _)| k.clone()).collect();
        for key in keys {
            let gen = self.gen();
            let e = self.pending.get_mut(&key).expect("listed");
            (e.gen, e.attempts, e.outage) = (gen, 0, false);
            self.retry.push_back((key, gen));
            released += 1;
        }
        if ok {
            self.limit.restore(d.limit_before, now);
        }
        let down_ms = (now - d.since).as_millis() as u64;
        tracing::info!(released, down_ms, "publisher: the API server answers again");
    }

    /// A request got no answer, or a 5xx: the server is down (probe it),
    /// or still down (the next probe waits longer, up to `probe_max`).
    fn failed(&mut self, sent: Sent, now: Instant) {
        let first_gap = self.config.backoff_min.min(self.config.probe_max);
        match &mut self.down {
            None => {
                tracing::warn!("publisher: the API server does not answer; probing it");
                self.down = Some(Down { limit_before: self.limit.get(), gap: first_gap, since: now, last_failure: now, probing: false });
            }
            Some(d) => {
                if sent.probe {
                    d.probing = false;
                    d.gap = (d.gap * 2).clamp(first_gap, self.config.probe_max.max(first_gap));
                }
                d.last_failure = now;
            }
        }
    }
}

/// The watch tasks; aborted when dropped (the updater stopped).
struct Followers(Vec<tokio::task::JoinHandle<()>>);

impl Drop for Followers {
    fn drop(&mut self) {
        for t in &self.0 {
            t.abort();
        }
    }
}

/// Follows `kind`'s objects of this node from `version`: hands what the
/// watch sees to the loop, resumes where it was when a stream ends, LISTs
/// again (a resync) when that history is gone and every `resync`. A
/// failing server is asked again after probe_max doubling to four times
/// that.
async fn follow<S: Sink>(sink: Arc<S>, shared: Arc<Shared>, config: UpdaterConfig, kind: Kind, version: String) {
    let mut version = Some(version);
    let mut attempts = 0u32;
    let mut resync_at = Instant::now() + config.resync;
    let on = {
        let shared = shared.clone();
        move |s: Seen| {
            lock(&shared.inbox).seen.push(s);
            shared.wake.notify_one();
        }
    };
    loop {
        if shared.stopping.load(Ordering::Relaxed) {
            return;
        }
        let result = match &mut version {
            Some(v) if Instant::now() < resync_at => {
                tokio::select! {
                    r = sink.watch(kind, &config.node, v, &on) => r.map(Some),
                    _ = tokio::time::sleep_until(resync_at) => Ok(None),
                }
            }
            _ => match sink.list_versioned(kind, &config.node).await {
                Ok((objs, v)) => {
                    lock(&shared.inbox).listed.push((kind, objs));
                    shared.wake.notify_one();
                    let Some(v) = v else { return };
                    version = Some(v);
                    resync_at = Instant::now() + config.resync;
                    Ok(None)
                }
                Err(e) => Err(e),
            },
        };
        match result {
            Ok(Some(Watched::Expired)) => {
                tracing::info!(kind = kind.as_str(), "publisher: watch history expired; listing again");
                version = None;
            }
            Ok(_) => attempts = 0,
            Err(e) => {
                let wait = match &e {
                    SinkError::Throttled { retry_after } => *retry_after,
                    SinkError::Overloaded { retry_after: Some(ra), .. } => *ra,
                    _ => config.probe_max.saturating_mul(1 << attempts.min(2)),
                };
                attempts += 1;
                tracing::debug!(kind = kind.as_str(), error = %e, retry_in_ms = wait.as_millis() as u64, "publisher: watch failed");
                tokio::time::sleep(wait).await;
            }
        }
    }
}

/// What a job does for one object.
#[derive(Debug, Clone)]
enum Plan {
    Write(Object),
    /// Read what is stored, then write what differs from it.
    Confirm(Object),
    Delete,
}

/// `None` when the sink already holds what is wanted.
fn plan(key: &Key, want: &Want, stored: Option<&Object>, gone: GonePolicy) -> Option<Plan> {
    match want {
        Want::Put(o) => needs(o, stored).then(|| Plan::Write(o.clone())),
        Want::Retire => {
            let s = stored?;
            debug_assert_eq!(&s.key, key);
            match gone {
                GonePolicy::Delete => Some(Plan::Delete),
                GonePolicy::MarkInactive => s.retired().filter(|r| needs(r, stored)).map(Plan::Write),
            }
        }
        Want::Remove => stored.map(|_| Plan::Delete),
        // Resolved to the desired object before planning.
        Want::Repair => None,
    }
}

fn main_differs(o: &Object, stored: Option<&Object>) -> bool {
    stored.is_none_or(|s| s.labels != o.labels || s.spec != o.spec)
}

fn status_differs(o: &Object, stored: Option<&Object>) -> bool {
    !o.status.is_null() && stored.is_none_or(|s| s.status != o.status)
}

fn needs(o: &Object, stored: Option<&Object>) -> bool {
    main_differs(o, stored) || status_differs(o, stored)
}

/// Runs one object's writes; a conflict re-reads it once and tries again
/// (a confirm reads it first). Returns what is stored afterwards, the
/// error that stopped it, and whether anything was written or deleted.
async fn run_job<S: Sink>(
    sink: &S,
    gate: &Gate,
    stats: &Stats,
    key: &Key,
    plan: Plan,
    mut stored: Option<Object>,
) -> (Option<Object>, Option<SinkError>, bool) {
    let mut wrote = false;
    let mut reread = false;
    let (plan, mut read_first) = match plan {
        Plan::Confirm(o) => (Plan::Write(o), true),
        p => (p, false),
    };
    loop {
        if read_first {
            gate.pass().await;
            bump(&stats.requests);
            match sink.get(key).await {
                Ok(now) => stored = now,
                Err(e) => {
                    count(stats, &e);
                    return (stored, Some(e), wrote);
                }
            }
            if let Plan::Write(o) = &plan {
                if !needs(o, stored.as_ref()) {
                    return (stored, None, wrote);
                }
            }
        }
        let r = match &plan {
            Plan::Delete => {
                gate.pass().await;
                bump(&stats.requests);
                sink.delete(key).await.map(|()| {
                    bump(&stats.deletes);
                    wrote = true;
                    stored = None;
                })
            }
            Plan::Write(o) => write(sink, gate, stats, o, &mut stored, &mut wrote).await,
            Plan::Confirm(_) => unreachable!("made a write above"),
        };
        let err = match r {
            Ok(()) => return (stored, None, wrote),
            Err(e) => e,
        };
        count(stats, &err);
        if !matches!(err, SinkError::Conflict(_)) || reread {
            return (stored, Some(err), wrote);
        }
        // A conflict: read it once and try again.
        reread = true;
        read_first = true;
    }
}

fn count(stats: &Stats, err: &SinkError) {
    match err {
        SinkError::Throttled { .. } => bump(&stats.throttled),
        SinkError::Conflict(_) => bump(&stats.conflicts),
        SinkError::Unavailable(_) | SinkError::Overloaded { .. } => bump(&stats.unavailable),
        SinkError::Refused(_) => bump(&stats.refused),
    }
}

/// Writes the parts of `o` that differ from `stored`, main first (it
/// creates the object), updating `stored` as each lands.
async fn write<S: Sink>(
    sink: &S,
    gate: &Gate,
    stats: &Stats,
    o: &Object,
    stored: &mut Option<Object>,
    wrote: &mut bool,
) -> Result<(), SinkError> {
    if main_differs(o, stored.as_ref()) {
        gate.pass().await;
        bump(&stats.requests);
        sink.write(o, Part::Main).await?;
        *wrote = true;
        bump(&stats.writes_main);
        let status = stored.take().map(|s| s.status).unwrap_or(serde_json::Value::Null);
        *stored = Some(Object { status, ..o.clone() });
    }
    if status_differs(o, stored.as_ref()) {
        gate.pass().await;
        bump(&stats.requests);
        sink.write(o, Part::Status).await?;
        *wrote = true;
        bump(&stats.writes_status);
        if let Some(s) = stored.as_mut() {
            s.status = o.status.clone();
        }
    }
    Ok(())
}
