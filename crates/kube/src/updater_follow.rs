//! The watch tasks that follow this node's objects for the updater.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use tokio::time::Instant;

use super::{lock, Seen, Shared, Sink, SinkError, UpdaterConfig, Watched};
use crate::objects::Kind;

/// The watch tasks; aborted when dropped (the updater stopped).
pub(super) struct Followers(pub(super) Vec<tokio::task::JoinHandle<()>>);

impl Drop for Followers {
    fn drop(&mut self) {
        for t in &self.0 {
            t.abort();
        }
    }
}

/// Follows `kind`'s objects of this node from `version`: hands what the
/// watch sees to the loop, resumes where it was when a stream ends, LISTs
/// again (a resync) when that history is gone and every `resync`. A
/// failing server is asked again after probe_max doubling to four times
/// that.
pub(super) async fn follow<S: Sink>(sink: Arc<S>, shared: Arc<Shared>, config: UpdaterConfig, kind: Kind, version: String) {
    let mut version = Some(version);
    let mut attempts = 0u32;
    let mut resync_at = Instant::now() + config.resync;
    let on = {
        let shared = shared.clone();
        move |s: Seen| {
            lock(&shared.inbox).seen.push(s);
            shared.wake.notify_one();
        }
    };
    loop {
        if shared.stopping.load(Ordering::Relaxed) {
            return;
        }
        let result = match &mut version {
            Some(v) if Instant::now() < resync_at => {
                tokio::select! {
                    r = sink.watch(kind, &config.node, v, &on) => r.map(Some),
                    _ = tokio::time::sleep_until(resync_at) => Ok(None),
                }
            }
            _ => match sink.list_versioned(kind, &config.node).await {
                Ok((objs, v)) => {
                    lock(&shared.inbox).listed.push((kind, objs));
                    shared.wake.notify_one();
                    let Some(v) = v else { return };
                    version = Some(v);
                    resync_at = Instant::now() + config.resync;
                    Ok(None)
                }
                Err(e) => Err(e),
            },
        };
        match result {
            Ok(Some(Watched::Expired)) => {
                tracing::info!(kind = kind.as_str(), "publisher: watch history expired; listing again");
                version = None;
            }
            Ok(_) => attempts = 0,
            Err(e) => {
                let wait = match &e {
                    SinkError::Throttled { retry_after } => *retry_after,
                    SinkError::Overloaded { retry_after: Some(ra), .. } => *ra,
                    _ => config.probe_max.saturating_mul(1 << attempts.min(2)),
                };
                attempts += 1;
                tracing::debug!(kind = kind.as_str(), error = %e, retry_in_ms = wait.as_millis() as u64, "publisher: watch failed");
                tokio::time::sleep(wait).await;
            }
        }
    }
}
