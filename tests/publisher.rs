//! The publisher against the API stand-in (tests/kube_support) and against
//! the node's embedded store: coalescing, restarts, 429/500/409, devices
//! that are gone, shutdown.
//!
//! Every wait is bounded; nothing here asserts how fast anything is.

mod kube_support;

use std::sync::Arc;
use std::time::Duration;

use axum::http::Method;
use kube_support::{Fault, Server};
use serde_json::json;
use volring::publisher::embedded_sink::EmbeddedSink;
use volring::publisher::kube_sink::KubeSink;
use volring::publisher::objects::{self, Key, Kind, Object, NODE_LABEL};
use volring::publisher::{GonePolicy, Updater, UpdaterConfig};

/// A BlockDevice of `node` numbered `i`, whose status carries `gen`.
fn bd(node: &str, i: usize, gen: usize) -> Object {
    let stable = format!("serial-test-{node}-{i}");
    Object {
        key: Key { kind: Kind::BlockDevice, name: objects::block_device_name(node, &stable) },
        labels: [(NODE_LABEL.to_string(), node.to_string()), (objects::KIND_LABEL.to_string(), "blockdevice".to_string())].into(),
        spec: json!({"nodeName": node, "path": format!("/dev/sd{i}"), "stableId": stable,
            "capacity": {"storage": 1u64 << 30, "logicalSectorSize": 512, "physicalSectorSize": 4096},
            "details": {"deviceType": "disk", "driveType": "SSD", "removable": false, "readOnly": false},
            "devlinks": [], "partitioned": false}),
        status: json!({"state": "Active", "claimState": "Unclaimed", "mountPoints": [format!("/mnt/{gen}")], "holders": []}),
    }
}

/// Fast enough for tests; the defaults are what the agent uses.
fn config(node: &str) -> UpdaterConfig {
    let mut c = UpdaterConfig::new(node);
    c.qps = 1000.0;
    c.burst = 1000;
    c.window = Duration::from_millis(300);
    c.backoff_min = Duration::from_millis(50);
    c
}

/// Waits (bounded) until `f` holds.
async fn until(what: &str, mut f: impl FnMut() -> bool) {
    for _ in 0..600 {
        if f() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("timed out waiting for {what}");
}

fn stored_status(s: &Server, o: &Object) -> serde_json::Value {
    s.api.object("blockdevices", &o.key.name).map(|v| v["status"].clone()).unwrap_or_default()
}

#[tokio::test]
async fn ten_thousand_changes_to_a_hundred_objects_coalesce_and_a_restart_writes_nothing() {
    let server = Server::start().await;
    let sink = Arc::new(KubeSink::new(server.config()).unwrap());
    let mut c = config("n1");
    c.window = Duration::from_secs(1);
    let up = Updater::start(sink.clone(), c.clone(), vec![]);
    for g in 0..100 {
        for i in 0..100 {
            up.submit(bd("n1", i, g));
        }
    }
    let last: Vec<Object> = (0..100).map(|i| bd("n1", i, 99)).collect();
    until("the last state of every object", || last.iter().all(|o| stored_status(&server, o) == o.status)).await;
    let stats = up.shutdown(Duration::from_secs(5)).await;
    let log = server.api.log();
    let status_writes = log.iter().filter(|l| l.is_write() && l.is_status()).count();
    let main_writes = log.iter().filter(|l| l.is_write() && !l.is_status()).count();
    assert!(status_writes <= 100 && main_writes <= 100, "{main_writes} main and {status_writes} status writes for 100 objects");
    assert_eq!(stats.submitted, 10_000);
    assert!(stats.coalesced >= 9_900, "{stats:?}");

    // Restart with the same facts: one LIST per kind, not one write.
    server.api.clear_log();
    let up = Updater::start(sink.clone(), c.clone(), last.clone());
    let stats = up.shutdown(Duration::from_secs(5)).await;
    let log = server.api.log();
    assert!(log.iter().all(|l| l.method == Method::GET && l.query.contains("labelSelector")), "{log:#?}");
    assert_eq!((stats.writes_main, stats.writes_status, stats.unchanged), (0, 0, 100));

    // Restart with one object changed: one status write, nothing else.
    server.api.clear_log();
    let mut now = last.clone();
    now[7] = bd("n1", 7, 1000);
    let up = Updater::start(sink, c, now);
    up.shutdown(Duration::from_secs(5)).await;
    let writes: Vec<_> = server.api.log().into_iter().filter(|l| l.method != Method::GET).collect();
    assert_eq!(writes.len(), 1, "{writes:#?}");
    assert!(writes[0].is_status() && writes[0].path.ends_with(&format!("{}/status", last[7].key.name)));
}

#[tokio::test]
async fn a_429_is_honoured_for_its_retry_after() {
    let server = Server::start().await;
    server.api.inject(Fault { status: 429, retry_after: Some(2), method: Some(Method::PATCH), path_contains: String::new(), times: 1 });
    // One request at a time, so "the next request" is well defined: the
    // pause holds every object, not only the throttled one.
    let mut c = config("n1");
    c.concurrency = 1;
    let up = Updater::start(Arc::new(KubeSink::new(server.config()).unwrap()), c, vec![]);
    let objs: Vec<Object> = (0..3).map(|i| bd("n1", i, 1)).collect();
    for o in &objs {
        up.submit(o.clone());
    }
    until("the objects", || objs.iter().all(|o| stored_status(&server, o) == o.status)).await;
    let stats = up.shutdown(Duration::from_secs(5)).await;
    let log = server.api.log();
    let throttled = log.iter().position(|l| l.status == 429).expect("the injected 429");
    let next = &log[throttled + 1];
    let waited = next.at - log[throttled].at;
    assert!(waited >= Duration::from_secs(2), "the next request came {waited:?} after a 429 asking for 2 s");
    assert_eq!(stats.throttled, 1);
}

#[tokio::test]
async fn requests_keep_to_the_token_bucket() {
    let server = Server::start().await;
    let mut c = config("n1");
    (c.qps, c.burst) = (20.0, 5);
    let objs: Vec<Object> = (0..10).map(|i| bd("n1", i, 1)).collect();
    Updater::start(Arc::new(KubeSink::new(server.config()).unwrap()), c, objs).shutdown(Duration::from_secs(10)).await;
    let log = server.api.log();
    assert_eq!(log.len(), 22, "two lists, a main and a status write for each of 10 objects");
    // 5 at once, then one every 50 ms: the last no sooner than 17 / 20 s.
    let span = log[21].at - log[0].at;
    assert!(span >= Duration::from_millis(800), "22 requests in {span:?} at 20 QPS, burst 5");
}

#[tokio::test]
async fn a_500_backs_off_and_retries_and_a_409_rereads_once_then_retries() {
    let server = Server::start().await;
    let mut c = config("n1");
    c.backoff_min = Duration::from_millis(400);
    let up = Updater::start(Arc::new(KubeSink::new(server.config()).unwrap()), c, vec![]);
    let (a, b) = (bd("n1", 1, 1), bd("n1", 2, 1));
    server.api.inject(Fault { status: 500, retry_after: None, method: Some(Method::PATCH), path_contains: a.key.name.clone(), times: 2 });
    server.api.inject(Fault { status: 409, retry_after: None, method: Some(Method::PATCH), path_contains: b.key.name.clone(), times: 1 });
    up.submit(a.clone());
    up.submit(b.clone());
    until("both objects", || stored_status(&server, &a) == a.status && stored_status(&server, &b) == b.status).await;
    let stats = up.shutdown(Duration::from_secs(5)).await;
    assert_eq!((stats.unavailable, stats.conflicts), (2, 1), "{stats:?}");
    let log = server.api.log();
    let of_b: Vec<_> = log.iter().filter(|l| l.path.contains(&b.key.name)).map(|l| (l.method.clone(), l.status)).collect();
    // The 409 is followed by one GET (404: not there yet) and the retry.
    assert_eq!(of_b[..3], [(Method::PATCH, 409), (Method::GET, 404), (Method::PATCH, 201)], "{of_b:?}");
    let gets_of_a = log.iter().filter(|l| l.path.contains(&a.key.name) && l.method == Method::GET).count();
    assert_eq!(gets_of_a, 0, "a 500 is retried without a re-read");
    // The backoff: 400 ms after the first 500, 800 ms after the second,
    // each with at most 25 % jitter off.
    let of_a: Vec<_> = log.iter().filter(|l| l.path.contains(&a.key.name)).collect();
    assert_eq!(of_a.iter().map(|l| l.status).collect::<Vec<_>>()[..3], [500, 500, 201]);
    for (i, least) in [(0, 300), (1, 600)] {
        let gap = of_a[i + 1].started - of_a[i].at;
        assert!(gap >= Duration::from_millis(least), "retry {} came {gap:?} after a 500", i + 1);
    }
}

#[tokio::test]
async fn a_refused_write_is_dropped_and_counted() {
    let server = Server::start().await;
    let up = Updater::start(Arc::new(KubeSink::new(server.config()).unwrap()), config("n1"), vec![]);
    let o = bd("n1", 1, 1);
    server.api.inject(Fault { status: 422, retry_after: None, method: Some(Method::PATCH), path_contains: o.key.name.clone(), times: 1 });
    up.submit(o.clone());
    until("the refusal", || up.stats().refused.load(std::sync::atomic::Ordering::Relaxed) == 1).await;
    let stats = up.shutdown(Duration::from_secs(2)).await;
    assert!(server.api.object("blockdevices", &o.key.name).is_none());
    assert_eq!((stats.refused, stats.abandoned), (1, 0));
    assert_eq!(server.api.log().iter().filter(|l| l.method == Method::PATCH).count(), 1, "not sent again");
}

#[tokio::test]
async fn a_gone_device_is_marked_inactive_and_other_nodes_are_untouched() {
    let server = Server::start().await;
    let sink = Arc::new(KubeSink::new(server.config()).unwrap());
    let mine: Vec<Object> = (0..3).map(|i| bd("n1", i, 0)).collect();
    let theirs: Vec<Object> = (0..2).map(|i| bd("n2", i, 0)).collect();
    for (node, objs) in [("n1", &mine), ("n2", &theirs)] {
        Updater::start(sink.clone(), config(node), objs.clone()).shutdown(Duration::from_secs(5)).await;
    }
    let before_theirs: Vec<_> = theirs.iter().map(|o| server.api.object("blockdevices", &o.key.name).unwrap()).collect();
    server.api.clear_log();
    // n1 restarts without device 2.
    Updater::start(sink.clone(), config("n1"), mine[..2].to_vec()).shutdown(Duration::from_secs(5)).await;
    let gone = server.api.object("blockdevices", &mine[2].key.name).unwrap();
    assert_eq!(gone["status"]["state"], "Inactive");
    assert_eq!(gone["spec"], mine[2].spec, "its last facts stay");
    for o in &mine[..2] {
        assert_eq!(stored_status(&server, o)["state"], "Active");
    }
    let after_theirs: Vec<_> = theirs.iter().map(|o| server.api.object("blockdevices", &o.key.name).unwrap()).collect();
    assert_eq!(before_theirs, after_theirs, "another node's objects are not touched");
    let writes: Vec<_> = server.api.log().into_iter().filter(|l| l.method != Method::GET).collect();
    assert_eq!(writes.len(), 1, "one status write for the gone device: {writes:#?}");

    // With the delete policy, it goes.
    let mut c = config("n1");
    c.gone = GonePolicy::Delete;
    Updater::start(sink, c, mine[..1].to_vec()).shutdown(Duration::from_secs(5)).await;
    assert!(server.api.object("blockdevices", &mine[1].key.name).is_none());
    assert!(server.api.object("blockdevices", &mine[2].key.name).is_none());
    assert_eq!(server.api.objects("blockdevices").len(), 3, "one of n1's and both of n2's");
}

#[tokio::test]
async fn shutdown_flushes_a_thirty_second_window_within_its_deadline() {
    let server = Server::start().await;
    let sink = Arc::new(KubeSink::new(server.config()).unwrap());
    let mut c = config("n1");
    c.window = Duration::from_secs(30);
    let up = Updater::start(sink.clone(), c.clone(), vec![]);
    let objs: Vec<Object> = (0..50).map(|i| bd("n1", i, 1)).collect();
    for o in &objs {
        up.submit(o.clone());
    }
    // Give the initial LIST time to pass, so the 30 s window has begun.
    until("the initial list", || server.api.log().len() >= 2).await;
    // 10 s: the flush is 100 requests, and CI machines are loaded.
    let stats = up.shutdown(Duration::from_secs(10)).await;
    assert_eq!(stats.abandoned, 0);
    for o in &objs {
        assert_eq!(stored_status(&server, o), o.status);
    }
    // A shutdown with nothing changed writes nothing again.
    server.api.clear_log();
    let up = Updater::start(sink, c, vec![]);
    for o in &objs {
        up.submit(o.clone());
    }
    up.shutdown(Duration::from_secs(10)).await;
    assert!(server.api.log().iter().all(|l| l.method == Method::GET));
}

#[tokio::test]
async fn lists_are_paginated() {
    let server = Server::start().await;
    let sink = Arc::new(KubeSink::new(server.config()).unwrap());
    let objs: Vec<Object> = (0..1203).map(|i| bd("n1", i, 0)).collect();
    for o in &objs {
        let mut v = volring::publisher::embedded_sink::api_form(o);
        v["metadata"]["labels"]["volring.io/node"] = json!("n1");
        server.api.seed("blockdevices", v);
    }
    server.api.seed("blockdevices", volring::publisher::embedded_sink::api_form(&bd("n2", 0, 0)));
    let listed = volring::publisher::Sink::list(&*sink, Kind::BlockDevice, "n1").await.unwrap();
    assert_eq!(listed.len(), 1203);
    let pages = server.api.log().iter().filter(|l| l.query.contains("limit=500")).count();
    assert_eq!(pages, 3);
}

#[tokio::test]
async fn with_no_cluster_the_objects_land_in_the_store_and_a_restart_writes_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join(volring::state::store::FILE);
    let objs: Vec<Object> = (0..20).map(|i| bd("n1", i, 3)).collect();
    {
        let store = Arc::new(volring::state::store::Store::open(&path).unwrap());
        let up = Updater::start(Arc::new(EmbeddedSink::new(store)), config("n1"), vec![]);
        for g in 0..4 {
            for i in 0..20 {
                up.submit(bd("n1", i, g));
            }
        }
        let stats = up.shutdown(Duration::from_secs(10)).await;
        assert_eq!((stats.writes_main, stats.writes_status), (20, 20));
    }
    let seen = volring::state::store::Store::read_only(&path, true).unwrap().published;
    assert_eq!(seen.len(), 20);
    for o in &objs {
        let key = volring::publisher::embedded_sink::store_key(&o.key);
        let (_, bytes) = seen.iter().find(|(k, _)| *k == key).expect("stored");
        let back = Object::from_api(Kind::BlockDevice, &serde_json::from_slice(bytes).unwrap()).unwrap();
        assert_eq!(&back, o);
    }
    let store = Arc::new(volring::state::store::Store::open(&path).unwrap());
    let up = Updater::start(Arc::new(EmbeddedSink::new(store)), config("n1"), objs[..19].to_vec());
    let stats = up.shutdown(Duration::from_secs(10)).await;
    assert_eq!((stats.writes_main, stats.writes_status), (0, 1), "only the gone device is written: {stats:?}");
}

/// This machine's real devices, as the agent builds them, published to the
/// stand-in: every device becomes one BlockDevice that reads back equal (so
/// a restart writes nothing), and the objects pass the stand-in's checks.
#[tokio::test]
async fn this_machines_devices_publish_and_read_back_equal() {
    let mountinfo = std::fs::read("/proc/self/mountinfo").unwrap();
    let (table, _) = volring::mounts::MountTable::from_mountinfo(&mountinfo);
    let cfg = volring::devices::ScanConfig { probe: false, ..Default::default() };
    let mut inv = volring::devices::Inventory::scan(&cfg, &table).unwrap();
    inv.link(&table, "n1");
    let node = objects::storage_node("n1", None, vec![]);
    let initial = volring::publisher::feed::Feed::initial(&inv, "n1", node);
    let devices = initial.len() - 1;
    let server = Server::start().await;
    let sink = Arc::new(KubeSink::new(server.config()).unwrap());
    let s = Updater::start(sink.clone(), config("n1"), initial.clone()).shutdown(Duration::from_secs(10)).await;
    assert_eq!((s.writes_main, s.writes_status, s.refused), (initial.len() as u64, initial.len() as u64, 0));
    assert_eq!(server.api.objects("blockdevices").len(), devices);
    let s = Updater::start(sink, config("n1"), initial).shutdown(Duration::from_secs(10)).await;
    assert_eq!((s.writes_main, s.writes_status), (0, 0), "{s:?}");
}

/// The healer hook's listing: VolumeAttachments have no field selector on
/// their spec, so every page is LISTed (500 a page, no selector the real
/// server would refuse) and filtered here: this driver, this node, attached.
#[tokio::test]
async fn volume_attachments_are_listed_in_pages_and_filtered_to_this_node_and_driver() {
    use volring::publisher::attachments;
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
    assert!(log.iter().all(|l| l.path == attachments::PATH && l.status == 200 && l.query.contains("limit=500")), "{log:?}");
    assert!(log.iter().all(|l| !l.query.contains("fieldSelector")));
}

/// This machine's first device, made into `n` devices of `node` as cloned
/// nodes have them: no serial or WWN, so the id falls through to a
/// partition GUID written into the image (`partuuid-clone-<i>`), the same
/// on every clone.
fn cloned_inventory(node: &str, n: usize) -> volring::devices::Inventory {
    let mountinfo = std::fs::read("/proc/self/mountinfo").unwrap();
    let (table, _) = volring::mounts::MountTable::from_mountinfo(&mountinfo);
    let cfg = volring::devices::ScanConfig { probe: false, ..Default::default() };
    let real = volring::devices::Inventory::scan(&cfg, &table).unwrap();
    let base = real.devices.values().next().expect("this machine has a block device").clone();
    let mut inv = volring::devices::Inventory { devices: Default::default(), errors: vec![] };
    for i in 0..n {
        let mut d = base.clone();
        (d.wwn, d.serial, d.loop_backing, d.dm) = (None, None, None, None);
        d.part_uuid = Some(format!("partuuid-clone-{i}"));
        d.name = format!("vdz{i}");
        d.path = format!("/dev/vdz{i}").into();
        d.dev = volring::mounts::DevNum { major: 252, minor: 1000 + i as u32 };
        d.id = volring::devices::stable_id(&d, node);
        assert_eq!(d.id, format!("partuuid-partuuid-clone-{i}"), "the id does not name the node");
        inv.devices.insert(d.dev, d);
    }
    inv
}

fn bd_names_of(server: &Server, node: &str) -> Vec<String> {
    let mut v: Vec<String> = server
        .api
        .objects("blockdevices")
        .into_iter()
        .filter(|o| o["metadata"]["labels"][NODE_LABEL] == node)
        .map(|o| o["metadata"]["name"].as_str().unwrap().to_string())
        .collect();
    v.sort();
    v
}

/// H1: two nodes cloned from one image have devices with the same stable
/// id. Each node keeps its own objects: both are listed, each restart
/// writes nothing, and deleting one node's gone devices leaves the other's.
#[tokio::test]
async fn cloned_nodes_sharing_a_partuuid_keep_an_object_each() {
    use volring::publisher::feed::Feed;
    let server = Server::start().await;
    let sink = Arc::new(KubeSink::new(server.config()).unwrap());
    let initial = |node: &str| Feed::initial(&cloned_inventory(node, 3), node, objects::storage_node(node, None, vec![]));
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
    let only_node = vec![objects::storage_node("n1", None, vec![])];
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
    use volring::publisher::feed::Feed;
    let server = Server::start().await;
    let inv = cloned_inventory("n1", 1);
    let initial = Feed::initial(&inv, "n1", objects::storage_node("n1", None, vec![]));
    let mut old = volring::publisher::embedded_sink::api_form(&initial[0]);
    let legacy = objects::legacy_block_device_name(initial[0].spec["stableId"].as_str().unwrap());
    old["metadata"]["name"] = json!(legacy);
    server.api.seed("blockdevices", old);
    let sink = Arc::new(KubeSink::new(server.config()).unwrap());
    let s = Updater::start(sink, config("n1"), initial.clone()).shutdown(Duration::from_secs(10)).await;
    assert_eq!(s.deletes, 1, "{s:?}");
    assert!(server.api.object("blockdevices", &legacy).is_none());
    assert_eq!(bd_names_of(&server, "n1"), vec![initial[0].key.name.clone()]);
}

/// L1: two devices with one id on one node (two paths to one LUN) are two
/// objects, not one that flips between them.
#[tokio::test]
async fn two_devices_with_one_id_on_one_node_are_two_objects() {
    use volring::publisher::feed::Feed;
    let mut inv = cloned_inventory("n1", 2);
    let id = inv.devices.values().next().unwrap().id.clone();
    for d in inv.devices.values_mut() {
        d.id = id.clone();
    }
    let initial = Feed::initial(&inv, "n1", objects::storage_node("n1", None, vec![]));
    assert_eq!(initial.len(), 3);
    assert_ne!(initial[0].key, initial[1].key, "one id on two devices of one node");
    let server = Server::start().await;
    let sink = Arc::new(KubeSink::new(server.config()).unwrap());
    Updater::start(sink, config("n1"), initial).shutdown(Duration::from_secs(10)).await;
    let mut paths: Vec<String> =
        server.api.objects("blockdevices").iter().map(|o| o["spec"]["path"].as_str().unwrap().to_string()).collect();
    paths.sort();
    assert_eq!(paths, ["/dev/vdz0", "/dev/vdz1"]);
}

/// L1: a device whose id cannot be read for a while (a transient sysfs
/// error) is neither retired nor rewritten, at run time or at a restart.
#[tokio::test]
async fn an_unread_id_is_not_a_removal() {
    use volring::publisher::feed::Feed;
    let mut inv = cloned_inventory("n1", 2);
    let initial = Feed::initial(&inv, "n1", objects::storage_node("n1", None, vec![]));
    let server = Server::start().await;
    let sink = Arc::new(KubeSink::new(server.config()).unwrap());
    let up = Updater::start(sink.clone(), config("n1"), initial.clone());
    let mut feed = Feed::default();
    feed.seed(&initial);
    until("both devices", || bd_names_of(&server, "n1").len() == 2).await;
    let first = *inv.devices.keys().next().unwrap();
    inv.devices.get_mut(&first).unwrap().id.clear();
    feed.devices(&up, &inv, "n1");
    let s = up.shutdown(Duration::from_secs(10)).await;
    for o in server.api.objects("blockdevices") {
        assert_eq!(o["status"]["state"], "Active", "{o}");
    }
    assert_eq!((s.writes_main, s.writes_status), (3, 3), "nothing after the first writes: {s:?}");
    // A restart while it cannot be read does not retire it either.
    let mut c = config("n1");
    c.unread_paths = volring::publisher::feed::unread_paths(&inv);
    let now = Feed::initial(&inv, "n1", objects::storage_node("n1", None, vec![]));
    assert_eq!(now.len(), 2);
    let s = Updater::start(sink, c, now).shutdown(Duration::from_secs(10)).await;
    assert_eq!((s.writes_main, s.writes_status), (0, 0), "{s:?}");
    for o in server.api.objects("blockdevices") {
        assert_eq!(o["status"]["state"], "Active", "{o}");
    }
}

/// A stored object of `node` numbered `i` for a status storm.
async fn seeded(server: &Server, sink: &Arc<KubeSink>, c: &UpdaterConfig, n: usize) -> Vec<Object> {
    let objs: Vec<Object> = (0..n).map(|i| bd(&c.node, i, 0)).collect();
    let s = Updater::start(sink.clone(), c.clone(), objs.clone()).shutdown(Duration::from_secs(10)).await;
    assert_eq!(s.writes_status, n as u64);
    server.api.clear_log();
    objs
}

/// M3: a storm of status changes (10,000 to 100 objects that exist, spread
/// over several windows) writes each object at most once per window: two
/// writes of one object are never closer than the window. (A new object
/// takes two requests, the apply that creates it and its status, so the
/// criterion is about changes to objects that exist.)
#[tokio::test]
async fn a_status_storm_writes_each_object_at_most_once_per_window() {
    let server = Server::start().await;
    let sink = Arc::new(KubeSink::new(server.config()).unwrap());
    let mut c = config("n1");
    c.window = Duration::from_millis(500);
    let objs = seeded(&server, &sink, &c, 100).await;
    let up = Updater::start(sink, c.clone(), objs);
    let began = std::time::Instant::now();
    for g in 1..=100 {
        for i in 0..100 {
            up.submit(bd("n1", i, g));
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    let last: Vec<Object> = (0..100).map(|i| bd("n1", i, 100)).collect();
    until("the last state of every object", || last.iter().all(|o| stored_status(&server, o) == o.status)).await;
    let elapsed = began.elapsed();
    let s = up.shutdown(Duration::from_secs(10)).await;
    assert_eq!(s.submitted, 10_000);
    let log = server.api.log();
    assert!(log.iter().filter(|l| l.method == Method::PATCH).all(|l| l.is_status()), "status-only changes apply nothing else");
    let windows = (elapsed.as_millis() / c.window.as_millis()) as usize + 1;
    let writes = log.iter().filter(|l| l.is_write()).count();
    assert!(writes <= 100 * windows, "{writes} writes in {windows} windows of 100 objects");
    for o in &last {
        let at: Vec<_> = log.iter().filter(|l| l.is_write() && l.path.contains(&o.key.name)).map(|l| (l.started, l.at)).collect();
        for w in at.windows(2) {
            let gap = w[1].0 - w[0].1;
            assert!(gap >= c.window, "{} written twice {gap:?} apart, inside one window", o.key.name);
        }
    }
}

/// M3: a full batch is flushed without waiting for the window.
#[tokio::test]
async fn a_full_batch_is_flushed_before_the_window_ends() {
    let server = Server::start().await;
    let sink = Arc::new(KubeSink::new(server.config()).unwrap());
    let mut c = config("n1");
    let objs = seeded(&server, &sink, &c, 25).await;
    (c.window, c.batch) = (Duration::from_secs(120), 10);
    let up = Updater::start(sink, c, objs);
    until("the initial list", || server.api.log().len() >= 2).await;
    let now: Vec<Object> = (0..25).map(|i| bd("n1", i, 1)).collect();
    for o in &now {
        up.submit(o.clone());
    }
    let written = || now.iter().filter(|o| stored_status(&server, o) == o.status).count();
    until("two full batches", || written() >= 20).await;
    // The rest (5, less than a batch) waits for its window.
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(written(), 20, "two batches of 10 went; 5 wait for the 120 s window");
    let s = up.shutdown(Duration::from_secs(10)).await;
    assert_eq!((written(), s.abandoned), (25, 0));
}

/// M1 and M4: the start-up LIST answered 429 (Retry-After) or 500 is not
/// retried before its wait is over, though changes keep arriving (the
/// agent submits on every relink).
#[tokio::test]
async fn a_failing_initial_list_waits_while_changes_arrive() {
    for (status, retry_after, least) in [(429, Some(2), Duration::from_secs(2)), (500, None, Duration::from_millis(750))] {
        let server = Server::start().await;
        server.api.inject(Fault { status, retry_after, method: Some(Method::GET), path_contains: "blockdevices".into(), times: 1 });
        let mut c = config("n1");
        c.backoff_min = Duration::from_secs(1);
        let up = Updater::start(Arc::new(KubeSink::new(server.config()).unwrap()), c, vec![]);
        let lists =
            || server.api.log().into_iter().filter(|l| l.method == Method::GET && l.path.ends_with("blockdevices")).collect::<Vec<_>>();
        for g in 0..500 {
            if lists().len() >= 2 {
                break;
            }
            up.submit(bd("n1", g % 5, g));
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let l = lists();
        assert_eq!(l.len(), 2, "{status}: {l:#?}");
        assert_eq!(l[0].status, status);
        let gap = l[1].started - l[0].at;
        assert!(gap >= least, "{status}: the LIST was retried {gap:?} after, while changes arrived");
        let o = bd("n1", 0, 0);
        until("the objects after the list", || server.api.object("blockdevices", &o.key.name).is_some()).await;
        let s = up.shutdown(Duration::from_secs(10)).await;
        assert_eq!((s.throttled, s.unavailable), if status == 429 { (1, 0) } else { (0, 1) }, "{s:?}");
    }
}

/// M4: repeated 429s across many objects, four requests at a time: after
/// each, no request reaches the server until its Retry-After is over (the
/// requests already on their way when it came are let through).
#[tokio::test]
async fn repeated_429s_pause_every_request() {
    let server = Server::start().await;
    let sink = Arc::new(KubeSink::new(server.config()).unwrap());
    let mut c = config("n1");
    let objs = seeded(&server, &sink, &c, 40).await;
    // Slow enough that the writes span the pauses, and each request held
    // at the server so four are in flight at once.
    (c.concurrency, c.qps, c.burst) = (4, 20.0, 4);
    server.api.set_hold(Duration::from_millis(150));
    server.api.inject(Fault { status: 429, retry_after: Some(1), method: Some(Method::PATCH), path_contains: String::new(), times: 3 });
    let up = Updater::start(sink, c, vec![]);
    let now: Vec<Object> = objs.iter().enumerate().map(|(i, _)| bd("n1", i, 1)).collect();
    for o in &now {
        up.submit(o.clone());
    }
    until("every object", || now.iter().all(|o| stored_status(&server, o) == o.status)).await;
    let s = up.shutdown(Duration::from_secs(10)).await;
    assert_eq!(s.throttled, 3, "{s:?}");
    assert!(server.api.max_in_flight() > 1, "requests overlapped");
    let log = server.api.log();
    let throttled: Vec<_> = log.iter().filter(|l| l.status == 429).collect();
    assert_eq!(throttled.len(), 3);
    // Requests sent before the client read the 429 may still arrive just
    // after it; 300 ms is far more than that takes.
    for t in &throttled {
        let inside: Vec<_> = log
            .iter()
            .filter(|l| l.started > t.at + Duration::from_millis(300) && l.started < t.at + Duration::from_secs(1))
            .map(|l| (l.method.clone(), l.path.clone(), l.started - t.at))
            .collect();
        assert!(inside.is_empty(), "requests during a 1 s pause: {inside:#?}");
    }
}

/// M6: the number of requests in flight, as the server sees them, never
/// exceeds `concurrency`.
#[tokio::test]
async fn requests_in_flight_stay_within_the_concurrency() {
    let server = Server::start().await;
    let sink = Arc::new(KubeSink::new(server.config()).unwrap());
    let mut c = config("n1");
    c.concurrency = 3;
    server.api.set_hold(Duration::from_millis(50));
    let objs: Vec<Object> = (0..40).map(|i| bd("n1", i, 1)).collect();
    let up = Updater::start(sink, c, objs);
    // The queue gauge (volring_publish_queued) counts what is being written.
    let queued = || up.stats().queued.load(std::sync::atomic::Ordering::Relaxed);
    until("the queue gauge to count the batch", || queued() >= 30).await;
    let s = up.shutdown(Duration::from_secs(30)).await;
    assert_eq!((s.writes_main, s.writes_status, s.abandoned, s.queued), (40, 40, 0, 0), "{s:?}");
    let max = server.api.max_in_flight();
    assert!((2..=3).contains(&max), "{max} requests at once with concurrency 3");
}

/// A kubeconfig that points at the stand-in.
fn kubeconfig_for(server: &Server, dir: &std::path::Path) -> std::path::PathBuf {
    let path = dir.join("kubeconfig");
    let text = format!(
        "apiVersion: v1\nkind: Config\nclusters:\n- name: stand-in\n  cluster:\n    server: http://{}\nusers:\n- name: tester\n  user:\n    token: not-checked\ncontexts:\n- name: stand-in\n  context:\n    cluster: stand-in\n    user: tester\ncurrent-context: stand-in\n",
        server.addr
    );
    std::fs::write(&path, text).unwrap();
    path
}

/// Runs `volring` with `args` and a clean environment (`env` added);
/// returns (status, stdout, stderr).
async fn volring(args: &[&str], env: &[(&str, &std::ffi::OsStr)]) -> (std::process::ExitStatus, String, String) {
    let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_volring"));
    cmd.args(args).env_clear().env("PATH", "/usr/bin:/bin");
    for (k, v) in env {
        cmd.env(k, v);
    }
    let out = tokio::task::spawn_blocking(move || cmd.output().unwrap()).await.unwrap();
    (out.status, String::from_utf8(out.stdout).unwrap(), String::from_utf8(out.stderr).unwrap())
}

/// H2: `volring get` reads the cluster a kubeconfig names (and says so),
/// reads the node's store when there is none or `--local-store` asks.
#[tokio::test]
async fn volring_get_reads_the_cluster_a_kubeconfig_names() {
    let server = Server::start().await;
    for i in 0..3 {
        server.api.seed("blockdevices", volring::publisher::embedded_sink::api_form(&bd("n1", i, 0)));
    }
    let dir = tempfile::tempdir().unwrap();
    let home = dir.path().join("home");
    std::fs::create_dir(&home).unwrap();
    let cfg = kubeconfig_for(&server, dir.path());
    let state = dir.path().join("state");
    std::fs::create_dir(&state).unwrap();
    let state_arg = format!("--state-dir={}", state.display());

    let (st, out, err) =
        volring(&["get", "bd", "-o", "json", &state_arg], &[("HOME", home.as_os_str()), ("KUBECONFIG", cfg.as_os_str())]).await;
    assert!(st.success(), "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    let mut names: Vec<&str> = v["items"].as_array().unwrap().iter().map(|i| i["metadata"]["name"].as_str().unwrap()).collect();
    names.sort();
    let mut want: Vec<String> = (0..3).map(|i| bd("n1", i, 0).key.name).collect();
    want.sort();
    assert_eq!(names, want);
    assert!(err.contains("from the cluster") && err.contains(&cfg.display().to_string()), "{err}");
    assert!(server.api.log().iter().any(|l| l.path.ends_with("/blockdevices")));

    // ~/.kube/config counts too.
    std::fs::create_dir(home.join(".kube")).unwrap();
    std::fs::copy(&cfg, home.join(".kube/config")).unwrap();
    let (st, out, err) = volring(&["get", "bd", &state_arg], &[("HOME", home.as_os_str())]).await;
    assert!(st.success() && out.lines().count() == 4 && err.contains("from the cluster"), "{out}{err}");

    // --local-store: the node's store, even with a kubeconfig.
    server.api.clear_log();
    let store = Arc::new(volring::state::store::Store::open(&state.join(volring::state::store::FILE)).unwrap());
    Updater::start(Arc::new(EmbeddedSink::new(store.clone())), config("n9"), vec![bd("n9", 0, 0)]).shutdown(Duration::from_secs(10)).await;
    drop(store);
    let (st, out, err) = volring(&["get", "bd", "--local-store", "-o", "json", &state_arg], &[("HOME", home.as_os_str())]).await;
    assert!(st.success(), "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["items"].as_array().unwrap().len(), 1, "{out}");
    assert_eq!(v["items"][0]["spec"]["nodeName"], "n9");
    assert!(err.contains("from the node's store"), "{err}");
    assert!(server.api.log().is_empty(), "the cluster was not asked");

    // No kubeconfig, no service account: the store, as before.
    let empty = dir.path().join("empty-home");
    std::fs::create_dir(&empty).unwrap();
    let (st, out, err) = volring(&["get", "bd", &state_arg], &[("HOME", empty.as_os_str())]).await;
    assert!(st.success() && out.lines().count() == 2 && err.contains("from the node's store"), "{out}{err}");
    assert!(server.api.log().is_empty());
}

/// A child process killed (and reaped) when the test ends, passed or not.
struct Reaped(std::process::Child);

impl Drop for Reaped {
    fn drop(&mut self) {
        if self.0.try_wait().ok().flatten().is_none() {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
}

/// GET `path` from 127.0.0.1:`port`; the body when the answer is 200.
async fn http_get(port: u16, path: &str) -> Option<String> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut c = tokio::net::TcpStream::connect(("127.0.0.1", port)).await.ok()?;
    c.write_all(format!("GET {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n").as_bytes()).await.ok()?;
    let mut reply = String::new();
    tokio::time::timeout(Duration::from_secs(30), c.read_to_string(&mut reply)).await.ok()?.ok()?;
    let (head, body) = reply.split_once("\r\n\r\n")?;
    head.starts_with("HTTP/1.1 200").then(|| body.to_string())
}

/// The value of the sample `series` (name and labels as printed).
fn sample(scrape: &str, series: &str) -> Option<f64> {
    scrape.lines().find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.trim().parse().ok())
}

/// M7: the agent itself, pointed at the stand-in by nothing but a
/// kubeconfig (no --kube: a configured cluster is found): this machine's
/// devices become BlockDevices labelled with the node, its StorageNode
/// (refused once here, with a 422) shows as refused on /metrics, `volring
/// get -o json` reads them back from the cluster, and SIGTERM stops it
/// cleanly.
#[tokio::test]
async fn the_agent_publishes_to_the_cluster_its_kubeconfig_names() {
    let server = Server::start().await;
    server.api.inject(Fault {
        status: 422,
        retry_after: None,
        method: Some(Method::PATCH),
        path_contains: "storagenodes".into(),
        times: 1,
    });
    let dir = tempfile::tempdir().unwrap();
    let cfg = kubeconfig_for(&server, dir.path());
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let kubelet = dir.path().join("kubelet");
    std::fs::create_dir(&kubelet).unwrap();
    let mut agent = Reaped(
        std::process::Command::new(env!("CARGO_BIN_EXE_volring"))
            .args(["node", "--node-id", "e2e-node", "--publish-window", "0.2", "--metrics-addr", &format!("127.0.0.1:{port}")])
            .arg("--state-dir")
            .arg(dir.path().join("state"))
            .arg("--kubelet-root")
            .arg(&kubelet)
            .arg("--csi-endpoint")
            .arg(format!("unix://{}", dir.path().join("csi.sock").display()))
            .env_clear()
            .env("PATH", "/usr/bin:/bin")
            .env("NODE_NAME", "e2e-node")
            .env("HOME", dir.path())
            .env("KUBECONFIG", &cfg)
            .env("RUST_LOG", "volring=info")
            .stdout(std::process::Stdio::null())
            .stderr(std::fs::File::create(dir.path().join("agent.log")).unwrap())
            .spawn()
            .unwrap(),
    );
    let log = || std::fs::read_to_string(dir.path().join("agent.log")).unwrap_or_default();
    let mut scrape = String::new();
    for _ in 0..600 {
        assert!(agent.0.try_wait().unwrap().is_none(), "the agent exited:\n{}", log());
        if let Some(s) = http_get(port, "/metrics").await {
            if sample(&s, "volring_publish_refused_total") == Some(1.0) && !bd_names_of(&server, "e2e-node").is_empty() {
                scrape = s;
                break;
            }
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(!scrape.is_empty(), "no BlockDevice of e2e-node and a refusal on /metrics:\n{}", log());
    let mine = bd_names_of(&server, "e2e-node");
    assert!(sample(&scrape, "volring_publish_writes_total{part=\"main\"}").is_some_and(|n| n >= mine.len() as f64), "{scrape}");
    assert!(log().contains("publishing to the cluster") && log().contains(&cfg.display().to_string()), "{}", log());
    for name in &mine {
        let o = server.api.object("blockdevices", name).unwrap();
        assert_eq!(o["spec"]["nodeName"], "e2e-node");
        assert_eq!(o["status"]["state"], "Active");
    }

    let (st, out, err) = volring(&["get", "bd", "-o", "json"], &[("HOME", dir.path().as_os_str()), ("KUBECONFIG", cfg.as_os_str())]).await;
    assert!(st.success(), "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    let mut listed: Vec<String> = v["items"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|i| i["spec"]["nodeName"] == "e2e-node")
        .map(|i| i["metadata"]["name"].as_str().unwrap().to_string())
        .collect();
    listed.sort();
    assert_eq!(listed, bd_names_of(&server, "e2e-node"));

    let pid = rustix::process::Pid::from_raw(agent.0.id() as i32).unwrap();
    rustix::process::kill_process(pid, rustix::process::Signal::TERM).unwrap();
    let mut status = None;
    for _ in 0..400 {
        status = agent.0.try_wait().unwrap();
        if status.is_some() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let Some(status) = status else {
        panic!("the agent did not stop within 20 s of SIGTERM:\n{}", log());
    };
    assert!(status.success(), "{status}:\n{}", log());
    assert!(log().contains("publisher stopped"), "{}", log());
}

/// The feed at run time: a device removed is retired (Inactive), one that
/// changes is written once, one that did not is not submitted at all.
#[tokio::test]
async fn the_feed_retires_a_removed_device_and_submits_only_changes() {
    use volring::publisher::feed::Feed;
    let mut inv = cloned_inventory("n1", 3);
    let initial = Feed::initial(&inv, "n1", objects::storage_node("n1", None, vec![]));
    let server = Server::start().await;
    let sink = Arc::new(KubeSink::new(server.config()).unwrap());
    let up = Updater::start(sink, config("n1"), initial.clone());
    let mut feed = Feed::default();
    feed.seed(&initial);
    until("the devices", || bd_names_of(&server, "n1").len() == 3).await;
    let before = up.stats().snapshot().submitted;
    let devs: Vec<_> = inv.devices.keys().copied().collect();
    inv.devices.remove(&devs[0]);
    inv.devices.get_mut(&devs[1]).unwrap().size_bytes += 1 << 20;
    feed.devices(&up, &inv, "n1");
    feed.devices(&up, &inv, "n1");
    assert_eq!(up.stats().snapshot().submitted - before, 2, "one retire and one change; nothing for the third, or for the repeat");
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
