//! UDF (ECMA-167): the volume recognition sequence from 32 KiB, the anchor
//! volume descriptor pointer, and the main volume descriptor sequence it
//! points to, where the primary descriptor gives blkid's UUID and the
//! logical volume descriptor its LABEL.
//!
//! blkid reads the anchor at sector 256 only; ECMA-167 also records it in
//! the last sector, which the probe's tail read holds. So the probe takes
//! the anchor at sector 256 when the head read reaches it (sectors of 512
//! and 1024 bytes) and else the one in the last sector (2048 and 4096):
//! both point at the same sequence, so the identifiers agree with blkid's.
//! A recognition sequence whose anchor is in neither read is still UDF,
//! with no identifiers.

use super::{le16, le32, Filesystem, FsType, Sample};

const TAG_PRIMARY: u16 = 1;
const TAG_ANCHOR: u16 = 2;
const TAG_LOGICAL: u16 = 6;
const TAG_TERMINATOR: u16 = 8;

/// Descriptors of the main sequence the probe looks at, at most.
const MAX_DESCRIPTORS: u32 = 64;

pub(super) fn probe(s: &Sample<'_>, logical_block: u32) -> Option<Filesystem> {
    if !recognised(s) {
        return None;
    }
    let mut f = Filesystem::new(FsType::Udf, None, None);
    let sizes = [logical_block, 512, 1024, 2048, 4096];
    let found = sizes.iter().filter(|&&bs| matches!(bs, 512 | 1024 | 2048 | 4096)).find_map(|&bs| anchor(s, bs).map(|a| (bs, a)));
    if let Some((bs, (len, loc))) = found {
        identifiers(s, bs, loc, len / bs, &mut f);
    }
    Some(f)
}

/// The recognition sequence holds NSR02 or NSR03 among the descriptors
/// blkid allows before it, in 2 KiB descriptors or 4 KiB ones (for 4 KiB
/// sectors).
fn recognised(s: &Sample<'_>) -> bool {
    [2048u64, 4096].into_iter().any(|step| {
        for i in 0..64 {
            let Some(d) = s.at(0x8000 + i * step, 7) else { return false };
            match &d[1..6] {
                [0, ..] => return false,
                b"NSR02" | b"NSR03" => return true,
                b"BEA01" | b"BOOT2" | b"CD001" | b"CDW02" | b"TEA01" => {}
                _ => return false,
            }
        }
        false
    })
}

/// A descriptor tag at sector `sector` of `bs` bytes: its identifier, if
/// it records that same sector as its location.
fn tag<'a>(s: &Sample<'a>, bs: u32, sector: u64) -> Option<(u16, &'a [u8])> {
    let d = s.at(sector.checked_mul(u64::from(bs))?, 512)?;
    (u64::from(le32(d, 12)?) == sector).then_some((le16(d, 0)?, d))
}

/// The anchor for sectors of `bs` bytes: at sector 256, else in the last
/// sector; `(length, location)` of the main descriptor sequence.
fn anchor(s: &Sample<'_>, bs: u32) -> Option<(u32, u32)> {
    let last = (s.size() / u64::from(bs)).checked_sub(1)?;
    [256, last].into_iter().find_map(|sector| match tag(s, bs, sector)? {
        (TAG_ANCHOR, d) => Some((le32(d, 16)?, le32(d, 20)?)),
        _ => None,
    })
}

/// Walks the main sequence: the first primary descriptor's volume set
/// identifier makes the UUID, the first logical volume descriptor's
/// identifier is the label. Stops at a terminator, an empty or misplaced
/// descriptor, or the end of what was read.
fn identifiers(s: &Sample<'_>, bs: u32, loc: u32, count: u32, f: &mut Filesystem) {
    for b in 0..count.min(MAX_DESCRIPTORS) {
        let Some((id, d)) = tag(s, bs, u64::from(loc) + u64::from(b)) else { return };
        match id {
            0 | TAG_TERMINATOR => return,
            TAG_PRIMARY if f.uuid.is_none() => f.uuid = d.get(72..200).and_then(volume_set_uuid),
            TAG_LOGICAL if f.label.is_none() => {
                f.label = d.get(84..212).and_then(dstring).map(|l| l.trim_end().to_string()).filter(|l| !l.is_empty())
            }
            _ => {}
        }
        if f.uuid.is_some() && f.label.is_some() {
            return;
        }
    }
}

/// A dstring: compression id (8: one byte a character, 16: UTF-16BE), the
/// characters, and the used length (including the id) in its last byte.
fn dstring(raw: &[u8]) -> Option<String> {
    let (&cid, rest) = raw.split_first()?;
    let (&used, chars) = rest.split_last()?;
    let chars = &chars[..usize::from(used.saturating_sub(1)).min(chars.len())];
    let text = match cid {
        8 => chars.iter().map(|&c| char::from(c)).collect(),
        16 => String::from_utf16_lossy(&chars.chunks_exact(2).map(|c| u16::from_be_bytes([c[0], c[1]])).collect::<Vec<_>>()),
        _ => return None,
    };
    Some(text.trim_end_matches('\0').to_string())
}

/// blkid's UUID from the volume set identifier: its first 16 bytes in
/// UTF-8; all hex digits: those, lowercased; else the first 8 when they
/// are hex, then the next 4 bytes in hex; else the first 8 bytes in hex.
/// Fewer than 8 bytes give none.
fn volume_set_uuid(raw: &[u8]) -> Option<String> {
    let text = dstring(raw)?;
    let mut buf = Vec::with_capacity(16);
    for c in text.chars() {
        let mut enc = [0u8; 4];
        let e = c.encode_utf8(&mut enc).as_bytes();
        if buf.len() + e.len() > 16 {
            break;
        }
        buf.extend_from_slice(e);
    }
    if buf.len() < 8 {
        return None;
    }
    buf.resize(16, 0);
    let hex_prefix = buf.iter().take_while(|b| b.is_ascii_hexdigit()).count();
    let hexed = |b: &[u8]| b.iter().map(|x| format!("{x:02x}")).collect::<String>();
    let lower = |b: &[u8]| b.iter().map(|x| char::from(x.to_ascii_lowercase())).collect::<String>();
    Some(match hex_prefix {
        0..=7 => hexed(&buf[..8]),
        8..=15 => format!("{}{}", lower(&buf[..8]), hexed(&buf[8..12])),
        _ => lower(&buf[..16]),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn d(cid: u8, text: &[u8]) -> Vec<u8> {
        let mut raw = vec![0u8; 128];
        raw[0] = cid;
        raw[1..1 + text.len()].copy_from_slice(text);
        raw[127] = text.len() as u8 + 1;
        raw
    }

    /// The three cases of blkid's rule, on the identifiers mkudffs writes
    /// and on ones that are not hex.
    #[test]
    fn uuid_from_the_volume_set_identifier() {
        assert_eq!(volume_set_uuid(&d(8, b"6b0792fe4d0bd795LinuxUDF")).as_deref(), Some("6b0792fe4d0bd795"));
        assert_eq!(volume_set_uuid(&d(8, b"6B0792FEzz12")).as_deref(), Some("6b0792fe7a7a3132"));
        assert_eq!(volume_set_uuid(&d(8, b"volume-set-one")).as_deref(), Some("766f6c756d652d73"));
        assert_eq!(volume_set_uuid(&d(8, b"short")), None);
        assert_eq!(
            volume_set_uuid(&d(16, &[0, b'a', 0, b'b', 0, b'c', 0, b'd', 0, b'e', 0, b'f', 0, b'0', 0, b'1'])).as_deref(),
            Some("abcdef0100000000")
        );
    }

    #[test]
    fn dstrings_in_both_encodings_and_bad_lengths() {
        assert_eq!(dstring(&d(8, b"Label")).as_deref(), Some("Label"));
        assert_eq!(dstring(&d(16, &[0, b'L', 0x26, 0x3A])).as_deref(), Some("L\u{263a}"));
        assert_eq!(dstring(&d(9, b"x")), None);
        let mut long = d(8, b"x");
        long[127] = 255;
        assert!(dstring(&long).is_some());
        assert_eq!(dstring(&[]), None);
    }
}
