//! The CSI node at scale, through the real socket and a real agent:
//!
//! 1. stage + publish throughput: `--publish` volumes (200) created, staged
//!    (attach, mkfs.ext4, mount) and published (bind) by `--clients`
//!    concurrent callers, as kubelet does when a node fills up;
//! 2. NodeGetVolumeStats latency with `--volumes` (1,000) staged volumes
//!    under `--callers` concurrent callers (hdrhistogram, p50/p99/p99.9),
//!    and, measured in the same run, what one read+parse of the mount table
//!    costs at that size: the price per call of a driver that scans the
//!    table instead of asking the watcher's copy.
//!
//! `cargo bench --bench csi_volumes -- [--volumes 1000] [--publish 200] [--clients 4] [--callers 8] [--calls 20000]`
//!
//! `VOLRING_BENCH_AGENT=/path/to/volring` runs that agent binary instead of
//! this build's (say a build of an older commit), so two agents can be
//! measured by the same client, round by round.
//!
//! Runs as root in a private mount namespace; every volume is unpublished,
//! unstaged and deleted at the end, and the agent is stopped by PID.

#[path = "support/loops.rs"]
mod loops;
use loops::detach_loops_under;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use hdrhistogram::Histogram;
use tonic::transport::Channel;
use volring_csi::client::{capability, Clients};
use volring_csi::proto::node_client::NodeClient;
use volring_csi::proto::volume_capability::access_mode::Mode;
use volring_csi::proto::*;

struct Agent {
    child: Child,
    dir: tempfile::TempDir,
}

impl Agent {
    fn kubelet(&self) -> PathBuf {
        self.dir.path().join("kubelet")
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        let _ = rustix::process::kill_process(rustix::process::Pid::from_child(&self.child), rustix::process::Signal::TERM);
        let _ = self.child.wait();
        // Anything a failed run left: unmount below the dir, detach its loops.
        for _ in 0..4 {
            let info = std::fs::read("/proc/thread-self/mountinfo").unwrap_or_default();
            let (t, _) = volring_mounts::MountTable::from_mountinfo(&info);
            for m in t.iter().filter(|m| m.mount_point_path().starts_with(self.dir.path())) {
                let _ = rustix::mount::unmount(m.mount_point_path(), rustix::mount::UnmountFlags::DETACH);
            }
        }
        detach_loops_under(self.dir.path());
    }
}

fn arg(name: &str, default: usize) -> usize {
    let args: Vec<String> = std::env::args().collect();
    args.iter().position(|a| a == name).and_then(|i| args.get(i + 1)).and_then(|v| v.parse().ok()).unwrap_or(default)
}

fn cap() -> VolumeCapability {
    capability(false, "ext4", &[], Mode::SingleNodeWriter)
}

fn main() {
    if std::env::args().any(|a| a == "--list") {
        return; // cargo bench -- --list
    }
    let volumes = arg("--volumes", 1000);
    let publish = arg("--publish", 200).min(volumes);
    let clients = arg("--clients", 4).max(1);
    let callers = arg("--callers", 8).max(1);
    let calls = arg("--calls", 20_000);
    volring_sys::ns::enter_private_mount_namespace().expect("private mount namespace (run as root)");
    let dir = tempfile::Builder::new().prefix("volring-bench-csi-").tempdir().expect("dir");
    let socket = dir.path().join("csi.sock");
    let agent_bin = std::env::var_os("VOLRING_BENCH_AGENT").map_or_else(|| PathBuf::from(env!("CARGO_BIN_EXE_volring")), PathBuf::from);
    let child = Command::new(&agent_bin)
        .args(["node", "--metrics-addr", "off", "--node-id", "bench", "--stats-interval", "10", "--csi-endpoint"])
        .arg(format!("unix://{}", socket.display()))
        .arg("--kubelet-root")
        .arg(dir.path().join("kubelet"))
        .arg("--state-dir")
        .arg(dir.path().join("state"))
        .env("RUST_LOG", "warn")
        .stdin(Stdio::null())
        .spawn()
        .expect("start volring node");
    let agent = Agent { child, dir };
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().expect("runtime");
    rt.block_on(run(&agent, &socket, volumes, publish, clients, callers, calls));
}

async fn connect(socket: &Path) -> Clients {
    for _ in 0..400 {
        if let Ok(mut c) = Clients::connect(socket.to_path_buf()).await {
            if c.identity.probe(ProbeRequest {}).await.is_ok_and(|r| r.into_inner().ready == Some(true)) {
                return c;
            }
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    panic!("agent not ready on {}", socket.display());
}

async fn run(agent: &Agent, socket: &Path, volumes: usize, publish: usize, clients: usize, callers: usize, calls: usize) {
    let c = connect(socket).await;
    let k = agent.kubelet();
    let ids: Arc<Vec<String>> = Arc::new((0..volumes).map(|i| format!("pvc-{i:05}")).collect());
    let staging = |id: &str| k.join("plugins/volring/staging").join(id).to_string_lossy().into_owned();
    let target = |id: &str| k.join("pods/bench/volumes").join(id).to_string_lossy().into_owned();

    // Create them all (sparse, cheap) first: the throughput figure is the
    // node's work.
    for id in ids.iter() {
        let mut ctl = c.controller.clone();
        ctl.create_volume(CreateVolumeRequest {
            name: id.clone(),
            capacity_range: Some(CapacityRange { required_bytes: 16 << 20, limit_bytes: 0 }),
            volume_capabilities: vec![cap()],
            ..Default::default()
        })
        .await
        .expect("create");
    }

    let t = Instant::now();
    fan_out(&c.node, &ids[..publish], clients, |mut n, id| {
        let (s, p) = (staging(&id), target(&id));
        async move {
            stage(&mut n, &id, &s).await;
            n.node_publish_volume(NodePublishVolumeRequest {
                volume_id: id.clone(),
                staging_target_path: s,
                target_path: p,
                volume_capability: Some(cap()),
                ..Default::default()
            })
            .await
            .expect("publish");
        }
    })
    .await;
    let took = t.elapsed();
    println!(
        "stage+publish: {publish} volumes, {clients} concurrent callers: {:.2} s, {:.1} volumes/s ({:.1} ms each)",
        took.as_secs_f64(),
        publish as f64 / took.as_secs_f64(),
        took.as_secs_f64() * 1000.0 / publish as f64
    );

    fan_out(&c.node, &ids[publish..], clients, |mut n, id| {
        let s = staging(&id);
        async move { stage(&mut n, &id, &s).await }
    })
    .await;

    // Stats: random volumes, at their target when published, else staging.
    let paths: Arc<Vec<(String, String)>> =
        Arc::new(ids.iter().enumerate().map(|(i, id)| (id.clone(), if i < publish { target(id) } else { staging(id) })).collect());
    let scan = mountinfo_scan_cost();
    let mut single_p50 = 0;
    for callers in [1, callers] {
        let (h, took) = stats_phase(&c.node, &paths, callers, if callers == 1 { calls / 4 } else { calls }).await;
        println!(
            "NodeGetVolumeStats, {volumes} staged volumes, {callers} concurrent caller(s), {} calls: p50 {} µs, p99 {} µs, p99.9 {} µs, max {} µs, {:.0} calls/s",
            h.len(),
            h.value_at_quantile(0.5),
            h.value_at_quantile(0.99),
            h.value_at_quantile(0.999),
            h.max(),
            h.len() as f64 / took.as_secs_f64()
        );
        if callers == 1 {
            single_p50 = h.value_at_quantile(0.5).max(1);
        }
    }
    println!(
        "one read+parse of the mount table ({} mounts), median of 15: {} µs = {:.1}x the whole single-caller stats call (p50), which a driver that scans the table pays on top, per call",
        scan.1,
        scan.0.as_micros(),
        scan.0.as_micros() as f64 / single_p50 as f64
    );

    // Tear down, concurrently.
    fan_out(&c.node, &ids[..], clients, |mut n, id| {
        let (s, p) = (staging(&id), target(&id));
        async move {
            n.node_unpublish_volume(NodeUnpublishVolumeRequest { volume_id: id.clone(), target_path: p }).await.expect("unpublish");
            n.node_unstage_volume(NodeUnstageVolumeRequest { volume_id: id.clone(), staging_target_path: s }).await.expect("unstage");
        }
    })
    .await;
    for id in ids.iter() {
        let mut ctl = c.controller.clone();
        ctl.delete_volume(DeleteVolumeRequest { volume_id: id.clone(), ..Default::default() }).await.expect("delete");
    }
}

/// `callers` tasks calling NodeGetVolumeStats on random volumes.
async fn stats_phase(
    node: &NodeClient<Channel>,
    paths: &Arc<Vec<(String, String)>>,
    callers: usize,
    calls: usize,
) -> (Histogram<u64>, Duration) {
    let per = calls / callers;
    let t = Instant::now();
    let mut tasks = Vec::new();
    for w in 0..callers {
        let (mut n, paths) = (node.clone(), paths.clone());
        tasks.push(tokio::spawn(async move {
            let mut h = Histogram::<u64>::new_with_bounds(1, 60_000_000, 3).expect("histogram");
            let mut x = 0x9e37_79b9_7f4a_7c15u64 ^ w as u64;
            for _ in 0..per {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                let (id, path) = &paths[(x % paths.len() as u64) as usize];
                let s = Instant::now();
                let r = n
                    .node_get_volume_stats(NodeGetVolumeStatsRequest {
                        volume_id: id.clone(),
                        volume_path: path.clone(),
                        ..Default::default()
                    })
                    .await
                    .expect("stats");
                h.record(s.elapsed().as_micros().max(1) as u64).expect("record");
                assert!(r.into_inner().volume_condition.is_some_and(|c| !c.abnormal));
            }
            h
        }));
    }
    let mut h = Histogram::<u64>::new_with_bounds(1, 60_000_000, 3).expect("histogram");
    for t in tasks {
        h.add(t.await.expect("caller")).expect("merge");
    }
    (h, t.elapsed())
}

async fn stage(n: &mut NodeClient<Channel>, id: &str, staging: &str) {
    n.node_stage_volume(NodeStageVolumeRequest {
        volume_id: id.to_string(),
        staging_target_path: staging.to_string(),
        volume_capability: Some(cap()),
        ..Default::default()
    })
    .await
    .expect("stage");
}

/// Runs `f` for every id with at most `width` in flight.
async fn fan_out<F, Fut>(node: &NodeClient<Channel>, ids: &[String], width: usize, f: F)
where
    F: Fn(NodeClient<Channel>, String) -> Fut,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    let mut set = tokio::task::JoinSet::new();
    for id in ids {
        if set.len() >= width {
            set.join_next().await.expect("task").expect("call");
        }
        set.spawn(f(node.clone(), id.clone()));
    }
    while let Some(r) = set.join_next().await {
        r.expect("call");
    }
}

/// Median time of reading and parsing this namespace's mountinfo, and the
/// number of mounts in it.
fn mountinfo_scan_cost() -> (Duration, usize) {
    let mut times = Vec::new();
    let mut n = 0;
    for _ in 0..15 {
        let t = Instant::now();
        let f = std::fs::File::open("/proc/thread-self/mountinfo").expect("mountinfo");
        let mut buf = Vec::new();
        volring_mounts::read_mountinfo(&f, &mut buf).expect("read");
        let (table, _) = volring_mounts::MountTable::from_mountinfo(&buf);
        n = table.len();
        times.push(t.elapsed());
    }
    times.sort();
    (times[times.len() / 2], n)
}
