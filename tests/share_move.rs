//! The owning node's side of moving a shared volume's NFS server (issue 17,
//! failover case 2), on this host with the agent's real ganesha; the move
//! itself, with the kernel's NFS client, is tests/vm/share_move.rs.
//!
//! - A removed export ends the server process: a ganesha that re-read a
//!   configuration without the export answered that export's connected
//!   clients NFS4ERR_STALE (a dead mount) instead of letting them
//!   reconnect to where the volume went. The other exports are served by
//!   the restarted process; with none left no server runs.
//! - The filesystem id in ganesha's handles survives the volume coming
//!   back from another block device (what a move does: a loop device on
//!   one node, /dev/nbdN on the next), for ext4 and xfs: ganesha takes it
//!   from the filesystem's UUID, though the kernel's own fsid of an xfs is
//!   its device number.

mod common;
mod csi_support;

use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::time::{Duration, Instant};

use common::check;
use csi_support::{Agent, MIB};
use libtest_mimic::{Failed, Trial};
use volring_csi::client::capability;
use volring_csi::proto::volume_capability::access_mode::Mode;
use volring_csi::proto::*;

fn rwx(fs: &str) -> VolumeCapability {
    capability(false, fs, &[], Mode::MultiNodeMultiWriter)
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()).map(|a| a.port()).expect("free port")
}

fn nfs_agent(port: u16) -> Agent {
    let listen = format!("127.0.0.1:{port}");
    // This host's libnfs client is the one client: listed (out of a
    // cluster no node announces itself).
    Agent::start_with(&[
        ("VOLRING_NFS_LISTEN", &listen),
        ("VOLRING_NFS_GRACE", "5"),
        ("VOLRING_NFS_LEASE", "5"),
        ("VOLRING_NFS_CLIENTS", "127.0.0.1"),
    ])
}

fn create(a: &Agent, name: &str, fs: &str) -> Result<(), Failed> {
    let mut c = a.c.controller.clone();
    let size = if fs == "xfs" { 320 * MIB } else { 32 * MIB };
    a.run(c.create_volume(CreateVolumeRequest {
        name: name.into(),
        capacity_range: Some(CapacityRange { required_bytes: size, limit_bytes: 0 }),
        volume_capabilities: vec![rwx(fs)],
        parameters: [("fsType".to_string(), fs.to_string())].into(),
        ..Default::default()
    }))?;
    Ok(())
}

fn server_pid(a: &Agent) -> Option<u32> {
    std::fs::read_to_string(a.state.join("nfs/ganesha.pid")).ok()?.trim().parse().ok()
}

/// Whether `pid` runs (a zombie does not).
fn running(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .is_ok_and(|s| s.rsplit(')').next().is_some_and(|r| !r.trim_start().starts_with('Z')))
}

/// Waits (every 50 ms, at most `secs`) until `f` holds.
fn until(secs: u64, what: &str, mut f: impl FnMut() -> bool) -> Result<(), Failed> {
    let deadline = Instant::now() + Duration::from_secs(secs);
    while !f() {
        if Instant::now() > deadline {
            return Err(format!("waited {secs} s for {what}").into());
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    Ok(())
}

/// Reads `/<export>/<file>` with libnfs's nfs-cat, retried for 30 s (a
/// restarted server answers NFS4ERR_GRACE for a while); killed by PID.
fn nfs_cat(port: u16, path: &str) -> Result<Vec<u8>, String> {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let out = std::process::Command::new("timeout")
            .args(["-s", "KILL", "20", "nfs-cat", &format!("nfs://127.0.0.1{path}?version=4&nfsport={port}")])
            .output()
            .map_err(|e| format!("nfs-cat: {e}"))?;
        if out.status.success() {
            return Ok(out.stdout);
        }
        if Instant::now() > deadline {
            return Err(format!("nfs-cat {path}: {}", String::from_utf8_lossy(&out.stderr)));
        }
        std::thread::sleep(Duration::from_millis(250));
    }
}

fn removed_export_ends_the_server() -> Result<(), Failed> {
    let port = free_port();
    let a = nfs_agent(port);
    let (s1, s2) = (a.k("plugins/stage/one"), a.k("plugins/stage/two"));
    for (id, staging) in [("pvc-one", &s1), ("pvc-two", &s2)] {
        create(&a, id, "ext4")?;
        a.stage(id, staging, rwx("ext4"))?;
        std::fs::write(format!("{staging}/f"), id)?;
    }
    check(nfs_cat(port, "/pvc-one/f")? == b"pvc-one" && nfs_cat(port, "/pvc-two/f")? == b"pvc-two", "both served")?;
    let first = server_pid(&a).ok_or("no server pid")?;
    a.unstage("pvc-one", &s1)?;
    // Ended, not reloaded: its connections are gone.
    check(!running(first), format!("the server (pid {first}) that served the removed export still runs"))?;
    until(30, "the server started again for the other export", || server_pid(&a).is_some_and(|p| p != first && running(p)))?;
    check(nfs_cat(port, "/pvc-two/f")? == b"pvc-two", "the other export after the restart")?;
    check(nfs_cat(port, "/pvc-one/f").is_err(), "the removed export is not served")?;
    let second = server_pid(&a).ok_or("no server pid")?;
    a.unstage("pvc-two", &s2)?;
    check(!running(second), format!("no export left, yet the server (pid {second}) runs"))?;
    std::thread::sleep(Duration::from_secs(1));
    check(server_pid(&a).is_none_or(|p| p == second && !running(p)), "a server was started with nothing to export")?;
    check(std::net::TcpStream::connect(("127.0.0.1", port)).is_err(), "the NFS port still answers with no export")?;
    Ok(())
}

/// The `dev=` and `fsid=` ganesha logged for the filesystem mounted at
/// `path` in the log lines after the first `skip`.
fn logged_fsid(log: &Path, skip: usize, path: &str) -> Option<(String, String)> {
    let text = std::fs::read_to_string(log).ok()?;
    let want = format!(" {path} namelen=");
    let line = text.lines().skip(skip).filter(|l| l.contains("Added filesystem") && l.contains(&want)).last()?;
    let field = |k: &str| line.split_whitespace().find_map(|w| w.strip_prefix(k)).map(str::to_string);
    Some((field("dev=")?, field("fsid=")?))
}

/// A loop device held (attached to a small file) until dropped.
struct HeldLoop(String);

impl Drop for HeldLoop {
    fn drop(&mut self) {
        let _ = std::process::Command::new("losetup").args(["-d", &self.0]).status();
    }
}

fn handle_fsid_survives_a_device_change(fs: &'static str) -> Result<(), Failed> {
    let port = free_port();
    let a = nfs_agent(port);
    let id = format!("pvc-dev-{fs}");
    let staging = a.k(&format!("plugins/stage/{fs}"));
    create(&a, &id, fs)?;
    let log = a.state.join("nfs/ganesha.log");
    a.stage(&id, &staging, rwx(fs))?;
    let dev1 = std::fs::metadata(&staging)?.dev();
    let statfs1 = rustix::fs::statfs(staging.as_str())?.f_fsid;
    let mut first = None;
    until(30, "ganesha's line for the first device", || {
        first = logged_fsid(&log, 0, &staging);
        first.is_some()
    })?;
    let (d1, f1) = first.ok_or("no line")?;
    a.unstage(&id, &staging)?;
    // The device the volume had is taken, so it comes back on another one.
    let lines = std::fs::read_to_string(&log)?.lines().count();
    let filler = a.scratch.path().join("filler");
    std::fs::File::create(&filler)?.set_len(MIB as u64)?;
    let name = format!("/dev/loop{}", rustix::fs::minor(dev1));
    let held = std::process::Command::new("losetup").arg(&name).arg(&filler).status()?.success().then(|| HeldLoop(name.clone()));
    a.stage(&id, &staging, rwx(fs))?;
    drop(held);
    let dev2 = std::fs::metadata(&staging)?.dev();
    let statfs2 = rustix::fs::statfs(staging.as_str())?.f_fsid;
    check(dev1 != dev2, format!("the volume came back on the same device ({name})"))?;
    let mut second = None;
    until(30, "ganesha's line for the second device", || {
        second = logged_fsid(&log, lines, &staging);
        second.is_some()
    })?;
    let (d2, f2) = second.ok_or("no line")?;
    eprintln!("note: {fs}: ganesha dev {d1} fsid {f1}, then dev {d2} fsid {f2}; the kernel's f_fsid {statfs1:?}, then {statfs2:?}");
    check(d1 != d2, format!("ganesha saw one device ({d1}) twice"))?;
    check(f1 == f2, format!("the fsid in ganesha's handles changed with the device: {f1} on {d1}, {f2} on {d2}"))?;
    a.unstage(&id, &staging)?;
    Ok(())
}

fn main() {
    common::run_in_private_namespace(vec![
        Trial::test("share_move::removed_export_ends_the_server", removed_export_ends_the_server),
        Trial::test("share_move::handle_fsid_survives_a_device_change_xfs", || handle_fsid_survives_a_device_change("xfs")),
        Trial::test("share_move::handle_fsid_survives_a_device_change_ext4", || handle_fsid_survives_a_device_change("ext4")),
    ])
}
