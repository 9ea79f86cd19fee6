//! A shared volume in a cluster (the API stand-in): its Service and
//! EndpointSlice, and endpoints that follow the server when it moves.

use super::*;

/// The agent in a cluster (the API stand-in, tests/kube_support): staging
/// a shared volume makes the Service and EndpointSlice named like its PVC
/// (re-read after each create), publishes `ClusterIP:2049` on the PVC once
/// they are there, and the reconcile's duration is on `/metrics`; another
/// node's NodeStage mounts that endpoint, not the owning node's address,
/// and waits (UNAVAILABLE) while none is published.
pub(super) fn service_in_a_cluster() -> Result<(), Failed> {
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
pub(super) fn endpoints_follow_the_server() -> Result<(), Failed> {
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
