//! BlockDevices across nodes and devices: names from (node, stable id), so
//! cloned nodes keep an object each; old-named objects replaced; duplicate
//! ids on one node; unread ids; the feed at run time. Against the API
//! stand-in (tests/kube_support).

mod kube_support;
mod publisher_support;

use std::sync::Arc;
use std::time::Duration;

use axum::http::Method;
use kube_support::Server;
use publisher_support::*;
use serde_json::json;
use volring_kube::kube_sink::KubeSink;
use volring_kube::node_feed::storage_node;
use volring_kube::Key;
use volring_kube::{GonePolicy, Updater};

/// H1: two nodes cloned from one image have devices with the same stable
/// id. Each node keeps its own objects: both are listed, each restart
/// writes nothing, and deleting one node's gone devices leaves the other's.
#[tokio::test]
async fn cloned_nodes_sharing_a_partuuid_keep_an_object_each() {
    use volring_kube::feed::Feed;
    let server = Server::start().await;
    let sink = Arc::new(KubeSink::new(server.config()).unwrap());
    let initial = |node: &str| {
        Feed::initial(&cloned_inventory(node, 3), storage_node(node, &[], None, None, None, &Default::default()), &mut config(node)).1
    };
    for node in ["n1", "n2"] {
        let s = Updater::start(sink.clone(), config(node), initial(node)).shutdown(Duration::from_secs(10)).await;
        assert_eq!((s.writes_main, s.refused, s.abandoned), (4, 0, 0), "{node}: {s:?}");
    }
    assert_eq!(server.api.objects("blockdevices").len(), 6, "three devices on each of two nodes");
    let (n1, n2) = (bd_names_of(&server, "n1"), bd_names_of(&server, "n2"));
    assert_eq!((n1.len(), n2.len()), (3, 3), "{n1:?} {n2:?}");
    for o in server.api.objects("blockdevices") {
        assert_eq!(o["metadata"]["labels"][NODE_LABEL], o["spec"]["nodeName"], "{o}");
    }
    // Each restart, with nothing changed, finds its own objects.
    for node in ["n1", "n2", "n1"] {
        server.api.clear_log();
        let s = Updater::start(sink.clone(), config(node), initial(node)).shutdown(Duration::from_secs(10)).await;
        assert_eq!((s.writes_main, s.writes_status, s.unchanged), (0, 0, 4), "{node} restarted: {s:?}");
        assert!(server.api.log().iter().all(|l| l.method == Method::GET), "{node}: {:#?}", server.api.log());
    }
    // n1 loses its devices; with --delete-gone-devices only n1's go.
    let before_n2: Vec<_> = n2.iter().map(|n| server.api.object("blockdevices", n).unwrap()).collect();
    let mut c = config("n1");
    c.gone = GonePolicy::Delete;
    let only_node = vec![storage_node("n1", &[], None, None, None, &Default::default())];
    let s = Updater::start(sink, c, only_node).shutdown(Duration::from_secs(10)).await;
    assert_eq!(s.deletes, 3, "{s:?}");
    assert!(bd_names_of(&server, "n1").is_empty());
    let after_n2: Vec<_> = n2.iter().map(|n| server.api.object("blockdevices", n).unwrap()).collect();
    assert_eq!(before_n2, after_n2, "the other node's objects are untouched");
}

/// An object stored under the name earlier versions gave it (from the id
/// alone) is deleted at start, whatever the gone policy, and the device is
/// published under its node's name: no Inactive twin is left behind.
#[tokio::test]
async fn an_object_under_the_old_name_is_replaced() {
    use volring_kube::feed::Feed;
    let server = Server::start().await;
    let inv = cloned_inventory("n1", 1);
    let mut c = config("n1");
    let initial = Feed::initial(&inv, storage_node("n1", &[], None, None, None, &Default::default()), &mut c).1;
    let mut old = kube_support::api_form(&initial[0]);
    let legacy = legacy_block_device_name(initial[0].spec["stableId"].as_str().unwrap());
    old["metadata"]["name"] = json!(legacy);
    server.api.seed("blockdevices", old);
    let sink = Arc::new(KubeSink::new(server.config()).unwrap());
    let s = Updater::start(sink, c, initial.clone()).shutdown(Duration::from_secs(10)).await;
    assert_eq!(s.deletes, 1, "{s:?}");
    assert!(server.api.object("blockdevices", &legacy).is_none());
    assert_eq!(bd_names_of(&server, "n1"), vec![initial[0].key.name.clone()]);
}

/// L1: two devices with one id on one node (two paths to one LUN) are two
/// objects, not one that flips between them.
#[tokio::test]
async fn two_devices_with_one_id_on_one_node_are_two_objects() {
    use volring_kube::feed::Feed;
    let mut inv = cloned_inventory("n1", 2);
    let id = inv.devices.values().next().unwrap().id.clone();
    for d in inv.devices.values_mut() {
        d.id = id.clone();
    }
    let mut c = config("n1");
    let initial = Feed::initial(&inv, storage_node("n1", &[], None, None, None, &Default::default()), &mut c).1;
    assert_eq!(initial.len(), 3);
    assert_ne!(initial[0].key, initial[1].key, "one id on two devices of one node");
    let server = Server::start().await;
    let sink = Arc::new(KubeSink::new(server.config()).unwrap());
    Updater::start(sink, c, initial).shutdown(Duration::from_secs(10)).await;
    let mut paths: Vec<String> =
        server.api.objects("blockdevices").iter().map(|o| o["spec"]["path"].as_str().unwrap().to_string()).collect();
    paths.sort();
    assert_eq!(paths, ["/dev/vdz0", "/dev/vdz1"]);
}

/// L1: a device whose id cannot be read for a while (a transient sysfs
/// error) is neither retired nor rewritten, at run time or at a restart.
#[tokio::test]
async fn an_unread_id_is_not_a_removal() {
    use volring_kube::feed::Feed;
    let mut inv = cloned_inventory("n1", 2);
    let mut c = config("n1");
    let (mut feed, initial) = Feed::initial(&inv, storage_node("n1", &[], None, None, None, &Default::default()), &mut c);
    let server = Server::start().await;
    let sink = Arc::new(KubeSink::new(server.config()).unwrap());
    let up = Updater::start(sink.clone(), c, initial.clone());
    until("both devices", || bd_names_of(&server, "n1").len() == 2).await;
    let first = *inv.devices.keys().next().unwrap();
    inv.devices.get_mut(&first).unwrap().id.clear();
    feed.devices(&up, &inv, "n1", None);
    let s = up.shutdown(Duration::from_secs(10)).await;
    for o in server.api.objects("blockdevices") {
        assert_eq!(o["status"]["state"], "Active", "{o}");
    }
    assert_eq!((s.writes_main, s.writes_status), (3, 3), "nothing after the first writes: {s:?}");
    // A restart while it cannot be read does not retire it either.
    let mut c = config("n1");
    let now = Feed::initial(&inv, storage_node("n1", &[], None, None, None, &Default::default()), &mut c).1;
    assert_eq!(c.unread_paths.len(), 1, "{:?}", c.unread_paths);
    assert_eq!(now.len(), 2);
    let s = Updater::start(sink, c, now).shutdown(Duration::from_secs(10)).await;
    assert_eq!((s.writes_main, s.writes_status), (0, 0), "{s:?}");
    for o in server.api.objects("blockdevices") {
        assert_eq!(o["status"]["state"], "Active", "{o}");
    }
}

/// The feed at run time: a device removed is retired (Inactive), one that
/// changes is written once, one that did not is not submitted at all.
#[tokio::test]
async fn the_feed_retires_a_removed_device_and_submits_only_changes() {
    use volring_kube::feed::Feed;
    let mut inv = cloned_inventory("n1", 3);
    let mut c = config("n1");
    let (mut feed, initial) = Feed::initial(&inv, storage_node("n1", &[], None, None, None, &Default::default()), &mut c);
    let server = Server::start().await;
    let sink = Arc::new(KubeSink::new(server.config()).unwrap());
    let stats = Arc::new(volring_kube::Stats::default());
    c.stats = Some(stats.clone());
    let up = Updater::start(sink, c, initial.clone());
    until("the devices", || bd_names_of(&server, "n1").len() == 3).await;
    let before = stats.submitted.load(std::sync::atomic::Ordering::Relaxed);
    let devs: Vec<_> = inv.devices.keys().copied().collect();
    inv.devices.remove(&devs[0]);
    inv.devices.get_mut(&devs[1]).unwrap().size_bytes += 1 << 20;
    feed.devices(&up, &inv, "n1", None);
    feed.devices(&up, &inv, "n1", None);
    assert_eq!(
        stats.submitted.load(std::sync::atomic::Ordering::Relaxed) - before,
        2,
        "one retire and one change; nothing for the third, or for the repeat"
    );
    let s = up.shutdown(Duration::from_secs(10)).await;
    let state = |k: &Key| server.api.object("blockdevices", &k.name).unwrap()["status"]["state"].clone();
    assert_eq!(state(&initial[0].key), "Inactive");
    assert_eq!((state(&initial[1].key), state(&initial[2].key)), (json!("Active"), json!("Active")));
    assert_eq!(
        server.api.object("blockdevices", &initial[1].key.name).unwrap()["spec"]["capacity"]["storage"],
        json!(inv.devices[&devs[1]].size_bytes)
    );
    assert_eq!((s.writes_main, s.writes_status), (4 + 1, 4 + 1), "{s:?}");
}

/// Issue 29: a node's objects are found as node-disk-manager's users look
/// for them (`-l kubernetes.io/hostname=<node>`), and by
/// `--field-selector spec.nodeName=<node>` (the CRDs declare it in
/// `selectableFields`; the stand-in, like the API server, refuses a field
/// the CRD does not list).
#[tokio::test]
async fn a_nodes_objects_are_found_by_hostname_label_and_by_node_field() {
    use volring_kube::feed::Feed;
    let server = Server::start().await;
    let sink = Arc::new(KubeSink::new(server.config()).unwrap());
    for node in ["n1", "n2"] {
        let mut c = config(node);
        let initial = Feed::initial(&cloned_inventory(node, 3), storage_node(node, &[], None, None, None, &Default::default()), &mut c).1;
        Updater::start(sink.clone(), c, initial).shutdown(Duration::from_secs(10)).await;
    }
    let client = kube::Client::try_from(server.config()).unwrap();
    let list = |plural: &'static str, query: String| {
        let client = client.clone();
        async move {
            let req = http::Request::get(format!("/apis/volring.io/v1alpha1/{plural}?{query}")).body(Vec::new()).unwrap();
            client.request::<serde_json::Value>(req).await
        }
    };
    let names = |v: &serde_json::Value| -> Vec<String> {
        let mut n: Vec<String> =
            v["items"].as_array().unwrap().iter().map(|i| i["metadata"]["name"].as_str().unwrap().to_string()).collect();
        n.sort();
        n
    };
    let by_label = list("blockdevices", "labelSelector=kubernetes.io%2Fhostname%3Dn1".into()).await.unwrap();
    assert_eq!(names(&by_label), bd_names_of(&server, "n1"));
    let sn = list("storagenodes", "labelSelector=kubernetes.io%2Fhostname%3Dn2".into()).await.unwrap();
    assert_eq!(names(&sn), ["n2"]);
    let by_field = list("blockdevices", "fieldSelector=spec.nodeName%3Dn1".into()).await.unwrap();
    assert_eq!(names(&by_field), bd_names_of(&server, "n1"));
    let not_n1 = list("blockdevices", "fieldSelector=spec.nodeName%21%3Dn1".into()).await.unwrap();
    assert_eq!(names(&not_n1), bd_names_of(&server, "n2"));
    let sn = list("storagenodes", "fieldSelector=spec.nodeName%3Dn1".into()).await.unwrap();
    assert_eq!(names(&sn), ["n1"]);
    let refused = list("blockdevices", "fieldSelector=spec.path%3D%2Fdev%2Fvdz0".into()).await;
    assert!(
        matches!(&refused, Err(kube::Error::Api(e)) if e.code == 400 && e.message.contains("field label not supported")),
        "{refused:?}"
    );
    for o in server.api.objects("blockdevices").into_iter().chain(server.api.objects("storagenodes")) {
        assert_eq!(o["metadata"]["labels"]["kubernetes.io/hostname"], o["spec"]["nodeName"], "{o}");
    }
}
