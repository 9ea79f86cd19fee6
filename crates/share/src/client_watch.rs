//! The owning node's view of the nodes announced on its exports' PVCs
//! ([`super::admit`]): one watch per exported volume's PVC, and each
//! change admitted to the export and answered on the PVC.
//!
//! Why a watch of each PVC by name (a `metadata.name` field selector, as
//! kubelet follows the secrets its pods use) and not a poll: a poll costs
//! one GET per export per interval whether anything changed or not (at
//! 1 s, a node exporting 50 volumes sends 50 requests a second for
//! nothing), and it admits a new client only at the next interval. A watch
//! costs the API server nothing while nothing changes, and admits at once.
//! Why not one watch of every PVC: each node would receive every PVC
//! change in the cluster, to keep the few it exports.
//!
//! Each watch keeps a connection to the API server open (one per export,
//! HTTP/2 streams of one connection where the server speaks it). It LISTs
//! its PVC (admitting what is announced now), then
//! WATCHes from the list's version until the stream ends (the server's
//! timeout, an outage), then lists again; a failure — of the API server or
//! of the admission — waits with backoff and starts over, so nothing is
//! lost between two streams.

use std::collections::{BTreeMap, HashMap};

use k8s_openapi::api::core::v1::PersistentVolumeClaim;
use kube::api::{Api, ListParams, WatchEvent, WatchParams};
use tokio_stream::StreamExt;

use super::follow::{Admit, Exported, RETRY_MAX, RETRY_MIN};

/// How long the API server keeps one watch stream open (it must be under
/// the client's read timeout, 295 s).
const STREAM_SECONDS: u32 = 290;

/// The watches of the exports' PVCs, one task each; stopped when dropped.
pub(crate) struct ClientWatches {
    client: kube::Client,
    admit: Admit,
    watches: HashMap<String, Watch>,
}

/// One export's watch: its PVC (namespace, name) and the task.
struct Watch {
    pvc: (String, String),
    task: tokio::task::JoinHandle<()>,
}

impl ClientWatches {
    pub(crate) fn new(client: kube::Client, admit: Admit) -> Self {
        Self { client, admit, watches: HashMap::new() }
    }

    /// Watches exactly the PVCs of `exports` (those that name one): a new
    /// export's watch starts, a gone one's stops.
    pub(crate) fn follow(&mut self, exports: &[Exported]) {
        let wanted: HashMap<&str, &(String, String)> =
            exports.iter().filter_map(|e| e.pvc.as_ref().map(|p| (e.volume_id.as_str(), p))).collect();
        self.watches.retain(|id, w| {
            // A task that ended (it only ends by a panic) is started again.
            let keep = wanted.get(id.as_str()).is_some_and(|p| **p == w.pvc) && !w.task.is_finished();
            if !keep {
                w.task.abort();
            }
            keep
        });
        for (id, pvc) in wanted {
            if self.watches.contains_key(id) {
                continue;
            }
            let task = tokio::spawn(watch_clients(self.client.clone(), self.admit.clone(), id.to_string(), pvc.clone()));
            self.watches.insert(id.to_string(), Watch { pvc: pvc.clone(), task });
        }
    }
}

impl Drop for ClientWatches {
    fn drop(&mut self) {
        for w in self.watches.values() {
            w.task.abort();
        }
    }
}

/// Follows volume `id`'s PVC until aborted.
async fn watch_clients(client: kube::Client, admit: Admit, id: String, (ns, name): (String, String)) {
    let api: Api<PersistentVolumeClaim> = Api::namespaced(client.clone(), &ns);
    let fields = format!("metadata.name={name}");
    let mut pause = RETRY_MIN;
    loop {
        match follow_once(&api, &fields, &|pvc| admit_announced(&client, &admit, &id, &ns, &name, pvc)).await {
            // The stream ended (its timeout): list again, after a breath so
            // a server that ends streams at once is not asked in a loop.
            Ok(()) => pause = RETRY_MIN,
            Err(e) => {
                tracing::debug!(volume = %id, error = %e, retry_in_ms = pause.as_millis() as u64, "the watch of the announced NFS clients failed");
                tokio::time::sleep(pause).await;
                pause = (pause * 2).min(RETRY_MAX);
                continue;
            }
        }
        tokio::time::sleep(RETRY_MIN).await;
    }
}

/// Why one LIST-then-WATCH of a PVC ended early.
#[derive(Debug, thiserror::Error)]
enum WatchError {
    #[error("API: {0}")]
    Api(#[from] kube::Error),
    #[error("the watch ended with {0}")]
    Ended(String),
    #[error(transparent)]
    Admit(#[from] super::Error),
    #[error("admitting the announced NFS clients failed: {0}")]
    AdmitFailed(String),
    #[error(transparent)]
    Answer(#[from] super::kube::Error),
}

/// The PVC as listed now, then each change of it until the stream ends;
/// `admit` sees every version.
async fn follow_once<F, Fut>(api: &Api<PersistentVolumeClaim>, fields: &str, admit: &F) -> Result<(), WatchError>
where
    F: Fn(PersistentVolumeClaim) -> Fut,
    Fut: std::future::Future<Output = Result<(), WatchError>>,
{
    let list = api.list(&ListParams::default().fields(fields)).await?;
    let version = list.metadata.resource_version.clone().unwrap_or_default();
    for pvc in list.items {
        admit(pvc).await?;
    }
    let params = WatchParams::default().fields(fields).timeout(STREAM_SECONDS);
    let stream = api.watch(&params, &version).await?;
    tokio::pin!(stream);
    while let Some(event) = stream.next().await {
        match event? {
            WatchEvent::Added(pvc) | WatchEvent::Modified(pvc) => admit(pvc).await?,
            // A deleted PVC takes its annotations (and the garbage
            // collector its Service) with it; the export goes at unstage.
            WatchEvent::Deleted(_) | WatchEvent::Bookmark(_) => {}
            // 410 Expired and the like: list again.
            WatchEvent::Error(e) => return Err(WatchError::Ended(format!("{} {}", e.code, e.message))),
        }
    }
    Ok(())
}

/// Admits the nodes announced on volume `id`'s PVC `pvc` to its export,
/// and answers them on the PVC (only what differs is written, so the
/// watch's own next event changes nothing).
async fn admit_announced(
    client: &kube::Client,
    admit: &Admit,
    id: &str,
    ns: &str,
    name: &str,
    pvc: PersistentVolumeClaim,
) -> Result<(), WatchError> {
    let announced: BTreeMap<String, String> = super::admit::announced(&pvc);
    // On a blocking thread: the share side serialises export changes, and
    // an unexport may hold it for seconds.
    let (admit, vid, list) = (admit.clone(), id.to_string(), announced.clone());
    match tokio::task::spawn_blocking(move || admit(&vid, &list)).await {
        Ok(Ok(_)) => {}
        Ok(Err(e)) => {
            tracing::warn!(volume = id, error = %e, "cannot admit the announced NFS clients");
            return Err(e.into());
        }
        Err(e) => return Err(WatchError::AdmitFailed(e.to_string())),
    }
    super::admit::answer(client, ns, name, &pvc, &announced).await?;
    Ok(())
}
