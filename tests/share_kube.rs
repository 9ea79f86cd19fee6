//! The shared-volume controller (crates/share/src/kube.rs) against the API
//! stand-in (tests/kube_support/, core/v1 and discovery/v1 in core.rs): the
//! Service and EndpointSlice life cycle per shared volume, the endpoint
//! published once, failover updating only the slice, the owner reference
//! that lets the garbage collector remove both with the PVC, core/v1
//! Endpoints never touched, and the duration histogram.

mod kube_support;

use std::cell::RefCell;
use std::time::Duration;

use axum::http::Method;
use kube_support::Server;
use serde_json::json;
use volring_share::kube::{ControllerConfig, Error, ShareController, SharedVolume};

fn vol(ip: &str) -> SharedVolume {
    SharedVolume {
        volume_id: "pvc-0001".into(),
        pvc_namespace: "apps".into(),
        pvc_name: "data".into(),
        server: ip.parse().unwrap(),
        server_port: 20490,
    }
}

async fn controller(server: &Server, poll_ms: u64) -> ShareController {
    let mut config = server.config();
    volring_share::kube::identify(&mut config, "n1");
    let client = kube::Client::try_from(config).expect("client");
    ShareController::new(client, ControllerConfig { poll: Duration::from_millis(poll_ms), total_wait: Duration::from_secs(5) })
}

fn pvc() -> serde_json::Value {
    json!({"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": "data"}, "spec": {"accessModes": ["ReadWriteMany"]}})
}

const SLICE: &str = "/apis/discovery.k8s.io/v1/namespaces/apps/endpointslices/data";

/// (method, path) of the stand-in's log for core and discovery objects, in
/// order.
fn core_calls(server: &Server) -> Vec<(Method, String)> {
    server
        .api
        .log()
        .into_iter()
        .filter(|l| l.path.starts_with("/api/v1/") || l.path.starts_with("/apis/discovery.k8s.io/"))
        .map(|l| (l.method, l.path))
        .collect()
}

fn writes(server: &Server) -> Vec<(Method, String)> {
    core_calls(server).into_iter().filter(|(m, _)| *m != Method::GET).collect()
}

#[tokio::test]
async fn service_and_endpoints_life_cycle() {
    let server = Server::start().await;
    let pvc = server.api.seed_core("apps", "persistentvolumeclaims", pvc());
    // Created objects stay invisible to the next 2 GETs: the controller
    // must re-read until they show.
    server.api.set_create_lag(2);
    let c = controller(&server, 20).await;
    let published = RefCell::new(Vec::new());
    let out = c.reconcile(&vol("192.0.2.10"), |e| published.borrow_mut().push(e.to_string())).await.expect("reconcile");
    assert!(out.service_created && out.endpoints_created && !out.service_updated && !out.endpoints_updated, "{out:?}");
    let svc = server.api.core_object("apps", "services", "data").expect("service");
    let ip = svc["spec"]["clusterIP"].as_str().unwrap().to_string();
    assert_eq!(published.borrow().as_slice(), [format!("{ip}:2049")], "published once, the ClusterIP");
    // Published where other nodes read it: the PVC's annotation.
    let annotated = server.api.core_object("apps", "persistentvolumeclaims", "data").expect("pvc");
    assert_eq!(annotated["metadata"]["annotations"]["volring.io/nfs-endpoint"], format!("{ip}:2049").as_str());
    assert_eq!(annotated["spec"]["accessModes"][0], "ReadWriteMany", "the merge patch keeps the rest of the PVC");
    let patches: Vec<_> = writes(&server).into_iter().filter(|(m, _)| *m == Method::PATCH).collect();
    assert_eq!(patches, [(Method::PATCH, "/api/v1/namespaces/apps/persistentvolumeclaims/data".to_string())]);
    assert_eq!(svc["spec"]["ports"][0]["port"], 2049);
    assert_eq!(svc["spec"]["ports"][0]["targetPort"], 20490);
    assert!(svc["spec"]["selector"].is_null(), "no selector: volring writes the EndpointSlice");
    let ep = server.api.core_object("apps", "endpointslices", "data").expect("endpointslice");
    assert_eq!((ep["addressType"].as_str(), ep["endpoints"][0]["addresses"][0].as_str()), (Some("IPv4"), Some("192.0.2.10")));
    assert_eq!(ep["endpoints"][0]["conditions"]["ready"], true);
    assert_eq!(ep["ports"][0]["port"], 20490);
    assert_eq!(ep["metadata"]["labels"]["kubernetes.io/service-name"], "data");
    assert_eq!(ep["metadata"]["labels"]["endpointslice.kubernetes.io/managed-by"], "volring.io");
    assert!(server.api.core_object("apps", "endpoints", "data").is_none(), "no core/v1 Endpoints");
    for o in [&svc, &ep] {
        let owner = &o["metadata"]["ownerReferences"][0];
        assert_eq!((owner["kind"].as_str(), owner["name"].as_str()), (Some("PersistentVolumeClaim"), Some("data")));
        assert_eq!(owner["uid"], pvc["metadata"]["uid"]);
        assert_eq!(o["metadata"]["labels"]["volring.io/volume"], "pvc-0001");
    }
    // Every request names volring and its node (issue 29).
    let ua = format!("volring/{} (n1)", env!("CARGO_PKG_VERSION"));
    assert!(server.api.log().iter().filter(|l| l.path.starts_with("/api")).all(|l| l.user_agent.as_deref() == Some(ua.as_str())));
    // The re-read after each create: GETs until visible (2 hidden + 1).
    let calls = core_calls(&server);
    let created = calls.iter().position(|(m, p)| *m == Method::POST && p.ends_with("/services")).expect("service POST");
    let svc_gets_after_create = calls[created + 1..].iter().take_while(|(m, p)| *m == Method::GET && p.ends_with("/services/data")).count();
    assert!(svc_gets_after_create >= 3, "the Service re-read until visible: {calls:?}");

    // Nothing changed: reads only, nothing written, nothing republished.
    server.api.clear_log();
    let out = c.reconcile(&vol("192.0.2.10"), |e| published.borrow_mut().push(e.to_string())).await.expect("again");
    assert_eq!(out, Default::default());
    assert!(writes(&server).is_empty(), "{:?}", writes(&server));
    assert_eq!(published.borrow().len(), 1);
    // A restarted agent (a new controller) reads the annotation: nothing
    // is published again, nothing written.
    let fresh = controller(&server, 20).await;
    let out = fresh.reconcile(&vol("192.0.2.10"), |e| published.borrow_mut().push(e.to_string())).await.expect("restarted");
    assert_eq!(out, Default::default());
    assert!(writes(&server).is_empty(), "{:?}", writes(&server));
    assert_eq!(published.borrow().len(), 1);

    // Failover: the server moved; only the slice is updated, the
    // Service keeps its ClusterIP and the endpoint is not republished.
    server.api.clear_log();
    let out = c.reconcile(&vol("192.0.2.20"), |e| published.borrow_mut().push(e.to_string())).await.expect("failover");
    assert!(out.endpoints_updated && !out.service_updated && !out.service_created && out.published.is_none(), "{out:?}");
    assert_eq!(writes(&server), [(Method::PUT, SLICE.to_string())]);
    assert_eq!(server.api.core_object("apps", "endpointslices", "data").unwrap()["endpoints"][0]["addresses"][0], "192.0.2.20");
    assert_eq!(server.api.core_object("apps", "services", "data").unwrap()["spec"]["clusterIP"], ip.as_str());
    assert_eq!(published.borrow().len(), 1);

    // Someone changed the Service's port: the controller puts it back,
    // keeping the ClusterIP (an update that changed it would be refused).
    let mut svc = server.api.core_object("apps", "services", "data").unwrap();
    svc["spec"]["ports"][0]["targetPort"] = json!(1111);
    let client = kube::Client::try_from(server.config()).unwrap();
    let api: kube::Api<k8s_openapi::api::core::v1::Service> = kube::Api::namespaced(client, "apps");
    api.replace("data", &Default::default(), &serde_json::from_value(svc).unwrap()).await.expect("tamper");
    server.api.clear_log();
    let out = c.reconcile(&vol("192.0.2.20"), |e| published.borrow_mut().push(e.to_string())).await.expect("repair");
    assert!(out.service_updated && !out.endpoints_updated, "{out:?}");
    let svc = server.api.core_object("apps", "services", "data").unwrap();
    assert_eq!((svc["spec"]["ports"][0]["targetPort"].as_i64(), svc["spec"]["clusterIP"].as_str()), (Some(20490), Some(ip.as_str())));
    assert_eq!(published.borrow().len(), 1, "same ClusterIP: not republished");

    // The histogram saw every reconcile.
    let mut registry = prometheus_client::registry::Registry::default();
    c.register(&mut registry);
    let mut text = String::new();
    prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
    assert!(text.contains("volring_share_reconcile_duration_seconds_count 4"), "{text}");

    // Deleting the PVC: the garbage collector removes both through the
    // owner reference; the controller deletes nothing itself.
    assert!(!core_calls(&server).iter().any(|(m, _)| *m == Method::DELETE));
    let client = kube::Client::try_from(server.config()).unwrap();
    let pvcs: kube::Api<k8s_openapi::api::core::v1::PersistentVolumeClaim> = kube::Api::namespaced(client, "apps");
    pvcs.delete("data", &Default::default()).await.expect("delete pvc");
    assert!(server.api.core_object("apps", "services", "data").is_none());
    assert!(server.api.core_object("apps", "endpointslices", "data").is_none());
    // Without its PVC, a reconcile creates nothing.
    let gone = c.reconcile(&vol("192.0.2.20"), |_| panic!("published without a PVC")).await;
    assert!(matches!(gone, Err(Error::PvcGone { .. })), "{gone:?}");
    assert!(server.api.core_object("apps", "services", "data").is_none());
}

#[tokio::test]
async fn an_object_that_never_shows_fails_the_reconcile_unpublished() {
    let server = Server::start().await;
    server.api.seed_core("apps", "persistentvolumeclaims", pvc());
    server.api.set_create_lag(1000);
    let c = controller(&server, 10).await;
    let mut called = false;
    let r = c.reconcile(&vol("192.0.2.10"), |_| called = true).await;
    assert!(matches!(r, Err(Error::NotVisible(..))), "{r:?}");
    assert!(!called, "nothing published before the objects are there");
}

/// Issue 29: the API server refuses an endpoint on a loopback (or
/// link-local, or unspecified) address — "may not be in the loopback
/// range" — and so does the stand-in: a server advertised there fails the
/// reconcile, nothing is published.
#[tokio::test]
async fn an_endpoint_on_a_loopback_address_is_refused() {
    for (ip, why) in [("127.0.0.1", "loopback"), ("169.254.10.1", "link-local"), ("::1", "loopback"), ("0.0.0.0", "unspecified")] {
        let server = Server::start().await;
        server.api.seed_core("apps", "persistentvolumeclaims", pvc());
        let c = controller(&server, 10).await;
        let r = c.reconcile(&vol(ip), |_| panic!("published")).await;
        match &r {
            Err(Error::Api { source: kube::Error::Api(e), .. }) => {
                assert_eq!(e.code, 422, "{ip}: {e:?}");
                assert!(e.message.contains(why) && e.message.contains("endpoints[0].addresses[0]"), "{ip}: {}", e.message);
            }
            other => panic!("{ip}: {other:?}"),
        }
        assert!(server.api.core_object("apps", "endpointslices", "data").is_none(), "{ip}");
    }
}

/// Least privilege (issue 29): core/v1 Endpoints are neither read nor
/// written — the agent's role has no access to them — even when an earlier
/// version's are there (the operator deletes those once). A withdrawal
/// empties volring's slice and leaves the Service.
#[tokio::test]
async fn old_endpoints_are_left_alone_and_a_withdrawal_empties_the_slice() {
    let server = Server::start().await;
    let pvc = server.api.seed_core("apps", "persistentvolumeclaims", pvc());
    let owner = json!([{"apiVersion": "v1", "kind": "PersistentVolumeClaim", "name": "data", "uid": pvc["metadata"]["uid"]}]);
    server.api.seed_core(
        "apps",
        "endpoints",
        json!({"apiVersion": "v1", "kind": "Endpoints",
            "metadata": {"name": "data", "labels": {"volring.io/volume": "pvc-0001"}, "ownerReferences": owner},
            "subsets": [{"addresses": [{"ip": "192.0.2.99"}], "ports": [{"name": "nfs", "port": 20490, "protocol": "TCP"}]}]}),
    );
    let c = controller(&server, 10).await;
    let out = c.reconcile(&vol("192.0.2.10"), |_| {}).await.expect("reconcile");
    assert!(out.endpoints_created, "{out:?}");
    let touched: Vec<_> = core_calls(&server).into_iter().filter(|(_, p)| p.contains("/endpoints/") || p.ends_with("/endpoints")).collect();
    assert!(touched.is_empty(), "core/v1 Endpoints requested: {touched:?}");
    let out = c.reconcile(&vol("192.0.2.10"), |_| {}).await.expect("again");
    assert_eq!(out, Default::default(), "nothing to write the second time");

    assert!(c.withdraw(&vol("192.0.2.10")).await.expect("withdraw"));
    let slice = server.api.core_object("apps", "endpointslices", "data").unwrap();
    assert_eq!(slice["endpoints"], json!([]), "{slice}");
    assert!(server.api.core_object("apps", "services", "data").is_some());
    assert!(!c.withdraw(&vol("192.0.2.10")).await.expect("again"), "nothing left to take out");
}
