//! Reading one block device's description out of sysfs.
//!
//! Layout (see the kernel's `Documentation/ABI/stable/sysfs-block`):
//! `/sys/class/block/<name>` links to the device's directory, which holds
//! `dev` (`maj:min`), `size` (512-byte sectors), `ro`, `removable`,
//! `partition` (partitions only; their disk is the parent directory),
//! `holders/`, `slaves/`, `queue/` (disks only), `device/` (the hardware),
//! and per-driver directories `loop/`, `dm/`, `md/`. A device can vanish at
//! any point of the walk: an attribute missing means "not this kind of
//! device", a `dev` missing means the device is gone.

use std::collections::BTreeMap;
use std::io;
use std::path::{Path, PathBuf};

use super::device::{Device, DeviceKind, DmInfo, LoopBacking};
use super::Error;
use volring_mounts::DevNum;

/// Reads an attribute, trimmed. `Ok(None)` when the file does not exist
/// (the device is not of that kind) or is empty.
///
/// One open, one read, one close: a sysfs attribute is at most a page and
/// the kernel hands all of it to the first read, so a short read is the
/// whole file (`std::fs::read` also stats the file and reads again for the
/// end, which made a scan of 235 devices cost 1.4x lsblk's CPU). A full
/// buffer is read on, up to 64 KiB.
fn attr(dir: &Path, name: &str) -> io::Result<Option<String>> {
    use std::io::Read;
    const PAGE: usize = 4096;
    let mut f = match std::fs::File::open(dir.join(name)) {
        Ok(f) => f,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(e),
    };
    let mut buf = [0u8; PAGE];
    let n = f.read(&mut buf)?;
    let mut v = buf[..n].to_vec();
    if n == PAGE {
        f.take(64 << 10).read_to_end(&mut v)?;
    }
    // Anything odd is shown, not trusted.
    let s = String::from_utf8_lossy(&v).trim().to_string();
    Ok((!s.is_empty()).then_some(s))
}

/// Where the `/sys/class/block/NAME` link points: its target read once
/// and joined without asking the kernel about each component (sysfs's
/// own directories are no symlinks), where `canonicalize` reads every
/// component of the path as a link. Falls back to `canonicalize` for a
/// link that is not relative.
fn resolve_link(link: &Path) -> io::Result<PathBuf> {
    let target = std::fs::read_link(link)?;
    if target.is_absolute() {
        return std::fs::canonicalize(link);
    }
    let mut out = link.parent().map(Path::to_path_buf).unwrap_or_default();
    for c in target.components() {
        match c {
            std::path::Component::ParentDir => {
                out.pop();
            }
            std::path::Component::Normal(n) => out.push(n),
            _ => {}
        }
    }
    Ok(out)
}

/// Collects attribute reads, keeping the failures as text on the device.
struct Attrs<'a> {
    dir: &'a Path,
    errors: Vec<String>,
}

impl Attrs<'_> {
    fn text(&mut self, name: &str) -> Option<String> {
        match attr(self.dir, name) {
            Ok(v) => v,
            Err(e) => {
                self.errors.push(format!("{name}: {e}"));
                None
            }
        }
    }

    fn number(&mut self, name: &str) -> Option<u64> {
        let t = self.text(name)?;
        match t.parse() {
            Ok(n) => Some(n),
            Err(_) => {
                self.errors.push(format!("{name}: not a number: {t:?}"));
                None
            }
        }
    }

    fn flag(&mut self, name: &str) -> bool {
        self.number(name).is_some_and(|n| n != 0)
    }

    fn names(&mut self, sub: &str) -> Vec<String> {
        match std::fs::read_dir(self.dir.join(sub)) {
            Ok(rd) => {
                let mut v: Vec<String> = rd.filter_map(|e| e.ok()).map(|e| e.file_name().to_string_lossy().into_owned()).collect();
                v.sort();
                v
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound => Vec::new(),
            Err(e) => {
                self.errors.push(format!("{sub}/: {e}"));
                Vec::new()
            }
        }
    }
}

/// Parses a sysfs `dev` file's `maj:min` (its newline trimmed).
pub(crate) fn parse_devnum(s: &str) -> Option<DevNum> {
    s.trim().parse().ok()
}

/// The names in `/sys/class/block`, sorted.
pub(crate) fn list(sys: &Path) -> Result<Vec<String>, Error> {
    let dir = sys.join("class/block");
    let rd = std::fs::read_dir(&dir).map_err(|e| Error::Io("listing /sys/class/block", e))?;
    let mut names: Vec<String> = rd.filter_map(|e| e.ok()).map(|e| e.file_name().to_string_lossy().into_owned()).collect();
    names.sort();
    Ok(names)
}

fn kind_of(name: &str, dir: &Path, is_partition: bool) -> DeviceKind {
    if is_partition {
        return DeviceKind::Partition;
    }
    let has = |sub: &str| dir.join(sub).exists();
    if name.starts_with("loop") || has("loop") {
        DeviceKind::Loop
    } else if has("dm") {
        DeviceKind::Dm
    } else if has("md") {
        DeviceKind::Md
    } else if name.starts_with("nvme") {
        DeviceKind::Nvme
    } else if name.starts_with("vd") {
        DeviceKind::Virtio
    } else if name.starts_with("nbd") {
        DeviceKind::Nbd
    } else if name.starts_with("zram") {
        DeviceKind::Zram
    } else if name.starts_with("sr") {
        DeviceKind::Rom
    } else if has("device") {
        DeviceKind::Disk
    } else {
        DeviceKind::Other
    }
}

/// Reads device `name` from sysfs. Probe results, mount points and the id
/// are filled in later by the inventory.
pub(crate) fn read(sys: &Path, name: &str) -> Result<Device, Error> {
    if name.contains('/') || name == "." || name == ".." {
        return Err(Error::BadName(name.to_string()));
    }
    let link = sys.join("class/block").join(name);
    // Resolve once so every attribute comes from the same directory even if
    // the name is reused mid-read.
    let dir = resolve_link(&link).map_err(|e| vanished_or(name, e))?;
    let mut a = Attrs { dir: &dir, errors: Vec::new() };
    // `uevent` says the device number and whether it is a partition (and
    // which), which spares reading `dev` and `partition`; those are read
    // when it does not say.
    let uevent = a.text("uevent").map(|u| parse_uevent_file(&u)).unwrap_or_default();
    let from_uevent = uevent
        .get("MAJOR")
        .zip(uevent.get("MINOR"))
        .and_then(|(major, minor)| Some(DevNum { major: major.parse().ok()?, minor: minor.parse().ok()? }));
    let dev = match from_uevent {
        Some(d) => d,
        None => match attr(&dir, "dev") {
            Ok(Some(s)) => parse_devnum(&s).ok_or_else(|| Error::Attribute(name.to_string(), format!("dev: {s:?}")))?,
            Ok(None) => return Err(Error::Vanished(name.to_string())),
            Err(e) => return Err(vanished_or(name, e)),
        },
    };
    let partition_no = match uevent.get("DEVTYPE").map(String::as_str) {
        Some("disk") => None,
        Some("partition") => uevent.get("PARTN").and_then(|n| n.parse().ok()).or_else(|| a.number("partition")),
        _ => a.number("partition"),
    };
    let parent = partition_no.and_then(|_| dir.parent()?.file_name().map(|n| n.to_string_lossy().into_owned()));
    // Partitions have no queue/ or device/ of their own: use the disk's.
    let disk_dir: PathBuf = if partition_no.is_some() { dir.parent().map(Path::to_path_buf).unwrap_or(dir.clone()) } else { dir.clone() };
    let kind = kind_of(name, &dir, partition_no.is_some());
    let size_bytes = a.number("size").unwrap_or(0).saturating_mul(512);
    let read_only = a.flag("ro");
    let holders = a.names("holders");
    // A loop device stacks on a file, never on block devices.
    let slaves = if kind == DeviceKind::Loop { Vec::new() } else { a.names("slaves") };
    // Only a device of that kind has the kind's directory: a miss costs a
    // failed open each, and most of a storage node's devices are loops.
    let loop_backing = (kind == DeviceKind::Loop).then(|| a.text("loop/backing_file")).flatten().map(|file| LoopBacking {
        file: PathBuf::from(file),
        offset: a.number("loop/offset").unwrap_or(0),
        size_limit: a.number("loop/sizelimit").unwrap_or(0),
        autoclear: a.flag("loop/autoclear"),
    });
    let dm = (kind == DeviceKind::Dm).then(|| a.text("dm/name")).flatten().map(|n| DmInfo { name: n, uuid: a.text("dm/uuid") });
    let md_level = (kind == DeviceKind::Md).then(|| a.text("md/level")).flatten();
    let mut errors = a.errors;
    let mut d = Attrs { dir: &disk_dir, errors: Vec::new() };
    let logical_block_size = d.number("queue/logical_block_size").unwrap_or(512) as u32;
    let physical_block_size = d.number("queue/physical_block_size").unwrap_or(u64::from(logical_block_size)) as u32;
    let rotational = d.flag("queue/rotational");
    let removable = d.flag("removable");
    // Hardware ids: a loop device (or a partition of one) has none, and
    // only a device with a device/ directory has the ones kept there.
    let on_loop = kind == DeviceKind::Loop || parent.as_deref().is_some_and(|p| p.starts_with("loop"));
    let hw = !on_loop && disk_dir.join("device").exists();
    let under_device = |d: &mut Attrs<'_>, name: &str| if hw { d.text(name) } else { None };
    let model = under_device(&mut d, "device/model");
    let vendor = under_device(&mut d, "device/vendor");
    // virtio and nvme keep the serial at the top; SCSI under device/.
    let top = |d: &mut Attrs<'_>, name: &str| if on_loop { None } else { d.text(name) };
    let serial = top(&mut d, "serial").or_else(|| under_device(&mut d, "device/serial"));
    let wwn = top(&mut d, "wwid").or_else(|| under_device(&mut d, "device/wwid")).map(|w| w.trim_start_matches("naa.").to_string());
    let firmware = under_device(&mut d, "device/firmware_rev").or_else(|| under_device(&mut d, "device/rev"));
    // A partition shares its disk's hardware ids; errors reading the disk's
    // attributes belong to the disk and are not repeated here.
    if partition_no.is_none() {
        errors.extend(d.errors);
    }
    let devname = uevent.get("DEVNAME").cloned().unwrap_or_else(|| name.to_string());
    Ok(Device {
        name: name.to_string(),
        dev,
        kind,
        path: Path::new("/dev").join(devname),
        size_bytes,
        logical_block_size,
        physical_block_size,
        rotational,
        removable,
        read_only,
        model,
        vendor,
        serial,
        wwn,
        firmware,
        partition: partition_no.zip(parent).map(|(n, p)| (n as u32, p)),
        holders,
        slaves,
        loop_backing,
        dm,
        md_level,
        links: Vec::new(),
        udev: BTreeMap::new(),
        content: Default::default(),
        probe_error: None,
        part_uuid: None,
        mountpoints: Vec::new(),
        uses: Vec::new(),
        os_disk: false,
        id: String::new(),
        attr_errors: errors,
    })
}

fn vanished_or(name: &str, e: io::Error) -> Error {
    if e.kind() == io::ErrorKind::NotFound || e.raw_os_error() == Some(libc::ENODEV) {
        Error::Vanished(name.to_string())
    } else {
        Error::Io("reading a device's sysfs directory", e)
    }
}

/// The fuzz entry (fuzz/fuzz_targets/sysfs_text.rs): runs every sysfs and
/// udev text parser over one input; none may panic.
pub fn fuzz_sysfs_text(text: &str) {
    let _ = parse_uevent_file(text);
    let _ = parse_udev_db(text);
    let _ = parse_devnum(text);
}

/// `KEY=VALUE` lines, as in a sysfs `uevent` file.
pub(crate) fn parse_uevent_file(text: &str) -> BTreeMap<String, String> {
    text.lines().filter_map(|l| l.split_once('=')).map(|(k, v)| (k.to_string(), v.to_string())).collect()
}

/// The properties (`E:KEY=VALUE`) and links (`S:disk/by-id/...`) of a udev
/// database entry, `/run/udev/data/b<maj>:<min>`.
pub(crate) fn parse_udev_db(text: &str) -> (BTreeMap<String, String>, Vec<PathBuf>) {
    let mut props = BTreeMap::new();
    let mut links = Vec::new();
    for line in text.lines() {
        if let Some(kv) = line.strip_prefix("E:") {
            if let Some((k, v)) = kv.split_once('=') {
                props.insert(k.to_string(), v.to_string());
            }
        } else if let Some(l) = line.strip_prefix("S:") {
            links.push(Path::new("/dev").join(l));
        }
    }
    (props, links)
}

/// Reads the udev database entry of `dev` under `run` (`/run`); empty when
/// udev does not run (as in many containers).
pub(crate) fn udev_entry(run: &Path, dev: DevNum) -> (BTreeMap<String, String>, Vec<PathBuf>) {
    match std::fs::read_to_string(run.join(format!("udev/data/b{}:{}", dev.major, dev.minor))) {
        Ok(t) => parse_udev_db(&t),
        Err(_) => Default::default(),
    }
}

/// `/dev/disk/by-id` and `/dev/disk/by-path` links, grouped by the kernel
/// name they resolve to.
pub(crate) fn disk_links(dev: &Path) -> BTreeMap<String, Vec<PathBuf>> {
    let mut out: BTreeMap<String, Vec<PathBuf>> = BTreeMap::new();
    for sub in ["disk/by-id", "disk/by-path"] {
        let Ok(rd) = std::fs::read_dir(dev.join(sub)) else { continue };
        for e in rd.filter_map(|e| e.ok()) {
            if let Ok(target) = std::fs::read_link(e.path()) {
                if let Some(n) = target.file_name() {
                    out.entry(n.to_string_lossy().into_owned()).or_default().push(e.path());
                }
            }
        }
    }
    for v in out.values_mut() {
        v.sort();
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn devnums_and_udev_entries() {
        assert_eq!(parse_devnum("7:3\n"), Some(DevNum { major: 7, minor: 3 }));
        assert_eq!(parse_devnum("7"), None);
        assert_eq!(parse_devnum("a:b"), None);
        let (p, l) = parse_udev_db("S:disk/by-id/wwn-0x5000\nE:ID_SERIAL=XYZ\nE:broken\nI:123\n");
        assert_eq!(p.get("ID_SERIAL").map(String::as_str), Some("XYZ"));
        assert_eq!(l, vec![PathBuf::from("/dev/disk/by-id/wwn-0x5000")]);
        let u = parse_uevent_file("MAJOR=7\nMINOR=0\nDEVNAME=loop0\nDEVTYPE=disk\n");
        assert_eq!(u.get("DEVNAME").map(String::as_str), Some("loop0"));
    }

    #[test]
    fn names_with_slashes_are_refused() {
        assert!(matches!(read(Path::new("/sys"), "../../etc"), Err(Error::BadName(_))));
        assert!(matches!(read(Path::new("/sys"), "no-such-device-here"), Err(Error::Vanished(_))));
    }

    /// A crafted sysfs tree (not the kernel's) where `size` cannot be read:
    /// the device is still reported, with the reason. (Was
    /// tests/devices.rs `inventory::unreadable_attribute_is_reported`.)
    #[test]
    fn unreadable_attribute_is_reported() {
        let root = tempfile::tempdir().unwrap();
        let dev = root.path().join("devices/virtual/block/fake0");
        std::fs::create_dir_all(dev.join("size")).unwrap(); // a directory: reading it fails
        std::fs::write(dev.join("dev"), "7:250\n").unwrap();
        std::fs::write(dev.join("ro"), "banana\n").unwrap();
        std::fs::create_dir_all(root.path().join("class/block")).unwrap();
        std::os::unix::fs::symlink(&dev, root.path().join("class/block/fake0")).unwrap();
        let d = read(root.path(), "fake0").unwrap();
        assert!(d.size_bytes == 0 && d.attr_errors.iter().any(|e| e.starts_with("size")), "errors {:?}", d.attr_errors);
        assert!(d.attr_errors.iter().any(|e| e.starts_with("ro: not a number")), "errors {:?}", d.attr_errors);
    }
}
