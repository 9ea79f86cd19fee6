//! The image pool: one sparse file per volume plus a small JSON record of
//! what was asked for, in one directory.
//!
//! The records are also held in memory (a `BTreeMap` by id), so listing and
//! paging thousands of volumes reads no files; the files are the durable
//! copy, written crash-safe. An image is created (and made durable) before
//! its record, so a crash in between leaves an image with no record, which
//! nobody was ever told about and the next create of that name replaces.

use std::collections::BTreeMap;
use std::fs::{self, File, OpenOptions};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::RwLock;

use serde::{Deserialize, Serialize};

use super::persist::{remove_durable, sweep_temporaries, write_atomic};
use super::Error;

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
}

pub struct ImagePool {
    dir: PathBuf,
    direct_io: bool,
    volumes: RwLock<BTreeMap<String, VolumeMeta>>,
}

const META: &str = ".json";
const IMAGE: &str = ".img";

impl ImagePool {
    /// Opens (creating if needed) the pool at `dir` and loads its records.
    pub fn open(dir: &Path) -> Result<Self, Error> {
        fs::create_dir_all(dir).map_err(Error::io("create pool", dir))?;
        // The kernel names a loop device's backing file by its canonical
        // path; image paths must compare equal to it.
        let dir = &fs::canonicalize(dir).map_err(Error::io("resolve pool", dir))?;
        sweep_temporaries(dir).map_err(Error::io("clean pool", dir))?;
        let mut volumes = BTreeMap::new();
        for entry in fs::read_dir(dir).map_err(Error::io("list pool", dir))? {
            let path = entry.map_err(Error::io("list pool", dir))?.path();
            let Some(name) = path.file_name().and_then(|n| n.to_str()) else { continue };
            if let Some(id) = name.strip_suffix(META) {
                let bytes = fs::read(&path).map_err(Error::io("read volume record", &path))?;
                let meta: VolumeMeta =
                    serde_json::from_slice(&bytes).map_err(|e| Error::Corrupt { path: path.clone(), detail: e.to_string() })?;
                if meta.id != id {
                    return Err(Error::Corrupt { path, detail: format!("names volume {}", meta.id) });
                }
                volumes.insert(meta.id.clone(), meta);
            }
        }
        let direct_io = supports_direct_io(dir);
        Ok(Self { dir: dir.to_path_buf(), direct_io, volumes: RwLock::new(volumes) })
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// True when files in the pool can be opened with O_DIRECT, so loop
    /// devices can skip the page cache (no double caching).
    pub fn direct_io(&self) -> bool {
        self.direct_io
    }

    pub fn image_path(&self, id: &str) -> PathBuf {
        self.dir.join(format!("{id}{IMAGE}"))
    }

    pub fn get(&self, id: &str) -> Option<VolumeMeta> {
        self.volumes.read().unwrap_or_else(|e| e.into_inner()).get(id).cloned()
    }

    pub fn len(&self) -> usize {
        self.volumes.read().unwrap_or_else(|e| e.into_inner()).len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
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
    /// volume's lock and has checked that no record exists.
    pub fn create(&self, meta: VolumeMeta) -> Result<VolumeMeta, Error> {
        let image = self.image_path(&meta.id);
        let tmp = self.dir.join(format!(".{}{IMAGE}.tmp", meta.id));
        {
            let f = File::create(&tmp).map_err(Error::io("create image", &tmp))?;
            f.set_len(meta.size_bytes).map_err(Error::io("size image", &tmp))?;
            f.sync_all().map_err(Error::io("sync image", &tmp))?;
        }
        fs::rename(&tmp, &image).map_err(Error::io("place image", &image))?;
        self.write_meta(&meta)?;
        self.volumes.write().unwrap_or_else(|e| e.into_inner()).insert(meta.id.clone(), meta.clone());
        Ok(meta)
    }

    /// Grows the image to `size` bytes (never shrinks) and records it.
    pub fn grow(&self, id: &str, size: u64) -> Result<VolumeMeta, Error> {
        let mut meta = self.get(id).ok_or_else(|| Error::NotFound(id.to_string()))?;
        if size <= meta.size_bytes {
            return Ok(meta);
        }
        let image = self.image_path(id);
        let f = OpenOptions::new().write(true).open(&image).map_err(Error::io("open image", &image))?;
        f.set_len(size).map_err(Error::io("grow image", &image))?;
        f.sync_all().map_err(Error::io("sync image", &image))?;
        meta.size_bytes = size;
        self.write_meta(&meta)?;
        self.volumes.write().unwrap_or_else(|e| e.into_inner()).insert(id.to_string(), meta.clone());
        Ok(meta)
    }

    /// Removes the record (from then on the volume does not exist) and then
    /// the image. Deleting an unknown volume succeeds.
    pub fn delete(&self, id: &str) -> Result<(), Error> {
        remove_durable(&self.dir, &format!("{id}{META}")).map_err(Error::io("remove volume record", &self.dir))?;
        self.volumes.write().unwrap_or_else(|e| e.into_inner()).remove(id);
        let image = self.image_path(id);
        match fs::remove_file(&image) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(Error::io("remove image", image)(e)),
        }
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

fn supports_direct_io(dir: &Path) -> bool {
    let probe = dir.join(".direct-io-probe.tmp");
    let ok = OpenOptions::new().create(true).truncate(true).write(true).custom_flags(libc::O_DIRECT).open(&probe).is_ok();
    let _ = fs::remove_file(&probe);
    ok
}

#[cfg(test)]
mod tests {
    use super::*;

    fn meta(id: &str, size: u64) -> VolumeMeta {
        VolumeMeta { id: id.into(), name: id.into(), size_bytes: size, fs_type: None, parameters: BTreeMap::new(), created_unix: 0 }
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
        pool.delete("b").unwrap();
        pool.delete("b").unwrap();
        let again = ImagePool::open(d.path()).unwrap();
        assert_eq!(ids(again.page(None, 10)), ["a", "c"]);
        assert_eq!(again.get("a").unwrap().size_bytes, 4 << 20);
    }

    #[test]
    fn a_corrupt_record_is_reported_not_skipped() {
        let d = tempfile::tempdir().unwrap();
        fs::write(d.path().join("x.json"), b"{nope").unwrap();
        assert!(matches!(ImagePool::open(d.path()), Err(Error::Corrupt { .. })));
    }
}
