//! The CSI driver's share side: which staged volumes this node exports, and
//! the one NFS server that exports them.
//!
//! The server starts with the first export and ends with the last (a node
//! with no shared volume runs no NFS server) and serves exactly the volumes recorded here: every
//! export is a staged, shared volume of this node, never another path.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use super::ganesha::{Export, Settings, Squash};
use super::records::{self, ShareRecord};
use super::server::{NfsServer, ServerFiles};
use super::Error;
use volring_volumes::store::Store;

/// How the node serves shared volumes; set from the node's flags.
#[derive(Debug, Clone)]
pub struct ShareConfig {
    /// The address and TCP port the NFS server binds; `None`: this node
    /// serves no NFS (its shared volumes are usable only where they are
    /// staged).
    pub listen: Option<SocketAddr>,
    /// `host:port` other nodes mount (default: `listen`).
    pub advertise: Option<String>,
    /// Client entries (addresses, `address/prefix` networks) admitted to
    /// every export besides the nodes that staged the volume: out of a
    /// cluster no node makes itself known, so whoever mounts is listed
    /// here (`--nfs-clients`). Empty by default: nobody.
    pub clients: Vec<String>,
    pub ganesha: PathBuf,
    pub plugins_dir: PathBuf,
    pub lease_secs: u32,
    pub grace_secs: u32,
    pub attr_expiry_secs: u32,
}

impl Default for ShareConfig {
    fn default() -> Self {
        Self {
            listen: None,
            advertise: None,
            clients: Vec::new(),
            ganesha: PathBuf::from("ganesha.nfsd"),
            plugins_dir: PathBuf::from("/usr/lib/x86_64-linux-gnu/ganesha"),
            // Short: a restarted server's grace lasts grace_secs, and a
            // client must renew within lease_secs. 15 s / 20 s keep a
            // restart's stall short while a TCG guest still renews in time.
            lease_secs: 15,
            grace_secs: 20,
            attr_expiry_secs: 0,
        }
    }
}

impl ShareConfig {
    /// The address clients are told to mount.
    pub(crate) fn advertised(&self) -> Option<String> {
        self.advertise.clone().or_else(|| self.listen.map(|a| a.to_string()))
    }
}

pub struct ShareSide {
    config: ShareConfig,
    dir: PathBuf,
    store: Arc<Store>,
    server: OnceLock<NfsServer>,
    /// Serialises export changes (record, then configuration).
    changing: Mutex<()>,
    /// Called after the set of exports changed (the cluster's Service
    /// loop follows these, not a timer).
    watchers: Mutex<Vec<Box<dyn Fn() + Send>>>,
    /// Called with the volume id after a mount record is removed (an
    /// unstage of a volume another node serves): in a cluster, this node
    /// takes its announcement off the PVC (`admit`).
    unmounted: OnceLock<Unmounted>,
}

/// See [`ShareSide::on_unmounted`].
type Unmounted = Box<dyn Fn(&str) + Send + Sync>;

/// How long an unexport waits for the server to let go of the volume's
/// files, so its filesystem can be unmounted.
const RELEASE_WAIT: Duration = Duration::from_secs(10);

impl ShareSide {
    /// `state_dir/nfs` holds the server's files and recovery database.
    pub fn new(config: ShareConfig, state_dir: &Path, store: Arc<Store>) -> Self {
        Self {
            config,
            dir: state_dir.join("nfs"),
            store,
            server: OnceLock::new(),
            changing: Mutex::new(()),
            watchers: Mutex::default(),
            unmounted: OnceLock::new(),
        }
    }

    pub fn enabled(&self) -> bool {
        self.config.listen.is_some()
    }

    pub(crate) fn config(&self) -> &ShareConfig {
        &self.config
    }

    /// The address clients are told to mount (`None`: this node serves no
    /// NFS).
    pub(crate) fn advertised(&self) -> Option<String> {
        self.config.advertised()
    }

    /// Adds the volume-context entries of volume `id`, created with
    /// `parameters`, to `context`: for a shared volume, its marker (so every
    /// node knows it is served over NFS), its squash and PVC, and where
    /// this node serves it (its advertised address) when it serves NFS.
    pub fn context(
        &self,
        id: &str,
        parameters: &std::collections::BTreeMap<String, String>,
        context: &mut std::collections::HashMap<String, String>,
    ) {
        super::context(id, parameters, self.advertised().as_deref(), context);
    }

    /// Calls `f` after every export, unexport and resume from now on.
    pub(crate) fn on_change(&self, f: impl Fn() + Send + 'static) {
        self.watchers.lock().unwrap_or_else(|e| e.into_inner()).push(Box::new(f));
    }

    fn changed(&self) {
        for f in self.watchers.lock().unwrap_or_else(|e| e.into_inner()).iter() {
            f();
        }
    }

    /// The volumes this node exports over NFS now, each with the PVC it
    /// was created for (for the cluster's Service loop, [`super::follow`],
    /// and `/metrics`): read from the volume's recorded parameters
    /// (`recorded(id)`; `None` when this node's pool holds no record of
    /// it), else from what its stage recorded (a volume staged here from
    /// another node's export). Empty, and logged, when the share records
    /// cannot be read.
    pub fn exported(&self, recorded: impl Fn(&str) -> Option<std::collections::BTreeMap<String, String>>) -> Vec<super::follow::Exported> {
        let records = match self.records() {
            Ok(r) => r,
            Err(e) => {
                tracing::error!(error = %e, "cannot read the share records");
                return Vec::new();
            }
        };
        records
            .into_iter()
            .map(|r| super::follow::Exported {
                pvc: match recorded(&r.volume_id) {
                    Some(parameters) => super::pvc_of(&parameters),
                    None => records::get_pvc(&self.store, &r.volume_id),
                },
                volume_id: r.volume_id,
            })
            .collect()
    }

    /// Every share this node records.
    pub(crate) fn records(&self) -> Result<Vec<ShareRecord>, Error> {
        records::load(&self.store)
    }

    /// The running NFS server's pid.
    pub(crate) fn server_pid(&self) -> Option<u32> {
        self.server.get().and_then(NfsServer::pid)
    }

    /// The record of shared volume `id` mounted here from another node.
    pub fn mount_record(&self, id: &str) -> Result<Option<super::MountRecord>, Error> {
        records::get_mount(&self.store, id)
    }

    /// Records the stage of volume `id` from another node's export as `r`
    /// says, or (`None`, its unstage) forgets it. A stage's first record
    /// (the intent, before the mount) also makes this node's NFSv4 client
    /// identity unique first (`super::identity`); a forgotten one is
    /// told to whoever follows the unmounts (the cluster side, `admit`).
    pub fn set_mount_record(&self, id: &str, r: Option<&super::MountRecord>) -> Result<(), Error> {
        match r {
            Some(r) => {
                if r.dev.is_none() {
                    super::identity::ensure_on_this_node();
                }
                records::put_mount(&self.store, r)
            }
            None => {
                records::remove_mount(&self.store, id)?;
                if let Some(f) = self.unmounted.get() {
                    f(id);
                }
                Ok(())
            }
        }
    }

    /// Calls `f` with the volume id after each mount record forgotten
    /// ([`ShareSide::set_mount_record`] with `None`; set once; later calls
    /// are ignored).
    pub(crate) fn on_unmounted(&self, f: impl Fn(&str) + Send + Sync + 'static) {
        let _ = self.unmounted.set(Box::new(f));
    }

    /// The node's store, for what the cluster side records beside the
    /// shares (the PVCs this node announced itself on).
    pub(crate) fn store(&self) -> Arc<Store> {
        self.store.clone()
    }

    /// Exports volume `id`'s staged filesystem at `path`, `squash` as its
    /// StorageClass says; idempotent. The nodes admitted so far stay.
    pub fn export_squashed(&self, id: &str, path: &Path, squash: Squash) -> Result<(), Error> {
        let server = self.config.advertised().ok_or_else(|| Error::Config("this node serves no NFS (--nfs-listen)".into()))?;
        let _g = self.changing.lock().unwrap_or_else(|e| e.into_inner());
        let have = records::load(&self.store)?;
        let clients = have.iter().find(|r| r.volume_id == id).map(|r| r.clients.clone()).unwrap_or_default();
        let rec = ShareRecord {
            volume_id: id.to_string(),
            export_id: records::export_id(&have, id)?,
            path: path.to_path_buf(),
            pseudo: super::pseudo_path(id),
            server,
            clients,
            squash,
        };
        if !have.contains(&rec) {
            records::put(&self.store, &rec)?;
        }
        let mut all: Vec<ShareRecord> = have.into_iter().filter(|r| r.volume_id != id).collect();
        all.push(rec.clone());
        self.apply(&all)?;
        tracing::info!(volume = id, export_id = rec.export_id, path = %path.display(), server = %rec.server, "exported over NFS");
        drop(_g);
        self.changed();
        Ok(())
    }

    /// Admits exactly `clients` (node name → address) to volume `id`'s
    /// export, on top of `--nfs-clients`: the server re-reads its
    /// configuration (SIGHUP; no client loses its state). True when the
    /// list changed; false also when `id` is not exported here. An address
    /// that is no IP is refused ([`super::ganesha::valid_client`]).
    pub(crate) fn set_clients(&self, id: &str, clients: &std::collections::BTreeMap<String, String>) -> Result<bool, Error> {
        if let Some((node, bad)) = clients.iter().find(|(_, a)| !super::ganesha::valid_client(a)) {
            return Err(Error::Config(format!("node {node}'s NFS client address {bad:?} is no IP address")));
        }
        let _g = self.changing.lock().unwrap_or_else(|e| e.into_inner());
        let mut all = records::load(&self.store)?;
        let Some(rec) = all.iter_mut().find(|r| r.volume_id == id) else { return Ok(false) };
        if &rec.clients == clients {
            return Ok(false);
        }
        let (was, now): (Vec<_>, Vec<_>) = (rec.clients.keys().cloned().collect(), clients.keys().cloned().collect());
        rec.clients = clients.clone();
        records::put(&self.store, rec)?;
        if self.enabled() {
            self.apply(&all)?;
        }
        tracing::info!(volume = id, before = ?was, now = ?now, "NFS export's client nodes changed");
        Ok(true)
    }

    /// Stops exporting volume `id` and waits (bounded) until the server
    /// holds none of its files, so its filesystem can be unmounted.
    pub fn unexport(&self, id: &str) -> Result<(), Error> {
        let _g = self.changing.lock().unwrap_or_else(|e| e.into_inner());
        let have = records::load(&self.store)?;
        let Some(gone) = have.iter().find(|r| r.volume_id == id).cloned() else { return Ok(()) };
        let rest: Vec<ShareRecord> = have.into_iter().filter(|r| r.volume_id != id).collect();
        if self.enabled() {
            self.apply(&rest)?;
            self.wait_released(&gone.path)?;
        }
        records::remove(&self.store, id)?;
        tracing::info!(volume = id, "NFS export removed");
        drop(_g);
        self.changed();
        Ok(())
    }

    /// After volume `id` was mounted again at `path` (the reconciler's
    /// repair): the server must serve the new mount. A running ganesha
    /// keeps an export on what its path resolved to when the export was
    /// made — the mount that went away, or the empty directory under it
    /// if the server (re)started in between — so it is restarted on the
    /// configuration naming `path`. True when the volume is exported here.
    pub fn refresh(&self, id: &str, path: &Path) -> Result<bool, Error> {
        let _g = self.changing.lock().unwrap_or_else(|e| e.into_inner());
        let mut all = records::load(&self.store)?;
        let Some(rec) = all.iter_mut().find(|r| r.volume_id == id) else { return Ok(false) };
        if !self.enabled() {
            return Ok(false);
        }
        if rec.path != path {
            rec.path = path.to_path_buf();
            records::put(&self.store, rec)?;
        }
        self.apply(&all)?;
        self.server()?.restart();
        tracing::warn!(volume = id, path = %path.display(), "NFS server restarted to serve the volume's new mount");
        drop(_g);
        self.changed();
        Ok(true)
    }

    /// At agent start: re-exports the recorded shares whose volume
    /// `staged_at` still finds staged intact (returning where), and drops
    /// the records of the others.
    pub fn resume(&self, staged_at: impl Fn(&str) -> Option<PathBuf>) -> Result<usize, Error> {
        let _g = self.changing.lock().unwrap_or_else(|e| e.into_inner());
        let mut keep = Vec::new();
        for mut r in records::load(&self.store)? {
            match staged_at(&r.volume_id) {
                Some(p) if self.enabled() => {
                    if p != r.path {
                        r.path = p;
                        records::put(&self.store, &r)?;
                    }
                    keep.push(r);
                }
                _ => {
                    tracing::warn!(volume = %r.volume_id, "share record of a volume not staged here (or NFS off); dropped");
                    records::remove(&self.store, &r.volume_id)?;
                }
            }
        }
        if !keep.is_empty() {
            self.apply(&keep)?;
        }
        drop(_g);
        self.changed();
        Ok(keep.len())
    }

    fn apply(&self, all: &[ShareRecord]) -> Result<(), Error> {
        let exports = all
            .iter()
            .map(|r| {
                let mut clients: Vec<String> = self.config.clients.iter().chain(r.clients.values()).cloned().collect();
                clients.sort();
                clients.dedup();
                Export { id: r.export_id, path: r.path.clone(), pseudo: r.pseudo.clone(), clients, squash: r.squash }
            })
            .collect();
        self.server()?.set_exports(exports)
    }

    fn server(&self) -> Result<&NfsServer, Error> {
        if let Some(s) = self.server.get() {
            return Ok(s);
        }
        let listen = self.config.listen.ok_or_else(|| Error::Config("this node serves no NFS (--nfs-listen)".into()))?;
        let settings = Settings {
            listen,
            plugins_dir: self.config.plugins_dir.clone(),
            recovery_dir: self.dir.join("recovery"),
            lease_secs: self.config.lease_secs,
            grace_secs: self.config.grace_secs,
            attr_expiry_secs: self.config.attr_expiry_secs,
        };
        let s = NfsServer::new(settings, ServerFiles { binary: self.config.ganesha.clone(), dir: self.dir.clone() })?;
        // Callers hold `changing`, so only one server is ever made.
        let _ = self.server.set(s);
        self.server.get().ok_or_else(|| Error::Config("NFS server not set".into()))
    }

    /// Polls (every 50 ms, at most [`RELEASE_WAIT`]) the server's open
    /// files until none lies under `path`.
    fn wait_released(&self, path: &Path) -> Result<(), Error> {
        let deadline = Instant::now() + RELEASE_WAIT;
        loop {
            let Some(pid) = self.server_pid() else { return Ok(()) };
            let held = holds_under(pid, path);
            if held.is_none() {
                return Ok(());
            }
            if Instant::now() >= deadline {
                return Err(Error::Busy(format!(
                    "the NFS server (pid {pid}) still holds {} after the export was removed",
                    held.unwrap_or_default().display()
                )));
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

/// A file process `pid` holds open under `path`, if any.
fn holds_under(pid: u32, path: &Path) -> Option<PathBuf> {
    let dir = std::fs::read_dir(format!("/proc/{pid}/fd")).ok()?;
    dir.flatten().filter_map(|e| std::fs::read_link(e.path()).ok()).find(|t| t.starts_with(path))
}
