//! The updater's loop: what is pending, queued, backing off and known to
//! be stored, and the turns that write it (see `updater.rs` for why each
//! part is there).

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap, HashSet, VecDeque};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use tokio::task::JoinSet;
use tokio::time::Instant;

use super::follow::Followers;
use super::job::{plan, run_job, Outcome, Plan, Sent};
use super::outage::Server;
use super::{bump, lock, Seen, Shared, Sink, SinkError, UpdaterConfig, Want};
use crate::objects::{Key, Kind, Object};
use crate::pace::{backoff, Gate, Limit, PushBack};

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

pub(super) struct Worker<S> {
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
    /// Whether the server answers, and how requests may go out.
    server: Server,
    config: UpdaterConfig,
}

impl<S: Sink> Worker<S> {
    pub(super) fn new(sink: Arc<S>, shared: Arc<Shared>, config: UpdaterConfig) -> Self {
        let gate = Arc::new(if S::PACED { Gate::new(config.qps, config.burst) } else { Gate::open() });
        let limit = Limit::new(config.concurrency, config.grow_every, Instant::now());
        shared.stats.limit.store(limit.get() as u64, Ordering::Relaxed);
        Worker {
            sink,
            gate,
            shared,
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
            server: Server::default(),
            config,
        }
    }

    pub(super) async fn run(mut self, initial: Vec<Object>) {
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
        self.server.blocked_until(now)
    }

    /// When the first backed-off key is due: its own time, or while the
    /// server is down the time of the next probe at the latest (it is
    /// pulled forward to probe with), never before it.
    fn next_due(&self) -> Option<Instant> {
        let first = self.delayed.peek().map(|Reverse((d, _, _))| *d)?;
        Some(self.server.next_due(first, self.config.probe_max))
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
                tokio::spawn(super::follow::follow(sink, shared, config, kind, version))
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
                if !self.server.may_start(jobs.len(), self.limit.get(), now) {
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
                let probe = self.server.start();
                if probe {
                    bump(&self.shared.stats.probes);
                }
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
                    self.server.lost();
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
                    self.server.hold(now, *retry_after);
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
        let Some(d) = self.server.answered() else { return };
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
        self.server.failed(sent.probe, self.limit.get(), now, &self.config);
    }
}
