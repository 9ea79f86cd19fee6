//! volring: a node agent for Kubernetes storage nodes.
//!
//! This package is the top of the workspace (docs/architecture.md): the
//! agent that starts and stops every component, the metrics it serves and
//! the command line. The engines live in the crates below it, lowest first:
//! `volring-sys`, `volring-ring`, `volring-mounts`, `volring-devices`,
//! `volring-nbd`, `volring-volumes`, `volring-share`, `volring-csi`,
//! `volring-kube`.

// Everything is crate-private unless the binary, tests or benches use it.
#![warn(unreachable_pub)]

pub mod agent;
pub mod metrics;
