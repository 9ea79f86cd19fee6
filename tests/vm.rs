//! Every test that boots a VM on Debian 12's 6.1 kernel (see
//! tests/vm/harness.rs), in one test executable so that two guests run at
//! once from the first trial to the last: cargo runs test executables one
//! after another, and when each group of trials was its own executable the
//! second of the machine's two cores sat idle while one group's single or
//! last guest ran (eight executables, eight such tails), and eight links.
//! Each module is one former executable and keeps its trials' names:
//!
//! - `suites`: the guest boots and loads nbd, a hung guest is killed, and
//!   the kernel-facing suites pass on 6.1 (`boot::`, `harness::`, `guest::`);
//! - `vm_nbd`, `vm_healer`, `vm_volumes`, `vm_remote`: the nbd driver
//!   against volring, the healer, CSI nbd volumes, remote volumes;
//! - `vm_share`, `vm_move`, `vm_share_move`: shared volumes and moves, with
//!   an agent on this host too.
//!
//! Without the image (`tests/vm/fetch.sh`) each trial prints why it skips;
//! in CI a missing image fails. `cargo test --test vm vm_nbd::` runs one
//! group.

mod common;
mod csi_support;
#[path = "vm/harness.rs"]
mod harness;
mod kube_support;

#[path = "vm/suites.rs"]
mod suites;
#[path = "vm/healer.rs"]
mod vm_healer;
#[path = "vm/move_.rs"]
mod vm_move;
#[path = "vm/nbd.rs"]
mod vm_nbd;
#[path = "vm/remote.rs"]
mod vm_remote;
#[path = "vm/share.rs"]
mod vm_share;
#[path = "vm/share_move.rs"]
mod vm_share_move;
#[path = "vm/volumes.rs"]
mod vm_volumes;

use std::sync::{Mutex, MutexGuard};

use libtest_mimic::{Arguments, Failed, Trial};

/// Held by the trials that run an agent on this host beside their guest
/// (vm_share, vm_move, vm_share_move): they ran one at a time when each
/// group was its own executable (tests/common runs a private mount
/// namespace's trials one by one), and still do, so their host agents,
/// loop devices, mounts and ganesha servers never meet in this process's
/// one mount namespace. Any of them runs beside a guest-only trial.
fn host_agents() -> MutexGuard<'static, ()> {
    static LOCK: Mutex<()> = Mutex::new(());
    // A trial that failed while holding it poisons it; the next one runs.
    LOCK.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// A trial written as a test that panics when it fails.
fn panicking(name: &str, f: fn()) -> Trial {
    Trial::test(name, move || {
        f();
        Ok(())
    })
}

/// A trial that takes [`host_agents`] first.
fn with_host_agents(name: &str, f: impl FnOnce() -> Result<(), Failed> + Send + 'static) -> Trial {
    Trial::test(name, move || {
        let _host = host_agents();
        f()
    })
}

fn main() {
    // Before any thread starts: unshare(CLONE_NEWNS) is refused to a
    // process whose threads share its filesystem context. The host agents
    // mount and attach loop devices here; every guest's qemu inherits it.
    volring_sys::ns::enter_private_mount_namespace().expect("private mount namespace (run as root)");
    let args = Arguments::from_args();
    suites::select(&args);
    // libtest-mimic starts the trials in this order, two at a time (one
    // per core): the longest first (guest seconds on an idle 2-core host,
    // two at a time), so that the short ones fill in at the end; the
    // host-agent trials apart from each other, so that one waiting for
    // another's lock rarely holds a core idle. The shared guest of the
    // suites starts early (boot::modprobe_nbd), and the guest:: trials that
    // read its results come last, when it has long ended: a trial started
    // while it runs would wait for it and hold a core idle.
    let mut trials = vec![
        panicking("vm_nbd::kill_and_reattach_two_connections", vm_nbd::kill_and_reattach_two_connections),
        panicking("vm_nbd::kill_and_reattach_one_ring_two_connections_64mib", vm_nbd::kill_and_reattach_one_ring_two_connections_64mib),
        with_host_agents("vm_share::two_clients", vm_share::two_clients),
        panicking("vm_remote::block_volume_rides_owner_restarts", vm_remote::block_volume_rides_owner_restarts),
        panicking("vm_remote::owner_restarts_under_a_remote_writer", vm_remote::owner_restarts_under_a_remote_writer),
        Trial::test("boot::modprobe_nbd", suites::boots_and_loads_nbd),
        panicking("vm_healer::agent_restarts_under_a_writer_on_xfs", vm_healer::agent_restarts_under_a_writer_on_xfs),
        panicking("vm_healer::agent_restarts_under_a_writer", vm_healer::agent_restarts_under_a_writer),
        panicking(
            "vm_healer::a_consumer_restart_leaves_a_healthy_remote_device_connected",
            vm_healer::a_consumer_restart_leaves_a_healthy_remote_device_connected,
        ),
        panicking("vm_volumes::ext4_round_trip_and_grow", vm_volumes::ext4_round_trip_and_grow),
        panicking("vm_volumes::xfs_round_trip_grow_and_shutdown", vm_volumes::xfs_round_trip_grow_and_shutdown),
        panicking("vm_volumes::block_round_trip_and_grow", vm_volumes::block_round_trip_and_grow),
        panicking("vm_healer::without_the_healer_the_writer_fails", vm_healer::without_the_healer_the_writer_fails),
        with_host_agents("vm_share_move::moves_under_a_client_xfs", || vm_share_move::moves_under_a_client("xfs")),
        panicking("vm_remote::without_reconnecting_the_writer_fails", vm_remote::without_reconnecting_the_writer_fails),
        with_host_agents("vm_share_move::moves_under_a_client_ext4", || vm_share_move::moves_under_a_client("ext4")),
        panicking("vm_nbd::without_reattach_the_writer_fails", vm_nbd::without_reattach_the_writer_fails),
        with_host_agents("vm_move::owner_to_guest_and_back", vm_move::owner_to_guest_and_back),
        panicking("vm_nbd::one_ring_two_connections_on_6_1", vm_nbd::one_ring_two_connections_on_6_1),
        Trial::test("harness::hung_guest_is_killed", suites::hung_guest_is_killed),
        Trial::test("harness::hung_boot_is_booted_again", suites::hung_boot_is_booted_again),
        Trial::test("harness::qemu_dies_with_its_spawner", suites::qemu_dies_with_the_thread_that_spawned_it),
    ];
    for &name in suites::SUITES {
        trials.push(Trial::test(format!("guest::{name}"), move || suites::suite_passes_on_6_1(name)));
    }
    let conclusion = libtest_mimic::run(&args, trials);
    suites::remove_shared_run();
    conclusion.exit();
}
