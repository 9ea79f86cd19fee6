//! The agent's side of the publisher: turns the inventory and the volumes'
//! records and verdicts into objects, and hands the updater only those that
//! changed since the last hand-over (the updater coalesces and compares
//! with what is stored; this keeps a relink of 1,000 unchanged devices from
//! costing 1,000 submissions).

use std::collections::HashMap;
use std::path::Path;

use super::objects::{self, Key, Object, Pool, VolumeEntry};
use super::updater::Updater;
use crate::devices::Inventory;
use crate::state::actual::VolumeHealth;
use crate::volumes::{AccessKind, StagePhase, StagedVolume};

/// What was last handed to the updater, per object.
#[derive(Default)]
pub struct Feed {
    last: HashMap<Key, Object>,
}

impl Feed {
    /// Every object of `node` now: its devices and the StorageNode.
    pub fn initial(inventory: &Inventory, node: &str, storage_node: Object) -> Vec<Object> {
        let mut v: Vec<Object> = inventory.devices.values().filter(|d| !d.id.is_empty()).map(|d| objects::block_device(d, node)).collect();
        v.push(storage_node);
        v
    }

    /// Remembers the objects the updater started with.
    pub fn seed(&mut self, objs: &[Object]) {
        self.last.extend(objs.iter().map(|o| (o.key.clone(), o.clone())));
    }

    /// Submits the devices that changed and retires those that are gone.
    pub fn devices(&mut self, up: &Updater, inventory: &Inventory, node: &str) {
        let mut now: HashMap<Key, Object> = HashMap::with_capacity(inventory.devices.len());
        for d in inventory.devices.values().filter(|d| !d.id.is_empty()) {
            let o = objects::block_device(d, node);
            now.insert(o.key.clone(), o);
        }
        let gone: Vec<Key> = self.last.keys().filter(|k| k.kind == objects::Kind::BlockDevice && !now.contains_key(*k)).cloned().collect();
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
pub fn volume_entry(rec: &StagedVolume, health: Option<&VolumeHealth>) -> VolumeEntry {
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
    }
}

/// Free space is published in whole GiB: a pool being written to would
/// otherwise change the node object on every tick.
const FREE_GRAIN: u64 = 1 << 30;

/// The pool's size and free space (statvfs); `None` when unreadable.
pub fn pool(dir: &Path) -> Option<Pool> {
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
    use crate::state::actual::Drift;

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
