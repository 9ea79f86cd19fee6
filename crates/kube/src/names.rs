//! The cluster's names for this node's volumes: a PV's PVC, a pod UID's
//! namespace and name, a CSI volume id's PV. Looked up through the API
//! server only for what the agent's cache lacks (a PV's claim and a pod's
//! name never change under the same PV name and UID), and never needed for
//! the node to work: a failed lookup leaves the labels empty and is tried
//! again later.
//!
//! Three requests at most per lookup, each read with a bound:
//! - `GET /api/v1/persistentvolumes/<name>` for a PV kubelet's paths named;
//! - `LIST /api/v1/persistentvolumes` (paginated) only when some volume's
//!   PV is not in its paths, to find it by `spec.csi.volumeHandle`;
//! - `LIST /api/v1/pods?fieldSelector=spec.nodeName=<node>` (paginated)
//!   for the pods of this node.
//!
//! The agent runs [`follow`], which asks whenever the node's volumes change
//! and, with a growing pause, while something stays unnamed.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;

use arc_swap::ArcSwap;
use serde_json::Value;
use tokio::sync::Notify;
use volring_volumes::{ClaimRef, ClusterNames, PodRef, VolumeIdentity};

use super::kube_sink::{query_escape, KubeSink, PAGE};
use super::updater::SinkError;

/// PVs fetched by name in one lookup; the rest wait for the next.
const MAX_PV_GETS: usize = 64;
/// Pages of a LIST read in one lookup (500 objects each).
const MAX_PAGES: usize = 40;
/// One lookup (its three requests) may take this long.
const LOOKUP_WAIT: Duration = Duration::from_secs(10);
/// What is still unnamed is asked again after this, doubling up to the
/// most (also when the API server answered but did not know it).
const RETRY_FIRST: Duration = Duration::from_secs(2);
const RETRY_MOST: Duration = Duration::from_secs(300);
/// The lookup logs as the agent it runs in (one of its components).
const LOG_TARGET: &str = "volring::agent";

#[derive(Debug, thiserror::Error)]
pub(crate) enum Error {
    #[error("looking up {what}: {source}")]
    Api {
        what: &'static str,
        #[source]
        source: SinkError,
    },
}

/// What the cache lacks for `ids`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct Wanted {
    /// PV names whose claim is not cached.
    pub(crate) pvs: BTreeSet<String>,
    /// Volume ids with no PV name from the paths nor the cache.
    pub(crate) handles: BTreeSet<String>,
    /// Pod UIDs not cached.
    pub(crate) pods: BTreeSet<String>,
}

impl Wanted {
    pub(crate) fn is_empty(&self) -> bool {
        self.pvs.is_empty() && self.handles.is_empty() && self.pods.is_empty()
    }
}

/// What `cache` does not say about `ids` (records named from the paths only).
pub(crate) fn wanted(ids: &[VolumeIdentity], cache: &ClusterNames) -> Wanted {
    let mut w = Wanted::default();
    for i in ids {
        match i.persistent_volume.as_ref().or_else(|| cache.volume_pv.get(&i.volume_id)) {
            Some(pv) if !cache.claims.contains_key(pv) => {
                w.pvs.insert(pv.clone());
            }
            Some(_) => {}
            None => {
                w.handles.insert(i.volume_id.clone());
            }
        }
        w.pods.extend(i.pod_uids.iter().filter(|u| !cache.pods.contains_key(*u)).cloned());
    }
    w
}

/// Forgets what no volume of `ids` refers to any more (the cache stays as
/// small as the node's volumes).
pub(crate) fn prune(cache: &mut ClusterNames, ids: &[VolumeIdentity]) {
    let handles: BTreeSet<&str> = ids.iter().map(|i| i.volume_id.as_str()).collect();
    cache.volume_pv.retain(|h, _| handles.contains(h.as_str()));
    let pvs: BTreeSet<&str> = ids
        .iter()
        .filter_map(|i| i.persistent_volume.as_deref().or_else(|| cache.volume_pv.get(&i.volume_id).map(String::as_str)))
        .collect();
    let pvs: BTreeSet<String> = pvs.into_iter().map(str::to_string).collect();
    cache.claims.retain(|pv, _| pvs.contains(pv));
    let uids: BTreeSet<&str> = ids.iter().flat_map(|i| i.pod_uids.iter().map(String::as_str)).collect();
    cache.pods.retain(|u, _| uids.contains(u.as_str()));
}

/// Looks up what `want` asks for; answers only what it found (a PV or pod
/// the server does not have is simply not in the answer).
pub(crate) async fn look_up(sink: &KubeSink, node: &str, want: &Wanted) -> Result<ClusterNames, Error> {
    let mut out = ClusterNames::default();
    for pv in want.pvs.iter().take(MAX_PV_GETS) {
        match sink.get_json(&format!("/api/v1/persistentvolumes/{}", query_escape(pv))).await {
            Ok(v) => add_pv(&mut out, &v, None),
            // 404 (the updater's Conflict): no such PV.
            Err(SinkError::Conflict(_)) => {}
            Err(source) => return Err(Error::Api { what: "a PersistentVolume", source }),
        }
    }
    if !want.handles.is_empty() {
        for v in list(sink, "/api/v1/persistentvolumes", "").await.map_err(|source| Error::Api { what: "PersistentVolumes", source })? {
            add_pv(&mut out, &v, Some(&want.handles));
        }
    }
    if !want.pods.is_empty() {
        let selector = format!("&fieldSelector={}", query_escape(&format!("spec.nodeName={node}")));
        for p in list(sink, "/api/v1/pods", &selector).await.map_err(|source| Error::Api { what: "the node's pods", source })? {
            let m = &p["metadata"];
            if let (Some(uid), Some(ns), Some(name)) = (m["uid"].as_str(), m["namespace"].as_str(), m["name"].as_str()) {
                if want.pods.contains(uid) {
                    out.pods.insert(uid.to_string(), PodRef { uid: uid.into(), namespace: ns.into(), name: name.into() });
                }
            }
        }
    }
    Ok(out)
}

/// Looks up what the cache lacks whenever `wake` is notified (the node's
/// volume records changed), and again (with a growing pause) while
/// something stays unnamed; `records` gives the records named from their
/// paths only. What is found goes into `names`, and `changed` is notified
/// when that changed it. A change that wants nothing the last lookup did
/// not already ask for (another volume's publish, say) waits out the
/// pause: one volume no PV names would otherwise cost a cluster-wide PV
/// LIST on every change of the records. Runs until its task is dropped.
pub async fn follow(
    sink: KubeSink,
    node: String,
    records: impl Fn() -> Vec<VolumeIdentity>,
    names: Arc<ArcSwap<ClusterNames>>,
    changed: Arc<Notify>,
    wake: Arc<Notify>,
) {
    let mut retry = RETRY_FIRST;
    // What the last lookup left unnamed, and when it may be asked again.
    let mut unanswered: Option<(Wanted, tokio::time::Instant)> = None;
    loop {
        let from_paths = records();
        let mut cache = ClusterNames::clone(&names.load());
        prune(&mut cache, &from_paths);
        let want = wanted(&from_paths, &cache);
        if let Some((asked, at)) = &unanswered {
            if !want.is_empty() && !adds_to(&want, asked) && tokio::time::Instant::now() < *at {
                tokio::select! {
                    _ = wake.notified() => {}
                    _ = tokio::time::sleep_until(*at) => {}
                }
                continue;
            }
        }
        let mut left = Wanted::default();
        if !want.is_empty() {
            left = want.clone();
            match tokio::time::timeout(LOOKUP_WAIT, look_up(&sink, &node, &want)).await {
                Ok(Ok(found)) => {
                    cache.volume_pv.extend(found.volume_pv);
                    cache.claims.extend(found.claims);
                    cache.pods.extend(found.pods);
                    left = wanted(&from_paths, &cache);
                }
                Ok(Err(e)) => tracing::warn!(target: LOG_TARGET, error = %e, "volume names not looked up; asking again later"),
                Err(_) => tracing::warn!(target: LOG_TARGET, "volume names: no answer within {LOOKUP_WAIT:?}; asking again later"),
            }
        }
        if cache != **names.load() {
            names.store(Arc::new(cache));
            changed.notify_one();
        }
        if left.is_empty() {
            unanswered = None;
            retry = RETRY_FIRST;
            wake.notified().await;
        } else {
            retry = next_pause(unanswered.as_ref().map(|(asked, _)| asked), &left, retry);
            let at = tokio::time::Instant::now() + retry;
            unanswered = Some((left, at));
            tokio::select! {
                _ = wake.notified() => {}
                _ = tokio::time::sleep_until(at) => {}
            }
        }
    }
}

/// Whether `want` names something `asked` did not.
fn adds_to(want: &Wanted, asked: &Wanted) -> bool {
    !(want.pvs.is_subset(&asked.pvs) && want.handles.is_subset(&asked.handles) && want.pods.is_subset(&asked.pods))
}

/// The pause before asking again for `left`: the first one when it names
/// something new since the last unanswered lookup, else the last one
/// doubled (up to the most).
fn next_pause(asked: Option<&Wanted>, left: &Wanted, last: Duration) -> Duration {
    match asked {
        Some(a) if !adds_to(left, a) => (last * 2).min(RETRY_MOST),
        _ => RETRY_FIRST,
    }
}

/// Adds what a PV says: its claim, and (when `handles` has its volume
/// handle) which volume it is.
fn add_pv(out: &mut ClusterNames, pv: &Value, handles: Option<&BTreeSet<String>>) {
    let Some(name) = pv["metadata"]["name"].as_str() else { return };
    if let Some(want) = handles {
        match pv["spec"]["csi"]["volumeHandle"].as_str() {
            Some(h) if want.contains(h) => {
                out.volume_pv.insert(h.to_string(), name.to_string());
            }
            _ => return,
        }
    }
    let c = &pv["spec"]["claimRef"];
    if let (Some(ns), Some(claim)) = (c["namespace"].as_str(), c["name"].as_str()) {
        out.claims.insert(name.to_string(), ClaimRef { namespace: ns.into(), name: claim.into() });
    }
}

/// The items of a paginated LIST (at most [`MAX_PAGES`] pages).
async fn list(sink: &KubeSink, path: &str, extra: &str) -> Result<Vec<Value>, SinkError> {
    let mut items = Vec::new();
    let mut token: Option<String> = None;
    for _ in 0..MAX_PAGES {
        let cont = token.as_deref().map(|t| format!("&continue={}", query_escape(t))).unwrap_or_default();
        let mut page = sink.get_json(&format!("{path}?limit={PAGE}{extra}{cont}")).await?;
        if let Some(Value::Array(a)) = page.get_mut("items").map(Value::take) {
            items.extend(a);
        }
        token = page["metadata"]["continue"].as_str().filter(|t| !t.is_empty()).map(str::to_string);
        if token.is_none() {
            break;
        }
    }
    Ok(items)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn id(volume: &str, pv: Option<&str>, pods: &[&str]) -> VolumeIdentity {
        VolumeIdentity {
            volume_id: volume.into(),
            device: Some("loop1".into()),
            staging_path: "/s".into(),
            targets: vec![],
            pod_uids: pods.iter().map(|p| p.to_string()).collect(),
            block: false,
            fs_type: None,
            persistent_volume: pv.map(str::to_string),
            claim: None,
            pods: vec![],
        }
    }

    #[test]
    fn only_what_the_cache_lacks_is_wanted() {
        let ids = [id("v1", Some("pv1"), &["u1"]), id("v2", None, &["u2"])];
        let mut cache = ClusterNames::default();
        let w = wanted(&ids, &cache);
        assert_eq!(w.pvs, ["pv1".to_string()].into());
        assert_eq!(w.handles, ["v2".to_string()].into());
        assert_eq!(w.pods, ["u1".to_string(), "u2".to_string()].into());
        cache.claims.insert("pv1".into(), ClaimRef { namespace: "n".into(), name: "c".into() });
        cache.volume_pv.insert("v2".into(), "pv2".into());
        cache.pods.insert("u1".into(), PodRef { uid: "u1".into(), namespace: "n".into(), name: "p".into() });
        let w = wanted(&ids, &cache);
        assert_eq!((w.pvs, w.handles, w.pods), (["pv2".to_string()].into(), BTreeSet::new(), ["u2".to_string()].into()));
    }

    #[test]
    fn the_cache_forgets_what_is_gone() {
        let mut cache = ClusterNames::default();
        cache.claims.insert("pv1".into(), ClaimRef { namespace: "n".into(), name: "c".into() });
        cache.claims.insert("pv-old".into(), ClaimRef { namespace: "n".into(), name: "old".into() });
        cache.pods.insert("u-old".into(), PodRef { uid: "u-old".into(), namespace: "n".into(), name: "p".into() });
        prune(&mut cache, &[id("v1", Some("pv1"), &[])]);
        assert_eq!(cache.claims.keys().collect::<Vec<_>>(), ["pv1"]);
        assert!(cache.pods.is_empty());
    }

    #[test]
    fn a_pv_names_its_claim_and_its_volume() {
        let pv =
            json!({"metadata": {"name": "pv9"}, "spec": {"csi": {"volumeHandle": "h9"}, "claimRef": {"namespace": "ns", "name": "data"}}});
        let mut out = ClusterNames::default();
        add_pv(&mut out, &pv, Some(&["other".to_string()].into()));
        assert!(out.claims.is_empty(), "a PV of another volume is not taken");
        add_pv(&mut out, &pv, Some(&["h9".to_string()].into()));
        assert_eq!(out.volume_pv["h9"], "pv9");
        assert_eq!(out.claims["pv9"], ClaimRef { namespace: "ns".into(), name: "data".into() });
        // Unbound, or not an object at all: nothing.
        let mut out = ClusterNames::default();
        add_pv(&mut out, &json!({"metadata": {"name": "pv1"}, "spec": {}}), None);
        add_pv(&mut out, &json!("garbage"), None);
        assert_eq!(out, ClusterNames::default());
    }

    fn want(handles: &[&str]) -> Wanted {
        Wanted { handles: handles.iter().map(|h| h.to_string()).collect(), ..Default::default() }
    }

    /// A volume that stays unnamed is asked for less and less often; only
    /// something newly wanted starts the pauses again.
    #[test]
    fn the_pause_grows_until_something_new_is_wanted() {
        let first = next_pause(None, &want(&["v1"]), RETRY_FIRST);
        assert_eq!(first, RETRY_FIRST);
        let second = next_pause(Some(&want(&["v1"])), &want(&["v1"]), first);
        assert_eq!(second, RETRY_FIRST * 2);
        assert_eq!(next_pause(Some(&want(&["v1"])), &want(&["v1"]), RETRY_MOST), RETRY_MOST);
        assert_eq!(next_pause(Some(&want(&["v1"])), &want(&["v1", "v2"]), second), RETRY_FIRST);
        assert!(!adds_to(&want(&["v1"]), &want(&["v1", "v2"])));
        assert!(adds_to(&want(&["v3"]), &want(&["v1", "v2"])));
    }
}
