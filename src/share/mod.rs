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

use std::collections::{BTreeMap, HashMap};

/// Parameter (recorded with the volume) and volume-context key marking a
/// shared volume; its one value is [`SHARE_NFS`].
pub const PARAM_SHARE: &str = "share";
pub const SHARE_NFS: &str = "nfs";

/// Whether a volume's recorded parameters mark it shared.
pub fn is_shared(parameters: &BTreeMap<String, String>) -> bool {
    parameters.get(PARAM_SHARE).is_some_and(|v| v == SHARE_NFS)
}

/// Marks recorded parameters shared.
pub fn mark_shared(parameters: &mut BTreeMap<String, String>) {
    parameters.insert(PARAM_SHARE.to_string(), SHARE_NFS.to_string());
}

/// The volume-context entries of a shared volume: the marker, so every
/// node knows the volume is served over NFS.
pub fn context(parameters: &BTreeMap<String, String>, context: &mut HashMap<String, String>) {
    if is_shared(parameters) {
        context.insert(PARAM_SHARE.to_string(), SHARE_NFS.to_string());
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
        context(&p, &mut c);
        assert!(c.is_empty());
        mark_shared(&mut p);
        assert!(is_shared(&p));
        context(&p, &mut c);
        assert_eq!(c.get(PARAM_SHARE).map(String::as_str), Some(SHARE_NFS));
    }
}
