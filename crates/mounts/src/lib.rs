//! The mount-table engine: parse, index, diff and watch the mount table.
//!
//! Pure parts (`parse`, `statmount`, `fanotify`, `diff`) work over bytes and
//! tables; the I/O is in `source` and `watcher`.

// Everything is crate-private unless another crate uses it: a `pub`
// item no other crate can reach is an error (`-D warnings`).
#![warn(unreachable_pub)]

mod devname;
mod diff;
mod escape;
mod event;
mod fanotify;
mod mount;
mod parse;
mod source;
pub mod statmount;
mod table;
mod watcher;

pub use devname::devices_of;
pub use diff::diff;
pub use escape::unescape;
pub use event::{BlockDevice, Changes, EventKind, MountEvent, ResyncReason, WatchEvent};
pub use fanotify::fuzz_fanotify_events;
pub use mount::{DevNum, Mount, Propagation};
pub use parse::{mountinfo_lines, mountinfo_mounts, LineError, RawMount};
pub use source::{load, read_mountinfo};
pub use table::MountTable;
pub use watcher::{MountWatcher, ResyncCounts, WatchConfig, WatchMode, WatcherStats};

/// Errors of the mount-table engine.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(transparent)]
    Line(#[from] LineError),
    #[error("statmount reply: {0}")]
    Statmount(&'static str),
    #[error("fanotify event: {0}")]
    Fanotify(&'static str),
    #[error("{0}: {1}")]
    Io(&'static str, #[source] std::io::Error),
    /// Text that is not a `major:minor` device number.
    #[error("{0:?} is not a major:minor device number")]
    DevNum(String),
    /// The kernel lacks an interface the asked-for mode needs. Distinct from
    /// `Io` so a caller can tell "too old, use the reparse mode" from a
    /// failure of an interface that exists.
    #[error("{what} need Linux {needs} or newer, which this kernel is not; the reparse mode works on it")]
    Unsupported { what: &'static str, needs: &'static str },
}
