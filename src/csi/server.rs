//! Serving the three CSI services on a unix socket.

use std::future::Future;
use std::io;
use std::os::unix::fs::{FileTypeExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use super::proto::controller_server::ControllerServer;
use super::proto::identity_server::IdentityServer;
use super::proto::node_server::NodeServer;
use super::service::{ControllerService, IdentityService, NodeService};
use super::Driver;

/// `unix:///run/csi/csi.sock`, `unix:/run/csi/csi.sock` or a bare absolute
/// path, to the socket path.
pub fn parse_endpoint(s: &str) -> Result<PathBuf, String> {
    let path = s.strip_prefix("unix://").or_else(|| s.strip_prefix("unix:")).unwrap_or(s);
    if !path.starts_with('/') {
        return Err(format!("CSI endpoint {s:?}: expected unix:///absolute/path"));
    }
    Ok(PathBuf::from(path))
}

/// Serves until `shutdown` completes, then removes the socket.
pub async fn serve(driver: Arc<Driver>, shutdown: impl Future<Output = ()>) -> io::Result<()> {
    let path = driver.config().endpoint.clone();
    let listener = bind(&path)?;
    tracing::info!(endpoint = %path.display(), "serving CSI");
    let incoming = tokio_stream::wrappers::UnixListenerStream::new(listener);
    let result = tonic::transport::Server::builder()
        .add_service(IdentityServer::new(IdentityService(driver.clone())))
        .add_service(ControllerServer::new(ControllerService(driver.clone())))
        .add_service(NodeServer::new(NodeService(driver)))
        .serve_with_incoming_shutdown(incoming, shutdown)
        .await
        .map_err(io::Error::other);
    let _ = std::fs::remove_file(&path);
    result
}

/// Binds the socket with mode 0660. A stale socket (one nobody answers on,
/// left by a crash) is removed; a live one, or any other kind of file, is
/// an error: two agents must not share a socket path.
fn bind(path: &Path) -> io::Result<tokio::net::UnixListener> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    match std::fs::symlink_metadata(path) {
        Ok(m) if m.file_type().is_socket() => {
            if std::os::unix::net::UnixStream::connect(path).is_ok() {
                return Err(io::Error::new(io::ErrorKind::AddrInUse, format!("{} is in use by a running server", path.display())));
            }
            tracing::info!(endpoint = %path.display(), "removing a stale socket");
            std::fs::remove_file(path)?;
        }
        Ok(_) => return Err(io::Error::new(io::ErrorKind::AlreadyExists, format!("{} exists and is not a socket", path.display()))),
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => return Err(e),
    }
    let listener = tokio::net::UnixListener::bind(path)?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o660))?;
    Ok(listener)
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
}
