//! The publisher against node-disk-manager's model (one write per change,
//! a full LIST per event message), both measured in the same run against
//! the API stand-in (tests/kube_support) over loopback HTTP:
//!
//! 1. a storm: 10,000 device events spread over 1,000 devices that are
//!    already stored. The publisher submits each event to the updater. The
//!    peer does what node-disk-manager's udev listener does with each event
//!    message (one device each): a LIST of every BlockDevice in the cluster
//!    (`ListBlockDeviceResource(true)`, unpaginated, read in full) to find
//!    the device's object, then one write — one event at a time, as its
//!    single listener goroutine does.
//! 2. an initial sync at start: 5,000 devices stored, nothing changed. The
//!    publisher LISTs (paginated, this node's label) and diffs. The peer
//!    does what node-disk-manager's start scan does: a LIST of this node's
//!    objects to deactivate stale ones, then one event message carrying
//!    every device, so one cluster-wide LIST, then each object written
//!    again (spec, then status: the two writes per object of a restart).
//!
//! For each it prints writes, reads, writes per object, requests, wall time
//! with no rate limit, the wall time those requests take at `--qps`
//! (requests / QPS: a client held to that rate, as the agent's token bucket
//! and client-go's limiter hold theirs, cannot go faster), client CPU and
//! **peak memory**. Each client runs in a child process of its own (this
//! binary again, `--child`), so its peak RSS (VmHWM) is the client's alone:
//! the stand-in stays in the parent and its memory is not counted. RSS at
//! the child's start (runtime and binary, the same for both) is printed too,
//! and the growth above it. Medians of `--runs` runs (by wall time).
//!
//! Then, in this process (the publisher on a runtime of its own, the
//! stand-in on another), how the publisher treats a server in trouble:
//!
//! 3. a throttled server: the stand-in as kube-apiserver with
//!    `--max-requests-inflight=1 --max-mutating-requests-inflight=1` (a
//!    request beyond one in flight is answered 429, `Retry-After: 1`), each
//!    request held 10 ms, 300 stored objects each given a new status, the
//!    publisher allowed 4 requests in flight. Printed: writes per object,
//!    rejected per accepted request, the wall time to write them all (cut
//!    at `--cap` seconds).
//! 4. an outage: the same 300 objects change while every request is
//!    answered 503 for `--outage` seconds (20). Printed: the requests made
//!    during the outage, and the time from the server's return until every
//!    object is written (cut at `--cap`).
//!
//! `cargo bench --bench publisher [-- --runs 3 --qps 20 --only storm,sync,throttled,outage --outage 20 --cap 120]`

#[path = "../tests/kube_support/mod.rs"]
mod kube_support;

use std::io::BufRead;
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::json;
use volring_kube::kube_sink::KubeSink;
use volring_kube::{Key, Kind, Object};
use volring_kube::{Part, Sink, Updater, UpdaterConfig};

/// The labels volring puts on its objects (the bench's own, as a client
/// selecting them would spell them).
const NODE_LABEL: &str = "volring.io/node";
const KIND_LABEL: &str = "volring.io/kind";

/// A BlockDevice's name: `bd-` and the first 16 hex digits of the SHA-256
/// of the node, a zero byte and the stable id.
fn block_device_name(node: &str, stable_id: &str) -> String {
    use sha2::Digest;
    let mut h = sha2::Sha256::new();
    h.update(node.as_bytes());
    h.update([0u8]);
    h.update(stable_id.as_bytes());
    format!("bd-{}", h.finalize().iter().take(8).map(|b| format!("{b:02x}")).collect::<String>())
}

/// A label selector as a query value: unreserved characters as they are,
/// every other byte percent-encoded.
fn query_escape(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'.' | b'_' | b'~' => (b as char).to_string(),
            _ => format!("%{b:02X}"),
        })
        .collect()
}

const DEVICES: usize = 1000;
const EVENTS: usize = 10_000;
const SYNC: usize = 5000;

fn bd(i: usize, gen: usize) -> Object {
    let stable = format!("serial-bench-{i}");
    Object {
        key: Key { kind: Kind::BlockDevice, name: block_device_name("n1", &stable) },
        labels: [(NODE_LABEL.to_string(), "n1".to_string()), (KIND_LABEL.to_string(), "blockdevice".to_string())].into(),
        spec: json!({"nodeName": "n1", "path": format!("/dev/x{i}"), "stableId": stable,
            "capacity": {"storage": 1u64 << 30, "logicalSectorSize": 512, "physicalSectorSize": 4096},
            "details": {"deviceType": "disk", "driveType": "SSD", "removable": false, "readOnly": false},
            "devlinks": [], "partitioned": false}),
        status: json!({"state": "Active", "claimState": "Unclaimed", "mountPoints": [format!("/mnt/{gen}")], "holders": []}),
    }
}

/// The storm's events: which device, and its new generation.
fn storm() -> Vec<(usize, usize)> {
    (0..EVENTS).map(|e| ((e * 7919) % DEVICES, 1 + e / DEVICES)).collect()
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Who {
    StormPublisher,
    StormPeer,
    SyncPublisher,
    SyncPeer,
}

impl Who {
    fn name(self) -> &'static str {
        match self {
            Who::StormPublisher => "storm-publisher",
            Who::StormPeer => "storm-peer",
            Who::SyncPublisher => "sync-publisher",
            Who::SyncPeer => "sync-peer",
        }
    }
    fn parse(s: &str) -> Option<Who> {
        [Who::StormPublisher, Who::StormPeer, Who::SyncPublisher, Who::SyncPeer].into_iter().find(|w| w.name() == s)
    }
}

// ---- the child: one client, measured ----

fn unlimited() -> UpdaterConfig {
    let mut c = UpdaterConfig::new("n1");
    c.qps = 1e9;
    c.burst = u32::MAX;
    c.window = Duration::from_millis(200);
    c
}

/// A LIST as node-disk-manager's client makes it: no limit, the whole
/// body decoded and held while the event is handled.
async fn list_all(client: &kube::Client, selector: Option<&str>) -> serde_json::Value {
    let mut uri = "/apis/volring.io/v1alpha1/blockdevices".to_string();
    if let Some(s) = selector {
        uri.push_str(&format!("?labelSelector={}", query_escape(s)));
    }
    let req = http::Request::get(uri).body(Vec::new()).unwrap();
    client.request::<serde_json::Value>(req).await.expect("list")
}

fn find<'a>(list: &'a serde_json::Value, name: &str) -> Option<&'a serde_json::Value> {
    list["items"].as_array()?.iter().find(|i| i["metadata"]["name"] == name)
}

async fn run_client(who: Who, config: kube::Config) {
    let sink = Arc::new(KubeSink::new(config.clone()).unwrap());
    let client = kube::Client::try_from(config).unwrap();
    match who {
        Who::StormPublisher => {
            let initial: Vec<Object> = (0..DEVICES).map(|i| bd(i, 0)).collect();
            let up = Updater::start(sink, unlimited(), initial);
            for (d, g) in storm() {
                up.submit(bd(d, g));
            }
            up.shutdown(Duration::from_secs(300)).await;
        }
        Who::StormPeer => {
            for (d, g) in storm() {
                let o = bd(d, g);
                let list = list_all(&client, None).await;
                assert!(find(&list, &o.key.name).is_some(), "the device's object is stored");
                sink.write(&o, Part::Status).await.expect("write");
            }
        }
        Who::SyncPublisher => {
            let initial: Vec<Object> = (0..SYNC).map(|i| bd(i, 0)).collect();
            Updater::start(sink, unlimited(), initial).shutdown(Duration::from_secs(300)).await;
        }
        Who::SyncPeer => {
            let stale = list_all(&client, Some(&format!("{NODE_LABEL}=n1"))).await;
            assert_eq!(stale["items"].as_array().map(Vec::len), Some(SYNC));
            drop(stale);
            let all = list_all(&client, None).await;
            for i in 0..SYNC {
                let o = bd(i, 0);
                assert!(find(&all, &o.key.name).is_some(), "the device's object is stored");
                sink.write(&o, Part::Main).await.expect("write");
                sink.write(&o, Part::Status).await.expect("write");
            }
        }
    }
}

fn status_kb(field: &str) -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| s.lines().find(|l| l.starts_with(field)).and_then(|l| l.split_whitespace().nth(1)?.parse().ok()))
        .unwrap_or(0)
}

fn process_cpu() -> Duration {
    let t = rustix::time::clock_gettime(rustix::time::ClockId::ProcessCPUTime);
    Duration::new(t.tv_sec as u64, t.tv_nsec as u32)
}

fn child(who: Who, addr: &str) {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let config = kube::Config::new(format!("http://{addr}").parse().unwrap());
    let rss_start = status_kb("VmRSS:");
    let (w, c) = (Instant::now(), process_cpu());
    rt.block_on(run_client(who, config));
    let (wall, cpu) = (w.elapsed(), process_cpu() - c);
    println!(
        "{}",
        json!({"wall_us": wall.as_micros() as u64, "cpu_us": cpu.as_micros() as u64,
            "rss_start_kb": rss_start, "rss_peak_kb": status_kb("VmHWM:")})
    );
}

// ---- the parent: the stand-in, the runs, the table ----

#[derive(Debug, Clone, Copy, Default)]
struct Run {
    writes: usize,
    reads: usize,
    wall: Duration,
    cpu: Duration,
    rss_start_kb: u64,
    rss_peak_kb: u64,
}

/// Stores `n` devices at generation 0 as another writer did (not measured).
fn seed(server: &kube_support::Server, n: usize) {
    server.api.clear();
    for i in 0..n {
        server.api.seed("blockdevices", kube_support::api_form(&bd(i, 0)));
    }
    server.api.clear_log();
}

fn measure(server: &kube_support::Server, who: Who, objects: usize) -> Run {
    seed(server, objects);
    let exe = std::env::current_exe().expect("this bench's path");
    let out = std::process::Command::new(exe)
        .args(["--child", who.name(), "--addr", &server.addr.to_string()])
        .stderr(std::process::Stdio::inherit())
        .output()
        .expect("run the client");
    assert!(out.status.success(), "{} failed: {:?}", who.name(), out.status);
    let line = out.stdout.lines().map_while(Result::ok).find(|l| l.starts_with('{')).expect("the client's figures");
    let v: serde_json::Value = serde_json::from_str(&line).unwrap();
    let log = server.api.log();
    assert!(log.iter().all(|l| l.status < 400), "{}: the stand-in refused a request", who.name());
    let writes = log.iter().filter(|l| l.method != axum::http::Method::GET).count();
    Run {
        writes,
        reads: log.len() - writes,
        wall: Duration::from_micros(v["wall_us"].as_u64().unwrap()),
        cpu: Duration::from_micros(v["cpu_us"].as_u64().unwrap()),
        rss_start_kb: v["rss_start_kb"].as_u64().unwrap(),
        rss_peak_kb: v["rss_peak_kb"].as_u64().unwrap(),
    }
}

fn median(mut v: Vec<Run>) -> Run {
    v.sort_by_key(|r| r.wall);
    let mid = v[v.len() / 2];
    let mut cpus: Vec<Duration> = v.iter().map(|r| r.cpu).collect();
    cpus.sort();
    let mut peaks: Vec<u64> = v.iter().map(|r| r.rss_peak_kb).collect();
    peaks.sort();
    Run { cpu: cpus[cpus.len() / 2], rss_peak_kb: peaks[peaks.len() / 2], ..mid }
}

fn report(name: &str, objects: usize, qps: f64, ours: Run, peer: Run) {
    let ratio = |a: f64, b: f64| if b > 0.0 { format!("{:.1}x", a / b) } else { "inf".to_string() };
    let mib = |kb: u64| kb as f64 / 1024.0;
    println!("\n{name} ({objects} objects)");
    println!(
        "{:<34} {:>7} {:>7} {:>10} {:>9} {:>10} {:>13} {:>9} {:>10} {:>10}",
        "",
        "writes",
        "reads",
        "writes/obj",
        "requests",
        "wall (ms)",
        format!("at {qps} QPS (s)"),
        "CPU (ms)",
        "peak (MiB)",
        "+start (MiB)"
    );
    for (who, r) in [("publisher (coalescing, diffing)", ours), ("node-disk-manager model", peer)] {
        println!(
            "{:<34} {:>7} {:>7} {:>10.2} {:>9} {:>10.1} {:>13.1} {:>9.1} {:>10.1} {:>10.1}",
            who,
            r.writes,
            r.reads,
            r.writes as f64 / objects as f64,
            r.writes + r.reads,
            r.wall.as_secs_f64() * 1e3,
            (r.writes + r.reads) as f64 / qps,
            r.cpu.as_secs_f64() * 1e3,
            mib(r.rss_peak_kb),
            mib(r.rss_peak_kb.saturating_sub(r.rss_start_kb)),
        );
    }
    println!(
        "peer / publisher: writes {}, requests {}, wall {}, client CPU {}, peak RSS {}, RSS growth {}",
        ratio(peer.writes as f64, ours.writes as f64),
        ratio((peer.writes + peer.reads) as f64, (ours.writes + ours.reads) as f64),
        ratio(peer.wall.as_secs_f64(), ours.wall.as_secs_f64()),
        ratio(peer.cpu.as_secs_f64(), ours.cpu.as_secs_f64()),
        ratio(peer.rss_peak_kb as f64, ours.rss_peak_kb as f64),
        ratio(peer.rss_peak_kb.saturating_sub(peer.rss_start_kb) as f64, ours.rss_peak_kb.saturating_sub(ours.rss_start_kb) as f64),
    );
}

fn arg<T: std::str::FromStr>(args: &[String], name: &str) -> Option<T> {
    args.iter().position(|a| a == name).and_then(|i| args.get(i + 1)).and_then(|r| r.parse().ok())
}

// ---- a server in trouble: throttled, then down ----

const TROUBLE: usize = 300;

/// Stores `TROUBLE` devices at generation 0 and starts a publisher (4 in
/// flight, no rate limit) that knows them, on `rt`.
fn trouble_start(server_rt: &tokio::runtime::Runtime, rt: &tokio::runtime::Runtime) -> (kube_support::Server, Updater) {
    let server = server_rt.block_on(kube_support::Server::start());
    seed(&server, TROUBLE);
    let mut c = unlimited();
    c.concurrency = 4;
    let config = server.config();
    let up = rt.block_on(async {
        let sink = Arc::new(KubeSink::new(config).unwrap());
        Updater::start(sink, c, (0..TROUBLE).map(|i| bd(i, 0)).collect())
    });
    (server, up)
}

fn all_at(server: &kube_support::Server, gen: usize) -> usize {
    (0..TROUBLE)
        .filter(|&i| server.api.object("blockdevices", &bd(i, gen).key.name).is_some_and(|o| o["status"] == bd(i, gen).status))
        .count()
}

/// Waits until every object has generation `gen`'s status, at most `cap`;
/// the time it took, or None.
fn converge(server: &kube_support::Server, gen: usize, cap: Duration) -> Option<Duration> {
    let t = Instant::now();
    while t.elapsed() < cap {
        if all_at(server, gen) == TROUBLE {
            return Some(t.elapsed());
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    None
}

fn secs(d: Option<Duration>, cap: Duration, server: &kube_support::Server, gen: usize) -> String {
    match d {
        Some(d) => format!("{:.2} s", d.as_secs_f64()),
        None => format!("not done in {} s ({} of {TROUBLE} written)", cap.as_secs(), all_at(server, gen)),
    }
}

fn throttled(server_rt: &tokio::runtime::Runtime, cap: Duration) {
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build().unwrap();
    let (server, up) = trouble_start(server_rt, &rt);
    assert!(converge(&server, 0, Duration::from_secs(30)).is_some());
    std::thread::sleep(Duration::from_millis(300));
    server.api.clear_log();
    server.api.set_hold(Duration::from_millis(10));
    server.api.set_max_in_flight(Some(1), Some(1));
    for i in 0..TROUBLE {
        up.submit(bd(i, 1));
    }
    let took = converge(&server, 1, cap);
    let log = server.api.log();
    let accepted = log.iter().filter(|l| l.method != axum::http::Method::GET && l.status < 300).count();
    let rejected = log.iter().filter(|l| l.status == 429).count();
    println!(
        "\nthrottled server (max in flight 1, each request held 10 ms): {TROUBLE} objects, each a new status, 4 requests allowed in flight"
    );
    println!(
        "  writes/object {:.2}, accepted {accepted}, rejected {rejected}, rejected per accepted {:.2}, all written in {}",
        accepted as f64 / TROUBLE as f64,
        rejected as f64 / accepted.max(1) as f64,
        secs(took, cap, &server, 1)
    );
    rt.block_on(up.shutdown(Duration::from_secs(1)));
}

fn outage(server_rt: &tokio::runtime::Runtime, down: Duration, cap: Duration) {
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build().unwrap();
    let (server, up) = trouble_start(server_rt, &rt);
    assert!(converge(&server, 0, Duration::from_secs(30)).is_some());
    std::thread::sleep(Duration::from_millis(300));
    server.api.clear_log();
    server.api.set_outage(true);
    for i in 0..TROUBLE {
        up.submit(bd(i, 1));
    }
    std::thread::sleep(down);
    let during = server.api.log().len();
    server.api.set_outage(false);
    let took = converge(&server, 1, cap);
    let log = server.api.log();
    let accepted = log.iter().filter(|l| l.method != axum::http::Method::GET && l.status < 300).count();
    println!("\noutage: {TROUBLE} objects change while every request is answered 503 for {} s", down.as_secs());
    println!(
        "  requests during the outage {during} ({:.1}/s), then all written {} after the server's return, writes/object {:.2}",
        during as f64 / down.as_secs_f64(),
        secs(took, cap, &server, 1),
        accepted as f64 / TROUBLE as f64
    );
    rt.block_on(up.shutdown(Duration::from_secs(1)));
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if let Some(who) = arg::<String>(&args, "--child") {
        let who = Who::parse(&who).expect("a known client");
        child(who, &arg::<String>(&args, "--addr").expect("--addr"));
        return;
    }
    let runs = arg(&args, "--runs").unwrap_or(3usize).max(1);
    let qps = arg(&args, "--qps").unwrap_or(20.0f64).max(0.001);
    let only = arg::<String>(&args, "--only").unwrap_or_else(|| "storm,sync,throttled,outage".into());
    let only: Vec<&str> = only.split(',').collect();
    let cap = Duration::from_secs(arg(&args, "--cap").unwrap_or(120u64));
    // The stand-in runs on its own runtime and threads, in this process.
    let server_rt = tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build().unwrap();
    let server = server_rt.block_on(kube_support::Server::start());
    let mut results = Vec::new();
    for (key, name, objects, ours, peer) in [
        ("storm", "storm: 10,000 events over 1,000 devices", DEVICES, Who::StormPublisher, Who::StormPeer),
        ("sync", "initial sync at start: 5,000 devices stored, nothing changed", SYNC, Who::SyncPublisher, Who::SyncPeer),
    ] {
        if !only.contains(&key) {
            continue;
        }
        let (mut a, mut b) = (Vec::new(), Vec::new());
        for _ in 0..runs {
            a.push(measure(&server, ours, objects));
            b.push(measure(&server, peer, objects));
        }
        results.push((name, objects, median(a), median(b)));
    }
    if !results.is_empty() {
        println!(
            "publisher vs the node-disk-manager model, medians of {runs} runs, stand-in API over loopback, each client in its own process"
        );
    }
    for (name, objects, a, b) in results {
        report(name, objects, qps, a, b);
    }
    if only.contains(&"throttled") {
        throttled(&server_rt, cap);
    }
    if only.contains(&"outage") {
        outage(&server_rt, Duration::from_secs(arg(&args, "--outage").unwrap_or(20u64)), cap);
    }
}
