//! The node's state of world against the real kernel: the reconciler
//! repairs what changes behind the agent's back, finishes what a crash
//! interrupted before Probe answers ready, and the store keeps (and
//! imports) every staged volume. Each test starts its own `volring node` in
//! a private mount namespace; tests run one at a time, so an environment
//! variable set for one agent reaches only that agent.

mod common;
mod csi_support;

use std::path::Path;
use std::time::{Duration, Instant};

use common::check;
use csi_support::{block_cap, loops_backed_by, loops_under, mount_cap, mounts_under, Agent, MIB};
use libtest_mimic::{Failed, Trial};

/// Polls `f` every 20 ms for at most `limit`.
fn eventually(limit: Duration, mut f: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + limit;
    while Instant::now() < deadline {
        if f() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    f()
}

fn all_gone(a: &Agent) -> Result<(), Failed> {
    let m = mounts_under(&a.kubelet);
    check(m.is_empty(), format!("still mounted: {m:?}"))?;
    let l = loops_under(a.scratch.path());
    check(l.is_empty(), format!("still attached: loop{l:?}"))
}

fn status_json(a: &Agent) -> Result<serde_json::Value, Failed> {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_volring"))
        .args(["status", "--json", "--state-dir"])
        .arg(&a.state)
        .stdin(std::process::Stdio::null())
        .output()?;
    check(out.status.success(), format!("volring status: {}", String::from_utf8_lossy(&out.stderr)))?;
    Ok(serde_json::from_slice(&out.stdout)?)
}

fn staged_entry(v: &serde_json::Value, id: &str) -> Option<serde_json::Value> {
    v["staged"].as_array()?.iter().find(|s| s["volume_id"] == id).cloned()
}

/// A loop device detached and a staging mount unmounted behind the
/// agent's back are both restored (same image, same data), a staging mount
/// that vanished under a published target is re-mounted, and the repairs
/// show in the volume condition and in `volring status`.
fn behind_the_back_repairs() -> Result<(), Failed> {
    let a = Agent::start();
    a.create("pvc-det", 64 * MIB, "ext4")?;
    let staging = a.k("plugins/stage/det");
    a.stage("pvc-det", &staging, mount_cap("ext4"))?;
    std::fs::write(Path::new(&staging).join("kept"), b"kept")?;
    let before = loops_backed_by(&a.image("pvc-det"));
    check(before.len() == 1, "one device")?;
    // Detach (the kernel defers it while mounted: autoclear) and unmount,
    // which really detaches it.
    volring_sys::loopdev::LoopDevice::open(before[0])?.detach()?;
    rustix::mount::unmount(staging.as_str(), rustix::mount::UnmountFlags::empty())?;
    let repaired = eventually(Duration::from_secs(20), || {
        loops_backed_by(&a.image("pvc-det")).len() == 1 && std::fs::read(Path::new(&staging).join("kept")).ok().as_deref() == Some(b"kept")
    });
    check(repaired, format!("re-attached and re-mounted: devices {:?}", loops_backed_by(&a.image("pvc-det"))))?;
    // The verdict is published right after the repair's own mount.
    let mut c = Default::default();
    let shown = eventually(Duration::from_secs(20), || {
        c = a.stats("pvc-det", &staging).ok().and_then(|s| s.volume_condition).unwrap_or_default();
        !c.abnormal && c.message.contains("repaired")
    });
    check(shown, format!("condition after repair: {c:?}"))?;
    // The store is written at the end of the reconciler's pass.
    let mut entry = serde_json::Value::Null;
    let stored = eventually(Duration::from_secs(20), || {
        entry = status_json(&a).ok().and_then(|st| staged_entry(&st, "pvc-det")).unwrap_or_default();
        entry["health"]["last_repair"].is_object()
    });
    check(stored, format!("status shows the repair: {entry}"))?;

    // A published volume whose staging mount vanishes: re-mounted, and the
    // target (kubelet's) is left as it is.
    a.create("pvc-pub", 320 * MIB, "xfs")?;
    let (staging2, target) = (a.k("plugins/stage/pub"), a.k("pods/p/pub"));
    a.stage("pvc-pub", &staging2, mount_cap("xfs"))?;
    a.publish("pvc-pub", &staging2, &target, mount_cap("xfs"), false)?;
    std::fs::write(Path::new(&target).join("data"), b"data")?;
    rustix::mount::unmount(staging2.as_str(), rustix::mount::UnmountFlags::empty())?;
    let back = eventually(Duration::from_secs(20), || std::fs::read(Path::new(&staging2).join("data")).ok().as_deref() == Some(b"data"));
    check(back, "the staging mount is back")?;
    check(std::fs::read(Path::new(&target).join("data"))? == b"data", "the target still serves the volume")?;

    // A block volume whose bound device node is unmounted: bound again.
    a.create("pvc-blk", 32 * MIB, "")?;
    let staging3 = a.k("plugins/stage/blk");
    a.stage("pvc-blk", &staging3, block_cap())?;
    let node = Path::new(&staging3).join("pvc-blk");
    rustix::mount::unmount(&node, rustix::mount::UnmountFlags::empty())?;
    let bound = eventually(Duration::from_secs(20), || mounts_under(Path::new(&staging3)).len() == 1);
    check(bound, "the block device is bound again")?;

    // A tmpfs over the staging path's parent: the volume is not mounted
    // under it (it is not volring's), and is repaired once it goes.
    let parent = Path::new(&staging3).parent().ok_or("parent")?.to_path_buf();
    let staging4 = parent.join("shadowed").to_string_lossy().into_owned();
    a.create("pvc-sh", 32 * MIB, "")?;
    a.stage("pvc-sh", &staging4, mount_cap(""))?;
    // Shadow first, then pull the (now hidden) staging mount through a
    // descriptor taken before, so nothing is repaired in between.
    let hidden = rustix::fs::open(staging4.as_str(), rustix::fs::OFlags::PATH | rustix::fs::OFlags::DIRECTORY, rustix::fs::Mode::empty())?;
    common::tmpfs_at(&parent);
    std::fs::create_dir_all(&staging4)?;
    rustix::mount::unmount(
        format!("/proc/self/fd/{}", std::os::fd::AsRawFd::as_raw_fd(&hidden)).as_str(),
        rustix::mount::UnmountFlags::DETACH,
    )?;
    drop(hidden);
    let refused = eventually(Duration::from_secs(20), || {
        a.stats("pvc-sh", &staging4).ok().and_then(|s| s.volume_condition).is_some_and(|c| c.abnormal && c.message.contains("covered"))
    });
    let under = mounts_under(Path::new(&staging4));
    // The agent looks at the covered path (through a descriptor) each time
    // it declines the repair, so the shadow can be busy for a moment; a
    // descriptor it kept would keep it busy and fail here.
    let gone =
        eventually(Duration::from_secs(20), || rustix::mount::unmount(parent.as_path(), rustix::mount::UnmountFlags::empty()).is_ok());
    check(gone, format!("the shadowing tmpfs stayed busy: {}", parent.display()))?;
    check(refused && under.is_empty(), format!("repair under a shadowing mount: reported {refused}, mounts {under:?}"))?;
    let back = eventually(Duration::from_secs(20), || mounts_under(Path::new(&staging4)).len() == 1);
    check(back, "repaired once the shadow is gone")?;
    a.unstage("pvc-sh", &staging4)?;

    a.unpublish("pvc-pub", &target)?;
    for (id, st) in [("pvc-det", &staging), ("pvc-pub", &staging2), ("pvc-blk", &staging3)] {
        a.unstage(id, st)?;
    }
    all_gone(&a)
}

/// Starts `a`'s agent with a fault point armed, runs `call` (which the
/// agent dies in), and starts it again unarmed.
fn crash_at(a: &mut Agent, point: &str, call: impl FnOnce(&Agent) -> bool) -> Result<(), Failed> {
    a.kill_hard();
    std::env::set_var("VOLRING_FAULT_POINT", point);
    a.respawn();
    std::env::remove_var("VOLRING_FAULT_POINT");
    let survived = call(a);
    check(!survived, format!("the call went through fault point {point}"))?;
    a.kill_hard();
    a.respawn();
    Ok(())
}

/// An unstage interrupted after its intent is finished by the restarted
/// agent before it answers Probe ready; kubelet's retry then succeeds.
/// An interrupted stage is likewise finished before ready.
fn interrupted_operations_finish_before_ready() -> Result<(), Failed> {
    let mut a = Agent::start();
    a.create("pvc-u", 32 * MIB, "")?;
    let staging = a.k("plugins/stage/u");
    a.stage("pvc-u", &staging, mount_cap(""))?;
    crash_at(&mut a, "unstage:intent", |a| a.unstage("pvc-u", &staging).is_ok())?;
    // `respawn` returned once Probe said ready: the unstage is done.
    check(mounts_under(Path::new(&staging)).is_empty(), "unmounted before ready")?;
    check(loops_backed_by(&a.image("pvc-u")).is_empty(), "detached before ready")?;
    check(staged_entry(&status_json(&a)?, "pvc-u").is_none(), "no record left")?;
    a.unstage("pvc-u", &staging)?;

    a.create("pvc-s", 32 * MIB, "")?;
    let staging = a.k("plugins/stage/s");
    crash_at(&mut a, "stage:mount", |a| a.stage("pvc-s", &staging, mount_cap("")).is_ok())?;
    check(mounts_under(Path::new(&staging)).len() == 1, "staged before ready")?;
    let entry = staged_entry(&status_json(&a)?, "pvc-s").ok_or("pvc-s in status")?;
    check(entry["phase"] == "staged", format!("recorded staged: {entry}"))?;
    a.stage("pvc-s", &staging, mount_cap(""))?;
    std::fs::write(Path::new(&staging).join("f"), b"f")?;
    a.unstage("pvc-s", &staging)?;
    all_gone(&a)
}

/// A node with the JSON records of the layout before the store imports
/// them once at start and keeps every staged volume; `volring status`
/// reads the store after a SIGKILL.
fn legacy_records_imported_and_status_after_crash() -> Result<(), Failed> {
    let mut a = Agent::start();
    a.create("pvc-l1", 32 * MIB, "")?;
    a.create("pvc-l2", 32 * MIB, "")?;
    let (s1, s2) = (a.k("plugins/stage/l1"), a.k("plugins/stage/l2"));
    a.stage("pvc-l1", &s1, mount_cap(""))?;
    a.stage("pvc-l2", &s2, block_cap())?;
    a.kill_hard();
    // After a SIGKILL the store needs redb's repair; status does it, as no
    // agent holds the state directory.
    let st = status_json(&a)?;
    check(staged_entry(&st, "pvc-l1").is_some() && staged_entry(&st, "pvc-l2").is_some(), format!("status after SIGKILL: {st}"))?;
    // Rewrite the state as an older agent kept it: one JSON file each.
    let records = volring_volumes::StagedRecords::open(&a.state)?.all();
    std::fs::remove_file(a.state.join(volring_volumes::store::FILE))?;
    let legacy = a.state.join("staged");
    std::fs::create_dir_all(&legacy)?;
    for r in &records {
        std::fs::write(legacy.join(format!("{}.json", r.volume_id)), serde_json::to_vec_pretty(r)?)?;
    }
    a.respawn();
    let st = status_json(&a)?;
    for id in ["pvc-l1", "pvc-l2"] {
        let e = staged_entry(&st, id).ok_or(format!("{id} imported"))?;
        check(e["phase"] == "staged" && e["attached"] == true, format!("{id}: {e}"))?;
        check(legacy.join("imported").join(format!("{id}.json")).exists(), "the file is set aside")?;
    }
    a.stage("pvc-l1", &s1, mount_cap(""))?;
    a.unstage("pvc-l1", &s1)?;
    a.unstage("pvc-l2", &s2)?;
    all_gone(&a)
}

/// A loop device serving a pool image that no record explains is reported
/// (status, agent) and left alone; with --remove-orphans it is detached.
fn orphans_reported_and_removed_only_when_asked() -> Result<(), Failed> {
    let mut a = Agent::start();
    a.create("pvc-o", 32 * MIB, "")?;
    let out = std::process::Command::new("losetup").arg("-f").arg("--show").arg(a.image("pvc-o")).output()?;
    check(out.status.success(), "losetup")?;
    let st = status_json(&a)?;
    check(st["problems"].to_string().contains("orphan"), format!("status reports the orphan: {}", st["problems"]))?;
    a.restart();
    check(loops_backed_by(&a.image("pvc-o")).len() == 1, "reported, not removed, by default")?;
    a.kill_hard();
    std::env::set_var("VOLRING_REMOVE_ORPHANS", "true");
    a.respawn();
    std::env::remove_var("VOLRING_REMOVE_ORPHANS");
    check(loops_backed_by(&a.image("pvc-o")).is_empty(), "removed at start when asked")?;
    a.delete("pvc-o")?;
    all_gone(&a)
}

/// An in-process driver whose mount table is a snapshot that never moves:
/// the table lags the kernel by as much as a test needs, deterministically.
struct Frozen {
    driver: std::sync::Arc<volring_csi::Driver>,
    table: std::sync::Arc<std::sync::RwLock<volring_mounts::MountTable>>,
    rt: tokio::runtime::Runtime,
    c: volring_csi::client::Clients,
    _socket: volring_csi::server::BoundSocket,
    scratch: Option<common::Scratch>,
}

fn snapshot() -> volring_mounts::MountTable {
    volring_mounts::MountTable::from_mountinfo(&std::fs::read("/proc/thread-self/mountinfo").unwrap_or_default()).0
}

impl Frozen {
    fn start() -> Result<Self, Failed> {
        let scratch = common::Scratch::new();
        let state = scratch.dir("state");
        let mut config = volring_csi::CsiConfig::new(scratch.path().join("csi.sock"), "test-node".into());
        config.kubelet_root = scratch.dir("kubelet");
        config.pool_dir = state.join("pool");
        config.state_dir = state;
        let table = std::sync::Arc::new(std::sync::RwLock::new(snapshot()));
        let ready = volring_csi::Readiness::default();
        ready.set(true);
        let driver = volring_csi::Driver::new(config.clone(), table.clone(), ready).map_err(|e| e.to_string())?;
        let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
        let (listener, socket) = rt.block_on(async { volring_csi::server::bind(&config.endpoint) })?;
        rt.spawn(volring_csi::server::serve(driver.clone(), listener, std::future::pending()));
        let c = rt.block_on(volring_csi::client::Clients::connect(config.endpoint.clone())).map_err(|e| e.to_string())?;
        Ok(Self { driver, table, rt, c, _socket: socket, scratch: Some(scratch) })
    }

    fn k(&self, rel: &str) -> String {
        self.driver.config().kubelet_root.join(rel).to_string_lossy().into_owned()
    }

    fn create(&self, name: &str, fs: &str) -> Result<(), Failed> {
        let mut c = self.c.controller.clone();
        let params = [("fsType".to_string(), fs.to_string())].into();
        self.rt.block_on(c.create_volume(volring_csi::proto::CreateVolumeRequest {
            name: name.into(),
            capacity_range: Some(volring_csi::proto::CapacityRange { required_bytes: 32 * MIB, limit_bytes: 0 }),
            volume_capabilities: vec![mount_cap(fs)],
            parameters: params,
            ..Default::default()
        }))?;
        Ok(())
    }

    fn stage(&self, id: &str, staging: &str) -> Result<(), Failed> {
        let mut c = self.c.node.clone();
        self.rt.block_on(c.node_stage_volume(volring_csi::proto::NodeStageVolumeRequest {
            volume_id: id.into(),
            staging_target_path: staging.into(),
            volume_capability: Some(mount_cap("ext4")),
            ..Default::default()
        }))?;
        Ok(())
    }

    fn publish(&self, id: &str, staging: &str, target: &str) -> Result<(), Failed> {
        let mut c = self.c.node.clone();
        self.rt.block_on(c.node_publish_volume(volring_csi::proto::NodePublishVolumeRequest {
            volume_id: id.into(),
            staging_target_path: staging.into(),
            target_path: target.into(),
            volume_capability: Some(mount_cap("ext4")),
            ..Default::default()
        }))?;
        Ok(())
    }
}

impl Drop for Frozen {
    fn drop(&mut self) {
        // Every mount below the scratch directory goes first (lazily), then
        // every loop device whose image lived there.
        let dir = self.scratch.as_ref().map(|s| s.path().to_path_buf());
        self.scratch.take();
        if let Some(dir) = dir {
            for n in loops_under(&dir) {
                if let Ok(d) = volring_sys::loopdev::LoopDevice::open(n) {
                    let _ = d.detach();
                }
            }
        }
    }
}

/// The reconciler handed a mount table that lags the kernel (a snapshot
/// taken before anything was staged, never updated) decides nothing from
/// it: a staged and published volume the table has not heard of is not
/// reported as drifting; a staging mount that vanished under a mount which
/// now covers its parent — a cover the table has not heard of either — is
/// not re-mounted under that cover; a loop device serving a pool image with
/// no record, mounted where the table does not show it, is not detached
/// even with orphan removal on. Once the table catches up, the verdicts
/// follow it.
fn a_stale_table_decides_nothing() -> Result<(), Failed> {
    let f = Frozen::start()?;
    // Staged and published: the table knows neither mount.
    f.create("pvc-a", "ext4")?;
    let (staging_a, target_a) = (f.k("plugins/a/stage"), f.k("pods/a/mount"));
    f.stage("pvc-a", &staging_a)?;
    f.publish("pvc-a", &staging_a, &target_a)?;
    // Staged, then a tmpfs over the staging path's parent and the (now
    // hidden) staging mount pulled away through a descriptor taken before.
    f.create("pvc-b", "ext4")?;
    let staging_b = f.k("plugins/b/stage");
    f.stage("pvc-b", &staging_b)?;
    let parent_b = Path::new(&staging_b).parent().ok_or("parent")?.to_path_buf();
    let hidden = rustix::fs::open(staging_b.as_str(), rustix::fs::OFlags::PATH | rustix::fs::OFlags::DIRECTORY, rustix::fs::Mode::empty())?;
    common::tmpfs_at(&parent_b);
    std::fs::create_dir_all(&staging_b)?;
    rustix::mount::unmount(
        format!("/proc/self/fd/{}", std::os::fd::AsRawFd::as_raw_fd(&hidden)).as_str(),
        rustix::mount::UnmountFlags::DETACH,
    )?;
    drop(hidden);
    // An orphan: an ext4 image in the pool on a loop device with no record,
    // mounted outside the kubelet root.
    let pool = f.driver.pool_dir().to_path_buf();
    let image = pool.join("pvc-orphan.img");
    std::fs::File::create(&image)?.set_len(32 * MIB as u64)?;
    let out = std::process::Command::new("mkfs.ext4").arg("-q").arg(&image).output()?;
    check(out.status.success(), format!("mkfs.ext4: {}", String::from_utf8_lossy(&out.stderr)))?;
    let out = std::process::Command::new("losetup").arg("-f").arg("--show").arg(&image).output()?;
    check(out.status.success(), format!("losetup: {}", String::from_utf8_lossy(&out.stderr)))?;
    let orphan = String::from_utf8_lossy(&out.stdout).trim().to_string();
    let number: u32 = orphan.strip_prefix("/dev/loop").and_then(|n| n.parse().ok()).ok_or_else(|| format!("losetup printed {orphan:?}"))?;
    let orphan_at = f.scratch.as_ref().ok_or("scratch")?.dir("orphan");
    rustix::mount::mount(orphan.as_str(), orphan_at.as_path(), "ext4", rustix::mount::MountFlags::empty(), None)?;

    let config = volring_volumes::ReconcileConfig { remove_orphans: true, ..Default::default() };
    // The first pass runs before this returns.
    let r = f.driver.start_reconciler(config)?;
    let a = r.view().get("pvc-a");
    let b = r.view().get("pvc-b");
    let repairs = r.stats().repairs_done.load(std::sync::atomic::Ordering::Relaxed);
    let under_cover = mounts_under(Path::new(&staging_b));
    let autoclear = std::fs::read_to_string(format!("/sys/block/loop{number}/loop/autoclear")).unwrap_or_default();
    let orphan_served = loops_backed_by(&image).contains(&number);
    // Every wrong decision is listed, not only the first.
    let orphans = r.stats().orphans.lock().map_err(|e| e.to_string())?.clone();
    let wrong: Vec<String> = [
        (a.as_ref().is_none_or(|h| h.drift.is_empty()), format!("pvc-a reported from the stale table: {a:?}")),
        (repairs == 0, format!("{repairs} repairs made from a stale table")),
        (under_cover.is_empty(), format!("pvc-b re-mounted under the covering tmpfs: {under_cover:?}")),
        (
            b.as_ref().and_then(|h| h.repair_error.as_deref()).is_some_and(|e| e.contains("covered")),
            format!("pvc-b: the cover is not reported: {b:?}"),
        ),
        (orphan_served && autoclear.trim() == "0", format!("the mounted orphan was detached (autoclear {:?})", autoclear.trim())),
        (
            orphans.iter().any(|o| o.contains("pvc-orphan.img") && !o.contains("detach")),
            format!("the orphan is not reported as left alone: {orphans:?}"),
        ),
    ]
    .into_iter()
    .filter(|(ok, _)| !ok)
    .map(|(_, why)| why)
    .collect();
    check(wrong.is_empty(), wrong.join("\n"))?;

    // The watcher catches up: the verdicts follow the (now true) table.
    *f.table.write().map_err(|e| e.to_string())? = snapshot();
    r.notifier().tell(volring_volumes::Changed::Resync);
    let mut seen = None;
    let caught_up = eventually(Duration::from_secs(20), || {
        seen = r.view().get("pvc-a");
        seen.as_ref().is_some_and(|h| h.drift.is_empty())
    });
    check(caught_up, format!("pvc-a healthy once the table agrees: {seen:?}"))?;
    check(mounts_under(Path::new(&staging_b)).is_empty(), "still nothing under the cover")?;
    r.stop();
    Ok(())
}

/// The reconciler decided "staging missing" and, between that decision and
/// its mount, a foreign tmpfs appears on the staging path (the pause point
/// `stage:premount` holds the repair there). The volume must not be
/// mounted on top of it: the tmpfs stays the top mount, its file visible,
/// and the refusal shows in the volume's condition, in status and in the
/// log. Once the tmpfs goes, the volume is repaired.
fn foreign_mount_between_decision_and_act() -> Result<(), Failed> {
    let pause = common::Scratch::new();
    let dir = pause.path().to_string_lossy().into_owned();
    // The first premount is the stage's own; the second, the repair's.
    let a = Agent::start_with(&[("VOLRING_PAUSE_POINT", "stage:premount@2"), ("VOLRING_PAUSE_DIR", &dir)]);
    a.create("pvc-race", 64 * MIB, "ext4")?;
    let staging = a.k("plugins/stage/race");
    a.stage("pvc-race", &staging, mount_cap("ext4"))?;
    std::fs::write(Path::new(&staging).join("kept"), b"kept")?;
    rustix::mount::unmount(staging.as_str(), rustix::mount::UnmountFlags::empty())?;
    let reached = eventually(Duration::from_secs(20), || pause.path().join("stage_premount.reached").exists());
    check(reached, format!("the repair never reached its mount; log:\n{}", a.log_tail(40)))?;
    common::tmpfs_at(Path::new(&staging));
    std::fs::write(Path::new(&staging).join("foreign"), b"tenant")?;
    std::fs::write(pause.path().join("stage_premount.go"), b"")?;
    // The repair went on: it says how it ended in the log.
    let acted = eventually(Duration::from_secs(20), || {
        let log = std::fs::read_to_string(&a.log).unwrap_or_default();
        log.contains("repaired") || log.contains("repair failed")
    });
    check(acted, format!("the repair did not finish; log:\n{}", a.log_tail(30)))?;
    let mut cond = Default::default();
    let refused = eventually(Duration::from_secs(20), || {
        cond = a.stats("pvc-race", &staging).ok().and_then(|s| s.volume_condition).unwrap_or_default();
        cond.abnormal && !cond.message.contains("repaired")
    });
    let on_top = std::fs::read(Path::new(&staging).join("foreign")).ok();
    let under = mounts_under(Path::new(&staging));
    check(refused, format!("condition: {cond:?}"))?;
    check(
        on_top.as_deref() == Some(b"tenant") && under.len() == 1,
        format!("the volume was mounted over the foreign tmpfs: mounts {under:?}, foreign file {on_top:?}"),
    )?;
    let log = std::fs::read_to_string(&a.log).unwrap_or_default();
    check(log.contains("mounted there while"), format!("the log says nothing of it:\n{}", a.log_tail(30)))?;
    let st = status_json(&a)?;
    let entry = staged_entry(&st, "pvc-race").unwrap_or_default();
    check(!entry["health"]["drift"].as_array().is_none_or(|d| d.is_empty()), format!("status shows the drift: {entry}"))?;
    // The foreign mount goes: repaired, the volume's data back.
    let gone =
        eventually(Duration::from_secs(20), || rustix::mount::unmount(staging.as_str(), rustix::mount::UnmountFlags::empty()).is_ok());
    check(gone, "the foreign tmpfs stayed busy")?;
    let back = eventually(Duration::from_secs(30), || std::fs::read(Path::new(&staging).join("kept")).ok().as_deref() == Some(b"kept"));
    check(back, format!("repaired once the foreign mount went; log:\n{}", a.log_tail(30)))?;
    a.unstage("pvc-race", &staging)?;
    all_gone(&a)
}

fn main() {
    let trials = vec![
        Trial::test("state::behind_the_back_repairs", behind_the_back_repairs),
        Trial::test("state::interrupted_operations_finish_before_ready", interrupted_operations_finish_before_ready),
        Trial::test("state::legacy_records_imported_and_status_after_crash", legacy_records_imported_and_status_after_crash),
        Trial::test("state::orphans_reported_and_removed_only_when_asked", orphans_reported_and_removed_only_when_asked),
        Trial::test("state::a_stale_table_decides_nothing", a_stale_table_decides_nothing),
        Trial::test("state::foreign_mount_between_decision_and_act", foreign_mount_between_decision_and_act),
    ];
    common::run_in_private_namespace(trials)
}
