//! `attach: nbd` CSI volumes on the kernel's nbd driver, in the VM (see
//! tests/vm/harness.rs and tests/vm/volumes.sh): ext4, xfs and block, each
//! staged, written with checksums, unstaged (image checked by e2fsck -fn or
//! xfs_repair -n), re-staged and verified, then grown online and verified
//! again; a shut-down xfs is reported abnormal and still unstages; the
//! agent's `/metrics` carries the attach server's series of the volume
//! (its writes, then after the re-stage its reads). Skips
//! (saying why) without the VM image; fails in CI.

use std::fs;
use std::time::Duration;

use crate::harness;
use crate::harness::{image_or_skip, Vm};

const SCRIPT: &str = include_str!("volumes.sh");

fn volume(test: &str, env: &[(&str, &str)]) {
    let Some(image) = image_or_skip(test) else { return };
    let mut env = env.to_vec();
    // The agent's log filter in the guest, e.g. volring_nbd::ring=debug
    // for the NBD rings' per-tick diagnostic.
    let log = std::env::var("VOLRING_VM_RUST_LOG").unwrap_or_default();
    if !log.is_empty() {
        env.push(("RUST_LOG", &log));
    }
    let script = harness::script(env!("CARGO_BIN_EXE_volring"), &env, SCRIPT);
    let mut vm = Vm::new(&image).expect("vm");
    vm.cpus = 2;
    let run = vm.run(&script, Duration::from_secs(600)).expect("vm run");
    eprintln!(
        "note: {test}: {}{}{}{}(guest {:.1} s)",
        run.read("verdict"),
        run.read("grow"),
        run.read("metrics.seen"),
        run.read("timeline"),
        run.elapsed.as_secs_f64()
    );
    let agent = run.read("agent.err");
    // The whole agent log kept where VOLRING_VM_KEEP names (a directory).
    if let Ok(dir) = std::env::var("VOLRING_VM_KEEP") {
        let _ = fs::create_dir_all(&dir);
        let name = test.replace("::", "-");
        let _ = fs::write(std::path::Path::new(&dir).join(format!("{name}.agent.err")), &agent);
        let _ = fs::write(std::path::Path::new(&dir).join(format!("{name}.describe")), run.describe());
    }
    // Its nbd, warning and error lines (the whole log is long under TCG).
    let lines: Vec<&str> = agent.lines().filter(|l| l.contains("nbd") || l.contains("WARN") || l.contains("ERROR")).collect();
    let tail = &lines[lines.len().saturating_sub(40)..];
    assert!(run.status == Some(0), "{test}:\n{}\n--- agent.err (nbd, warnings, errors)\n{}", run.describe(), tail.join("\n"));
}

/// ext4 on /dev/nbdN; NodeExpandVolume grows image, device and filesystem
/// (`--expansion node`).
pub fn ext4_round_trip_and_grow() {
    volume("vm_volumes::ext4_round_trip_and_grow", &[("KIND", "ext4"), ("SIZE_MIB", "96"), ("EXPANSION", "node")]);
}

/// xfs on /dev/nbdN; ControllerExpandVolume grows image and device,
/// NodeExpandVolume the filesystem; then the filesystem shut down. Once
/// failed 4 of 7 runs in the stage: while mkfs.xfs wrote, the ring reaped a
/// multishot receive's data completions in one batch with its last one and
/// dropped them, so the pool's buffers looked held and every receive ended
/// ENOBUFS at once (see `IoRing::complete`).
pub fn xfs_round_trip_grow_and_shutdown() {
    volume("vm_volumes::xfs_round_trip_grow_and_shutdown", &[("KIND", "xfs"), ("SIZE_MIB", "320"), ("EXPANSION", "controller")]);
}

/// A raw block volume on /dev/nbdN, published; ControllerExpandVolume alone
/// grows the device (no node step for block).
pub fn block_round_trip_and_grow() {
    volume("vm_volumes::block_round_trip_and_grow", &[("KIND", "block"), ("SIZE_MIB", "96"), ("EXPANSION", "controller")]);
}
