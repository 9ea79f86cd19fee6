//! What is on a device: filesystem, volume-manager and partition-table
//! signatures, from a few bounded reads.
//!
//! Pure over the bytes read (`Sample`), so it can be fuzzed; the reads
//! themselves are the caller's ([`probe_reads`]), laid out by
//! `read_plan`. It only ever reads: unlike node-disk-manager, nothing is
//! written to a bare disk to give it an id. Offsets and magics are those of
//! the on-disk formats. A device that holds a RAID or volume-manager member
//! must never look blank, so the members (`members`) are probed first, as
//! blkid does.

use serde::Serialize;

mod fs;
mod members;
pub(crate) mod tables;
mod udf;
mod windows;

use tables::{gpt, mbr, PartitionTable};

/// How much of the start of a device the probe reads: the first two ZFS
/// labels (each with its nvlist at 16 KiB and uberblock array at 128–256
/// KiB), so a pool whose first label is damaged is still seen; this also
/// covers btrfs's superblock at 64 KiB, the ISO 9660 and UDF volume
/// descriptors from 32 KiB, UDF's anchor at sector 256 of 512 and 1024-byte
/// sectors, GPT entries on 4 KiB sectors and swap on 64 KiB pages.
pub const PROBE_LEN: usize = 512 << 10;

/// The reads that [`probe_sample`] wants from a device of `size` bytes, as
/// `(offset, length)`: the head, and the tail when the device is larger
/// than the head. Never more than two reads: at most [`PROBE_LEN`] and
/// 768 KiB of tail (the tests' `TAIL_MAX` and `READ_BUDGET`).
pub(crate) fn read_plan(size: u64) -> Vec<(u64, usize)> {
    let head = size.min(PROBE_LEN as u64);
    let mut plan = vec![(0, head as usize)];
    if size > head {
        let tail_start = size.saturating_sub(members::zfs_tail_len(size)).max(head);
        plan.push((tail_start, (size - tail_start) as usize));
    }
    plan
}

/// Bytes read from one device, each run at its offset, and the device's
/// size (where end-of-device signatures are looked for).
#[derive(Debug, Clone)]
pub(crate) struct Sample<'a> {
    size: u64,
    runs: Vec<(u64, &'a [u8])>,
}

impl<'a> Sample<'a> {
    /// Nothing read yet, from a device of `size` bytes.
    pub(crate) fn new(size: u64) -> Self {
        Self { size, runs: Vec::new() }
    }

    /// A whole device held in `bytes`.
    pub(crate) fn whole(bytes: &'a [u8]) -> Self {
        Self { size: bytes.len() as u64, runs: vec![(0, bytes)] }
    }

    /// Adds bytes read at `offset`; bytes past the device's size are ignored.
    pub(crate) fn add(&mut self, offset: u64, bytes: &'a [u8]) {
        self.runs.push((offset, bytes));
    }

    pub(crate) fn size(&self) -> u64 {
        self.size
    }

    /// `len` bytes at `offset`, when one read covered all of them.
    fn at(&self, offset: u64, len: usize) -> Option<&'a [u8]> {
        let end = offset.checked_add(len as u64)?;
        if end > self.size {
            return None;
        }
        self.runs.iter().find_map(|&(o, b)| {
            let from = usize::try_from(offset.checked_sub(o)?).ok()?;
            b.get(from..from.checked_add(len)?)
        })
    }

    /// What was read from offset 0 on (empty when nothing was).
    fn head(&self) -> &'a [u8] {
        let b = self.runs.iter().find(|(o, _)| *o == 0).map(|&(_, b)| b).unwrap_or(&[]);
        &b[..b.len().min(usize::try_from(self.size).unwrap_or(usize::MAX))]
    }

    /// True when every byte read is zero.
    pub(crate) fn all_zero(&self) -> bool {
        self.runs.iter().all(|(_, b)| b.iter().all(|&x| x == 0))
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum FsType {
    Ext2,
    Ext3,
    Ext4,
    Xfs,
    Btrfs,
    Swap,
    /// `crypto_LUKS` in blkid's words.
    Luks,
    /// FAT12/16/32.
    Vfat,
    Ntfs,
    Exfat,
    Iso9660,
    Udf,
    Squashfs,
    /// squashfs before version 4 (either byte order), a type of its own in blkid.
    Squashfs3,
    Erofs,
    /// A BitLocker-encrypted NTFS or FAT volume.
    #[serde(rename = "BitLocker")]
    BitLocker,
    /// An LVM2 physical volume.
    #[serde(rename = "LVM2_member")]
    Lvm2Member,
    /// A Linux software RAID (md) member, any superblock version.
    #[serde(rename = "linux_raid_member")]
    LinuxRaidMember,
    /// A bcache backing or cache device.
    Bcache,
    /// A Ceph OSD's BlueStore block device.
    #[serde(rename = "ceph_bluestore")]
    CephBluestore,
    /// A vdev of a ZFS pool.
    #[serde(rename = "zfs_member")]
    ZfsMember,
}

impl FsType {
    pub fn as_str(self) -> &'static str {
        match self {
            FsType::Ext2 => "ext2",
            FsType::Ext3 => "ext3",
            FsType::Ext4 => "ext4",
            FsType::Xfs => "xfs",
            FsType::Btrfs => "btrfs",
            FsType::Swap => "swap",
            FsType::Luks => "crypto_LUKS",
            FsType::Vfat => "vfat",
            FsType::Ntfs => "ntfs",
            FsType::Exfat => "exfat",
            FsType::Iso9660 => "iso9660",
            FsType::Udf => "udf",
            FsType::Squashfs => "squashfs",
            FsType::Squashfs3 => "squashfs3",
            FsType::Erofs => "erofs",
            FsType::BitLocker => "BitLocker",
            FsType::Lvm2Member => "LVM2_member",
            FsType::LinuxRaidMember => "linux_raid_member",
            FsType::Bcache => "bcache",
            FsType::CephBluestore => "ceph_bluestore",
            FsType::ZfsMember => "zfs_member",
        }
    }
}

/// A filesystem (or swap, or LUKS) signature.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Filesystem {
    #[serde(rename = "type")]
    pub fstype: FsType,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub uuid: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub label: Option<String>,
    /// This device's own id where `uuid` names the whole set (blkid's
    /// UUID_SUB: an md member's device UUID, a ZFS vdev's guid).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub uuid_sub: Option<String>,
}

impl Filesystem {
    fn new(fstype: FsType, uuid: Option<String>, label: Option<String>) -> Self {
        Self { fstype, uuid, label, uuid_sub: None }
    }
}

/// What the first blocks of a device hold.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct Content {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub filesystem: Option<Filesystem>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub table: Option<PartitionTable>,
}

/// Probes `buf` as a whole device whose logical block size is
/// `logical_block` (where a GPT header lives).
pub fn probe(buf: &[u8], logical_block: u32) -> Content {
    probe_sample(&Sample::whole(buf), logical_block)
}

/// Probes a device of `size` bytes whose logical block size is
/// `logical_block` through the reads `read_plan` lays out (at most two:
/// the first [`PROBE_LEN`] bytes, and at most the last 768 KiB, where the
/// end-of-device signatures live): `read(offset, len)` returns the bytes at
/// `offset`, fewer when the device ends sooner. Also says whether every
/// byte read was zero, which is what tells a blank device from one that
/// holds data of no known kind. The one entry for callers that read a
/// device themselves (the CSI stage path, the bench, the fuzz target).
pub fn probe_reads<E>(size: u64, logical_block: u32, mut read: impl FnMut(u64, usize) -> Result<Vec<u8>, E>) -> Result<(Content, bool), E> {
    let mut bufs = Vec::new();
    for (offset, len) in read_plan(size) {
        bufs.push((offset, read(offset, len)?));
    }
    let mut sample = Sample::new(size);
    for (offset, bytes) in &bufs {
        sample.add(*offset, bytes);
    }
    Ok((probe_sample(&sample, logical_block), sample.all_zero()))
}

/// Probes what [`read_plan`] read from a device. Members (md, LVM, bcache,
/// BlueStore, ZFS) come first: an md 1.0 mirror half also holds the
/// filesystem of the array at offset 0, and it is the membership that makes
/// the device busy. BitLocker comes before FAT and NTFS, whose boot sectors
/// it imitates. A FAT, exFAT, NTFS or BitLocker boot sector ends in 0x55AA
/// like an MBR; when one is found there is no MBR.
pub(crate) fn probe_sample(s: &Sample<'_>, logical_block: u32) -> Content {
    let buf = s.head();
    let filesystem = members::probe(s)
        .or_else(|| luks(buf))
        .or_else(|| windows::bitlocker(s))
        .or_else(|| xfs(buf))
        .or_else(|| ext(buf))
        .or_else(|| btrfs(buf))
        .or_else(|| windows::probe(s))
        .or_else(|| udf::probe(s, logical_block))
        .or_else(|| fs::probe(buf))
        .or_else(|| swap(buf));
    let boot_sector =
        filesystem.as_ref().is_some_and(|f| matches!(f.fstype, FsType::Vfat | FsType::Ntfs | FsType::Exfat | FsType::BitLocker));
    let table =
        gpt(buf, logical_block).or_else(|| gpt(buf, 512)).or_else(|| gpt(buf, 4096)).or_else(|| if boot_sector { None } else { mbr(buf) });
    Content { filesystem, table }
}

fn bytes<const N: usize>(buf: &[u8], at: usize) -> Option<[u8; N]> {
    buf.get(at..at.checked_add(N)?)?.try_into().ok()
}
fn le16(buf: &[u8], at: usize) -> Option<u16> {
    bytes(buf, at).map(u16::from_le_bytes)
}
fn le32(buf: &[u8], at: usize) -> Option<u32> {
    bytes(buf, at).map(u32::from_le_bytes)
}
fn le64(buf: &[u8], at: usize) -> Option<u64> {
    bytes(buf, at).map(u64::from_le_bytes)
}
fn be16(buf: &[u8], at: usize) -> Option<u16> {
    bytes(buf, at).map(u16::from_be_bytes)
}
fn be32(buf: &[u8], at: usize) -> Option<u32> {
    bytes(buf, at).map(u32::from_be_bytes)
}

/// A NUL-padded label; `None` when empty.
fn label(raw: &[u8]) -> Option<String> {
    let end = raw.iter().position(|&b| b == 0).unwrap_or(raw.len());
    let s = String::from_utf8_lossy(&raw[..end]).trim_end().to_string();
    (!s.is_empty()).then_some(s)
}

/// A UUID in the usual text form, bytes in on-disk order; `None` if all zero.
fn uuid(raw: [u8; 16]) -> Option<String> {
    if raw == [0; 16] {
        return None;
    }
    let h: Vec<String> = raw.iter().map(|b| format!("{b:02x}")).collect();
    Some(format!("{}-{}-{}-{}-{}", h[0..4].concat(), h[4..6].concat(), h[6..8].concat(), h[8..10].concat(), h[10..16].concat()))
}

/// A GUID as GPT stores it: the first three fields little-endian.
fn guid(raw: [u8; 16]) -> Option<String> {
    let mut b = raw;
    b[0..4].reverse();
    b[4..6].reverse();
    b[6..8].reverse();
    uuid(b)
}

fn ext(buf: &[u8]) -> Option<Filesystem> {
    const SB: usize = 1024;
    if le16(buf, SB + 0x38)? != 0xEF53 {
        return None;
    }
    let compat = le32(buf, SB + 0x5C)?;
    let incompat = le32(buf, SB + 0x60)?;
    let ro_compat = le32(buf, SB + 0x64)?;
    // Features ext3 lacks: extents, 64bit, flex_bg, mmp, inline data, csum seed
    // (incompat); huge_file, gdt_csum, dir_nlink, extra_isize, metadata_csum
    // (ro_compat). Journal (compat 0x4) marks ext3.
    let fstype = if incompat & (0x40 | 0x80 | 0x100 | 0x200 | 0x2000 | 0x8000) != 0 || ro_compat & (0x8 | 0x10 | 0x20 | 0x40 | 0x400) != 0 {
        FsType::Ext4
    } else if compat & 0x4 != 0 {
        FsType::Ext3
    } else {
        FsType::Ext2
    };
    Some(Filesystem::new(fstype, uuid(bytes(buf, SB + 0x68)?), label(buf.get(SB + 0x78..SB + 0x88)?)))
}

fn xfs(buf: &[u8]) -> Option<Filesystem> {
    if buf.get(0..4)? != b"XFSB" {
        return None;
    }
    Some(Filesystem::new(FsType::Xfs, uuid(bytes(buf, 32)?), label(buf.get(108..120)?)))
}

fn btrfs(buf: &[u8]) -> Option<Filesystem> {
    const SB: usize = 0x10000;
    if buf.get(SB + 0x40..SB + 0x48)? != b"_BHRfS_M" {
        return None;
    }
    Some(Filesystem::new(FsType::Btrfs, uuid(bytes(buf, SB + 0x20)?), label(buf.get(SB + 0x12B..SB + 0x22B)?)))
}

fn swap(buf: &[u8]) -> Option<Filesystem> {
    // The magic ends the first page; the page size is the writer's.
    let page =
        [4096usize, 8192, 16384, 65536].into_iter().find(|&p| matches!(buf.get(p - 10..p), Some(b"SWAPSPACE2") | Some(b"SWAP-SPACE")))?;
    let v1 = buf.get(page - 10..page) == Some(b"SWAPSPACE2");
    let (uuid_, label_) = if v1 { (uuid(bytes(buf, 1036)?), label(buf.get(1052..1068)?)) } else { (None, None) };
    Some(Filesystem::new(FsType::Swap, uuid_, label_))
}

fn luks(buf: &[u8]) -> Option<Filesystem> {
    if buf.get(0..6)? != b"LUKS\xba\xbe" {
        return None;
    }
    let version = be16(buf, 6)?;
    let uuid_ = label(buf.get(168..208)?);
    let label_ = if version == 2 { label(buf.get(24..72)?) } else { None };
    Some(Filesystem::new(FsType::Luks, uuid_, label_))
}

#[cfg(test)]
mod tests {
    use super::tables::TableType;
    use super::*;

    /// How much of the end of a device the probe reads, at most: the last two
    /// ZFS labels (256 KiB each, ending where the size rounds down to 256 KiB,
    /// so up to 256 KiB more), which also covers the md 0.90 superblock (the
    /// last 64 KiB-aligned 64 KiB) and the md 1.0 one (8–12 KiB from the end).
    const TAIL_MAX: usize = (512 << 10) + (256 << 10);

    /// The read budget per device: two reads, at most this many bytes.
    const READ_BUDGET: usize = PROBE_LEN + TAIL_MAX;

    fn ext4_image() -> Vec<u8> {
        let mut b = vec![0u8; 4096];
        b[1024 + 0x38..1024 + 0x3A].copy_from_slice(&0xEF53u16.to_le_bytes());
        b[1024 + 0x60..1024 + 0x64].copy_from_slice(&0x2C2u32.to_le_bytes());
        b[1024 + 0x68..1024 + 0x78].copy_from_slice(&[0x12; 16]);
        b[1024 + 0x78..1024 + 0x7D].copy_from_slice(b"data1");
        b
    }

    #[test]
    fn ext4_with_uuid_and_label() {
        let c = probe(&ext4_image(), 512);
        let fs = c.filesystem.unwrap();
        assert_eq!(fs.fstype, FsType::Ext4);
        assert_eq!(fs.uuid.as_deref(), Some("12121212-1212-1212-1212-121212121212"));
        assert_eq!(fs.label.as_deref(), Some("data1"));
        assert_eq!(c.table, None);
    }

    #[test]
    fn truncated_and_garbage_buffers_probe_to_nothing() {
        let img = ext4_image();
        for len in [0, 1, 511, 1024 + 0x39, 1024 + 0x70] {
            assert_eq!(probe(&img[..len], 512).filesystem, None, "len {len}");
        }
        let noise: Vec<u8> = (0..PROBE_LEN).map(|i| ((i * 2654435761usize) >> 7) as u8).collect();
        assert_eq!(probe(&noise, 512), Content::default());
    }

    #[test]
    fn gpt_with_a_bad_crc_is_ignored_and_its_protective_mbr_too() {
        let mut b = vec![0u8; 34 * 512];
        b[510] = 0x55;
        b[511] = 0xAA;
        b[446 + 4] = 0xEE;
        b[446 + 12..446 + 16].copy_from_slice(&100u32.to_le_bytes());
        b[512..520].copy_from_slice(b"EFI PART");
        b[512 + 12..512 + 16].copy_from_slice(&92u32.to_le_bytes());
        b[512 + 24..512 + 32].copy_from_slice(&1u64.to_le_bytes());
        b[512 + 72..512 + 80].copy_from_slice(&2u64.to_le_bytes());
        b[512 + 80..512 + 84].copy_from_slice(&128u32.to_le_bytes());
        b[512 + 84..512 + 88].copy_from_slice(&128u32.to_le_bytes());
        // One entry.
        b[1024..1040].copy_from_slice(&[0xAB; 16]);
        b[1024 + 16..1024 + 32].copy_from_slice(&[0xCD; 16]);
        b[1024 + 32..1024 + 40].copy_from_slice(&2048u64.to_le_bytes());
        b[1024 + 40..1024 + 48].copy_from_slice(&4095u64.to_le_bytes());
        assert_eq!(probe(&b, 512).table, None, "no CRC yet");
        let crc = crc32fast::hash(&b[512..512 + 92]);
        b[512 + 16..512 + 20].copy_from_slice(&crc.to_le_bytes());
        let t = probe(&b, 512).table.unwrap();
        assert_eq!(t.table, TableType::Gpt);
        assert_eq!(t.partitions.len(), 1);
        assert_eq!((t.partitions[0].number, t.partitions[0].start_lba, t.partitions[0].sectors), (1, 2048, 2048));
        assert_eq!(t.partitions[0].uuid.as_deref(), Some("cdcdcdcd-cdcd-cdcd-cdcd-cdcdcdcdcdcd"));
    }

    #[test]
    fn mbr_entries_and_fat_boot_sector() {
        let mut b = vec![0u8; 512];
        b[440..444].copy_from_slice(&0xDEADBEEFu32.to_le_bytes());
        b[510] = 0x55;
        b[511] = 0xAA;
        b[446 + 16 + 4] = 0x83;
        b[446 + 16 + 8..446 + 16 + 12].copy_from_slice(&2048u32.to_le_bytes());
        b[446 + 16 + 12..446 + 16 + 16].copy_from_slice(&1000u32.to_le_bytes());
        let t = probe(&b, 512).table.unwrap();
        assert_eq!((t.table, t.id.as_str()), (TableType::Mbr, "deadbeef"));
        assert_eq!((t.partitions[0].number, t.partitions[0].type_id.as_str()), (2, "0x83"));
        b[446] = 0x29; // not a boot flag
        assert_eq!(probe(&b, 512).table, None);
    }

    #[test]
    fn read_plan_is_two_reads_within_budget_and_covers_the_tail_signatures() {
        for size in [0u64, 511, 4096, 300 << 10, 1 << 20, (64 << 20) + 12345 * 512, 1 << 40, u64::MAX >> 1] {
            let plan = read_plan(size);
            assert!(plan.len() <= 2, "{size}: {plan:?}");
            assert!(plan.iter().map(|&(_, l)| l).sum::<usize>() <= READ_BUDGET, "{size}: {plan:?}");
            assert!(plan.iter().all(|&(o, l)| o + l as u64 <= size), "{size}: {plan:?}");
            let covered = |at: u64, len: u64| plan.iter().any(|&(o, l)| o <= at && at + len <= o + l as u64);
            if size >= 1 << 20 {
                let md090 = (size & !0xFFFF) - 0x10000;
                let md10 = (((size >> 9) - 16) & !7) << 9;
                let zfs_l2 = size - 2 * (256 << 10) - size % (256 << 10);
                assert!(covered(md090, 4096) && covered(md10, 4096) && covered(zfs_l2, 512 << 10), "{size}: {plan:?}");
            }
        }
    }

    #[test]
    fn a_sample_only_answers_from_what_was_read() {
        let head = [1u8; 8];
        let tail = [2u8; 8];
        let mut s = Sample::new(100);
        s.add(0, &head);
        s.add(92, &tail);
        assert_eq!(s.at(0, 8), Some(&head[..]));
        assert_eq!(s.at(94, 6), Some(&tail[2..]));
        assert_eq!(s.at(4, 8), None, "spans a gap");
        assert_eq!(s.at(96, 8), None, "past the end");
        assert_eq!(s.at(u64::MAX, 2), None);
        assert!(!s.all_zero());
    }

    #[test]
    fn fat_boot_sector_is_vfat_not_an_mbr() {
        let mut b = vec![0u8; 64 << 10];
        b[0..3].copy_from_slice(&[0xEB, 0x3C, 0x90]);
        b[11..13].copy_from_slice(&512u16.to_le_bytes());
        b[13] = 4;
        b[14..16].copy_from_slice(&4u16.to_le_bytes());
        b[16] = 2;
        b[17..19].copy_from_slice(&512u16.to_le_bytes());
        b[0x15] = 0xF8;
        b[22..24].copy_from_slice(&32u16.to_le_bytes());
        b[0x26] = 0x29;
        b[0x27..0x2B].copy_from_slice(&0x1A2B_3C4Du32.to_le_bytes());
        b[0x2B..0x36].copy_from_slice(b"BOOTLABEL  ");
        b[0x36..0x3E].copy_from_slice(b"FAT16   ");
        b[510] = 0x55;
        b[511] = 0xAA;
        let c = probe(&b, 512);
        assert_eq!(c.table, None);
        let fs = c.filesystem.expect("vfat");
        assert_eq!((fs.fstype, fs.uuid.as_deref(), fs.label.as_deref()), (FsType::Vfat, Some("1A2B-3C4D"), Some("BOOTLABEL")));
        // The root directory's volume entry wins over the boot sector's.
        let root = (4 + 2 * 32) * 512;
        b[root..root + 11].copy_from_slice(b"DIRLABEL   ");
        b[root + 11] = 0x08;
        assert_eq!(probe(&b, 512).filesystem.and_then(|f| f.label).as_deref(), Some("DIRLABEL"));
        b[0x15] = 0x12; // not a media byte: a boot loader, not FAT
        assert_eq!(probe(&b, 512).filesystem, None);
        assert_eq!(probe(&b, 512).table.map(|t| t.table), Some(TableType::Mbr));
    }

    #[test]
    fn lvm_label_needs_its_crc_and_sector() {
        let mut b = vec![0u8; 4096];
        let at = 512;
        b[at..at + 8].copy_from_slice(b"LABELONE");
        b[at + 8..at + 16].copy_from_slice(&1u64.to_le_bytes());
        b[at + 20..at + 24].copy_from_slice(&32u32.to_le_bytes());
        b[at + 24..at + 32].copy_from_slice(b"LVM2 001");
        b[at + 32..at + 64].copy_from_slice(b"abcdefGHIJklmnOPQRstuvWXYZ012345");
        assert_eq!(probe(&b, 512).filesystem, None, "no CRC");
        let crc = members::lvm_crc(&b[at + 20..at + 512]);
        b[at + 16..at + 20].copy_from_slice(&crc.to_le_bytes());
        let fs = probe(&b, 512).filesystem.expect("pv");
        assert_eq!((fs.fstype, fs.uuid.as_deref()), (FsType::Lvm2Member, Some("abcdef-GHIJ-klmn-OPQR-stuv-WXYZ-012345")));
        b[at + 8] = 2; // names another sector
        assert_eq!(probe(&b, 512).filesystem, None);
    }

    /// Found by the fuzz target: an NTFS boot sector cut short after the
    /// reserved-sectors field indexed past the buffer.
    #[test]
    fn every_prefix_of_an_ntfs_boot_sector_probes_without_panic() {
        let mut b = vec![0u8; 512];
        b[0..3].copy_from_slice(&[0xEB, 0x52, 0x90]);
        b[3..11].copy_from_slice(b"NTFS    ");
        b[11..13].copy_from_slice(&512u16.to_le_bytes());
        b[13] = 8;
        b[0x40] = 0xF6;
        b[0x48..0x50].copy_from_slice(&0x638635D437BC0010u64.to_le_bytes());
        b[510] = 0x55;
        b[511] = 0xAA;
        let full = probe(&b, 512);
        assert_eq!(full.filesystem.map(|f| (f.fstype, f.uuid)), Some((FsType::Ntfs, Some("638635D437BC0010".to_string()))));
        assert_eq!(full.table, None, "an NTFS boot sector is not an MBR");
        for len in 0..b.len() {
            let _ = probe(&b[..len], 512);
        }
    }
}
