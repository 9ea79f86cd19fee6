//! The CLI against the tools it stands in for, in the same run: CPU of
//! `volring devices --no-probe` beside `lsblk`, and of `volring mounts
//! --tree` beside `findmnt`, each a whole process measured by `perf stat`'s
//! task-clock (every thread, exact, unlike rusage's ticks).
//!
//! In a private mount namespace it first makes the node busy the way a
//! storage node is: `--loops` loop devices (default 231, so about 235 block
//! devices with the machine's own) and `--mounts` tmpfs mounts (default
//! 200, some nested). Then `--rounds` rounds (default 15), each running the
//! four commands once, the order rotating every round, stdout to
//! /dev/null. It prints each command's median, min and max CPU, and the
//! ratios of the medians (goal: at most 1.0 each). Everything it made is
//! removed at the end, also on failure.
//!
//! `cargo bench --bench cli_vs_util [-- --rounds 15 --loops 231 --mounts 200]` (root, perf, lsblk, findmnt)

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

const VOLRING: &str = env!("CARGO_BIN_EXE_volring");

struct Opts {
    rounds: usize,
    loops: usize,
    mounts: usize,
}

fn opts() -> Opts {
    let mut o = Opts { rounds: 15, loops: 231, mounts: 200 };
    let args: Vec<String> = std::env::args().collect();
    let mut i = 1;
    while i < args.len() {
        let value = args.get(i + 1).and_then(|v| v.parse().ok());
        match (args[i].as_str(), value) {
            ("--rounds", Some(v)) => o.rounds = v,
            ("--loops", Some(v)) => o.loops = v,
            ("--mounts", Some(v)) => o.mounts = v,
            // cargo bench passes --bench; anything else is ignored.
            _ => {
                i += 1;
                continue;
            }
        }
        i += 2;
    }
    o.rounds = o.rounds.clamp(1, 1000);
    o.loops = o.loops.min(4000);
    o.mounts = o.mounts.min(20_000);
    o
}

/// What the bench made; removed on drop (loop devices detached, the
/// scratch tmpfs and its mounts go with the namespace and the directory).
struct Made {
    dir: tempfile::TempDir,
    loops: Vec<String>,
}

impl Drop for Made {
    fn drop(&mut self) {
        for l in &self.loops {
            let _ = Command::new("losetup").arg("-d").arg(l).status();
        }
        let _ = Command::new("umount").arg("-R").arg("-l").arg(self.dir.path()).status();
    }
}

fn setup(o: &Opts) -> Made {
    volring_sys::ns::enter_private_mount_namespace().expect("private mount namespace (run as root)");
    let dir = tempfile::Builder::new().prefix("volring-bench-").tempdir().expect("tempdir");
    let mut made = Made { dir, loops: Vec::new() };
    let root = made.dir.path().to_path_buf();
    let ok = Command::new("mount").args(["-t", "tmpfs", "-o", "size=64m", "bench"]).arg(&root).status().is_ok_and(|s| s.success());
    assert!(ok, "mount the scratch tmpfs");
    for i in 0..o.loops {
        let image = root.join(format!("img{i}"));
        std::fs::File::create(&image).and_then(|f| f.set_len(1 << 20)).expect("image");
        let out = Command::new("losetup").arg("--find").arg("--show").arg(&image).output().expect("losetup");
        assert!(out.status.success(), "losetup: {}", String::from_utf8_lossy(&out.stderr));
        made.loops.push(String::from_utf8_lossy(&out.stdout).trim().to_string());
    }
    let mut parent: PathBuf = root.join("m");
    for i in 0..o.mounts {
        // Every tenth mount starts a new top; the others nest one below
        // the last, so the tree has depth.
        let at = if i % 10 == 0 { root.join(format!("m{i}")) } else { parent.join(format!("n{i}")) };
        std::fs::create_dir_all(&at).expect("mkdir");
        let ok = Command::new("mount").args(["-t", "tmpfs", "-o", "size=64k", "benchm"]).arg(&at).status().is_ok_and(|s| s.success());
        assert!(ok, "mount {}", at.display());
        parent = at;
    }
    made
}

/// CPU milliseconds of one run of `cmd`, by perf stat's task-clock.
fn cpu_ms(cmd: &[&str], out: &Path) -> f64 {
    let status = Command::new("perf")
        .args(["stat", "-x,", "-e", "task-clock", "-o"])
        .arg(out)
        .arg("--")
        .args(cmd)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .expect("perf stat (apt-get install linux-perf)");
    assert!(status.success(), "{cmd:?} failed");
    let text = std::fs::read_to_string(out).expect("perf output");
    text.lines()
        .find(|l| l.contains("task-clock"))
        .and_then(|l| l.split(',').next()?.parse().ok())
        .unwrap_or_else(|| panic!("no task-clock in {text}"))
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

fn main() {
    let o = opts();
    let made = setup(&o);
    let devices = std::fs::read_dir("/sys/block").map(|d| d.count()).unwrap_or(0);
    let mounts = std::fs::read_to_string("/proc/self/mountinfo").map(|t| t.lines().count()).unwrap_or(0);
    let commands: [(&str, Vec<&str>); 4] = [
        ("volring devices --no-probe", vec![VOLRING, "devices", "--no-probe"]),
        ("lsblk", vec!["lsblk"]),
        ("volring mounts --tree", vec![VOLRING, "mounts", "--tree"]),
        ("findmnt", vec!["findmnt"]),
    ];
    let perf_out = made.dir.path().join("perf.txt");
    let mut cpu: Vec<Vec<f64>> = vec![Vec::new(); commands.len()];
    for round in 0..o.rounds {
        for k in 0..commands.len() {
            let i = (k + round) % commands.len();
            cpu[i].push(cpu_ms(&commands[i].1, &perf_out));
        }
    }
    println!("{devices} block devices, {mounts} mounts, {} interleaved rounds; CPU per run (perf stat task-clock, ms)", o.rounds);
    println!("{:<28} {:>8} {:>8} {:>8}", "command", "median", "min", "max");
    let mut medians = Vec::new();
    for (i, (name, _)) in commands.iter().enumerate() {
        let (min, max) = cpu[i].iter().fold((f64::MAX, 0.0f64), |(a, b), &x| (a.min(x), b.max(x)));
        let m = median(&mut cpu[i]);
        medians.push(m);
        println!("{name:<28} {m:>8.2} {min:>8.2} {max:>8.2}");
    }
    println!("devices --no-probe / lsblk:   {:.2}x", medians[0] / medians[1]);
    println!("mounts --tree / findmnt:      {:.2}x", medians[2] / medians[3]);
    drop(made);
}
