//! What `volring top`, `volring df` and `volring stats --by volume` read:
//! the node's staged volumes with their devices, and each one's I/O
//! counters, from a running agent's `/metrics` (the `volring_volume_*`
//! series, with the PVC and pod names the agent learned from the cluster)
//! or, with no agent, from the kernel directly (the store's staged records,
//! read-only as `volring status` reads them, and `/sys/block/DEV/stat`).

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::time::Duration;

use volring_devices::IoCounters;

/// Where the agent serves `/metrics` unless told otherwise (its own
/// `--metrics-addr` default).
pub(crate) const DEFAULT_METRICS_ADDR: &str = "127.0.0.1:9477";
/// The most of a scrape read: a node with thousands of volumes scrapes to
/// a few MiB.
const SCRAPE_LIMIT: u64 = 64 << 20;

/// Where to read from, and what.
#[derive(Debug, Clone, clap::Args)]
pub(crate) struct SourceArgs {
    /// The agent's state directory (the staged volumes, with no agent).
    #[arg(long, default_value = "/var/lib/volring")]
    pub(crate) state_dir: PathBuf,
    /// kubelet's root directory (pod UIDs are read from the publish paths).
    #[arg(long, default_value = "/var/lib/kubelet")]
    pub(crate) kubelet_root: PathBuf,
    /// The running agent's metrics address.
    #[arg(long, env = "VOLRING_METRICS_ADDR", default_value = DEFAULT_METRICS_ADDR)]
    pub(crate) metrics_addr: String,
    /// `agent`: the agent's /metrics; `kernel`: the store and sysfs;
    /// `auto`: the agent when it answers and exports the per-volume
    /// series (an idle agent too), else the kernel.
    #[arg(long, value_enum, default_value = "auto")]
    pub(crate) source: SourceChoice,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub(crate) enum SourceChoice {
    Auto,
    Agent,
    Kernel,
}

/// One staged volume, as far as it is known.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize)]
pub(crate) struct Volume {
    pub(crate) volume: String,
    /// The kernel's name of its device (`loop7`, `nbd0`).
    pub(crate) device: String,
    /// Where its filesystem is mounted by volring (none for block access).
    pub(crate) mount: Option<PathBuf>,
    /// `block` or the filesystem type.
    pub(crate) access: String,
    pub(crate) persistentvolumeclaim: String,
    pub(crate) namespace: String,
    pub(crate) pod: String,
    /// The UIDs of the pods it is published to (from kubelet's paths).
    pub(crate) pod_uids: Vec<String>,
}

/// Cumulative I/O counters of one volume or device, in the contract's
/// units (bytes, seconds).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub(crate) struct Counters {
    pub(crate) reads: f64,
    pub(crate) writes: f64,
    pub(crate) read_bytes: f64,
    pub(crate) written_bytes: f64,
    pub(crate) read_time: f64,
    pub(crate) write_time: f64,
    pub(crate) io_time: f64,
    pub(crate) in_flight: f64,
}

impl From<&IoCounters> for Counters {
    fn from(c: &IoCounters) -> Self {
        Self {
            reads: c.reads as f64,
            writes: c.writes as f64,
            read_bytes: c.read_sectors as f64 * 512.0,
            written_bytes: c.write_sectors as f64 * 512.0,
            read_time: c.read_ticks as f64 / 1000.0,
            write_time: c.write_ticks as f64 / 1000.0,
            io_time: c.io_ticks as f64 / 1000.0,
            in_flight: c.in_flight as f64,
        }
    }
}

/// Rates between two samples of [`Counters`].
#[derive(Debug, Clone, Copy, Default, PartialEq, serde::Serialize)]
pub(crate) struct Rates {
    pub(crate) reads_per_second: f64,
    pub(crate) writes_per_second: f64,
    pub(crate) read_bytes_per_second: f64,
    pub(crate) write_bytes_per_second: f64,
    /// Mean time an I/O waited and was served, milliseconds.
    pub(crate) await_ms: f64,
    /// Share of the interval with I/O in flight, 0–100.
    pub(crate) util_pct: f64,
    pub(crate) in_flight: f64,
}

impl Rates {
    /// A counter that went backwards (a device re-attached) counts as 0.
    pub(crate) fn between(a: &Counters, b: &Counters, secs: f64) -> Self {
        let d = |x: f64, y: f64| (y - x).max(0.0);
        let secs = secs.max(1e-6);
        let ios = d(a.reads, b.reads) + d(a.writes, b.writes);
        let busy = d(a.read_time, b.read_time) + d(a.write_time, b.write_time);
        Self {
            reads_per_second: d(a.reads, b.reads) / secs,
            writes_per_second: d(a.writes, b.writes) / secs,
            read_bytes_per_second: d(a.read_bytes, b.read_bytes) / secs,
            write_bytes_per_second: d(a.written_bytes, b.written_bytes) / secs,
            await_ms: if ios > 0.0 { busy / ios * 1000.0 } else { 0.0 },
            util_pct: (d(a.io_time, b.io_time) / secs * 100.0).min(100.0),
            in_flight: b.in_flight,
        }
    }

    pub(crate) fn iops(&self) -> f64 {
        self.reads_per_second + self.writes_per_second
    }

    pub(crate) fn throughput(&self) -> f64 {
        self.read_bytes_per_second + self.write_bytes_per_second
    }
}

/// The staged volumes the node's store holds, read-only as `volring
/// status` reads them.
pub(crate) fn staged(state_dir: &Path, kubelet_root: &Path) -> anyhow::Result<Vec<Volume>> {
    anyhow::ensure!(state_dir.is_dir(), "state directory {} does not exist", state_dir.display());
    let dirs = super::status::NodeDirs { state_dir: state_dir.to_path_buf(), pool_dir: None, kubelet_root: kubelet_root.to_path_buf() };
    let r = super::status::read_report(&dirs)?;
    Ok(r.staged
        .into_iter()
        .map(|s| Volume {
            device: s.device.as_deref().and_then(Path::file_name).map(|n| n.to_string_lossy().into_owned()).unwrap_or_default(),
            mount: (s.access != "block").then(|| s.staging_path.clone()),
            pod_uids: s.targets.keys().filter_map(|t| pod_uid(t, kubelet_root)).collect(),
            access: s.access,
            volume: s.volume_id,
            ..Volume::default()
        })
        .collect())
}

/// The pod UID in a kubelet publish path under `kubelet_root`, read as the
/// agent reads it (so both sources agree): `ROOT/pods/UID/volumes/...` for
/// a filesystem volume, `ROOT/plugins/kubernetes.io/csi/volumeDevices/
/// publish/PV/UID` for a block one.
fn pod_uid(target: &Path, kubelet_root: &Path) -> Option<String> {
    target.strip_prefix(kubelet_root).ok()?;
    volring_volumes::pod_of_target(target).map(|(uid, _)| uid)
}

/// A device's counters from `/sys/block/NAME/stat`.
pub(crate) fn sysfs_counters(device: &str) -> Option<Counters> {
    if device.is_empty() || device.contains('/') {
        return None;
    }
    let line = std::fs::read(format!("/sys/block/{device}/stat")).ok()?;
    IoCounters::parse(&line).ok().map(|c| Counters::from(&c))
}

/// Every whole device and partition in `/proc/diskstats`, by name.
pub(crate) fn diskstats() -> BTreeMap<String, Counters> {
    let text = std::fs::read("/proc/diskstats").unwrap_or_default();
    volring_devices::parse_diskstats(&text)
        .filter_map(|(_, l)| l.ok())
        .map(|l| (String::from_utf8_lossy(l.name).into_owned(), Counters::from(&l.counters)))
        .collect()
}

/// One scrape of the agent: each volume with its labels and counters.
#[derive(Debug, Default)]
pub(crate) struct Scrape {
    /// The agent exports the per-volume families (their `# TYPE` lines
    /// come even with no volume staged): an idle agent is a source with
    /// no rows, not a missing one.
    pub(crate) exported: bool,
    pub(crate) volumes: BTreeMap<String, (Volume, Counters)>,
    /// Per volume: capacity, used, available bytes; inodes, used, free.
    pub(crate) space: BTreeMap<String, [f64; 6]>,
    /// When the agent's collector read the counters (Unix seconds), if the
    /// agent says: the clock to compute rates against.
    pub(crate) sampled_at: Option<f64>,
}

/// Reads `http://addr/metrics`; `None` when nothing answers there.
pub(crate) fn fetch_metrics(addr: &str) -> Option<String> {
    let sock: std::net::SocketAddr = addr.parse().ok()?;
    let mut c = std::net::TcpStream::connect_timeout(&sock, Duration::from_millis(500)).ok()?;
    c.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    c.write_all(format!("GET /metrics HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n").as_bytes()).ok()?;
    let mut reply = Vec::new();
    c.take(SCRAPE_LIMIT).read_to_end(&mut reply).ok()?;
    let text = String::from_utf8_lossy(&reply);
    let (head, body) = text.split_once("\r\n\r\n")?;
    head.starts_with("HTTP/1.1 200").then(|| body.to_string())
}

/// The per-volume families the agent exports (without `volring_volume_`).
const CONTRACT: [&str; 15] = [
    "reads_completed_total",
    "writes_completed_total",
    "read_bytes_total",
    "written_bytes_total",
    "read_time_seconds_total",
    "write_time_seconds_total",
    "io_time_seconds_total",
    "in_flight",
    "capacity_bytes",
    "used_bytes",
    "available_bytes",
    "inodes",
    "inodes_used",
    "inodes_free",
    "info",
];

/// Whether `family` (after `volring_volume_`) is one of [`CONTRACT`]; a
/// counter's TYPE line names it without `_total`, as OpenMetrics does.
fn in_contract(family: &str) -> bool {
    CONTRACT.iter().any(|c| *c == family || c.strip_suffix("_total") == Some(family))
}

/// The `volring_volume_*` series of a scrape, by volume. A scrape without
/// them (an agent older than them, or no volume staged) has no volumes;
/// only the first has `exported` false.
pub(crate) fn parse_scrape(text: &str) -> Scrape {
    let mut out = Scrape::default();
    for line in text.lines() {
        if let Some(v) = line.strip_prefix("volring_stat_sample_timestamp_seconds ") {
            out.sampled_at = v.trim().parse::<f64>().ok().filter(|t| t.is_finite() && *t > 0.0);
            continue;
        }
        // A contract family, not any `volring_volume_*`: an agent older than
        // the per-volume series exports `volring_volume_drift` already.
        if line.strip_prefix("# TYPE volring_volume_").and_then(|t| t.split_whitespace().next()).is_some_and(in_contract) {
            out.exported = true;
        }
        let Some(rest) = line.strip_prefix("volring_volume_") else { continue };
        let Some((name, labels, value)) = split_sample(rest) else { continue };
        // Only the contract's families make a row: other `volring_volume_*`
        // series (the reconciler's `volring_volume_drift`) name volumes that
        // may not be staged, with no device to show.
        if !in_contract(name) {
            continue;
        }
        let Some(volume) = labels.get("volume").filter(|v| !v.is_empty()) else { continue };
        let (v, c) = out.volumes.entry(volume.clone()).or_insert_with(|| {
            let label = |k: &str| labels.get(k).cloned().unwrap_or_default();
            let v = Volume {
                volume: volume.clone(),
                device: label("device"),
                persistentvolumeclaim: label("persistentvolumeclaim"),
                namespace: label("namespace"),
                pod: label("pod"),
                ..Volume::default()
            };
            (v, Counters::default())
        });
        if v.device.is_empty() {
            v.device = labels.get("device").cloned().unwrap_or_default();
        }
        let space = |i: usize, out: &mut BTreeMap<String, [f64; 6]>| out.entry(volume.clone()).or_default()[i] = value;
        match name {
            "reads_completed_total" => c.reads = value,
            "writes_completed_total" => c.writes = value,
            "read_bytes_total" => c.read_bytes = value,
            "written_bytes_total" => c.written_bytes = value,
            "read_time_seconds_total" => c.read_time = value,
            "write_time_seconds_total" => c.write_time = value,
            "io_time_seconds_total" => c.io_time = value,
            "in_flight" => c.in_flight = value,
            "capacity_bytes" => space(0, &mut out.space),
            "used_bytes" => space(1, &mut out.space),
            "available_bytes" => space(2, &mut out.space),
            "inodes" => space(3, &mut out.space),
            "inodes_used" => space(4, &mut out.space),
            "inodes_free" => space(5, &mut out.space),
            // What only the info series carries: the pods' UIDs, joined
            // by commas, and the access (a filesystem's type).
            "info" => {
                v.pod_uids =
                    labels.get("pod_uid").into_iter().flat_map(|u| u.split(',')).filter(|u| !u.is_empty()).map(str::to_string).collect();
                v.access = match (labels.get("access").map(String::as_str), labels.get("fstype")) {
                    (Some("block"), _) => "block".into(),
                    (_, Some(fs)) if !fs.is_empty() => fs.clone(),
                    (access, _) => access.unwrap_or_default().to_string(),
                };
            }
            _ => {}
        }
    }
    out
}

/// `name{k="v",...} value [timestamp]` → its parts; `None` for anything
/// else (comments are filtered before).
fn split_sample(line: &str) -> Option<(&str, BTreeMap<String, String>, f64)> {
    let (name, rest) = match line.find('{') {
        Some(i) => (&line[..i], &line[i + 1..]),
        None => {
            let (n, v) = line.split_once(' ')?;
            return Some((n, BTreeMap::new(), v.split_whitespace().next()?.parse().ok()?));
        }
    };
    let mut labels = BTreeMap::new();
    let mut chars = rest.char_indices().peekable();
    let end = loop {
        while chars.next_if(|(_, c)| *c == ',' || *c == ' ').is_some() {}
        let (start, c) = chars.next()?;
        if c == '}' {
            break start;
        }
        let eq = rest[start..].find('=')? + start;
        let key = rest[start..eq].to_string();
        while chars.next_if(|(i, _)| *i <= eq).is_some() {}
        if chars.next()?.1 != '"' {
            return None;
        }
        let mut value = String::new();
        loop {
            match chars.next()? {
                (_, '"') => break,
                (_, '\\') => match chars.next()?.1 {
                    'n' => value.push('\n'),
                    other => value.push(other),
                },
                (_, c) => value.push(c),
            }
        }
        labels.insert(key, value);
    };
    let value = rest[end + 1..].split_whitespace().next()?.parse().ok()?;
    Some((name, labels, value))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The contract's series, as the agent exports them, read back by
    /// volume with their labels.
    #[test]
    fn reads_the_contract_series() {
        let text = r#"# HELP volring_volume_reads_completed_total Reads
# TYPE volring_volume_reads_completed_total counter
volring_volume_reads_completed_total{volume="pvc-1",device="loop7",persistentvolumeclaim="data",namespace="web",pod="web-0"} 10
volring_volume_written_bytes_total{volume="pvc-1",device="loop7",persistentvolumeclaim="data",namespace="web",pod="web-0"} 4096
volring_volume_io_time_seconds_total{volume="pvc-1",device="loop7",persistentvolumeclaim="data",namespace="web",pod="web-0"} 1.5
volring_volume_capacity_bytes{volume="pvc-1",device="loop7",persistentvolumeclaim="data",namespace="web",pod="web-0"} 1e9
volring_volume_reads_completed_total{volume="pvc-2",device="nbd0",persistentvolumeclaim="",namespace="",pod="a \"quoted\\ name"} 3
volring_volume_drift{volume="pvc-3",kind="staging_missing"} 1
volring_device_reads_completed_total{device="loop7"} 99
volring_volume_info{volume="pvc-1",device="loop7",persistentvolumeclaim="data",namespace="web",pod="web-0,web-1",persistentvolume="pv-1",pod_uid="u-1,u-2",access="filesystem",fstype="ext4"} 1
volring_volume_info{volume="pvc-2",device="nbd0",persistentvolumeclaim="",namespace="",pod="",persistentvolume="",pod_uid="",access="block",fstype=""} 1
"#;
        let s = parse_scrape(text);
        // pvc-3 has only a drift series: not a staged volume's row.
        assert_eq!(s.volumes.keys().collect::<Vec<_>>(), ["pvc-1", "pvc-2"]);
        let (v, c) = &s.volumes["pvc-1"];
        assert_eq!(
            (v.device.as_str(), v.persistentvolumeclaim.as_str(), v.namespace.as_str(), v.pod.as_str()),
            ("loop7", "data", "web", "web-0")
        );
        assert_eq!((c.reads, c.written_bytes, c.io_time), (10.0, 4096.0, 1.5));
        assert_eq!(s.space["pvc-1"][0], 1e9);
        assert_eq!(s.volumes["pvc-2"].0.pod, "a \"quoted\\ name");
        // The info series: comma-joined pod UIDs, the access.
        assert_eq!((v.pod_uids.as_slice(), v.access.as_str()), (&["u-1".to_string(), "u-2".to_string()][..], "ext4"));
        assert_eq!((s.volumes["pvc-2"].0.pod_uids.len(), s.volumes["pvc-2"].0.access.as_str()), (0, "block"));
        assert!(s.exported);
        // An agent with no volume staged still exports the families.
        let idle = parse_scrape("# HELP volring_volume_info A staged volume\n# TYPE volring_volume_info gauge\n# EOF\n");
        assert!(idle.exported && idle.volumes.is_empty());
        // When the agent took its sample: the clock rates are taken against.
        assert_eq!(s.sampled_at, None);
        let timed = parse_scrape("volring_stat_sample_timestamp_seconds 1.7643e9\nvolring_stat_samples_total 5\n");
        assert_eq!(timed.sampled_at, Some(1.7643e9));
        assert_eq!(parse_scrape("volring_stat_sample_timestamp_seconds NaN\n").sampled_at, None);
        assert!(!parse_scrape("# TYPE volring_device_info gauge\nvolring_device_info{device=\"loop0\"} 1\n").exported);
        assert!(
            !parse_scrape("# TYPE volring_volume_drift gauge\nvolring_volume_drift{volume=\"v\",kind=\"staging_missing\"} 1\n").exported
        );
        assert!(split_sample("garbage{x=\"1\"").is_none());
        assert!(split_sample("x{y=1} 2").is_none());
    }

    #[test]
    fn rates_from_two_samples() {
        let a = Counters { reads: 100.0, writes: 0.0, read_time: 1.0, io_time: 2.0, ..Counters::default() };
        let b = Counters { reads: 300.0, writes: 200.0, read_time: 2.0, write_time: 1.0, io_time: 2.5, ..Counters::default() };
        let r = Rates::between(&a, &b, 2.0);
        assert_eq!((r.reads_per_second, r.writes_per_second, r.iops()), (100.0, 100.0, 200.0));
        assert_eq!(r.await_ms, 2000.0 / 400.0 * 1.0);
        assert_eq!(r.util_pct, 25.0);
        // A device re-attached: its counters restart; nothing negative.
        assert_eq!(Rates::between(&b, &a, 1.0).reads_per_second, 0.0);
    }

    #[test]
    fn pod_uid_from_a_publish_path() {
        let root = Path::new("/var/lib/kubelet");
        let t = root.join("pods/1f2e-33/volumes/kubernetes.io~csi/pvc-1/mount");
        assert_eq!(pod_uid(&t, root).as_deref(), Some("1f2e-33"));
        assert_eq!(pod_uid(Path::new("/elsewhere/pods/x"), root), None);
        assert_eq!(pod_uid(&root.join("plugins/x"), root), None);
        // A block volume's publish path ends in the pod's UID.
        let block = root.join("plugins/kubernetes.io/csi/volumeDevices/publish/pv-b/0a9b-8c7d");
        assert_eq!(pod_uid(&block, root).as_deref(), Some("0a9b-8c7d"));
    }
}
