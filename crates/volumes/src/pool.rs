//! The image pool: one sparse file per volume plus a small JSON record of
//! what was asked for, in one directory.
//!
//! The records are also held in memory (a `BTreeMap` by id), so listing and
//! paging thousands of volumes reads no files; the files are the durable
//! copy, written crash-safe.
//!
//! Every step that changes the pool is ordered so that a crash between any
//! two steps leaves something [`ImagePool::open`] recognises and finishes:
//!
//! - create: temporary image → image placed → record. A crash before the
//!   record leaves an image nobody was told about: open removes it.
//! - delete: image renamed to a tombstone → record removed → tombstone
//!   removed. Once the tombstone exists the data is on its way out whatever
//!   happens next; open finishes the delete (record and tombstone).
//! - a record that cannot be read is quarantined ([`super::persist`]) and
//!   its image kept: the volume is unknown to the CO's calls until an
//!   operator looks, but its data is never collected as an orphan.

use std::collections::{BTreeMap, BTreeSet};
use std::fs::{self, File, OpenOptions};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::RwLock;

use serde::{Deserialize, Serialize};

use super::persist::{self, remove_durable, sweep_temporaries, sync_dir, write_atomic, Quarantined};
use super::{attach, Error};
use crate::fault;

/// What the pool remembers of one volume.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct VolumeMeta {
    pub id: String,
    /// The name the CO created it with (the idempotency key).
    pub name: String,
    pub size_bytes: u64,
    /// `fsType` from the create parameters, when one was given.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fs_type: Option<String>,
    #[serde(default)]
    pub parameters: BTreeMap<String, String>,
    pub created_unix: u64,
    /// For an nbd volume this node exports to others: the hex secret a
    /// client must present (see `nbd::remote`). As readable as the image
    /// beside it, and no more.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub nbd_secret: Option<String>,
}

pub struct ImagePool {
    dir: PathBuf,
    direct_io: bool,
    max_image_bytes: u64,
    volumes: RwLock<BTreeMap<String, VolumeMeta>>,
    quarantined: RwLock<Vec<Quarantined>>,
}

pub(crate) const META: &str = ".json";
pub(crate) const IMAGE: &str = ".img";
/// Suffix of a tombstone: `.<id>.img.deleted`, an image being deleted.
pub(crate) const TOMBSTONE: &str = ".img.deleted";
/// A record file is small; anything larger is not one of ours.
const MAX_RECORD: u64 = 1 << 20;
const MIB: u64 = 1 << 20;

/// Reads and checks one pool record; the error says what is wrong with it.
pub(crate) fn read_record(path: &Path, id: &str) -> Result<VolumeMeta, String> {
    let bytes = read_small(path)?;
    let meta: VolumeMeta = serde_json::from_slice(&bytes).map_err(|e| format!("not a volume record: {e}"))?;
    if meta.id != id {
        return Err(format!("names volume {:?}, not {id:?}", meta.id));
    }
    Ok(meta)
}

/// Reads a record file of at most [`MAX_RECORD`] bytes.
pub(crate) fn read_small(path: &Path) -> Result<Vec<u8>, String> {
    use std::io::Read;
    let f = File::open(path).map_err(|e| format!("cannot read: {e}"))?;
    let mut bytes = Vec::new();
    f.take(MAX_RECORD + 1).read_to_end(&mut bytes).map_err(|e| format!("cannot read: {e}"))?;
    if bytes.len() as u64 > MAX_RECORD {
        return Err(format!("larger than {MAX_RECORD} bytes"));
    }
    Ok(bytes)
}

/// What a pool directory holds, by kind of file.
#[derive(Default)]
pub(crate) struct Listing {
    pub records: Vec<String>,
    pub images: BTreeSet<String>,
    pub tombstones: Vec<String>,
}

pub(crate) fn list(dir: &Path) -> std::io::Result<Listing> {
    let mut l = Listing::default();
    for entry in fs::read_dir(dir)? {
        let entry = entry?;
        if !entry.file_type()?.is_file() {
            continue;
        }
        let Some(name) = entry.file_name().to_str().map(str::to_string) else { continue };
        if let Some(id) = name.strip_prefix('.').and_then(|n| n.strip_suffix(TOMBSTONE)) {
            l.tombstones.push(id.to_string());
        } else if name.starts_with('.') {
            continue;
        } else if let Some(id) = name.strip_suffix(META) {
            l.records.push(id.to_string());
        } else if let Some(id) = name.strip_suffix(IMAGE) {
            l.images.insert(id.to_string());
        }
    }
    Ok(l)
}

impl ImagePool {
    /// Opens (creating if needed) the pool at `dir`, loads its records,
    /// quarantines the unreadable ones and finishes or undoes whatever a
    /// crash interrupted (see the module doc).
    pub fn open(dir: &Path) -> Result<Self, Error> {
        fs::create_dir_all(dir).map_err(Error::io("create pool", dir))?;
        // The kernel names a loop device's backing file by its canonical
        // path; image paths must compare equal to it.
        let dir = &fs::canonicalize(dir).map_err(Error::io("resolve pool", dir))?;
        sweep_temporaries(dir).map_err(Error::io("clean pool", dir))?;
        let listing = list(dir).map_err(Error::io("list pool", dir))?;
        let mut volumes = BTreeMap::new();
        for id in &listing.records {
            let name = format!("{id}{META}");
            let path = dir.join(&name);
            match read_record(&path, id) {
                Ok(meta) => {
                    volumes.insert(meta.id.clone(), meta);
                }
                Err(reason) => {
                    let q = persist::quarantine(dir, &name, &reason).map_err(Error::io("quarantine volume record", &path))?;
                    tracing::error!(record = %path.display(), moved_to = %q.path.display(), %reason,
                        "unreadable volume record quarantined; its volume is not served until an operator repairs it");
                }
            }
        }
        let quarantined = persist::quarantined(dir).map_err(Error::io("list quarantined records", dir))?;
        for id in &listing.tombstones {
            // A delete got as far as the tombstone: finish it.
            remove_durable(dir, &format!("{id}{META}")).map_err(Error::io("remove volume record", dir))?;
            volumes.remove(id);
            remove_file(&dir.join(format!(".{id}{TOMBSTONE}")))?;
            tracing::warn!(volume = %id, "finished an interrupted delete");
        }
        let kept: BTreeSet<&str> = quarantined.iter().filter_map(Quarantined::volume_id).collect();
        for id in listing.images.iter().filter(|id| !volumes.contains_key(*id) && !kept.contains(id.as_str())) {
            let image = dir.join(format!("{id}{IMAGE}"));
            if let Some(a) = attach::find_backed_by(&image).first() {
                tracing::error!(image = %image.display(), device = %a.path().display(), "an image with no record is attached; left alone");
                continue;
            }
            remove_file(&image)?;
            tracing::warn!(image = %image.display(), "removed an image with no record (a create or delete was interrupted)");
        }
        sync_dir(dir).map_err(Error::io("sync pool", dir))?;
        let direct_io = supports_direct_io(dir);
        let max_image_bytes = probe_max_file_size(dir)?;
        Ok(Self {
            dir: dir.to_path_buf(),
            direct_io,
            max_image_bytes,
            volumes: RwLock::new(volumes),
            quarantined: RwLock::new(quarantined),
        })
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// True when files in the pool can be opened with O_DIRECT, so loop
    /// devices can skip the page cache (no double caching).
    pub fn direct_io(&self) -> bool {
        self.direct_io
    }

    /// The largest image the pool's filesystem can hold, in whole MiB (found
    /// by probing at open; see `probe_max_file_size`).
    pub fn max_image_bytes(&self) -> u64 {
        self.max_image_bytes
    }

    pub fn image_path(&self, id: &str) -> PathBuf {
        self.dir.join(format!("{id}{IMAGE}"))
    }

    pub fn get(&self, id: &str) -> Option<VolumeMeta> {
        self.volumes.read().unwrap_or_else(|e| e.into_inner()).get(id).cloned()
    }

    /// The records moved to `quarantine/` (by this run or earlier ones;
    /// the unit tests read them).
    #[cfg(test)]
    fn quarantined(&self) -> Vec<Quarantined> {
        self.quarantined.read().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// The quarantined record of volume `id`, if its record is quarantined.
    pub(crate) fn quarantined_record(&self, id: &str) -> Option<Quarantined> {
        self.quarantined.read().unwrap_or_else(|e| e.into_inner()).iter().find(|q| q.volume_id() == Some(id)).cloned()
    }

    /// How many volumes, and their sizes together.
    pub fn provisioned(&self) -> (usize, u64) {
        let v = self.volumes.read().unwrap_or_else(|e| e.into_inner());
        (v.len(), v.values().map(|m| m.size_bytes).sum())
    }

    /// Up to `max` volumes with ids after `after`, in id order.
    pub fn page(&self, after: Option<&str>, max: usize) -> Vec<VolumeMeta> {
        let v = self.volumes.read().unwrap_or_else(|e| e.into_inner());
        let range = match after {
            Some(a) => v.range::<str, _>((std::ops::Bound::Excluded(a), std::ops::Bound::Unbounded)),
            None => v.range::<str, _>(..),
        };
        range.take(max).map(|(_, m)| m.clone()).collect()
    }

    /// Creates the sparse image and its record. The caller holds the
    /// volume's lock and has checked that no record exists. A volume whose
    /// record is quarantined is refused: its image may hold data.
    pub fn create(&self, meta: VolumeMeta) -> Result<VolumeMeta, Error> {
        if let Some(q) = self.quarantined_record(&meta.id) {
            return Err(Error::Corrupt {
                path: q.path,
                detail: format!(
                    "volume {}'s record is quarantined ({}); its image is kept until an operator repairs or removes it",
                    meta.id, q.reason
                ),
            });
        }
        if meta.size_bytes > self.max_image_bytes {
            return Err(Error::OutOfRange(format!(
                "{} bytes is above the largest file the pool's filesystem holds, {} bytes",
                meta.size_bytes, self.max_image_bytes
            )));
        }
        let image = self.image_path(&meta.id);
        let tmp = self.dir.join(format!(".{}{IMAGE}.tmp", meta.id));
        {
            let f = File::create(&tmp).map_err(Error::io("create image", &tmp))?;
            fault::point("pool.create.created");
            let sized = f
                .set_len(meta.size_bytes)
                .map_err(Error::io("size image", &tmp))
                .and_then(|()| f.sync_all().map_err(Error::io("sync image", &tmp)));
            if let Err(e) = sized {
                let _ = fs::remove_file(&tmp);
                return Err(e);
            }
            fault::point("pool.create.sized");
        }
        fs::rename(&tmp, &image).map_err(Error::io("place image", &image))?;
        fault::point("pool.create.placed");
        if let Err(e) = self.write_meta(&meta) {
            // Nobody was told about the image: take it back.
            let _ = fs::remove_file(&image);
            return Err(e);
        }
        fault::point("pool.create.recorded");
        self.volumes.write().unwrap_or_else(|e| e.into_inner()).insert(meta.id.clone(), meta.clone());
        Ok(meta)
    }

    /// Grows the image to `size` bytes (never shrinks) and records it.
    pub fn grow(&self, id: &str, size: u64) -> Result<VolumeMeta, Error> {
        let mut meta = self.get(id).ok_or_else(|| Error::NotFound(id.to_string()))?;
        if size <= meta.size_bytes {
            return Ok(meta);
        }
        if size > self.max_image_bytes {
            return Err(Error::OutOfRange(format!(
                "{size} bytes is above the largest file the pool's filesystem holds, {} bytes",
                self.max_image_bytes
            )));
        }
        let image = self.image_path(id);
        let f = OpenOptions::new().write(true).open(&image).map_err(Error::io("open image", &image))?;
        f.set_len(size).map_err(Error::io("grow image", &image))?;
        f.sync_all().map_err(Error::io("sync image", &image))?;
        fault::point("pool.expand.grown");
        meta.size_bytes = size;
        self.write_meta(&meta)?;
        fault::point("pool.expand.recorded");
        self.volumes.write().unwrap_or_else(|e| e.into_inner()).insert(id.to_string(), meta.clone());
        Ok(meta)
    }

    /// Deletes the volume's data and then its record (see the module doc for
    /// the order); returns whether there was anything to delete. Deleting an
    /// unknown volume succeeds. The image of a volume whose record is
    /// quarantined is deleted too (the CO asked for exactly that), and the
    /// quarantined record with it.
    pub fn delete(&self, id: &str) -> Result<bool, Error> {
        let image = self.image_path(id);
        let tombstone = self.dir.join(format!(".{id}{TOMBSTONE}"));
        let mut found = match fs::rename(&image, &tombstone) {
            Ok(()) => {
                sync_dir(&self.dir).map_err(Error::io("sync pool", &self.dir))?;
                true
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => tombstone.exists(),
            Err(e) => return Err(Error::io("tombstone image", &image)(e)),
        };
        fault::point("pool.delete.tombstoned");
        found |= self.get(id).is_some();
        remove_durable(&self.dir, &format!("{id}{META}")).map_err(Error::io("remove volume record", &self.dir))?;
        self.volumes.write().unwrap_or_else(|e| e.into_inner()).remove(id);
        fault::point("pool.delete.unrecorded");
        remove_file(&tombstone)?;
        fault::point("pool.delete.removed");
        let mut q = self.quarantined.write().unwrap_or_else(|e| e.into_inner());
        for gone in q.iter().filter(|q| q.volume_id() == Some(id)) {
            remove_file(&gone.path)?;
            remove_file(&PathBuf::from(format!("{}.reason", gone.path.display())))?;
            tracing::warn!(volume = %id, record = %gone.path.display(), "deleted a volume whose record was quarantined");
            found = true;
        }
        q.retain(|q| q.volume_id() != Some(id));
        Ok(found)
    }

    /// Bytes free for new data in the pool's filesystem.
    pub fn free_bytes(&self) -> Result<u64, Error> {
        let s = rustix::fs::statvfs(&self.dir).map_err(|e| Error::io("statvfs", &self.dir)(e.into()))?;
        Ok(s.f_bavail.saturating_mul(s.f_frsize))
    }

    fn write_meta(&self, meta: &VolumeMeta) -> Result<(), Error> {
        let bytes = serde_json::to_vec_pretty(meta).expect("a volume record serialises");
        write_atomic(&self.dir, &format!("{}{META}", meta.id), &bytes).map_err(Error::io("write volume record", &self.dir))
    }
}

fn remove_file(p: &Path) -> Result<(), Error> {
    match fs::remove_file(p) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(Error::io("remove", p)(e)),
        _ => Ok(()),
    }
}

fn supports_direct_io(dir: &Path) -> bool {
    let probe = dir.join(".direct-io-probe.tmp");
    let ok = OpenOptions::new().create(true).truncate(true).write(true).custom_flags(libc::O_DIRECT).open(&probe).is_ok();
    let _ = fs::remove_file(&probe);
    ok
}

/// The largest size, in whole MiB and at most `i64::MAX` (CSI sizes are
/// int64), a file in `dir` can be given.
///
/// Probed rather than computed from the filesystem type: the limit depends
/// on more than the type (ext4's block size and extent feature, a kernel's
/// `MAX_LFS_FILESIZE`, FUSE and network filesystems that say nothing), and
/// `ftruncate` on a sparse file asks the filesystem itself, allocating no
/// blocks. A binary search over MiB takes at most 44 calls, once per open.
fn probe_max_file_size(dir: &Path) -> Result<u64, Error> {
    let path = dir.join(".size-probe.tmp");
    let f = File::create(&path).map_err(Error::io("create size probe", &path))?;
    let fits = |mib: u64| f.set_len(mib * MIB).is_ok();
    let (mut lo, mut hi) = (0u64, i64::MAX as u64 / MIB);
    let max = if fits(hi) {
        hi
    } else {
        while hi - lo > 1 {
            let mid = lo + (hi - lo) / 2;
            if fits(mid) {
                lo = mid;
            } else {
                hi = mid;
            }
        }
        lo
    };
    drop(f);
    let _ = fs::remove_file(&path);
    Ok(max * MIB)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn meta(id: &str, size: u64) -> VolumeMeta {
        VolumeMeta {
            id: id.into(),
            name: id.into(),
            size_bytes: size,
            fs_type: None,
            parameters: BTreeMap::new(),
            created_unix: 0,
            nbd_secret: None,
        }
    }

    #[test]
    fn create_grow_page_delete_and_reopen() {
        let d = tempfile::tempdir().unwrap();
        let pool = ImagePool::open(d.path()).unwrap();
        for id in ["b", "a", "c"] {
            pool.create(meta(id, 1 << 20)).unwrap();
        }
        assert_eq!(fs::metadata(pool.image_path("a")).unwrap().len(), 1 << 20);
        pool.grow("a", 4 << 20).unwrap();
        pool.grow("a", 2 << 20).unwrap();
        assert_eq!(fs::metadata(pool.image_path("a")).unwrap().len(), 4 << 20);
        let ids = |v: Vec<VolumeMeta>| v.into_iter().map(|m| m.id).collect::<Vec<_>>();
        assert_eq!(ids(pool.page(None, 2)), ["a", "b"]);
        assert_eq!(ids(pool.page(Some("b"), 2)), ["c"]);
        assert!(pool.delete("b").unwrap());
        assert!(!pool.delete("b").unwrap());
        let again = ImagePool::open(d.path()).unwrap();
        assert_eq!(ids(again.page(None, 10)), ["a", "c"]);
        assert_eq!(again.get("a").unwrap().size_bytes, 4 << 20);
    }

    #[test]
    fn a_corrupt_record_is_quarantined_and_its_image_kept() {
        let d = tempfile::tempdir().unwrap();
        let pool = ImagePool::open(d.path()).unwrap();
        pool.create(meta("good", 1 << 20)).unwrap();
        pool.create(meta("bad", 1 << 20)).unwrap();
        drop(pool);
        fs::write(d.path().join("bad.json"), b"{nope").unwrap();
        fs::write(d.path().join("alias.json"), serde_json::to_vec(&meta("other", 1)).unwrap()).unwrap();
        let pool = ImagePool::open(d.path()).unwrap();
        assert!(pool.get("good").is_some() && pool.get("bad").is_none() && pool.get("other").is_none());
        let q: Vec<_> = pool.quarantined().into_iter().map(|q| q.name).collect();
        assert_eq!(q, ["alias.json", "bad.json"]);
        assert!(d.path().join("quarantine/bad.json").exists());
        assert!(pool.image_path("bad").exists(), "a quarantined volume's image is not an orphan");
        assert!(matches!(pool.create(meta("bad", 1 << 20)), Err(Error::Corrupt { .. })));
        // Reopening changes nothing; deleting removes image and quarantined record.
        let pool = ImagePool::open(d.path()).unwrap();
        assert!(pool.image_path("bad").exists() && pool.quarantined_record("bad").is_some());
        assert!(pool.delete("bad").unwrap());
        assert!(!pool.image_path("bad").exists() && pool.quarantined_record("bad").is_none());
        assert!(!d.path().join("quarantine/bad.json").exists());
    }

    #[test]
    fn open_collects_orphans_and_finishes_deletes() {
        let d = tempfile::tempdir().unwrap();
        let pool = ImagePool::open(d.path()).unwrap();
        pool.create(meta("kept", 1 << 20)).unwrap();
        pool.create(meta("half-deleted", 1 << 20)).unwrap();
        drop(pool);
        fs::write(d.path().join("orphan.img"), b"tenant data").unwrap();
        fs::rename(d.path().join("half-deleted.img"), d.path().join(".half-deleted.img.deleted")).unwrap();
        fs::write(d.path().join(".gone.img.deleted"), b"tenant data").unwrap();
        fs::write(d.path().join(".new.img.tmp"), b"").unwrap();
        let pool = ImagePool::open(d.path()).unwrap();
        assert!(pool.get("kept").is_some() && pool.get("half-deleted").is_none());
        let mut left: Vec<_> = fs::read_dir(d.path()).unwrap().map(|e| e.unwrap().file_name().into_string().unwrap()).collect();
        left.sort();
        assert_eq!(left, ["kept.img", "kept.json"]);
    }

    #[test]
    fn the_size_limit_is_the_filesystems() {
        let d = tempfile::tempdir().unwrap();
        let pool = ImagePool::open(d.path()).unwrap();
        let max = pool.max_image_bytes();
        assert!(max > 0 && max.is_multiple_of(MIB));
        let f = File::create(d.path().join("x")).unwrap();
        f.set_len(max).unwrap();
        if max < i64::MAX as u64 / MIB * MIB {
            assert!(f.set_len(max + MIB).is_err());
            assert!(matches!(pool.create(meta("big", max + MIB)), Err(Error::OutOfRange(_))));
        }
    }
}
