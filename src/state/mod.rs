//! The node's state of world: what was asked for (desired), what is really
//! there (actual), and the reconciler that converges them.
//!
//! - [`store`]: the node's embedded, transactional store (redb), where the
//!   desired state is written intent-first and the reconciler's verdicts are
//!   kept for `volring status`.

pub mod store;
