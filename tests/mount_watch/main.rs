//! The mount watcher against the real kernel, in a private mount namespace.
//!
//! Every scenario runs for both strategies (fanotify+statmount, and the
//! mountinfo re-parse fallback) on both ring engines (io_uring, epoll), and
//! asserts the exact events emitted. The scenarios live in one module per
//! theme; this file holds what they share (the `Watch` consumer, the event
//! checks) and the list of trials.

#[path = "../common/mod.rs"]
mod common;

mod bursts;
mod cli;
mod events;
mod names;
mod remount;

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{tmpfs_at, umount, LoopDevice, Scratch};
use libtest_mimic::{Failed, Trial};
use rustix::mount::{
    mount_bind, mount_bind_recursive, mount_change, mount_move, mount_remount, unmount, MountFlags, MountPropagationFlags, UnmountFlags,
};
use volring_mounts::{Changes, EventKind, MountEvent, MountTable, MountWatcher, ResyncReason, WatchConfig, WatchEvent, WatchMode};
use volring_ring::{queue::Receiver, BackendChoice};

use bursts::{
    fanotify_overflow, lagging_consumer, periodic_resyncs_are_not_overflows, short_lived_mounts, short_lived_mounts_racing_resyncs,
};
use cli::{
    cli_prints_the_table_like_findmnt, cli_watch_streams_json_lines, moves_read_after_the_mount_is_gone, stopped_watcher_reports_every_move,
};
use events::{
    bind_mounts, fanotify_mode_on_an_older_kernel_says_what_is_missing, loop_ext4_with_space, move_mount, other_namespace, propagation,
    remount_read_only, tmpfs_attach_detach, unmount_tree,
};
use names::odd_names_same_in_both_strategies;
use remount::{remount_then_umount, Steps};

/// The longest a test waits for something that should happen: 30 s, and
/// 120 s in the emulated guest of tests/vm.rs (it exports
/// `VOLRING_TEST_IN_GUEST`), where time runs 10-50x slower. Every wait
/// bounded by it ends as soon as its condition holds.
fn patience() -> Duration {
    if std::env::var_os("VOLRING_TEST_IN_GUEST").is_some() {
        Duration::from_secs(120)
    } else {
        Duration::from_secs(30)
    }
}
/// How long a test keeps listening after what it waited for arrived, to
/// catch extra events that must not be there.
const QUIET: Duration = Duration::from_millis(500);

struct Watch {
    watcher: Option<MountWatcher>,
    rx: Receiver<WatchEvent>,
    table: MountTable,
    scope: Vec<u8>,
}

impl Watch {
    fn start(mode: WatchMode, backend: BackendChoice, scratch: &Scratch) -> Self {
        Self::with(WatchConfig { mode, backend, resync_interval: None, ..WatchConfig::default() }, scratch)
    }

    fn with(config: WatchConfig, scratch: &Scratch) -> Self {
        let mode = config.mode;
        let (watcher, table, rx) = MountWatcher::start(config).expect("watcher starts");
        assert_eq!(watcher.stats().mode, mode);
        Self { watcher: Some(watcher), rx, table, scope: scratch.path().as_os_str().as_encoded_bytes().to_vec() }
    }

    fn watcher(&self) -> &MountWatcher {
        self.watcher.as_ref().expect("running")
    }

    fn in_scope(&self, e: &MountEvent) -> bool {
        e.subject().is_none_or(|m| m.mount_point().starts_with(&self.scope))
    }

    /// Takes deliveries until `n` events in scope arrived, then keeps
    /// listening `QUIET` to catch any extra. Applies all to the table. The
    /// wait ends as soon as the events are in, so its bound (`patience()`) only
    /// matters on a loaded host or in the emulated guest of tests/vm.rs.
    fn take(&mut self, n: usize) -> Vec<MountEvent> {
        let mut got = Vec::new();
        let deadline = Instant::now() + patience();
        let mut quiet_until: Option<Instant> = None;
        loop {
            let now = Instant::now();
            let until = match quiet_until {
                Some(q) => q,
                None if got.len() >= n => *quiet_until.insert(now + QUIET),
                None => deadline,
            };
            if now >= until {
                break;
            }
            let Some(d) = self.rx.recv_timeout(until - now) else {
                continue;
            };
            for e in d.changes() {
                self.table.apply(e);
                if self.in_scope(e) {
                    got.push(e.clone());
                }
            }
        }
        got
    }
}

impl Drop for Watch {
    fn drop(&mut self) {
        if let Some(w) = self.watcher.take() {
            let _ = w.stop();
        }
    }
}

/// Mounted read-only: proc(5) puts `ro` or `rw` first in a mount's
/// per-mount options.
fn read_only(m: &volring_mounts::Mount) -> bool {
    m.options().split(|&b| b == b',').next() == Some(b"ro")
}

fn target(e: &MountEvent) -> String {
    e.subject().map(|m| m.mount_point_path().display().to_string()).unwrap_or_default()
}

/// The events as (kind, path relative to the scratch dir), sorted.
fn summary(events: &[MountEvent], scratch: &Scratch) -> Vec<(EventKind, String)> {
    let root = scratch.path().display().to_string();
    let mut v: Vec<_> = events.iter().map(|e| (e.kind, target(e).strip_prefix(&root).unwrap_or("?").to_string())).collect();
    v.sort();
    v
}

fn expect(events: &[MountEvent], scratch: &Scratch, want: &[(EventKind, &str)]) -> Result<(), Failed> {
    let got = summary(events, scratch);
    let mut want: Vec<_> = want.iter().map(|(k, p)| (*k, p.to_string())).collect();
    want.sort();
    if got != want {
        return Err(format!("events differ\n  got:  {got:?}\n  want: {want:?}").into());
    }
    Ok(())
}

fn check(cond: bool, what: impl std::fmt::Display) -> Result<(), Failed> {
    if cond {
        Ok(())
    } else {
        Err(what.to_string().into())
    }
}

use EventKind::*;

fn same_as_kernel(table: &MountTable, mode: WatchMode) -> Result<(), Failed> {
    let (fresh, _) = volring_mounts::load(mode == WatchMode::Fanotify)?;
    let key = |t: &MountTable| {
        let mut v: Vec<_> = t.iter().map(|m| (m.id, m.mount_point().to_vec(), m.options().to_vec(), m.propagation)).collect();
        v.sort();
        v
    };
    check(key(table) == key(&fresh), "consumer's table matches the kernel's")
}

/// Applies deliveries until the consumer's table equals the kernel's
/// (`patience()` at most), and fails with the last difference otherwise. A
/// fixed quiet window is not enough: an event still on its way (late on a
/// loaded host) makes a single comparison differ for a moment.
fn converges_to_kernel(w: &mut Watch, mode: WatchMode) -> Result<(), Failed> {
    let deadline = Instant::now() + patience();
    loop {
        while Instant::now() < deadline {
            let Some(ev) = w.rx.recv_timeout(Duration::from_millis(100)) else { break };
            ev.changes().iter().for_each(|e| w.table.apply(e));
        }
        match same_as_kernel(&w.table, mode) {
            Err(_) if Instant::now() < deadline => {}
            done => return done,
        }
    }
}

fn bytes(p: &std::path::Path) -> &[u8] {
    p.as_os_str().as_encoded_bytes()
}

fn main() {
    type Scenario = fn(WatchMode, BackendChoice) -> Result<(), Failed>;
    let scenarios: &[(&str, Scenario)] = &[
        ("tmpfs_attach_detach", tmpfs_attach_detach),
        ("bind_mounts", bind_mounts),
        ("loop_ext4_with_space", loop_ext4_with_space),
        ("move_mount", move_mount),
        ("remount_read_only", remount_read_only),
        ("propagation", propagation),
        ("unmount_tree", unmount_tree),
        ("short_lived_mounts", short_lived_mounts),
        ("lagging_consumer", lagging_consumer),
        ("stopped_watcher_reports_every_move", stopped_watcher_reports_every_move),
    ];
    // Fanotify mount events arrived in 6.15 (statmount in 6.8): on an older
    // kernel (the 6.1 VM of tests/vm.rs) the trials that need them are
    // ignored, saying why, and the fallback is tested instead.
    let unsupported = MountWatcher::fanotify_support().err();
    if let Some(why) = &unsupported {
        eprintln!("note: fanotify trials ignored: {why}");
    }
    let no_fanotify = unsupported.is_some();
    let mut trials = Vec::new();
    for (mode_name, mode) in [("fanotify", WatchMode::Fanotify), ("reparse", WatchMode::Reparse)] {
        for (backend_name, backend) in [("uring", BackendChoice::IoUring), ("epoll", BackendChoice::Epoll)] {
            for &(name, f) in scenarios {
                trials.push(
                    Trial::test(format!("{mode_name}::{backend_name}::{name}"), move || f(mode, backend))
                        .with_ignored_flag(no_fanotify && mode == WatchMode::Fanotify),
                );
            }
        }
    }
    for (backend_name, backend) in [("uring", BackendChoice::IoUring), ("epoll", BackendChoice::Epoll)] {
        trials.push(
            Trial::test(format!("fanotify::{backend_name}::overflow_resync"), move || fanotify_overflow(backend))
                .with_ignored_flag(no_fanotify),
        );
        trials.push(
            Trial::test(format!("fanotify::{backend_name}::periodic_resyncs_are_not_overflows"), move || {
                periodic_resyncs_are_not_overflows(backend)
            })
            .with_ignored_flag(no_fanotify),
        );
        trials.push(
            Trial::test(format!("fanotify::{backend_name}::short_lived_mounts_racing_resyncs"), move || {
                short_lived_mounts_racing_resyncs(backend)
            })
            .with_ignored_flag(no_fanotify),
        );
        trials.push(
            Trial::test(format!("fanotify::{backend_name}::moves_read_after_the_mount_is_gone"), move || {
                moves_read_after_the_mount_is_gone(backend)
            })
            .with_ignored_flag(no_fanotify),
        );
        trials.push(
            Trial::test(format!("both::{backend_name}::odd_names_same_in_both_strategies"), move || {
                odd_names_same_in_both_strategies(backend)
            })
            .with_ignored_flag(no_fanotify),
        );
    }
    for (mode_name, mode) in [("fanotify", WatchMode::Fanotify), ("reparse", WatchMode::Reparse)] {
        for (backend_name, backend) in [("uring", BackendChoice::IoUring), ("epoll", BackendChoice::Epoll)] {
            for (steps_name, steps) in [("syscalls", Steps::Syscalls), ("commands", Steps::Commands)] {
                trials.push(
                    Trial::test(format!("{mode_name}::{backend_name}::remount_then_umount_{steps_name}"), move || {
                        remount_then_umount(mode, backend, steps)
                    })
                    .with_ignored_flag(no_fanotify && mode == WatchMode::Fanotify),
                );
            }
        }
    }
    trials.push(Trial::test("fanotify::other_namespace", || other_namespace(WatchMode::Fanotify)).with_ignored_flag(no_fanotify));
    trials.push(Trial::test("reparse::other_namespace", || other_namespace(WatchMode::Reparse)));
    trials.push(
        Trial::test(
            "fallback::fanotify_mode_on_an_older_kernel_says_what_is_missing",
            fanotify_mode_on_an_older_kernel_says_what_is_missing,
        )
        .with_ignored_flag(!no_fanotify),
    );
    trials.push(Trial::test("cli::mounts_like_findmnt", cli_prints_the_table_like_findmnt));
    trials.push(Trial::test("cli::watch_streams_json_lines", cli_watch_streams_json_lines));
    common::run_in_private_namespace(trials)
}
