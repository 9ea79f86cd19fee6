//! What the mount watcher tells its consumers.

use std::sync::Arc;

use serde::Serialize;

use super::mount::{DevNum, Mount, MountId};

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum EventKind {
    Detached,
    Moved,
    Changed,
    Attached,
}

bitflags::bitflags! {
    /// Which attributes of a mount changed. In JSON, an array of their
    /// names: `["options", "propagation"]`.
    #[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
    pub struct Changes: u16 {
        const MOUNT_POINT = 1 << 0;
        const PARENT = 1 << 1;
        const OPTIONS = 1 << 2;
        const SUPER_OPTIONS = 1 << 3;
        const PROPAGATION = 1 << 4;
        const SOURCE = 1 << 5;
        const ROOT = 1 << 6;
        const FS_TYPE = 1 << 7;
        const DEVICE = 1 << 8;
    }
}

impl Serialize for Changes {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeSeq;
        let mut seq = s.serialize_seq(Some(self.iter().count()))?;
        for (name, _) in self.iter_names() {
            seq.serialize_element(&name.to_ascii_lowercase())?;
        }
        seq.end()
    }
}

impl Changes {
    /// What differs between two states of one mount.
    pub(crate) fn between(a: &Mount, b: &Mount) -> Self {
        let mut c = Changes::empty();
        c.set(Changes::MOUNT_POINT, a.mount_point() != b.mount_point());
        c.set(Changes::PARENT, a.parent != b.parent);
        c.set(Changes::OPTIONS, a.options() != b.options());
        c.set(Changes::SUPER_OPTIONS, a.super_options() != b.super_options());
        c.set(Changes::PROPAGATION, a.propagation != b.propagation);
        c.set(Changes::SOURCE, a.source() != b.source());
        c.set(Changes::ROOT, a.root() != b.root());
        c.set(Changes::FS_TYPE, a.fs_type() != b.fs_type());
        c.set(Changes::DEVICE, a.dev != b.dev);
        c
    }

    /// A change of place is a move; anything else is a change.
    pub(crate) fn kind(self) -> EventKind {
        if self.intersects(Changes::MOUNT_POINT | Changes::PARENT) {
            EventKind::Moved
        } else {
            EventKind::Changed
        }
    }
}

/// A block device a mount event touches, resolved through sysfs.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct BlockDevice {
    #[serde(rename = "maj:min")]
    pub dev: DevNum,
    /// Kernel name (`loop0`, `nvme0n1p2`); `None` when sysfs has no entry.
    pub name: Option<String>,
    /// The device node (`/dev/loop0`).
    pub path: Option<String>,
}

/// One change to one mount.
#[derive(Debug, Clone, Serialize)]
pub struct MountEvent {
    #[serde(rename = "event")]
    pub kind: EventKind,
    pub id: MountId,
    /// The mount after the change, or the last known state of a detached
    /// mount. `None` when the mount was gone before it could be read (a mount
    /// attached and detached between two looks: both are still reported),
    /// and for a `moved` whose destination the mount had already left when
    /// it was read (each kernel move is reported; the id's last event holds
    /// its state).
    pub mount: Option<Arc<Mount>>,
    /// The state before, for moves and changes.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub previous: Option<Arc<Mount>>,
    #[serde(skip_serializing_if = "Changes::is_empty")]
    pub changes: Changes,
    pub devices: Vec<BlockDevice>,
}

impl MountEvent {
    pub(crate) fn attached(id: MountId, mount: Option<Arc<Mount>>) -> Self {
        Self { kind: EventKind::Attached, id, mount, previous: None, changes: Changes::empty(), devices: Vec::new() }
    }

    pub(crate) fn detached(id: MountId, mount: Option<Arc<Mount>>) -> Self {
        Self { kind: EventKind::Detached, id, mount, previous: None, changes: Changes::empty(), devices: Vec::new() }
    }

    /// The event that takes `old` to `new`, or `None` when nothing differs.
    pub(crate) fn between(old: &Arc<Mount>, new: &Arc<Mount>) -> Option<Self> {
        let changes = Changes::between(old, new);
        (!changes.is_empty()).then(|| Self {
            kind: changes.kind(),
            id: new.id,
            mount: Some(new.clone()),
            previous: Some(old.clone()),
            changes,
            devices: Vec::new(),
        })
    }

    /// The mount this event is about (new state, else previous).
    pub fn subject(&self) -> Option<&Arc<Mount>> {
        self.mount.as_ref().or(self.previous.as_ref())
    }
}

/// Why the watcher sent a batch instead of single events.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ResyncReason {
    /// The kernel's fanotify queue overflowed; the table was re-read.
    Overflow,
    /// The consumer fell behind; what it missed is folded into one diff.
    ConsumerLagged,
}

/// What the watcher delivers.
#[derive(Debug, Clone)]
pub enum WatchEvent {
    Mount(MountEvent),
    Resync { reason: ResyncReason, changes: Vec<MountEvent> },
}

/// A mount event as itself; a resync as `{"event":"resync","reason":..,
/// "changes":[..]}`, so a JSON reader tells them apart by `event`.
impl Serialize for WatchEvent {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeStruct;
        match self {
            WatchEvent::Mount(e) => e.serialize(s),
            WatchEvent::Resync { reason, changes } => {
                let mut st = s.serialize_struct("Resync", 3)?;
                st.serialize_field("event", "resync")?;
                st.serialize_field("reason", reason)?;
                st.serialize_field("changes", changes)?;
                st.end()
            }
        }
    }
}

impl WatchEvent {
    pub(crate) fn resync(reason: ResyncReason, changes: Vec<MountEvent>) -> Self {
        WatchEvent::Resync { reason, changes }
    }

    /// The single events this delivery stands for.
    pub fn changes(&self) -> &[MountEvent] {
        match self {
            WatchEvent::Mount(e) => std::slice::from_ref(e),
            WatchEvent::Resync { changes, .. } => changes,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A consumer reads the changed attributes as a list, not as bitflags'
    /// `"OPTIONS | PROPAGATION"` text.
    #[test]
    fn changes_serialize_as_an_array_of_names() {
        let c = Changes::OPTIONS | Changes::PROPAGATION;
        assert_eq!(serde_json::to_string(&c).unwrap(), r#"["options","propagation"]"#);
        assert_eq!(serde_json::to_string(&Changes::MOUNT_POINT).unwrap(), r#"["mount_point"]"#);
        assert_eq!(serde_json::to_string(&Changes::empty()).unwrap(), "[]");
    }

    /// `volring mounts --watch --json` readers tell a resync by its `event`.
    #[test]
    fn a_resync_serializes_with_its_event_tag() {
        let resync = WatchEvent::resync(ResyncReason::Overflow, Vec::new());
        assert_eq!(serde_json::to_string(&resync).unwrap(), r#"{"event":"resync","reason":"overflow","changes":[]}"#);
    }
}
