//! The NFS export the owning node serves, read and written by libnfs, and
//! how it follows the volume's life and a repair.

use super::*;

/// The owning node exports a staged RWX volume over NFSv4 from the ganesha
/// it supervises: one TCP port on the configured address, only the staged
/// volumes exported, a userspace NFS client reads and writes through it,
/// the server is restarted when killed and when the agent is, the export
/// follows the volume's life, and the store records it.
pub(super) fn export_served() -> Result<(), Failed> {
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

/// The reconciler mounts a shared volume again: the NFS server serves the
/// new mount. The case made here: the staging mount goes away while the
/// way to it is covered (so the repair waits), and the server restarts
/// meanwhile — it now exports the empty directory it finds at the path.
/// Once the cover is gone the reconciler mounts the volume again, and
/// clients must see the volume's files, not that directory.
pub(super) fn export_follows_a_repair() -> Result<(), Failed> {
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
