//! One kind of mount change per scenario (attach, bind, move, remount,
//! propagation, a tree's unmount), a namespace other than the caller's,
//! and the fallback on a kernel without fanotify mount events.

use super::*;

pub(super) fn tmpfs_attach_detach(mode: WatchMode, backend: BackendChoice) -> Result<(), Failed> {
    let s = Scratch::new();
    let mut w = Watch::start(mode, backend, &s);
    let a = s.tmpfs("a");
    let ev = w.take(1);
    expect(&ev, &s, &[(Attached, "/a")])?;
    let m = ev[0].mount.as_ref().expect("attached mount is read");
    check(m.fs_type() == b"tmpfs" && m.source() == b"tmpfs", format!("{m:?}"))?;
    check(ev[0].devices.is_empty(), "tmpfs has no block device")?;
    umount(&a);
    let ev = w.take(1);
    expect(&ev, &s, &[(Detached, "/a")])?;
    check(ev[0].id == m.id, "detach names the same mount id")
}

pub(super) fn bind_mounts(mode: WatchMode, backend: BackendChoice) -> Result<(), Failed> {
    let s = Scratch::new();
    let src = s.tmpfs("src");
    std::fs::create_dir(src.join("sub"))?;
    let mut w = Watch::start(mode, backend, &s);
    mount_bind(&src, s.dir("dst"))?;
    mount_bind(src.join("sub"), s.dir("dst2"))?;
    let ev = w.take(2);
    expect(&ev, &s, &[(Attached, "/dst"), (Attached, "/dst2")])?;
    let root = |p: &str| ev.iter().find(|e| target(e).ends_with(p)).and_then(|e| e.mount.clone()).map(|m| m.root().to_vec());
    check(root("/dst") == Some(b"/".to_vec()), "bind of the root has root /")?;
    check(root("/dst2") == Some(b"/sub".to_vec()), "bind of a subtree names it as root")
}

pub(super) fn loop_ext4_with_space(mode: WatchMode, backend: BackendChoice) -> Result<(), Failed> {
    let s = Scratch::new();
    let dev = LoopDevice::new(64 << 20);
    dev.mkfs("ext4");
    let mut w = Watch::start(mode, backend, &s);
    let p = s.dir("vol with space");
    rustix::mount::mount(dev.path(), &p, "ext4", MountFlags::empty(), None)?;
    let ev = w.take(1);
    expect(&ev, &s, &[(Attached, "/vol with space")])?;
    let m = ev[0].mount.as_ref().expect("read");
    check(m.fs_type() == b"ext4", "ext4")?;
    check(m.source() == dev.path().as_bytes(), format!("source {:?}", String::from_utf8_lossy(m.source())))?;
    check(ev[0].devices.len() == 1, "one device")?;
    let d = &ev[0].devices[0];
    check(d.name.as_deref() == Some(dev.name()) && d.path.as_deref() == Some(dev.path()), format!("device {d:?}"))?;
    check(d.dev == m.dev && d.dev.major == 7, "loop major")?;
    umount(&p);
    let ev = w.take(1);
    expect(&ev, &s, &[(Detached, "/vol with space")])?;
    check(ev[0].devices.first().and_then(|d| d.name.as_deref()) == Some(dev.name()), "detach names the device too")
}

pub(super) fn move_mount(mode: WatchMode, backend: BackendChoice) -> Result<(), Failed> {
    let s = Scratch::new();
    let m1 = s.tmpfs("m1");
    let mut w = Watch::start(mode, backend, &s);
    mount_move(&m1, s.dir("m2"))?;
    let ev = w.take(1);
    expect(&ev, &s, &[(Moved, "/m2")])?;
    let prev = ev[0].previous.as_ref().expect("previous state");
    check(prev.mount_point_path() == m1, "previous target")?;
    check(ev[0].changes.contains(Changes::MOUNT_POINT), "changes say the mount point")
}

pub(super) fn remount_read_only(mode: WatchMode, backend: BackendChoice) -> Result<(), Failed> {
    let s = Scratch::new();
    let r = s.tmpfs("r");
    let mut w = Watch::start(mode, backend, &s);
    // Per-mount flag: a bind remount.
    mount_remount(&r, MountFlags::BIND | MountFlags::RDONLY, "")?;
    let ev = w.take(1);
    expect(&ev, &s, &[(Changed, "/r")])?;
    check(ev[0].mount.as_ref().is_some_and(|m| read_only(m)), "now ro")?;
    check(ev[0].changes == Changes::OPTIONS, format!("changes {:?}", ev[0].changes))?;
    // Superblock: a plain remount with new fs options.
    mount_remount(&r, MountFlags::RDONLY, "size=2m")?;
    let ev = w.take(1);
    expect(&ev, &s, &[(Changed, "/r")])?;
    let sup = String::from_utf8_lossy(ev[0].mount.as_ref().expect("read").super_options()).into_owned();
    check(sup.starts_with("ro,") && sup.contains("size=2048k"), format!("super options {sup}"))?;
    check(ev[0].changes.contains(Changes::SUPER_OPTIONS), "super options changed")
}

pub(super) fn propagation(mode: WatchMode, backend: BackendChoice) -> Result<(), Failed> {
    let s = Scratch::new();
    let p = s.tmpfs("p");
    std::fs::create_dir_all(p.join("x"))?;
    std::fs::create_dir_all(p.join("y"))?;
    let mut w = Watch::start(mode, backend, &s);
    // Neither fanotify nor mountinfo's poll reports a propagation change alone:
    // a resync does.
    mount_change(&p, MountPropagationFlags::SHARED)?;
    check(w.take(0).is_empty(), "make-shared is silent in the kernel")?;
    check(w.watcher().resync(), "resync queued")?;
    let ev = w.take(1);
    expect(&ev, &s, &[(Changed, "/p")])?;
    let group = ev[0].mount.as_ref().and_then(|m| m.propagation.shared).ok_or("shared:N")?;
    check(ev[0].changes == Changes::PROPAGATION, "only propagation changed")?;

    // A bind of a shared mount joins its peer group.
    let q = s.dir("q");
    mount_bind(&p, &q)?;
    let ev = w.take(1);
    expect(&ev, &s, &[(Attached, "/q")])?;
    check(ev[0].mount.as_ref().and_then(|m| m.propagation.shared) == Some(group), "bind is a peer")?;

    // A mount under one peer propagates to the other: two attaches.
    tmpfs_at(&p.join("x"));
    let ev = w.take(2);
    expect(&ev, &s, &[(Attached, "/p/x"), (Attached, "/q/x")])?;

    // Make q a slave of p's group; a new mount under p reaches q as a slave copy.
    mount_change(&q, MountPropagationFlags::DOWNSTREAM)?;
    check(w.watcher().resync(), "resync queued")?;
    let ev = w.take(1);
    expect(&ev, &s, &[(Changed, "/q")])?;
    check(
        ev[0].mount.as_ref().is_some_and(|m| m.propagation.master == Some(group) && m.propagation.shared.is_none()),
        format!("{:?}", ev[0].mount),
    )?;
    tmpfs_at(&p.join("y"));
    let ev = w.take(2);
    expect(&ev, &s, &[(Attached, "/p/y"), (Attached, "/q/y")])?;
    let qy = ev.iter().find(|e| target(e).ends_with("/q/y")).and_then(|e| e.mount.clone()).ok_or("q/y read")?;
    check(qy.propagation.master.is_some(), "copy under a slave receives from a master")
}

pub(super) fn unmount_tree(mode: WatchMode, backend: BackendChoice) -> Result<(), Failed> {
    let s = Scratch::new();
    let t = s.tmpfs("t");
    for sub in ["t/a", "t/a/b", "t/c"] {
        s.tmpfs(sub);
    }
    let mut w = Watch::start(mode, backend, &s);
    unmount(&t, UnmountFlags::DETACH)?;
    let ev = w.take(4);
    expect(&ev, &s, &[(Detached, "/t"), (Detached, "/t/a"), (Detached, "/t/a/b"), (Detached, "/t/c")])
}
/// The watcher can watch a namespace other than its caller's (the host's,
/// from a DaemonSet pod): only its ring thread joins it.
pub(super) fn other_namespace(mode: WatchMode) -> Result<(), Failed> {
    let s = Scratch::new();
    let d = s.dir("elsewhere");
    let mut holder = std::process::Command::new("unshare").args(["-m", "--propagation", "private", "sleep", "60"]).spawn()?;
    let pid = holder.id();
    let result = (|| -> Result<(), Failed> {
        let ns = std::path::PathBuf::from(format!("/proc/{pid}/ns/mnt"));
        // Wait (bounded) until the holder has its own namespace.
        let deadline = Instant::now() + patience();
        while std::fs::read_link(&ns)? == std::fs::read_link("/proc/self/ns/mnt")? {
            check(Instant::now() < deadline, "the holder never entered a namespace of its own")?;
            std::thread::sleep(Duration::from_millis(10));
        }
        let (watcher, table, rx) =
            MountWatcher::start(WatchConfig { mode, namespace: Some(ns), resync_interval: None, ..WatchConfig::default() })?;
        check(!table.is_empty(), "initial table of the other namespace")?;
        let st = std::process::Command::new("nsenter")
            .arg("-t")
            .arg(pid.to_string())
            .args(["-m", "mount", "-t", "tmpfs", "tmpfs"])
            .arg(&d)
            .status()?;
        check(st.success(), "mount inside the other namespace")?;
        let mut found = false;
        let deadline = Instant::now() + patience();
        while !found && Instant::now() < deadline {
            if let Some(ev) = rx.recv_timeout(Duration::from_millis(100)) {
                found = ev.changes().iter().any(|e| e.kind == Attached && e.subject().is_some_and(|m| m.mount_point_path() == d));
            }
        }
        watcher.stop()?;
        check(found, "attach in the other namespace reported")?;
        // And nothing reached ours.
        let (here, _) = volring_mounts::load(false)?;
        check(here.top_at(d.as_os_str().as_encoded_bytes()).is_none(), "our namespace untouched")
    })();
    let _ = holder.kill();
    let _ = holder.wait();
    result
}
/// On a kernel without fanotify mount events (or statmount), asking for
/// the fanotify mode is a typed `Unsupported` error naming what is missing,
/// and `Auto` falls back to reparse.
pub(super) fn fanotify_mode_on_an_older_kernel_says_what_is_missing() -> Result<(), Failed> {
    let config = || WatchConfig { resync_interval: None, ..WatchConfig::default() };
    match MountWatcher::start(WatchConfig { mode: WatchMode::Fanotify, ..config() }) {
        Err(volring_mounts::Error::Unsupported { what, needs }) => {
            check(!what.is_empty() && (needs == "6.8" || needs == "6.15"), format!("unsupported {what:?}, needs {needs:?}"))?
        }
        Err(e) => return Err(format!("fanotify mode on this kernel: {e:?}, want Error::Unsupported").into()),
        Ok(_) => return Err("fanotify mode started on a kernel that fanotify_support() says lacks it".into()),
    }
    let (watcher, _, _rx) = MountWatcher::start(WatchConfig { mode: WatchMode::Auto, ..config() })?;
    let mode = watcher.stats().mode;
    let _ = watcher.stop();
    check(mode == WatchMode::Reparse, format!("auto mode chose {mode:?}"))
}
