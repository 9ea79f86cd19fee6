//! `volring node` as a process: one agent per state directory and socket,
//! listeners that cannot be had are fatal, signals, shutdown waiting for
//! work a client gave up on, bounded error messages, and the printing
//! commands into a closed pipe. Each test starts its own processes in a
//! scratch directory, inside a private mount namespace, and stops them by
//! PID.

mod common;

use std::io::{BufRead, BufReader, Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::{check, without_colours, Scratch};
use libtest_mimic::{Failed, Trial};
use volring_csi::client::{capability, Clients};
use volring_csi::proto::volume_capability::access_mode::Mode;
use volring_csi::proto::*;

const VOLRING: &str = env!("CARGO_BIN_EXE_volring");
/// The longest any wait in these tests may take: 30 s, and 120 s in the
/// emulated guest of tests/vm.rs (it exports `VOLRING_TEST_IN_GUEST`), where
/// time runs 10-50x slower. Every wait ends as soon as its condition holds.
fn patience() -> Duration {
    if std::env::var_os("VOLRING_TEST_IN_GUEST").is_some() {
        Duration::from_secs(120)
    } else {
        Duration::from_secs(30)
    }
}

/// Lines a child writes to stderr, collected by a thread as they come.
#[derive(Clone, Default)]
struct Lines(Arc<(Mutex<Vec<String>>, std::sync::atomic::AtomicBool)>);

impl Lines {
    fn collect(from: impl Read + Send + 'static) -> Self {
        let lines = Lines::default();
        let l = lines.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(from).lines() {
                let Ok(line) = line else { break };
                if std::env::var_os("VOLRING_TEST_LOG").is_some() {
                    eprintln!("{line}");
                }
                l.0 .0.lock().unwrap().push(line);
            }
            l.0 .1.store(true, std::sync::atomic::Ordering::Release);
        });
        lines
    }

    fn all(&self) -> Vec<String> {
        self.0 .0.lock().unwrap().clone()
    }

    /// The index of the first line with every one of `words`.
    fn find(&self, words: &[&str]) -> Option<usize> {
        self.all().iter().position(|l| words.iter().all(|w| l.contains(w)))
    }

    /// Waits (at most `patience()`) until the writer has closed its end, so
    /// that every line is in.
    fn wait_closed(&self) {
        let deadline = Instant::now() + patience();
        while !self.0 .1.load(std::sync::atomic::Ordering::Acquire) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    fn text(&self) -> String {
        self.all().join("\n")
    }
}

/// A process this test started; killed by PID when dropped.
struct Proc {
    child: Child,
    stderr: Lines,
}

impl Proc {
    fn spawn(cmd: &mut Command) -> Self {
        let mut child = cmd.stdin(Stdio::null()).stderr(Stdio::piped()).spawn().expect("spawn volring");
        let stderr = Lines::collect(child.stderr.take().expect("stderr"));
        Self { child, stderr }
    }

    fn pid(&self) -> u32 {
        self.child.id()
    }

    fn signal(&self, sig: rustix::process::Signal) {
        let _ = rustix::process::kill_process(rustix::process::Pid::from_child(&self.child), sig);
    }

    /// The exit status, waiting at most `patience()`; once it has exited,
    /// its stderr is read to the end.
    fn wait(&mut self) -> Option<ExitStatus> {
        let deadline = Instant::now() + patience();
        while Instant::now() < deadline {
            if let Ok(Some(s)) = self.child.try_wait() {
                self.stderr.wait_closed();
                return Some(s);
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        None
    }

    /// The exit status if it has exited (its stderr then read to the end).
    fn exited(&mut self) -> Option<ExitStatus> {
        let s = self.child.try_wait().ok().flatten()?;
        self.stderr.wait_closed();
        Some(s)
    }

    /// SIGTERM, and the exit status.
    fn stop(&mut self) -> Option<ExitStatus> {
        self.signal(rustix::process::Signal::TERM);
        self.wait()
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        if self.exited().is_none() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// A scratch directory for agents: kubelet root, state directories, sockets.
/// On drop (after the agents' own guards) everything mounted below it is
/// unmounted and every loop device backed by a file in it is detached.
struct Site {
    scratch: Scratch,
    rt: tokio::runtime::Runtime,
}

impl Site {
    fn new() -> Self {
        Self { scratch: Scratch::new(), rt: tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime") }
    }

    fn path(&self, name: &str) -> PathBuf {
        self.scratch.path().join(name)
    }

    /// `volring node` with its CSI socket `socket` and state in `state`
    /// (both names inside the site), plus `extra` arguments.
    fn node(&self, state: &str, socket: &str, extra: &[&str]) -> Command {
        let mut cmd = Command::new(VOLRING);
        cmd.args(["node", "--node-id", "test-node", "--stats-interval", "5"])
            .arg("--csi-endpoint")
            .arg(format!("unix://{}", self.path(socket).display()))
            .arg("--kubelet-root")
            .arg(self.scratch.dir("kubelet"))
            .arg("--state-dir")
            .arg(self.path(state))
            .args(extra)
            .env("RUST_LOG", "volring=info")
            .stdout(Stdio::null());
        if !extra.contains(&"--metrics-addr") {
            cmd.args(["--metrics-addr", "off"]);
        }
        cmd
    }

    /// Starts an agent and waits until it answers Probe with ready.
    fn start(&self, state: &str, socket: &str, extra: &[&str]) -> Result<(Proc, Clients), Failed> {
        let mut p = Proc::spawn(&mut self.node(state, socket, extra));
        let c = self.ready(&mut p, &self.path(socket))?;
        Ok((p, c))
    }

    fn ready(&self, p: &mut Proc, socket: &Path) -> Result<Clients, Failed> {
        let deadline = Instant::now() + patience();
        loop {
            if let Some(s) = p.exited() {
                return Err(format!("the agent exited ({s}) before it was ready:\n{}", p.stderr.text()).into());
            }
            if let Some(c) = self.rt.block_on(probe(socket)) {
                return Ok(c);
            }
            if Instant::now() > deadline {
                return Err(format!("the agent did not become ready on {}", socket.display()).into());
            }
            std::thread::sleep(Duration::from_millis(25));
        }
    }
}

impl Drop for Site {
    fn drop(&mut self) {
        let dir = self.scratch.path().to_path_buf();
        for _ in 0..64 {
            let mut under = common_mounts_under(&dir);
            if under.is_empty() {
                break;
            }
            under.sort_by_key(|p| std::cmp::Reverse(p.components().count()));
            for p in &under {
                let _ = rustix::mount::unmount(p, rustix::mount::UnmountFlags::DETACH);
            }
        }
        for n in volring_volumes::attach::find_backed_by_prefix(&dir) {
            if let Ok(d) = volring_sys::loopdev::LoopDevice::open(n) {
                let _ = d.detach();
            }
        }
    }
}

/// A client when the socket answers Probe with ready.
async fn probe(socket: &Path) -> Option<Clients> {
    if !socket.exists() {
        return None;
    }
    let mut c = Clients::connect(socket.to_path_buf()).await.ok()?;
    let r = c.identity.probe(ProbeRequest {}).await.ok()?;
    (r.into_inner().ready == Some(true)).then_some(c)
}

/// The agent exited with a failure status and said `words` on one line.
fn refused(p: &mut Proc, words: &[&str]) -> Result<(), Failed> {
    let Some(status) = p.wait() else {
        return Err(format!("the second agent kept running; it said:\n{}", p.stderr.text()).into());
    };
    check(!status.success(), format!("the refused agent exited with {status}"))?;
    check(p.stderr.find(words).is_some(), format!("no line with {words:?} in:\n{}", p.stderr.text()))
}

fn second_agent_on_the_same_state_dir_is_refused() -> Result<(), Failed> {
    let site = Site::new();
    let (mut first, _c) = site.start("state", "a.sock", &[])?;
    let mut second = Proc::spawn(&mut site.node("state", "b.sock", &[]));
    let state = site.path("state");
    let pid = first.pid().to_string();
    refused(&mut second, &["another volring agent holds", &state.display().to_string(), &pid])?;
    check(!site.path("b.sock").exists(), "the refused agent left a socket")?;
    check(site.rt.block_on(probe(&site.path("a.sock"))).is_some(), "the first agent still answers")?;
    let status = first.stop().ok_or("the first agent did not stop")?;
    check(status.success(), format!("the first agent exited with {status}"))?;
    check(!site.path("a.sock").exists(), "the first agent removes its own socket at exit")?;
    // Once the first has gone, the state directory is free again.
    let (mut third, _c) = site.start("state", "b.sock", &[])?;
    check(third.stop().is_some_and(|s| s.success()), "the third agent stops cleanly")
}

fn second_agent_on_the_same_socket_is_refused_and_leaves_it() -> Result<(), Failed> {
    let site = Site::new();
    let (mut first, _c) = site.start("state-a", "csi.sock", &[])?;
    let mut second = Proc::spawn(&mut site.node("state-b", "csi.sock", &[]));
    let sock = site.path("csi.sock").display().to_string();
    refused(&mut second, &["cannot bind CSI socket", &sock, "in use"])?;
    check(site.path("csi.sock").exists(), "the refused agent removed the first agent's socket")?;
    check(site.rt.block_on(probe(&site.path("csi.sock"))).is_some(), "the first agent still answers")?;
    check(first.stop().is_some_and(|s| s.success()), "the first agent stops cleanly")
}

fn a_file_at_the_socket_path_is_refused_and_kept() -> Result<(), Failed> {
    let site = Site::new();
    std::fs::write(site.path("csi.sock"), b"precious")?;
    let mut p = Proc::spawn(&mut site.node("state", "csi.sock", &[]));
    refused(&mut p, &["cannot bind CSI socket", "not a socket"])?;
    check(std::fs::read(site.path("csi.sock"))? == b"precious", "the file was changed")
}

fn metrics_address_in_use_is_fatal() -> Result<(), Failed> {
    let site = Site::new();
    let taken = std::net::TcpListener::bind("127.0.0.1:0")?;
    let addr = taken.local_addr()?.to_string();
    let mut p = Proc::spawn(&mut site.node("state", "csi.sock", &["--metrics-addr", &addr]));
    refused(&mut p, &["cannot bind the metrics address", &addr])?;
    check(!site.path("csi.sock").exists(), "the failed agent left its CSI socket behind")
}

/// The agent binds the metrics listener at start and serves `/metrics` on
/// it: asked for port 0, it says which port it got and answers there.
fn metrics_are_served_on_the_listener_bound_at_start() -> Result<(), Failed> {
    let site = Site::new();
    let (mut p, _c) = site.start("state", "csi.sock", &["--metrics-addr", "127.0.0.1:0"])?;
    let deadline = Instant::now() + patience();
    let addr = loop {
        let said = p.stderr.find(&["serving /metrics"]).map(|i| without_colours(&p.stderr.all()[i]));
        if let Some(addr) = said.as_deref().and_then(|l| l.split("addr=").nth(1)).and_then(|a| a.split_whitespace().next()) {
            break addr.parse::<std::net::SocketAddr>().map_err(|e| format!("{addr:?}: {e}"))?;
        }
        check(Instant::now() < deadline, format!("no word of the metrics address in:\n{}", p.stderr.text()))?;
        std::thread::sleep(Duration::from_millis(10));
    };
    check(addr.ip().is_loopback() && addr.port() != 0, format!("metrics served on {addr}"))?;
    let mut conn = std::net::TcpStream::connect(addr)?;
    conn.set_read_timeout(Some(patience()))?;
    std::io::Write::write_all(
        &mut conn,
        b"GET /metrics HTTP/1.1\r\nHost: localhost\r\nAccept: application/openmetrics-text;version=1.0.0,text/plain;q=0.3\r\nConnection: close\r\n\r\n",
    )?;
    let mut reply = String::new();
    conn.take(16 << 20).read_to_string(&mut reply)?;
    check(reply.starts_with("HTTP/1.1 200"), format!("reply: {reply:.200}"))?;
    check(reply.contains("application/openmetrics-text"), "not OpenMetrics")?;
    check(reply.contains("volring_devices "), format!("no device gauge in: {reply:.2000}"))?;
    // node_exporter's disk counters, and an info series per device.
    for family in [
        "volring_device_reads_merged_total{",
        "volring_device_writes_merged_total{",
        "volring_device_discard_time_seconds_total{",
        "volring_device_flush_time_seconds_total{",
        "volring_device_io_time_weighted_seconds_total{",
        "volring_device_info{device=",
    ] {
        check(reply.contains(family), format!("no {family} in: {reply:.2000}"))?;
    }
    // The reconciler's start pass ran before ready, and is counted.
    let passes = reply.lines().find_map(|l| l.strip_prefix("volring_reconcile_passes_total ")).and_then(|n| n.parse::<u64>().ok());
    check(passes.is_some_and(|n| n >= 1), format!("reconciler passes {passes:?} in: {reply:.4000}"))?;
    check(reply.lines().any(|l| l == "volring_volumes 0"), "no volume gauge")?;
    // CSI: every RPC has its OK series; the start's Probe was counted.
    let probes = reply
        .lines()
        .find_map(|l| l.strip_prefix("volring_csi_requests_total{rpc=\"Probe\",code=\"OK\"} "))
        .and_then(|n| n.parse::<u64>().ok());
    check(probes.is_some_and(|n| n >= 1), format!("Probe calls {probes:?}"))?;
    check(reply.contains("volring_csi_requests_total{rpc=\"NodeStageVolume\",code=\"OK\"} 0"), "NodeStageVolume series")?;
    check(reply.contains("volring_csi_request_duration_seconds_bucket{le=\"0.0001\",rpc=\"Probe\"}"), "CSI latency histogram")?;
    for g in [
        "volring_csi_volumes_staged 0",
        "volring_csi_volumes_published 0",
        "volring_csi_pool_volumes 0",
        "volring_csi_pool_provisioned_bytes 0",
    ] {
        check(reply.lines().any(|l| l == g), format!("no {g:?}"))?;
    }
    // Without OpenMetrics in Accept: the classic text, which the standard
    // linter passes (OpenMetrics counter families lack the `_total` their
    // samples carry, so promtool found "no help text" on every counter).
    let classic = http_get(addr, "/metrics")?;
    check(classic.contains("text/plain; version=0.0.4"), format!("classic content type: {classic:.300}"))?;
    let body = classic.split_once("\r\n\r\n").map(|(_, b)| b).unwrap_or("");
    check(body.contains("# TYPE volring_reconcile_passes_total counter"), format!("classic counter family: {body:.2000}"))?;
    promtool_check(body)?;
    // The probes kubelet uses (deploy/base/daemonset.yaml).
    for (path, want) in [("/healthz", "ok"), ("/readyz", "ready")] {
        let reply = http_get(addr, path)?;
        check(reply.starts_with("HTTP/1.1 200") && reply.ends_with(&format!("{want}\n")), format!("{path}: {reply:.300}"))?;
    }
    check(p.stop().is_some_and(|s| s.success()), "the agent stops cleanly")
}

/// `promtool check metrics` on an exposition: it must exit 0 with nothing
/// to say. Skipped where promtool is missing, except in CI (`.ci/run`
/// installs Debian's prometheus package for it).
fn promtool_check(body: &str) -> Result<(), Failed> {
    let spawned = std::process::Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn();
    let mut child = match spawned {
        Ok(c) => c,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound && std::env::var_os("CI").is_none() => {
            eprintln!("promtool not found: the lint of /metrics is skipped (apt-get install prometheus)");
            return Ok(());
        }
        Err(e) => return Err(format!("promtool: {e}").into()),
    };
    let mut stdin = child.stdin.take().ok_or("promtool stdin")?;
    stdin.write_all(body.as_bytes())?;
    drop(stdin);
    let out = child.wait_with_output()?;
    let said = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    check(out.status.success() && said.trim().is_empty(), format!("promtool check metrics: {:?}\n{said}", out.status))
}

fn http_get(addr: std::net::SocketAddr, path: &str) -> Result<String, Failed> {
    let mut conn = std::net::TcpStream::connect(addr)?;
    conn.set_read_timeout(Some(patience()))?;
    std::io::Write::write_all(&mut conn, format!("GET {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n").as_bytes())?;
    let mut reply = String::new();
    conn.take(1 << 20).read_to_string(&mut reply)?;
    Ok(reply)
}

/// Logs to a pipe carry no colour codes; `--log-format json` gives one JSON
/// object per line; the one "ready" line says what the agent serves;
/// `--version` names the commit. (Before: ANSI codes in every piped line, no
/// JSON, no ready line, a bare version.)
fn logs_ready_line_and_version() -> Result<(), Failed> {
    let site = Site::new();
    let (mut p, _c) = site.start("state", "csi.sock", &["--metrics-addr", "127.0.0.1:0"])?;
    let deadline = Instant::now() + patience();
    let ready = loop {
        if let Some(i) = p.stderr.find(&[" ready "]) {
            break p.stderr.all()[i].clone();
        }
        check(Instant::now() < deadline, format!("no ready line in:\n{}", p.stderr.text()))?;
        std::thread::sleep(Duration::from_millis(10));
    };
    check(!p.stderr.text().contains('\x1b'), format!("colour codes in piped logs:\n{}", p.stderr.text()))?;
    for want in ["mounts=", "devices=", "metrics=\"http://127.0.0.1:", "csi=\"unix://", "nbd=\"off\""] {
        check(ready.contains(want), format!("{want} missing from the ready line: {ready}"))?;
    }
    check(p.stop().is_some_and(|s| s.success()), "the agent stops cleanly")?;

    let (mut p, _c) = site.start("state", "csi.sock", &["--log-format", "json"])?;
    check(p.stop().is_some_and(|s| s.success()), "the JSON-logging agent stops cleanly")?;
    let lines = p.stderr.all();
    check(lines.len() >= 3, format!("too few log lines: {lines:?}"))?;
    for l in &lines {
        let v: serde_json::Value = serde_json::from_str(l).map_err(|e| format!("not JSON ({e}): {l}"))?;
        check(v["level"].is_string() && v["fields"]["message"].is_string(), format!("JSON log line without level or message: {l}"))?;
    }
    check(lines.iter().any(|l| l.contains("\"message\":\"ready\"")), "a JSON ready line")?;

    let out = Command::new(VOLRING).arg("--version").output()?;
    let version = String::from_utf8_lossy(&out.stdout).to_string();
    // Built from a git checkout (as here and in CI): the commit is named.
    let in_git = Command::new("git").args(["rev-parse", "HEAD"]).current_dir(env!("CARGO_MANIFEST_DIR")).output();
    if in_git.is_ok_and(|o| o.status.success()) {
        check(version.contains("(commit "), format!("--version without a commit: {version}"))?;
    }
    check(version.starts_with(&format!("volring {}", env!("CARGO_PKG_VERSION"))), format!("--version: {version}"))
}

/// An agent started without root fails with its cause and a hint that
/// root is what is missing (before: the bare EACCES).
fn non_root_is_told_it_needs_root() -> Result<(), Failed> {
    let site = Site::new();
    let state = site.path("nobody-state");
    let out = Command::new("setpriv")
        .args(["--reuid=65534", "--regid=65534", "--clear-groups", VOLRING, "node", "--metrics-addr", "off", "--state-dir"])
        .arg(&state)
        .stdin(Stdio::null())
        .output()?;
    let err = String::from_utf8_lossy(&out.stderr);
    check(!out.status.success(), "a non-root agent fails")?;
    check(err.contains("Permission denied") && err.contains("hint: this needs root"), format!("stderr: {err}"))
}

fn nbd_listener_in_use_is_fatal() -> Result<(), Failed> {
    let site = Site::new();
    let taken = std::net::TcpListener::bind("127.0.0.1:0")?;
    let addr = taken.local_addr()?.to_string();
    let mut p = Proc::spawn(&mut site.node("state", "csi.sock", &["--nbd-listen", &addr]));
    refused(&mut p, &["cannot start the NBD server", &addr])?;
    check(!site.path("csi.sock").exists(), "the failed agent left its CSI socket behind")
}

fn sighup_is_logged_and_ignored() -> Result<(), Failed> {
    let site = Site::new();
    let (mut p, _c) = site.start("state", "csi.sock", &[])?;
    p.signal(rustix::process::Signal::HUP);
    let deadline = Instant::now() + patience();
    while p.stderr.find(&["SIGHUP"]).is_none() {
        if let Some(s) = p.exited() {
            return Err(format!("SIGHUP ended the agent ({s})").into());
        }
        check(Instant::now() < deadline, "no word about SIGHUP")?;
        std::thread::sleep(Duration::from_millis(10));
    }
    check(p.exited().is_none(), "the agent exited after SIGHUP")?;
    check(site.rt.block_on(probe(&site.path("csi.sock"))).is_some(), "the agent still answers after SIGHUP")?;
    let status = p.stop().ok_or("the agent did not stop")?;
    check(status.success(), format!("exit status {status}"))
}

/// `volring mounts --watch | head -1`: after the reader has gone, the next
/// event ends the command quietly.
fn mounts_watch_into_a_closed_pipe_exits_quietly() -> Result<(), Failed> {
    let scratch = Scratch::new();
    // Where fanotify mount events are missing (kernels before 6.15), `auto`
    // rightly warns that it falls back; asking for the fallback by name keeps
    // stderr a clean signal there too.
    let mut args = vec!["mounts", "--watch"];
    if volring_mounts::MountWatcher::fanotify_support().is_err() {
        args.extend(["--mount-watch", "reparse"]);
    }
    let mut p = Proc::spawn(Command::new(VOLRING).args(&args).env("RUST_BACKTRACE", "1").stdout(Stdio::piped()));
    let mut out = BufReader::new(p.child.stdout.take().expect("stdout"));
    let (tx, rx) = std::sync::mpsc::channel();
    let reader = std::thread::spawn(move || {
        let mut first = String::new();
        let _ = out.read_line(&mut first);
        let _ = tx.send(first);
        // `out` drops here: the reader goes away like `head -1`.
    });
    let dir = scratch.dir("m");
    let deadline = Instant::now() + patience();
    let mut first = None;
    let mut mounted = false;
    // Mount or unmount in turn until the command has printed one event and
    // ended at the next, holding each state 500 ms: in the re-parse mode (the
    // 6.1 guest) a mount made and gone between two re-parses shows no change.
    let status = 'watch: loop {
        if Instant::now() >= deadline {
            if mounted {
                common::umount(&dir);
            }
            return Err(format!("mounts --watch neither printed nor ended in {:?} (first line {first:?})", patience()).into());
        }
        if mounted {
            common::umount(&dir);
        } else {
            common::tmpfs_at(&dir);
        }
        mounted = !mounted;
        let held = Instant::now() + Duration::from_millis(500);
        while Instant::now() < held {
            if first.is_none() {
                first = rx.try_recv().ok();
            }
            if let Some(s) = p.exited() {
                break 'watch s;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    };
    if mounted {
        common::umount(&dir);
    }
    let _ = reader.join();
    let first = first.or_else(|| rx.try_recv().ok()).unwrap_or_default();
    check(first.starts_with('{'), format!("the first event line: {first:?}"))?;
    check(status.success(), format!("exit status {status}; stderr:\n{}", p.stderr.text()))?;
    check(p.stderr.all().is_empty(), format!("stderr not empty:\n{}", p.stderr.text()))
}

/// A server keeps serving when its stdout goes away, and says nothing
/// about it (no panic at the next stats line or at exit).
fn nbd_serve_with_a_closed_stdout() -> Result<(), Failed> {
    let scratch = Scratch::new();
    let image = scratch.path().join("disk.img");
    std::fs::File::create(&image)?.set_len(1 << 20)?;
    let sock = scratch.path().join("nbd.sock");
    let mut p = Proc::spawn(
        Command::new(VOLRING)
            .args(["nbd", "serve", "--stats-interval", "0.01", "--export"])
            .arg(format!("disk={}", image.display()))
            .arg("--unix")
            .arg(&sock)
            .env("RUST_BACKTRACE", "1")
            .stdout(Stdio::piped()),
    );
    let mut out = BufReader::new(p.child.stdout.take().expect("stdout"));
    let mut line = String::new();
    out.read_line(&mut line)?;
    check(line.contains("listening"), format!("first line {line:?}"))?;
    drop(out);
    // A connection proves the server is still up after a stats tick has
    // found stdout closed: ticks come every 10 ms and the handshake waits
    // for the ring thread.
    for _ in 0..3 {
        let mut s = std::os::unix::net::UnixStream::connect(&sock)?;
        let mut magic = [0u8; 8];
        s.read_exact(&mut magic)?;
        check(&magic == b"NBDMAGIC", "the server greets")?;
        std::thread::sleep(Duration::from_millis(20));
    }
    let status = p.stop().ok_or("nbd serve did not stop")?;
    check(status.success(), format!("exit status {status}; stderr:\n{}", p.stderr.text()))?;
    let noise: Vec<_> = p.stderr.all().into_iter().filter(|l| l.contains("panicked") || l.contains("Broken pipe")).collect();
    check(noise.is_empty(), format!("stderr: {noise:?}"))
}

/// Every RPC answers a huge field with its code and a short message (the
/// message travels in a header, and clients drop replies with huge ones).
fn huge_fields_get_short_messages() -> Result<(), Failed> {
    use tonic::Code;
    let site = Site::new();
    let (mut p, c) = site.start("state", "csi.sock", &[])?;
    let huge = "x".repeat(3 << 20);
    let staging = site.scratch.dir("kubelet").join("plugins/stage/pvc-big").display().to_string();
    let target = site.scratch.dir("kubelet").join("pods/p/pvc-big").display().to_string();
    let huge_fs = capability(false, &huge, &[], Mode::SingleNodeWriter);
    let (mut ctl, mut node) = (c.controller.clone(), c.node.clone());
    let results: Vec<(&str, Code, Result<(), tonic::Status>)> = site.rt.block_on(async {
        vec![
            (
                "ListVolumes starting_token",
                Code::Aborted,
                ctl.list_volumes(ListVolumesRequest { starting_token: huge.clone(), ..Default::default() }).await.map(drop),
            ),
            (
                "CreateVolume parameter",
                Code::InvalidArgument,
                ctl.create_volume(CreateVolumeRequest {
                    name: "pvc-big".into(),
                    capacity_range: Some(CapacityRange { required_bytes: 32 << 20, limit_bytes: 0 }),
                    volume_capabilities: vec![capability(false, "ext4", &[], Mode::SingleNodeWriter)],
                    parameters: [(huge.clone(), "v".to_string())].into(),
                    ..Default::default()
                })
                .await
                .map(drop),
            ),
            (
                "NodeStageVolume fs_type",
                Code::InvalidArgument,
                node.node_stage_volume(NodeStageVolumeRequest {
                    volume_id: "pvc-big".into(),
                    staging_target_path: staging.clone(),
                    volume_capability: Some(huge_fs.clone()),
                    ..Default::default()
                })
                .await
                .map(drop),
            ),
            (
                "NodePublishVolume fs_type",
                Code::InvalidArgument,
                node.node_publish_volume(NodePublishVolumeRequest {
                    volume_id: "pvc-big".into(),
                    staging_target_path: staging.clone(),
                    target_path: target.clone(),
                    volume_capability: Some(huge_fs.clone()),
                    ..Default::default()
                })
                .await
                .map(drop),
            ),
        ]
    });
    for (what, want, r) in results {
        match r {
            Err(s) if s.code() == want && s.message().len() <= 1024 => {}
            Err(s) => {
                return Err(format!("{what}: {:?} with a {}-byte message; wanted {want:?}, short", s.code(), s.message().len()).into())
            }
            Ok(()) => return Err(format!("{what}: succeeded").into()),
        }
    }
    check(site.rt.block_on(probe(&site.path("csi.sock"))).is_some(), "the agent still answers")?;
    check(p.stop().is_some_and(|s| s.success()), "the agent stops cleanly")
}

/// Where `program` is on PATH.
fn which(program: &str) -> Option<PathBuf> {
    std::env::split_paths(&std::env::var_os("PATH")?).map(|d| d.join(program)).find(|p| p.is_file())
}

/// Creates its file when dropped: opens a gate also when a test fails.
struct OpenOnDrop(PathBuf);

impl Drop for OpenOnDrop {
    fn drop(&mut self) {
        let _ = std::fs::write(&self.0, b"");
    }
}

/// kubelet gives up on a stage (its deadline passes) while the stage's
/// mkfs still runs; then the agent is told to stop. It must wait for the
/// stage to finish, keeping its socket until then, not drop it halfway.
/// mkfs.ext4 is a wrapper (first on the agent's PATH) that waits for the
/// test to open a gate, so the stage is slow for exactly as long as needed.
fn shutdown_waits_for_work_a_client_gave_up_on() -> Result<(), Failed> {
    use std::os::unix::fs::PermissionsExt;
    let site = Site::new();
    let real = which("mkfs.ext4").ok_or("mkfs.ext4 not found")?;
    let bin = site.scratch.dir("bin");
    let gate = site.scratch.dir("gate");
    let script = format!(
        "#!/bin/sh\n: > '{g}/started'\ni=0\nwhile [ ! -e '{g}/go' ] && [ $i -lt 600 ]; do sleep 0.05; i=$((i+1)); done\nexec '{real}' \"$@\"\n",
        g = gate.display(),
        real = real.display()
    );
    std::fs::write(bin.join("mkfs.ext4"), script)?;
    std::fs::set_permissions(bin.join("mkfs.ext4"), std::fs::Permissions::from_mode(0o755))?;
    let _gate = OpenOnDrop(gate.join("go"));
    let mut cmd = site.node("state", "csi.sock", &[]);
    cmd.env("PATH", format!("{}:{}", bin.display(), std::env::var("PATH").unwrap_or_default()));
    let mut p = Proc::spawn(&mut cmd);
    let c = site.ready(&mut p, &site.path("csi.sock"))?;
    let (mut ctl, mut node) = (c.controller.clone(), c.node.clone());
    let staging = site.scratch.dir("kubelet").join("plugins/stage/pvc-slow");
    let staged = site.rt.block_on(async {
        ctl.create_volume(CreateVolumeRequest {
            name: "pvc-slow".into(),
            capacity_range: Some(CapacityRange { required_bytes: 64 << 20, limit_bytes: 0 }),
            volume_capabilities: vec![capability(false, "ext4", &[], Mode::SingleNodeWriter)],
            parameters: [("fsType".to_string(), "ext4".to_string())].into(),
            ..Default::default()
        })
        .await?;
        let mut req = tonic::Request::new(NodeStageVolumeRequest {
            volume_id: "pvc-slow".into(),
            staging_target_path: staging.display().to_string(),
            volume_capability: Some(capability(false, "ext4", &[], Mode::SingleNodeWriter)),
            ..Default::default()
        });
        req.set_timeout(Duration::from_millis(300));
        Ok::<_, tonic::Status>(node.node_stage_volume(req).await)
    })?;
    check(staged.is_err(), "the stage finished within the deadline; the gate did not hold mkfs")?;
    let deadline = Instant::now() + patience();
    while !gate.join("started").exists() {
        check(Instant::now() < deadline, "the stage never reached mkfs")?;
        std::thread::sleep(Duration::from_millis(10));
    }
    p.signal(rustix::process::Signal::TERM);
    // Either the agent says it waits for the call, or it goes on stopping.
    loop {
        if p.stderr.find(&["waiting for running CSI calls"]).is_some() {
            break;
        }
        let gone = p.stderr.find(&["stopped", "cpu_ms"]).is_some() || !site.path("csi.sock").exists() || p.exited().is_some();
        check(!gone, format!("the agent stopped while a stage it started was still running:\n{}", p.stderr.text()))?;
        check(Instant::now() < deadline, "the agent neither waited nor stopped")?;
        std::thread::sleep(Duration::from_millis(10));
    }
    check(site.path("csi.sock").exists(), "the socket went before the running call ended")?;
    std::fs::write(gate.join("go"), b"")?;
    let status = p.wait().ok_or("the agent did not stop after the stage")?;
    check(status.success(), format!("exit status {status}"))?;
    let done = p.stderr.find(&["NodeStageVolume", "pvc-slow", "ok"]).ok_or("the stage's outcome was not logged")?;
    let stopped = p.stderr.find(&["stopped", "cpu_ms"]).ok_or("no stopped line")?;
    check(done < stopped, "the agent said it stopped before the stage ended")?;
    let mounted = common_mounts_under(&staging);
    check(!mounted.is_empty(), "the stage did not complete: nothing mounted at the staging path")
}

/// Mount points at or below `dir`.
fn common_mounts_under(dir: &Path) -> Vec<PathBuf> {
    let info = std::fs::read("/proc/thread-self/mountinfo").unwrap_or_default();
    let (table, _) = volring_mounts::MountTable::from_mountinfo(&info);
    table.iter().map(|m| m.mount_point_path().to_path_buf()).filter(|p| p.starts_with(dir)).collect()
}

/// The HTTP/2 client side of a test: what h2 writes is passed on with the
/// `:authority` value of request headers replaced by `authority` (h2 will
/// not send a value that is not a URI authority, other clients do). One
/// request per connection: the client's own HPACK table then never matters.
struct SendAuthority<S> {
    inner: S,
    authority: Vec<u8>,
    written: Vec<u8>,
    ready: Vec<u8>,
    preface_passed: bool,
}

impl<S> SendAuthority<S> {
    /// Moves complete frames from `written` to `ready`, rewriting HEADERS.
    fn frames(&mut self) {
        if !self.preface_passed {
            if self.written.len() < 24 {
                return;
            }
            self.ready.extend(self.written.drain(..24));
            self.preface_passed = true;
        }
        while self.written.len() >= 9 {
            let len = u32::from_be_bytes([0, self.written[0], self.written[1], self.written[2]]) as usize;
            if self.written.len() < 9 + len {
                return;
            }
            let mut frame: Vec<u8> = self.written.drain(..9 + len).collect();
            // h2 sends small request headers as one unpadded HEADERS frame.
            if frame[3] == 0x1 && frame[4] & 0x4 != 0 && frame[4] & 0x28 == 0 {
                let block = with_authority(&frame[9..], &self.authority);
                frame.truncate(9);
                frame[..3].copy_from_slice(&(block.len() as u32).to_be_bytes()[1..]);
                frame.extend(block);
            }
            self.ready.extend(frame);
        }
    }
}

/// An HPACK integer with an `n`-bit prefix: value and length.
fn hpack_int(b: &[u8], n: u8) -> (usize, usize) {
    let max = (1usize << n) - 1;
    let mut v = usize::from(b[0]) & max;
    if v < max {
        return (v, 1);
    }
    let mut i = 1;
    loop {
        v += usize::from(b[i] & 0x7f) << (7 * (i - 1));
        i += 1;
        if b[i - 1] & 0x80 == 0 {
            return (v, i);
        }
    }
}

/// The header block with the value of the literal field named by static
/// index 1 (`:authority`) replaced by `value`, as a plain string.
fn with_authority(block: &[u8], value: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    let mut i = 0;
    while i < block.len() {
        let b = block[i];
        if b & 0x80 != 0 || b & 0xe0 == 0x20 {
            let (_, n) = hpack_int(&block[i..], if b & 0x80 != 0 { 7 } else { 5 });
            out.extend_from_slice(&block[i..i + n]);
            i += n;
            continue;
        }
        let (index, mut n) = hpack_int(&block[i..], if b & 0x40 != 0 { 6 } else { 4 });
        if index == 0 {
            let (len, m) = hpack_int(&block[i + n..], 7);
            n += m + len;
        }
        let (len, m) = hpack_int(&block[i + n..], 7);
        if index == 1 {
            out.extend_from_slice(&block[i..i + n]);
            out.push(value.len() as u8); // short test values: one byte
            out.extend_from_slice(value);
        } else {
            out.extend_from_slice(&block[i..i + n + m + len]);
        }
        i += n + m + len;
    }
    out
}

impl<S: tokio::io::AsyncRead + Unpin> tokio::io::AsyncRead for SendAuthority<S> {
    fn poll_read(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.get_mut().inner).poll_read(cx, buf)
    }
}

impl<S: tokio::io::AsyncWrite + Unpin> tokio::io::AsyncWrite for SendAuthority<S> {
    fn poll_write(self: std::pin::Pin<&mut Self>, _cx: &mut std::task::Context<'_>, buf: &[u8]) -> std::task::Poll<std::io::Result<usize>> {
        let this = self.get_mut();
        this.written.extend_from_slice(buf);
        this.frames();
        std::task::Poll::Ready(Ok(buf.len()))
    }

    fn poll_flush(self: std::pin::Pin<&mut Self>, cx: &mut std::task::Context<'_>) -> std::task::Poll<std::io::Result<()>> {
        let this = self.get_mut();
        while !this.ready.is_empty() {
            let n = std::task::ready!(std::pin::Pin::new(&mut this.inner).poll_write(cx, &this.ready))?;
            this.ready.drain(..n);
        }
        std::pin::Pin::new(&mut this.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: std::pin::Pin<&mut Self>, cx: &mut std::task::Context<'_>) -> std::task::Poll<std::io::Result<()>> {
        std::task::ready!(self.as_mut().poll_flush(cx))?;
        std::pin::Pin::new(&mut self.get_mut().inner).poll_shutdown(cx)
    }
}

/// Identity/Probe over a raw HTTP/2 connection whose `:authority` is
/// `authority`: the grpc-status of the reply, or what went wrong.
async fn probe_with_authority(socket: &Path, authority: &str) -> Result<String, String> {
    use tonic::codegen::{http, Bytes};
    let stream = tokio::net::UnixStream::connect(socket).await.map_err(|e| e.to_string())?;
    let io = SendAuthority {
        inner: stream,
        authority: authority.as_bytes().to_vec(),
        written: Vec::new(),
        ready: Vec::new(),
        preface_passed: false,
    };
    let (mut client, conn) = h2::client::handshake(io).await.map_err(|e| e.to_string())?;
    let conn = tokio::spawn(conn);
    let request = http::Request::builder()
        .method("POST")
        .uri("http://localhost/csi.v1.Identity/Probe")
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .body(())
        .map_err(|e| e.to_string())?;
    let (response, mut body) = client.send_request(request, false).map_err(|e| e.to_string())?;
    // An empty ProbeRequest: uncompressed, zero bytes long.
    body.send_data(Bytes::from_static(&[0, 0, 0, 0, 0]), true).map_err(|e| e.to_string())?;
    let response = response.await.map_err(|e| format!("the request failed: {e}"))?;
    let mut reply = response.into_body();
    let mut data = Vec::new();
    while let Some(chunk) = reply.data().await {
        let chunk = chunk.map_err(|e| e.to_string())?;
        let _ = reply.flow_control().release_capacity(chunk.len());
        data.extend_from_slice(&chunk);
    }
    let trailers = reply.trailers().await.map_err(|e| e.to_string())?.ok_or("no trailers")?;
    conn.abort();
    let status = trailers.get("grpc-status").and_then(|v| v.to_str().ok()).unwrap_or("none").to_string();
    // ProbeResponse { ready: true } after the 5-byte gRPC prefix.
    if status == "0" && data.get(5..) != Some(&[0x0a, 0x02, 0x08, 0x01][..]) {
        return Err(format!("unexpected reply {data:?}"));
    }
    Ok(status)
}

/// Clients send as `:authority` "localhost" (grpc-go), the socket path
/// (grpc-java) or the path percent-encoded (C-core, grpcio): all are served.
fn any_authority_a_grpc_client_sends_is_served() -> Result<(), Failed> {
    let site = Site::new();
    let (mut p, _c) = site.start("state", "csi.sock", &[])?;
    let path = site.path("csi.sock").display().to_string();
    let encoded = path.replace('/', "%2F");
    for authority in ["localhost", &path, &encoded] {
        let status = site.rt.block_on(probe_with_authority(&site.path("csi.sock"), authority));
        check(status.as_deref() == Ok("0"), format!(":authority {authority:?}: {status:?}"))?;
    }
    check(p.stop().is_some_and(|s| s.success()), "the agent stops cleanly")
}

fn main() {
    let trials = vec![
        Trial::test("second_agent_on_the_same_state_dir_is_refused", second_agent_on_the_same_state_dir_is_refused),
        Trial::test("second_agent_on_the_same_socket_is_refused_and_leaves_it", second_agent_on_the_same_socket_is_refused_and_leaves_it),
        Trial::test("a_file_at_the_socket_path_is_refused_and_kept", a_file_at_the_socket_path_is_refused_and_kept),
        Trial::test("metrics_address_in_use_is_fatal", metrics_address_in_use_is_fatal),
        Trial::test("metrics_are_served_on_the_listener_bound_at_start", metrics_are_served_on_the_listener_bound_at_start),
        Trial::test("logs_ready_line_and_version", logs_ready_line_and_version),
        Trial::test("non_root_is_told_it_needs_root", non_root_is_told_it_needs_root),
        Trial::test("nbd_listener_in_use_is_fatal", nbd_listener_in_use_is_fatal),
        Trial::test("sighup_is_logged_and_ignored", sighup_is_logged_and_ignored),
        Trial::test("mounts_watch_into_a_closed_pipe_exits_quietly", mounts_watch_into_a_closed_pipe_exits_quietly),
        Trial::test("nbd_serve_with_a_closed_stdout", nbd_serve_with_a_closed_stdout),
        Trial::test("huge_fields_get_short_messages", huge_fields_get_short_messages),
        Trial::test("shutdown_waits_for_work_a_client_gave_up_on", shutdown_waits_for_work_a_client_gave_up_on),
        Trial::test("any_authority_a_grpc_client_sends_is_served", any_authority_a_grpc_client_sends_is_served),
    ];
    common::run_in_private_namespace(trials)
}
