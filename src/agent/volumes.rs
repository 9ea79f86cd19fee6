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
    let sink = match KubeSink::connect(&node, None).await {
        Ok(s) => s,
        Err(e) => {
            tracing::warn!(target: TARGET, error = %e, "volumes' PVC and pod names are not looked up");
            return ids;
        }
    };
    let d = driver.clone();
    let records = move || identities(&d.staged(), &ClusterNames::default());
    let task = names::follow(sink, node, records, ids.names.clone(), ids.changed.clone(), lookup_wake);
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
