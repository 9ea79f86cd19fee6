//! Windows' own formats: NTFS, exFAT and BitLocker, each from its boot
//! sector and what that sector points at, as far as the probe's two reads
//! reach.
//!
//! Offsets and checks are those of the on-disk formats and follow blkid's
//! rules so both agree on the same device. Where a structure lies outside
//! what was read (NTFS's MFT or exFAT's root directory on a large volume,
//! BitLocker's metadata block), the boot sector alone decides and the
//! label is left unknown: a device with such a boot sector is in use.

use super::{bytes, le16, le32, le64, Filesystem, FsType, Sample};

/// NTFS, then exFAT (BitLocker is asked for earlier, before the formats
/// whose boot sectors it imitates).
pub(super) fn probe(s: &Sample<'_>) -> Option<Filesystem> {
    ntfs(s).or_else(|| exfat(s))
}

fn pow2_in(v: u32, lo: u32, hi: u32) -> bool {
    v.is_power_of_two() && (lo..=hi).contains(&v)
}

/// The boot sector's BIOS parameter block must look like NTFS's (FAT
/// fields zero, sane sizes, the MFT inside the volume), and MFT records 0
/// and 3 must carry the `FILE` magic where they were read: a boot sector
/// copied over a wiped volume is not NTFS.
fn ntfs(s: &Sample<'_>) -> Option<Filesystem> {
    let b = s.head();
    if b.get(3..11)? != b"NTFS    " {
        return None;
    }
    let sector = u32::from(le16(b, 11)?);
    let spc = *b.get(13)?;
    let spc = if spc > 0x80 { 1u32.checked_shl(256 - u32::from(spc))? } else { u32::from(spc) };
    // The FAT fields NTFS leaves unused must be zero.
    if !pow2_in(sector, 256, 4096)
        || !pow2_in(spc, 1, 1 << 16)
        || le16(b, 14)? != 0
        || *b.get(16)? != 0
        || le16(b, 17)? != 0
        || le16(b, 19)? != 0
        || le16(b, 22)? != 0
        || le32(b, 32)? != 0
    {
        return None;
    }
    let cluster = u64::from(sector) * u64::from(spc);
    // Clusters per MFT record: 1–64, or a negative power of two of bytes.
    let per_rec = *b.get(0x40)?;
    let rec = match per_rec {
        1 | 2 | 4 | 8 | 16 | 32 | 64 => u64::from(per_rec) * cluster,
        0xE1..=0xF7 => 1u64 << (256 - u32::from(per_rec)),
        _ => return None,
    };
    let clusters = le64(b, 0x28)? / u64::from(spc);
    let (mft, mirror) = (le64(b, 0x30)?, le64(b, 0x38)?);
    if mft > clusters || mirror > clusters {
        return None;
    }
    let serial = format!("{:016X}", le64(b, 0x48)?);
    let mft_at = mft.checked_mul(cluster)?;
    let rec_len = usize::try_from(rec).ok()?;
    let record = |n: u64| mft_at.checked_add(n.checked_mul(rec)?).and_then(|at| s.at(at, rec_len));
    let mut lbl = None;
    for n in [0, 3] {
        match record(n) {
            Some(r) if &r[..4] != b"FILE" => return None,
            Some(r) if n == 3 => lbl = ntfs_volume_name(r, sector),
            _ => {}
        }
    }
    Some(Filesystem::new(FsType::Ntfs, Some(serial), lbl))
}

/// The $VOLUME_NAME attribute (0x60) of MFT record 3 ($Volume), after
/// undoing the record's update-sequence fixups.
fn ntfs_volume_name(record: &[u8], sector: u32) -> Option<String> {
    if !(256..=4096).contains(&record.len()) {
        return None;
    }
    let mut r = record.to_vec();
    let (usa, count) = (le16(&r, 4)? as usize, le16(&r, 6)? as usize);
    let stride = sector as usize;
    for i in 1..count {
        let fix: [u8; 2] = bytes(&r, usa + 2 * i)?;
        let end = (i * stride).checked_sub(2)?;
        r.get_mut(end..end + 2)?.copy_from_slice(&fix);
    }
    let mut a = le16(&r, 0x14)? as usize;
    for _ in 0..64 {
        let (ty, alen) = (le32(&r, a)?, le32(&r, a + 4)? as usize);
        if ty == 0xFFFF_FFFF || alen == 0 {
            return None;
        }
        if ty == 0x60 && *r.get(a + 8)? == 0 {
            let (vlen, voff) = (le32(&r, a + 16)? as usize, le16(&r, a + 20)? as usize);
            let v = r.get(a + voff..a + voff + vlen)?;
            return utf16le(v);
        }
        a = a.checked_add(alen)?;
    }
    None
}

/// UTF-16LE text as a label: trailing spaces dropped, `None` when empty.
fn utf16le(v: &[u8]) -> Option<String> {
    let units: Vec<u16> = v.chunks_exact(2).map(|c| u16::from_le_bytes([c[0], c[1]])).collect();
    let s = String::from_utf16_lossy(&units);
    let s = s.trim_end_matches(['\0', ' ']).to_string();
    (!s.is_empty()).then_some(s)
}

/// Most directory entries the exFAT label search looks at (blkid's limit
/// is a 256 MiB directory; the label comes first in practice).
const EXFAT_MAX_ENTRIES: usize = 4096;

/// exFAT: the boot sector's jump, name and zeroed legacy area, and the boot
/// region checksum (sectors 0–10, repeated through sector 11). The label is
/// the root directory's volume-label entry (type 0x83, up to 11 UTF-16
/// characters), found by following the cluster chain through the FAT, as
/// far as the reads reach; the UUID is the volume serial.
fn exfat(s: &Sample<'_>) -> Option<Filesystem> {
    let b = s.head();
    if b.get(3..11)? != b"EXFAT   " || b.get(0..3)? != [0xEB, 0x76, 0x90] || b.get(510..512)? != [0x55, 0xAA] {
        return None;
    }
    if b.get(11..64)?.iter().any(|&x| x != 0) {
        return None;
    }
    let (sector_shift, cluster_shift) = (u32::from(*b.get(108)?), u32::from(*b.get(109)?));
    if !(9..=12).contains(&sector_shift) || sector_shift + cluster_shift > 25 {
        return None;
    }
    let sector = 1usize << sector_shift;
    let boot = b.get(..12 * sector)?;
    let sum = exfat_boot_checksum(&boot[..11 * sector]);
    if !boot[11 * sector..].chunks_exact(4).all(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]) == sum) {
        return None;
    }
    let serial: [u8; 4] = bytes(b, 100)?;
    let uuid = format!("{:02X}{:02X}-{:02X}{:02X}", serial[3], serial[2], serial[1], serial[0]);
    Some(Filesystem::new(FsType::Exfat, Some(uuid), exfat_label(s, b, sector_shift, cluster_shift)))
}

/// The exFAT boot checksum: a rotate-right-and-add over the first eleven
/// sectors, skipping VolumeFlags (106–107) and PercentInUse (112).
fn exfat_boot_checksum(sectors: &[u8]) -> u32 {
    sectors
        .iter()
        .enumerate()
        .filter(|(i, _)| !matches!(i, 106 | 107 | 112))
        .fold(0u32, |c, (_, &x)| c.rotate_right(1).wrapping_add(u32::from(x)))
}

fn exfat_label(s: &Sample<'_>, b: &[u8], sector_shift: u32, cluster_shift: u32) -> Option<String> {
    let fat_at = u64::from(le32(b, 80)?) << sector_shift;
    let heap = u64::from(le32(b, 88)?);
    let cluster_bytes = 1u64 << (sector_shift + cluster_shift);
    let cluster_at =
        |c: u32| -> Option<u64> { heap.checked_add(u64::from(c.checked_sub(2)?) << cluster_shift)?.checked_mul(1 << sector_shift) };
    let mut cluster = le32(b, 96)?;
    let mut at = cluster_at(cluster)?;
    for _ in 0..EXFAT_MAX_ENTRIES {
        let e = s.at(at, 32)?;
        match e[0] {
            0x00 => return None,
            0x83 => return utf16le(e.get(2..2 + (usize::from(e[1]) * 2).min(22))?),
            _ => {}
        }
        at += 32;
        if at.is_multiple_of(cluster_bytes) {
            cluster = le32(s.at(fat_at.checked_add(u64::from(cluster) * 4)?, 4)?, 0)?;
            if !(2..=0x0FFF_FFF6).contains(&cluster) {
                return None;
            }
            at = cluster_at(cluster)?;
        }
    }
    None
}

/// BitLocker: a boot sector whose OEM name is `-FVE-FS-` (Vista, Windows
/// 7+) or, for BitLocker To Go, `MSWIN4.1` with a metadata offset, and
/// for the latter two an FVE metadata block starting `-FVE-FS-` at that
/// offset. When the block lies outside what was read, the boot sector
/// decides. Windows 7+ volumes get blkid's UUID: the 32-bit volume serial
/// as 16 decimal digits (none when zero).
pub(super) fn bitlocker(s: &Sample<'_>) -> Option<Filesystem> {
    let b = s.head();
    let head = b.get(..11)?;
    let (offset_at, win7) = match head {
        [0xEB, 0x52, 0x90, rest @ ..] if rest == b"-FVE-FS-" => return Some(Filesystem::new(FsType::BitLocker, None, None)),
        [0xEB, 0x58, 0x90, rest @ ..] if rest == b"-FVE-FS-" => (176, true),
        [0xEB, 0x58, 0x90, rest @ ..] if rest == b"MSWIN4.1" => (440, false),
        _ => return None,
    };
    let fve = le64(b, offset_at)?;
    if fve == 0 {
        return None;
    }
    if s.at(fve, 8).is_some_and(|m| m != b"-FVE-FS-") {
        return None;
    }
    let uuid = if win7 { le32(b, 67).filter(|&v| v != 0).map(|v| format!("{v:016}")) } else { None };
    Some(Filesystem::new(FsType::BitLocker, uuid, None))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The checksum's rotate-and-add, and the three bytes it skips.
    #[test]
    fn exfat_checksum_skips_flags_and_percent_in_use() {
        let mut a = vec![0u8; 11 * 512];
        a[0] = 1;
        let base = exfat_boot_checksum(&a);
        assert_eq!(base, 1u32.rotate_right(11 * 512 - 1 - 3));
        for skipped in [106, 107, 112] {
            a[skipped] = 0x5A;
            assert_eq!(exfat_boot_checksum(&a), base, "byte {skipped}");
        }
        a[113] = 1;
        assert_ne!(exfat_boot_checksum(&a), base);
    }

    #[test]
    fn utf16_labels_trim_like_blkid() {
        assert_eq!(utf16le(&[b'a', 0, b' ', 0, 0, 0]).as_deref(), Some("a"));
        assert_eq!(utf16le(&[0, 0]), None);
        assert_eq!(utf16le(&[]), None);
    }
}
