//! The NBD server against real clients from Debian's packages (nbdinfo,
//! qemu-io, qemu-img, nbdcopy, nbdfuse) and a raw client for what they
//! never send. Mounts happen in a private mount namespace. The tests live
//! in one module per theme; this file holds the list of trials.

#[path = "../common/mod.rs"]
mod common;
#[path = "../nbd_support/mod.rs"]
mod nbd_support;

mod clients;
mod exports;
mod hostile;
mod memory;
mod weight;

use std::io::{Read, Write};
use std::os::unix::fs::FileExt;
use std::time::{Duration, Instant};

use common::check;
use libtest_mimic::{Failed, Trial};
use nbd_support::wire::{cmd, cmd_flags as cf, errno, state, HeaderStyle};
use nbd_support::{pattern, run, ChildServer, ChildSpec, RawClient, Rng, ServeProcess, Served, MIB};

use clients::{
    acked_flush_survives_kill9, block_path_through_nbdfuse, nbdcopy_both_ways_multi_conn, nbdinfo_shows_every_feature, qemu_io_patterns,
    random_workload_then_compare, structured_acks_are_simple_replies,
};
use exports::{
    block_status_and_sparse_reads, block_status_is_bounded_per_request, direct_io_export, exports_added_and_removed_at_run_time,
    exports_file_reloads_on_sighup, spliced_reads_are_timed_until_sent, tcp_listener, write_zeroes_without_filesystem_help,
};
use hostile::{
    a_client_that_reads_late_gets_every_reply, broken_streams_close_only_their_connection, client_that_never_reads_is_bounded,
    hostile_requests_get_errors, stalled_handshake_is_dropped, the_rest_of_a_short_reply_is_sent_at_once,
};
use memory::{
    hostile_connections_stay_under_the_server_budget, list_flood_in_the_handshake_is_bounded,
    many_hostile_connections_do_not_starve_others, one_burst_of_reads_is_admitted_request_by_request,
};
use weight::{
    a_deep_connection_takes_two_threads_weight, a_ring_takes_the_weight_of_its_busy_connections, a_rings_workers_take_its_weight,
    a_starved_ring_takes_more_than_its_connections_weight, no_ring_weight_keeps_rings_at_their_nice,
};

const T: Duration = Duration::from_secs(60);

fn main() {
    nbd_support::child_server_main();
    let trials = vec![
        Trial::test("nbd::nbdinfo_shows_every_feature", nbdinfo_shows_every_feature),
        Trial::test("nbd::qemu_io_patterns", qemu_io_patterns),
        Trial::test("nbd::random_workload_then_compare", random_workload_then_compare),
        Trial::test("nbd::structured_acks_are_simple_replies", structured_acks_are_simple_replies),
        Trial::test("nbd::nbdcopy_both_ways_multi_conn", nbdcopy_both_ways_multi_conn),
        Trial::test("nbd::block_path_through_nbdfuse", block_path_through_nbdfuse),
        Trial::test("nbd::acked_flush_survives_kill9", acked_flush_survives_kill9),
        Trial::test("nbd::hostile_requests_get_errors", hostile_requests_get_errors),
        Trial::test("nbd::broken_streams_close_only_their_connection", broken_streams_close_only_their_connection),
        Trial::test("nbd::stalled_handshake_is_dropped", stalled_handshake_is_dropped),
        Trial::test("nbd::client_that_never_reads_is_bounded", client_that_never_reads_is_bounded),
        Trial::test("nbd::a_client_that_reads_late_gets_every_reply", a_client_that_reads_late_gets_every_reply),
        Trial::test("nbd::the_rest_of_a_short_reply_is_sent_at_once", the_rest_of_a_short_reply_is_sent_at_once),
        Trial::test("nbd::exports_added_and_removed_at_run_time", exports_added_and_removed_at_run_time),
        Trial::test("nbd::block_status_and_sparse_reads", block_status_and_sparse_reads),
        Trial::test("nbd::block_status_is_bounded_per_request", block_status_is_bounded_per_request),
        Trial::test("nbd::spliced_reads_are_timed_until_sent", spliced_reads_are_timed_until_sent),
        Trial::test("nbd::write_zeroes_without_filesystem_help", write_zeroes_without_filesystem_help),
        Trial::test("nbd::direct_io_export", direct_io_export),
        Trial::test("nbd::tcp_listener", tcp_listener),
        Trial::test("nbd::exports_file_reloads_on_sighup", exports_file_reloads_on_sighup),
        Trial::test("nbd::one_burst_of_reads_is_admitted_request_by_request", one_burst_of_reads_is_admitted_request_by_request),
        Trial::test("nbd::list_flood_in_the_handshake_is_bounded", list_flood_in_the_handshake_is_bounded),
        Trial::test("nbd::hostile_connections_stay_under_the_server_budget", hostile_connections_stay_under_the_server_budget),
        Trial::test("nbd::many_hostile_connections_do_not_starve_others", many_hostile_connections_do_not_starve_others),
        Trial::test("nbd::a_ring_takes_the_weight_of_its_busy_connections", a_ring_takes_the_weight_of_its_busy_connections),
        Trial::test("nbd::a_deep_connection_takes_two_threads_weight", a_deep_connection_takes_two_threads_weight),
        Trial::test("nbd::no_ring_weight_keeps_rings_at_their_nice", no_ring_weight_keeps_rings_at_their_nice),
        Trial::test("nbd::a_starved_ring_takes_more_than_its_connections_weight", a_starved_ring_takes_more_than_its_connections_weight),
        Trial::test("nbd::a_rings_workers_take_its_weight", a_rings_workers_take_its_weight),
    ];
    common::run_in_private_namespace(trials)
}
