//! volring: a node agent for Kubernetes storage nodes.
//!
//! See `DESIGN.md` beside the repository for the architecture. Each module is
//! one concern: `sys` (raw syscalls), `ring` (the io_uring reactor), `mounts`
//! (the mount-table engine), `state` (desired and actual state of the
//! node's volumes, and the reconciler), `agent` (wiring).

pub mod agent;
pub mod csi;
pub mod devices;
pub mod fault;
pub mod metrics;
pub mod mounts;
pub mod nbd;
pub mod publisher;
// The two homes of `unsafe` (see Cargo.toml's [lints]).
#[allow(unsafe_code)]
pub mod ring;
pub mod share;
pub mod state;
#[allow(unsafe_code)]
pub mod sys;
pub mod volumes;
