//! I/O counters, their parsers, and iostat-style rates.
//!
//! The kernel exposes the same 17 counters twice: one line per device in
//! `/proc/diskstats` (with `major minor name` in front) and one line in each
//! `/sys/class/block/<name>/stat`. Older kernels print 11 or 15 fields; the
//! missing ones read as zero. Parsing is pure so it can be fuzzed and
//! benched alone.

use std::sync::Arc;
use std::time::Duration;

use serde::Serialize;

use volring_mounts::DevNum;

/// The kernel's counters for one block device (see the kernel's
/// `Documentation/admin-guide/iostats.rst`). Sectors are 512 bytes; ticks
/// are milliseconds.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct IoCounters {
    pub reads: u64,
    pub reads_merged: u64,
    pub read_sectors: u64,
    pub read_ticks: u64,
    pub writes: u64,
    pub writes_merged: u64,
    pub write_sectors: u64,
    pub write_ticks: u64,
    pub in_flight: u64,
    pub io_ticks: u64,
    pub time_in_queue: u64,
    pub discards: u64,
    pub discards_merged: u64,
    pub discard_sectors: u64,
    pub discard_ticks: u64,
    pub flushes: u64,
    pub flush_ticks: u64,
}

/// Why a counters line was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum StatLineError {
    #[error("fewer than 11 counters")]
    TooFewFields,
    #[error("a counter is not a decimal number")]
    NotANumber,
    #[error("no device number or name before the counters")]
    MissingHeader,
}

impl IoCounters {
    /// Parses the counters of a sysfs `stat` file: 11, 15 or 17 numbers
    /// separated by spaces. Extra fields (a future kernel's) are ignored.
    pub fn parse(line: &[u8]) -> Result<Self, StatLineError> {
        let mut v = [0u64; 17];
        let mut n = 0;
        for field in line.split(|b| b.is_ascii_whitespace()).filter(|f| !f.is_empty()) {
            if n < v.len() {
                v[n] = parse_u64(field).ok_or(StatLineError::NotANumber)?;
            }
            n += 1;
        }
        if n < 11 {
            return Err(StatLineError::TooFewFields);
        }
        Ok(Self::from_array(v))
    }

    fn from_array(v: [u64; 17]) -> Self {
        Self {
            reads: v[0],
            reads_merged: v[1],
            read_sectors: v[2],
            read_ticks: v[3],
            writes: v[4],
            writes_merged: v[5],
            write_sectors: v[6],
            write_ticks: v[7],
            in_flight: v[8],
            io_ticks: v[9],
            time_in_queue: v[10],
            discards: v[11],
            discards_merged: v[12],
            discard_sectors: v[13],
            discard_ticks: v[14],
            flushes: v[15],
            flush_ticks: v[16],
        }
    }
}

/// Decimal u64 without sign or overflow; `None` otherwise.
fn parse_u64(s: &[u8]) -> Option<u64> {
    if s.is_empty() || s.len() > 20 {
        return None;
    }
    let mut n: u64 = 0;
    for &b in s {
        if !b.is_ascii_digit() {
            return None;
        }
        n = n.checked_mul(10)?.checked_add(u64::from(b - b'0'))?;
    }
    Some(n)
}

/// One line of `/proc/diskstats`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DiskstatsLine<'a> {
    pub dev: DevNum,
    pub name: &'a [u8],
    pub counters: IoCounters,
}

/// Parses one `/proc/diskstats` line: `major minor name` then the counters.
pub(crate) fn parse_diskstats_line(line: &[u8]) -> Result<DiskstatsLine<'_>, StatLineError> {
    let mut fields = line.split(|b| b.is_ascii_whitespace()).filter(|f| !f.is_empty());
    let mut header = || fields.next().ok_or(StatLineError::MissingHeader);
    let major = header()?;
    let minor = header()?;
    let name = header()?;
    let dev = DevNum {
        major: parse_u64(major).and_then(|n| u32::try_from(n).ok()).ok_or(StatLineError::NotANumber)?,
        minor: parse_u64(minor).and_then(|n| u32::try_from(n).ok()).ok_or(StatLineError::NotANumber)?,
    };
    let start = name.as_ptr() as usize - line.as_ptr() as usize + name.len();
    Ok(DiskstatsLine { dev, name, counters: IoCounters::parse(&line[start..])? })
}

/// Every line of a `/proc/diskstats` read; a bad line is reported with its
/// index and does not stop the others.
pub fn parse_diskstats(text: &[u8]) -> impl Iterator<Item = (usize, Result<DiskstatsLine<'_>, StatLineError>)> {
    text.split(|&b| b == b'\n').filter(|l| !l.iter().all(u8::is_ascii_whitespace)).enumerate().map(|(i, l)| (i, parse_diskstats_line(l)))
}

/// iostat -x's per-device figures over an interval, with its definitions
/// (sysstat's `iostat(1)`): per-second rates divide a counter's change by
/// the interval; `*_await` divide the time requests spent (ticks) by how
/// many completed; `*areq-sz` divide kilobytes by requests; `%*rqm` is the
/// share of requests merged before they reached the device.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct IoRates {
    pub reads_per_sec: f64,
    pub writes_per_sec: f64,
    pub read_kib_per_sec: f64,
    pub write_kib_per_sec: f64,
    /// Mean time a read waited and was served, milliseconds.
    pub read_await_ms: f64,
    pub write_await_ms: f64,
    /// Share of wall time the device had I/O in flight, 0–100.
    pub util_pct: f64,
    /// rrqm/s, wrqm/s: requests merged into others per second.
    pub reads_merged_per_sec: f64,
    pub writes_merged_per_sec: f64,
    /// %rrqm, %wrqm: merged requests as a share of all requests, 0–100.
    pub reads_merged_pct: f64,
    pub writes_merged_pct: f64,
    /// aqu-sz: the mean number of requests queued or in service.
    pub queue_size: f64,
    /// rareq-sz, wareq-sz: mean request size, kilobytes.
    pub read_req_kib: f64,
    pub write_req_kib: f64,
    /// d/s, dkB/s, drqm/s, %drqm, d_await, dareq-sz: the same for discards.
    pub discards_per_sec: f64,
    pub discard_kib_per_sec: f64,
    pub discards_merged_per_sec: f64,
    pub discards_merged_pct: f64,
    pub discard_await_ms: f64,
    pub discard_req_kib: f64,
    /// f/s, f_await: flush requests (the block layer counts those it sends
    /// to the device; requests merged into one flush count once).
    pub flushes_per_sec: f64,
    pub flush_await_ms: f64,
}

impl IoRates {
    /// The rates between two samples `elapsed` apart. Counters that went
    /// backwards (the device was removed and a new one took its number) give
    /// zero for that interval instead of a huge wrapped figure.
    pub fn between(before: &IoCounters, after: &IoCounters, elapsed: Duration) -> Self {
        let secs = elapsed.as_secs_f64();
        if secs <= 0.0 {
            return Self::default();
        }
        let d = |a: u64, b: u64| b.saturating_sub(a) as f64;
        let per = |n: f64, of: f64| if of > 0.0 { n / of } else { 0.0 };
        let reads = d(before.reads, after.reads);
        let writes = d(before.writes, after.writes);
        let discards = d(before.discards, after.discards);
        let flushes = d(before.flushes, after.flushes);
        let (rm, wm, dm) = (
            d(before.reads_merged, after.reads_merged),
            d(before.writes_merged, after.writes_merged),
            d(before.discards_merged, after.discards_merged),
        );
        let (rkb, wkb, dkb) = (
            d(before.read_sectors, after.read_sectors) / 2.0,
            d(before.write_sectors, after.write_sectors) / 2.0,
            d(before.discard_sectors, after.discard_sectors) / 2.0,
        );
        Self {
            reads_per_sec: reads / secs,
            writes_per_sec: writes / secs,
            read_kib_per_sec: rkb / secs,
            write_kib_per_sec: wkb / secs,
            read_await_ms: per(d(before.read_ticks, after.read_ticks), reads),
            write_await_ms: per(d(before.write_ticks, after.write_ticks), writes),
            util_pct: (d(before.io_ticks, after.io_ticks) / (secs * 1000.0) * 100.0).min(100.0),
            reads_merged_per_sec: rm / secs,
            writes_merged_per_sec: wm / secs,
            reads_merged_pct: per(rm * 100.0, rm + reads),
            writes_merged_pct: per(wm * 100.0, wm + writes),
            queue_size: d(before.time_in_queue, after.time_in_queue) / (secs * 1000.0),
            read_req_kib: per(rkb, reads),
            write_req_kib: per(wkb, writes),
            discards_per_sec: discards / secs,
            discard_kib_per_sec: dkb / secs,
            discards_merged_per_sec: dm / secs,
            discards_merged_pct: per(dm * 100.0, dm + discards),
            discard_await_ms: per(d(before.discard_ticks, after.discard_ticks), discards),
            discard_req_kib: per(dkb, discards),
            flushes_per_sec: flushes / secs,
            flush_await_ms: per(d(before.flush_ticks, after.flush_ticks), flushes),
        }
    }
}

/// One device's entry in a [`StatSnapshot`].
#[derive(Debug, Clone, Serialize)]
pub struct DeviceStat {
    pub dev: DevNum,
    pub name: Arc<str>,
    pub counters: IoCounters,
    /// Over the interval since the previous snapshot; `None` in the first.
    pub rates: Option<IoRates>,
}

/// Every tracked device's counters at one instant. Published whole (behind
/// an `Arc`) so readers never lock and never see half a refresh.
#[derive(Debug, Clone, Default, Serialize)]
pub struct StatSnapshot {
    /// Sorted by device number.
    pub devices: Vec<DeviceStat>,
    /// Monotonic time of the sample, since the collector started.
    #[serde(with = "duration_ms")]
    pub taken_at: Duration,
    /// Wall-clock time of the sample, seconds since the Unix epoch (what
    /// `volring stats` prints per sample, like `iostat -t`).
    pub unix_time: f64,
    /// How long the collection took.
    #[serde(with = "duration_ms")]
    pub cost: Duration,
    /// Which method collected it.
    pub method: &'static str,
    /// Monotonically increasing; 0 before the first sample.
    pub generation: u64,
    /// Devices whose counters could not be read this time, with the reason.
    pub errors: Vec<(Arc<str>, String)>,
    /// With the `auto` method: the median cost of each candidate when last
    /// timed, fastest first.
    pub calibration: Vec<(&'static str, f64)>,
}

mod duration_ms {
    pub(crate) fn serialize<S: serde::Serializer>(d: &std::time::Duration, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_f64(d.as_secs_f64() * 1000.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_17_15_and_11_fields() {
        let c = IoCounters::parse(b"  1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17\n").unwrap();
        assert_eq!((c.reads, c.in_flight, c.flush_ticks), (1, 9, 17));
        let c = IoCounters::parse(b"1 2 3 4 5 6 7 8 9 10 11 12 13 14 15").unwrap();
        assert_eq!((c.discard_ticks, c.flushes), (15, 0));
        let c = IoCounters::parse(b"1 2 3 4 5 6 7 8 9 10 11").unwrap();
        assert_eq!((c.time_in_queue, c.discards), (11, 0));
        assert_eq!(IoCounters::parse(b"1 2 3"), Err(StatLineError::TooFewFields));
        assert_eq!(IoCounters::parse(b"1 2 3 4 5 6 7 8 9 10 x"), Err(StatLineError::NotANumber));
        assert_eq!(IoCounters::parse(b"1 2 3 4 5 6 7 8 9 10 99999999999999999999999"), Err(StatLineError::NotANumber));
    }

    #[test]
    fn diskstats_lines_keep_going_past_a_bad_one() {
        let text =
            b" 254       0 vda 397830 13869 22356402 1241567 33116 51014 21843920 93329 0 41868 1341210 21542 16 9430992 5833 10308 479\n\
                     7 x loop0 0 0 0 0 0 0 0 0 0 0 0\n\
                     7 1 loop1 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0\n";
        let lines: Vec<_> = parse_diskstats(text).collect();
        assert_eq!(lines.len(), 3);
        let vda = lines[0].1.unwrap();
        assert_eq!(
            (vda.dev, vda.name, vda.counters.reads, vda.counters.flush_ticks),
            (DevNum { major: 254, minor: 0 }, &b"vda"[..], 397830, 479)
        );
        assert_eq!(lines[1].1, Err(StatLineError::NotANumber));
        assert_eq!(lines[2].1.unwrap().name, b"loop1");
        assert_eq!(parse_diskstats_line(b"7 1"), Err(StatLineError::MissingHeader));
    }

    #[test]
    fn rates_match_iostat_and_survive_a_counter_reset() {
        let a = IoCounters {
            reads: 100,
            read_sectors: 800,
            read_ticks: 50,
            writes: 10,
            write_sectors: 80,
            io_ticks: 200,
            ..Default::default()
        };
        let b = IoCounters {
            reads: 300,
            read_sectors: 2800,
            read_ticks: 250,
            writes: 20,
            write_sectors: 100,
            io_ticks: 700,
            ..Default::default()
        };
        let r = IoRates::between(&a, &b, Duration::from_secs(2));
        assert_eq!((r.reads_per_sec, r.writes_per_sec, r.read_kib_per_sec, r.write_kib_per_sec), (100.0, 5.0, 500.0, 5.0));
        assert_eq!((r.read_await_ms, r.write_await_ms, r.util_pct), (1.0, 0.0, 25.0));
        let back = IoRates::between(&b, &a, Duration::from_secs(1));
        assert_eq!(back.read_req_kib, 0.0);
        assert_eq!(back.reads_per_sec, 0.0);
        assert_eq!(IoRates::between(&a, &b, Duration::ZERO), IoRates::default());
    }

    /// The extended columns against figures worked by hand from iostat(1)'s
    /// definitions over a 2 s interval.
    #[test]
    fn extended_columns_follow_iostat_definitions() {
        let a = IoCounters::default();
        let b = IoCounters {
            reads: 100,
            reads_merged: 300,
            read_sectors: 1600,
            writes: 50,
            writes_merged: 50,
            write_sectors: 400,
            time_in_queue: 3000,
            discards: 4,
            discards_merged: 1,
            discard_sectors: 4096,
            discard_ticks: 8,
            flushes: 10,
            flush_ticks: 5,
            ..Default::default()
        };
        let r = IoRates::between(&a, &b, Duration::from_secs(2));
        assert_eq!((r.reads_merged_per_sec, r.writes_merged_per_sec), (150.0, 25.0));
        assert_eq!((r.reads_merged_pct, r.writes_merged_pct), (75.0, 50.0));
        assert_eq!(r.queue_size, 1.5);
        assert_eq!((r.read_req_kib, r.write_req_kib), (8.0, 4.0));
        assert_eq!((r.discards_per_sec, r.discard_kib_per_sec, r.discards_merged_per_sec), (2.0, 1024.0, 0.5));
        assert_eq!((r.discards_merged_pct, r.discard_await_ms, r.discard_req_kib), (20.0, 2.0, 512.0));
        assert_eq!((r.flushes_per_sec, r.flush_await_ms), (5.0, 0.5));
    }
}
