//! An agent restarted or killed mid-call, and a volume's condition: ext4
//! errors and an xfs shutdown are abnormal, and repair.

use super::*;

/// The records on disk let a new agent unpublish and unstage what the old
/// one staged, after a clean stop and after SIGKILL.
pub(super) fn restart_between_stage_and_unstage() -> Result<(), Failed> {
    let mut a = Agent::start();
    for (i, fs) in ["ext4", "xfs"].iter().enumerate() {
        let id = format!("pvc-r{i}");
        a.create(&id, 320 * MIB, fs)?;
        a.stage(&id, &a.k(&format!("plugins/stage/{id}")), mount_cap(fs))?;
        a.publish(&id, &a.k(&format!("plugins/stage/{id}")), &a.k(&format!("pods/r/{id}")), mount_cap(fs), false)?;
        std::fs::write(a.k(&format!("pods/r/{id}/kept")), b"before restart")?;
    }
    a.create("pvc-blk", 32 * MIB, "")?;
    a.stage("pvc-blk", &a.k("plugins/stage/pvc-blk"), block_cap())?;
    a.restart();
    a.kill_hard();
    a.respawn();
    for (i, fs) in ["ext4", "xfs"].iter().enumerate() {
        let id = format!("pvc-r{i}");
        let (staging, target) = (a.k(&format!("plugins/stage/{id}")), a.k(&format!("pods/r/{id}")));
        // Repeating the stage and publish after the restart changes nothing.
        a.stage(&id, &staging, mount_cap(fs))?;
        a.publish(&id, &staging, &target, mount_cap(fs), false)?;
        check(std::fs::read(format!("{target}/kept"))? == b"before restart", "data still there")?;
        let s = a.stats(&id, &target)?;
        check(s.volume_condition.is_some_and(|c| !c.abnormal), "healthy after restart")?;
        a.unpublish(&id, &target)?;
        a.unstage(&id, &staging)?;
    }
    a.unstage("pvc-blk", &a.k("plugins/stage/pvc-blk"))?;
    all_gone(&a)
}

/// An agent killed between attaching a loop device and recording its
/// number: the next stage adopts that device (no second one), and an unstage
/// without a stage finds it by its image.
pub(super) fn crash_mid_attach() -> Result<(), Failed> {
    let mut a = Agent::start();
    for id in ["pvc-adopt", "pvc-orphan"] {
        a.create(id, 32 * MIB, "")?;
    }
    a.kill_hard();
    let mut loops = Vec::new();
    for id in ["pvc-adopt", "pvc-orphan"] {
        let staging = a.k(&format!("plugins/stage/{id}"));
        let record = serde_json::json!({
            "volume_id": id, "image": a.image(id), "staging_path": staging,
            "access": {"kind": "mount", "fs_type": "", "flags": []},
            "read_only": false, "phase": "attaching",
        });
        // The record the killed agent left, put where a live one keeps it.
        let record: volring_volumes::StagedVolume = serde_json::from_value(record)?;
        volring_volumes::StagedRecords::open(&a.state)?.put(&record)?;
        let out = std::process::Command::new("losetup").arg("-f").arg("--show").arg(a.image(id)).output()?;
        check(out.status.success(), "losetup")?;
        loops.push(String::from_utf8(out.stdout)?.trim().to_string());
    }
    a.respawn();
    a.stage("pvc-adopt", &a.k("plugins/stage/pvc-adopt"), mount_cap(""))?;
    let adopted = loops_under(&a.state.join("pool").join("pvc-adopt.img"));
    check(adopted.len() == 1 && loops[0] == format!("/dev/loop{}", adopted[0]), format!("adopted {loops:?} -> {adopted:?}"))?;
    a.unstage("pvc-adopt", &a.k("plugins/stage/pvc-adopt"))?;
    a.unstage("pvc-orphan", &a.k("plugins/stage/pvc-orphan"))?;
    all_gone(&a)
}

/// With repairs off (`--no-repair`), a volume whose mount vanished behind
/// the driver's back is reported abnormal, and staging it again repairs it.
/// (With repairs on, the reconciler re-mounts it: tests/state.rs.)
pub(super) fn condition_and_repair() -> Result<(), Failed> {
    // Tests in this binary run one at a time: the variable reaches only
    // this agent.
    std::env::set_var("VOLRING_NO_REPAIR", "true");
    let a = Agent::start();
    std::env::remove_var("VOLRING_NO_REPAIR");
    a.create("pvc-c", 32 * MIB, "")?;
    let staging = a.k("plugins/stage/c");
    a.stage("pvc-c", &staging, mount_cap(""))?;
    rustix::mount::unmount(staging.as_str(), rustix::mount::UnmountFlags::empty())?;
    // The watcher's table catches up within milliseconds; poll (bounded).
    let mut abnormal = false;
    for _ in 0..100 {
        let s = a.stats("pvc-c", &staging)?;
        if s.volume_condition.is_some_and(|c| c.abnormal && c.message.contains("not mounted")) {
            abnormal = true;
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    check(abnormal, "a vanished mount is abnormal")?;
    a.stage("pvc-c", &staging, mount_cap(""))?;
    let s = a.stats("pvc-c", &staging)?;
    check(s.volume_condition.as_ref().is_some_and(|c| !c.abnormal), format!("stage repaired the mount: {:?}", s.volume_condition))?;
    a.unstage("pvc-c", &staging)?;
    all_gone(&a)
}

/// An ext4 that recorded an error (and, with the default errors=
/// behaviour, may have shut itself down while /proc/mounts still says rw)
/// is an abnormal volume, though its mount is where it should be.
pub(super) fn ext4_errors_are_abnormal() -> Result<(), Failed> {
    let a = Agent::start();
    a.create("pvc-err", 32 * MIB, "ext4")?;
    let staging = a.k("plugins/stage/err");
    a.stage("pvc-err", &staging, mount_cap("ext4"))?;
    let s = a.stats("pvc-err", &staging)?;
    check(s.volume_condition.as_ref().is_some_and(|c| !c.abnormal), format!("healthy at first: {:?}", s.volume_condition))?;
    let loops = csi_support::loops_backed_by(&a.image("pvc-err"));
    check(loops.len() == 1, "one loop device")?;
    let sys = format!("/sys/fs/ext4/loop{}", loops[0]);
    // ext4's own knob: records an error exactly as a failed I/O would.
    std::fs::write(format!("{sys}/trigger_fs_error"), b"volring test")?;
    // The kernel saves the count from a work item: poll (bounded).
    let mut c = VolumeCondition::default();
    for _ in 0..100 {
        c = a.stats("pvc-err", &staging)?.volume_condition.unwrap_or_default();
        if c.abnormal {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    check(std::fs::read_to_string(format!("{sys}/errors_count"))?.trim() != "0", "the kernel counted the error")?;
    check(c.abnormal && c.message.contains("errors"), format!("an ext4 with errors is abnormal: {c:?}"))?;
    a.unstage("pvc-err", &staging)?;
    all_gone(&a)
}

/// An xfs that shut itself down still answers statfs and /proc/mounts
/// still says rw (and xfs keeps no error count in sysfs): the volume is
/// abnormal all the same.
pub(super) fn xfs_shutdown_is_abnormal() -> Result<(), Failed> {
    let a = Agent::start();
    a.create("pvc-xshut", 320 * MIB, "xfs")?;
    let staging = a.k("plugins/stage/xshut");
    a.stage("pvc-xshut", &staging, mount_cap("xfs"))?;
    let s = a.stats("pvc-xshut", &staging)?;
    check(s.volume_condition.as_ref().is_some_and(|c| !c.abnormal), format!("healthy at first: {:?}", s.volume_condition))?;
    // What a failed metadata write does, asked for directly.
    let out = std::process::Command::new("xfs_io").args(["-x", "-c", "shutdown"]).arg(&staging).output()?;
    check(out.status.success(), format!("xfs_io shutdown: {}", String::from_utf8_lossy(&out.stderr)))?;
    let opts = String::from_utf8(std::process::Command::new("findmnt").args(["-no", "OPTIONS"]).arg(&staging).output()?.stdout)?;
    check(opts.starts_with("rw"), format!("the mount still says rw: {opts:?}"))?;
    let c = a.stats("pvc-xshut", &staging)?.volume_condition.unwrap_or_default();
    check(c.abnormal && c.message.contains("shut down"), format!("a shut-down xfs is abnormal: {c:?}"))?;
    a.unstage("pvc-xshut", &staging)?;
    all_gone(&a)
}
