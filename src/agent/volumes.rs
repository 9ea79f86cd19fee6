//! The staged volumes' identity records (`volring_volumes::VolumeIdentity`): who
//! keeps them and what wakes them. The CSI driver's records are the
//! source: each stage, publish, unpublish and unstage puts or removes one,
//! and its change hook wakes the event loop, which rebuilds the records at
//! its next relink and hands them to `/metrics` and the publisher. With a
//! cluster, a task looks up what the paths do not say (the PVC of each PV,
//! the names of the pods) and keeps it in a cache; without one, or while
//! the API server does not answer, those names are empty and nothing else
//! waits for them.

use std::sync::Arc;
use std::time::Duration;

use arc_swap::ArcSwap;
use tokio::sync::Notify;

use volring_kube::kube_sink::KubeSink;
use volring_kube::names;
use volring_volumes::{identities, ClusterNames, VolumeIdentity};

use super::component::Components;
use super::{AgentConfig, TARGET};

/// One lookup (its three requests) may take this long.
const LOOKUP_WAIT: Duration = Duration::from_secs(10);
/// What is still unnamed is asked again after this, doubling up to the
/// most (also when the API server answered but did not know it).
const RETRY_FIRST: Duration = Duration::from_secs(2);
const RETRY_MOST: Duration = Duration::from_secs(300);
const STOP_WAIT: Duration = Duration::from_secs(5);

/// What the event loop and `/metrics` share of the records.
#[derive(Clone, Default)]
pub(super) struct Identities {
    /// The records as of the last relink, sorted by volume id.
    pub current: Arc<ArcSwap<Vec<VolumeIdentity>>>,
    /// The cluster's names, as the lookup last cached them.
    pub names: Arc<ArcSwap<ClusterNames>>,
    /// Woken when a CSI record changed or names arrived: the loop relinks.
    pub changed: Arc<Notify>,
}

impl Identities {
    /// The records of `staged`, named from the cache, made current.
    pub(crate) fn rebuild(&self, staged: &[volring_volumes::StagedVolume]) -> Arc<Vec<VolumeIdentity>> {
        let ids = Arc::new(identities(staged, &self.names.load()));
        self.current.store(ids.clone());
        ids
    }
}

/// Follows `driver`'s records, and in a cluster (the publisher's choice:
/// `--kube`, else a kubeconfig or a pod's service account) starts the
/// name lookup as a component.
pub(super) async fn start(config: &AgentConfig, driver: &Arc<volring_csi::Driver>, parts: &mut Components) -> Identities {
    let ids = Identities::default();
    let lookup_wake = Arc::new(Notify::new());
    let (loop_wake, w) = (ids.changed.clone(), lookup_wake.clone());
    driver.on_volume_change(move |_| {
        loop_wake.notify_one();
        w.notify_one();
    });
    let cluster = config.publish.as_ref().and_then(|p| p.kube).unwrap_or_else(|| KubeSink::detect().is_some());
    if !cluster {
        return ids;
    }
    let node = config.devices.node_name.clone();
    let sink = match KubeSink::infer_for(&node).await {
        Ok(s) => s,
        Err(e) => {
            tracing::warn!(target: TARGET, error = %e, "volumes' PVC and pod names are not looked up");
            return ids;
        }
    };
    let task = follow(sink, node, driver.clone(), ids.clone(), lookup_wake);
    let cut = tokio_util::sync::CancellationToken::new();
    let c = cut.clone();
    let handle = parts.tasks().spawn(async move {
        tokio::select! {
            _ = task => {}
            _ = c.cancelled() => {}
        }
    });
    parts.started("volume name lookup", STOP_WAIT, move || async move {
        cut.cancel();
        let _ = handle.await;
        Ok(())
    });
    ids
}

/// Looks up what the cache lacks whenever the records change, and again
/// (with a growing pause) while something stays unnamed. A change that
/// wants nothing the last lookup did not already ask for (another volume's
/// publish, say) waits out the pause: one volume no PV names would
/// otherwise cost a cluster-wide PV LIST on every change of the records.
async fn follow(sink: KubeSink, node: String, driver: Arc<volring_csi::Driver>, ids: Identities, wake: Arc<Notify>) {
    let mut retry = RETRY_FIRST;
    // What the last lookup left unnamed, and when it may be asked again.
    let mut unanswered: Option<(names::Wanted, tokio::time::Instant)> = None;
    loop {
        let from_paths = identities(&driver.staged(), &ClusterNames::default());
        let mut cache = ClusterNames::clone(&ids.names.load());
        names::prune(&mut cache, &from_paths);
        let want = names::wanted(&from_paths, &cache);
        if let Some((asked, at)) = &unanswered {
            if !want.is_empty() && !adds_to(&want, asked) && tokio::time::Instant::now() < *at {
                tokio::select! {
                    _ = wake.notified() => {}
                    _ = tokio::time::sleep_until(*at) => {}
                }
                continue;
            }
        }
        let mut left = names::Wanted::default();
        if !want.is_empty() {
            left = want.clone();
            match tokio::time::timeout(LOOKUP_WAIT, names::look_up(&sink, &node, &want)).await {
                Ok(Ok(found)) => {
                    cache.volume_pv.extend(found.volume_pv);
                    cache.claims.extend(found.claims);
                    cache.pods.extend(found.pods);
                    left = names::wanted(&from_paths, &cache);
                }
                Ok(Err(e)) => tracing::warn!(target: TARGET, error = %e, "volume names not looked up; asking again later"),
                Err(_) => tracing::warn!(target: TARGET, "volume names: no answer within {LOOKUP_WAIT:?}; asking again later"),
            }
        }
        if cache != **ids.names.load() {
            ids.names.store(Arc::new(cache));
            ids.changed.notify_one();
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
fn adds_to(want: &names::Wanted, asked: &names::Wanted) -> bool {
    !(want.pvs.is_subset(&asked.pvs) && want.handles.is_subset(&asked.handles) && want.pods.is_subset(&asked.pods))
}

/// The pause before asking again for `left`: the first one when it names
/// something new since the last unanswered lookup, else the last one
/// doubled (up to the most).
fn next_pause(asked: Option<&names::Wanted>, left: &names::Wanted, last: Duration) -> Duration {
    match asked {
        Some(a) if !adds_to(left, a) => (last * 2).min(RETRY_MOST),
        _ => RETRY_FIRST,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn want(handles: &[&str]) -> names::Wanted {
        names::Wanted { handles: handles.iter().map(|h| h.to_string()).collect(), ..Default::default() }
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
