//! The NBD server on `/metrics`: each export's requests, bytes and request
//! latency, and each ring thread's own counters (its idle polls, the
//! windows it was starved of CPU, whether its reads are offloaded, its
//! nice value), all read at scrape time from the catalog the server
//! serves.

use std::fmt::Error as FmtError;

use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::MetricType;
use volring_nbd::stats::{ExportSnapshot, RingSnapshot};

/// The NBD families of one scrape, from the server's catalog.
pub(super) fn encode(e: &mut DescriptorEncoder<'_>, exports: &volring_nbd::Exports) -> Result<(), FmtError> {
    encode_exports(e, &export_snapshots(exports))?;
    encode_rings(e, &Vec::<RingSnapshot>::from(exports))
}

/// One series per export for each NBD counter, and request latency as a
/// histogram per export and command.
fn encode_exports(e: &mut DescriptorEncoder<'_>, snaps: &[ExportSnapshot]) -> Result<(), FmtError> {
    use volring_nbd::stats::Kind;
    type Pick = fn(&ExportSnapshot) -> u64;
    let counters: [(&str, &str, Pick); 13] = [
        ("volring_nbd_connections_accepted", "Connections accepted into transmission", |s| s.connections_total),
        ("volring_nbd_reads", "READ requests answered", |s| s.reads),
        ("volring_nbd_writes", "WRITE requests answered", |s| s.writes),
        ("volring_nbd_read_bytes", "Bytes read by clients", |s| s.read_bytes),
        ("volring_nbd_written_bytes", "Bytes written by clients", |s| s.write_bytes),
        ("volring_nbd_flushes", "FLUSH requests answered", |s| s.flushes),
        ("volring_nbd_trims", "TRIM requests answered", |s| s.trims),
        ("volring_nbd_write_zeroes", "WRITE_ZEROES requests answered", |s| s.zeroes),
        ("volring_nbd_other_requests", "CACHE and BLOCK_STATUS requests answered", |s| s.other),
        ("volring_nbd_errors", "Requests answered with an error", |s| s.errors),
        ("volring_nbd_inline_writes", "WRITEs done on a ring thread instead of an io_uring worker", |s| s.inline_writes),
        ("volring_nbd_offloaded_reads", "READs handed to io_uring's workers while the ring was starved of CPU", |s| s.offloaded_reads),
        (
            "volring_nbd_copied_write_bytes",
            "WRITE payload bytes copied out of the receive buffers instead of received into the write's own",
            |s| s.copied_write_bytes,
        ),
    ];
    for (name, help, pick) in counters {
        let mut fam = e.encode_descriptor(name, help, None, MetricType::Counter)?;
        for s in snaps {
            ConstCounter::new(pick(s)).encode(fam.encode_family(&[("export", s.name.as_str())])?)?;
        }
    }
    let mut fam = e.encode_descriptor("volring_nbd_connections", "Connections open now", None, MetricType::Gauge)?;
    for s in snaps {
        ConstGauge::new(s.connections as f64).encode(fam.encode_family(&[("export", s.name.as_str())])?)?;
    }
    // A READ is timed until its data is in the socket (spliced ones too);
    // other commands until their reply is queued.
    let mut fam = e.encode_descriptor(
        "volring_nbd_request_duration_seconds",
        "Time from a request's arrival to its answer, by command",
        None,
        MetricType::Histogram,
    )?;
    let mut buckets: Vec<(f64, u64)> = Vec::new();
    for x in snaps {
        for h in &x.latency {
            let op = match h.kind {
                Kind::Read => "read",
                Kind::Write => "write",
                Kind::Flush => "flush",
                Kind::Trim => "trim",
                Kind::Zero => "write_zeroes",
                Kind::Other => "other",
            };
            buckets.clear();
            buckets.extend(h.buckets.iter().map(|&(le, n)| (le.map_or(f64::MAX, |b| b as f64 / 1e6), n)));
            let labels = [("export", x.name.as_str()), ("op", op)];
            let mut m = fam.encode_family(&labels)?;
            let count = h.buckets.iter().map(|(_, n)| n).sum();
            m.encode_histogram::<prometheus_client::encoding::NoLabelSet>(h.sum_us as f64 / 1e6, count, &buckets, None)?;
        }
    }
    Ok(())
}

/// Every export's counters, taken once for one scrape.
fn export_snapshots(exports: &volring_nbd::Exports) -> Vec<ExportSnapshot> {
    exports.all().iter().map(|x| x.snapshot()).collect()
}

/// One series per ring thread (label `ring`: its number, the thread is
/// `nbd-ring-<ring>`): what only the ring knows about how it is served by
/// the CPU, which no export's counter shows. The rings publish these once
/// per tick, so a scrape may trail them by up to a tick (250 ms).
fn encode_rings(e: &mut DescriptorEncoder<'_>, rings: &[RingSnapshot]) -> Result<(), FmtError> {
    let names: Vec<String> = rings.iter().map(|r| r.ring.to_string()).collect();
    let mut fam = e.encode_descriptor(
        "volring_nbd_ring_idle_polls",
        "Polls of a quiet NBD ring before it sleeps, by whether work came within the window",
        None,
        MetricType::Counter,
    )?;
    for (r, ring) in rings.iter().zip(&names) {
        for (result, n) in [("found", r.idle_polls_found), ("missed", r.idle_polls_missed)] {
            ConstCounter::new(n).encode(fam.encode_family(&[("ring", ring.as_str()), ("result", result)])?)?;
        }
    }
    let mut fam = e.encode_descriptor(
        "volring_nbd_ring_starved_windows",
        "20 ms windows in which an NBD ring waited for its CPU (runnable, not running) enough to count as starved",
        None,
        MetricType::Counter,
    )?;
    for (r, ring) in rings.iter().zip(&names) {
        ConstCounter::new(r.starved_windows).encode(fam.encode_family(&[("ring", ring.as_str())])?)?;
    }
    type Pick = fn(&RingSnapshot) -> i64;
    let gauges: [(&str, &str, Pick); 2] = [
        ("volring_nbd_ring_offloading_reads", "1 while an NBD ring hands its page-cache reads to io_uring's workers", |r| {
            i64::from(r.offloading_reads)
        }),
        ("volring_nbd_ring_nice", "The scheduler nice value of an NBD ring thread", |r| i64::from(r.nice)),
    ];
    for (name, help, pick) in gauges {
        let mut fam = e.encode_descriptor(name, help, None, MetricType::Gauge)?;
        for (r, ring) in rings.iter().zip(&names) {
            ConstGauge::new(pick(r)).encode(fam.encode_family(&[("ring", ring.as_str())])?)?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use prometheus_client::collector::Collector;
    use prometheus_client::registry::Registry;

    /// Just the NBD part of the exposition.
    struct Nbd(Vec<ExportSnapshot>, Vec<RingSnapshot>);

    impl std::fmt::Debug for Nbd {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("Nbd")
        }
    }

    impl Collector for Nbd {
        fn encode(&self, mut e: DescriptorEncoder<'_>) -> Result<(), FmtError> {
            encode_exports(&mut e, &self.0)?;
            encode_rings(&mut e, &self.1)
        }
    }

    #[test]
    fn nbd_latency_is_a_histogram_per_command() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("img");
        std::fs::write(&path, [0u8; 4096]).unwrap();
        let exports = volring_nbd::Exports::default();
        exports.add(&format!("a={}", path.display()).parse().unwrap(), None).unwrap();
        let mut snaps = export_snapshots(&exports);
        // Two READs, of 80 us and 3 ms (the buckets nbd's stats put them
        // in are its own unit test's).
        let read = &mut snaps[0].latency[volring_nbd::stats::Kind::Read as usize];
        (read.buckets[2].1, read.buckets[7].1, read.sum_us) = (1, 1, 3_080);
        let mut registry = Registry::default();
        registry.register_collector(Box::new(Nbd(snaps, Vec::new())));
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, &registry).unwrap();
        assert!(out.contains("# TYPE volring_nbd_request_duration_seconds histogram"), "{out}");
        for line in [
            r#"volring_nbd_request_duration_seconds_bucket{le="0.00005",export="a",op="read"} 0"#,
            r#"volring_nbd_request_duration_seconds_bucket{le="0.0001",export="a",op="read"} 1"#,
            r#"volring_nbd_request_duration_seconds_bucket{le="0.005",export="a",op="read"} 2"#,
            r#"volring_nbd_request_duration_seconds_bucket{le="+Inf",export="a",op="read"} 2"#,
            r#"volring_nbd_request_duration_seconds_count{export="a",op="read"} 2"#,
            r#"volring_nbd_request_duration_seconds_count{export="a",op="write"} 0"#,
        ] {
            assert!(out.contains(line), "{line} in\n{out}");
        }
        assert!(!out.contains("latency_p50"), "no since-start quantile gauges");
    }

    fn text(exports: Vec<ExportSnapshot>, rings: Vec<RingSnapshot>) -> String {
        let mut registry = Registry::default();
        registry.register_collector(Box::new(Nbd(exports, rings)));
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, &registry).unwrap();
        out
    }

    /// Each ring's counters are a series per ring; with no server running
    /// the families are declared and empty.
    #[test]
    fn nbd_rings_have_a_series_each() {
        let ring = |ring, found, missed, starved, offloading| RingSnapshot {
            ring,
            idle_polls_found: found,
            idle_polls_missed: missed,
            starved_windows: starved,
            offloading_reads: offloading,
            nice: 0,
        };
        let out = text(Vec::new(), vec![ring(0, 41, 3, 0, false), ring(1, 0, 0, 7, true)]);
        for line in [
            "# TYPE volring_nbd_ring_idle_polls counter",
            r#"volring_nbd_ring_idle_polls_total{ring="0",result="found"} 41"#,
            r#"volring_nbd_ring_idle_polls_total{ring="0",result="missed"} 3"#,
            r#"volring_nbd_ring_idle_polls_total{ring="1",result="found"} 0"#,
            r#"volring_nbd_ring_starved_windows_total{ring="0"} 0"#,
            r#"volring_nbd_ring_starved_windows_total{ring="1"} 7"#,
            "# TYPE volring_nbd_ring_offloading_reads gauge",
            r#"volring_nbd_ring_offloading_reads{ring="0"} 0"#,
            r#"volring_nbd_ring_offloading_reads{ring="1"} 1"#,
            r#"volring_nbd_ring_nice{ring="0"} 0"#,
            r#"volring_nbd_ring_nice{ring="1"} 0"#,
        ] {
            assert!(out.lines().any(|l| l == line), "{line} in\n{out}");
        }
        let idle = text(Vec::new(), Vec::<RingSnapshot>::from(&volring_nbd::Exports::default()));
        assert!(idle.contains("# TYPE volring_nbd_ring_starved_windows counter"), "{idle}");
        assert!(!idle.contains("ring=\""), "no server, no ring series:\n{idle}");
    }
}
