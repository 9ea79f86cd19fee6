//! The agent's start, in order; each component is registered with the list
//! as soon as it runs, so a start that fails half way stops what it
//! started, newest first.
//!
//! Everything that can make a second agent on the node harmful is taken
//! first, and failing to take it is fatal: the CSI socket, the metrics
//! address and the NBD listeners (the state directory's lock is taken
//! before). Then the nbd healer's start walk, before anything it does not
//! need; then the rings and servers.

use std::sync::{Arc, RwLock};
use std::time::Duration;

use anyhow::Context;
use arc_swap::ArcSwap;

use volring_devices::{DeviceEvent, DeviceWatcher, HotplugStats, Inventory, StatCollector, StatsReader};
use volring_mounts::{MountTable, MountWatcher, WatchEvent, WatcherStats};
use volring_ring::queue::Receiver;
use volring_ring::RingStats;
use volring_volumes::Notifier;

use super::component::{Components, OffRuntime};
use super::events::{self, Events};
use super::{csi, publisher, volumes, AgentConfig, TARGET};

/// A ring thread's stop joins it; it is quick unless the thread is stuck.
const RING_WAIT: Duration = Duration::from_secs(10);
/// The reconciler may be inside a repair: it is let finish.
const RECONCILER_WAIT: Duration = Duration::from_secs(60);
/// The shared-volume loop empties this node's EndpointSlices within 5 s.
const SHARE_EMPTY: Duration = Duration::from_secs(5);
const SHARE_WAIT: Duration = Duration::from_secs(10);
const SERVER_WAIT: Duration = Duration::from_secs(5);

/// A started agent: its event loop, and what its "ready" line says.
pub(super) struct Started {
    pub events: Events,
    pub ready: volring_csi::Readiness,
    pub summary: Summary,
}

/// What the agent serves, for its "ready" line.
pub(super) struct Summary {
    pub metrics: Option<String>,
    pub csi: Option<String>,
    pub nbd: Option<String>,
    pub nbd_export: Option<String>,
    pub volumes: usize,
}

/// What is taken before anything starts, and the CSI driver after the walk.
struct Taken {
    csi_socket: Option<(tokio::net::UnixListener, volring_csi::server::BoundSocket)>,
    metrics: Option<tokio::net::TcpListener>,
    /// The NBD server's addresses (for the ready line) and exports.
    nbd: Option<(String, Arc<volring_nbd::Exports>)>,
    export_listener: Option<OffRuntime<volring_csi::nbd_export::ExportListener>>,
    table: Arc<RwLock<MountTable>>,
    ready: volring_csi::Readiness,
    driver: Option<Arc<volring_csi::Driver>>,
}

/// Starts every component, in order (see the module's text).
pub(super) async fn start(config: &AgentConfig, parts: &mut Components) -> anyhow::Result<Started> {
    let t = take(config, parts).await?;
    let (driver, table) = (t.driver.clone(), t.table.clone());
    let mounts = watch_mounts(config, &table, parts).await?;
    let csi_url = match (&driver, t.csi_socket) {
        (Some(d), Some(socket)) => Some(csi::serve(d, socket, t.export_listener, parts).await?),
        _ => None,
    };
    let devices = watch_devices(config, &table, parts).await?;
    // Before Probe answers ready, every volume is looked at once and what a
    // crash interrupted is finished (or undone).
    let reconciler = match &driver {
        Some(d) => Some(reconcile(d, config, parts).await?),
        None => None,
    };
    // Made before /metrics serves, so the publisher's series are there from
    // the first scrape.
    let publish_stats = config.publish.as_ref().map(|_| Arc::new(volring_kube::Stats::default()));
    let share = share_loop(config, driver.as_ref(), parts).await?;
    let identities = match &driver {
        Some(d) => Some(volumes::start(config, d, parts).await),
        None => None,
    };
    let published = Arc::new(ArcSwap::from_pointee(devices.inventory.clone()));
    let sources = crate::metrics::Sources {
        share,
        stats: devices.stats.clone(),
        inventory: published.clone(),
        hotplug: devices.hotplug,
        rings: devices.rings,
        mounts: mounts.stats.clone(),
        nbd: t.nbd.as_ref().map(|(_, exports)| exports.clone()),
        reconcile: reconciler.as_ref().map(|(_, r)| r.clone()),
        csi: driver.clone(),
        ready: t.ready.clone(),
        publish: publish_stats.clone(),
        volumes: identities.as_ref().map(|i| i.current.clone()),
    };
    let metrics = t.metrics.map(|l| serve_metrics(l, sources, parts));
    let view = reconciler.as_ref().map(|(_, r)| r.view.clone());
    let publisher = match &config.publish {
        Some(p) => {
            Some(publisher::start(p, publish_inputs(config, &driver, &view, &devices.inventory, publish_stats, &identities), parts).await?)
        }
        None => None,
    };
    let summary = Summary {
        metrics,
        csi: csi_url,
        nbd: t.nbd.map(|(addresses, _)| addresses),
        nbd_export: driver.as_ref().and_then(|d| d.export_address()),
        volumes: view.map_or(0, |v| v.all().len()),
    };
    let events = Events {
        devices: config.devices.clone(),
        log_events: config.log_events,
        table,
        inventory: devices.inventory,
        published,
        mount_stats: mounts.stats,
        watcher: mounts.watcher,
        collector: devices.collector,
        device_stats: devices.stats,
        mount_events: mounts.events,
        device_events: devices.events,
        notify: reconciler.map(|(n, _)| n),
        publisher,
        csi: driver.clone(),
        volumes: identities,
        reprobed: Default::default(),
        // The first relink builds the volumes' records.
        dirty: driver.is_some(),
    };
    Ok(Started { events, ready: t.ready, summary })
}

/// What the publisher reads: this node's name and store, and the parts
/// started before it.
fn publish_inputs<'a>(
    config: &'a AgentConfig,
    driver: &Option<Arc<volring_csi::Driver>>,
    view: &Option<Arc<volring_volumes::HealthView>>,
    inventory: &'a Inventory,
    stats: Option<Arc<volring_kube::Stats>>,
    identities: &Option<volumes::Identities>,
) -> publisher::Inputs<'a> {
    publisher::Inputs {
        state_dir: &config.state_dir,
        node: &config.devices.node_name,
        driver: driver.clone(),
        view: view.clone(),
        inventory,
        stats: stats.unwrap_or_default(),
        names: identities.as_ref().map(|i| i.names.clone()),
    }
}

/// Takes what only one agent may have (the CSI socket, the metrics
/// address, the NBD listeners), then opens the CSI driver and runs the nbd
/// healer's start walk.
async fn take(config: &AgentConfig, parts: &mut Components) -> anyhow::Result<Taken> {
    let csi_socket = match &config.csi {
        Some(c) => {
            Some(volring_csi::server::bind(&c.endpoint).with_context(|| format!("cannot bind CSI socket {}", c.endpoint.display()))?)
        }
        None => None,
    };
    let metrics = match config.metrics {
        Some(addr) => Some(tokio::net::TcpListener::bind(addr).await.with_context(|| format!("cannot bind the metrics address {addr}"))?),
        None => None,
    };
    let nbd = start_nbd(config, parts).await?;
    let export_listener = start_export_listener(config).await?;
    // The nbd healer next (after the listeners, so an agent that cannot
    // have them exits before it touches a device), before anything the
    // walk does not need (the mount watcher, the device scan, the stat
    // collector, the CSI server, the reconciler): while the agent is away
    // the kernel queues the volumes' I/O, so every step taken before their
    // devices get fresh sockets is time the applications wait. The walk
    // needs only the store and the driver's own NBD server; the mount table
    // is filled in next, before the CSI server and the reconciler (the
    // first to read it) start.
    let table = Arc::new(RwLock::new(MountTable::default()));
    let ready = volring_csi::Readiness::default();
    let driver = match &config.csi {
        Some(c) => Some(csi::heal_first(c.clone(), table.clone(), ready.clone(), parts).await?),
        None => None,
    };
    Ok(Taken { csi_socket, metrics, nbd, export_listener, table, ready, driver })
}

/// The agent's NBD server and its exports at start; its addresses (for the
/// ready line) and exports (for `/metrics`).
async fn start_nbd(config: &AgentConfig, parts: &mut Components) -> anyhow::Result<Option<(String, Arc<volring_nbd::Exports>)>> {
    let Some(c) = &config.nbd else { return Ok(None) };
    // A server with no address would serve only sockets handed to it
    // (`volring nbd serve`'s inetd mode), never the agent's exports.
    anyhow::ensure!(!c.server.listen.is_empty(), "the NBD server needs at least one address to listen on");
    // The NBD error's text already carries its cause.
    // Off the runtime: a bind may wait for a killed agent's port.
    let server_config = c.server.clone();
    let server =
        tokio::task::spawn_blocking(move || volring_nbd::NbdServer::start(server_config, Arc::new(volring_nbd::Exports::default())))
            .await?
            .map_err(|e| anyhow::anyhow!("cannot start the NBD server: {e}"))?;
    let server = OffRuntime::new(server);
    for spec in &c.exports {
        server.add_export(spec).with_context(|| format!("NBD export {}", spec.name))?;
    }
    let out = (server.addresses().join(","), server.exports().clone());
    parts.started_blocking("NBD server", RING_WAIT, move || {
        server.into_inner().stop();
        Ok(())
    });
    Ok(Some(out))
}

/// The listener serving this node's nbd volumes to other nodes (the CSI
/// driver takes it over when its server starts).
async fn start_export_listener(config: &AgentConfig) -> anyhow::Result<Option<OffRuntime<volring_csi::nbd_export::ExportListener>>> {
    let Some(e) = config.csi.as_ref().and_then(|c| c.nbd_export.clone()) else { return Ok(None) };
    let listen = e.listen;
    let l = tokio::task::spawn_blocking(move || volring_csi::nbd_export::ExportListener::start(e))
        .await?
        .map_err(|e| anyhow::anyhow!("cannot start the nbd export listener on {listen}: {e}"))?;
    Ok(Some(OffRuntime::new(l)))
}

/// The mount watcher, its events and its counters (refreshed by the loop).
struct Mounts {
    watcher: Arc<MountWatcher>,
    events: Receiver<WatchEvent>,
    stats: Arc<ArcSwap<WatcherStats>>,
}

/// Starts the mount watcher (on the blocking pool: the start waits for its
/// ring thread) and fills the shared mount table. Its stop leaves its last
/// counters for the "stopped" line.
async fn watch_mounts(config: &AgentConfig, table: &RwLock<MountTable>, parts: &mut Components) -> anyhow::Result<Mounts> {
    let c = config.mounts.clone();
    let (watcher, initial, events) = tokio::task::spawn_blocking(move || MountWatcher::start(c)).await??;
    let watcher = Arc::new(watcher);
    let stats = Arc::new(ArcSwap::from_pointee(watcher.stats()));
    let (w, last) = (watcher.clone(), stats.clone());
    parts.started_blocking("mount watcher", RING_WAIT, move || {
        // The loop that shared it is over.
        let w = Arc::into_inner(w).context("the mount watcher is still in use at stop")?;
        last.store(Arc::new(w.stop()?));
        Ok(())
    });
    tracing::info!(target: TARGET, mounts = initial.len(), mode = ?watcher.stats().mode, backend = ?watcher.stats().backend, "watching the mount table");
    *table.write().unwrap_or_else(|e| e.into_inner()) = initial;
    Ok(Mounts { watcher, events, stats })
}

/// The devices' side: the hot-plug listener, the first inventory, the
/// stat collector, and what `/metrics` reads of them.
struct Devices {
    events: Receiver<DeviceEvent>,
    inventory: Inventory,
    collector: Arc<StatCollector>,
    stats: StatsReader,
    hotplug: Arc<HotplugStats>,
    rings: Vec<(&'static str, Arc<RingStats>)>,
}

/// Listens before scanning, so nothing plugged in between is missed (an
/// event for a device the scan already has is just a change); then the
/// collector starts on the scanned devices.
async fn watch_devices(config: &AgentConfig, table: &RwLock<MountTable>, parts: &mut Components) -> anyhow::Result<Devices> {
    let c = config.devices.clone();
    let hotplug_stats = Arc::new(HotplugStats::default());
    let counting = hotplug_stats.clone();
    let (hotplug, events) = tokio::task::spawn_blocking(move || DeviceWatcher::start(c, 4096, counting)).await??;
    let hotplug_ring = hotplug.ring_stats().clone();
    parts.started_blocking("hot-plug listener", RING_WAIT, move || Ok(hotplug.stop()?));
    let inventory = events::scan(&config.devices, table).await??;
    tracing::info!(target: TARGET, devices = inventory.devices.len(), "block device inventory");
    let (c, devices) = (config.stats.clone(), events::tracked(&inventory));
    let (collector, stats) = tokio::task::spawn_blocking(move || StatCollector::start(c, devices)).await??;
    let collector = Arc::new(collector);
    let c = collector.clone();
    parts.started_blocking("stat collector", RING_WAIT, move || {
        Ok(Arc::into_inner(c).context("the stat collector is still in use at stop")?.stop()?)
    });
    let rings = vec![("stats", collector.ring_stats().clone()), ("hotplug", hotplug_ring)];
    Ok(Devices { events, inventory, collector, stats, hotplug: hotplug_stats, rings })
}

/// Starts the reconciler (on the blocking pool: its first pass looks at
/// every volume); its stop lets a repair it is inside of finish.
async fn reconcile(
    driver: &Arc<volring_csi::Driver>,
    config: &AgentConfig,
    parts: &mut Components,
) -> anyhow::Result<(Notifier, crate::metrics::Reconcile)> {
    let (d, rc) = (driver.clone(), config.reconcile.clone());
    let r = tokio::task::spawn_blocking(move || d.start_reconciler(rc)).await??;
    tracing::info!(
        target: TARGET,
        volumes = r.view().all().len(),
        repairs = r.stats().repairs_done.load(std::sync::atomic::Ordering::Relaxed),
        "volumes reconciled"
    );
    let out = (r.notifier(), crate::metrics::Reconcile { stats: r.stats().clone(), view: r.view().clone() });
    parts.started_blocking("reconciler", RECONCILER_WAIT, move || {
        r.stop();
        Ok(())
    });
    Ok(out)
}

/// In a cluster (the same choice the publisher makes: --kube, else a
/// kubeconfig or the pod's service account): NodeStage reads the endpoints
/// published on PVCs, and a node serving NFS keeps a Service and EndpointSlice
/// per export. Its stop empties the EndpointSlices of this node's exports
/// first (the NFS server stops with the agent), and ends the retry of
/// announcements to take off (kept in the store for the next start).
async fn share_loop(
    config: &AgentConfig,
    driver: Option<&Arc<volring_csi::Driver>>,
    parts: &mut Components,
) -> anyhow::Result<Option<Arc<volring_share::kube::ShareController>>> {
    let cluster = config.publish.as_ref().and_then(|p| p.kube).unwrap_or_else(|| volring_kube::kube_sink::KubeSink::detect().is_some());
    let Some(d) = driver.filter(|_| cluster) else { return Ok(None) };
    let running =
        volring_share::follow::in_cluster(d, &config.devices.node_name, config.nfs_client_address, config.share_kube.clone()).await?;
    let controller = running.controller.clone();
    parts.started("shared-volume loop", SHARE_WAIT, move || async move {
        running.stop(SHARE_EMPTY).await;
        Ok(())
    });
    Ok(controller)
}

/// Serves `/metrics`, `/healthz` and `/readyz`; returns the URL.
fn serve_metrics(listener: tokio::net::TcpListener, sources: crate::metrics::Sources, parts: &mut Components) -> String {
    let url = listener.local_addr().map_or_else(|_| "off".to_string(), |a| format!("http://{a}/metrics"));
    let server = parts.serve("metrics", move |_| crate::metrics::serve(listener, sources));
    parts.started("metrics server", SERVER_WAIT, move || async move {
        server.abort().await;
        Ok(())
    });
    url
}
