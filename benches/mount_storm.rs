//! Mount storm: volring's watcher against a full re-parse watcher, same run.
//!
//! In a private mount namespace holding N mounts (default 1,000 / 10,000 /
//! 20,000), 1,000 short-lived mounts (mount(2) then umount(2) at once) are
//! made under each watcher in turn. For each it prints how many of the 1,000
//! attaches it reported, its ring thread's CPU time for the storm, and the
//! latency from mount(2) returning to the event reaching a consumer thread.
//!
//! `cargo bench --bench mount_storm [-- --sizes 1000,10000 --pairs 1000 --watcher volring|reparse]` (root)

mod support;

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rustix::fs::{statx, AtFlags, StatxFlags, CWD};
use rustix::mount::{mount, unmount, MountFlags, UnmountFlags};
use volring::mounts::{EventKind, MountWatcher, WatchConfig, WatchMode};

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
    volring::sys::ns::enter_private_mount_namespace().expect("private mount namespace (run as root)");
    let mut farm = support::MountFarm::new();
    let dirs: Vec<PathBuf> = (0..pairs).map(|i| farm.dir(&format!("storm/s{i}"))).collect();
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
