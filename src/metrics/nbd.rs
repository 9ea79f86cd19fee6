//! The NBD servers on `/metrics`: each export's requests, bytes and request
//! latency, and each ring thread's own counters (its idle polls, the
//! windows it was starved of CPU, whether its reads are offloaded, its
//! nice value), all read at scrape time from the catalog each server
//! serves.
//!
//! Up to three servers run in an agent: the one `--nbd-listen` serves to
//! outside clients, and two the CSI driver runs (crates/csi): the attach
//! server, which serves the node's own `attach: nbd` volumes to the
//! kernel's nbd client (started by the first such volume), and the export
//! server, which `--nbd-export-listen` runs to serve those volumes to other
//! nodes. Their series share the families and are told apart by a `server`
//! label (`listen`, `attach`, `export`): a sum over a family is the node's
//! NBD work, the listener's series keep their names and labels (`server`
//! comes on top, so a selector on `export`, `ring` or `op` still finds
//! them, beside the others' unless it names `server`). The driver's
//! servers name their exports by volume id, and their series carry it as
//! `volume` too, the label the `volring_volume_*` series join on.

use std::fmt::Error as FmtError;

use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::MetricType;
use volring_nbd::stats::{ExportSnapshot, RingSnapshot};

/// The `server` label of the `--nbd-listen` server's series (the CSI
/// driver names its own servers: `Driver::nbd_servers`).
const LISTEN: &str = "listen";
/// The `server` label `Driver::nbd_servers` gives the server of this node's
/// nbd volumes to other nodes.
const EXPORT: &str = "export";

/// One server's part of a scrape, taken once.
struct Server {
    /// Its `server` label.
    name: &'static str,
    exports: Vec<ExportSnapshot>,
    rings: Vec<RingSnapshot>,
}

impl Server {
    fn read(name: &'static str, catalog: &volring_nbd::Exports) -> Self {
        Self { name, exports: export_snapshots(catalog), rings: Vec::<RingSnapshot>::from(catalog) }
    }

    /// An export's labels: its name and the server's, and for the CSI
    /// driver's servers (every one but the listener) the volume id (its
    /// export's name).
    fn labels<'a>(&self, x: &'a ExportSnapshot) -> Vec<(&'static str, &'a str)> {
        let mut l = vec![("export", x.name.as_str()), ("server", self.name)];
        if self.name != LISTEN {
            l.push(("volume", x.name.as_str()));
        }
        l
    }
}

/// The NBD families of one scrape: the `--nbd-listen` server's (`listen`,
/// when it runs), and the CSI driver's: the attach server's (once a volume
/// started it) and the export server's (with `--nbd-export-listen`).
/// Declared, empty, while none serves anything, so a query finds the
/// families on any node that may run one.
pub(super) fn encode(
    e: &mut DescriptorEncoder<'_>,
    listen: Option<&volring_nbd::Exports>,
    csi: Option<&volring_csi::Driver>,
) -> Result<(), FmtError> {
    if listen.is_none() && csi.is_none() {
        return Ok(());
    }
    let mut servers = Vec::new();
    if let Some(x) = listen {
        servers.push(Server::read(LISTEN, x));
    }
    for (name, x) in csi.map(|d| d.nbd_servers()).unwrap_or_default() {
        servers.push(Server::read(name, &x));
    }
    encode_servers(e, &servers)
}

fn encode_servers(e: &mut DescriptorEncoder<'_>, servers: &[Server]) -> Result<(), FmtError> {
    encode_exports(e, servers)?;
    encode_rings(e, servers)
}

/// One series per server and export for each NBD counter, and request
/// latency as a histogram per server, export and command.
fn encode_exports(e: &mut DescriptorEncoder<'_>, servers: &[Server]) -> Result<(), FmtError> {
    use volring_nbd::stats::Kind;
    type Pick = fn(&ExportSnapshot) -> u64;
    let counters: [(&str, &str, Pick); 14] = [
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
            "volring_nbd_offloaded_writes",
            "WRITEs the ring thread would have done blocking, handed to io_uring's workers while it was starved of CPU",
            |s| s.offloaded_writes,
        ),
        (
            "volring_nbd_copied_write_bytes",
            "WRITE payload bytes copied out of the receive buffers instead of received into the write's own or written from where they landed",
            |s| s.copied_write_bytes,
        ),
    ];
    // The export server exports every nbd volume of the node's pool from
    // the start: only those another node has connected to are shown, or a
    // node with thousands of volumes would carry some twenty series of zeroes
    // for each.
    let shown = |s: &Server, x: &ExportSnapshot| s.name != EXPORT || x.connections_total > 0;
    let exports = || servers.iter().flat_map(move |s| s.exports.iter().filter(move |x| shown(s, x)).map(move |x| (s.labels(x), x)));
    for (name, help, pick) in counters {
        let mut fam = e.encode_descriptor(name, help, None, MetricType::Counter)?;
        for (labels, x) in exports() {
            ConstCounter::new(pick(x)).encode(fam.encode_family(&labels)?)?;
        }
    }
    let mut fam = e.encode_descriptor("volring_nbd_connections", "Connections open now", None, MetricType::Gauge)?;
    for (labels, x) in exports() {
        ConstGauge::new(x.connections as f64).encode(fam.encode_family(&labels)?)?;
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
    for (labels, x) in exports() {
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
            let mut with_op = labels.clone();
            with_op.insert(1, ("op", op));
            let mut m = fam.encode_family(&with_op)?;
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

/// One series per server and ring thread (label `ring`: its number, the
/// thread is `nbd-ring-<ring>`): what only the ring knows about how it is
/// served by the CPU, which no export's counter shows. The rings publish
/// these once per tick, so a scrape may trail them by up to a tick (250 ms).
fn encode_rings(e: &mut DescriptorEncoder<'_>, servers: &[Server]) -> Result<(), FmtError> {
    let rings: Vec<(String, &'static str, &RingSnapshot)> =
        servers.iter().flat_map(|s| s.rings.iter().map(move |r| (r.ring.to_string(), s.name, r))).collect();
    let mut fam = e.encode_descriptor(
        "volring_nbd_ring_idle_polls",
        "Polls of a quiet NBD ring before it sleeps, by whether work came within the window",
        None,
        MetricType::Counter,
    )?;
    for (ring, server, r) in &rings {
        for (result, n) in [("found", r.idle_polls_found), ("missed", r.idle_polls_missed)] {
            ConstCounter::new(n).encode(fam.encode_family(&[("ring", ring.as_str()), ("result", result), ("server", server)])?)?;
        }
    }
    let mut fam = e.encode_descriptor(
        "volring_nbd_ring_starved_windows",
        "20 ms windows in which an NBD ring waited for its CPU (runnable, not running) enough to count as starved",
        None,
        MetricType::Counter,
    )?;
    for (ring, server, r) in &rings {
        ConstCounter::new(r.starved_windows).encode(fam.encode_family(&[("ring", ring.as_str()), ("server", server)])?)?;
    }
    let mut fam = e.encode_descriptor(
        "volring_nbd_ring_enters",
        "Calls of io_uring_enter by an NBD ring thread (submits and waits); per request served, its kernel entries",
        None,
        MetricType::Counter,
    )?;
    for (ring, server, r) in &rings {
        ConstCounter::new(r.enters).encode(fam.encode_family(&[("ring", ring.as_str()), ("server", server)])?)?;
    }
    type Pick = fn(&RingSnapshot) -> i64;
    let gauges: [(&str, &str, Pick); 4] = [
        ("volring_nbd_ring_offloading_reads", "1 while an NBD ring hands its page-cache reads to io_uring's workers", |r| {
            i64::from(r.offloading_reads)
        }),
        ("volring_nbd_ring_nice", "The scheduler nice value of an NBD ring thread", |r| i64::from(r.nice)),
        ("volring_nbd_ring_recv_buffers_held", "Provided receive buffers an NBD ring holds, lent ones included (0 when quiet)", |r| {
            i64::from(r.recv_buffers_held)
        }),
        ("volring_nbd_ring_recv_buffers_lent", "Provided receive buffers NBD writes in flight are made from", |r| {
            i64::from(r.recv_buffers_lent)
        }),
    ];
    for (name, help, pick) in gauges {
        let mut fam = e.encode_descriptor(name, help, None, MetricType::Gauge)?;
        for (ring, server, r) in &rings {
            ConstGauge::new(pick(r)).encode(fam.encode_family(&[("ring", ring.as_str()), ("server", server)])?)?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use prometheus_client::collector::Collector;
    use prometheus_client::registry::Registry;

    /// The name `Driver::nbd_servers` gives the attach server.
    const ATTACH: &str = "attach";

    /// Just the NBD part of the exposition.
    struct Nbd(Vec<Server>);

    impl std::fmt::Debug for Nbd {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("Nbd")
        }
    }

    impl Collector for Nbd {
        fn encode(&self, mut e: DescriptorEncoder<'_>) -> Result<(), FmtError> {
            encode_servers(&mut e, &self.0)
        }
    }

    #[test]
    fn nbd_latency_is_a_histogram_per_command() {
        let dir = tempfile::tempdir().unwrap();
        let mut snaps = export_snapshots(&catalog(dir.path(), &["a"]));
        // Two READs, of 80 us and 3 ms (the buckets nbd's stats put them
        // in are its own unit test's).
        let read = &mut snaps[0].latency[volring_nbd::stats::Kind::Read as usize];
        (read.buckets[2].1, read.buckets[7].1, read.sum_us) = (1, 1, 3_080);
        let mut registry = Registry::default();
        registry.register_collector(Box::new(Nbd(vec![Server { name: LISTEN, exports: snaps, rings: Vec::new() }])));
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, &registry).unwrap();
        assert!(out.contains("# TYPE volring_nbd_request_duration_seconds histogram"), "{out}");
        for line in [
            r#"volring_nbd_request_duration_seconds_bucket{le="0.00005",export="a",op="read",server="listen"} 0"#,
            r#"volring_nbd_request_duration_seconds_bucket{le="0.0001",export="a",op="read",server="listen"} 1"#,
            r#"volring_nbd_request_duration_seconds_bucket{le="0.005",export="a",op="read",server="listen"} 2"#,
            r#"volring_nbd_request_duration_seconds_bucket{le="+Inf",export="a",op="read",server="listen"} 2"#,
            r#"volring_nbd_request_duration_seconds_count{export="a",op="read",server="listen"} 2"#,
            r#"volring_nbd_request_duration_seconds_count{export="a",op="write",server="listen"} 0"#,
        ] {
            assert!(out.contains(line), "{line} in\n{out}");
        }
        assert!(!out.contains("latency_p50"), "no since-start quantile gauges");
    }

    fn text(servers: Vec<Server>) -> String {
        let mut registry = Registry::default();
        registry.register_collector(Box::new(Nbd(servers)));
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, &registry).unwrap();
        out
    }

    /// Each ring's counters are a series per ring; with no server running
    /// the families are declared and empty.
    #[test]
    fn nbd_rings_have_a_series_each() {
        let out = text(vec![Server { name: LISTEN, exports: Vec::new(), rings: vec![ring(0, 41, 3, 0, false), ring(1, 0, 0, 7, true)] }]);
        for line in [
            "# TYPE volring_nbd_ring_idle_polls counter",
            r#"volring_nbd_ring_idle_polls_total{ring="0",result="found",server="listen"} 41"#,
            r#"volring_nbd_ring_idle_polls_total{ring="0",result="missed",server="listen"} 3"#,
            r#"volring_nbd_ring_idle_polls_total{ring="1",result="found",server="listen"} 0"#,
            r#"volring_nbd_ring_starved_windows_total{ring="0",server="listen"} 0"#,
            r#"volring_nbd_ring_starved_windows_total{ring="1",server="listen"} 7"#,
            r#"volring_nbd_ring_enters_total{ring="0",server="listen"} 100"#,
            r#"volring_nbd_ring_enters_total{ring="1",server="listen"} 101"#,
            "# TYPE volring_nbd_ring_offloading_reads gauge",
            r#"volring_nbd_ring_offloading_reads{ring="0",server="listen"} 0"#,
            r#"volring_nbd_ring_offloading_reads{ring="1",server="listen"} 1"#,
            r#"volring_nbd_ring_nice{ring="0",server="listen"} 0"#,
            r#"volring_nbd_ring_nice{ring="1",server="listen"} 0"#,
            "# TYPE volring_nbd_ring_recv_buffers_held gauge",
            r#"volring_nbd_ring_recv_buffers_held{ring="1",server="listen"} 1"#,
            r#"volring_nbd_ring_recv_buffers_lent{ring="1",server="listen"} 1"#,
            r#"volring_nbd_ring_recv_buffers_lent{ring="0",server="listen"} 0"#,
        ] {
            assert!(out.lines().any(|l| l == line), "{line} in\n{out}");
        }
        let idle = text(vec![Server::read(LISTEN, &volring_nbd::Exports::default())]);
        assert!(idle.contains("# TYPE volring_nbd_ring_starved_windows counter"), "{idle}");
        assert!(!idle.contains("ring=\""), "no server, no ring series:\n{idle}");
    }

    /// A catalog exporting `names`, each on the one 4 KiB image in `dir`.
    fn catalog(dir: &std::path::Path, names: &[&str]) -> volring_nbd::Exports {
        let image = dir.join("img");
        std::fs::write(&image, [0u8; 4096]).unwrap();
        let exports = volring_nbd::Exports::default();
        for name in names {
            exports.add(&format!("{name}={}", image.display()).parse().unwrap(), None).unwrap();
        }
        exports
    }

    fn ring(ring: usize, found: u64, missed: u64, starved: u64, offloading: bool) -> RingSnapshot {
        RingSnapshot {
            ring,
            idle_polls_found: found,
            idle_polls_missed: missed,
            starved_windows: starved,
            offloading_reads: offloading,
            nice: 0,
            recv_buffers_held: ring as u32,
            recv_buffers_lent: ring as u32,
            enters: 100 + ring as u64,
        }
    }

    /// The attach server (the node's nbd volumes) and the `--nbd-listen`
    /// server share the families, told apart by `server`; the attach
    /// server's export series carry the volume id as `volume` too. Each
    /// server's ring 0 is its own series. (Before, the attach server had no
    /// series at all: only the listener's catalog reached the encoder.)
    #[test]
    fn the_attach_servers_series_are_labelled_apart_from_the_listeners() {
        let dir = tempfile::tempdir().unwrap();
        let (listen, attach) = (catalog(dir.path(), &["demo"]), catalog(dir.path(), &["pvc-1"]));
        let mut volume = Server::read(ATTACH, &attach);
        (volume.exports[0].writes, volume.exports[0].write_bytes, volume.exports[0].offloaded_writes) = (3, 12_288, 2);
        volume.exports[0].latency[volring_nbd::stats::Kind::Write as usize].buckets[2].1 = 3;
        volume.rings = vec![ring(0, 0, 0, 5, false)];
        let mut listener = Server::read(LISTEN, &listen);
        listener.exports[0].reads = 7;
        listener.rings = vec![ring(0, 2, 0, 0, false)];
        let out = text(vec![listener, volume]);
        for line in [
            r#"volring_nbd_reads_total{export="demo",server="listen"} 7"#,
            r#"volring_nbd_writes_total{export="demo",server="listen"} 0"#,
            r#"volring_nbd_writes_total{export="pvc-1",server="attach",volume="pvc-1"} 3"#,
            r#"volring_nbd_written_bytes_total{export="pvc-1",server="attach",volume="pvc-1"} 12288"#,
            r#"volring_nbd_copied_write_bytes_total{export="pvc-1",server="attach",volume="pvc-1"} 0"#,
            r#"volring_nbd_offloaded_writes_total{export="pvc-1",server="attach",volume="pvc-1"} 2"#,
            r#"volring_nbd_connections{export="pvc-1",server="attach",volume="pvc-1"} 0.0"#,
            r#"volring_nbd_request_duration_seconds_count{export="pvc-1",op="write",server="attach",volume="pvc-1"} 3"#,
            r#"volring_nbd_request_duration_seconds_count{export="demo",op="write",server="listen"} 0"#,
            r#"volring_nbd_ring_idle_polls_total{ring="0",result="found",server="listen"} 2"#,
            r#"volring_nbd_ring_idle_polls_total{ring="0",result="found",server="attach"} 0"#,
            r#"volring_nbd_ring_starved_windows_total{ring="0",server="attach"} 5"#,
            r#"volring_nbd_ring_starved_windows_total{ring="0",server="listen"} 0"#,
            r#"volring_nbd_ring_nice{ring="0",server="attach"} 0"#,
        ] {
            assert!(out.lines().any(|l| l == line), "{line} in\n{out}");
        }
        // One family each, whichever servers run.
        assert_eq!(out.lines().filter(|l| *l == "# TYPE volring_nbd_writes counter").count(), 1, "{out}");
        assert_eq!(out.lines().filter(|l| *l == "# TYPE volring_nbd_ring_nice gauge").count(), 1, "{out}");
    }

    /// The export server (`--nbd-export-listen`: the node's nbd volumes
    /// served to other nodes) names its exports by volume id too, so its
    /// series carry `volume`; a volume staged here has an export in both
    /// the attach and the export server (the fence hands it to one holder
    /// at a time), and each server's series of it stay apart.
    #[test]
    fn the_export_servers_series_carry_the_volume_beside_the_attach_servers() {
        let dir = tempfile::tempdir().unwrap();
        let (attach, export) = (catalog(dir.path(), &["pvc-1"]), catalog(dir.path(), &["pvc-1", "pvc-idle"]));
        let mut local = Server::read(ATTACH, &attach);
        local.exports[0].writes = 2;
        let mut remote = Server::read(EXPORT, &export);
        let used = remote.exports.iter_mut().find(|x| x.name == "pvc-1").expect("pvc-1");
        (used.reads, used.read_bytes, used.connections_total) = (5, 20_480, 1);
        used.latency[volring_nbd::stats::Kind::Read as usize].buckets[2].1 = 5;
        remote.rings = vec![ring(0, 4, 1, 0, false)];
        let out = text(vec![local, remote]);
        for line in [
            r#"volring_nbd_reads_total{export="pvc-1",server="export",volume="pvc-1"} 5"#,
            r#"volring_nbd_read_bytes_total{export="pvc-1",server="export",volume="pvc-1"} 20480"#,
            r#"volring_nbd_writes_total{export="pvc-1",server="export",volume="pvc-1"} 0"#,
            r#"volring_nbd_writes_total{export="pvc-1",server="attach",volume="pvc-1"} 2"#,
            r#"volring_nbd_reads_total{export="pvc-1",server="attach",volume="pvc-1"} 0"#,
            r#"volring_nbd_request_duration_seconds_count{export="pvc-1",op="read",server="export",volume="pvc-1"} 5"#,
            r#"volring_nbd_ring_idle_polls_total{ring="0",result="found",server="export"} 4"#,
            r#"volring_nbd_ring_nice{ring="0",server="export"} 0"#,
        ] {
            assert!(out.lines().any(|l| l == line), "{line} in\n{out}");
        }
        assert!(!out.contains("pvc-idle"), "an export no node connected to has no series:\n{out}");
    }

    /// With neither server possible (no `--nbd-listen`, no CSI driver) the
    /// families are not declared; with only a listener they are, with its
    /// series alone.
    #[test]
    fn nbd_families_are_declared_where_a_server_may_run() {
        struct Encode(Option<volring_nbd::Exports>);
        impl std::fmt::Debug for Encode {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("Encode")
            }
        }
        impl Collector for Encode {
            fn encode(&self, mut e: DescriptorEncoder<'_>) -> Result<(), FmtError> {
                encode(&mut e, self.0.as_ref(), None)
            }
        }
        let render = |c: Encode| {
            let mut registry = Registry::default();
            registry.register_collector(Box::new(c));
            let mut out = String::new();
            prometheus_client::encoding::text::encode(&mut out, &registry).unwrap();
            out
        };
        assert!(!render(Encode(None)).contains("volring_nbd"), "no server, no family");
        let out = render(Encode(Some(volring_nbd::Exports::default())));
        assert!(out.contains("# TYPE volring_nbd_reads counter"), "{out}");
        assert!(!out.contains("server=\"attach\""), "{out}");
    }
}
