//! Staged volumes and their devices, bounded messages for huge fields, and
//! a shutdown that waits for work a client gave up on.

use super::*;

/// A staged volume's device carries its CSI volume id on /metrics
/// (`volring_device_info{csi_volume=...}`), and loses it once unstaged.
/// (Before: `Inventory::mark_volume` was never called; csi_volume was
/// always empty.)
pub(super) fn staged_volumes_mark_their_devices() -> Result<(), Failed> {
    let site = Site::new();
    let port = std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
    let addr: std::net::SocketAddr = ([127, 0, 0, 1], port).into();
    let (mut p, c) = site.start("state", "csi.sock", &["--metrics-addr", &addr.to_string()])?;
    let (mut ctl, mut node) = (c.controller.clone(), c.node.clone());
    let staging = site.scratch.dir("kubelet").join("plugins/stage/pvc-mark").display().to_string();
    site.rt.block_on(async {
        ctl.create_volume(CreateVolumeRequest {
            name: "pvc-mark".into(),
            capacity_range: Some(CapacityRange { required_bytes: 64 << 20, limit_bytes: 0 }),
            volume_capabilities: vec![capability(false, "ext4", &[], Mode::SingleNodeWriter)],
            parameters: [("fsType".to_string(), "ext4".to_string())].into(),
            ..Default::default()
        })
        .await?;
        node.node_stage_volume(NodeStageVolumeRequest {
            volume_id: "pvc-mark".into(),
            staging_target_path: staging.clone(),
            volume_capability: Some(capability(false, "ext4", &[], Mode::SingleNodeWriter)),
            ..Default::default()
        })
        .await?;
        Ok::<_, tonic::Status>(())
    })?;
    let marked = |want: bool| -> Result<(), Failed> {
        let deadline = Instant::now() + patience();
        loop {
            let body = http_get(addr, "/metrics")?;
            let has = body.lines().any(|l| l.starts_with("volring_device_info{") && l.contains("csi_volume=\"pvc-mark\""));
            if has == want {
                return Ok(());
            }
            let info: Vec<&str> = body.lines().filter(|l| l.starts_with("volring_device_info{")).collect();
            check(Instant::now() < deadline, format!("csi_volume=\"pvc-mark\" present: {has}, wanted {want}:\n{}", info.join("\n")))?;
            std::thread::sleep(Duration::from_millis(50));
        }
    };
    marked(true)?;
    site.rt.block_on(node.node_unstage_volume(NodeUnstageVolumeRequest { volume_id: "pvc-mark".into(), staging_target_path: staging }))?;
    marked(false)?;
    site.rt.block_on(ctl.delete_volume(DeleteVolumeRequest { volume_id: "pvc-mark".into(), ..Default::default() }))?;
    check(p.stop().is_some_and(|s| s.success()), "the agent stops cleanly")
}

/// Every RPC answers a huge field with its code and a short message (the
/// message travels in a header, and clients drop replies with huge ones).
pub(super) fn huge_fields_get_short_messages() -> Result<(), Failed> {
    use tonic::Code;
    let site = Site::new();
    let (mut p, c) = site.start("state", "csi.sock", &[])?;
    let huge = "x".repeat(3 << 20);
    let staging = site.scratch.dir("kubelet").join("plugins/stage/pvc-big").display().to_string();
    let target = site.scratch.dir("kubelet").join("pods/p/pvc-big").display().to_string();
    let huge_fs = capability(false, &huge, &[], Mode::SingleNodeWriter);
    let (mut ctl, mut node) = (c.controller.clone(), c.node.clone());
    let results: Vec<(&str, Code, Result<(), tonic::Status>)> = site.rt.block_on(async {
        vec![
            (
                "ListVolumes starting_token",
                Code::Aborted,
                ctl.list_volumes(ListVolumesRequest { starting_token: huge.clone(), ..Default::default() }).await.map(drop),
            ),
            (
                "CreateVolume parameter",
                Code::InvalidArgument,
                ctl.create_volume(CreateVolumeRequest {
                    name: "pvc-big".into(),
                    capacity_range: Some(CapacityRange { required_bytes: 32 << 20, limit_bytes: 0 }),
                    volume_capabilities: vec![capability(false, "ext4", &[], Mode::SingleNodeWriter)],
                    parameters: [(huge.clone(), "v".to_string())].into(),
                    ..Default::default()
                })
                .await
                .map(drop),
            ),
            (
                "NodeStageVolume fs_type",
                Code::InvalidArgument,
                node.node_stage_volume(NodeStageVolumeRequest {
                    volume_id: "pvc-big".into(),
                    staging_target_path: staging.clone(),
                    volume_capability: Some(huge_fs.clone()),
                    ..Default::default()
                })
                .await
                .map(drop),
            ),
            (
                "NodePublishVolume fs_type",
                Code::InvalidArgument,
                node.node_publish_volume(NodePublishVolumeRequest {
                    volume_id: "pvc-big".into(),
                    staging_target_path: staging.clone(),
                    target_path: target.clone(),
                    volume_capability: Some(huge_fs.clone()),
                    ..Default::default()
                })
                .await
                .map(drop),
            ),
        ]
    });
    for (what, want, r) in results {
        match r {
            Err(s) if s.code() == want && s.message().len() <= 1024 => {}
            Err(s) => {
                return Err(format!("{what}: {:?} with a {}-byte message; wanted {want:?}, short", s.code(), s.message().len()).into())
            }
            Ok(()) => return Err(format!("{what}: succeeded").into()),
        }
    }
    check(site.rt.block_on(probe(&site.path("csi.sock"))).is_some(), "the agent still answers")?;
    check(p.stop().is_some_and(|s| s.success()), "the agent stops cleanly")
}

/// Where `program` is on PATH.
fn which(program: &str) -> Option<PathBuf> {
    std::env::split_paths(&std::env::var_os("PATH")?).map(|d| d.join(program)).find(|p| p.is_file())
}

/// Creates its file when dropped: opens a gate also when a test fails.
struct OpenOnDrop(PathBuf);

impl Drop for OpenOnDrop {
    fn drop(&mut self) {
        let _ = std::fs::write(&self.0, b"");
    }
}

/// kubelet gives up on a stage (its deadline passes) while the stage's
/// mkfs still runs; then the agent is told to stop. It must wait for the
/// stage to finish, keeping its socket until then, not drop it halfway.
/// mkfs.ext4 is a wrapper (first on the agent's PATH) that waits for the
/// test to open a gate, so the stage is slow for exactly as long as needed.
pub(super) fn shutdown_waits_for_work_a_client_gave_up_on() -> Result<(), Failed> {
    use std::os::unix::fs::PermissionsExt;
    let site = Site::new();
    let real = which("mkfs.ext4").ok_or("mkfs.ext4 not found")?;
    let bin = site.scratch.dir("bin");
    let gate = site.scratch.dir("gate");
    let script = format!(
        "#!/bin/sh\n: > '{g}/started'\ni=0\nwhile [ ! -e '{g}/go' ] && [ $i -lt 600 ]; do sleep 0.05; i=$((i+1)); done\nexec '{real}' \"$@\"\n",
        g = gate.display(),
        real = real.display()
    );
    std::fs::write(bin.join("mkfs.ext4"), script)?;
    std::fs::set_permissions(bin.join("mkfs.ext4"), std::fs::Permissions::from_mode(0o755))?;
    let _gate = OpenOnDrop(gate.join("go"));
    let mut cmd = site.node("state", "csi.sock", &[]);
    cmd.env("PATH", format!("{}:{}", bin.display(), std::env::var("PATH").unwrap_or_default()));
    let mut p = Proc::spawn(&mut cmd);
    let c = site.ready(&mut p, &site.path("csi.sock"))?;
    let (mut ctl, mut node) = (c.controller.clone(), c.node.clone());
    let staging = site.scratch.dir("kubelet").join("plugins/stage/pvc-slow");
    let staged = site.rt.block_on(async {
        ctl.create_volume(CreateVolumeRequest {
            name: "pvc-slow".into(),
            capacity_range: Some(CapacityRange { required_bytes: 64 << 20, limit_bytes: 0 }),
            volume_capabilities: vec![capability(false, "ext4", &[], Mode::SingleNodeWriter)],
            parameters: [("fsType".to_string(), "ext4".to_string())].into(),
            ..Default::default()
        })
        .await?;
        let mut req = tonic::Request::new(NodeStageVolumeRequest {
            volume_id: "pvc-slow".into(),
            staging_target_path: staging.display().to_string(),
            volume_capability: Some(capability(false, "ext4", &[], Mode::SingleNodeWriter)),
            ..Default::default()
        });
        req.set_timeout(Duration::from_millis(300));
        Ok::<_, tonic::Status>(node.node_stage_volume(req).await)
    })?;
    check(staged.is_err(), "the stage finished within the deadline; the gate did not hold mkfs")?;
    let deadline = Instant::now() + patience();
    while !gate.join("started").exists() {
        check(Instant::now() < deadline, "the stage never reached mkfs")?;
        std::thread::sleep(Duration::from_millis(10));
    }
    p.signal(rustix::process::Signal::TERM);
    // Either the agent says it waits for the call, or it goes on stopping.
    loop {
        if p.stderr.find(&["waiting for running CSI calls"]).is_some() {
            break;
        }
        let gone = p.stderr.find(&["stopped", "cpu_ms"]).is_some() || !site.path("csi.sock").exists() || p.exited().is_some();
        check(!gone, format!("the agent stopped while a stage it started was still running:\n{}", p.stderr.text()))?;
        check(Instant::now() < deadline, "the agent neither waited nor stopped")?;
        std::thread::sleep(Duration::from_millis(10));
    }
    check(site.path("csi.sock").exists(), "the socket went before the running call ended")?;
    std::fs::write(gate.join("go"), b"")?;
    let status = p.wait().ok_or("the agent did not stop after the stage")?;
    check(status.success(), format!("exit status {status}"))?;
    let done = p.stderr.find(&["NodeStageVolume", "pvc-slow", "ok"]).ok_or("the stage's outcome was not logged")?;
    let stopped = p.stderr.find(&["stopped", "cpu_ms"]).ok_or("no stopped line")?;
    check(done < stopped, "the agent said it stopped before the stage ended")?;
    let mounted = common_mounts_under(&staging);
    check(!mounted.is_empty(), "the stage did not complete: nothing mounted at the staging path")
}
