//! Shared (ReadWriteMany) volumes through the CSI socket of a real
//! `volring node`: the access-mode checks, and the NFS export the owning
//! node serves (read and written with libnfs's userspace client, since
//! this machine's kernel has no NFS client; the kernel client runs in the
//! VM test, tests/vm/share.rs).

mod common;
mod csi_support;
mod kube_support;
mod share_support;

use common::check;
use csi_support::{mount_cap, Agent, MIB};
use libtest_mimic::{Failed, Trial};
use share_support::{eventually, free_port, kubeconfig, libnfs, url};
use tonic::Code;
use volring_csi::client::capability;
use volring_csi::proto::volume_capability::access_mode::Mode;
use volring_csi::proto::*;

fn expect_code<T>(r: Result<T, tonic::Status>, want: Code, what: &str) -> Result<(), Failed> {
    match r {
        Err(s) if s.code() == want => Ok(()),
        Err(s) => Err(format!("{what}: expected {want:?}, got {:?}: {}", s.code(), s.message()).into()),
        Ok(_) => Err(format!("{what}: expected {want:?}, got success").into()),
    }
}

fn rwx(fs: &str) -> VolumeCapability {
    capability(false, fs, &[], Mode::MultiNodeMultiWriter)
}

fn rwx_block() -> VolumeCapability {
    capability(true, "", &[], Mode::MultiNodeMultiWriter)
}

fn create(a: &Agent, name: &str, caps: Vec<VolumeCapability>) -> Result<Volume, tonic::Status> {
    let mut c = a.c.controller.clone();
    let r = a.run(c.create_volume(CreateVolumeRequest {
        name: name.into(),
        capacity_range: Some(CapacityRange { required_bytes: 32 * MIB, limit_bytes: 0 }),
        volume_capabilities: caps,
        ..Default::default()
    }))?;
    Ok(r.into_inner().volume.expect("volume"))
}

fn validate(a: &Agent, id: &str, caps: Vec<VolumeCapability>) -> Result<ValidateVolumeCapabilitiesResponse, tonic::Status> {
    let mut c = a.c.controller.clone();
    a.run(c.validate_volume_capabilities(ValidateVolumeCapabilitiesRequest {
        volume_id: id.into(),
        volume_capabilities: caps,
        ..Default::default()
    }))
    .map(|r| r.into_inner())
}

/// MULTI_NODE_MULTI_WRITER: accepted for mount volumes by CreateVolume,
/// ValidateVolumeCapabilities and NodeStage; refused for block volumes
/// with INVALID_ARGUMENT (CreateVolume, NodeStage) or an unconfirmed reply
/// with a message (ValidateVolumeCapabilities, as the spec has it); on a
/// volume created single-node, refused by NodeStage and NodePublish with
/// FAILED_PRECONDITION; the single-node modes as before.
fn access_modes() -> Result<(), Failed> {
    let a = Agent::start();
    let v = create(&a, "pvc-rwx", vec![rwx("ext4")])?;
    check(v.volume_context.get("share").map(String::as_str) == Some("nfs"), format!("shared in the context: {:?}", v.volume_context))?;
    check(create(&a, "pvc-rwx", vec![rwx("ext4")])? == v, "create is idempotent")?;
    expect_code(create(&a, "pvc-rwx", vec![mount_cap("ext4")]), Code::AlreadyExists, "same name, single-node")?;
    // Block RWX is refused with a message naming why.
    match create(&a, "pvc-rwx-block", vec![rwx_block()]) {
        Err(s) if s.code() == Code::InvalidArgument && s.message().contains("MULTI_NODE_MULTI_WRITER") && s.message().contains("mount") => {
        }
        other => return Err(format!("block RWX create: {other:?}").into()),
    }
    expect_code(create(&a, "pvc-rwx-mix", vec![rwx("ext4"), rwx_block()]), Code::InvalidArgument, "one block RWX among others")?;
    // The other multi-node modes stay refused.
    for m in [Mode::MultiNodeReaderOnly, Mode::MultiNodeSingleWriter] {
        expect_code(create(&a, "pvc-mn", vec![capability(false, "ext4", &[], m)]), Code::InvalidArgument, m.as_str_name())?;
    }
    // ValidateVolumeCapabilities confirms RWX mount on a shared volume, and
    // answers block RWX (and RWX on a single-node volume) unconfirmed.
    let ok = validate(&a, "pvc-rwx", vec![rwx("ext4")])?;
    check(ok.confirmed.is_some(), format!("RWX mount confirmed: {:?}", ok.message))?;
    let no = validate(&a, "pvc-rwx", vec![rwx_block()])?;
    check(no.confirmed.is_none() && no.message.contains("MULTI_NODE_MULTI_WRITER"), format!("RWX block unconfirmed: {no:?}"))?;
    a.create("pvc-single", 32 * MIB, "ext4")?;
    let single = validate(&a, "pvc-single", vec![rwx("ext4")])?;
    check(single.confirmed.is_none() && !single.message.is_empty(), format!("RWX on a single-node volume: {single:?}"))?;
    check(validate(&a, "pvc-single", vec![mount_cap("ext4")])?.confirmed.is_some(), "single-node mode unchanged")?;
    // NodeStage: RWX mount stages on the owning node; block RWX is refused.
    let staging = a.k("plugins/stage/rwx");
    expect_code(a.stage("pvc-rwx", &staging, rwx_block()), Code::InvalidArgument, "stage block RWX")?;
    a.stage("pvc-rwx", &staging, rwx("ext4"))?;
    a.stage("pvc-rwx", &staging, rwx("ext4"))?;
    let target = a.k("pods/p/rwx");
    a.publish("pvc-rwx", &staging, &target, rwx("ext4"), false)?;
    std::fs::write(format!("{target}/hello"), b"shared")?;
    check(std::fs::read(format!("{staging}/hello"))? == b"shared", "the publish is the staged filesystem")?;
    a.unpublish("pvc-rwx", &target)?;
    a.unstage("pvc-rwx", &staging)?;
    // NodeStage and NodePublish hold a single-node volume to what it was
    // created for, as ValidateVolumeCapabilities does above: RWX exceeds
    // its capabilities (FAILED_PRECONDITION, the spec's code for that in
    // both tables), and nothing is staged or published for it.
    let s2 = a.k("plugins/stage/single");
    expect_code(a.stage("pvc-single", &s2, rwx("ext4")), Code::FailedPrecondition, "stage RWX of a single-node volume")?;
    let left = csi_support::mounts_under(&a.kubelet);
    check(left.is_empty() && csi_support::loops_backed_by(&a.image("pvc-single")).is_empty(), format!("a refused stage left {left:?}"))?;
    // Single-node stage unchanged.
    a.stage("pvc-single", &s2, mount_cap("ext4"))?;
    let t2 = a.k("pods/p/single");
    expect_code(a.publish("pvc-single", &s2, &t2, rwx("ext4"), false), Code::FailedPrecondition, "publish RWX of a single-node volume")?;
    check(!std::path::Path::new(&t2).exists(), "a refused publish made its target")?;
    a.unstage("pvc-single", &s2)?;
    // A volume another node holds, reached through the nbd export its
    // context names: the context CreateVolume returned is its record here,
    // and one without `share=nfs` is single-node. Refused before any
    // connection (nothing listens on that port). An unknown volume is
    // NotFound first.
    let far = a.k("plugins/stage/far");
    let ctx = std::collections::HashMap::from([
        ("volring.io/nbd-uri".to_string(), format!("nbd://127.0.0.1:{}/pvc-far", free_port())),
        ("volring.io/nbd-secret".to_string(), "ab".repeat(32)),
    ]);
    let mut n = a.c.node.clone();
    let r = a.run(n.node_stage_volume(NodeStageVolumeRequest {
        volume_id: "pvc-far".into(),
        staging_target_path: far.clone(),
        volume_capability: Some(rwx("ext4")),
        volume_context: ctx,
        ..Default::default()
    }));
    expect_code(r, Code::FailedPrecondition, "stage RWX of another node's single-node volume")?;
    expect_code(a.stage("pvc-none", &far, rwx("ext4")), Code::NotFound, "stage RWX of an unknown volume")?;
    Ok(())
}

/// The ganesha the agent runs, by the pid file it writes.
fn server_pid(a: &Agent) -> Option<u32> {
    std::fs::read_to_string(a.state.join("nfs/ganesha.pid")).ok()?.trim().parse().ok()
}

/// The TCP sockets process `pid` listens on, as `ss` prints them.
fn listening(pid: u32) -> Vec<String> {
    let out = std::process::Command::new("ss").args(["-Hltnp"]).output().map(|o| o.stdout).unwrap_or_default();
    String::from_utf8_lossy(&out)
        .lines()
        .filter(|l| l.contains(&format!("pid={pid},")))
        .filter_map(|l| l.split_whitespace().nth(3).map(str::to_string))
        .collect()
}

fn share_records(a: &Agent) -> Result<Vec<serde_json::Value>, Failed> {
    let c = volring_volumes::store::Store::read_only(&a.state.join("state.redb"), false)?;
    Ok(c.published.iter().filter(|(k, _)| k.starts_with("NfsShare/")).map(|(_, v)| serde_json::from_slice(v)).collect::<Result<_, _>>()?)
}

const GRACE: &str = "5";

/// An agent serving NFS on 127.0.0.1:`port` to this host's libnfs client
/// (out of a cluster no node announces itself: `--nfs-clients`).
fn nfs_agent(port: u16) -> Agent {
    let listen = format!("127.0.0.1:{port}");
    Agent::start_with(&[
        ("VOLRING_NFS_LISTEN", &listen),
        ("VOLRING_NFS_GRACE", GRACE),
        ("VOLRING_NFS_LEASE", GRACE),
        ("VOLRING_NFS_CLIENTS", "127.0.0.1"),
    ])
}

/// A shared volume whose export does not squash root (this test's libnfs
/// client writes as root into the filesystem's root directory).
fn create_unsquashed(a: &Agent, name: &str) -> Result<Volume, tonic::Status> {
    let mut c = a.c.controller.clone();
    let r = a.run(c.create_volume(CreateVolumeRequest {
        name: name.into(),
        capacity_range: Some(CapacityRange { required_bytes: 32 * MIB, limit_bytes: 0 }),
        volume_capabilities: vec![rwx("ext4")],
        parameters: [("nfsSquash".to_string(), "none".to_string())].into(),
        ..Default::default()
    }))?;
    Ok(r.into_inner().volume.expect("volume"))
}

/// The owning node exports a staged RWX volume over NFSv4 from the ganesha
/// it supervises: one TCP port on the configured address, only the staged
/// volumes exported, a userspace NFS client reads and writes through it,
/// the server is restarted when killed and when the agent is, the export
/// follows the volume's life, and the store records it.
fn export_served() -> Result<(), Failed> {
    let port = free_port();
    let mut a = nfs_agent(port);
    let v = create_unsquashed(&a, "pvc-nfs")?;
    let server = format!("127.0.0.1:{port}");
    check(v.volume_context.get("nfsServer") == Some(&server), format!("server in the context: {:?}", v.volume_context))?;
    check(v.volume_context.get("nfsExport").map(String::as_str) == Some("/pvc-nfs"), "export path in the context")?;
    a.create("pvc-local", 32 * MIB, "ext4")?;
    let (staging, local) = (a.k("plugins/stage/nfs"), a.k("plugins/stage/local"));
    // A single-node volume staged here is not exported, and starts no server.
    a.stage("pvc-local", &local, mount_cap("ext4"))?;
    check(server_pid(&a).is_none(), "no NFS server without a shared volume")?;
    a.stage("pvc-nfs", &staging, rwx("ext4"))?;
    std::fs::write(format!("{staging}/from-node"), b"written on the owning node\n")?;
    let got = eventually(30, || libnfs("nfs-cat", &[&url(port, "/pvc-nfs/from-node")]))?;
    check(got == b"written on the owning node\n", format!("read over NFS: {:?}", String::from_utf8_lossy(&got)))?;
    // Debian 12's libnfs (4.0) fails NFSv4 writes of more than a few KiB
    // (a client limit: the kernel client in tests/vm/share.rs writes MiBs),
    // so the userspace client writes small files.
    let src = a.scratch.path().join("src");
    let payload: Vec<u8> = (0..1500u32).map(|i| (i * 7 % 251) as u8).collect();
    std::fs::write(&src, &payload)?;
    libnfs("nfs-cp", &[src.to_str().unwrap_or(""), &url(port, "/pvc-nfs/from-client")])?;
    check(std::fs::read(format!("{staging}/from-client"))? == payload, "written over NFS, on the staged filesystem")?;
    // Only the staged shared volume is exported: not the other volume, not
    // the node's root.
    let root = String::from_utf8(libnfs("nfs-ls", &[&url(port, "/")])?)?;
    check(root.contains("pvc-nfs") && !root.contains("pvc-local"), format!("pseudo root lists only pvc-nfs: {root}"))?;
    // One TCP port, on the configured address.
    let pid = server_pid(&a).ok_or("no ganesha pid file")?;
    let socks = listening(pid);
    // ganesha binds an IPv6 socket to the v4-mapped address: `[::ffff:127.0.0.1]:port`.
    let on_loopback = |s: &str| s == format!("127.0.0.1:{port}") || s == format!("[::ffff:127.0.0.1]:{port}");
    check(socks.len() == 1 && on_loopback(&socks[0]), format!("ganesha listens on {socks:?}"))?;
    let conf = std::fs::read_to_string(a.state.join("nfs/ganesha.conf"))?;
    check(conf.contains("Attr_Expiration_Time = 0;") && conf.contains("Protocols = 4;"), "config: v4, attribute cache off")?;
    // The store records the share.
    let recs = share_records(&a)?;
    check(recs.len() == 1 && recs[0]["volumeId"] == "pvc-nfs" && recs[0]["server"] == server.as_str(), format!("records: {recs:?}"))?;
    let export_id = recs[0]["exportId"].clone();

    // The server killed: the agent starts it again (with backoff) and the
    // export answers once its grace period is over.
    rustix::process::kill_process(rustix::process::Pid::from_raw(pid as i32).ok_or("pid 0")?, rustix::process::Signal::KILL)?;
    let got = eventually(60, || {
        let p = server_pid(&a).ok_or("no pid")?;
        if p == pid {
            return Err("not restarted yet".into());
        }
        libnfs("nfs-cat", &[&url(port, "/pvc-nfs/from-node")])
    })?;
    check(got == b"written on the owning node\n", "read after the server's restart")?;

    // The agent killed (the server dies with it) and started again: the
    // export is resumed from the record, with the same export id.
    let before = server_pid(&a);
    let listen = format!("127.0.0.1:{port}");
    a.respawn_with(&[
        ("VOLRING_NFS_LISTEN", &listen),
        ("VOLRING_NFS_GRACE", GRACE),
        ("VOLRING_NFS_LEASE", GRACE),
        ("VOLRING_NFS_CLIENTS", "127.0.0.1"),
    ]);
    let got = eventually(60, || {
        if server_pid(&a) == before {
            return Err("old server".into());
        }
        libnfs("nfs-cat", &[&url(port, "/pvc-nfs/from-client")])
    })?;
    check(got == payload, "read after the agent's restart")?;
    let recs = share_records(&a)?;
    check(recs.len() == 1 && recs[0]["exportId"] == export_id, format!("same export id after a restart: {recs:?}"))?;

    // Unstage: the export goes, then the filesystem (the server let go of it).
    a.unstage("pvc-nfs", &staging)?;
    check(share_records(&a)?.is_empty(), "record removed with the export")?;
    let gone = libnfs("nfs-ls", &[&url(port, "/pvc-nfs")]);
    check(gone.is_err(), format!("the export is gone: {gone:?}"))?;
    a.unstage("pvc-local", &local)?;
    Ok(())
}

/// The agent in a cluster (the API stand-in, tests/kube_support): staging
/// a shared volume makes the Service and EndpointSlice named like its PVC
/// (re-read after each create), publishes `ClusterIP:2049` on the PVC once
/// they are there, and the reconcile's duration is on `/metrics`; another
/// node's NodeStage mounts that endpoint, not the owning node's address,
/// and waits (UNAVAILABLE) while none is published.
fn service_in_a_cluster() -> Result<(), Failed> {
    use kube_support::Server;
    let api_rt = tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build()?;
    let server = api_rt.block_on(Server::start());
    let pvc = serde_json::json!({"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": "data"},
        "spec": {"accessModes": ["ReadWriteMany"]}});
    let pvc = server.api.seed_core("apps", "persistentvolumeclaims", pvc);
    // Created objects stay invisible to the next 2 GETs: only the re-read
    // after the create lets the agent publish.
    server.api.set_create_lag(2);
    let scratch = common::Scratch::new();
    let kc = kubeconfig(scratch.path(), server.addr)?;
    let (port, metrics_port) = (free_port(), free_port());
    // The API server refuses a loopback address in an EndpointSlice: the
    // NFS server listens on loopback and the agent advertises a TEST-NET
    // address (in a cluster: the pod's IP).
    let (listen, metrics) = (format!("127.0.0.1:{port}"), format!("127.0.0.1:{metrics_port}"));
    let advertise = format!("{SERVER_IP}:{port}");
    let api_port = server.addr.port().to_string();
    // In a pod (the service's env), the configuration from KUBECONFIG.
    let cluster = [("KUBECONFIG", kc.as_str()), ("KUBERNETES_SERVICE_HOST", "127.0.0.1"), ("KUBERNETES_SERVICE_PORT", api_port.as_str())];
    let mut env = vec![("VOLRING_NFS_LISTEN", listen.as_str()), ("VOLRING_NFS_GRACE", GRACE), ("VOLRING_NFS_LEASE", GRACE)];
    env.push(("VOLRING_NFS_ADVERTISE", advertise.as_str()));
    env.extend([("VOLRING_NFS_SERVICE_POLL", "0.05"), ("VOLRING_METRICS_ADDR", metrics.as_str())]);
    env.extend(cluster);
    let a = Agent::start_with(&env);
    let mut c = a.c.controller.clone();
    let params = [("csi.storage.k8s.io/pvc/namespace", "apps"), ("csi.storage.k8s.io/pvc/name", "data")];
    let v = a
        .run(c.create_volume(CreateVolumeRequest {
            name: "pvc-svc".into(),
            capacity_range: Some(CapacityRange { required_bytes: 32 * MIB, limit_bytes: 0 }),
            volume_capabilities: vec![rwx("ext4")],
            parameters: params.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect(),
            ..Default::default()
        }))?
        .into_inner()
        .volume
        .ok_or("no volume")?;
    let ctx = v.volume_context.clone();
    check(
        ctx.get("nfsPvcNamespace").map(String::as_str) == Some("apps") && ctx.get("nfsPvcName").map(String::as_str) == Some("data"),
        format!("the PVC in the context: {ctx:?}"),
    )?;
    let annotation = || {
        server
            .api
            .core_object("apps", "persistentvolumeclaims", "data")
            .and_then(|p| p["metadata"]["annotations"]["volring.io/nfs-endpoint"].as_str().map(str::to_string))
    };

    // Another node (a second agent, serving no NFS) stages the volume:
    // nothing is published yet, so it waits.
    let b = Agent::start_with(&cluster);
    let stage_b = |id: &str, staging: &str| {
        let mut n = b.c.node.clone();
        b.run(n.node_stage_volume(NodeStageVolumeRequest {
            volume_id: id.into(),
            staging_target_path: staging.into(),
            volume_capability: Some(rwx("ext4")),
            volume_context: ctx.clone(),
            ..Default::default()
        }))
    };
    let b_staging = b.k("plugins/stage/svc");
    expect_code(stage_b("pvc-svc", &b_staging), Code::Unavailable, "stage before the endpoint is published")?;
    check(server.api.core_object("apps", "services", "data").is_none(), "no Service before the volume is exported")?;

    // The owning node stages it: Service, EndpointSlice, then the annotation.
    // The API server fails the first read of the Service: the loop
    // retries (after 1 s) without another event.
    server.api.inject(kube_support::Fault {
        status: 500,
        retry_after: None,
        method: Some(axum::http::Method::GET),
        path_contains: "/services/data".into(),
        times: 1,
    });
    let staging = a.k("plugins/stage/svc");
    a.stage("pvc-svc", &staging, rwx("ext4"))?;
    let endpoint = eventually(30, || annotation().ok_or_else(|| "not published yet".to_string()))?;
    let failed = server.api.log().iter().filter(|l| l.status == 500).count();
    check(failed == 1, format!("the injected failure was met and retried: {failed}"))?;
    let svc = server.api.core_object("apps", "services", "data").ok_or("no Service")?;
    let ep = server.api.core_object("apps", "endpointslices", "data").ok_or("no EndpointSlice")?;
    let ip = svc["spec"]["clusterIP"].as_str().unwrap_or_default();
    check(endpoint == format!("{ip}:2049"), format!("published {endpoint}, Service {svc}"))?;
    check(svc["spec"]["ports"][0]["targetPort"] == port, format!("the Service targets the NFS port: {svc}"))?;
    check(ep["endpoints"][0]["addresses"][0] == SERVER_IP && ep["ports"][0]["port"] == port, format!("{ep}"))?;
    for o in [&svc, &ep] {
        check(o["metadata"]["ownerReferences"][0]["uid"] == pvc["metadata"]["uid"], format!("owned by the PVC: {o}"))?;
    }
    // The shared-volume controller's requests (core/v1): the publisher's
    // writes of this machine's devices go on beside them.
    let calls: Vec<_> = server.api.log().into_iter().filter(|l| l.path.starts_with("/api/v1/")).collect();
    let created = calls.iter().position(|l| l.method == "POST" && l.path.ends_with("/services")).ok_or("no Service POST")?;
    let reread = calls[created + 1..].iter().take_while(|l| l.method == "GET" && l.path.ends_with("/services/data")).count();
    check(reread >= 3, "the Service re-read until visible")?;
    let patches = calls.iter().filter(|l| l.method == "PATCH" && l.path.ends_with("/persistentvolumeclaims/data")).count();
    check(patches == 1, format!("published once: {patches} PVC patches"))?;
    // Issue 29: the shared-volume loop's requests name the agent's
    // --node-id (the test agents run as `test-node`), as the publisher's do.
    let want = format!("volring/{} (test-node)", env!("CARGO_PKG_VERSION"));
    let all = server.api.log();
    let strangers: Vec<_> = all.iter().filter(|l| l.path.contains("/apps/") && l.user_agent.as_deref() != Some(want.as_str())).collect();
    check(strangers.is_empty(), format!("requests not sent as {want}: {:?}", strangers.iter().map(|l| &l.user_agent).collect::<Vec<_>>()))?;

    // The reconcile's duration on the agent's /metrics.
    let text = a.run(async {
        let mut s = tokio::net::TcpStream::connect(("127.0.0.1", metrics_port)).await?;
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        s.write_all(b"GET /metrics HTTP/1.0\r\nHost: x\r\n\r\n").await?;
        let mut out = String::new();
        s.read_to_string(&mut out).await?;
        Ok::<_, std::io::Error>(out)
    })?;
    let count = text.lines().find(|l| l.starts_with("volring_share_reconcile_duration_seconds_count")).unwrap_or_default();
    check(count.split_whitespace().nth(1).and_then(|n| n.parse::<u64>().ok()).unwrap_or(0) >= 1, format!("histogram: {count:?}"))?;

    // The other node now mounts the Service's endpoint (this machine's
    // kernel has no NFS client, so the mount itself fails, naming it).
    match stage_b("pvc-svc", &b_staging) {
        Err(s) if s.message().contains(&format!("mount {ip}:/pvc-svc")) => {}
        other => return Err(format!("stage on the other node: expected a mount of {ip}:/pvc-svc, got {other:?}").into()),
    }
    // The owning node restarted: nothing republished.
    drop(b);
    let mut a = a;
    a.respawn_with(&env);
    a.stage("pvc-svc", &staging, rwx("ext4"))?;
    std::thread::sleep(std::time::Duration::from_secs(1));
    let patches = server.api.log().iter().filter(|l| l.method == "PATCH" && l.path.ends_with("/persistentvolumeclaims/data")).count();
    check(patches == 1 && annotation() == Some(endpoint), format!("not republished after a restart: {patches} patches"))?;
    a.unstage("pvc-svc", &staging)?;
    drop(api_rt);
    Ok(())
}

/// The addresses (`ip:port`) the volume's EndpointSlice sends clients to
/// (ready or not); `None` while there is no slice.
fn endpoint_addresses(server: &kube_support::Server, name: &str) -> Option<Vec<String>> {
    let slice = server.api.core_object("apps", "endpointslices", name)?;
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

/// "During the move the Service exists but does not answer": whenever the
/// NFS server stops serving the volume from the address in its EndpointSlice —
/// the export removed on this node, the agent stopping, the agent back at
/// a new advertised address whose server does not answer yet — the
/// EndpointSlice is emptied (the Service and its ClusterIP stay), and filled
/// with the advertised address once the server answers (at its listen
/// address: the advertised one is the cluster's view). The server is started
/// through a gate the test opens, so "not answering yet" lasts as long as
/// the test looks.
fn endpoints_follow_the_server() -> Result<(), Failed> {
    use kube_support::Server;
    let api_rt = tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build()?;
    let server = api_rt.block_on(Server::start());
    let pvc = serde_json::json!({"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": "moving"},
        "spec": {"accessModes": ["ReadWriteMany"]}});
    server.api.seed_core("apps", "persistentvolumeclaims", pvc);
    let scratch = common::Scratch::new();
    let kc = kubeconfig(scratch.path(), server.addr)?;
    let gate = scratch.path().join("gate");
    let gated = scratch.path().join("ganesha-gated");
    // Bounded: 60 s at most at the gate.
    std::fs::write(
        &gated,
        format!(
            "#!/bin/sh\ni=0\nwhile [ ! -e '{}' ] && [ $i -lt 600 ]; do sleep 0.1; i=$((i + 1)); done\nexec ganesha.nfsd \"$@\"\n",
            gate.display()
        ),
    )?;
    std::fs::set_permissions(&gated, std::os::unix::fs::PermissionsExt::from_mode(0o755))?;
    std::fs::write(&gate, b"")?;
    let api_port = server.addr.port().to_string();
    let (p1, p2) = (free_port(), free_port());
    // Listening on loopback, advertising TEST-NET addresses (the API
    // server refuses loopback ones in an EndpointSlice).
    let (l1, l2, ganesha) = (format!("127.0.0.1:{p1}"), format!("127.0.0.1:{p2}"), gated.display().to_string());
    let (a1, a2) = (format!("{SERVER_IP}:{p1}"), format!("{MOVED_IP}:{p2}"));
    let env = |listen: &str, advertise: &str| -> Vec<(&str, String)> {
        vec![
            ("VOLRING_NFS_LISTEN", listen.to_string()),
            ("VOLRING_NFS_ADVERTISE", advertise.to_string()),
            ("VOLRING_NFS_GRACE", GRACE.to_string()),
            ("VOLRING_NFS_LEASE", GRACE.to_string()),
            ("VOLRING_NFS_GANESHA", ganesha.clone()),
            ("VOLRING_NFS_SERVICE_POLL", "0.05".to_string()),
            ("KUBECONFIG", kc.clone()),
            ("KUBERNETES_SERVICE_HOST", "127.0.0.1".to_string()),
            ("KUBERNETES_SERVICE_PORT", api_port.clone()),
        ]
    };
    let (e1, e2) = (env(&l1, &a1), env(&l2, &a2));
    let e1: Vec<(&str, &str)> = e1.iter().map(|(k, v)| (*k, v.as_str())).collect();
    let e2: Vec<(&str, &str)> = e2.iter().map(|(k, v)| (*k, v.as_str())).collect();
    let mut a = Agent::start_with(&e1);
    let mut c = a.c.controller.clone();
    let params = [("csi.storage.k8s.io/pvc/namespace", "apps"), ("csi.storage.k8s.io/pvc/name", "moving")];
    a.run(c.create_volume(CreateVolumeRequest {
        name: "pvc-move".into(),
        capacity_range: Some(CapacityRange { required_bytes: 32 * MIB, limit_bytes: 0 }),
        volume_capabilities: vec![rwx("ext4")],
        parameters: params.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect(),
        ..Default::default()
    }))?;
    let staging = a.k("plugins/stage/move");
    let addresses = || endpoint_addresses(&server, "moving");
    let cluster_ip =
        || server.api.core_object("apps", "services", "moving").and_then(|s| s["spec"]["clusterIP"].as_str().map(str::to_string));
    let until = |secs: u64, what: &str, f: &dyn Fn() -> bool| -> Result<(), Failed> {
        eventually(secs, || if f() { Ok(()) } else { Err(format!("{what}: EndpointSlice {:?}", addresses())) }).map_err(Failed::from)
    };
    let only = |addr: &str| Some(vec![addr.to_string()]);

    a.stage("pvc-move", &staging, rwx("ext4"))?;
    until(30, "the EndpointSlice names the server", &|| addresses() == only(&a1))?;
    let ip = cluster_ip().ok_or("no ClusterIP")?;

    // The export removed here: the EndpointSlice empty, the Service stays.
    a.unstage("pvc-move", &staging)?;
    until(10, "the EndpointSlice emptied after the unexport", &|| addresses() == Some(vec![]))?;
    check(cluster_ip().as_deref() == Some(ip.as_str()), "the Service and its ClusterIP kept after the unexport")?;
    a.stage("pvc-move", &staging, rwx("ext4"))?;
    until(30, "the EndpointSlice names the server again", &|| addresses() == only(&a1))?;

    // The agent stops (SIGTERM; its server stops with it): emptied.
    rustix::process::kill_process(rustix::process::Pid::from_raw(a.pid() as i32).ok_or("no agent")?, rustix::process::Signal::TERM)?;
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    while a.alive() {
        check(std::time::Instant::now() < deadline, "the agent did not stop on SIGTERM")?;
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    // Nobody else writes them: emptied before the agent exited.
    check(addresses() == Some(vec![]), format!("the EndpointSlice emptied by the stopping agent: {:?}", addresses()))?;
    check(cluster_ip().as_deref() == Some(ip.as_str()), "the Service and its ClusterIP kept while the agent is away")?;
    a.respawn_with(&e1);
    until(30, "the EndpointSlice names the restarted server", &|| addresses() == only(&a1))?;

    // The agent dies (no chance to empty anything) and comes back at a new
    // address whose server does not answer yet: the old address goes, the
    // new one comes only once its server answers.
    std::fs::remove_file(&gate)?;
    a.kill_hard();
    a.respawn_with(&e2);
    until(20, "the old address out of the EndpointSlice", &|| addresses() == Some(vec![]))?;
    let watch_until = std::time::Instant::now() + std::time::Duration::from_secs(2);
    while std::time::Instant::now() < watch_until {
        check(addresses() == Some(vec![]), format!("the EndpointSlice stays empty while nothing answers at {l2}: {:?}", addresses()))?;
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    check(std::net::TcpStream::connect(&l2).is_err(), "nothing answers at the new address yet")?;
    let svc = server.api.core_object("apps", "services", "moving").ok_or("the Service is gone during the move")?;
    check(svc["spec"]["clusterIP"] == ip.as_str(), format!("the ClusterIP kept during the move: {svc}"))?;
    std::fs::write(&gate, b"")?;
    until(60, "the new address in the EndpointSlice once its server answers", &|| addresses() == only(&a2))?;
    let svc = server.api.core_object("apps", "services", "moving").ok_or("no Service")?;
    check(
        svc["spec"]["clusterIP"] == ip.as_str() && svc["spec"]["ports"][0]["targetPort"] == p2,
        format!("the Service after the move: {svc}"),
    )?;
    let patches = server.api.log().iter().filter(|l| l.method == "PATCH" && l.path.ends_with("/persistentvolumeclaims/moving")).count();
    check(patches == 1, format!("the endpoint was published once: {patches} PVC patches"))?;
    a.unstage("pvc-move", &staging)?;
    drop(api_rt);
    Ok(())
}

/// The reconciler mounts a shared volume again: the NFS server serves the
/// new mount. The case made here: the staging mount goes away while the
/// way to it is covered (so the repair waits), and the server restarts
/// meanwhile — it now exports the empty directory it finds at the path.
/// Once the cover is gone the reconciler mounts the volume again, and
/// clients must see the volume's files, not that directory.
fn export_follows_a_repair() -> Result<(), Failed> {
    use rustix::mount::{mount_bind, unmount, UnmountFlags};
    let port = free_port();
    let a = nfs_agent(port);
    create(&a, "pvc-rep", vec![rwx("ext4")])?;
    let staging = a.k("plugins/stage/rep/mnt");
    a.stage("pvc-rep", &staging, rwx("ext4"))?;
    std::fs::write(format!("{staging}/kept"), b"on the volume\n")?;
    let got = eventually(30, || libnfs("nfs-cat", &[&url(port, "/pvc-rep/kept")]))?;
    check(got == b"on the volume\n", "read over NFS before")?;

    // Cover the staging path's parent with an empty directory, then detach
    // the staging mount beneath the cover (through a descriptor of it).
    let cover = a.scratch.dir("cover").display().to_string();
    std::fs::create_dir_all(format!("{cover}/mnt"))?;
    let held = std::fs::File::open(&staging)?;
    let parent = a.k("plugins/stage/rep");
    mount_bind(cover.as_str(), parent.as_str())?;
    let via_fd = format!("/proc/self/fd/{}", std::os::fd::AsRawFd::as_raw_fd(&held));
    unmount(via_fd.as_str(), UnmountFlags::DETACH)?;
    drop(held);
    // The server restarts while the volume is not there.
    let pid = server_pid(&a).ok_or("no ganesha pid")?;
    rustix::process::kill_process(rustix::process::Pid::from_raw(pid as i32).ok_or("pid 0")?, rustix::process::Signal::KILL)?;
    let listing = eventually(60, || {
        if server_pid(&a).is_none_or(|p| p == pid) {
            return Err("not restarted yet".into());
        }
        libnfs("nfs-ls", &[&url(port, "/pvc-rep")])
    })?;
    check(!String::from_utf8_lossy(&listing).contains("kept"), "while covered, the server serves the empty directory")?;

    // The cover goes (detached: the server holds it); the reconciler
    // mounts the volume again, and the server must serve it.
    unmount(parent.as_str(), UnmountFlags::DETACH)?;
    let got = eventually(60, || libnfs("nfs-cat", &[&url(port, "/pvc-rep/kept")]));
    let log = a.log_tail(40);
    check(got.as_deref() == Ok(b"on the volume\n".as_slice()), format!("read over NFS after the repair: {got:?}\n{log}"))?;
    check(log.contains("repaired"), "the reconciler repaired the mount")?;
    a.unstage("pvc-rep", &staging)?;
    Ok(())
}

/// The address the agent advertises in the cluster tests, and the one it
/// moves to: TEST-NET-1 (RFC 5737), which the API server accepts in an
/// EndpointSlice (it refuses loopback addresses) and which these tests
/// never connect to — the agent checks that its server answers at its
/// listen address, and other nodes mount the Service's ClusterIP.
const SERVER_IP: &str = "192.0.2.1";
const MOVED_IP: &str = "192.0.2.2";

fn main() {
    let trials = vec![
        Trial::test("share::access_modes", access_modes),
        Trial::test("share::export_served", export_served),
        Trial::test("share::service_in_a_cluster", service_in_a_cluster),
        Trial::test("share::export_follows_a_repair", export_follows_a_repair),
        Trial::test("share::endpoints_follow_the_server", endpoints_follow_the_server),
    ];
    common::run_in_private_namespace(trials)
}
