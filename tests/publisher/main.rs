//! The publisher against the API stand-in (tests/kube_support) and against
//! the node's embedded store: coalescing, restarts, 429/500/409, devices
//! that are gone, shutdown, storms, concurrency.
//!
//! Every wait is bounded; nothing here asserts how fast anything is.
//! The tests live in one module per theme; this file holds the helper they
//! share.

#[path = "../kube_support/mod.rs"]
mod kube_support;
#[path = "../publisher_support/mod.rs"]
mod publisher_support;

mod api;
mod throttle;
mod writes;

use std::sync::Arc;
use std::time::Duration;

use axum::http::Method;
use kube_support::{Fault, Server};
use publisher_support::*;
use serde_json::json;
use volring_kube::kube_sink::KubeSink;
use volring_kube::{GonePolicy, Updater, UpdaterConfig};
use volring_kube::{Kind, Object};

/// A stored object of `node` numbered `i` for a status storm.
async fn seeded(server: &Server, sink: &Arc<KubeSink>, c: &UpdaterConfig, n: usize) -> Vec<Object> {
    let objs: Vec<Object> = (0..n).map(|i| bd(&c.node, i, 0)).collect();
    let s = Updater::start(sink.clone(), c.clone(), objs.clone()).shutdown(Duration::from_secs(10)).await;
    assert_eq!(s.writes_status, n as u64);
    server.api.clear_log();
    objs
}
