//! Filesystems beyond Linux's own: FAT, ISO 9660, squashfs (4 and older) and
//! EROFS, each from its superblock or boot sector in the head of the device
//! (NTFS, exFAT and BitLocker are in `windows`, UDF in `udf`).
//!
//! A FAT boot sector ends in 0x55AA like an MBR; telling them apart
//! takes the BIOS parameter block's sanity rules (jump opcode, power-of-two
//! sector and cluster sizes, media byte), which a partition table's boot
//! code does not satisfy by chance.

use super::{be16, bytes, label, le16, le32, uuid, Filesystem, FsType};

pub(super) fn probe(head: &[u8]) -> Option<Filesystem> {
    vfat(head).or_else(|| iso9660(head)).or_else(|| squashfs(head)).or_else(|| erofs(head))
}

fn pow2_in(v: u32, lo: u32, hi: u32) -> bool {
    v.is_power_of_two() && (lo..=hi).contains(&v)
}

/// A FAT volume label: 11 space-padded bytes; "NO NAME" means none.
fn fat_label(raw: &[u8]) -> Option<String> {
    let l = label(raw)?;
    (l != "NO NAME").then_some(l)
}

/// A FAT volume serial as blkid prints it: `XXXX-XXXX`, high half first.
fn fat_serial(raw: [u8; 4]) -> String {
    format!("{:02X}{:02X}-{:02X}{:02X}", raw[3], raw[2], raw[1], raw[0])
}

fn vfat(b: &[u8]) -> Option<Filesystem> {
    let fat1x = matches!(b.get(0x36..0x3E)?, b"FAT12   " | b"FAT16   " | b"FAT     ");
    let fat32 = b.get(0x52..0x5A)? == b"FAT32   ";
    if !(fat1x || fat32) || b.get(510..512)? != [0x55, 0xAA] {
        return None;
    }
    let sector = u32::from(le16(b, 11)?);
    let cluster = u32::from(*b.get(13)?);
    let media = *b.get(0x15)?;
    if !matches!(b[0], 0xEB | 0xE9)
        || !pow2_in(sector, 512, 4096)
        || !pow2_in(cluster, 1, 128)
        || le16(b, 14)? == 0
        || b[16] == 0
        || !(media == 0xF0 || media >= 0xF8)
    {
        return None;
    }
    let (reserved, fats) = (u64::from(le16(b, 14)?), u64::from(b[16]));
    let fat_len16 = u64::from(le16(b, 22)?);
    let is32 = fat_len16 == 0 && le32(b, 36)? != 0;
    let (sig_at, serial_at, label_at) = if is32 { (0x42, 0x43, 0x47) } else { (0x26, 0x27, 0x2B) };
    let sig = *b.get(sig_at)?;
    let serial = (sig == 0x29 || (is32 && sig == 0x28)).then(|| bytes(b, serial_at).map(fat_serial)).flatten();
    let boot_label = if sig == 0x29 { fat_label(b.get(label_at..label_at + 11)?) } else { None };
    // The label blkid prefers is the root directory's volume-id entry.
    let sector = u64::from(sector);
    let (root, entries) = if is32 {
        let fat_len = u64::from(le32(b, 36)?);
        let root_cluster = u64::from(le32(b, 44)?).saturating_sub(2);
        let at = (reserved + fats * fat_len) * sector + root_cluster * u64::from(cluster) * sector;
        (at, u64::from(cluster) * sector / 32)
    } else {
        ((reserved + fats * fat_len16) * sector, u64::from(le16(b, 17)?))
    };
    let dir_label = fat_root_label(b, root, entries);
    Some(Filesystem::new(FsType::Vfat, serial, dir_label.or(boot_label)))
}

/// The volume-label entry of a root directory at byte `at` with `entries`
/// slots, as far as `b` reaches.
fn fat_root_label(b: &[u8], at: u64, entries: u64) -> Option<String> {
    let at = usize::try_from(at).ok()?;
    for i in 0..usize::try_from(entries.min(4096)).ok()? {
        let e = b.get(at.checked_add(i * 32)?..at.checked_add(i * 32 + 32)?)?;
        match (e[0], e[11]) {
            (0, _) => return None,
            (0xE5, _) | (_, 0x0F) => continue,
            (_, attr) if attr & 0x08 != 0 => return fat_label(&e[..11]),
            _ => {}
        }
    }
    None
}

/// The volume descriptors from 32 KiB, 2 KiB each, up to the terminator
/// (type 255); the primary one (type 1) holds the label and the dates that
/// blkid turns into a UUID (modification date, else creation date).
fn iso9660(b: &[u8]) -> Option<Filesystem> {
    for i in 0..16 {
        let d = b.get(0x8000 + i * 2048..0x8000 + (i + 1) * 2048)?;
        if &d[1..6] != b"CD001" {
            return None;
        }
        match d[0] {
            1 => {
                let u = iso_date(&d[830..847]).or_else(|| iso_date(&d[813..830]));
                return Some(Filesystem::new(FsType::Iso9660, u, label(&d[40..72])));
            }
            255 => return None,
            _ => {}
        }
    }
    None
}

/// `YYYYMMDDhhmmsscc` as `YYYY-MM-DD-hh-mm-ss-cc`; `None` when unset.
fn iso_date(d: &[u8]) -> Option<String> {
    let digits = &d[..16];
    if digits.iter().all(|&c| c == b'0' || c == 0) || !digits.iter().all(u8::is_ascii_digit) {
        return None;
    }
    let t = std::str::from_utf8(digits).ok()?;
    Some(format!("{}-{}-{}-{}-{}-{}-{}", &t[0..4], &t[4..6], &t[6..8], &t[8..10], &t[10..12], &t[12..14], &t[14..16]))
}

/// squashfs: magic `hsqs` (little-endian) or `sqsh` (big-endian, only
/// before version 4), the major version at 28 in the magic's byte order.
/// blkid calls 4 and later `squashfs` and the older ones `squashfs3`.
fn squashfs(b: &[u8]) -> Option<Filesystem> {
    let major = match b.get(..4)? {
        b"hsqs" => le16(b, 28)?,
        b"sqsh" => be16(b, 28)?,
        _ => return None,
    };
    let fstype = match (major, b[0]) {
        (4.., b'h') => FsType::Squashfs,
        (4.., _) => return None,
        _ => FsType::Squashfs3,
    };
    Some(Filesystem::new(fstype, None, None))
}

/// EROFS: the superblock at 1 KiB; block size 512 B–64 KiB.
fn erofs(b: &[u8]) -> Option<Filesystem> {
    const SB: usize = 1024;
    if le32(b, SB)? != 0xE0F5_E1E2 || !(9..=16).contains(b.get(SB + 12)?) {
        return None;
    }
    Some(Filesystem::new(FsType::Erofs, uuid(bytes(b, SB + 48)?), label(b.get(SB + 64..SB + 80)?)))
}
