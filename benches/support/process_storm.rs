//! Whole-process CPU of a mount watcher during a storm: `volring mounts
//! --watch` against a C fanotify+statmount watcher (`fanwatch.c`, built here
//! with `cc`), in paired runs, same namespace, same storm.
//!
//! A watcher is a child process writing JSON lines into a pipe that a thread
//! of the bench drains and counts. Its CPU is the sum of its threads'
//! `schedstat` run time (ns), taken before the storm and once its output has
//! been quiet for 300 ms; context switches come from the threads' `status`.
//! Latency: from mount(2) returning to the bench reading the `attached`
//! line of that mount id (both watchers print `{"event":"attached","id":N`).

use std::collections::HashMap;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rustix::fs::{statx, AtFlags, StatxFlags, CWD};
use rustix::mount::{mount, unmount, MountFlags, UnmountFlags};

/// `STATX_MNT_ID_UNIQUE` (6.8+): the id fanotify and statmount use.
const STATX_MNT_ID_UNIQUE: u32 = 0x4000;

/// The C peer, compiled into `dir`; `Err` says why it cannot be (no `cc`).
pub fn build_peer(dir: &Path) -> Result<PathBuf, String> {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("benches/support/fanwatch.c");
    let out = dir.join("fanwatch");
    let status = Command::new("cc").args(["-O2", "-o"]).arg(&out).arg(&src).status().map_err(|e| format!("cc: {e}"))?;
    if !status.success() {
        return Err(format!("cc failed: {status}"));
    }
    Ok(out)
}

/// One watcher process and the thread that counts its lines.
struct Watcher {
    child: Child,
    lines: Arc<AtomicUsize>,
    /// `moved` lines (both watchers start them `{"event":"moved"`).
    moved: Arc<AtomicUsize>,
    /// When the first `attached` line of each mount id was read.
    attached: Arc<Mutex<HashMap<u64, Instant>>>,
    reader: Option<std::thread::JoinHandle<()>>,
}

/// What one storm cost one watcher.
#[derive(Clone, Debug)]
pub struct Cost {
    pub cpu: Duration,
    pub switches: u64,
    pub lines: usize,
    /// `moved` lines among them.
    pub moved: usize,
    /// mount(2) return to the attached line, in µs, sorted; one per storm
    /// mount whose attach was reported.
    pub latency_us: Vec<f64>,
}

/// The mount id of an `attached` line, else `None`.
fn attached_id(line: &[u8]) -> Option<u64> {
    let rest = line.strip_prefix(b"{\"event\":\"attached\",\"id\":")?;
    let digits = rest.iter().take_while(|b| b.is_ascii_digit()).count();
    std::str::from_utf8(&rest[..digits]).ok()?.parse().ok()
}

impl Watcher {
    fn spawn(cmd: &mut Command) -> std::io::Result<Self> {
        let mut child = cmd.stdout(Stdio::piped()).stderr(Stdio::null()).spawn()?;
        let stdout = child.stdout.take().expect("piped");
        let lines = Arc::new(AtomicUsize::new(0));
        let moved = Arc::new(AtomicUsize::new(0));
        let attached = Arc::new(Mutex::new(HashMap::new()));
        let (count, moves, seen) = (lines.clone(), moved.clone(), attached.clone());
        let reader = std::thread::spawn(move || {
            let mut r = BufReader::with_capacity(1 << 16, stdout);
            let mut line = Vec::new();
            while r.read_until(b'\n', &mut line).map(|n| n > 0).unwrap_or(false) {
                if let Some(id) = attached_id(&line) {
                    seen.lock().expect("attached map").entry(id).or_insert_with(Instant::now);
                } else if line.starts_with(b"{\"event\":\"moved\"") {
                    moves.fetch_add(1, Ordering::Relaxed);
                }
                count.fetch_add(1, Ordering::Relaxed);
                line.clear();
            }
        });
        Ok(Self { child, lines, moved, attached, reader: Some(reader) })
    }

    /// (run time of all threads, voluntary + involuntary context switches).
    fn usage(&self) -> (Duration, u64) {
        super::support::thread_usage(self.child.id())
    }

    /// Mounts and unmounts `probe` in turn, each state held 100 ms, until the
    /// watcher prints (so it is watching; 30 s at most), then lets it settle.
    fn wait_ready(&self, probe: &Path) -> std::io::Result<()> {
        let deadline = Instant::now() + Duration::from_secs(30);
        while self.lines.load(Ordering::Relaxed) == 0 {
            if Instant::now() > deadline {
                return Err(std::io::Error::other("watcher printed nothing in 30 s"));
            }
            mount("tmpfs", probe, "tmpfs", MountFlags::empty(), Some(c"size=64k"))?;
            std::thread::sleep(Duration::from_millis(100));
            unmount(probe, UnmountFlags::empty())?;
            std::thread::sleep(Duration::from_millis(100));
        }
        self.settle(Duration::from_millis(200));
        Ok(())
    }

    /// Waits until the line count stays put for `quiet` (30 s at most).
    fn settle(&self, quiet: Duration) {
        let deadline = Instant::now() + Duration::from_secs(30);
        let mut last = usize::MAX;
        let mut since = Instant::now();
        while Instant::now() < deadline {
            let n = self.lines.load(Ordering::Relaxed);
            if n != last {
                last = n;
                since = Instant::now();
            } else if since.elapsed() >= quiet {
                return;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

impl Drop for Watcher {
    fn drop(&mut self) {
        // Our own child, by its PID.
        let _ = self.child.kill();
        let _ = self.child.wait();
        if let Some(r) = self.reader.take() {
            let _ = r.join();
        }
    }
}

/// Runs one storm of `dirs.len()` mount+umount pairs under the watcher that
/// `cmd` starts. `probe` is a directory the bench mounts on until the watcher
/// prints (so it is watching) before the storm.
pub fn storm(cmd: &mut Command, dirs: &[PathBuf], probe: &Path) -> std::io::Result<Cost> {
    let w = Watcher::spawn(cmd)?;
    w.wait_ready(probe)?;
    let before = w.lines.load(Ordering::Relaxed);
    let (cpu0, sw0) = w.usage();
    let mut made = Vec::with_capacity(dirs.len());
    for d in dirs {
        mount("tmpfs", d, "tmpfs", MountFlags::empty(), Some(c"size=64k"))?;
        let t0 = Instant::now();
        let id = statx(CWD, d, AtFlags::empty(), StatxFlags::from_bits_retain(STATX_MNT_ID_UNIQUE))?.stx_mnt_id;
        unmount(d, UnmountFlags::empty())?;
        made.push((id, t0));
    }
    w.settle(Duration::from_millis(300));
    let (cpu1, sw1) = w.usage();
    let seen = w.attached.lock().expect("attached map");
    let mut latency_us: Vec<f64> =
        made.iter().filter_map(|(id, t0)| seen.get(id).map(|t| t.saturating_duration_since(*t0).as_secs_f64() * 1e6)).collect();
    latency_us.sort_by(f64::total_cmp);
    Ok(Cost {
        cpu: cpu1.saturating_sub(cpu0),
        switches: sw1.saturating_sub(sw0),
        lines: w.lines.load(Ordering::Relaxed) - before,
        moved: w.moved.load(Ordering::Relaxed),
        latency_us,
    })
}

/// One tmpfs moved from `dirs[0]` through every following directory, `gap`
/// apart (issue 12's "mount moves 1 ms apart"), under the watcher that
/// `cmd` starts: how many of the `dirs.len() - 1` kernel moves it reported
/// as `moved` lines, and its CPU for them.
pub fn move_storm(cmd: &mut Command, dirs: &[PathBuf], probe: &Path, gap: Duration) -> std::io::Result<Cost> {
    let w = Watcher::spawn(cmd)?;
    w.wait_ready(probe)?;
    let before = w.lines.load(Ordering::Relaxed);
    let (cpu0, sw0) = w.usage();
    mount("tmpfs", &dirs[0], "tmpfs", MountFlags::empty(), Some(c"size=64k"))?;
    let mut last = &dirs[0];
    let result = dirs[1..].iter().try_for_each(|d| {
        std::thread::sleep(gap);
        rustix::mount::mount_move(last, d)?;
        last = d;
        Ok::<(), std::io::Error>(())
    });
    unmount(last, UnmountFlags::empty())?;
    result?;
    w.settle(Duration::from_millis(300));
    let (cpu1, sw1) = w.usage();
    Ok(Cost {
        cpu: cpu1.saturating_sub(cpu0),
        switches: sw1.saturating_sub(sw0),
        lines: w.lines.load(Ordering::Relaxed) - before,
        moved: w.moved.load(Ordering::Relaxed),
        latency_us: Vec::new(),
    })
}
