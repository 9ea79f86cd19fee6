//! `/metrics`: Prometheus (OpenMetrics) exposition of what the agent knows.
//!
//! Nothing is copied into metric objects as it changes: on each scrape the
//! encoder reads the latest [`StatSnapshot`](volring_devices::StatSnapshot)
//! and the counters the ring threads keep, so thousands of devices cost
//! nothing between scrapes.

use std::fmt::Error as FmtError;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use arc_swap::ArcSwap;
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::MetricType;
use prometheus_client::registry::Registry;

mod classic;
mod csi;
mod device_info;
pub(crate) mod logs;
mod nbd;
mod publish;
mod volume;

use classic::Format;

use volring_devices::{HotplugStats, Inventory, StatsReader};
use volring_mounts::WatcherStats;
use volring_ring::RingStats;
use volring_volumes::HealthView;
use volring_volumes::{ReconcileStats, PASS_BUCKETS_US};

/// Everything `/metrics` reads from.
#[derive(Clone)]
pub(crate) struct Sources {
    pub stats: StatsReader,
    pub inventory: Arc<ArcSwap<Inventory>>,
    pub hotplug: Arc<HotplugStats>,
    /// Ring threads by name.
    pub rings: Vec<(&'static str, Arc<RingStats>)>,
    /// The mount watcher's counters, refreshed by the agent.
    pub mounts: Arc<ArcSwap<WatcherStats>>,
    /// The `--nbd-listen` server's exports, when it runs (the CSI
    /// driver's servers', attach and export, are read from `csi`).
    pub nbd: Option<Arc<volring_nbd::Exports>>,
    /// The reconciler's counters and verdicts, when the CSI driver runs.
    pub reconcile: Option<Reconcile>,
    /// The CSI driver, when it runs: its calls, volumes and pool.
    pub csi: Option<Arc<volring_csi::Driver>>,
    /// What `/readyz` answers: set once the start pass is done, cleared
    /// when the agent begins to stop.
    pub ready: volring_csi::Readiness,
    /// The publisher's counters, when it runs.
    pub publish: Option<Arc<volring_kube::Stats>>,
    /// The shared-volume loop's controller, when it runs (its reconcile
    /// duration histogram).
    pub share: Option<Arc<volring_share::kube::ShareController>>,
    /// The staged volumes' identity records, when the CSI driver runs
    /// (the `volring_volume_*` series).
    pub volumes: Option<Arc<ArcSwap<Vec<volring_volumes::VolumeIdentity>>>>,
}

/// What `/metrics` reads of the reconciler.
#[derive(Clone)]
pub(crate) struct Reconcile {
    pub stats: Arc<ReconcileStats>,
    pub view: Arc<HealthView>,
}

impl std::fmt::Debug for Sources {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("metrics::Sources")
    }
}

fn counter(e: &mut DescriptorEncoder<'_>, name: &str, help: &str, v: u64) -> Result<(), FmtError> {
    ConstCounter::new(v).encode(e.encode_descriptor(name, help, None, MetricType::Counter)?)
}

fn gauge(e: &mut DescriptorEncoder<'_>, name: &str, help: &str, v: f64) -> Result<(), FmtError> {
    ConstGauge::new(v).encode(e.encode_descriptor(name, help, None, MetricType::Gauge)?)
}

/// A gauge that counts things (printed as an integer).
fn how_many(e: &mut DescriptorEncoder<'_>, name: &str, help: &str, n: usize) -> Result<(), FmtError> {
    ConstGauge::new(i64::try_from(n).unwrap_or(i64::MAX)).encode(e.encode_descriptor(name, help, None, MetricType::Gauge)?)
}

/// One family, one series per device.
fn per_device<T: Copy>(
    e: &mut DescriptorEncoder<'_>,
    name: &str,
    help: &str,
    kind: MetricType,
    rows: &[(&str, T)],
    encode: impl Fn(T, prometheus_client::encoding::MetricEncoder<'_>) -> Result<(), FmtError>,
) -> Result<(), FmtError> {
    let mut fam = e.encode_descriptor(name, help, None, kind)?;
    for &(device, v) in rows {
        let labels = [("device", device)];
        encode(v, fam.encode_family(&labels)?)?;
    }
    Ok(())
}

impl Collector for Sources {
    fn encode(&self, mut e: DescriptorEncoder<'_>) -> Result<(), FmtError> {
        let snap = self.stats.latest();
        let inv = self.inventory.load();
        gauge(&mut e, "volring_devices", "Block devices in the inventory", inv.devices.len() as f64)?;
        gauge(
            &mut e,
            "volring_devices_in_use",
            "Devices mounted, held or serving a volume",
            inv.devices.values().filter(|d| d.in_use()).count() as f64,
        )?;
        gauge(&mut e, "volring_stat_collection_seconds", "Cost of the latest counter collection", snap.cost.as_secs_f64())?;
        counter(&mut e, "volring_stat_samples", "Counter collections so far", snap.generation)?;
        // When the counters below were read: a reader that turns two scrapes
        // into rates divides by this, not by its own clock (the counters
        // move once per --stats-interval, not per scrape).
        gauge(&mut e, "volring_stat_sample_timestamp_seconds", "When the latest counter collection was taken (Unix time)", snap.unix_time)?;
        let mut fam = e.encode_descriptor("volring_stat_method", "Collection method in use (1)", None, MetricType::Gauge)?;
        ConstGauge::new(1i64).encode(fam.encode_family(&[("method", snap.method)])?)?;

        encode_device_counters(&mut e, &snap)?;

        device_info::encode(&mut e, &inv)?;
        if let Some(v) = &self.volumes {
            volume::encode(&mut e, &v.load(), &snap, &inv)?;
        }

        let rates: Vec<(&str, volring_devices::IoRates)> = snap.devices.iter().filter_map(|d| Some((&*d.name, d.rates?))).collect();
        type RateFn = fn(&volring_devices::IoRates) -> f64;
        let rate_families: [(&str, &str, RateFn); 7] = [
            ("volring_device_read_iops", "Reads per second over the last interval", |r| r.reads_per_sec),
            ("volring_device_write_iops", "Writes per second over the last interval", |r| r.writes_per_sec),
            ("volring_device_read_bytes_per_second", "Read throughput over the last interval", |r| r.read_kib_per_sec * 1024.0),
            ("volring_device_write_bytes_per_second", "Write throughput over the last interval", |r| r.write_kib_per_sec * 1024.0),
            ("volring_device_read_await_seconds", "Mean read latency over the last interval", |r| r.read_await_ms / 1000.0),
            ("volring_device_write_await_seconds", "Mean write latency over the last interval", |r| r.write_await_ms / 1000.0),
            ("volring_device_utilization_ratio", "Share of the last interval with I/O in flight", |r| r.util_pct / 100.0),
        ];
        for (name, help, f) in rate_families {
            let rows: Vec<(&str, f64)> = rates.iter().map(|(n, r)| (*n, f(r))).collect();
            per_device(&mut e, name, help, MetricType::Gauge, &rows, |v, m| ConstGauge::new(v).encode(m))?;
        }

        self.encode_watchers(&mut e)?;
        nbd::encode(&mut e, self.nbd.as_deref(), self.csi.as_deref())?;
        if let Some(r) = &self.reconcile {
            encode_reconcile(&mut e, r)?;
        }
        if let Some(d) = &self.csi {
            csi::encode(&mut e, d)?;
        }
        if let Some(p) = &self.publish {
            publish::encode(&mut e, p)?;
        }
        Ok(())
    }
}

impl Sources {
    /// The hotplug listener's, mount watcher's and ring threads' own
    /// counters.
    fn encode_watchers(&self, e: &mut DescriptorEncoder<'_>) -> Result<(), FmtError> {
        for (help, name, v) in [
            ("Kernel uevents received", "volring_hotplug_uevents", &self.hotplug.uevents),
            ("Uevents refused as malformed", "volring_hotplug_refused", &self.hotplug.refused),
            ("Device events delivered", "volring_hotplug_events", &self.hotplug.emitted),
            ("Device events dropped on a full queue (a rescan follows)", "volring_hotplug_dropped", &self.hotplug.dropped),
        ] {
            counter(e, name, help, v.load(Ordering::Relaxed))?;
        }
        let m = self.mounts.load();
        counter(e, "volring_mount_events", "Mount events delivered", m.mount_events)?;
        {
            // By cause: only `overflow` means events were lost (the alert's
            // series); `periodic` ticks on an idle node too.
            let mut fam = e.encode_descriptor("volring_mount_resyncs", "Full mount-table resyncs, by reason", None, MetricType::Counter)?;
            for (reason, n) in m.resyncs_by.by_reason() {
                ConstCounter::new(n).encode(fam.encode_family(&[("reason", reason)])?)?;
            }
        }
        counter(e, "volring_log_lines_lost", "Log lines dropped because stderr refused them (its reader gone)", logs::lines_lost())?;

        for (family, help, pick) in [
            ("volring_ring_cpu_seconds", "CPU time of each ring thread", 0),
            ("volring_ring_completions", "Completions reaped by each ring thread", 1),
            ("volring_ring_wakeups", "Command wakeups of each ring thread", 2),
        ] {
            let mut fam = e.encode_descriptor(family, help, None, MetricType::Counter)?;
            for (ring, s) in &self.rings {
                let labels = [("ring", *ring)];
                let m = fam.encode_family(&labels)?;
                match pick {
                    0 => ConstCounter::new(s.cpu_ns.load(Ordering::Relaxed) as f64 / 1e9).encode(m)?,
                    1 => ConstCounter::new(s.completions.load(Ordering::Relaxed)).encode(m)?,
                    _ => ConstCounter::new(s.wakeups.load(Ordering::Relaxed)).encode(m)?,
                }
            }
        }
        Ok(())
    }
}

/// Each device's /proc/diskstats counters from the latest collection, as
/// node_exporter names them.
fn encode_device_counters(e: &mut DescriptorEncoder<'_>, snap: &volring_devices::StatSnapshot) -> Result<(), FmtError> {
    let c: Vec<(&str, &volring_devices::IoCounters)> = snap.devices.iter().map(|d| (&*d.name, &d.counters)).collect();
    let total = |name: &str, help: &str, f: &dyn Fn(&volring_devices::IoCounters) -> u64, e: &mut DescriptorEncoder<'_>| {
        let rows: Vec<(&str, u64)> = c.iter().map(|(n, c)| (*n, f(c))).collect();
        per_device(e, name, help, MetricType::Counter, &rows, |v, m| ConstCounter::new(v).encode(m))
    };
    let seconds = |name: &str, help: &str, f: &dyn Fn(&volring_devices::IoCounters) -> u64, e: &mut DescriptorEncoder<'_>| {
        let rows: Vec<(&str, f64)> = c.iter().map(|(n, c)| (*n, f(c) as f64 / 1000.0)).collect();
        per_device(e, name, help, MetricType::Counter, &rows, |v, m| ConstCounter::new(v).encode(m))
    };
    total("volring_device_reads_completed", "Reads completed", &|c| c.reads, e)?;
    total("volring_device_writes_completed", "Writes completed", &|c| c.writes, e)?;
    total("volring_device_read_bytes", "Bytes read", &|c| c.read_sectors * 512, e)?;
    total("volring_device_written_bytes", "Bytes written", &|c| c.write_sectors * 512, e)?;
    total("volring_device_discards_completed", "Discards completed", &|c| c.discards, e)?;
    total("volring_device_flushes_completed", "Flushes completed", &|c| c.flushes, e)?;
    seconds("volring_device_read_time_seconds", "Time spent reading", &|c| c.read_ticks, e)?;
    seconds("volring_device_write_time_seconds", "Time spent writing", &|c| c.write_ticks, e)?;
    seconds("volring_device_io_time_seconds", "Time with I/O in flight", &|c| c.io_ticks, e)?;
    // The rest of /proc/diskstats, as node_exporter names them: merges,
    // discards' bytes and time, flush time, and the weighted I/O time
    // whose rate is the average queue size (iostat's aqu-sz).
    total("volring_device_reads_merged", "Adjacent reads merged", &|c| c.reads_merged, e)?;
    total("volring_device_writes_merged", "Adjacent writes merged", &|c| c.writes_merged, e)?;
    total("volring_device_discards_merged", "Adjacent discards merged", &|c| c.discards_merged, e)?;
    total("volring_device_discarded_bytes", "Bytes discarded", &|c| c.discard_sectors * 512, e)?;
    seconds("volring_device_discard_time_seconds", "Time spent discarding", &|c| c.discard_ticks, e)?;
    seconds("volring_device_flush_time_seconds", "Time spent flushing", &|c| c.flush_ticks, e)?;
    seconds(
        "volring_device_io_time_weighted_seconds",
        "I/O time weighted by I/Os in flight (its rate is the average queue size)",
        &|c| c.time_in_queue,
        e,
    )?;
    let in_flight: Vec<(&str, f64)> = c.iter().map(|(n, c)| (*n, c.in_flight as f64)).collect();
    per_device(e, "volring_device_io_in_flight", "I/Os in flight now", MetricType::Gauge, &in_flight, |v, m| ConstGauge::new(v).encode(m))?;
    Ok(())
}

/// The kinds of drift, in the order they are exported; every kind gets a
/// series (0 included), so an alert can be written before anything drifts.
const DRIFT_KINDS: [&str; 6] = ["device_detached", "staging_missing", "staging_foreign", "target_missing", "target_foreign", "interrupted"];

/// The reconciler: passes, repairs, a pass-duration histogram, how many
/// volumes drift by kind, and one series per drifting volume (healthy
/// volumes have none, so thousands of them cost nothing here).
fn encode_reconcile(e: &mut DescriptorEncoder<'_>, r: &Reconcile) -> Result<(), FmtError> {
    let s = &r.stats;
    counter(e, "volring_reconcile_passes", "Reconciler passes (events, resyncs and the start)", s.passes.load(Ordering::Relaxed))?;
    counter(
        e,
        "volring_reconcile_volumes_assessed",
        "Volumes compared with their record, all passes",
        s.volumes_assessed.load(Ordering::Relaxed),
    )?;
    let mut fam = e.encode_descriptor("volring_reconcile_repairs", "Repairs attempted, by result", None, MetricType::Counter)?;
    for (result, v) in [("done", &s.repairs_done), ("failed", &s.repairs_failed)] {
        ConstCounter::new(v.load(Ordering::Relaxed)).encode(fam.encode_family(&[("result", result)])?)?;
    }
    let orphans = s.orphans.lock().unwrap_or_else(|p| p.into_inner()).len();
    how_many(e, "volring_reconcile_orphans", "Loop devices serving pool images that no record explains", orphans)?;
    // The encoder takes each bucket's own count and accumulates them.
    let buckets: Vec<(f64, u64)> = PASS_BUCKETS_US
        .iter()
        .map(|&b| b as f64 / 1e6)
        .chain([f64::MAX])
        .zip(&s.pass_buckets)
        .map(|(bound, n)| (bound, n.load(Ordering::Relaxed)))
        .collect();
    let count = buckets.iter().map(|(_, n)| n).sum();
    let mut fam =
        e.encode_descriptor("volring_reconcile_pass_duration_seconds", "Time one reconciler pass took", None, MetricType::Histogram)?;
    fam.encode_histogram::<prometheus_client::encoding::NoLabelSet>(
        s.pass_sum_us.load(Ordering::Relaxed) as f64 / 1e6,
        count,
        &buckets,
        None,
    )?;

    let verdicts = r.view.all();
    let mut by_kind = [0i64; DRIFT_KINDS.len()];
    let mut drifting: Vec<(&str, &'static str)> = Vec::new();
    for (id, h) in &verdicts {
        for d in &h.drift {
            if let Some(i) = DRIFT_KINDS.iter().position(|k| *k == d.kind()) {
                by_kind[i] += 1;
            }
            drifting.push((id, d.kind()));
        }
    }
    how_many(e, "volring_volumes", "Volumes this node holds (staged records)", verdicts.len())?;
    let mut fam =
        e.encode_descriptor("volring_volumes_drifting", "Drifts between desired and actual state, by kind", None, MetricType::Gauge)?;
    for (kind, n) in DRIFT_KINDS.iter().zip(by_kind) {
        ConstGauge::new(n).encode(fam.encode_family(&[("kind", *kind)])?)?;
    }
    drifting.sort_unstable();
    drifting.dedup();
    let mut fam =
        e.encode_descriptor("volring_volume_drift", "1 for each way a volume differs from its record", None, MetricType::Gauge)?;
    for (volume, kind) in drifting {
        ConstGauge::new(1i64).encode(fam.encode_family(&[("volume", volume), ("kind", kind)])?)?;
    }
    let failing = verdicts.iter().filter(|(_, h)| h.repair_error.is_some()).count();
    how_many(e, "volring_volumes_repair_failing", "Volumes whose last repair attempt failed", failing)
}

/// Renders the exposition text.
pub(crate) fn render(sources: &Sources) -> Result<String, FmtError> {
    let mut registry = Registry::default();
    registry.register_collector(Box::new(sources.clone()));
    if let Some(s) = &sources.share {
        s.register(&mut registry);
    }
    let mut out = String::new();
    prometheus_client::encoding::text::encode(&mut out, &registry)?;
    Ok(out)
}

/// Renders the exposition in the format the scraper asked for.
pub(crate) fn render_as(sources: &Sources, format: Format) -> Result<String, FmtError> {
    let text = render(sources)?;
    Ok(match format {
        Format::OpenMetrics => text,
        Format::Classic => classic::from_openmetrics(&text),
    })
}

/// Serves `/metrics`, `/healthz` and `/readyz` on `listener` until the
/// future is dropped. The caller binds it, so that a bad or taken address
/// fails the agent at start rather than in a task that runs later.
///
/// `/healthz` answers from the agent's runtime, so a wedged runtime fails
/// kubelet's liveness probe; the CSI socket's own liveness is the
/// livenessprobe sidecar's (it calls Probe). `/readyz` is 503 until the
/// start pass is done and again once the agent is stopping.
pub(crate) async fn serve(listener: tokio::net::TcpListener, sources: Sources) -> std::io::Result<()> {
    use axum::http::{header, StatusCode};
    use axum::routing::get;
    let addr = listener.local_addr()?;
    tracing::info!(%addr, "serving /metrics");
    let ready = sources.ready.clone();
    let app = axum::Router::new()
        .route(
            "/metrics",
            get(move |headers: axum::http::HeaderMap| {
                let sources = sources.clone();
                async move {
                    let format = Format::negotiate(headers.get(header::ACCEPT).and_then(|v| v.to_str().ok()));
                    // Off the runtime: a scrape reads statvfs(2) of every
                    // staged volume's mount (`volume.rs`).
                    match tokio::task::spawn_blocking(move || render_as(&sources, format)).await {
                        Ok(Ok(body)) => (StatusCode::OK, [(header::CONTENT_TYPE, format.content_type())], body),
                        Ok(Err(_)) | Err(_) => {
                            (StatusCode::INTERNAL_SERVER_ERROR, [(header::CONTENT_TYPE, "text/plain")], "encoding failed".to_string())
                        }
                    }
                }
            }),
        )
        .route("/healthz", get(|| async { "ok\n" }))
        .route(
            "/readyz",
            get(move || {
                let ready = ready.get();
                async move {
                    match ready {
                        true => (StatusCode::OK, "ready\n"),
                        false => (StatusCode::SERVICE_UNAVAILABLE, "not ready\n"),
                    }
                }
            }),
        );
    axum::serve(listener, app).await
}

#[cfg(test)]
mod tests {
    use super::*;

    use volring_volumes::{Drift, VolumeHealth};

    struct Only(Reconcile);

    impl std::fmt::Debug for Only {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("Only")
        }
    }

    impl Collector for Only {
        fn encode(&self, mut e: DescriptorEncoder<'_>) -> Result<(), FmtError> {
            encode_reconcile(&mut e, &self.0)
        }
    }

    fn text(r: &Reconcile) -> String {
        let mut registry = Registry::default();
        registry.register_collector(Box::new(Only(r.clone())));
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, &registry).unwrap();
        out
    }

    #[test]
    fn reconciler_drift_and_passes_are_exported() {
        let r = Reconcile { stats: Arc::default(), view: Arc::default() };
        r.stats.passes.store(3, Ordering::Relaxed);
        r.stats.repairs_done.store(2, Ordering::Relaxed);
        r.stats.repairs_failed.store(1, Ordering::Relaxed);
        r.stats.pass_buckets[0].store(2, Ordering::Relaxed); // <= 100 us
        r.stats.pass_buckets[4].store(1, Ordering::Relaxed); // <= 1 s
        r.stats.pass_sum_us.store(500_150, Ordering::Relaxed);
        let sick = VolumeHealth {
            drift: vec![Drift::StagingMissing, Drift::DeviceDetached],
            repair_error: Some("busy".into()),
            ..Default::default()
        };
        let target = VolumeHealth { drift: vec![Drift::TargetMissing { path: "/t".into() }], ..Default::default() };
        r.view.set_many(vec![("pvc-a".into(), sick), ("pvc-b".into(), target), ("pvc-ok".into(), VolumeHealth::default())]);
        let t = text(&r);
        for line in [
            "volring_reconcile_passes_total 3",
            "volring_reconcile_repairs_total{result=\"done\"} 2",
            "volring_reconcile_repairs_total{result=\"failed\"} 1",
            "volring_reconcile_pass_duration_seconds_bucket{le=\"0.0001\"} 2",
            "volring_reconcile_pass_duration_seconds_bucket{le=\"0.1\"} 2",
            "volring_reconcile_pass_duration_seconds_bucket{le=\"1.0\"} 3",
            "volring_reconcile_pass_duration_seconds_count 3",
            "volring_volumes 3",
            "volring_volumes_drifting{kind=\"staging_missing\"} 1",
            "volring_volumes_drifting{kind=\"target_missing\"} 1",
            "volring_volumes_drifting{kind=\"staging_foreign\"} 0",
            "volring_volume_drift{volume=\"pvc-a\",kind=\"device_detached\"} 1",
            "volring_volume_drift{volume=\"pvc-b\",kind=\"target_missing\"} 1",
            "volring_volumes_repair_failing 1",
        ] {
            assert!(t.lines().any(|l| l == line), "missing {line:?} in:\n{t}");
        }
        assert!(!t.contains("pvc-ok"), "a healthy volume has no series:\n{t}");
    }
}
