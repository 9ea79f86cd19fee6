//! Node-local volumes: sparse image files in a pool directory, attached
//! through loop devices, formatted and mounted for the CSI node service.
//!
//! The pieces are small and separately testable: [`ImagePool`] owns the
//! images and their metadata, [`StagedRecords`] remembers on disk what this
//! node has staged (so an agent restart loses nothing), [`attach`] maps an
//! image to a loop device, [`filesystem`] probes, formats and grows, and
//! [`mounting`] turns CSI mount flags into mount(2) calls. Everything that
//! writes state writes it crash-safe (`persist`); a record that cannot be
//! read back is quarantined rather than fatal, and [`status`] reports it all.
//!
//! Below the volumes sits [`store`], the node's embedded transactional store
//! where every step that changes the machine writes its intent first; above
//! them, the [`Reconciler`] compares what was asked for with what the kernel shows and
//! reconciles. [`fault`] names the crash points the recovery tests kill at.

// Everything is crate-private unless another crate uses it: a `pub`
// item no other crate can reach is an error (`-D warnings`).
#![warn(unreachable_pub)]

pub mod attach;
pub mod beneath;
pub mod fault;
pub mod filesystem;
mod identity;
pub mod mounting;
mod persist;
mod pool;
pub mod recover;
mod staged;
mod state;
pub mod status;
pub mod store;

pub use identity::{identities, pod_of_target, ClaimRef, ClusterNames, KubeletLabels, PodRef, VolumeIdentity};
pub use persist::Quarantined;
pub use pool::{ImagePool, VolumeMeta};
pub use staged::{AccessKind, AttachKind, RemoteExport, StagePhase, StagedRecords, StagedVolume, StoreLoss};
pub use state::{
    actual::{Action, AtPath, Drift, HealthView, Proof, Repair, VolumeActual, VolumeHealth},
    history::{RepairEvent, RepairResult},
    reconcile::{Acted, Changed, Notifier, ReconcileConfig, ReconcileStats, Reconciler, Volumes, PASS_BUCKETS_US},
};

use std::path::PathBuf;

/// What can go wrong with a volume. The CSI layer maps each to a gRPC code.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("volume {0} not found")]
    NotFound(String),
    #[error("volume {id} exists with a different size or parameters: {detail}")]
    Conflict { id: String, detail: String },
    #[error("size out of range: {0}")]
    OutOfRange(String),
    #[error("{0}")]
    Precondition(String),
    #[error("{what} {path}: {source}")]
    Io {
        what: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{command} failed ({status}): {stderr}")]
    Command { command: String, status: String, stderr: String },
    #[error("corrupt record {path}: {detail}")]
    Corrupt { path: PathBuf, detail: String },
}

impl Error {
    pub(crate) fn io(what: &'static str, path: impl Into<PathBuf>) -> impl FnOnce(std::io::Error) -> Error {
        let path = path.into();
        move |source| Error::Io { what, path, source }
    }
}

/// Runs a helper program (mkfs, resize2fs, xfs_growfs) and turns a failure
/// into a typed error carrying its stderr.
pub(crate) fn run(program: &str, args: &[&str]) -> Result<(), Error> {
    let out =
        std::process::Command::new(program).args(args).stdin(std::process::Stdio::null()).output().map_err(Error::io("run", program))?;
    if out.status.success() {
        return Ok(());
    }
    let mut stderr = String::from_utf8_lossy(&out.stderr).trim().to_string();
    // Cut on a character boundary (truncate panics inside a character).
    let cut = (0..=stderr.len().min(2000)).rev().find(|&i| stderr.is_char_boundary(i)).unwrap_or(0);
    stderr.truncate(cut);
    Err(Error::Command { command: format!("{program} {}", args.join(" ")), status: out.status.to_string(), stderr })
}
