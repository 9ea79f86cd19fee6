//! Attaching NBD exports to `/dev/nbdN` through the kernel's nbd driver,
//! over its generic netlink family (not the ioctls: only a device
//! configured over netlink can be given fresh sockets with RECONFIGURE,
//! which is what lets the serving process restart under a mounted
//! filesystem).
//!
//! - `volring_sys::NbdNetlink`: the family's commands and notices on one
//!   socket, with the netlink framing behind it;
//! - `control`: [`NbdControl`] with [`ConnectSpec`], the backend
//!   identifier check before any reconfigure or disconnect, and the
//!   LINK_DEAD listener ([`LinkDeadListener`]);
//! - `local`: a device served by this process's own NBD server over
//!   socketpairs ([`LocalAttachment`], [`local_sockets`]);
//! - `remote`: a device served by another node's export over TCP
//!   ([`RemoteAttachment`], [`remote_sockets`]).

mod control;
mod local;
mod remote;

pub use control::{read_backend, ConnectSpec, LinkDeadListener, NbdControl, DEFAULT_DEAD_CONN_TIMEOUT, DEFAULT_TIMEOUT};
pub use local::{connected_sockets as local_sockets, LocalAttachment};
pub use remote::{connected_sockets as remote_sockets, let_go, RemoteAttachment, RemoteSource};

/// Everything that can go wrong attaching a device.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The kernel has no "nbd" genl family: the module is not loaded.
    #[error("the kernel has no nbd netlink family (is the nbd module loaded?)")]
    FamilyNotFound,
    /// The device serves another backend than the one asked for: it is not
    /// touched.
    #[error("/dev/nbd{index} serves backend {found:?}, not {expected:?}")]
    BackendMismatch { index: u32, expected: String, found: Option<String> },
    #[error("malformed netlink message: {0}")]
    Malformed(&'static str),
    #[error("{op}: {source}")]
    Kernel { op: &'static str, source: std::io::Error },
    #[error("{what}: {source}")]
    Io { what: String, source: std::io::Error },
    #[error("NBD negotiation: {0}")]
    Negotiation(#[from] crate::Error),
    #[error("invalid request: {0}")]
    Invalid(String),
}

impl Error {
    pub(crate) fn io(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> Error {
        let what = what.into();
        move |source| Error::Io { what, source }
    }
}
