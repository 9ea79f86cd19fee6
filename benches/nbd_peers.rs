//! volring's NBD server against nbdkit and qemu-nbd on the same image,
//! driven by the same client (fio's nbd engine, libnbd), interleaved round
//! by round, printing medians and the ratios; then 10,000 idle connections
//! held by volring and its resident memory.
//!
//! Placement is the same for every server: the server on CPU 1, fio on
//! CPU 0 (on 2 cores, unpinned runs measure the scheduler as much as the
//! servers: client and server land on one core in some runs and not others).
//! VOLRING_BENCH_UNPINNED=1 lets both run on either CPU instead.
//!
//! Last, hostile clients against volring's default limits: its peak
//! resident memory while they sit, and once they left.
//!
//! `cargo bench --bench nbd_peers` (VOLRING_BENCH_SECS per run, default 5;
//! VOLRING_BENCH_ROUNDS, default 3; VOLRING_BENCH_IDLE_ONLY=1 for just the
//! idle connections, VOLRING_BENCH_HOSTILE_ONLY=1 for just the hostile ones).
//! VOLRING_BENCH_POOLS=ext4,xfs puts the image on each of those file
//! systems (a loop device mounted in a private mount namespace; default:
//! the temporary directory's own), VOLRING_BENCH_ONLY=reads|writes runs one
//! half of the workloads (qd1: the two rows at queue depth 1), VOLRING_BENCH_PEERS=volring,nbdkit leaves the
//! others out. The volring child inherits VOLRING_NBD_* settings.
//! VOLRING_BENCH_BASELINE=/path/to/an/older/volring adds that binary as
//! one more peer, "baseline" (served exactly as volring is), for a
//! before/after comparison measured in the same run; a second path after
//! a comma is one more such peer, "baseline2".
//!
//! "floor" is a peer too: the least a server can do (benches/support/
//! nbd_floor.rs, std only, a thread per connection: recv, pwrite/pread,
//! one write of a batch's replies), served by this binary itself; every
//! row prints each server's CPU per op and throughput against it.
//! Unpinned, "floor-1cpu" is the same floor held to CPU 1: one CPU at a
//! time, as a server that serves every connection from one thread is. The
//! floor's threads otherwise each run beside their own client, and skip
//! the cross-CPU wakeups and copies a single thread pays for the clients
//! on the other CPU (docs/benchmarks.md, issue 30's ninth pass).
//! `--background-load N` (or VOLRING_BENCH_BACKGROUND_LOAD=N) runs N plain
//! CPU spinners at default priority during every round; each row prints
//! the load average beside it. QD1 rows print p99/p99.9 completion latency.

#[path = "support/hostile.rs"]
mod hostile;
#[path = "support/load.rs"]
mod load;
#[path = "support/nbd_floor.rs"]
mod nbd_floor;

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const IMAGE: u64 = 1 << 30;

struct Peer {
    name: &'static str,
    socket: PathBuf,
    child: Child,
}

impl Drop for Peer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn have(tool: &str) -> bool {
    Command::new("sh").args(["-c", &format!("command -v {tool}")]).stdout(Stdio::null()).status().is_ok_and(|s| s.success())
}

fn wait_for(socket: &Path) {
    let start = Instant::now();
    while UnixStream::connect(socket).is_err() {
        assert!(start.elapsed() < Duration::from_secs(20), "{} never came up", socket.display());
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn start(name: &'static str, dir: &Path, img: &Path, cpus: &str) -> Peer {
    let socket = dir.join(format!("{name}.sock"));
    let img = img.to_str().expect("utf-8 path");
    let sock = socket.to_str().expect("utf-8 path");
    let volring = env!("CARGO_BIN_EXE_volring");
    let spec = format!("disk={img}");
    let baselines = std::env::var("VOLRING_BENCH_BASELINE").unwrap_or_default();
    let mut baselines = baselines.split(',').map(str::to_string);
    let (baseline, baseline2) = (baselines.next().unwrap_or_default(), baselines.next().unwrap_or_default());
    let own = std::env::current_exe().expect("the bench's own path").to_str().expect("utf-8 path").to_string();
    let args: Vec<&str> = match name {
        "volring" => vec![volring, "nbd", "serve", "--nbd-threads", "1", "--unix", sock, "--export", &spec],
        "baseline" => vec![&baseline, "nbd", "serve", "--nbd-threads", "1", "--unix", sock, "--export", &spec],
        "baseline2" => vec![&baseline2, "nbd", "serve", "--nbd-threads", "1", "--unix", sock, "--export", &spec],
        "floor" | "floor-1cpu" => vec![&own, "--nbd-floor", sock, img],
        "nbdkit" => vec!["nbdkit", "-f", "-U", sock, "-t", "16", "file", img],
        "qemu-nbd-uring" => {
            vec!["qemu-nbd", "-t", "-f", "raw", "-x", "disk", "-k", sock, "-e", "8", "--cache=writeback", "--aio=io_uring", img]
        }
        _ => vec!["qemu-nbd", "-t", "-f", "raw", "-x", "disk", "-k", sock, "-e", "8", "--cache=writeback", img],
    };
    let cpus = if name == "floor-1cpu" { "1" } else { cpus };
    let mut child = Command::new("taskset")
        .arg("-c")
        .arg(cpus)
        .args(&args)
        .stdin(Stdio::null())
        .stdout(if name.starts_with("volring") || name.starts_with("baseline") { Stdio::piped() } else { Stdio::null() })
        .stderr(Stdio::null())
        .spawn()
        .unwrap_or_else(|e| panic!("{name}: {e}"));
    if let Some(out) = child.stdout.take() {
        // volring says so once its exports are in place.
        let mut line = String::new();
        let _ = std::io::BufRead::read_line(&mut std::io::BufReader::new(out), &mut line);
        assert!(line.contains("listening"), "volring said {line:?}");
    }
    wait_for(&socket);
    Peer { name, socket, child }
}

struct Workload {
    label: &'static str,
    rw: &'static str,
    bs: &'static str,
    depth: u32,
    jobs: u32,
    /// Report bytes per second instead of IOPS.
    bandwidth: bool,
}

const WORKLOADS: [Workload; 8] = [
    Workload { label: "4 KiB random read, QD1, 1 connection", rw: "randread", bs: "4k", depth: 1, jobs: 1, bandwidth: false },
    Workload { label: "4 KiB random read, QD32, 1 connection", rw: "randread", bs: "4k", depth: 32, jobs: 1, bandwidth: false },
    Workload { label: "4 KiB random read, 4 connections x QD8", rw: "randread", bs: "4k", depth: 8, jobs: 4, bandwidth: false },
    Workload { label: "1 MiB sequential read, QD8", rw: "read", bs: "1M", depth: 8, jobs: 1, bandwidth: true },
    Workload { label: "4 KiB random write, QD1, 1 connection", rw: "randwrite", bs: "4k", depth: 1, jobs: 1, bandwidth: false },
    Workload { label: "4 KiB random write, QD32, 1 connection", rw: "randwrite", bs: "4k", depth: 32, jobs: 1, bandwidth: false },
    Workload { label: "4 KiB random write, 4 connections x QD8", rw: "randwrite", bs: "4k", depth: 8, jobs: 4, bandwidth: false },
    Workload { label: "1 MiB sequential write, QD8", rw: "write", bs: "1M", depth: 8, jobs: 1, bandwidth: true },
];

/// A file system on a loop device, mounted for the image (unmounted by
/// the private mount namespace going away with the process, or on drop).
struct Pool {
    mount: PathBuf,
}

impl Pool {
    fn new(dir: &Path, fs: &str) -> Pool {
        let backing = dir.join(format!("pool-{fs}.img"));
        std::fs::File::create(&backing).and_then(|f| f.set_len(4 * IMAGE)).expect("pool backing file");
        let force = if fs == "xfs" { "-f" } else { "-F" };
        let ok = Command::new(format!("mkfs.{fs}")).args(["-q", force]).arg(&backing).status().is_ok_and(|s| s.success());
        assert!(ok, "mkfs.{fs} failed");
        let mount = dir.join(format!("pool-{fs}"));
        std::fs::create_dir_all(&mount).expect("mount point");
        let ok = Command::new("mount").args(["-o", "loop"]).arg(&backing).arg(&mount).status().is_ok_and(|s| s.success());
        assert!(ok, "mount {fs} pool failed");
        Pool { mount }
    }
}

impl Drop for Pool {
    fn drop(&mut self) {
        // Lazily: the servers' exit may still be releasing the image.
        let _ = Command::new("umount").arg("-l").arg(&self.mount).status();
    }
}

/// Writes the image: random contents, synced, then read once so every
/// server reads from the page cache.
fn make_image(img: &Path) {
    let mut f = std::fs::File::create(img).expect("image");
    let mut block = vec![0u8; 1 << 20];
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    for _ in 0..(IMAGE >> 20) {
        for b in block.chunks_exact_mut(8) {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            b.copy_from_slice(&x.to_le_bytes());
        }
        f.write_all(&block).expect("write image");
    }
    f.sync_all().expect("sync");
    warm(img);
}

/// Reads the image through once, so the run that follows reads it from
/// the page cache: a DAMON pageout scheme (kdamond) evicted half of
/// it between rounds, and a server measured then read from the disk.
fn warm(img: &Path) {
    let Ok(mut f) = std::fs::File::open(img) else { return };
    let mut block = vec![0u8; 1 << 20];
    while f.read(&mut block).is_ok_and(|n| n > 0) {}
}

/// CPU time (user + system, all threads) a process has used, in seconds.
fn cpu_seconds(pid: u32) -> f64 {
    // utime and stime are fields 14 and 15 of the line.
    stat_seconds(&format!("/proc/{pid}/stat"), 14, 15)
}

/// The sum of two clock-tick fields of a /proc stat line (numbered as in
/// proc(5)), in seconds.
fn stat_seconds(path: &str, a: usize, b: usize) -> f64 {
    let stat = std::fs::read_to_string(path).unwrap_or_default();
    // Fields after the command name (which may hold spaces) start at ") ",
    // with field 3.
    let rest = stat.rsplit_once(") ").map_or("", |(_, r)| r);
    let f: Vec<u64> = rest.split_whitespace().map(|x| x.parse().unwrap_or(0)).collect();
    let field = |n: usize| f.get(n - 3).copied().unwrap_or(0);
    (field(a) + field(b)) as f64 / 100.0 // USER_HZ on Linux
}

/// One fio run.
struct Sample {
    /// IOPS, or bytes per second.
    rate: f64,
    /// Server CPU seconds per operation.
    cpu: f64,
    /// fio's CPU seconds per operation: what the server's way of
    /// answering costs its client (a reply read in two receives, say).
    /// Where fio is not busy (QD1) it mostly follows the latency: a client
    /// that waits longer per request pays more for its sleeps and
    /// wake-ups, so read it with `client_cpus`.
    client_cpu: f64,
    /// fio's CPU seconds per second of the run.
    client_cpus: f64,
    /// Completion latency percentiles 99 and 99.9, µs.
    p99: f64,
    p999: f64,
}

fn fio(peer: &Peer, w: &Workload, secs: u64) -> Sample {
    let cpu_before = cpu_seconds(peer.child.id());
    let client_before = children_cpu_seconds();
    let uri = format!("nbd+unix:///disk?socket={}", peer.socket.display());
    let out = Command::new("taskset")
        .args(["-c", placement().1, "fio", "--name=bench", "--ioengine=nbd", "--output-format=json", "--time_based", "--group_reporting"])
        .arg(format!("--uri={uri}"))
        .arg(format!("--rw={}", w.rw))
        .arg(format!("--bs={}", w.bs))
        .arg(format!("--iodepth={}", w.depth))
        .arg(format!("--numjobs={}", w.jobs))
        .arg(format!("--runtime={secs}"))
        .arg(format!("--size={IMAGE}"))
        .output()
        .expect("fio");
    // fio may print notes before its JSON document.
    let text = String::from_utf8_lossy(&out.stdout);
    let json = if text.starts_with('{') { &text[..] } else { text.find("\n{").map_or(&text[..], |i| &text[i + 1..]) };
    let v: serde_json::Value =
        serde_json::from_str(json).unwrap_or_else(|e| panic!("fio output ({e}): {text}\n{}", String::from_utf8_lossy(&out.stderr)));
    let cpu = cpu_seconds(peer.child.id()) - cpu_before;
    let client_cpu = children_cpu_seconds() - client_before;
    let dir = if w.rw.contains("write") { "write" } else { "read" };
    let job = &v["jobs"][0][dir];
    let ops = job["total_ios"].as_f64().unwrap_or(0.0).max(1.0);
    let rate = if w.bandwidth { job["bw_bytes"].as_f64().unwrap_or(0.0) } else { job["iops"].as_f64().unwrap_or(0.0) };
    let pct = |p: &str| job["clat_ns"]["percentile"][p].as_f64().unwrap_or(f64::NAN) / 1e3;
    let client_cpus = client_cpu / secs as f64;
    Sample { rate, cpu: cpu / ops, client_cpu: client_cpu / ops, client_cpus, p99: pct("99.000000"), p999: pct("99.900000") }
}

/// CPU seconds of every child reaped so far, theirs included (cutime and
/// cstime of /proc/self/stat): fio, whose job processes are its children,
/// is the only child reaped while a round runs; the servers and spinners
/// are reaped at the end.
fn children_cpu_seconds() -> f64 {
    stat_seconds("/proc/self/stat", 16, 17)
}

/// CPUs of the servers and of fio: apart by default; both on CPUs 0-1
/// with VOLRING_BENCH_UNPINNED=1. Unpinned, a server can run on the
/// client's CPU between its requests and skip the cross-CPU wakeup a
/// pinned server pays on every one, which is most of a QD1 read's CPU time
/// on this kind of machine: the two placements give different ratios
/// against nbdkit (issue 12's first figures were unpinned).
fn placement() -> (&'static str, &'static str) {
    if unpinned() {
        ("0-1", "0-1")
    } else {
        ("1", "0")
    }
}

fn unpinned() -> bool {
    std::env::var_os("VOLRING_BENCH_UNPINNED").is_some_and(|v| v == "1")
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

fn show(v: f64, bandwidth: bool) -> String {
    if bandwidth {
        format!("{:.2} GB/s", v / 1e9)
    } else {
        format!("{:.1}k IOPS", v / 1e3)
    }
}

/// Negotiates one connection into transmission (GO on "disk") and keeps it.
fn idle_connection(socket: &Path) -> std::io::Result<UnixStream> {
    let mut s = UnixStream::connect(socket)?;
    s.set_read_timeout(Some(Duration::from_secs(30)))?;
    let mut greeting = [0u8; 18];
    s.read_exact(&mut greeting)?;
    let mut msg = 3u32.to_be_bytes().to_vec();
    msg.extend_from_slice(&0x4948_4156_454f_5054u64.to_be_bytes());
    msg.extend_from_slice(&7u32.to_be_bytes());
    msg.extend_from_slice(&10u32.to_be_bytes());
    msg.extend_from_slice(&4u32.to_be_bytes());
    msg.extend_from_slice(b"disk");
    msg.extend_from_slice(&0u16.to_be_bytes());
    s.write_all(&msg)?;
    loop {
        let mut h = [0u8; 20];
        s.read_exact(&mut h)?;
        let kind = u32::from_be_bytes(h[12..16].try_into().expect("4 bytes"));
        let mut d = vec![0u8; u32::from_be_bytes(h[16..20].try_into().expect("4 bytes")) as usize];
        s.read_exact(&mut d)?;
        match kind {
            1 => return Ok(s),
            3 => continue,
            k => return Err(std::io::Error::other(format!("GO refused: {k:#x}"))),
        }
    }
}

fn rss_kib(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| s.lines().find(|l| l.starts_with("VmRSS:")).and_then(|l| l.split_whitespace().nth(1)?.parse().ok()))
        .unwrap_or(0)
}

fn idle_connections(dir: &Path, img: &Path, n: usize) {
    // Room for the client ends here (the server raises its own limit); the
    // hard limit may not be raisable (no CAP_SYS_RESOURCE), so stay under it.
    let mut limit = rustix::process::getrlimit(rustix::process::Resource::Nofile);
    let want = n as u64 + 512;
    if limit.maximum.is_some_and(|m| m < want) {
        println!("idle connections: RLIMIT_NOFILE hard limit {:?} < {want}; skipped", limit.maximum);
        return;
    }
    limit.current = Some(want.max(limit.current.unwrap_or(0)));
    if let Err(e) = rustix::process::setrlimit(rustix::process::Resource::Nofile, limit) {
        println!("idle connections: cannot raise RLIMIT_NOFILE ({e}); skipped");
        return;
    }
    let peer = start("volring", dir, img, "0-1");
    let before = rss_kib(peer.child.id());
    let started = Instant::now();
    let mut conns = Vec::with_capacity(n);
    for i in 0..n {
        match idle_connection(&peer.socket) {
            Ok(c) => conns.push(c),
            Err(e) => {
                println!("idle connections: connection {i} failed: {e}");
                break;
            }
        }
    }
    let took = started.elapsed();
    std::thread::sleep(Duration::from_millis(500));
    let after = rss_kib(peer.child.id());
    // Still serving: one more client reads through all of this.
    let alive = idle_connection(&peer.socket).is_ok();
    println!(
        "{} idle connections (each through GO): volring RSS {:.1} MiB (was {:.1} MiB with none; {:.2} KiB per connection); set up in {:.2} s; new clients still served: {alive}",
        conns.len(),
        after as f64 / 1024.0,
        before as f64 / 1024.0,
        (after.saturating_sub(before)) as f64 / conns.len().max(1) as f64,
        took.as_secs_f64()
    );
    println!("target: <= 32 MiB with 10,000 idle connections -> {}", if after <= 32 * 1024 { "met" } else { "NOT met" });
}

fn main() {
    // `cargo bench` passes --bench; `cargo test --benches` passes nothing we need.
    let args: Vec<String> = std::env::args().collect();
    if args.iter().any(|a| a == "--list") {
        return;
    }
    if args.get(1).is_some_and(|a| a == "--spin") {
        load::spin();
    }
    if let (Some("--nbd-floor"), Some(sock), Some(img)) = (args.get(1).map(String::as_str), args.get(2), args.get(3)) {
        if let Err(e) = nbd_floor::serve(Path::new(sock), Path::new(img)) {
            eprintln!("nbd floor server: {e}");
            std::process::exit(1);
        }
        return;
    }
    let missing: Vec<&str> = ["fio", "nbdkit", "qemu-nbd", "taskset"].into_iter().filter(|t| !have(t)).collect();
    if !missing.is_empty() {
        println!("nbd_peers: skipped, missing {missing:?} (apt-get install fio nbdkit qemu-utils util-linux)");
        return;
    }
    let secs: u64 = std::env::var("VOLRING_BENCH_SECS").ok().and_then(|s| s.parse().ok()).unwrap_or(5);
    let rounds: usize = std::env::var("VOLRING_BENCH_ROUNDS").ok().and_then(|s| s.parse().ok()).unwrap_or(3);
    let dir = tempfile::Builder::new().prefix("volring-nbd-bench-").tempdir().expect("tempdir");
    let img = dir.path().join("disk.img");
    let needs_image = std::env::var_os("VOLRING_BENCH_POOLS").is_none()
        || std::env::var_os("VOLRING_BENCH_IDLE_ONLY").is_some()
        || std::env::var_os("VOLRING_BENCH_HOSTILE_ONLY").is_some();
    if needs_image {
        make_image(&img);
    }
    if std::env::var_os("VOLRING_BENCH_IDLE_ONLY").is_some() {
        idle_connections(dir.path(), &img, 10_000);
        return;
    }
    if std::env::var_os("VOLRING_BENCH_HOSTILE_ONLY").is_some() {
        hostile::hostile_clients(dir.path(), &img);
        return;
    }
    let only = std::env::var("VOLRING_BENCH_ONLY").unwrap_or_default();
    let workloads: Vec<&Workload> = WORKLOADS
        .iter()
        .filter(|w| match only.as_str() {
            "reads" => !w.rw.contains("write"),
            "writes" => w.rw.contains("write"),
            "qd1" => w.depth == 1 && w.jobs == 1,
            _ => true,
        })
        .collect();
    let names = peers();
    // Stopped by PID when this goes out of scope, a panic included.
    let background = load::Background::start(load::requested());
    if background.len() > 0 {
        println!("background load: {} CPU spinners at default priority during every round", background.len());
    }
    match std::env::var("VOLRING_BENCH_POOLS") {
        Ok(pools) => {
            volring_sys::ns::enter_private_mount_namespace().expect("private mount namespace (run as root)");
            for fs in pools.split(',').filter(|f| !f.is_empty()) {
                let pool = Pool::new(dir.path(), fs);
                let img = pool.mount.join("disk.img");
                make_image(&img);
                compare(&format!("{fs} pool"), &names, &workloads, &pool.mount, &img, rounds, secs);
            }
        }
        Err(_) => compare("temporary directory's file system", &names, &workloads, dir.path(), &img, rounds, secs),
    }
    if !only.is_empty() {
        return;
    }
    if !needs_image {
        make_image(&img);
    }
    idle_connections(dir.path(), &img, 10_000);
    hostile::hostile_clients(dir.path(), &img);
}

/// The servers to compare, volring first: VOLRING_BENCH_PEERS (default:
/// all), a baseline for each path in VOLRING_BENCH_BASELINE, and
/// floor-1cpu only unpinned (pinned, the floor is on one CPU already).
fn peers() -> Vec<&'static str> {
    let all = ["volring", "baseline", "baseline2", "floor", "floor-1cpu", "nbdkit", "qemu-nbd-uring", "qemu-nbd"];
    let wanted = std::env::var("VOLRING_BENCH_PEERS").unwrap_or_default();
    let baseline = std::env::var("VOLRING_BENCH_BASELINE").unwrap_or_default();
    let named = |n: &str| wanted.is_empty() || wanted.split(',').any(|w| w == n);
    let names: Vec<&'static str> = all
        .into_iter()
        .filter(|n| match *n {
            "baseline" => !baseline.is_empty(),
            "baseline2" => baseline.contains(','),
            "floor-1cpu" => unpinned() && named(n),
            _ => named(n),
        })
        .collect();
    assert!(
        names.first() == Some(&"volring") && names.len() >= 2,
        "VOLRING_BENCH_PEERS must name volring and a peer (floor-1cpu runs only with VOLRING_BENCH_UNPINNED=1)"
    );
    names
}

/// Every workload against every server on one image, rounds interleaved.
fn compare(pool: &str, names: &[&'static str], workloads: &[&Workload], dir: &Path, img: &Path, rounds: usize, secs: u64) {
    let (server_cpus, fio_cpus) = placement();
    let peers: Vec<Peer> = names.iter().map(|n| start(n, dir, img, server_cpus)).collect();
    println!(
        "{pool}: NBD servers on CPUs {server_cpus}, fio (nbd engine) on CPUs {fio_cpus}; {rounds} interleaved rounds of {secs} s; medians"
    );
    for w in workloads {
        let mut samples: Vec<Vec<Sample>> = peers.iter().map(|_| Vec::new()).collect();
        let mut loads = Vec::new();
        for round in 0..rounds {
            // Rotate the order so no server always runs first or last.
            for k in 0..peers.len() {
                let i = (k + round) % peers.len();
                warm(img);
                samples[i].push(fio(&peers[i], w, secs));
                loads.push(load::loadavg());
            }
        }
        report(pool, w, &peers, &samples, &loads);
    }
}

/// One row: each server's medians (and the spread of its throughput over
/// the rounds), then the ratios against volring's and against the floor's.
fn report(pool: &str, w: &Workload, peers: &[Peer], samples: &[Vec<Sample>], loads: &[f64]) {
    let pick = |f: fn(&Sample) -> f64| -> Vec<f64> { samples.iter().map(|s| median(s.iter().map(f).collect())).collect() };
    let (med, cpu, p99, p999) = (pick(|s| s.rate), pick(|s| s.cpu), pick(|s| s.p99), pick(|s| s.p999));
    let (client, client_cpus) = (pick(|s| s.client_cpu), pick(|s| s.client_cpus));
    let (lo, hi) = loads.iter().fold((f64::MAX, 0f64), |(l, h), x| (l.min(*x), h.max(*x)));
    println!("{} ({pool}): load average {lo:.1}-{hi:.1}", w.label);
    for (i, p) in peers.iter().enumerate() {
        let rates: Vec<f64> = samples[i].iter().map(|s| s.rate).collect();
        let (rlo, rhi) = rates.iter().fold((f64::MAX, 0f64), |(l, h), x| (l.min(*x), h.max(*x)));
        let spread = if med[i] > 0.0 { (rhi - rlo) / med[i] * 100.0 } else { 0.0 };
        let tail = if w.depth == 1 && w.jobs == 1 { format!("  p99 {:.0} µs  p99.9 {:.0} µs", p99[i], p999[i]) } else { String::new() };
        println!(
            "  {:<16} {:<16} server CPU {:.2} µs/op  client {:.2} µs/op ({:.2} CPUs)  (rounds spread {spread:.0}%){tail}",
            p.name,
            show(med[i], w.bandwidth),
            cpu[i] * 1e6,
            client[i] * 1e6,
            client_cpus[i]
        );
    }
    let ratios: Vec<String> = peers.iter().zip(&med).skip(1).map(|(p, m)| format!("volring/{} {:.2}x", p.name, med[0] / m)).collect();
    println!("  throughput: {}", ratios.join("   "));
    let ratios: Vec<String> = peers.iter().zip(&cpu).skip(1).map(|(p, c)| format!("volring/{} {:.2}x", p.name, cpu[0] / c)).collect();
    println!("  server CPU per op: {}", ratios.join("   "));
    if let Some(f) = peers.iter().position(|p| p.name == "floor") {
        let vs: Vec<String> = peers
            .iter()
            .enumerate()
            .filter(|(i, _)| *i != f)
            .map(|(i, p)| format!("{}/floor {:.2}x CPU, {:.2}x throughput", p.name, cpu[i] / cpu[f], med[i] / med[f]))
            .collect();
        println!("  against the floor: {}", vs.join("   "));
    }
}
