//! A report of what a state directory holds — pool volumes, staged records
//! with their phase, device and targets, quarantined records, and anything
//! left half-done — for `volring status` and for operators.
//!
//! Reading only: it changes nothing on disk (no quarantine, no sweep), so it
//! can run beside a live agent, reading the node's store read-only. The one
//! exception is redb's own crash repair of the store, which it runs only
//! when no agent holds the state directory. The one thing it asks the kernel
//! is whether each staged record's loop device still serves its image.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::Serialize;

use super::persist::{self, Quarantined};
use super::pool::{self, IMAGE};
use super::staged::{self, AccessKind, StagePhase};
use super::{attach, Error};

#[derive(Debug, Clone, Serialize)]
pub struct StatusReport {
    pub pool_dir: PathBuf,
    /// The node's store the staged volumes were read from.
    pub store: PathBuf,
    pub volumes: Vec<VolumeStatus>,
    pub staged: Vec<StagedStatus>,
    pub quarantined: Vec<Quarantined>,
    /// Files an agent would quarantine or clean up when it next starts.
    pub problems: Vec<Problem>,
    /// Why the store could not be read, when it could not: the staged
    /// volumes are then what the kernel shows (`from_kernel`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub store_error: Option<String>,
    /// The times the store was lost or damaged and the records rebuilt
    /// from the kernel, as the rebuilding agent recorded them.
    pub recoveries: Vec<crate::store::Recovery>,
    /// Damaged stores set aside in the state directory (kept).
    pub set_aside: Vec<PathBuf>,
    /// The reconciler's last repairs, oldest first
    /// (`crate::state::history`).
    pub repairs: Vec<crate::state::history::RepairEvent>,
}

#[derive(Debug, Clone, Serialize)]
pub struct VolumeStatus {
    pub id: String,
    pub size_bytes: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub fs_type: Option<String>,
    pub created_unix: u64,
    /// Bytes the sparse image really occupies; `None` if it is missing.
    pub allocated_bytes: Option<u64>,
}

#[derive(Debug, Clone, Serialize)]
pub struct StagedStatus {
    pub volume_id: String,
    pub phase: StagePhase,
    /// `block`, or the filesystem type.
    pub access: String,
    pub read_only: bool,
    pub staging_path: PathBuf,
    /// `/dev/loopN`, when the record names a device.
    pub device: Option<PathBuf>,
    /// Whether that device still serves the volume's image.
    pub attached: bool,
    /// Published target paths, each with whether it is read-only.
    pub targets: BTreeMap<PathBuf, bool>,
    /// The reconciler's last verdict on the volume (drift found, repairs
    /// made), when a running agent recorded one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub health: Option<serde_json::Value>,
    /// Read from the kernel, not the store (which could not be read).
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub from_kernel: bool,
}

#[derive(Debug, Clone, Serialize)]
pub struct Problem {
    pub path: PathBuf,
    pub detail: String,
}

/// Reads the pool at `pool_dir` and the node's store in `state_dir`. A
/// directory that does not exist reads as empty. `no_agent`: the caller
/// holds the agent's lock, so a store left unrepaired by a crash may be
/// repaired before it is read.
///
/// A store that cannot be read does not fail the report: it says why
/// (`store_error`), and with `kubelet_root` the staged volumes are read
/// from the kernel instead (`recover::from_kernel`, nothing written).
pub fn report(pool_dir: &Path, state_dir: &Path, kubelet_root: Option<&Path>, no_agent: bool) -> Result<StatusReport, Error> {
    let store = state_dir.join(crate::store::FILE);
    let mut out = StatusReport {
        pool_dir: pool_dir.to_path_buf(),
        store: store.clone(),
        volumes: Vec::new(),
        staged: Vec::new(),
        quarantined: Vec::new(),
        problems: Vec::new(),
        store_error: None,
        recoveries: Vec::new(),
        set_aside: crate::store::set_aside_in(state_dir),
        repairs: Vec::new(),
    };
    if pool_dir.is_dir() {
        out.quarantined.extend(persist::quarantined(pool_dir).map_err(Error::io("list quarantined records", pool_dir))?);
        read_pool(pool_dir, &mut out)?;
    }
    let kernel_only = |out: &mut StatusReport| {
        let Some(root) = kubelet_root else { return 0 };
        let found = crate::recover::from_kernel(pool_dir, root, &|_| false);
        let n = found.adopted.len();
        for r in found.adopted {
            let mut s = staged_status(r, None);
            s.from_kernel = true;
            out.staged.push(s);
        }
        for r in found.refused {
            out.problems.push(Problem { path: root.to_path_buf(), detail: format!("seen in the kernel, not provable: {r}") });
        }
        n
    };
    if !store.exists() && kubelet_root.is_some() {
        // No store, yet the kernel may show staged volumes (a store
        // removed): they are not orphans, and the agent rebuilds them.
        if kernel_only(&mut out) > 0 {
            out.store_error = Some(format!("{} is missing", store.display()));
            out.problems.push(Problem {
                path: store.clone(),
                detail: "missing while the kernel shows staged volumes; the agent rebuilds their records from the kernel at start (`volring recover` shows what it would rebuild)".into(),
            });
        }
    } else if let Err(e) = read_store(&store, no_agent, &mut out) {
        out.store_error = Some(e.to_string());
        out.problems.push(Problem {
            path: store.clone(),
            detail: format!("cannot be read ({e}); the agent sets it aside and rebuilds the records from the kernel at start (`volring recover` shows what it would rebuild)"),
        });
        kernel_only(&mut out);
    }
    for p in &out.set_aside {
        out.problems.push(Problem { path: p.clone(), detail: "a damaged store, set aside (kept for the operator)".into() });
    }
    // Devices serving pool images that no staged record names: orphans.
    for (att, image) in attach::serving_images_in(pool_dir) {
        if !out.staged.iter().any(|s| s.device.as_deref() == Some(att.path().as_path())) {
            out.problems.push(Problem {
                path: att.path(),
                detail: format!(
                    "serves {} with no staged record (`volring recover` shows whether its record can be rebuilt from the kernel; if not, it is an orphan `volring node --remove-orphans` detaches)",
                    image.display()
                ),
            });
        }
    }
    let legacy = state_dir.join(staged::LEGACY_DIR);
    if legacy.is_dir() {
        read_legacy(&legacy, &mut out)?;
        out.quarantined.extend(persist::quarantined(&legacy).map_err(Error::io("list quarantined records", &legacy))?);
    }
    Ok(out)
}

fn read_pool(dir: &Path, out: &mut StatusReport) -> Result<(), Error> {
    let listing = pool::list(dir).map_err(Error::io("list pool", dir))?;
    for id in &listing.records {
        let path = dir.join(format!("{id}{}", pool::META));
        match pool::read_record(&path, id) {
            Ok(m) => {
                let image = dir.join(format!("{id}{IMAGE}"));
                let allocated_bytes = std::fs::metadata(&image).ok().map(|md| std::os::unix::fs::MetadataExt::blocks(&md) * 512);
                if allocated_bytes.is_none() {
                    out.problems.push(Problem { path: image, detail: "the volume's image is missing".into() });
                }
                out.volumes.push(VolumeStatus {
                    id: m.id,
                    size_bytes: m.size_bytes,
                    fs_type: m.fs_type,
                    created_unix: m.created_unix,
                    allocated_bytes,
                });
            }
            Err(detail) => {
                out.problems.push(Problem { path, detail: format!("unreadable record (quarantined at the next start): {detail}") })
            }
        }
    }
    for id in &listing.tombstones {
        out.problems.push(Problem {
            path: dir.join(format!(".{id}{}", pool::TOMBSTONE)),
            detail: "an interrupted delete (finished at the next start)".into(),
        });
    }
    let kept: Vec<&str> = out.quarantined.iter().filter_map(Quarantined::volume_id).collect();
    let orphans: Vec<String> =
        listing.images.iter().filter(|id| !listing.records.contains(id) && !kept.contains(&id.as_str())).cloned().collect();
    for id in orphans {
        out.problems.push(Problem {
            path: dir.join(format!("{id}{IMAGE}")),
            detail: "an image with no record (removed at the next start unless its record is quarantined)".into(),
        });
    }
    Ok(())
}

fn read_store(path: &Path, no_agent: bool, out: &mut StatusReport) -> Result<(), Error> {
    let contents =
        crate::store::Store::read_only(path, no_agent).map_err(|e| Error::Corrupt { path: path.to_path_buf(), detail: e.to_string() })?;
    let health: std::collections::HashMap<String, serde_json::Value> =
        contents.health.iter().filter_map(|(id, b)| Some((id.clone(), serde_json::from_slice(b).ok()?))).collect();
    for (id, bytes) in &contents.volumes {
        match staged::decode(bytes, id) {
            Ok(r) => out.staged.push(staged_status(r, health.get(id).cloned())),
            Err(detail) => out.problems.push(Problem {
                path: PathBuf::from(format!("{}#volumes/{id}", path.display())),
                detail: format!("undecodable record (quarantined at the next start): {detail}"),
            }),
        }
    }
    out.quarantined.extend(contents.quarantined.iter().map(|q| staged::as_quarantined(path, q)));
    out.recoveries = contents.recovered;
    out.repairs = crate::state::history::decode(&contents.repairs);
    Ok(())
}

fn staged_status(r: staged::StagedVolume, health: Option<serde_json::Value>) -> StagedStatus {
    StagedStatus {
        attached: attach::of_record(&r).is_some(),
        device: r.device_name().map(|n| PathBuf::from(format!("/dev/{n}"))),
        access: match &r.access {
            AccessKind::Block => "block".into(),
            AccessKind::Mount { fs_type, .. } => fs_type.clone(),
        },
        volume_id: r.volume_id,
        phase: r.phase,
        read_only: r.read_only,
        staging_path: r.staging_path,
        targets: r.published,
        health,
        from_kernel: false,
    }
}

/// Legacy JSON records not imported yet (the agent imports them at start).
fn read_legacy(dir: &Path, out: &mut StatusReport) -> Result<(), Error> {
    for id in staged::record_ids(dir).map_err(Error::io("list staged records", dir))? {
        let path = dir.join(format!("{id}{}", staged::SUFFIX));
        match staged::read_record(&path, &id) {
            Ok(r) if !out.staged.iter().any(|s| s.volume_id == r.volume_id) => {
                out.problems
                    .push(Problem { path: path.clone(), detail: "a legacy record, imported into the store at the next start".into() });
                out.staged.push(staged_status(r, None));
            }
            Ok(_) => out
                .problems
                .push(Problem { path, detail: "a legacy record for a volume the store holds; set aside at the next start".into() }),
            Err(detail) => {
                out.problems.push(Problem { path, detail: format!("unreadable record (quarantined at the next start): {detail}") })
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{ImagePool, StagedRecords, StagedVolume, VolumeMeta};

    #[test]
    fn reports_without_changing_anything() {
        let d = tempfile::tempdir().unwrap();
        let (pool_dir, state_dir) = (d.path().join("pool"), d.path().to_path_buf());
        let pool = ImagePool::open(&pool_dir).unwrap();
        for id in ["a", "b"] {
            let meta = VolumeMeta {
                id: id.into(),
                name: id.into(),
                size_bytes: 1 << 20,
                fs_type: None,
                parameters: Default::default(),
                created_unix: 1,
                nbd_secret: None,
            };
            pool.create(meta).unwrap();
        }
        let recs = StagedRecords::open(&state_dir).unwrap();
        recs.put(&StagedVolume {
            volume_id: "a".into(),
            image: pool.image_path("a"),
            staging_path: "/k/s".into(),
            access: AccessKind::Block,
            read_only: false,
            phase: StagePhase::Staged,
            loop_number: Some(u32::MAX),
            attach: Default::default(),
            nbd_index: None,
            published: [(PathBuf::from("/k/p"), true)].into(),
            remote: None,
        })
        .unwrap();
        std::fs::write(pool_dir.join("b.json"), b"{").unwrap();
        std::fs::write(pool_dir.join("orphan.img"), b"").unwrap();
        let before: Vec<_> = walk(d.path());
        let r = report(&pool_dir, &state_dir, None, false).unwrap();
        assert_eq!(walk(d.path()), before, "status changes nothing");
        assert_eq!(r.volumes.iter().map(|v| v.id.as_str()).collect::<Vec<_>>(), ["a"]);
        assert_eq!(r.staged.len(), 1);
        assert!(!r.staged[0].attached && r.staged[0].targets.len() == 1);
        assert_eq!(r.problems.len(), 2, "{:?}", r.problems);
        let json = serde_json::to_value(&r).unwrap();
        assert_eq!(json["staged"][0]["phase"], "staged");
        // After a restart the bad record is quarantined and reported so.
        drop(ImagePool::open(&pool_dir).unwrap());
        let r = report(&pool_dir, &state_dir, None, false).unwrap();
        assert_eq!(r.quarantined.len(), 1);
        assert!(r.problems.is_empty(), "{:?}", r.problems);
    }

    fn walk(dir: &Path) -> Vec<PathBuf> {
        let mut v = Vec::new();
        for e in std::fs::read_dir(dir).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                v.extend(walk(&p));
            }
            v.push(p);
        }
        v.sort();
        v
    }
}
