//! The mount table, indexed by mount id, by mount point and by device.

use std::collections::HashMap;
use std::sync::Arc;

use super::event::{EventKind, MountEvent};
use super::mount::{DevNum, Mount, MountId};
use super::parse::LineError;

/// All mounts of one namespace, from one source (mountinfo or statmount).
///
/// Mounts are shared (`Arc`) so events and snapshots can hold them without
/// copying. A mount point may carry a stack of mounts; the index keeps them
/// in id order, so the top of a stack (the newest) is last.
#[derive(Debug, Clone, Default)]
pub struct MountTable {
    by_id: HashMap<MountId, Arc<Mount>>,
    by_point: HashMap<Box<[u8]>, Vec<MountId>>,
    by_dev: HashMap<DevNum, Vec<MountId>>,
}

fn unlink(index: &mut Vec<MountId>, id: MountId) -> bool {
    index.retain(|&x| x != id);
    index.is_empty()
}

impl MountTable {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn with_capacity(n: usize) -> Self {
        Self { by_id: HashMap::with_capacity(n), by_point: HashMap::with_capacity(n), by_dev: HashMap::with_capacity(n / 4) }
    }

    /// Builds a table from mountinfo bytes. Malformed lines are returned
    /// beside the table, not fatal: one bad line must not hide the others.
    pub fn from_mountinfo(buf: &[u8]) -> (Self, Vec<LineError>) {
        let (mounts, errors) = super::parse::mounts(buf);
        let mut t = Self::with_capacity(mounts.len());
        for m in mounts {
            t.insert(Arc::new(m));
        }
        (t, errors)
    }

    pub fn len(&self) -> usize {
        self.by_id.len()
    }

    pub fn is_empty(&self) -> bool {
        self.by_id.is_empty()
    }

    pub fn get(&self, id: MountId) -> Option<&Arc<Mount>> {
        self.by_id.get(&id)
    }

    /// Mounts stacked on `point`, bottom first.
    pub fn at(&self, point: &[u8]) -> impl Iterator<Item = &Arc<Mount>> + '_ {
        self.by_point.get(point).into_iter().flatten().filter_map(|id| self.by_id.get(id))
    }

    /// The visible (topmost) mount on `point`.
    pub fn top_at(&self, point: &[u8]) -> Option<&Arc<Mount>> {
        self.at(point).last()
    }

    /// Every mount of device `dev`, in id order.
    pub fn on_device(&self, dev: DevNum) -> impl Iterator<Item = &Arc<Mount>> + '_ {
        self.by_dev.get(&dev).into_iter().flatten().filter_map(|id| self.by_id.get(id))
    }

    /// All mounts in no particular order.
    pub fn iter(&self) -> impl Iterator<Item = &Arc<Mount>> + '_ {
        self.by_id.values()
    }

    /// All mounts in id order (stable output for people and tests).
    pub fn sorted(&self) -> Vec<&Arc<Mount>> {
        let mut v: Vec<_> = self.by_id.values().collect();
        v.sort_unstable_by_key(|m| m.id);
        v
    }

    /// Inserts or replaces a mount; returns the one it replaced.
    pub fn insert(&mut self, m: Arc<Mount>) -> Option<Arc<Mount>> {
        let old = self.remove(m.id);
        let ids = self.by_point.entry(m.mount_point().into()).or_default();
        let at = ids.partition_point(|&x| x < m.id);
        ids.insert(at, m.id);
        let ids = self.by_dev.entry(m.dev).or_default();
        let at = ids.partition_point(|&x| x < m.id);
        ids.insert(at, m.id);
        self.by_id.insert(m.id, m);
        old
    }

    pub fn remove(&mut self, id: MountId) -> Option<Arc<Mount>> {
        let m = self.by_id.remove(&id)?;
        if let Some(ids) = self.by_point.get_mut(m.mount_point()) {
            if unlink(ids, id) {
                self.by_point.remove(m.mount_point());
            }
        }
        if let Some(ids) = self.by_dev.get_mut(&m.dev) {
            if unlink(ids, id) {
                self.by_dev.remove(&m.dev);
            }
        }
        Some(m)
    }

    /// Applies an event, so a consumer can keep its own copy of the table
    /// from the initial snapshot and the event stream.
    pub fn apply(&mut self, e: &MountEvent) {
        match e.kind {
            EventKind::Detached => {
                self.remove(e.id);
            }
            EventKind::Attached | EventKind::Moved | EventKind::Changed => {
                if let Some(m) = &e.mount {
                    self.insert(m.clone());
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const INFO: &[u8] = b"1 0 0:1 / / rw - rootfs rootfs rw
2 1 7:0 / /data rw - ext4 /dev/loop0 rw
3 1 0:30 / /data rw - tmpfs tmpfs rw
4 1 7:0 /sub /bind rw - ext4 /dev/loop0 rw
";

    #[test]
    fn indexes_by_id_point_and_device() {
        let (t, errs) = MountTable::from_mountinfo(INFO);
        assert!(errs.is_empty());
        assert_eq!(t.len(), 4);
        assert_eq!(t.at(b"/data").map(|m| m.id).collect::<Vec<_>>(), vec![2, 3]);
        assert_eq!(t.top_at(b"/data").unwrap().id, 3);
        let loop0 = DevNum { major: 7, minor: 0 };
        assert_eq!(t.on_device(loop0).map(|m| m.id).collect::<Vec<_>>(), vec![2, 4]);
        let mut t2 = t.clone();
        t2.remove(3);
        assert_eq!(t2.top_at(b"/data").unwrap().id, 2);
        t2.remove(2);
        assert!(t2.top_at(b"/data").is_none());
        assert_eq!(t2.on_device(loop0).count(), 1);
        assert_eq!(t2.sorted().iter().map(|m| m.id).collect::<Vec<_>>(), vec![1, 4]);
    }
}
