//! The per-volume series (`volring_volume_*`) at scale, through a real
//! agent: `--volumes` (1,000) ext4 volumes created, staged and published
//! at kubelet's pod paths, then, in one run:
//!
//! 1. the agent's CPU per second with nobody scraping (its stat collector
//!    reads every device's counters each second; the per-volume series cost
//!    nothing between scrapes);
//! 2. `/metrics` scraped once a second `--scrapes` (15) times: the median
//!    scrape time, its size and the share of the per-volume lines, and the
//!    agent's CPU per second while scraped;
//! 3. the same two for node_exporter's diskstats collector alone on the
//!    same devices (`prometheus-node-exporter`, loop devices not excluded),
//!    when it is installed.
//!
//! `cargo bench --bench volume_series -- [--volumes 1000] [--scrapes 15] [--idle 10]`
//!
//! Runs as root in a private mount namespace; every volume is unpublished,
//! unstaged and deleted at the end, and both processes are stopped by PID.

#[path = "support/loops.rs"]
mod loops;
use loops::detach_loops_under;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use tonic::transport::Channel;
use volring_csi::client::{capability, Clients};
use volring_csi::proto::node_client::NodeClient;
use volring_csi::proto::volume_capability::access_mode::Mode;
use volring_csi::proto::*;

/// A process this bench started; stopped by PID on drop.
struct Proc(Child);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = rustix::process::kill_process(rustix::process::Pid::from_child(&self.0), rustix::process::Signal::TERM);
        let _ = self.0.wait();
    }
}

/// The scratch directory: on drop, what a failed run left is unmounted and
/// its loop devices detached.
struct Dir(tempfile::TempDir);

impl Drop for Dir {
    fn drop(&mut self) {
        for _ in 0..4 {
            let info = std::fs::read("/proc/thread-self/mountinfo").unwrap_or_default();
            let (t, _) = volring_mounts::MountTable::from_mountinfo(&info);
            for m in t.iter().filter(|m| m.mount_point_path().starts_with(self.0.path())) {
                let _ = rustix::mount::unmount(m.mount_point_path(), rustix::mount::UnmountFlags::DETACH);
            }
        }
        detach_loops_under(self.0.path());
    }
}

fn arg(name: &str, default: usize) -> usize {
    let args: Vec<String> = std::env::args().collect();
    args.iter().position(|a| a == name).and_then(|i| args.get(i + 1)).and_then(|v| v.parse().ok()).unwrap_or(default)
}

fn cap() -> VolumeCapability {
    capability(false, "ext4", &[], Mode::SingleNodeWriter)
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()).expect("a free port").port()
}

/// CPU time (user + system) the process has used so far.
fn cpu(pid: u32) -> Duration {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).expect("stat");
    // Fields after the command's closing parenthesis; utime and stime are
    // the 14th and 15th of the line.
    let rest = &stat[stat.rfind(')').expect("comm") + 2..];
    let f: Vec<u64> = rest.split_whitespace().skip(11).take(2).map(|x| x.parse().expect("ticks")).collect();
    let hz = rustix::param::clock_ticks_per_second();
    Duration::from_secs_f64((f[0] + f[1]) as f64 / hz as f64)
}

/// One GET of `path`; the body.
fn get(port: u16, path: &str) -> Option<String> {
    let mut c = std::net::TcpStream::connect(("127.0.0.1", port)).ok()?;
    c.set_read_timeout(Some(Duration::from_secs(30))).ok()?;
    c.write_all(format!("GET {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n").as_bytes()).ok()?;
    let mut reply = String::new();
    c.take(256 << 20).read_to_string(&mut reply).ok()?;
    reply.split_once("\r\n\r\n").map(|(_, b)| b.to_string())
}

/// What one exporter cost: CPU per second idle and scraped, median
/// scrape time, and the last scrape.
struct Cost {
    idle_cpu: f64,
    scraped_cpu: f64,
    scrape: Duration,
    body: String,
}

/// `idle` seconds untouched, then `scrapes` scrapes a second apart.
fn measure(pid: u32, port: u16, path: &str, idle: usize, scrapes: usize) -> Cost {
    let (c0, t0) = (cpu(pid), Instant::now());
    std::thread::sleep(Duration::from_secs(idle as u64));
    let idle_cpu = (cpu(pid) - c0).as_secs_f64() / t0.elapsed().as_secs_f64();
    let (c1, t1) = (cpu(pid), Instant::now());
    let mut times = Vec::new();
    let mut body = String::new();
    for i in 0..scrapes {
        let due = t1 + Duration::from_secs(i as u64);
        std::thread::sleep(due.saturating_duration_since(Instant::now()));
        let s = Instant::now();
        body = get(port, path).expect("scrape");
        times.push(s.elapsed());
    }
    std::thread::sleep((t1 + Duration::from_secs(scrapes as u64)).saturating_duration_since(Instant::now()));
    let scraped_cpu = (cpu(pid) - c1).as_secs_f64() / t1.elapsed().as_secs_f64();
    times.sort();
    Cost { idle_cpu, scraped_cpu, scrape: times[times.len() / 2], body }
}

fn bytes_of(body: &str, prefix: &str) -> (usize, usize) {
    let lines: Vec<&str> =
        body.lines().filter(|l| l.starts_with(prefix) || l.strip_prefix("# ").is_some_and(|r| r.contains(prefix))).collect();
    (lines.iter().map(|l| l.len() + 1).sum(), lines.iter().filter(|l| !l.starts_with('#')).count())
}

fn main() {
    if std::env::args().any(|a| a == "--list") {
        return; // cargo bench -- --list
    }
    let volumes = arg("--volumes", 1000);
    let scrapes = arg("--scrapes", 15).max(1);
    let idle = arg("--idle", 10).max(1);
    volring_sys::ns::enter_private_mount_namespace().expect("private mount namespace (run as root)");
    let dir = Dir(tempfile::Builder::new().prefix("volring-bench-series-").tempdir().expect("dir"));
    let socket = dir.0.path().join("csi.sock");
    let port = free_port();
    let agent = Proc(
        Command::new(env!("CARGO_BIN_EXE_volring"))
            .args(["node", "--node-id", "bench", "--stats-interval", "1", "--metrics-addr", &format!("127.0.0.1:{port}"), "--csi-endpoint"])
            .arg(format!("unix://{}", socket.display()))
            .arg("--kubelet-root")
            .arg(dir.0.path().join("kubelet"))
            .arg("--state-dir")
            .arg(dir.0.path().join("state"))
            .env("RUST_LOG", "warn")
            .env_remove("KUBECONFIG")
            .stdin(Stdio::null())
            .spawn()
            .expect("start volring node"),
    );
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().expect("runtime");
    let kubelet = dir.0.path().join("kubelet");
    let c = rt.block_on(connect(&socket));
    let ids: Vec<String> = (0..volumes).map(|i| format!("pvc-{i:05}")).collect();
    let t = Instant::now();
    rt.block_on(stage_all(&c, &kubelet, &ids));
    println!("staged and published {volumes} ext4 volumes in {:.1} s", t.elapsed().as_secs_f64());
    // Until every volume has its series (bounded).
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let n = get(port, "/metrics").map_or(0, |b| b.lines().filter(|l| l.starts_with("volring_volume_info{")).count());
        if n == volumes {
            break;
        }
        assert!(Instant::now() < deadline, "{n} of {volumes} volumes on /metrics after 120 s");
        std::thread::sleep(Duration::from_millis(200));
    }

    let v = measure(agent.0.id(), port, "/metrics", idle, scrapes);
    let (vol_bytes, vol_series) = bytes_of(&v.body, "volring_volume_");
    let (dev_bytes, dev_series) = bytes_of(&v.body, "volring_device_");
    println!(
        "volring agent, {volumes} staged volumes: CPU {:.1} ms/s idle, {:.1} ms/s scraped once a second; /metrics median {:.1} ms, {} KiB; per-volume series {} ({} KiB, {:.0}%), per-device {} ({} KiB)",
        v.idle_cpu * 1000.0,
        v.scraped_cpu * 1000.0,
        v.scrape.as_secs_f64() * 1000.0,
        v.body.len() / 1024,
        vol_series,
        vol_bytes / 1024,
        vol_bytes as f64 * 100.0 / v.body.len().max(1) as f64,
        dev_series,
        dev_bytes / 1024
    );
    node_exporter(idle, scrapes);

    rt.block_on(unstage_all(&c, &kubelet, &ids));
    drop(agent);
}

/// node_exporter's diskstats collector alone, on every device (its default
/// leaves loop devices out), measured as the agent was.
fn node_exporter(idle: usize, scrapes: usize) {
    let port = free_port();
    let spawned = Command::new("prometheus-node-exporter")
        .args(["--collector.disable-defaults", "--collector.diskstats", "--collector.diskstats.device-exclude=^$"])
        .arg(format!("--web.listen-address=127.0.0.1:{port}"))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn();
    let Ok(child) = spawned else {
        println!("node_exporter: not installed (apt-get install prometheus-node-exporter); not compared");
        return;
    };
    let ne = Proc(child);
    let deadline = Instant::now() + Duration::from_secs(30);
    while get(port, "/metrics").is_none() {
        assert!(Instant::now() < deadline, "node_exporter did not answer");
        std::thread::sleep(Duration::from_millis(50));
    }
    let n = measure(ne.0.id(), port, "/metrics", idle, scrapes);
    let (disk_bytes, disk_series) = bytes_of(&n.body, "node_disk_");
    println!(
        "node_exporter (diskstats only), same devices: CPU {:.1} ms/s idle, {:.1} ms/s scraped once a second; /metrics median {:.1} ms, {} KiB; disk series {} ({} KiB)",
        n.idle_cpu * 1000.0,
        n.scraped_cpu * 1000.0,
        n.scrape.as_secs_f64() * 1000.0,
        n.body.len() / 1024,
        disk_series,
        disk_bytes / 1024
    );
}

async fn connect(socket: &Path) -> Clients {
    for _ in 0..1200 {
        if let Ok(mut c) = Clients::connect(socket.to_path_buf()).await {
            if c.identity.probe(ProbeRequest {}).await.is_ok_and(|r| r.into_inner().ready == Some(true)) {
                return c;
            }
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    panic!("agent not ready on {}", socket.display());
}

/// Kubelet's paths for volume `id` (its pod's UID made from its number).
fn paths(kubelet: &Path, id: &str) -> (String, String) {
    let n: u32 = id.trim_start_matches("pvc-").parse().unwrap_or(0);
    let uid = format!("00000000-0000-4000-8000-{n:012x}");
    let staging = kubelet.join("plugins/kubernetes.io/csi/pv").join(id).join("globalmount");
    let target: PathBuf = kubelet.join("pods").join(uid).join("volumes/kubernetes.io~csi").join(id).join("mount");
    (staging.display().to_string(), target.display().to_string())
}

async fn stage_all(c: &Clients, kubelet: &Path, ids: &[String]) {
    for id in ids {
        let mut ctl = c.controller.clone();
        let req = CreateVolumeRequest {
            name: id.clone(),
            capacity_range: Some(CapacityRange { required_bytes: 16 << 20, limit_bytes: 0 }),
            volume_capabilities: vec![cap()],
            ..Default::default()
        };
        ctl.create_volume(req).await.expect("create");
    }
    fan_out(&c.node, ids, 4, |mut n, id| {
        let (s, t) = paths(kubelet, &id);
        async move {
            std::fs::create_dir_all(&s).expect("staging dir");
            std::fs::create_dir_all(Path::new(&t).parent().expect("parent")).expect("target parent");
            let stage = NodeStageVolumeRequest {
                volume_id: id.clone(),
                staging_target_path: s.clone(),
                volume_capability: Some(cap()),
                ..Default::default()
            };
            n.node_stage_volume(stage).await.expect("stage");
            let publish = NodePublishVolumeRequest {
                volume_id: id,
                staging_target_path: s,
                target_path: t,
                volume_capability: Some(cap()),
                ..Default::default()
            };
            n.node_publish_volume(publish).await.expect("publish");
        }
    })
    .await;
}

async fn unstage_all(c: &Clients, kubelet: &Path, ids: &[String]) {
    fan_out(&c.node, ids, 4, |mut n, id| {
        let (s, t) = paths(kubelet, &id);
        async move {
            n.node_unpublish_volume(NodeUnpublishVolumeRequest { volume_id: id.clone(), target_path: t }).await.expect("unpublish");
            n.node_unstage_volume(NodeUnstageVolumeRequest { volume_id: id, staging_target_path: s }).await.expect("unstage");
        }
    })
    .await;
    for id in ids {
        let mut ctl = c.controller.clone();
        ctl.delete_volume(DeleteVolumeRequest { volume_id: id.clone(), ..Default::default() }).await.expect("delete");
    }
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
