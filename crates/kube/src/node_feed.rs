//! The StorageNode follows the agent's queues: a staged record put or
//! removed (the CSI calls), a verdict changed (the reconciler) and a device
//! relink each raise a [`NodeSignal`]; the follower rebuilds the object once
//! per wake-up, however many signals came meanwhile, and hands the updater
//! only an object that differs, which coalesces it per window like every
//! other object. Nothing runs on a timer: a quiet node costs nothing, and a
//! change reaches the API one flush window after it happened.
//!
//! The pool's size and free space are read with each rebuild. Free space
//! shrinking as volumes fill raises no event, and polling for it is what
//! this design avoids; `/metrics` serves it live, and the object catches up
//! with the next change of anything else.

use std::path::Path;
use std::sync::Arc;

use tokio::sync::Notify;

use super::feed;
use super::objects::{self, Object};
use super::updater::{Submitter, Updater};
use volring_volumes::HealthView;
use volring_volumes::{ClusterNames, StagedVolume, VolumeIdentity};

/// "The StorageNode may have changed." Clones share one flag: any number
/// of signals before the follower wakes make one rebuild.
#[derive(Clone, Default)]
pub struct NodeSignal(Arc<Notify>);

impl NodeSignal {
    pub fn signal(&self) {
        self.0.notify_one();
    }

    async fn wait(&self) {
        self.0.notified().await;
    }
}

/// Builds the node's object from what the agent holds now.
pub(crate) type Builder = Arc<dyn Fn() -> Object + Send + Sync>;

/// The StorageNode's follower.
pub struct NodeFeed {
    signal: NodeSignal,
    build: Builder,
    last: Option<Object>,
}

impl NodeFeed {
    /// The follower of what `build` makes, woken by `signal`, and the
    /// object now (for the updater's start), remembered as handed out.
    pub fn new(signal: NodeSignal, build: Builder) -> (Self, Object) {
        let now = build();
        (Self { signal, build, last: Some(now.clone()) }, now)
    }

    /// Waits for a signal and returns the object once it differs from the
    /// last one handed out. Cancel-safe: the only await is the signal's, and
    /// a dropped wait passes its wake-up on.
    pub(crate) async fn changed(&mut self) -> Object {
        loop {
            self.signal.wait().await;
            let o = (self.build)();
            if self.last.as_ref() != Some(&o) {
                self.last = Some(o.clone());
                return o;
            }
        }
    }

    /// Follows the signals for good, submitting each changed object to
    /// `up` (the future holds its own handle, not `up`). When
    /// the task is dropped (the publisher's stop aborts it), submits the
    /// object as it is then, for the updater's last flush (what is already
    /// stored is not written again). The last look is armed before the
    /// future is first polled, so a stop right after the start still
    /// submits it; it is skipped while unwinding (the builder that
    /// panicked would be called again inside the panic).
    pub fn follow(mut self, up: &Updater) -> impl std::future::Future<Output = ()> + Send {
        let to = up.handle();
        /// The last look, taken as the follower is dropped.
        struct Last(Builder, Submitter);
        impl Drop for Last {
            fn drop(&mut self) {
                if !std::thread::panicking() {
                    self.1.submit((self.0)());
                }
            }
        }
        let last = Last(self.build.clone(), to.clone());
        async move {
            let _last = last;
            loop {
                let o = self.changed().await;
                to.submit(o);
            }
        }
    }
}

/// The StorageNode of `node` from the staged records, the reconciler's
/// verdicts and the pool directory, each volume named with its PV, PVC and
/// pods (from kubelet's paths, and `names`: what the cluster told);
/// `unknown_attachments` is what the healer hook's cross-check found
/// (`None`: it has not run, or there is no cluster).
pub fn storage_node(
    node: &str,
    records: &[StagedVolume],
    view: Option<&HealthView>,
    pool_dir: Option<&Path>,
    unknown_attachments: Option<&[String]>,
    names: &ClusterNames,
) -> Object {
    let volumes = records
        .iter()
        .map(|r| {
            let mut e = feed::volume_entry(r, view.and_then(|v| v.get(&r.volume_id)).as_deref());
            let id = VolumeIdentity::named(r, names);
            feed::name_entry(&mut e, &id);
            e
        })
        .collect();
    let mut o = objects::storage_node(node, pool_dir.and_then(feed::pool), volumes);
    if let (Some(unknown), Some(conditions)) = (unknown_attachments, o.status.get_mut("conditions").and_then(|c| c.as_array_mut())) {
        let c = attachments_condition(unknown);
        conditions.push(serde_json::to_value(c).expect("a condition serialises"));
    }
    o
}

/// Ids named in the condition's message, at most (the count is exact).
const NAMED: usize = 20;

/// `AttachmentsKnown`: False when VolumeAttachments of this driver name
/// this node for volumes the node has no record of.
fn attachments_condition(unknown: &[String]) -> objects::Condition {
    if unknown.is_empty() {
        return objects::Condition {
            type_: "AttachmentsKnown".into(),
            status: "True".into(),
            reason: "AllAttachmentsRecorded".into(),
            message: String::new(),
        };
    }
    let mut names = unknown.iter().take(NAMED).cloned().collect::<Vec<_>>().join(", ");
    if unknown.len() > NAMED {
        names.push_str(", ...");
    }
    objects::Condition {
        type_: "AttachmentsKnown".into(),
        status: "False".into(),
        reason: "UnknownVolumeAttachments".into(),
        message: format!("{} VolumeAttachments name this node for volumes it has no record of: {names}", unknown.len()),
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Mutex;
    use std::time::Duration;

    use super::*;
    use crate::objects::{Key, Kind};
    use crate::{Part, Sink, SinkError, Updater, UpdaterConfig};
    use volring_volumes::{AccessKind, StagePhase, StagedRecords};
    use volring_volumes::{Drift, VolumeHealth};

    /// An in-memory sink: this test is about what feeds the updater, not
    /// about the API (tests/publisher/ covers that against the stand-in).
    #[derive(Default)]
    struct Memory(Mutex<HashMap<Key, Object>>);

    impl Sink for Memory {
        async fn list(&self, kind: Kind, node: &str) -> Result<Vec<Object>, SinkError> {
            let m = self.0.lock().unwrap();
            Ok(m.values().filter(|o| o.key.kind == kind && o.node() == Some(node)).cloned().collect())
        }
        async fn get(&self, key: &Key) -> Result<Option<Object>, SinkError> {
            Ok(self.0.lock().unwrap().get(key).cloned())
        }
        async fn write(&self, obj: &Object, part: Part) -> Result<(), SinkError> {
            let mut m = self.0.lock().unwrap();
            let new = match (part, m.get(&obj.key).cloned()) {
                (Part::Main, Some(s)) => Object { labels: obj.labels.clone(), spec: obj.spec.clone(), ..s },
                (Part::Main, None) => Object { status: serde_json::Value::Null, ..obj.clone() },
                (Part::Status, Some(s)) => Object { status: obj.status.clone(), ..s },
                (Part::Status, None) => return Err(SinkError::Conflict("not stored".into())),
            };
            m.insert(obj.key.clone(), new);
            Ok(())
        }
        async fn delete(&self, key: &Key) -> Result<(), SinkError> {
            self.0.lock().unwrap().remove(key);
            Ok(())
        }
    }

    fn staged(id: &str) -> StagedVolume {
        StagedVolume {
            volume_id: id.into(),
            image: format!("/p/{id}.img").into(),
            staging_path: format!("/k/s/{id}").into(),
            access: AccessKind::Mount { fs_type: "ext4".into(), flags: vec![] },
            read_only: false,
            phase: StagePhase::Staged,
            loop_number: Some(7),
            published: Default::default(),
            attach: Default::default(),
            nbd_index: None,
            remote: None,
        }
    }

    fn volumes_in(sink: &Memory) -> Vec<(String, String)> {
        let m = sink.0.lock().unwrap();
        let Some(o) = m.get(&Key { kind: Kind::StorageNode, name: "n1".into() }) else { return vec![] };
        o.status["volumes"]
            .as_array()
            .map(|v| v.iter().map(|e| (e["id"].as_str().unwrap_or("").into(), e["health"].as_str().unwrap_or("").into())).collect())
            .unwrap_or_default()
    }

    async fn until(what: &str, mut f: impl FnMut() -> bool) {
        for _ in 0..600 {
            if f() {
                return;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        panic!("timed out waiting for {what}");
    }

    #[test]
    fn unknown_attachments_are_a_false_condition_and_no_check_is_none() {
        let cond = |o: &Object| o.status["conditions"].as_array().unwrap().iter().find(|c| c["type"] == "AttachmentsKnown").cloned();
        assert_eq!(cond(&storage_node("n1", &[], None, None, None, &ClusterNames::default())), None);
        let ok = cond(&storage_node("n1", &[], None, None, Some(&[]), &ClusterNames::default())).unwrap();
        assert_eq!(ok["status"], "True");
        let ids: Vec<String> = (0..25).map(|i| format!("pvc-{i}")).collect();
        let bad = cond(&storage_node("n1", &[], None, None, Some(&ids), &ClusterNames::default())).unwrap();
        assert_eq!((bad["status"].as_str(), bad["reason"].as_str()), (Some("False"), Some("UnknownVolumeAttachments")));
        let msg = bad["message"].as_str().unwrap();
        assert!(
            msg.starts_with("25 VolumeAttachments") && msg.contains("pvc-19") && !msg.contains("pvc-20") && msg.ends_with("..."),
            "{msg}"
        );
        // The Ready condition is untouched by it.
        let ready = storage_node("n1", &[], None, None, Some(&ids), &ClusterNames::default()).status["conditions"][0].clone();
        assert_eq!(ready["type"], "Ready");
    }

    /// A publisher stopped right after it started drops the follower
    /// before its first poll: the last look is still submitted (it was
    /// armed inside the async body, so such a stop lost it).
    #[tokio::test]
    async fn a_follower_dropped_before_its_first_poll_still_submits_its_last_look() {
        let builds = Arc::new(AtomicUsize::new(0));
        let b = builds.clone();
        let (feed, now) = NodeFeed::new(
            NodeSignal::default(),
            Arc::new(move || {
                b.fetch_add(1, Ordering::SeqCst);
                storage_node("n1", &[], None, None, None, &ClusterNames::default())
            }),
        );
        let sink = Arc::new(Memory::default());
        let up = Updater::start(sink, UpdaterConfig::new("n1"), vec![now]);
        let before = builds.load(Ordering::SeqCst);
        drop(feed.follow(&up));
        assert_eq!(builds.load(Ordering::SeqCst), before + 1, "no last look was taken");
        up.shutdown(Duration::from_secs(5)).await;
    }

    /// A record staged and a verdict changed each reach the StorageNode in
    /// one flush (one status write), and with nothing changing the object
    /// is never rebuilt: there is no timer behind it.
    #[tokio::test]
    async fn a_staged_volume_reaches_the_storage_node_in_one_flush_and_nothing_polls() {
        let dir = tempfile::tempdir().unwrap();
        let records = Arc::new(StagedRecords::open(dir.path()).unwrap());
        let view = Arc::new(HealthView::default());
        let signal = NodeSignal::default();
        let s = signal.clone();
        records.on_change(move |_| s.signal());
        let s = signal.clone();
        view.on_change(move || s.signal());
        let builds = Arc::new(AtomicUsize::new(0));
        let (r, v, b) = (records.clone(), view.clone(), builds.clone());
        let (feed, now) = NodeFeed::new(
            signal,
            Arc::new(move || {
                b.fetch_add(1, Ordering::SeqCst);
                storage_node("n1", &r.all(), Some(&*v), None, None, &ClusterNames::default())
            }),
        );
        let sink = Arc::new(Memory::default());
        let mut config = UpdaterConfig::new("n1");
        config.window = Duration::from_millis(300);
        let stats = Arc::new(crate::Stats::default());
        config.stats = Some(stats.clone());
        let up = Updater::start(sink.clone(), config, vec![now]);
        let follower = tokio::spawn(feed.follow(&up));
        until("the initial StorageNode", || stats.writes_status.load(Ordering::SeqCst) == 1).await;

        // Quiet: longer than the 2 s timer this replaced, no rebuild at all.
        let quiet = builds.load(Ordering::SeqCst);
        tokio::time::sleep(Duration::from_secs(3)).await;
        assert_eq!(builds.load(Ordering::SeqCst), quiet, "the StorageNode was rebuilt with nothing changed");

        let flushes = stats.flushes.load(Ordering::SeqCst);
        records.put(&staged("v1")).unwrap();
        until("v1 in the StorageNode", || volumes_in(&sink) == [("v1".to_string(), "Unknown".to_string())]).await;
        assert_eq!(stats.flushes.load(Ordering::SeqCst), flushes + 1, "one flush window");
        assert_eq!(stats.writes_status.load(Ordering::SeqCst), 2);

        view.set_many(vec![("v1".into(), VolumeHealth { drift: vec![Drift::StagingMissing], ..Default::default() })]);
        until("v1 drifting", || volumes_in(&sink) == [("v1".to_string(), "Drifting".to_string())]).await;
        records.remove("v1").unwrap();
        until("v1 gone", || volumes_in(&sink).is_empty()).await;
        assert_eq!(stats.writes_main.load(Ordering::SeqCst), 1, "the spec never changed");
        follower.abort();
        let s = up.shutdown(Duration::from_secs(5)).await;
        assert_eq!(s.abandoned, 0);
    }
}
