//! Many changes at once: short-lived mounts, a consumer that does not
//! read, a fanotify queue overflow, and periodic resyncs.

use super::*;

/// After any burst the consumer's table equals the kernel's, and with
/// fanotify every short-lived mount is reported (attach and detach).
pub(super) fn short_lived_mounts(mode: WatchMode, backend: BackendChoice) -> Result<(), Failed> {
    short_lived_mounts_with(WatchConfig { mode, backend, resync_interval: None, ..WatchConfig::default() }, false)
}

/// Resyncs race the fanotify events of the same mounts (a resync is asked
/// for after every mount and umount, and table changes are checked for
/// remounts at once): each mount must still be reported attached once and
/// detached once.
pub(super) fn short_lived_mounts_racing_resyncs(backend: BackendChoice) -> Result<(), Failed> {
    short_lived_mounts_with(
        WatchConfig { mode: WatchMode::Fanotify, backend, resync_interval: None, remount_grace: Duration::ZERO, ..WatchConfig::default() },
        true,
    )
}

/// Counts every event, including those of mounts gone before they could be
/// read (which name no path, so cannot be told apart from other tests'
/// mounts): runs on a thread with a mount namespace of its own.
fn short_lived_mounts_with(config: WatchConfig, racing_resyncs: bool) -> Result<(), Failed> {
    std::thread::spawn(move || {
        volring_sys::ns::enter_private_mount_namespace()?;
        short_lived_mounts_alone(config, racing_resyncs)
    })
    .join()
    .map_err(|_| Failed::from("scenario thread panicked"))?
}

fn short_lived_mounts_alone(config: WatchConfig, racing_resyncs: bool) -> Result<(), Failed> {
    let mode = config.mode;
    let s = Scratch::new();
    let d = s.dir("burst");
    let mut w = Watch::with(config, &s);
    for _ in 0..50 {
        tmpfs_at(&d);
        if racing_resyncs {
            w.watcher().resync();
        }
        umount(&d);
        if racing_resyncs {
            w.watcher().resync();
        }
    }
    let keep = s.tmpfs("keep");
    let ev = w.take(if mode == WatchMode::Fanotify { 101 } else { 1 });
    if mode == WatchMode::Fanotify {
        let attached = ev.iter().filter(|e| e.kind == Attached).count();
        let detached = ev.iter().filter(|e| e.kind == Detached).count();
        check(attached == 51 && detached == 50, format!("attached {attached}, detached {detached}"))?;
    }
    check(w.table.top_at(keep.as_os_str().as_encoded_bytes()).is_some(), "last mount is in the table")?;
    if racing_resyncs {
        check(w.watcher().stats().resyncs > 0, "resyncs ran during the burst")?;
    }
    same_as_kernel(&w.table, mode)
}
/// A consumer that does not read gets one coalesced diff, not a gap.
pub(super) fn lagging_consumer(mode: WatchMode, backend: BackendChoice) -> Result<(), Failed> {
    let s = Scratch::new();
    let mut w = Watch::with(WatchConfig { mode, backend, queue_capacity: 2, resync_interval: None, ..WatchConfig::default() }, &s);
    let mut paths = Vec::new();
    for i in 0..20 {
        let p = s.tmpfs(&format!("l{i}"));
        // Give the watcher time to see each one separately.
        std::thread::sleep(Duration::from_millis(2));
        paths.push(p);
    }
    for p in &paths[..5] {
        umount(p);
    }
    // Nothing has been read yet: once the watcher has counted two events more
    // than the queue holds, the last one counted has been fully handled and
    // went to the backlog (counted events before it filled the queue), so a
    // coalesced resync must follow. A bounded wait for that, not a fixed
    // sleep: a watcher slowed by load could otherwise be read as fast as it
    // emits and never lag.
    let deadline = Instant::now() + patience();
    while w.watcher().stats().mount_events < 4 {
        check(Instant::now() < deadline, format!("the watcher emitted too little: {:?}", w.watcher().stats()))?;
        std::thread::sleep(Duration::from_millis(10));
    }
    let mut lagged = 0;
    let mut attached = std::collections::BTreeSet::new();
    let deadline = Instant::now() + patience();
    // Until the table shows the kernel's end state (15 live, 5 gone): with
    // 15 known, a detach may still be on its way.
    let settled = |w: &Watch, attached: &std::collections::BTreeSet<std::path::PathBuf>| {
        attached.len() == 15 && paths[..5].iter().all(|p| w.table.top_at(p.as_os_str().as_encoded_bytes()).is_none())
    };
    while Instant::now() < deadline && !settled(&w, &attached) {
        let Some(d) = w.rx.recv_timeout(Duration::from_millis(200)) else {
            continue;
        };
        if let WatchEvent::Resync { reason, .. } = &d {
            check(*reason == ResyncReason::ConsumerLagged, "lag reason")?;
            lagged += 1;
        }
        for e in d.changes() {
            w.table.apply(e);
        }
        attached = paths.iter().filter(|p| w.table.top_at(p.as_os_str().as_encoded_bytes()).is_some()).cloned().collect();
    }
    check(lagged >= 1, "a coalesced resync was delivered")?;
    check(attached.len() == 15, format!("{} of 15 live mounts known", attached.len()))?;
    check(paths[..5].iter().all(|p| w.table.top_at(p.as_os_str().as_encoded_bytes()).is_none()), "unmounted ones are gone")?;
    converges_to_kernel(&mut w, mode)
}

/// A fanotify queue overflow is answered with one `resync` delivery. The
/// kernel's per-group queue limit is read once, at group creation, so it is
/// lowered only around the watcher's start.
///
/// Mounts made one syscall at a time do not overflow for sure: on an idle
/// machine the watcher, on the other core, may read each event as it comes
/// (1 run in 8 never overflowed in 200 rounds). A recursive bind of a tree
/// of four mounts queues four events in one syscall, past the limit of 2
/// whatever the watcher does; its lazy unmount queues four more.
pub(super) fn fanotify_overflow(backend: BackendChoice) -> Result<(), Failed> {
    const KNOB: &str = "/proc/sys/fs/fanotify/max_queued_events";
    let s = Scratch::new();
    let d = s.dir("o");
    let tree = s.dir("tree");
    let copy = s.dir("copy");
    tmpfs_at(&tree);
    let subs: Vec<_> = (0..3).map(|i| tree.join(i.to_string())).collect();
    for sub in &subs {
        std::fs::create_dir(sub)?;
        tmpfs_at(sub);
    }
    let old = std::fs::read_to_string(KNOB)?;
    std::fs::write(KNOB, "2")?;
    let started = std::panic::catch_unwind(|| Watch::start(WatchMode::Fanotify, backend, &s));
    std::fs::write(KNOB, old.trim())?;
    let mut w = started.map_err(|_| "watcher start panicked")?;
    let mut overflowed = false;
    for _ in 0..200 {
        for _ in 0..20 {
            tmpfs_at(&d);
            umount(&d);
        }
        mount_bind_recursive(&tree, &copy)?;
        unmount(&copy, UnmountFlags::DETACH)?;
        tmpfs_at(&d);
        while let Some(ev) = w.rx.recv_timeout(Duration::from_millis(50)) {
            overflowed |= matches!(ev, WatchEvent::Resync { reason: ResyncReason::Overflow, .. });
            ev.changes().iter().for_each(|e| w.table.apply(e));
        }
        umount(&d);
        if overflowed {
            break;
        }
    }
    check(overflowed, "an overflow resync was delivered")?;
    check(w.watcher().stats().overflows >= 1, "overflow counted")?;
    check(w.watcher().stats().resyncs_by.overflow >= 1, "the resync counted under reason overflow")?;
    converges_to_kernel(&mut w, WatchMode::Fanotify)?;
    for sub in subs.iter().rev() {
        umount(sub);
    }
    umount(&tree);
    Ok(())
}

/// An idle watcher's periodic resyncs are counted as periodic, never as
/// overflows: `VolringMountResyncStorm` counts only overflows, and before
/// the split every periodic resync (each 30 s) counted toward it.
pub(super) fn periodic_resyncs_are_not_overflows(backend: BackendChoice) -> Result<(), Failed> {
    let s = Scratch::new();
    let config =
        WatchConfig { mode: WatchMode::Fanotify, backend, resync_interval: Some(Duration::from_millis(20)), ..WatchConfig::default() };
    let w = Watch::with(config, &s);
    let deadline = Instant::now() + patience();
    while w.watcher().stats().resyncs_by.periodic < 3 {
        check(Instant::now() < deadline, "three periodic resyncs ran")?;
        std::thread::sleep(Duration::from_millis(10));
    }
    let stats = w.watcher().stats();
    check(stats.resyncs_by.overflow == 0, format!("no overflow counted on an idle watcher: {:?}", stats.resyncs_by))?;
    check(stats.resyncs == stats.resyncs_by.by_reason().iter().map(|(_, n)| n).sum::<u64>(), "the total is the sum of the reasons")?;
    Ok(())
}
