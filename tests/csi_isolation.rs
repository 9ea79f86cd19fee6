//! The CSI node service acts only on what is provably the volume's own: a
//! staging path holding another volume's mount is refused, unpublish and
//! unstage never unmount what is not theirs, a target swapped for a symlink
//! mid-call never gets a mount outside the kubelet root, stats never measure
//! the parent filesystem as the volume, and an interrupted mkfs does not
//! leave a volume that can never be staged again. Each test but the last
//! failed on the node service before this fix; the last guards the rule the
//! mkfs fix must keep (never format data the agent did not write).

mod common;
mod csi_support;

use std::os::unix::fs::FileExt;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::check;
use csi_support::*;
use libtest_mimic::{Failed, Trial};
use tonic::Code;

fn expect_code<T>(r: Result<T, tonic::Status>, want: Code, what: &str) -> Result<(), Failed> {
    match r {
        Err(s) if s.code() == want => Ok(()),
        Err(s) => Err(format!("{what}: expected {want:?}, got {:?}: {}", s.code(), s.message()).into()),
        Ok(_) => Err(format!("{what}: expected {want:?}, got OK").into()),
    }
}

/// The device (st_dev) of whatever filesystem `p` is in.
fn dev_of(p: &Path) -> u64 {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata(p).map(|m| m.dev()).unwrap_or(0)
}

/// Whether `p` is the root of a mount, as statx(2) says (the test's own
/// look, not the agent's).
fn is_mount_point(p: &Path) -> bool {
    use rustix::fs::{statx, AtFlags, StatxAttributes, StatxFlags, CWD};
    statx(CWD, p, AtFlags::SYMLINK_NOFOLLOW, StatxFlags::BASIC_STATS).is_ok_and(|s| s.stx_attributes.contains(StatxAttributes::MOUNT_ROOT))
}

/// Stage B where A is mounted: refused, A untouched; B's publish and
/// unstage there can then never reach A.
fn stage_over_another_volume() -> Result<(), Failed> {
    let a = Agent::start();
    let (sa, ta) = (a.k("plugins/s/a"), a.k("pods/pa/a"));
    a.create("vol-a", 32 * MIB, "")?;
    a.create("vol-b", 32 * MIB, "")?;
    a.stage("vol-a", &sa, mount_cap(""))?;
    a.publish("vol-a", &sa, &ta, mount_cap(""), false)?;
    std::fs::write(Path::new(&ta).join("secret-of-a"), b"a's data")?;
    let dev_a = dev_of(Path::new(&sa));
    expect_code(a.stage("vol-b", &sa, mount_cap("")), Code::FailedPrecondition, "stage B on A's staging path")?;
    check(dev_of(Path::new(&sa)) == dev_a && Path::new(&ta).join("secret-of-a").exists(), "A still mounted and readable")?;
    // B was not staged, so it cannot be published from there, and its
    // unstage at A's path does not touch A.
    expect_code(
        a.publish("vol-b", &sa, &a.k("pods/pb/b"), mount_cap(""), false),
        Code::FailedPrecondition,
        "publish B from A's staging path",
    )?;
    check(!Path::new(&a.k("pods/pb/b")).join("secret-of-a").exists(), "B's pod does not see A's files")?;
    a.unstage("vol-b", &sa)?;
    check(is_mount_point(Path::new(&sa)) && dev_of(Path::new(&sa)) == dev_a, "unstage of B left A's staging mount")?;
    // A foreign filesystem at a staging path is refused the same way.
    let foreign = a.k("plugins/s/foreign");
    std::fs::create_dir_all(&foreign)?;
    common::tmpfs_at(Path::new(&foreign));
    expect_code(a.stage("vol-b", &foreign, mount_cap("")), Code::FailedPrecondition, "stage B on a tmpfs")?;
    check(is_mount_point(Path::new(&foreign)), "the tmpfs is still there")?;
    common::umount(Path::new(&foreign));
    a.unpublish("vol-a", &ta)?;
    a.unstage("vol-a", &sa)?;
    Ok(())
}

/// Unpublish of B at A's target and unstage of B under a foreign mount
/// leave A's mounts (and the foreign one) where they are.
fn unpublish_and_unstage_touch_only_their_own() -> Result<(), Failed> {
    let a = Agent::start();
    let (sa, ta) = (a.k("plugins/s/a"), a.k("pods/pa/a"));
    let (sb, tb) = (a.k("plugins/s/b"), a.k("pods/pb/b"));
    for (id, s, t) in [("vol-a", &sa, &ta), ("vol-b", &sb, &tb)] {
        a.create(id, 32 * MIB, "")?;
        a.stage(id, s, mount_cap(""))?;
        a.publish(id, s, t, mount_cap(""), false)?;
    }
    expect_code(a.unpublish("vol-b", &ta), Code::NotFound, "unpublish B at A's target")?;
    check(is_mount_point(Path::new(&ta)), "A's target still mounted")?;
    expect_code(a.unstage("vol-b", &sa), Code::NotFound, "unstage B at A's staging path")?;
    check(is_mount_point(Path::new(&sa)), "A's staging still mounted")?;
    // Something mounted over B's own target by someone else stops the
    // unpublish; it is not unmounted in B's name.
    common::tmpfs_at(Path::new(&tb));
    expect_code(a.unpublish("vol-b", &tb), Code::FailedPrecondition, "unpublish B under a foreign mount")?;
    check(is_mount_point(Path::new(&tb)) && dev_of(Path::new(&tb)) != dev_of(Path::new(&sb)), "the foreign mount is left")?;
    common::umount(Path::new(&tb));
    a.unpublish("vol-b", &tb)?;
    // The same for B's staging path.
    common::tmpfs_at(Path::new(&sb));
    expect_code(a.unstage("vol-b", &sb), Code::FailedPrecondition, "unstage B under a foreign mount")?;
    check(is_mount_point(Path::new(&sb)), "the foreign mount on B's staging path is left")?;
    common::umount(Path::new(&sb));
    a.unstage("vol-b", &sb)?;
    // A is whole throughout, and a repeated unpublish is still OK.
    check(is_mount_point(Path::new(&ta)) && is_mount_point(Path::new(&sa)), "A untouched")?;
    a.unpublish("vol-a", &ta)?;
    a.unpublish("vol-a", &ta)?;
    a.unstage("vol-a", &sa)?;
    Ok(())
}

/// A target exchanged with a symlink to a directory outside the kubelet
/// root (renameat2 RENAME_EXCHANGE in a loop) while publishes run: no bind
/// mount ever lands outside the root.
fn publish_target_swapped_for_a_symlink() -> Result<(), Failed> {
    let a = Agent::start();
    let staging = a.k("plugins/s/race");
    a.create("vol-race", 32 * MIB, "")?;
    a.stage("vol-race", &staging, mount_cap(""))?;
    let outside = a.scratch.dir("outside");
    let parent = Path::new(&a.k("pods/race/volumes")).to_path_buf();
    std::fs::create_dir_all(parent.join("t"))?;
    std::os::unix::fs::symlink(&outside, parent.join("l"))?;
    let stop = Arc::new(AtomicBool::new(false));
    let swapper = {
        let (stop, parent) = (stop.clone(), parent.clone());
        std::thread::spawn(move || {
            let mut swaps = 0u64;
            while !stop.load(Ordering::Relaxed) && swaps < 50_000_000 {
                // EBUSY while `t` is a mount point: the kernel keeps a mount
                // point from being renamed.
                let _ = rustix::fs::renameat_with(
                    rustix::fs::CWD,
                    parent.join("t"),
                    rustix::fs::CWD,
                    parent.join("l"),
                    rustix::fs::RenameFlags::EXCHANGE,
                );
                swaps += 1;
            }
        })
    };
    let target = parent.join("t").to_string_lossy().into_owned();
    let deadline = Instant::now() + Duration::from_secs(25);
    let (mut ok, mut refused, mut escaped) = (0, 0, 0);
    for _ in 0..3000 {
        if Instant::now() > deadline {
            break;
        }
        match a.publish("vol-race", &staging, &target, mount_cap(""), false) {
            Ok(()) => ok += 1,
            Err(e) => {
                if refused < 3 || std::env::var_os("VOLRING_TEST_VERBOSE").is_some() {
                    eprintln!("refused: {:?} {}", e.code(), e.message());
                }
                refused += 1
            }
        }
        if !mounts_under(&outside).is_empty() || is_mount_point(&outside) {
            escaped += 1;
            for m in mounts_under(&outside) {
                let _ = rustix::mount::unmount(&m, rustix::mount::UnmountFlags::DETACH);
            }
        }
        let _ = a.unpublish("vol-race", &target);
    }
    stop.store(true, Ordering::Relaxed);
    let _ = swapper.join();
    eprintln!("publishes: {ok} made, {refused} refused, {escaped} outside the root");
    check(escaped == 0, format!("{escaped} publishes bind-mounted outside the kubelet root"))?;
    check(ok > 0, "no publish succeeded at all")?;
    Ok(())
}

/// Stats measure the volume's own mount or report it gone — never the
/// filesystem the path leads to now. Two ways a path stops leading to the
/// volume: its mount is pulled (the path shows the parent filesystem), or a
/// filesystem is mounted over a parent directory (the volume's mount is still
/// in the table under that path string, shadowed; the path now leads into
/// the new filesystem, where a directory of the same name exists).
fn stats_never_measure_another_filesystem() -> Result<(), Failed> {
    // This is about what stats measure, so the reconciler only reports
    // (with repairs on it re-mounts the pulled volume at once; that, and
    // that it never mounts under a shadowing mount, is tests/state.rs's).
    // Tests here run one at a time: the variable reaches only this agent.
    std::env::set_var("VOLRING_NO_REPAIR", "true");
    let a = Agent::start();
    std::env::remove_var("VOLRING_NO_REPAIR");
    let staging = a.k("plugins/s/st/mnt");
    let shadow_at = Path::new(&staging).parent().map(Path::to_path_buf).unwrap_or_default();
    a.create("vol-st", 32 * MIB, "")?;
    a.stage("vol-st", &staging, mount_cap(""))?;
    let healthy = a.stats("vol-st", &staging)?;
    check(healthy.volume_condition.as_ref().is_some_and(|c| !c.abnormal) && !healthy.usage.is_empty(), "staged volume is healthy")?;
    // Shadowed: a tmpfs over the parent, with a directory of the same name.
    common::tmpfs_at(&shadow_at);
    std::fs::create_dir_all(&staging)?;
    let r = a.stats("vol-st", &staging)?;
    common::umount(&shadow_at);
    check(
        r.volume_condition.as_ref().is_some_and(|c| c.abnormal) && r.usage.is_empty(),
        format!("a tmpfs over the staging path's parent was reported as the volume: {r:?}"),
    )?;
    check(a.stats("vol-st", &staging)?.volume_condition.is_some_and(|c| !c.abnormal), "healthy again once uncovered")?;
    // Pulled: the path shows the parent filesystem.
    common::umount(Path::new(&staging));
    let r = a.stats("vol-st", &staging)?;
    check(r.volume_condition.as_ref().is_some_and(|c| c.abnormal) && r.usage.is_empty(), format!("after an unmount: {r:?}"))?;
    a.unstage("vol-st", &staging)?;
    Ok(())
}

/// Unknown volume: NotFound, even when another field is malformed (but a
/// missing field is InvalidArgument first); stats of a known volume at a
/// path it is not at, malformed or not: NotFound; a staging path that is a
/// regular file: InvalidArgument, not Internal.
fn error_precedence_and_bad_paths() -> Result<(), Failed> {
    let a = Agent::start();
    expect_code(a.stats("vol-nope", "relative/path"), Code::NotFound, "stats of an unknown volume at a relative path")?;
    // A missing field is the caller's error before anything else is judged
    // (csi-sanity: "should fail when no volume path is provided").
    expect_code(a.stats("vol-nope", ""), Code::InvalidArgument, "stats of an unknown volume without a path")?;
    expect_code(a.stats("", "relative/path"), Code::InvalidArgument, "stats without a volume id")?;
    expect_code(a.node_expand("vol-nope", "relative/path", 0), Code::NotFound, "node expand of an unknown volume at a relative path")?;
    a.create("vol-f", 32 * MIB, "")?;
    let file = a.k("plugins/s/file");
    std::fs::create_dir_all(Path::new(&file).parent().unwrap_or(Path::new("/")))?;
    std::fs::write(&file, b"not a directory")?;
    expect_code(a.stage("vol-f", &file, mount_cap("")), Code::InvalidArgument, "staging path that is a regular file")?;
    check(std::fs::read(&file)? == b"not a directory", "the file is untouched")?;
    // A known volume at a path it is not at.
    let staging = a.k("plugins/s/f");
    a.stage("vol-f", &staging, mount_cap(""))?;
    expect_code(a.stats("vol-f", &a.k("pods/nowhere")), Code::NotFound, "stats of a known volume elsewhere")?;
    // A path the volume cannot be at, however it is malformed, is where the
    // volume is not (csi-sanity: "should fail when volume does not exist on
    // the specified path" asks at `some/path`); no path at all stays the
    // caller's error.
    for p in ["some/path", "/etc", &a.k("plugins/s/../s/f")] {
        expect_code(a.stats("vol-f", p), Code::NotFound, &format!("stats of a known volume at {p:?}"))?;
    }
    expect_code(a.stats("vol-f", ""), Code::InvalidArgument, "stats of a known volume without a path")?;
    a.unstage("vol-f", &staging)?;
    Ok(())
}

/// The PIDs of `parent`'s children whose command starts with `prefix`.
fn children_named(parent: u32, prefix: &str) -> Vec<u32> {
    let mut out = Vec::new();
    for e in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|s| s.parse::<u32>().ok()) else { continue };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else { continue };
        // pid (comm) state ppid ...
        let Some((comm, rest)) = stat.split_once(") ").map(|(a, b)| (a.split_once(" (").map_or("", |x| x.1), b)) else { continue };
        let ppid = rest.split(' ').nth(1).and_then(|s| s.parse::<u32>().ok());
        if ppid == Some(parent) && comm.starts_with(prefix) {
            out.push(pid);
        }
    }
    out
}

/// mkfs killed 0–200 ms into a stage (alone, as the OOM killer would, or
/// with the agent, as a cgroup kill would): the retried stage completes,
/// on ext4 and xfs, and the volume keeps what is written to it.
fn mkfs_killed_mid_stage(fs: &'static str, with_agent: bool) -> impl FnOnce() -> Result<(), Failed> {
    move || {
        let mut a = Agent::start();
        let size = if fs == "xfs" { 1024 } else { 2048 } * MIB;
        let mut killed = 0;
        for (round, delay_ms) in [0u64, 2, 5, 10, 20, 40, 80, 200].into_iter().enumerate() {
            let id = format!("vol-mkfs-{round}");
            let staging = a.k(&format!("plugins/s/{id}"));
            a.create(&id, size, fs)?;
            let agent_pid = a.pid();
            let killer = std::thread::spawn(move || {
                let deadline = Instant::now() + Duration::from_secs(10);
                while Instant::now() < deadline {
                    let found = children_named(agent_pid, "mkfs");
                    if !found.is_empty() {
                        std::thread::sleep(Duration::from_millis(delay_ms));
                        let mut n = 0;
                        for pid in children_named(agent_pid, "mkfs") {
                            if let Some(pid) = rustix::process::Pid::from_raw(pid as i32) {
                                n += rustix::process::kill_process(pid, rustix::process::Signal::KILL).is_ok() as u32;
                            }
                        }
                        return n;
                    }
                    std::thread::sleep(Duration::from_micros(200));
                }
                0
            });
            let first = a.stage(&id, &staging, mount_cap(fs));
            let n = killer.join().unwrap_or(0);
            killed += n;
            if with_agent && n > 0 {
                a.kill_hard();
                a.respawn();
            }
            if first.is_err() || with_agent {
                // kubelet retries until it succeeds; it must within a few tries.
                let mut done = false;
                for _ in 0..5 {
                    if a.stage(&id, &staging, mount_cap(fs)).is_ok() {
                        done = true;
                        break;
                    }
                }
                check(done, format!("{fs} round {round} (mkfs killed {n}x after {delay_ms} ms): the stage never completed"))?;
            }
            let probe = Path::new(&staging).join("probe");
            std::fs::write(&probe, b"written after the retry")?;
            a.unstage(&id, &staging)?;
            a.stage(&id, &staging, mount_cap(fs))?;
            check(std::fs::read(&probe)? == b"written after the retry", "data kept across unstage/stage")?;
            a.unstage(&id, &staging)?;
            a.delete(&id)?;
        }
        eprintln!("{fs}: mkfs killed in {killed} of 8 rounds");
        check(killed > 0, "mkfs was never caught running; the test proved nothing")
    }
}

/// A volume that holds data the agent did not write is never formatted,
/// also when its record says a mkfs of the agent's was interrupted on
/// another device (the intent is per volume, and only a blank or
/// agent-formatted device is formatted).
fn foreign_data_never_formatted() -> Result<(), Failed> {
    let a = Agent::start();
    a.create("vol-data", 32 * MIB, "")?;
    std::fs::OpenOptions::new().write(true).open(a.image("vol-data"))?.write_all_at(b"tenant bytes", 8192)?;
    let staging = a.k("plugins/s/data");
    for _ in 0..3 {
        expect_code(a.stage("vol-data", &staging, mount_cap("")), Code::FailedPrecondition, "stage of a volume holding unknown data")?;
    }
    let mut head = [0u8; 12];
    std::fs::File::open(a.image("vol-data"))?.read_exact_at(&mut head, 8192)?;
    check(&head == b"tenant bytes", "the tenant's bytes are still there")
}

fn main() {
    let trials = vec![
        Trial::test("csi_isolation::stage_over_another_volume", stage_over_another_volume),
        Trial::test("csi_isolation::unpublish_and_unstage_touch_only_their_own", unpublish_and_unstage_touch_only_their_own),
        Trial::test("csi_isolation::publish_target_swapped_for_a_symlink", publish_target_swapped_for_a_symlink),
        Trial::test("csi_isolation::stats_never_measure_another_filesystem", stats_never_measure_another_filesystem),
        Trial::test("csi_isolation::error_precedence_and_bad_paths", error_precedence_and_bad_paths),
        Trial::test("csi_isolation::mkfs_killed_mid_stage_ext4", mkfs_killed_mid_stage("ext4", false)),
        Trial::test("csi_isolation::mkfs_killed_mid_stage_xfs", mkfs_killed_mid_stage("xfs", false)),
        Trial::test("csi_isolation::mkfs_and_agent_killed_mid_stage_xfs", mkfs_killed_mid_stage("xfs", true)),
        Trial::test("csi_isolation::foreign_data_never_formatted", foreign_data_never_formatted),
    ];
    common::run_in_private_namespace(trials)
}
