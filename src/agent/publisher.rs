//! The publisher as agent components: the coalescing updater (to the API
//! server or the node's store) with the StorageNode's follower, and in a
//! cluster the healer hook's cross-check of the VolumeAttachments.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use tokio_util::sync::CancellationToken;

use volring_devices::Inventory;
use volring_kube::node_feed::{self, NodeFeed, NodeSignal};
use volring_kube::queued::{self, Target};
use volring_kube::{embedded_sink::EmbeddedSink, kube_sink::KubeSink, Updater, UpdaterConfig};

use super::component::Components;
use super::{PublishConfig, TARGET};

/// What the event loop feeds: the devices' objects, and the StorageNode's
/// signal. The updater itself is the publisher component's; the loop holds
/// it only while it runs.
pub(super) struct Feeding {
    pub up: Arc<Updater>,
    pub feed: volring_kube::feed::Feed,
    pub node_signal: NodeSignal,
}

/// How long the pending writes may take at a stop (then they are counted
/// as abandoned); the component's own bound is a little longer.
const FLUSH: Duration = Duration::from_secs(10);
const STOP_WAIT: Duration = Duration::from_secs(15);
/// The healer hook is cut at a stop: what it would find is published by
/// nobody once the publisher stopped.
const HOOK_WAIT: Duration = Duration::from_secs(5);

/// What the publisher reads of the rest of the agent.
pub(super) struct Inputs<'a> {
    pub state_dir: &'a Path,
    pub node: &'a str,
    pub driver: Option<Arc<volring_csi::Driver>>,
    pub view: Option<Arc<volring_volumes::HealthView>>,
    pub inventory: &'a Inventory,
    pub stats: Arc<volring_kube::Stats>,
    /// What the cluster told of the volumes' names (the StorageNode lists
    /// each volume's PVC and pods).
    pub names: Option<Arc<arc_swap::ArcSwap<volring_volumes::ClusterNames>>>,
}

/// Starts the updater on the cluster or the node's store, with this node's
/// objects as they are now, and the StorageNode's follower (a task woken by
/// the CSI records, the reconciler's verdicts and device relinks; never by
/// a timer). Its stop writes what is pending, within 10 s.
pub(super) async fn start(p: &PublishConfig, i: Inputs<'_>, parts: &mut Components) -> anyhow::Result<Feeding> {
    let mut uc = UpdaterConfig::new(i.node);
    (uc.qps, uc.burst, uc.window, uc.gone) = (p.qps, p.burst, p.window, p.gone);
    uc.stats = Some(i.stats.clone());
    let node_signal = NodeSignal::default();
    // What the healer hook's cross-check found (cluster only).
    let unknown: Arc<std::sync::Mutex<Option<Vec<String>>>> = Default::default();
    let (node_feed, node_now) = node_feed(&i, &node_signal, unknown.clone());
    let (feed, initial) = volring_kube::feed::Feed::initial(i.inventory, node_now, &mut uc);
    let source = KubeSink::detect();
    let to_cluster = p.kube.unwrap_or(source.is_some());
    let up = if to_cluster {
        // The User-Agent names this node as the agent knows it (--node-id).
        let sink = Arc::new(KubeSink::connect(i.node, None).await.context("--kube")?);
        let from = source.map_or_else(|| "--kube".to_string(), |s| s.to_string());
        tracing::info!(target: TARGET, objects = initial.len(), from, "publishing to the cluster");
        if let Some(d) = i.driver.clone() {
            let hook = volring_kube::attachments::healer_hook(sink.clone(), d, i.node.to_string(), unknown, node_signal.clone());
            cut_at_stop("healer hook", hook, parts);
        }
        Updater::start(sink, uc, initial)
    } else {
        let store = match i.driver.as_ref().map(|d| d.store()) {
            Some(s) => s,
            None => Arc::new(volring_volumes::store::Store::open(&i.state_dir.join(volring_volumes::store::FILE))?),
        };
        tracing::info!(target: TARGET, objects = initial.len(), "no cluster: publishing to the node's store");
        Updater::start(Arc::new(EmbeddedSink::new(store)), uc, initial)
    };
    let up = Arc::new(up);
    record_queued(i.stats, i.state_dir, if to_cluster { Target::Cluster } else { Target::Store }, parts);
    let follower = parts.tasks().spawn(node_feed.follow(&up));
    let last = up.clone();
    parts.started("publisher", STOP_WAIT, move || async move {
        // Dropped, the follower submits the StorageNode as it is now.
        follower.abort();
        let _ = follower.await;
        // The loop is over and has fed it the last inventory: this is the
        // only reference left.
        let up = Arc::into_inner(last).context("the publisher's updater is still in use at stop")?;
        let s = up.shutdown(FLUSH).await;
        tracing::info!(target: TARGET, writes = s.writes_main + s.writes_status, unchanged = s.unchanged, coalesced = s.coalesced,
            abandoned = s.abandoned, "publisher stopped");
        Ok(())
    });
    Ok(Feeding { up, feed, node_signal })
}

/// The StorageNode's feed and the object now: listening (before its first
/// build, so no change falls between) to the CSI records and the
/// reconciler's verdicts.
fn node_feed(i: &Inputs<'_>, signal: &NodeSignal, unknown: Arc<std::sync::Mutex<Option<Vec<String>>>>) -> (NodeFeed, volring_kube::Object) {
    if let Some(d) = &i.driver {
        let s = signal.clone();
        d.on_volume_change(move |_| s.signal());
    }
    if let Some(v) = &i.view {
        let s = signal.clone();
        v.on_change(move || s.signal());
    }
    let (name, driver, view, names) = (i.node.to_string(), i.driver.clone(), i.view.clone(), i.names.clone());
    NodeFeed::new(
        signal.clone(),
        Arc::new(move || {
            let u = unknown.lock().unwrap_or_else(|e| e.into_inner());
            match &driver {
                Some(d) => {
                    let names = names.as_ref().map(|n| n.load_full()).unwrap_or_default();
                    node_feed::storage_node(&name, &d.staged(), view.as_deref(), Some(d.pool_dir()), u.as_deref(), &names)
                }
                None => node_feed::storage_node(&name, &[], None, None, u.as_deref(), &Default::default()),
            }
        }),
    )
}

/// Runs `task` as a component whose stop cuts it short.
fn cut_at_stop(name: &'static str, task: impl std::future::Future<Output = ()> + Send + 'static, parts: &mut Components) {
    let cut = CancellationToken::new();
    let c = cut.clone();
    let handle = parts.tasks().spawn(async move {
        tokio::select! {
            _ = task => {}
            _ = c.cancelled() => {}
        }
    });
    parts.started(name, HOOK_WAIT, move || async move {
        cut.cancel();
        let _ = handle.await;
        Ok(())
    });
}

/// Keeps the count of objects the publisher still holds in the state
/// directory, for `volring get` (`volring_kube::queued`); removed at stop.
fn record_queued(stats: Arc<volring_kube::Stats>, state_dir: &Path, target: Target, parts: &mut Components) {
    let handle = parts.tasks().spawn(queued::follow(stats, state_dir.to_path_buf(), target));
    parts.started("publisher queue record", HOOK_WAIT, move || async move {
        // The task removes the record as it is dropped.
        handle.abort();
        let _ = handle.await;
        Ok(())
    });
}
