//! The agent's event loop: it owns the device inventory, applies the mount
//! watcher's and the hot-plug listener's events to the mount table and the
//! inventory, joins the two (which device is mounted where) at most every
//! 250 ms, tells the collector which devices to sample, publishes the
//! inventory for `/metrics` and the publisher, and wakes the reconciler
//! for what an event touched.

use std::collections::HashSet;
use std::path::PathBuf;
use std::sync::{Arc, RwLock};
use std::time::Duration;

use arc_swap::ArcSwap;
use tokio::task::JoinHandle;

use volring_devices::{DeviceEvent, Inventory, ScanConfig, StatCollector, StatsReader};
use volring_mounts::{MountTable, MountWatcher, WatchEvent, WatcherStats};
use volring_ring::queue::Receiver;
use volring_volumes::{Changed, Notifier};

use super::component::Stopping;
use super::publisher::Feeding;
use super::volumes::Identities;
use super::TARGET;

/// A full device scan, running on the blocking pool.
type Scan = JoinHandle<Result<Inventory, volring_devices::Error>>;
/// Devices probed again (the volumes' they were probed for, and what the
/// probes found), on the blocking pool.
type Reprobe = JoinHandle<Reprobed>;
/// (volume, device) pairs asked for, and the devices as probed again.
type Reprobed = (Vec<(String, volring_mounts::DevNum)>, Vec<volring_devices::Device>);

/// What the loop owns and reaches; made by the start (`start.rs`).
pub(super) struct Events {
    pub devices: ScanConfig,
    pub log_events: bool,
    pub table: Arc<RwLock<MountTable>>,
    pub inventory: Inventory,
    /// The inventory as last joined, for `/metrics`.
    pub published: Arc<ArcSwap<Inventory>>,
    pub mount_stats: Arc<ArcSwap<WatcherStats>>,
    /// Shared with its component, which stops it once the loop is over.
    pub watcher: Arc<MountWatcher>,
    pub collector: Arc<StatCollector>,
    /// The collector's latest sample (for the status line).
    pub device_stats: StatsReader,
    pub mount_events: Receiver<WatchEvent>,
    pub device_events: Receiver<DeviceEvent>,
    /// The reconciler, when the CSI driver runs.
    pub notify: Option<Notifier>,
    pub publisher: Option<Feeding>,
    /// The CSI driver, when it runs: its staged volumes mark their devices
    /// (`volring_device_info{csi_volume}`, the BlockDevice's use).
    pub csi: Option<Arc<volring_csi::Driver>>,
    /// The staged volumes' identity records (with the CSI driver).
    pub volumes: Option<Identities>,
    /// (volume, device) pairs whose device was probed again once its
    /// volume was staged: the device was probed when it was attached,
    /// before the stage formatted it, and no uevent tells of a mkfs.
    pub reprobed: HashSet<(String, volring_mounts::DevNum)>,
    /// Mount or device changes wait for the next join.
    pub dirty: bool,
}

impl Events {
    /// Runs until a stop is asked (`Ok`) or a ring thread's queue closes.
    /// On the way out the publisher is handed the last inventory (its
    /// component writes it before stopping).
    pub(crate) async fn run(mut self, stopping: &Stopping) -> anyhow::Result<()> {
        let mut report = tokio::time::interval(Duration::from_secs(60));
        let mut relink = tokio::time::interval(Duration::from_millis(250));
        report.tick().await;
        // A full rescan runs on the blocking pool; device events wait in
        // their queue meanwhile, so they apply after it, in order.
        let mut rescan: Option<Scan> = None;
        let mut reprobe: Option<Reprobe> = None;
        let result = loop {
            tokio::select! {
                ev = self.mount_events.recv() => match ev {
                    Some(ev) => self.mounts(&ev),
                    None => break Err(anyhow::anyhow!("mount watcher stopped")),
                },
                ev = self.device_events.recv(), if rescan.is_none() => match ev {
                    Some(DeviceEvent::Rescan { reason }) => {
                        tracing::warn!(target: TARGET, reason, "device events lost; rescanning");
                        rescan = Some(scan(&self.devices, &self.table));
                    }
                    Some(ev) => self.device(ev),
                    None => break Err(anyhow::anyhow!("hot-plug listener stopped")),
                },
                done = finished(&mut rescan) => {
                    rescan = None;
                    self.rescanned(done);
                }
                done = finished(&mut reprobe) => {
                    reprobe = None;
                    self.reprobed(done);
                }
                _ = woken(self.volumes.as_ref()) => self.dirty = true,
                // A burst of thousands of events is joined, published and
                // handed to the collector once, not once per event.
                _ = relink.tick(), if self.dirty => {
                    let again = self.relink();
                    if reprobe.is_none() && !again.is_empty() {
                        reprobe = Some(self.reprobe(again));
                    }
                }
                _ = report.tick() => self.report(),
                _ = stopping.asked() => break Ok(()),
            }
        };
        if let Some(p) = &mut self.publisher {
            p.feed.devices(&p.up, &self.inventory, &self.devices.node_name, None);
        }
        result
    }

    fn mounts(&mut self, ev: &WatchEvent) {
        self.dirty |= apply_mounts(&mut self.table.write().unwrap_or_else(|e| e.into_inner()), ev, self.log_events);
        if let Some(n) = &self.notify {
            n.tell(Changed::Paths(changed_paths(ev)));
        }
    }

    fn device(&mut self, ev: DeviceEvent) {
        if let (Some(n), Some(name)) = (&self.notify, device_name(&ev)) {
            n.tell(Changed::Device(name.to_string()));
        }
        apply_device(&mut self.inventory, ev, self.log_events);
        self.dirty = true;
    }

    fn rescanned(&mut self, done: Result<Result<Inventory, volring_devices::Error>, tokio::task::JoinError>) {
        match done {
            Ok(Ok(fresh)) => self.inventory = fresh,
            Ok(Err(e)) => tracing::error!(target: TARGET, error = %e, "device rescan failed"),
            Err(e) => tracing::error!(target: TARGET, error = %e, "device rescan did not finish"),
        }
        self.dirty = true;
    }

    /// Joins, publishes and hands over; answers the volumes' devices to
    /// probe again (see `reprobed`).
    fn relink(&mut self) -> Vec<(String, volring_mounts::DevNum)> {
        self.dirty = false;
        let before: Vec<_> = self.published.load().devices.keys().copied().collect();
        self.inventory.link(&read(&self.table), &self.devices);
        let mut again = Vec::new();
        let mut volumes = None;
        if let Some(driver) = &self.csi {
            let staged = driver.staged();
            mark_staged(&mut self.inventory, &staged);
            if let Some(v) = &self.volumes {
                let ids = v.rebuild(&staged);
                self.reprobed.retain(|(id, _)| ids.iter().any(|i| &i.volume_id == id));
                again = unprobed(&self.inventory, &ids, &self.reprobed);
                volumes = Some(ids);
            }
        }
        if !self.inventory.devices.keys().copied().eq(before) && !self.collector.track(tracked(&self.inventory)) {
            tracing::warn!(target: TARGET, "stat collector busy; the device set is passed with the next change");
        }
        self.published.store(Arc::new(self.inventory.clone()));
        self.mount_stats.store(Arc::new(self.watcher.stats()));
        if let Some(p) = &mut self.publisher {
            p.feed.devices(&p.up, &self.inventory, &self.devices.node_name, volumes.as_deref().map(Vec::as_slice));
            // The pool's figures ride along with device changes.
            p.node_signal.signal();
        }
        again
    }

    /// Probes `devices` again on the blocking pool.
    fn reprobe(&self, devices: Vec<(String, volring_mounts::DevNum)>) -> Reprobe {
        let cfg = self.devices.clone();
        let names: Vec<String> = devices.iter().filter_map(|(_, dev)| self.inventory.devices.get(dev).map(|d| d.name.clone())).collect();
        tokio::task::spawn_blocking(move || {
            let found = names.iter().filter_map(|n| volring_devices::describe(&cfg, n).ok().flatten()).collect();
            (devices, found)
        })
    }

    fn reprobed(&mut self, done: Result<Reprobed, tokio::task::JoinError>) {
        let Ok((asked, found)) = done else { return };
        for d in found {
            if self.log_events {
                tracing::info!(target: TARGET, device = %d.name, fstype = d.fstype(), "device probed again for its volume");
            }
            // What a probe finds again is a change to the device.
            self.inventory.apply(DeviceEvent::Changed { device: Box::new(d), seqnum: None });
        }
        self.reprobed.extend(asked);
        self.dirty = true;
    }

    fn report(&self) {
        let s = self.watcher.stats();
        let snap = self.device_stats.latest();
        tracing::info!(target: TARGET, mounts = read(&self.table).len(), events = s.mount_events, resyncs = s.resyncs,
            cpu_ms = s.cpu.as_millis() as u64, devices = self.inventory.devices.len(), stat_method = snap.method,
            stat_cost_us = snap.cost.as_micros() as u64, "status");
        self.mount_stats.store(Arc::new(s));
    }
}

/// Scans the devices on the blocking pool (a full scan reads sysfs and the
/// first blocks of every device), against a copy of the mount table.
pub(super) fn scan(cfg: &ScanConfig, table: &RwLock<MountTable>) -> Scan {
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

pub(super) fn read(t: &RwLock<MountTable>) -> std::sync::RwLockReadGuard<'_, MountTable> {
    t.read().unwrap_or_else(|e| e.into_inner())
}

/// The devices the collector samples.
pub(super) fn tracked(inv: &Inventory) -> Vec<(volring_mounts::DevNum, Arc<str>)> {
    inv.devices.values().map(|d| (d.dev, Arc::from(d.name.as_str()))).collect()
}

/// Applies mount events; true when one touched a block device.
fn apply_mounts(table: &mut MountTable, ev: &WatchEvent, log: bool) -> bool {
    if let WatchEvent::Resync { reason, changes, .. } = ev {
        tracing::warn!(target: TARGET, ?reason, changes = changes.len(), "mount table resync");
    }
    let mut devices = false;
    for e in ev.changes() {
        table.apply(e);
        devices |= !e.devices.is_empty();
        if log {
            let target = e.subject().map(|m| m.mount_point_path().display().to_string());
            let devices: Vec<_> = e.devices.iter().filter_map(|d| d.path.clone()).collect();
            tracing::info!(target: TARGET, kind = ?e.kind, id = e.id, target, ?devices, "mount");
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
    match &ev {
        DeviceEvent::Added { device, .. } | DeviceEvent::Changed { device, .. } if log => {
            tracing::info!(target: TARGET, device = %device.name, dev = %device.dev, fstype = device.fstype(), "device");
        }
        DeviceEvent::Removed { name, .. } if log => tracing::info!(target: TARGET, device = %name, "device removed"),
        // The loop runs rescans itself, off the runtime; none comes here.
        _ => {}
    }
    inv.apply(ev);
}

/// Waits until the volumes' records changed; never, with no CSI driver.
async fn woken(v: Option<&Identities>) {
    match v {
        Some(v) => v.changed.notified().await,
        None => std::future::pending().await,
    }
}

/// The devices of filesystem volumes that are mounted and show no
/// filesystem, not yet probed again for that volume.
fn unprobed(
    inv: &Inventory,
    ids: &[volring_volumes::VolumeIdentity],
    done: &HashSet<(String, volring_mounts::DevNum)>,
) -> Vec<(String, volring_mounts::DevNum)> {
    ids.iter()
        .filter(|i| !i.block)
        .filter_map(|i| {
            let d = inv.by_name(i.device.as_deref()?)?;
            let key = (i.volume_id.clone(), d.dev);
            (d.fstype().is_none() && !d.mountpoints.is_empty() && !done.contains(&key)).then_some(key)
        })
        .collect()
}

/// Marks each staged volume's device with its volume id, and unmarks a
/// device whose volume is no longer staged (staging mounts and unmounts
/// are mount events, so a relink follows each stage and unstage).
fn mark_staged(inventory: &mut Inventory, staged: &[volring_volumes::StagedVolume]) {
    for d in inventory.devices.values_mut() {
        d.uses.retain(|u| !matches!(u, volring_devices::Use::Volume(_)));
    }
    for v in staged {
        let name = match v.attach {
            volring_volumes::AttachKind::Loop => v.loop_number.map(|n| format!("loop{n}")),
            volring_volumes::AttachKind::Nbd => v.nbd_index.map(|n| format!("nbd{n}")),
        };
        if let Some(dev) = name.and_then(|n| inventory.by_name(&n)).map(|d| d.dev) {
            inventory.mark_volume(dev, &v.volume_id);
        }
    }
}
