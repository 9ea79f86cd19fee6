//! The inventory: every block device, probed, with its users.
//!
//! Built in three steps that keep I/O at the edges: read sysfs
//! ([`super::sysfs`]), probe the first blocks of every device in one ring
//! batch ([`super::probe`]), then join with the mount table (pure).

use std::collections::{BTreeMap, BTreeSet};
use std::os::fd::AsFd;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::Serialize;

use super::device::{id_unread, stable_id, Device, DeviceEvent, Use};
use super::filter::DeviceFilter;
use super::probe::{probe_sample, read_plan, Sample};
use super::{sysfs, Error};
use volring_mounts::{DevNum, MountTable};
use volring_ring::BackendChoice;
use volring_ring::{BatchRead, BatchReader, ReadBatch};

/// Where the inventory looks, and what it keeps.
#[derive(Debug, Clone)]
pub struct ScanConfig {
    /// `/sys`.
    pub sys: PathBuf,
    /// `/dev` (for `disk/by-id` links).
    pub dev: PathBuf,
    /// `/run` (for the udev database).
    pub run: PathBuf,
    /// Part of each device's stable id where only the node makes it unique.
    pub node_name: String,
    pub filter: DeviceFilter,
    /// Read each device's first blocks for signatures.
    pub probe: bool,
    /// How long a probe may wait on a device before it is reported as hung.
    pub probe_timeout: Duration,
    pub io: BackendChoice,
}

impl Default for ScanConfig {
    fn default() -> Self {
        Self {
            sys: "/sys".into(),
            dev: "/dev".into(),
            run: "/run".into(),
            node_name: node_name(),
            filter: DeviceFilter::default(),
            probe: true,
            probe_timeout: Duration::from_secs(5),
            io: BackendChoice::Auto,
        }
    }
}

/// This machine's name: `$NODE_NAME` (set from the downward API in a pod),
/// else the kernel's hostname.
pub fn node_name() -> String {
    std::env::var("NODE_NAME")
        .ok()
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| rustix::system::uname().nodename().to_string_lossy().into_owned())
}

/// Every known device, by device number.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Inventory {
    pub devices: BTreeMap<DevNum, Device>,
    /// Devices that could not be read during the scan, with the reason.
    pub errors: Vec<(String, String)>,
}

impl Inventory {
    /// A full scan: sysfs, probes, mount table.
    pub fn scan(cfg: &ScanConfig, mounts: &MountTable) -> Result<Self, Error> {
        let mut inv = Inventory::default();
        let mut found = Vec::new();
        for name in sysfs::list(&cfg.sys)? {
            match sysfs::read(&cfg.sys, &name) {
                Ok(d) => found.push(d),
                // Gone between the listing and the read: not an error.
                Err(Error::Vanished(_)) => {}
                Err(e) => inv.errors.push((name, e.to_string())),
            }
        }
        enrich(cfg, &mut found);
        for d in found {
            if d.size_bytes == 0 && !cfg.filter.include_empty {
                continue;
            }
            inv.devices.insert(d.dev, d);
        }
        inv.link(mounts, cfg);
        Ok(inv)
    }

    /// Applies a change to the set of devices: an added or changed device
    /// (as [`describe`] reads it) replaces one of the same name, a removed
    /// one goes. Mount points, uses, the id and the filter are applied by
    /// the next [`Inventory::link`]. A `Rescan` changes nothing here: it
    /// asks the caller for a new [`Inventory::scan`].
    pub fn apply(&mut self, event: DeviceEvent) {
        match event {
            DeviceEvent::Added { device, .. } | DeviceEvent::Changed { device, .. } => {
                self.devices.retain(|_, d| d.name != device.name);
                self.devices.insert(device.dev, *device);
            }
            DeviceEvent::Removed { name, .. } => self.devices.retain(|_, d| d.name != name),
            DeviceEvent::Rescan { .. } => {}
        }
    }

    pub fn by_name(&self, name: &str) -> Option<&Device> {
        self.devices.values().find(|d| d.name == name)
    }

    /// Joins devices with the mount table and with each other: mount
    /// points, holders, the OS disk, partition GUIDs from the parent's
    /// table, and the stable id (unique on `cfg.node_name`); then keeps what
    /// `cfg.filter` admits, which may rest on the join (the OS disk). Pure.
    pub fn link(&mut self, mounts: &MountTable, cfg: &ScanConfig) {
        self.join(mounts, &cfg.node_name);
        self.devices.retain(|_, d| cfg.filter.admits(d));
    }

    fn join(&mut self, mounts: &MountTable, node: &str) {
        let mut points: BTreeMap<DevNum, BTreeSet<PathBuf>> = BTreeMap::new();
        for m in mounts.iter() {
            let point = m.mount_point_path().to_path_buf();
            if m.dev.major != 0 {
                points.entry(m.dev).or_default().insert(point);
            } else {
                // btrfs and friends hide the device behind an anonymous one.
                for b in volring_mounts::devices_of(m) {
                    points.entry(b.dev).or_default().insert(point.clone());
                }
            }
        }
        let root_dev = mounts.top_at(b"/").map(|m| m.dev).filter(|d| d.major != 0);
        let by_name: BTreeMap<String, DevNum> = self.devices.values().map(|d| (d.name.clone(), d.dev)).collect();
        // The OS disk: the root device, the disk it is a partition of, and
        // everything below it (dm over partitions, md members).
        let mut os = BTreeSet::new();
        let mut todo: Vec<DevNum> = root_dev.into_iter().collect();
        while let Some(dev) = todo.pop() {
            if !os.insert(dev) {
                continue;
            }
            if let Some(d) = self.devices.get(&dev) {
                let below = d.slaves.iter().chain(d.partition.as_ref().map(|(_, p)| p));
                todo.extend(below.filter_map(|n| by_name.get(n).copied()));
            }
        }
        let part_uuids: BTreeMap<(String, u32), String> = self
            .devices
            .values()
            .filter_map(|d| Some((d.name.clone(), d.content.table.as_ref()?)))
            .flat_map(|(disk, t)| t.partitions.iter().filter_map(move |p| Some(((disk.clone(), p.number), p.uuid.clone()?))))
            .collect();
        for d in self.devices.values_mut() {
            d.mountpoints = points.get(&d.dev).map(|s| s.iter().cloned().collect()).unwrap_or_default();
            d.uses.retain(|u| matches!(u, Use::Volume(_)));
            if !d.mountpoints.is_empty() {
                d.uses.push(Use::Mounted(d.mountpoints.clone()));
            }
            if !d.holders.is_empty() {
                d.uses.push(Use::Held(d.holders.clone()));
            }
            d.os_disk = os.contains(&d.dev);
            d.part_uuid = d.partition.as_ref().and_then(|(n, disk)| part_uuids.get(&(disk.clone(), *n)).cloned());
        }
        // Ids in a second pass: a partition's depends on what was read of its disk.
        let ids: Vec<(DevNum, String)> = self
            .devices
            .values()
            .map(|d| {
                let disk = d.partition.as_ref().and_then(|(_, p)| by_name.get(p)).and_then(|dev| self.devices.get(dev));
                (d.dev, if id_unread(d, disk).is_some() { String::new() } else { stable_id(d, node) })
            })
            .collect();
        for (dev, id) in ids {
            if let Some(d) = self.devices.get_mut(&dev) {
                d.id = id;
            }
        }
    }

    /// Why `d`'s stable id is unknown (its `id` is empty), if an input the
    /// id would rest on could not be read; the CLI says it beside the table.
    pub fn id_unknown(&self, d: &Device) -> Option<String> {
        let disk = d.partition.as_ref().and_then(|(_, p)| self.by_name(p));
        id_unread(d, disk)
    }

    /// Marks `dev` as used by a volume volring serves (CSI, NBD).
    pub fn mark_volume(&mut self, dev: DevNum, volume: &str) {
        if let Some(d) = self.devices.get_mut(&dev) {
            d.uses.retain(|u| !matches!(u, Use::Volume(v) if v == volume));
            d.uses.push(Use::Volume(volume.to_string()));
        }
    }
}

/// Reads one device from sysfs and probes it: what a uevent calls for.
/// `Ok(None)` when the device is gone.
pub fn describe(cfg: &ScanConfig, name: &str) -> Result<Option<Device>, Error> {
    let d = match sysfs::read(&cfg.sys, name) {
        Ok(d) => d,
        Err(Error::Vanished(_)) => return Ok(None),
        Err(e) => return Err(e),
    };
    let mut one = [d];
    enrich(cfg, &mut one);
    let [d] = one;
    Ok(Some(d))
}

/// Links, udev entry and signature probe for freshly read devices.
fn enrich(cfg: &ScanConfig, devices: &mut [Device]) {
    let links = sysfs::disk_links(&cfg.dev);
    // Without udev (many containers) there is no entry to look for.
    let udev_runs = cfg.run.join("udev/data").is_dir();
    for d in devices.iter_mut() {
        let (udev, udev_links) = if udev_runs { sysfs::udev_entry(&cfg.run, d.dev) } else { Default::default() };
        d.udev = udev;
        let mut all: BTreeSet<PathBuf> = udev_links.into_iter().collect();
        all.extend(links.get(&d.name).into_iter().flatten().cloned());
        d.links = all.into_iter().collect();
    }
    if cfg.probe {
        probe_all(devices, cfg.io, cfg.probe_timeout);
    } else {
        // Unread is not empty: without this a device would look free and
        // get a weaker id than a probed scan gives it.
        for d in devices.iter_mut().filter(|d| d.size_bytes > 0) {
            d.probe_error = Some("not read: probing is off".into());
        }
    }
}

/// Reads what [`read_plan`] asks of every device (its head and its tail, at
/// most two reads each) in one ring batch and probes them. A device that cannot be opened or read is reported with
/// the reason; a zero-size one (an unattached loop device) is not read.
pub(crate) fn probe_all(devices: &mut [Device], io: BackendChoice, timeout: Duration) {
    let mut files = Vec::with_capacity(devices.len());
    for d in devices.iter_mut() {
        d.probe_error = None;
        if d.size_bytes == 0 {
            files.push(None);
            continue;
        }
        match open_for_probe(&d.path) {
            Ok(f) => files.push(Some(f)),
            Err(e) => {
                d.probe_error = Some(format!("open {}: {e}", d.path.display()));
                files.push(None);
            }
        }
    }
    let mut reader = match BatchReader::new(io, 64) {
        Ok(r) => r,
        Err(e) => {
            for d in devices.iter_mut() {
                d.probe_error.get_or_insert_with(|| format!("no reader: {e}"));
            }
            return;
        }
    };
    let mut reads: Vec<BatchRead<'_>> = Vec::new();
    let mut owners = Vec::new();
    for (i, f) in files.iter().enumerate() {
        if let Some(f) = f {
            for (offset, len) in read_plan(devices[i].size_bytes) {
                reads.push(BatchRead::new(f.as_fd(), offset, vec![0u8; len]));
                owners.push(i);
            }
        }
    }
    if let Err(e) = reader.read_batch(&mut reads, timeout) {
        for &i in &owners {
            devices[i].probe_error = Some(format!("read: {e}"));
        }
        return;
    }
    let mut at = 0;
    while at < reads.len() {
        let i = owners[at];
        let n = owners[at..].iter().take_while(|&&o| o == i).count();
        let d = &mut devices[i];
        let mut sample = Sample::new(d.size_bytes);
        for r in &reads[at..at + n] {
            match &r.result {
                Ok(_) => sample.add(r.offset, r.data()),
                Err(e) => d.probe_error = Some(format!("read {} at {}: {e}", d.path.display(), r.offset)),
            }
        }
        if d.probe_error.is_none() {
            d.content = probe_sample(&sample, d.logical_block_size);
        }
        at += n;
    }
}

/// Opens read-only and without O_EXCL: the probe must never get in the way
/// of a mount or a holder.
fn open_for_probe(path: &Path) -> std::io::Result<std::fs::File> {
    use std::os::unix::fs::OpenOptionsExt;
    std::fs::OpenOptions::new().read(true).custom_flags(libc::O_CLOEXEC | libc::O_NOCTTY).open(path)
}
