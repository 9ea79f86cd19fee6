//! Serving volumes over NBD.
//!
//! - [`wire`] and [`handshake`]: the protocol as pure code over bytes (fuzzed);
//! - `export`: what is served (image files and block devices), added and
//!   removed at run time, with per-export metrics;
//! - `server`: ring threads that own the sockets and the files and drive
//!   both through io_uring, replying out of order as requests complete
//!   ([`NbdServer`]).

// Everything is crate-private unless another crate uses it: a `pub`
// item no other crate can reach is an error (`-D warnings`).
#![warn(unreachable_pub)]

pub mod attach;
pub mod client;
mod export;
pub mod handshake;
pub mod remote;
mod server;
pub mod stats;
pub mod wire;

pub use export::{Admission, Export, ExportSpec, Exports};
pub use server::{inline::InlineWrites, starve::OffloadReads, Listen, NbdServer, ServerConfig};

/// Everything that can go wrong in this module.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("bad request magic {0:#010x}")]
    BadMagic(u32),
    #[error("bad option magic {0:#018x}")]
    OptionMagic(u64),
    #[error("unknown client flags {0:#x}")]
    ClientFlags(u32),
    /// The server answered an option with an error reply.
    #[error("server refused option {option} with reply {reply:#x}")]
    Refused { option: u32, reply: u32 },
    #[error("protocol violation: {0}")]
    Protocol(&'static str),
    #[error("invalid export spec {spec:?}: {why}")]
    Spec { spec: String, why: String },
    #[error("invalid NBD listen address {addr:?}: {why}")]
    Listen { addr: String, why: String },
    #[error("invalid {what} {value:?}: {why}")]
    Setting { what: &'static str, value: String, why: &'static str },
    /// An export URI that is not `nbd://HOST[:PORT]/EXPORT`.
    #[error("invalid export URI {uri:?}: {why}")]
    Uri { uri: String, why: &'static str },
    /// A secret that is not 64 hex digits, or an export that needs one.
    #[error("export secret: {0}")]
    Secret(&'static str),
    #[error("export {0:?} already exists")]
    Exists(String),
    #[error("no export named {0:?}")]
    NoSuchExport(String),
    #[error("{path}: {source}")]
    Open { path: std::path::PathBuf, source: std::io::Error },
    /// A unix socket path that is not this server's to take: another
    /// server holds or listens on it, or something else is there.
    #[error("socket {path}: {why}")]
    Socket { path: std::path::PathBuf, why: String },
    #[error("{what}: {source}")]
    Io { what: String, source: std::io::Error },
}

impl Error {
    pub(crate) fn io(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> Error {
        let what = what.into();
        move |source| Error::Io { what, source }
    }
}
