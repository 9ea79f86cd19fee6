//! Fault points: named places in a step that changes the machine where a
//! test can make the agent die at once, as a crash or the OOM killer would.
//!
//! `VOLRING_FAULT_POINT=name` (read once) makes [`point`]`("name")` send
//! SIGKILL to the agent's own process; `VOLRING_FAULT_POINT=name@N` waits for
//! the N-th time that point is reached (1-based). Nothing else reads the
//! variable, so an agent started without it pays one relaxed load per point.
//! The crash tests (tests/csi_recovery.rs, tests/crash_loop.rs) walk every
//! point of an operation, kill there, restart and retry as kubelet does.
//!
//! Every point is listed in `POINTS` (below, for the unit tests), in the
//! order a volume's life reaches them; a point sits right after a step that
//! changed the machine (a file, a device, a mount, a record), so a kill
//! there leaves that step done and the next one not. The unit tests keep
//! the list equal to the calls in the source and to the crash loop's own
//! list (tests/csi_support/crash_model.rs), which the loop kills at.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;

/// Every fault point, grouped by the CSI call that reaches it:
///
/// - CreateVolume: `pool.create.created` (temporary image made),
///   `.sized` (its size set and synced), `.placed` (renamed to the image),
///   `.recorded` (record written);
/// - NodeStageVolume: `stage:attach` (intent recorded, nothing attached),
///   `stage:attached` (loop device attached and recorded), `stage:path`
///   (staging directory or block file made), `stage:mkfs` (mkfs intent
///   recorded), `stage:formatted` (mkfs done), `stage:mount` (mount intent
///   recorded), `stage:mounted` (mounted or bound), `stage:staged` (recorded
///   as staged);
/// - NodePublishVolume: `publish:target` (target made), `publish:bind`
///   (target recorded), `publish:bound` (bind mounted);
/// - ControllerExpandVolume: `pool.expand.grown` (image grown),
///   `pool.expand.recorded` (new size recorded), `expand:refreshed` (a staged
///   loop device told the new size);
/// - NodeExpandVolume: `node_expand:refreshed` (loop device resized),
///   `node_expand:grow` (about to grow the filesystem), `node_expand:grown`;
/// - NodeUnpublishVolume: `unpublish:unmounted`, `unpublish:removed`
///   (target removed), `unpublish:done` (record updated);
/// - NodeUnstageVolume: `unstage:intent` (the Unstaging intent recorded,
///   stale targets dropped), `unstage:unmounted`, `unstage:removed` (block file removed),
///   `unstage:detached`, `unstage:done` (record removed);
/// - DeleteVolume: `pool.delete.tombstoned` (image renamed to its
///   tombstone), `pool.delete.unrecorded` (record removed),
///   `pool.delete.removed` (tombstone removed).
#[cfg(test)]
const POINTS: &[&str] = &[
    "pool.create.created",
    "pool.create.sized",
    "pool.create.placed",
    "pool.create.recorded",
    "stage:attach",
    "stage:attached",
    "stage:path",
    "stage:mkfs",
    "stage:formatted",
    "stage:mount",
    "stage:mounted",
    "stage:staged",
    "publish:target",
    "publish:bind",
    "publish:bound",
    "pool.expand.grown",
    "pool.expand.recorded",
    "expand:refreshed",
    "node_expand:refreshed",
    "node_expand:grow",
    "node_expand:grown",
    "unpublish:unmounted",
    "unpublish:removed",
    "unpublish:done",
    "unstage:intent",
    "unstage:unmounted",
    "unstage:removed",
    "unstage:detached",
    "unstage:done",
    "pool.delete.tombstoned",
    "pool.delete.unrecorded",
    "pool.delete.removed",
];

/// The CSI call a point of `POINTS` lies in, by its name: `create`,
/// `stage`, `publish`, `expand` (ControllerExpandVolume), `node_expand`,
/// `unpublish`, `unstage` or `delete`.
#[cfg(test)]
fn call_of(point: &str) -> &str {
    let name = point.strip_prefix("pool.").unwrap_or(point);
    name.split([':', '.']).next().unwrap_or(name)
}

/// The armed point and the hit it fires on, if any.
fn armed() -> Option<&'static (String, u64)> {
    static ARMED: OnceLock<Option<(String, u64)>> = OnceLock::new();
    ARMED
        .get_or_init(|| {
            let v = std::env::var("VOLRING_FAULT_POINT").ok()?;
            match v.split_once('@') {
                Some((name, n)) => Some((name.to_string(), n.parse().ok().filter(|&n| n > 0)?)),
                None => Some((v, 1)),
            }
        })
        .as_ref()
}

/// Dies with SIGKILL here when this point is armed (see the module doc).
pub fn point(name: &str) {
    static HITS: AtomicU64 = AtomicU64::new(0);
    let Some((want, nth)) = armed() else { return };
    if want != name {
        return;
    }
    if HITS.fetch_add(1, Ordering::AcqRel) + 1 == *nth {
        tracing::error!(point = name, "fault point reached: killing the agent");
        let _ = rustix::process::kill_process(rustix::process::getpid(), rustix::process::Signal::KILL);
        // SIGKILL to oneself is delivered before kill(2) returns; should it
        // not be, abort rather than carry on past the point.
        std::process::abort();
    }
}

/// Test hooks that hold the agent between two steps, so a test can change
/// the machine there (mount something foreign on a path, say) and see what
/// the agent does next. `VOLRING_PAUSE_POINT=name` (or `name@N`, the N-th
/// time) with `VOLRING_PAUSE_DIR=dir`: at [`pause`]`("name")` the agent
/// creates `dir/name.reached` and waits (at most a minute) until the test
/// creates `dir/name.go`. The pause points:
///
/// - `reconcile:decided`: the reconciler decided a repair and holds the
///   volume's lock; nothing has been opened or mounted yet;
/// - `stage:premount`: a stage (a call's or the reconciler's repair) proved
///   the staging path empty and is about to mount onto it.
///
/// Waits here when this pause point is armed.
pub fn pause(name: &str) {
    static ARMED: OnceLock<Option<(String, u64, std::path::PathBuf)>> = OnceLock::new();
    static HITS: AtomicU64 = AtomicU64::new(0);
    let armed = ARMED.get_or_init(|| {
        let v = std::env::var("VOLRING_PAUSE_POINT").ok()?;
        let dir = std::path::PathBuf::from(std::env::var_os("VOLRING_PAUSE_DIR")?);
        match v.split_once('@') {
            Some((name, n)) => Some((name.to_string(), n.parse().ok().filter(|&n| n > 0)?, dir)),
            None => Some((v, 1, dir)),
        }
    });
    let Some((want, nth, dir)) = armed else { return };
    if want != name || HITS.fetch_add(1, Ordering::AcqRel) + 1 != *nth {
        return;
    }
    let file = name.replace(':', "_");
    tracing::warn!(point = name, "pause point reached: waiting for the test");
    let _ = std::fs::write(dir.join(format!("{file}.reached")), b"");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    while !dir.join(format!("{file}.go")).exists() && std::time::Instant::now() < deadline {
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The names passed to `point(...)` in one source file.
    fn called_in(source: &str) -> Vec<&str> {
        let mut out = Vec::new();
        for piece in source.split("fault::point(\"").skip(1) {
            out.push(&piece[..piece.find('"').expect("a closing quote")]);
        }
        out
    }

    #[test]
    fn the_list_is_the_points_in_the_source() {
        let sources = [
            include_str!("pool.rs"),
            include_str!("../../csi/src/node.rs"),
            include_str!("../../csi/src/publish.rs"),
            include_str!("../../csi/src/node_stats.rs"),
            include_str!("../../csi/src/controller.rs"),
        ];
        let mut in_source: Vec<&str> = sources.iter().flat_map(|s| called_in(s)).collect();
        in_source.sort();
        in_source.dedup();
        let mut listed = POINTS.to_vec();
        listed.sort();
        assert_eq!(in_source, listed);
    }

    /// The crash loop (tests/crash_loop.rs) kills at the points its model
    /// lists; a point missing there would never be crashed at.
    #[test]
    fn the_crash_model_lists_every_point() {
        let model = include_str!("../../../tests/csi_support/crash_model.rs");
        let start = model.find("pub const POINTS: &[&str] = &[").expect("the model's point list");
        let list = &model[start..start + model[start..].find("];").expect("the end of the list")];
        let named: Vec<&str> = list.split('"').skip(1).step_by(2).collect();
        assert_eq!(named, POINTS);
    }

    #[test]
    fn every_point_names_its_call() {
        let calls = ["create", "stage", "publish", "expand", "node_expand", "unpublish", "unstage", "delete"];
        for p in POINTS {
            assert!(calls.contains(&call_of(p)), "{p}: {}", call_of(p));
        }
        assert_eq!(call_of("pool.delete.tombstoned"), "delete");
        assert_eq!(call_of("node_expand:grow"), "node_expand");
    }
}
