//! Members of something larger: md RAID, LVM2 physical volumes, bcache,
//! Ceph BlueStore and ZFS vdevs. None of them is mounted, so without these
//! a device in use looks free.
//!
//! Offsets, magics and checksums are those of each format's on-disk layout
//! (mdadm's superblock 0.90 and 1.x, LVM2's label, bcache's cache_sb,
//! BlueStore's label, ZFS's vdev label); what counts as a match follows
//! blkid's rules so that the two agree on the same device.

use super::{be32, bytes, label, le32, le64, uuid, Filesystem, FsType, Sample};

/// In blkid's order: RAID first, then the others.
pub(super) fn probe(s: &Sample<'_>) -> Option<Filesystem> {
    md(s).or_else(|| lvm2(s.head())).or_else(|| bcache(s.head())).or_else(|| bluestore(s.head())).or_else(|| zfs(s))
}

const MD_MAGIC: u32 = 0xa92b_4efc;

/// md superblocks, where mdadm puts them: 0.90 in the last 64 KiB-aligned
/// 64 KiB, 1.0 8–12 KiB from the end (4 KiB-aligned), 1.1 at 0, 1.2 at 4 KiB.
fn md(s: &Sample<'_>) -> Option<Filesystem> {
    let size = s.size();
    if size < 0x10000 {
        return None;
    }
    let v090 = (size & !0xFFFF) - 0x10000;
    if let Some(f) = s.at(v090, 64).and_then(|sb| md0(sb, v090)) {
        return Some(f);
    }
    let v10 = (((size >> 9).saturating_sub(16)) & !7) << 9;
    [v10, 0, 0x1000].into_iter().find_map(|at| md1(s.at(at, 4096).or_else(|| s.at(at, 256))?, at))
}

/// Superblock 0.90 at byte `at`, written in the host's byte order. The
/// array's size (KiB, at 32) must fit before the superblock. The set UUID
/// (word 0 at 20, words 1–3 at 52) reads as each word's big-endian bytes.
fn md0(sb: &[u8], at: u64) -> Option<Filesystem> {
    let le = match (le32(sb, 0)?, be32(sb, 0)?) {
        (MD_MAGIC, _) => true,
        (_, MD_MAGIC) => false,
        _ => return None,
    };
    let word = |off: usize| -> Option<u32> {
        let raw: [u8; 4] = bytes(sb, off)?;
        Some(if le { u32::from_le_bytes(raw) } else { u32::from_be_bytes(raw) })
    };
    if u64::from(word(32)?) << 10 > at {
        return None;
    }
    let mut raw = [0u8; 16];
    let words: &[usize] = if word(8)? >= 90 { &[20, 52, 56, 60] } else { &[20] };
    for (i, &off) in words.iter().enumerate() {
        raw[i * 4..i * 4 + 4].copy_from_slice(&word(off)?.to_be_bytes());
    }
    Some(Filesystem::new(FsType::LinuxRaidMember, uuid(raw), None))
}

/// Superblock 1.x at byte `at`: little-endian, records its own sector and
/// carries a checksum over 256 bytes plus two per device slot.
fn md1(sb: &[u8], at: u64) -> Option<Filesystem> {
    if le32(sb, 0)? != MD_MAGIC || le32(sb, 4)? != 1 || le64(sb, 144)? != at >> 9 {
        return None;
    }
    let len = 256 + 2 * le32(sb, 220)? as usize;
    let body = sb.get(..len)?;
    let mut sum: u64 = 0;
    for (i, w) in body.chunks(4).enumerate() {
        let v = match w.len() {
            4 if i == 216 / 4 => 0,
            4 => u64::from(le32(w, 0)?),
            2 => u64::from(u16::from_le_bytes([w[0], w[1]])),
            _ => 0,
        };
        sum += v;
    }
    let csum = ((sum & 0xFFFF_FFFF) + (sum >> 32)) as u32;
    if csum != le32(sb, 216)? {
        return None;
    }
    let mut f = Filesystem::new(FsType::LinuxRaidMember, uuid(bytes(sb, 16)?), label(sb.get(32..64)?));
    f.uuid_sub = uuid(bytes(sb, 168)?);
    Some(f)
}

/// LVM2's CRC: the reflected CRC-32 polynomial from a seed of its own and
/// without the final inversion, i.e. CRC-32 with seed `!0xf597a6cf`, inverted.
pub(super) fn lvm_crc(data: &[u8]) -> u32 {
    let mut h = crc32fast::Hasher::new_with_initial(!0xf597_a6cf);
    h.update(data);
    !h.finalize()
}

/// The label is in one of the first four sectors, names that sector, and
/// is checksummed from its `offset_xl` field to the sector's end; the PV
/// header it points to starts with the 32-character PV UUID.
fn lvm2(head: &[u8]) -> Option<Filesystem> {
    (0..4u64).find_map(|sector| {
        let at = sector as usize * 512;
        let l = head.get(at..at + 512)?;
        if &l[0..8] != b"LABELONE" || &l[24..32] != b"LVM2 001" || le64(l, 8)? != sector {
            return None;
        }
        if lvm_crc(&l[20..]) != le32(l, 16)? {
            return None;
        }
        let pv = at.checked_add(le32(l, 20)? as usize)?;
        let id = head.get(pv..pv + 32)?;
        if !id.iter().all(u8::is_ascii_graphic) {
            return None;
        }
        let id = std::str::from_utf8(id).ok()?;
        let mut text = String::with_capacity(38);
        let mut from = 0;
        for n in [6, 4, 4, 4, 4, 4, 6] {
            if from > 0 {
                text.push('-');
            }
            text.push_str(&id[from..from + n]);
            from += n;
        }
        Some(Filesystem::new(FsType::Lvm2Member, Some(text), None))
    })
}

const BCACHE_MAGIC: [u8; 16] = [0xc6, 0x85, 0x73, 0xf6, 0x4e, 0x1a, 0x45, 0xca, 0x82, 0x65, 0xf5, 0x7f, 0x48, 0xba, 0x6d, 0x81];

/// The superblock at 4 KiB records its own sector (8) and carries a
/// CRC-64 over everything after the checksum up to the end of its journal
/// bucket list (`keys` entries of 8 bytes from 208); the kernel refuses a
/// superblock whose checksum does not match, and so does the probe. The
/// UUID is the device's.
fn bcache(head: &[u8]) -> Option<Filesystem> {
    const SB: usize = 4096;
    if bytes::<16>(head, SB + 24)? != BCACHE_MAGIC || le64(head, SB + 8)? != 8 {
        return None;
    }
    let keys = usize::from(u16::from_le_bytes(bytes(head, SB + 206)?));
    if keys > 256 {
        return None;
    }
    let body = head.get(SB + 8..SB + 208 + 8 * keys)?;
    if crc64_we(body) != le64(head, SB)? {
        return None;
    }
    Some(Filesystem::new(FsType::Bcache, uuid(bytes(head, SB + 40)?), None))
}

/// CRC-64/WE (ECMA-182's polynomial, not reflected, all ones in and out),
/// bcache's superblock checksum. Bitwise: one superblock, a few hundred bytes.
pub(super) fn crc64_we(data: &[u8]) -> u64 {
    const POLY: u64 = 0x42F0_E1EB_A9EA_3693;
    let mut crc = u64::MAX;
    for &b in data {
        crc ^= u64::from(b) << 56;
        for _ in 0..8 {
            crc = if crc & (1 << 63) != 0 { (crc << 1) ^ POLY } else { crc << 1 };
        }
    }
    !crc
}

/// BlueStore's label starts with a fixed text line.
fn bluestore(head: &[u8]) -> Option<Filesystem> {
    (head.get(..22)? == b"bluestore block device").then(|| Filesystem::new(FsType::CephBluestore, None, None))
}

const ZFS_LABEL: u64 = 256 << 10;
const ZFS_UB_MAGIC: u64 = 0x00ba_b10c;

/// How far from the end the last two ZFS labels start: they end where the
/// size rounds down to 256 KiB.
pub(super) fn zfs_tail_len(size: u64) -> u64 {
    2 * ZFS_LABEL + size % ZFS_LABEL
}

/// Uberblocks with the magic (either byte order) in a label's array, which
/// blkid scans in 1 KiB steps from 128 KiB.
fn uberblocks(s: &Sample<'_>, label_at: u64) -> usize {
    let Some(arr) = s.at(label_at + (128 << 10), 128 << 10) else { return 0 };
    arr.chunks_exact(1024)
        .filter(|ub| {
            let m = u64::from_le_bytes(ub[..8].try_into().unwrap_or_default());
            m == ZFS_UB_MAGIC || m == ZFS_UB_MAGIC.swap_bytes()
        })
        .count()
}

/// A vdev: at least four uberblocks across the labels, counted in blkid's
/// order (the two at the start, then the two at the end), so a pool with a
/// damaged label is still found from the others. blkid only looks on
/// devices of 64 MiB or more. The nvlist of the label where the fourth was
/// found names the pool (LABEL), its guid (UUID) and the vdev's (UUID_SUB),
/// both in decimal.
fn zfs(s: &Sample<'_>) -> Option<Filesystem> {
    let size = s.size();
    if size < 64 << 20 {
        return None;
    }
    let tail = size - zfs_tail_len(size);
    let mut found = 0;
    let mut at = None;
    for l in [0, ZFS_LABEL, tail, tail + ZFS_LABEL] {
        found += uberblocks(s, l);
        if found >= 4 {
            at = Some(l);
            break;
        }
    }
    let at = at?;
    let mut f = Filesystem::new(FsType::ZfsMember, None, None);
    if let Some(nv) = s.at((at & !(ZFS_LABEL - 1)) + (16 << 10), 4096) {
        zfs_nvlist(nv, &mut f);
    }
    Some(f)
}

/// The first 4 KiB of the XDR nvlist: a 12-byte header, then pairs of
/// (size, decoded size, name length, name padded to 4, type, count, value),
/// big-endian. Only `name` (string), `guid` and `pool_guid` (uint64) are read.
fn zfs_nvlist(nv: &[u8], f: &mut Filesystem) {
    const STRING: u32 = 9;
    const UINT64: u32 = 8;
    let mut at = 12usize;
    for _ in 0..256 {
        let (Some(size), Some(namelen)) = (be32(nv, at), be32(nv, at + 8)) else { return };
        let (size, namelen) = (size as usize, namelen as usize);
        if size < 12 || at + size > nv.len() {
            return;
        }
        let Some(name) = nv.get(at + 12..at + 12 + namelen) else { return };
        let v = at + 12 + namelen.next_multiple_of(4);
        let ty = be32(nv, v);
        match (name, ty) {
            (b"name", Some(STRING)) => {
                if let Some(n) = be32(nv, v + 8) {
                    f.label = nv.get(v + 12..v + 12 + n as usize).and_then(label);
                }
            }
            (b"guid", Some(UINT64)) => f.uuid_sub = be64(nv, v + 8).map(|g| g.to_string()),
            (b"pool_guid", Some(UINT64)) => f.uuid = be64(nv, v + 8).map(|g| g.to_string()),
            _ => {}
        }
        at += size;
    }
}

fn be64(buf: &[u8], at: usize) -> Option<u64> {
    bytes(buf, at).map(u64::from_be_bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// CRC-64/WE's published check value.
    #[test]
    fn crc64_we_check_value() {
        assert_eq!(crc64_we(b"123456789"), 0x62EC_59E3_F1A4_F00A);
    }

    /// Eight uberblocks in the second label alone (the first wiped, the
    /// last two gone) make a member, with the second label's names.
    #[test]
    fn zfs_from_the_second_label_alone() {
        let size = 64u64 << 20;
        let mut dev = vec![0u8; 1 << 20];
        let l1 = ZFS_LABEL as usize;
        for i in 0..8 {
            let at = l1 + (128 << 10) + i * 1024;
            dev[at..at + 8].copy_from_slice(&ZFS_UB_MAGIC.to_le_bytes());
        }
        let mut s = Sample::new(size);
        s.add(0, &dev[..super::super::PROBE_LEN]);
        assert_eq!(zfs(&s).map(|f| f.fstype), Some(FsType::ZfsMember));
        let mut short = Sample::new(size);
        short.add(0, &dev[..l1]);
        assert_eq!(zfs(&short), None, "only what was read counts");
    }
}
