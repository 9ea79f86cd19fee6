//! What a lagging consumer has not yet taken, folded into one net diff.
//!
//! Bounded by the number of distinct mounts touched while the consumer lags:
//! a mount that comes and goes meanwhile nets out and is forgotten.

use std::collections::HashMap;
use std::sync::Arc;

use crate::event::{EventKind, MountEvent};
use crate::mount::{Mount, MountId};

/// A mount's state: `None` = not in the table; `Some(None)` = present but
/// never read (it vanished before statmount could see it).
type State = Option<Option<Arc<Mount>>>;

struct Entry {
    before: State,
    now: State,
}

#[derive(Default)]
pub(super) struct Backlog {
    order: Vec<MountId>,
    entries: HashMap<MountId, Entry>,
}

impl Backlog {
    pub(super) fn is_empty(&self) -> bool {
        self.entries.is_empty() && self.order.is_empty()
    }

    pub(super) fn add(&mut self, e: MountEvent) {
        // A move to a place never seen carries no state; the net diff shows
        // where the mount is now.
        if e.kind == EventKind::Moved && e.mount.is_none() {
            return;
        }
        let entry = self.entries.entry(e.id).or_insert_with(|| {
            self.order.push(e.id);
            let before = match e.kind {
                EventKind::Attached => None,
                EventKind::Detached => Some(e.mount.clone()),
                EventKind::Moved | EventKind::Changed => Some(e.previous.clone()),
            };
            Entry { now: before.clone(), before }
        });
        entry.now = match e.kind {
            EventKind::Detached => None,
            _ => Some(e.mount),
        };
        if entry.before.is_none() && entry.now.is_none() {
            self.entries.remove(&e.id);
            if self.order.len() > 64 && self.order.len() > 2 * self.entries.len() {
                let entries = &self.entries;
                self.order.retain(|id| entries.contains_key(id));
            }
        }
    }

    /// The net change since the consumer last kept up, in first-seen order.
    pub(super) fn take(&mut self) -> Vec<MountEvent> {
        let mut out = Vec::new();
        for id in self.order.drain(..) {
            let Some(e) = self.entries.remove(&id) else {
                continue;
            };
            match (e.before, e.now) {
                (None, None) => {}
                (None, Some(m)) | (Some(None), Some(m)) => out.push(MountEvent::attached(id, m)),
                (Some(p), None) => out.push(MountEvent::detached(id, p)),
                (Some(Some(p)), Some(Some(m))) => out.extend(MountEvent::between(&p, &m)),
                (Some(Some(_)), Some(None)) => out.push(MountEvent::attached(id, None)),
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::event::Changes;
    use crate::MountTable;

    #[test]
    fn nets_out_transient_mounts_and_folds_changes() {
        let (t, _) = MountTable::from_mountinfo(b"2 1 0:20 / /a rw - tmpfs tmpfs rw\n3 1 0:21 / /b rw - tmpfs tmpfs rw\n");
        let (t2, _) = MountTable::from_mountinfo(b"2 1 0:20 / /a2 ro - tmpfs tmpfs ro\n");
        let a = t.get(2).unwrap().clone();
        let a2 = t2.get(2).unwrap().clone();
        let b = t.get(3).unwrap().clone();
        let mut bl = Backlog::default();
        for i in 100..300 {
            bl.add(MountEvent::attached(i, None));
            bl.add(MountEvent::detached(i, None));
        }
        bl.add(MountEvent::between(&a, &a2).unwrap());
        bl.add(MountEvent::detached(3, Some(b.clone())));
        bl.add(MountEvent::attached(9, Some(b.clone())));
        assert!(bl.order.len() < 100, "transient ids are compacted away");
        let net = bl.take();
        let kinds: Vec<_> = net.iter().map(|e| (e.kind, e.id)).collect();
        assert_eq!(kinds, vec![(EventKind::Moved, 2), (EventKind::Detached, 3), (EventKind::Attached, 9)]);
        assert!(bl.is_empty());
    }

    #[test]
    fn moves_never_seen_leave_the_net_diff_alone() {
        let (t, _) = MountTable::from_mountinfo(b"2 1 0:20 / /a rw - tmpfs tmpfs rw\n");
        let (t2, _) = MountTable::from_mountinfo(b"2 1 0:20 / /c rw - tmpfs tmpfs rw\n");
        let (a, c) = (t.get(2).unwrap().clone(), t2.get(2).unwrap().clone());
        let unseen =
            MountEvent { kind: EventKind::Moved, id: 2, mount: None, previous: None, changes: Changes::MOUNT_POINT, devices: Vec::new() };
        let mut bl = Backlog::default();
        bl.add(unseen.clone());
        assert!(bl.is_empty(), "a move with no state is no diff");
        bl.add(unseen);
        bl.add(MountEvent::between(&a, &c).unwrap());
        let net = bl.take();
        assert_eq!(net.len(), 1);
        assert_eq!(net[0].mount.as_ref().map(|m| m.mount_point().to_vec()), Some(b"/c".to_vec()));
        assert_eq!(net[0].previous.as_ref().map(|m| m.mount_point().to_vec()), Some(b"/a".to_vec()));
    }
}
