//! The in-process signature probe against its peer, `blkid -p -o export`,
//! on the same loop devices in the same run: wall time per device (median
//! of the runs), CPU per probe and bytes read from the device, with the
//! page cache warm and with it dropped (BLKFLSBUF, via `blockdev
//! --flushbufs`, before every probe).
//!
//! The in-process side is what the CSI stage path does: open, then
//! `probe_reads` with a positioned read. Needs root and the mkfs tools of .ci/deps.
//!
//! `cargo bench --bench probe_vs_blkid` (`-- <runs>` to change 100 runs)

use std::os::unix::fs::FileExt;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use volring_devices::probe_reads;
use volring_sys::loopdev::{LoopDevice, LoopOptions};

struct Dev {
    kind: &'static str,
    dev: LoopDevice,
    _file: tempfile::NamedTempFile,
}

impl Dev {
    fn path(&self) -> String {
        self.dev.path().display().to_string()
    }
}

fn make(kind: &'static str, size: u64, cmd: &[&str]) -> Dev {
    use std::os::fd::AsFd;
    let file = tempfile::Builder::new().prefix("volring-bench-img-").tempfile().expect("image");
    file.as_file().set_len(size).expect("size");
    let dev = LoopDevice::attach(file.as_file().as_fd(), &LoopOptions { autoclear: true, ..Default::default() }).expect("loop");
    let d = Dev { kind, dev, _file: file };
    if let Some((prog, args)) = cmd.split_first() {
        let st = Command::new(prog)
            .args(args)
            .arg(d.path())
            .env("LVM_SUPPRESS_FD_WARNINGS", "1")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .expect(prog);
        assert!(st.success(), "{prog} failed");
    }
    d
}

/// Sectors read from the device so far (/sys/block/<loopN>/stat, field 3).
fn sectors_read(d: &Dev) -> u64 {
    let s = std::fs::read_to_string(format!("/sys/block/loop{}/stat", d.dev.number())).unwrap_or_default();
    s.split_whitespace().nth(2).and_then(|v| v.parse().ok()).unwrap_or(0)
}

fn flush(d: &Dev) {
    let st = Command::new("blockdev").args(["--flushbufs", &d.path()]).status().expect("blockdev");
    assert!(st.success());
}

/// CPU time of this (single-threaded) process in nanoseconds, from
/// schedstat, and of its reaped children, from /proc/self/stat's cutime and
/// cstime in clock ticks (hence summed over all runs before dividing).
fn cpu_ns() -> (u64, u64) {
    let own = std::fs::read_to_string("/proc/thread-self/schedstat")
        .ok()
        .and_then(|s| s.split_whitespace().next().and_then(|v| v.parse().ok()))
        .unwrap_or(0);
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    let after = stat.rsplit_once(')').map(|(_, r)| r).unwrap_or("");
    let v: Vec<u64> = after.split_whitespace().map(|x| x.parse().unwrap_or(0)).collect();
    // cutime and cstime are fields 16 and 17, the 14th and 15th after ')'.
    // Linux reports these in USER_HZ, 100 per second on every architecture.
    let tick_ns = 10_000_000;
    let kids = (v.get(13).unwrap_or(&0) + v.get(14).unwrap_or(&0)) * tick_ns;
    (own, kids)
}

fn in_process(path: &str) -> String {
    let f = std::fs::File::open(path).expect("open");
    let size = std::io::Seek::seek(&mut &f, std::io::SeekFrom::End(0)).expect("size");
    let read = |o: u64, l: usize| {
        let mut b = vec![0u8; l];
        f.read_exact_at(&mut b, o).map(|()| b)
    };
    let (content, _) = probe_reads(size, 512, read).expect("read");
    content.filesystem.map(|f| f.fstype.as_str().to_string()).unwrap_or_default()
}

fn blkid(path: &str) -> String {
    let out = Command::new("blkid").args(["-p", "-o", "export", path]).output().expect("blkid");
    String::from_utf8_lossy(&out.stdout).lines().find_map(|l| l.strip_prefix("TYPE=")).unwrap_or("").to_string()
}

struct Figures {
    median: Duration,
    cpu_us: f64,
    kib_read: f64,
    answer: String,
}

fn measure(d: &Dev, runs: usize, cold: bool, peer: bool) -> Figures {
    let mut times = Vec::with_capacity(runs);
    let (mut cpu, mut sectors) = (0u64, 0u64);
    let mut answer = String::new();
    for _ in 0..runs {
        if cold {
            flush(d);
        }
        let s0 = sectors_read(d);
        let (o0, k0) = cpu_ns();
        let t = Instant::now();
        answer = if peer { blkid(&d.path()) } else { in_process(&d.path()) };
        times.push(t.elapsed());
        let (o1, k1) = cpu_ns();
        cpu += if peer { k1 - k0 } else { o1 - o0 };
        sectors += sectors_read(d) - s0;
    }
    times.sort();
    Figures { median: times[runs / 2], cpu_us: cpu as f64 / 1000.0 / runs as f64, kib_read: sectors as f64 / 2.0 / runs as f64, answer }
}

fn main() {
    let runs: usize = std::env::args().skip(1).find_map(|a| a.parse().ok()).unwrap_or(100);
    let devs = vec![
        make("blank", 256 << 20, &[]),
        make("ext4", 256 << 20, &["mkfs.ext4", "-q", "-F"]),
        make("vfat", 256 << 20, &["mkfs.vfat", "-F", "32"]),
        make("LVM2_member", 256 << 20, &["pvcreate", "-ff", "-y", "-q"]),
        make("ntfs", 256 << 20, &["mkfs.ntfs", "-Q", "-F", "-q"]),
        make("xfs", 320 << 20, &["mkfs.xfs", "-q", "-f"]),
        make("exfat", 256 << 20, &["mkfs.exfat"]),
        make("udf", 256 << 20, &["mkudffs"]),
    ];
    println!("{runs} runs per device and mode; time is the median wall time of one probe; CPU is user+sys per probe");
    println!(
        "{:<12} {:<5} {:>12} {:>12} {:>7} {:>10} {:>10} {:>9} {:>9}",
        "device", "cache", "volring", "blkid -p", "ratio", "cpu volr", "cpu blkid", "KiB volr", "KiB blkid"
    );
    for d in &devs {
        for cold in [false, true] {
            let ours = measure(d, runs, cold, false);
            let peer = measure(d, runs, cold, true);
            let want = if d.kind == "blank" { "" } else { d.kind };
            assert_eq!((ours.answer.as_str(), peer.answer.as_str()), (want, want), "{} disagrees", d.kind);
            println!(
                "{:<12} {:<5} {:>10.1}µs {:>10.1}µs {:>6.1}x {:>8.0}µs {:>8.0}µs {:>9.0} {:>9.0}",
                d.kind,
                if cold { "cold" } else { "warm" },
                ours.median.as_secs_f64() * 1e6,
                peer.median.as_secs_f64() * 1e6,
                peer.median.as_secs_f64() / ours.median.as_secs_f64(),
                ours.cpu_us,
                peer.cpu_us,
                ours.kib_read,
                peer.kib_read,
            );
        }
    }
}
