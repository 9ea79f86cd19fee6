//! Shared (ReadWriteMany) volumes through the CSI socket of a real
//! `volring node`: the access-mode checks, and the NFS export the owning
//! node serves (read and written with libnfs's userspace client, since
//! this machine's kernel has no NFS client; the kernel client runs in the
//! VM test, tests/vm_share.rs).

mod common;
mod csi_support;

use common::check;
use csi_support::{mount_cap, Agent, MIB};
use libtest_mimic::{Failed, Trial};
use tonic::Code;
use volring::csi::client::capability;
use volring::csi::proto::volume_capability::access_mode::Mode;
use volring::csi::proto::*;

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
/// with a message (ValidateVolumeCapabilities, as the spec has it); the
/// single-node modes as before.
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
    // Single-node stage unchanged.
    let s2 = a.k("plugins/stage/single");
    a.stage("pvc-single", &s2, mount_cap("ext4"))?;
    a.unstage("pvc-single", &s2)?;
    Ok(())
}

fn main() {
    let trials = vec![Trial::test("share::access_modes", access_modes)];
    common::run_in_private_namespace(trials)
}
