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
use std::sync::{Arc, RwLock};
use std::time::Duration;

use arc_swap::ArcSwap;

use crate::devices::{CollectorConfig, DeviceEvent, DeviceWatcher, Inventory, ScanConfig, StatCollector};
use crate::mounts::{MountTable, MountWatcher, WatchConfig, WatchEvent};

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
    /// The CSI driver's settings; `None`: no CSI socket.
    pub csi: Option<crate::csi::CsiConfig>,
    /// The NBD server's settings; `None`: no NBD server.
    pub nbd: Option<NbdConfig>,
}

/// The node's NBD server: where it listens and what it exports at start.
#[derive(Debug, Clone)]
pub struct NbdConfig {
    pub server: crate::nbd::ServerConfig,
    pub exports: Vec<crate::nbd::ExportSpec>,
}

impl Default for AgentConfig {
    fn default() -> Self {
        Self {
            mounts: WatchConfig::default(),
            devices: ScanConfig::default(),
            stats: CollectorConfig::default(),
            metrics: Some(SocketAddr::from(([127, 0, 0, 1], 9477))),
            log_events: false,
            csi: None,
            nbd: None,
        }
    }
}

/// Runs the agent until SIGINT or SIGTERM.
pub async fn run(config: AgentConfig) -> anyhow::Result<()> {
    let (watcher, table, mount_events) = MountWatcher::start(config.mounts.clone())?;
    tracing::info!(mounts = table.len(), mode = ?watcher.mode(), backend = ?watcher.stats().backend, "watching the mount table");
    let table = Arc::new(RwLock::new(table));
    let ready = crate::csi::Readiness::default();
    let (csi_stop, csi_stopped) = tokio::sync::oneshot::channel::<()>();
    let csi = match &config.csi {
        Some(c) => {
            let driver = crate::csi::Driver::new(c.clone(), table.clone(), ready.clone())?;
            let server = tokio::spawn(crate::csi::server::serve(driver.clone(), async {
                let _ = csi_stopped.await;
            }));
            Some((driver, server))
        }
        None => None,
    };

    let nbd = match &config.nbd {
        Some(c) => {
            let server = crate::nbd::NbdServer::start(c.server.clone(), Arc::new(crate::nbd::Exports::new()))?;
            for spec in &c.exports {
                server.add_export(spec)?;
            }
            Some(server)
        }
        None => None,
    };

    // Listen before scanning, so nothing plugged in between is missed (an
    // event for a device the scan already has is just a change).
    let (hotplug, device_events) = DeviceWatcher::start(config.devices.clone(), 4096)?;
    let mut inventory = Inventory::scan(&config.devices, &read(&table))?;
    tracing::info!(devices = inventory.len(), "block device inventory");
    let collector = StatCollector::start(config.stats.clone(), tracked(&inventory))?;
    let published = Arc::new(ArcSwap::from_pointee(inventory.clone()));
    let mount_stats = Arc::new(ArcSwap::from_pointee(watcher.stats()));

    let sources = crate::metrics::Sources {
        stats: collector.reader(),
        inventory: published.clone(),
        hotplug: hotplug.stats().clone(),
        rings: vec![("stats", collector.ring_stats().clone()), ("hotplug", hotplug.ring_stats().clone())],
        mounts: mount_stats.clone(),
        nbd: nbd.as_ref().map(|s| s.exports().clone()),
    };
    let server = config.metrics.map(|addr| tokio::spawn(crate::metrics::serve(addr, sources)));
    ready.set(true);

    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    let mut report = tokio::time::interval(Duration::from_secs(60));
    let mut relink = tokio::time::interval(Duration::from_millis(250));
    report.tick().await;
    // Mount and device changes are joined in at most every 250 ms.
    let mut dirty = false;
    loop {
        tokio::select! {
            ev = mount_events.recv() => match ev {
                Some(ev) => dirty |= apply_mounts(&mut table.write().unwrap_or_else(|e| e.into_inner()), &ev, config.log_events),
                None => anyhow::bail!("mount watcher stopped"),
            },
            ev = device_events.recv() => match ev {
                Some(ev) => {
                    apply_device(&mut inventory, ev, &read(&table), &config);
                    dirty = true;
                }
                None => anyhow::bail!("hot-plug listener stopped"),
            },
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
            }
            _ = report.tick() => {
                let s = watcher.stats();
                let snap = collector.reader().latest();
                tracing::info!(mounts = read(&table).len(), events = s.mount_events, resyncs = s.resyncs, cpu_ms = s.cpu.as_millis() as u64,
                    devices = inventory.len(), stat_method = snap.method, stat_cost_us = snap.cost.as_micros() as u64, "status");
                mount_stats.store(Arc::new(s));
            }
            _ = tokio::signal::ctrl_c() => break,
            _ = term.recv() => break,
        }
    }
    ready.set(false);
    if let Some(s) = server {
        s.abort();
    }
    if let Some((driver, server)) = csi {
        stop_csi(&driver, server, csi_stop).await;
    }
    if let Some(server) = nbd {
        server.stop();
    }
    collector.stop()?;
    hotplug.stop()?;
    let stats = watcher.stop()?;
    tracing::info!(events = stats.mount_events, resyncs = stats.resyncs, cpu_ms = stats.cpu.as_millis() as u64, "stopped");
    Ok(())
}

/// Stops accepting CSI calls, lets the running ones finish (kubelet keeps
/// its connection open forever, so idle connections are not waited for),
/// then drops the server and its socket.
async fn stop_csi(
    driver: &crate::csi::Driver,
    server: tokio::task::JoinHandle<std::io::Result<()>>,
    stop: tokio::sync::oneshot::Sender<()>,
) {
    let _ = stop.send(());
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
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
    let _ = std::fs::remove_file(&driver.config().endpoint);
}

fn read(t: &RwLock<MountTable>) -> std::sync::RwLockReadGuard<'_, MountTable> {
    t.read().unwrap_or_else(|e| e.into_inner())
}

/// The devices the collector samples.
fn tracked(inv: &Inventory) -> Vec<(crate::mounts::DevNum, Arc<str>)> {
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

/// Applies a device event; joining with the mount table and the filter
/// happen on the next relink.
fn apply_device(inv: &mut Inventory, ev: DeviceEvent, table: &MountTable, cfg: &AgentConfig) {
    match ev {
        DeviceEvent::Added { device, .. } | DeviceEvent::Changed { device, .. } => {
            if cfg.log_events {
                tracing::info!(device = %device.name, dev = %device.dev, fstype = device.fstype(), "device");
            }
            inv.insert(*device);
        }
        DeviceEvent::Removed { name, .. } => {
            if cfg.log_events {
                tracing::info!(device = %name, "device removed");
            }
            inv.remove_named(&name);
        }
        DeviceEvent::Rescan { reason } => {
            tracing::warn!(reason, "device events lost; rescanning");
            match Inventory::scan(&cfg.devices, table) {
                Ok(fresh) => *inv = fresh,
                Err(e) => tracing::error!(error = %e, "device rescan failed"),
            }
        }
    }
}
