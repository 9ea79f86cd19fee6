//! Issue 27: a shared volume's NFS export admits only the nodes that staged
//! it. Two agents against the API stand-in: A owns and exports the volume,
//! B stages it from A (this machine's kernel has no NFS client, so B's
//! mount itself fails, after B made itself known). This host's libnfs
//! client connects from 127.0.0.1, B's announced address: before B's
//! stage it is refused and does not see the volume in the pseudo root,
//! after it reads (root squashed), and after B's unstage it is refused
//! again while another node's admission stays.

mod common;
mod csi_support;
mod kube_support;
mod share_support;

use common::check;
use csi_support::{Agent, MIB};
use libtest_mimic::{Failed, Trial};
use share_support::{eventually, free_port, kubeconfig, libnfs, url};
use tonic::Code;
use volring_csi::client::capability;
use volring_csi::proto::volume_capability::access_mode::Mode;
use volring_csi::proto::*;

const VOLUME: &str = "pvc-acl";

fn rwx() -> VolumeCapability {
    capability(false, "ext4", &[], Mode::MultiNodeMultiWriter)
}

/// The nodes A's share record admits (node → address).
fn admitted(a: &Agent) -> Result<serde_json::Value, Failed> {
    let c = volring_volumes::store::Store::read_only(&a.state.join("state.redb"), false)?;
    let rec = c.published.iter().find(|(k, _)| k.as_str() == format!("NfsShare/{VOLUME}")).ok_or("no share record")?;
    let v: serde_json::Value = serde_json::from_slice(&rec.1)?;
    Ok(v["clients"].clone())
}

fn clients_follow_stage_and_unstage() -> Result<(), Failed> {
    use kube_support::Server;
    let api_rt = tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build()?;
    let server = api_rt.block_on(Server::start());
    let pvc = serde_json::json!({"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": "acl"},
        "spec": {"accessModes": ["ReadWriteMany"]}});
    server.api.seed_core("apps", "persistentvolumeclaims", pvc);
    let scratch = common::Scratch::new();
    let kc = kubeconfig(scratch.path(), server.addr)?;
    let port = free_port();
    let (listen, advertise, api_port) = (format!("127.0.0.1:{port}"), format!("192.0.2.1:{port}"), server.addr.port().to_string());
    let cluster = [("KUBECONFIG", kc.as_str()), ("KUBERNETES_SERVICE_HOST", "127.0.0.1"), ("KUBERNETES_SERVICE_PORT", api_port.as_str())];
    // A: no --nfs-clients; only announced nodes get in.
    let mut env_a = vec![("VOLRING_NFS_LISTEN", listen.as_str()), ("VOLRING_NFS_ADVERTISE", advertise.as_str())];
    env_a.extend([("VOLRING_NFS_GRACE", "5"), ("VOLRING_NFS_LEASE", "5"), ("VOLRING_NFS_SERVICE_POLL", "0.05")]);
    env_a.extend(cluster);
    let a = Agent::start_with(&env_a);
    let mut c = a.c.controller.clone();
    let params = [("csi.storage.k8s.io/pvc/namespace", "apps"), ("csi.storage.k8s.io/pvc/name", "acl")];
    let v = a
        .run(c.create_volume(CreateVolumeRequest {
            name: VOLUME.into(),
            capacity_range: Some(CapacityRange { required_bytes: 32 * MIB, limit_bytes: 0 }),
            volume_capabilities: vec![rwx()],
            parameters: params.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect(),
            ..Default::default()
        }))?
        .into_inner()
        .volume
        .ok_or("no volume")?;
    // A squash the server has no word for is refused at creation.
    let bad = a.run(c.create_volume(CreateVolumeRequest {
        name: "pvc-bad-squash".into(),
        capacity_range: Some(CapacityRange { required_bytes: 32 * MIB, limit_bytes: 0 }),
        volume_capabilities: vec![rwx()],
        parameters: [("nfsSquash".to_string(), "no_root_squash".to_string())].into(),
        ..Default::default()
    }));
    check(bad.as_ref().is_err_and(|s| s.code() == Code::InvalidArgument), format!("nfsSquash no_root_squash: {bad:?}"))?;
    let staging = a.k("plugins/stage/acl");
    a.stage(VOLUME, &staging, rwx())?;
    std::fs::write(format!("{staging}/kept"), b"on the volume\n")?;
    let annotations = || {
        server.api.core_object("apps", "persistentvolumeclaims", "acl").map(|p| p["metadata"]["annotations"].clone()).unwrap_or_default()
    };

    // Nobody announced: the server answers (its pseudo root lists), but
    // shows this client nothing and refuses the export.
    let root = eventually(30, || libnfs("nfs-ls", &[&url(port, "/")]))?;
    check(!String::from_utf8_lossy(&root).contains(VOLUME), format!("the pseudo root shows a client not in the list: {root:?}"))?;
    // Refused as if there were no such export (not the grace period's
    // refusal, which would say NFS4ERR_GRACE).
    let refused = libnfs("nfs-cat", &[&url(port, &format!("/{VOLUME}/kept"))]);
    check(refused.as_ref().is_err_and(|e| e.contains("NOENT")), format!("a client not in the list: {refused:?}"))?;

    // Another node announces itself: admitted and answered, and still not
    // this client.
    server.api.edit_core("apps", "persistentvolumeclaims", "acl", |p| {
        p["metadata"]["annotations"]["nfs-client.volring.io/node-c"] = "192.0.2.77".into();
    });
    eventually(30, || {
        (annotations()["nfs-admitted.volring.io/node-c"] == "192.0.2.77").then_some(()).ok_or_else(|| format!("{}", annotations()))
    })?;
    check(admitted(&a)? == serde_json::json!({"node-c": "192.0.2.77"}), format!("A admits {}", admitted(&a)?))?;
    // While nothing changes, A asks the API server nothing about the PVC:
    // it watches it (the old owner read it every --nfs-service-poll, here
    // 50 ms: ~40 GETs in these 2 s).
    let quiet_from = std::time::Instant::now();
    std::thread::sleep(std::time::Duration::from_secs(2));
    let reads: Vec<String> = server
        .api
        .log()
        .into_iter()
        .filter(|l| l.started >= quiet_from && l.path.starts_with("/api/v1/namespaces/apps/persistentvolumeclaims"))
        .map(|l| format!("{} {}?{}", l.method, l.path, l.query))
        .collect();
    check(reads.iter().all(|r| r.contains("watch=true")), format!("requests for the PVC while nothing changed: {reads:?}"))?;
    let root = String::from_utf8(libnfs("nfs-ls", &[&url(port, "/")])?)?;
    check(!root.contains(VOLUME), format!("the pseudo root shows the volume to a client not in the list: {root}"))?;

    // B (announcing 127.0.0.1) stages it: UNAVAILABLE until A admits it,
    // then the mount (which this kernel cannot do).
    let mut env_b = vec![("VOLRING_NFS_CLIENT_ADDRESS", "127.0.0.1")];
    env_b.extend(cluster);
    let b = Agent::start_with(&env_b);
    let b_staging = b.k("plugins/stage/acl");
    let stage_b = || {
        let mut n = b.c.node.clone();
        b.run(n.node_stage_volume(NodeStageVolumeRequest {
            volume_id: VOLUME.into(),
            staging_target_path: b_staging.clone(),
            volume_capability: Some(rwx()),
            volume_context: v.volume_context.clone(),
            ..Default::default()
        }))
    };
    eventually(30, || match stage_b() {
        Err(s) if s.code() == Code::Unavailable => Err(format!("not admitted yet: {}", s.message())),
        Err(s) if s.message().contains("mount ") => Ok(()),
        other => Err(format!("B's stage: {other:?}")),
    })?;
    check(
        annotations()["nfs-client.volring.io/test-node"] == "127.0.0.1"
            && annotations()["nfs-admitted.volring.io/test-node"] == "127.0.0.1",
        format!("B announced and admitted: {}", annotations()),
    )?;
    let got = eventually(30, || libnfs("nfs-cat", &[&url(port, &format!("/{VOLUME}/kept"))]))?;
    check(got == b"on the volume\n", "read by an admitted client")?;
    let root = String::from_utf8(libnfs("nfs-ls", &[&url(port, "/")])?)?;
    check(root.contains(VOLUME), format!("the pseudo root shows the volume to an admitted client: {root}"))?;
    // Root is squashed by default: the client's root cannot write into the
    // root-owned directory, and what it writes where it may is not root's.
    let src = scratch.path().join("src");
    std::fs::write(&src, b"from the client\n")?;
    let to = |name: &str| url(port, &format!("/{VOLUME}/{name}"));
    check(libnfs("nfs-cp", &[src.to_str().unwrap_or(""), &to("as-root")]).is_err(), "root not squashed")?;
    std::fs::create_dir(format!("{staging}/open"))?;
    std::fs::set_permissions(format!("{staging}/open"), std::os::unix::fs::PermissionsExt::from_mode(0o1777))?;
    libnfs("nfs-cp", &[src.to_str().unwrap_or(""), &to("open/squashed")])?;
    let uid = std::os::unix::fs::MetadataExt::uid(&std::fs::metadata(format!("{staging}/open/squashed"))?);
    check(uid != 0, format!("the client's root wrote as uid {uid}"))?;

    // B unstages: its announcement goes, A drops 127.0.0.1 and keeps
    // node-c, and this client is refused again.
    let mut n = b.c.node.clone();
    b.run(n.node_unstage_volume(NodeUnstageVolumeRequest { volume_id: VOLUME.into(), staging_target_path: b_staging.clone() }))?;
    check(annotations().get("nfs-client.volring.io/test-node").is_none(), format!("B's announcement stays: {}", annotations()))?;
    eventually(30, || {
        let now = admitted(&a).map_err(|e| format!("{e:?}"))?;
        (now == serde_json::json!({"node-c": "192.0.2.77"})).then_some(()).ok_or_else(|| format!("A admits {now}"))
    })?;
    eventually(30, || {
        let gone = annotations().get("nfs-admitted.volring.io/test-node").is_none();
        gone.then_some(()).ok_or_else(|| format!("A's answer to B stays: {}", annotations()))
    })?;
    check(annotations()["nfs-admitted.volring.io/node-c"] == "192.0.2.77", "node-c's admission kept")?;
    let refused = eventually(30, || match libnfs("nfs-cat", &[&url(port, &format!("/{VOLUME}/kept"))]) {
        Ok(_) => Err("still read".to_string()),
        Err(e) => Ok(e),
    })?;
    check(refused.contains("NOENT"), format!("after B's unstage: {refused}"))?;
    let root = String::from_utf8(libnfs("nfs-ls", &[&url(port, "/")])?)?;
    check(!root.contains(VOLUME), format!("after B's unstage the pseudo root still shows the volume: {root}"))?;

    // B stages again, then unstages while the API server is down: the
    // unstage finishes, the announcement stays on the PVC for now, and B
    // takes it off once the API server is back (the old agent logged it
    // and left it there for good).
    eventually(30, || match stage_b() {
        Err(s) if s.message().contains("mount ") => Ok(()),
        other => Err(format!("B's second stage: {other:?}")),
    })?;
    check(annotations()["nfs-client.volring.io/test-node"] == "127.0.0.1", format!("B announced again: {}", annotations()))?;
    server.api.set_outage(true);
    let mut n = b.c.node.clone();
    let unstaged =
        b.run(n.node_unstage_volume(NodeUnstageVolumeRequest { volume_id: VOLUME.into(), staging_target_path: b_staging.clone() }));
    server.api.set_outage(false);
    check(unstaged.is_ok(), format!("an unstage during an API outage: {unstaged:?}"))?;
    eventually(60, || {
        let gone = annotations().get("nfs-client.volring.io/test-node").is_none();
        gone.then_some(()).ok_or_else(|| format!("the announcement an outage kept stays: {}", annotations()))
    })?;

    // Never over a new stage's: another unstage during an outage leaves a
    // renouncement pending, and B stages again before it is retried. The
    // new announcement stays past the retries (5 s apart) and is admitted.
    let stage_again = || {
        eventually(30, || match stage_b() {
            Err(s) if s.message().contains("mount ") => Ok(()),
            other => Err(format!("B's stage: {other:?}")),
        })
    };
    stage_again()?;
    server.api.set_outage(true);
    let unstaged =
        b.run(n.node_unstage_volume(NodeUnstageVolumeRequest { volume_id: VOLUME.into(), staging_target_path: b_staging.clone() }));
    server.api.set_outage(false);
    check(unstaged.is_ok(), format!("the second unstage during an outage: {unstaged:?}"))?;
    stage_again()?;
    std::thread::sleep(std::time::Duration::from_secs(12));
    check(
        annotations()["nfs-client.volring.io/test-node"] == "127.0.0.1"
            && annotations()["nfs-admitted.volring.io/test-node"] == "127.0.0.1",
        format!("a retried renouncement took a new stage's announcement off: {}", annotations()),
    )?;
    let unstaged =
        b.run(n.node_unstage_volume(NodeUnstageVolumeRequest { volume_id: VOLUME.into(), staging_target_path: b_staging.clone() }));
    check(unstaged.is_ok(), format!("the last unstage: {unstaged:?}"))?;
    check(annotations().get("nfs-client.volring.io/test-node").is_none(), format!("B's announcement stays: {}", annotations()))?;
    drop(b);
    a.unstage(VOLUME, &staging)?;
    drop(api_rt);
    Ok(())
}

fn main() {
    let trials = vec![Trial::test("share_access::clients_follow_stage_and_unstage", clients_follow_stage_and_unstage)];
    common::run_in_private_namespace(trials)
}
