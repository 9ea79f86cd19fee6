//! Taking this node's NFS announcements off PVCs ([`super::admit`]) when
//! it no longer stages the volume: at unstage, and again later for each one
//! the API server did not take then (an outage), or that a stage left
//! behind when it never finished (kubelet gave up on it: no unstage comes).
//!
//! Why turns per volume: a stage's announcement and a retried renouncement
//! of the same volume must not interleave (a retry would take off the new
//! stage's announcement), while other volumes' stages and unstages must
//! not wait behind them (during an outage each call may take its whole
//! deadline).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use volring_volumes::store::Store;

/// How long one call to the API server may take (and how long a call
/// waits for its volume's turn).
pub(crate) const API_WAIT: Duration = Duration::from_secs(10);

/// How often the leftovers are looked at: pending renouncements, and
/// announcements of stages that never finished.
const RETRY: Duration = Duration::from_secs(5);

/// An announcement with no staged volume behind it is a leftover once no
/// stage of the volume has announced for this long: kubelet retries a
/// failing stage far more often, so a stage still being retried renews it.
const ABANDONED: Duration = Duration::from_secs(600);

/// One lock per volume id, made on first use and dropped when unused.
#[derive(Clone, Default)]
pub(crate) struct Turns(Arc<Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>>);

impl Turns {
    /// Waits (at most [`API_WAIT`]) for volume `id`'s turn.
    pub(crate) async fn take(&self, id: &str) -> Result<tokio::sync::OwnedMutexGuard<()>, String> {
        let lock = {
            let mut all = self.0.lock().unwrap_or_else(|e| e.into_inner());
            all.retain(|_, m| Arc::strong_count(m) > 1);
            all.entry(id.to_string()).or_default().clone()
        };
        tokio::time::timeout(API_WAIT, lock.lock_owned())
            .await
            .map_err(|_| format!("volume {id} is busy: its turn did not come within {API_WAIT:?}"))
    }
}

/// Takes this node's announcements off PVCs of volumes it no longer stages.
#[derive(Clone)]
pub(crate) struct Renouncer {
    pub(crate) client: kube::Client,
    pub(crate) store: Arc<Store>,
    pub(crate) node: String,
    pub(crate) turns: Turns,
    /// When a stage of each volume last announced this node (this
    /// process's stages only: after a restart every record is old).
    pub(crate) announced_at: Arc<Mutex<HashMap<String, Instant>>>,
}

impl Renouncer {
    /// Records that a stage of `id` announced this node now.
    pub(crate) fn announced(&self, id: &str) {
        self.announced_at.lock().unwrap_or_else(|e| e.into_inner()).insert(id.to_string(), Instant::now());
    }

    /// At unstage: takes the announcement for `id` off `pvc`; one the API
    /// server does not take now is kept as pending (in the store, so a
    /// restarted agent retries it too).
    pub(crate) async fn renounce(&self, id: &str, pvc: &(String, String)) {
        match self.turns.take(id).await {
            Ok(_turn) => self.renounce_in_turn(id, pvc).await,
            Err(e) => {
                tracing::warn!(volume = id, error = e, "the NFS announcement stays on the PVC for now");
                self.keep_pending(id, pvc).await;
            }
        }
    }

    /// [`Self::renounce`], with the turn already taken.
    async fn renounce_in_turn(&self, id: &str, pvc: &(String, String)) {
        let (ns, name) = pvc;
        let result = tokio::time::timeout(API_WAIT, super::admit::renounce(&self.client, ns, name, &self.node)).await;
        let error = match result {
            Ok(Ok(())) => {
                self.announced_at.lock().unwrap_or_else(|e| e.into_inner()).remove(id);
                let (store, vid) = (self.store.clone(), id.to_string());
                let gone = off_runtime(move || {
                    super::records::remove_announced(&store, &vid).and_then(|()| super::records::remove_renounce_pending(&store, &vid))
                });
                if let Err(e) = gone.await {
                    tracing::warn!(volume = id, error = e, "cannot forget the NFS announcement");
                }
                return;
            }
            Ok(Err(e)) => e.to_string(),
            Err(_) => format!("no answer from the API server within {API_WAIT:?}"),
        };
        // Said once per volume at warn; its retries say it at debug.
        let first = !matches!(self.pending_now(id).await, Some(true));
        if first {
            tracing::warn!(volume = id, error, "the NFS announcement stays on the PVC for now; retried every {RETRY:?}");
        } else {
            tracing::debug!(volume = id, error, "the NFS announcement still stays on the PVC");
        }
        self.keep_pending(id, pvc).await;
    }

    async fn keep_pending(&self, id: &str, pvc: &(String, String)) {
        let (store, vid, p) = (self.store.clone(), id.to_string(), pvc.clone());
        if let Err(e) = off_runtime(move || super::records::put_renounce_pending(&store, &vid, &p)).await {
            tracing::warn!(volume = id, error = e, "cannot record the NFS announcement to take off");
        }
    }

    /// Whether a renouncement of `id` is pending now (`None`: the store
    /// cannot say).
    async fn pending_now(&self, id: &str) -> Option<bool> {
        let (store, vid) = (self.store.clone(), id.to_string());
        off_runtime(move || super::records::is_renounce_pending(&store, &vid)).await.ok()
    }

    /// Every [`RETRY`], for as long as the runtime runs: the pending
    /// renouncements, and announcements no staged volume stands behind
    /// (the work is records in the store: nothing is lost when the agent
    /// stops mid-way).
    pub(crate) async fn retry(self) {
        let mut every = tokio::time::interval(RETRY);
        every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            every.tick().await;
            let store = self.store.clone();
            let leftovers = match off_runtime(move || super::records::leftovers(&store)).await {
                Ok(l) => l,
                Err(e) => {
                    tracing::warn!(error = e, "cannot read the NFS announcements to take off");
                    continue;
                }
            };
            for super::records::Leftover { volume_id: id, pvc, pending } in leftovers {
                if !pending && !self.abandoned(&id) {
                    continue;
                }
                let Ok(_turn) = self.turns.take(&id).await else { continue };
                // Proven in the turn: a stage since took the pending record
                // away (its announcement is a new one that stays), or staged
                // the volume after all.
                let (store, vid) = (self.store.clone(), id.clone());
                let still = off_runtime(move || super::records::leftover(&store, &vid, pending)).await;
                if matches!(still, Ok(true)) && (pending || self.abandoned(&id)) {
                    if !pending {
                        tracing::info!(volume = %id, "a stage that never finished left this node's NFS announcement: taking it off");
                    }
                    self.renounce_in_turn(&id, &pvc).await;
                }
            }
        }
    }

    /// Whether no stage of `id` in this process announced within
    /// [`ABANDONED`].
    fn abandoned(&self, id: &str) -> bool {
        self.announced_at.lock().unwrap_or_else(|e| e.into_inner()).get(id).is_none_or(|at| at.elapsed() >= ABANDONED)
    }
}

/// Runs a store call on a blocking thread (redb writes fsync): the
/// runtime's threads keep serving the agent meanwhile.
async fn off_runtime<T: Send + 'static>(f: impl FnOnce() -> Result<T, super::Error> + Send + 'static) -> Result<T, String> {
    match tokio::task::spawn_blocking(f).await {
        Ok(r) => r.map_err(|e| e.to_string()),
        Err(e) => Err(e.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One volume's turn held (a call waiting on a hung API server) keeps
    /// its own volume waiting, and no other; the lock goes when unused.
    #[tokio::test]
    async fn turns_are_per_volume() {
        let turns = Turns::default();
        let a = turns.take("pvc-a").await.unwrap();
        let b = tokio::time::timeout(Duration::from_secs(5), turns.take("pvc-b")).await;
        assert!(matches!(b, Ok(Ok(_))), "another volume waited for pvc-a's turn");
        let again = tokio::time::timeout(Duration::from_millis(50), turns.take("pvc-a")).await;
        assert!(again.is_err(), "pvc-a's turn was taken twice");
        drop((a, b));
        assert!(turns.take("pvc-a").await.is_ok());
        let _c = turns.take("pvc-c").await.unwrap();
        assert_eq!(turns.0.lock().unwrap().len(), 1, "unused locks are dropped");
    }
}
