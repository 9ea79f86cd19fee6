//! Crash-safe small files: a record is either the old one or the new one,
//! never a torn mix, and once a call returns it survives a power cut.
//!
//! A record that cannot be read back is not fatal to the agent: it is moved
//! aside into a `quarantine/` subdirectory (durably, with a note saying why)
//! so the records beside it keep being served and an operator can look at it.

use std::fs::{self, File};
use std::io::{self, Read, Write};
use std::path::{Path, PathBuf};

use serde::Serialize;

/// The subdirectory of a record directory that holds quarantined records.
pub(crate) const QUARANTINE: &str = "quarantine";
/// The note beside a quarantined record saying why it was moved.
const REASON: &str = ".reason";
/// A note longer than this is cut (it is read back by `status`).
const MAX_REASON: u64 = 4096;

/// Writes `bytes` to `dir/name`: a temporary file, fsync, rename over the
/// old one, fsync of the directory (the rename itself must be durable).
pub(crate) fn write_atomic(dir: &Path, name: &str, bytes: &[u8]) -> io::Result<()> {
    let tmp = dir.join(format!(".{name}.tmp"));
    {
        let mut f = File::create(&tmp)?;
        f.write_all(bytes)?;
        f.sync_all()?;
    }
    fs::rename(&tmp, dir.join(name))?;
    sync_dir(dir)
}

/// Removes `dir/name` durably; a missing file is not an error.
pub(crate) fn remove_durable(dir: &Path, name: &str) -> io::Result<()> {
    match fs::remove_file(dir.join(name)) {
        Ok(()) => sync_dir(dir),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(e),
    }
}

pub(crate) fn sync_dir(dir: &Path) -> io::Result<()> {
    File::open(dir)?.sync_all()
}

/// Removes temporary files a crash left behind in `dir`.
pub(crate) fn sweep_temporaries(dir: &Path) -> io::Result<usize> {
    let mut n = 0;
    for entry in fs::read_dir(dir)? {
        let entry = entry?;
        let name = entry.file_name();
        let name = name.to_string_lossy();
        if name.starts_with('.') && name.ends_with(".tmp") {
            fs::remove_file(entry.path())?;
            n += 1;
        }
    }
    Ok(n)
}

/// A record moved aside because it could not be read.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Quarantined {
    /// The record's name in its directory before it was moved
    /// (`<volume id>.json`).
    pub name: String,
    /// Where it is now.
    pub path: PathBuf,
    /// Why it was moved.
    pub reason: String,
}

impl Quarantined {
    /// The volume the record was about, by its file name.
    pub fn volume_id(&self) -> Option<&str> {
        self.name.strip_suffix(".json")
    }
}

/// Moves `dir/name` into `dir/quarantine/` (as `name`, or `name.N` when an
/// earlier record of that name is already there), writes the reason beside
/// it, and makes both durable before returning.
pub(crate) fn quarantine(dir: &Path, name: &str, reason: &str) -> io::Result<Quarantined> {
    let qdir = dir.join(QUARANTINE);
    if !qdir.is_dir() {
        fs::create_dir_all(&qdir)?;
        sync_dir(dir)?;
    }
    let mut target = name.to_string();
    for n in 1..=1000 {
        if fs::symlink_metadata(qdir.join(&target)).is_err() {
            break;
        }
        target = format!("{name}.{n}");
    }
    let path = qdir.join(&target);
    if fs::symlink_metadata(&path).is_ok() {
        return Err(io::Error::new(io::ErrorKind::AlreadyExists, format!("{} already holds 1000 copies of {name}", qdir.display())));
    }
    write_atomic(&qdir, &format!("{target}{REASON}"), reason.as_bytes())?;
    fs::rename(dir.join(name), &path)?;
    sync_dir(&qdir)?;
    sync_dir(dir)?;
    Ok(Quarantined { name: name.to_string(), path, reason: reason.to_string() })
}

/// The records quarantined in `dir/quarantine/` (by this run or earlier
/// ones), in name order. Reading never changes anything.
pub(crate) fn quarantined(dir: &Path) -> io::Result<Vec<Quarantined>> {
    let qdir = dir.join(QUARANTINE);
    let entries = match fs::read_dir(&qdir) {
        Ok(e) => e,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(e),
    };
    let mut out = Vec::new();
    for entry in entries {
        let entry = entry?;
        let Some(file) = entry.file_name().to_str().map(str::to_string) else { continue };
        if file.starts_with('.') || file.ends_with(REASON) {
            continue;
        }
        let path = entry.path();
        let mut reason = String::new();
        match File::open(qdir.join(format!("{file}{REASON}"))) {
            Ok(f) => {
                let _ = f.take(MAX_REASON).read_to_string(&mut reason);
            }
            Err(_) => reason.push_str("no reason recorded"),
        }
        out.push(Quarantined { name: original_name(&file).to_string(), path, reason });
    }
    out.sort_by(|a, b| a.path.cmp(&b.path));
    Ok(out)
}

/// `x.json.3` → `x.json`: strips the copy number [`quarantine`] adds.
fn original_name(file: &str) -> &str {
    match file.rsplit_once('.') {
        Some((stem, n)) if !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()) && stem.ends_with(".json") => stem,
        _ => file,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn replaces_whole_and_sweeps() {
        let d = tempfile::tempdir().unwrap();
        write_atomic(d.path(), "r.json", b"one").unwrap();
        write_atomic(d.path(), "r.json", b"two").unwrap();
        assert_eq!(fs::read(d.path().join("r.json")).unwrap(), b"two");
        fs::write(d.path().join(".x.json.tmp"), b"torn").unwrap();
        assert_eq!(sweep_temporaries(d.path()).unwrap(), 1);
        remove_durable(d.path(), "r.json").unwrap();
        remove_durable(d.path(), "r.json").unwrap();
        assert_eq!(fs::read_dir(d.path()).unwrap().count(), 0);
    }

    #[test]
    fn quarantine_keeps_every_copy_and_its_reason() {
        let d = tempfile::tempdir().unwrap();
        assert!(quarantined(d.path()).unwrap().is_empty());
        for body in ["first", "second"] {
            fs::write(d.path().join("v.json"), body).unwrap();
            let q = quarantine(d.path(), "v.json", &format!("bad {body}")).unwrap();
            assert_eq!(fs::read_to_string(&q.path).unwrap(), body);
            assert_eq!(q.volume_id(), Some("v"));
        }
        assert!(!d.path().join("v.json").exists());
        let all = quarantined(d.path()).unwrap();
        assert_eq!(all.len(), 2);
        assert!(all.iter().all(|q| q.name == "v.json"));
        let reasons: Vec<_> = all.iter().map(|q| q.reason.as_str()).collect();
        assert_eq!(reasons, ["bad first", "bad second"]);
        assert_eq!(original_name("a.json.12"), "a.json");
        assert_eq!(original_name("a.img.1"), "a.img.1");
    }
}
