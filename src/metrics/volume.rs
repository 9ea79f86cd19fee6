//! `volring_volume_*`: one set of series per staged volume, labelled with
//! the names kubelet's `kubelet_volume_stats_*` use (`namespace`,
//! `persistentvolumeclaim`) plus `volume`, `device` and `pod`, so the two
//! join in PromQL. The I/O counters are the volume's device's counters
//! (`/sys/block/<dev>/stat`, as the collector last read them): a volume is
//! the only user of its loop or nbd device. Capacity, usage and inodes are
//! the staging mount's statvfs(2) (what kubelet reports), read at scrape
//! time and only while the staging path is that device's mount; a block
//! volume reports its device's size as its capacity.
//!
//! Latency: the kernel keeps only the sum of the time each request took
//! (milliseconds) per direction, not a distribution, so there are no
//! histograms; the mean (`rate(read_time) / rate(reads_completed)`) is what
//! the counters allow, as iostat's r_await. A distribution would need a
//! BPF program on the block layer's tracepoints.
//!
//! Cardinality: one series per family and staged volume (the labels are
//! the volume's, not its pods': a volume published to several pods of the
//! node joins their names in one `pod` label). A volume's series go at its
//! unstage, when its record goes.

use std::collections::HashMap;
use std::fmt::Error as FmtError;
use std::path::Path;

use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::MetricType;

use volring_devices::{Inventory, IoCounters, StatSnapshot};
use volring_volumes::KubeletLabels;
use volring_volumes::VolumeIdentity;

/// A filesystem's figures, as kubelet's volume stats report them.
#[derive(Clone, Copy)]
struct FsStat {
    capacity: u64,
    used: u64,
    available: u64,
    inodes: u64,
    inodes_used: u64,
    inodes_free: u64,
}

/// One volume's row: its labels and figures.
struct Row<'a> {
    id: &'a VolumeIdentity,
    device: &'a str,
    kubelet: KubeletLabels<'a>,
    io: Option<&'a IoCounters>,
    capacity: Option<u64>,
    fs: Option<FsStat>,
}

impl Row<'_> {
    fn labels(&self) -> [(&str, &str); 5] {
        [
            ("volume", self.id.volume_id.as_str()),
            ("device", self.device),
            ("persistentvolumeclaim", self.kubelet.persistentvolumeclaim),
            ("namespace", self.kubelet.namespace),
            ("pod", self.kubelet.pod.as_str()),
        ]
    }
}

fn statvfs(path: &Path) -> Option<FsStat> {
    let s = rustix::fs::statvfs(path).ok()?;
    let f = s.f_frsize;
    Some(FsStat {
        capacity: s.f_blocks.saturating_mul(f),
        used: s.f_blocks.saturating_sub(s.f_bfree).saturating_mul(f),
        available: s.f_bavail.saturating_mul(f),
        inodes: s.f_files,
        inodes_used: s.f_files.saturating_sub(s.f_ffree),
        inodes_free: s.f_ffree,
    })
}

fn rows<'a>(ids: &'a [VolumeIdentity], snap: &'a StatSnapshot, inv: &'a Inventory) -> Vec<Row<'a>> {
    let io: HashMap<&str, &IoCounters> = snap.devices.iter().map(|d| (&*d.name, &d.counters)).collect();
    ids.iter()
        .filter_map(|id| {
            let device = id.device.as_deref()?;
            let dev = inv.by_name(device);
            // The staging path is this device's mount (not the directory
            // before the mount, whose statvfs is its parent's).
            let mounted = dev.is_some_and(|d| d.mountpoints.iter().any(|m| m == &id.staging_path));
            let fs = if id.block || !mounted { None } else { statvfs(&id.staging_path) };
            let capacity = fs.map(|f| f.capacity).or_else(|| dev.filter(|_| id.block).map(|d| d.size_bytes));
            Some(Row { id, device, kubelet: id.labels(), io: io.get(device).copied(), capacity, fs })
        })
        .collect()
}

type CountPick = fn(&IoCounters) -> u64;
type FsPick = fn(&FsStat) -> u64;

pub(super) fn encode(e: &mut DescriptorEncoder<'_>, ids: &[VolumeIdentity], snap: &StatSnapshot, inv: &Inventory) -> Result<(), FmtError> {
    let rows = rows(ids, snap, inv);
    info(e, &rows)?;
    let counts: [(&str, &str, CountPick); 4] = [
        ("volring_volume_reads_completed", "Reads the volume's device completed", |c| c.reads),
        ("volring_volume_writes_completed", "Writes the volume's device completed", |c| c.writes),
        ("volring_volume_read_bytes", "Bytes read from the volume", |c| c.read_sectors.saturating_mul(512)),
        ("volring_volume_written_bytes", "Bytes written to the volume", |c| c.write_sectors.saturating_mul(512)),
    ];
    for (name, help, pick) in counts {
        let mut fam = e.encode_descriptor(name, help, None, MetricType::Counter)?;
        for r in rows.iter().filter(|r| r.io.is_some()) {
            ConstCounter::new(r.io.map_or(0, pick)).encode(fam.encode_family(&r.labels())?)?;
        }
    }
    // The kernel counts milliseconds.
    let times: [(&str, &str, CountPick); 3] = [
        ("volring_volume_read_time_seconds", "Time the volume's reads took, summed (over the reads' rate: the mean latency)", |c| {
            c.read_ticks
        }),
        ("volring_volume_write_time_seconds", "Time the volume's writes took, summed (over the writes' rate: the mean latency)", |c| {
            c.write_ticks
        }),
        ("volring_volume_io_time_seconds", "Time the volume's device had I/O in flight (its rate is the utilisation)", |c| c.io_ticks),
    ];
    for (name, help, pick) in times {
        let mut fam = e.encode_descriptor(name, help, None, MetricType::Counter)?;
        for r in rows.iter().filter(|r| r.io.is_some()) {
            ConstCounter::new(r.io.map_or(0, pick) as f64 / 1000.0).encode(fam.encode_family(&r.labels())?)?;
        }
    }
    let mut fam = e.encode_descriptor("volring_volume_in_flight", "I/Os in flight on the volume's device now", None, MetricType::Gauge)?;
    for r in &rows {
        if let Some(c) = r.io {
            ConstGauge::new(i64::try_from(c.in_flight).unwrap_or(i64::MAX)).encode(fam.encode_family(&r.labels())?)?;
        }
    }
    let mut fam = e.encode_descriptor(
        "volring_volume_capacity_bytes",
        "The volume's filesystem size (statvfs), or a block volume's device size",
        None,
        MetricType::Gauge,
    )?;
    for r in &rows {
        if let Some(c) = r.capacity {
            ConstGauge::new(i64::try_from(c).unwrap_or(i64::MAX)).encode(fam.encode_family(&r.labels())?)?;
        }
    }
    let fs: [(&str, &str, FsPick); 5] = [
        ("volring_volume_used_bytes", "Bytes used on the volume's filesystem (size less free)", |f| f.used),
        ("volring_volume_available_bytes", "Bytes available to unprivileged users on the volume's filesystem", |f| f.available),
        ("volring_volume_inodes", "Inodes of the volume's filesystem", |f| f.inodes),
        ("volring_volume_inodes_used", "Inodes in use on the volume's filesystem", |f| f.inodes_used),
        ("volring_volume_inodes_free", "Free inodes on the volume's filesystem", |f| f.inodes_free),
    ];
    for (name, help, pick) in fs {
        let mut fam = e.encode_descriptor(name, help, None, MetricType::Gauge)?;
        for r in &rows {
            if let Some(f) = &r.fs {
                ConstGauge::new(i64::try_from(pick(f)).unwrap_or(i64::MAX)).encode(fam.encode_family(&r.labels())?)?;
            }
        }
    }
    Ok(())
}

/// `volring_volume_info`: what names the volume beyond the five labels
/// (the PV, the pods' UIDs, its access and filesystem), value 1.
fn info(e: &mut DescriptorEncoder<'_>, rows: &[Row<'_>]) -> Result<(), FmtError> {
    let mut fam = e.encode_descriptor(
        "volring_volume_info",
        "A staged volume: its PV, the UIDs of the pods it is published to, access and filesystem type (value 1)",
        None,
        MetricType::Gauge,
    )?;
    for r in rows {
        let uids = r.id.pod_uids.join(",");
        let [volume, device, pvc, ns, pod] = r.labels();
        let labels = [
            volume,
            device,
            pvc,
            ns,
            pod,
            ("persistentvolume", r.id.persistent_volume.as_deref().unwrap_or("")),
            ("pod_uid", uids.as_str()),
            ("access", if r.id.block { "block" } else { "filesystem" }),
            ("fstype", r.id.fs_type.as_deref().unwrap_or("")),
        ];
        ConstGauge::new(1i64).encode(fam.encode_family(&labels)?)?;
    }
    Ok(())
}
