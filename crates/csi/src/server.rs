//! Serving the three CSI services on a unix socket.
//!
//! Binding and serving are two steps so that the agent can bind every
//! listener before it starts anything: a socket it cannot have is a fatal
//! error at start, not a task that dies unseen. The socket file belongs to
//! whoever bound it, and only that process removes it ([`BoundSocket`]).

use std::future::Future;
use std::io;
use std::os::unix::fs::{FileTypeExt, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use super::proto::controller_server::ControllerServer;
use super::proto::identity_server::IdentityServer;
use super::proto::node_server::NodeServer;
use super::service::{ControllerService, IdentityService, NodeService};
use super::{authority, Driver};

/// `unix:///run/csi/csi.sock`, `unix:/run/csi/csi.sock` or a bare absolute
/// path, to the socket path.
pub fn parse_endpoint(s: &str) -> Result<PathBuf, String> {
    let path = s.strip_prefix("unix://").or_else(|| s.strip_prefix("unix:")).unwrap_or(s);
    if !path.starts_with('/') {
        return Err(format!("CSI endpoint {s:?}: expected unix:///absolute/path"));
    }
    Ok(PathBuf::from(path))
}

/// A socket file this process bound. Dropping it removes the file, but only
/// while the path still names that very socket (same device and inode): a
/// socket another server bound there since, or any other file, is left alone.
/// The socket's inode is held open (`O_PATH`) until then, so its number
/// cannot be reused by a newer file even after the listener has closed.
#[derive(Debug)]
pub struct BoundSocket {
    path: PathBuf,
    inode: std::os::fd::OwnedFd,
}

impl BoundSocket {
    /// True while `path` is still the socket this process bound.
    pub(crate) fn is_ours(&self) -> bool {
        let Ok(ours) = rustix::fs::fstat(&self.inode) else { return false };
        std::fs::symlink_metadata(&self.path).is_ok_and(|m| m.file_type().is_socket() && m.dev() == ours.st_dev && m.ino() == ours.st_ino)
    }
}

impl Drop for BoundSocket {
    fn drop(&mut self) {
        if self.is_ours() {
            let _ = std::fs::remove_file(&self.path);
        } else {
            tracing::warn!(endpoint = %self.path.display(), "the CSI socket path no longer names this agent's socket; left alone");
        }
    }
}

/// Serves until `shutdown` completes. The socket file stays: its
/// [`BoundSocket`] removes it.
pub async fn serve(driver: Arc<Driver>, listener: tokio::net::UnixListener, shutdown: impl Future<Output = ()>) -> io::Result<()> {
    use tokio_stream::StreamExt;
    tracing::info!(endpoint = %driver.config().endpoint.display(), "serving CSI");
    let incoming = tokio_stream::wrappers::UnixListenerStream::new(listener).map(|r| r.map(authority::Fixing::new));
    tonic::transport::Server::builder()
        .add_service(IdentityServer::new(IdentityService(driver.clone())))
        .add_service(ControllerServer::new(ControllerService(driver.clone())))
        .add_service(NodeServer::new(NodeService(driver)))
        .serve_with_incoming_shutdown(incoming, shutdown)
        .await
        .map_err(io::Error::other)
}

/// Binds the socket with mode 0660 (must run inside a tokio runtime). A
/// stale socket (one nobody answers on, left by a crash) is removed; a live
/// one, or any other kind of file, is an error: two agents must not share a
/// socket path.
///
/// The check, the removal and the bind run under an exclusive lock on the
/// socket's directory, so two agents starting at once cannot each remove
/// the other's fresh socket as stale. Only binders take that lock, and
/// only for the moment of binding.
pub fn bind(path: &Path) -> io::Result<(tokio::net::UnixListener, BoundSocket)> {
    let dir = path.parent().filter(|d| !d.as_os_str().is_empty()).unwrap_or(Path::new("/"));
    std::fs::create_dir_all(dir)?;
    let dir_fd = std::fs::File::open(dir)?;
    rustix::fs::flock(&dir_fd, rustix::fs::FlockOperation::LockExclusive)?;
    match std::fs::symlink_metadata(path) {
        Ok(m) if m.file_type().is_socket() => {
            if std::os::unix::net::UnixStream::connect(path).is_ok() {
                return Err(io::Error::new(io::ErrorKind::AddrInUse, "address in use by a running server"));
            }
            tracing::info!(endpoint = %path.display(), "removing a stale socket");
            std::fs::remove_file(path)?;
        }
        Ok(_) => return Err(io::Error::new(io::ErrorKind::AlreadyExists, "the path exists and is not a socket")),
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => return Err(e),
    }
    let listener = tokio::net::UnixListener::bind(path)?;
    use rustix::fs::OFlags;
    let inode = rustix::fs::open(path, OFlags::PATH | OFlags::NOFOLLOW | OFlags::CLOEXEC, rustix::fs::Mode::empty())?;
    let bound = BoundSocket { path: path.to_path_buf(), inode };
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o660))?;
    drop(dir_fd);
    Ok((listener, bound))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoints() {
        assert_eq!(parse_endpoint("unix:///run/csi.sock").unwrap(), Path::new("/run/csi.sock"));
        assert_eq!(parse_endpoint("unix:/run/csi.sock").unwrap(), Path::new("/run/csi.sock"));
        assert_eq!(parse_endpoint("/run/csi.sock").unwrap(), Path::new("/run/csi.sock"));
        assert!(parse_endpoint("tcp://127.0.0.1:1").is_err());
        assert!(parse_endpoint("unix://relative").is_err());
    }

    #[tokio::test]
    async fn only_the_socket_this_process_bound_is_removed() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("csi.sock");
        let (listener, bound) = bind(&path).unwrap();
        // A live socket is refused, and the refusal touches nothing.
        assert_eq!(bind(&path).unwrap_err().kind(), io::ErrorKind::AddrInUse);
        assert!(bound.is_ours());
        drop(listener);
        // Someone else's socket now at the path (bound over the stale one).
        let (other_listener, other) = bind(&path).unwrap();
        drop(bound);
        assert!(path.exists(), "another process's socket was removed");
        drop(other_listener);
        drop(other);
        assert!(!path.exists());
        // A regular file is never replaced nor removed.
        std::fs::write(&path, b"not a socket").unwrap();
        assert_eq!(bind(&path).unwrap_err().kind(), io::ErrorKind::AlreadyExists);
        assert_eq!(std::fs::read(&path).unwrap(), b"not a socket");
    }
}
