//! Mount storm: volring's watcher against a full re-parse watcher, same run.
//!
//! In a private mount namespace holding N mounts (default 1,000 / 10,000 /
//! 20,000), 1,000 short-lived mounts (mount(2) then umount(2) at once) are
//! made under each watcher in turn. For each it prints how many of the 1,000
//! attaches it reported, its ring thread's CPU time for the storm, and the
//! latency from mount(2) returning to the event reaching a consumer thread.
//!
//! Then, per size, the whole `volring mounts --watch` process against a C
//! fanotify+statmount watcher (`support/fanwatch.c`, compiled with `cc` here;
//! skipped with a message when there is no `cc`): CPU of all threads of each
//! process for the same storm, in paired runs (order alternating), medians
//! and the median of the per-pair volring/C ratios, with lines printed and
//! context switches as counts that noise does not blur.
//!
//! With `--volring-bin A:B` (or `VOLRING_BENCH_BIN=A:B`) the process rows
//! measure two volring binaries (say a build of main, and this one) beside
//! the C peer, rounds rotating the order of the three (5 rounds unless
//! `--runs`), and the in-process rows are left out. Each row gives CPU per
//! change (CPU over the 2 lines a pair should print), context switches,
//! lines seen against expected and the mount-to-line latency.
//!
//! With the C peer the process rows are followed by mount moves: one tmpfs
//! moved 500 times 1 ms apart (`--moves`, `--gap-us`) under each watcher in
//! turn, counting the `moved` lines each printed (`--watcher moves` runs
//! only those).
//!
//! `cargo bench --bench mount_storm [-- --sizes 1000,10000 --pairs 1000 --watcher volring|reparse|process|moves --runs 9 --volring-bin A:B]` (root)

#[path = "support/process_storm.rs"]
mod process_storm;
mod support;

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rustix::fs::{statx, AtFlags, StatxFlags, CWD};
use rustix::mount::{mount, unmount, MountFlags, UnmountFlags};
use volring_mounts::{EventKind, MountWatcher, WatchConfig, WatchMode};

/// `STATX_MNT_ID_UNIQUE` (6.8+): the id fanotify and statmount use.
const STATX_MNT_ID_UNIQUE: u32 = 0x4000;

struct Outcome {
    seen: usize,
    cpu: Duration,
    p50_us: f64,
    p99_us: f64,
    max_us: f64,
    resyncs: u64,
    storm: Duration,
}

fn storm(mode: WatchMode, dirs: &[PathBuf]) -> Outcome {
    let config = WatchConfig { mode, queue_capacity: 1 << 16, resync_interval: None, ..WatchConfig::default() };
    let (watcher, _table, rx) = MountWatcher::start(config).expect("watcher");
    let done = Arc::new(AtomicBool::new(false));
    let consumer = {
        let done = done.clone();
        std::thread::spawn(move || {
            let mut by_id = HashMap::new();
            let mut by_path = HashMap::new();
            let mut quiet_since = Instant::now();
            loop {
                match rx.recv_timeout(Duration::from_millis(20)) {
                    Some(d) => {
                        let now = Instant::now();
                        quiet_since = now;
                        for e in d.changes().iter().filter(|e| e.kind == EventKind::Attached) {
                            by_id.entry(e.id).or_insert(now);
                            if let Some(m) = &e.mount {
                                by_path.entry(m.mount_point().to_vec()).or_insert(now);
                            }
                        }
                    }
                    None if done.load(Ordering::Acquire) && quiet_since.elapsed() > Duration::from_millis(500) => break,
                    None if quiet_since.elapsed() > Duration::from_secs(30) => break,
                    None => {}
                }
            }
            (by_id, by_path)
        })
    };
    std::thread::sleep(Duration::from_millis(50));
    let cpu0 = watcher.stats().cpu;
    let mut made = Vec::with_capacity(dirs.len());
    let t_storm = Instant::now();
    for d in dirs {
        mount("tmpfs", d, "tmpfs", MountFlags::empty(), Some(c"size=64k")).expect("storm mount");
        let t0 = Instant::now();
        let id = statx(CWD, d, AtFlags::empty(), StatxFlags::from_bits_retain(STATX_MNT_ID_UNIQUE)).expect("statx").stx_mnt_id;
        unmount(d, UnmountFlags::empty()).expect("storm umount");
        made.push((id, d.as_os_str().as_encoded_bytes().to_vec(), t0));
    }
    let storm_time = t_storm.elapsed();
    done.store(true, Ordering::Release);
    let (by_id, by_path) = consumer.join().expect("consumer");
    let stats = watcher.stop().expect("stop");
    let mut lat = Vec::new();
    for (id, path, t0) in &made {
        // statmount ids are unique; mountinfo ids are reused, so the re-parse
        // watcher is matched by path (every storm mount has its own).
        let seen = if mode == WatchMode::Fanotify { by_id.get(id) } else { by_path.get(path) };
        if let Some(t) = seen {
            lat.push(t.saturating_duration_since(*t0).as_secs_f64() * 1e6);
        }
    }
    lat.sort_by(f64::total_cmp);
    Outcome {
        seen: lat.len(),
        cpu: stats.cpu.saturating_sub(cpu0),
        p50_us: support::pct(&lat, 0.50),
        p99_us: support::pct(&lat, 0.99),
        max_us: lat.last().copied().unwrap_or(f64::NAN),
        resyncs: stats.resyncs,
        storm: storm_time,
    }
}

fn arg_list(args: &[String], name: &str, default: &[usize]) -> Vec<usize> {
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1))
        .map(|v| v.split(',').filter_map(|x| x.trim().parse().ok()).collect())
        .unwrap_or_else(|| default.to_vec())
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if args.iter().any(|a| a == "--list") {
        return; // cargo's bench discovery
    }
    let sizes = arg_list(&args, "--sizes", &[1_000, 10_000, 20_000]);
    let pairs = arg_list(&args, "--pairs", &[1_000])[0];
    let only = args.iter().position(|a| a == "--watcher").and_then(|i| args.get(i + 1)).cloned();
    let bins = volring_bins(&args);
    let runs = arg_list(&args, "--runs", &[if bins.len() == 2 { 5 } else { 9 }])[0].max(1);
    volring_sys::ns::enter_private_mount_namespace().expect("private mount namespace (run as root)");
    let mut farm = support::MountFarm::new();
    let dirs: Vec<PathBuf> = (0..pairs).map(|i| farm.dir(&format!("storm/s{i}"))).collect();
    let probe = farm.dir("probe");
    let moves = arg_list(&args, "--moves", &[500])[0];
    let gap = Duration::from_micros(arg_list(&args, "--gap-us", &[1_000])[0] as u64);
    let move_dirs: Vec<PathBuf> = (0..=moves).map(|i| farm.dir(&format!("moves/m{i}"))).collect();
    let peer_dir = tempfile::tempdir().expect("tempdir");
    let peer = match only.as_deref() {
        None | Some("process") | Some("moves") => match process_storm::build_peer(peer_dir.path()) {
            Ok(p) => Some(p),
            Err(e) => {
                println!("process comparison skipped: cannot build the C peer ({e})");
                None
            }
        },
        Some(_) => None,
    };
    // In-process rows measure this build only: not in an A/B run.
    let lib_rows = !matches!(only.as_deref(), Some("process" | "moves")) && bins.len() == 1;
    println!("mount storm: {pairs} short-lived mounts per run; latency = mount(2) return -> event at a consumer thread");
    println!(
        "{:>7} {:>9} {:>11} {:>10} {:>9} {:>9} {:>9} {:>8} {:>9}",
        "mounts", "watcher", "seen", "cpu_ms", "p50_us", "p99_us", "max_us", "resyncs", "storm_ms"
    );
    for n in sizes {
        farm.grow_to(n);
        let row = |name: &str, o: &Outcome| {
            println!(
                "{:>7} {:>9} {:>11} {:>10.1} {:>9.0} {:>9.0} {:>9.0} {:>8} {:>9.0}",
                n,
                name,
                format!("{}/{}", o.seen, pairs),
                o.cpu.as_secs_f64() * 1e3,
                o.p50_us,
                o.p99_us,
                o.max_us,
                o.resyncs,
                o.storm.as_secs_f64() * 1e3
            )
        };
        if let Some(peer) = &peer {
            if only.as_deref() != Some("moves") {
                process_rows(n, runs, peer, &bins, &dirs, &probe);
            }
            moves_rows(n, runs, peer, &bins, &move_dirs, &probe, gap);
        }
        if !lib_rows {
            continue;
        }
        let ours = (only.as_deref() != Some("reparse")).then(|| storm(WatchMode::Fanotify, &dirs));
        ours.iter().for_each(|o| row("volring", o));
        let base = (only.as_deref() != Some("volring")).then(|| storm(WatchMode::Reparse, &dirs));
        base.iter().for_each(|o| row("reparse", o));
        let (Some(ours), Some(base)) = (ours, base) else { continue };
        println!(
            "{:>7} ratio: volring sees {:.1}x the events for {:.3}x the CPU of a re-parse watcher",
            n,
            ours.seen as f64 / base.seen.max(1) as f64,
            ours.cpu.as_secs_f64() / base.cpu.as_secs_f64().max(1e-9)
        );
    }
}

/// Mount moves `gap` apart under each volring binary and the C peer, `runs`
/// rounds in rotating order: how many kernel moves each reported as `moved`
/// lines (medians, min–max) and its CPU per move.
fn moves_rows(
    n: usize,
    runs: usize,
    peer: &std::path::Path,
    bins: &[(String, PathBuf)],
    dirs: &[PathBuf],
    probe: &std::path::Path,
    gap: Duration,
) {
    let expected = dirs.len() - 1;
    let k = bins.len() + 1;
    let mut costs: Vec<Vec<process_storm::Cost>> = vec![Vec::new(); k];
    for round in 0..runs {
        for j in 0..k {
            let who = (round + j) % k;
            let mut cmd = contestant(bins, peer, who);
            match process_storm::move_storm(&mut cmd, dirs, probe, gap) {
                Ok(c) => costs[who].push(c),
                Err(e) => println!("{n:>7} moves round {round}: {} failed: {e}", bins.get(who).map_or("C", |b| b.0.as_str())),
            }
        }
    }
    for (i, name) in bins.iter().map(|b| b.0.as_str()).chain(["C"]).enumerate() {
        let v = &costs[i];
        if v.is_empty() {
            continue;
        }
        let seen: Vec<f64> = v.iter().map(|c| c.moved as f64).collect();
        let (lo, hi) = (seen.iter().copied().fold(f64::MAX, f64::min), seen.iter().copied().fold(0.0, f64::max));
        let cpu_ms = median(v.iter().map(|c| c.cpu.as_secs_f64() * 1e3).collect());
        println!(
            "{n:>7} moves {name:>7} ({} rounds, {} us apart): moved lines {:.0}/{expected} median ({lo:.0}-{hi:.0}); {cpu_ms:.1} ms CPU, {:.1} us per move",
            v.len(),
            gap.as_micros(),
            median(seen.clone()),
            cpu_ms * 1e3 / expected as f64,
        );
    }
}

/// The command that starts contestant `who`: a volring binary watching in
/// fanotify mode, or (past the binaries) the C peer.
fn contestant(bins: &[(String, PathBuf)], peer: &std::path::Path, who: usize) -> std::process::Command {
    match bins.get(who) {
        Some((_, bin)) => {
            let mut c = std::process::Command::new(bin);
            c.args(["mounts", "--watch", "--mount-watch", "fanotify"]);
            c
        }
        None => std::process::Command::new(peer),
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    support::pct(&v, 0.5)
}

/// The volring binaries the process rows measure: this build's, or two
/// given as `A:B` (`--volring-bin` or `VOLRING_BENCH_BIN`), e.g. a build of
/// main against this one, measured in the same run.
fn volring_bins(args: &[String]) -> Vec<(String, PathBuf)> {
    let given = args.iter().position(|a| a == "--volring-bin").and_then(|i| args.get(i + 1)).cloned();
    match given.or_else(|| std::env::var("VOLRING_BENCH_BIN").ok()) {
        Some(ab) => {
            let (a, b) = ab.split_once(':').expect("--volring-bin wants A:B (two paths)");
            vec![("A".to_string(), PathBuf::from(a)), ("B".to_string(), PathBuf::from(b))]
        }
        None => vec![("volring".to_string(), PathBuf::from(env!("CARGO_BIN_EXE_volring")))],
    }
}

/// `runs` rounds; in each, every volring binary and the C peer take one
/// storm, in an order that rotates from round to round. Prints medians over
/// the rounds and the median of each round's ratio to the C peer.
fn process_rows(n: usize, runs: usize, peer: &std::path::Path, bins: &[(String, PathBuf)], dirs: &[PathBuf], probe: &std::path::Path) {
    let expected = 2 * dirs.len();
    let k = bins.len() + 1; // the C peer is contestant `bins.len()`
    let mut costs: Vec<Vec<process_storm::Cost>> = vec![Vec::new(); k];
    for round in 0..runs {
        let mut got = Vec::with_capacity(k);
        for j in 0..k {
            let who = (round + j) % k;
            let mut cmd = contestant(bins, peer, who);
            got.push((who, process_storm::storm(&mut cmd, dirs, probe)));
        }
        if let Some((who, Err(e))) = got.iter().find(|(_, r)| r.is_err()) {
            let name = bins.get(*who).map_or("C", |b| b.0.as_str());
            println!("{n:>7} round {round} dropped: {name} failed: {e}");
            continue;
        }
        for (who, r) in got {
            costs[who].push(r.expect("checked"));
        }
    }
    let c = &costs[bins.len()];
    if c.is_empty() {
        return;
    }
    let ms = |v: &[process_storm::Cost]| median(v.iter().map(|c| c.cpu.as_secs_f64() * 1e3).collect());
    let stat = |v: &[process_storm::Cost], f: &dyn Fn(&process_storm::Cost) -> f64| median(v.iter().map(f).collect());
    for (i, name) in bins.iter().map(|b| b.0.as_str()).chain(["C"]).enumerate() {
        let v = &costs[i];
        let ratios: Vec<f64> = v.iter().zip(c).map(|(a, b)| a.cpu.as_secs_f64() / b.cpu.as_secs_f64().max(1e-9)).collect();
        let all: Vec<String> = ratios.iter().map(|r| format!("{r:.2}")).collect();
        println!(
            "{n:>7} process {name:>7} ({} rounds, medians): {:.1} ms CPU, {:.2}x C (per round: {}); {:.1} us CPU per change; ctx switches {:.0}; lines {:.0}/{expected}; latency p50 {:.0} us, p99 {:.0} us",
            v.len(),
            ms(v),
            median(ratios),
            all.join(" "),
            ms(v) * 1e3 / expected as f64,
            stat(v, &|c| c.switches as f64),
            stat(v, &|c| c.lines as f64),
            stat(v, &|c| support::pct(&c.latency_us, 0.50)),
            stat(v, &|c| support::pct(&c.latency_us, 0.99)),
        );
    }
    if let [(a, _), (b, _)] = bins {
        let ratios: Vec<f64> = costs[1].iter().zip(&costs[0]).map(|(y, x)| y.cpu.as_secs_f64() / x.cpu.as_secs_f64().max(1e-9)).collect();
        println!("{n:>7} process {b} / {a}: {:.2}x CPU (median of per-round ratios)", median(ratios));
    }
    for (name, bin) in bins {
        println!("{n:>7} process {name:>7} = {}", bin.display());
    }
}
