//! Which nodes a shared volume's NFS export admits, in a cluster: each
//! node that stages the volume makes itself known on the volume's PVC, and
//! the owning node admits exactly those.
//!
//! Why the PVC: it is the one object every node already reads for the
//! volume (its endpoint annotation) and the agent's role may patch. Each
//! node writes only its own annotation,
//! `nfs-client.volring.io/<node>: <address>`, with a merge patch of that
//! one key, so nodes staging at once never conflict; the owner answers
//! with `nfs-admitted.volring.io/<node>: <address>` once its server
//! admits that address, and a node's
//! NodeStage mounts only after it sees its own answer (until then the
//! stage is UNAVAILABLE and kubelet retries), so the first mount is never
//! refused. The unstage removes the node's annotation; the owner then
//! drops the address from the export, the other nodes' stay.
//!
//! The address is the one the owner's server sees the node's connections
//! from: the node's own IP (`--nfs-client-address`; in deploy/ the pod's
//! IP, which under hostNetwork is the node's). A Service's ClusterIP is
//! translated to the owner's address without changing the source.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::PersistentVolumeClaim;
use kube::api::{Api, Patch, PatchParams};

use super::kube::Error;

/// The annotation prefix a consuming node announces itself under.
pub(crate) const CLIENT_PREFIX: &str = "nfs-client.volring.io/";
/// The annotation prefix the owning node answers under.
pub(crate) const ADMITTED_PREFIX: &str = "nfs-admitted.volring.io/";

/// The annotation name part for `node`: the node's name when it fits an
/// annotation name (at most 63 characters, alphanumeric at both ends,
/// `-`, `_`, `.` inside), else `h-` and a hash of it (node names may be
/// 253 characters long).
pub(crate) fn node_key(node: &str) -> String {
    let fits = (1..=63).contains(&node.len())
        && node.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
        && node.as_bytes().first().is_some_and(u8::is_ascii_alphanumeric)
        && node.as_bytes().last().is_some_and(u8::is_ascii_alphanumeric);
    if fits {
        node.to_string()
    } else {
        format!("h-{:016x}", volring_volumes::store::fnv1a(node.as_bytes()))
    }
}

/// The annotations under `prefix`: node key → value.
fn under(pvc: &PersistentVolumeClaim, prefix: &str) -> BTreeMap<String, String> {
    pvc.metadata.annotations.iter().flatten().filter_map(|(k, v)| k.strip_prefix(prefix).map(|n| (n.to_string(), v.clone()))).collect()
}

/// The nodes that announced themselves on `pvc`, with their addresses.
/// Left out, so the owner never writes them into its configuration: a value
/// that is no single IP address, and the unspecified, multicast and IPv4
/// broadcast addresses (none is one node's, and ganesha may read the
/// unspecified one as "any client").
pub(crate) fn announced(pvc: &PersistentVolumeClaim) -> BTreeMap<String, String> {
    under(pvc, CLIENT_PREFIX).into_iter().filter(|(_, a)| a.parse::<std::net::IpAddr>().is_ok_and(one_node)).collect()
}

/// Whether `ip` can name one node. Loopback stays: a node may consume its
/// own share through it (the host tests do), and it admits only the owner.
fn one_node(ip: std::net::IpAddr) -> bool {
    let broadcast = matches!(ip, std::net::IpAddr::V4(v4) if v4.is_broadcast());
    !(ip.is_unspecified() || ip.is_multicast() || broadcast)
}

fn api(client: &kube::Client, ns: &str) -> Api<PersistentVolumeClaim> {
    Api::namespaced(client.clone(), ns)
}

fn api_err(ns: &str, name: &str) -> impl Fn(kube::Error) -> Error {
    let what = format!("PersistentVolumeClaim {ns}/{name}");
    move |e| Error::Api { what: what.clone(), source: e }
}

/// A merge patch of the annotations in `set` (a `None` value removes one).
async fn patch(client: &kube::Client, ns: &str, name: &str, set: BTreeMap<String, Option<String>>) -> Result<(), Error> {
    if set.is_empty() {
        return Ok(());
    }
    let body = serde_json::json!({"metadata": {"annotations": set}});
    api(client, ns).patch(name, &PatchParams::default(), &Patch::Merge(&body)).await.map_err(api_err(ns, name))?;
    Ok(())
}

/// The consuming side, at NodeStage: announces `node` at `address` on the
/// PVC (written only when it is not there yet) and says whether the owner
/// admits it already.
pub(crate) async fn announce(client: &kube::Client, ns: &str, name: &str, node: &str, address: &str) -> Result<bool, Error> {
    let pvc = api(client, ns).get_opt(name).await.map_err(api_err(ns, name))?;
    let pvc = pvc.ok_or_else(|| Error::PvcGone { namespace: ns.into(), name: name.into() })?;
    let key = node_key(node);
    if under(&pvc, CLIENT_PREFIX).get(&key).map(String::as_str) != Some(address) {
        patch(client, ns, name, [(format!("{CLIENT_PREFIX}{key}"), Some(address.to_string()))].into()).await?;
        tracing::info!(pvc = %format!("{ns}/{name}"), node, address, "announced to the shared volume's NFS server");
    }
    Ok(under(&pvc, ADMITTED_PREFIX).get(&key).map(String::as_str) == Some(address))
}

/// The consuming side, at NodeUnstage: takes `node`'s announcement off the
/// PVC (a PVC already gone has none).
pub(crate) async fn renounce(client: &kube::Client, ns: &str, name: &str, node: &str) -> Result<(), Error> {
    let Some(pvc) = api(client, ns).get_opt(name).await.map_err(api_err(ns, name))? else { return Ok(()) };
    let key = node_key(node);
    if under(&pvc, CLIENT_PREFIX).contains_key(&key) {
        patch(client, ns, name, [(format!("{CLIENT_PREFIX}{key}"), None)].into()).await?;
        tracing::info!(pvc = %format!("{ns}/{name}"), node, "no longer a client of the shared volume's NFS server");
    }
    Ok(())
}

/// The owning side, after its server admits `admitted`: the PVC's answers
/// (`nfs-admitted.volring.io/*`) made to say exactly that. True when
/// something was written.
pub(crate) async fn answer(
    client: &kube::Client,
    ns: &str,
    name: &str,
    pvc: &PersistentVolumeClaim,
    admitted: &BTreeMap<String, String>,
) -> Result<bool, Error> {
    let have = under(pvc, ADMITTED_PREFIX);
    let mut set: BTreeMap<String, Option<String>> = BTreeMap::new();
    for (k, a) in admitted {
        if have.get(k) != Some(a) {
            set.insert(format!("{ADMITTED_PREFIX}{k}"), Some(a.clone()));
        }
    }
    for k in have.keys().filter(|k| !admitted.contains_key(*k)) {
        set.insert(format!("{ADMITTED_PREFIX}{k}"), None);
    }
    let wrote = !set.is_empty();
    patch(client, ns, name, set).await?;
    Ok(wrote)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn node_keys_are_annotation_names() {
        assert_eq!(node_key("node-a.example"), "node-a.example");
        for odd in ["", "-a", "a-", "a/b", "A:B", &"n".repeat(64)] {
            let k = node_key(odd);
            assert!(k.starts_with("h-") && k.len() == 18, "{odd:?} → {k}");
        }
        assert_ne!(node_key(&"n".repeat(64)), node_key(&"n".repeat(65)));
    }

    #[test]
    fn only_addresses_are_taken() {
        let mut pvc = PersistentVolumeClaim::default();
        pvc.metadata.annotations = Some(
            [
                ("nfs-client.volring.io/a".to_string(), "10.0.0.1".to_string()),
                ("nfs-client.volring.io/b".to_string(), "10.0.0.0/8".to_string()),
                ("nfs-client.volring.io/c".to_string(), "*".to_string()),
                ("nfs-client.volring.io/d".to_string(), "0.0.0.0".to_string()),
                ("nfs-client.volring.io/e".to_string(), "::".to_string()),
                ("nfs-client.volring.io/f".to_string(), "224.0.0.1".to_string()),
                ("nfs-client.volring.io/g".to_string(), "255.255.255.255".to_string()),
                ("nfs-admitted.volring.io/a".to_string(), "10.0.0.1".to_string()),
                ("other".to_string(), "x".to_string()),
            ]
            .into(),
        );
        assert_eq!(announced(&pvc), [("a".to_string(), "10.0.0.1".to_string())].into());
    }
}
