//! The node's state of world: what was asked for (desired), what is really
//! there (actual), and the reconciler that converges them.
//!
//! - [`crate::store`] (below the volumes, which record their intents in it): the node's embedded, transactional store (redb), where the
//!   desired state is written intent-first and the reconciler's verdicts are
//!   kept for `volring status`.
//! - [`actual`]: what is really there for a volume, read from the engines
//!   (the mount watcher's table, the kernel's loop device records), the
//!   pure comparison with its desired record, and the published verdicts.
//! - [`history`]: the reconciler's last repairs, a bounded ring in the
//!   store, for `volring status`.
//! - [`reconcile`]: the thread that runs that comparison on events and on a
//!   periodic resync, and repairs what volring owns.

pub(crate) mod actual;
pub(crate) mod history;
pub(crate) mod reconcile;
