//! Shared (ReadWriteMany) volumes: the node holding a volume exports its
//! staged filesystem over NFSv4, and other nodes mount that export.
//!
//! Why NFS from the owning node: a volring volume lives in one node's pool;
//! a filesystem cannot be mounted read-write by two kernels, so the node
//! that stages it serves it and everyone else is an NFS client. Why
//! nfs-ganesha and not a Rust NFS server crate: the crates that exist serve
//! NFSv3 only, without the NLM side protocol, so fcntl and flock locks —
//! what RWX workloads (databases' lock files, mail spools, build caches)
//! rely on — would not exclude across nodes; ganesha serves NFSv4.1/4.2
//! with byte-range locks, leases and a grace period for reclaiming them
//! after a restart, from userspace (the kernel server needs the node's
//! nfsd module), on one TCP port with no rpcbind.
//!
//! The CSI side marks a volume shared when it is created with
//! MULTI_NODE_MULTI_WRITER (the `share` parameter below), and the node that
//! stages such a volume exports it.

// Everything is crate-private unless another crate uses it: a `pub`
// item no other crate can reach is an error (`-D warnings`).
#![warn(unreachable_pub)]

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

mod admit;
pub mod client;
mod client_watch;
pub mod follow;
mod ganesha;
mod identity;
pub mod kube;
mod records;
mod renounce;
mod server;
mod side;

pub use ganesha::{valid_client, Squash};
pub use records::{record_pvc, MountRecord};
pub use side::{ShareConfig, ShareSide};

/// Why sharing a volume failed.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("NFS server configuration: {0}")]
    Config(String),
    #[error("{path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },
    #[error("share records: {0}")]
    Store(String),
    #[error("{0}")]
    Busy(String),
}

impl Error {
    fn io(path: &Path, source: std::io::Error) -> Self {
        Error::Io { path: path.to_path_buf(), source }
    }
}

/// Parameter (recorded with the volume) and volume-context key marking a
/// shared volume; its one value is [`SHARE_NFS`].
pub(crate) const PARAM_SHARE: &str = "share";
pub(crate) const SHARE_NFS: &str = "nfs";

/// StorageClass parameter (recorded with the volume): root squash of its
/// NFS export, `root` (the default), `none` or `all` ([`Squash`]).
pub const PARAM_SQUASH: &str = "nfsSquash";

/// The squash a volume's recorded parameters ask for, else (a volume
/// exported from a node that does not hold its pool record has only its
/// context) its volume context: the default when they say nothing or
/// neither is there; an error naming the parameter when it is no value.
pub fn squash_of(recorded: Option<&BTreeMap<String, String>>, context: Option<&HashMap<String, String>>) -> Result<Squash, Error> {
    let value = match (recorded, context) {
        (Some(parameters), _) => parameters.get(PARAM_SQUASH),
        (None, Some(context)) => context.get(PARAM_SQUASH),
        (None, None) => None,
    };
    value.map_or(Ok(Squash::Root), |v| v.parse())
}

/// Whether a volume's recorded parameters mark it shared.
pub fn is_shared(parameters: &BTreeMap<String, String>) -> bool {
    parameters.get(PARAM_SHARE).is_some_and(|v| v == SHARE_NFS)
}

/// Marks recorded parameters shared.
pub fn mark_shared(parameters: &mut BTreeMap<String, String>) {
    parameters.insert(PARAM_SHARE.to_string(), SHARE_NFS.to_string());
}

/// Volume-context key: the export's `host:port` as other nodes reach it.
pub const CTX_SERVER: &str = "nfsServer";
/// Volume-context key: the path clients mount on that server.
pub(crate) const CTX_EXPORT: &str = "nfsExport";

/// Volume-context keys: the namespace and name of the PVC a shared volume
/// was created for, so other nodes know where its endpoint is published
/// (the PVC's `volring.io/nfs-endpoint` annotation, see [`kube`]).
pub(crate) const CTX_PVC_NAMESPACE: &str = "nfsPvcNamespace";
pub(crate) const CTX_PVC_NAME: &str = "nfsPvcName";

/// The external-provisioner's keys (`--extra-create-metadata`) in
/// CreateVolume's parameters, recorded with the volume.
const PROVISIONER_PVC_NAMESPACE: &str = "csi.storage.k8s.io/pvc/namespace";
const PROVISIONER_PVC_NAME: &str = "csi.storage.k8s.io/pvc/name";

/// The PVC (namespace, name) a volume's recorded parameters name, when
/// both are names Kubernetes allows.
pub(crate) fn pvc_of(parameters: &BTreeMap<String, String>) -> Option<(String, String)> {
    pvc(parameters.get(PROVISIONER_PVC_NAMESPACE)?, parameters.get(PROVISIONER_PVC_NAME)?)
}

/// The PVC a volume context names. The names go into API paths, so only
/// names Kubernetes allows are taken: a namespace is a DNS label, a PVC
/// name a DNS subdomain (lower-case letters, digits, `-`, and `.` between
/// labels).
pub fn pvc_in_context(context: &HashMap<String, String>) -> Option<(String, String)> {
    pvc(context.get(CTX_PVC_NAMESPACE)?, context.get(CTX_PVC_NAME)?)
}

fn pvc(ns: &str, name: &str) -> Option<(String, String)> {
    let label = |s: &str| {
        (1..=63).contains(&s.len())
            && s.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
            && !s.starts_with('-')
            && !s.ends_with('-')
    };
    let subdomain = |s: &str| s.len() <= 253 && s.split('.').all(label);
    (label(ns) && subdomain(name)).then(|| (ns.to_string(), name.to_string()))
}

/// The path volume `id` is exported as (`server:/<id>`).
pub(crate) fn pseudo_path(id: &str) -> String {
    format!("/{id}")
}

/// The volume-context entries of a shared volume: the marker, so every
/// node knows the volume is served over NFS, and where, when the node that
/// holds it serves NFS (`server`, its advertised address).
pub(crate) fn context(id: &str, parameters: &BTreeMap<String, String>, server: Option<&str>, context: &mut HashMap<String, String>) {
    if is_shared(parameters) {
        context.insert(PARAM_SHARE.to_string(), SHARE_NFS.to_string());
        // So a node the export moves to squashes as the StorageClass says.
        if let Some(s) = parameters.get(PARAM_SQUASH) {
            context.insert(PARAM_SQUASH.to_string(), s.clone());
        }
        if let Some((ns, name)) = pvc_of(parameters) {
            context.insert(CTX_PVC_NAMESPACE.to_string(), ns);
            context.insert(CTX_PVC_NAME.to_string(), name);
        }
        if let Some(s) = server {
            context.insert(CTX_SERVER.to_string(), s.to_string());
            context.insert(CTX_EXPORT.to_string(), pseudo_path(id));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn marker() {
        let mut p = BTreeMap::new();
        assert!(!is_shared(&p));
        let mut c = HashMap::new();
        context("pvc-1", &p, Some("10.0.0.1:2049"), &mut c);
        assert!(c.is_empty());
        mark_shared(&mut p);
        assert!(is_shared(&p));
        context("pvc-1", &p, None, &mut c);
        assert_eq!(c.get(PARAM_SHARE).map(String::as_str), Some(SHARE_NFS));
        assert!(!c.contains_key(CTX_SERVER));
        context("pvc-1", &p, Some("10.0.0.1:2049"), &mut c);
        assert_eq!(c.get(CTX_SERVER).map(String::as_str), Some("10.0.0.1:2049"));
        assert_eq!(c.get(CTX_EXPORT).map(String::as_str), Some("/pvc-1"));
        assert_eq!(pvc_in_context(&c), None, "no PVC recorded");
        p.insert(PROVISIONER_PVC_NAMESPACE.into(), "apps".into());
        p.insert(PROVISIONER_PVC_NAME.into(), "data".into());
        context("pvc-1", &p, Some("10.0.0.1:2049"), &mut c);
        assert_eq!(pvc_in_context(&c), Some(("apps".into(), "data".into())));
    }

    #[test]
    fn the_squash_comes_from_the_record_else_the_context() {
        let recorded = BTreeMap::from([(PARAM_SQUASH.to_string(), "none".to_string())]);
        let context = HashMap::from([(PARAM_SQUASH.to_string(), "all".to_string())]);
        assert_eq!(squash_of(Some(&recorded), Some(&context)).ok(), Some(Squash::None));
        assert_eq!(squash_of(None, Some(&context)).ok(), Some(Squash::All));
        assert_eq!(squash_of(Some(&BTreeMap::new()), Some(&context)).ok(), Some(Squash::Root), "the record says nothing");
        assert_eq!(squash_of(None, None).ok(), Some(Squash::Root));
        let bad = HashMap::from([(PARAM_SQUASH.to_string(), "some".to_string())]);
        assert!(squash_of(None, Some(&bad)).is_err_and(|e| e.to_string().contains("nfsSquash")));
    }

    #[test]
    fn pvc_names_are_kubernetes_names() {
        assert_eq!(pvc("apps", "data.v1-x"), Some(("apps".into(), "data.v1-x".into())));
        for (ns, name) in [
            ("", "data"),
            ("apps", ""),
            ("apps/x", "data"),
            ("apps", "../data"),
            ("apps", "da/ta"),
            ("Apps", "data"),
            ("apps", "-data"),
            ("apps", "data..x"),
            ("a.b", "data"),
            ("apps", "data?x=1"),
        ] {
            assert_eq!(pvc(ns, name), None, "{ns:?} {name:?}");
        }
        assert!(pvc(&"a".repeat(64), "d").is_none());
        assert!(pvc("a", &format!("{0}.{0}.{0}.{0}", "b".repeat(63))).is_none(), "longer than 253");
    }
}
