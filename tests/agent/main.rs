//! `volring node` as a process: one agent per state directory and socket,
//! listeners that cannot be had are fatal, signals, shutdown waiting for
//! work a client gave up on, bounded error messages, and the printing
//! commands into a closed pipe. Each test starts its own processes in a
//! scratch directory, inside a private mount namespace, and stops them by
//! PID. The tests live in one module per theme; this file holds what they
//! share (`Proc`, `Site`, the waits) and the list of trials.

#[path = "../common/mod.rs"]
mod common;

mod authority;
mod listeners;
mod pipes;
mod shutdown;

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

use authority::any_authority_a_grpc_client_sends_is_served;
use listeners::{
    a_file_at_the_socket_path_is_refused_and_kept, logs_ready_line_and_version, metrics_address_in_use_is_fatal,
    metrics_are_served_on_the_listener_bound_at_start, nbd_listener_in_use_is_fatal, nbd_ring_counters_reach_metrics,
    non_root_is_told_it_needs_root, second_agent_on_the_same_socket_is_refused_and_leaves_it,
    second_agent_on_the_same_state_dir_is_refused,
};
use pipes::{
    a_closed_stderr_does_not_stop_the_agent, mounts_watch_into_a_closed_pipe_exits_quietly, nbd_serve_checks_exports_before_listening,
    nbd_serve_memlock_is_named, nbd_serve_with_a_closed_stdout, sighup_is_logged_and_ignored,
};
use shutdown::{huge_fields_get_short_messages, shutdown_waits_for_work_a_client_gave_up_on, staged_volumes_mark_their_devices};

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
        common::detach_loops_under(&dir);
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

fn http_get(addr: std::net::SocketAddr, path: &str) -> Result<String, Failed> {
    let mut conn = std::net::TcpStream::connect(addr)?;
    conn.set_read_timeout(Some(patience()))?;
    std::io::Write::write_all(&mut conn, format!("GET {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n").as_bytes())?;
    let mut reply = String::new();
    conn.take(1 << 20).read_to_string(&mut reply)?;
    Ok(reply)
}

/// Mount points at or below `dir`.
fn common_mounts_under(dir: &Path) -> Vec<PathBuf> {
    let info = std::fs::read("/proc/thread-self/mountinfo").unwrap_or_default();
    let (table, _) = volring_mounts::MountTable::from_mountinfo(&info);
    table.iter().map(|m| m.mount_point_path().to_path_buf()).filter(|p| p.starts_with(dir)).collect()
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
        Trial::test("nbd_ring_counters_reach_metrics", nbd_ring_counters_reach_metrics),
        Trial::test("sighup_is_logged_and_ignored", sighup_is_logged_and_ignored),
        Trial::test("mounts_watch_into_a_closed_pipe_exits_quietly", mounts_watch_into_a_closed_pipe_exits_quietly),
        Trial::test("nbd_serve_with_a_closed_stdout", nbd_serve_with_a_closed_stdout),
        Trial::test("a_closed_stderr_does_not_stop_the_agent", a_closed_stderr_does_not_stop_the_agent),
        Trial::test("nbd_serve_checks_exports_before_listening", nbd_serve_checks_exports_before_listening),
        Trial::test("nbd_serve_memlock_is_named", nbd_serve_memlock_is_named),
        Trial::test("staged_volumes_mark_their_devices", staged_volumes_mark_their_devices),
        Trial::test("huge_fields_get_short_messages", huge_fields_get_short_messages),
        Trial::test("shutdown_waits_for_work_a_client_gave_up_on", shutdown_waits_for_work_a_client_gave_up_on),
        Trial::test("any_authority_a_grpc_client_sends_is_served", any_authority_a_grpc_client_sends_is_served),
    ];
    common::run_in_private_namespace(trials)
}
