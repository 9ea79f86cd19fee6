//! The CSI spec's error codes for bad and out-of-order calls, and
//! concurrent calls on one volume.

use super::*;

pub(super) fn error_codes() -> Result<(), Failed> {
    let a = Agent::start();
    let staging = a.k("plugins/stage/v");
    let target = a.k("pods/p/v");
    a.create("pvc-e", 32 * MIB, "")?;
    // Bad fields.
    expect_code(a.stage("../../etc", &staging, mount_cap("")), Code::InvalidArgument, "id with ..")?;
    expect_code(a.stage("", &staging, mount_cap("")), Code::InvalidArgument, "empty id")?;
    expect_code(a.stage("pvc-e", &a.k("plugins/../../../etc"), mount_cap("")), Code::InvalidArgument, "staging path with ..")?;
    expect_code(a.stage("pvc-e", "/etc/volring", mount_cap("")), Code::InvalidArgument, "staging path outside the root")?;
    expect_code(a.stage("pvc-e", "relative/path", mount_cap("")), Code::InvalidArgument, "relative staging path")?;
    expect_code(a.stage("pvc-e", &staging, VolumeCapability::default()), Code::InvalidArgument, "capability without access")?;
    expect_code(a.stage("pvc-e", &staging, capability(false, "", &[], Mode::MultiNodeSingleWriter)), Code::InvalidArgument, "multi-node")?;
    expect_code(a.stage("pvc-e", &staging, capability(true, "", &[], Mode::MultiNodeMultiWriter)), Code::InvalidArgument, "block RWX")?;
    expect_code(a.stage("pvc-e", &staging, mount_cap("vfat")), Code::InvalidArgument, "unsupported fs")?;
    expect_code(
        a.stage("pvc-e", &staging, capability(false, "", &["bind".into()], Mode::SingleNodeWriter)),
        Code::InvalidArgument,
        "bind flag",
    )?;
    // A symlink inside the root that leads out of it.
    std::os::unix::fs::symlink("/etc", a.kubelet.join("escape"))?;
    expect_code(a.stage("pvc-e", &a.k("escape/x"), mount_cap("")), Code::InvalidArgument, "symlink out of the root")?;
    // Unknown volumes.
    expect_code(a.stage("pvc-nope", &staging, mount_cap("")), Code::NotFound, "stage unknown")?;
    expect_code(a.unstage("pvc-nope", &staging), Code::NotFound, "unstage unknown")?;
    expect_code(a.unpublish("pvc-nope", &target), Code::NotFound, "unpublish unknown")?;
    expect_code(a.stats("pvc-nope", &target), Code::NotFound, "stats unknown")?;
    expect_code(a.expand("pvc-nope", 64 * MIB, mount_cap("")), Code::NotFound, "expand unknown")?;
    // Order.
    expect_code(a.publish("pvc-e", &staging, &target, mount_cap(""), false), Code::FailedPrecondition, "publish before stage")?;
    a.stage("pvc-e", &staging, mount_cap(""))?;
    expect_code(a.stage("pvc-e", &a.k("plugins/stage/other"), mount_cap("")), Code::FailedPrecondition, "stage elsewhere")?;
    expect_code(a.stage("pvc-e", &staging, block_cap()), Code::AlreadyExists, "stage again as block")?;
    expect_code(a.publish("pvc-e", &staging, &target, block_cap(), false), Code::FailedPrecondition, "publish block of a mount stage")?;
    expect_code(a.delete("pvc-e"), Code::FailedPrecondition, "delete while staged")?;
    expect_code(a.stats("pvc-e", &a.k("pods/elsewhere")), Code::NotFound, "stats at a path it is not at")?;
    expect_code(a.unstage("pvc-e", &a.k("plugins/stage/other")), Code::NotFound, "unstage at a path it is not at")?;
    expect_code(a.node_expand("pvc-e", &a.k("pods/elsewhere"), 0), Code::NotFound, "node expand at a path it is not at")?;
    a.publish("pvc-e", &staging, &target, mount_cap(""), false)?;
    expect_code(a.unstage("pvc-e", &staging), Code::FailedPrecondition, "unstage while published")?;
    a.unpublish("pvc-e", &target)?;
    a.unstage("pvc-e", &staging)?;
    // Sizes.
    expect_code(a.create("pvc-e", 64 * MIB, ""), Code::AlreadyExists, "same name, other size")?;
    expect_code(a.create("pvc-e", 32 * MIB, "xfs"), Code::AlreadyExists, "same name, other fs")?;
    expect_code(
        a.expand("pvc-e", 16 * MIB, mount_cap("")).map(drop).and_then(|_| {
            let mut c = a.c.controller.clone();
            a.run(c.controller_expand_volume(ControllerExpandVolumeRequest {
                volume_id: "pvc-e".into(),
                capacity_range: Some(CapacityRange { required_bytes: 0, limit_bytes: 16 * MIB }),
                ..Default::default()
            }))
            .map(drop)
        }),
        Code::OutOfRange,
        "shrink",
    )?;
    let mut c = a.c.controller.clone();
    expect_code(
        a.run(c.create_volume(CreateVolumeRequest {
            name: "pvc-tiny".into(),
            capacity_range: Some(CapacityRange { required_bytes: 0, limit_bytes: MIB }),
            volume_capabilities: vec![mount_cap("")],
            ..Default::default()
        })),
        Code::OutOfRange,
        "below the smallest volume",
    )?;
    expect_code(a.create("bad/name", MIB, ""), Code::InvalidArgument, "name with a slash")?;
    expect_code(
        a.run(c.list_volumes(ListVolumesRequest { max_entries: 1, starting_token: "not a token!".into() })),
        Code::Aborted,
        "bad starting token",
    )?;
    expect_code(
        a.run(c.controller_publish_volume(ControllerPublishVolumeRequest { volume_id: "pvc-e".into(), ..Default::default() })),
        Code::Unimplemented,
        "controller publish",
    )?;
    // A volume holding something that is not a filesystem is never formatted,
    // and the failed stage leaves nothing attached.
    a.create("pvc-junk", 32 * MIB, "")?;
    std::fs::OpenOptions::new().write(true).open(a.image("pvc-junk"))?.write_all_at(b"precious bytes", 2048)?;
    expect_code(a.stage("pvc-junk", &a.k("plugins/stage/junk"), mount_cap("")), Code::FailedPrecondition, "non-blank volume")?;
    // A volume formatted ext4 is not reformatted as xfs.
    let other = a.k("plugins/stage/fs");
    a.create("pvc-fs", 320 * MIB, "")?;
    a.stage("pvc-fs", &other, mount_cap("ext4"))?;
    a.unstage("pvc-fs", &other)?;
    expect_code(a.stage("pvc-fs", &other, mount_cap("xfs")), Code::FailedPrecondition, "xfs over ext4")?;
    let mut head = vec![0u8; 64];
    std::fs::File::open(a.image("pvc-junk"))?.read_exact_at(&mut head, 2048)?;
    check(head.starts_with(b"precious bytes"), "refused volume untouched")?;
    all_gone(&a)
}

pub(super) fn concurrent_calls_on_one_volume() -> Result<(), Failed> {
    let a = Agent::start();
    a.create("pvc-race", 64 * MIB, "")?;
    a.create("pvc-other", 64 * MIB, "")?;
    let staging = a.k("plugins/stage/race");
    let results = a.run(async {
        let mut calls = Vec::new();
        for _ in 0..8 {
            let mut n = a.c.node.clone();
            let req = NodeStageVolumeRequest {
                volume_id: "pvc-race".into(),
                staging_target_path: staging.clone(),
                volume_capability: Some(mount_cap("")),
                ..Default::default()
            };
            calls.push(tokio::spawn(async move { n.node_stage_volume(req).await.map(drop) }));
        }
        // A different volume at the same time is not held up.
        let mut n = a.c.node.clone();
        let other = NodeStageVolumeRequest {
            volume_id: "pvc-other".into(),
            staging_target_path: a.k("plugins/stage/other"),
            volume_capability: Some(mount_cap("")),
            ..Default::default()
        };
        let other = tokio::spawn(async move { n.node_stage_volume(other).await.map(drop) });
        let mut out = Vec::new();
        for c in calls {
            out.push(c.await.expect("task"));
        }
        (out, other.await.expect("task"))
    });
    let (results, other) = results;
    let ok = results.iter().filter(|r| r.is_ok()).count();
    let aborted = results.iter().filter(|r| code((*r).clone()) == Some(Code::Aborted)).count();
    check(ok >= 1 && aborted >= 1 && ok + aborted == 8, format!("{ok} succeeded, {aborted} aborted of 8: {results:?}"))?;
    check(other.is_ok(), format!("other volume: {other:?}"))?;
    a.unstage("pvc-race", &staging)?;
    a.unstage("pvc-other", &a.k("plugins/stage/other"))?;
    all_gone(&a)
}
