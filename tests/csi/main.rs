//! The CSI driver through a real gRPC client over its unix socket, against
//! the real kernel: loop devices, ext4, xfs, mount(2), in a private mount
//! namespace. Each test starts its own `volring node`. The tests live in
//! one module per theme; this file holds the checks they share and the list
//! of trials.

#[path = "../common/mod.rs"]
mod common;
#[path = "../csi_support/mod.rs"]
mod csi_support;

mod errors;
mod lifecycle;
mod listing;
mod recovery;

use std::io::{Seek, SeekFrom, Write};
use std::os::unix::fs::FileExt;

use common::check;
use csi_support::{block_cap, code, ext4_grows_mounted, loops_under, mount_cap, mounts_under, Agent, MIB};
use libtest_mimic::{Failed, Trial};
use tonic::Code;
use volring_csi::client::capability;
use volring_csi::proto::volume_capability::access_mode::Mode;
use volring_csi::proto::*;

use errors::{concurrent_calls_on_one_volume, error_codes};
use lifecycle::{
    block_stats_at_kubelets_device_path, expand_while_published, lifecycle_block, lifecycle_mount,
    node_expansion_grows_where_the_volume_lives, readonly_and_two_publishes,
};
use listing::{
    identity_controller_and_listing, nbd_attach_kind, staged_record_quarantined, stale_socket_and_cli,
    status_shows_volumes_staged_and_quarantined,
};
use recovery::{
    condition_and_repair, crash_mid_attach, ext4_errors_are_abnormal, restart_between_stage_and_unstage, xfs_shutdown_is_abnormal,
};

fn expect_code<T>(r: Result<T, tonic::Status>, want: Code, what: &str) -> Result<(), Failed> {
    match r {
        Err(s) if s.code() == want => Ok(()),
        Err(s) => Err(format!("{what}: expected {want:?}, got {:?}: {}", s.code(), s.message()).into()),
        Ok(_) => Err(format!("{what}: expected {want:?}, got success").into()),
    }
}

fn bytes_usage(r: &NodeGetVolumeStatsResponse) -> Option<&VolumeUsage> {
    r.usage.iter().find(|u| u.unit == volume_usage::Unit::Bytes as i32)
}

/// Nothing of the test's is mounted or attached any more.
fn all_gone(a: &Agent) -> Result<(), Failed> {
    let m = mounts_under(&a.kubelet);
    check(m.is_empty(), format!("still mounted: {m:?}"))?;
    let l = loops_under(a.scratch.path());
    check(l.is_empty(), format!("still attached: loop{l:?}"))
}

fn main() {
    let trials = vec![
        Trial::test("csi::lifecycle_mount_ext4", lifecycle_mount("ext4")),
        Trial::test("csi::lifecycle_mount_xfs", lifecycle_mount("xfs")),
        Trial::test("csi::lifecycle_block", lifecycle_block),
        Trial::test("csi::block_stats_at_kubelets_device_path", block_stats_at_kubelets_device_path),
        Trial::test("csi::readonly_and_two_publishes", readonly_and_two_publishes),
        Trial::test("csi::expand_while_published_xfs", expand_while_published("xfs")),
        Trial::test("csi::expand_while_published_ext4", expand_while_published("ext4")),
        Trial::test("csi::node_expansion_grows_where_the_volume_lives", node_expansion_grows_where_the_volume_lives),
        Trial::test("csi::error_codes", error_codes),
        Trial::test("csi::concurrent_calls_on_one_volume", concurrent_calls_on_one_volume),
        Trial::test("csi::restart_between_stage_and_unstage", restart_between_stage_and_unstage),
        Trial::test("csi::condition_and_repair", condition_and_repair),
        Trial::test("csi::crash_mid_attach", crash_mid_attach),
        Trial::test("csi::identity_controller_and_listing", identity_controller_and_listing),
        Trial::test("csi::stale_socket_and_cli", stale_socket_and_cli),
        Trial::test("csi::status_shows_volumes_staged_and_quarantined", status_shows_volumes_staged_and_quarantined),
        Trial::test("csi::staged_record_quarantined", staged_record_quarantined),
        Trial::test("csi::nbd_attach_kind", nbd_attach_kind),
        Trial::test("csi::ext4_errors_are_abnormal", ext4_errors_are_abnormal),
        Trial::test("csi::xfs_shutdown_is_abnormal", xfs_shutdown_is_abnormal),
    ];
    common::run_in_private_namespace(trials)
}
