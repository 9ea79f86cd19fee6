//! The publisher against the one-write-per-change model (node-disk-manager's),
//! both measured in the same run against the API stand-in
//! (tests/kube_support) over loopback HTTP:
//!
//! 1. a storm: 10,000 device events spread over 1,000 devices that are
//!    already stored; the publisher submits each event to the updater, the
//!    peer applies each event's status as it comes (one PATCH per event);
//! 2. a restart sync: 5,000 devices stored, nothing changed; the publisher
//!    LISTs and diffs, the peer writes each object again (spec, then status:
//!    two writes per object).
//!
//! For each it prints requests (writes and reads), writes per object, wall
//! time with no rate limit, the wall time those writes would take at the
//! agent's default 20 QPS (requests / 20: the token bucket makes it so), and
//! client CPU (the client runs on its own thread; its thread CPU time is
//! read, the stand-in's is not counted), as medians of the runs, with the
//! ratio peer / publisher.
//!
//! `cargo bench --bench publisher [-- --runs 3]`

#[path = "../tests/kube_support/mod.rs"]
mod kube_support;

use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::json;
use volring::publisher::kube_sink::KubeSink;
use volring::publisher::objects::{self, Key, Kind, Object, NODE_LABEL};
use volring::publisher::{Part, Sink, Updater, UpdaterConfig};

fn bd(i: usize, gen: usize) -> Object {
    let stable = format!("serial-bench-{i}");
    Object {
        key: Key { kind: Kind::BlockDevice, name: objects::block_device_name(&stable) },
        labels: [(NODE_LABEL.to_string(), "n1".to_string()), (objects::KIND_LABEL.to_string(), "blockdevice".to_string())].into(),
        spec: json!({"nodeName": "n1", "path": format!("/dev/x{i}"), "stableId": stable,
            "capacity": {"storage": 1u64 << 30, "logicalSectorSize": 512, "physicalSectorSize": 4096},
            "details": {"deviceType": "disk", "driveType": "SSD", "removable": false, "readOnly": false},
            "devlinks": [], "partitioned": false}),
        status: json!({"state": "Active", "claimState": "Unclaimed", "mountPoints": [format!("/mnt/{gen}")], "holders": []}),
    }
}

#[derive(Debug, Clone, Copy, Default)]
struct Run {
    writes: usize,
    reads: usize,
    wall: Duration,
    cpu: Duration,
}

fn thread_cpu() -> Duration {
    let t = rustix::time::clock_gettime(rustix::time::ClockId::ThreadCPUTime);
    Duration::new(t.tv_sec as u64, t.tv_nsec as u32)
}

/// Runs `f` on a fresh current-thread runtime on this thread; wall and
/// this thread's CPU.
fn measured<F: std::future::Future<Output = ()>>(f: F) -> (Duration, Duration) {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let (w, c) = (Instant::now(), thread_cpu());
    rt.block_on(f);
    (w.elapsed(), thread_cpu() - c)
}

fn unlimited() -> UpdaterConfig {
    let mut c = UpdaterConfig::new("n1");
    c.qps = 1e9;
    c.burst = u32::MAX;
    c.window = Duration::from_millis(200);
    c
}

/// Stores `n` devices at generation 0 (not measured).
fn seed(server: &kube_support::Server, n: usize) {
    server.api.clear();
    for i in 0..n {
        server.api.seed("blockdevices", volring::publisher::embedded_sink::api_form(&bd(i, 0)));
    }
    server.api.clear_log();
}

fn counts(server: &kube_support::Server) -> (usize, usize) {
    let log = server.api.log();
    let writes = log.iter().filter(|l| l.method != axum::http::Method::GET).count();
    (writes, log.len() - writes)
}

const DEVICES: usize = 1000;
const EVENTS: usize = 10_000;
const SYNC: usize = 5000;

/// The storm's events: which device, and its new generation.
fn storm() -> Vec<(usize, usize)> {
    (0..EVENTS).map(|e| ((e * 7919) % DEVICES, 1 + e / DEVICES)).collect()
}

fn storm_publisher(server: &kube_support::Server, config: &kube::Config) -> Run {
    seed(server, DEVICES);
    let initial: Vec<Object> = (0..DEVICES).map(|i| bd(i, 0)).collect();
    let (wall, cpu) = measured(async {
        let sink = Arc::new(KubeSink::new(config.clone()).unwrap());
        let up = Updater::start(sink, unlimited(), initial);
        for (d, g) in storm() {
            up.submit(bd(d, g));
        }
        up.shutdown(Duration::from_secs(120)).await;
    });
    let (writes, reads) = counts(server);
    Run { writes, reads, wall, cpu }
}

/// One PATCH per event, 4 at a time (the same concurrency).
fn storm_peer(server: &kube_support::Server, config: &kube::Config) -> Run {
    seed(server, DEVICES);
    let (wall, cpu) = measured(async {
        let sink = Arc::new(KubeSink::new(config.clone()).unwrap());
        let mut events = storm().into_iter();
        let mut jobs = tokio::task::JoinSet::new();
        loop {
            while jobs.len() < 4 {
                let Some((d, g)) = events.next() else { break };
                let sink = sink.clone();
                jobs.spawn(async move { sink.write(&bd(d, g), Part::Status).await.expect("write") });
            }
            if jobs.join_next().await.is_none() {
                break;
            }
        }
    });
    let (writes, reads) = counts(server);
    Run { writes, reads, wall, cpu }
}

fn sync_publisher(server: &kube_support::Server, config: &kube::Config) -> Run {
    seed(server, SYNC);
    let initial: Vec<Object> = (0..SYNC).map(|i| bd(i, 0)).collect();
    let (wall, cpu) = measured(async {
        let sink = Arc::new(KubeSink::new(config.clone()).unwrap());
        Updater::start(sink, unlimited(), initial).shutdown(Duration::from_secs(120)).await;
    });
    let (writes, reads) = counts(server);
    Run { writes, reads, wall, cpu }
}

/// Every object written again, spec then status, 4 at a time.
fn sync_peer(server: &kube_support::Server, config: &kube::Config) -> Run {
    seed(server, SYNC);
    let (wall, cpu) = measured(async {
        let sink = Arc::new(KubeSink::new(config.clone()).unwrap());
        let mut todo = 0..SYNC;
        let mut jobs = tokio::task::JoinSet::new();
        loop {
            while jobs.len() < 4 {
                let Some(i) = todo.next() else { break };
                let sink = sink.clone();
                jobs.spawn(async move {
                    let o = bd(i, 0);
                    sink.write(&o, Part::Main).await.expect("write");
                    sink.write(&o, Part::Status).await.expect("write");
                });
            }
            if jobs.join_next().await.is_none() {
                break;
            }
        }
    });
    let (writes, reads) = counts(server);
    Run { writes, reads, wall, cpu }
}

fn median(mut v: Vec<Run>) -> Run {
    v.sort_by_key(|r| r.wall);
    let mid = v[v.len() / 2];
    let mut cpus: Vec<Duration> = v.iter().map(|r| r.cpu).collect();
    cpus.sort();
    Run { cpu: cpus[cpus.len() / 2], ..mid }
}

fn report(name: &str, objects: usize, ours: Run, peer: Run) {
    let ratio = |a: f64, b: f64| if b > 0.0 { format!("{:.1}x", a / b) } else { "inf".to_string() };
    println!("\n{name} ({objects} objects)");
    println!(
        "{:<28} {:>10} {:>10} {:>12} {:>12} {:>14} {:>12}",
        "", "writes", "reads", "writes/obj", "wall (ms)", "at 20 QPS (s)", "client CPU (ms)"
    );
    for (who, r) in [("publisher (coalescing)", ours), ("one write per change", peer)] {
        println!(
            "{:<28} {:>10} {:>10} {:>12.2} {:>12.1} {:>14.1} {:>12.1}",
            who,
            r.writes,
            r.reads,
            r.writes as f64 / objects as f64,
            r.wall.as_secs_f64() * 1e3,
            (r.writes + r.reads) as f64 / 20.0,
            r.cpu.as_secs_f64() * 1e3
        );
    }
    println!(
        "peer / publisher: writes {}, requests {}, wall {}, client CPU {}",
        ratio(peer.writes as f64, ours.writes as f64),
        ratio((peer.writes + peer.reads) as f64, (ours.writes + ours.reads) as f64),
        ratio(peer.wall.as_secs_f64(), ours.wall.as_secs_f64()),
        ratio(peer.cpu.as_secs_f64(), ours.cpu.as_secs_f64())
    );
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let runs = args.iter().position(|a| a == "--runs").and_then(|i| args.get(i + 1)).and_then(|r| r.parse().ok()).unwrap_or(3usize);
    // The stand-in runs on its own runtime and threads.
    let server_rt = tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build().unwrap();
    let server = server_rt.block_on(kube_support::Server::start());
    let config = server.config();
    let mut results = Vec::new();
    for (name, objects, ours, peer) in [
        ("storm: 10,000 events over 1,000 devices", DEVICES, storm_publisher as fn(&_, &_) -> Run, storm_peer as fn(&_, &_) -> Run),
        ("restart sync, nothing changed", SYNC, sync_publisher, sync_peer),
    ] {
        let (mut a, mut b) = (Vec::new(), Vec::new());
        for _ in 0..runs {
            a.push(ours(&server, &config));
            b.push(peer(&server, &config));
        }
        results.push((name, objects, median(a), median(b)));
    }
    println!("publisher vs one write per change, medians of {runs} runs, stand-in API over loopback");
    for (name, objects, a, b) in results {
        report(name, objects, a, b);
    }
}
