//! `volring mounts` and `volring mounts --watch` as child processes,
//! including a watcher stopped while the kernel moves a mount.

use super::*;

pub(super) fn cli_prints_the_table_like_findmnt() -> Result<(), Failed> {
    let s = Scratch::new();
    s.tmpfs("with space");
    let ours = std::process::Command::new(env!("CARGO_BIN_EXE_volring")).arg("mounts").output()?;
    check(ours.status.success(), "volring mounts exits 0")?;
    let theirs = std::process::Command::new("findmnt").args(["--raw", "-n", "-o", "TARGET"]).output()?;
    let mut a: Vec<String> =
        String::from_utf8(ours.stdout)?.lines().skip(1).map(|l| l.split(' ').next().unwrap_or("").to_string()).collect();
    let mut b: Vec<String> = String::from_utf8(theirs.stdout)?.lines().map(str::to_string).collect();
    a.sort();
    b.sort();
    check(a == b, format!("targets differ:\n{a:?}\n{b:?}"))?;
    check(a.iter().any(|t| t.ends_with("/with\\x20space")), "space escaped like findmnt")?;
    let json = std::process::Command::new(env!("CARGO_BIN_EXE_volring")).args(["mounts", "--json"]).output()?;
    let v: serde_json::Value = serde_json::from_slice(&json.stdout)?;
    check(v["filesystems"].as_array().map(|a| a.len()) == Some(b.len()), "json lists every mount")
}

pub(super) fn cli_watch_streams_json_lines() -> Result<(), Failed> {
    use std::io::BufRead;
    let s = Scratch::new();
    let d = s.dir("w");
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_volring"))
        .args(["mounts", "--watch"])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()?;
    let stdout = child.stdout.take().ok_or("stdout")?;
    let (tx, rx) = std::sync::mpsc::channel();
    let reader = std::thread::spawn(move || {
        for line in std::io::BufReader::new(stdout).lines().map_while(Result::ok) {
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    // The child needs a moment to start watching (a debug build started
    // under an emulated CPU, the 6.1 VM of tests/vm.rs, took more than 5 s):
    // change the mount until it reports one.
    let seen = toggle_until_a_line(&d, &rx);
    let _ = child.kill();
    let _ = child.wait();
    let _ = reader.join();
    let line = seen.ok_or("no event line")?;
    let v: serde_json::Value = serde_json::from_str(&line)?;
    check(v["event"] == "attached" || v["event"] == "detached", format!("line {line}"))
}

/// Mounts or unmounts `probe` in turn, holding each state 500 ms, until a
/// line arrives on `lines` (`patience()` at most); leaves `probe` unmounted.
/// Each state is held long enough for a re-parse to see it: a mount made and
/// gone within one re-parse window shows no change, so a watcher in the
/// re-parse mode (the 6.1 guest) could miss every one of a quick series.
fn toggle_until_a_line(probe: &std::path::Path, lines: &std::sync::mpsc::Receiver<String>) -> Option<String> {
    let deadline = Instant::now() + patience();
    let mut mounted = false;
    let mut line = None;
    while line.is_none() && Instant::now() < deadline {
        if mounted {
            umount(probe);
        } else {
            tmpfs_at(probe);
        }
        mounted = !mounted;
        line = lines.recv_timeout(Duration::from_millis(500)).ok();
    }
    if mounted {
        umount(probe);
    }
    line
}

/// `STATX_MNT_ID_UNIQUE` (6.8+): the 64-bit id fanotify and statmount use.
const STATX_MNT_ID_UNIQUE: u32 = 0x4000;

/// `volring mounts --watch` as a child, its stdout lines on a channel. Killed
/// by its own PID and reaped on drop, also while it is stopped.
struct WatchChild {
    child: std::process::Child,
    lines: std::sync::mpsc::Receiver<String>,
    reader: Option<std::thread::JoinHandle<()>>,
}

impl WatchChild {
    fn spawn(mode: WatchMode, backend: BackendChoice) -> Result<Self, Failed> {
        use std::io::BufRead;
        let mode = if mode == WatchMode::Fanotify { "fanotify" } else { "reparse" };
        let io = if backend == BackendChoice::Epoll { "epoll" } else { "uring" };
        let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_volring"))
            .args(["mounts", "--watch", "--mount-watch", mode, "--io", io])
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::null())
            .spawn()?;
        let stdout = child.stdout.take().ok_or("stdout")?;
        let (tx, lines) = std::sync::mpsc::channel();
        let reader = std::thread::spawn(move || {
            for line in std::io::BufReader::new(stdout).lines().map_while(Result::ok) {
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        Ok(Self { child, lines, reader: Some(reader) })
    }

    fn signal(&self, sig: rustix::process::Signal) -> Result<(), Failed> {
        let pid = rustix::process::Pid::from_raw(self.child.id() as i32).ok_or("pid")?;
        Ok(rustix::process::kill_process(pid, sig)?)
    }

    /// Stops the child and waits (`patience()` at most) until the kernel says so.
    fn stop(&self) -> Result<(), Failed> {
        self.signal(rustix::process::Signal::STOP)?;
        let stat = format!("/proc/{}/stat", self.child.id());
        let deadline = Instant::now() + patience();
        while Instant::now() < deadline {
            let text = std::fs::read_to_string(&stat)?;
            // The state follows the command name's closing parenthesis.
            if text.rsplit_once(") ").is_some_and(|(_, rest)| rest.starts_with('T')) {
                return Ok(());
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        Err("child did not stop".into())
    }

    /// Changes the mount at `probe` until the child prints a line (a debug
    /// binary starting on a loaded 2-core CI machine once missed a 5 s
    /// budget), then drains what follows.
    fn wait_ready(&self, probe: &std::path::Path) -> Result<(), Failed> {
        check(toggle_until_a_line(probe, &self.lines).is_some(), format!("the watcher printed nothing in {:?}", patience()))?;
        self.lines_until(patience(), |_| true);
        Ok(())
    }

    /// Parsed lines until `enough` says so or `limit` passes, then `QUIET`
    /// more to catch extras.
    fn lines_until(&self, limit: Duration, mut enough: impl FnMut(&[serde_json::Value]) -> bool) -> Vec<serde_json::Value> {
        let deadline = Instant::now() + limit;
        let mut got = Vec::new();
        let mut quiet_until: Option<Instant> = None;
        loop {
            let now = Instant::now();
            if quiet_until.is_none() && enough(&got) {
                quiet_until = Some(now + QUIET);
            }
            let until = quiet_until.unwrap_or(deadline);
            if now >= until {
                break;
            }
            if let Ok(line) = self.lines.recv_timeout(until - now) {
                got.push(serde_json::from_str(&line).unwrap_or(serde_json::Value::String(line)));
            }
        }
        got
    }
}

impl Drop for WatchChild {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        if let Some(r) = self.reader.take() {
            let _ = r.join();
        }
    }
}

/// Every kernel move is one `moved` line, also when the watcher was late and
/// the kernel hands it all the moves of one mount in one fanotify read: the
/// child is stopped (SIGSTOP, by its PID) while a tmpfs moves 20 times. The
/// re-parse fallback sees one net move; its last line must say where to.
pub(super) fn stopped_watcher_reports_every_move(mode: WatchMode, backend: BackendChoice) -> Result<(), Failed> {
    const MOVES: usize = 20;
    let s = Scratch::new();
    let places: Vec<_> = (0..=MOVES).map(|i| s.dir(&format!("mv{i}"))).collect();
    tmpfs_at(&places[0]);
    let stx = rustix::fs::statx(
        rustix::fs::CWD,
        &places[0],
        rustix::fs::AtFlags::empty(),
        rustix::fs::StatxFlags::from_bits_retain(STATX_MNT_ID_UNIQUE),
    )?;
    let id = stx.stx_mnt_id;
    let child = WatchChild::spawn(mode, backend)?;
    child.wait_ready(&s.dir("probe"))?;
    child.stop()?;
    for pair in places.windows(2) {
        mount_move(&pair[0], &pair[1])?;
    }
    child.signal(rustix::process::Signal::CONT)?;
    let last = places[MOVES].display().to_string();
    let is_move_of = |v: &serde_json::Value| {
        v["event"] == "moved"
            && (v["id"] == id
                || v["mount"]["target"] == last.as_str()
                || v["previous"]["target"] == places[0].display().to_string().as_str())
    };
    let want = if mode == WatchMode::Fanotify { MOVES } else { 1 };
    let lines = child.lines_until(patience(), |got| got.iter().filter(|v| is_move_of(v)).count() >= want);
    let moves: Vec<_> = lines.iter().filter(|v| is_move_of(v)).collect();
    check(moves.len() == want, format!("{} moved lines for {want} kernel moves: {moves:?}", moves.len()))?;
    let final_place = moves.iter().rev().find_map(|v| v["mount"]["target"].as_str());
    check(final_place == Some(last.as_str()), format!("last known place {final_place:?}, want {last}"))?;
    let state_last = moves.last().is_some_and(|v| v["mount"]["target"] == last.as_str());
    check(state_last, "the mount's last event holds its state")
}

/// Every kernel move is one `moved` line also when statmount sees the mount
/// gone before the watcher has read its last moves and its detach: the
/// child is stopped while a tmpfs moves back and forth more times than one
/// 64 KiB fanotify read holds (40-byte events), then is unmounted, so the
/// first read's statmount finds it gone and the rest arrive in a second
/// read. The 1 ms moves of issue 12 lost their last move this way.
pub(super) fn moves_read_after_the_mount_is_gone(backend: BackendChoice) -> Result<(), Failed> {
    const MOVES: usize = 2_000;
    let s = Scratch::new();
    let (a, b) = (s.dir("a"), s.dir("b"));
    tmpfs_at(&a);
    let stx = rustix::fs::statx(
        rustix::fs::CWD,
        &a,
        rustix::fs::AtFlags::empty(),
        rustix::fs::StatxFlags::from_bits_retain(STATX_MNT_ID_UNIQUE),
    )?;
    let id = stx.stx_mnt_id;
    let child = WatchChild::spawn(WatchMode::Fanotify, backend)?;
    child.wait_ready(&s.dir("probe"))?;
    child.stop()?;
    for i in 0..MOVES {
        let (from, to) = if i % 2 == 0 { (&a, &b) } else { (&b, &a) };
        mount_move(from, to)?;
    }
    umount(&a);
    child.signal(rustix::process::Signal::CONT)?;
    let of_mount = |v: &serde_json::Value| v["id"] == id;
    let lines = child.lines_until(patience(), |got| got.iter().any(|v| of_mount(v) && v["event"] == "detached"));
    let events: Vec<_> = lines.iter().filter(|v| of_mount(v)).map(|v| v["event"].as_str().unwrap_or("?")).collect();
    let moves = events.iter().filter(|e| **e == "moved").count();
    check(moves == MOVES, format!("{moves} moved lines for {MOVES} kernel moves"))?;
    check(events.len() == MOVES + 1 && events.last() == Some(&"detached"), format!("then one detached, last; got {} lines", events.len()))
}
