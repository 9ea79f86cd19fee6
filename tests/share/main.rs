//! Shared (ReadWriteMany) volumes through the CSI socket of a real
//! `volring node`: the access-mode checks, and the NFS export the owning
//! node serves (read and written with libnfs's userspace client, since
//! this machine's kernel has no NFS client; the kernel client runs in the
//! VM test, tests/vm/share.rs).
//! The tests live in one module per theme; this file holds the agents and
//! calls they share and the list of trials.

#[path = "../common/mod.rs"]
mod common;
#[path = "../csi_support/mod.rs"]
mod csi_support;
#[path = "../kube_support/mod.rs"]
mod kube_support;
#[path = "../share_support/mod.rs"]
mod share_support;

mod access;
mod cluster;
mod export;

use common::check;
use csi_support::{mount_cap, Agent, MIB};
use libtest_mimic::{Failed, Trial};
use share_support::{eventually, free_port, kubeconfig, libnfs, url};
use tonic::Code;
use volring_csi::client::capability;
use volring_csi::proto::volume_capability::access_mode::Mode;
use volring_csi::proto::*;

use access::access_modes;
use cluster::{endpoints_follow_the_server, service_in_a_cluster};
use export::{export_follows_a_repair, export_served};

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
