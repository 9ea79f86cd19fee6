//! Where the nbd healer's start walk sits in `volring node`'s start, on
//! this machine's kernel (no VM, no TCG): an agent whose store records an
//! `attach: nbd` volume is started (and killed -9) several times, and its
//! log must show the walk reach the record before the agent starts its
//! mount watcher or scans the block devices: while an agent is away the
//! kernel queues its nbd volumes' I/O, so nothing the walk does not need
//! may come first.
//!
//! The order is asserted; the times are only printed (never asserted):
//! exec to the walk's decision and exec to "ready", with their ratio, and
//! the userspace half of a reconnect (the driver's NBD server started, the
//! image exported, one socket negotiated), which the walk does next for a
//! device that is still there. This kernel has no nbd module, so the walk
//! finds the recorded device gone; the RECONFIGURE itself is one netlink
//! request, measured only in the VM (tests/vm/healer.sh).
//!
//! Runs in a private mount namespace (tests/common); the agents are
//! stopped by PID.

mod common;

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{check, without_colours, Scratch};
use libtest_mimic::{Failed, Trial};
use volring_volumes::{AccessKind, AttachKind, StagePhase, StagedRecords, StagedVolume};

const VOLRING: &str = env!("CARGO_BIN_EXE_volring");
/// The longest any agent may take to say it is ready.
const PATIENCE: Duration = Duration::from_secs(60);
/// Agent starts measured.
const RUNS: usize = 15;

fn main() {
    common::run_in_private_namespace(vec![Trial::test(
        "heal_start::the_nbd_walk_comes_before_the_mount_watcher_and_the_device_scan",
        walk_comes_first,
    )]);
}

/// The moments (since the spawn) at which the agent logged each line we
/// look for; `None` when it never did.
#[derive(Debug, Default)]
struct Start {
    /// The agent's first line ("volring node starting").
    main: Option<Duration>,
    walk: Option<(usize, Duration)>,
    mounts: Option<(usize, Duration)>,
    devices: Option<(usize, Duration)>,
    ready: Option<Duration>,
    log: Vec<String>,
}

/// Kills the agent (by PID) when dropped, so a failing check leaves
/// nothing running.
struct Agent(Child);

impl Drop for Agent {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn start_once(state: &Path, kubelet: &Path, socket: &Path) -> Result<Start, Failed> {
    let mut cmd = Command::new(VOLRING);
    cmd.args(["node", "--node-id", "heal-start", "--metrics-addr", "off", "--no-publish", "--stats-interval", "5"])
        .arg("--csi-endpoint")
        .arg(format!("unix://{}", socket.display()))
        .arg("--kubelet-root")
        .arg(kubelet)
        .arg("--state-dir")
        .arg(state)
        .env("RUST_LOG", "volring=info")
        .env("NO_COLOR", "1")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    // Before the spawn: the exec is at most a fork later, so every figure
    // is an upper bound. (`spawn` returns once the exec succeeded.)
    let t0 = Instant::now();
    let mut agent = Agent(cmd.spawn()?);
    let stderr = agent.0.stderr.take().expect("piped");
    let (tx, rx) = mpsc::channel::<(Instant, String)>();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines() {
            let Ok(line) = line else { break };
            if tx.send((Instant::now(), line)).is_err() {
                break;
            }
        }
    });
    let mut s = Start::default();
    let deadline = t0 + PATIENCE;
    while s.ready.is_none() {
        let left = deadline.saturating_duration_since(Instant::now());
        let Ok((at, line)) = rx.recv_timeout(left) else {
            return Err(format!("the agent did not say ready within {PATIENCE:?}:\n{}", s.log.join("\n")).into());
        };
        let line = without_colours(&line);
        let (n, since) = (s.log.len(), at - t0);
        if line.contains("volring node starting") {
            s.main = Some(since);
        } else if line.contains("the recorded nbd device is gone") && s.walk.is_none() {
            s.walk = Some((n, since));
        } else if line.contains("watching the mount table") {
            s.mounts = Some((n, since));
        } else if line.contains("block device inventory") {
            s.devices = Some((n, since));
        } else if line.contains("agent: ready") {
            s.ready = Some(since);
        }
        s.log.push(line);
    }
    drop(agent);
    Ok(s)
}

fn walk_comes_first() -> Result<(), Failed> {
    let scratch = Scratch::new();
    let state = scratch.dir("state");
    let kubelet = scratch.dir("kubelet");
    let socket = scratch.path().join("csi.sock");
    // An nbd volume the store says is staged on a device no kernel has
    // (this one has no nbd module at all): the walk finds it gone.
    {
        let records = StagedRecords::open(&state)?;
        records.put(&StagedVolume {
            volume_id: "pvc-walk".into(),
            image: state.join("pool/pvc-walk.img"),
            staging_path: kubelet.join("plugins/stage/pvc-walk"),
            access: AccessKind::Mount { fs_type: "ext4".into(), flags: vec![] },
            read_only: false,
            phase: StagePhase::Staged,
            loop_number: None,
            published: Default::default(),
            attach: AttachKind::Nbd,
            nbd_index: Some(1 << 20),
            remote: None,
        })?;
    }
    let mut walks = Vec::new();
    let mut readies = Vec::new();
    let mut mains = Vec::new();
    for run in 1..=RUNS {
        let s = start_once(&state, &kubelet, &socket)?;
        let log = || s.log.join("\n");
        let Some((walk_line, walk)) = s.walk else {
            return Err(format!("run {run}: the walk never reached the recorded volume:\n{}", log()).into());
        };
        let (Some((mounts_line, _)), Some((devices_line, _))) = (s.mounts, s.devices) else {
            return Err(format!("run {run}: no mount-table or device-inventory line:\n{}", log()).into());
        };
        check(
            walk_line < mounts_line && walk_line < devices_line,
            format!("run {run}: the nbd walk came after the mount watcher or the device scan:\n{}", log()),
        )?;
        let Some(main) = s.main else { return Err(format!("run {run}: no starting line:\n{}", log()).into()) };
        mains.push(main);
        walks.push(walk);
        readies.push(s.ready.expect("loop ends at ready"));
        if run == RUNS {
            // What the last start did before its walk (for profiling).
            eprintln!("note: heal_start: the last start up to its walk:\n{}", s.log[..=walk_line].join("\n"));
        }
    }
    let server = reconnect_userspace(&scratch)?;
    let (w, r, m) = (median(&mut walks), median(&mut readies), median(&mut mains));
    eprintln!(
        "note: heal_start ({RUNS} agent starts, debug build): exec -> nbd walk decision min {:.1} median {:.1} max {:.1} ms; \
         exec -> the agent's first line median {:.1} ms; exec -> ready median {:.1} ms; walk/ready {:.2}; server start + export + 1 negotiated socket median {:.1} ms \
         (min {:.1}, max {:.1}) over {RUNS}",
        ms(walks[0]),
        ms(w),
        ms(walks[RUNS - 1]),
        ms(m),
        ms(r),
        w.as_secs_f64() / r.as_secs_f64(),
        ms(server.1),
        ms(server.0),
        ms(server.2),
    );
    Ok(())
}

/// What the walk does for a device still there, short of the RECONFIGURE:
/// the driver's NBD server started, the image exported, one socket
/// negotiated; (min, median, max) over `RUNS`.
fn reconnect_userspace(scratch: &Scratch) -> Result<(Duration, Duration, Duration), Failed> {
    use volring_nbd::{ExportSpec, Exports, NbdServer, ServerConfig};
    let image = scratch.path().join("walk.img");
    std::fs::File::create(&image)?.set_len(64 << 20)?;
    let mut times = Vec::new();
    for _ in 0..RUNS {
        let t0 = Instant::now();
        let threads = ServerConfig::default().threads.max(1);
        let server = NbdServer::start(ServerConfig { threads, ..ServerConfig::default() }, Arc::new(Exports::default()))?;
        let spec = ExportSpec {
            name: "walk".into(),
            path: image.clone(),
            read_only: false,
            direct_io: false,
            max_connections: 0,
            description: "walk".into(),
        };
        server.add_export(&spec)?;
        let (sockets, details) = volring_nbd::attach::local_sockets(&server, "walk", 1)?;
        times.push(t0.elapsed());
        check(sockets.len() == 1 && details.size == 64 << 20, format!("negotiated {} sockets, size {}", sockets.len(), details.size))?;
        drop(sockets);
        server.stop();
    }
    let m = median(&mut times);
    Ok((times[0], m, times[RUNS - 1]))
}

/// Sorts and returns the median (the lower middle of an even count).
fn median(v: &mut [Duration]) -> Duration {
    v.sort();
    v[(v.len() - 1) / 2]
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}
