//! The state every CSI service shares: the pool, the staged records, the
//! volume locks and the mount table the agent keeps current.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, RwLock};

use super::proto::Topology;
use super::{Error, Result, VolumeGuard, VolumeLocks, TOPOLOGY_KEY};
use volring_mounts::MountTable;
use volring_volumes::beneath::Beneath;
use volring_volumes::{ImagePool, StagedRecords};

#[derive(Debug, Clone)]
pub struct CsiConfig {
    /// The unix socket to serve on.
    pub endpoint: PathBuf,
    /// Every staging and target path must lie inside this directory.
    pub kubelet_root: PathBuf,
    /// Where the volume images live.
    pub pool_dir: PathBuf,
    /// The agent's state directory: the node's store (`state.redb`) with
    /// every staged record, and legacy JSON records under `staged/`.
    pub state_dir: PathBuf,
    pub node_id: String,
    /// Reported by NodeGetInfo; 0 means no limit.
    pub max_volumes: i64,
    /// Attach loop devices with direct I/O when the pool allows it.
    pub direct_io: bool,
    /// How `attach: nbd` volumes are attached and healed.
    pub nbd: super::nbd::NbdAttachConfig,
    /// Which service grows a volume's image.
    pub expansion: Expansion,
    /// Serve this node's nbd volumes to other nodes (the agent starts the
    /// listener; see `nbd_export`).
    pub nbd_export: Option<super::nbd_export::ExportConfig>,
    /// How shared (RWX) volumes are served over NFS.
    pub share: volring_share::ShareConfig,
}

/// Where a volume grows. Volumes are node-local, so in a cluster the
/// image can only grow on the node that holds it: with [`Expansion::Node`]
/// the controller does not offer EXPAND_VOLUME (the external resizer then
/// only records the new size, its "trivial" mode) and NodeExpandVolume,
/// which kubelet calls on the volume's own node, grows the image, the
/// device and the filesystem. [`Expansion::Controller`] keeps the CSI
/// spec's two-step flow for a CO that calls both services on this node.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Expansion {
    #[default]
    Controller,
    Node,
}

impl CsiConfig {
    /// Defaults for a node: kubelet's root, the agent's state directory.
    pub fn new(endpoint: PathBuf, node_id: String) -> Self {
        Self {
            endpoint,
            kubelet_root: PathBuf::from("/var/lib/kubelet"),
            pool_dir: PathBuf::from("/var/lib/volring/pool"),
            state_dir: PathBuf::from("/var/lib/volring"),
            node_id,
            max_volumes: 0,
            direct_io: true,
            expansion: Expansion::Controller,
            nbd: Default::default(),
            nbd_export: None,
            share: Default::default(),
        }
    }
}

/// Whether the agent's subsystems are up; Probe reports it.
#[derive(Clone, Default)]
pub struct Readiness(Arc<AtomicBool>);

impl Readiness {
    pub fn set(&self, ready: bool) {
        self.0.store(ready, Ordering::Release);
    }

    pub fn get(&self) -> bool {
        self.0.load(Ordering::Acquire)
    }
}

pub struct Driver {
    pub(super) config: CsiConfig,
    /// `kubelet_root` as the kernel resolves it (it may be a symlink).
    pub(super) real_root: PathBuf,
    /// The kubelet root held open: every path from a request is resolved
    /// beneath it, once, and acted on through the descriptor.
    pub(super) beneath: Beneath,
    pub(super) pool: ImagePool,
    pub(super) records: StagedRecords,
    pub(super) locks: VolumeLocks,
    /// Kept current by the agent from the mount watcher's events.
    pub(super) mounts: Arc<RwLock<MountTable>>,
    pub(super) ready: Readiness,
    /// The reconciler's published verdicts, once it runs.
    pub(super) health: std::sync::OnceLock<Arc<volring_volumes::state::actual::HealthView>>,
    /// Calls running now; a stopping agent waits for them, not for idle
    /// connections (kubelet never closes its own).
    pub(super) in_flight: AtomicUsize,
    /// Calls by RPC and outcome, for `/metrics`.
    pub(super) rpc_stats: Arc<super::rpc_stats::RpcStats>,
    /// The nbd devices this agent serves (`attach: nbd` volumes).
    pub(super) nbd: super::nbd::NbdSide,
    /// The listener serving this node's nbd volumes to other nodes, when
    /// the node exports (`--nbd-export-listen`).
    pub(super) exports: std::sync::OnceLock<super::nbd_export::ExportListener>,
    /// The NFS exports of shared volumes (`volring_share`).
    pub(super) share: volring_share::ShareSide,
    /// Who holds each exported volume: this node or another, never both
    /// (`fence`).
    pub(super) fence: Arc<super::fence::Fence>,
    /// How NodeStage finds a shared volume's published endpoint (set by
    /// the agent when it has a cluster).
    pub(super) endpoint_lookup: std::sync::OnceLock<super::share::EndpointLookup>,
}

impl Driver {
    pub fn new(mut config: CsiConfig, mounts: Arc<RwLock<MountTable>>, ready: Readiness) -> Result<Arc<Self>> {
        let root = config.kubelet_root.to_string_lossy().to_string();
        config.kubelet_root = super::validate::absolute(&root, "kubelet root")?;
        std::fs::create_dir_all(&config.kubelet_root).map_err(|e| Error::Internal(format!("kubelet root: {e}")))?;
        let real_root = std::fs::canonicalize(&config.kubelet_root).map_err(|e| Error::Internal(format!("kubelet root: {e}")))?;
        let beneath = Beneath::open(&config.kubelet_root)
            .map_err(|e| Error::Internal(format!("kubelet root {}: {e}", config.kubelet_root.display())))?;
        let pool = ImagePool::open(&config.pool_dir)?;
        let records = StagedRecords::open(&config.state_dir)?;
        let config_nbd = config.nbd.clone();
        tracing::info!(pool = %pool.dir().display(), volumes = pool.len(), staged = records.len(), direct_io = pool.direct_io(),
            "CSI volume pool");
        let share = volring_share::ShareSide::new(config.share.clone(), &config.state_dir, records.store().clone());
        let fence = Arc::new(super::fence::Fence::open(records.store().clone())?);
        let exported_staged: Vec<String> =
            records.ids().into_iter().filter(|id| pool.get(id).is_some_and(|m| m.nbd_secret.is_some())).collect();
        fence.resume(|id| records.contains(id) || records.quarantined_record(id).is_some(), &exported_staged)?;
        Ok(Arc::new(Self {
            share,
            fence,
            endpoint_lookup: std::sync::OnceLock::new(),
            config,
            real_root,
            beneath,
            pool,
            records,
            locks: VolumeLocks::new(),
            mounts,
            ready,
            health: std::sync::OnceLock::new(),
            in_flight: AtomicUsize::new(0),
            rpc_stats: Default::default(),
            nbd: super::nbd::NbdSide::new(config_nbd),
            exports: std::sync::OnceLock::new(),
        }))
    }

    pub fn config(&self) -> &CsiConfig {
        &self.config
    }

    /// Calls by RPC, gRPC code and latency.
    pub fn rpc_stats(&self) -> &super::rpc_stats::RpcStats {
        &self.rpc_stats
    }

    /// The pool's volumes: how many, bytes provisioned (their sizes
    /// together), and the bytes the pool's filesystem has left.
    pub fn pool_usage(&self) -> (usize, u64, Option<u64>) {
        let (n, provisioned) = self.pool.provisioned();
        (n, provisioned, self.pool.free_bytes().ok())
    }

    /// Volumes staged on this node, and of those, published to a target.
    pub fn staged_and_published(&self) -> (usize, usize) {
        let all = self.records.all();
        (all.len(), all.iter().filter(|r| !r.published.is_empty()).count())
    }

    /// How many calls are running.
    pub fn in_flight(&self) -> usize {
        self.in_flight.load(Ordering::Acquire)
    }

    pub fn locks(&self) -> &VolumeLocks {
        &self.locks
    }

    /// The node's store (with no cluster the publisher writes there too:
    /// one process may open it once).
    pub fn store(&self) -> Arc<volring_volumes::store::Store> {
        self.records.store().clone()
    }

    /// Every staged volume's record, for the publisher.
    pub fn staged(&self) -> Vec<volring_volumes::StagedVolume> {
        self.records.all()
    }

    /// Calls `f` with the id of every staged record put or removed from
    /// now on (the publisher's StorageNode follows them).
    pub fn on_volume_change(&self, f: impl Fn(&str) + Send + 'static) {
        self.records.on_change(f);
    }

    pub fn pool_dir(&self) -> &std::path::Path {
        self.pool.dir()
    }

    /// Takes the volume's lock or answers Aborted. A repair the reconciler
    /// is making is waited for (up to 30 s), not reported.
    pub(super) fn lock(&self, id: &str) -> Result<VolumeGuard> {
        self.locks
            .lock_for_call(id, std::time::Duration::from_secs(30))
            .ok_or_else(|| Error::Aborted(format!("an operation on volume {id} is already in progress")))
    }

    /// Checks a validated path against symlinks: its deepest existing
    /// ancestor, resolved by the kernel, must still be inside the root.
    pub(super) fn contained(&self, p: &Path) -> Result<()> {
        let mut probe = p;
        loop {
            match std::fs::canonicalize(probe) {
                Ok(real) if real.starts_with(&self.real_root) => return Ok(()),
                Ok(real) => {
                    return Err(Error::InvalidArgument(format!("{} resolves to {}, outside the kubelet root", p.display(), real.display())))
                }
                Err(_) => match probe.parent() {
                    Some(parent) => probe = parent,
                    None => return Err(Error::InvalidArgument(format!("{} is not inside the kubelet root", p.display()))),
                },
            }
        }
    }

    pub(super) fn path(&self, p: &str, what: &str) -> Result<PathBuf> {
        let p = super::validate::path_under(p, &self.config.kubelet_root, what)?;
        self.contained(&p)?;
        Ok(p)
    }

    pub(super) fn topology(&self) -> Topology {
        Topology { segments: HashMap::from([(TOPOLOGY_KEY.to_string(), self.config.node_id.clone())]) }
    }

    /// True when `t` names this node (and nothing this node lacks).
    pub(super) fn is_here(&self, t: &Topology) -> bool {
        t.segments.iter().all(|(k, v)| k == TOPOLOGY_KEY && *v == self.config.node_id)
    }
}
