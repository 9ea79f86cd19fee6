//! Reading and the API's rules: paginated lists, this machine's devices
//! read back, VolumeAttachments, the User-Agent, and what
//! the stand-in refuses as the API server does.

use super::*;

/// The Kubernetes API's path of VolumeAttachments (the test's own).
const ATTACHMENTS: &str = "/apis/storage.k8s.io/v1/volumeattachments";

#[tokio::test]
async fn lists_are_paginated() {
    let server = Server::start().await;
    let sink = Arc::new(KubeSink::new(server.config()).unwrap());
    let objs: Vec<Object> = (0..1203).map(|i| bd("n1", i, 0)).collect();
    for o in &objs {
        let mut v = crate::kube_support::api_form(o);
        v["metadata"]["labels"]["volring.io/node"] = json!("n1");
        server.api.seed("blockdevices", v);
    }
    server.api.seed("blockdevices", crate::kube_support::api_form(&bd("n2", 0, 0)));
    let listed = volring_kube::Sink::list(&*sink, Kind::BlockDevice, "n1").await.unwrap();
    assert_eq!(listed.len(), 1203);
    let pages = server.api.log().iter().filter(|l| l.query.contains("limit=500")).count();
    assert_eq!(pages, 3);
}

/// This machine's real devices, as the agent builds them, published to the
/// stand-in: every device becomes one BlockDevice that reads back equal (so
/// a restart writes nothing), and the objects pass the stand-in's checks.
#[tokio::test]
async fn this_machines_devices_publish_and_read_back_equal() {
    let mountinfo = std::fs::read("/proc/self/mountinfo").unwrap();
    let (table, _) = volring_mounts::MountTable::from_mountinfo(&mountinfo);
    let cfg = volring_devices::ScanConfig { probe: false, node_name: "n1".into(), ..Default::default() };
    let inv = volring_devices::Inventory::scan(&cfg, &table).unwrap();
    let node = volring_kube::node_feed::storage_node("n1", &[], None, None, None, &Default::default());
    let mut c = config("n1");
    let (_, initial) = volring_kube::feed::Feed::initial(&inv, node, &mut c);
    let devices = initial.len() - 1;
    let server = Server::start().await;
    let sink = Arc::new(KubeSink::new(server.config()).unwrap());
    let s = Updater::start(sink.clone(), c.clone(), initial.clone()).shutdown(Duration::from_secs(10)).await;
    assert_eq!((s.writes_main, s.writes_status, s.refused), (initial.len() as u64, initial.len() as u64, 0));
    assert_eq!(server.api.objects("blockdevices").len(), devices);
    let s = Updater::start(sink, c, initial).shutdown(Duration::from_secs(10)).await;
    assert_eq!((s.writes_main, s.writes_status), (0, 0), "{s:?}");
}

/// The healer hook's listing: VolumeAttachments have no field selector on
/// their spec, so every page is LISTed (500 a page, no selector the real
/// server would refuse) and filtered here: this driver, this node, attached.
#[tokio::test]
async fn volume_attachments_are_listed_in_pages_and_filtered_to_this_node_and_driver() {
    use volring_kube::attachments;
    let server = Server::start().await;
    let mut want = Vec::new();
    for i in 0..1200 {
        let (attacher, node, attached) = match i % 4 {
            0 => ("volring.csi.io", "n1", true),
            1 => ("volring.csi.io", "n2", true),
            2 => ("other.csi.io", "n1", true),
            _ => ("volring.csi.io", "n1", false),
        };
        let pv = format!("pvc-{i:04}");
        if i % 4 == 0 {
            want.push(pv.clone());
        }
        server.api.seed(
            "volumeattachments",
            json!({"apiVersion": "storage.k8s.io/v1", "kind": "VolumeAttachment", "metadata": {"name": format!("csi-{i:04}")},
                "spec": {"attacher": attacher, "nodeName": node, "source": {"persistentVolumeName": pv}},
                "status": {"attached": attached}}),
        );
    }
    let sink = KubeSink::new(server.config()).unwrap();
    let got = attachments::attached_here(&sink, "volring.csi.io", "n1").await.unwrap();
    assert_eq!(got, want);
    let log = server.api.log();
    assert_eq!(log.len(), 3, "three pages of 500: {log:?}");
    assert!(log.iter().all(|l| l.path == ATTACHMENTS && l.status == 200 && l.query.contains("limit=500")), "{log:?}");
    assert!(log.iter().all(|l| !l.query.contains("fieldSelector")));
}

/// Issue 29: every request names volring, its version and its node in the
/// User-Agent (`volring/<version> (<node>)`): writes, LISTs, the re-read
/// after a conflict, the healer's VolumeAttachment listing.
#[tokio::test]
async fn every_request_names_volring_and_its_node() {
    let server = Server::start().await;
    // The form crates/share's unit test checks `user_agent` makes.
    let want = format!("volring/{} (n1)", env!("CARGO_PKG_VERSION"));
    let sink = Arc::new(KubeSink::connect("n1", Some(server.config())).await.unwrap());
    let o = bd("n1", 1, 1);
    server.api.inject(Fault { status: 409, retry_after: None, method: Some(Method::PATCH), path_contains: o.key.name.clone(), times: 1 });
    Updater::start(sink.clone(), config("n1"), vec![o, bd("n1", 2, 1)]).shutdown(Duration::from_secs(10)).await;
    volring_kube::attachments::attached_here(&sink, "volring.csi.io", "n1").await.unwrap();
    let log = server.api.log();
    assert!(log.iter().any(|l| l.method == Method::GET && l.path.ends_with(&bd("n1", 1, 1).key.name)), "the re-read: {log:#?}");
    assert!(log.iter().any(|l| l.path == ATTACHMENTS));
    for l in &log {
        assert_eq!(l.user_agent.as_deref(), Some(want.as_str()), "{} {}", l.method, l.path);
    }
    // Not told the node: the one the agent would publish for.
    server.api.clear_log();
    let sink = KubeSink::new(server.config()).unwrap();
    volring_kube::Sink::list(&sink, Kind::StorageNode, "n1").await.unwrap();
    let ua = format!("volring/{} ({})", env!("CARGO_PKG_VERSION"), volring_devices::node_name());
    assert_eq!(server.api.log()[0].user_agent.as_deref(), Some(ua.as_str()));
}

/// Sends `body` to the stand-in as a server-side apply (or any method), and
/// returns the status, the Warning headers and the reply.
async fn raw(server: &Server, method: Method, uri: &str, body: serde_json::Value) -> (u16, Vec<String>, serde_json::Value) {
    let client = kube::Client::try_from(server.config()).unwrap();
    let req = http::Request::builder()
        .method(method.as_str())
        .uri(uri)
        .header("content-type", "application/apply-patch+yaml")
        .body(kube::client::Body::from(serde_json::to_vec(&body).unwrap()))
        .unwrap();
    let resp = client.send(req).await.unwrap();
    let status = resp.status().as_u16();
    let warnings = resp.headers().get_all("warning").iter().map(|v| v.to_str().unwrap().to_string()).collect();
    let bytes = resp.into_body().collect_bytes().await.unwrap();
    (status, warnings, serde_json::from_slice(&bytes).unwrap_or_default())
}

/// The two server-side apply bodies of `o`, labels and spec, and the status
/// for the status subresource, made from the test's own API form
/// (`kube_support::api_form`), not the publisher's: the test below is about
/// what the stand-in refuses (the updater's tests send the publisher's).
fn apply_bodies(o: &Object) -> (serde_json::Value, serde_json::Value) {
    let mut main = crate::kube_support::api_form(o);
    let status = main.as_object_mut().unwrap().remove("status").unwrap_or_default();
    let status =
        json!({"apiVersion": main["apiVersion"], "kind": main["kind"], "metadata": {"name": main["metadata"]["name"]}, "status": status});
    (main, status)
}

/// Issue 29: the stand-in refuses what the API server refuses (and only
/// that): an unknown field under `fieldValidation=Strict` (400; dropped
/// with a Warning by default), an object its CRD's schema does not allow
/// (422), a label value of 64 characters (422). A status apply without
/// `status` is accepted, as by the API server: the status fields that
/// manager owned are dropped.
#[tokio::test]
async fn the_stand_in_refuses_what_the_api_server_refuses() {
    let server = Server::start().await;
    let o = bd("n1", 1, 1);
    let url = format!("/apis/volring.io/v1alpha1/blockdevices/{}?fieldManager=t", o.key.name);
    let status_url = format!("/apis/volring.io/v1alpha1/blockdevices/{}/status?fieldManager=t", o.key.name);
    let (main_body, status_body) = apply_bodies(&o);
    let mut body = main_body.clone();
    body["spec"]["colour"] = json!("blue");
    let (code, _, reply) = raw(&server, Method::PATCH, &format!("{url}&fieldValidation=Strict"), body.clone()).await;
    assert_eq!(code, 400, "{reply}");
    assert!(reply["message"].as_str().unwrap().contains("unknown field \"spec.colour\""), "{reply}");
    let (code, warnings, reply) = raw(&server, Method::PATCH, &url, body).await;
    assert_eq!((code, warnings), (201, vec!["299 - \"unknown field \\\"spec.colour\\\"\"".to_string()]), "{reply}");
    assert!(server.api.object("blockdevices", &o.key.name).unwrap()["spec"].get("colour").is_none(), "dropped");

    let mut bad = status_body.clone();
    bad["status"]["state"] = json!("Bogus");
    let (code, _, reply) = raw(&server, Method::PATCH, &status_url, bad).await;
    assert_eq!(code, 422, "{reply}");
    assert!(reply["message"].as_str().unwrap().contains("status.state: Unsupported value: \"Bogus\""), "{reply}");
    let mut bad = main_body.clone();
    bad["spec"]["capacity"]["storage"] = json!("a lot");
    let (code, _, reply) = raw(&server, Method::PATCH, &url, bad).await;
    assert_eq!(code, 422, "{reply}");
    assert!(reply["message"].as_str().unwrap().contains("spec.capacity.storage in body must be of type integer"), "{reply}");
    let mut bad = main_body.clone();
    bad["metadata"]["labels"][NODE_LABEL] = json!("n".repeat(64));
    let (code, _, reply) = raw(&server, Method::PATCH, &url, bad).await;
    assert_eq!(code, 422, "{reply}");
    assert!(reply["message"].as_str().unwrap().contains("at most 63 characters"), "{reply}");

    let (code, _, reply) = raw(&server, Method::PATCH, &status_url, status_body.clone()).await;
    assert_eq!(code, 200, "{reply}");
    let mut empty = status_body.clone();
    empty.as_object_mut().unwrap().remove("status");
    let (code, _, reply) = raw(&server, Method::PATCH, &status_url, empty).await;
    assert_eq!(code, 200, "{reply}");
    assert!(server.api.object("blockdevices", &o.key.name).unwrap().get("status").is_none(), "status dropped with its fields");
}

/// A state the CRD does not allow is refused by the (stand-in) API server:
/// the updater drops it and counts it, and does not send it again.
#[tokio::test]
async fn a_write_the_schema_refuses_is_dropped_and_counted() {
    let server = Server::start().await;
    let stats = Arc::new(volring_kube::Stats::default());
    let mut c = config("n1");
    c.stats = Some(stats.clone());
    let up = Updater::start(Arc::new(KubeSink::new(server.config()).unwrap()), c, vec![]);
    let mut o = bd("n1", 1, 1);
    o.status["state"] = json!("Exploded");
    up.submit(o.clone());
    until("the refusal", || stats.refused.load(std::sync::atomic::Ordering::Relaxed) == 1).await;
    let s = up.shutdown(Duration::from_secs(5)).await;
    assert_eq!((s.writes_main, s.writes_status, s.refused), (1, 0, 1), "{s:?}");
    assert!(stored_status(&server, &o).is_null(), "the object is there, without the refused status");
}
