//! What volring knows about one block device, and its stable identity.

use std::collections::BTreeMap;
use std::path::PathBuf;

use serde::Serialize;

use super::probe::Content;
use volring_mounts::DevNum;

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
    pub(crate) fn as_str(self) -> &'static str {
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

/// lsblk's TYPE column (`disk`, `part`, `loop`, `dm`…).
impl std::fmt::Display for DeviceKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.pad(self.as_str())
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
    /// Stable across reboots and renames; see [`stable_id`]. Empty when it
    /// is unknown: an input that could decide it could not be read (see
    /// `id_unread`), so that a device never gets a different id because
    /// of who asked.
    pub id: String,
    /// Attributes that exist but could not be read, with the reason; the
    /// rest of the device is still reported.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub attr_errors: Vec<String>,
}

/// A change to the set of devices.
#[derive(Debug, Clone, Serialize)]
#[serde(tag = "event", rename_all = "lowercase")]
pub enum DeviceEvent {
    Added {
        device: Box<Device>,
        seqnum: Option<u64>,
    },
    Changed {
        device: Box<Device>,
        seqnum: Option<u64>,
    },
    Removed {
        name: String,
        dev: Option<DevNum>,
        seqnum: Option<u64>,
    },
    /// Events were lost (the socket's buffer or the queue overflowed):
    /// rescan. The next events after this one are complete again.
    Rescan {
        reason: &'static str,
    },
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

/// The sysfs attributes [`stable_id`] reads (for a partition, its disk's).
const ID_ATTRS: [&str; 5] = ["wwid", "device/wwid", "serial", "device/serial", "device/model"];

/// Why [`stable_id`] cannot be trusted for `d`, if it cannot: an input it
/// would consult before the one it settles on could not be read. Run as
/// an ordinary user the probe cannot open `/dev/vda`, so a filesystem UUID
/// (or a partition GUID from the disk's table) that decides root's id is
/// missing, and the id would silently fall through to a weaker one. Such an
/// id is reported unknown instead. `disk` is a partition's disk.
pub(crate) fn id_unread(d: &Device, disk: Option<&Device>) -> Option<String> {
    let attr_error = |dev: &Device, names: &[&str]| {
        dev.attr_errors.iter().find(|e| names.iter().any(|n| e.strip_prefix(n).is_some_and(|r| r.starts_with(':')))).cloned()
    };
    let hw = if d.partition.is_some() { disk } else { Some(d) };
    if let Some(e) = hw.and_then(|h| attr_error(h, &ID_ATTRS)) {
        return Some(format!("attribute {e}"));
    }
    if d.wwn.is_some() || d.serial.is_some() {
        return None;
    }
    if d.partition.is_some() && d.part_uuid.is_none() {
        match disk {
            None => return Some("its disk is not in the inventory (partition GUID unknown)".into()),
            Some(k) => {
                if let Some(e) = &k.probe_error {
                    return Some(format!("its disk's partition table was not read: {e}"));
                }
            }
        }
    }
    if d.part_uuid.is_some() || d.content.filesystem.as_ref().is_some_and(|f| f.uuid.is_some()) {
        return None;
    }
    if let Some(e) = &d.probe_error {
        return Some(format!("its first blocks were not read: {e}"));
    }
    attr_error(d, &["loop/backing_file", "loop/offset", "dm/name", "dm/uuid"]).map(|e| format!("attribute {e}"))
}

#[cfg(test)]
mod tests {
    use super::super::probe::{Filesystem, FsType};
    use super::*;

    fn bare(name: &str, kind: DeviceKind) -> Device {
        Device {
            name: name.into(),
            dev: DevNum { major: 7, minor: 0 },
            kind,
            path: PathBuf::from("/dev").join(name),
            size_bytes: 1 << 20,
            logical_block_size: 512,
            physical_block_size: 512,
            rotational: false,
            removable: false,
            read_only: false,
            model: None,
            vendor: None,
            serial: None,
            wwn: None,
            firmware: None,
            partition: None,
            holders: Vec::new(),
            slaves: Vec::new(),
            loop_backing: None,
            dm: None,
            md_level: None,
            links: Vec::new(),
            udev: BTreeMap::new(),
            content: Content::default(),
            probe_error: None,
            part_uuid: None,
            mountpoints: Vec::new(),
            uses: Vec::new(),
            os_disk: false,
            id: String::new(),
            attr_errors: Vec::new(),
        }
    }

    /// An id is unknown exactly when something that could have decided it
    /// was not read; what was read and ranks first still decides it.
    #[test]
    fn an_unread_input_makes_the_id_unknown_not_weaker() {
        let mut lo = bare("loop0", DeviceKind::Loop);
        lo.loop_backing = Some(LoopBacking { file: "/img".into(), offset: 0, size_limit: 0, autoclear: false });
        assert_eq!(id_unread(&lo, None), None, "nothing unread: the loop id stands");
        lo.probe_error = Some("open /dev/loop0: Permission denied".into());
        assert!(id_unread(&lo, None).is_some_and(|w| w.contains("Permission denied")));
        lo.content.filesystem = Some(Filesystem { fstype: FsType::Ext4, uuid: Some("u".into()), label: None, uuid_sub: None });
        assert_eq!(id_unread(&lo, None), None, "a UUID read ranks above the loop id");

        let mut vda = bare("vda", DeviceKind::Virtio);
        vda.serial = Some("S1".into());
        vda.probe_error = Some("open: EPERM".into());
        assert_eq!(id_unread(&vda, None), None, "the serial decides whatever the probe says");
        let mut part = bare("vda1", DeviceKind::Partition);
        part.partition = Some((1, "vda".into()));
        // sysfs gives a partition its disk's hardware ids.
        part.serial = vda.serial.clone();
        assert_eq!(id_unread(&part, Some(&vda)), None, "a partition of a serial'd disk");
        (vda.serial, part.serial) = (None, None);
        assert!(id_unread(&part, Some(&vda)).is_some_and(|w| w.contains("partition table")));
        vda.probe_error = None;
        assert_eq!(id_unread(&part, Some(&vda)), None);
        vda.attr_errors.push("serial: Permission denied (os error 13)".into());
        assert!(id_unread(&part, Some(&vda)).is_some_and(|w| w.contains("serial")));
        assert!(id_unread(&vda, None).is_some());
        vda.attr_errors = vec!["serialx: odd".into(), "holders/: EIO".into()];
        assert_eq!(id_unread(&vda, None), None, "other attributes do not touch the id");
    }
}
