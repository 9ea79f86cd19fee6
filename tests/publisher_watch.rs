//! The publisher's watch of its node's objects across an API server
//! restart (issue 29): bookmarks keep its resourceVersion current while
//! only other nodes' objects change, so after the restart — when the
//! server's watch cache starts again empty at the current version — it
//! resumes from there, with no LIST, and still sees what changed.
//!
//! Every wait is bounded; nothing here asserts how fast anything is.

mod kube_support;
mod publisher_support;

use std::sync::Arc;
use std::time::Duration;

use axum::http::Method;
use kube_support::Server;
use publisher_support::*;
use serde_json::json;
use volring_kube::kube_sink::KubeSink;
use volring_kube::Object;
use volring_kube::Updater;

/// The resourceVersion a watch request resumed from.
fn resumed_from(query: &str) -> Option<u64> {
    query.split('&').find_map(|kv| kv.strip_prefix("resourceVersion=")).and_then(|v| v.parse().ok())
}

#[tokio::test]
async fn a_restarted_api_server_is_watched_again_from_the_last_bookmark_without_a_list() {
    let server = Server::start().await;
    server.api.set_bookmark_every(Duration::from_millis(50));
    let sink = Arc::new(KubeSink::new(server.config()).unwrap());
    let bds: Vec<Object> = (0..3).map(|i| bd("n1", i, 1)).collect();
    let up = Updater::start(sink, config("n1"), bds.clone());
    until("the objects", || bds.iter().all(|o| stored_status(&server, o) == o.status)).await;
    until("the watches", || server.api.log().iter().filter(|l| l.is_watch()).count() == 2).await;
    let listed_at = server.api.resource_version();

    // Another node's objects change: this node's watch sees none of it,
    // only bookmarks at the versions the server reached.
    for i in 0..20 {
        let o = bd("n2", i, 1);
        server.api.seed(
            "blockdevices",
            json!({"apiVersion": "volring.io/v1alpha1", "kind": "BlockDevice",
            "metadata": {"name": o.key.name, "labels": o.labels}, "spec": o.spec}),
        );
    }
    let reached = server.api.resource_version();
    assert!(reached > listed_at);
    until("a bookmark at the latest version", || server.api.last_bookmark("blockdevices") >= reached).await;

    // The restart: connections drop, the watch cache starts again at
    // `reached`, and right after it someone edits one of n1's objects.
    server.api.set_outage(true);
    server.api.restart();
    server.api.clear_log();
    server.api.edit("blockdevices", &bds[1].key.name, |o| o["status"]["claimState"] = json!("InUse"));
    server.api.set_outage(false);

    until("bd1 repaired", || stored_status(&server, &bds[1]) == bds[1].status).await;
    let s = up.shutdown(Duration::from_secs(10)).await;
    assert_eq!(s.repairs, 1, "{s:?}");
    let log = server.api.log();
    let lists: Vec<_> = log.iter().filter(|l| l.method == Method::GET && !l.is_watch() && !l.path.contains("/blockdevices/")).collect();
    assert!(lists.is_empty(), "listed again after the restart: {lists:#?}");
    let watches: Vec<_> = log.iter().filter(|l| l.is_watch() && l.path.ends_with("/blockdevices") && l.status == 200).collect();
    assert!(!watches.is_empty(), "watched again: {log:#?}");
    for w in &watches {
        let from = resumed_from(&w.query);
        assert!(from.is_some_and(|v| v >= reached), "resumed from {from:?}, the last bookmark was at {reached}: {}", w.query);
    }
}
