//! The CSI driver: Identity, Controller (node-local image volumes) and Node
//! services over gRPC on a unix socket.
//!
//! `validate` checks every request field before anything touches the
//! machine (pure, fuzzed); `VolumeLocks` keeps two calls from working on one
//! volume at once; `controller` and `node` do the work with `volumes`;
//! `service` adapts them to the generated tonic traits and is the one place
//! where errors become gRPC codes; `server` runs it all on the socket.

// Everything is crate-private unless another crate uses it: a `pub`
// item no other crate can reach is an error (`-D warnings`).
#![warn(unreachable_pub)]

mod attached;
pub mod authority;
mod base;
pub mod client;
mod controller;
mod driver;
pub mod fence;
mod identity;
mod locks;
pub mod nbd;
pub mod nbd_export;
mod node;
mod node_stats;
mod owned;
pub mod proto;
mod publish;
mod repair;
mod rpc_stats;
pub mod server;
mod service;
mod share;
mod share_client;
/// Only the fuzz targets' entries are public; the validators are the
/// calls' own.
pub mod validate;

pub use attached::AttachedCheck;
pub use driver::{CsiConfig, Driver, DriverStats, Expansion, Readiness, RpcSnapshot};
use locks::{VolumeGuard, VolumeLocks};

/// The plugin name reported by GetPluginInfo (and used by CSIDriver objects).
pub const DRIVER_NAME: &str = "volring.csi.io";
/// The topology key naming the node a volume lives on.
pub(crate) const TOPOLOGY_KEY: &str = "topology.volring.csi.io/node";

/// Why a CSI call failed; each variant is one gRPC code, chosen by the CSI
/// specification's error tables.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{0}")]
    InvalidArgument(String),
    #[error("{0}")]
    NotFound(String),
    #[error("{0}")]
    AlreadyExists(String),
    #[error("{0}")]
    FailedPrecondition(String),
    /// Another operation on the volume is running, or a list token is not
    /// one volring issued: the CO retries or restarts.
    #[error("{0}")]
    Aborted(String),
    #[error("{0}")]
    OutOfRange(String),
    #[error("{0}")]
    ResourceExhausted(String),
    #[error("{0} is not implemented by volring")]
    Unimplemented(&'static str),
    /// Something the call needs is out of reach for now (another node's
    /// export): the CO retries.
    #[error("{0}")]
    Unavailable(String),
    #[error("{0}")]
    Internal(String),
}

impl Error {
    pub(crate) fn code(&self) -> tonic::Code {
        match self {
            Error::InvalidArgument(_) => tonic::Code::InvalidArgument,
            Error::NotFound(_) => tonic::Code::NotFound,
            Error::AlreadyExists(_) => tonic::Code::AlreadyExists,
            Error::FailedPrecondition(_) => tonic::Code::FailedPrecondition,
            Error::Aborted(_) => tonic::Code::Aborted,
            Error::OutOfRange(_) => tonic::Code::OutOfRange,
            Error::ResourceExhausted(_) => tonic::Code::ResourceExhausted,
            Error::Unimplemented(_) => tonic::Code::Unimplemented,
            Error::Unavailable(_) => tonic::Code::Unavailable,
            Error::Internal(_) => tonic::Code::Internal,
        }
    }
}

impl From<Error> for tonic::Status {
    fn from(e: Error) -> Self {
        tonic::Status::new(e.code(), e.to_string())
    }
}

impl From<volring_volumes::Error> for Error {
    fn from(e: volring_volumes::Error) -> Self {
        use volring_volumes::Error as V;
        match e {
            V::NotFound(id) => Error::NotFound(format!("volume {id} does not exist")),
            e @ V::Conflict { .. } => Error::AlreadyExists(e.to_string()),
            V::OutOfRange(m) => Error::OutOfRange(m),
            V::Precondition(m) => Error::FailedPrecondition(m),
            e @ (V::Io { .. } | V::Command { .. } | V::Corrupt { .. }) => Error::Internal(e.to_string()),
        }
    }
}

pub(crate) type Result<T> = std::result::Result<T, Error>;
