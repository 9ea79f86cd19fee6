//! The agent's shared-volume loop in a cluster: every volume this node
//! exports gets its Service and EndpointSlice ([`super::kube`]), and its
//! endpoint published on its PVC.
//!
//! Why driven by the share side's changes and not a timer: the objects
//! only have to change when an export appears here (a stage, a resume at
//! start, a volume that moved to this node), and the controller reads
//! before it writes, so one reconcile per change is enough. A reconcile
//! that fails (the API server away, the PVC not there yet) is retried with
//! backoff. At start every export is reconciled once, which also points
//! the EndpointSlice back at this node after the agent or the server moved.
//! The nodes announced on each exported volume's PVC are watched and
//! admitted to its export as they change (`super::client_watch`).
//!
//! The EndpointSlice names this node's advertised address only while its
//! NFS server accepts connections (at its listen address: the advertised
//! one may be a NAT'ed or forwarded address the node cannot reach itself;
//! the agent proves what it can, that its server answers) ("during the move the Service exists but
//! does not answer"): a server not answering yet (starting, or at a new
//! advertised address) gets the Service with an empty EndpointSlice, looked at
//! again every poll interval until it answers; an export removed here, and
//! the agent stopping, take the address out (only if the EndpointSlice still
//! name it — another node may have taken the volume over). A client sent
//! to an address where nothing serves the volume would get errors or hang
//! on the wrong server; with no endpoint its connection is refused and the
//! hard mount retries until the new address is in.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::Notify;
use tokio::time::Instant;

use super::kube::{ShareController, SharedVolume};
use super::renounce::{Renouncer, Turns};

/// The first wait after a failed reconcile (or watch of a PVC); each
/// failure doubles it.
pub(crate) const RETRY_MIN: Duration = Duration::from_secs(1);
pub(crate) const RETRY_MAX: Duration = Duration::from_secs(60);

/// A volume this node exports, and the PVC it was created for (`None`:
/// created without the provisioner's metadata; no Service is made).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Exported {
    pub volume_id: String,
    pub pvc: Option<(String, String)>,
}

/// How NodeStage of shared volume `id`, which another node holds, reads the
/// endpoint its owner published on the PVC `(namespace, name)` (`Ok(None)`:
/// not yet); in a cluster it also makes this node known to the owner
/// first (`super::admit`).
pub type EndpointLookup = Box<dyn Fn(&str, &str, &str) -> std::result::Result<Option<String>, String> + Send + Sync>;

/// What the cluster loop needs of the node's CSI driver. The driver sits
/// above this crate (it stages and exports the shared volumes), so the loop
/// sees it only through this trait, which the driver implements.
pub trait ShareHost: Send + Sync + 'static {
    /// The node's share side: its exports and their change notices.
    fn shares(&self) -> &super::ShareSide;
    /// The volumes this node exports now, each with the PVC it was created for.
    fn exported_shares(&self) -> Vec<Exported>;
    /// Sets how NodeStage finds the endpoint published on a PVC.
    fn set_endpoint_lookup(&self, f: EndpointLookup);
}

/// What the loop needs from the node: the exports now, and a wake-up when
/// they change.
pub(crate) struct Follower {
    pub controller: Arc<ShareController>,
    /// Where other nodes reach this node's NFS server (the EndpointSlice's
    /// address: `--nfs-advertise`, the pod's IP in a cluster).
    pub server: SocketAddr,
    /// Where the server listens (`--nfs-listen`): what the loop connects to
    /// to know whether it answers.
    pub probe: SocketAddr,
    pub exports: Arc<dyn Fn() -> Vec<Exported> + Send + Sync>,
    /// Admits exactly these nodes (name → address) to a volume's export
    /// (`ShareSide::set_clients`).
    pub admit: Admit,
    pub wake: Arc<Notify>,
}

/// See [`Follower::admit`].
pub(crate) type Admit = Arc<dyn Fn(&str, &std::collections::BTreeMap<String, String>) -> Result<bool, super::Error> + Send + Sync>;

/// A volume whose last write failed.
struct Failing {
    attempts: u32,
    next: Instant,
}

impl Failing {
    /// Counts one more failure and sets the next try (backoff).
    fn failed(map: &mut HashMap<String, Failing>, id: &str) -> Duration {
        let f = map.entry(id.to_string()).or_insert(Failing { attempts: 0, next: Instant::now() });
        f.attempts += 1;
        let wait = RETRY_MIN.saturating_mul(1 << (f.attempts - 1).min(6)).min(RETRY_MAX);
        f.next = Instant::now() + wait;
        wait
    }

    fn waiting(map: &HashMap<String, Failing>, id: &str) -> bool {
        map.get(id).is_some_and(|f| f.next > Instant::now())
    }
}

/// What a volume's objects were last brought to: `v`, with the server's
/// address in the EndpointSlice (`serving`) or with none.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Target {
    v: SharedVolume,
    serving: bool,
}

/// How long the loop waits for a TCP connection to the advertised address.
const ANSWER_WAIT: Duration = Duration::from_secs(2);

impl Follower {
    /// Runs until `stop` completes, then takes this node's address out of
    /// the EndpointSlice of every volume it still exports (the server stops
    /// with the agent), and returns.
    pub(crate) async fn run_until(self, stop: impl std::future::Future<Output = ()>) {
        tokio::pin!(stop);
        // What each volume was last brought to, successfully.
        let mut done: HashMap<String, Target> = HashMap::new();
        // Every exported volume's objects as last tried, so a volume that
        // stops being exported can be withdrawn even when its last
        // reconcile failed.
        let mut known: HashMap<String, SharedVolume> = HashMap::new();
        let mut failing: HashMap<String, Failing> = HashMap::new();
        // No longer exported here: this node's address still to be taken
        // out of their EndpointSlices.
        let mut leaving: HashMap<String, SharedVolume> = HashMap::new();
        let mut leave_failing: HashMap<String, Failing> = HashMap::new();
        let mut unnamed: Vec<String> = Vec::new();
        let mut clients = super::client_watch::ClientWatches::new(self.controller.client().clone(), self.admit.clone());
        // Whether the server answered when last asked, and whether to ask
        // again: not when only a retry's timer woke the loop and every
        // server answered (a connection a second would only fill
        // ganesha's log).
        let mut answered: Option<bool> = None;
        let mut woken_by_change = true;
        loop {
            let now = (self.exports)();
            clients.follow(&now);
            // Asked only when a Service is kept: the EndpointSlice names this
            // address only while something accepts connections there.
            let ask = woken_by_change
                || answered.is_none()
                || done.values().any(|t| !t.serving)
                || failing.values().chain(leave_failing.values()).any(|f| f.next <= Instant::now());
            let serving = self.serving(&now, ask, &mut answered).await;
            for e in &now {
                let Some(v) = self.shared_volume(e, &mut unnamed) else { continue };
                leaving.remove(&v.volume_id);
                leave_failing.remove(&v.volume_id);
                known.insert(v.volume_id.clone(), v.clone());
                let target = Target { v, serving };
                let v = &target.v;
                if done.get(&v.volume_id) == Some(&target) || Failing::waiting(&failing, &v.volume_id) {
                    continue;
                }
                self.bring(target, &mut done, &mut failing).await;
            }
            // A volume no longer exported here: its EndpointSlice must not send
            // clients to this node any more. Once withdrawn it is
            // forgotten; if it comes back (or moves back), it is
            // reconciled again.
            let exported = |id: &String| now.iter().any(|e| &e.volume_id == id);
            for (id, v) in known.iter().filter(|(id, _)| !exported(id)) {
                leaving.insert(id.clone(), v.clone());
            }
            known.retain(|id, _| exported(id));
            done.retain(|id, _| exported(id));
            failing.retain(|id, _| exported(id));
            unnamed.retain(|id| exported(id));
            self.withdraw_due(&mut leaving, &mut leave_failing).await;
            // Woken by the next export change; else by the earliest retry,
            // or the next look at a server that did not answer.
            let mut next = failing.values().chain(leave_failing.values()).map(|f| f.next).min();
            if done.values().any(|t| !t.serving) {
                let poll = Instant::now() + self.controller.poll();
                next = Some(next.map_or(poll, |n| n.min(poll)));
            }
            woken_by_change = tokio::select! {
                _ = self.wake.notified() => true,
                _ = sleep_until(next) => false,
                _ = &mut stop => break,
            };
        }
        // Stopping: the server goes with the agent. Bounded by the caller.
        drop(clients);
        self.withdraw_all(known.values().chain(leaving.values())).await;
    }

    /// Whether the server is taken to be serving: asked again when `ask`,
    /// else as `answered` last; not at all when no export names a PVC
    /// (no Service is kept then).
    async fn serving(&self, now: &[Exported], ask: bool, answered: &mut Option<bool>) -> bool {
        if now.iter().any(|e| e.pvc.is_some()) {
            if ask {
                *answered = Some(self.answers().await);
            }
            answered.unwrap_or(false)
        } else {
            *answered = None;
            false
        }
    }

    /// Takes this node's address out of every one of `volumes`'
    /// EndpointSlices, on the way out; failures are logged only.
    async fn withdraw_all(&self, volumes: impl Iterator<Item = &SharedVolume>) {
        for v in volumes {
            match self.controller.withdraw(v).await {
                Ok(wrote) => {
                    tracing::info!(volume = %v.volume_id, emptied = wrote, "stopping: this node's address is out of the EndpointSlice")
                }
                Err(err) => tracing::warn!(volume = %v.volume_id, error = %err, "stopping: EndpointSlice not emptied"),
            }
        }
    }

    /// Export `e`'s objects, or `None` (warned about once, kept in
    /// `unnamed`) when no PVC was recorded for it: no Service can be named.
    fn shared_volume(&self, e: &Exported, unnamed: &mut Vec<String>) -> Option<SharedVolume> {
        let Some((ns, name)) = e.pvc.clone() else {
            if !unnamed.contains(&e.volume_id) {
                tracing::warn!(volume = %e.volume_id,
                    "shared volume has no PVC recorded (external-provisioner without --extra-create-metadata): no Service for it");
                unnamed.push(e.volume_id.clone());
            }
            return None;
        };
        Some(SharedVolume {
            volume_id: e.volume_id.clone(),
            pvc_namespace: ns,
            pvc_name: name,
            server: self.server.ip(),
            server_port: self.server.port(),
        })
    }

    /// Brings one volume's Service and EndpointSlice to `target`; records
    /// it in `done` on success, in `failing` (with its next try) on failure.
    async fn bring(&self, target: Target, done: &mut HashMap<String, Target>, failing: &mut HashMap<String, Failing>) {
        let v = &target.v;
        let serving = target.serving;
        let published = |endpoint: &str| tracing::info!(volume = %v.volume_id, endpoint, "NFS endpoint published on the PVC");
        let r = if serving { self.controller.reconcile(v, published).await } else { self.controller.reconcile_idle(v).await };
        match r {
            Ok(out) => {
                if serving {
                    tracing::debug!(volume = %v.volume_id, ?out, "Service and EndpointSlice reconciled");
                } else {
                    tracing::info!(volume = %v.volume_id, server = %self.server, ?out,
                        "the NFS server does not answer yet: the Service is kept with an empty EndpointSlice");
                }
                failing.remove(&v.volume_id);
                done.insert(v.volume_id.clone(), target);
            }
            Err(err) => {
                let wait = Failing::failed(failing, &v.volume_id);
                done.remove(&v.volume_id);
                tracing::warn!(volume = %v.volume_id, error = %err, retry_in_ms = wait.as_millis() as u64,
                    "Service and EndpointSlice not reconciled");
            }
        }
    }

    /// Takes this node's address out of the EndpointSlice of each volume
    /// in `leaving` whose retry is due; a withdrawn volume is forgotten, a
    /// failed one waits in `leave_failing`.
    async fn withdraw_due(&self, leaving: &mut HashMap<String, SharedVolume>, leave_failing: &mut HashMap<String, Failing>) {
        let due: Vec<SharedVolume> = leaving.values().filter(|v| !Failing::waiting(leave_failing, &v.volume_id)).cloned().collect();
        for v in due {
            match self.controller.withdraw(&v).await {
                Ok(wrote) => {
                    tracing::info!(volume = %v.volume_id, emptied = wrote, "NFS export gone from this node: its address is out of the EndpointSlice");
                    leaving.remove(&v.volume_id);
                    leave_failing.remove(&v.volume_id);
                }
                Err(err) => {
                    let wait = Failing::failed(leave_failing, &v.volume_id);
                    tracing::warn!(volume = %v.volume_id, error = %err, retry_in_ms = wait.as_millis() as u64,
                        "EndpointSlice not emptied after the export went away");
                }
            }
        }
    }

    /// Whether the NFS server accepts a TCP connection at its listen
    /// address.
    async fn answers(&self) -> bool {
        matches!(tokio::time::timeout(ANSWER_WAIT, tokio::net::TcpStream::connect(self.probe)).await, Ok(Ok(_)))
    }
}

/// Sleeps until `at`, or forever when there is nothing to wait for.
async fn sleep_until(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

/// What runs for shared volumes in a cluster, and what `/metrics` reads
/// of it: the export loop when this node serves NFS, and the renouncer's
/// retry loop when it announces itself as a client.
pub struct Running {
    /// The export loop's controller (`None`: this node serves no NFS).
    pub controller: Option<Arc<ShareController>>,
    exports: Option<ExportLoop>,
    /// The renouncer's retry loop, when this node announces itself
    /// ([`super::renounce`]); its work is records in the store, so an
    /// abort loses nothing.
    retry: Option<tokio::task::JoinHandle<()>>,
}

/// The export loop: its task, and the signal that asks it to stop.
pub(crate) struct ExportLoop {
    task: tokio::task::JoinHandle<()>,
    stop: tokio::sync::oneshot::Sender<()>,
}

impl Running {
    /// Stops the export loop, which first empties the EndpointSlices of
    /// what this node exports (at most `wait`; then it is aborted), and the
    /// renouncer's retry loop.
    pub async fn stop(self, wait: Duration) {
        if let Some(retry) = self.retry {
            retry.abort();
            let _ = retry.await;
        }
        let Some(ExportLoop { mut task, stop }) = self.exports else { return };
        let _ = stop.send(());
        if tokio::time::timeout(wait, &mut task).await.is_err() {
            tracing::warn!(wait_ms = wait.as_millis() as u64, "shared-volume loop did not stop in time; aborted");
            task.abort();
        }
    }
}

/// How long NodeStage waits for the API server when it reads a PVC's
/// published endpoint (kubelet retries a failed stage).
const LOOKUP_WAIT: Duration = Duration::from_secs(10);

/// In a cluster: `driver`'s NodeStage reads published endpoints, and when
/// the node serves NFS the loop runs (`None` when it does not). `node` is
/// the agent's `--node-id`: its requests' User-Agent names it, as the
/// publisher's do, so one node's requests read alike in the audit log;
/// `address` is where other nodes' NFS servers see this node's
/// connections come from (`--nfs-client-address`), which it announces
/// when it stages a shared volume (`None`: it announces nothing, and is
/// admitted only where the owner lists it in `--nfs-clients`).
pub async fn in_cluster<D: ShareHost>(
    driver: &Arc<D>,
    node: &str,
    address: Option<std::net::IpAddr>,
    config: super::kube::ControllerConfig,
) -> Result<Running, super::Error> {
    let cluster = |e: String| super::Error::Config(format!("shared volumes need the cluster's client configuration: {e}"));
    let mut kc = kube::Config::infer().await.map_err(|e| cluster(e.to_string()))?;
    super::kube::identify(&mut kc, node);
    let client = kube::Client::try_from(kc).map_err(|e| cluster(e.to_string()))?;
    let retry = read_endpoints(driver.as_ref(), client.clone(), node, address);
    if !driver.shares().enabled() {
        return Ok(Running { controller: None, exports: None, retry });
    }
    let (exports, controller) = match start(driver.clone(), client, config) {
        Ok(started) => started,
        Err(e) => {
            if let Some(retry) = retry {
                retry.abort();
            }
            return Err(e);
        }
    };
    tracing::info!("shared volumes: a Service and EndpointSlice per NFS export");
    Ok(Running { controller: Some(controller), exports: Some(exports), retry })
}

/// Lets `driver`'s NodeStage read the endpoints owning nodes publish on
/// PVCs (every node of a cluster, also one that serves no NFS itself).
/// With an `address`, a stage first announces this node on the PVC and
/// waits for the owner to admit it (UNAVAILABLE until then), and the
/// unstage takes the announcement off ([`super::admit`]); one the API
/// server did not take off (an outage), or that a stage which never
/// finished left, is taken off later ([`super::renounce`]).
pub(crate) fn read_endpoints(
    driver: &dyn ShareHost,
    client: kube::Client,
    node: &str,
    address: Option<std::net::IpAddr>,
) -> Option<tokio::task::JoinHandle<()>> {
    let handle = tokio::runtime::Handle::current();
    let renouncer = Renouncer {
        client: client.clone(),
        store: driver.shares().store(),
        node: node.to_string(),
        turns: Turns::default(),
        announced_at: Default::default(),
    };
    let (h, r) = (handle.clone(), renouncer.clone());
    driver.set_endpoint_lookup(Box::new(move |id, ns, name| {
        let r = &r;
        let lookup = async move {
            if let Some(address) = address {
                let pvc = (ns.to_string(), name.to_string());
                // This volume's turn: a retried renouncement of it waits.
                let _turn = r.turns.take(id).await?;
                super::records::put_announced(&r.store, id, &pvc).map_err(|e| e.to_string())?;
                let admitted =
                    super::admit::announce(&r.client, ns, name, &r.node, &address.to_string()).await.map_err(|e| e.to_string())?;
                // Announced: a renouncement still pending from an earlier
                // unstage would take this new announcement off.
                r.announced(id);
                super::records::remove_renounce_pending(&r.store, id).map_err(|e| e.to_string())?;
                if !admitted {
                    return Err(format!("the owning node has not admitted this node ({address}) to the NFS export yet"));
                }
            }
            super::kube::published_endpoint(&r.client, ns, name).await.map_err(|e| e.to_string())
        };
        match h.block_on(async move { tokio::time::timeout(LOOKUP_WAIT, lookup).await }) {
            Ok(r) => r,
            Err(_) => Err(format!("no answer from the API server within {LOOKUP_WAIT:?}")),
        }
    }));
    // Without an address nothing is announced, so nothing is renounced.
    address?;
    let r = renouncer.clone();
    driver.shares().on_unmounted(move |id| {
        let Some(pvc) = super::records::get_announced(&r.store, id) else { return };
        // On a thread of its own: block_on must not run on a runtime's
        // thread, and the caller's is not known here.
        let done = std::thread::scope(|t| t.spawn(|| handle.block_on(r.renounce(id, &pvc))).join());
        if done.is_err() {
            tracing::warn!(volume = id, "the NFS announcement's renouncement panicked");
        }
    });
    Some(tokio::spawn(renouncer.retry()))
}

/// Starts the loop over `driver`'s exports. The node's advertised NFS
/// address must be `IP:port`, and one the API server accepts in an
/// EndpointSlice ([`endpoint_address`]).
pub(crate) fn start<D: ShareHost>(
    driver: Arc<D>,
    client: kube::Client,
    config: super::kube::ControllerConfig,
) -> Result<(ExportLoop, Arc<ShareController>), super::Error> {
    let share = driver.shares().config();
    let server = endpoint_address(share.advertised().as_deref())?;
    let probe = share.listen.unwrap_or(server);
    let controller = Arc::new(ShareController::new(client, config));
    let wake = Arc::new(Notify::new());
    let w = wake.clone();
    driver.shares().on_change(move || w.notify_one());
    let d = driver.clone();
    let exports = Arc::new(move || d.exported_shares());
    let d = driver.clone();
    let admit: Admit = Arc::new(move |id, clients| d.shares().set_clients(id, clients));
    let follower = Follower { controller: controller.clone(), server, probe, exports, admit, wake };
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn(follower.run_until(async move {
        let _ = stopped.await;
    }));
    Ok((ExportLoop { task, stop }, controller))
}

/// The advertised NFS address as an EndpointSlice address: `IP:port`, and
/// not an address the API server refuses there (loopback, link-local,
/// unspecified, multicast: "may not be in the loopback range" and the
/// like). Refused at start with the flag to set, rather than by every
/// reconcile: a node listening on loopback or a wildcard must advertise
/// the address other nodes reach it at (`--nfs-advertise`, in deploy/ the
/// pod's IP from the downward API).
pub(crate) fn endpoint_address(advertised: Option<&str>) -> Result<SocketAddr, super::Error> {
    let a = advertised.unwrap_or_default();
    let addr: SocketAddr =
        a.parse().map_err(|_| super::Error::Config(format!("the advertised NFS address {a:?} is not IP:port (--nfs-advertise)")))?;
    let ip = addr.ip();
    let link_local = match ip {
        std::net::IpAddr::V4(v4) => v4.is_link_local(),
        std::net::IpAddr::V6(v6) => (v6.segments()[0] & 0xffc0) == 0xfe80,
    };
    if ip.is_loopback() || ip.is_unspecified() || ip.is_multicast() || link_local {
        return Err(super::Error::Config(format!(
            "the advertised NFS address {addr} is one the API server refuses in an EndpointSlice \
             (loopback, link-local, unspecified or multicast): set --nfs-advertise to the address other nodes reach this one at"
        )));
    }
    Ok(addr)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn advertised_addresses_the_api_server_accepts() {
        assert_eq!(endpoint_address(Some("10.0.0.7:2049")).unwrap(), "10.0.0.7:2049".parse().unwrap());
        assert!(endpoint_address(Some("[fd00::7]:2049")).is_ok());
        for bad in [None, Some("node-a:2049"), Some("10.0.0.7"), Some("127.0.0.1:2049"), Some("0.0.0.0:2049"), Some("[::1]:2049")] {
            assert!(matches!(endpoint_address(bad), Err(crate::Error::Config(_))), "{bad:?}");
        }
        for bad in ["169.254.1.1:2049", "[fe80::1]:2049", "[::]:2049", "224.0.0.1:2049"] {
            assert!(endpoint_address(Some(bad)).is_err(), "{bad}");
        }
    }
}
