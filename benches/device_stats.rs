//! Counter collection at scale: attaches N loop devices (1,000 and 4,096 by
//! default) and prints, in one run, the median time of one collection of
//! all their counters per method, and the ratios to the fastest.
//!
//! `cargo bench --bench device_stats -- [--sizes 1000,4096] [--rounds 15]`
//!
//! Every device made is detached and removed at the end (also on panic);
//! devices that existed before the run are left as they were.

use std::collections::HashSet;
use std::os::fd::AsFd;
use std::sync::Arc;
use std::time::{Duration, Instant};

use volring_devices::{StatMethod, StatSource};
use volring_mounts::DevNum;
use volring_ring::BackendChoice;
use volring_sys::loopdev::{self, LoopDevice, LoopOptions};

/// N loop devices over one sparse file; detached and removed on drop.
struct LoopFarm {
    devices: Vec<LoopDevice>,
    existed: HashSet<u32>,
    _file: tempfile::NamedTempFile,
}

impl LoopFarm {
    fn new(n: usize) -> Self {
        let existed = existing_loops();
        let file = tempfile::Builder::new().prefix("volring-bench-").tempfile().expect("backing file");
        file.as_file().set_len(1 << 20).expect("truncate");
        let opts = LoopOptions { read_only: true, autoclear: true, ..Default::default() };
        let mut farm = Self { devices: Vec::with_capacity(n), existed, _file: file };
        for _ in 0..n {
            farm.devices.push(LoopDevice::attach(farm._file.as_file().as_fd(), &opts).expect("attach"));
        }
        farm
    }

    fn tracked(&self) -> Vec<(DevNum, Arc<str>)> {
        self.devices.iter().map(|d| (DevNum { major: 7, minor: d.number() }, Arc::from(format!("loop{}", d.number()).as_str()))).collect()
    }
}

impl Drop for LoopFarm {
    fn drop(&mut self) {
        let made: Vec<u32> = self.devices.iter().map(|d| d.number()).filter(|n| !self.existed.contains(n)).collect();
        // Closing detaches (autoclear).
        self.devices.clear();
        // Removal waits on an RCU grace period per device: in parallel.
        let chunks: Vec<Vec<u32>> = made.chunks(made.len().div_ceil(64).max(1)).map(<[u32]>::to_vec).collect();
        std::thread::scope(|s| {
            for c in chunks {
                s.spawn(move || {
                    for n in c {
                        for _ in 0..200 {
                            if loopdev::remove(n).is_ok() {
                                break;
                            }
                            std::thread::sleep(Duration::from_millis(5));
                        }
                    }
                });
            }
        });
    }
}

fn existing_loops() -> HashSet<u32> {
    std::fs::read_dir("/sys/block")
        .map(|rd| rd.filter_map(|e| e.ok()?.file_name().to_str()?.strip_prefix("loop")?.parse().ok()).collect())
        .unwrap_or_default()
}

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

/// io-wq workers of this process: how many threads the kernel started to
/// serve ring reads that could not be done inline.
fn iou_workers() -> usize {
    std::fs::read_dir("/proc/self/task")
        .map(|rd| rd.filter_map(|e| std::fs::read_to_string(e.ok()?.path().join("comm")).ok()).filter(|c| c.starts_with("iou-wrk")).count())
        .unwrap_or(0)
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let arg = |name: &str| args.iter().position(|a| a == name).and_then(|i| args.get(i + 1)).cloned();
    let sizes: Vec<usize> = arg("--sizes").unwrap_or_else(|| "1000,4096".into()).split(',').map(|s| s.parse().expect("size")).collect();
    let rounds: usize = arg("--rounds").map(|s| s.parse().expect("rounds")).unwrap_or(15);
    let system = std::fs::read_to_string("/proc/diskstats").map(|s| s.lines().count()).unwrap_or(0);
    println!("device_stats: {rounds} rounds per method, median of one collection of all devices ({system} devices in the system before)");
    for n in sizes {
        let t = Instant::now();
        let farm = LoopFarm::new(n);
        println!("\n{n} loop devices attached in {:.2} s", t.elapsed().as_secs_f64());
        let mut src = StatSource::new(farm.tracked(), BackendChoice::IoUring).expect("stat source");
        let methods = [StatMethod::Diskstats, StatMethod::Ring, StatMethod::Pread, StatMethod::OpenRead];
        let mut results = Vec::new();
        for m in methods {
            let s = src.read(m).expect("warm-up read");
            let bad = s.iter().filter(|(_, _, r)| r.is_err()).count();
            assert_eq!(bad, 0, "{m:?}: {bad} devices unread");
            let times: Vec<Duration> = (0..rounds)
                .map(|_| {
                    let t = Instant::now();
                    std::hint::black_box(src.read(m).expect("read"));
                    t.elapsed()
                })
                .collect();
            results.push((m, median(times)));
        }
        let best = results.iter().map(|r| r.1).min().expect("methods");
        for (m, t) in &results {
            println!("  {:<10} {:>8.3} ms  {:>5.2}x the fastest", m, t.as_secs_f64() * 1e3, t.as_secs_f64() / best.as_secs_f64());
        }
        // The methods `auto` chooses among, timed the way the collector's
        // calibration times them (the median of three reads each). This is
        // the bench's own measurement, not the collector's pick read back.
        let timed = |m: StatMethod, src: &mut StatSource| {
            let times = (0..3)
                .map(|_| {
                    let t = Instant::now();
                    std::hint::black_box(src.read(m).expect("read"));
                    t.elapsed()
                })
                .collect();
            (m, median(times))
        };
        let auto = [StatMethod::Diskstats, StatMethod::Ring, StatMethod::Pread].map(|m| timed(m, &mut src));
        let chosen = auto.iter().min_by_key(|&&(_, t)| t).expect("methods").0;
        println!("  timed as auto times them, {chosen} is the fastest here; {} io-wq workers served the ring's reads", iou_workers());
        let t = Instant::now();
        drop(src);
        drop(farm);
        println!("  (detached and removed in {:.2} s)", t.elapsed().as_secs_f64());
    }
}
