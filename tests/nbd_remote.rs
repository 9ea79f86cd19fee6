//! Remote nbd volumes on the host (no nbd module needed): the guarded
//! export catalog against the real clients (nbdinfo, qemu-io) — the right
//! secret reads and writes, a wrong or missing one is refused like an
//! unknown export, nothing is listed — and `volring node
//! --nbd-export-listen`: CreateVolume fills the export URI and secret into
//! the volume context, only the volumes it created are served, the export
//! survives a restart and goes with DeleteVolume, and NodeStage on a node
//! without the image answers the spec's codes for a bad context, an
//! unreachable export and a refused secret.

mod common;
mod csi_support;
#[path = "nbd_remote/metrics.rs"]
mod metrics;
mod nbd_support;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use common::check;
use csi_support::{code, mount_cap, Agent, MIB};
use libtest_mimic::{Failed, Trial};
use nbd_support::run;
use tonic::Code;
use volring_csi::proto::*;
use volring_nbd::remote::Secret;
use volring_nbd::{ExportSpec, Exports, Listen, NbdServer, ServerConfig};

/// The export name a client sends for a guarded export: `<export>/<secret>`,
/// then `/<client>` when it names itself. Written out here from the design
/// (volring_nbd::remote's docs), not borrowed from the server that parses it.
fn wire_name(export: &str, secret: &Secret, client: Option<&str>) -> String {
    match client {
        Some(c) => format!("{export}/{secret:x}/{c}"),
        None => format!("{export}/{secret:x}"),
    }
}

/// The volume-context keys of an exported volume, as docs/nbd.md names
/// them (the test's own, not the driver's: a key the driver changed would
/// strand every volume created before).
const CONTEXT_URI: &str = "volring.io/nbd-uri";
const CONTEXT_SECRET: &str = "volring.io/nbd-secret";

const T: Duration = Duration::from_secs(60);

/// A TCP server with one guarded export `vol` of `size` bytes.
struct Guarded {
    _dir: tempfile::TempDir,
    server: NbdServer,
    secret: Secret,
}

impl Guarded {
    fn new(size: u64) -> Self {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("vol.img");
        std::fs::File::create(&path).and_then(|f| f.set_len(size)).expect("image");
        let config = ServerConfig { listen: vec![Listen::Tcp("127.0.0.1:0".parse().unwrap())], threads: 1, ..ServerConfig::default() };
        let server = NbdServer::start(config, Arc::new(Exports::guarded())).expect("server");
        let secret = Secret::generate().expect("secret");
        let spec =
            ExportSpec { name: "vol".into(), path, read_only: false, direct_io: false, max_connections: 0, description: String::new() };
        server.exports().add(&spec, Some(secret.clone())).expect("export");
        Guarded { _dir: dir, server, secret }
    }

    fn uri(&self, name: &str) -> String {
        format!("nbd://{}/{name}", self.server.addresses()[0])
    }
}

fn real_clients_need_the_secret() -> Result<(), Failed> {
    let g = Guarded::new(16 * MIB as u64);
    let good = g.uri(&wire_name("vol", &g.secret, None));
    let (ok, out, err) = run("nbdinfo", &["--json", &good], T);
    check(ok, format!("nbdinfo with the secret: {err}"))?;
    let v: serde_json::Value = serde_json::from_str(&out)?;
    check(v["exports"][0]["export-size"] == 16 * MIB, format!("size: {v}"))?;

    let other = Secret::generate()?;
    let mut one_off = format!("{:x}", g.secret).into_bytes();
    one_off[63] = if one_off[63] == b'0' { b'1' } else { b'0' };
    let refused = [
        g.uri("vol"),
        g.uri(&wire_name("vol", &other, None)),
        g.uri(&format!("vol/{}", String::from_utf8(one_off)?)),
        g.uri(&format!("vol/{}", &format!("{:x}", g.secret)[..32])),
        g.uri(&wire_name("nope", &g.secret, None)),
    ];
    let mut messages = Vec::new();
    for uri in &refused {
        let (ok, _, err) = run("nbdinfo", &[uri], T);
        check(!ok && !err.contains("killed after"), format!("{uri} was served: {err}"))?;
        check(!err.contains(&format!("{:x}", g.secret)) || uri.contains(&format!("{:x}", g.secret)), "the secret is never told")?;
        messages.push(err.replace(uri, "URI"));
    }
    // A wrong secret and an unknown export look the same to the client.
    let kind = |m: &str| {
        m.lines().find(|l| l.contains("server replied with error")).and_then(|l| l.split(" for export").next()).map(str::to_string)
    };
    check(kind(&messages[1]).is_some(), format!("a GO refusal: {}", messages[1]))?;
    check(kind(&messages[1]) == kind(&messages[4]), format!("wrong secret vs unknown export:\n{}\n{}", messages[1], messages[4]))?;

    // Nothing is listed (names would carry the volumes, and a listing no secret).
    let (ok, out, err) = run("nbdinfo", &["--list", "--json", &g.uri("")], T);
    check(ok, format!("nbdinfo --list: {err}"))?;
    let v: serde_json::Value = serde_json::from_str(&out)?;
    check(v["exports"].as_array().is_none_or(|a| a.is_empty()), format!("listed: {v}"))?;

    // qemu-io writes and reads back through the secret; refused without it.
    let (ok, out, err) = run(
        "qemu-io",
        &["-f", "raw", "-c", "write -P 0xa5 1M 2M", "-c", "flush", "-c", "read -P 0xa5 1M 2M", "-c", "read -P 0 0 1M", &good],
        T,
    );
    check(ok && !out.contains("failed") && !out.contains("Pattern verification"), format!("qemu-io: {out}{err}"))?;
    let (ok, out, err) = run("qemu-io", &["-f", "raw", "-c", "read -P 0xa5 1M 4096", &g.uri(&wire_name("vol", &other, None))], T);
    check(
        !ok || out.contains("failed") || err.contains("Could not") || err.contains("Requested export not available"),
        format!("qemu-io with a wrong secret: {out}{err}"),
    )?;
    check(!out.contains("read 4096/4096"), format!("qemu-io read with a wrong secret: {out}"))
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()).expect("port").port()
}

/// An agent serving its nbd volumes to other nodes on a free port, and
/// that port's `HOST:PORT`.
fn exporting_agent() -> (Agent, String) {
    let listen = format!("127.0.0.1:{}", free_port());
    (Agent::start_with(&[("VOLRING_NBD_EXPORT_LISTEN", &listen)]), listen)
}

fn create_nbd(a: &Agent, name: &str, attach: &str) -> Result<Volume, tonic::Status> {
    let mut c = a.c.controller.clone();
    let params = HashMap::from([("attach".to_string(), attach.to_string()), ("fsType".to_string(), "ext4".to_string())]);
    let r = a.run(c.create_volume(CreateVolumeRequest {
        name: name.into(),
        capacity_range: Some(CapacityRange { required_bytes: 32 * MIB, limit_bytes: 0 }),
        volume_capabilities: vec![mount_cap("ext4")],
        parameters: params,
        ..Default::default()
    }))?;
    Ok(r.into_inner().volume.expect("volume"))
}

fn client_uri(v: &Volume) -> String {
    format!("{}/{}", v.volume_context[CONTEXT_URI], v.volume_context[CONTEXT_SECRET])
}

/// Whether agent `a`'s export hands `uri`'s volume out (to nbdinfo). When
/// it does, waits until `a` has read nbdinfo's NBD_CMD_DISC and let the
/// holder go: the owner reads it on its own time, and a stage or a SIGKILL
/// right after must not race it (a DISC a crash cuts off leaves the holder
/// recorded, as a dropped connection does).
fn served(a: &Agent, uri: &str) -> bool {
    let released = || a.log_tail(400).matches("let go of the volume").count();
    let before = released();
    if !run("nbdinfo", &[uri], T).0 {
        return false;
    }
    if let Err(e) = until("the owner reads nbdinfo's NBD_CMD_DISC", || released() > before) {
        panic!("{e:?}: {}", a.log_tail(20));
    }
    true
}

fn agent_exports_only_what_it_created() -> Result<(), Failed> {
    let (mut a, listen) = exporting_agent();
    let v = create_nbd(&a, "pvc-remote", "nbd")?;
    let uri = v.volume_context.get(CONTEXT_URI).cloned().unwrap_or_default();
    check(uri == format!("nbd://{listen}/pvc-remote"), format!("context: {:?}", v.volume_context.get(CONTEXT_URI)))?;
    let secret = v.volume_context.get(CONTEXT_SECRET).cloned().unwrap_or_default();
    check(secret.parse::<Secret>().is_ok(), "a 64-hex-digit secret in the context")?;
    check(v.accessible_topology.is_empty(), format!("an exported volume is reachable from every node: {:?}", v.accessible_topology))?;
    check(served(&a, &client_uri(&v)), format!("not served: {}", a.log_tail(20)))?;
    check(!served(&a, &format!("{uri}/{:x}", Secret::generate()?)), "served with another secret")?;
    check(!a.log_tail(400).contains(&secret), "the secret is in the agent's log")?;

    // A second nbd volume has its own secret; a loop volume is not exported.
    let w = create_nbd(&a, "pvc-other", "nbd")?;
    check(w.volume_context[CONTEXT_SECRET] != secret, "one secret per volume")?;
    check(!served(&a, &format!("nbd://{listen}/pvc-other/{secret}")), "one volume's secret opens another")?;
    let l = create_nbd(&a, "pvc-loop", "loop")?;
    check(!l.volume_context.contains_key(CONTEXT_URI) && !l.volume_context.contains_key(CONTEXT_SECRET), "a loop volume has no export")?;
    check(!served(&a, &format!("nbd://{listen}/pvc-loop/{secret}")), "a loop volume is served")?;

    // A restarted agent serves it again, with the same secret; the
    // repeated create returns the same context.
    a.respawn_with(&[("VOLRING_NBD_EXPORT_LISTEN", &listen)]);
    check(served(&a, &client_uri(&v)), format!("not served after a restart: {}", a.log_tail(20)))?;
    let again = create_nbd(&a, "pvc-remote", "nbd")?;
    check(again.volume_context == v.volume_context, "a repeated create returns the same context")?;

    // Without the listener, no URI is handed out (it would lead nowhere).
    a.respawn_with(&[]);
    let plain = create_nbd(&a, "pvc-remote", "nbd")?;
    check(!plain.volume_context.contains_key(CONTEXT_URI), "a URI without a listener")?;

    a.respawn_with(&[("VOLRING_NBD_EXPORT_LISTEN", &listen)]);
    a.delete("pvc-remote")?;
    check(!served(&a, &client_uri(&v)), "served after DeleteVolume")?;
    check(served(&a, &client_uri(&w)), "the other volume stays served")?;
    Ok(())
}

fn stage_answers_the_specs_codes() -> Result<(), Failed> {
    let (owner, _) = exporting_agent();
    let v = create_nbd(&owner, "pvc-r", "nbd")?;
    let consumer = Agent::start();
    let staging = consumer.k("plugins/stage/pvc-r");
    let stage = |ctx: HashMap<String, String>| {
        let mut c = consumer.c.node.clone();
        consumer.run(c.node_stage_volume(NodeStageVolumeRequest {
            volume_id: "pvc-r".into(),
            staging_target_path: staging.clone(),
            volume_capability: Some(mount_cap("ext4")),
            volume_context: ctx,
            ..Default::default()
        }))
    };
    let ctx = |uri: &str, secret: &str| {
        HashMap::from([(CONTEXT_URI.to_string(), uri.to_string()), (CONTEXT_SECRET.to_string(), secret.to_string())])
    };
    let secret = v.volume_context[CONTEXT_SECRET].clone();
    let uri = v.volume_context[CONTEXT_URI].clone();

    check(code(stage(HashMap::new())) == Some(Code::NotFound), "an unknown volume without an export")?;
    for (u, s) in [(uri.as_str(), "00"), ("nbd://127.0.0.1/pvc-other", secret.as_str()), ("file:///x", secret.as_str())] {
        let r = stage(ctx(u, s));
        check(code(r) == Some(Code::InvalidArgument), format!("context {u:?}"))?;
    }
    let mut half = ctx(&uri, &secret);
    half.remove(CONTEXT_SECRET);
    check(code(stage(half)) == Some(Code::InvalidArgument), "a URI without its secret")?;

    let r = stage(ctx(&format!("nbd://127.0.0.1:{}/pvc-r", free_port()), &secret));
    check(code(r) == Some(Code::Unavailable), "an export nobody listens on is Unavailable")?;
    let r = stage(ctx(&uri, &format!("{:x}", Secret::generate()?)));
    let wrong = r.as_ref().err().map(|s| s.message().to_string()).unwrap_or_default();
    check(code(r) == Some(Code::NotFound), format!("a wrong secret is NotFound: {wrong}"))?;
    check(!wrong.contains(&secret), "the error does not tell the secret")?;
    // The right secret negotiates; this host has no nbd driver, which is
    // the node's condition.
    if std::path::Path::new("/sys/module/nbd").exists() {
        eprintln!("note: this kernel has the nbd driver; the attach itself is the VM tests' (tests/vm/remote.rs)");
        return Ok(());
    }
    let r = stage(ctx(&uri, &secret));
    let msg = r.as_ref().err().map(|s| s.message().to_string()).unwrap_or_default();
    check(
        matches!(code(r), Some(Code::FailedPrecondition)) && msg.contains("nbd driver"),
        format!("with the right secret, the missing nbd driver: {msg}"),
    )?;
    check(!consumer.log_tail(400).contains(&secret), "the secret is in the consumer's log")?;
    Ok(())
}

/// The volume context a test stages a volume on its owning node with:
/// through a loop device (this host has no nbd driver), which is as much
/// a local mount of the image as a socketpair nbd device.
fn local_ctx() -> HashMap<String, String> {
    HashMap::from([("attach".to_string(), "loop".to_string())])
}

fn stage_ctx(a: &Agent, id: &str, staging: &str, ctx: HashMap<String, String>) -> Result<(), tonic::Status> {
    let mut c = a.c.node.clone();
    a.run(c.node_stage_volume(NodeStageVolumeRequest {
        volume_id: id.into(),
        staging_target_path: staging.into(),
        volume_capability: Some(mount_cap("ext4")),
        volume_context: ctx,
        ..Default::default()
    }))
    .map(drop)
}

/// Waits (every 50 ms, at most 20 s) until `f` holds.
fn until(what: &str, mut f: impl FnMut() -> bool) -> Result<(), Failed> {
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    while !f() {
        if std::time::Instant::now() > deadline {
            return Err(format!("not within 20 s: {what}").into());
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    Ok(())
}

/// The fence on the owning node: never its own mount and another node's
/// client on one volume at once. Fails on the old code at the first
/// check: the export was served while the owner had the volume mounted.
fn owner_fence_one_holder_at_a_time() -> Result<(), Failed> {
    let (mut a, listen) = exporting_agent();
    let env = [("VOLRING_NBD_EXPORT_LISTEN", listen.as_str())];
    let v = create_nbd(&a, "pvc-f", "nbd")?;
    let uri = client_uri(&v);
    let staging = a.k("plugins/stage/pvc-f");
    // A client that connects and disconnects (NBD_CMD_DISC) holds nothing after.
    check(served(&a, &uri), format!("not served: {}", a.log_tail(20)))?;

    // Staged here: the export refuses to hand it out — also after a crash.
    stage_ctx(&a, "pvc-f", &staging, local_ctx())?;
    let (ok, _, err) = run("env", &["LIBNBD_DEBUG=1", "nbdinfo", &uri], T);
    check(!ok, "the export was handed out while its owning node has the volume mounted")?;
    check(err.contains("staged on its owning node"), format!("the refusal says why: {err}"))?;
    a.respawn_with(&env);
    check(!served(&a, &uri), "handed out after the owner restarted with the volume staged")?;
    a.unstage("pvc-f", &staging)?;
    check(served(&a, &uri), format!("not handed out after the unstage: {}", a.log_tail(20)))?;

    // Another node's client holds it: no local stage, no delete.
    let holds = |a: &Agent| a.log_tail(400).matches("held by another node").count();
    let before = holds(&a);
    let mut holder = std::process::Command::new("qemu-io")
        .args(["-f", "raw", "-c", "read 0 64k", "-c", "sleep 60000", &uri])
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()?;
    let held = until("the owner records the remote holder", || holds(&a) > before);
    let r = stage_ctx(&a, "pvc-f", &staging, local_ctx());
    let msg = r.as_ref().err().map(|s| s.message().to_string()).unwrap_or_default();
    let _ = holder.kill();
    let _ = holder.wait();
    held?;
    check(code(r) == Some(Code::FailedPrecondition), format!("staged while another node's client holds it: {msg}"))?;
    check(msg.contains("another node"), format!("the refusal says why: {msg}"))?;
    // Its connection dropped without NBD_CMD_DISC (killed): held still —
    // a consumer away reconnects — and across an owner crash.
    check(code(stage_ctx(&a, "pvc-f", &staging, local_ctx())) == Some(Code::FailedPrecondition), "released by a dropped connection")?;
    a.respawn_with(&env);
    check(code(stage_ctx(&a, "pvc-f", &staging, local_ctx())) == Some(Code::FailedPrecondition), "released by an owner restart")?;
    check(code(a.delete("pvc-f")) == Some(Code::FailedPrecondition), "deleted while another node holds it")?;
    // The holder comes back (the volume is still served to it) and lets go.
    let (ok, out, err) = run("qemu-io", &["-f", "raw", "-c", "read 0 64k", &uri], T);
    check(ok && out.contains("read 65536/65536"), format!("the holder again: {out}{err}"))?;
    stage_ctx(&a, "pvc-f", &staging, local_ctx()).map_err(|s| format!("stage after the holder let go: {s}"))?;
    check(!served(&a, &uri), "handed out after the owner staged it again")?;
    a.unstage("pvc-f", &staging)?;
    a.delete("pvc-f")?;
    Ok(())
}

/// A crash of the owner at each step of a stage and an unstage never
/// leaves the export handed out while the image is attached here, nor the
/// volume fenced for good once it is unstaged. A crash between removing
/// the record and dropping the holder (`unstage:done`) is what the start
/// walk mends (the same walk drops a holder whose stage crashed before its
/// record was written: `csi::fence`'s unit tests).
fn owner_fence_survives_crashes_mid_step() -> Result<(), Failed> {
    let (mut a, listen) = exporting_agent();
    let env = [("VOLRING_NBD_EXPORT_LISTEN", listen.as_str())];
    let v = create_nbd(&a, "pvc-c", "nbd")?;
    let uri = client_uri(&v);
    let image = a.image("pvc-c");
    let staging = a.k("plugins/stage/pvc-c");
    // Never both: the image attached here and the export handed out.
    let safe = |a: &Agent, when: &str| -> Result<(), Failed> {
        let attached = !csi_support::loops_backed_by(&image).is_empty();
        check(!(attached && served(a, &uri)), format!("handed out while attached here, {when}"))
    };
    for point in ["stage:attach", "stage:mount", "stage:staged"] {
        a.respawn_with(&[env[0], ("VOLRING_FAULT_POINT", point)]);
        check(stage_ctx(&a, "pvc-c", &staging, local_ctx()).is_err(), format!("the agent did not die at {point}"))?;
        a.respawn_with(&env);
        safe(&a, &format!("after a crash at {point}"))?;
        a.unstage("pvc-c", &staging).map_err(|s| format!("unstage after {point}: {s}"))?;
        check(served(&a, &uri), format!("not handed out after the unstage that followed {point}: {}", a.log_tail(20)))?;
    }
    for point in ["unstage:intent", "unstage:detached", "unstage:done"] {
        stage_ctx(&a, "pvc-c", &staging, local_ctx())?;
        check(!served(&a, &uri), "handed out while staged")?;
        a.respawn_with(&[env[0], ("VOLRING_FAULT_POINT", point)]);
        check(a.unstage("pvc-c", &staging).is_err(), format!("the agent did not die at {point}"))?;
        a.respawn_with(&env);
        safe(&a, &format!("after a crash at {point}"))?;
        if point == "unstage:done" {
            check(served(&a, &uri), format!("fenced after the record was removed: {}", a.log_tail(20)))?;
        }
        a.unstage("pvc-c", &staging).map_err(|s| format!("unstage after {point}: {s}"))?;
        check(served(&a, &uri), format!("not handed out after the unstage finished ({point})"))?;
    }
    Ok(())
}

fn holders_cli(a: &Agent, extra: &[&str]) -> (bool, String, String) {
    let state = a.state.display().to_string();
    let args = [&["nbd", "holders", "--state-dir", state.as_str()][..], extra].concat();
    run(env!("CARGO_BIN_EXE_volring"), &args, T)
}

/// A remote holder that will not come back (its node is gone) is let go
/// only by the operator, with the agent stopped; a local one only by
/// NodeUnstage.
fn operator_releases_a_dead_holder() -> Result<(), Failed> {
    let (mut a, listen) = exporting_agent();
    let env = [("VOLRING_NBD_EXPORT_LISTEN", listen.as_str())];
    let v = create_nbd(&a, "pvc-d", "nbd")?;
    let uri = client_uri(&v);
    let staging = a.k("plugins/stage/pvc-d");
    let mut holder = std::process::Command::new("qemu-io")
        .args(["-f", "raw", "-c", "read 0 64k", "-c", "sleep 60000", &uri])
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()?;
    let held = until("the owner records the remote holder", || a.log_tail(400).contains("held by another node"));
    let _ = holder.kill();
    let _ = holder.wait();
    held?;
    let (ok, _, err) = holders_cli(&a, &["--release", "pvc-d"]);
    check(!ok && err.contains("another volring agent"), format!("released beside a running agent: {err}"))?;
    a.kill_hard();
    let (ok, out, err) = holders_cli(&a, &["--json"]);
    check(ok && out.contains("pvc-d") && out.contains("remote"), format!("holders: {out}{err}"))?;
    let (ok, out, err) = holders_cli(&a, &["--release", "pvc-d"]);
    check(ok, format!("release: {out}{err}"))?;
    let (ok, out, _) = holders_cli(&a, &["--json"]);
    check(ok && !out.contains("pvc-d"), format!("still held after the release: {out}"))?;
    a.respawn_with(&env);
    stage_ctx(&a, "pvc-d", &staging, local_ctx()).map_err(|s| format!("stage after the release: {s}"))?;
    a.kill_hard();
    let (ok, _, err) = holders_cli(&a, &["--release", "pvc-d"]);
    check(!ok && err.contains("NodeUnstage"), format!("a local holder released by hand: {err}"))?;
    a.respawn_with(&env);
    check(!served(&a, &uri), "handed out while staged, after the refused release")?;
    a.unstage("pvc-d", &staging)?;
    Ok(())
}

/// Two consuming nodes present the same volume's secret: the owning node
/// hands the volume to the node that named itself first and refuses the
/// other, and a client that gives no name, until the first lets go with
/// NBD_CMD_DISC — across a dropped connection and an owner restart. On the
/// old code the secret was the only identity: a second node was one more
/// connection of the same holder, and both could mount the volume (the
/// old code does not understand the name at all: node-b is refused at
/// once).
fn one_consuming_node_at_a_time() -> Result<(), Failed> {
    let (mut a, listen) = exporting_agent();
    let env = [("VOLRING_NBD_EXPORT_LISTEN", listen.as_str())];
    let v = create_nbd(&a, "pvc-n", "nbd")?;
    let uri = client_uri(&v);
    let as_node = |n: &str| format!("{uri}/{n}");
    let held_by = |a: &Agent, n: &str| a.log_tail(400).lines().any(|l| l.contains("held by another node") && l.contains(n));
    // node-b writes (and lets go: qemu-io ends with DISC), then holds it.
    let (ok, out, err) = run("qemu-io", &["-f", "raw", "-c", "write -P 0x5b 4M 64k", &as_node("node-b")], T);
    check(ok && out.contains("wrote 65536/65536"), format!("node-b's write: {out}{err}"))?;
    let mut holder = std::process::Command::new("qemu-io")
        .args(["-f", "raw", "-c", "read 0 4k", "-c", "sleep 60000", &as_node("node-b")])
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()?;
    let held = until("the owner records node-b as the holder", || held_by(&a, "node-b"));
    let second = run("qemu-io", &["-f", "raw", "-c", "read -P 0x5b 4M 64k", &as_node("node-b")], T);
    let other = run("env", &["LIBNBD_DEBUG=1", "nbdinfo", &as_node("node-c")], T);
    let nameless = run("nbdinfo", &[&uri], T);
    let _ = holder.kill();
    let _ = holder.wait();
    held?;
    check(second.0 && second.1.contains("read 65536/65536"), format!("node-b's second connection: {}{}", second.1, second.2))?;
    check(!other.0, "node-c was handed the volume node-b holds")?;
    check(other.2.contains("held by node node-b"), format!("the refusal says who holds it: {}", other.2))?;
    check(!nameless.0, "a client without a name was handed the volume node-b holds")?;
    // node-b's connection dropped without NBD_CMD_DISC: away, not gone.
    check(!served(&a, &as_node("node-c")), "node-c served after node-b's connection dropped")?;
    a.respawn_with(&env);
    check(!served(&a, &as_node("node-c")), "node-c served after an owner restart")?;
    // node-b comes back, reads its data, and lets go (qemu-io ends with DISC).
    let (ok, out, err) = run("qemu-io", &["-f", "raw", "-c", "read -P 0x5b 4M 64k", &as_node("node-b")], T);
    check(ok && out.contains("read 65536/65536"), format!("node-b again: {out}{err}"))?;
    // The owner reads node-b's DISC on its own time: node-c may be refused
    // for that moment (its CO retries).
    until("node-c is served once node-b let go", || served(&a, &as_node("node-c")))?;
    let staging = a.k("plugins/stage/pvc-n");
    stage_ctx(&a, "pvc-n", &staging, local_ctx()).map_err(|s| format!("stage after both let go: {s}"))?;
    a.unstage("pvc-n", &staging)?;
    Ok(())
}

/// After a shared volume's NFS server moved to another node (which holds
/// the volume through this node's export), the owning node's own stage of
/// it is an NFS client of the context's server, not a local mount (the
/// fence would refuse that). This host has no NFS client: the stage fails
/// in the NFSv4 mount, which is what shows the path taken. On the old code
/// the owner mounted the image itself under the other node's writer.
fn owner_stages_a_moved_share_over_nfs() -> Result<(), Failed> {
    use volring_csi::client::capability;
    use volring_csi::proto::volume_capability::access_mode::Mode;
    let (a, _) = exporting_agent();
    let rwx = capability(false, "ext4", &[], Mode::MultiNodeMultiWriter);
    let mut c = a.c.controller.clone();
    let v = a
        .run(c.create_volume(CreateVolumeRequest {
            name: "pvc-s".into(),
            capacity_range: Some(CapacityRange { required_bytes: 32 * MIB, limit_bytes: 0 }),
            volume_capabilities: vec![rwx.clone()],
            parameters: HashMap::from([("attach".to_string(), "nbd".to_string()), ("fsType".to_string(), "ext4".to_string())]),
            ..Default::default()
        }))?
        .into_inner()
        .volume
        .ok_or("no volume")?;
    let uri = client_uri(&v);
    let staging = a.k("plugins/stage/pvc-s");
    let mut holder = std::process::Command::new("qemu-io")
        .args(["-f", "raw", "-c", "read 0 64k", "-c", "sleep 60000", &uri])
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()?;
    let held = until("the owner records the remote holder", || a.log_tail(400).contains("held by another node"));
    let mut ctx = v.volume_context.clone();
    ctx.insert("attach".into(), "loop".into());
    ctx.insert("nfsServer".into(), format!("127.0.0.1:{}", free_port()));
    ctx.insert("nfsExport".into(), "/pvc-s".into());
    let mut n = a.c.node.clone();
    let r = a.run(n.node_stage_volume(NodeStageVolumeRequest {
        volume_id: "pvc-s".into(),
        staging_target_path: staging.clone(),
        volume_capability: Some(rwx),
        volume_context: ctx,
        ..Default::default()
    }));
    let _ = holder.kill();
    let _ = holder.wait();
    held?;
    check(csi_support::loops_backed_by(&a.image("pvc-s")).is_empty(), "the owner attached the image under the other node's client")?;
    let msg = r.as_ref().err().map(|s| s.message().to_string()).unwrap_or_else(|| "staged".into());
    check(msg.contains("NFSv4"), format!("the owner's stage of a share served elsewhere is not an NFS mount: {msg}"))?;
    Ok(())
}

/// The consuming node's side of the fence: a volume its owner has staged
/// is FailedPrecondition (not NotFound: the secret was right), and a
/// stage that fails after negotiating (no nbd driver here) lets the
/// volume go, so the owner can stage it.
fn consumer_sees_the_fence() -> Result<(), Failed> {
    let (owner, _) = exporting_agent();
    let v = create_nbd(&owner, "pvc-k", "nbd")?;
    let consumer = Agent::start();
    let staging = consumer.k("plugins/stage/pvc-k");
    let ctx = HashMap::from([
        (CONTEXT_URI.to_string(), v.volume_context[CONTEXT_URI].clone()),
        (CONTEXT_SECRET.to_string(), v.volume_context[CONTEXT_SECRET].clone()),
    ]);
    let owner_staging = owner.k("plugins/stage/pvc-k");
    stage_ctx(&owner, "pvc-k", &owner_staging, local_ctx())?;
    let r = stage_ctx(&consumer, "pvc-k", &staging, ctx.clone());
    let msg = r.as_ref().err().map(|s| s.message().to_string()).unwrap_or_default();
    check(code(r) == Some(Code::FailedPrecondition) && msg.contains("owning node has it staged"), format!("owner staged: {msg}"))?;
    owner.unstage("pvc-k", &owner_staging)?;
    if std::path::Path::new("/sys/module/nbd").exists() {
        eprintln!("note: this kernel has the nbd driver; the consumer's failed attach is not exercised here");
        return Ok(());
    }
    let r = stage_ctx(&consumer, "pvc-k", &staging, ctx);
    check(code(r) == Some(Code::FailedPrecondition), "no nbd driver on the consumer")?;
    // The consumer gave the owner its node id (the fence holds for it alone).
    let named = owner.log_tail(400).lines().any(|l| l.contains("held by another node") && l.contains("test-node"));
    check(named, format!("the consumer did not name itself: {}", owner.log_tail(10)))?;
    stage_ctx(&owner, "pvc-k", &owner_staging, local_ctx()).map_err(|s| format!("the consumer's failed attach kept the volume: {s}"))?;
    owner.unstage("pvc-k", &owner_staging)?;
    Ok(())
}

fn main() {
    let trials = vec![
        Trial::test("nbd_remote::real_clients_need_the_secret", real_clients_need_the_secret),
        Trial::test("nbd_remote::agent_exports_only_what_it_created", agent_exports_only_what_it_created),
        Trial::test("nbd_remote::stage_answers_the_specs_codes", stage_answers_the_specs_codes),
        Trial::test("nbd_remote::owner_fence_one_holder_at_a_time", owner_fence_one_holder_at_a_time),
        Trial::test("nbd_remote::owner_fence_survives_crashes_mid_step", owner_fence_survives_crashes_mid_step),
        Trial::test("nbd_remote::consumer_sees_the_fence", consumer_sees_the_fence),
        Trial::test("nbd_remote::one_consuming_node_at_a_time", one_consuming_node_at_a_time),
        Trial::test("nbd_remote::operator_releases_a_dead_holder", operator_releases_a_dead_holder),
        Trial::test("nbd_remote::owner_stages_a_moved_share_over_nfs", owner_stages_a_moved_share_over_nfs),
        Trial::test("nbd_remote::export_server_reaches_metrics", metrics::export_server_reaches_metrics),
    ];
    common::run_in_private_namespace(trials)
}
