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
//!
//! An address still in use is waited for, up to [`LISTEN_PATIENCE`]: the
//! kernel closes a killed server's io_uring — and with it the listening
//! socket its accept was armed on — in a worker after the process has been
//! reaped, so an agent restarted at once after a SIGKILL found its own old
//! port (or socket) still listening and exited (8 starts in 40 in
//! `nbd_remote::agent_exports_only_what_it_created`).

use std::fs::File;
use std::os::fd::OwnedFd;
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use rustix::fs::FlockOperation;

use super::Listen;
use crate::Error;

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

/// How long a bind waits for an address that is still in use.
pub(crate) const LISTEN_PATIENCE: Duration = Duration::from_secs(10);

/// Why one attempt to bind did not give a listener.
enum Attempt {
    /// Someone listens there; it may be a dead server's ring not yet closed.
    InUse(Error),
    Failed(Error),
}

impl Listener {
    /// Binds `l`, waiting up to [`LISTEN_PATIENCE`] while the address is in
    /// use (blocking: call it off the async runtime); returns the listener
    /// and the address it is bound to.
    pub(super) fn bind(l: &Listen) -> Result<(Listener, String), Error> {
        let deadline = Instant::now() + LISTEN_PATIENCE;
        let mut pause = Duration::from_millis(10);
        let mut waited = false;
        loop {
            match Self::try_bind(l) {
                Ok(bound) => {
                    if waited {
                        tracing::info!(listen = %bound.1, "NBD listen address free again");
                    }
                    return Ok(bound);
                }
                Err(Attempt::InUse(e)) if Instant::now() < deadline => {
                    if !waited {
                        tracing::warn!(error = %e, patience = ?LISTEN_PATIENCE, "NBD listen address in use (a server killed just before?): waiting");
                        waited = true;
                    }
                    std::thread::sleep(pause);
                    pause = (pause * 2).min(Duration::from_millis(200));
                }
                Err(Attempt::InUse(e) | Attempt::Failed(e)) => return Err(e),
            }
        }
    }

    fn try_bind(l: &Listen) -> Result<(Listener, String), Attempt> {
        match l {
            Listen::Tcp(addr) => {
                let s = std::net::TcpListener::bind(addr).map_err(|e| {
                    let in_use = e.kind() == std::io::ErrorKind::AddrInUse;
                    let e = Error::io(format!("bind {addr}"))(e);
                    if in_use {
                        Attempt::InUse(e)
                    } else {
                        Attempt::Failed(e)
                    }
                })?;
                // Accepted sockets inherit TCP_NODELAY: replies leave at once.
                rustix::net::sockopt::set_tcp_nodelay(&s, true).map_err(|e| Attempt::Failed(Error::io("TCP_NODELAY")(e.into())))?;
                let local = s.local_addr().map_err(|e| Attempt::Failed(Error::io("local_addr")(e)))?;
                Ok((Listener { fd: OwnedFd::from(s), _claim: None }, local.to_string()))
            }
            Listen::Unix(path) => {
                // Like the CSI socket's: the directory is made if missing
                // (`/run/volring/nbd.sock` on a fresh machine).
                let failed = |why: String| Attempt::Failed(socket_error(path, why));
                if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
                    std::fs::create_dir_all(dir).map_err(|e| failed(format!("create {}: {e}", dir.display())))?;
                }
                let lock = claim(path).map_err(Attempt::Failed)?;
                remove_stale_socket(path)?;
                let s = std::os::unix::net::UnixListener::bind(path).map_err(|e| failed(format!("bind: {e}")))?;
                let meta = std::fs::symlink_metadata(path).map_err(|e| failed(format!("stat after bind: {e}")))?;
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
/// else at the path is refused and left as it is. A socket that still
/// accepts is [`Attempt::InUse`]: with the claim ours, no live server of
/// ours holds it, but a killed one's ring may not be closed yet.
fn remove_stale_socket(path: &Path) -> Result<(), Attempt> {
    let failed = |why: String| Attempt::Failed(socket_error(path, why));
    let meta = match std::fs::symlink_metadata(path) {
        Ok(m) => m,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(failed(format!("stat: {e}"))),
    };
    if !meta.file_type().is_socket() {
        return Err(failed("exists and is not a socket".into()));
    }
    match std::os::unix::net::UnixStream::connect(path) {
        Ok(_) => return Err(Attempt::InUse(socket_error(path, "another server is listening there"))),
        Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused => {}
        // Anything but a refusal (a full backlog, no permission) may be a
        // live server: its socket is not ours to remove.
        Err(e) => return Err(failed(format!("cannot tell whether the socket is in use: {e}"))),
    }
    match std::fs::symlink_metadata(path) {
        Ok(again) if file_id(&again) == file_id(&meta) => {
            std::fs::remove_file(path).map_err(|e| failed(format!("remove stale socket: {e}")))
        }
        Ok(_) => Err(failed("the socket was replaced while it was checked".into())),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(failed(format!("stat: {e}"))),
    }
}
