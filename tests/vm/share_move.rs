//! A shared (RWX) volume's NFS server moves to another node while a client
//! keeps its mount (issue 17, failover case 2): this host's agent (node A)
//! owns the volume, stages it through a loop device, exports it with its
//! ganesha and serves the image on its nbd export; a 6.1 guest
//! (tests/vm/share_move.sh) is node B — its own agent and ganesha, the
//! kernel nbd client — and the client node, whose NFS mount goes through
//! one fixed address standing in for the volume's Service. The guest asks
//! the host to unstage A; B stages the volume over nbd with share=nfs and
//! exports it; the Service's stand-in then leads to B. The client's writer,
//! open file and cwd must ride through; then `xfs_repair -n` (or `e2fsck
//! -fn`) of the image. Skips (saying why) without the VM image; fails in CI.

use std::collections::HashMap;
use std::path::Path;
use std::time::{Duration, Instant};

use crate::common::check;
use crate::csi_support::{code, Agent, MIB};
use crate::harness;
use crate::harness::{image_or_skip, Vm};
use crate::kube_support;
use libtest_mimic::Failed;
use volring_csi::client::capability;
use volring_csi::proto::volume_capability::access_mode::Mode;
use volring_csi::proto::*;

/// The volume-context keys of an exported volume, as docs/nbd.md names
/// them (the test's own, not the driver's: a key the driver changed would
/// strand every volume created before).
const CONTEXT_URI: &str = "volring.io/nbd-uri";
const CONTEXT_SECRET: &str = "volring.io/nbd-secret";

const SCRIPT: &str = include_str!("share_move.sh");
const GUEST_NBD: &str = "10.0.2.100:10809";
const GUEST_NFS: &str = "10.0.2.100:2049";
const GUEST_API: &str = "10.0.2.100:6443";
/// B's NFS server, as its EndpointSlice names it: B listens on the guest's
/// loopback and advertises the guest's address (`--nfs-advertise`; the API
/// server refuses loopback addresses in a slice).
const B_NFS: &str = "10.0.2.15:2049";

/// The addresses the EndpointSlice named like the PVC lists, or `None`
/// while there is none.
fn endpoints(server: &kube_support::Server) -> Option<Vec<String>> {
    let slice = server.api.core_object("apps", "endpointslices", "data")?;
    let mut out = Vec::new();
    for e in slice["endpoints"].as_array().into_iter().flatten() {
        for a in e["addresses"].as_array().into_iter().flatten() {
            for p in slice["ports"].as_array().into_iter().flatten() {
                out.push(format!("{}:{}", a.as_str().unwrap_or_default(), p["port"]));
            }
        }
    }
    Some(out)
}

fn cluster_ip(server: &kube_support::Server) -> Option<String> {
    server.api.core_object("apps", "services", "data").and_then(|s| s["spec"]["clusterIP"].as_str().map(str::to_string))
}

/// Waits (every 100 ms, at most `secs`) until the EndpointSlice names `want`.
fn endpoints_become(server: &kube_support::Server, want: &str, secs: u64) -> Result<(), String> {
    let deadline = Instant::now() + Duration::from_secs(secs);
    while endpoints(server) != Some(vec![want.to_string()]) {
        if Instant::now() > deadline {
            return Err(format!("the EndpointSlice names {:?}, not {want}, after {secs} s", endpoints(server)));
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    Ok(())
}

/// A relay script for qemu's guestfwd: one socat per guest connection to
/// the host's `port`.
fn relay(dir: &Path, name: &str, port: u16) -> Result<std::path::PathBuf, Failed> {
    let path = dir.join(name);
    std::fs::write(&path, format!("#!/bin/sh\nexec socat -t 0.1 - TCP:127.0.0.1:{port},nodelay 2>>'{}.log'\n", path.display()))?;
    std::fs::set_permissions(&path, std::os::unix::fs::PermissionsExt::from_mode(0o755))?;
    Ok(path)
}

fn free_port() -> Result<u16, Failed> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

pub fn moves_under_a_client(fs: &'static str) -> Result<(), Failed> {
    let test = format!("vm_share_move::moves_under_a_client_{fs}");
    let Some(image) = image_or_skip(&test) else { return Ok(()) };
    if std::process::Command::new("socat").arg("-V").output().is_err() {
        return Err("socat (the guest connection's relay) is not installed: run .ci/deps".into());
    }
    let volume = format!("pvc-move-{fs}");
    // The cluster: the API stand-in, which both agents reach (the guest's
    // through guestfwd), with the PVC the volume is created for.
    let api_rt = tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build()?;
    let api = api_rt.block_on(kube_support::Server::start());
    let pvc = serde_json::json!({"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": "data"},
        "spec": {"accessModes": ["ReadWriteMany"]}});
    api.api.seed_core("apps", "persistentvolumeclaims", pvc);
    let work = tempfile::tempdir()?;
    let kubeconfig = work.path().join("kubeconfig");
    std::fs::write(
        &kubeconfig,
        format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: s\n  cluster:\n    server: http://{}\nusers:\n- name: u\n  user: {{}}\n\
             contexts:\n- name: c\n  context:\n    cluster: s\n    user: u\ncurrent-context: c\n",
            api.addr
        ),
    )?;
    let (kc, api_port) = (kubeconfig.display().to_string(), api.addr.port().to_string());
    let (nbd, nfs) = (free_port()?, free_port()?);
    let (nbd_listen, nfs_listen) = (format!("127.0.0.1:{nbd}"), format!("127.0.0.1:{nfs}"));
    let a = Agent::start_with(&[
        ("VOLRING_NBD_EXPORT_LISTEN", &nbd_listen),
        ("VOLRING_NFS_LISTEN", &nfs_listen),
        // Where the guest reaches A's server (qemu's guestfwd): not loopback.
        ("VOLRING_NFS_ADVERTISE", GUEST_NFS),
        // The guest's connections arrive through socat from 127.0.0.1.
        ("VOLRING_NFS_CLIENTS", "127.0.0.1"),
        ("VOLRING_NFS_GRACE", "10"),
        ("VOLRING_NFS_LEASE", "10"),
        ("VOLRING_NFS_SERVICE_POLL", "0.2"),
        ("KUBECONFIG", &kc),
        ("KUBERNETES_SERVICE_HOST", "127.0.0.1"),
        ("KUBERNETES_SERVICE_PORT", &api_port),
    ]);
    let rwx = capability(false, fs, &[], Mode::MultiNodeMultiWriter);
    let mut c = a.c.controller.clone();
    let v = a
        .run(c.create_volume(CreateVolumeRequest {
            name: volume.clone(),
            capacity_range: Some(CapacityRange { required_bytes: 320 * MIB, limit_bytes: 0 }),
            volume_capabilities: vec![rwx.clone()],
            parameters: HashMap::from([
                ("attach".into(), "nbd".into()),
                ("fsType".into(), fs.into()),
                ("csi.storage.k8s.io/pvc/namespace".into(), "apps".into()),
                ("csi.storage.k8s.io/pvc/name".into(), "data".into()),
                // The guest's writer runs as root.
                ("nfsSquash".into(), "none".into()),
            ]),
            ..Default::default()
        }))?
        .into_inner()
        .volume
        .ok_or("no volume")?;
    let secret = v.volume_context.get(CONTEXT_SECRET).cloned().ok_or("no secret in the context")?;
    check(v.volume_context.contains_key(CONTEXT_URI), "no URI in the context")?;
    // Node A stages it (a loop device: this host has no nbd driver) and
    // exports it.
    let staging = a.k(&format!("plugins/stage/{volume}"));
    let mut n = a.c.node.clone();
    a.run(n.node_stage_volume(NodeStageVolumeRequest {
        volume_id: volume.clone(),
        staging_target_path: staging.clone(),
        volume_capability: Some(rwx),
        volume_context: HashMap::from([("attach".to_string(), "loop".to_string())]),
        ..Default::default()
    }))?;
    // A's slice names the address it advertises: where the guest reaches it.
    endpoints_become(&api, GUEST_NFS, 30)?;
    let ip = cluster_ip(&api).ok_or("no ClusterIP")?;

    let mut vm = Vm::new(&image)?;
    vm.cpus = 2;
    vm.extra_args = vec![
        "-netdev".into(),
        format!(
            "user,id=n0,restrict=on,guestfwd=tcp:{GUEST_NBD}-cmd:{},guestfwd=tcp:{GUEST_NFS}-cmd:{},guestfwd=tcp:{GUEST_API}-cmd:{}",
            relay(work.path(), "nbd.sh", nbd)?.display(),
            relay(work.path(), "nfs.sh", nfs)?.display(),
            relay(work.path(), "api.sh", api.addr.port())?.display()
        ),
        "-device".into(),
        "virtio-net-pci,netdev=n0".into(),
    ];
    let uri = format!("nbd://{GUEST_NBD}/{volume}");
    let script =
        harness::script(env!("CARGO_BIN_EXE_volring"), &[("URI", &uri), ("SECRET", &secret), ("VOLUME", &volume), ("FS", fs)], SCRIPT);
    let timeout = Duration::from_secs(900);
    let mut guest = vm.start(&script)?;
    let results = guest.xfer().join("results");
    let mut unstaged = None;
    let mut followed = None;
    let answer = |step: &str, r: &Result<(), String>| {
        std::fs::write(results.join(format!("done-{step}")), r.as_ref().map_or_else(|e| format!("{e}\n"), |_| "ok\n".into()))
    };
    while !guest.finished() && guest.elapsed() < timeout {
        if unstaged.is_none() && results.join("ask-owner-unstaged").exists() {
            let r = a.unstage(&volume, &staging).map_err(|s| format!("A's unstage: {s}"));
            answer("owner-unstaged", &r)?;
            unstaged = Some(r);
        }
        // B exports it: the EndpointSlice names B, the ClusterIP stays.
        if followed.is_none() && results.join("ask-endpoints-moved").exists() {
            let r = endpoints_become(&api, B_NFS, 60).and_then(|()| match cluster_ip(&api) {
                Some(now) if now == ip => Ok(()),
                other => Err(format!("the ClusterIP was {ip}, is {other:?}")),
            });
            answer("endpoints-moved", &r)?;
            followed = Some(r);
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let run = guest.wait(timeout)?;
    eprintln!("note: {test}: {}\n{}(guest {:.1} s)", run.read("verdict").trim(), run.read("notes"), run.elapsed.as_secs_f64());
    check(
        run.status == Some(0) && matches!(unstaged, Some(Ok(()))) && matches!(followed, Some(Ok(()))),
        format!(
            "{}\nA's unstage: {unstaged:?}\nthe EndpointSlice: {followed:?}\n--- B's agent\n{}\n--- A's agent\n{}",
            run.describe(),
            harness::tail(&run.read("b.err"), 15),
            a.log_tail(400).lines().filter(|l| !l.contains("ring tick")).collect::<Vec<_>>().join("\n")
        ),
    )?;
    // The filesystem id in the handles: the same from A's loop device and
    // B's nbd device (ganesha takes it from the filesystem's UUID).
    let fsid = |log: &str, path: &str| {
        let want = format!(" {path} namelen=");
        let line = log.lines().rev().find(|l| l.contains("Added filesystem") && l.contains(&want))?;
        let field = |k: &str| line.split_whitespace().find_map(|w| w.strip_prefix(k)).map(str::to_string);
        Some((field("dev=")?, field("fsid=")?))
    };
    let on_a = fsid(&std::fs::read_to_string(a.state.join("nfs/ganesha.log"))?, &staging);
    let on_b = fsid(&run.read("b-fsid"), &format!("/tmp/kubelet/plugins/stage/{volume}"));
    eprintln!("note: {test}: ganesha's (dev, fsid) on A {on_a:?}, on B {on_b:?}");
    check(
        on_a.is_some() && on_a.as_ref().map(|a| &a.1) == on_b.as_ref().map(|b| &b.1),
        format!("the fsid in the handles changed with the move: A {on_a:?}, B {on_b:?}"),
    )?;
    let fsck = match fs {
        "xfs" => std::process::Command::new("xfs_repair").arg("-n").arg(a.image(&volume)).output()?,
        _ => std::process::Command::new("e2fsck").arg("-fn").arg(a.image(&volume)).output()?,
    };
    check(
        fsck.status.success(),
        format!("check of the image after the move:\n{}{}", String::from_utf8_lossy(&fsck.stdout), String::from_utf8_lossy(&fsck.stderr)),
    )?;
    check(code(a.delete(&volume)).is_none(), "delete after the move")?;
    Ok(())
}
