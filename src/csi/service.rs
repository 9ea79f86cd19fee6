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
use super::{Driver, Error, Result};

pub struct IdentityService(pub Arc<Driver>);
pub struct ControllerService(pub Arc<Driver>);
pub struct NodeService(pub Arc<Driver>);

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

/// Counts a call as running until dropped (also when its future is).
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

async fn call<Q, T>(
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
    let volume = request.subject().to_string();
    let start = Instant::now();
    let outcome = match tokio::task::spawn_blocking(move || f(request)).await {
        Ok(r) => r,
        Err(e) if e.is_panic() => Err(Error::Internal(format!("{rpc} failed unexpectedly: {}", panic_text(e.into_panic())))),
        Err(e) => Err(Error::Internal(format!("{rpc} was cancelled: {e}"))),
    };
    let micros = start.elapsed().as_micros() as u64;
    match &outcome {
        Ok(_) if kind == Kind::Change => tracing::info!(request = id, rpc, volume, micros, "ok"),
        Ok(_) => tracing::debug!(request = id, rpc, volume, micros, "ok"),
        Err(e) => tracing::warn!(request = id, rpc, volume, micros, code = ?e.code(), error = %e, "failed"),
    }
    outcome.map(Response::new).map_err(Status::from)
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
                    let _running = InFlight::new(&self.0);
                    let $d = self.0.clone();
                    call($name, Kind::$kind, request, move |$r: $req| {
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
    get_plugin_info, "GetPluginInfo", Query, GetPluginInfoRequest => GetPluginInfoResponse, |d, r| Ok(d.plugin_info());
    get_plugin_capabilities, "GetPluginCapabilities", Query, GetPluginCapabilitiesRequest => GetPluginCapabilitiesResponse,
        |d, r| Ok(d.plugin_capabilities());
    probe, "Probe", Query, ProbeRequest => ProbeResponse, |d, r| Ok(d.probe());
});

service!(ControllerService: Controller {
    create_volume, "CreateVolume", Change, CreateVolumeRequest => CreateVolumeResponse, |d, r| d.create_volume(r);
    delete_volume, "DeleteVolume", Change, DeleteVolumeRequest => DeleteVolumeResponse, |d, r| d.delete_volume(r);
    controller_expand_volume, "ControllerExpandVolume", Change, ControllerExpandVolumeRequest => ControllerExpandVolumeResponse,
        |d, r| d.controller_expand(r);
    validate_volume_capabilities, "ValidateVolumeCapabilities", Query,
        ValidateVolumeCapabilitiesRequest => ValidateVolumeCapabilitiesResponse, |d, r| d.validate_capabilities(r);
    list_volumes, "ListVolumes", Query, ListVolumesRequest => ListVolumesResponse, |d, r| d.list_volumes(r);
    get_capacity, "GetCapacity", Query, GetCapacityRequest => GetCapacityResponse, |d, r| d.get_capacity(r);
    controller_get_capabilities, "ControllerGetCapabilities", Query,
        ControllerGetCapabilitiesRequest => ControllerGetCapabilitiesResponse, |d, r| Ok(d.controller_capabilities());
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
    node_stage_volume, "NodeStageVolume", Change, NodeStageVolumeRequest => NodeStageVolumeResponse, |d, r| d.node_stage(r);
    node_unstage_volume, "NodeUnstageVolume", Change, NodeUnstageVolumeRequest => NodeUnstageVolumeResponse, |d, r| d.node_unstage(r);
    node_publish_volume, "NodePublishVolume", Change, NodePublishVolumeRequest => NodePublishVolumeResponse, |d, r| d.node_publish(r);
    node_unpublish_volume, "NodeUnpublishVolume", Change, NodeUnpublishVolumeRequest => NodeUnpublishVolumeResponse,
        |d, r| d.node_unpublish(r);
    node_get_volume_stats, "NodeGetVolumeStats", Query, NodeGetVolumeStatsRequest => NodeGetVolumeStatsResponse, |d, r| d.node_stats(r);
    node_expand_volume, "NodeExpandVolume", Change, NodeExpandVolumeRequest => NodeExpandVolumeResponse, |d, r| d.node_expand(r);
    node_get_capabilities, "NodeGetCapabilities", Query, NodeGetCapabilitiesRequest => NodeGetCapabilitiesResponse,
        |d, r| Ok(d.node_capabilities());
    node_get_info, "NodeGetInfo", Query, NodeGetInfoRequest => NodeGetInfoResponse, |d, r| Ok(d.node_info());
});

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_panic_becomes_internal_and_the_next_call_works() {
        let r = call("Probe", Kind::Query, Request::new(ProbeRequest {}), |_r| -> Result<ProbeResponse> { panic!("handler bug") }).await;
        let s = r.expect_err("panicked");
        assert_eq!(s.code(), tonic::Code::Internal);
        assert!(s.message().contains("handler bug"), "{}", s.message());
        let ok = call("Probe", Kind::Query, Request::new(ProbeRequest {}), |_r| Ok(ProbeResponse { ready: Some(true) })).await;
        assert_eq!(ok.unwrap().into_inner().ready, Some(true));
    }

    #[tokio::test]
    async fn errors_keep_their_codes() {
        let r = call("NodeStageVolume", Kind::Change, Request::new(NodeStageVolumeRequest::default()), |_r| -> Result<()> {
            Err(Error::Aborted("v".into()))
        })
        .await;
        assert_eq!(r.unwrap_err().code(), tonic::Code::Aborted);
    }
}
