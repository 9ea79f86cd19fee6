//! The agent's side of the publisher: turns the inventory and the volumes'
//! records and verdicts into objects, and hands the updater only those that
//! changed since the last hand-over (the updater coalesces and compares
//! with what is stored; this keeps a relink of 1,000 unchanged devices from
//! costing 1,000 submissions).

use std::collections::{HashMap, HashSet};
use std::path::Path;

use super::objects::{self, Key, Object, Pool, VolumeEntry};
use super::updater::{Updater, UpdaterConfig};
use volring_devices::Inventory;
use volring_volumes::VolumeHealth;
use volring_volumes::{AccessKind, StagePhase, StagedVolume, VolumeIdentity};

/// What was last handed to the updater, per object.
#[derive(Default)]
pub struct Feed {
    last: HashMap<Key, Object>,
    /// The staged volumes' identity records, by volume id: a Claimed
    /// device's object names the volume's PV and PVC.
    volumes: HashMap<String, VolumeIdentity>,
}

/// This node's BlockDevices now. Devices whose id could not be read are
/// left out (see [`Feed::devices`] and [`unread_paths`]); devices that share
/// an id on this node each get their own object, told apart by kernel name.
pub(crate) fn block_devices(inventory: &Inventory, node: &str) -> Vec<Object> {
    block_devices_of(inventory, node, &HashMap::new())
}

/// [`block_devices`], each device a volume is on naming that volume's PV
/// and PVC from its identity record in `volumes` (by volume id).
pub(crate) fn block_devices_of(inventory: &Inventory, node: &str, volumes: &HashMap<String, VolumeIdentity>) -> Vec<Object> {
    let mut count: HashMap<&str, usize> = HashMap::new();
    for d in inventory.devices.values().filter(|d| !d.id.is_empty()) {
        *count.entry(d.id.as_str()).or_default() += 1;
    }
    inventory
        .devices
        .values()
        .filter(|d| !d.id.is_empty())
        .map(|d| {
            let who = d.uses.iter().find_map(|u| match u {
                volring_devices::Use::Volume(v) => volumes.get(v),
                _ => None,
            });
            let mut o = objects::block_device_of(d, node, who);
            if count[d.id.as_str()] > 1 {
                o.key.name = objects::duplicate_block_device_name(node, &d.id, &d.name);
            }
            o
        })
        .collect()
}

/// The paths of devices present whose id could not be read now (a
/// transient sysfs or probe error): their objects are neither rewritten
/// nor retired until the id reads again.
pub(crate) fn unread_paths(inventory: &Inventory) -> HashSet<String> {
    inventory.devices.values().filter(|d| d.id.is_empty()).map(|d| d.path.display().to_string()).collect()
}

/// The `/dev` path a BlockDevice describes.
pub(crate) fn path_of(o: &Object) -> Option<&str> {
    o.spec.get("path").and_then(|p| p.as_str())
}

impl Feed {
    /// The updater's start: every object of `config`'s node now, its
    /// devices and the StorageNode, and the feed that remembers them; and
    /// in `config`, the devices whose id could not be read now
    /// ([`UpdaterConfig::unread_paths`]: the first diff leaves their
    /// objects alone).
    pub fn initial(inventory: &Inventory, storage_node: Object, config: &mut UpdaterConfig) -> (Feed, Vec<Object>) {
        config.unread_paths = unread_paths(inventory);
        let mut v = block_devices(inventory, &config.node);
        v.push(storage_node);
        let mut feed = Feed::default();
        feed.seed(&v);
        (feed, v)
    }

    /// Remembers the objects the updater started with.
    pub(crate) fn seed(&mut self, objs: &[Object]) {
        self.last.extend(objs.iter().map(|o| (o.key.clone(), o.clone())));
    }

    /// Submits the devices that changed and retires those that are gone.
    /// A device still present whose id cannot be read now keeps its
    /// object as it was: an unreadable input is not a removal. `volumes`:
    /// the staged volumes' identity records, when they were read again
    /// (they are kept from then on, and a device a volume is on names its
    /// PV and PVC); `None`: the ones last given.
    pub fn devices(&mut self, up: &Updater, inventory: &Inventory, node: &str, volumes: Option<&[VolumeIdentity]>) {
        if let Some(ids) = volumes {
            self.volumes = ids.iter().map(|i| (i.volume_id.clone(), i.clone())).collect();
        }
        let now: HashMap<Key, Object> = block_devices_of(inventory, node, &self.volumes).into_iter().map(|o| (o.key.clone(), o)).collect();
        let unread = unread_paths(inventory);
        let gone: Vec<Key> = self
            .last
            .iter()
            .filter(|(k, o)| {
                k.kind == objects::Kind::BlockDevice && !now.contains_key(*k) && !path_of(o).is_some_and(|p| unread.contains(p))
            })
            .map(|(k, _)| k.clone())
            .collect();
        for k in gone {
            self.last.remove(&k);
            up.retire(k);
        }
        for (k, o) in now {
            self.offer(up, k, o);
        }
    }

    fn offer(&mut self, up: &Updater, k: Key, o: Object) {
        if self.last.get(&k) != Some(&o) {
            self.last.insert(k, o.clone());
            up.submit(o);
        }
    }
}

/// A volume's entry from its record and its reconciler verdict.
pub(crate) fn volume_entry(rec: &StagedVolume, health: Option<&VolumeHealth>) -> VolumeEntry {
    let (access, fs_type) = match &rec.access {
        AccessKind::Block => ("block", None),
        AccessKind::Mount { fs_type, .. } => ("mount", Some(fs_type.clone())),
    };
    let phase = match rec.phase {
        StagePhase::Attaching => "Attaching",
        StagePhase::Formatting => "Formatting",
        StagePhase::Mounting => "Mounting",
        StagePhase::Staged => "Staged",
        StagePhase::Unstaging => "Unstaging",
    };
    let (health, drift, message) = match health {
        None => ("Unknown", vec![], None),
        Some(h) => {
            let drift: Vec<String> = h.drift.iter().map(|d| d.kind().to_string()).collect();
            let state = if h.problem().is_none() { "Healthy" } else { "Drifting" };
            (state, drift, h.problem())
        }
    };
    VolumeEntry {
        id: rec.volume_id.clone(),
        access: access.to_string(),
        fs_type,
        read_only: rec.read_only,
        phase: phase.to_string(),
        device: rec.device_name().map(|n| format!("/dev/{n}")),
        staging_path: rec.staging_path.display().to_string(),
        targets: rec.published.keys().map(|p| p.display().to_string()).collect(),
        health: health.to_string(),
        drift,
        message,
        persistent_volume: None,
        persistent_volume_claim: None,
        pods: vec![],
    }
}

/// Puts what `id` (the volume's identity record) names into its entry:
/// PV, PVC, and its pods (`namespace/name` where known, else the UID).
pub(crate) fn name_entry(e: &mut VolumeEntry, id: &VolumeIdentity) {
    e.persistent_volume = id.persistent_volume.clone();
    e.persistent_volume_claim = id.claim.as_ref().map(|c| objects::ClaimRef { namespace: c.namespace.clone(), name: c.name.clone() });
    e.pods = id
        .pod_uids
        .iter()
        .map(|u| id.pods.iter().find(|p| &p.uid == u).map_or_else(|| u.clone(), |p| format!("{}/{}", p.namespace, p.name)))
        .collect();
}

/// Free space is published in whole GiB: a pool being written to would
/// otherwise change the node object on every tick.
const FREE_GRAIN: u64 = 1 << 30;

/// The pool's size and free space (statvfs); `None` when unreadable.
pub(crate) fn pool(dir: &Path) -> Option<Pool> {
    let s = rustix::fs::statvfs(dir).ok()?;
    let free = s.f_bavail.saturating_mul(s.f_frsize);
    Some(Pool {
        path: dir.display().to_string(),
        capacity_bytes: s.f_blocks.saturating_mul(s.f_frsize),
        available_bytes: free - free % FREE_GRAIN,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use volring_volumes::Drift;

    #[test]
    fn a_volume_entry_says_what_drifts_and_why() {
        let rec = StagedVolume {
            volume_id: "v1".into(),
            image: "/p/v1.img".into(),
            staging_path: "/k/s/v1".into(),
            access: AccessKind::Mount { fs_type: "xfs".into(), flags: vec![] },
            read_only: false,
            phase: StagePhase::Staged,
            loop_number: Some(4),
            published: [("/k/t/v1".into(), false)].into(),
            remote: None,
            attach: Default::default(),
            nbd_index: None,
        };
        let e = volume_entry(&rec, Some(&VolumeHealth { drift: vec![Drift::StagingMissing], ..Default::default() }));
        assert_eq!((e.health.as_str(), e.drift.as_slice()), ("Drifting", &["staging_missing".to_string()][..]));
        assert_eq!(e.device.as_deref(), Some("/dev/loop4"));
        assert!(e.message.unwrap().contains("staging mount is gone"));
        let ok = volume_entry(&rec, Some(&VolumeHealth::default()));
        assert_eq!((ok.health.as_str(), ok.message), ("Healthy", None));
        assert_eq!(volume_entry(&rec, None).health, "Unknown");
    }
}
