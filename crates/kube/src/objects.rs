//! The custom resources volring publishes, generated from these types:
//! `BlockDevice` (one per device, named from its stable id) and
//! `StorageNode` (one per node: its pool and volumes, healthy or not).
//!
//! Builders here are pure: the agent hands them what it knows, they return
//! the [`Object`] the updater writes. Nothing in a status carries a time
//! stamp, so an object rebuilt from unchanged facts is byte-equal to the
//! stored one and the updater writes nothing.

use std::collections::BTreeMap;

use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use volring_devices::{Device, DeviceKind, Use};

/// The API group of every volring object.
pub(crate) const GROUP: &str = "volring.io";
pub(crate) const VERSION: &str = "v1alpha1";
/// Label: the node an object describes.
pub(crate) const NODE_LABEL: &str = "volring.io/node";
/// Label: the object's kind in lower case (so one selector finds a kind).
pub(crate) const KIND_LABEL: &str = "volring.io/kind";
/// Label: the node, under the name node-disk-manager's users search by
/// (`-l kubernetes.io/hostname=<node>`). Its value is the node's name,
/// which is the node's own `kubernetes.io/hostname` label unless the
/// kubelet was given another (`--hostname-override`).
pub(crate) const HOSTNAME_LABEL: &str = "kubernetes.io/hostname";

/// Whether volring writes (and so compares) label `key`.
pub(crate) fn is_own_label(key: &str) -> bool {
    key.starts_with("volring.io/") || key == HOSTNAME_LABEL
}

/// schemars gives unsigned fields `format: uint32` / `uint64`, which the
/// API server does not know (it warns on every apply of the CRD): they
/// become `int64` with `minimum: 0`, what it does know. Applied to every
/// type of the CRDs that holds one, nested ones included.
pub(crate) fn kube_int_formats(schema: &mut schemars::Schema) {
    fn walk(v: &mut serde_json::Value) {
        match v {
            serde_json::Value::Object(m) => {
                let unsigned = m.get("format").and_then(|f| f.as_str()).is_some_and(|f| f.starts_with("uint"));
                if unsigned {
                    m.insert("format".into(), "int64".into());
                    m.insert("minimum".into(), 0.into());
                }
                m.values_mut().for_each(walk);
            }
            serde_json::Value::Array(a) => a.iter_mut().for_each(walk),
            _ => {}
        }
    }
    if let Some(m) = schema.as_object_mut() {
        m.values_mut().for_each(walk);
    }
}
/// At most this many volumes are listed in a StorageNode's status (the
/// drifting ones first); the rest are counted in `volumesOmitted`. An
/// object must stay far below the API server's 1.5 MiB request limit.
pub(crate) const MAX_LISTED_VOLUMES: usize = 1000;

/// A block device on a node, as volring sees it.
#[derive(CustomResource, Serialize, Deserialize, Debug, Clone, PartialEq, JsonSchema)]
// Each printer column repeats `type_`: clippy takes those for duplicates.
#[allow(clippy::duplicated_attributes)]
#[kube(
    group = "volring.io",
    version = "v1alpha1",
    kind = "BlockDevice",
    shortname = "bd",
    status = "BlockDeviceStatus",
    selectable = ".spec.nodeName",
    printcolumn(name = "Node", type_ = "string", json_path = ".spec.nodeName"),
    printcolumn(name = "Path", type_ = "string", json_path = ".spec.path"),
    printcolumn(name = "Size", type_ = "integer", json_path = ".spec.capacity.storage"),
    printcolumn(name = "ClaimState", type_ = "string", json_path = ".status.claimState"),
    printcolumn(name = "State", type_ = "string", json_path = ".status.state"),
    printcolumn(name = "FsType", type_ = "string", json_path = ".status.filesystem.fsType", priority = 1),
    printcolumn(name = "Volume", type_ = "string", json_path = ".status.volume", priority = 1),
    printcolumn(name = "Claim", type_ = "string", json_path = ".status.persistentVolumeClaim.name", priority = 1),
    printcolumn(name = "Age", type_ = "date", json_path = ".metadata.creationTimestamp")
)]
#[serde(rename_all = "camelCase")]
#[schemars(transform = kube_int_formats)]
pub(crate) struct BlockDeviceSpec {
    pub(crate) node_name: String,
    /// `/dev/<name>` now; may change across reboots (the name does not).
    pub path: String,
    /// The identity that survives reboots and renames (see `devices::stable_id`).
    pub(crate) stable_id: String,
    pub capacity: Capacity,
    pub(crate) details: Details,
    #[serde(default)]
    pub(crate) devlinks: Vec<String>,
    pub(crate) partitioned: bool,
    /// The disk a partition is on (its kernel name).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) parent_disk: Option<String>,
}

#[derive(Serialize, Deserialize, Debug, Clone, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(transform = kube_int_formats)]
pub(crate) struct Capacity {
    /// Bytes.
    pub(crate) storage: u64,
    pub(crate) logical_sector_size: u32,
    pub(crate) physical_sector_size: u32,
}

#[derive(Serialize, Deserialize, Debug, Clone, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub(crate) struct Details {
    /// disk, part, loop, dm, md, nbd, rom, other (lsblk's TYPE).
    pub(crate) device_type: String,
    /// HDD or SSD (from the rotational flag), Unknown for virtual devices.
    pub(crate) drive_type: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) model: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) serial: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) vendor: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) wwn: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) firmware_revision: Option<String>,
    pub(crate) removable: bool,
    pub read_only: bool,
}

#[derive(Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq, JsonSchema)]
pub(crate) enum DeviceState {
    /// Present on the node now.
    Active,
    /// Was on the node and is gone (or the agent restarted without it).
    Inactive,
    Unknown,
}

#[derive(Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq, JsonSchema)]
pub(crate) enum ClaimState {
    /// Nothing uses it.
    Unclaimed,
    /// A volume volring serves is on it.
    Claimed,
    /// Mounted or held by something volring does not own.
    InUse,
}

#[derive(Serialize, Deserialize, Debug, Clone, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub(crate) struct BlockDeviceStatus {
    pub state: DeviceState,
    pub(crate) claim_state: ClaimState,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub filesystem: Option<Filesystem>,
    #[serde(default)]
    pub(crate) mount_points: Vec<String>,
    #[serde(default)]
    pub(crate) holders: Vec<String>,
    /// The CSI volume using the device.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub volume: Option<String>,
    /// The PersistentVolume of that volume, when known (from kubelet's
    /// paths or the cluster).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub persistent_volume: Option<String>,
    /// The PVC bound to that PersistentVolume, when the cluster named it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub persistent_volume_claim: Option<ClaimRef>,
}

/// A PersistentVolumeClaim, by namespace and name.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq, Eq, JsonSchema)]
pub(crate) struct ClaimRef {
    pub namespace: String,
    pub name: String,
}

#[derive(Serialize, Deserialize, Debug, Clone, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub(crate) struct Filesystem {
    pub fs_type: String,
    /// The first mount point, when mounted.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mount_point: Option<String>,
}

/// One node: its pool and the volumes on it, desired against actual.
#[derive(CustomResource, Serialize, Deserialize, Debug, Clone, PartialEq, JsonSchema)]
// Each printer column repeats `type_`: clippy takes those for duplicates.
#[allow(clippy::duplicated_attributes)]
#[kube(
    group = "volring.io",
    version = "v1alpha1",
    kind = "StorageNode",
    shortname = "sn",
    status = "StorageNodeStatus",
    selectable = ".spec.nodeName",
    printcolumn(name = "Volumes", type_ = "integer", json_path = ".status.volumesTotal"),
    printcolumn(name = "Drifting", type_ = "integer", json_path = ".status.volumesDrifting"),
    printcolumn(name = "PoolFree", type_ = "integer", json_path = ".status.pool.availableBytes"),
    printcolumn(name = "Ready", type_ = "string", json_path = ".status.conditions[?(@.type==\"Ready\")].status"),
    printcolumn(name = "Age", type_ = "date", json_path = ".metadata.creationTimestamp")
)]
#[serde(rename_all = "camelCase")]
pub(crate) struct StorageNodeSpec {
    pub(crate) node_name: String,
}

#[derive(Serialize, Deserialize, Debug, Clone, PartialEq, Default, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(transform = kube_int_formats)]
pub(crate) struct StorageNodeStatus {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pool: Option<Pool>,
    pub(crate) volumes_total: u32,
    pub(crate) volumes_drifting: u32,
    /// Volumes not listed in `volumes` (past the bound; healthy ones first).
    pub(crate) volumes_omitted: u32,
    #[serde(default)]
    pub(crate) volumes: Vec<VolumeEntry>,
    #[serde(default)]
    pub(crate) conditions: Vec<Condition>,
}

#[derive(Serialize, Deserialize, Debug, Clone, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(transform = kube_int_formats)]
pub(crate) struct Pool {
    pub path: String,
    pub(crate) capacity_bytes: u64,
    pub(crate) available_bytes: u64,
}

/// One volume: what was asked (access, fsType, readOnly, targets) and what
/// is there (phase, device, health, drift).
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub(crate) struct VolumeEntry {
    pub id: String,
    /// mount or block.
    pub(crate) access: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fs_type: Option<String>,
    pub read_only: bool,
    /// The stage phase (staged, or an interrupted step).
    pub phase: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub device: Option<String>,
    pub(crate) staging_path: String,
    #[serde(default)]
    pub(crate) targets: Vec<String>,
    /// Healthy, Drifting or Unknown.
    pub(crate) health: String,
    /// Drift kinds (see the reconciler).
    #[serde(default)]
    pub(crate) drift: Vec<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
    /// The volume's PersistentVolume (from kubelet's paths or the cluster).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub persistent_volume: Option<String>,
    /// Its PVC, when the cluster named it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub persistent_volume_claim: Option<ClaimRef>,
    /// The pods it is published to: `namespace/name` when the cluster
    /// named them, else their UIDs (from kubelet's paths).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub pods: Vec<String>,
}

/// A condition without a transition time: writing one must not change it
/// when nothing else did.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub(crate) struct Condition {
    #[serde(rename = "type")]
    pub(crate) type_: String,
    /// "True", "False" or "Unknown".
    pub status: String,
    pub(crate) reason: String,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub message: String,
}

/// The kinds the updater knows.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum Kind {
    BlockDevice,
    StorageNode,
}

impl Kind {
    pub(crate) const ALL: [Kind; 2] = [Kind::BlockDevice, Kind::StorageNode];

    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Kind::BlockDevice => "BlockDevice",
            Kind::StorageNode => "StorageNode",
        }
    }

    /// The resource's plural, as in its URL.
    pub(crate) fn plural(self) -> &'static str {
        match self {
            Kind::BlockDevice => "blockdevices",
            Kind::StorageNode => "storagenodes",
        }
    }

    pub(crate) fn label(self) -> &'static str {
        match self {
            Kind::BlockDevice => "blockdevice",
            Kind::StorageNode => "storagenode",
        }
    }
}

/// Which object: kind and (cluster-scoped) name.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Key {
    pub kind: Kind,
    pub name: String,
}

/// An object as the updater handles it: the parts it writes, in JSON.
/// `main` is what server-side apply of the object sets (labels and spec),
/// `status` what goes through the status subresource.
#[derive(Debug, Clone, PartialEq)]
pub struct Object {
    pub key: Key,
    pub labels: BTreeMap<String, String>,
    pub spec: serde_json::Value,
    pub status: serde_json::Value,
}

impl Object {
    /// The body of a server-side apply of labels and spec.
    pub(crate) fn main_body(&self) -> serde_json::Value {
        serde_json::json!({
            "apiVersion": format!("{GROUP}/{VERSION}"),
            "kind": self.key.kind.as_str(),
            "metadata": {"name": self.key.name, "labels": self.labels},
            "spec": self.spec,
        })
    }

    /// The body of a server-side apply to the status subresource.
    pub(crate) fn status_body(&self) -> serde_json::Value {
        serde_json::json!({
            "apiVersion": format!("{GROUP}/{VERSION}"),
            "kind": self.key.kind.as_str(),
            "metadata": {"name": self.key.name},
            "status": self.status,
        })
    }

    /// Reads back an object as the API (or the embedded store) returns it,
    /// keeping only what volring writes: its labels, spec and status.
    pub(crate) fn from_api(kind: Kind, v: &serde_json::Value) -> Option<Object> {
        let name = v.pointer("/metadata/name")?.as_str()?.to_string();
        let labels = v
            .pointer("/metadata/labels")
            .and_then(|l| l.as_object())
            .map(|l| l.iter().filter(|(k, _)| is_own_label(k)).filter_map(|(k, v)| Some((k.clone(), v.as_str()?.to_string()))).collect())
            .unwrap_or_default();
        let spec = v.get("spec").cloned().unwrap_or(serde_json::Value::Null);
        let status = v.get("status").cloned().unwrap_or(serde_json::Value::Null);
        Some(Object { key: Key { kind, name }, labels, spec, status })
    }

    /// The object marked as gone from its node: a BlockDevice becomes
    /// Inactive (its other facts stay as last seen); `None` for kinds that
    /// have no such state.
    pub(crate) fn retired(&self) -> Option<Object> {
        match self.key.kind {
            Kind::BlockDevice => {
                let mut o = self.clone();
                if !o.status.is_object() {
                    o.status = serde_json::json!({"claimState": "Unclaimed"});
                }
                o.status["state"] = serde_json::json!("Inactive");
                // A device leaves the node when its volume is unstaged
                // (the loop device is detached): the claim is released.
                if o.status["claimState"] == "Claimed" {
                    o.status["claimState"] = serde_json::json!("Unclaimed");
                    if let Some(s) = o.status.as_object_mut() {
                        for k in ["volume", "persistentVolume", "persistentVolumeClaim"] {
                            s.remove(k);
                        }
                    }
                }
                Some(o)
            }
            Kind::StorageNode => None,
        }
    }

    pub(crate) fn node(&self) -> Option<&str> {
        self.labels.get(NODE_LABEL).map(String::as_str)
    }

    /// True for a BlockDevice stored under the name earlier versions gave
    /// it (see [`legacy_block_device_name`]): another node may hold the
    /// same name, so it is removed rather than kept as Inactive.
    pub(crate) fn superseded(&self) -> bool {
        self.key.kind == Kind::BlockDevice
            && self.spec.get("stableId").and_then(|i| i.as_str()).is_some_and(|id| legacy_block_device_name(id) == self.key.name)
    }
}

fn labels(kind: Kind, node: &str) -> BTreeMap<String, String> {
    [
        (NODE_LABEL.to_string(), node.to_string()),
        (HOSTNAME_LABEL.to_string(), node.to_string()),
        (KIND_LABEL.to_string(), kind.label().to_string()),
    ]
    .into()
}

/// `bd-` and the first 16 hex digits of the SHA-256 of the node and the
/// stable id: a valid object name whatever the id holds, the same across
/// reboots. The node is part of it because BlockDevices are cluster-scoped
/// and most ids are not unique across nodes: nodes cloned from one image
/// share their partitions' GUIDs and filesystem UUIDs, and serial-less
/// virtual disks fall through to those (node-disk-manager puts the host
/// name into such ids for the same reason).
pub(crate) fn block_device_name(node: &str, stable_id: &str) -> String {
    let mut h = Sha256::new();
    h.update(node.as_bytes());
    // A separator no node name holds: ("a", "bc") and ("ab", "c") differ.
    h.update([0u8]);
    h.update(stable_id.as_bytes());
    let hex: String = h.finalize().iter().take(8).map(|b| format!("{b:02x}")).collect();
    format!("bd-{hex}")
}

/// The name of one of several devices on `node` that share a stable id
/// (two paths to one LUN, disks of one batch with a blank serial): the
/// kernel name tells them apart. Each keeps its own object, rather than
/// one object flipping between them.
pub(crate) fn duplicate_block_device_name(node: &str, stable_id: &str, kernel_name: &str) -> String {
    block_device_name(node, &format!("{stable_id}\0{kernel_name}"))
}

/// The name earlier versions gave a BlockDevice: from the stable id alone,
/// so it collided across nodes. A stored object of this node under such a
/// name is superseded by its node-qualified name and is deleted.
pub(crate) fn legacy_block_device_name(stable_id: &str) -> String {
    let digest = Sha256::digest(stable_id.as_bytes());
    let hex: String = digest.iter().take(8).map(|b| format!("{b:02x}")).collect();
    format!("bd-{hex}")
}

/// The BlockDevice for a device present now, with the PV and PVC of the
/// volume on it (`who`: that volume's identity record, when staged).
pub(crate) fn block_device_of(d: &Device, node: &str, who: Option<&volring_volumes::VolumeIdentity>) -> Object {
    let volume = d.uses.iter().find_map(|u| match u {
        Use::Volume(v) => Some(v.clone()),
        _ => None,
    });
    let claim = if volume.is_some() {
        ClaimState::Claimed
    } else if d.in_use() || !d.holders.is_empty() || !d.mountpoints.is_empty() {
        ClaimState::InUse
    } else {
        ClaimState::Unclaimed
    };
    let virt = matches!(d.kind, DeviceKind::Loop | DeviceKind::Dm | DeviceKind::Md | DeviceKind::Nbd | DeviceKind::Zram);
    let spec = BlockDeviceSpec {
        node_name: node.to_string(),
        path: d.path.display().to_string(),
        stable_id: d.id.clone(),
        capacity: Capacity {
            storage: d.size_bytes,
            logical_sector_size: d.logical_block_size,
            physical_sector_size: d.physical_block_size,
        },
        details: Details {
            device_type: d.kind.to_string(),
            drive_type: if virt {
                "Unknown"
            } else if d.rotational {
                "HDD"
            } else {
                "SSD"
            }
            .to_string(),
            model: d.model.clone(),
            serial: d.serial.clone(),
            vendor: d.vendor.clone(),
            wwn: d.wwn.clone(),
            firmware_revision: d.firmware.clone(),
            removable: d.removable,
            read_only: d.read_only,
        },
        devlinks: d.links.iter().map(|l| l.display().to_string()).collect(),
        partitioned: d.content.table.is_some(),
        parent_disk: d.partition.as_ref().map(|(_, disk)| disk.clone()),
    };
    let mount_points: Vec<String> = d.mountpoints.iter().map(|m| m.display().to_string()).collect();
    let status = BlockDeviceStatus {
        state: DeviceState::Active,
        claim_state: claim,
        filesystem: d.fstype().map(|t| Filesystem { fs_type: t.to_string(), mount_point: mount_points.first().cloned() }),
        mount_points,
        holders: d.holders.clone(),
        persistent_volume: who.filter(|_| volume.is_some()).and_then(|w| w.persistent_volume.clone()),
        persistent_volume_claim: who
            .filter(|_| volume.is_some())
            .and_then(|w| w.claim.as_ref())
            .map(|c| ClaimRef { namespace: c.namespace.clone(), name: c.name.clone() }),
        volume,
    };
    Object {
        key: Key { kind: Kind::BlockDevice, name: block_device_name(node, &d.id) },
        labels: labels(Kind::BlockDevice, node),
        spec: serde_json::to_value(spec).expect("a spec serialises"),
        status: serde_json::to_value(status).expect("a status serialises"),
    }
}

/// The StorageNode for `node`: `volumes` in any order; drifting ones are
/// listed first, then by id, at most [`MAX_LISTED_VOLUMES`].
pub(crate) fn storage_node(node: &str, pool: Option<Pool>, mut volumes: Vec<VolumeEntry>) -> Object {
    let drifting = |v: &VolumeEntry| v.health != "Healthy";
    volumes.sort_by(|a, b| drifting(b).cmp(&drifting(a)).then_with(|| a.id.cmp(&b.id)));
    let total = volumes.len() as u32;
    let n_drifting = volumes.iter().filter(|v| drifting(v)).count() as u32;
    let omitted = volumes.len().saturating_sub(MAX_LISTED_VOLUMES) as u32;
    volumes.truncate(MAX_LISTED_VOLUMES);
    let ready = Condition {
        type_: "Ready".into(),
        status: if n_drifting == 0 { "True" } else { "False" }.into(),
        reason: if n_drifting == 0 { "AllVolumesHealthy" } else { "VolumesDrifting" }.into(),
        message: if n_drifting == 0 { String::new() } else { format!("{n_drifting} of {total} volumes drift from their desired state") },
    };
    let status = StorageNodeStatus {
        pool,
        volumes_total: total,
        volumes_drifting: n_drifting,
        volumes_omitted: omitted,
        volumes,
        conditions: vec![ready],
    };
    Object {
        key: Key { kind: Kind::StorageNode, name: node.to_string() },
        labels: labels(Kind::StorageNode, node),
        spec: serde_json::to_value(StorageNodeSpec { node_name: node.to_string() }).expect("a spec serialises"),
        status: serde_json::to_value(status).expect("a status serialises"),
    }
}

/// Both CRDs as one YAML stream (what `volring crds` prints and
/// deploy/crds/volring.io.yaml holds).
pub fn crds_yaml() -> String {
    use kube::CustomResourceExt;
    let mut out = String::from("# Generated by `volring crds` from crates/kube/src/objects.rs; do not edit.\n");
    for crd in [BlockDevice::crd(), StorageNode::crd()] {
        out.push_str("---\n");
        out.push_str(&serde_saphyr::to_string(&crd).expect("a CRD serialises"));
    }
    out
}

#[cfg(test)]
mod tests;
