//! The whole `volring node` under a mount storm, with the mount watcher's
//! batch window off (0) and at its default (1000 µs), same run.
//!
//! In a private mount namespace holding N mounts (default 1,000), one agent
//! per round and window (CSI, reconciler, device scan, stat collector: the
//! node as deployed, its kubelet root and state in the bench's tmpfs) is
//! started; once it is ready, its CPU is read over an idle stretch, then
//! over a storm of `--pairs` (1,000) mount(2)+umount(2) pairs outside the
//! kubelet root and one second after it. The storm's cost is the storm
//! stretch less an idle stretch of the same length. CPU is the sum over the
//! agent's threads of `/proc/<pid>/task/*/schedstat` (nanoseconds; the
//! clock ticks of `/proc/<pid>/stat` are 10 ms, coarser than a storm), with
//! `/proc/<pid>/stat` utime+stime beside it as a check. The agent's own
//! count of mount events handled (its `stopped` log line) says whether it
//! saw every change. Rounds alternate the order of the two windows; medians
//! and the median of the per-round ratios are printed.
//!
//! `cargo bench --bench node_storm [-- --sizes 1000,10000 --pairs 1000 --runs 5]` (root)

mod support;

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use rustix::mount::{mount, unmount, MountFlags, UnmountFlags};

const WINDOWS_US: [u64; 2] = [0, 1000];

#[derive(Clone, Copy)]
struct Cost {
    /// Storm stretch less an idle stretch of the same length.
    storm: Duration,
    idle: Duration,
    /// utime+stime over the storm stretch, in clock ticks.
    ticks: u64,
    switches: u64,
    events: u64,
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if args.iter().any(|a| a == "--list") {
        return;
    }
    let arg = |name: &str, def: &str| -> String {
        args.iter().position(|a| a == name).and_then(|i| args.get(i + 1)).cloned().unwrap_or_else(|| def.to_string())
    };
    let sizes: Vec<usize> = arg("--sizes", "1000").split(',').filter_map(|s| s.parse().ok()).collect();
    let pairs: usize = arg("--pairs", "1000").parse().expect("--pairs");
    let runs: usize = arg("--runs", "5").parse::<usize>().expect("--runs").max(1);
    volring_sys::ns::enter_private_mount_namespace().expect("private mount namespace (run as root)");
    let mut farm = support::MountFarm::new();
    let dirs: Vec<PathBuf> = (0..pairs).map(|i| farm.dir(&format!("storm/s{i}"))).collect();
    println!(
        "node storm: {pairs} mount+umount pairs outside the kubelet root; CPU = storm stretch - idle stretch of the same length, all agent threads"
    );
    for n in sizes {
        farm.grow_to(n);
        let mut costs: Vec<Vec<Cost>> = vec![Vec::new(); WINDOWS_US.len()];
        for round in 0..runs {
            for j in 0..WINDOWS_US.len() {
                let w = (round + j) % WINDOWS_US.len();
                match one(&farm, &dirs, WINDOWS_US[w], round) {
                    Ok(c) => costs[w].push(c),
                    Err(e) => println!("{n:>7} round {round} window {} µs failed: {e}", WINDOWS_US[w]),
                }
            }
        }
        for (w, c) in WINDOWS_US.iter().zip(&costs) {
            let ms = |f: &dyn Fn(&Cost) -> f64| median(c.iter().map(f).collect());
            println!(
                "{n:>7} mounts, window {w:>4} µs ({} rounds, medians): storm {:.1} ms CPU (idle-corrected; per round: {}), {:.2} µs per change; idle {:.1} ms; /proc stat {:.0} ticks; ctx switches {:.0}; events handled {:.0}/{}",
                c.len(),
                ms(&|c| c.storm.as_secs_f64() * 1e3),
                c.iter().map(|c| format!("{:.1}", c.storm.as_secs_f64() * 1e3)).collect::<Vec<_>>().join(" "),
                ms(&|c| c.storm.as_secs_f64() * 1e6 / (2 * pairs) as f64),
                ms(&|c| c.idle.as_secs_f64() * 1e3),
                ms(&|c| c.ticks as f64),
                ms(&|c| c.switches as f64),
                ms(&|c| c.events as f64),
                2 * pairs,
            );
        }
        let ratios: Vec<f64> =
            costs[0].iter().zip(&costs[1]).map(|(a, b)| b.storm.as_secs_f64() / a.storm.as_secs_f64().max(1e-9)).collect();
        println!("{n:>7} mounts: window 1000 / window 0: {:.2}x CPU (median of per-round ratios)", median(ratios));
    }
}

/// One agent, one window: idle stretch, storm stretch, stop.
fn one(farm: &support::MountFarm, dirs: &[PathBuf], window_us: u64, round: usize) -> std::io::Result<Cost> {
    let base = farm.dir(&format!("node-{window_us}-{round}"));
    let (kubelet, state) = (base.join("kubelet"), base.join("state"));
    std::fs::create_dir_all(&kubelet)?;
    let socket = base.join("csi.sock");
    let log = base.join("agent.log");
    let mut child = Command::new(env!("CARGO_BIN_EXE_volring"))
        .args(["node", "--metrics-addr", "off", "--node-id", "bench", "--stats-interval", "5", "--mount-batch-us"])
        .arg(window_us.to_string())
        .arg("--csi-endpoint")
        .arg(format!("unix://{}", socket.display()))
        .arg("--kubelet-root")
        .arg(&kubelet)
        .arg("--state-dir")
        .arg(&state)
        .env("RUST_LOG", "volring=info")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log)?)
        .spawn()?;
    let result = measure(&mut child, &log, dirs);
    let _ = rustix::process::kill_process(rustix::process::Pid::from_child(&child), rustix::process::Signal::TERM);
    let _ = child.wait();
    let events = stopped_events(&log);
    let cost = result?;
    Ok(Cost { events: events.unwrap_or(0).saturating_sub(cost.events), ..cost })
}

fn measure(child: &mut Child, log: &Path, dirs: &[PathBuf]) -> std::io::Result<Cost> {
    let pid = child.id();
    let deadline = Instant::now() + Duration::from_secs(30);
    while !std::fs::read_to_string(log).unwrap_or_default().contains(" ready ") {
        if Instant::now() > deadline || child.try_wait()?.is_some() {
            return Err(std::io::Error::other(format!("the agent did not become ready: {}", tail(log))));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    // Past start-up work (first scans, calibration).
    std::thread::sleep(Duration::from_millis(1500));
    let settle = Duration::from_secs(1);
    // The storm stretch's length is only known after it: an idle stretch of
    // a generous length first, scaled to the storm's.
    let idle_len = Duration::from_millis(1500);
    let (c0, _) = support::thread_usage(pid);
    std::thread::sleep(idle_len);
    let (c1, _) = support::thread_usage(pid);
    let idle_rate = c1.saturating_sub(c0).as_secs_f64() / idle_len.as_secs_f64();
    // Mount events the agent has handled so far come from its log only at
    // the end; the probe-free storm below is all it sees meanwhile.
    let (s0, sw0) = support::thread_usage(pid);
    let t0 = ticks(pid);
    let start = Instant::now();
    for d in dirs {
        mount("tmpfs", d, "tmpfs", MountFlags::empty(), Some(c"size=64k"))?;
        unmount(d, UnmountFlags::empty())?;
    }
    std::thread::sleep(settle);
    let (s1, sw1) = support::thread_usage(pid);
    let t1 = ticks(pid);
    let stretch = start.elapsed();
    let idle = Duration::from_secs_f64(idle_rate * stretch.as_secs_f64());
    Ok(Cost {
        storm: s1.saturating_sub(s0).saturating_sub(idle),
        idle,
        ticks: t1.saturating_sub(t0),
        switches: sw1.saturating_sub(sw0),
        events: 0,
    })
}

/// utime+stime of the whole process from `/proc/<pid>/stat`, clock ticks.
fn ticks(pid: u32) -> u64 {
    let s = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    // Fields after the command name (which may hold spaces) in parentheses.
    let rest = s.rsplit_once(')').map_or("", |(_, r)| r);
    let f: Vec<&str> = rest.split_whitespace().collect();
    // utime and stime are fields 14 and 15; `rest` starts at field 3.
    f.get(11).and_then(|v| v.parse::<u64>().ok()).unwrap_or(0) + f.get(12).and_then(|v| v.parse::<u64>().ok()).unwrap_or(0)
}

/// The mount event count in the agent's `stopped` line.
fn stopped_events(log: &Path) -> Option<u64> {
    let mut s = String::new();
    std::fs::File::open(log).ok()?.read_to_string(&mut s).ok()?;
    let line = s.lines().rev().find(|l| l.contains("stopped") && l.contains("events="))?;
    line.split_whitespace().find_map(|w| w.strip_prefix("events=")?.parse().ok())
}

fn tail(log: &Path) -> String {
    let s = std::fs::read_to_string(log).unwrap_or_default();
    s.lines().rev().take(5).collect::<Vec<_>>().join(" | ")
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    support::pct(&v, 0.5)
}
