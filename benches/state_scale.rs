//! The node's state of world at scale: 1,000 and 10,000 recorded volumes.
//!
//! For each size it prints: the time to open the store and load every
//! record (agent start, first half), the reconciler's first pass over every
//! volume (agent start, second half: each volume observed from the mount
//! table and its loop device's sysfs record, assessed, and — drifting —
//! checked against a proof that agrees), the cost of
//! one mount event (one volume's path) — which must not grow with the
//! number of volumes —, the latency of one intent's put (the durable
//! commit with its serialising and change hooks; p50/p99), and the
//! resident memory the records and the reconciler add.
//!
//! The volumes are records only (their loop devices do not exist, so each
//! is assessed as detached); the reconciler runs with repairs off, so what
//! is measured is the bookkeeping, not mkfs or mount(2).
//!
//! `cargo bench --bench state_scale [-- --sizes 1000,10000]`

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

use volring_mounts::MountTable;
use volring_volumes::attach;
use volring_volumes::{AccessKind, StagePhase, StagedRecords, StagedVolume};
use volring_volumes::{Acted, ReconcileConfig, Reconciler, Volumes};
use volring_volumes::{Action, AtPath, Proof, VolumeActual};

struct Records(Arc<StagedRecords>);

impl Volumes for Records {
    fn record(&self, id: &str) -> Option<StagedVolume> {
        self.0.get(id)
    }
    fn ids(&self) -> Vec<String> {
        self.0.ids()
    }
    fn act(&self, _: &str, _: Action) -> Acted {
        Acted::Intact
    }
    fn orphans(&self, _: bool) -> Vec<String> {
        Vec::new()
    }
    /// What the kernel shows for these records: no device and no mount at
    /// any of their paths, as the (empty) table says; so every drift is
    /// confirmed and the proof costs one device lookup and the comparison.
    fn prove(&self, rec: &StagedVolume) -> Proof {
        let targets = rec.published.keys().map(|t| (t.clone(), AtPath::Missing)).collect();
        Proof::Seen { actual: VolumeActual { device: attach::of_record(rec), staging: AtPath::Missing, targets }, covered: None }
    }
}

fn record(i: usize) -> StagedVolume {
    let id = format!("pvc-{i:08}");
    StagedVolume {
        image: PathBuf::from(format!("/var/lib/volring/pool/{id}.img")),
        staging_path: PathBuf::from(format!("/var/lib/kubelet/plugins/kubernetes.io/csi/volring.csi.io/{id}/globalmount")),
        access: AccessKind::Mount { fs_type: "ext4".into(), flags: vec!["noatime".into()] },
        read_only: false,
        phase: StagePhase::Staged,
        // Numbers no loop device has here: one failed sysfs read each.
        loop_number: Some(1_000_000 + i as u32),
        attach: Default::default(),
        nbd_index: None,
        published: BTreeMap::from([(PathBuf::from(format!("/var/lib/kubelet/pods/p{i}/volumes/kubernetes.io~csi/{id}/mount")), false)]),
        remote: None,
        volume_id: id,
    }
}

fn rss_kib() -> u64 {
    let s = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    s.lines().find_map(|l| l.strip_prefix("VmRSS:")).and_then(|v| v.trim().trim_end_matches(" kB").trim().parse().ok()).unwrap_or(0)
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let sizes: Vec<usize> = args
        .iter()
        .position(|a| a == "--sizes")
        .and_then(|i| args.get(i + 1))
        .map(|s| s.split(',').filter_map(|n| n.parse().ok()).collect())
        .unwrap_or_else(|| vec![1_000, 10_000]);
    println!(
        "{:>7} {:>10} {:>12} {:>14} {:>14} {:>12} {:>12} {:>10}",
        "volumes", "load ms", "1st pass ms", "event µs p50", "event µs p99", "put p50", "put p99", "RSS MiB"
    );
    for n in sizes {
        let dir = tempfile::tempdir_in(std::env::var_os("CARGO_TARGET_TMPDIR").map(PathBuf::from).unwrap_or_else(std::env::temp_dir))
            .expect("tempdir");
        // Write the records in batches of one transaction each (a real node
        // wrote them one by one over its life; that is not what is timed).
        {
            let recs = StagedRecords::open(dir.path()).expect("store");
            let store = recs.store().clone();
            let all: Vec<(String, Vec<u8>)> =
                (0..n).map(record).map(|r| (r.volume_id.clone(), serde_json::to_vec(&r).expect("json"))).collect();
            for chunk in all.chunks(1000) {
                let changes: Vec<_> = chunk.iter().map(|(id, b)| volring_volumes::store::Change::PutVolume(id, b)).collect();
                store.apply(&changes).expect("write");
            }
        }
        let rss0 = rss_kib();
        let t = Instant::now();
        let recs = Arc::new(StagedRecords::open(dir.path()).expect("store"));
        let load = t.elapsed();
        assert_eq!(recs.ids().len(), n);
        let (info, _) = MountTable::from_mountinfo(&std::fs::read("/proc/self/mountinfo").unwrap_or_default());
        let table = Arc::new(RwLock::new(info));
        let t = Instant::now();
        let config = ReconcileConfig { resync: Duration::from_secs(3600), repair: false, remove_orphans: false };
        let r = Reconciler::start(config, Arc::new(Records(recs.clone())), table, recs.store().clone()).expect("reconciler");
        let first = t.elapsed();
        let rss = rss_kib().saturating_sub(rss0);
        // One mount event at a time, each naming one volume's staging path.
        let notify = r.notifier();
        let mut events = hdrhistogram::Histogram::<u64>::new(3).expect("histogram");
        for i in 0..500usize {
            let rec = record((i * 7919) % n);
            let before = r.stats().passes.load(std::sync::atomic::Ordering::Relaxed);
            let t = Instant::now();
            notify.tell(volring_volumes::Changed::Paths(vec![rec.staging_path.clone()]));
            let deadline = t + Duration::from_secs(5);
            while r.stats().passes.load(std::sync::atomic::Ordering::Relaxed) == before && Instant::now() < deadline {
                std::hint::spin_loop();
            }
            events.record(t.elapsed().as_micros() as u64).ok();
        }
        // Intents, one durable commit each, timed around the put.
        let mut commits = hdrhistogram::Histogram::<u64>::new(3).expect("histogram");
        for i in 0..200usize {
            let mut rec = record(i % n);
            rec.phase = if i % 2 == 0 { StagePhase::Mounting } else { StagePhase::Staged };
            let t = Instant::now();
            recs.put(&rec).expect("put");
            commits.record(t.elapsed().as_micros() as u64).ok();
        }
        let (p50, p99) = (commits.value_at_quantile(0.5), commits.value_at_quantile(0.99));
        println!(
            "{:>7} {:>10.1} {:>12.1} {:>14} {:>14} {:>10}µs {:>10}µs {:>10.1}",
            n,
            load.as_secs_f64() * 1e3,
            first.as_secs_f64() * 1e3,
            events.value_at_quantile(0.5),
            events.value_at_quantile(0.99),
            p50,
            p99,
            rss as f64 / 1024.0
        );
        r.stop();
    }
}
