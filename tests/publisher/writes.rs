//! What the publisher writes, and when: changes coalesce per window, a
//! restart writes nothing, a refused write is dropped, a gone device is
//! marked inactive, shutdown flushes, storms and full batches, and objects
//! changed behind its back are written again.

use super::*;

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
async fn a_refused_write_is_dropped_and_counted() {
    let server = Server::start().await;
    let stats = Arc::new(volring_kube::Stats::default());
    let mut c = config("n1");
    c.stats = Some(stats.clone());
    let up = Updater::start(Arc::new(KubeSink::new(server.config()).unwrap()), c, vec![]);
    let o = bd("n1", 1, 1);
    server.api.inject(Fault { status: 422, retry_after: None, method: Some(Method::PATCH), path_contains: o.key.name.clone(), times: 1 });
    up.submit(o.clone());
    until("the refusal", || stats.refused.load(std::sync::atomic::Ordering::Relaxed) == 1).await;
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
    let sn = volring_kube::node_feed::storage_node("n1", &[], None, None, None, &Default::default());
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
        o["metadata"]["labels"].as_object_mut().unwrap().remove(NODE_LABEL);
    });
    server.api.edit("storagenodes", "n1", |o| o["spec"]["nodeName"] = json!("someone-else"));

    let label = |o: &Object| server.api.object("blockdevices", &o.key.name).map(|v| v["metadata"]["labels"][NODE_LABEL].clone());
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
