//! Crash recovery and controller conformance of the CSI driver, against a
//! real `volring node` and the real kernel, in a private mount namespace.
//!
//! Crashes are made with fault points (`VOLRING_FAULT_POINT`, see
//! `src/fault.rs`): the agent is started with a point armed, SIGKILLs
//! itself there, and a plain agent is started on the same state, as a
//! DaemonSet restart would. Conformance cases are written from the CSI
//! spec's error tables, not from the code.

mod common;
mod csi_support;

use std::path::PathBuf;
use std::sync::mpsc;
use std::time::Duration;

use common::check;
use csi_support::{block_cap, code, loops_backed_by, loops_under, mount_cap, mounts_under, Agent, MIB};
use libtest_mimic::{Failed, Trial};
use tonic::Code;
use volring_csi::proto::*;

fn expect_code<T>(r: Result<T, tonic::Status>, want: Code, what: &str) -> Result<(), Failed> {
    match r {
        Err(s) if s.code() == want => Ok(()),
        Err(s) => Err(format!("{what}: expected {want:?}, got {:?}: {}", s.code(), s.message()).into()),
        Ok(_) => Err(format!("{what}: expected {want:?}, got success").into()),
    }
}

/// Nothing of the test's is mounted or attached any more.
fn all_gone(a: &Agent) -> Result<(), Failed> {
    let m = mounts_under(&a.kubelet);
    check(m.is_empty(), format!("still mounted: {m:?}"))?;
    let l = loops_under(a.scratch.path());
    check(l.is_empty(), format!("still attached: loop{l:?}"))
}

fn pool(a: &Agent) -> PathBuf {
    a.state.join("pool")
}

/// Every file in the pool (and its quarantine) whose name mentions `id`.
fn pool_files_of(a: &Agent, id: &str) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for dir in [pool(a), pool(a).join("quarantine")] {
        for e in std::fs::read_dir(&dir).into_iter().flatten().flatten() {
            if e.file_name().to_string_lossy().contains(id) {
                out.push(e.path());
            }
        }
    }
    out
}

fn listed(a: &Agent) -> Result<Vec<String>, Failed> {
    let mut c = a.c.controller.clone();
    let r = a.run(c.list_volumes(ListVolumesRequest::default()))?.into_inner();
    Ok(r.entries.into_iter().filter_map(|e| e.volume).map(|v| v.volume_id).collect())
}

/// Puts recognisable tenant data into a volume's image.
fn fill(a: &Agent, id: &str) -> Result<(), Failed> {
    use std::os::unix::fs::FileExt;
    let f = std::fs::OpenOptions::new().write(true).open(a.image(id))?;
    f.write_all_at(b"tenant secret", 3 * MIB as u64)?;
    f.sync_all()?;
    Ok(())
}

// ---- 1. deletes and creates interrupted by a crash ----

/// DeleteVolume killed between each of its steps: after a restart the
/// retried delete answers OK and no file of the volume is left — in
/// particular not its data.
fn delete_interrupted_at_each_step() -> Result<(), Failed> {
    let mut a = Agent::start();
    for (i, point) in ["pool.delete.tombstoned", "pool.delete.unrecorded"].into_iter().enumerate() {
        let id = format!("pvc-del{i}");
        a.create(&id, 32 * MIB, "")?;
        fill(&a, &id)?;
        a.arm(point);
        check(a.delete(&id).is_err(), format!("{point}: the agent dies inside DeleteVolume"))?;
        check(a.died_at_point(), format!("{point}: killed at the point"))?;
        a.respawn();
        a.delete(&id)?;
        let left = pool_files_of(&a, &id);
        check(left.is_empty(), format!("{point}: after the retried delete the pool still holds {left:?}"))?;
        check(!listed(&a)?.contains(&id), format!("{point}: not listed"))?;
    }
    Ok(())
}

/// A crash after the tombstone and a restart with no retry: the restart
/// alone finishes the delete.
fn restart_alone_finishes_delete() -> Result<(), Failed> {
    let mut a = Agent::start();
    a.create("pvc-half", 32 * MIB, "")?;
    fill(&a, "pvc-half")?;
    a.arm("pool.delete.tombstoned");
    check(a.delete("pvc-half").is_err(), "the agent dies inside DeleteVolume")?;
    check(a.died_at_point(), "killed at the point")?;
    a.respawn();
    let left = pool_files_of(&a, "pvc-half");
    check(left.is_empty(), format!("the restart left {left:?}"))?;
    check(!listed(&a)?.contains(&"pvc-half".to_string()), "not listed")
}

/// An image with no record (what the old delete order left behind, or a
/// create killed before its record) is collected by a restart.
fn restart_collects_orphan_image() -> Result<(), Failed> {
    let mut a = Agent::start();
    a.create("pvc-kept", 32 * MIB, "")?;
    a.kill_hard();
    std::fs::write(a.image("pvc-orphan"), b"a deleted tenant's data")?;
    a.respawn();
    check(!a.image("pvc-orphan").exists(), "the orphan image is removed at start")?;
    check(a.image("pvc-kept").exists() && listed(&a)? == ["pvc-kept"], "the volume with a record is kept")
}

/// CreateVolume killed after placing the image and before its record:
/// after a restart there is no image, and the retried create works.
fn create_interrupted_leaves_nothing() -> Result<(), Failed> {
    let mut a = Agent::start();
    a.arm("pool.create.placed");
    check(a.create("pvc-new", 32 * MIB, "").is_err(), "the agent dies inside CreateVolume")?;
    check(a.died_at_point(), "killed at the point")?;
    check(a.image("pvc-new").exists(), "the point is after the image was placed")?;
    a.respawn();
    let left = pool_files_of(&a, "pvc-new");
    check(left.is_empty(), format!("the restart left {left:?}"))?;
    let v = a.create("pvc-new", 32 * MIB, "")?;
    check(v.capacity_bytes == 32 * MIB, "the retried create works")?;
    a.delete("pvc-new")?;
    Ok(())
}

/// NodePublishVolume killed right after it made the target, and the pod
/// gone before kubelet retried: kubelet calls NodeUnpublishVolume for the
/// uncertain target, which answers OK and removes the directory (block:
/// file) publish made — "the SP MUST delete the file or directory it
/// created at this path". Found by tests/crash_loop.rs (seed 2, cycle 67).
fn publish_interrupted_then_unpublished_removes_target() -> Result<(), Failed> {
    let mut a = Agent::start();
    for (id, fs) in [("pvc-pt-fs", "ext4"), ("pvc-pt-blk", "")] {
        let cap = if fs.is_empty() { block_cap() } else { mount_cap(fs) };
        let (staging, target) = (a.k(&format!("plugins/stage/{id}")), a.k(&format!("pods/{id}/vol")));
        a.create(id, 32 * MIB, fs)?;
        a.stage(id, &staging, cap.clone())?;
        a.arm("publish:target");
        check(a.publish(id, &staging, &target, cap, false).is_err(), format!("{id}: the agent dies inside NodePublishVolume"))?;
        check(a.died_at_point(), format!("{id}: killed at the point"))?;
        a.respawn();
        check(std::path::Path::new(&target).exists(), format!("{id}: the point is after the target was made"))?;
        a.unpublish(id, &target)?;
        check(!std::path::Path::new(&target).exists(), format!("{id}: the target publish made is left after NodeUnpublishVolume"))?;
        a.unstage(id, &staging)?;
        a.delete(id)?;
    }
    all_gone(&a)
}

// ---- 2. corrupt records ----

/// A corrupt pool record and a corrupt staged record do not stop the
/// service: both are moved to quarantine/, the good volume stages and
/// publishes, the quarantined volume's data is kept (not an orphan) and not
/// overwritten by a create of the same name, and the status report shows it.
fn corrupt_records_are_quarantined() -> Result<(), Failed> {
    let mut a = Agent::start();
    a.create("pvc-good", 32 * MIB, "")?;
    a.create("pvc-bad", 32 * MIB, "")?;
    fill(&a, "pvc-bad")?;
    a.kill_hard();
    std::fs::write(pool(&a).join("pvc-bad.json"), b"{\"id\": \"pvc-bad\", \"size_by")?;
    // A record of the layout before the store, unreadable: the import
    // quarantines it.
    std::fs::create_dir_all(a.state.join("staged"))?;
    std::fs::write(a.state.join("staged").join("pvc-ghost.json"), b"\x00\x00\x00")?;
    a.respawn();
    let (staging, target) = (a.k("plugins/stage/good"), a.k("pods/g/vol"));
    a.stage("pvc-good", &staging, mount_cap(""))?;
    a.publish("pvc-good", &staging, &target, mount_cap(""), false)?;
    check(pool(&a).join("quarantine/pvc-bad.json").exists(), "the pool record is in quarantine/")?;
    check(a.state.join("staged/quarantine/pvc-ghost.json").exists(), "the staged record is in quarantine/")?;
    check(!pool(&a).join("pvc-bad.json").exists(), "moved, not copied")?;
    check(a.image("pvc-bad").exists(), "the quarantined volume's image is kept")?;
    check(listed(&a)? == ["pvc-good"], "only the good volume is listed")?;
    check(code(a.create("pvc-bad", 32 * MIB, "")).is_some(), "a create of the quarantined name is refused")?;
    let mut data = [0u8; 13];
    std::os::unix::fs::FileExt::read_exact_at(&std::fs::File::open(a.image("pvc-bad"))?, &mut data, 3 * MIB as u64)?;
    check(&data == b"tenant secret", "and did not replace its image")?;
    let report = volring_volumes::status::report(&pool(&a), &a.state, false)?;
    let names: Vec<_> = report.quarantined.iter().map(|q| q.name.as_str()).collect();
    check(names == ["pvc-bad.json", "pvc-ghost.json"], format!("status shows the quarantined records: {names:?}"))?;
    check(report.staged.iter().any(|s| s.volume_id == "pvc-good" && s.attached && s.targets.len() == 1), "status shows the staged volume")?;
    // The CO deleting the quarantined volume removes its data.
    a.delete("pvc-bad")?;
    check(pool_files_of(&a, "pvc-bad").is_empty(), "deleted with its quarantined record")?;
    a.unpublish("pvc-good", &target)?;
    a.unstage("pvc-good", &staging)?;
    all_gone(&a)
}

// ---- 3. a detach the kernel defers ----

/// The loop device serving a staged volume's image, as sysfs shows it
/// (exactly one).
fn loop_number(a: &Agent, id: &str) -> Result<u32, Failed> {
    let image = std::fs::canonicalize(a.image(id))?;
    match loops_backed_by(&image)[..] {
        [n] => Ok(n),
        ref other => Err(format!("{id}: expected one loop device backed by {}, found {other:?}", image.display()).into()),
    }
}

/// Opens `/dev/loop<n>` read-only on a thread and keeps it open for `hold`
/// (or until `release` is signalled); returns once the device is open.
fn hold_open(n: u32, hold: Duration) -> Result<(std::thread::JoinHandle<()>, mpsc::Sender<()>), Failed> {
    let (opened_tx, opened_rx) = mpsc::channel();
    let (release_tx, release_rx) = mpsc::channel::<()>();
    let t = std::thread::spawn(move || {
        let f = std::fs::File::open(format!("/dev/loop{n}"));
        let _ = opened_tx.send(f.is_ok());
        let _ = release_rx.recv_timeout(hold);
        drop(f);
    });
    check(opened_rx.recv_timeout(Duration::from_secs(30)) == Ok(true), format!("open /dev/loop{n}"))?;
    Ok((t, release_tx))
}

/// NodeUnstageVolume answered OK while something else held the device
/// open must still have detached it: the DeleteVolume right after succeeds.
/// Bounded: 100 cycles, the holder keeping the device 0–30 ms.
fn unstage_then_delete_with_a_holder() -> Result<(), Failed> {
    let a = Agent::start();
    let staging = a.k("plugins/stage/held");
    for i in 0..100u64 {
        let id = format!("pvc-held{i}");
        a.create(&id, 16 * MIB, "")?;
        a.stage(&id, &staging, block_cap())?;
        let n = loop_number(&a, &id)?;
        let (t, _release) = hold_open(n, Duration::from_millis(i * 7 % 31))?;
        a.unstage(&id, &staging)?;
        let deleted = a.delete(&id);
        t.join().map_err(|_| "holder thread")?;
        deleted.map_err(|s| format!("cycle {i}: delete right after unstage: {:?} {}", s.code(), s.message()))?;
        check(!a.image(&id).exists(), "image removed")?;
    }
    all_gone(&a)
}

/// A holder that outlasts the detach bound: unstage says so (not OK), and
/// once the holder lets go the retried unstage and the delete succeed.
fn unstage_reports_a_device_held_too_long() -> Result<(), Failed> {
    let a = Agent::start();
    let staging = a.k("plugins/stage/stuck");
    a.create("pvc-stuck", 16 * MIB, "")?;
    a.stage("pvc-stuck", &staging, block_cap())?;
    let n = loop_number(&a, "pvc-stuck")?;
    let (t, release) = hold_open(n, Duration::from_secs(60))?;
    let first = a.unstage("pvc-stuck", &staging);
    let _ = release.send(());
    t.join().map_err(|_| "holder thread")?;
    expect_code(first, Code::FailedPrecondition, "unstage while another process holds the device")?;
    a.unstage("pvc-stuck", &staging)?;
    a.delete("pvc-stuck")?;
    all_gone(&a)
}

// ---- 4. loop devices are removed ----

/// Each volume's loop device is gone from the kernel after its unstage
/// (only the numbers this test's volumes used are looked at; a number
/// reused at once by someone else's attach is theirs and not counted).
fn detached_devices_are_removed() -> Result<(), Failed> {
    let a = Agent::start();
    for i in 0..10 {
        let id = format!("pvc-rm{i}");
        let staging = a.k(&format!("plugins/stage/{id}"));
        a.create(&id, 16 * MIB, "")?;
        a.stage(&id, &staging, block_cap())?;
        let n = loop_number(&a, &id)?;
        a.unstage(&id, &staging)?;
        let sys = PathBuf::from(format!("/sys/block/loop{n}"));
        let reused =
            std::fs::read_to_string(sys.join("loop/backing_file")).is_ok_and(|b| !b.starts_with(&*a.scratch.path().to_string_lossy()));
        check(!sys.exists() || reused, format!("/dev/loop{n} of {id} is left behind, empty"))?;
        a.delete(&id)?;
    }
    all_gone(&a)
}

// ---- 5. controller conformance (CSI spec error tables) ----

/// ListVolumes: "Invalid starting_token → 10 ABORTED". A token volring did
/// not issue — even one shaped like a volume id — is invalid.
fn list_volumes_tokens() -> Result<(), Failed> {
    let a = Agent::start();
    for i in 0..5 {
        a.create(&format!("pvc-t{i}"), 16 * MIB, "")?;
    }
    let mut c = a.c.controller.clone();
    for token in ["pvc-t1", "pvc-t9", "zzz", "vr1.00.00000000", &"x".repeat(5000)] {
        let r = a.run(c.list_volumes(ListVolumesRequest { max_entries: 2, starting_token: token.to_string() }));
        expect_code(r, Code::Aborted, &format!("starting_token {:?}", &token[..token.len().min(20)]))?;
    }
    let first = a.run(c.list_volumes(ListVolumesRequest { max_entries: 2, starting_token: String::new() }))?.into_inner();
    let mut tampered = first.next_token.clone().into_bytes();
    let last = tampered.len() - 1;
    tampered[last] = if tampered[last] == b'0' { b'1' } else { b'0' };
    let r = a.run(c.list_volumes(ListVolumesRequest { max_entries: 2, starting_token: String::from_utf8(tampered)? }));
    expect_code(r, Code::Aborted, "a tampered token")?;
    // Issued tokens page through everything.
    let mut seen: Vec<String> = first.entries.into_iter().filter_map(|e| e.volume).map(|v| v.volume_id).collect();
    let mut token = first.next_token;
    for _ in 0..10 {
        if token.is_empty() {
            break;
        }
        let page = a.run(c.list_volumes(ListVolumesRequest { max_entries: 2, starting_token: token }))?.into_inner();
        seen.extend(page.entries.into_iter().filter_map(|e| e.volume).map(|v| v.volume_id));
        token = page.next_token;
    }
    check(seen == (0..5).map(|i| format!("pvc-t{i}")).collect::<Vec<_>>(), format!("paged through all: {seen:?}"))
}

/// GetCapacity's maximum_volume_size is "the largest size that may be used
/// in a CreateVolumeRequest.capacity_range.required_bytes": a volume of
/// exactly that size is created, one MiB more is "Unsupported
/// capacity_range → 11 OUT_OF_RANGE", and so is 20 TiB when the pool's
/// filesystem cannot hold it (never INTERNAL).
fn sizes_match_get_capacity() -> Result<(), Failed> {
    let a = Agent::start();
    let mut c = a.c.controller.clone();
    let max = a.run(c.get_capacity(GetCapacityRequest::default()))?.into_inner().maximum_volume_size.ok_or("maximum_volume_size is set")?;
    check(max > 0, "a positive maximum")?;
    a.create("pvc-max", max, "")?;
    a.delete("pvc-max")?;
    expect_code(a.create("pvc-over", max + MIB, ""), Code::OutOfRange, "one MiB above maximum_volume_size")?;
    let huge = 20 << 40;
    if huge > max {
        expect_code(a.create("pvc-20t", huge, ""), Code::OutOfRange, "20 TiB above the maximum")?;
    }
    // Growing past it is refused the same way.
    a.create("pvc-grow", 16 * MIB, "")?;
    expect_code(a.expand("pvc-grow", max + MIB, block_cap()), Code::OutOfRange, "expand above maximum_volume_size")?;
    a.delete("pvc-grow")?;
    Ok(())
}

/// CapacityRange: "The value of this field MUST NOT be negative"; an
/// invalid field is "3 INVALID_ARGUMENT" (general error table), for
/// ControllerExpandVolume as for CreateVolume.
fn negative_capacity_is_invalid() -> Result<(), Failed> {
    let a = Agent::start();
    a.create("pvc-neg", 16 * MIB, "")?;
    let mut c = a.c.controller.clone();
    for (req, lim) in [(-1, 0), (0, -1), (i64::MIN, 0), (32 * MIB, 16 * MIB)] {
        let r = a.run(c.controller_expand_volume(ControllerExpandVolumeRequest {
            volume_id: "pvc-neg".into(),
            capacity_range: Some(CapacityRange { required_bytes: req, limit_bytes: lim }),
            volume_capability: Some(block_cap()),
            ..Default::default()
        }));
        expect_code(r, Code::InvalidArgument, &format!("expand with required {req}, limit {lim}"))?;
        let r = a.run(c.create_volume(CreateVolumeRequest {
            name: "pvc-neg2".into(),
            capacity_range: Some(CapacityRange { required_bytes: req, limit_bytes: lim }),
            volume_capabilities: vec![block_cap()],
            ..Default::default()
        }));
        expect_code(r, Code::InvalidArgument, &format!("create with required {req}, limit {lim}"))?;
    }
    let mut v = a.c.controller.clone();
    let got = a.run(v.list_volumes(ListVolumesRequest::default()))?.into_inner();
    check(got.entries.iter().filter_map(|e| e.volume.as_ref()).all(|v| v.capacity_bytes == 16 * MIB), "the volume did not change")
}

fn main() {
    let trials = vec![
        Trial::test("csi_recovery::delete_interrupted_at_each_step", delete_interrupted_at_each_step),
        Trial::test("csi_recovery::restart_alone_finishes_delete", restart_alone_finishes_delete),
        Trial::test("csi_recovery::restart_collects_orphan_image", restart_collects_orphan_image),
        Trial::test("csi_recovery::create_interrupted_leaves_nothing", create_interrupted_leaves_nothing),
        Trial::test(
            "csi_recovery::publish_interrupted_then_unpublished_removes_target",
            publish_interrupted_then_unpublished_removes_target,
        ),
        Trial::test("csi_recovery::corrupt_records_are_quarantined", corrupt_records_are_quarantined),
        Trial::test("csi_recovery::unstage_then_delete_with_a_holder", unstage_then_delete_with_a_holder),
        Trial::test("csi_recovery::unstage_reports_a_device_held_too_long", unstage_reports_a_device_held_too_long),
        Trial::test("csi_recovery::detached_devices_are_removed", detached_devices_are_removed),
        Trial::test("csi_recovery::list_volumes_tokens", list_volumes_tokens),
        Trial::test("csi_recovery::sizes_match_get_capacity", sizes_match_get_capacity),
        Trial::test("csi_recovery::negative_capacity_is_invalid", negative_capacity_is_invalid),
    ];
    common::run_in_private_namespace(trials)
}
