//! One volume, one name: everything the node knows that names a staged
//! volume — its CSI id, its kernel device, its staging path and targets,
//! the pods kubelet published it for — and, with a cluster, its PV, PVC
//! and pods' names. The record is derived from the CSI driver's own
//! records (so it follows every stage, publish, unpublish and unstage),
//! and the cluster's names are filled in from a cache the agent keeps;
//! with no cluster they stay empty and nothing else changes.
//!
//! Kubelet puts the pod's UID and the PV's name in the paths it hands the
//! driver, so both are known without a cluster:
//!
//! - a filesystem target: `<root>/pods/<pod-uid>/volumes/kubernetes.io~csi/<pv>/mount`;
//! - a block target: `<root>/plugins/kubernetes.io/csi/volumeDevices/publish/<pv>/<pod-uid>`
//!   (older kubelets: `<root>/pods/<pod-uid>/volumeDevices/kubernetes.io~csi/<pv>`);
//! - a block staging path: `<root>/plugins/kubernetes.io/csi/volumeDevices/staging/<pv>`;
//!   a filesystem staging path names the PV only on old kubelets
//!   (`.../kubernetes.io/csi/pv/<pv>/globalmount`), newer ones use a hash.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Component, Path, PathBuf};

use serde::Serialize;

use super::staged::{AccessKind, StagedVolume};

/// Longest pod UID accepted from a path (a UUID is 36).
const MAX_UID: usize = 64;
/// Longest PV name accepted from a path (a DNS subdomain).
const MAX_NAME: usize = 253;

/// A PVC, by namespace and name.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Serialize)]
pub struct ClaimRef {
    pub namespace: String,
    pub name: String,
}

/// A pod, by UID, namespace and name.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Serialize)]
pub struct PodRef {
    pub uid: String,
    pub namespace: String,
    pub name: String,
}

/// The identity record of one staged volume.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct VolumeIdentity {
    pub volume_id: String,
    /// The kernel name of the device the volume is on (`loop3`, `nbd0`);
    /// `None` while the stage has not attached one yet. A volume is on one
    /// device.
    pub device: Option<String>,
    pub staging_path: PathBuf,
    /// Published targets, sorted.
    pub targets: Vec<PathBuf>,
    /// The UIDs of the pods the targets belong to, sorted and unique.
    pub pod_uids: Vec<String>,
    /// `true` for a raw block volume (no filesystem of its own to report).
    pub block: bool,
    /// The filesystem type asked for, for a filesystem volume.
    pub fs_type: Option<String>,
    /// The PV: from kubelet's paths, else from the cluster.
    pub persistent_volume: Option<String>,
    /// The PVC the PV is bound to (cluster only).
    pub claim: Option<ClaimRef>,
    /// The pods of `pod_uids` the cluster named, sorted by UID.
    pub pods: Vec<PodRef>,
}

impl VolumeIdentity {
    /// The volume `v` describes, with what the cluster said of it in
    /// `names`.
    pub fn named(v: &StagedVolume, names: &ClusterNames) -> Self {
        let mut i = Self::from_staged(v);
        i.name_with(names);
        i
    }

    /// The record as the CSI driver's record shows it (no cluster names).
    fn from_staged(v: &StagedVolume) -> Self {
        let targets: Vec<PathBuf> = v.published.keys().cloned().collect();
        let mut uids = BTreeSet::new();
        let mut pv = pv_of_staging(&v.staging_path);
        for t in &targets {
            if let Some((uid, name)) = pod_of_target(t) {
                uids.insert(uid);
                pv = pv.or(name);
            }
        }
        let (block, fs_type) = match &v.access {
            AccessKind::Block => (true, None),
            AccessKind::Mount { fs_type, .. } => (false, Some(fs_type.clone()).filter(|t| !t.is_empty())),
        };
        Self {
            volume_id: v.volume_id.clone(),
            device: v.device_name(),
            staging_path: v.staging_path.clone(),
            targets,
            pod_uids: uids.into_iter().collect(),
            block,
            fs_type,
            persistent_volume: pv,
            claim: None,
            pods: Vec::new(),
        }
    }

    /// Fills in what the cluster said (leaves what it did not say as it is).
    fn name_with(&mut self, names: &ClusterNames) {
        if self.persistent_volume.is_none() {
            self.persistent_volume = names.volume_pv.get(&self.volume_id).cloned();
        }
        if let Some(pv) = &self.persistent_volume {
            self.claim = names.claims.get(pv).cloned();
        }
        self.pods = self.pod_uids.iter().filter_map(|u| names.pods.get(u).cloned()).collect();
    }

    /// The labels kubelet gives a volume's metrics, from what the cluster
    /// said (each "" when it said nothing).
    pub fn labels(&self) -> KubeletLabels<'_> {
        let pods: BTreeSet<&str> = self.pods.iter().map(|p| p.name.as_str()).collect();
        KubeletLabels {
            persistentvolumeclaim: self.claim.as_ref().map_or("", |c| c.name.as_str()),
            namespace: self.claim.as_ref().map_or("", |c| c.namespace.as_str()),
            pod: pods.into_iter().collect::<Vec<_>>().join(","),
        }
    }
}

/// A volume's labels as kubelet names them, for metric series that join
/// kubelet's own.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KubeletLabels<'a> {
    /// The PVC's name.
    pub persistentvolumeclaim: &'a str,
    /// The PVC's namespace.
    pub namespace: &'a str,
    /// The pods' names, comma-joined (a volume published to several pods
    /// of the node keeps one series).
    pub pod: String,
}

/// What the cluster told about this node's volumes, as the agent caches it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ClusterNames {
    /// CSI volume id → PV name (from the PVs' `spec.csi.volumeHandle`).
    pub volume_pv: BTreeMap<String, String>,
    /// PV name → the PVC it is bound to.
    pub claims: BTreeMap<String, ClaimRef>,
    /// Pod UID → pod.
    pub pods: BTreeMap<String, PodRef>,
}

/// The records of every staged volume, named with `names`.
pub fn identities(staged: &[StagedVolume], names: &ClusterNames) -> Vec<VolumeIdentity> {
    let mut v: Vec<VolumeIdentity> = staged.iter().map(|s| VolumeIdentity::named(s, names)).collect();
    v.sort_by(|a, b| a.volume_id.cmp(&b.volume_id));
    v
}

fn normal(p: &Path) -> Option<Vec<&str>> {
    p.components()
        .filter_map(|c| match c {
            Component::Normal(s) => Some(s.to_str()),
            _ => None,
        })
        .collect()
}

fn uid_ok(s: &str) -> bool {
    !s.is_empty() && s.len() <= MAX_UID && s.bytes().all(|b| b.is_ascii_hexdigit() || b == b'-')
}

fn name_ok(s: &str) -> bool {
    !s.is_empty() && s.len() <= MAX_NAME && s.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'.' || b == b'-')
}

/// The pod UID (and the PV name, when the path has it) in a kubelet publish
/// target; `None` for a path of any other shape.
pub fn pod_of_target(target: &Path) -> Option<(String, Option<String>)> {
    let c = normal(target)?;
    // `.../pods/<uid>/volumes/kubernetes.io~csi/<pv>/mount` and the old
    // block layout `.../pods/<uid>/volumeDevices/kubernetes.io~csi/<pv>`.
    if let Some(i) = c.windows(3).rposition(|w| w[0] == "pods" && uid_ok(w[1]) && matches!(w[2], "volumes" | "volumeDevices")) {
        let pv = match c.get(i + 3..) {
            Some([plugin, pv, ..]) if *plugin == "kubernetes.io~csi" && name_ok(pv) => Some(pv.to_string()),
            _ => None,
        };
        return Some((c[i + 1].to_string(), pv));
    }
    // `.../volumeDevices/publish/<pv>/<uid>`.
    match c.as_slice() {
        [.., "volumeDevices", "publish", pv, uid] if uid_ok(uid) => Some((uid.to_string(), Some(pv.to_string()).filter(|p| name_ok(p)))),
        _ => None,
    }
}

/// The PV name in a kubelet staging path, when the path has it.
pub(crate) fn pv_of_staging(staging: &Path) -> Option<String> {
    let c = normal(staging)?;
    let pv = match c.as_slice() {
        [.., "volumeDevices", "staging", pv] => *pv,
        [.., "csi", "pv", pv, "globalmount"] => *pv,
        _ => return None,
    };
    name_ok(pv).then(|| pv.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::staged::{AttachKind, StagePhase};

    const UID: &str = "0b9a6f8e-5c3d-4e7a-9f1b-2c4d6e8fa0b1";

    fn staged(access: AccessKind, staging: &str, targets: &[&str]) -> StagedVolume {
        StagedVolume {
            volume_id: "vol-1".into(),
            image: "/pool/vol-1.img".into(),
            staging_path: staging.into(),
            access,
            read_only: false,
            phase: StagePhase::Staged,
            loop_number: Some(7),
            attach: AttachKind::Loop,
            nbd_index: None,
            published: targets.iter().map(|t| (PathBuf::from(t), false)).collect(),
            remote: None,
        }
    }

    #[test]
    fn filesystem_targets_name_the_pod_and_the_pv() {
        let t = format!("/var/lib/kubelet/pods/{UID}/volumes/kubernetes.io~csi/pvc-1234/mount");
        assert_eq!(pod_of_target(Path::new(&t)), Some((UID.to_string(), Some("pvc-1234".to_string()))));
        let mount = AccessKind::Mount { fs_type: "ext4".into(), flags: vec![] };
        let i = VolumeIdentity::from_staged(&staged(mount, "/var/lib/kubelet/plugins/kubernetes.io/csi/volring.io/abc/globalmount", &[&t]));
        assert_eq!(i.pod_uids, vec![UID.to_string()]);
        assert_eq!(i.persistent_volume.as_deref(), Some("pvc-1234"));
        assert_eq!(i.device.as_deref(), Some("loop7"));
        assert_eq!((i.block, i.fs_type.as_deref()), (false, Some("ext4")));
        let l = i.labels();
        assert_eq!((l.persistentvolumeclaim, l.namespace, l.pod.as_str()), ("", "", ""));
    }

    #[test]
    fn block_targets_both_layouts() {
        let new = format!("/k/plugins/kubernetes.io/csi/volumeDevices/publish/pvc-b/{UID}");
        assert_eq!(pod_of_target(Path::new(&new)), Some((UID.to_string(), Some("pvc-b".to_string()))));
        let old = format!("/k/pods/{UID}/volumeDevices/kubernetes.io~csi/pvc-b");
        assert_eq!(pod_of_target(Path::new(&old)), Some((UID.to_string(), Some("pvc-b".to_string()))));
        assert_eq!(pv_of_staging(Path::new("/k/plugins/kubernetes.io/csi/volumeDevices/staging/pvc-b")), Some("pvc-b".into()));
        assert_eq!(pv_of_staging(Path::new("/k/plugins/kubernetes.io/csi/pv/pvc-m/globalmount")), Some("pvc-m".into()));
    }

    #[test]
    fn other_paths_name_nothing() {
        for p in [
            "/mnt/x",
            "/k/pods/not a uid/volumes/kubernetes.io~csi/pv/mount",
            "/k/pods//volumes",
            "/k/plugins/kubernetes.io/csi/volumeDevices/publish/pvc-b/Not-Hex!",
        ] {
            assert_eq!(pod_of_target(Path::new(p)), None, "{p}");
        }
        let long = format!("/k/pods/{}/volumes/kubernetes.io~csi/pv/mount", "a".repeat(MAX_UID + 1));
        assert_eq!(pod_of_target(Path::new(&long)), None);
        // A PV name that is no DNS subdomain is left out, the pod is kept.
        let bad_pv = format!("/k/pods/{UID}/volumes/kubernetes.io~csi/PV_X/mount");
        assert_eq!(pod_of_target(Path::new(&bad_pv)), Some((UID.to_string(), None)));
        assert_eq!(pv_of_staging(Path::new("/k/plugins/kubernetes.io/csi/volring.io/abc/globalmount")), None);
    }

    #[test]
    fn cluster_names_fill_the_labels() {
        let t1 = format!("/k/pods/{UID}/volumes/kubernetes.io~csi/pvc-1/mount");
        let other = "1b9a6f8e-5c3d-4e7a-9f1b-2c4d6e8fa0b1";
        let t2 = format!("/k/pods/{other}/volumes/kubernetes.io~csi/pvc-1/mount");
        let mount = AccessKind::Mount { fs_type: "xfs".into(), flags: vec![] };
        let mut names = ClusterNames::default();
        names.claims.insert("pvc-1".into(), ClaimRef { namespace: "shop".into(), name: "data".into() });
        for (uid, name) in [(UID, "web-1"), (other, "web-0")] {
            names.pods.insert(uid.into(), PodRef { uid: uid.into(), namespace: "shop".into(), name: name.into() });
        }
        let v = identities(&[staged(mount, "/k/s", &[&t1, &t2])], &names);
        let l = v[0].labels();
        assert_eq!((l.persistentvolumeclaim, l.namespace), ("data", "shop"));
        assert_eq!(l.pod, "web-0,web-1");
        // Without a PV in the paths, the cluster's volumeHandle index names it.
        let mut s = staged(AccessKind::Block, "/k/s", &[]);
        s.volume_id = "handle-9".into();
        names.volume_pv.insert("handle-9".into(), "pvc-1".into());
        let v = identities(&[s], &names);
        assert_eq!((v[0].persistent_volume.as_deref(), v[0].labels().persistentvolumeclaim), (Some("pvc-1"), "data"));
        assert!(v[0].block);
    }
}
