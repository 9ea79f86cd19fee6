//! Crash-safe small files: a record is either the old one or the new one,
//! never a torn mix, and once a call returns it survives a power cut.

use std::fs::{self, File};
use std::io::{self, Write};
use std::path::Path;

/// Writes `bytes` to `dir/name`: a temporary file, fsync, rename over the
/// old one, fsync of the directory (the rename itself must be durable).
pub fn write_atomic(dir: &Path, name: &str, bytes: &[u8]) -> io::Result<()> {
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
pub fn remove_durable(dir: &Path, name: &str) -> io::Result<()> {
    match fs::remove_file(dir.join(name)) {
        Ok(()) => sync_dir(dir),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(e),
    }
}

pub fn sync_dir(dir: &Path) -> io::Result<()> {
    File::open(dir)?.sync_all()
}

/// Removes temporary files a crash left behind in `dir`.
pub fn sweep_temporaries(dir: &Path) -> io::Result<usize> {
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
}
