//! Which access modes a volume may be created, validated and staged with.

use super::*;

/// MULTI_NODE_MULTI_WRITER: accepted for mount volumes by CreateVolume,
/// ValidateVolumeCapabilities and NodeStage; refused for block volumes
/// with INVALID_ARGUMENT (CreateVolume, NodeStage) or an unconfirmed reply
/// with a message (ValidateVolumeCapabilities, as the spec has it); on a
/// volume created single-node, refused by NodeStage and NodePublish with
/// FAILED_PRECONDITION; the single-node modes as before.
pub(super) fn access_modes() -> Result<(), Failed> {
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
