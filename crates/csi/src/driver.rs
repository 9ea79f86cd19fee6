//! The driver and its configuration: the parts it owns (`base` for what
//! they share), and the one place the agent reaches them.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, RwLock};

use super::attached::{AttachedCheck, Healer};
use super::base::Base;
use super::controller::Controller;
use super::fence::Fence;
use super::identity::Identity;
use super::nbd::{Healed, NbdSide};
use super::nbd_export::{ExportListener, NbdExports};
use super::node::Stager;
use super::node_stats::Stats;
use super::owned::Root;
use super::publish::Publisher;
use super::repair::Repairs;
use super::rpc_stats::RpcStats;
use super::share::{EndpointLookup, Shares};
use super::share_client::NfsClient;
use super::{Result, VolumeLocks};
use volring_mounts::MountTable;
use volring_volumes::{ImagePool, StagedRecords};
use volring_volumes::{ReconcileConfig, Reconciler};

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

/// One RPC's calls as `/metrics` shows them: how many ended with each gRPC
/// code, and how long they took.
#[derive(Debug, Clone, PartialEq)]
pub struct RpcSnapshot {
    pub rpc: &'static str,
    /// Calls ended, by gRPC code name (`OK` ... `Unauthenticated`), every
    /// code listed.
    pub by_code: Vec<(&'static str, u64)>,
    /// Calls per latency bucket: upper bound in seconds (the last one
    /// `f64::MAX`), count in that bucket alone (not cumulative).
    pub buckets: Vec<(f64, u64)>,
    /// All calls' durations together, seconds.
    pub sum_seconds: f64,
}

/// A snapshot of the driver for `/metrics` ([`Driver::stats`]).
#[derive(Debug, Clone)]
pub struct DriverStats {
    /// Every RPC the driver serves, in the order `/metrics` lists them.
    pub rpcs: Vec<RpcSnapshot>,
    /// Volumes staged on this node, and of those, published to a target.
    pub staged: usize,
    pub published: usize,
    /// The pool's volumes, bytes provisioned (their sizes together), and
    /// the bytes the pool's filesystem has left.
    pub pool_volumes: usize,
    pub provisioned: u64,
    pub available: Option<u64>,
    /// How long the node store's commits took (each step that changes the
    /// machine waits for its intent to commit).
    pub store_commits: volring_volumes::store::CommitStats,
}

/// The CSI driver: owned parts, each with its own file and state, over
/// one shared `Base`. The gRPC services (`service.rs`) hand each call to
/// its part; the agent uses the methods below.
pub struct Driver {
    pub(crate) base: Arc<Base>,
    pub(crate) identity: Identity,
    pub(crate) controller: Controller,
    /// Stage and unstage (and the reconciler's repairs).
    pub(crate) stager: Arc<Stager>,
    pub(crate) publisher: Publisher,
    pub(crate) stats: Stats,
    /// The nbd devices this agent serves, and their healer's walks.
    healer: Healer,
    /// This node's nbd volumes served to other nodes (`--nbd-export-listen`).
    exports: Arc<NbdExports>,
    /// The NFS exports of shared volumes this node serves.
    shares: Arc<Shares>,
    /// Shared volumes another node serves, mounted here over NFS.
    nfs: Arc<NfsClient>,
    /// Calls running now; a stopping agent waits for them, not for idle
    /// connections (kubelet never closes its own).
    pub(crate) in_flight: AtomicUsize,
    /// Calls by RPC and outcome, for `/metrics`.
    pub(crate) rpc_stats: Arc<RpcStats>,
}

impl Driver {
    pub fn new(mut config: CsiConfig, mounts: Arc<RwLock<MountTable>>, ready: Readiness) -> Result<Arc<Self>> {
        let root = Root::open(&config.kubelet_root)?;
        config.kubelet_root = root.dir().to_path_buf();
        let pool = ImagePool::open(&config.pool_dir)?;
        let records = StagedRecords::open(&config.state_dir)?;
        if let Some(loss) = records.loss().cloned() {
            rebuild_from_kernel(&pool, &records, &config.kubelet_root, &config.state_dir, &loss)?;
        }
        let nbd = Arc::new(NbdSide::new(config.nbd.clone()).with_state_dir(&config.state_dir));
        tracing::info!(pool = %pool.dir().display(), volumes = pool.provisioned().0, staged = records.ids().len(), direct_io = pool.direct_io(),
            "CSI volume pool");
        let side = Arc::new(volring_share::ShareSide::new(config.share.clone(), &config.state_dir, records.store().clone()));
        let fence = Arc::new(Fence::open(records.store().clone())?);
        let exported_staged: Vec<String> =
            records.ids().into_iter().filter(|id| pool.get(id).is_some_and(|m| m.nbd_secret.is_some())).collect();
        fence.resume(|id| records.knows(id), &exported_staged)?;
        let base = Arc::new(Base { config, root, pool, records, locks: VolumeLocks::new(), mounts });
        let exports = Arc::new(NbdExports::new(base.clone(), fence.clone()));
        let shares = Arc::new(Shares::new(base.clone(), side.clone()));
        let nfs = Arc::new(NfsClient::new(base.clone(), side.clone(), fence.clone()));
        let stager = Arc::new(Stager::new(base.clone(), nbd.clone(), fence, shares.clone(), nfs.clone()));
        Ok(Arc::new(Self {
            identity: Identity::new(base.clone(), ready),
            controller: Controller::new(base.clone(), exports.clone(), side, nbd.clone()),
            publisher: Publisher::new(base.clone(), shares.clone(), nfs.clone()),
            stats: Stats::new(base.clone(), nbd.clone(), nfs.clone()),
            healer: Healer::new(base.clone(), nbd),
            stager,
            exports,
            shares,
            nfs,
            base,
            in_flight: AtomicUsize::new(0),
            rpc_stats: Default::default(),
        }))
    }

    pub fn config(&self) -> &CsiConfig {
        &self.base.config
    }

    /// What `/metrics` shows of the driver, as it is now: calls by RPC,
    /// gRPC code and latency, the volumes staged and published, the pool's
    /// volumes and bytes.
    pub fn stats(&self) -> DriverStats {
        let all = self.base.records.all();
        let (pool_volumes, provisioned) = self.base.pool.provisioned();
        DriverStats {
            rpcs: self.rpc_stats.snapshot(),
            staged: all.len(),
            published: all.iter().filter(|r| !r.published.is_empty()).count(),
            pool_volumes,
            provisioned,
            available: self.base.pool.free_bytes().ok(),
            store_commits: self.base.records.store().commit_stats(),
        }
    }

    /// How many calls are running.
    pub fn in_flight(&self) -> usize {
        self.in_flight.load(Ordering::Acquire)
    }

    /// The node's store (with no cluster the publisher writes there too:
    /// one process may open it once).
    pub fn store(&self) -> Arc<volring_volumes::store::Store> {
        self.base.records.store().clone()
    }

    /// Every staged volume's record, for the publisher.
    pub fn staged(&self) -> Vec<volring_volumes::StagedVolume> {
        self.base.records.all()
    }

    /// Calls `f` with the id of every staged record put or removed from
    /// now on (the publisher's StorageNode follows them).
    pub fn on_volume_change(&self, f: impl Fn(&str) + Send + 'static) {
        self.base.records.on_change(f);
    }

    pub fn pool_dir(&self) -> &Path {
        self.base.pool.dir()
    }

    /// Starts the reconciler over this driver's volumes: looks at every
    /// volume once (finishing what a crash interrupted) before it returns,
    /// then follows the events. Every record change is passed on to it, and
    /// NodeGetVolumeStats reads its published verdicts.
    pub fn start_reconciler(self: &Arc<Self>, config: ReconcileConfig) -> std::io::Result<Reconciler> {
        // nbd devices first: a device whose server died with the last agent
        // gets fresh sockets before the first pass looks at its mount (and
        // before Probe answers ready); the pass re-stages the ones gone.
        for (id, healed) in self.heal_nbd() {
            tracing::debug!(volume = %id, ?healed, "nbd start walk");
        }
        let store = self.base.records.store().clone();
        let r = Reconciler::start(config, Arc::new(Repairs::new(self.stager.clone())), self.base.mounts.clone(), store)?;
        let notify = r.notifier();
        self.base.records.on_change(move |id| notify.tell(volring_volumes::Changed::Volume(id.to_string())));
        let _ = self.stats.health.set(r.view().clone());
        self.shares.resume();
        Ok(r)
    }

    /// The nbd healer's start walk, once per process (see `Healer::heal_nbd`).
    pub fn heal_nbd(&self) -> Vec<(String, Healed)> {
        self.healer.heal_nbd()
    }

    /// Hands the volumes the cluster says are attached here to the nbd
    /// healer, where this agent owns their data path and does not serve it.
    pub fn heal_attached(&self, ids: &[String]) -> AttachedCheck {
        self.healer.heal_attached(ids)
    }

    /// Starts serving every exported volume of the pool on `listener`, and
    /// every one created from now on.
    pub fn serve_exports(&self, listener: ExportListener) -> Result<()> {
        self.exports.serve(listener)
    }

    /// The NBD servers the driver runs, each by its name and as its catalog
    /// (an export per volume, named by the volume id, and its rings'
    /// counters), for `/metrics` to read at each scrape as it reads the
    /// `--nbd-listen` server's: `attach`, the server of this node's nbd
    /// volumes to the kernel's nbd client, once the first `attach: nbd`
    /// volume started it; `export`, the `--nbd-export-listen` server of
    /// them to other nodes, once the agent handed it over. One call for
    /// both keeps the crate's public surface where it was.
    pub fn nbd_servers(&self) -> Vec<(&'static str, Arc<volring_nbd::Exports>)> {
        let attach = self.healer.nbd.exports().map(|x| ("attach", x));
        let export = self.exports.catalog().map(|x| ("export", x));
        attach.into_iter().chain(export).collect()
    }

    /// The address the export listener is bound to, if it runs.
    pub fn export_address(&self) -> Option<String> {
        self.exports.address()
    }

    /// Sets how NodeStage of a shared volume another node holds finds the
    /// endpoint published on its PVC (in a cluster).
    pub(crate) fn set_endpoint_lookup(&self, f: EndpointLookup) {
        self.nfs.set_endpoint_lookup(f)
    }
}

/// The cluster's shared-volume loop (`volring_share::follow`) reaches the
/// driver through this trait: share sits below csi in the crate graph.
/// `/metrics` reads the node's exports through it too.
impl volring_share::follow::ShareHost for Driver {
    fn shares(&self) -> &volring_share::ShareSide {
        self.shares.side()
    }
    fn exported_shares(&self) -> Vec<volring_share::follow::Exported> {
        self.shares.exported()
    }
    fn set_endpoint_lookup(&self, f: EndpointLookup) {
        Driver::set_endpoint_lookup(self, f)
    }
}

/// The store was missing or damaged at open: the staged volumes' records
/// are rebuilt from what the kernel shows (`volumes::recover`: devices
/// proven by inode or backend, mounts proven by descriptor), what cannot be
/// proven is reported and left alone, and all of it is said loudly — an
/// ERROR in the log and a line in `volring status` (kept in the new store).
/// A new node (no store, nothing in the kernel) is only noted.
fn rebuild_from_kernel(
    pool: &ImagePool,
    records: &StagedRecords,
    kubelet_root: &Path,
    state_dir: &Path,
    loss: &volring_volumes::StoreLoss,
) -> Result<()> {
    use volring_volumes::StoreLoss;
    let store = state_dir.join(volring_volumes::store::FILE);
    let found = volring_volumes::recover::from_kernel(pool.dir(), kubelet_root, &|id| records.contains(id));
    if *loss == StoreLoss::Missing && found.adopted.is_empty() && found.refused.is_empty() {
        tracing::info!(store = %store.display(), "no store yet: a new one made");
        return Ok(());
    }
    let adopted = records.adopt(&found)?;
    tracing::error!(store = %store.display(), cause = %loss, adopted = adopted.len(),
        refused = found.refused.len(), volumes = ?adopted,
        "THE NODE'S STORE WAS LOST: the staged volumes' records were rebuilt from the kernel (see `volring status`)");
    for r in &found.refused {
        tracing::error!(what = %r, "not rebuilt from the kernel: could not be proven; left alone");
    }
    Ok(())
}
