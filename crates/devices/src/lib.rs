//! Block devices: discovery, signature probes, stats, hot-plug.
//!
//! The job of node-disk-manager's daemon, done in-process: [`Inventory`]
//! knows every block device (sysfs), what is on it ([`probe()`], from its
//! first blocks, read through the ring), who uses it (the mount table and
//! holders) and a [`stable_id`] for it; [`DeviceWatcher`] follows kernel
//! uevents; [`StatCollector`] samples I/O counters on a ring thread and
//! publishes each [`StatSnapshot`] for lock-free readers.

#![warn(unreachable_pub)]

mod collect;
mod collector;
mod device;
mod filter;
mod hotplug;
mod inventory;
mod probe;
mod stats;
mod swaps;
mod sysfs;
mod uevent;

pub use collect::{StatMethod, StatSource};
pub use collector::{CollectorConfig, StatCollector, StatsReader};
pub use device::{stable_id, Device, DeviceEvent, DeviceKind, DmInfo, LoopBacking, Use};
pub use filter::DeviceFilter;
pub use hotplug::{DeviceWatcher, HotplugStats};
pub use inventory::{describe, node_name, Inventory, ScanConfig};
pub use probe::{probe, probe_reads, tables::TableType, Content, FsType, PROBE_LEN};
pub use stats::{parse_diskstats, DeviceStat, DiskstatsLine, IoCounters, IoRates, StatLineError, StatSnapshot};
pub use swaps::{active_swap_devices, fuzz_proc_swaps};
pub use sysfs::fuzz_sysfs_text;
pub use uevent::fuzz_uevent;

/// Errors of device discovery.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The device went away while it was being read.
    #[error("device {0} vanished")]
    Vanished(String),
    #[error("{0:?} is not a block device name")]
    BadName(String),
    #[error("device {0}: attribute {1}")]
    Attribute(String, String),
    #[error("{0}: {1}")]
    Io(&'static str, #[source] std::io::Error),
}
