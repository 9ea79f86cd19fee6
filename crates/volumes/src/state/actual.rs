//! The actual state of world: what is really there for each volume, as the
//! engines see it, and the verdict against what was asked for.
//!
//! [`observe`] reads one volume's actual state from the mount watcher's table
//! and the kernel's record of its loop device (one sysfs read), so its cost
//! does not grow with the number of volumes. [`assess`] compares it with the
//! desired record; it is pure, so every case is a unit test. [`HealthView`]
//! publishes the verdicts: readers (NodeGetVolumeStats, metrics) never take a
//! lock a writer holds.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use arc_swap::ArcSwap;
use serde::{Deserialize, Serialize};

use crate::{attach, AccessKind, StagePhase, StagedVolume};
use volring_mounts::MountTable;

/// What is at one path the volume should be mounted on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AtPath {
    /// The volume's own device is mounted there.
    Ours,
    /// Nothing is mounted there.
    Missing,
    /// Something else is mounted there (not volring's to touch).
    Foreign,
}

/// One volume's actual state.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VolumeActual {
    /// The loop device serving the volume's image, if one does.
    pub device: Option<attach::Attachment>,
    pub staging: AtPath,
    pub targets: BTreeMap<PathBuf, AtPath>,
}

/// Reads the actual state of the volume `rec` describes.
pub(crate) fn observe(rec: &StagedVolume, table: &MountTable) -> VolumeActual {
    let device = attach::of_record(rec);
    let staging = at_path(table, &rec.staged_at(), rec, device);
    let targets = rec.published.keys().map(|t| (t.clone(), at_path(table, t, rec, device))).collect();
    VolumeActual { device, staging, targets }
}

/// What the table has on top at `path`, judged against the volume's device.
/// A filesystem is the volume's when its device is the loop device; a bound
/// block device when it is the device node of that loop device (its root
/// in devtmpfs is `/loopN`).
fn at_path(table: &MountTable, path: &Path, rec: &StagedVolume, device: Option<attach::Attachment>) -> AtPath {
    let Some(m) = table.top_at(path.as_os_str().as_encoded_bytes()) else { return AtPath::Missing };
    let Some(att) = device else { return AtPath::Foreign };
    let ours = match rec.access {
        AccessKind::Mount { .. } => m.dev == att.dev,
        AccessKind::Block => m.root() == format!("/loop{}", att.number).as_bytes(),
    };
    if ours {
        AtPath::Ours
    } else {
        AtPath::Foreign
    }
}

/// A difference between desired and actual state.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "kind")]
pub enum Drift {
    /// The loop device serving the image is gone.
    DeviceDetached,
    /// Nothing is mounted at the staging path.
    StagingMissing,
    /// Something not the volume's is mounted at the staging path.
    StagingForeign,
    /// A published target is not mounted (kubelet's to fix: reported only).
    TargetMissing { path: PathBuf },
    /// A published target holds something not the volume's.
    TargetForeign { path: PathBuf },
    /// A stage or unstage was interrupted (the agent died mid-way).
    Interrupted { phase: StagePhase },
}

impl Drift {
    /// A short name, for metrics labels.
    pub fn kind(&self) -> &'static str {
        match self {
            Drift::DeviceDetached => "device_detached",
            Drift::StagingMissing => "staging_missing",
            Drift::StagingForeign => "staging_foreign",
            Drift::TargetMissing { .. } => "target_missing",
            Drift::TargetForeign { .. } => "target_foreign",
            Drift::Interrupted { .. } => "interrupted",
        }
    }
}

/// What the reconciler should do about a volume.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Action {
    None,
    /// Attach (if needed) and mount again with the recorded flags, or
    /// finish an interrupted stage: the stage's own idempotent steps.
    Restage,
    /// Finish an interrupted unstage.
    FinishUnstage,
}

/// Compares a volume's desired record with its actual state.
pub(crate) fn assess(rec: &StagedVolume, actual: &VolumeActual) -> (Vec<Drift>, Action) {
    let mut drift = Vec::new();
    match rec.phase {
        StagePhase::Unstaging => return (vec![Drift::Interrupted { phase: rec.phase }], Action::FinishUnstage),
        StagePhase::Attaching | StagePhase::Formatting | StagePhase::Mounting => {
            return (vec![Drift::Interrupted { phase: rec.phase }], Action::Restage)
        }
        StagePhase::Staged => {}
    }
    if actual.device.is_none() {
        drift.push(Drift::DeviceDetached);
    }
    match actual.staging {
        AtPath::Ours => {}
        AtPath::Missing => drift.push(Drift::StagingMissing),
        AtPath::Foreign if actual.device.is_none() => drift.push(Drift::StagingMissing),
        AtPath::Foreign => drift.push(Drift::StagingForeign),
    }
    for (path, at) in &actual.targets {
        match at {
            AtPath::Ours => {}
            AtPath::Missing => drift.push(Drift::TargetMissing { path: path.clone() }),
            AtPath::Foreign => drift.push(Drift::TargetForeign { path: path.clone() }),
        }
    }
    // A foreign mount on the staging path is never mounted over; a
    // missing device or staging mount is volring's to restore.
    let repairable =
        drift.iter().any(|d| matches!(d, Drift::DeviceDetached | Drift::StagingMissing)) && !drift.contains(&Drift::StagingForeign);
    (drift, if repairable { Action::Restage } else { Action::None })
}

/// A volume as the kernel shows it when asked just now — its paths opened
/// beneath the kubelet root and judged by `statx` of the descriptor, its
/// device asked what backs it — rather than as the mount table says. The
/// table is as old as the last event the watcher handed over (up to its
/// batch window, more under load); a repair or a reported drift must be
/// what the kernel shows, not what the table last heard.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Proof {
    Seen {
        actual: VolumeActual,
        /// A directory between the kubelet root and the staging path that
        /// is itself a mount's root: the path now lies in someone else's
        /// filesystem, and nothing is mounted under it.
        covered: Option<PathBuf>,
    },
    /// Something is between states (a device being detached) or could not
    /// be asked: decide nothing until it settles.
    Unsettled(String),
}

/// What the reconciler may do about a volume whose table view drifts,
/// once the proof is in.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Checked {
    /// The kernel shows what the table shows: report `drift`; take
    /// `action`, unless `blocked` says why not.
    Confirmed { drift: Vec<Drift>, action: Action, blocked: Option<String> },
    /// The kernel shows something else than the table: the watcher has not
    /// caught up (or a device is mid-change). Neither act nor report; look
    /// again once it has.
    Lagging(String),
}

/// Checks the table's view of a volume (`table`) against a proof. Only a
/// drift the proof shows too is reported, and only an action it supports
/// is taken; a repair never mounts under a covered path.
pub(crate) fn check(rec: &StagedVolume, table: &VolumeActual, proof: &Proof) -> Checked {
    let (actual, covered) = match proof {
        Proof::Unsettled(why) => return Checked::Lagging(why.clone()),
        Proof::Seen { actual, covered } => (actual, covered),
    };
    if actual != table {
        return Checked::Lagging(difference(table, actual));
    }
    let (drift, action) = assess(rec, actual);
    match covered {
        Some(dir) if action == Action::Restage => {
            let why = format!("{} is covered by a mount at {}; not repairing under it", rec.staged_at().display(), dir.display());
            Checked::Confirmed { drift, action: Action::None, blocked: Some(why) }
        }
        _ => Checked::Confirmed { drift, action, blocked: None },
    }
}

/// Where the table and the kernel part, for the log.
fn difference(table: &VolumeActual, kernel: &VolumeActual) -> String {
    let mut parts = Vec::new();
    if table.device != kernel.device {
        parts.push(format!(
            "device: table view {:?}, kernel {:?}",
            table.device.map(|a| a.to_string()),
            kernel.device.map(|a| a.to_string())
        ));
    }
    if table.staging != kernel.staging {
        parts.push(format!("staging: table {:?}, kernel {:?}", table.staging, kernel.staging));
    }
    for (path, at) in &kernel.targets {
        let t = table.targets.get(path);
        if t != Some(at) {
            parts.push(format!("target {}: table {t:?}, kernel {at:?}", path.display()));
        }
    }
    parts.join("; ")
}

/// The reconciler's verdict on one volume, as published and stored.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct VolumeHealth {
    /// What differs now (empty: healthy).
    pub drift: Vec<Drift>,
    /// The last repair made, with when (unix seconds).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_repair: Option<Repair>,
    /// Why the last repair attempt failed, if it did.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub repair_error: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Repair {
    pub what: Vec<Drift>,
    pub at_unix: u64,
}

impl VolumeHealth {
    /// A one-line description of what is wrong, for a volume condition.
    pub fn problem(&self) -> Option<String> {
        if self.drift.is_empty() && self.repair_error.is_none() {
            return None;
        }
        let mut parts: Vec<String> = self.drift.iter().map(describe).collect();
        if let Some(e) = &self.repair_error {
            parts.push(format!("repair failed: {e}"));
        }
        Some(parts.join("; "))
    }
}

/// What was repaired, for people: each drift described, `; `-separated.
impl std::fmt::Display for Repair {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.what.iter().map(describe).collect::<Vec<_>>().join("; "))
    }
}

fn describe(d: &Drift) -> String {
    match d {
        Drift::DeviceDetached => "the loop device serving the volume was detached".into(),
        Drift::StagingMissing => "the staging mount is gone".into(),
        Drift::StagingForeign => "something else is mounted on the staging path".into(),
        Drift::TargetMissing { path } => format!("target {} is not mounted", path.display()),
        Drift::TargetForeign { path } => format!("target {} holds a mount that is not the volume's", path.display()),
        Drift::Interrupted { phase } => format!("an operation was interrupted in phase {phase:?}"),
    }
}

type Slots = HashMap<Arc<str>, Arc<ArcSwap<VolumeHealth>>>;

/// Published verdicts. A reader loads a map of per-volume slots and one
/// slot, without a lock; the writer (the reconciler, one thread) replaces a
/// slot's value in O(1) and copies the map only when a volume appears or
/// goes, which a CSI stage or unstage costs far more than.
#[derive(Default)]
pub struct HealthView {
    slots: ArcSwap<Slots>,
    /// Told after verdicts change (the publisher's StorageNode follows it).
    changed: std::sync::OnceLock<Box<dyn Fn() + Send + Sync>>,
}

impl HealthView {
    pub fn get(&self, id: &str) -> Option<Arc<VolumeHealth>> {
        self.slots.load().get(id).map(|s| s.load_full())
    }

    /// Every volume's verdict.
    pub fn all(&self) -> Vec<(Arc<str>, Arc<VolumeHealth>)> {
        self.slots.load().iter().map(|(k, v)| (k.clone(), v.load_full())).collect()
    }

    /// Calls `f` after each change of verdicts (one listener).
    pub fn on_change(&self, f: impl Fn() + Send + Sync + 'static) {
        let _ = self.changed.set(Box::new(f));
    }

    fn notify(&self) {
        if let Some(f) = self.changed.get() {
            f();
        }
    }

    /// Sets many verdicts: existing slots in place, and every new volume in
    /// one copy of the map (a first pass over 10,000 volumes would
    /// otherwise copy it 10,000 times).
    pub fn set_many(&self, verdicts: Vec<(String, VolumeHealth)>) {
        if verdicts.is_empty() {
            return;
        }
        let mut new = Vec::new();
        {
            let slots = self.slots.load();
            for (id, h) in verdicts {
                match slots.get(id.as_str()) {
                    Some(slot) => slot.store(Arc::new(h)),
                    None => new.push((Arc::<str>::from(id), Arc::new(ArcSwap::from_pointee(h)))),
                }
            }
        }
        if !new.is_empty() {
            self.slots.rcu(|m| {
                let mut m = Slots::clone(m);
                m.extend(new.iter().cloned());
                m
            });
        }
        self.notify();
    }

    pub(crate) fn remove(&self, id: &str) {
        if self.slots.load().contains_key(id) {
            self.slots.rcu(|m| {
                let mut m = Slots::clone(m);
                m.remove(id);
                m
            });
            self.notify();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use volring_mounts::DevNum;

    fn rec(phase: StagePhase) -> StagedVolume {
        StagedVolume {
            volume_id: "v".into(),
            image: "/pool/v.img".into(),
            staging_path: "/k/s".into(),
            access: AccessKind::Mount { fs_type: "ext4".into(), flags: vec![] },
            read_only: false,
            phase,
            loop_number: Some(3),
            attach: Default::default(),
            nbd_index: None,
            published: [(PathBuf::from("/k/t"), false)].into(),
            remote: None,
        }
    }

    fn actual(device: bool, staging: AtPath, target: AtPath) -> VolumeActual {
        VolumeActual {
            device: device.then_some(attach::Attachment { number: 3, dev: DevNum { major: 7, minor: 3 }, kind: Default::default() }),
            staging,
            targets: [(PathBuf::from("/k/t"), target)].into(),
        }
    }

    #[test]
    fn healthy_needs_nothing() {
        assert_eq!(assess(&rec(StagePhase::Staged), &actual(true, AtPath::Ours, AtPath::Ours)), (vec![], Action::None));
    }

    #[test]
    fn missing_staging_mount_or_device_is_restaged() {
        let (d, a) = assess(&rec(StagePhase::Staged), &actual(true, AtPath::Missing, AtPath::Ours));
        assert_eq!((d, a), (vec![Drift::StagingMissing], Action::Restage));
        let (d, a) = assess(&rec(StagePhase::Staged), &actual(false, AtPath::Missing, AtPath::Ours));
        assert_eq!((d, a), (vec![Drift::DeviceDetached, Drift::StagingMissing], Action::Restage));
    }

    #[test]
    fn foreign_staging_mount_is_reported_not_touched() {
        let (d, a) = assess(&rec(StagePhase::Staged), &actual(true, AtPath::Foreign, AtPath::Ours));
        assert_eq!((d, a), (vec![Drift::StagingForeign], Action::None));
    }

    #[test]
    fn targets_are_kubelets_reported_only() {
        let (d, a) = assess(&rec(StagePhase::Staged), &actual(true, AtPath::Ours, AtPath::Missing));
        assert_eq!((d, a), (vec![Drift::TargetMissing { path: "/k/t".into() }], Action::None));
    }

    #[test]
    fn interrupted_operations_are_finished() {
        for p in [StagePhase::Attaching, StagePhase::Formatting, StagePhase::Mounting] {
            assert_eq!(assess(&rec(p), &actual(false, AtPath::Missing, AtPath::Missing)).1, Action::Restage);
        }
        assert_eq!(assess(&rec(StagePhase::Unstaging), &actual(true, AtPath::Ours, AtPath::Missing)).1, Action::FinishUnstage);
    }

    fn seen(a: VolumeActual, covered: Option<&str>) -> Proof {
        Proof::Seen { actual: a, covered: covered.map(PathBuf::from) }
    }

    #[test]
    fn a_table_the_kernel_contradicts_decides_nothing() {
        let r = rec(StagePhase::Staged);
        // The table has not seen the stage's mount yet; the kernel has it.
        let stale = actual(true, AtPath::Missing, AtPath::Missing);
        assert!(matches!(check(&r, &stale, &seen(actual(true, AtPath::Ours, AtPath::Ours), None)), Checked::Lagging(_)));
        // The table still has a mount the kernel no longer shows: not
        // reported healthy-but-foreign, not acted on either way.
        let old = actual(true, AtPath::Foreign, AtPath::Ours);
        assert!(matches!(check(&r, &old, &seen(actual(true, AtPath::Missing, AtPath::Ours), None)), Checked::Lagging(_)));
        // A device mid-detach: wait.
        assert!(matches!(check(&r, &stale, &Proof::Unsettled("detaching".into())), Checked::Lagging(_)));
    }

    #[test]
    fn a_proven_drift_is_reported_and_acted_on() {
        let r = rec(StagePhase::Staged);
        let gone = actual(false, AtPath::Missing, AtPath::Ours);
        assert_eq!(
            check(&r, &gone, &seen(gone.clone(), None)),
            Checked::Confirmed { drift: vec![Drift::DeviceDetached, Drift::StagingMissing], action: Action::Restage, blocked: None }
        );
        let target = actual(true, AtPath::Ours, AtPath::Missing);
        assert_eq!(
            check(&r, &target, &seen(target.clone(), None)),
            Checked::Confirmed { drift: vec![Drift::TargetMissing { path: "/k/t".into() }], action: Action::None, blocked: None }
        );
    }

    #[test]
    fn a_covered_staging_path_is_never_mounted_under() {
        let r = rec(StagePhase::Staged);
        let missing = actual(true, AtPath::Missing, AtPath::Ours);
        match check(&r, &missing, &seen(missing.clone(), Some("/k"))) {
            Checked::Confirmed { drift, action: Action::None, blocked: Some(why) } => {
                assert_eq!(drift, vec![Drift::StagingMissing]);
                assert!(why.contains("covered by a mount at /k"), "{why}");
            }
            other => panic!("{other:?}"),
        }
        // Nothing to repair: the cover blocks nothing.
        let foreign = actual(true, AtPath::Foreign, AtPath::Ours);
        assert_eq!(
            check(&r, &foreign, &seen(foreign.clone(), Some("/k"))),
            Checked::Confirmed { drift: vec![Drift::StagingForeign], action: Action::None, blocked: None }
        );
    }

    #[test]
    fn view_publishes_without_locks() {
        let v = HealthView::default();
        assert!(v.get("a").is_none());
        v.set_many(vec![("a".into(), VolumeHealth::default())]);
        let h = VolumeHealth { drift: vec![Drift::StagingMissing], ..Default::default() };
        v.set_many(vec![("a".into(), h.clone())]);
        assert_eq!(*v.get("a").unwrap(), h);
        assert!(v.get("a").unwrap().problem().unwrap().contains("staging"));
        v.remove("a");
        assert!(v.all().is_empty());
    }
}
