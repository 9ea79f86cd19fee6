//! One volume, one name (issue 28): two volumes staged and published under
//! kubelet's own path layout — a filesystem volume in one pod, a raw block
//! volume in another — and `dd` loading the first. `/metrics` shows the
//! loaded volume's `volring_volume_*` rising, labelled with its pod's UID
//! (from the publish path) and, with a cluster (the API stand-in of
//! tests/kube_support, seeded with the PVs and pods the provisioner and
//! the scheduler would have made), its PVC and pod names; the other stays
//! flat. The device under the filesystem volume is a Claimed BlockDevice
//! that names the volume, its PVC and its real filesystem (the device was
//! probed before the stage formatted it). Unstaging removes the series and
//! releases the device. Runs on the real kernel in a private mount
//! namespace; everything made is removed on drop.

mod common;
mod kube_support;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::{check, Scratch};
use libtest_mimic::{Failed, Trial};
use serde_json::{json, Value};
use volring_csi::client::{capability, Clients};
use volring_csi::proto::volume_capability::access_mode::Mode;
use volring_csi::proto::*;

const VOLRING: &str = env!("CARGO_BIN_EXE_volring");
const NODE: &str = "vi-node";
const UID_A: &str = "6f1c2a3b-4d5e-4f60-8a7b-9c0d1e2f3a4b";
const UID_B: &str = "0a9b8c7d-6e5f-4a3b-9c2d-1e0f9a8b7c6d";
/// Every wait ends as soon as its condition holds; none takes longer.
const PATIENCE: Duration = Duration::from_secs(60);
const LOAD: u64 = 16 << 20;

/// The agent this test started; killed by PID when dropped.
struct Agent {
    child: Child,
    log: PathBuf,
}

impl Agent {
    fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// SIGTERM, and whether it exited cleanly within the patience.
    fn stop(&mut self) -> bool {
        let pid = rustix::process::Pid::from_child(&self.child);
        let _ = rustix::process::kill_process(pid, rustix::process::Signal::TERM);
        let deadline = Instant::now() + PATIENCE;
        while Instant::now() < deadline {
            if let Ok(Some(s)) = self.child.try_wait() {
                return s.success();
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        false
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        if self.child.try_wait().ok().flatten().is_none() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// A test's site: scratch directory (unmounted and its loop devices
/// detached on drop), the agent's addresses, a runtime for the clients.
struct Site {
    scratch: Scratch,
    rt: tokio::runtime::Runtime,
    port: u16,
}

impl Drop for Site {
    fn drop(&mut self) {
        // Mounts go with the scratch directory; the images' loop devices here.
        common::detach_loops_under(self.scratch.path());
    }
}

impl Site {
    fn new() -> Result<Self, Failed> {
        let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
        let port = std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
        Ok(Self { scratch: Scratch::new(), rt, port })
    }

    fn kubelet(&self) -> PathBuf {
        self.scratch.path().join("kubelet")
    }

    /// Starts the agent (`env` added to a clean environment) and waits
    /// until its CSI socket answers Probe with ready.
    fn agent(&self, env: &[(&str, &std::ffi::OsStr)]) -> Result<(Agent, Clients), Failed> {
        let (dir, sock) = (self.scratch.path(), self.scratch.path().join("csi.sock"));
        let log = dir.join("agent.log");
        let mut cmd = Command::new(VOLRING);
        cmd.args(["node", "--node-id", NODE, "--stats-interval", "0.2", "--publish-window", "0.2"])
            .args(["--metrics-addr", &format!("127.0.0.1:{}", self.port)])
            .arg("--csi-endpoint")
            .arg(format!("unix://{}", sock.display()))
            .arg("--kubelet-root")
            .arg(self.scratch.dir("kubelet"))
            .arg("--state-dir")
            .arg(dir.join("state"))
            .env_clear()
            .env("PATH", "/usr/sbin:/usr/bin:/sbin:/bin")
            .env("HOME", dir)
            .env("RUST_LOG", "volring=info")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log)?);
        for (k, v) in env {
            cmd.env(k, v);
        }
        let mut agent = Agent { child: cmd.spawn()?, log };
        let deadline = Instant::now() + PATIENCE;
        loop {
            if let Some(s) = agent.child.try_wait()? {
                return Err(format!("the agent exited ({s}):\n{}", agent.log()).into());
            }
            if sock.exists() {
                if let Some(c) = self.rt.block_on(probe(&sock)) {
                    return Ok((agent, c));
                }
            }
            check(Instant::now() < deadline, format!("the agent was not ready:\n{}", agent.log()))?;
            std::thread::sleep(Duration::from_millis(25));
        }
    }

    fn metrics(&self) -> Result<String, Failed> {
        use std::io::{Read, Write};
        let mut c = std::net::TcpStream::connect(("127.0.0.1", self.port))?;
        c.set_read_timeout(Some(PATIENCE))?;
        c.write_all(b"GET /metrics HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")?;
        let mut reply = String::new();
        c.take(64 << 20).read_to_string(&mut reply)?;
        Ok(reply.split_once("\r\n\r\n").map(|(_, b)| b.to_string()).unwrap_or_default())
    }

    /// Scrapes until `f` holds on a scrape (bounded); returns that scrape.
    fn scrape_until(&self, what: &str, agent: &Agent, f: impl Fn(&str) -> bool) -> Result<String, Failed> {
        let deadline = Instant::now() + PATIENCE;
        loop {
            let s = self.metrics()?;
            if f(&s) {
                return Ok(s);
            }
            let ours: Vec<&str> = s.lines().filter(|l| l.starts_with("volring_volume_")).collect();
            check(Instant::now() < deadline, format!("{what}; volume series:\n{}\nagent:\n{}", ours.join("\n"), agent.log()))?;
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

async fn probe(socket: &Path) -> Option<Clients> {
    let mut c = Clients::connect(socket.to_path_buf()).await.ok()?;
    let r = c.identity.probe(ProbeRequest {}).await.ok()?;
    (r.into_inner().ready == Some(true)).then_some(c)
}

/// The sample of `family` whose labels contain every one of `labels`.
fn sample(scrape: &str, family: &str, labels: &[&str]) -> Option<f64> {
    scrape.lines().find_map(|l| {
        let rest = l.strip_prefix(family)?.strip_prefix('{')?;
        let (set, value) = rest.rsplit_once("} ")?;
        labels.iter().all(|x| set.contains(x)).then(|| value.trim().parse().ok())?
    })
}

/// The volumes: A a filesystem volume in pod A, B a block volume in pod B,
/// at kubelet's paths. Returns (staging, target) of each.
struct Paths {
    a: (String, String),
    b: (String, String),
}

fn paths(kubelet: &Path) -> Paths {
    let s = |p: &str| kubelet.join(p).display().to_string();
    Paths {
        a: (s("plugins/kubernetes.io/csi/volring.io/0d1e2f/globalmount"), s(&format!("pods/{UID_A}/volumes/kubernetes.io~csi/pv-a/mount"))),
        b: (
            s("plugins/kubernetes.io/csi/volumeDevices/staging/pv-b"),
            s(&format!("plugins/kubernetes.io/csi/volumeDevices/publish/pv-b/{UID_B}")),
        ),
    }
}

/// Creates both volumes, stages and publishes them as kubelet would.
fn stage_and_publish(site: &Site, c: &Clients, p: &Paths) -> Result<(), Failed> {
    let (mut ctl, mut node) = (c.controller.clone(), c.node.clone());
    for (id, block, (staging, target)) in [("vol-a", false, &p.a), ("vol-b", true, &p.b)] {
        let cap = capability(block, "ext4", &[], Mode::SingleNodeWriter);
        std::fs::create_dir_all(staging)?;
        std::fs::create_dir_all(Path::new(target).parent().ok_or("a target has a parent")?)?;
        site.rt.block_on(async {
            ctl.create_volume(CreateVolumeRequest {
                name: id.into(),
                capacity_range: Some(CapacityRange { required_bytes: 64 << 20, limit_bytes: 0 }),
                volume_capabilities: vec![cap.clone()],
                ..Default::default()
            })
            .await?;
            node.node_stage_volume(NodeStageVolumeRequest {
                volume_id: id.into(),
                staging_target_path: staging.clone(),
                volume_capability: Some(cap.clone()),
                ..Default::default()
            })
            .await?;
            node.node_publish_volume(NodePublishVolumeRequest {
                volume_id: id.into(),
                staging_target_path: staging.clone(),
                target_path: target.clone(),
                volume_capability: Some(cap),
                ..Default::default()
            })
            .await?;
            Ok::<_, tonic::Status>(())
        })?;
    }
    Ok(())
}

fn unpublish_and_unstage(site: &Site, c: &Clients, id: &str, (staging, target): &(String, String)) -> Result<(), Failed> {
    let mut node = c.node.clone();
    site.rt.block_on(async {
        node.node_unpublish_volume(NodeUnpublishVolumeRequest { volume_id: id.into(), target_path: target.clone() }).await?;
        node.node_unstage_volume(NodeUnstageVolumeRequest { volume_id: id.into(), staging_target_path: staging.clone() }).await?;
        Ok::<_, tonic::Status>(())
    })?;
    Ok(())
}

/// Writes `LOAD` bytes into volume A with O_DIRECT (through to its device).
fn load(target: &str) -> Result<(), Failed> {
    let out = Command::new("dd")
        .args(["if=/dev/zero", &format!("of={target}/load"), "bs=1M", &format!("count={}", LOAD >> 20), "oflag=direct", "status=none"])
        .output()?;
    check(out.status.success(), format!("dd: {}", String::from_utf8_lossy(&out.stderr)))
}

/// What both variants check: A rises with its labels, B stays flat, the
/// per-volume gauges are there, unstage removes A's series.
fn the_loaded_volume_rises_alone(site: &Site, agent: &Agent, p: &Paths, a_labels: &[&str]) -> Result<(), Failed> {
    let written = "volring_volume_written_bytes_total";
    let before = site.scrape_until("no series of both volumes", agent, |s| {
        sample(s, written, &["volume=\"vol-a\""]).is_some() && sample(s, written, &["volume=\"vol-b\""]).is_some()
    })?;
    let (a0, b0) =
        (sample(&before, written, &["volume=\"vol-a\""]).unwrap_or(0.0), sample(&before, written, &["volume=\"vol-b\""]).unwrap_or(0.0));
    load(&p.a.1)?;
    let mut after = site.scrape_until("volume A's written bytes did not rise by the load", agent, |s| {
        sample(s, written, a_labels).is_some_and(|a| a - a0 >= LOAD as f64)
    })?;
    // The device's busy time (the kernel's io_ticks) counts the jiffies in
    // which it had I/O in flight: a load done within one jiffy (4 ms at
    // HZ=250; 45 writes took 13 ms together in a failed run) adds none. So
    // A is loaded again, a few times at most, until a jiffy's tick fell in.
    let io_time = "volring_volume_io_time_seconds_total";
    for round in 2..=5 {
        if sample(&after, io_time, a_labels).is_some_and(|v| v > 0.0) {
            break;
        }
        load(&p.a.1)?;
        after = site.scrape_until("volume A's written bytes did not rise by the load again", agent, |s| {
            sample(s, written, a_labels).is_some_and(|a| a - a0 >= (round * LOAD) as f64)
        })?;
    }
    let b1 = sample(&after, written, &["volume=\"vol-b\""]).ok_or("volume B's series went")?;
    check(b1 - b0 < (1 << 20) as f64, format!("volume B was not loaded but its written bytes rose by {}", b1 - b0))?;
    for f in ["volring_volume_writes_completed_total", "volring_volume_write_time_seconds_total", "volring_volume_io_time_seconds_total"] {
        check(sample(&after, f, a_labels).is_some_and(|v| v > 0.0), format!("{f} of A:\n{after}"))?;
    }
    for f in ["volring_volume_capacity_bytes", "volring_volume_used_bytes", "volring_volume_available_bytes", "volring_volume_inodes"] {
        check(sample(&after, f, a_labels).is_some_and(|v| v > 0.0), format!("{f} of A"))?;
    }
    check(sample(&after, "volring_volume_used_bytes", a_labels).is_some_and(|v| v >= LOAD as f64), "A's used bytes hold the load")?;
    // B is a block volume: its device's size, no filesystem figures.
    check(sample(&after, "volring_volume_capacity_bytes", &["volume=\"vol-b\""]) == Some((64u64 << 20) as f64), "B's capacity")?;
    check(sample(&after, "volring_volume_used_bytes", &["volume=\"vol-b\""]).is_none(), "B has no filesystem")?;
    let info_a = [format!("pod_uid=\"{UID_A}\""), "persistentvolume=\"pv-a\"".into(), "fstype=\"ext4\"".into()];
    let info_a: Vec<&str> = info_a.iter().map(String::as_str).chain(["volume=\"vol-a\""]).collect();
    check(sample(&after, "volring_volume_info", &info_a) == Some(1.0), format!("A's info series:\n{after}"))?;
    promtool_check(&after)?;
    let uid_b = format!("pod_uid=\"{UID_B}\"");
    check(
        sample(&after, "volring_volume_info", &["volume=\"vol-b\"", &uid_b, "persistentvolume=\"pv-b\"", "access=\"block\""]) == Some(1.0),
        "B's info",
    )?;
    Ok(())
}

/// `promtool check metrics` on a scrape with volumes (skipped where
/// promtool is missing, outside CI).
fn promtool_check(scrape: &str) -> Result<(), Failed> {
    use std::io::Write;
    let spawned =
        Command::new("promtool").args(["check", "metrics"]).stdin(Stdio::piped()).stdout(Stdio::piped()).stderr(Stdio::piped()).spawn();
    let mut child = match spawned {
        Ok(c) => c,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound && std::env::var_os("CI").is_none() => return Ok(()),
        Err(e) => return Err(format!("promtool: {e}").into()),
    };
    child.stdin.take().ok_or("promtool stdin")?.write_all(scrape.as_bytes())?;
    let out = child.wait_with_output()?;
    let said = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    check(out.status.success() && said.trim().is_empty(), format!("promtool check metrics on a scrape with volumes:\n{said}"))
}

fn unstaged_goes(site: &Site, agent: &Agent, c: &Clients, p: &Paths) -> Result<(), Failed> {
    unpublish_and_unstage(site, c, "vol-a", &p.a)?;
    let s = site.scrape_until("volume A's series stayed after its unstage", agent, |s| !s.contains("volume=\"vol-a\""))?;
    check(s.contains("volume=\"vol-b\""), "volume B's series went with A's")?;
    unpublish_and_unstage(site, c, "vol-b", &p.b)?;
    site.scrape_until("volume B's series stayed after its unstage", agent, |s| {
        !s.lines().any(|l| l.starts_with("volring_volume_") && l.contains('{'))
    })?;
    Ok(())
}

/// The present BlockDevice that names `volume`, from `objects`.
fn claimed_of<'a>(objects: &'a [Value], volume: &str) -> Option<&'a Value> {
    objects.iter().find(|o| o["status"]["volume"] == volume && o["status"]["state"] == "Active")
}

fn with_a_cluster() -> Result<(), Failed> {
    let site = Site::new()?;
    let server = site.rt.block_on(kube_support::Server::start());
    for (pv, handle, ns, claim) in [("pv-a", "vol-a", "shop", "data-a"), ("pv-b", "vol-b", "shop", "raw-b")] {
        server.api.seed_cluster(
            "persistentvolumes",
            json!({"apiVersion": "v1", "kind": "PersistentVolume", "metadata": {"name": pv},
                "spec": {"csi": {"driver": "volring.io", "volumeHandle": handle}, "claimRef": {"namespace": ns, "name": claim}}}),
        );
    }
    for (uid, name, node) in [(UID_A, "web-0", NODE), (UID_B, "db-0", NODE), ("ffffffff-0000-4000-8000-000000000000", "elsewhere", "other")]
    {
        server.api.seed_cluster(
            "pods",
            json!({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": "shop", "uid": uid}, "spec": {"nodeName": node}}),
        );
    }
    let cfg = site.scratch.path().join("kubeconfig");
    std::fs::write(
        &cfg,
        format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: s\n  cluster:\n    server: http://{}\nusers:\n- name: t\n  user:\n    token: x\ncontexts:\n- name: s\n  context:\n    cluster: s\n    user: t\ncurrent-context: s\n",
            server.addr
        ),
    )?;
    let (mut agent, c) = site.agent(&[("KUBECONFIG", cfg.as_os_str())])?;
    let p = paths(&site.kubelet());
    stage_and_publish(&site, &c, &p)?;
    let a = ["volume=\"vol-a\"", "device=\"loop", "persistentvolumeclaim=\"data-a\"", "namespace=\"shop\"", "pod=\"web-0\""];
    the_loaded_volume_rises_alone(&site, &agent, &p, &a)?;
    let s = site.metrics()?;
    check(
        sample(&s, "volring_volume_in_flight", &["volume=\"vol-b\"", "persistentvolumeclaim=\"raw-b\"", "pod=\"db-0\""]).is_some(),
        "B's names",
    )?;

    // The device under A: Claimed, with the volume, its PV and PVC, and ext4.
    let deadline = Instant::now() + PATIENCE;
    let bd = loop {
        let all = server.api.objects("blockdevices");
        match claimed_of(&all, "vol-a") {
            Some(o) if o["status"]["persistentVolumeClaim"]["name"] == "data-a" && o["status"]["filesystem"]["fsType"] == "ext4" => {
                break o.clone()
            }
            found => check(Instant::now() < deadline, format!("A's BlockDevice: {found:#?}\n{}", agent.log()))?,
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    check(bd["status"]["claimState"] == "Claimed", format!("{bd:#}"))?;
    check(bd["status"]["persistentVolumeClaim"]["namespace"] == "shop" && bd["status"]["persistentVolume"] == "pv-a", format!("{bd:#}"))?;
    // The StorageNode lists the volume with the same names.
    let deadline = Instant::now() + PATIENCE;
    loop {
        let sn = server.api.objects("storagenodes");
        let vols = sn.iter().filter_map(|o| o["status"]["volumes"].as_array()).flatten().cloned().collect::<Vec<_>>();
        let a = vols.iter().find(|v| v["id"] == "vol-a");
        if a.is_some_and(|a| {
            a["persistentVolumeClaim"]["name"] == "data-a" && a["pods"] == json!(["shop/web-0"]) && a["persistentVolume"] == "pv-a"
        }) {
            break;
        }
        check(Instant::now() < deadline, format!("A in the StorageNode: {a:#?}"))?;
        std::thread::sleep(Duration::from_millis(50));
    }
    // Only what the cache lacked was asked for: one pod LIST of this node.
    let pods: Vec<_> = server.api.log().into_iter().filter(|l| l.path == "/api/v1/pods").collect();
    check(!pods.is_empty() && pods.iter().all(|l| l.query.contains("spec.nodeName%3Dvi-node") && l.status == 200), format!("{pods:#?}"))?;

    unstaged_goes(&site, &agent, &c, &p)?;
    // Released: no BlockDevice names the volume once it is unstaged.
    let deadline = Instant::now() + PATIENCE;
    while server.api.objects("blockdevices").iter().any(|o| o["status"]["volume"] == "vol-a" || o["status"]["claimState"] == "Claimed") {
        check(Instant::now() < deadline, format!("A's BlockDevice still Claimed:\n{}", agent.log()))?;
        std::thread::sleep(Duration::from_millis(50));
    }
    check(agent.stop(), format!("the agent stops cleanly:\n{}", agent.log()))
}

fn without_a_cluster() -> Result<(), Failed> {
    let site = Site::new()?;
    let (mut agent, c) = site.agent(&[])?;
    let p = paths(&site.kubelet());
    stage_and_publish(&site, &c, &p)?;
    // The names only the cluster knows are empty; the pod UID and the PV
    // come from kubelet's paths.
    let a = ["volume=\"vol-a\"", "device=\"loop", "persistentvolumeclaim=\"\"", "namespace=\"\"", "pod=\"\""];
    the_loaded_volume_rises_alone(&site, &agent, &p, &a)?;
    // The node's store holds A's device as Claimed, with its filesystem.
    let deadline = Instant::now() + PATIENCE;
    loop {
        let out = Command::new(VOLRING)
            .args(["get", "bd", "-o", "json", "--state-dir"])
            .arg(site.scratch.path().join("state"))
            .env_clear()
            .env("HOME", site.scratch.path())
            .env("PATH", "/usr/bin:/bin")
            .output()?;
        let v: Value = serde_json::from_slice(&out.stdout).unwrap_or_default();
        let items = v["items"].as_array().cloned().unwrap_or_default();
        match claimed_of(&items, "vol-a") {
            Some(o) if o["status"]["claimState"] == "Claimed" && o["status"]["filesystem"]["fsType"] == "ext4" => {
                check(o["status"]["persistentVolume"] == "pv-a" && o["status"].get("persistentVolumeClaim").is_none(), format!("{o:#}"))?;
                break;
            }
            found => check(
                Instant::now() < deadline,
                format!("A's BlockDevice in the store: {found:#?}\n{}", String::from_utf8_lossy(&out.stderr)),
            )?,
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    unstaged_goes(&site, &agent, &c, &p)?;
    check(agent.stop(), format!("the agent stops cleanly:\n{}", agent.log()))
}

fn main() {
    common::run_in_private_namespace(vec![
        Trial::test("without_a_cluster", without_a_cluster),
        Trial::test("with_a_cluster", with_a_cluster),
    ]);
}
