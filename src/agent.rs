//! `volring node`: starts the agent's components, runs until told to
//! stop, and stops them.
//!
//! The agent is a list of components (`component.rs`), started in order
//! (`start.rs`) and stopped in the reverse order, each stop bounded: the
//! NBD server, the CSI driver (after the nbd healer's start walk), the
//! mount watcher, the CSI server, the hot-plug listener, the stat
//! collector, the reconciler, the shared-volume loop, the metrics server,
//! the healer hook and the publisher. Three ring threads feed one async
//! loop (`events.rs`): the mount watcher, the hot-plug listener and the
//! stat collector. The loop owns the device inventory, joins it with the
//! mount table (which device is mounted where), tells the collector which
//! devices to sample, and publishes the inventory for `/metrics` and the
//! publisher. The mount table is shared with the CSI driver behind a
//! read-write lock: the loop writes each batch of events,
//! NodeGetVolumeStats reads one entry.

mod component;
mod csi;
mod events;
mod publisher;
mod signals;
mod start;
mod volumes;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::Context;

use volring_devices::{CollectorConfig, ScanConfig};
use volring_mounts::WatchConfig;

/// The target of the agent's log lines, whichever of its modules logs
/// them (`INFO volring::agent: ready ...`).
const TARGET: &str = "volring::agent";

/// What `volring node` was asked to do.
#[derive(Debug, Clone)]
pub(crate) struct AgentConfig {
    pub mounts: WatchConfig,
    pub devices: ScanConfig,
    pub stats: CollectorConfig,
    /// Where `/metrics` is served; `None`: not served.
    pub metrics: Option<SocketAddr>,
    /// Log a line per mount and device event (they are always counted).
    pub log_events: bool,
    /// The agent's state directory; one agent at a time may use it.
    pub state_dir: PathBuf,
    /// The CSI driver's settings; `None`: no CSI socket.
    pub csi: Option<volring_csi::CsiConfig>,
    /// The NBD server's settings; `None`: no NBD server.
    pub nbd: Option<NbdConfig>,
    /// How the CSI volumes' state is reconciled.
    pub reconcile: volring_volumes::ReconcileConfig,
    /// Publishing BlockDevice and StorageNode objects; `None`: not published.
    pub publish: Option<PublishConfig>,
    /// The re-read after creating a shared volume's Service or Endpoints
    /// (the loop runs when the node serves NFS and has a cluster).
    pub share_kube: volring_share::kube::ControllerConfig,
    /// Where other nodes' NFS servers see this node's connections come
    /// from: announced on a shared volume's PVC at its stage
    /// (`--nfs-client-address`).
    pub nfs_client_address: Option<std::net::IpAddr>,
}

/// Where and how fast the node's objects are published.
#[derive(Debug, Clone)]
pub(crate) struct PublishConfig {
    /// `Some(true)`: the cluster (fails when no client configuration is
    /// found); `Some(false)`: the node's store; `None`: the cluster when a
    /// kubeconfig or a pod's service account is found, else the store.
    pub kube: Option<bool>,
    pub qps: f64,
    pub burst: u32,
    pub window: Duration,
    pub gone: volring_kube::GonePolicy,
}

impl Default for PublishConfig {
    fn default() -> Self {
        let d = volring_kube::UpdaterConfig::new("");
        Self { kube: None, qps: d.qps, burst: d.burst, window: d.window, gone: d.gone }
    }
}

/// The node's NBD server: where it listens and what it exports at start.
#[derive(Debug, Clone)]
pub(crate) struct NbdConfig {
    pub server: volring_nbd::ServerConfig,
    pub exports: Vec<volring_nbd::ExportSpec>,
}

impl Default for AgentConfig {
    fn default() -> Self {
        Self {
            mounts: WatchConfig::default(),
            devices: ScanConfig::default(),
            stats: CollectorConfig::default(),
            metrics: Some(SocketAddr::from(([127, 0, 0, 1], 9477))),
            log_events: false,
            state_dir: PathBuf::from("/var/lib/volring"),
            csi: None,
            nbd: None,
            reconcile: Default::default(),
            publish: Some(PublishConfig::default()),
            share_kube: Default::default(),
            nfs_client_address: None,
        }
    }
}

/// The name of the lock file in the state directory.
const LOCK_FILE: &str = "agent.lock";

/// Runs the agent until SIGINT or SIGTERM; SIGHUP is logged and ignored
/// (nothing of `volring node` is reloadable).
///
/// Everything that can make a second agent on the node harmful is taken
/// first, and failing to take it is fatal: the state directory's lock, the
/// CSI socket, the metrics address and the NBD listeners. Only then do the
/// rings and servers start (`start.rs`). A start that fails half way stops
/// what it started. At a stop, `/readyz` and Probe turn not ready first;
/// then the components stop, newest first: the publisher writes what is
/// pending, the shared-volume loop empties this node's Endpoints, the CSI
/// server lets running calls finish and removes its socket.
pub(crate) async fn run(config: AgentConfig) -> anyhow::Result<()> {
    // The first line: how long the process took to reach its own code
    // (exec, loading) tells apart from what the start below costs.
    tracing::info!(pid = std::process::id(), "volring node starting");
    let signals = signals::Signals::take()?;
    lock_state_dir(&config.state_dir)?;
    let mut parts = component::Components::new();
    let started = match start::start(&config, &mut parts).await {
        Ok(s) => s,
        Err(e) => {
            // The start's error is what the agent exits with.
            parts.stop().await;
            return Err(e);
        }
    };
    tracing::debug!(components = ?parts.names(), "every component started");
    let start::Started { events, ready, summary } = started;
    let mount_stats = events.mount_stats.clone();
    ready.set(true);
    say_ready(&summary, &events);
    signals.follow(&parts);
    let stopping = parts.stopping().clone();
    let result = events.run(&stopping).await.and_then(|()| stopping.outcome());
    ready.set(false);
    let stopped = parts.stop().await;
    if let Some(e) = stopped.error {
        return Err(e);
    }
    let stats = mount_stats.load_full();
    tracing::info!(events = stats.mount_events, resyncs = stats.resyncs, cpu_ms = stats.cpu.as_millis() as u64, "stopped");
    result
}

/// One line that says what this agent serves, for the person who just
/// started it.
fn say_ready(s: &start::Summary, events: &events::Events) {
    tracing::info!(
        mounts = events::read(&events.table).len(),
        devices = events.inventory.devices.len(),
        metrics = s.metrics.as_deref().unwrap_or("off"),
        csi = s.csi.as_deref().unwrap_or("off"),
        nbd = s.nbd.as_deref().unwrap_or("off"),
        nbd_export = s.nbd_export.as_deref().unwrap_or("off"),
        volumes = s.volumes,
        "ready"
    );
}

/// Takes the state directory for this process: an exclusive `flock` on
/// `STATE_DIR/agent.lock`, which then holds the holder's pid. The lock is
/// held until the process exits (its descriptor is never closed), also
/// past `run` while the runtime waits for blocking work to end, so a
/// restarted agent cannot start while the old one still touches the state.
pub(crate) fn lock_state_dir(dir: &Path) -> anyhow::Result<()> {
    use std::io::{Read, Seek, Write};
    use std::os::fd::IntoRawFd;
    std::fs::create_dir_all(dir).with_context(|| format!("cannot create the state directory {}", dir.display()))?;
    let path = dir.join(LOCK_FILE);
    let mut file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(&path)
        .with_context(|| format!("cannot open {}", path.display()))?;
    match rustix::fs::flock(&file, rustix::fs::FlockOperation::NonBlockingLockExclusive) {
        Ok(()) => {}
        Err(rustix::io::Errno::WOULDBLOCK) => {
            let mut held_by = String::new();
            let _ = file.read_to_string(&mut held_by);
            let pid = match held_by.trim() {
                "" => "unknown".to_string(),
                p => p.chars().take(20).collect(),
            };
            anyhow::bail!("another volring agent holds {} (pid {pid})", dir.display());
        }
        Err(e) => return Err(std::io::Error::from(e)).with_context(|| format!("cannot lock {}", path.display())),
    }
    file.set_len(0)?;
    file.rewind()?;
    writeln!(file, "{}", std::process::id())?;
    // Kept open on purpose until exit: closing it would release the lock.
    let _ = file.into_raw_fd();
    tracing::debug!(state_dir = %dir.display(), "state directory locked");
    Ok(())
}
