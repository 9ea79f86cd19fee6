//! The publisher against the API stand-in (tests/kube_support) and against
//! the node's embedded store: coalescing, restarts, 429/500/409, devices
//! that are gone, shutdown, storms, concurrency.
//!
//! Every wait is bounded; nothing here asserts how fast anything is.

mod kube_support;
mod publisher_support;

use std::sync::Arc;
use std::time::Duration;

use axum::http::Method;
use kube_support::{Fault, Server};
use publisher_support::*;
use serde_json::json;
use volring_kube::embedded_sink::EmbeddedSink;
use volring_kube::kube_sink::KubeSink;
use volring_kube::objects::{self, Kind, Object};
use volring_kube::{GonePolicy, Updater, UpdaterConfig};

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
    // One request at a time: the floor. A 429 there says even one is too
    // many, so the next request (of any object) waits the Retry-After too.
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
    let log: Vec<_> = server.api.log().into_iter().filter(|l| !l.is_watch()).collect();
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
        let mut v = volring_kube::embedded_sink::api_form(o);
        v["metadata"]["labels"]["volring.io/node"] = json!("n1");
        server.api.seed("blockdevices", v);
    }
    server.api.seed("blockdevices", volring_kube::embedded_sink::api_form(&bd("n2", 0, 0)));
    let listed = volring_kube::Sink::list(&*sink, Kind::BlockDevice, "n1").await.unwrap();
    assert_eq!(listed.len(), 1203);
    let pages = server.api.log().iter().filter(|l| l.query.contains("limit=500")).count();
    assert_eq!(pages, 3);
}

#[tokio::test]
async fn with_no_cluster_the_objects_land_in_the_store_and_a_restart_writes_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join(volring_volumes::store::FILE);
    let objs: Vec<Object> = (0..20).map(|i| bd("n1", i, 3)).collect();
    {
        let store = Arc::new(volring_volumes::store::Store::open(&path).unwrap());
        let up = Updater::start(Arc::new(EmbeddedSink::new(store)), config("n1"), vec![]);
        for g in 0..4 {
            for i in 0..20 {
                up.submit(bd("n1", i, g));
            }
        }
        let stats = up.shutdown(Duration::from_secs(10)).await;
        assert_eq!((stats.writes_main, stats.writes_status), (20, 20));
    }
    let seen = volring_volumes::store::Store::read_only(&path, true).unwrap().published;
    assert_eq!(seen.len(), 20);
    for o in &objs {
        let key = volring_kube::embedded_sink::store_key(&o.key);
        let (_, bytes) = seen.iter().find(|(k, _)| *k == key).expect("stored");
        let back = Object::from_api(Kind::BlockDevice, &serde_json::from_slice(bytes).unwrap()).unwrap();
        assert_eq!(&back, o);
    }
    let store = Arc::new(volring_volumes::store::Store::open(&path).unwrap());
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
    let (table, _) = volring_mounts::MountTable::from_mountinfo(&mountinfo);
    let cfg = volring_devices::ScanConfig { probe: false, ..Default::default() };
    let mut inv = volring_devices::Inventory::scan(&cfg, &table).unwrap();
    inv.link(&table, "n1");
    let node = objects::storage_node("n1", None, vec![]);
    let initial = volring_kube::feed::Feed::initial(&inv, "n1", node);
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
    assert!(log.iter().all(|l| l.path == attachments::PATH && l.status == 200 && l.query.contains("limit=500")), "{log:?}");
    assert!(log.iter().all(|l| !l.query.contains("fieldSelector")));
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
        let lists = || {
            server
                .api
                .log()
                .into_iter()
                .filter(|l| l.method == Method::GET && !l.is_watch() && l.path.ends_with("blockdevices"))
                .collect::<Vec<_>>()
        };
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

/// Issue 29: a 429 halves the requests in flight (the updater then keeps
/// to two) and only the throttled object waits its Retry-After: the other
/// objects are written meanwhile. (Before, every request paused.)
#[tokio::test]
async fn a_429_halves_the_requests_in_flight_and_only_its_object_waits() {
    let server = Server::start().await;
    let sink = Arc::new(KubeSink::new(server.config()).unwrap());
    let mut c = config("n1");
    let objs = seeded(&server, &sink, &c, 40).await;
    // No growth back during the test: the halved limit is what is seen.
    (c.concurrency, c.grow_every) = (4, Duration::from_secs(3600));
    server.api.set_hold(Duration::from_millis(100));
    server.api.inject(Fault { status: 429, retry_after: Some(2), method: Some(Method::PATCH), path_contains: String::new(), times: 1 });
    let up = Updater::start(sink, c, objs);
    until("the initial lists", || server.api.log().len() >= 2).await;
    let now: Vec<Object> = (0..40).map(|i| bd("n1", i, 1)).collect();
    for o in &now {
        up.submit(o.clone());
    }
    let limit = || up.stats().limit.load(std::sync::atomic::Ordering::Relaxed);
    until("the limit halved", || limit() == 2).await;
    let cut = std::time::Instant::now();
    until("every object", || now.iter().all(|o| stored_status(&server, o) == o.status)).await;
    let s = up.shutdown(Duration::from_secs(10)).await;
    assert_eq!((s.throttled, s.limit), (1, 2), "{s:?}");
    let log = server.api.log();
    let t = log.iter().position(|l| l.status == 429).expect("the 429");
    let throttled = &log[t];
    let retried = log[t + 1..].iter().position(|l| l.path == throttled.path).map(|i| t + 1 + i).expect("its retry");
    let waited = log[retried].started - throttled.at;
    assert!(waited >= Duration::from_secs(2), "the throttled object was sent again {waited:?} after a 429 asking for 2 s");
    let between = log[t + 1..retried].iter().filter(|l| l.is_write()).count();
    assert!(between >= 10, "only {between} writes of other objects while the throttled one waited");
    // Every request that reached the server after the cut found at most one
    // other in flight.
    for r in log.iter().filter(|l| l.started >= cut) {
        let at_once = log.iter().filter(|l| l.started <= r.started && r.started < l.at).count();
        assert!(at_once <= 2, "{at_once} requests in flight after the limit was halved to 2");
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

/// Waits (bounded by `limit`) until `f` holds; false if it never did.
async fn within(limit: Duration, mut f: impl FnMut() -> bool) -> bool {
    let end = std::time::Instant::now() + limit;
    while std::time::Instant::now() < end {
        if f() {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    f()
}

/// `n` BlockDevices of n1 stored at generation 0, as another writer left them.
fn stored_at_zero(server: &Server, n: usize) -> Vec<Object> {
    let objs: Vec<Object> = (0..n).map(|i| bd("n1", i, 0)).collect();
    for o in &objs {
        server.api.seed("blockdevices", volring_kube::embedded_sink::api_form(o));
    }
    objs
}

/// Issue 29: kube-apiserver run with `--max-requests-inflight=1
/// --max-mutating-requests-inflight=1` answers a request beyond the one in
/// flight 429 with `Retry-After: 1`. 300 objects to write, four requests
/// allowed in flight: the updater must find the server's capacity, so few
/// requests are rejected for each accepted one, and everything converges.
/// (Before: four requests at once and a pause for every 429 — one write a
/// second and three rejected for each.)
#[tokio::test]
async fn a_throttled_server_rejects_few_requests_and_everything_converges() {
    let server = Server::start().await;
    let n = 300;
    stored_at_zero(&server, n);
    server.api.set_hold(Duration::from_millis(5));
    server.api.set_max_in_flight(Some(1), Some(1));
    let mut c = config("n1");
    c.concurrency = 4;
    let want: Vec<Object> = (0..n).map(|i| bd("n1", i, 1)).collect();
    let up = Updater::start(Arc::new(KubeSink::new(server.config()).unwrap()), c, want.clone());
    let written = || want.iter().filter(|o| stored_status(&server, o) == o.status).count();
    let converged = within(Duration::from_secs(60), || written() == n).await;
    let log = server.api.log();
    let accepted = log.iter().filter(|l| l.is_write()).count();
    let rejected = log.iter().filter(|l| l.status == 429).count();
    let ratio = rejected as f64 / accepted.max(1) as f64;
    let figures =
        format!("{} of {n} objects written, {accepted} writes accepted, {rejected} requests rejected ({ratio:.2} per accepted)", written());
    println!("{figures}");
    assert!(converged, "not converged within 60 s: {figures}");
    assert!(ratio <= 0.5, "{figures}");
    let s = up.shutdown(Duration::from_secs(10)).await;
    assert_eq!((s.writes_status, s.abandoned), (n as u64, 0), "{s:?}");
}

/// Issue 29: an outage (every request answered 503) while 300 objects wait
/// to be written. The queue waits behind one probe at a time rather than
/// every object retrying on its own backoff (far fewer 503s than objects),
/// and once the server answers again every object is written.
#[tokio::test]
async fn during_an_outage_one_probe_at_a_time_and_everything_converges_after() {
    let server = Server::start().await;
    let n = 300;
    let objs = stored_at_zero(&server, n);
    let up = Updater::start(Arc::new(KubeSink::new(server.config()).unwrap()), config("n1"), objs);
    until("the initial lists", || server.api.log().iter().filter(|l| l.status == 200).count() >= 2).await;
    server.api.set_outage(true);
    let want: Vec<Object> = (0..n).map(|i| bd("n1", i, 1)).collect();
    for o in &want {
        up.submit(o.clone());
    }
    // The outage lasts a few seconds (not a measurement: long enough for
    // per-object backoffs to grow past a second).
    tokio::time::sleep(Duration::from_secs(4)).await;
    let during = server.api.log().iter().filter(|l| l.status == 503).count();
    server.api.set_outage(false);
    let written = || want.iter().filter(|o| stored_status(&server, o) == o.status).count();
    let converged = within(Duration::from_secs(60), || written() == n).await;
    println!("{during} requests failed during the outage");
    assert!(converged, "{} of {n} written after the outage", written());
    assert!(during <= 30, "{during} requests failed during a 4 s outage with {n} objects queued: not one probe at a time");
    let s = up.shutdown(Duration::from_secs(10)).await;
    assert_eq!(s.abandoned, 0, "{s:?}");
}

/// Issue 29: every request names volring, its version and its node in the
/// User-Agent (`volring/<version> (<node>)`): writes, LISTs, the re-read
/// after a conflict, the healer's VolumeAttachment listing.
#[tokio::test]
async fn every_request_names_volring_and_its_node() {
    let server = Server::start().await;
    let want = volring_share::kube::user_agent("n1");
    assert_eq!(want, format!("volring/{} (n1)", env!("CARGO_PKG_VERSION")));
    let sink = Arc::new(KubeSink::for_node(server.config(), "n1").unwrap());
    let o = bd("n1", 1, 1);
    server.api.inject(Fault { status: 409, retry_after: None, method: Some(Method::PATCH), path_contains: o.key.name.clone(), times: 1 });
    Updater::start(sink.clone(), config("n1"), vec![o, bd("n1", 2, 1)]).shutdown(Duration::from_secs(10)).await;
    volring_kube::attachments::attached_here(&sink, "volring.csi.io", "n1").await.unwrap();
    let log = server.api.log();
    assert!(log.iter().any(|l| l.method == Method::GET && l.path.ends_with(&bd("n1", 1, 1).key.name)), "the re-read: {log:#?}");
    assert!(log.iter().any(|l| l.path == volring_kube::attachments::PATH));
    for l in &log {
        assert_eq!(l.user_agent.as_deref(), Some(want.as_str()), "{} {}", l.method, l.path);
    }
    // Not told the node: the one the agent would publish for.
    server.api.clear_log();
    let sink = KubeSink::new(server.config()).unwrap();
    volring_kube::Sink::list(&sink, Kind::StorageNode, "n1").await.unwrap();
    let ua = volring_share::kube::user_agent(&volring_devices::node_name());
    assert_eq!(server.api.log()[0].user_agent.as_deref(), Some(ua.as_str()));
}

/// Issue 29: the updater watches its node's objects (label selected). One
/// deleted, one whose status someone edited, one whose node label was
/// removed, and the StorageNode's spec edited: each is written again as
/// the agent last wanted it, and only what differs (a read first, since
/// the watch also shows the agent's own writes, maybe late).
#[tokio::test]
async fn objects_deleted_or_edited_behind_the_agents_back_are_written_again() {
    let server = Server::start().await;
    let sink = Arc::new(KubeSink::new(server.config()).unwrap());
    let bds: Vec<Object> = (0..3).map(|i| bd("n1", i, 1)).collect();
    let sn = objects::storage_node("n1", None, vec![]);
    let mut all = bds.clone();
    all.push(sn.clone());
    let up = Updater::start(sink, config("n1"), all);
    until("the objects", || bds.iter().all(|o| stored_status(&server, o) == o.status) && server.api.object("storagenodes", "n1").is_some())
        .await;
    until("the watches", || server.api.log().iter().filter(|l| l.is_watch()).count() == 2).await;
    server.api.clear_log();

    let client = kube::Client::try_from(server.config()).unwrap();
    let req = http::Request::delete(format!("/apis/volring.io/v1alpha1/blockdevices/{}", bds[0].key.name)).body(Vec::new()).unwrap();
    client.request::<serde_json::Value>(req).await.expect("delete bd0");
    server.api.edit("blockdevices", &bds[1].key.name, |o| o["status"]["state"] = json!("Inactive"));
    server.api.edit("blockdevices", &bds[2].key.name, |o| {
        o["metadata"]["labels"].as_object_mut().unwrap().remove(objects::NODE_LABEL);
    });
    server.api.edit("storagenodes", "n1", |o| o["spec"]["nodeName"] = json!("someone-else"));

    let label = |o: &Object| server.api.object("blockdevices", &o.key.name).map(|v| v["metadata"]["labels"][objects::NODE_LABEL].clone());
    until("bd0 back", || stored_status(&server, &bds[0]) == bds[0].status).await;
    until("bd1's status back", || stored_status(&server, &bds[1]) == bds[1].status).await;
    until("bd2's label back", || label(&bds[2]) == Some(json!("n1"))).await;
    until("the StorageNode's spec back", || server.api.object("storagenodes", "n1").unwrap()["spec"] == sn.spec).await;
    let s = up.shutdown(Duration::from_secs(10)).await;
    assert_eq!(s.repairs, 4, "{s:?}");
    let log = server.api.log();
    let patches: Vec<_> = log.iter().filter(|l| l.method == Method::PATCH).map(|l| l.path.clone()).collect();
    // bd0: created again (main, status); bd1: status; bd2: main (labels);
    // the StorageNode: main.
    assert_eq!(patches.len(), 5, "{patches:#?}");
    assert!(log.iter().filter(|l| l.method == Method::GET && !l.is_watch()).count() >= 4, "each read before it is written");
}

/// Issue 29: a watch resumed after the server compacted its history (410
/// Expired) LISTs again, and what changed meanwhile is repaired.
#[tokio::test]
async fn a_watch_whose_history_is_gone_lists_again_and_repairs() {
    let server = Server::start().await;
    let sink = Arc::new(KubeSink::new(server.config()).unwrap());
    let bds: Vec<Object> = (0..3).map(|i| bd("n1", i, 1)).collect();
    let up = Updater::start(sink, config("n1"), bds.clone());
    until("the objects", || bds.iter().all(|o| stored_status(&server, o) == o.status)).await;
    until("the watches", || server.api.log().iter().filter(|l| l.is_watch()).count() == 2).await;
    // The edit is never sent on the stream: it stalls, and then the
    // server forgets the history the watch would resume from.
    server.api.set_watch_stall(true);
    server.api.edit("blockdevices", &bds[1].key.name, |o| o["status"]["claimState"] = json!("InUse"));
    server.api.clear_log();
    server.api.compact();
    server.api.set_watch_stall(false);
    until("bd1 repaired", || stored_status(&server, &bds[1]) == bds[1].status).await;
    let s = up.shutdown(Duration::from_secs(10)).await;
    assert_eq!(s.repairs, 1, "{s:?}");
    let lists = server.api.log().iter().filter(|l| l.method == Method::GET && !l.is_watch() && l.path.ends_with("/blockdevices")).count();
    assert!(lists >= 1, "listed again: {:#?}", server.api.log());
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
    let mut body = o.main_body();
    body["spec"]["colour"] = json!("blue");
    let (code, _, reply) = raw(&server, Method::PATCH, &format!("{url}&fieldValidation=Strict"), body.clone()).await;
    assert_eq!(code, 400, "{reply}");
    assert!(reply["message"].as_str().unwrap().contains("unknown field \"spec.colour\""), "{reply}");
    let (code, warnings, reply) = raw(&server, Method::PATCH, &url, body).await;
    assert_eq!((code, warnings), (201, vec!["299 - \"unknown field \\\"spec.colour\\\"\"".to_string()]), "{reply}");
    assert!(server.api.object("blockdevices", &o.key.name).unwrap()["spec"].get("colour").is_none(), "dropped");

    let mut bad = o.status_body();
    bad["status"]["state"] = json!("Bogus");
    let (code, _, reply) = raw(&server, Method::PATCH, &status_url, bad).await;
    assert_eq!(code, 422, "{reply}");
    assert!(reply["message"].as_str().unwrap().contains("status.state: Unsupported value: \"Bogus\""), "{reply}");
    let mut bad = o.main_body();
    bad["spec"]["capacity"]["storage"] = json!("a lot");
    let (code, _, reply) = raw(&server, Method::PATCH, &url, bad).await;
    assert_eq!(code, 422, "{reply}");
    assert!(reply["message"].as_str().unwrap().contains("spec.capacity.storage in body must be of type integer"), "{reply}");
    let mut bad = o.main_body();
    bad["metadata"]["labels"][objects::NODE_LABEL] = json!("n".repeat(64));
    let (code, _, reply) = raw(&server, Method::PATCH, &url, bad).await;
    assert_eq!(code, 422, "{reply}");
    assert!(reply["message"].as_str().unwrap().contains("at most 63 characters"), "{reply}");

    let (code, _, reply) = raw(&server, Method::PATCH, &status_url, o.status_body()).await;
    assert_eq!(code, 200, "{reply}");
    let mut empty = o.status_body();
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
    let up = Updater::start(Arc::new(KubeSink::new(server.config()).unwrap()), config("n1"), vec![]);
    let mut o = bd("n1", 1, 1);
    o.status["state"] = json!("Exploded");
    up.submit(o.clone());
    until("the refusal", || up.stats().refused.load(std::sync::atomic::Ordering::Relaxed) == 1).await;
    let s = up.shutdown(Duration::from_secs(5)).await;
    assert_eq!((s.writes_main, s.writes_status, s.refused), (1, 0, 1), "{s:?}");
    assert!(stored_status(&server, &o).is_null(), "the object is there, without the refused status");
}
