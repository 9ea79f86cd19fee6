//! `volring top` and `volring df` reading a real running agent's
//! `/metrics` (issue 28), not a synthetic scrape: two volumes staged and
//! published under kubelet's own paths — a filesystem volume in one pod, a
//! raw block volume in another — with the API stand-in of tests/kube_support
//! naming their PVCs and pods, and dd loading the first. `top --once --json
//! --source agent` ranks the loaded volume first with its PVC, namespace,
//! pod and pod UID; `df --source agent` shows both volumes, the filesystem
//! one with coreutils' `df -B1` figures of its staging mount and the block
//! one with its device's size; `--source auto` picks the agent. Runs on the
//! real kernel in a private mount namespace; everything made is removed on
//! drop (the agent by PID, mounts and loop devices with its scratch dir).

mod common;
mod csi_support;
mod kube_support;

use std::process::Command;
use std::time::{Duration, Instant};

use common::check;
use common::load::Load;
use csi_support::{block_cap, mount_cap, Agent, MIB};
use libtest_mimic::{Failed, Trial};
use serde_json::{json, Value};

const VOLRING: &str = env!("CARGO_BIN_EXE_volring");
const UID_A: &str = "7a1c2a3b-4d5e-4f60-8a7b-9c0d1e2f3a4b";
const UID_B: &str = "1b9b8c7d-6e5f-4a3b-9c2d-1e0f9a8b7c6d";
/// Every wait ends as soon as its condition holds; none takes longer.
const PATIENCE: Duration = Duration::from_secs(60);
/// Longer than the stats interval of csi_support's agent (5 s), so two
/// scrapes this far apart straddle at least one of its device samples.
const TOP_INTERVAL: &str = "6";

/// The agent with `/metrics` on a free port, talking to the API stand-in
/// that knows both volumes' PVs and pods; A (ext4) and B (block) staged and
/// published at kubelet's paths. The stand-in's runtime outlives the agent.
struct Site {
    a: Agent,
    addr: String,
    _cfg: common::Scratch,
    _server: kube_support::Server,
    _rt: tokio::runtime::Runtime,
}

impl Site {
    fn start() -> Result<Self, Failed> {
        let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build()?;
        let server = rt.block_on(kube_support::Server::start());
        for (pv, handle, claim) in [("pv-a", "vol-a", "data-a"), ("pv-b", "vol-b", "raw-b")] {
            server.api.seed_cluster(
                "persistentvolumes",
                json!({"apiVersion": "v1", "kind": "PersistentVolume", "metadata": {"name": pv},
                    "spec": {"csi": {"driver": "volring.io", "volumeHandle": handle}, "claimRef": {"namespace": "shop", "name": claim}}}),
            );
        }
        for (uid, name) in [(UID_A, "web-0"), (UID_B, "db-0")] {
            server.api.seed_cluster(
                "pods",
                json!({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": "shop", "uid": uid},
                    "spec": {"nodeName": "test-node"}}),
            );
        }
        let scratch = common::Scratch::new();
        let cfg = scratch.path().join("kubeconfig");
        std::fs::write(
            &cfg,
            format!(
                "apiVersion: v1\nkind: Config\nclusters:\n- name: s\n  cluster:\n    server: http://{}\nusers:\n- name: t\n  user:\n    token: x\ncontexts:\n- name: s\n  context:\n    cluster: s\n    user: t\ncurrent-context: s\n",
                server.addr
            ),
        )?;
        let port = std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
        let addr = format!("127.0.0.1:{port}");
        let cfg = cfg.to_string_lossy().into_owned();
        let a = Agent::start_with(&[("VOLRING_METRICS_ADDR", &addr), ("KUBECONFIG", &cfg)]);
        Ok(Self { a, addr, _cfg: scratch, _server: server, _rt: rt })
    }

    /// Stages and publishes both volumes.
    fn stage(&self) -> Result<(), Failed> {
        let site = self;
        for (id, cap) in [("vol-a", mount_cap("ext4")), ("vol-b", block_cap())] {
            site.a.create(id, 64 * MIB, if id == "vol-a" { "ext4" } else { "" })?;
            let (staging, target) = site.paths(id);
            std::fs::create_dir_all(&staging)?;
            std::fs::create_dir_all(std::path::Path::new(&target).parent().ok_or("a target has a parent")?)?;
            site.a.stage(id, &staging, cap.clone())?;
            site.a.publish(id, &staging, &target, cap, false)?;
        }
        Ok(())
    }

    /// (staging, target) of a volume, as kubelet lays them out.
    fn paths(&self, id: &str) -> (String, String) {
        match id {
            "vol-a" => (
                self.a.k("plugins/kubernetes.io/csi/volring.io/0d1e2f/globalmount"),
                self.a.k(&format!("pods/{UID_A}/volumes/kubernetes.io~csi/pv-a/mount")),
            ),
            _ => (
                self.a.k("plugins/kubernetes.io/csi/volumeDevices/staging/pv-b"),
                self.a.k(&format!("plugins/kubernetes.io/csi/volumeDevices/publish/pv-b/{UID_B}")),
            ),
        }
    }

    /// `volring ARGS` reading this node (its state, kubelet root and
    /// metrics address).
    fn json(&self, args: &[&str]) -> Result<Value, Failed> {
        let out = Command::new(VOLRING)
            .args(args)
            .arg("--state-dir")
            .arg(&self.a.state)
            .arg("--kubelet-root")
            .arg(&self.a.kubelet)
            .args(["--metrics-addr", &self.addr])
            .output()?;
        check(out.status.success(), format!("volring {args:?}: {}", String::from_utf8_lossy(&out.stderr)))?;
        Ok(serde_json::from_slice(&out.stdout)?)
    }

    /// Waits (bounded) until `top --once --json --source agent` has both
    /// volumes with their PVC names: the agent learned them from the
    /// stand-in and its collector has sampled both devices.
    fn named(&self) -> Result<(), Failed> {
        let deadline = Instant::now() + PATIENCE;
        loop {
            // Until the collector's first sample of the new devices there
            // are no series, and `--source agent` says so (rc 1).
            let v = self.json(&["top", "--once", "--json", "--source", "agent", "--interval", "0.01"]).unwrap_or_default();
            let rows = v["rows"].as_array().cloned().unwrap_or_default();
            if rows.len() == 2 && rows.iter().all(|r| r["persistentvolumeclaim"] != "") {
                return Ok(());
            }
            check(Instant::now() < deadline, format!("the agent's volumes never had their names: {v}\n{}", self.a.log_tail(40)))?;
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    fn unstage(&self) -> Result<(), Failed> {
        for id in ["vol-a", "vol-b"] {
            let (staging, target) = self.paths(id);
            self.a.unpublish(id, &target)?;
            self.a.unstage(id, &staging)?;
        }
        Ok(())
    }
}

fn row<'a>(rows: &'a Value, volume: &str) -> Option<&'a Value> {
    rows.as_array()?.iter().find(|r| r["volume"] == volume)
}

/// The loaded volume first, with every name the agent knows; `auto`
/// picks the agent.
fn top_ranks_the_loaded_volume_first() -> Result<(), Failed> {
    let site = Site::start()?;
    // An agent with no volume is a source with no rows, not a missing one.
    let idle = site.json(&["top", "--once", "--json", "--source", "agent", "--interval", "0.01"])?;
    check(idle["source"].as_str().is_some_and(|s| s.starts_with("agent")) && idle["rows"] == json!([]), format!("{idle}"))?;
    let idle = site.json(&["df", "--json", "--source", "agent"])?;
    check(idle["volumes"] == json!([]), format!("{idle}"))?;
    site.stage()?;
    site.named()?;
    let load = Load::on(&site.paths("vol-a").1);
    let top = site.json(&["top", "--once", "--json", "--source", "agent", "--interval", TOP_INTERVAL])?;
    let auto = site.json(&["top", "--once", "--json", "--source", "auto", "--interval", "0.01"])?;
    // Two scrapes 10 ms apart mostly fall between two of the agent's
    // 1 s collections: the rates are per the agent's sample times, and
    // --once waits for its next sample rather than print zeros.
    let short = site.json(&["top", "--once", "--json", "--source", "agent", "--interval", "0.01"])?;
    drop(load);
    check(
        row(&short["rows"], "vol-a").is_some_and(|r| r["writes_per_second"].as_f64().is_some_and(|w| w > 0.0)),
        format!("a short --interval still sees the load: {short}"),
    )?;
    check(top["source"].as_str().is_some_and(|s| s.starts_with("agent")), format!("{top}"))?;
    let rows = &top["rows"];
    let order: Vec<&str> = rows.as_array().into_iter().flatten().filter_map(|r| r["volume"].as_str()).collect();
    check(order == ["vol-a", "vol-b"], format!("the loaded volume first: {rows:#}"))?;
    let a = &rows[0];
    check(a["writes_per_second"].as_f64().is_some_and(|w| w > 0.0), format!("it writes: {a}"))?;
    check(a["device"].as_str().is_some_and(|d| d.starts_with("loop")), format!("its loop device: {a}"))?;
    check(
        a["persistentvolumeclaim"] == "data-a" && a["namespace"] == "shop" && a["pod"] == "web-0",
        format!("A's PVC, namespace and pod: {a}"),
    )?;
    check(a["pod_uids"] == json!([UID_A]), format!("A's pod UID: {a}"))?;
    let b = &rows[1];
    check(b["persistentvolumeclaim"] == "raw-b" && b["pod"] == "db-0" && b["pod_uids"] == json!([UID_B]), format!("B's names: {b}"))?;
    check(auto["source"].as_str().is_some_and(|s| s.starts_with("agent")), format!("--source auto picks the agent: {auto}"))?;
    check(row(&auto["rows"], "vol-a").is_some_and(|r| r["pod_uids"] == json!([UID_A])), format!("{auto}"))?;
    // The kernel source reads the same pod UIDs from kubelet's paths, the
    // block volume's (`volumeDevices/publish/PV/UID`) too.
    let kernel = site.json(&["top", "--once", "--json", "--source", "kernel", "--interval", "0.01"])?;
    for (volume, uid) in [("vol-a", UID_A), ("vol-b", UID_B)] {
        check(row(&kernel["rows"], volume).is_some_and(|r| r["pod_uids"] == json!([uid])), format!("{volume} from the kernel: {kernel}"))?;
    }
    site.unstage()
}

/// Both volumes: the filesystem one with `df -B1`'s figures of its staging
/// mount, the block one with its device's size; names from the agent.
fn df_shows_both_volumes() -> Result<(), Failed> {
    let site = Site::start()?;
    site.stage()?;
    site.named()?;
    let out = Command::new("dd")
        .args(["if=/dev/zero", &format!("of={}/data", site.paths("vol-a").1), "bs=1M", "count=8", "conv=fsync", "status=none"])
        .output()?;
    check(out.status.success(), "dd")?;
    let v = site.json(&["df", "--json", "--source", "agent"])?;
    let a = row(&v["volumes"], "vol-a").ok_or_else(|| format!("no vol-a: {v}"))?;
    let b = row(&v["volumes"], "vol-b").ok_or_else(|| format!("no vol-b: {v}"))?;
    let staging = site.paths("vol-a").0;
    let out = Command::new("df").args(["-B1", "--output=size,used,avail,pcent"]).arg(&staging).output()?;
    let text = String::from_utf8(out.stdout)?;
    let theirs: Vec<String> =
        text.lines().nth(1).unwrap_or_default().split_whitespace().map(|s| s.trim_end_matches('%').to_string()).collect();
    let ours: Vec<String> =
        ["size_bytes", "used_bytes", "available_bytes", "use_pct"].iter().map(|k| a[*k].as_u64().unwrap_or(u64::MAX).to_string()).collect();
    check(ours == theirs, format!("vol-a: volring {ours:?}, df {theirs:?}"))?;
    check(a["persistentvolumeclaim"] == "data-a" && a["namespace"] == "shop", format!("A's names: {a}"))?;
    check(b["size_bytes"].as_u64() == Some(64 << 20) && b["used_bytes"].is_null(), format!("B, a block volume: {b}"))?;
    check(b["persistentvolumeclaim"] == "raw-b" && b["access"] == "block", format!("B's names: {b}"))?;
    site.unstage()
}

fn main() {
    common::run_in_private_namespace(vec![
        Trial::test("top_agent::top_ranks_the_loaded_volume_first", top_ranks_the_loaded_volume_first),
        Trial::test("top_agent::df_shows_both_volumes", df_shows_both_volumes),
    ]);
}
