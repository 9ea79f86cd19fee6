//! The CSI side as agent components: the driver (its store, pool, the nbd
//! healer's start walk and what it serves: the local nbd volumes, the
//! export listener, the NFS server) and its gRPC server on the socket.

use std::sync::{Arc, RwLock};
use std::time::Duration;

use volring_csi::nbd_export::ExportListener;
use volring_csi::server::BoundSocket;
use volring_mounts::MountTable;

use super::component::{Components, OffRuntime, Server};
use super::TARGET;

/// Running calls are waited for this long at a stop.
const CALLS_WAIT: Duration = Duration::from_secs(30);
const SERVER_WAIT: Duration = Duration::from_secs(35);
/// Dropping the driver stops its NBD servers and the NFS server.
const DRIVER_WAIT: Duration = Duration::from_secs(30);

/// Opens the CSI driver (its store and pool) and runs the nbd healer's
/// start walk on it (see `run`); the reconciler's start, which would run
/// the walk otherwise, finds it done. The driver is a component: its stop
/// lets go of the agent's reference on the blocking pool (the last one,
/// once the components that hold it stopped), which stops what it serves.
pub(super) async fn heal_first(
    c: volring_csi::CsiConfig,
    table: Arc<RwLock<MountTable>>,
    ready: volring_csi::Readiness,
    parts: &mut Components,
) -> anyhow::Result<Arc<volring_csi::Driver>> {
    let driver = volring_csi::Driver::new(c, table, ready)?;
    let kept = driver.clone();
    parts.started_blocking("CSI driver", DRIVER_WAIT, move || {
        tracing::debug!(target: TARGET, references = Arc::strong_count(&kept), "letting go of the CSI driver");
        drop(kept);
        Ok(())
    });
    let d = driver.clone();
    let walked = tokio::task::spawn_blocking(move || d.heal_nbd()).await?;
    if !walked.is_empty() {
        tracing::info!(target: TARGET, volumes = walked.len(), "nbd start walk done");
    }
    Ok(driver)
}

/// Serves the exported volumes on the export listener, if any, then the
/// CSI services on the bound socket; returns the socket's URL.
pub(super) async fn serve(
    driver: &Arc<volring_csi::Driver>,
    (listener, socket): (tokio::net::UnixListener, BoundSocket),
    exports: Option<OffRuntime<ExportListener>>,
    parts: &mut Components,
) -> anyhow::Result<String> {
    if let Some(l) = exports {
        // Off the runtime: it opens every exported image, and a listener
        // it refuses is dropped there (its rings are joined).
        let d = driver.clone();
        tokio::task::spawn_blocking(move || d.serve_exports(l.into_inner())).await??;
    }
    // The socket was bound at the driver's endpoint (`start.rs`).
    let url = format!("unix://{}", driver.config().endpoint.display());
    let d = driver.clone();
    let server = parts.serve("CSI", move |stop| volring_csi::server::serve(d, listener, stop));
    let d = driver.clone();
    parts.started("CSI server", SERVER_WAIT, move || stop(d, server, socket));
    Ok(url)
}

/// Stops accepting CSI calls, lets the running ones finish (kubelet keeps
/// its connection open forever, so idle connections are not waited for),
/// then drops the server and removes the socket if it is still this
/// agent's. A call counts as running until its blocking work returns, also
/// when kubelet gave up on it.
async fn stop(driver: Arc<volring_csi::Driver>, server: Server, socket: BoundSocket) -> anyhow::Result<()> {
    let task = server.stop().await;
    let deadline = tokio::time::Instant::now() + CALLS_WAIT;
    if driver.in_flight() > 0 {
        tracing::info!(target: TARGET, calls = driver.in_flight(), "waiting for running CSI calls");
    }
    while driver.in_flight() > 0 && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    if driver.in_flight() > 0 {
        tracing::warn!(
            target: TARGET,
            calls = driver.in_flight(),
            "CSI calls still running after 30 s; stopping anyway (their records let a restart finish them)"
        );
    }
    if let Some(task) = task {
        task.abort();
        let _ = task.await;
    }
    drop(socket);
    Ok(())
}
