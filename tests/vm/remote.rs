//! Remote nbd volumes across two machines (see tests/vm/harness.rs and
//! tests/vm/remote.sh): the owning node is this host — its `volring node`
//! serves the volume on 127.0.0.1 with `--nbd-export-listen` — and the
//! consuming node is a 6.1 guest whose kernel nbd driver is attached over
//! TCP to that export. A wrong secret is refused, data is written and
//! verified with checksums, and the owner is killed -9 and restarted on the
//! host under a writer in the guest while the consumer lives; e2fsck -n of
//! the owner's image on the host at the end. A block volume (volumeMode
//! Block: staged without a filesystem, published as a device node) rides
//! the same restarts, its pieces checked in the owner's image. Skips
//! (saying why) without the VM image; fails in CI.
//!
//! The guest reaches the host through qemu's user network, restricted to
//! one forward: `guestfwd=tcp:10.0.2.100:10809-cmd:RELAY`. A `cmd:` forward
//! runs RELAY once per guest connection with that connection as its stdin,
//! stdout and stderr; RELAY is socat to the owner's port (its own messages
//! to a log file, never into the connection, where the kernel would read
//! them as replies). So every reconnect of the consumer is a fresh TCP
//! connection to whichever owner process runs then; while none runs, socat
//! fails to connect and exits, the guest sees its connection closed, and
//! the consumer retries. (A `chardev` forward would connect once, when qemu
//! starts, and never again after the owner's restart.) The owner advertises
//! 10.0.2.100:10809 (`--nbd-export-advertise`), so the URI its CreateVolume
//! writes into the volume context is the one the guest uses.
//!
//! The guest asks for each restart (file `kill-C` in its results) and the
//! host answers `back-C` once the new owner runs.

use std::fs;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::harness;
use crate::harness::{image_or_skip, Vm};
use sha2::Digest;

const SCRIPT: &str = include_str!("remote.sh");
/// The address the guest connects to (qemu's guestfwd).
const GUEST_SIDE: &str = "10.0.2.100:10809";
/// How long the owner stays dead on each restart.
const DOWN: Duration = Duration::from_secs(1);
const VOLUME: &str = "pvc-r";

/// The owning node: `volring node` on this host, restarted at will.
struct Owner {
    dir: tempfile::TempDir,
    port: u16,
    child: Option<Child>,
    runs: u32,
    /// Owners that died at their start (see [`Owner::wait_ready`]).
    respawns: Vec<String>,
}

impl Owner {
    fn new() -> Self {
        let dir = tempfile::Builder::new().prefix("volring-owner-").tempdir().expect("tempdir");
        // A free port on loopback; each run of the owner binds it again.
        let port = std::net::TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()).expect("free port").port();
        Owner { dir, port, child: None, runs: 0, respawns: Vec::new() }
    }

    fn endpoint(&self) -> String {
        format!("unix://{}", self.dir.path().join("owner.sock").display())
    }

    fn image(&self) -> PathBuf {
        self.dir.path().join(format!("state/pool/{VOLUME}.img"))
    }

    fn log(&self, run: u32) -> PathBuf {
        self.dir.path().join(format!("owner{run}.err"))
    }

    /// Starts an owner (a new process on the same state and port).
    fn spawn(&mut self) {
        self.runs += 1;
        let d = self.dir.path();
        let child = Command::new(env!("CARGO_BIN_EXE_volring"))
            .args(["node", "--metrics-addr", "off", "--node-id", "owner", "--stats-interval", "5", "--no-publish"])
            .args(["--nbd-threads", "2", "--nbd-export-advertise", GUEST_SIDE])
            .arg("--nbd-export-listen")
            .arg(format!("127.0.0.1:{}", self.port))
            .arg("--csi-endpoint")
            .arg(self.endpoint())
            .arg("--kubelet-root")
            .arg(d.join("kubelet"))
            .arg("--state-dir")
            .arg(d.join("state"))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(fs::File::create(self.log(self.runs)).expect("owner log"))
            .spawn()
            .expect("start the owner");
        self.child = Some(child);
    }

    fn csi(&self, args: &[&str]) -> std::process::Output {
        Command::new(env!("CARGO_BIN_EXE_volring")).args(["csi", "--endpoint", &self.endpoint()]).args(args).output().expect("volring csi")
    }

    /// Waits (every 100 ms, at most `secs`) for Probe to answer ready. An
    /// owner that exits first is started again, up to 4 times, 1 s apart,
    /// as its supervisor would: on a host short of free memory its ring
    /// setup has failed with ENOMEM (a fatal error for the agent, by
    /// design). The restarts are counted in `respawns`.
    fn wait_ready(&mut self, secs: u64) -> Result<(), String> {
        let deadline = Instant::now() + Duration::from_secs(secs);
        let mut tries = 0;
        loop {
            if String::from_utf8_lossy(&self.csi(&["probe"]).stdout).contains("true") {
                return Ok(());
            }
            if let Some(Ok(Some(status))) = self.child.as_mut().map(|c| c.try_wait()) {
                if tries < 4 && Instant::now() < deadline {
                    tries += 1;
                    self.respawns.push(format!("owner{} exited ({status}) before it was ready", self.runs));
                    std::thread::sleep(Duration::from_secs(1));
                    self.spawn();
                    continue;
                }
                return Err(format!("the owner exited ({status}):\n{}", self.logs()));
            }
            if Instant::now() > deadline {
                return Err(format!("the owner was not ready after {secs} s:\n{}", self.logs()));
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    fn kill_hard(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Every run's log (tails), for a failure message.
    fn logs(&self) -> String {
        let mut out = String::new();
        for run in 1..=self.runs {
            let text = fs::read_to_string(self.log(run)).unwrap_or_default();
            let lines: Vec<&str> = text.lines().collect();
            out.push_str(&format!("--- owner{run}.err\n{}\n", lines[lines.len().saturating_sub(10)..].join("\n")));
        }
        out
    }

    /// The relay qemu runs per guest connection.
    fn relay(&self) -> PathBuf {
        let path = self.dir.path().join("relay.sh");
        let log = self.dir.path().join("relay.log");
        let body = format!("#!/bin/sh\nexec socat -t 0.1 -b 262144 - TCP:127.0.0.1:{},nodelay 2>>'{}'\n", self.port, log.display());
        fs::write(&path, body).expect("relay script");
        fs::set_permissions(&path, std::os::unix::fs::PermissionsExt::from_mode(0o755)).expect("chmod relay");
        path
    }
}

impl Drop for Owner {
    fn drop(&mut self) {
        self.kill_hard();
    }
}

/// Runs remote.sh in a guest against an owner on this host; `cycles`:
/// the owner restarts the guest asks for.
fn remote(test: &str, env: &[(&str, &str)], cycles: u32) {
    let no_heal = env.contains(&("NO_HEAL", "1"));
    let block = env.contains(&("KIND", "block"));
    let Some(image) = image_or_skip(test) else { return };
    if Command::new("socat").arg("-V").output().is_err() {
        // .ci/deps installs it; a missing relay is a broken setup, not a skip.
        panic!("{test}: socat (the guest connection's relay) is not installed: run .ci/deps");
    }
    let mut owner = Owner::new();
    owner.spawn();
    owner.wait_ready(60).unwrap_or_else(|e| panic!("{test}: {e}"));
    let access: &[&str] = if block { &["--block"] } else { &["--param", "fsType=ext4", "--fs", "ext4"] };
    let out = owner.csi(&[&["create", "--name", VOLUME, "--size", "192M", "--param", "attach=nbd"], access].concat());
    assert!(out.status.success(), "{test}: create: {}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    let created: serde_json::Value = serde_json::from_slice(&out.stdout).expect("create's JSON");
    let context = &created["volume"]["volume_context"];
    let uri = context["volring.io/nbd-uri"].as_str().expect("URI in the volume context").to_string();
    let secret = context["volring.io/nbd-secret"].as_str().expect("secret in the volume context").to_string();
    assert_eq!(uri, format!("nbd://{GUEST_SIDE}/{VOLUME}"), "{test}: the advertised URI");

    let mut vm = Vm::new(&image).expect("vm");
    vm.cpus = 2;
    vm.extra_args = vec![
        "-netdev".into(),
        format!("user,id=n0,restrict=on,guestfwd=tcp:{GUEST_SIDE}-cmd:{}", owner.relay().display()),
        "-device".into(),
        "virtio-net-pci,netdev=n0".into(),
    ];
    let mut env: Vec<(&str, &str)> = env.to_vec();
    env.extend([("URI", uri.as_str()), ("SECRET", secret.as_str())]);
    let script = harness::script(env!("CARGO_BIN_EXE_volring"), &env, SCRIPT);
    let timeout = Duration::from_secs(900);
    let mut guest = vm.start(&script).expect("vm start");
    let results = guest.xfer().join("results");

    // The owner's side of the restarts the guest asks for; bounded by the
    // guest's own timeout.
    let mut restarts = Vec::new();
    let mut next = 1;
    while !guest.finished() && guest.elapsed() < timeout {
        if results.join(format!("kill-{next}")).exists() {
            let t = Instant::now();
            owner.kill_hard();
            std::thread::sleep(DOWN);
            owner.spawn();
            let down = t.elapsed();
            fs::write(results.join(format!("back-{next}")), format!("owner down {:.2} s", down.as_secs_f64())).expect("back file");
            owner.wait_ready(60).unwrap_or_else(|e| panic!("{test}: restart {next}: {e}"));
            restarts.push((down, t.elapsed()));
            next += 1;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let run = guest.wait(timeout).expect("vm run");
    let ready: Vec<String> = restarts.iter().map(|(d, r)| format!("{:.2}", (*r - *d).as_secs_f64())).collect();
    eprintln!(
        "note: {test}: {}\n{}{}{}(owner ready after its exec, s: {}; started again at its start: {:?}; guest {:.1} s)",
        run.read("verdict").trim(),
        run.read("notes"),
        run.read("resume"),
        run.read("phases"),
        ready.join(" "),
        owner.respawns,
        run.elapsed.as_secs_f64()
    );
    let tail = |n: &str| harness::tail(&run.read(n), 15);
    let relay_log = fs::read_to_string(owner.dir.path().join("relay.log")).unwrap_or_default();
    assert!(
        run.status == Some(0),
        "{test}:\n{}\n--- consumer.err\n{}\n{}--- writer.err\n{}\n--- relay.log (tail)\n{}",
        run.describe(),
        tail("consumer.err"),
        owner.logs(),
        run.read("writer.err"),
        relay_log.lines().rev().take(10).collect::<Vec<_>>().join("\n")
    );
    assert_eq!(restarts.len() as u32, cycles, "{test}: restarts the guest asked for");
    for run in 1..=owner.runs {
        let log = fs::read_to_string(owner.log(run)).unwrap_or_default();
        assert!(!log.contains(&secret), "{test}: the secret is in owner{run}.err");
    }
    owner.kill_hard();
    if block {
        // Every piece the guest wrote, at its offset in the owner's image
        // (pieces of remote.sh's default FILE_KIB, 1 MiB).
        let image = fs::read(owner.image()).expect("the owner's image");
        let writes = run.read("writes");
        for line in writes.lines() {
            let mut f = line.split_whitespace();
            let (n, sum): (usize, &str) = (f.next().and_then(|n| n.parse().ok()).expect("piece number"), f.next().expect("piece sum"));
            let piece = &image[(n - 1) << 20..n << 20];
            let got: String = sha2::Sha256::digest(piece).iter().map(|b| format!("{b:02x}")).collect();
            assert_eq!(got, sum, "{test}: piece {n} in the owner's image");
        }
        assert!(writes.lines().count() >= 64, "{test}: {} pieces written", writes.lines().count());
    } else if !no_heal {
        // The filesystem the consumer left, as the owner's disk holds it.
        let fsck = Command::new("e2fsck").arg("-fn").arg(owner.image()).output().expect("e2fsck");
        assert!(fsck.status.success(), "{test}: e2fsck -fn of the owner's image:\n{}", String::from_utf8_lossy(&fsck.stdout));
    }
}

/// The owner (on the host) is killed -9 and restarted 3 times under a
/// writer on the consumer (in the guest); the consumer reconnects each
/// time, no write fails, the data and the filesystem verify.
pub fn owner_restarts_under_a_remote_writer() {
    let cycles = std::env::var("VOLRING_REMOTE_CYCLES").unwrap_or_else(|_| "3".into());
    let conns = std::env::var("VOLRING_REMOTE_CONNS").unwrap_or_else(|_| "1".into());
    let n = cycles.parse().expect("VOLRING_REMOTE_CYCLES");
    remote("vm_remote::owner_restarts_under_a_remote_writer", &[("CYCLES", &cycles), ("CONNS", &conns)], n);
}

/// A block volume (volumeMode Block: NodeStage, NodePublish of the device
/// node) served by the host's owner, written in pieces at their offsets
/// while the owner restarts twice; the pieces verify in the guest after a
/// re-stage and in the owner's image on the host.
pub fn block_volume_rides_owner_restarts() {
    remote("vm_remote::block_volume_rides_owner_restarts", &[("KIND", "block"), ("CYCLES", "2")], 2);
}

/// The control: the consumer does not reconnect (--nbd-no-heal, 4 s
/// dead-connection timeout) and the same restart fails the writer.
pub fn without_reconnecting_the_writer_fails() {
    remote("vm_remote::without_reconnecting_the_writer_fails", &[("NO_HEAL", "1")], 1);
}
