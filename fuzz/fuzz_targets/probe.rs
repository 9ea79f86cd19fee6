//! A device's bytes → signatures. Never panics, whatever the buffer length,
//! logical block size or device size, never reports more GPT partitions
//! than the buffer can hold, and never asks for more than the read budget.
//!
//! The input is split into a head and a tail read, as `probe_reads` asks
//! for them for a device size taken from the input, so the
//! end-of-device parsers (md 0.90/1.0, ZFS's last labels, UDF's last-sector
//! anchor) see fuzzed bytes too; the same bytes are also probed as a whole
//! device. Labels and UUIDs stay within what their on-disk fields can hold
//! (a UDF dstring of 126 bytes is the longest: at most 3 UTF-8 bytes each).
//! Seeds (fuzz/seeds/probe) hold a real or hand-made image of every format.
#![no_main]

use libfuzzer_sys::fuzz_target;
use volring_devices::{probe, probe_reads, Content};

/// The read budget the probe documents, kept here rather than borrowed from
/// the code, so that a change of the code's bound is caught, not copied:
/// the first 512 KiB, and at most the last 768 KiB (the two trailing ZFS
/// labels of 256 KiB each, ending up to 256 KiB before the device's end).
const READ_BUDGET: usize = (512 << 10) + (512 << 10) + (256 << 10);

fn bounded(c: &Content) {
    if let Some(f) = &c.filesystem {
        assert!(f.label.as_ref().is_none_or(|l| l.len() <= 126 * 3), "{f:?}");
        assert!(f.uuid.as_ref().is_none_or(|u| u.len() <= 64), "{f:?}");
    }
}

fuzz_target!(|data: &[u8]| {
    let Some((&sel, rest)) = data.split_first() else { return };
    let lb = [512u32, 4096, 1024, 2048, 0, 7][sel as usize % 6];
    let c = probe(rest, lb);
    bounded(&c);
    if let Some(t) = c.table {
        assert!(t.partitions.len() <= rest.len() / 128 + 4);
    }
    // A device size from 8 more bytes (scaled so that it is often near the
    // data's length), then the head and tail reads filled from the data.
    let Some((size, body)) = rest.split_first_chunk::<8>().map(|(s, b)| (u64::from_le_bytes(*s), b)) else { return };
    let size = if sel & 0x80 != 0 { size } else { body.len() as u64 + (size % (1 << 20)) };
    let (mut reads, mut asked) = (0, 0);
    let mut left = body;
    let read = |_offset: u64, len: usize| {
        reads += 1;
        asked += len;
        let (got, more) = left.split_at(len.min(left.len()));
        left = more;
        Ok::<_, std::convert::Infallible>(got.to_vec())
    };
    let (c, _) = probe_reads(size, lb, read).unwrap_or_else(|never| match never {});
    assert!(reads <= 2 && asked <= READ_BUDGET);
    bounded(&c);
});
