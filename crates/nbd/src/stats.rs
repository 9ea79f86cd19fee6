//! Per-export counters and request latencies, written by the ring threads
//! and read by `/metrics` and `volring nbd serve`'s report.
//!
//! Latencies are kept twice: per command in fixed buckets of plain
//! counters (`LatencyBuckets`, exported as Prometheus histograms, so a
//! scrape can compute any window's quantiles), and in one HDR histogram
//! for the quantiles `volring nbd serve` prints.
//!
//! Beside them, each ring thread's own counters (`RingCounters`): what
//! its idle polls found, the windows in which it was starved of CPU, and
//! whether its reads go to io_uring's workers now. They belong to the
//! server's threads rather than to an export, and reach `/metrics`
//! through the catalog the server serves ([`RingSnapshot`]).

use std::sync::atomic::{AtomicBool, AtomicI32, AtomicU32, AtomicU64, Ordering};
use std::sync::Mutex;

use hdrhistogram::Histogram;
use serde::Serialize;

/// Request latencies are kept in microseconds, up to 100 s, to two
/// significant figures: about 20 KiB per export, made on first use.
const LATENCY_MAX_US: u64 = 100_000_000;

/// Upper bounds of the latency buckets, in microseconds (25 µs to 10 s);
/// one more bucket counts everything slower.
const BUCKET_BOUNDS_US: [u64; 18] = [
    25, 50, 100, 250, 500, 1_000, 2_500, 5_000, 10_000, 25_000, 50_000, 100_000, 250_000, 500_000, 1_000_000, 2_500_000, 5_000_000,
    10_000_000,
];
const BUCKETS: usize = BUCKET_BOUNDS_US.len() + 1;
/// Commands timed apart, in [`Kind`] order.
const KINDS: [Kind; 6] = [Kind::Read, Kind::Write, Kind::Flush, Kind::Trim, Kind::Zero, Kind::Other];

fn bucket_of(us: u64) -> usize {
    BUCKET_BOUNDS_US.partition_point(|&b| b < us)
}

/// One command's latencies: a count per bucket (not cumulative) and the
/// sum, all only ever added to.
#[derive(Default)]
pub(crate) struct LatencyBuckets {
    counts: [AtomicU64; BUCKETS],
    sum_us: AtomicU64,
}

/// A copy of one command's buckets, each with its bound, so a reader
/// (`/metrics`' histograms) needs nothing else to label them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LatencySnapshot {
    /// The command timed.
    pub kind: Kind,
    /// Per bucket, fastest first: its upper bound in microseconds (`None`
    /// for the last, which counts everything slower) and how many requests
    /// it counted (not cumulative).
    pub buckets: [(Option<u64>, u64); BUCKETS],
    pub sum_us: u64,
}

#[cfg(test)]
impl LatencySnapshot {
    /// Requests timed in all buckets.
    fn count(&self) -> u64 {
        self.counts().iter().sum()
    }

    /// The buckets' counts alone.
    fn counts(&self) -> [u64; BUCKETS] {
        self.buckets.map(|(_, n)| n)
    }
}

impl LatencyBuckets {
    pub(crate) fn snapshot(&self, kind: Kind) -> LatencySnapshot {
        LatencySnapshot {
            kind,
            buckets: std::array::from_fn(|i| (BUCKET_BOUNDS_US.get(i).copied(), self.counts[i].load(Ordering::Relaxed))),
            sum_us: self.sum_us.load(Ordering::Relaxed),
        }
    }
}
#[derive(Default)]
pub(crate) struct ExportStats {
    pub(crate) connections: AtomicU64,
    pub(crate) connections_total: AtomicU64,
    pub(crate) reads: AtomicU64,
    pub(crate) writes: AtomicU64,
    pub(crate) read_bytes: AtomicU64,
    pub(crate) write_bytes: AtomicU64,
    pub(crate) flushes: AtomicU64,
    pub(crate) trims: AtomicU64,
    pub(crate) zeroes: AtomicU64,
    pub(crate) other: AtomicU64,
    pub(crate) errors: AtomicU64,
    /// WRITEs done by a blocking call on a ring thread instead of through
    /// io_uring (see `server::inline`): tells an operator which path the
    /// pool's file system got.
    pub(crate) inline_writes: AtomicU64,
    /// Page-cache READs handed to io_uring's workers because the ring was
    /// starved of CPU (see `server::starve`).
    pub(crate) offloaded_reads: AtomicU64,
    /// WRITEs the inline path would have done with a blocking call on the
    /// ring thread, handed to io_uring's workers instead because the ring
    /// was starved of CPU (see `server::inline`).
    pub(crate) offloaded_writes: AtomicU64,
    /// WRITE payload bytes copied into the write's buffer from where they
    /// were received (the ring's provided buffers, or bytes a paused
    /// connection held) instead of received straight into it or written
    /// from where they landed: a second pass over them (see
    /// `server::direct`, and `server::conn`'s `Lend`).
    pub(crate) copied_write_bytes: AtomicU64,
    latency: Mutex<Option<Histogram<u64>>>,
    /// Per command, in [`KINDS`] order.
    buckets: [LatencyBuckets; 6],
}

/// Which counter a finished request lands in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Read,
    Write,
    Flush,
    Trim,
    Zero,
    Other,
}

/// A batch of finished requests a ring thread folds in at once, so the
/// shared counters and the histogram lock are touched once per loop turn,
/// not once per request.
#[derive(Default)]
pub(crate) struct Pending {
    counts: [u64; 6],
    read_bytes: u64,
    write_bytes: u64,
    errors: u64,
    offloaded_reads: u64,
    copied_write_bytes: u64,
    latencies_us: Vec<u32>,
    buckets: [[u64; BUCKETS]; 6],
    sums_us: [u64; 6],
}

impl Pending {
    pub(crate) fn record(&mut self, kind: Kind, bytes: u64, ok: bool, latency_us: u64) {
        self.counts[kind as usize] += 1;
        match kind {
            Kind::Read => self.read_bytes += bytes,
            Kind::Write => self.write_bytes += bytes,
            _ => {}
        }
        if !ok {
            self.errors += 1;
        }
        self.buckets[kind as usize][bucket_of(latency_us)] += 1;
        self.sums_us[kind as usize] += latency_us;
        if self.latencies_us.len() < 65_536 {
            self.latencies_us.push(latency_us.min(u64::from(u32::MAX)) as u32);
        }
    }

    /// A READ handed to io_uring's workers.
    pub(crate) fn offloaded_read(&mut self) {
        self.offloaded_reads += 1;
    }

    /// WRITE payload bytes copied out of where they were received.
    pub(crate) fn copied_write(&mut self, bytes: u64) {
        self.copied_write_bytes += bytes;
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.counts.iter().all(|&c| c == 0) && self.offloaded_reads == 0 && self.copied_write_bytes == 0
    }
}

impl ExportStats {
    pub(crate) fn fold(&self, p: &mut Pending) {
        if p.is_empty() {
            return;
        }
        let targets = [&self.reads, &self.writes, &self.flushes, &self.trims, &self.zeroes, &self.other];
        for (t, c) in targets.iter().zip(p.counts) {
            if c > 0 {
                t.fetch_add(c, Ordering::Relaxed);
            }
        }
        self.read_bytes.fetch_add(p.read_bytes, Ordering::Relaxed);
        self.write_bytes.fetch_add(p.write_bytes, Ordering::Relaxed);
        self.errors.fetch_add(p.errors, Ordering::Relaxed);
        self.offloaded_reads.fetch_add(p.offloaded_reads, Ordering::Relaxed);
        self.copied_write_bytes.fetch_add(p.copied_write_bytes, Ordering::Relaxed);
        for (k, target) in self.buckets.iter().enumerate() {
            if p.sums_us[k] == 0 && p.buckets[k].iter().all(|&c| c == 0) {
                continue;
            }
            for (t, &c) in target.counts.iter().zip(&p.buckets[k]) {
                if c > 0 {
                    t.fetch_add(c, Ordering::Relaxed);
                }
            }
            target.sum_us.fetch_add(p.sums_us[k], Ordering::Relaxed);
        }
        if let Ok(mut h) = self.latency.lock() {
            let h = h.get_or_insert_with(|| Histogram::new_with_bounds(1, LATENCY_MAX_US, 2).expect("valid histogram bounds"));
            for &us in &p.latencies_us {
                h.saturating_record(u64::from(us).max(1));
            }
        }
        // Keep the latency vector's allocation for the next batch.
        let mut latencies = std::mem::take(&mut p.latencies_us);
        latencies.clear();
        *p = Pending { latencies_us: latencies, ..Default::default() };
    }

    /// Latency buckets of one command.
    pub(crate) fn latency(&self, kind: Kind) -> LatencySnapshot {
        self.buckets[kind as usize].snapshot(kind)
    }

    pub(crate) fn snapshot(&self, name: &str) -> ExportSnapshot {
        let load = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let (p50, p99, max, count) = match self.latency.lock().ok().as_deref().and_then(|h| h.as_ref()) {
            Some(h) => (h.value_at_quantile(0.5), h.value_at_quantile(0.99), h.max(), h.len()),
            None => (0, 0, 0, 0),
        };
        ExportSnapshot {
            name: name.to_string(),
            connections: load(&self.connections),
            connections_total: load(&self.connections_total),
            reads: load(&self.reads),
            writes: load(&self.writes),
            read_bytes: load(&self.read_bytes),
            write_bytes: load(&self.write_bytes),
            flushes: load(&self.flushes),
            trims: load(&self.trims),
            zeroes: load(&self.zeroes),
            other: load(&self.other),
            errors: load(&self.errors),
            inline_writes: load(&self.inline_writes),
            offloaded_reads: load(&self.offloaded_reads),
            offloaded_writes: load(&self.offloaded_writes),
            copied_write_bytes: load(&self.copied_write_bytes),
            latency_count: count,
            latency_p50_us: p50,
            latency_p99_us: p99,
            latency_max_us: max,
            latency: KINDS.map(|k| self.latency(k)),
        }
    }
}

/// A copy of one export's counters.
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub struct ExportSnapshot {
    pub name: String,
    pub connections: u64,
    pub connections_total: u64,
    pub reads: u64,
    pub writes: u64,
    pub read_bytes: u64,
    pub write_bytes: u64,
    pub flushes: u64,
    pub trims: u64,
    pub zeroes: u64,
    pub other: u64,
    pub errors: u64,
    pub inline_writes: u64,
    pub offloaded_reads: u64,
    pub offloaded_writes: u64,
    /// WRITE payload bytes copied out of the buffers they were received
    /// into rather than received straight into the write's own.
    pub copied_write_bytes: u64,
    pub latency_count: u64,
    pub latency_p50_us: u64,
    pub latency_p99_us: u64,
    pub latency_max_us: u64,
    /// Per command, in [`Kind`] order: the buckets `/metrics` exports as
    /// histograms (not in the JSON, which keeps the quantiles above).
    #[serde(skip)]
    pub latency: [LatencySnapshot; 6],
}

/// One ring thread's counters as the ring publishes them: written by that
/// ring at most once per tick (50-250 ms), never per completion, and read
/// by `/metrics` at scrape time without a lock on the ring's path.
#[derive(Default)]
pub(crate) struct RingCounters {
    /// Idle polls (see `server::idle`) that found work before the window
    /// ran out, and those that ran out and slept.
    pub(crate) idle_polls_found: AtomicU64,
    pub(crate) idle_polls_missed: AtomicU64,
    /// Windows in which the ring was judged starved of CPU (see
    /// `server::starve`), since it started.
    pub(crate) starved_windows: AtomicU64,
    /// Whether the ring hands its page-cache reads to io_uring's workers now.
    pub(crate) offloading_reads: AtomicBool,
    /// The ring thread's scheduler nice value, as the weight rule
    /// (`server::weight`) last set it.
    pub(crate) nice: AtomicI32,
    /// Provided receive buffers the ring's driver holds at the tick, and
    /// those of them writes in flight are made from.
    pub(crate) recv_buffers_held: AtomicU32,
    pub(crate) recv_buffers_lent: AtomicU32,
    /// The ring's calls of `io_uring_enter` (submits and waits) so far.
    pub(crate) enters: AtomicU64,
}

impl RingCounters {
    /// A copy for ring `ring` (its thread is `nbd-ring-<ring>`).
    pub(crate) fn snapshot(&self, ring: usize) -> RingSnapshot {
        RingSnapshot {
            ring,
            idle_polls_found: self.idle_polls_found.load(Ordering::Relaxed),
            idle_polls_missed: self.idle_polls_missed.load(Ordering::Relaxed),
            starved_windows: self.starved_windows.load(Ordering::Relaxed),
            offloading_reads: self.offloading_reads.load(Ordering::Relaxed),
            nice: self.nice.load(Ordering::Relaxed),
            recv_buffers_held: self.recv_buffers_held.load(Ordering::Relaxed),
            recv_buffers_lent: self.recv_buffers_lent.load(Ordering::Relaxed),
            enters: self.enters.load(Ordering::Relaxed),
        }
    }
}

/// A copy of one ring thread's counters (see `RingCounters`), taken from
/// the catalog its server serves: `Vec::<RingSnapshot>::from(&*exports)`
/// gives one per ring of that server, in ring order (none while no
/// server runs).
#[derive(Debug, Clone, Copy, Serialize, PartialEq, Eq)]
pub struct RingSnapshot {
    /// The ring's number: its thread is `nbd-ring-<ring>`.
    pub ring: usize,
    pub idle_polls_found: u64,
    pub idle_polls_missed: u64,
    pub starved_windows: u64,
    /// Page-cache reads go to io_uring's workers now (the ring was starved
    /// of CPU lately, or the server's setting is `always`).
    pub offloading_reads: bool,
    /// The ring thread's nice value: the one it started with, lowered by
    /// the weight of its busy connections (`server::weight`).
    pub nice: i32,
    /// Provided receive buffers (of 128) the ring held at its last tick:
    /// handed out by receives and not yet given back. A quiet ring holds
    /// none; one that keeps holding some has lost track of them.
    pub recv_buffers_held: u32,
    /// Of those, the ones writes in flight are made from (small WRITE
    /// payloads written from where they arrived, `server::conn`'s `Lend`).
    pub recv_buffers_lent: u32,
    /// The ring thread's calls of `io_uring_enter` (each hands queued
    /// operations to the kernel, waits, or both) since it started: against
    /// the requests it served, what a request costs in kernel entries.
    pub enters: u64,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn folded_batches_add_up() {
        let s = ExportStats::default();
        let mut p = Pending::default();
        for i in 0..100 {
            p.record(Kind::Read, 4096, true, 10 + i);
        }
        p.record(Kind::Write, 512, false, 1000);
        s.fold(&mut p);
        assert!(p.is_empty());
        let snap = s.snapshot("x");
        assert_eq!((snap.reads, snap.read_bytes, snap.writes, snap.errors), (100, 409_600, 1, 1));
        assert_eq!(snap.latency_count, 101);
        assert!(snap.latency_p50_us >= 55 && snap.latency_p50_us <= 65, "{}", snap.latency_p50_us);
        assert!(snap.latency_max_us >= 990);
        let reads = s.latency(Kind::Read);
        assert_eq!(reads.count(), 100);
        assert_eq!(reads.sum_us, (10..110).sum::<u64>());
        assert_eq!(reads.counts()[..3], [16, 25, 50], "<=25, <=50, <=100 us");
        let writes = s.latency(Kind::Write);
        assert_eq!((writes.count(), writes.counts()[5]), (1, 1), "1 ms lands in the <=1000 us bucket");
    }

    /// The latencies `/metrics`' histogram test starts from (80 us and
    /// 3 ms READs) land in the <=100 us and <=5 ms buckets of the snapshot.
    #[test]
    fn the_snapshot_carries_each_commands_buckets() {
        let s = ExportStats::default();
        let mut p = Pending::default();
        p.record(Kind::Read, 4096, true, 80);
        p.record(Kind::Read, 4096, true, 3_000);
        s.fold(&mut p);
        let read = &s.snapshot("a").latency[Kind::Read as usize];
        assert_eq!((read.counts()[2], read.counts()[7], read.count(), read.sum_us), (1, 1, 2, 3_080));
        assert_eq!(s.snapshot("a").latency[Kind::Write as usize].count(), 0);
    }
}
