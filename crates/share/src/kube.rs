//! In a cluster: a Service and its EndpointSlice per shared volume, in the
//! PVC's namespace with the PVC's name, so pods on any node mount
//! `<ClusterIP>:2049` and the address behind it can move (StorageOS's
//! shared-volume controller does the same). The slice (discovery.k8s.io/v1,
//! what kube-proxy reads) is labelled `kubernetes.io/service-name` and
//! `endpointslice.kubernetes.io/managed-by: volring.io`. core/v1 Endpoints,
//! deprecated since 1.33, are neither read nor written: the agent's role
//! has no access to them (least privilege). The ones an earlier version
//! wrote are the operator's to delete once (docs/shared-volumes.md), else
//! the API server's mirroring controller keeps their address in a slice of
//! its own.
//!
//! What one reconcile does, and why:
//! - Reads the PVC for its uid: both objects carry an owner reference to
//!   it, so deleting the PVC removes them (the garbage collector's job; the
//!   controller never deletes them itself).
//! - Reads each object first and writes only what differs: create when
//!   absent, update when not equivalent (only the fields volring owns are
//!   compared, so defaults the API server fills in never cause a write).
//! - After a create, re-reads until the object is visible (poll interval
//!   and total wait configurable, 1 s / 20 s by default): the endpoint is
//!   published only once the objects are really there.
//! - Publishes `ClusterIP:2049` as the PVC's `ENDPOINT_ANNOTATION` (what
//!   other nodes' NodeStage mounts), only when the annotation differs: a
//!   changed endpoint turns NFS clients' handles stale, and the annotation
//!   read back from the PVC (not a memory of this process) decides, so a
//!   restarted agent does not publish again.
//! - Failover (the server moved to another address): the Service keeps its
//!   ClusterIP, only the slice is updated, nothing is republished (a move
//!   between IPv4 and IPv6 replaces the slice: its address type is
//!   immutable).
//! - While no server answers for the volume (the export removed here, the
//!   agent stopping, a new address whose server is not up yet) the
//!   slice has no endpoints and the Service stays: clients keep the ClusterIP
//!   they mounted and their connections are refused, which a hard mount
//!   retries, instead of reaching an address where nothing serves the
//!   volume (`ShareController::reconcile_idle`,
//!   [`ShareController::withdraw`]).
//! - Every reconcile's duration goes into one histogram.

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::{PersistentVolumeClaim, Service, ServicePort, ServiceSpec};
use k8s_openapi::api::discovery::v1::{Endpoint, EndpointConditions, EndpointPort, EndpointSlice};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use kube::api::{Api, Patch, PatchParams, PostParams};
use prometheus_client::metrics::histogram::Histogram;

/// The port clients mount on the Service.
pub(crate) const NFS_PORT: u16 = 2049;
/// Label naming the volume on both objects.
pub(crate) const VOLUME_LABEL: &str = "volring.io/volume";
/// The label that ties an EndpointSlice to its Service.
pub(crate) const SERVICE_NAME_LABEL: &str = "kubernetes.io/service-name";
/// The label that says who manages an EndpointSlice (the API server's own
/// controllers leave a slice managed by another alone).
pub(crate) const MANAGED_BY_LABEL: &str = "endpointslice.kubernetes.io/managed-by";
/// volring's value of [`MANAGED_BY_LABEL`].
pub(crate) const MANAGED_BY: &str = "volring.io";
const PORT_NAME: &str = "nfs";
/// Annotation on the PVC: the endpoint (`ClusterIP:2049`) other nodes
/// mount the shared volume from.
pub(crate) const ENDPOINT_ANNOTATION: &str = "volring.io/nfs-endpoint";

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("PVC {namespace}/{name} does not exist")]
    PvcGone { namespace: String, name: String },
    #[error("{what}: {source}")]
    Api { what: String, source: kube::Error },
    #[error("{0} was created but not visible after {1:?}")]
    NotVisible(String, Duration),
    #[error("Service {0} has no ClusterIP")]
    NoClusterIp(String),
    #[error("{0}: changed by someone else at each of {1} tries")]
    Contended(String, u32),
}

/// `volring/<version> (<node>)`: the User-Agent of every request volring
/// makes to the API server, so its audit log, its metrics and priority
/// and fairness can tell volring's requests and each node's apart.
pub(crate) fn user_agent(node: &str) -> String {
    format!("volring/{} ({node})", env!("CARGO_PKG_VERSION"))
}

/// Sets `user_agent` on every request a client made from `config` sends
/// (replacing any User-Agent it had).
pub fn identify(config: &mut kube::Config, node: &str) {
    let name = http::header::USER_AGENT;
    config.headers.retain(|(n, _)| n != name);
    // A node name that is no header value (it never is one in a cluster:
    // node names are DNS names) leaves it out rather than fail.
    let value =
        http::HeaderValue::from_str(&user_agent(node)).unwrap_or_else(|_| http::HeaderValue::from_str(&user_agent("?")).expect("ASCII"));
    config.headers.push((name, value));
}

/// How many times [`ShareController::withdraw`] reads again after a
/// conflicting write.
const WITHDRAW_TRIES: u32 = 5;

/// Poll interval and total wait of the re-read after a create.
#[derive(Debug, Clone)]
pub struct ControllerConfig {
    pub poll: Duration,
    pub total_wait: Duration,
}

impl Default for ControllerConfig {
    fn default() -> Self {
        Self { poll: Duration::from_secs(1), total_wait: Duration::from_secs(20) }
    }
}

/// One shared volume as the controller sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SharedVolume {
    pub volume_id: String,
    pub pvc_namespace: String,
    pub pvc_name: String,
    /// Where the NFS server answers now.
    pub server: IpAddr,
    pub server_port: u16,
}

/// What a reconcile wrote.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Outcome {
    pub service_created: bool,
    pub service_updated: bool,
    /// The EndpointSlice (the endpoints behind the Service).
    pub endpoints_created: bool,
    pub endpoints_updated: bool,
    /// The endpoint published by this reconcile (None: unchanged).
    pub published: Option<String>,
}

pub struct ShareController {
    client: kube::Client,
    config: ControllerConfig,
    duration: Histogram,
}

impl ShareController {
    pub fn new(client: kube::Client, config: ControllerConfig) -> Self {
        // 5 ms to ~41 s: a reconcile that waits for a create's visibility
        // takes seconds.
        let duration = Histogram::new(prometheus_client::metrics::histogram::exponential_buckets(0.005, 2.0, 14));
        Self { client, config, duration }
    }

    /// The API client the controller writes with.
    pub(crate) fn client(&self) -> &kube::Client {
        &self.client
    }

    /// Registers the reconcile-duration histogram.
    pub fn register(&self, registry: &mut prometheus_client::registry::Registry) {
        registry.register(
            "volring_share_reconcile_duration_seconds",
            "Time one reconcile of a shared volume's Service and EndpointSlice took",
            self.duration.clone(),
        );
    }

    /// The poll interval of re-reads (also how often the loop looks
    /// whether a server that does not answer yet does).
    pub(crate) fn poll(&self) -> Duration {
        self.config.poll
    }

    /// Brings volume `v`'s Service and EndpointSlice to what they should be
    /// while `v.server` serves it; `publish` is called with
    /// `ClusterIP:2049` when that changed.
    pub async fn reconcile(&self, v: &SharedVolume, publish: impl FnOnce(&str)) -> Result<Outcome, Error> {
        let start = Instant::now();
        let r = self.reconcile_inner(v, true, publish).await;
        self.duration.observe(start.elapsed().as_secs_f64());
        r
    }

    /// The volume is staged on this node but its server does not answer
    /// yet (it is starting, or at a new address): the Service is made or
    /// kept as [`Self::reconcile`] would, the EndpointSlice is emptied
    /// (whatever address it held is not serving the volume now), and
    /// nothing is published — other nodes mount only once an address is
    /// behind the ClusterIP.
    pub(crate) async fn reconcile_idle(&self, v: &SharedVolume) -> Result<Outcome, Error> {
        let start = Instant::now();
        let r = self.reconcile_inner(v, false, |_| {}).await;
        self.duration.observe(start.elapsed().as_secs_f64());
        r
    }

    /// The server at `v.server` stops serving the volume (its export was
    /// removed here, or the agent stops): its address is taken out of the
    /// EndpointSlice, which is left empty; the Service and its ClusterIP
    /// stay. A slice that does not list this address (another node took
    /// the volume over meanwhile) is left alone; the replace carries the
    /// resourceVersion read, so a concurrent takeover is not overwritten
    /// (the conflict is read again). True when something was written.
    pub async fn withdraw(&self, v: &SharedVolume) -> Result<bool, Error> {
        let start = Instant::now();
        let r = self.withdraw_inner(v).await;
        self.duration.observe(start.elapsed().as_secs_f64());
        r
    }

    async fn withdraw_inner(&self, v: &SharedVolume) -> Result<bool, Error> {
        let (ns, name) = (v.pvc_namespace.as_str(), v.pvc_name.as_str());
        let what = format!("EndpointSlice {ns}/{name}");
        let slices: Api<EndpointSlice> = Api::namespaced(self.client.clone(), ns);
        // Bounded: a conflict means someone wrote in between; read again.
        for _ in 0..WITHDRAW_TRIES {
            let Some(have) = slices.get_opt(name).await.map_err(|e| Error::Api { what: what.clone(), source: e })? else {
                return Ok(false);
            };
            if !lists(&have, v) {
                return Ok(false);
            }
            let mut next = have;
            next.endpoints = Some(Vec::new());
            match slices.replace(name, &PostParams::default(), &next).await {
                Ok(_) => return Ok(true),
                Err(kube::Error::Api(e)) if e.code == 409 => continue,
                Err(e) => return Err(Error::Api { what, source: e }),
            }
        }
        Err(Error::Contended(what, WITHDRAW_TRIES))
    }

    async fn reconcile_inner(&self, v: &SharedVolume, serving: bool, publish: impl FnOnce(&str)) -> Result<Outcome, Error> {
        let ns = v.pvc_namespace.as_str();
        let name = v.pvc_name.as_str();
        let what = |kind: &str| format!("{kind} {ns}/{name}");
        let pvcs: Api<PersistentVolumeClaim> = Api::namespaced(self.client.clone(), ns);
        let pvc = pvcs
            .get_opt(name)
            .await
            .map_err(|e| Error::Api { what: what("PersistentVolumeClaim"), source: e })?
            .ok_or_else(|| Error::PvcGone { namespace: ns.into(), name: name.into() })?;
        let owner = OwnerReference {
            api_version: "v1".into(),
            kind: "PersistentVolumeClaim".into(),
            name: name.into(),
            uid: pvc.metadata.uid.clone().unwrap_or_default(),
            block_owner_deletion: None,
            controller: None,
        };
        let mut out = Outcome::default();

        let services: Api<Service> = Api::namespaced(self.client.clone(), ns);
        let want = desired_service(v, &owner);
        let svc = match services.get_opt(name).await.map_err(|e| Error::Api { what: what("Service"), source: e })? {
            None => {
                services.create(&PostParams::default(), &want).await.map_err(|e| Error::Api { what: what("Service"), source: e })?;
                out.service_created = true;
                self.visible(&services, &what("Service")).await?
            }
            Some(have) if service_equivalent(&have, &want) => have,
            Some(have) => {
                let mut next = want.clone();
                next.metadata.resource_version = have.metadata.resource_version.clone();
                // The ClusterIP is immutable, and what clients mount: kept.
                if let (Some(spec), Some(have_spec)) = (next.spec.as_mut(), have.spec.as_ref()) {
                    spec.cluster_ip = have_spec.cluster_ip.clone();
                    spec.cluster_ips = have_spec.cluster_ips.clone();
                }
                out.service_updated = true;
                services.replace(name, &PostParams::default(), &next).await.map_err(|e| Error::Api { what: what("Service"), source: e })?
            }
        };

        self.ensure_slice(v, &owner, serving, &mut out).await?;
        let ip = svc.spec.as_ref().and_then(|s| s.cluster_ip.clone()).filter(|ip| !ip.is_empty() && ip != "None");
        let ip = ip.ok_or_else(|| Error::NoClusterIp(what("Service")))?;
        if !serving {
            return Ok(out);
        }
        let endpoint = match ip.parse::<IpAddr>() {
            Ok(IpAddr::V6(a)) => format!("[{a}]:{NFS_PORT}"),
            _ => format!("{ip}:{NFS_PORT}"),
        };
        let have = pvc.metadata.annotations.as_ref().and_then(|a| a.get(ENDPOINT_ANNOTATION));
        if have != Some(&endpoint) {
            // A merge patch of the one annotation: the PVC's other fields
            // belong to others and are not sent back.
            let patch = serde_json::json!({"metadata": {"annotations": {ENDPOINT_ANNOTATION: endpoint}}});
            pvcs.patch(name, &PatchParams::default(), &Patch::Merge(&patch))
                .await
                .map_err(|e| Error::Api { what: what("PersistentVolumeClaim"), source: e })?;
            publish(&endpoint);
            out.published = Some(endpoint);
        }
        Ok(out)
    }

    /// Brings the volume's EndpointSlice to this node's address (`serving`)
    /// or to none, creating or replacing it as needed; says what it did in
    /// `out`.
    async fn ensure_slice(&self, v: &SharedVolume, owner: &OwnerReference, serving: bool, out: &mut Outcome) -> Result<(), Error> {
        let (ns, name) = (v.pvc_namespace.as_str(), v.pvc_name.as_str());
        let what = |kind: &str| format!("{kind} {ns}/{name}");
        let slices: Api<EndpointSlice> = Api::namespaced(self.client.clone(), ns);
        let want = desired_slice(v, owner, serving);
        let what_slice = what("EndpointSlice");
        let api_err = |e| Error::Api { what: what_slice.clone(), source: e };
        match slices.get_opt(name).await.map_err(api_err)? {
            None => {
                slices.create(&PostParams::default(), &want).await.map_err(api_err)?;
                out.endpoints_created = true;
                self.visible(&slices, &what_slice).await?;
            }
            Some(have) if slice_equivalent(&have, &want) => {}
            Some(have) if have.address_type != want.address_type => {
                // Immutable: a move between IPv4 and IPv6 replaces it.
                slices.delete(name, &Default::default()).await.map_err(api_err)?;
                slices.create(&PostParams::default(), &want).await.map_err(api_err)?;
                out.endpoints_created = true;
                self.visible(&slices, &what_slice).await?;
            }
            Some(have) => {
                let mut next = want;
                next.metadata.resource_version = have.metadata.resource_version;
                slices.replace(name, &PostParams::default(), &next).await.map_err(api_err)?;
                out.endpoints_updated = true;
            }
        }
        Ok(())
    }

    /// Re-reads a just-created object every `poll` until it is visible, at
    /// most `total_wait`.
    async fn visible<K>(&self, api: &Api<K>, what: &str) -> Result<K, Error>
    where
        K: kube::Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug,
    {
        let name = what.rsplit('/').next().unwrap_or_default().to_string();
        let deadline = Instant::now() + self.config.total_wait;
        loop {
            if let Some(o) = api.get_opt(&name).await.map_err(|e| Error::Api { what: what.into(), source: e })? {
                return Ok(o);
            }
            if Instant::now() + self.config.poll > deadline {
                return Err(Error::NotVisible(what.into(), self.config.total_wait));
            }
            tokio::time::sleep(self.config.poll).await;
        }
    }
}

/// What the owning node published for a PVC: its [`ENDPOINT_ANNOTATION`]
/// (`None`: not yet). Other nodes' NodeStage mounts this.
pub(crate) async fn published_endpoint(client: &kube::Client, namespace: &str, name: &str) -> Result<Option<String>, Error> {
    let pvcs: Api<PersistentVolumeClaim> = Api::namespaced(client.clone(), namespace);
    let pvc = pvcs
        .get_opt(name)
        .await
        .map_err(|e| Error::Api { what: format!("PersistentVolumeClaim {namespace}/{name}"), source: e })?
        .ok_or_else(|| Error::PvcGone { namespace: namespace.into(), name: name.into() })?;
    Ok(pvc.metadata.annotations.and_then(|mut a| a.remove(ENDPOINT_ANNOTATION)))
}

fn labels(v: &SharedVolume) -> BTreeMap<String, String> {
    [(VOLUME_LABEL.to_string(), v.volume_id.clone())].into()
}

fn meta(v: &SharedVolume, owner: &OwnerReference) -> ObjectMeta {
    ObjectMeta {
        name: Some(v.pvc_name.clone()),
        namespace: Some(v.pvc_namespace.clone()),
        labels: Some(labels(v)),
        owner_references: Some(vec![owner.clone()]),
        ..Default::default()
    }
}

/// A ClusterIP Service with no selector (its EndpointSlice is written here),
/// port 2049 to the server's port.
pub fn desired_service(v: &SharedVolume, owner: &OwnerReference) -> Service {
    Service {
        metadata: meta(v, owner),
        spec: Some(ServiceSpec {
            type_: Some("ClusterIP".into()),
            ports: Some(vec![ServicePort {
                name: Some(PORT_NAME.into()),
                port: NFS_PORT.into(),
                target_port: Some(IntOrString::Int(v.server_port.into())),
                protocol: Some("TCP".into()),
                ..Default::default()
            }]),
            ..Default::default()
        }),
        status: None,
    }
}

fn slice_meta(v: &SharedVolume, owner: &OwnerReference) -> ObjectMeta {
    let mut m = meta(v, owner);
    let labels = m.labels.get_or_insert_with(Default::default);
    labels.insert(SERVICE_NAME_LABEL.into(), v.pvc_name.clone());
    labels.insert(MANAGED_BY_LABEL.into(), MANAGED_BY.into());
    m
}

fn slice_ports(v: &SharedVolume) -> Option<Vec<EndpointPort>> {
    Some(vec![EndpointPort {
        name: Some(PORT_NAME.into()),
        port: Some(v.server_port.into()),
        protocol: Some("TCP".into()),
        app_protocol: None,
    }])
}

fn address_type(v: &SharedVolume) -> String {
    if v.server.is_ipv4() { "IPv4" } else { "IPv6" }.into()
}

/// The EndpointSlice of volume `v`: when `serving`, its one endpoint is
/// `v.server:v.server_port`; when no server answers for it, it has none
/// (the Service keeps its ClusterIP; connections to it are refused).
pub fn desired_slice(v: &SharedVolume, owner: &OwnerReference, serving: bool) -> EndpointSlice {
    if !serving {
        return EndpointSlice {
            metadata: slice_meta(v, owner),
            address_type: address_type(v),
            endpoints: Some(Vec::new()),
            ports: slice_ports(v),
        };
    }
    EndpointSlice {
        metadata: slice_meta(v, owner),
        address_type: address_type(v),
        endpoints: Some(vec![Endpoint {
            addresses: vec![v.server.to_string()],
            conditions: Some(EndpointConditions { ready: Some(true), serving: Some(true), terminating: Some(false) }),
            ..Default::default()
        }]),
        ports: slice_ports(v),
    }
}

/// Whether `e` sends clients to `v.server:v.server_port` (ready or not).
fn lists(e: &EndpointSlice, v: &SharedVolume) -> bool {
    let ip = v.server.to_string();
    let port = e.ports.iter().flatten().any(|p| p.port == Some(i32::from(v.server_port)));
    port && e.endpoints.iter().flatten().any(|ep| ep.addresses.contains(&ip))
}

/// The labels and owner references volring sets are there (others may be
/// added by anyone).
fn meta_holds(have: &ObjectMeta, want: &ObjectMeta) -> bool {
    let labels = have.labels.clone().unwrap_or_default();
    let owners = have.owner_references.clone().unwrap_or_default();
    want.labels.iter().flatten().all(|(k, v)| labels.get(k) == Some(v))
        && want.owner_references.iter().flatten().all(|o| owners.iter().any(|h| h.uid == o.uid && h.kind == o.kind && h.name == o.name))
}

/// Equivalent: the fields volring sets agree; what the API server fills
/// in (ClusterIP, session affinity, IP families...) is not compared.
pub(crate) fn service_equivalent(have: &Service, want: &Service) -> bool {
    let ports = |s: &Service| -> Vec<(Option<String>, i32, Option<IntOrString>, String)> {
        let mut p: Vec<_> = s
            .spec
            .iter()
            .flat_map(|s| s.ports.iter().flatten())
            .map(|p| (p.name.clone(), p.port, p.target_port.clone(), p.protocol.clone().unwrap_or_else(|| "TCP".into())))
            .collect();
        p.sort_by_key(|a| (a.0.clone(), a.1));
        p
    };
    let kind = |s: &Service| s.spec.as_ref().and_then(|s| s.type_.clone()).unwrap_or_else(|| "ClusterIP".into());
    let selector = |s: &Service| s.spec.as_ref().and_then(|s| s.selector.clone()).unwrap_or_default();
    meta_holds(&have.metadata, &want.metadata) && ports(have) == ports(want) && kind(have) == kind(want) && selector(have).is_empty()
}

/// Equivalent: the same type, endpoints (addresses and readiness) and
/// ports, and the labels and owner volring sets.
pub(crate) fn slice_equivalent(have: &EndpointSlice, want: &EndpointSlice) -> bool {
    type Ports = Vec<(Option<String>, Option<i32>, String)>;
    let flat = |e: &EndpointSlice| -> (Vec<String>, Ports) {
        let mut ips: Vec<String> = e
            .endpoints
            .iter()
            .flatten()
            .flat_map(|ep| {
                // Not ready is not served: one there is a difference.
                let ready = ep.conditions.as_ref().and_then(|c| c.ready).unwrap_or(true);
                ep.addresses.iter().map(move |a| if ready { a.clone() } else { format!("not-ready:{a}") })
            })
            .collect();
        let mut ports: Ports =
            e.ports.iter().flatten().map(|p| (p.name.clone(), p.port, p.protocol.clone().unwrap_or_else(|| "TCP".into()))).collect();
        ips.sort();
        ports.sort();
        (ips, ports)
    };
    have.address_type == want.address_type && meta_holds(&have.metadata, &want.metadata) && flat(have) == flat(want)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Issue 29: every request names volring, its version and its node
    /// (`volring/<version> (<node>)`); the API tests compare the requests'
    /// User-Agent with that form (this check was in tests/publisher/api.rs).
    #[test]
    fn the_user_agent_names_volring_its_version_and_node() {
        assert_eq!(user_agent("n1"), format!("volring/{} (n1)", env!("CARGO_PKG_VERSION")));
    }

    fn vol(ip: &str) -> SharedVolume {
        SharedVolume {
            volume_id: "pvc-1".into(),
            pvc_namespace: "apps".into(),
            pvc_name: "data".into(),
            server: ip.parse().unwrap(),
            server_port: 2049,
        }
    }

    fn owner() -> OwnerReference {
        OwnerReference {
            api_version: "v1".into(),
            kind: "PersistentVolumeClaim".into(),
            name: "data".into(),
            uid: "u1".into(),
            ..Default::default()
        }
    }

    #[test]
    fn equivalence_ignores_server_defaults() {
        let want = desired_service(&vol("10.0.0.1"), &owner());
        let mut have = want.clone();
        let spec = have.spec.as_mut().unwrap();
        spec.cluster_ip = Some("10.96.0.7".into());
        spec.session_affinity = Some("None".into());
        have.metadata.labels.as_mut().unwrap().insert("team".into(), "x".into());
        assert!(service_equivalent(&have, &want));
        have.spec.as_mut().unwrap().ports.as_mut().unwrap()[0].target_port = Some(IntOrString::Int(20490));
        assert!(!service_equivalent(&have, &want));
        let mut orphan = want.clone();
        orphan.metadata.owner_references = None;
        assert!(!service_equivalent(&orphan, &want));
        // The slice follows the server's address.
        let e1 = desired_slice(&vol("10.0.0.1"), &owner(), true);
        let e2 = desired_slice(&vol("10.0.0.2"), &owner(), true);
        assert!(slice_equivalent(&e1, &e1.clone()));
        assert!(!slice_equivalent(&e1, &e2));
        assert_eq!(e1.metadata.labels.as_ref().unwrap()[SERVICE_NAME_LABEL], "data");
        assert_eq!(e1.metadata.labels.as_ref().unwrap()[MANAGED_BY_LABEL], "volring.io");
        assert_eq!((e1.address_type.as_str(), desired_slice(&vol("fd00::1"), &owner(), true).address_type.as_str()), ("IPv4", "IPv6"));
        // The Service does not.
        assert!(service_equivalent(&desired_service(&vol("10.0.0.2"), &owner()), &want));
        // A server going away takes out only its own address and port.
        assert!(lists(&e1, &vol("10.0.0.1")));
        assert!(!lists(&e2, &vol("10.0.0.1")), "another node's slice is left alone");
        let mut other_port = vol("10.0.0.1");
        other_port.server_port = 20490;
        assert!(!lists(&e1, &other_port));
        assert!(!lists(&desired_slice(&vol("10.0.0.1"), &owner(), false), &vol("10.0.0.1")));
        assert!(slice_equivalent(&desired_slice(&vol("10.0.0.1"), &owner(), false), &desired_slice(&vol("10.0.0.2"), &owner(), false)));
    }
}
