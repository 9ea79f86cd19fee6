//! The mount table, indexed by mount id, by mount point and by device.

use std::collections::hash_map::{Entry, RandomState};
use std::collections::HashMap;
use std::hash::BuildHasher;
use std::sync::Arc;

use super::event::{EventKind, MountEvent};
use super::mount::{DevNum, Mount, MountId};
use super::parse::LineError;

/// All mounts of one namespace, from one source (mountinfo or statmount).
///
/// Mounts are shared (`Arc`) so events and snapshots can hold them without
/// copying. A mount point may carry a stack of mounts; the index keeps them
/// in id order, so the top of a stack (the newest) is last.
///
/// The secondary indexes allocate nothing for the common case: the mount
/// point index is keyed by a 64-bit hash of the path (lookups check the path
/// itself), and each entry holds one id inline, spilling to a vector only for
/// stacks and collisions. Building the index this way is what keeps a
/// 20,000-mount resync from being dominated by allocation.
#[derive(Debug, Clone, Default)]
pub struct MountTable {
    by_id: HashMap<MountId, Arc<Mount>>,
    by_point: HashMap<u64, Ids>,
    by_dev: HashMap<DevNum, Ids>,
    hasher: RandomState,
}

/// The ids under one index key, in id order.
#[derive(Debug, Clone)]
enum Ids {
    One(MountId),
    Many(Vec<MountId>),
}

impl Ids {
    fn as_slice(&self) -> &[MountId] {
        match self {
            Ids::One(id) => std::slice::from_ref(id),
            Ids::Many(v) => v,
        }
    }

    fn add(&mut self, id: MountId) {
        match self {
            Ids::One(first) => {
                let mut v = vec![*first];
                let at = v.partition_point(|&x| x < id);
                v.insert(at, id);
                *self = Ids::Many(v);
            }
            Ids::Many(v) => {
                let at = v.partition_point(|&x| x < id);
                v.insert(at, id);
            }
        }
    }

    /// Removes `id`; true when nothing is left.
    fn remove(&mut self, id: MountId) -> bool {
        match self {
            Ids::One(x) => *x == id,
            Ids::Many(v) => {
                v.retain(|&x| x != id);
                match v[..] {
                    [] => true,
                    [only] => {
                        *self = Ids::One(only);
                        false
                    }
                    _ => false,
                }
            }
        }
    }
}

fn index_add<K: std::hash::Hash + Eq>(index: &mut HashMap<K, Ids>, key: K, id: MountId) {
    match index.entry(key) {
        Entry::Occupied(mut e) => e.get_mut().add(id),
        Entry::Vacant(e) => {
            e.insert(Ids::One(id));
        }
    }
}

fn index_remove<K: std::hash::Hash + Eq>(index: &mut HashMap<K, Ids>, key: K, id: MountId) {
    if let Entry::Occupied(mut e) = index.entry(key) {
        if e.get_mut().remove(id) {
            e.remove();
        }
    }
}

impl MountTable {
    pub(crate) fn with_capacity(n: usize) -> Self {
        Self {
            by_id: HashMap::with_capacity(n),
            by_point: HashMap::with_capacity(n),
            by_dev: HashMap::with_capacity(n / 4),
            hasher: RandomState::new(),
        }
    }

    fn point_key(&self, point: &[u8]) -> u64 {
        self.hasher.hash_one(point)
    }

    /// Builds a table from mountinfo bytes. Malformed lines are returned
    /// beside the table, not fatal: one bad line must not hide the others.
    pub fn from_mountinfo(buf: &[u8]) -> (Self, Vec<LineError>) {
        let (mounts, errors) = super::parse::mountinfo_mounts(buf);
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
    pub(crate) fn at<'a>(&'a self, point: &'a [u8]) -> impl Iterator<Item = &'a Arc<Mount>> + 'a {
        let ids = self.by_point.get(&self.point_key(point)).map(Ids::as_slice).unwrap_or(&[]);
        ids.iter().filter_map(|id| self.by_id.get(id)).filter(move |m| m.mount_point() == point)
    }

    /// The visible (topmost) mount on `point`.
    pub fn top_at<'a>(&'a self, point: &'a [u8]) -> Option<&'a Arc<Mount>> {
        self.at(point).last()
    }

    /// Every mount of device `dev`, in id order.
    pub fn on_device(&self, dev: DevNum) -> impl Iterator<Item = &Arc<Mount>> + '_ {
        self.by_dev.get(&dev).map(Ids::as_slice).unwrap_or(&[]).iter().filter_map(|id| self.by_id.get(id))
    }

    /// All mounts in no particular order.
    pub fn iter(&self) -> impl Iterator<Item = &Arc<Mount>> + '_ {
        self.by_id.values()
    }

    /// Inserts or replaces a mount; returns the one it replaced.
    pub(crate) fn insert(&mut self, m: Arc<Mount>) -> Option<Arc<Mount>> {
        let old = self.remove(m.id);
        let key = self.point_key(m.mount_point());
        index_add(&mut self.by_point, key, m.id);
        index_add(&mut self.by_dev, m.dev, m.id);
        self.by_id.insert(m.id, m);
        old
    }

    pub(crate) fn remove(&mut self, id: MountId) -> Option<Arc<Mount>> {
        let m = self.by_id.remove(&id)?;
        let key = self.point_key(m.mount_point());
        index_remove(&mut self.by_point, key, id);
        index_remove(&mut self.by_dev, m.dev, id);
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
        let mut ids: Vec<_> = t2.iter().map(|m| m.id).collect();
        ids.sort_unstable();
        assert_eq!(ids, vec![1, 4]);
    }

    #[test]
    fn stacks_grow_and_shrink_back() {
        let (mut t, _) = MountTable::from_mountinfo(
            b"5 1 0:30 / /s rw - tmpfs a rw\n7 1 0:31 / /s rw - tmpfs b rw\n6 1 0:32 / /s rw - tmpfs c rw\n8 1 0:33 / /other rw - tmpfs d rw\n",
        );
        let ids = |t: &MountTable| t.at(b"/s").map(|m| m.id).collect::<Vec<_>>();
        assert_eq!(ids(&t), vec![5, 6, 7]);
        assert_eq!(t.top_at(b"/s").unwrap().id, 7);
        t.remove(6);
        t.remove(7);
        assert_eq!(ids(&t), vec![5]);
        t.remove(5);
        assert!(ids(&t).is_empty() && t.top_at(b"/s").is_none());
        assert_eq!(t.top_at(b"/other").unwrap().id, 8);
        assert!(t.at(b"/nowhere").next().is_none());
        // Re-inserting a mount under the same id moves it between stacks.
        let moved = t.get(8).unwrap().clone();
        let (again, _) = MountTable::from_mountinfo(b"8 1 0:33 / /s rw - tmpfs d rw\n");
        t.insert(again.get(8).unwrap().clone());
        assert!(t.top_at(b"/other").is_none());
        assert_eq!(t.top_at(b"/s").unwrap().id, moved.id);
    }
}
