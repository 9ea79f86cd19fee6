//! `volring top`: the node's volumes (or devices) sorted by the busiest,
//! refreshed each interval, like iotop. Interactive on a terminal
//! (ratatui); `--once` prints one ranking (two samples an interval apart)
//! as a table or `--json`, for scripts and tests. `volring stats --by
//! volume` prints the same rows every interval, as `volring stats` does
//! for devices.

use std::collections::BTreeMap;
use std::io::Write;
use std::time::{Duration, Instant};

use super::devices_report::human_size;

use super::stdout_error;
use super::volumes::{self, Counters, Rates, SourceArgs, SourceChoice};

#[derive(Debug, Clone, clap::Args)]
pub(crate) struct TopArgs {
    #[command(flatten)]
    pub(crate) source: SourceArgs,
    /// Seconds between refreshes.
    #[arg(long, default_value_t = 1.0)]
    pub(crate) interval: f64,
    /// Print one ranking (two samples an interval apart) and exit.
    #[arg(long)]
    pub(crate) once: bool,
    /// With --once: one JSON document (`{"view", "source", "rows": [...]}`).
    #[arg(long, requires = "once")]
    pub(crate) json: bool,
    /// Start with devices instead of volumes.
    #[arg(long)]
    pub(crate) devices: bool,
    /// What the rows are sorted by, busiest first.
    #[arg(long, value_enum, default_value = "iops")]
    pub(crate) sort: SortKey,
    /// Only rows whose volume, device, PVC, namespace or pod contains TEXT.
    #[arg(long, value_name = "TEXT")]
    pub(crate) filter: Option<String>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub(crate) enum SortKey {
    Iops,
    Throughput,
    Await,
    Util,
    Name,
}

impl SortKey {
    pub(crate) fn next(self) -> Self {
        match self {
            Self::Iops => Self::Throughput,
            Self::Throughput => Self::Await,
            Self::Await => Self::Util,
            Self::Util => Self::Name,
            Self::Name => Self::Iops,
        }
    }

    pub(crate) fn label(self) -> &'static str {
        match self {
            Self::Iops => "IOPS",
            Self::Throughput => "throughput",
            Self::Await => "await",
            Self::Util => "util",
            Self::Name => "name",
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub(crate) enum View {
    Volumes,
    Devices,
}

/// One line of the view.
#[derive(Debug, Clone, serde::Serialize)]
pub(crate) struct Row {
    /// The CSI volume id (volumes), or the volume on the device, if any.
    pub(crate) volume: String,
    pub(crate) device: String,
    pub(crate) persistentvolumeclaim: String,
    pub(crate) namespace: String,
    pub(crate) pod: String,
    pub(crate) pod_uids: Vec<String>,
    #[serde(flatten)]
    pub(crate) rates: Rates,
}

impl Row {
    pub(crate) fn matches(&self, text: &str) -> bool {
        [&self.volume, &self.device, &self.persistentvolumeclaim, &self.namespace, &self.pod].iter().any(|f| f.contains(text))
    }
}

/// Reads samples and turns two of them into rows.
pub(crate) struct Sampler {
    args: SourceArgs,
    /// The agent's address when it is the source; `None`: the kernel.
    agent: Option<String>,
    last: BTreeMap<(View, String), Last>,
    /// The kernel source's clock: sample times are seconds since this.
    epoch: Instant,
    /// When the agent's collector took the counters of the last scrape.
    agent_sampled_at: Option<f64>,
}

/// How long `--once` waits for the agent's next collection when its
/// interval has passed without one (the agent's `--stats-interval` is
/// 1 s by default).
const AGENT_SAMPLE_PATIENCE: Duration = Duration::from_secs(10);

/// Whose clock a sample time is on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Clock {
    /// The agent's collector (Unix seconds, from its scrape).
    Agent,
    /// `top`'s own (seconds since it started).
    Own,
}

/// A row's previous sample: when it was taken (seconds on `clock`), its
/// counters, and the rates shown for it.
#[derive(Debug, Clone, Copy)]
struct Last {
    clock: Clock,
    at: f64,
    counters: Counters,
    rates: Rates,
}

/// A row's rates from its previous sample and this one. A sample taken at
/// the same time as the previous one (the agent has not collected again
/// since the last refresh) is no new information: the rates shown stay,
/// rather than drop to zero and then double at the next refresh. A sample
/// on another clock (an agent without the sample time replaced one with
/// it), or earlier than the previous one (the agent's clock stepped back),
/// starts the row again.
fn advance(last: Option<&Last>, clock: Clock, at: f64, counters: Counters) -> Last {
    let fresh = Last { clock, at, counters, rates: Rates::default() };
    match last {
        Some(l) if l.clock != clock || at < l.at => fresh,
        Some(l) if at == l.at => *l,
        Some(l) => Last { clock, at, counters, rates: Rates::between(&l.counters, &counters, at - l.at) },
        None => fresh,
    }
}

impl Sampler {
    /// Picks the source: the agent when asked, or (auto) when it answers
    /// and exports the per-volume families (with no volume staged too);
    /// else the kernel.
    pub(crate) fn new(args: &SourceArgs) -> anyhow::Result<Self> {
        let agent = match args.source {
            SourceChoice::Kernel => None,
            choice => {
                let has_series = volumes::fetch_metrics(&args.metrics_addr).is_some_and(|t| volumes::parse_scrape(&t).exported);
                anyhow::ensure!(
                    has_series || choice == SourceChoice::Auto,
                    "no per-volume series at http://{}/metrics (is the agent running there?)",
                    args.metrics_addr
                );
                has_series.then(|| args.metrics_addr.clone())
            }
        };
        if agent.is_none() {
            anyhow::ensure!(args.state_dir.is_dir(), "state directory {} does not exist", args.state_dir.display());
        }
        Ok(Self { args: args.clone(), agent, last: BTreeMap::new(), epoch: Instant::now(), agent_sampled_at: None })
    }

    pub(crate) fn source(&self) -> String {
        match &self.agent {
            Some(a) => format!("agent http://{a}/metrics"),
            None => format!("kernel ({})", self.args.state_dir.display()),
        }
    }

    /// The rows now, with rates since the last call (zero on the first).
    pub(crate) fn sample(&mut self, view: View) -> anyhow::Result<Vec<Row>> {
        // The agent's counters carry the time its collector read them; the
        // kernel's are read now.
        let (mut clock, mut now) = (Clock::Own, self.epoch.elapsed().as_secs_f64());
        let mut rows = Vec::new();
        let mut raw: Vec<(volumes::Volume, Option<Counters>)> = match (&self.agent, view) {
            (Some(addr), View::Volumes) => {
                let text = volumes::fetch_metrics(addr).ok_or_else(|| anyhow::anyhow!("the agent at {addr} stopped answering"))?;
                let scrape = volumes::parse_scrape(&text);
                if let Some(at) = scrape.sampled_at {
                    (clock, now) = (Clock::Agent, at);
                }
                self.agent_sampled_at = scrape.sampled_at;
                scrape.volumes.into_values().map(|(v, c)| (v, Some(c))).collect()
            }
            (None, View::Volumes) => volumes::staged(&self.args.state_dir, &self.args.kubelet_root)?
                .into_iter()
                .map(|v| {
                    let c = volumes::sysfs_counters(&v.device);
                    (v, c)
                })
                .collect(),
            (_, View::Devices) => {
                let owners: BTreeMap<String, volumes::Volume> = volumes::staged(&self.args.state_dir, &self.args.kubelet_root)
                    .unwrap_or_default()
                    .into_iter()
                    .map(|v| (v.device.clone(), v))
                    .collect();
                volumes::diskstats()
                    .into_iter()
                    .filter(|(name, c)| c.reads + c.writes > 0.0 || owners.contains_key(name))
                    .map(|(name, c)| {
                        let v = owners.get(&name).cloned().unwrap_or_default();
                        (volumes::Volume { device: name, ..v }, Some(c))
                    })
                    .collect()
            }
        };
        let mut seen = Vec::with_capacity(raw.len());
        for (v, c) in raw.drain(..) {
            let key = (view, if view == View::Volumes { v.volume.clone() } else { v.device.clone() });
            let rates = match c {
                Some(c) => {
                    let next = advance(self.last.get(&key), clock, now, c);
                    self.last.insert(key.clone(), next);
                    next.rates
                }
                None => Rates::default(),
            };
            seen.push(key);
            rows.push(Row {
                volume: v.volume,
                device: v.device,
                persistentvolumeclaim: v.persistentvolumeclaim,
                namespace: v.namespace,
                pod: v.pod,
                pod_uids: v.pod_uids,
                rates,
            });
        }
        // Volumes unstaged (devices gone) since: their counters go.
        self.last.retain(|k, _| k.0 != view || seen.contains(k));
        Ok(rows)
    }
}

/// Sorts busiest first (by name: alphabetically), ties by name.
pub(crate) fn rank(rows: &mut [Row], key: SortKey, reverse: bool, view: View) {
    let name = |r: &Row| if view == View::Volumes { r.volume.clone() } else { r.device.clone() };
    let value = |r: &Row| match key {
        SortKey::Iops => r.rates.iops(),
        SortKey::Throughput => r.rates.throughput(),
        SortKey::Await => r.rates.await_ms,
        SortKey::Util => r.rates.util_pct,
        SortKey::Name => 0.0,
    };
    rows.sort_by(|a, b| value(b).total_cmp(&value(a)).then_with(|| name(a).cmp(&name(b))));
    if reverse {
        rows.reverse();
    }
}

/// The header and the cells of one row, as both the TUI and the text
/// print them.
pub(crate) const COLUMNS: [&str; 11] = ["VOLUME", "DEVICE", "PVC", "NAMESPACE", "POD", "R/s", "W/s", "READ/s", "WRITE/s", "AWAIT", "UTIL%"];

pub(crate) fn cells(r: &Row) -> [String; 11] {
    let dash = |s: &str| if s.is_empty() { "-".to_string() } else { s.to_string() };
    let pod = if r.pod.is_empty() { r.pod_uids.first().map_or("-".to_string(), |u| format!("uid:{u}")) } else { r.pod.clone() };
    [
        dash(&r.volume),
        dash(&r.device),
        dash(&r.persistentvolumeclaim),
        dash(&r.namespace),
        pod,
        format!("{:.0}", r.rates.reads_per_second),
        format!("{:.0}", r.rates.writes_per_second),
        human_size(r.rates.read_bytes_per_second as u64),
        human_size(r.rates.write_bytes_per_second as u64),
        format!("{:.2}ms", r.rates.await_ms),
        format!("{:.1}", r.rates.util_pct),
    ]
}

fn text_table(rows: &[Row]) -> String {
    let all: Vec<[String; 11]> = rows.iter().map(cells).collect();
    let mut widths: Vec<usize> = COLUMNS.iter().map(|c| c.len()).collect();
    for r in &all {
        for (w, c) in widths.iter_mut().zip(r) {
            *w = (*w).max(c.len());
        }
    }
    let line = |cells: &[String]| {
        let mut s = String::new();
        for (i, (c, w)) in cells.iter().zip(&widths).enumerate() {
            // Names left-aligned, figures right-aligned.
            if i < 5 {
                s.push_str(&format!("{c:<w$} "));
            } else {
                s.push_str(&format!("{c:>w$} "));
            }
        }
        s.trim_end().to_string() + "\n"
    };
    let mut out = line(&COLUMNS.map(str::to_string));
    for r in &all {
        out.push_str(&line(r));
    }
    out
}

/// `--once`: two samples an interval apart, ranked, printed; then exit.
fn once(args: &TopArgs) -> anyhow::Result<()> {
    let view = if args.devices { View::Devices } else { View::Volumes };
    let mut sampler = Sampler::new(&args.source)?;
    sampler.sample(view)?;
    let first = sampler.agent_sampled_at;
    std::thread::sleep(Duration::from_secs_f64(args.interval.clamp(0.01, 3600.0)));
    let mut rows = sampler.sample(view)?;
    // Two scrapes of one agent sample are no interval: wait (bounded) for
    // the agent's next collection, so a short --interval is not all zeros.
    let deadline = Instant::now() + AGENT_SAMPLE_PATIENCE;
    while first.is_some() && sampler.agent_sampled_at == first && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
        rows = sampler.sample(view)?;
    }
    if let Some(f) = &args.filter {
        rows.retain(|r| r.matches(f));
    }
    rank(&mut rows, args.sort, false, view);
    let mut out = std::io::stdout().lock();
    if args.json {
        let doc = serde_json::json!({
            "view": view, "source": sampler.source(), "sort": args.sort,
            "interval_seconds": args.interval, "rows": rows,
        });
        serde_json::to_writer_pretty(&mut out, &doc).map_err(std::io::Error::from).map_err(stdout_error)?;
        return writeln!(out).map_err(stdout_error);
    }
    out.write_all(text_table(&rows).as_bytes()).map_err(stdout_error)
}

pub(crate) fn top(args: &TopArgs) -> anyhow::Result<()> {
    if args.once {
        return once(args);
    }
    super::top_ui::run(args)
}

/// `volring stats --by volume`: the volumes' rates every interval, as
/// `volring stats` prints devices': a timestamped table, or JSON lines.
pub(crate) fn stats_by_volume(source: &SourceArgs, interval: f64, count: Option<u64>, all: bool, json: bool) -> anyhow::Result<()> {
    let mut sampler = Sampler::new(source)?;
    sampler.sample(View::Volumes)?;
    let every = Duration::from_secs_f64(interval.clamp(0.01, 3600.0));
    let mut printed = 0u64;
    while count.is_none_or(|c| printed < c) {
        std::thread::sleep(every);
        let mut rows = sampler.sample(View::Volumes)?;
        if !all {
            rows.retain(|r| r.rates.iops() > 0.0);
        }
        rank(&mut rows, SortKey::Iops, false, View::Volumes);
        let at = volring_volumes::store::utc_text(
            std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0),
        );
        let text = if json {
            serde_json::to_string(&serde_json::json!({"time": at, "source": sampler.source(), "volumes": rows}))? + "\n"
        } else {
            format!("{at}\n{}\n", text_table(&rows))
        };
        let mut out = std::io::stdout().lock();
        out.write_all(text.as_bytes()).and_then(|_| out.flush()).map_err(stdout_error)?;
        printed += 1;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(volume: &str, iops: f64, util: f64) -> Row {
        Row {
            volume: volume.into(),
            device: format!("dev-{volume}"),
            persistentvolumeclaim: String::new(),
            namespace: String::new(),
            pod: String::new(),
            pod_uids: Vec::new(),
            rates: Rates { reads_per_second: iops, util_pct: util, ..Rates::default() },
        }
    }

    #[test]
    fn ranks_the_busiest_first() {
        let mut rows = vec![row("a", 1.0, 90.0), row("b", 50.0, 10.0), row("c", 50.0, 0.0)];
        rank(&mut rows, SortKey::Iops, false, View::Volumes);
        assert_eq!(rows.iter().map(|r| r.volume.as_str()).collect::<Vec<_>>(), ["b", "c", "a"]);
        rank(&mut rows, SortKey::Util, false, View::Volumes);
        assert_eq!(rows[0].volume, "a");
        rank(&mut rows, SortKey::Name, true, View::Volumes);
        assert_eq!(rows[0].volume, "c");
        let t = text_table(&rows);
        assert!(t.starts_with("VOLUME") && t.lines().count() == 4, "{t}");
    }

    fn reads(n: f64) -> Counters {
        Counters { reads: n, ..Counters::default() }
    }

    /// The agent collects once a second; `top` refreshes when it likes.
    /// Rates are per the agent's clock, and a refresh between two agent
    /// samples keeps what was shown instead of flashing zero.
    #[test]
    fn rates_follow_the_sources_clock_and_a_repeated_sample_keeps_them() {
        let first = advance(None, Clock::Agent, 100.0, reads(1_000.0));
        assert_eq!(first.rates, Rates::default());
        // 500 reads between agent samples 1 s apart: 500/s, however long
        // `top` itself waited between the two scrapes.
        let second = advance(Some(&first), Clock::Agent, 101.0, reads(1_500.0));
        assert_eq!(second.rates.reads_per_second, 500.0);
        // A scrape before the agent sampled again: same time, same counters.
        let repeat = advance(Some(&second), Clock::Agent, 101.0, reads(1_500.0));
        assert_eq!(repeat.rates.reads_per_second, 500.0);
        assert_eq!(repeat.at, 101.0);
        // The next agent sample 2 s on (a refresh skipped one): per second.
        let third = advance(Some(&repeat), Clock::Agent, 103.0, reads(2_500.0));
        assert_eq!(third.rates.reads_per_second, 500.0);
        // Another clock (an older agent took over) or a step back: the row
        // starts again instead of freezing or dividing by 1.7e9 s.
        let other = advance(Some(&third), Clock::Own, 5.0, reads(2_600.0));
        assert_eq!((other.rates, other.clock, other.at), (Rates::default(), Clock::Own, 5.0));
        let back = advance(Some(&third), Clock::Agent, 90.0, reads(2_600.0));
        assert_eq!((back.rates, back.at), (Rates::default(), 90.0));
    }
}
