//! The agent's shared-volume loop in a cluster: every volume this node
//! exports gets its Service and Endpoints ([`super::kube`]), and its
//! endpoint published on its PVC.
//!
//! Why driven by the share side's changes and not a timer: the objects
//! only have to change when an export appears here (a stage, a resume at
//! start, a volume that moved to this node), and the controller reads
//! before it writes, so one reconcile per change is enough. A reconcile
//! that fails (the API server away, the PVC not there yet) is retried with
//! backoff — that is the only waiting the loop does on its own. At start
//! every export is reconciled once, which also points the Endpoints back
//! at this node after the agent or the server moved.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::Notify;
use tokio::time::Instant;

use super::kube::{ShareController, SharedVolume};

/// The first wait after a failed reconcile; each failure doubles it.
const RETRY_MIN: Duration = Duration::from_secs(1);
const RETRY_MAX: Duration = Duration::from_secs(60);

/// A volume this node exports, and the PVC it was created for (`None`:
/// created without the provisioner's metadata; no Service is made).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Exported {
    pub volume_id: String,
    pub pvc: Option<(String, String)>,
}

/// What the loop needs from the node: the exports now, and a wake-up when
/// they change.
pub struct Follower {
    pub controller: Arc<ShareController>,
    /// Where this node's NFS server answers (the Endpoints' address).
    pub server: SocketAddr,
    pub exports: Arc<dyn Fn() -> Vec<Exported> + Send + Sync>,
    pub wake: Arc<Notify>,
}

/// A volume whose last reconcile failed.
struct Failing {
    attempts: u32,
    next: Instant,
}

impl Follower {
    /// Runs until the task is aborted.
    pub async fn run(self) {
        // What each volume was last reconciled to, successfully.
        let mut done: HashMap<String, SharedVolume> = HashMap::new();
        let mut failing: HashMap<String, Failing> = HashMap::new();
        let mut unnamed: Vec<String> = Vec::new();
        loop {
            let now = (self.exports)();
            for e in &now {
                let Some((ns, name)) = e.pvc.clone() else {
                    if !unnamed.contains(&e.volume_id) {
                        tracing::warn!(volume = %e.volume_id,
                            "shared volume has no PVC recorded (external-provisioner without --extra-create-metadata): no Service for it");
                        unnamed.push(e.volume_id.clone());
                    }
                    continue;
                };
                let v = SharedVolume {
                    volume_id: e.volume_id.clone(),
                    pvc_namespace: ns,
                    pvc_name: name,
                    server: self.server.ip(),
                    server_port: self.server.port(),
                };
                if done.get(&v.volume_id) == Some(&v) || failing.get(&v.volume_id).is_some_and(|f| f.next > Instant::now()) {
                    continue;
                }
                let published = |endpoint: &str| tracing::info!(volume = %v.volume_id, endpoint, "NFS endpoint published on the PVC");
                match self.controller.reconcile(&v, published).await {
                    Ok(out) => {
                        tracing::debug!(volume = %v.volume_id, ?out, "Service and Endpoints reconciled");
                        failing.remove(&v.volume_id);
                        done.insert(v.volume_id.clone(), v);
                    }
                    Err(err) => {
                        let f = failing.entry(v.volume_id.clone()).or_insert(Failing { attempts: 0, next: Instant::now() });
                        f.attempts += 1;
                        let wait = RETRY_MIN.saturating_mul(1 << (f.attempts - 1).min(6)).min(RETRY_MAX);
                        f.next = Instant::now() + wait;
                        done.remove(&v.volume_id);
                        tracing::warn!(volume = %v.volume_id, error = %err, attempts = f.attempts, retry_in_ms = wait.as_millis() as u64,
                            "Service and Endpoints not reconciled");
                    }
                }
            }
            // A volume no longer exported here is forgotten: if it comes
            // back (or moves back), it is reconciled again.
            done.retain(|id, _| now.iter().any(|e| &e.volume_id == id));
            failing.retain(|id, _| now.iter().any(|e| &e.volume_id == id));
            unnamed.retain(|id| now.iter().any(|e| &e.volume_id == id));
            match failing.values().map(|f| f.next).min() {
                Some(next) => {
                    tokio::select! {
                        _ = self.wake.notified() => {}
                        _ = tokio::time::sleep_until(next) => {}
                    }
                }
                None => self.wake.notified().await,
            }
        }
    }
}

/// The running loop and what `/metrics` reads of it.
pub struct Running {
    pub task: tokio::task::JoinHandle<()>,
    pub controller: Arc<ShareController>,
}

/// How long NodeStage waits for the API server when it reads a PVC's
/// published endpoint (kubelet retries a failed stage).
const LOOKUP_WAIT: Duration = Duration::from_secs(10);

/// In a cluster: `driver`'s NodeStage reads published endpoints, and when
/// the node serves NFS the loop runs (`None` when it does not).
pub async fn in_cluster(driver: &Arc<crate::csi::Driver>, config: super::kube::ControllerConfig) -> Result<Option<Running>, super::Error> {
    let cluster = |e: String| super::Error::Config(format!("shared volumes need the cluster's client configuration: {e}"));
    let kc = kube::Config::infer().await.map_err(|e| cluster(e.to_string()))?;
    let client = kube::Client::try_from(kc).map_err(|e| cluster(e.to_string()))?;
    read_endpoints(driver, client.clone());
    if !driver.shares().enabled() {
        return Ok(None);
    }
    let running = start(driver.clone(), client, config)?;
    tracing::info!("shared volumes: a Service and Endpoints per NFS export");
    Ok(Some(running))
}

/// Lets `driver`'s NodeStage read the endpoints owning nodes publish on
/// PVCs (every node of a cluster, also one that serves no NFS itself).
pub fn read_endpoints(driver: &crate::csi::Driver, client: kube::Client) {
    let handle = tokio::runtime::Handle::current();
    driver.set_endpoint_lookup(Box::new(move |ns, name| {
        let lookup = tokio::time::timeout(LOOKUP_WAIT, super::kube::published_endpoint(&client, ns, name));
        match handle.block_on(lookup) {
            Ok(r) => r.map_err(|e| e.to_string()),
            Err(_) => Err(format!("no answer from the API server within {LOOKUP_WAIT:?}")),
        }
    }));
}

/// Starts the loop over `driver`'s exports. The node's advertised NFS
/// address must be `IP:port`: it becomes the Endpoints' address.
pub fn start(
    driver: Arc<crate::csi::Driver>,
    client: kube::Client,
    config: super::kube::ControllerConfig,
) -> Result<Running, super::Error> {
    let advertised = driver.shares().config().advertised().unwrap_or_default();
    let server: SocketAddr = advertised.parse().map_err(|_| {
        super::Error::Config(format!(
            "the advertised NFS address {advertised:?} is not IP:port (--nfs-advertise), which the Endpoints need"
        ))
    })?;
    let controller = Arc::new(ShareController::new(client, config));
    let wake = Arc::new(Notify::new());
    let w = wake.clone();
    driver.shares().on_change(move || w.notify_one());
    let d = driver.clone();
    let follower = Follower { controller: controller.clone(), server, exports: Arc::new(move || d.exported_shares()), wake };
    Ok(Running { task: tokio::spawn(follower.run()), controller })
}
