//! What volring knows about one block device, and its stable identity.

use std::collections::BTreeMap;
use std::path::PathBuf;

use serde::Serialize;

use super::probe::Content;
use crate::mounts::DevNum;

/// The driver family behind a device, as the kernel name and sysfs tell it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum DeviceKind {
    /// SCSI/SATA/USB (`sd*`), or anything else with a `device/` link.
    Disk,
    Partition,
    Loop,
    /// device-mapper (`dm-*`): LVM, dm-crypt, multipath.
    Dm,
    /// Linux software RAID (`md*`).
    Md,
    Nvme,
    Virtio,
    Nbd,
    /// Compressed RAM disk.
    Zram,
    Rom,
    Other,
}

impl DeviceKind {
    /// lsblk's TYPE column.
    pub fn as_str(self) -> &'static str {
        match self {
            DeviceKind::Disk | DeviceKind::Nvme | DeviceKind::Virtio | DeviceKind::Zram => "disk",
            DeviceKind::Partition => "part",
            DeviceKind::Loop => "loop",
            DeviceKind::Dm => "dm",
            DeviceKind::Md => "md",
            DeviceKind::Nbd => "nbd",
            DeviceKind::Rom => "rom",
            DeviceKind::Other => "other",
        }
    }
}

/// A loop device's backing, from `/sys/class/block/loopN/loop/`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct LoopBacking {
    pub file: PathBuf,
    pub offset: u64,
    pub size_limit: u64,
    pub autoclear: bool,
}

/// A device-mapper device's name and uuid (`dm/name`, `dm/uuid`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct DmInfo {
    pub name: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub uuid: Option<String>,
}

/// Why a device is busy.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case", tag = "by", content = "detail")]
pub enum Use {
    /// Mounted at these points.
    Mounted(Vec<PathBuf>),
    /// Held by these devices (dm, md, a partition's disk is not a holder).
    Held(Vec<String>),
    /// A volume volring serves or attached.
    Volume(String),
}

/// Everything known about one block device.
#[derive(Debug, Clone, Serialize)]
pub struct Device {
    /// Kernel name: `vda`, `loop3`, `nvme0n1p2`, `dm-0`.
    pub name: String,
    pub dev: DevNum,
    pub kind: DeviceKind,
    /// `/dev/<DEVNAME>`.
    pub path: PathBuf,
    pub size_bytes: u64,
    pub logical_block_size: u32,
    pub physical_block_size: u32,
    pub rotational: bool,
    pub removable: bool,
    pub read_only: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub vendor: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub serial: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub wwn: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub firmware: Option<String>,
    /// Partitions: their number and the disk they are on.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub partition: Option<(u32, String)>,
    pub holders: Vec<String>,
    pub slaves: Vec<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub loop_backing: Option<LoopBacking>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub dm: Option<DmInfo>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub md_level: Option<String>,
    /// `/dev/disk/by-id` and `by-path` links that resolve to this device.
    pub links: Vec<PathBuf>,
    /// The udev database entry's properties (`E:` lines), when udev runs.
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub udev: BTreeMap<String, String>,
    /// What the first blocks hold.
    pub content: Content,
    /// Why the probe could not read the device, when it could not.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub probe_error: Option<String>,
    /// Partition GUID from the parent's GPT, for partitions.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub part_uuid: Option<String>,
    pub mountpoints: Vec<PathBuf>,
    pub uses: Vec<Use>,
    /// The device behind `/`, or a disk that holds it.
    pub os_disk: bool,
    /// Stable across reboots and renames; see [`stable_id`].
    pub id: String,
    /// Attributes that exist but could not be read, with the reason; the
    /// rest of the device is still reported.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub attr_errors: Vec<String>,
}

impl Device {
    pub fn in_use(&self) -> bool {
        !self.uses.is_empty()
    }

    /// The filesystem type lsblk would print.
    pub fn fstype(&self) -> Option<&'static str> {
        self.content.filesystem.as_ref().map(|f| f.fstype.as_str())
    }
}

/// The identity of a device that survives reboots and renames (`sdb`
/// becoming `sdc`, `loop3` becoming `loop7`). The first of these that the
/// device has wins, because each later one is weaker:
///
/// 1. `wwn-<WWN>-<serial>`, else `serial-<model>-<serial>`: they come from
///    the device itself; a partition appends its number.
/// 2. `partuuid-<GUID>`: a GPT partition's unique GUID is written once at
///    creation and never changes.
/// 3. `fsuuid-<UUID>`: the filesystem's UUID; changes only if reformatted.
/// 4. `loop-<node>:<backing file>@<offset>`: a loop device is its backing
///    file, not its number; the path is only unique on its node.
/// 5. `dm-<uuid>` / `dm-<name>`: device-mapper names are chosen by their owner.
/// 6. `name-<node>:<kernel name>`: nothing better; stable until a rename.
///
/// Node-disk-manager writes a GPT onto a bare disk to manufacture an id;
/// volring never writes, so an unlabelled, serial-less disk gets the weak id.
pub fn stable_id(d: &Device, node: &str) -> String {
    let part = d.partition.as_ref().map(|(n, _)| format!("-part{n}")).unwrap_or_default();
    if let (Some(wwn), Some(serial)) = (&d.wwn, &d.serial) {
        return format!("wwn-{wwn}-{serial}{part}");
    }
    if let Some(wwn) = &d.wwn {
        return format!("wwn-{wwn}{part}");
    }
    if let Some(serial) = &d.serial {
        let model = d.model.as_ref().map(|m| format!("{m}-")).unwrap_or_default();
        return format!("serial-{model}{serial}{part}");
    }
    if let Some(g) = &d.part_uuid {
        return format!("partuuid-{g}");
    }
    if let Some(f) = d.content.filesystem.as_ref() {
        // A RAID member or ZFS vdev shares its UUID with the set; its own
        // UUID_SUB keeps the id unique.
        match (&f.uuid, &f.uuid_sub) {
            (Some(u), Some(sub)) => return format!("fsuuid-{u}-{sub}"),
            (Some(u), None) => return format!("fsuuid-{u}"),
            _ => {}
        }
    }
    if let Some(l) = &d.loop_backing {
        return format!("loop-{node}:{}@{}", l.file.display(), l.offset);
    }
    if let Some(dm) = &d.dm {
        return match &dm.uuid {
            Some(u) => format!("dm-{u}"),
            None => format!("dm-{}", dm.name),
        };
    }
    format!("name-{node}:{}", d.name)
}
