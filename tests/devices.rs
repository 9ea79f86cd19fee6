//! Block-device discovery, probes, hot-plug and counters against the real
//! kernel: loop devices over sparse files, real mkfs/mkswap/sfdisk/dmsetup,
//! checked against blkid. Runs in a private mount namespace; every loop
//! device is attached with autoclear and detached on drop.

mod common;

use std::collections::BTreeMap;
use std::os::unix::fs::OpenOptionsExt;
use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{check, LoopDevice, Scratch};
use libtest_mimic::{Failed, Trial};
use volring_devices::{describe, DeviceEvent, DeviceWatcher, Inventory, ScanConfig, StatCollector, StatMethod, StatSource, Use};
use volring_devices::{FsType, TableType};
use volring_mounts::MountTable;
use volring_ring::BackendChoice;

/// The longest a test waits for the kernel to get somewhere (partitions to
/// appear, a detached device to empty, a uevent, counters to move). Each
/// wait ends as soon as its condition holds, so the bound only matters on a
/// loaded CI host and in the emulated 6.1 guest of tests/vm.rs.
const PATIENCE: Duration = Duration::from_secs(30);

/// `blkid -p -o export` of a device: what the probe must agree with.
fn blkid(path: &str) -> BTreeMap<String, String> {
    let out = Command::new("blkid").args(["-p", "-o", "export", path]).output().expect("blkid");
    String::from_utf8_lossy(&out.stdout).lines().filter_map(|l| l.split_once('=')).map(|(k, v)| (k.to_string(), v.to_string())).collect()
}

fn mounts() -> MountTable {
    volring_mounts::load(false).expect("mount table").0
}

fn scan_config() -> ScanConfig {
    ScanConfig { node_name: "testnode".into(), ..ScanConfig::default() }
}

fn probe_matches_blkid(fs: &str, extra: &[&str], want: FsType) -> Result<(), Failed> {
    let lo = LoopDevice::new(if fs == "xfs" { 320 << 20 } else { 128 << 20 });
    lo.mkfs_with(fs, extra);
    let inv = Inventory::scan(&scan_config(), &mounts())?;
    let d = inv.by_name(lo.name()).ok_or("loop device not in the inventory")?;
    let got = d.content.filesystem.as_ref().ok_or_else(|| format!("no filesystem found; probe error {:?}", d.probe_error))?;
    let b = blkid(lo.path());
    check(got.fstype == want, format!("type {:?}, blkid says {:?}", got.fstype, b.get("TYPE")))?;
    check(b.get("TYPE").map(String::as_str) == Some(want.as_str()), format!("blkid TYPE {:?}", b.get("TYPE")))?;
    check(got.uuid.as_ref() == b.get("UUID"), format!("uuid {:?} vs blkid {:?}", got.uuid, b.get("UUID")))?;
    check(got.label.as_ref() == b.get("LABEL"), format!("label {:?} vs blkid {:?}", got.label, b.get("LABEL")))?;
    check(d.id == format!("fsuuid-{}", got.uuid.as_deref().unwrap_or("")), format!("id {}", d.id))?;
    check(
        d.loop_backing.as_ref().is_some_and(|l| l.file.to_string_lossy().contains("volring-img-")),
        format!("backing {:?}", d.loop_backing),
    )?;
    Ok(())
}

/// cryptsetup writes the LUKS2 header without needing device-mapper.
fn luks2() -> Result<(), Failed> {
    let lo = LoopDevice::new(32 << 20);
    let mut c = Command::new("cryptsetup")
        .args([
            "luksFormat",
            "--batch-mode",
            "--type",
            "luks2",
            "--label",
            "secret",
            "--pbkdf",
            "pbkdf2",
            "--pbkdf-force-iterations",
            "1000",
        ])
        .args(["--key-file", "-", lo.path()])
        .stdin(std::process::Stdio::piped())
        .spawn()?;
    use std::io::Write;
    c.stdin.take().ok_or("stdin")?.write_all(b"not-a-real-key")?;
    check(c.wait()?.success(), "cryptsetup luksFormat failed")?;
    let d = describe(&scan_config(), lo.name())?.ok_or("gone")?;
    let fs = d.content.filesystem.ok_or("no LUKS header found")?;
    let b = blkid(lo.path());
    check(fs.fstype == FsType::Luks && b.get("TYPE").map(String::as_str) == Some("crypto_LUKS"), format!("{fs:?} {b:?}"))?;
    check(fs.uuid.as_ref() == b.get("UUID") && fs.label.as_ref() == b.get("LABEL"), format!("{fs:?} {b:?}"))?;
    Ok(())
}

fn gpt_partitions() -> Result<(), Failed> {
    let lo = LoopDevice::with_partscan(64 << 20, true);
    let mut sf = Command::new("sfdisk").args(["-q", "-X", "gpt", lo.path()]).stdin(std::process::Stdio::piped()).spawn()?;
    use std::io::Write;
    sf.stdin.take().ok_or("stdin")?.write_all(b"size=16MiB, name=alpha\nsize=8MiB, name=beta\n")?;
    check(sf.wait()?.success(), "sfdisk failed")?;
    // Kernels built without partition parsers (this one) make no partition
    // devices on their own; BLKPG through partx adds them from the table.
    if !std::path::Path::new(&format!("/sys/class/block/{}p1", lo.name())).exists() {
        let _ = Command::new("partx").args(["-a", lo.path()]).status();
    }
    let p1 = format!("{}p1", lo.name());
    let p2 = format!("{}p2", lo.name());
    let deadline = Instant::now() + PATIENCE;
    while !std::path::Path::new(&format!("/sys/class/block/{p2}")).exists() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    let inv = Inventory::scan(&scan_config(), &mounts())?;
    let disk = inv.by_name(lo.name()).ok_or("disk missing")?;
    let table = disk.content.table.as_ref().ok_or("no partition table found")?;
    let b = blkid(lo.path());
    check(table.table == TableType::Gpt && Some(&table.id) == b.get("PTUUID"), format!("table {table:?} vs {b:?}"))?;
    check(table.partitions.len() == 2, format!("{} partitions", table.partitions.len()))?;
    check(table.partitions[0].name.as_deref() == Some("alpha"), format!("name {:?}", table.partitions[0].name))?;
    for (n, name) in [(1, &p1), (2, &p2)] {
        let part = inv.by_name(name).ok_or_else(|| format!("{name} not found"))?;
        check(part.partition == Some((n, lo.name().to_string())), format!("{name} partition {:?}", part.partition))?;
        let want = blkid(&format!("/dev/{name}")).get("PART_ENTRY_UUID").cloned();
        check(part.part_uuid == want, format!("{name} PARTUUID {:?} vs {:?}", part.part_uuid, want))?;
        check(part.id == format!("partuuid-{}", want.unwrap_or_default()), format!("id {}", part.id))?;
    }
    check(inv.by_name(&p1).map(|p| p.size_bytes) == Some(16 << 20), "p1 size")?;
    Ok(())
}

/// dm-linear over a loop device: holders and slaves both ways.
fn holders_and_slaves() -> Result<(), Failed> {
    let lo = LoopDevice::new(32 << 20);
    let name = format!("volring-test-{}", std::process::id());
    let table = format!("0 {} linear {} 0", (32 << 20) / 512, lo.path());
    check(Command::new("dmsetup").args(["create", &name, "--table", &table]).status()?.success(), "dmsetup create")?;
    struct Dm(String);
    impl Drop for Dm {
        fn drop(&mut self) {
            let _ = Command::new("dmsetup").args(["remove", "--retry", &self.0]).status();
        }
    }
    let _dm = Dm(name.clone());
    let inv = Inventory::scan(&scan_config(), &mounts())?;
    let below = inv.by_name(lo.name()).ok_or("loop missing")?;
    let dm = inv.devices.values().find(|d| d.dm.as_ref().is_some_and(|m| m.name == name)).ok_or("dm device missing")?;
    check(below.holders == vec![dm.name.clone()], format!("holders {:?}", below.holders))?;
    check(below.uses.iter().any(|u| matches!(u, Use::Held(h) if h == &vec![dm.name.clone()])), format!("uses {:?}", below.uses))?;
    check(dm.slaves == vec![lo.name().to_string()], format!("slaves {:?}", dm.slaves))?;
    check(dm.kind.to_string() == "dm", format!("kind {:?}", dm.kind))?;
    Ok(())
}

fn mounted_device_is_in_use() -> Result<(), Failed> {
    let scratch = Scratch::new();
    let lo = LoopDevice::new(64 << 20);
    lo.mkfs("ext4");
    let at = scratch.dir("mnt");
    rustix::mount::mount(lo.path(), &at, "ext4", rustix::mount::MountFlags::empty(), None)?;
    let inv = Inventory::scan(&scan_config(), &mounts())?;
    let d = inv.by_name(lo.name()).ok_or("missing")?;
    check(d.mountpoints == vec![at.clone()], format!("mountpoints {:?}", d.mountpoints))?;
    check(d.in_use() && !d.os_disk, format!("uses {:?} os {}", d.uses, d.os_disk))?;
    Ok(())
}

fn garbage_superblock_and_vanished_device() -> Result<(), Failed> {
    let lo = LoopDevice::new(1 << 20);
    let mut f = std::fs::OpenOptions::new().write(true).open(lo.path())?;
    let noise: Vec<u8> = (0..256 * 1024u32).map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8).collect();
    use std::io::Write;
    f.write_all(&noise[..1 << 20 >> 2])?;
    f.sync_all()?;
    drop(f);
    let d = describe(&scan_config(), lo.name())?.ok_or("gone")?;
    check(
        d.content.filesystem.is_none() && d.content.table.is_none() && d.probe_error.is_none(),
        format!("{:?} {:?}", d.content, d.probe_error),
    )?;
    let name = lo.name().to_string();
    lo.detach();
    let deadline = Instant::now() + PATIENCE;
    loop {
        let d = describe(&scan_config(), &name)?;
        if d.as_ref().is_none_or(|d| d.size_bytes == 0) {
            break;
        }
        check(Instant::now() < deadline, "device still sized after detach")?;
        std::thread::sleep(Duration::from_millis(20));
    }
    check(describe(&scan_config(), "loop-that-never-was")?.is_none(), "a missing device must read as gone")?;
    Ok(())
}

fn hotplug_add_and_remove(io: BackendChoice) -> Result<(), Failed> {
    let (watcher, rx) = DeviceWatcher::start(ScanConfig { io, ..scan_config() }, 256, Default::default())?;
    let lo = LoopDevice::new(16 << 20);
    lo.mkfs("ext4");
    let name = lo.name().to_string();
    let next = |want: &dyn Fn(&DeviceEvent) -> bool| -> Result<DeviceEvent, Failed> {
        let deadline = Instant::now() + PATIENCE;
        while Instant::now() < deadline {
            if let Some(ev) = rx.recv_timeout(Duration::from_millis(100)) {
                if want(&ev) {
                    return Ok(ev);
                }
            }
        }
        Err(format!("no such device event within {PATIENCE:?}").into())
    };
    let added = next(&|ev| matches!(ev, DeviceEvent::Added { device, .. } | DeviceEvent::Changed { device, .. } if device.name == name))?;
    check(matches!(added, DeviceEvent::Added { .. }), format!("first event {added:?}"))?;
    lo.detach();
    let removed = next(&|ev| matches!(ev, DeviceEvent::Removed { name: n, .. } if *n == name))?;
    check(matches!(removed, DeviceEvent::Removed { dev: Some(_), .. }), format!("{removed:?}"))?;
    watcher.stop()?;
    Ok(())
}

/// Writes through the device show up in every method's counters.
fn counters_see_io() -> Result<(), Failed> {
    let lo = LoopDevice::new(16 << 20);
    let lo_dev = describe(&scan_config(), lo.name())?.ok_or("gone")?.dev;
    let tracked = vec![(lo_dev, Arc::from(lo.name()))];
    let mut src = StatSource::new(tracked.clone(), BackendChoice::Auto)?;
    let before: Vec<_> = [StatMethod::Diskstats, StatMethod::Ring, StatMethod::Pread, StatMethod::OpenRead]
        .iter()
        .map(|&m| src.read(m).map(|s| s[0].2.clone()))
        .collect::<Result<_, _>>()?;
    let (collector, reader) =
        StatCollector::start(volring_devices::CollectorConfig { interval: Duration::from_millis(50), ..Default::default() }, tracked)?;
    let mut f = std::fs::OpenOptions::new().write(true).custom_flags(libc::O_DIRECT).open(lo.path())?;
    let buf = AlignedBlock::new();
    use std::io::Write;
    for _ in 0..64 {
        f.write_all(buf.as_slice())?; // 64 × 16 KiB = 1 MiB, 2048 sectors
    }
    f.sync_all()?;
    for (i, &m) in [StatMethod::Diskstats, StatMethod::Ring, StatMethod::Pread, StatMethod::OpenRead].iter().enumerate() {
        let after = src.read(m)?[0].2.clone()?;
        let was = before[i].clone()?;
        check(after.write_sectors >= was.write_sectors + 2048, format!("{m:?}: {} -> {} sectors", was.write_sectors, after.write_sectors))?;
        check(after.writes > was.writes, format!("{m:?}: writes {} -> {}", was.writes, after.writes))?;
    }
    let deadline = Instant::now() + PATIENCE;
    loop {
        let snap = reader.latest();
        let seen = snap.devices.iter().find(|d| d.dev == lo_dev);
        if seen.is_some_and(|d| d.counters.write_sectors >= 2048) {
            break;
        }
        check(Instant::now() < deadline, format!("collector never saw the writes: {seen:?}"))?;
        std::thread::sleep(Duration::from_millis(20));
    }
    collector.stop()?;
    Ok(())
}

/// 16 KiB aligned for O_DIRECT.
struct AlignedBlock(Vec<u8>, usize);
impl AlignedBlock {
    fn new() -> Self {
        let v = vec![0x5Au8; 16384 + 4096];
        let off = v.as_ptr().align_offset(4096);
        Self(v, off)
    }
    fn as_slice(&self) -> &[u8] {
        &self.0[self.1..self.1 + 16384]
    }
}

fn cli_devices_json_and_stats() -> Result<(), Failed> {
    let lo = LoopDevice::new(64 << 20);
    lo.mkfs_with("ext4", &["-L", "clitest"]);
    let out = Command::new(env!("CARGO_BIN_EXE_volring")).args(["devices", "--json"]).output()?;
    check(out.status.success(), String::from_utf8_lossy(&out.stderr).to_string())?;
    let v: serde_json::Value = serde_json::from_slice(&out.stdout)?;
    let d =
        v["blockdevices"].as_array().ok_or("no blockdevices")?.iter().find(|d| d["name"] == lo.name()).ok_or("loop not listed")?.clone();
    check(d["content"]["filesystem"]["type"] == "ext4" && d["content"]["filesystem"]["label"] == "clitest", format!("{d}"))?;
    let table = Command::new(env!("CARGO_BIN_EXE_volring")).arg("devices").output()?;
    let text = String::from_utf8_lossy(&table.stdout);
    check(text.lines().any(|l| l.starts_with(lo.name()) && l.contains("ext4") && l.contains("64M")), text.to_string())?;
    let stats = Command::new(env!("CARGO_BIN_EXE_volring")).args(["stats", "--count", "1", "--interval", "0.1", "--json"]).output()?;
    check(stats.status.success(), String::from_utf8_lossy(&stats.stderr).to_string())?;
    let s: serde_json::Value = serde_json::from_slice(&stats.stdout)?;
    check(s["devices"].as_array().is_some_and(|a| a.iter().any(|d| d["name"] == lo.name() && d["rates"].is_object())), format!("{s}"))?;
    Ok(())
}

fn main() {
    // device-mapper is the usual holder; kernels without it cannot show one.
    let has_dm = std::fs::read_to_string("/proc/devices").is_ok_and(|d| d.contains("device-mapper"));
    if !has_dm {
        eprintln!("note: this kernel has no device-mapper; inventory::holders_and_slaves is ignored");
    }
    let mut trials = vec![
        Trial::test("probe::ext4", || {
            probe_matches_blkid("ext4", &["-L", "vol-data", "-U", "0b3c4ef0-59e5-4fd8-9b5a-3a7a2c1a5c11"], FsType::Ext4)
        }),
        Trial::test("probe::ext2", || probe_matches_blkid("ext2", &["-L", "old"], FsType::Ext2)),
        Trial::test("probe::ext3", || probe_matches_blkid("ext3", &[], FsType::Ext3)),
        Trial::test("probe::xfs", || probe_matches_blkid("xfs", &["-L", "xfslabel"], FsType::Xfs)),
        Trial::test("probe::btrfs", || probe_matches_blkid("btrfs", &["-L", "butter"], FsType::Btrfs)),
        Trial::test("probe::swap", || probe_matches_blkid("swap", &["-L", "swappy"], FsType::Swap)),
        Trial::test("probe::gpt_partitions", gpt_partitions),
        Trial::test("probe::luks2", luks2),
        Trial::test("inventory::holders_and_slaves", holders_and_slaves).with_ignored_flag(!has_dm),
        Trial::test("inventory::mounted_device_is_in_use", mounted_device_is_in_use),
        Trial::test("inventory::garbage_superblock_and_vanished_device", garbage_superblock_and_vanished_device),
        Trial::test("stats::counters_see_io", counters_see_io),
        Trial::test("cli::devices_json_and_stats", cli_devices_json_and_stats),
    ];
    for (name, io) in [("uring", BackendChoice::IoUring), ("epoll", BackendChoice::Epoll)] {
        trials.push(Trial::test(format!("hotplug::{name}::add_and_remove"), move || hotplug_add_and_remove(io)));
    }
    common::run_in_private_namespace(trials)
}
