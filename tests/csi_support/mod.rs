//! A running `volring node` with its CSI socket in a scratch directory, and
//! a client connected to it. Dropping it stops the agent (by PID), unmounts
//! everything under the scratch directory and detaches every loop device
//! whose image lives there, so a failing test leaves nothing behind.
//!
//! The agent's log (RUST_LOG=volring=debug) goes to `agent.log` in the
//! scratch directory (every run of the agent appends), or to the test's
//! stderr when `VOLRING_TEST_LOG` is set. Crash tests start it with a fault
//! point armed ([`Agent::arm`]) and see it die there ([`Agent::died_at_point`]).

#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use tonic::{Code, Status};
use volring_csi::client::{capability, Clients};
use volring_csi::proto::volume_capability::access_mode::Mode;
use volring_csi::proto::*;

use crate::common::{without_colours, Scratch};

pub mod crash_model;
mod machine;

pub use machine::*;

pub const MIB: i64 = 1 << 20;

pub struct Agent {
    pub scratch: Scratch,
    pub kubelet: PathBuf,
    pub state: PathBuf,
    pub socket: PathBuf,
    /// Where the agent's log goes (unless `VOLRING_TEST_LOG` is set).
    pub log: PathBuf,
    child: Option<Child>,
    pub rt: tokio::runtime::Runtime,
    pub c: Clients,
}

impl Agent {
    pub fn start() -> Self {
        Self::start_with(&[])
    }

    /// Starts an agent with `env` added to its environment (its flags'
    /// variables, such as `VOLRING_NFS_LISTEN`).
    pub fn start_with(env: &[(&str, &str)]) -> Self {
        let scratch = Scratch::new();
        let kubelet = scratch.dir("kubelet");
        let state = scratch.dir("state");
        let socket = scratch.path().join("csi.sock");
        let log = scratch.path().join("agent.log");
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
        let mut child = spawn(&kubelet, &state, &socket, &log, env);
        let c = rt.block_on(connect(&socket, &mut child, &log));
        Self { scratch, kubelet, state, socket, log, child: Some(child), rt, c }
    }

    /// Stops the agent (SIGTERM, then wait) and starts a new one on the same
    /// state, as after an upgrade or a crash loop.
    pub fn restart(&mut self) {
        self.stop();
        self.respawn();
    }

    /// Kills the agent with SIGKILL: no chance to clean anything up.
    pub fn kill_hard(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Starts a plain agent on the same state (after [`Self::kill_hard`] or
    /// a death at a fault point) and connects the clients to it.
    pub fn respawn(&mut self) {
        self.respawn_with(&[]);
    }

    /// Kills whatever agent runs (SIGKILL) and starts one with `env` added
    /// to its environment, on the same state; returns once it is ready.
    pub fn respawn_with(&mut self, env: &[(&str, &str)]) {
        self.kill_hard();
        let mut child = spawn(&self.kubelet, &self.state, &self.socket, &self.log, env);
        self.c = self.rt.block_on(connect(&self.socket, &mut child, &self.log));
        self.child = Some(child);
    }

    /// Replaces the agent by one that SIGKILLs itself at fault point `point`
    /// (`name` or `name@N`, see `src/fault.rs`). True once it is ready;
    /// false when it died at the point before that — while finishing, at
    /// start, an operation an earlier crash interrupted. No agent runs then.
    pub fn arm(&mut self, point: &str) -> bool {
        self.kill_hard();
        let mut child = spawn(&self.kubelet, &self.state, &self.socket, &self.log, &[("VOLRING_FAULT_POINT", point)]);
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if let Ok(Some(_)) = child.try_wait() {
                return false;
            }
            if let Some(c) = self.rt.block_on(try_connect(&self.socket)) {
                self.child = Some(child);
                self.c = c;
                return true;
            }
            assert!(Instant::now() < deadline, "the armed agent neither became ready nor died on {}", self.socket.display());
            std::thread::sleep(Duration::from_millis(25));
        }
    }

    /// Waits (bounded, 20 s) for the running agent to exit; true if it died
    /// of SIGKILL, as it does at an armed fault point. No agent runs after.
    pub fn died_at_point(&mut self) -> bool {
        let Some(mut c) = self.child.take() else { return false };
        let deadline = Instant::now() + Duration::from_secs(20);
        while Instant::now() < deadline {
            if let Ok(Some(status)) = c.try_wait() {
                return std::os::unix::process::ExitStatusExt::signal(&status) == Some(libc::SIGKILL);
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        let _ = c.kill();
        let _ = c.wait();
        false
    }

    /// Whether the agent started last is still running.
    pub fn alive(&mut self) -> bool {
        self.child.as_mut().is_some_and(|c| matches!(c.try_wait(), Ok(None)))
    }

    /// The last `n` lines of the agent's log file (for a failure message).
    pub fn log_tail(&self, n: usize) -> String {
        log_tail(&self.log, n)
    }

    fn stop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = rustix::process::kill_process(rustix::process::Pid::from_child(&c), rustix::process::Signal::TERM);
            let deadline = Instant::now() + Duration::from_secs(15);
            while Instant::now() < deadline {
                if let Ok(Some(_)) = c.try_wait() {
                    return;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// The running agent's PID (0 when none runs).
    pub fn pid(&self) -> u32 {
        self.child.as_ref().map_or(0, |c| c.id())
    }

    pub fn k(&self, rel: &str) -> String {
        self.kubelet.join(rel).to_string_lossy().into_owned()
    }

    pub fn image(&self, id: &str) -> PathBuf {
        self.state.join("pool").join(format!("{id}.img"))
    }

    pub fn run<T>(&self, f: impl std::future::Future<Output = T>) -> T {
        self.rt.block_on(f)
    }

    // ---- calls, each returning the reply or the status ----

    pub fn create(&self, name: &str, size: i64, fs: &str) -> Result<Volume, Status> {
        let mut c = self.c.controller.clone();
        let mut params = std::collections::HashMap::new();
        if !fs.is_empty() {
            params.insert("fsType".to_string(), fs.to_string());
        }
        let r = self.run(c.create_volume(CreateVolumeRequest {
            name: name.into(),
            capacity_range: Some(CapacityRange { required_bytes: size, limit_bytes: 0 }),
            volume_capabilities: vec![mount_cap(fs)],
            parameters: params,
            ..Default::default()
        }))?;
        Ok(r.into_inner().volume.expect("volume"))
    }

    pub fn delete(&self, id: &str) -> Result<(), Status> {
        let mut c = self.c.controller.clone();
        self.run(c.delete_volume(DeleteVolumeRequest { volume_id: id.into(), ..Default::default() })).map(drop)
    }

    pub fn stage(&self, id: &str, staging: &str, cap: VolumeCapability) -> Result<(), Status> {
        let mut c = self.c.node.clone();
        self.run(c.node_stage_volume(NodeStageVolumeRequest {
            volume_id: id.into(),
            staging_target_path: staging.into(),
            volume_capability: Some(cap),
            ..Default::default()
        }))
        .map(drop)
    }

    pub fn unstage(&self, id: &str, staging: &str) -> Result<(), Status> {
        let mut c = self.c.node.clone();
        self.run(c.node_unstage_volume(NodeUnstageVolumeRequest { volume_id: id.into(), staging_target_path: staging.into() })).map(drop)
    }

    pub fn publish(&self, id: &str, staging: &str, target: &str, cap: VolumeCapability, readonly: bool) -> Result<(), Status> {
        let mut c = self.c.node.clone();
        self.run(c.node_publish_volume(NodePublishVolumeRequest {
            volume_id: id.into(),
            staging_target_path: staging.into(),
            target_path: target.into(),
            volume_capability: Some(cap),
            readonly,
            ..Default::default()
        }))
        .map(drop)
    }

    pub fn unpublish(&self, id: &str, target: &str) -> Result<(), Status> {
        let mut c = self.c.node.clone();
        self.run(c.node_unpublish_volume(NodeUnpublishVolumeRequest { volume_id: id.into(), target_path: target.into() })).map(drop)
    }

    pub fn stats(&self, id: &str, path: &str) -> Result<NodeGetVolumeStatsResponse, Status> {
        let mut c = self.c.node.clone();
        self.run(c.node_get_volume_stats(NodeGetVolumeStatsRequest {
            volume_id: id.into(),
            volume_path: path.into(),
            staging_target_path: String::new(),
        }))
        .map(|r| r.into_inner())
    }

    pub fn expand(&self, id: &str, size: i64, cap: VolumeCapability) -> Result<ControllerExpandVolumeResponse, Status> {
        let mut c = self.c.controller.clone();
        self.run(c.controller_expand_volume(ControllerExpandVolumeRequest {
            volume_id: id.into(),
            capacity_range: Some(CapacityRange { required_bytes: size, limit_bytes: 0 }),
            volume_capability: Some(cap),
            ..Default::default()
        }))
        .map(|r| r.into_inner())
    }

    pub fn node_expand(&self, id: &str, path: &str, size: i64) -> Result<i64, Status> {
        let mut c = self.c.node.clone();
        self.run(c.node_expand_volume(NodeExpandVolumeRequest {
            volume_id: id.into(),
            volume_path: path.into(),
            capacity_range: Some(CapacityRange { required_bytes: size, limit_bytes: 0 }),
            ..Default::default()
        }))
        .map(|r| r.into_inner().capacity_bytes)
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        self.stop();
        unmount_under(self.scratch.path());
        detach_loops_under(self.scratch.path());
    }
}

pub fn mount_cap(fs: &str) -> VolumeCapability {
    capability(false, fs, &[], Mode::SingleNodeWriter)
}

pub fn block_cap() -> VolumeCapability {
    capability(true, "", &[], Mode::SingleNodeWriter)
}

pub fn code<T>(r: Result<T, Status>) -> Option<Code> {
    r.err().map(|s| s.code())
}

/// Starts `volring node` on the given paths with `env` added to its
/// environment; its stderr is appended to `log` (or inherited when
/// `VOLRING_TEST_LOG` is set).
fn spawn(kubelet: &Path, state: &Path, socket: &Path, log: &Path, env: &[(&str, &str)]) -> Child {
    let _ = std::fs::remove_file(socket.with_extension("ready"));
    let _ = std::fs::remove_file(socket);
    let stderr = match std::env::var_os("VOLRING_TEST_LOG") {
        Some(_) => Stdio::inherit(),
        None => std::fs::OpenOptions::new().create(true).append(true).open(log).map_or_else(|_| Stdio::null(), Stdio::from),
    };
    // `/metrics` only when the test asks for it (VOLRING_METRICS_ADDR in `env`).
    let metrics = env.iter().find(|(k, _)| *k == "VOLRING_METRICS_ADDR").map_or("off", |(_, v)| *v);
    Command::new(env!("CARGO_BIN_EXE_volring"))
        .args(["node", "--metrics-addr", metrics, "--node-id", "test-node", "--stats-interval", "5"])
        .arg("--csi-endpoint")
        .arg(format!("unix://{}", socket.display()))
        .arg("--kubelet-root")
        .arg(kubelet)
        .arg("--state-dir")
        .arg(state)
        .env("RUST_LOG", "volring=debug")
        .envs(env.iter().copied())
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(stderr)
        .spawn()
        .expect("start volring node")
}

/// Connects once; the clients when the agent answers Probe ready.
async fn try_connect(socket: &Path) -> Option<Clients> {
    if !socket.exists() {
        return None;
    }
    let mut c = Clients::connect(socket.to_path_buf()).await.ok()?;
    let r = c.identity.probe(ProbeRequest {}).await.ok()?;
    (r.into_inner().ready == Some(true)).then_some(c)
}

/// Waits for the agent `child` to answer Probe ready on `socket`. A failure
/// says why, with the end of the agent's `log`: the agent exited (and how),
/// or it was still not ready after the budget.
async fn connect(socket: &Path, child: &mut Child, log: &Path) -> Clients {
    let deadline = Instant::now() + Duration::from_secs(if std::env::var_os("CI").is_some() { 60 } else { 20 });
    loop {
        if let Some(c) = try_connect(socket).await {
            return c;
        }
        if let Ok(Some(status)) = child.try_wait() {
            panic!("the agent exited ({status}) before it was ready on {}:\n{}", socket.display(), log_tail(log, 40));
        }
        assert!(Instant::now() < deadline, "the agent did not become ready on {}:\n{}", socket.display(), log_tail(log, 40));
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
}

/// The last `n` lines of an agent's log file, without terminal colours.
fn log_tail(log: &Path, n: usize) -> String {
    let raw = std::fs::read_to_string(log).unwrap_or_default();
    let lines: Vec<String> = raw.lines().map(without_colours).collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

/// Whether the agent (started by this test process, with its
/// capabilities) may grow a mounted ext4 filesystem: the kernel grows one
/// only for CAP_SYS_RESOURCE, so without it NodeExpandVolume of an ext4
/// volume must answer FailedPrecondition.
pub fn ext4_grows_mounted() -> bool {
    rustix::thread::capabilities(None).is_ok_and(|c| c.effective.contains(rustix::thread::CapabilitySet::SYS_RESOURCE))
}
