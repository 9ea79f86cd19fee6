//! The healer's walk over staged nbd records (at start, and for the
//! volumes the cluster hands over): local volumes first, one after
//! another — they need no network, only this agent's own server — then
//! every remote volume at once, each on a thread of its own and bounded
//! by its connect timeout (`nbd::attach::remote_sockets`, 5 s a connect and a
//! negotiation). The walk waits for the remote ones, all together, at
//! most `wait`; those still connecting then go on in the background
//! (reported [`Healed::Pending`], logged when they end, retried like a
//! LINK_DEAD device if the export does not answer). So a hung owner costs
//! neither the local volumes nor the agent's start more than `wait`, and N
//! hung owners cost no more than one.
//!
//! "At once" is bounded: at most [`MAX_REMOTE_HEALS`] remote connects run
//! together, each on one of as many threads, taking the remote volumes in
//! the records' order; a thousand remote volumes whose owners hang cost
//! eight threads, not a thousand. And the walk has an overall deadline
//! ([`HEAL_DEADLINE`], well inside the devices' dead-connection timeout):
//! a remote volume whose turn comes after it is not connected by the walk
//! but handed to the retry loop ([`Steps::defer`]), which tries it again
//! and again as it does a LINK_DEAD device.

use std::collections::{HashMap, VecDeque};
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};

use super::Healed;
use crate::locks::VolumeGuard;
use volring_volumes::StagedVolume;

/// How long the start pass waits, for every remote volume together,
/// before the agent goes on (and serves CSI) with the rest still
/// connecting in the background.
pub(crate) const REMOTE_WAIT: Duration = Duration::from_millis(200);

/// Remote connects (and threads) a walk runs at once, at most.
pub(crate) const MAX_REMOTE_HEALS: usize = 8;

/// How long after a walk starts its remote volumes may still begin their
/// connect; later ones are deferred to the retry loop.
pub(crate) const HEAL_DEADLINE: Duration = Duration::from_secs(60);

/// A walk's bounds.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Bounds {
    /// How long the walk waits for its remote volumes, all together.
    pub(crate) wait: Duration,
    /// Remote connects at once, at most (at least one).
    pub(crate) workers: usize,
    /// After this, a remote volume's turn defers it.
    pub(crate) deadline: Duration,
}

impl Bounds {
    pub(crate) fn waiting(wait: Duration) -> Self {
        Bounds { wait, workers: MAX_REMOTE_HEALS, deadline: HEAL_DEADLINE }
    }
}

/// What the first look at a record found (sysfs and the sockets' state
/// only: nothing that waits).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Plan {
    /// Nothing more to do: this is the outcome.
    Done(Healed),
    /// A local device owed fresh sockets, and why.
    Local(u32, String),
    /// A remote device owed fresh sockets, and why.
    Remote(u32, String),
}

/// The steps that touch the kernel and the network (a test gives its own).
pub(crate) trait Steps: Send + Sync + 'static {
    /// Fresh socketpairs from this agent's server: no network.
    fn local(&self, rec: &StagedVolume, index: u32) -> Healed;
    /// Fresh TCP sockets to the owning node's export: may wait on it, up
    /// to its connect timeout.
    fn remote(&self, rec: &StagedVolume, index: u32) -> Healed;
    /// The walk's deadline passed before the remote volume's turn: hand it
    /// to whatever retries it later.
    fn defer(&self, rec: &StagedVolume, index: u32) -> Healed {
        let _ = rec;
        Healed::Retrying { index, why: "the healer's walk ran out of time before its turn".into() }
    }
}

/// Says what the walk did with one record.
pub(crate) fn log_healed(rec: &StagedVolume, h: &Healed, why: Option<&str>) {
    let id = &rec.volume_id;
    let why = why.unwrap_or("");
    match h {
        Healed::Reconnected(i) => tracing::info!(volume = %id, index = i, why, "nbd device reconnected"),
        Healed::LeftConnected { index, why } => tracing::info!(volume = %id, index, why = %why, "nbd device left connected"),
        Healed::Drift { index, found } => {
            tracing::error!(volume = %id, index, ?found, "the recorded nbd device carries another backend identifier; not touched")
        }
        Healed::Gone => tracing::warn!(volume = %id, "the recorded nbd device is gone; re-staging"),
        Healed::ImageGone(index) => tracing::error!(volume = %id, index, image = %rec.image.display(),
            "the recorded volume's image is gone; its nbd device is left as it is"),
        Healed::Retrying { index, why } => {
            tracing::warn!(volume = %id, index, why = %why, "the remote export does not answer yet; retrying")
        }
        Healed::Pending(index) => {
            tracing::info!(volume = %id, index, "the remote export's reconnect goes on in the background")
        }
        Healed::Failed(e) => tracing::error!(volume = %id, error = %e, "nbd reconnect failed"),
    }
}

/// Walks `planned` (each record with its repair lock and its plan):
/// outcomes in the records' order.
pub(crate) fn walk<S: Steps>(steps: Arc<S>, planned: Vec<(StagedVolume, VolumeGuard, Plan)>, bounds: Bounds) -> Vec<(String, Healed)> {
    let mut out: Vec<(usize, String, Healed)> = Vec::with_capacity(planned.len());
    let mut remotes = Vec::new();
    for (n, (rec, guard, plan)) in planned.into_iter().enumerate() {
        match plan {
            Plan::Done(h) => {
                log_healed(&rec, &h, None);
                out.push((n, rec.volume_id.clone(), h));
            }
            Plan::Local(index, why) => {
                let h = steps.local(&rec, index);
                log_healed(&rec, &h, Some(&why));
                drop(guard);
                out.push((n, rec.volume_id.clone(), h));
            }
            Plan::Remote(index, why) => remotes.push((n, rec, guard, index, why)),
        }
    }
    let (tx, rx) = mpsc::channel::<(usize, Healed)>();
    let pending: HashMap<usize, (String, u32)> =
        remotes.iter().map(|(n, rec, _, index, _)| (*n, (rec.volume_id.clone(), *index))).collect();
    let mut pending = pending;
    let queue: Arc<Mutex<VecDeque<Remote>>> = Arc::new(Mutex::new(remotes.into()));
    let defer_after = Instant::now() + bounds.deadline;
    let workers = pending.len().min(bounds.workers.max(1));
    let mut spawned = 0;
    for _ in 0..workers {
        let (steps, tx, queue) = (steps.clone(), tx.clone(), queue.clone());
        let worker = std::thread::Builder::new().name("nbd-heal".into()).spawn(move || heal_remotes(&*steps, &queue, defer_after, &tx));
        match worker {
            Ok(_) => spawned += 1,
            Err(e) => tracing::warn!(error = %e, "cannot spawn an nbd healer thread"),
        }
    }
    if spawned == 0 {
        // Not one thread: nothing reconnects them now (the locks go with them).
        for (n, rec, _guard, ..) in std::mem::take(&mut *queue.lock().unwrap_or_else(|e| e.into_inner())) {
            pending.remove(&n);
            out.push((n, rec.volume_id, Healed::Failed("cannot spawn a thread to reconnect it".into())));
        }
    }
    drop(tx);
    let deadline = Instant::now() + bounds.wait;
    while !pending.is_empty() {
        match rx.recv_timeout(deadline.saturating_duration_since(Instant::now())) {
            Ok((n, h)) => {
                if let Some((id, _)) = pending.remove(&n) {
                    out.push((n, id, h));
                }
            }
            Err(_) => break,
        }
    }
    for (n, (id, index)) in pending {
        tracing::info!(volume = %id, index, "the start pass goes on; the remote export's reconnect continues in the background");
        out.push((n, id, Healed::Pending(index)));
    }
    out.sort_by_key(|(n, ..)| *n);
    out.into_iter().map(|(_, id, h)| (id, h)).collect()
}

/// A remote volume waiting for its turn: its place in the walk, its
/// record and lock, its device, and why it needs a reconnect.
type Remote = (usize, StagedVolume, VolumeGuard, u32, String);

/// One healer thread: takes the remote volumes in turn until none is
/// left; each stays locked for its one attempt, and no longer (a retry
/// after it takes no lock, as a LINK_DEAD one does).
fn heal_remotes<S: Steps>(steps: &S, queue: &Mutex<VecDeque<Remote>>, defer_after: Instant, tx: &mpsc::Sender<(usize, Healed)>) {
    loop {
        let Some((n, rec, guard, index, why)) = queue.lock().unwrap_or_else(|e| e.into_inner()).pop_front() else { return };
        let h = if Instant::now() < defer_after { steps.remote(&rec, index) } else { steps.defer(&rec, index) };
        log_healed(&rec, &h, Some(&why));
        drop(guard);
        let _ = tx.send((n, h));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::locks::VolumeLocks;
    use std::sync::Mutex;
    use volring_volumes::{AccessKind, AttachKind, RemoteExport, StagePhase};

    fn rec(id: &str, index: u32, remote: bool) -> StagedVolume {
        StagedVolume {
            volume_id: id.into(),
            image: format!("/p/{id}.img").into(),
            staging_path: format!("/k/s/{id}").into(),
            access: AccessKind::Mount { fs_type: "ext4".into(), flags: vec![] },
            read_only: false,
            phase: StagePhase::Staged,
            loop_number: None,
            published: Default::default(),
            attach: AttachKind::Nbd,
            nbd_index: Some(index),
            remote: remote.then(|| RemoteExport { uri: format!("nbd://10.0.0.9:10809/{id}"), secret: "ab".repeat(32) }),
        }
    }

    /// Remote volumes wait on a gate of their own (a hung owner until it
    /// is opened); every step is written down in the order it happened.
    struct Fake {
        events: Mutex<Vec<String>>,
        gates: Mutex<HashMap<String, mpsc::Receiver<()>>>,
    }

    impl Steps for Fake {
        fn local(&self, rec: &StagedVolume, index: u32) -> Healed {
            self.events.lock().unwrap().push(format!("local {} healed", rec.volume_id));
            Healed::Reconnected(index)
        }

        fn remote(&self, rec: &StagedVolume, index: u32) -> Healed {
            self.events.lock().unwrap().push(format!("remote {} connecting", rec.volume_id));
            let gate = self.gates.lock().unwrap().remove(&rec.volume_id);
            if let Some(g) = gate {
                // Bounded only so that a walk that waits for it (the
                // regression) fails the checks instead of hanging.
                let _ = g.recv_timeout(Duration::from_secs(30));
            }
            self.events.lock().unwrap().push(format!("remote {} connected", rec.volume_id));
            Healed::Reconnected(index)
        }
    }

    /// Two remote volumes whose owners hang, walked before a local volume
    /// (the order the store gave): the local volume heals before any
    /// remote connect starts, and the walk comes back while both remote
    /// connects are still pending (it cannot have waited for them: they
    /// end only when the test opens their gates, after the walk returned).
    /// The old walk (one record after another, in the store's order) healed
    /// the local volume only after both remote connects had ended.
    #[test]
    fn locals_heal_first_and_hung_owners_hold_up_nothing() {
        let locks = VolumeLocks::new();
        let (open_a, gate_a) = mpsc::channel();
        let (open_b, gate_b) = mpsc::channel();
        let fake = Arc::new(Fake {
            events: Mutex::new(Vec::new()),
            gates: Mutex::new(HashMap::from([("remote-a".to_string(), gate_a), ("remote-b".to_string(), gate_b)])),
        });
        let plans = [
            (rec("remote-a", 1, true), Plan::Remote(1, "test".into())),
            (rec("remote-b", 2, true), Plan::Remote(2, "test".into())),
            (rec("local-c", 3, false), Plan::Local(3, "test".into())),
            (rec("gone-d", 4, false), Plan::Done(Healed::Gone)),
        ];
        let planned = plans.into_iter().map(|(r, p)| (r.clone(), locks.try_lock_for_repair(&r.volume_id).unwrap(), p)).collect();
        let got = walk(fake.clone(), planned, Bounds::waiting(Duration::from_millis(20)));
        assert_eq!(
            got,
            vec![
                ("remote-a".to_string(), Healed::Pending(1)),
                ("remote-b".to_string(), Healed::Pending(2)),
                ("local-c".to_string(), Healed::Reconnected(3)),
                ("gone-d".to_string(), Healed::Gone),
            ]
        );
        let events = fake.events.lock().unwrap().clone();
        assert_eq!(events[0], "local local-c healed", "{events:?}");
        assert!(!events.iter().any(|e| e.ends_with("connected") && !e.ends_with("connecting")), "{events:?}");
        // The local volume's lock is free; each remote one's is held by its
        // attempt until it ends.
        assert!(locks.try_lock_for_repair("local-c").is_some());
        assert!(locks.try_lock_for_repair("remote-a").is_none());
        open_a.send(()).unwrap();
        open_b.send(()).unwrap();
        let deadline = Instant::now() + Duration::from_secs(30);
        while fake.events.lock().unwrap().iter().filter(|e| e.ends_with(" connected")).count() < 2 {
            assert!(Instant::now() < deadline, "the background reconnects never ended");
            std::thread::sleep(Duration::from_millis(5));
        }
        while locks.try_lock_for_repair("remote-a").is_none() || locks.try_lock_for_repair("remote-b").is_none() {
            assert!(Instant::now() < deadline, "the background reconnects kept their volumes locked");
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// Remote connects that end within the wait are reported as they
    /// ended, in the records' order.
    #[test]
    fn remote_connects_that_end_in_time_are_reported() {
        let locks = VolumeLocks::new();
        let fake = Arc::new(Fake { events: Mutex::new(Vec::new()), gates: Mutex::new(HashMap::new()) });
        let planned = vec![
            (rec("remote-a", 1, true), locks.try_lock_for_repair("remote-a").unwrap(), Plan::Remote(1, "test".into())),
            (rec("local-b", 2, false), locks.try_lock_for_repair("local-b").unwrap(), Plan::Local(2, "test".into())),
        ];
        // Long enough never to expire: the walk returns when both ended.
        let got = walk(fake, planned, Bounds::waiting(Duration::from_secs(600)));
        assert_eq!(got, vec![("remote-a".to_string(), Healed::Reconnected(1)), ("local-b".to_string(), Healed::Reconnected(2))]);
    }

    /// Remote steps whose owners all hang until the test opens one gate;
    /// counts how many run at once (the peak) and on how many threads.
    #[derive(Default)]
    struct Crowd {
        running: Mutex<(usize, usize)>,
        threads: Mutex<std::collections::HashSet<std::thread::ThreadId>>,
        open: Mutex<bool>,
        opened: std::sync::Condvar,
        ended: std::sync::atomic::AtomicUsize,
        deferred: Mutex<Vec<String>>,
    }

    impl Steps for Crowd {
        fn local(&self, _: &StagedVolume, index: u32) -> Healed {
            Healed::Reconnected(index)
        }

        fn remote(&self, _: &StagedVolume, index: u32) -> Healed {
            self.threads.lock().unwrap().insert(std::thread::current().id());
            {
                let mut r = self.running.lock().unwrap();
                r.0 += 1;
                r.1 = r.1.max(r.0);
            }
            // Bounded only so that a broken walk fails instead of hanging.
            let open = self.open.lock().unwrap();
            let _ = self.opened.wait_timeout_while(open, Duration::from_secs(30), |o| !*o).unwrap();
            self.running.lock().unwrap().0 -= 1;
            self.ended.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            Healed::Reconnected(index)
        }

        fn defer(&self, rec: &StagedVolume, index: u32) -> Healed {
            self.deferred.lock().unwrap().push(rec.volume_id.clone());
            self.ended.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            Healed::Retrying { index, why: "deferred".into() }
        }
    }

    fn remotes(locks: &VolumeLocks, n: u32) -> Vec<(StagedVolume, VolumeGuard, Plan)> {
        (0..n)
            .map(|i| {
                let r = rec(&format!("remote-{i}"), i, true);
                let g = locks.try_lock_for_repair(&r.volume_id).unwrap();
                (r, g, Plan::Remote(i, "test".into()))
            })
            .collect()
    }

    /// Issue 27: 40 remote volumes whose owners all hang. The old walk
    /// started a thread, and a connect, for each of them at once; now at
    /// most `workers` connects run together, on as many threads, and every
    /// volume still gets its turn once the owners answer.
    #[test]
    fn hung_owners_cost_a_bounded_number_of_threads() {
        let locks = VolumeLocks::new();
        let crowd = Arc::new(Crowd::default());
        let bounds = Bounds { wait: Duration::from_millis(20), workers: 4, deadline: Duration::from_secs(600) };
        let got = walk(crowd.clone(), remotes(&locks, 40), bounds);
        assert!(got.iter().all(|(_, h)| matches!(h, Healed::Pending(_))), "{got:?}");
        let deadline = Instant::now() + Duration::from_secs(30);
        while crowd.running.lock().unwrap().0 < 4 {
            assert!(Instant::now() < deadline, "the healer threads never started");
            std::thread::sleep(Duration::from_millis(5));
        }
        *crowd.open.lock().unwrap() = true;
        crowd.opened.notify_all();
        while crowd.ended.load(std::sync::atomic::Ordering::SeqCst) < 40 {
            assert!(Instant::now() < deadline, "not every remote volume got its turn");
            std::thread::sleep(Duration::from_millis(5));
        }
        let (_, peak) = *crowd.running.lock().unwrap();
        let threads = crowd.threads.lock().unwrap().len();
        assert!(peak <= 4 && threads <= 4, "{peak} connects at once on {threads} threads; the bound is 4");
        assert!(crowd.deferred.lock().unwrap().is_empty());
    }

    /// A remote volume whose turn comes after the walk's deadline is not
    /// connected by the walk: it is deferred to the retry loop (and its
    /// lock let go).
    #[test]
    fn past_the_deadline_remote_volumes_are_deferred() {
        let locks = VolumeLocks::new();
        let crowd = Arc::new(Crowd::default());
        let bounds = Bounds { wait: Duration::from_secs(600), workers: 2, deadline: Duration::ZERO };
        let got = walk(crowd.clone(), remotes(&locks, 5), bounds);
        assert!(got.iter().all(|(_, h)| matches!(h, Healed::Retrying { .. })), "{got:?}");
        assert_eq!(crowd.deferred.lock().unwrap().len(), 5);
        assert_eq!(crowd.running.lock().unwrap().1, 0, "no connect was started");
        assert!((0..5).all(|i| locks.try_lock_for_repair(&format!("remote-{i}")).is_some()));
    }

    /// An owner process that really hangs: nbdkit, stopped (SIGSTOP)
    /// once it listens; continued and killed, by its PID, when dropped.
    struct HungOwner {
        child: std::process::Child,
        port: u16,
    }

    impl HungOwner {
        fn start() -> Option<Self> {
            let port = std::net::TcpListener::bind("127.0.0.1:0").ok()?.local_addr().ok()?.port();
            let child = std::process::Command::new("nbdkit")
                .args(["-f", "-i", "127.0.0.1", "-p", &port.to_string(), "memory", "1M"])
                .stdout(std::process::Stdio::null())
                .stderr(std::process::Stdio::null())
                .spawn()
                .ok()?;
            let owner = HungOwner { child, port };
            // Wait until it listens (a readiness wait, not a bound).
            let deadline = Instant::now() + Duration::from_secs(30);
            while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
                assert!(Instant::now() < deadline, "nbdkit never listened on {port}");
                std::thread::sleep(Duration::from_millis(10));
            }
            owner.signal(rustix::process::Signal::STOP);
            Some(owner)
        }

        fn signal(&self, s: rustix::process::Signal) {
            let pid = rustix::process::Pid::from_raw(self.child.id() as i32).expect("a child's pid");
            rustix::process::kill_process(pid, s).expect("signal the owner");
        }
    }

    impl Drop for HungOwner {
        fn drop(&mut self) {
            self.signal(rustix::process::Signal::CONT);
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }

    /// The remote step the agent takes (a TCP connect and a negotiation
    /// with the export, `nbd::attach::remote_sockets`), against a real owner; the
    /// local step a fake (this kernel has no nbd module).
    struct RealRemote {
        events: Mutex<Vec<String>>,
    }

    impl Steps for RealRemote {
        fn local(&self, rec: &StagedVolume, index: u32) -> Healed {
            self.events.lock().unwrap().push(format!("local {} healed", rec.volume_id));
            Healed::Reconnected(index)
        }

        fn remote(&self, rec: &StagedVolume, index: u32) -> Healed {
            self.events.lock().unwrap().push(format!("remote {} connecting", rec.volume_id));
            let r = rec.remote.as_ref().unwrap();
            let source = volring_nbd::attach::RemoteSource {
                uri: r.uri.parse::<volring_nbd::remote::ExportUri>().unwrap(),
                secret: r.secret.parse::<volring_nbd::remote::Secret>().unwrap(),
                client: None,
            };
            let h = match volring_nbd::attach::remote_sockets(&source, 1) {
                Ok((sockets, _)) => {
                    volring_nbd::attach::let_go(sockets);
                    Healed::Reconnected(index)
                }
                Err(e) => Healed::Retrying { index, why: e.to_string() },
            };
            self.events.lock().unwrap().push(format!("remote {} ended", rec.volume_id));
            h
        }
    }

    /// One owner hung (SIGSTOP) and a local volume walked after it: the
    /// local volume heals before the remote connect even starts, and the
    /// walk returns while that connect is still pending (the owner cannot
    /// answer until it is continued, after the checks).
    #[test]
    fn a_hung_owner_holds_up_neither_the_local_volume_nor_the_walk() {
        let Some(owner) = HungOwner::start() else {
            assert!(std::env::var_os("CI").is_none(), "nbdkit is missing");
            eprintln!("note: skipped: no nbdkit");
            return;
        };
        let locks = VolumeLocks::new();
        let mut remote = rec("remote-hung", 1, true);
        remote.remote.as_mut().unwrap().uri = format!("nbd://127.0.0.1:{}/remote-hung", owner.port);
        let local = rec("local-after", 2, false);
        let steps = Arc::new(RealRemote { events: Mutex::new(Vec::new()) });
        let planned = vec![
            (remote.clone(), locks.try_lock_for_repair(&remote.volume_id).unwrap(), Plan::Remote(1, "test".into())),
            (local.clone(), locks.try_lock_for_repair(&local.volume_id).unwrap(), Plan::Local(2, "test".into())),
        ];
        let got = walk(steps.clone(), planned, Bounds::waiting(REMOTE_WAIT));
        let events = steps.events.lock().unwrap().clone();
        assert_eq!(got, vec![("remote-hung".to_string(), Healed::Pending(1)), ("local-after".to_string(), Healed::Reconnected(2))]);
        assert_eq!(events.first().map(String::as_str), Some("local local-after healed"), "{events:?}");
        assert!(!events.iter().any(|e| e.ends_with(" ended")), "the walk waited for the hung owner: {events:?}");
        drop(owner);
        let deadline = Instant::now() + Duration::from_secs(60);
        while !steps.events.lock().unwrap().iter().any(|e| e.ends_with(" ended")) {
            assert!(Instant::now() < deadline, "the background connect never ended");
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}
