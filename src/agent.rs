//! `volring node`: wires the ring threads to the async side and runs until
//! told to stop.
//!
//! Three ring threads feed one async loop: the mount watcher, the hot-plug
//! listener and the stat collector. The loop owns the mount table and the
//! device inventory, joins them (which device is mounted where), tells the
//! collector which devices to sample, and publishes the inventory for
//! `/metrics` (later: the CR updater) to read without locks. The mount
//! table is shared with the CSI driver behind a read-write lock: the loop
//! writes each batch of events, NodeGetVolumeStats reads one entry.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use anyhow::Context;
use arc_swap::ArcSwap;
use tokio::signal::unix::{signal, SignalKind};
use tokio::task::JoinHandle;

use volring_devices::{CollectorConfig, DeviceEvent, DeviceWatcher, Inventory, ScanConfig, StatCollector};
use volring_mounts::{MountTable, MountWatcher, WatchConfig, WatchEvent};

/// What `volring node` was asked to do.
#[derive(Debug, Clone)]
pub struct AgentConfig {
    pub mounts: WatchConfig,
    pub devices: ScanConfig,
    pub stats: CollectorConfig,
    /// Where `/metrics` is served; `None`: not served.
    pub metrics: Option<SocketAddr>,
    /// Log a line per mount and device event (they are always counted).
    pub log_events: bool,
    /// The agent's state directory; one agent at a time may use it.
    pub state_dir: PathBuf,
    /// The CSI driver's settings; `None`: no CSI socket.
    pub csi: Option<volring_csi::CsiConfig>,
    /// The NBD server's settings; `None`: no NBD server.
    pub nbd: Option<NbdConfig>,
    /// How the CSI volumes' state is reconciled.
    pub reconcile: volring_volumes::state::reconcile::ReconcileConfig,
    /// Publishing BlockDevice and StorageNode objects; `None`: not published.
    pub publish: Option<PublishConfig>,
    /// The re-read after creating a shared volume's Service or Endpoints
    /// (the loop runs when the node serves NFS and has a cluster).
    pub share_kube: volring_share::kube::ControllerConfig,
}

/// Where and how fast the node's objects are published.
#[derive(Debug, Clone)]
pub struct PublishConfig {
    /// `Some(true)`: the cluster (fails when no client configuration is
    /// found); `Some(false)`: the node's store; `None`: the cluster when a
    /// kubeconfig or a pod's service account is found, else the store.
    pub kube: Option<bool>,
    pub qps: f64,
    pub burst: u32,
    pub window: Duration,
    pub gone: volring_kube::GonePolicy,
}

impl Default for PublishConfig {
    fn default() -> Self {
        let d = volring_kube::UpdaterConfig::new("");
        Self { kube: None, qps: d.qps, burst: d.burst, window: d.window, gone: d.gone }
    }
}

/// The node's NBD server: where it listens and what it exports at start.
#[derive(Debug, Clone)]
pub struct NbdConfig {
    pub server: volring_nbd::ServerConfig,
    pub exports: Vec<volring_nbd::ExportSpec>,
}

impl Default for AgentConfig {
    fn default() -> Self {
        Self {
            mounts: WatchConfig::default(),
            devices: ScanConfig::default(),
            stats: CollectorConfig::default(),
            metrics: Some(SocketAddr::from(([127, 0, 0, 1], 9477))),
            log_events: false,
            state_dir: PathBuf::from("/var/lib/volring"),
            csi: None,
            nbd: None,
            reconcile: Default::default(),
            publish: Some(PublishConfig::default()),
            share_kube: Default::default(),
        }
    }
}

/// Opens the CSI driver (its store and pool) and runs the nbd healer's
/// start walk on it (see `run`); the reconciler's start, which would run
/// the walk otherwise, finds it done.
async fn heal_first(
    c: volring_csi::CsiConfig,
    table: Arc<RwLock<MountTable>>,
    ready: volring_csi::Readiness,
) -> anyhow::Result<Arc<volring_csi::Driver>> {
    let driver = volring_csi::Driver::new(c, table, ready)?;
    let d = driver.clone();
    let walked = tokio::task::spawn_blocking(move || d.heal_nbd()).await?;
    if !walked.is_empty() {
        tracing::info!(volumes = walked.len(), "nbd start walk done");
    }
    Ok(driver)
}

/// The name of the lock file in the state directory.
const LOCK_FILE: &str = "agent.lock";

/// Runs the agent until SIGINT or SIGTERM; SIGHUP is logged and ignored
/// (nothing of `volring node` is reloadable).
///
/// Everything that can make a second agent on the node harmful is taken
/// first, and failing to take it is fatal: the state directory's lock, the
/// CSI socket, the metrics address and the NBD listeners. Only then do the
/// rings and servers start.
pub async fn run(config: AgentConfig) -> anyhow::Result<()> {
    // The first line: how long the process took to reach its own code
    // (exec, loading) tells apart from what the start below costs.
    tracing::info!(pid = std::process::id(), "volring node starting");
    let mut term = signal(SignalKind::terminate())?;
    let mut hup = signal(SignalKind::hangup())?;
    lock_state_dir(&config.state_dir)?;
    let csi_socket = match &config.csi {
        Some(c) => {
            Some(volring_csi::server::bind(&c.endpoint).with_context(|| format!("cannot bind CSI socket {}", c.endpoint.display()))?)
        }
        None => None,
    };
    let metrics_listener = match config.metrics {
        Some(addr) => Some(tokio::net::TcpListener::bind(addr).await.with_context(|| format!("cannot bind the metrics address {addr}"))?),
        None => None,
    };
    let nbd = match &config.nbd {
        Some(c) => {
            // The NBD error's text already carries its cause.
            // Off the runtime: a bind may wait for a killed agent's port.
            let server_config = c.server.clone();
            let server =
                tokio::task::spawn_blocking(move || volring_nbd::NbdServer::start(server_config, Arc::new(volring_nbd::Exports::new())))
                    .await?
                    .map_err(|e| anyhow::anyhow!("cannot start the NBD server: {e}"))?;
            for spec in &c.exports {
                server.add_export(spec).with_context(|| format!("NBD export {}", spec.name))?;
            }
            Some(server)
        }
        None => None,
    };

    let export_listener = match config.csi.as_ref().and_then(|c| c.nbd_export.clone()) {
        Some(e) => {
            let listen = e.listen;
            Some(
                tokio::task::spawn_blocking(move || volring_csi::nbd_export::ExportListener::start(e))
                    .await?
                    .map_err(|e| anyhow::anyhow!("cannot start the nbd export listener on {listen}: {e}"))?,
            )
        }
        None => None,
    };
    // The nbd healer next (after the listeners, so an agent that cannot
    // have them exits before it touches a device), before anything the
    // walk does not need (the mount watcher, the device scan, the stat
    // collector, the CSI server, the reconciler): while the agent
    // is away the kernel queues the volumes' I/O, so every step taken
    // before their devices get fresh sockets is time the applications wait.
    // The walk needs only the store and the driver's own NBD server; the
    // mount table is filled in below, before the CSI server and the
    // reconciler (the first to read it) start.
    let table = Arc::new(RwLock::new(MountTable::new()));
    let ready = volring_csi::Readiness::default();
    let driver = match &config.csi {
        Some(c) => Some(heal_first(c.clone(), table.clone(), ready.clone()).await?),
        None => None,
    };
    let (watcher, initial, mount_events) = MountWatcher::start(config.mounts.clone())?;
    tracing::info!(mounts = initial.len(), mode = ?watcher.mode(), backend = ?watcher.stats().backend, "watching the mount table");
    *table.write().unwrap_or_else(|e| e.into_inner()) = initial;
    let (csi_stop, csi_stopped) = tokio::sync::oneshot::channel::<()>();
    let mut csi = match (driver, csi_socket) {
        (Some(driver), Some((listener, socket))) => {
            if let Some(l) = export_listener {
                driver.serve_exports(l)?;
            }
            let server = tokio::spawn(volring_csi::server::serve(driver.clone(), listener, async {
                let _ = csi_stopped.await;
            }));
            Some(Csi { driver, server, socket })
        }
        _ => None,
    };

    // Listen before scanning, so nothing plugged in between is missed (an
    // event for a device the scan already has is just a change).
    let (hotplug, device_events) = DeviceWatcher::start(config.devices.clone(), 4096)?;
    let mut inventory = scan(&config.devices, &table).await??;
    tracing::info!(devices = inventory.len(), "block device inventory");
    let collector = StatCollector::start(config.stats.clone(), tracked(&inventory))?;
    let published = Arc::new(ArcSwap::from_pointee(inventory.clone()));
    let mount_stats = Arc::new(ArcSwap::from_pointee(watcher.stats()));

    // Before Probe answers ready, every volume is looked at once and what a
    // crash interrupted is finished (or undone).
    let reconciler = match &csi {
        Some(c) => {
            let (driver, rc) = (c.driver.clone(), config.reconcile.clone());
            let r = tokio::task::spawn_blocking(move || driver.start_reconciler(rc)).await??;
            tracing::info!(
                volumes = r.view().all().len(),
                repairs = r.stats().repairs_done.load(std::sync::atomic::Ordering::Relaxed),
                "volumes reconciled"
            );
            Some(r)
        }
        None => None,
    };
    // Made before /metrics serves, so the publisher's series are there from
    // the first scrape.
    let publish_stats = config.publish.as_ref().map(|_| Arc::new(volring_kube::updater::Stats::default()));
    // In a cluster (the same choice the publisher makes: --kube, else a
    // kubeconfig or the pod's service account): NodeStage reads the
    // endpoints published on PVCs, and a node serving NFS keeps a Service
    // and Endpoints per export.
    let cluster = config.publish.as_ref().and_then(|p| p.kube).unwrap_or_else(|| volring_kube::kube_sink::KubeSink::detect().is_some());
    let shares = match &csi {
        Some(c) if cluster => volring_share::follow::in_cluster(&c.driver, config.share_kube.clone()).await?,
        _ => None,
    };
    let sources = crate::metrics::Sources {
        share: shares.as_ref().map(|s| s.controller.clone()),
        stats: collector.reader(),
        inventory: published.clone(),
        hotplug: hotplug.stats().clone(),
        rings: vec![("stats", collector.ring_stats().clone()), ("hotplug", hotplug.ring_stats().clone())],
        mounts: mount_stats.clone(),
        nbd: nbd.as_ref().map(|s| s.exports().clone()),
        reconcile: reconciler.as_ref().map(|r| crate::metrics::Reconcile { stats: r.stats().clone(), view: r.view().clone() }),
        csi: csi.as_ref().map(|c| c.driver.clone()),
        ready: ready.clone(),
        publish: publish_stats.clone(),
    };
    let metrics_url = metrics_listener.as_ref().and_then(|l| l.local_addr().ok()).map(|a| format!("http://{a}/metrics"));
    let mut metrics = metrics_listener.map(|l| tokio::spawn(crate::metrics::serve(l, sources)));
    let notify = reconciler.as_ref().map(|r| r.notifier());
    let node = config.devices.node_name.clone();
    let view = reconciler.as_ref().map(|r| r.view().clone());
    let driver = csi.as_ref().map(|c| c.driver.clone());
    let mut publisher = match &config.publish {
        Some(p) => Some(
            start_publisher(
                p,
                &config.state_dir,
                &node,
                driver.clone(),
                view.clone(),
                &inventory,
                publish_stats.clone().unwrap_or_default(),
            )
            .await?,
        ),
        None => None,
    };
    ready.set(true);
    // One line that says what this agent serves, for the person who just
    // started it.
    tracing::info!(
        mounts = table.read().unwrap_or_else(|e| e.into_inner()).len(),
        devices = inventory.len(),
        metrics = metrics_url.as_deref().unwrap_or("off"),
        csi = csi.as_ref().map_or_else(|| "off".to_string(), |c| format!("unix://{}", c.socket.path().display())),
        nbd = nbd.as_ref().map_or_else(|| "off".to_string(), |s| s.addresses().join(",")),
        nbd_export = csi.as_ref().and_then(|c| c.driver.export_address()).unwrap_or_else(|| "off".to_string()),
        volumes = reconciler.as_ref().map_or(0, |r| r.view().all().len()),
        "ready"
    );

    let mut report = tokio::time::interval(Duration::from_secs(60));
    let mut relink = tokio::time::interval(Duration::from_millis(250));
    report.tick().await;
    // Mount and device changes are joined in at most every 250 ms.
    let mut dirty = false;
    // A full rescan runs on the blocking pool; device events wait in their
    // queue meanwhile, so they apply after it, in order, as they always did.
    let mut rescan: Option<JoinHandle<Result<Inventory, volring_devices::Error>>> = None;
    let result = loop {
        tokio::select! {
            ev = mount_events.recv() => match ev {
                Some(ev) => {
                    dirty |= apply_mounts(&mut table.write().unwrap_or_else(|e| e.into_inner()), &ev, config.log_events);
                    if let Some(n) = &notify {
                        n.paths(changed_paths(&ev));
                    }
                }
                None => break Err(anyhow::anyhow!("mount watcher stopped")),
            },
            ev = device_events.recv(), if rescan.is_none() => match ev {
                Some(DeviceEvent::Rescan { reason }) => {
                    tracing::warn!(reason, "device events lost; rescanning");
                    rescan = Some(scan(&config.devices, &table));
                }
                Some(ev) => {
                    if let (Some(n), Some(name)) = (&notify, device_name(&ev)) {
                        n.device(name);
                    }
                    apply_device(&mut inventory, ev, config.log_events);
                    dirty = true;
                }
                None => break Err(anyhow::anyhow!("hot-plug listener stopped")),
            },
            done = finished(&mut rescan) => {
                rescan = None;
                match done {
                    Ok(Ok(fresh)) => inventory = fresh,
                    Ok(Err(e)) => tracing::error!(error = %e, "device rescan failed"),
                    Err(e) => tracing::error!(error = %e, "device rescan did not finish"),
                }
                dirty = true;
            }
            // A burst of thousands of events is joined, published and handed
            // to the collector once, not once per event.
            _ = relink.tick(), if dirty => {
                dirty = false;
                let before: Vec<_> = published.load().devices.keys().copied().collect();
                inventory.link(&read(&table), &config.devices.node_name);
                inventory.devices.retain(|_, d| config.devices.filter.admits(d));
                if !inventory.devices.keys().copied().eq(before) && !collector.track(tracked(&inventory)) {
                    tracing::warn!("stat collector busy; the device set is passed with the next change");
                }
                published.store(Arc::new(inventory.clone()));
                mount_stats.store(Arc::new(watcher.stats()));
                if let Some(p) = &mut publisher {
                    p.feed.devices(&p.up, &inventory, &node);
                    // The pool's figures ride along with device changes.
                    p.node_signal.signal();
                }
            }
            _ = report.tick() => {
                let s = watcher.stats();
                let snap = collector.reader().latest();
                tracing::info!(mounts = read(&table).len(), events = s.mount_events, resyncs = s.resyncs, cpu_ms = s.cpu.as_millis() as u64,
                    devices = inventory.len(), stat_method = snap.method, stat_cost_us = snap.cost.as_micros() as u64, "status");
                mount_stats.store(Arc::new(s));
            }
            // A server that stops on its own leaves the node without it:
            // exit (non-zero) so the DaemonSet restarts the agent.
            r = finished(&mut metrics) => break Err(server_ended("metrics", r)),
            r = finished_csi(&mut csi) => break Err(server_ended("CSI", r)),
            _ = hup.recv() => tracing::info!("SIGHUP: volring node has nothing to reload; ignored"),
            _ = tokio::signal::ctrl_c() => break Ok(()),
            _ = term.recv() => break Ok(()),
        }
    };
    ready.set(false);
    if let Some(Publisher { up, mut feed, node_follower, node_build, .. }) = publisher {
        node_follower.abort();
        feed.devices(&up, &inventory, &node);
        // What is already stored is not written again.
        up.submit(node_build());
        let s = up.shutdown(Duration::from_secs(10)).await;
        tracing::info!(
            writes = s.writes_main + s.writes_status,
            unchanged = s.unchanged,
            coalesced = s.coalesced,
            abandoned = s.abandoned,
            "publisher stopped"
        );
    }
    if let Some(r) = reconciler {
        // It may be inside a repair: let it finish on the blocking pool.
        let _ = tokio::task::spawn_blocking(move || r.stop()).await;
    }
    if let Some(s) = metrics {
        s.abort();
    }
    if let Some(s) = shares {
        // Empties the Endpoints of this node's exports first: the NFS
        // server stops with the agent.
        s.stop(Duration::from_secs(5)).await;
    }
    if let Some(c) = csi {
        stop_csi(c, csi_stop).await;
    }
    if let Some(server) = nbd {
        server.stop();
    }
    collector.stop()?;
    hotplug.stop()?;
    let stats = watcher.stop()?;
    tracing::info!(events = stats.mount_events, resyncs = stats.resyncs, cpu_ms = stats.cpu.as_millis() as u64, "stopped");
    result
}

/// The running publisher: the updater, the devices' feed, and the
/// StorageNode's follower (a task woken by the CSI records, the
/// reconciler's verdicts and device relinks; never by a timer).
struct Publisher {
    up: volring_kube::Updater,
    feed: volring_kube::feed::Feed,
    node_signal: volring_kube::node_feed::NodeSignal,
    node_follower: JoinHandle<()>,
    node_build: volring_kube::node_feed::Builder,
}

/// Starts the updater on the cluster or the node's store, with this node's
/// objects as they are now, and the StorageNode's follower.
async fn start_publisher(
    p: &PublishConfig,
    state_dir: &Path,
    node: &str,
    driver: Option<Arc<volring_csi::Driver>>,
    view: Option<Arc<volring_volumes::state::actual::HealthView>>,
    inventory: &Inventory,
    stats: Arc<volring_kube::updater::Stats>,
) -> anyhow::Result<Publisher> {
    use volring_kube::node_feed::{self, NodeFeed, NodeSignal};
    use volring_kube::{embedded_sink::EmbeddedSink, kube_sink::KubeSink, Updater, UpdaterConfig};
    let mut uc = UpdaterConfig::new(node);
    (uc.qps, uc.burst, uc.window, uc.gone) = (p.qps, p.burst, p.window, p.gone);
    uc.unread_paths = volring_kube::feed::unread_paths(inventory);
    // Listen before the first build, so no change falls between.
    let node_signal = NodeSignal::default();
    if let Some(d) = &driver {
        let s = node_signal.clone();
        d.on_volume_change(move |_| s.signal());
    }
    if let Some(v) = &view {
        let s = node_signal.clone();
        v.on_change(move || s.signal());
    }
    let store = driver.as_ref().map(|d| d.store());
    let (name, hook_driver) = (node.to_string(), driver.clone());
    // What the healer hook's cross-check found (cluster only).
    let unknown: Arc<std::sync::Mutex<Option<Vec<String>>>> = Default::default();
    let u = unknown.clone();
    let mut node_feed = NodeFeed::new(
        node_signal.clone(),
        Arc::new(move || {
            let u = u.lock().unwrap_or_else(|e| e.into_inner());
            match &driver {
                Some(d) => node_feed::storage_node(&name, &d.staged(), view.as_deref(), Some(d.pool_dir()), u.as_deref()),
                None => node_feed::storage_node(&name, &[], None, None, u.as_deref()),
            }
        }),
    );
    let initial = volring_kube::feed::Feed::initial(inventory, node, node_feed.current());
    let mut feed = volring_kube::feed::Feed::default();
    feed.seed(&initial);
    let source = KubeSink::detect();
    let up = if p.kube.unwrap_or(source.is_some()) {
        let sink = Arc::new(KubeSink::infer().await.context("--kube")?);
        let from = source.map_or_else(|| "--kube".to_string(), |s| s.to_string());
        tracing::info!(objects = initial.len(), from, "publishing to the cluster");
        if let Some(d) = hook_driver {
            tokio::spawn(volring_kube::attachments::healer_hook(sink.clone(), d, node.to_string(), unknown, node_signal.clone()));
        }
        Updater::start_counting(sink, uc, initial, stats)
    } else {
        let store = match store {
            Some(s) => s,
            None => Arc::new(volring_volumes::store::Store::open(&state_dir.join(volring_volumes::store::FILE))?),
        };
        tracing::info!(objects = initial.len(), "no cluster: publishing to the node's store");
        Updater::start_counting(Arc::new(EmbeddedSink::new(store)), uc, initial, stats)
    };
    let node_build = node_feed.builder();
    let node_follower = tokio::spawn(node_feed.follow(up.handle()));
    Ok(Publisher { up, feed, node_signal, node_follower, node_build })
}

/// The running CSI driver, its server task and the socket it bound.
struct Csi {
    driver: Arc<volring_csi::Driver>,
    server: JoinHandle<std::io::Result<()>>,
    socket: volring_csi::server::BoundSocket,
}

/// Takes the state directory for this process: an exclusive `flock` on
/// `STATE_DIR/agent.lock`, which then holds the holder's pid. The lock is
/// held until the process exits (its descriptor is never closed), also
/// past `run` while the runtime waits for blocking work to end, so a
/// restarted agent cannot start while the old one still touches the state.
pub fn lock_state_dir(dir: &Path) -> anyhow::Result<()> {
    use std::io::{Read, Seek, Write};
    use std::os::fd::IntoRawFd;
    std::fs::create_dir_all(dir).with_context(|| format!("cannot create the state directory {}", dir.display()))?;
    let path = dir.join(LOCK_FILE);
    let mut file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(&path)
        .with_context(|| format!("cannot open {}", path.display()))?;
    match rustix::fs::flock(&file, rustix::fs::FlockOperation::NonBlockingLockExclusive) {
        Ok(()) => {}
        Err(rustix::io::Errno::WOULDBLOCK) => {
            let mut held_by = String::new();
            let _ = file.read_to_string(&mut held_by);
            let pid = match held_by.trim() {
                "" => "unknown".to_string(),
                p => p.chars().take(20).collect(),
            };
            anyhow::bail!("another volring agent holds {} (pid {pid})", dir.display());
        }
        Err(e) => return Err(std::io::Error::from(e)).with_context(|| format!("cannot lock {}", path.display())),
    }
    file.set_len(0)?;
    file.rewind()?;
    writeln!(file, "{}", std::process::id())?;
    // Kept open on purpose until exit: closing it would release the lock.
    let _ = file.into_raw_fd();
    tracing::debug!(state_dir = %dir.display(), "state directory locked");
    Ok(())
}

/// Scans the devices on the blocking pool (a full scan reads sysfs and the
/// first blocks of every device), against a copy of the mount table.
fn scan(cfg: &ScanConfig, table: &RwLock<MountTable>) -> JoinHandle<Result<Inventory, volring_devices::Error>> {
    let (cfg, table) = (cfg.clone(), read(table).clone());
    tokio::task::spawn_blocking(move || Inventory::scan(&cfg, &table))
}

/// Waits for the task in `slot`; never completes when there is none.
async fn finished<T>(slot: &mut Option<JoinHandle<T>>) -> Result<T, tokio::task::JoinError> {
    match slot {
        Some(h) => h.await,
        None => std::future::pending().await,
    }
}

async fn finished_csi(csi: &mut Option<Csi>) -> Result<std::io::Result<()>, tokio::task::JoinError> {
    match csi {
        Some(c) => (&mut c.server).await,
        None => std::future::pending().await,
    }
}

fn server_ended(what: &str, r: Result<std::io::Result<()>, tokio::task::JoinError>) -> anyhow::Error {
    match r {
        Ok(Ok(())) => anyhow::anyhow!("the {what} server stopped"),
        Ok(Err(e)) => anyhow::anyhow!("the {what} server failed: {e}"),
        Err(e) => anyhow::anyhow!("the {what} server task ended: {e}"),
    }
}

/// Stops accepting CSI calls, lets the running ones finish (kubelet keeps
/// its connection open forever, so idle connections are not waited for),
/// then drops the server and removes the socket if it is still this
/// agent's. A call counts as running until its blocking work returns, also
/// when kubelet gave up on it.
async fn stop_csi(csi: Csi, stop: tokio::sync::oneshot::Sender<()>) {
    let Csi { driver, server, socket } = csi;
    let _ = stop.send(());
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    if driver.in_flight() > 0 {
        tracing::info!(calls = driver.in_flight(), "waiting for running CSI calls");
    }
    while driver.in_flight() > 0 && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    if driver.in_flight() > 0 {
        tracing::warn!(
            calls = driver.in_flight(),
            "CSI calls still running after 30 s; stopping anyway (their records let a restart finish them)"
        );
    }
    server.abort();
    let _ = server.await;
    drop(socket);
}

fn read(t: &RwLock<MountTable>) -> std::sync::RwLockReadGuard<'_, MountTable> {
    t.read().unwrap_or_else(|e| e.into_inner())
}

/// The devices the collector samples.
fn tracked(inv: &Inventory) -> Vec<(volring_mounts::DevNum, Arc<str>)> {
    inv.devices.values().map(|d| (d.dev, Arc::from(d.name.as_str()))).collect()
}

/// Applies mount events; true when one touched a block device.
fn apply_mounts(table: &mut MountTable, ev: &WatchEvent, log: bool) -> bool {
    if let WatchEvent::Resync { reason, changes, .. } = ev {
        tracing::warn!(?reason, changes = changes.len(), "mount table resync");
    }
    let mut devices = false;
    for e in ev.changes() {
        table.apply(e);
        devices |= !e.devices.is_empty();
        if log {
            let target = e.subject().map(|m| m.mount_point_path().display().to_string());
            let devices: Vec<_> = e.devices.iter().filter_map(|d| d.path.clone()).collect();
            tracing::info!(kind = ?e.kind, id = e.id, target, ?devices, "mount");
        }
    }
    devices
}

/// The mount points a batch of mount events touched (before and after a
/// move), for the reconciler.
fn changed_paths(ev: &WatchEvent) -> Vec<PathBuf> {
    let mut paths = Vec::new();
    for e in ev.changes() {
        for m in [&e.mount, &e.previous].into_iter().flatten() {
            paths.push(m.mount_point_path().to_path_buf());
        }
    }
    paths
}

fn device_name(ev: &DeviceEvent) -> Option<&str> {
    match ev {
        DeviceEvent::Added { device, .. } | DeviceEvent::Changed { device, .. } => Some(&device.name),
        DeviceEvent::Removed { name, .. } => Some(name),
        DeviceEvent::Rescan { .. } => None,
    }
}

/// Applies a device event other than a rescan (the loop runs those);
/// joining with the mount table and the filter happen on the next relink.
fn apply_device(inv: &mut Inventory, ev: DeviceEvent, log: bool) {
    match ev {
        DeviceEvent::Added { device, .. } | DeviceEvent::Changed { device, .. } => {
            if log {
                tracing::info!(device = %device.name, dev = %device.dev, fstype = device.fstype(), "device");
            }
            inv.insert(*device);
        }
        DeviceEvent::Removed { name, .. } => {
            if log {
                tracing::info!(device = %name, "device removed");
            }
            inv.remove_named(&name);
        }
        // The loop runs rescans itself, off the runtime; none comes here.
        DeviceEvent::Rescan { .. } => {}
    }
}
