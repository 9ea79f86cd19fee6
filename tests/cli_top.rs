//! `volring top`, `volring df` and `volring stats --by volume` on real
//! loop-backed volumes staged and published by a running agent under
//! kubelet-style pod paths, one of them loaded by dd: `top --once --json`
//! ranks it first, `df` agrees with coreutils' df to the byte, `stats --by
//! volume` has a row for each. And the TUI itself, driven in a
//! pseudo-terminal: keys sent, the screen read back through a terminal
//! emulator (vt100).

mod common;
mod csi_support;

use std::io::{Read, Write};
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use common::check;
use common::load::Load;
use csi_support::{mount_cap, Agent, MIB};
use libtest_mimic::{Failed, Trial};
use serde_json::Value;

const VOLRING: &str = env!("CARGO_BIN_EXE_volring");
const PATIENCE: Duration = Duration::from_secs(30);
/// The pod UIDs kubelet would have put in the publish paths.
const BUSY_POD: &str = "0b6f1c1e-7d1a-4c55-9a53-3a4b2d0e0001";
const IDLE_POD: &str = "0b6f1c1e-7d1a-4c55-9a53-3a4b2d0e0002";

/// Two ext4 volumes, staged and published like kubelet does.
struct Node {
    a: Agent,
}

impl Node {
    fn start() -> Result<Self, Failed> {
        let a = Agent::start();
        for (id, pod) in [("pvc-z-busy", BUSY_POD), ("pvc-idle", IDLE_POD)] {
            a.create(id, 64 * MIB, "ext4")?;
            let staging = a.k(&format!("plugins/kubernetes.io/csi/volring/{id}/globalmount"));
            a.stage(id, &staging, mount_cap("ext4"))?;
            let target = a.k(&format!("pods/{pod}/volumes/kubernetes.io~csi/{id}/mount"));
            a.publish(id, &staging, &target, mount_cap("ext4"), false)?;
        }
        Ok(Self { a })
    }

    fn target(&self, id: &str, pod: &str) -> String {
        self.a.k(&format!("pods/{pod}/volumes/kubernetes.io~csi/{id}/mount"))
    }

    fn staging(&self, id: &str) -> String {
        self.a.k(&format!("plugins/kubernetes.io/csi/volring/{id}/globalmount"))
    }

    /// `volring ARGS` with the node's state and kubelet root, read from
    /// the kernel (this agent serves no /metrics).
    fn volring(&self, args: &[&str]) -> Command {
        let mut c = Command::new(VOLRING);
        c.args(args).arg("--state-dir").arg(&self.a.state).arg("--kubelet-root").arg(&self.a.kubelet).args(["--source", "kernel"]);
        c
    }

    fn json(&self, args: &[&str]) -> Result<Value, Failed> {
        let out = self.volring(args).output()?;
        check(out.status.success(), format!("volring {args:?}: {}", String::from_utf8_lossy(&out.stderr)))?;
        Ok(serde_json::from_slice(&out.stdout)?)
    }

    fn unstage(&self) -> Result<(), Failed> {
        for (id, pod) in [("pvc-z-busy", BUSY_POD), ("pvc-idle", IDLE_POD)] {
            self.a.unpublish(id, &self.target(id, pod))?;
            self.a.unstage(id, &self.staging(id))?;
        }
        Ok(())
    }
}

fn names(rows: &Value) -> Vec<String> {
    rows.as_array().into_iter().flatten().filter_map(|r| r["volume"].as_str().map(str::to_string)).collect()
}

/// `top --once --json` ranks the dd-loaded volume first, with its pod UID;
/// `stats --by volume` shows both.
fn once_ranks_the_loaded_volume_first() -> Result<(), Failed> {
    let n = Node::start()?;
    let load = Load::on(&n.target("pvc-z-busy", BUSY_POD));
    let top = n.json(&["top", "--once", "--json", "--interval", "1"])?;
    let stats = n.json(&["stats", "--by", "volume", "--all", "--count", "1", "--interval", "0.5", "--json"])?;
    drop(load);
    check(top["view"] == "volumes" && top["source"].as_str().is_some_and(|s| s.starts_with("kernel")), format!("{top}"))?;
    let rows = &top["rows"];
    check(names(rows) == ["pvc-z-busy", "pvc-idle"], format!("the loaded volume first: {rows}"))?;
    check(rows[0]["writes_per_second"].as_f64().is_some_and(|w| w > 0.0), format!("it writes: {}", rows[0]))?;
    check(rows[0]["write_bytes_per_second"].as_f64() > rows[1]["write_bytes_per_second"].as_f64(), format!("{rows}"))?;
    check(rows[0]["pod_uids"][0] == BUSY_POD && rows[1]["pod_uids"][0] == IDLE_POD, format!("pod UIDs from the publish paths: {rows}"))?;
    check(rows[0]["device"].as_str().is_some_and(|d| d.starts_with("loop")), format!("its loop device: {}", rows[0]))?;
    let mut seen = names(&stats["volumes"]);
    seen.sort();
    check(seen == ["pvc-idle", "pvc-z-busy"], format!("stats --by volume: {stats}"))?;

    // Filter and sort by name.
    let only = n.json(&["top", "--once", "--json", "--interval", "0.1", "--filter", "idle", "--sort", "name"])?;
    check(names(&only["rows"]) == ["pvc-idle"], format!("--filter idle: {only}"))?;
    n.unstage()
}

/// `df` shows both volumes with the same size, used and available bytes
/// as coreutils' df of their staging mounts.
fn df_matches_coreutils() -> Result<(), Failed> {
    let n = Node::start()?;
    let file = format!("{}/data", n.target("pvc-z-busy", BUSY_POD));
    let out = Command::new("dd").args(["if=/dev/zero", &format!("of={file}"), "bs=1M", "count=8", "conv=fsync"]).output()?;
    check(out.status.success(), "dd")?;
    let v = n.json(&["df", "--json"])?;
    let rows = v["volumes"].as_array().cloned().unwrap_or_default();
    let mut both = names(&v["volumes"]);
    both.sort();
    check(both == ["pvc-idle", "pvc-z-busy"], format!("both volumes: {v}"))?;
    for r in &rows {
        let staging = n.staging(r["volume"].as_str().unwrap_or_default());
        let out = Command::new("df").args(["-B1", "--output=size,used,avail,pcent"]).arg(&staging).output()?;
        let text = String::from_utf8(out.stdout)?;
        let theirs: Vec<String> =
            text.lines().nth(1).unwrap_or_default().split_whitespace().map(|s| s.trim_end_matches('%').to_string()).collect();
        let ours: Vec<String> = ["size_bytes", "used_bytes", "available_bytes", "use_pct"]
            .iter()
            .map(|k| r[*k].as_u64().unwrap_or(u64::MAX).to_string())
            .collect();
        check(ours == theirs, format!("{}: volring {ours:?}, df {theirs:?}", r["volume"]))?;
        check(r["mount"] == staging.as_str() && r["access"] == "ext4", format!("{r}"))?;
    }
    let used = |id: &str| rows.iter().find(|r| r["volume"] == id).and_then(|r| r["used_bytes"].as_u64());
    check(used("pvc-z-busy") > used("pvc-idle"), "the written one uses more")?;
    let text = n.volring(&["df"]).output()?;
    let text = String::from_utf8(text.stdout)?;
    check(text.starts_with("VOLUME") && text.contains("USE%") && text.lines().count() == 3, text.clone())?;
    let gone = n.volring(&["df", "pvc-nonexistent"]).output()?;
    check(gone.status.code() == Some(1), "an unknown volume: rc 1, as df")?;
    n.unstage()
}

/// The terminal emulator's view of what `volring top` drew.
struct Screen {
    child: std::process::Child,
    master: std::fs::File,
    output: mpsc::Receiver<Vec<u8>>,
    parser: vt100::Parser,
    raw: Vec<u8>,
}

const ROWS: u16 = 24;
const COLS: u16 = 160;
const ROWS_NZ: std::num::NonZeroU16 = std::num::NonZeroU16::new(ROWS).expect("rows");
const COLS_NZ: std::num::NonZeroU16 = std::num::NonZeroU16::new(COLS).expect("columns");

impl Screen {
    fn spawn(n: &Node) -> Result<Self, Failed> {
        use rustix::fs::{Mode, OFlags};
        use rustix::pty::{grantpt, openpt, ptsname, unlockpt, OpenptFlags};
        let master = openpt(OpenptFlags::RDWR | OpenptFlags::NOCTTY)?;
        grantpt(&master)?;
        unlockpt(&master)?;
        rustix::termios::tcsetwinsize(&master, rustix::termios::Winsize { ws_row: ROWS, ws_col: COLS, ws_xpixel: 0, ws_ypixel: 0 })?;
        let name = ptsname(&master, Vec::new())?;
        let slave: std::os::fd::OwnedFd =
            rustix::fs::open(name.as_c_str(), OFlags::RDWR | OFlags::NOCTTY | OFlags::CLOEXEC, Mode::empty())?;
        // A session of its own with the pseudo-terminal as its controlling
        // terminal, as a shell would give it (crossterm asks /dev/tty).
        let mut c = Command::new("setsid");
        c.arg("--ctty").arg(VOLRING).args(["top", "--interval", "0.2", "--source", "kernel"]);
        c.arg("--state-dir").arg(&n.a.state).arg("--kubelet-root").arg(&n.a.kubelet);
        let child = c
            .stdin(Stdio::from(slave.try_clone()?))
            .stdout(Stdio::from(slave))
            .stderr(Stdio::null())
            .env("TERM", "xterm-256color")
            .spawn()?;
        let master = std::fs::File::from(master);
        let mut reader = master.try_clone()?;
        let (tx, output) = mpsc::channel();
        std::thread::spawn(move || {
            let mut buf = [0u8; 8192];
            while let Ok(n @ 1..) = reader.read(&mut buf) {
                if tx.send(buf[..n].to_vec()).is_err() {
                    break;
                }
            }
        });
        Ok(Self { child, master, output, parser: vt100::Parser::new(ROWS_NZ, COLS_NZ, 0), raw: Vec::new() })
    }

    fn contents(&self) -> String {
        self.parser.screen().contents()
    }

    /// Reads until the screen satisfies `enough` (bounded).
    fn wait(&mut self, what: &str, enough: impl Fn(&str) -> bool) -> Result<String, Failed> {
        let deadline = Instant::now() + PATIENCE;
        loop {
            let now = self.contents();
            if enough(&now) {
                return Ok(now);
            }
            let Some(left) = deadline.checked_duration_since(Instant::now()) else {
                return Err(format!("{what}; the screen:\n{now}").into());
            };
            match self.output.recv_timeout(left) {
                Ok(bytes) => {
                    self.parser.process(&bytes);
                    self.raw.extend_from_slice(&bytes);
                }
                Err(_) => return Err(format!("{what}: the output ended; the screen:\n{}", self.contents()).into()),
            }
        }
    }

    fn keys(&mut self, keys: &str) -> Result<(), Failed> {
        self.master.write_all(keys.as_bytes())?;
        Ok(())
    }
}

impl Drop for Screen {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The live view in a pseudo-terminal: it shows the volumes, `d` the
/// devices, `/idle` Enter filters, `s` sorts by throughput, `q` quits and
/// gives the terminal back.
fn the_tui_in_a_pseudo_terminal() -> Result<(), Failed> {
    let n = Node::start()?;
    let load = Load::on(&n.target("pvc-z-busy", BUSY_POD));
    let mut s = Screen::spawn(&n)?;
    let busy_first = |t: &str| t.find("pvc-z-busy").zip(t.find("pvc-idle")).is_some_and(|(b, i)| b < i);
    s.wait("the volumes, busiest first", |t| t.contains("volumes by IOPS") && busy_first(t) && t.contains("uid:"))?;
    s.keys("d")?;
    s.wait("the devices", |t| t.contains("devices by IOPS") && t.contains("loop"))?;
    s.keys("v/idle\r")?;
    s.wait("the filtered volumes", |t| {
        t.contains("filter: idle") && !t.contains("filter: idle_") && t.contains("pvc-idle") && !t.contains("pvc-z-busy")
    })?;
    s.keys("s")?;
    s.wait("sorted by throughput", |t| t.contains("volumes by throughput"))?;
    s.keys("q")?;
    let deadline = Instant::now() + PATIENCE;
    let status = loop {
        if let Some(st) = s.child.try_wait()? {
            break st;
        }
        check(Instant::now() < deadline, "top did not quit on q")?;
        std::thread::sleep(Duration::from_millis(20));
    };
    check(status.success(), format!("top exits 0 on q: {status}"))?;
    // Whatever is left in the pipe, then: the alternate screen was left.
    while let Ok(bytes) = s.output.recv_timeout(Duration::from_millis(500)) {
        s.raw.extend_from_slice(&bytes);
    }
    let raw = String::from_utf8_lossy(&s.raw);
    check(raw.contains("\x1b[?1049h") && raw.contains("\x1b[?1049l"), "the alternate screen entered and left")?;
    drop(s);
    drop(load);
    n.unstage()
}

fn main() {
    common::run_in_private_namespace(vec![
        Trial::test("top::once_ranks_the_loaded_volume_first", once_ranks_the_loaded_volume_first),
        Trial::test("top::df_matches_coreutils", df_matches_coreutils),
        Trial::test("top::the_tui_in_a_pseudo_terminal", the_tui_in_a_pseudo_terminal),
    ]);
}
