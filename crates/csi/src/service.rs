//! The tonic service traits, each method a one-line hand-off to `Driver`.
//!
//! Every call goes through [`call`]: it gets a request id, runs on the
//! blocking pool (the work is syscalls and helper programs), turns a panic
//! into `Internal` instead of a dead connection, logs the outcome with its
//! latency, and maps the error to its gRPC code. This is the one place where
//! errors become gRPC statuses.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use tonic::{Request, Response, Status};

use super::proto::controller_server::Controller;
use super::proto::identity_server::Identity;
use super::proto::node_server::Node;
use super::proto::*;
use super::rpc_stats::RpcStats;
use super::{Driver, Error, Result};

pub(crate) struct IdentityService(pub Arc<Driver>);
pub(crate) struct ControllerService(pub Arc<Driver>);
pub(crate) struct NodeService(pub Arc<Driver>);

static NEXT_REQUEST: AtomicU64 = AtomicU64::new(1);

/// Whether a call changes the machine (logged at info) or only reads (debug:
/// kubelet polls stats for every volume every minute).
#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    Change,
    Query,
}

/// The volume a request is about, for the log line.
trait Subject {
    fn subject(&self) -> &str {
        ""
    }
}

macro_rules! subject_by {
    ($field:ident: $($t:ty),*) => { $(impl Subject for $t { fn subject(&self) -> &str { &self.$field } })* };
}
subject_by!(volume_id: DeleteVolumeRequest, ControllerExpandVolumeRequest, ValidateVolumeCapabilitiesRequest, NodeStageVolumeRequest,
    NodeUnstageVolumeRequest, NodePublishVolumeRequest, NodeUnpublishVolumeRequest, NodeGetVolumeStatsRequest, NodeExpandVolumeRequest,
    ControllerPublishVolumeRequest, ControllerUnpublishVolumeRequest, ControllerGetVolumeRequest, ControllerModifyVolumeRequest);
subject_by!(name: CreateVolumeRequest);
impl Subject for GetPluginInfoRequest {}
impl Subject for GetPluginCapabilitiesRequest {}
impl Subject for ProbeRequest {}
impl Subject for ListVolumesRequest {}
impl Subject for GetCapacityRequest {}
impl Subject for ControllerGetCapabilitiesRequest {}
impl Subject for CreateSnapshotRequest {}
impl Subject for DeleteSnapshotRequest {}
impl Subject for ListSnapshotsRequest {}
impl Subject for NodeGetCapabilitiesRequest {}
impl Subject for NodeGetInfoRequest {}

/// Counts a call as running until dropped. It is moved into the blocking
/// work, not held by the async wrapper: kubelet's deadline drops the
/// wrapper, but the work it started runs on, and a stopping agent must wait
/// for that work, not for the wrapper.
struct InFlight(Arc<Driver>);

impl InFlight {
    fn new(d: &Arc<Driver>) -> Self {
        d.in_flight.fetch_add(1, Ordering::AcqRel);
        Self(d.clone())
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Ordering::AcqRel);
    }
}

/// The longest status message sent back: gRPC carries it in a header
/// (grpc-message), and clients drop replies whose headers are too large.
const MAX_MESSAGE: usize = 1024;
/// The longest volume id or name written to a log line.
const MAX_LOGGED_SUBJECT: usize = 256;

/// `s` cut to at most `max` bytes on a char boundary; a cut text says so
/// and how long it was.
fn bounded(s: &str, max: usize) -> std::borrow::Cow<'_, str> {
    if s.len() <= max {
        return s.into();
    }
    let note = format!("... (cut; {} bytes in all)", s.len());
    let mut end = max.saturating_sub(note.len());
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}{note}", &s[..end]).into()
}

/// The status for an error: its code, and its message bounded.
fn status(e: &Error) -> Status {
    Status::new(e.code(), bounded(&e.to_string(), MAX_MESSAGE).into_owned())
}

/// Runs `f` on the blocking pool with `running` held until it returns (also
/// when the caller has given up), logs and counts the outcome from there,
/// and maps the error to its status.
async fn call<Q, T>(
    running: impl Send + 'static,
    stats: Arc<RpcStats>,
    rpc: &'static str,
    kind: Kind,
    request: Request<Q>,
    f: impl FnOnce(Q) -> Result<T> + Send + 'static,
) -> std::result::Result<Response<T>, Status>
where
    Q: Subject + Send + 'static,
    T: Send + 'static,
{
    let id = NEXT_REQUEST.fetch_add(1, Ordering::Relaxed);
    let request = request.into_inner();
    let work = move || {
        let _running = running;
        let volume = bounded(request.subject(), MAX_LOGGED_SUBJECT).into_owned();
        let start = Instant::now();
        let outcome = match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(request))) {
            Ok(r) => r,
            Err(p) => Err(Error::Internal(format!("{rpc} failed unexpectedly: {}", panic_text(p)))),
        };
        let micros = start.elapsed().as_micros() as u64;
        let code = outcome.as_ref().map_or_else(|e| e.code(), |_| tonic::Code::Ok);
        stats.record(rpc, code, micros);
        match &outcome {
            Ok(_) if kind == Kind::Change => tracing::info!(request = id, rpc, volume, micros, "ok"),
            Ok(_) => tracing::debug!(request = id, rpc, volume, micros, "ok"),
            Err(e) => {
                let error = bounded(&e.to_string(), MAX_MESSAGE).into_owned();
                tracing::warn!(request = id, rpc, volume, micros, code = ?e.code(), error, "failed")
            }
        }
        outcome
    };
    let outcome = match tokio::task::spawn_blocking(work).await {
        Ok(r) => r,
        Err(e) => Err(Error::Internal(format!("{rpc} was cancelled: {e}"))),
    };
    outcome.map(Response::new).map_err(|e| status(&e))
}

fn panic_text(p: Box<dyn std::any::Any + Send>) -> String {
    p.downcast_ref::<&str>().map(|s| s.to_string()).or_else(|| p.downcast_ref::<String>().cloned()).unwrap_or_else(|| "a panic".into())
}

/// Implements a service trait: each method hands its request to `Driver`
/// through [`call`]. (One macro for the whole impl, because `async_trait`
/// must see the methods expanded.)
macro_rules! service {
    ($svc:ty: $tr:path { $($method:ident, $name:literal, $kind:ident, $req:ty => $resp:ty, |$d:ident, $r:ident| $body:expr;)* }) => {
        #[tonic::async_trait]
        impl $tr for $svc {
            $(
                async fn $method(&self, request: Request<$req>) -> std::result::Result<Response<$resp>, Status> {
                    let $d = self.0.clone();
                    call(InFlight::new(&self.0), self.0.rpc_stats.clone(), $name, Kind::$kind, request, move |$r: $req| {
                        let _ = (&$d, &$r);
                        $body
                    })
                    .await
                }
            )*
        }
    };
}

service!(IdentityService: Identity {
    get_plugin_info, "GetPluginInfo", Query, GetPluginInfoRequest => GetPluginInfoResponse, |d, r| Ok(d.identity.plugin_info());
    get_plugin_capabilities, "GetPluginCapabilities", Query, GetPluginCapabilitiesRequest => GetPluginCapabilitiesResponse,
        |d, r| Ok(d.identity.plugin_capabilities());
    probe, "Probe", Query, ProbeRequest => ProbeResponse, |d, r| Ok(d.identity.probe());
});

service!(ControllerService: Controller {
    create_volume, "CreateVolume", Change, CreateVolumeRequest => CreateVolumeResponse, |d, r| d.controller.create_volume(r);
    delete_volume, "DeleteVolume", Change, DeleteVolumeRequest => DeleteVolumeResponse, |d, r| d.controller.delete_volume(r);
    controller_expand_volume, "ControllerExpandVolume", Change, ControllerExpandVolumeRequest => ControllerExpandVolumeResponse,
        |d, r| d.controller.controller_expand(r);
    validate_volume_capabilities, "ValidateVolumeCapabilities", Query,
        ValidateVolumeCapabilitiesRequest => ValidateVolumeCapabilitiesResponse, |d, r| d.controller.validate_capabilities(r);
    list_volumes, "ListVolumes", Query, ListVolumesRequest => ListVolumesResponse, |d, r| d.controller.list_volumes(r);
    get_capacity, "GetCapacity", Query, GetCapacityRequest => GetCapacityResponse, |d, r| d.controller.get_capacity(r);
    controller_get_capabilities, "ControllerGetCapabilities", Query,
        ControllerGetCapabilitiesRequest => ControllerGetCapabilitiesResponse, |d, r| Ok(d.identity.controller_capabilities());
    controller_publish_volume, "ControllerPublishVolume", Query, ControllerPublishVolumeRequest => ControllerPublishVolumeResponse,
        |d, r| Err(Error::Unimplemented("ControllerPublishVolume"));
    controller_unpublish_volume, "ControllerUnpublishVolume", Query, ControllerUnpublishVolumeRequest => ControllerUnpublishVolumeResponse,
        |d, r| Err(Error::Unimplemented("ControllerUnpublishVolume"));
    create_snapshot, "CreateSnapshot", Query, CreateSnapshotRequest => CreateSnapshotResponse, |d, r| Err(Error::Unimplemented("CreateSnapshot"));
    delete_snapshot, "DeleteSnapshot", Query, DeleteSnapshotRequest => DeleteSnapshotResponse, |d, r| Err(Error::Unimplemented("DeleteSnapshot"));
    list_snapshots, "ListSnapshots", Query, ListSnapshotsRequest => ListSnapshotsResponse, |d, r| Err(Error::Unimplemented("ListSnapshots"));
    controller_get_volume, "ControllerGetVolume", Query, ControllerGetVolumeRequest => ControllerGetVolumeResponse,
        |d, r| Err(Error::Unimplemented("ControllerGetVolume"));
    controller_modify_volume, "ControllerModifyVolume", Query, ControllerModifyVolumeRequest => ControllerModifyVolumeResponse,
        |d, r| Err(Error::Unimplemented("ControllerModifyVolume"));
});

service!(NodeService: Node {
    node_stage_volume, "NodeStageVolume", Change, NodeStageVolumeRequest => NodeStageVolumeResponse, |d, r| d.stager.node_stage(r);
    node_unstage_volume, "NodeUnstageVolume", Change, NodeUnstageVolumeRequest => NodeUnstageVolumeResponse, |d, r| d.stager.node_unstage(r);
    node_publish_volume, "NodePublishVolume", Change, NodePublishVolumeRequest => NodePublishVolumeResponse, |d, r| d.publisher.node_publish(r);
    node_unpublish_volume, "NodeUnpublishVolume", Change, NodeUnpublishVolumeRequest => NodeUnpublishVolumeResponse,
        |d, r| d.publisher.node_unpublish(r);
    node_get_volume_stats, "NodeGetVolumeStats", Query, NodeGetVolumeStatsRequest => NodeGetVolumeStatsResponse, |d, r| d.stats.node_stats(r);
    node_expand_volume, "NodeExpandVolume", Change, NodeExpandVolumeRequest => NodeExpandVolumeResponse, |d, r| d.stats.node_expand(r);
    node_get_capabilities, "NodeGetCapabilities", Query, NodeGetCapabilitiesRequest => NodeGetCapabilitiesResponse,
        |d, r| Ok(d.identity.node_capabilities());
    node_get_info, "NodeGetInfo", Query, NodeGetInfoRequest => NodeGetInfoResponse, |d, r| Ok(d.stats.node_info());
});

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_panic_becomes_internal_and_the_next_call_works() {
        let r = call((), Default::default(), "Probe", Kind::Query, Request::new(ProbeRequest {}), |_r| -> Result<ProbeResponse> {
            panic!("handler bug")
        })
        .await;
        let s = r.expect_err("panicked");
        assert_eq!(s.code(), tonic::Code::Internal);
        assert!(s.message().contains("handler bug"), "{}", s.message());
        let ok =
            call((), Default::default(), "Probe", Kind::Query, Request::new(ProbeRequest {}), |_r| Ok(ProbeResponse { ready: Some(true) }))
                .await;
        assert_eq!(ok.unwrap().into_inner().ready, Some(true));
    }

    #[tokio::test]
    async fn errors_keep_their_codes() {
        let r = call(
            (),
            Default::default(),
            "NodeStageVolume",
            Kind::Change,
            Request::new(NodeStageVolumeRequest::default()),
            |_r| -> Result<()> { Err(Error::Aborted("v".into())) },
        )
        .await;
        assert_eq!(r.unwrap_err().code(), tonic::Code::Aborted);
    }

    #[tokio::test]
    async fn messages_are_bounded_on_a_char_boundary() {
        let huge = "é".repeat(3 << 20);
        let r = call(
            (),
            Default::default(),
            "ListVolumes",
            Kind::Query,
            Request::new(ListVolumesRequest::default()),
            move |_r| -> Result<()> { Err(Error::Aborted(format!("starting_token {huge:?} is not one volring issued"))) },
        )
        .await;
        let s = r.unwrap_err();
        assert_eq!(s.code(), tonic::Code::Aborted);
        assert!(s.message().len() <= MAX_MESSAGE, "{} bytes", s.message().len());
        assert!(s.message().starts_with("starting_token \"éé"), "{}", s.message());
        assert!(s.message().ends_with(&format!("(cut; {} bytes in all)", 2 * (3 << 20) + 43)), "{}", s.message());
        assert_eq!(bounded("short", MAX_MESSAGE), "short");
    }

    #[tokio::test]
    async fn the_running_count_is_held_by_the_work_not_by_the_caller() {
        let (started_tx, started_rx) = std::sync::mpsc::channel();
        let (go_tx, go_rx) = std::sync::mpsc::channel::<()>();
        let held = Arc::new(());
        let caller = tokio::spawn(call(
            held.clone(),
            Default::default(),
            "NodeStageVolume",
            Kind::Change,
            Request::new(NodeStageVolumeRequest::default()),
            move |_r| {
                started_tx.send(()).unwrap();
                go_rx.recv().unwrap();
                Ok(())
            },
        ));
        tokio::task::spawn_blocking(move || started_rx.recv().unwrap()).await.unwrap();
        caller.abort();
        let _ = caller.await;
        assert_eq!(Arc::strong_count(&held), 2, "the work still runs, so it is still counted");
        go_tx.send(()).unwrap();
        for _ in 0..1000 {
            if Arc::strong_count(&held) == 1 {
                return;
            }
            tokio::time::sleep(std::time::Duration::from_millis(5)).await;
        }
        panic!("the count was not released when the work ended");
    }
}
