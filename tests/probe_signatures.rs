//! The signatures that mark a device as in use, made for real on loop
//! devices and checked against `blkid -p -o export` on the same device:
//! type, UUID, UUID_SUB, label and whether a partition table is reported.
//! Each device is probed twice, through the inventory (the ring batch) and
//! through the CSI stage probe, which must never call it blank.
//!
//! Made with the real tools where Debian has them (mkfs.vfat, pvcreate,
//! make-bcache, mkfs.ntfs, xorriso, mksquashfs, mkfs.erofs, mkfs.exfat,
//! mkudffs). Written by hand
//! from the on-disk layouts where it cannot be made here: md superblocks
//! (`mdadm --create` needs the md driver, which this kernel lacks), ZFS
//! labels (no ZFS tools in Debian's main archive), BlueStore's label (no
//! Ceph OSD here), squashfs 3 (today's mksquashfs writes only 4) and
//! BitLocker (made only by Windows). Runs in a private mount namespace; loop devices are
//! detached on drop.

mod common;

use std::collections::BTreeMap;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::process::Command;

use common::{check, LoopDevice, Scratch};
use libtest_mimic::{Failed, Trial};
use volring_devices::{describe, ScanConfig};
use volring_volumes::filesystem::{probe_device, Content};

fn blkid(path: &str) -> BTreeMap<String, String> {
    let out = Command::new("blkid").args(["-p", "-o", "export", path]).output().expect("blkid");
    String::from_utf8_lossy(&out.stdout).lines().filter_map(|l| l.split_once('=')).map(|(k, v)| (k.to_string(), v.to_string())).collect()
}

fn scan_config() -> ScanConfig {
    ScanConfig { node_name: "testnode".into(), ..ScanConfig::default() }
}

fn run(prog: &str, args: &[&str]) -> Result<(), Failed> {
    let out = Command::new(prog).args(args).env("LVM_SUPPRESS_FD_WARNINGS", "1").output().map_err(|e| format!("{prog}: {e}"))?;
    check(out.status.success(), format!("{prog} {args:?}: {}", String::from_utf8_lossy(&out.stderr)))
}

fn write_at(path: &str, offset: u64, bytes: &[u8]) -> Result<(), Failed> {
    let f = std::fs::OpenOptions::new().write(true).open(path)?;
    f.write_all_at(bytes, offset)?;
    f.sync_all()?;
    Ok(())
}

fn size_of(path: &str) -> Result<u64, Failed> {
    let mut f = std::fs::File::open(path)?;
    Ok(std::io::Seek::seek(&mut f, std::io::SeekFrom::End(0))?)
}

/// The probe's answer for `lo` agrees with blkid's, and blkid says `want`.
fn agrees(lo: &LoopDevice, want: &str) -> Result<(), Failed> {
    agrees_but(lo, want, &[])
}

/// Like [`agrees`], except for the blkid fields in `differs`, each with the
/// reason: there blkid has a value and the probe must have none (a label
/// beyond the probe's reads, a table blkid 2.38 wrongly reports).
fn agrees_but(lo: &LoopDevice, want: &str, differs: &[(&str, &str)]) -> Result<(), Failed> {
    let mut b = blkid(lo.path());
    for (field, why) in differs {
        check(b.remove(*field).is_some(), format!("blkid has no {field} any more ({why}): drop the exception"))?;
    }
    check(b.get("TYPE").map(String::as_str) == Some(want), format!("blkid itself does not see {want}: {b:?}"))?;
    let d = describe(&scan_config(), lo.name())?.ok_or("device gone")?;
    let fs = d
        .content
        .filesystem
        .as_ref()
        .ok_or_else(|| format!("probe found no signature (table {:?}, error {:?}); blkid: {b:?}", d.content.table, d.probe_error))?;
    check(fs.fstype.as_str() == want, format!("type {:?}; blkid: {b:?}", fs.fstype))?;
    check(fs.uuid.as_ref() == b.get("UUID"), format!("uuid {:?}; blkid: {b:?}", fs.uuid))?;
    check(fs.label.as_ref() == b.get("LABEL"), format!("label {:?}; blkid: {b:?}", fs.label))?;
    let json = serde_json::to_value(fs)?;
    let sub = json.get("uuid_sub").and_then(|v| v.as_str()).map(String::from);
    check(sub.as_ref() == b.get("UUID_SUB"), format!("uuid_sub {sub:?}; blkid: {b:?}"))?;
    // Members of one set share UUID; the stable id must still be this device's.
    if let (Some(u), Some(sub)) = (b.get("UUID"), b.get("UUID_SUB")) {
        let id = volring_devices::stable_id(&d, "testnode");
        check(id == format!("fsuuid-{u}-{sub}"), format!("id {id} for a member with UUID_SUB {sub}"))?;
    }
    check(d.content.table.is_some() == b.contains_key("PTTYPE"), format!("table {:?}; blkid: {b:?}", d.content.table))?;
    let staged = probe_device(Path::new(lo.path()))?;
    check(matches!(&staged, Content::Other(t) if t == want), format!("the stage probe says {staged:?}"))?;
    Ok(())
}

fn vfat(bits: &str, size: u64) -> Result<(), Failed> {
    let lo = LoopDevice::new(size);
    run("mkfs.vfat", &["-F", bits, "-n", "EFI-DATA", "-i", "1a2b3c4d", lo.path()])?;
    agrees(&lo, "vfat")?;
    let b = blkid(lo.path());
    check(b.get("UUID").map(String::as_str) == Some("1A2B-3C4D"), format!("{b:?}"))
}

/// A DOS table with boot code stays a table, and is not taken for FAT.
fn dos_table_is_not_vfat() -> Result<(), Failed> {
    let lo = LoopDevice::new(64 << 20);
    let mut sf = Command::new("sfdisk").args(["-q", "-X", "dos", lo.path()]).stdin(std::process::Stdio::piped()).spawn()?;
    use std::io::Write;
    sf.stdin.take().ok_or("stdin")?.write_all(b"size=16MiB, type=83\n")?;
    check(sf.wait()?.success(), "sfdisk failed")?;
    let d = describe(&scan_config(), lo.name())?.ok_or("gone")?;
    let b = blkid(lo.path());
    check(d.content.filesystem.is_none() && b.get("PTTYPE").map(String::as_str) == Some("dos"), format!("{:?} {b:?}", d.content))?;
    check(d.content.table.as_ref().is_some_and(|t| t.partitions.len() == 1), format!("{:?}", d.content.table))
}

fn lvm2() -> Result<(), Failed> {
    let lo = LoopDevice::new(64 << 20);
    run("pvcreate", &["-ff", "-y", "-q", lo.path()])?;
    agrees(&lo, "LVM2_member")
}

fn bcache() -> Result<(), Failed> {
    let lo = LoopDevice::new(64 << 20);
    run("make-bcache", &["-B", lo.path()])?;
    agrees(&lo, "bcache")
}

fn ntfs() -> Result<(), Failed> {
    let lo = LoopDevice::new(64 << 20);
    run("mkfs.ntfs", &["-Q", "-F", "-q", "-L", "winvol", lo.path()])?;
    agrees(&lo, "ntfs")
}

/// Builds an image of `dir` with `prog` into `img` and writes it onto `lo`.
fn image_onto(lo: &LoopDevice, s: &Scratch, prog: &str, args: &[&str]) -> Result<(), Failed> {
    let src = s.dir("src");
    std::fs::write(src.join("hello.txt"), b"hello\n")?;
    let img = s.path().join("fs.img");
    let (src, img) = (src.to_string_lossy().to_string(), img.to_string_lossy().to_string());
    let args: Vec<&str> = args
        .iter()
        .map(|a| {
            if *a == "SRC" {
                src.as_str()
            } else if *a == "IMG" {
                img.as_str()
            } else {
                a
            }
        })
        .collect();
    run(prog, &args)?;
    write_at(lo.path(), 0, &std::fs::read(&img)?)
}

fn iso9660() -> Result<(), Failed> {
    let (lo, s) = (LoopDevice::new(16 << 20), Scratch::new());
    image_onto(&lo, &s, "xorriso", &["-as", "mkisofs", "-quiet", "-V", "INSTALL_ME", "-o", "IMG", "SRC"])?;
    agrees(&lo, "iso9660")
}

fn squashfs() -> Result<(), Failed> {
    let (lo, s) = (LoopDevice::new(16 << 20), Scratch::new());
    image_onto(&lo, &s, "mksquashfs", &["SRC", "IMG", "-noappend", "-quiet", "-no-progress"])?;
    agrees(&lo, "squashfs")
}

fn erofs() -> Result<(), Failed> {
    let (lo, s) = (LoopDevice::new(16 << 20), Scratch::new());
    image_onto(&lo, &s, "mkfs.erofs", &["--quiet", "-U7e1f0c3a-5b2d-4c6e-8f90-a1b2c3d4e5f6", "IMG", "SRC"])?;
    agrees(&lo, "erofs")
}

/// BlueStore's label starts with this line and the OSD's UUID.
fn ceph_bluestore() -> Result<(), Failed> {
    let lo = LoopDevice::new(64 << 20);
    write_at(lo.path(), 0, b"bluestore block device\n0b3c4ef0-59e5-4fd8-9b5a-3a7a2c1a5c11\n")?;
    agrees(&lo, "ceph_bluestore")
}

const MD_MAGIC: u32 = 0xa92b_4efc;
const SET_UUID: [u8; 16] = [0x5e, 0x7a, 0x11, 0x02, 0x9c, 0x44, 0x4d, 0x1b, 0x8e, 0x21, 0x33, 0x0f, 0x6a, 0x5d, 0x77, 0x90];

/// An mdadm 1.x superblock for member 0 of a two-disk RAID1, at byte `at`,
/// with its checksum (32-bit sum of the little-endian words over 256 bytes
/// plus two per device slot, folded once).
fn md1_superblock(at: u64, data_offset: u64, data_size: u64) -> Vec<u8> {
    let mut sb = vec![0u8; 4096];
    let put32 = |sb: &mut Vec<u8>, o: usize, v: u32| sb[o..o + 4].copy_from_slice(&v.to_le_bytes());
    let put64 = |sb: &mut Vec<u8>, o: usize, v: u64| sb[o..o + 8].copy_from_slice(&v.to_le_bytes());
    put32(&mut sb, 0, MD_MAGIC);
    put32(&mut sb, 4, 1);
    sb[16..32].copy_from_slice(&SET_UUID);
    sb[32..42].copy_from_slice(b"node1:data");
    put64(&mut sb, 64, 1_700_000_000);
    put32(&mut sb, 72, 1); // level
    put64(&mut sb, 80, data_size);
    put32(&mut sb, 92, 2); // raid disks
    put64(&mut sb, 128, data_offset);
    put64(&mut sb, 136, data_size);
    put64(&mut sb, 144, at >> 9);
    sb[168..184].copy_from_slice(&[0xd0, 0x0d, 0xfe, 0xed, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]);
    put64(&mut sb, 192, 1_700_000_100);
    put64(&mut sb, 200, 42); // events
    put64(&mut sb, 208, u64::MAX); // resync offset: clean
    put32(&mut sb, 220, 384); // max_dev
    for slot in 0..384 {
        let role: u16 = if slot < 2 { slot as u16 } else { 0xFFFF };
        sb[256 + slot * 2..258 + slot * 2].copy_from_slice(&role.to_le_bytes());
    }
    let sum: u64 = sb[..256 + 2 * 384].chunks(4).map(|w| u64::from(u32::from_le_bytes(w.try_into().expect("4")))).sum();
    put32(&mut sb, 216, ((sum & 0xFFFF_FFFF) + (sum >> 32)) as u32);
    sb
}

/// `version` "1.1", "1.2" or "1.0"; with `ext4` the array's filesystem is
/// also there, at offset 0 of the member as a 1.0 mirror half has it.
fn md1(version: &str, ext4: bool) -> Result<(), Failed> {
    let lo = LoopDevice::new(64 << 20);
    if ext4 {
        lo.mkfs_with("ext4", &["-L", "inside"]);
    }
    let size = size_of(lo.path())?;
    let at = match version {
        "1.1" => 0,
        "1.2" => 4096,
        _ => (((size >> 9) - 16) & !7) << 9,
    };
    let data_offset = if version == "1.0" { 0 } else { 2048 };
    write_at(lo.path(), at, &md1_superblock(at, data_offset, (size >> 9) - 4096))?;
    agrees(&lo, "linux_raid_member")
}

/// Superblock 0.90 in the last 64 KiB-aligned 64 KiB, host byte order.
fn md090() -> Result<(), Failed> {
    let lo = LoopDevice::new((64 << 20) + 12345 * 512);
    let size = size_of(lo.path())?;
    let mut sb = vec![0u8; 4096];
    let words: [(usize, u32); 12] = [
        (0, MD_MAGIC),
        (4, 0),
        (8, 90),
        (12, 0),
        (20, u32::from_le_bytes(SET_UUID[0..4].try_into()?)),
        (24, 1_700_000_000),
        (28, 1),
        (32, (((size & !0xFFFF) - 0x10000) >> 10) as u32),
        (36, 2),
        (40, 2),
        (52, u32::from_le_bytes(SET_UUID[4..8].try_into()?)),
        (56, u32::from_le_bytes(SET_UUID[8..12].try_into()?)),
    ];
    for (o, v) in words {
        sb[o..o + 4].copy_from_slice(&v.to_le_bytes());
    }
    sb[60..64].copy_from_slice(&SET_UUID[12..16]);
    write_at(lo.path(), (size & !0xFFFF) - 0x10000, &sb)?;
    agrees(&lo, "linux_raid_member")
}

/// A big-endian XDR nvpair: sizes, padded name, type, one element, value.
fn nvpair(name: &str, ty: u32, value: &[u8]) -> Vec<u8> {
    let pad = |n: usize| n.next_multiple_of(4);
    let size = 4 * 3 + pad(name.len()) + 8 + pad(value.len());
    let mut p = Vec::with_capacity(size);
    p.extend_from_slice(&(size as u32).to_be_bytes());
    p.extend_from_slice(&(size as u32 + 16).to_be_bytes());
    p.extend_from_slice(&(name.len() as u32).to_be_bytes());
    p.extend_from_slice(name.as_bytes());
    p.resize(p.len().next_multiple_of(4), 0);
    p.extend_from_slice(&ty.to_be_bytes());
    p.extend_from_slice(&1u32.to_be_bytes());
    p.extend_from_slice(value);
    p.resize(size, 0);
    p
}

/// A 256 KiB ZFS vdev label: the nvlist at 16 KiB (pool name and guids) and
/// `uberblocks` uberblocks (magic, version, txg) in the array at 128 KiB.
fn zfs_label(uberblocks: usize) -> Vec<u8> {
    let mut l = vec![0u8; 256 << 10];
    let mut nv = vec![1u8, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1];
    let mut s = Vec::new();
    s.extend_from_slice(&4u32.to_be_bytes());
    s.extend_from_slice(b"tank");
    nv.extend(nvpair("version", 8, &5000u64.to_be_bytes()));
    nv.extend(nvpair("name", 9, &s));
    nv.extend(nvpair("state", 8, &0u64.to_be_bytes()));
    nv.extend(nvpair("pool_guid", 8, &12_345_678_901_234_567_890u64.to_be_bytes()));
    nv.extend(nvpair("guid", 8, &9_876_543_210_987_654_321u64.to_be_bytes()));
    nv.extend([0u8; 8]);
    l[16 << 10..(16 << 10) + nv.len()].copy_from_slice(&nv);
    for i in 0..uberblocks {
        let at = (128 << 10) + i * 1024;
        l[at..at + 8].copy_from_slice(&0x00ba_b10cu64.to_le_bytes());
        l[at + 8..at + 16].copy_from_slice(&5000u64.to_le_bytes());
        l[at + 16..at + 24].copy_from_slice(&(i as u64 + 4).to_le_bytes());
    }
    l
}

/// `front`: all four labels; else only the two at the end (the first two
/// wiped), which only the tail read can see.
fn zfs(front: bool) -> Result<(), Failed> {
    let lo = LoopDevice::new((128 << 20) + 100 * 1024);
    let size = size_of(lo.path())?;
    let end = size - size % (256 << 10);
    let starts: &[u64] = if front { &[0, 256 << 10] } else { &[] };
    for &at in starts.iter().chain(&[end - (512 << 10), end - (256 << 10)]) {
        write_at(lo.path(), at, &zfs_label(if front { 8 } else { 2 }))?;
    }
    agrees(&lo, "zfs_member")
}

/// blkid finds nothing on `lo`, and neither does the probe; the stage
/// probe still refuses to call the device blank.
fn neither(lo: &LoopDevice) -> Result<(), Failed> {
    let b = blkid(lo.path());
    check(!b.contains_key("TYPE"), format!("blkid sees {b:?}"))?;
    let d = describe(&scan_config(), lo.name())?.ok_or("device gone")?;
    check(d.content.filesystem.is_none(), format!("probe found {:?}; blkid: {b:?}", d.content.filesystem))?;
    let staged = probe_device(Path::new(lo.path()))?;
    check(matches!(staged, Content::Other(_)), format!("the stage probe says {staged:?}"))
}

/// Only the second label (at 256 KiB) survives: the first is wiped and the
/// two at the end are gone. blkid counts it, so the probe must read it.
fn zfs_second_label_only() -> Result<(), Failed> {
    let lo = LoopDevice::new((128 << 20) + 100 * 1024);
    write_at(lo.path(), 256 << 10, &zfs_label(8))?;
    agrees(&lo, "zfs_member")
}

/// MFT record `n`'s offset, from the NTFS boot sector.
fn ntfs_mft_record(path: &str, n: u64) -> Result<u64, Failed> {
    let mut boot = [0u8; 512];
    std::fs::File::open(path)?.read_exact_at(&mut boot, 0)?;
    let cluster = u64::from(u16::from_le_bytes([boot[11], boot[12]])) * u64::from(boot[13]);
    let rec = match boot[0x40] {
        v @ 1..=64 => u64::from(v) * cluster,
        v => 1u64 << (256 - u32::from(v)),
    };
    Ok(u64::from_le_bytes(boot[0x30..0x38].try_into()?) * cluster + n * rec)
}

/// A boot sector whose MFT lost its `FILE` magic (record 0, then record 3)
/// is not NTFS to blkid, nor to the probe.
fn ntfs_without_mft(record: u64) -> Result<(), Failed> {
    let lo = LoopDevice::new(64 << 20);
    run("mkfs.ntfs", &["-Q", "-F", "-q", lo.path()])?;
    write_at(lo.path(), ntfs_mft_record(lo.path(), record)?, b"\0\0\0\0")?;
    neither(&lo)
}

/// A bcache superblock with one byte changed fails its CRC-64: the kernel
/// refuses it and so does the probe. blkid 2.38 does not check the
/// checksum (2.39 does), so it still says bcache; the stage probe must not
/// call the device blank either way.
fn bcache_bad_checksum() -> Result<(), Failed> {
    let lo = LoopDevice::new(64 << 20);
    run("make-bcache", &["-B", lo.path()])?;
    write_at(lo.path(), 4096 + 72, b"relabelled")?;
    let d = describe(&scan_config(), lo.name())?.ok_or("device gone")?;
    check(d.content.filesystem.is_none(), format!("probe found {:?} behind a bad checksum", d.content.filesystem))?;
    let staged = probe_device(Path::new(lo.path()))?;
    check(matches!(staged, Content::Other(_)), format!("the stage probe says {staged:?}"))
}

/// squashfs 3 (no mksquashfs in Debian makes it any more): the superblock
/// fields blkid reads, in either byte order.
fn squashfs3(big_endian: bool) -> Result<(), Failed> {
    let lo = LoopDevice::new(16 << 20);
    let mut sb = vec![0u8; 96];
    let (magic, major, minor): (&[u8], [u8; 2], [u8; 2]) =
        if big_endian { (b"sqsh", 3u16.to_be_bytes(), 1u16.to_be_bytes()) } else { (b"hsqs", 3u16.to_le_bytes(), 0u16.to_le_bytes()) };
    sb[0..4].copy_from_slice(magic);
    sb[28..30].copy_from_slice(&major);
    sb[30..32].copy_from_slice(&minor);
    write_at(lo.path(), 0, &sb)?;
    agrees(&lo, "squashfs3")
}

/// blkid 2.38 also reports an exFAT boot sector as a DOS table (2.39 asks
/// the exFAT prober first); the probe does not.
const EXFAT_NOT_A_TABLE: (&str, &str) = ("PTTYPE", "an exFAT boot sector is not an MBR; blkid 2.38 reports one");

/// exFAT with its root directory near the start (4 KiB alignment): type,
/// serial and the label from the root directory all agree.
fn exfat_small_alignment() -> Result<(), Failed> {
    let lo = LoopDevice::new(64 << 20);
    run("mkfs.exfat", &["-b", "4K", "-c", "4K", "-L", "SmallEx", lo.path()])?;
    agrees_but(&lo, "exfat", &[EXFAT_NOT_A_TABLE])
}

/// exFAT as mkfs.exfat lays it out by default: the cluster heap, and the
/// root directory with the label, start 2 MiB in, beyond the probe's
/// reads. The type and serial agree; the label is left unknown.
fn exfat_default() -> Result<(), Failed> {
    let lo = LoopDevice::new(64 << 20);
    run("mkfs.exfat", &["-L", "ExLabel", lo.path()])?;
    agrees_but(&lo, "exfat", &[EXFAT_NOT_A_TABLE, ("LABEL", "the root directory lies 2 MiB in, beyond the two reads")])
}

/// UDF with 512-byte blocks (the anchor at sector 256, in the head read)
/// and 2048-byte ones (the anchor at 512 KiB, read from the last sector).
fn udf(block: &str) -> Result<(), Failed> {
    let lo = LoopDevice::new(64 << 20);
    run("mkudffs", &["-b", block, "--label=UdfVol", lo.path()])?;
    agrees(&lo, "udf")
}

/// BitLocker (no tool in Debian makes it): a Windows 7 boot sector, with
/// the FVE metadata block it points to; without that block it is nothing.
fn bitlocker(with_metadata: bool) -> Result<(), Failed> {
    let lo = LoopDevice::new(64 << 20);
    let mut boot = vec![0u8; 512];
    boot[0..3].copy_from_slice(&[0xEB, 0x58, 0x90]);
    boot[3..11].copy_from_slice(b"-FVE-FS-");
    boot[11..13].copy_from_slice(&512u16.to_le_bytes());
    boot[13] = 8;
    boot[67..71].copy_from_slice(&20_250_101u32.to_le_bytes());
    boot[71..82].copy_from_slice(b"NO NAME    ");
    boot[160..176].copy_from_slice(&[0x3b, 0xd6, 0x67, 0x49, 0x29, 0x2e, 0xd8, 0x4a, 0x83, 0x99, 0xf6, 0xa3, 0x39, 0xe3, 0xd0, 0x01]);
    boot[176..184].copy_from_slice(&(96u64 << 10).to_le_bytes());
    boot[510] = 0x55;
    boot[511] = 0xAA;
    write_at(lo.path(), 0, &boot)?;
    if !with_metadata {
        return neither(&lo);
    }
    let mut fve = b"-FVE-FS-".to_vec();
    fve.extend_from_slice(&64u16.to_le_bytes());
    fve.extend_from_slice(&2u16.to_le_bytes());
    write_at(lo.path(), 96 << 10, &fve)?;
    // This boot sector has no boot code, so its partition-table area is
    // zeros, which blkid reads as an empty DOS table.
    agrees_but(&lo, "BitLocker", &[("PTTYPE", "a BitLocker boot sector is not an MBR")])
}

fn main() {
    let trials = vec![
        Trial::test("signatures::vfat_fat12", || vfat("12", 8 << 20)),
        Trial::test("signatures::vfat_fat16", || vfat("16", 64 << 20)),
        Trial::test("signatures::vfat_fat32", || vfat("32", 256 << 20)),
        Trial::test("signatures::dos_table_is_not_vfat", dos_table_is_not_vfat),
        Trial::test("signatures::lvm2_member", lvm2),
        Trial::test("signatures::md_1_2", || md1("1.2", false)),
        Trial::test("signatures::md_1_1", || md1("1.1", false)),
        Trial::test("signatures::md_1_0", || md1("1.0", false)),
        Trial::test("signatures::md_1_0_over_ext4", || md1("1.0", true)),
        Trial::test("signatures::md_0_90", md090),
        Trial::test("signatures::bcache", bcache),
        Trial::test("signatures::ceph_bluestore", ceph_bluestore),
        Trial::test("signatures::zfs_member", || zfs(true)),
        Trial::test("signatures::zfs_member_tail_labels_only", || zfs(false)),
        Trial::test("signatures::ntfs", ntfs),
        Trial::test("signatures::iso9660", iso9660),
        Trial::test("signatures::squashfs", squashfs),
        Trial::test("signatures::erofs", erofs),
        Trial::test("signatures::zfs_member_second_label_only", zfs_second_label_only),
        Trial::test("signatures::ntfs_mft_record_0_wiped", || ntfs_without_mft(0)),
        Trial::test("signatures::ntfs_mft_record_3_wiped", || ntfs_without_mft(3)),
        Trial::test("signatures::bcache_bad_checksum", bcache_bad_checksum),
        Trial::test("signatures::squashfs3_little_endian", || squashfs3(false)),
        Trial::test("signatures::squashfs3_big_endian", || squashfs3(true)),
        Trial::test("signatures::exfat", exfat_small_alignment),
        Trial::test("signatures::exfat_default_layout", exfat_default),
        Trial::test("signatures::udf_512", || udf("512")),
        Trial::test("signatures::udf_2048", || udf("2048")),
        Trial::test("signatures::bitlocker", || bitlocker(true)),
        Trial::test("signatures::bitlocker_without_metadata", || bitlocker(false)),
    ];
    common::run_in_private_namespace(trials)
}
