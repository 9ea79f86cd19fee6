//! Binding the server's listeners, and giving a unix socket path back.
//!
//! A unix socket path is shared state on the node: an agent restarted after
//! a crash finds its old socket file, and a second agent started by mistake
//! finds the first one's. Three rules keep them apart:
//! - the path is claimed by an exclusive `flock` on `PATH.lock`, held for
//!   the server's life, so two servers never decide about one path at once
//!   (a second one fails with [`Error::Socket`] even when the first one's
//!   socket file was deleted under it);
//! - a socket file left at the path is removed only when connecting to it
//!   is refused (nobody listens) and it is still the same inode when looked
//!   at again (nobody replaced it meanwhile);
//! - at shutdown the path is removed only while it is still the socket this
//!   server bound (same device and inode).
//!
//! The lock file stays: unlinking it would let a process that opened it
//! just before lock an orphaned inode while another creates a new one.

use std::fs::File;
use std::os::fd::OwnedFd;
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::{Path, PathBuf};

use rustix::fs::FlockOperation;

use super::Listen;
use crate::nbd::Error;

/// A bound listener, kept open for the server's life; dropping it closes
/// the socket and gives the path back.
pub(super) struct Listener {
    /// Declared first: closed before the claim on the path ends.
    pub(super) fd: OwnedFd,
    /// Held for what its Drop does.
    _claim: Option<UnixClaim>,
}

/// What a unix listener owns besides its descriptor.
struct UnixClaim {
    path: PathBuf,
    /// (device, inode) of the socket file this server bound.
    id: (u64, u64),
    /// The locked `PATH.lock`; the lock ends when it is closed.
    _lock: File,
}

fn socket_error(path: &Path, why: impl Into<String>) -> Error {
    Error::Socket { path: path.to_path_buf(), why: why.into() }
}

/// The file whose lock claims `path`.
fn lock_path(path: &Path) -> PathBuf {
    let mut p = path.as_os_str().to_os_string();
    p.push(".lock");
    PathBuf::from(p)
}

fn file_id(meta: &std::fs::Metadata) -> (u64, u64) {
    (meta.dev(), meta.ino())
}

impl Listener {
    /// Binds `l`; returns the listener and the address it is bound to.
    pub(super) fn bind(l: &Listen) -> Result<(Listener, String), Error> {
        match l {
            Listen::Tcp(addr) => {
                let s = std::net::TcpListener::bind(addr).map_err(Error::io(format!("bind {addr}")))?;
                // Accepted sockets inherit TCP_NODELAY: replies leave at once.
                rustix::net::sockopt::set_tcp_nodelay(&s, true).map_err(|e| Error::io("TCP_NODELAY")(e.into()))?;
                let local = s.local_addr().map_err(Error::io("local_addr"))?;
                Ok((Listener { fd: OwnedFd::from(s), _claim: None }, local.to_string()))
            }
            Listen::Unix(path) => {
                // Like the CSI socket's: the directory is made if missing
                // (`/run/volring/nbd.sock` on a fresh machine).
                if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
                    std::fs::create_dir_all(dir).map_err(|e| socket_error(path, format!("create {}: {e}", dir.display())))?;
                }
                let lock = claim(path)?;
                remove_stale_socket(path)?;
                let s = std::os::unix::net::UnixListener::bind(path).map_err(|e| socket_error(path, format!("bind: {e}")))?;
                let meta = std::fs::symlink_metadata(path).map_err(|e| socket_error(path, format!("stat after bind: {e}")))?;
                let claim = UnixClaim { path: path.clone(), id: file_id(&meta), _lock: lock };
                Ok((Listener { fd: OwnedFd::from(s), _claim: Some(claim) }, format!("unix:{}", path.display())))
            }
        }
    }
}

impl Drop for UnixClaim {
    /// Runs after the listener's descriptor is closed (declared before it):
    /// the socket file goes only if it is still ours, then the lock.
    fn drop(&mut self) {
        match std::fs::symlink_metadata(&self.path) {
            Ok(meta) if file_id(&meta) == self.id => {
                if let Err(e) = std::fs::remove_file(&self.path) {
                    tracing::warn!(path = %self.path.display(), error = %e, "NBD socket could not be removed");
                }
            }
            Ok(_) => tracing::warn!(path = %self.path.display(), "NBD socket path was replaced; left alone"),
            Err(_) => {}
        }
    }
}

/// Takes the exclusive lock on `PATH.lock`, or says who holds it.
fn claim(path: &Path) -> Result<File, Error> {
    let lock_at = lock_path(path);
    let lock = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(&lock_at)
        .map_err(|e| socket_error(path, format!("open {}: {e}", lock_at.display())))?;
    match rustix::fs::flock(&lock, FlockOperation::NonBlockingLockExclusive) {
        Ok(()) => Ok(lock),
        Err(rustix::io::Errno::WOULDBLOCK) => Err(socket_error(path, format!("another server holds {}", lock_at.display()))),
        Err(e) => Err(socket_error(path, format!("lock {}: {e}", lock_at.display()))),
    }
}

/// With the path claimed: a socket nobody listens on is removed; anything
/// else at the path is refused and left as it is.
fn remove_stale_socket(path: &Path) -> Result<(), Error> {
    let meta = match std::fs::symlink_metadata(path) {
        Ok(m) => m,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(socket_error(path, format!("stat: {e}"))),
    };
    if !meta.file_type().is_socket() {
        return Err(socket_error(path, "exists and is not a socket"));
    }
    match std::os::unix::net::UnixStream::connect(path) {
        Ok(_) => return Err(socket_error(path, "another server is listening there")),
        Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused => {}
        // Anything but a refusal (a full backlog, no permission) may be a
        // live server: its socket is not ours to remove.
        Err(e) => return Err(socket_error(path, format!("cannot tell whether the socket is in use: {e}"))),
    }
    match std::fs::symlink_metadata(path) {
        Ok(again) if file_id(&again) == file_id(&meta) => {
            std::fs::remove_file(path).map_err(|e| socket_error(path, format!("remove stale socket: {e}")))
        }
        Ok(_) => Err(socket_error(path, "the socket was replaced while it was checked")),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(socket_error(path, format!("stat: {e}"))),
    }
}
