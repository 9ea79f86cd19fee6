//! The stand-in's watch of volring resources, with the real server's
//! semantics as a client can observe them:
//!
//! - `GET .../{plural}?watch=true` answers 200 and then a stream of events,
//!   one JSON object a line: `ADDED`, `MODIFIED`, `DELETED` (the object as
//!   it was last, at the deletion's resourceVersion), `BOOKMARK` (only with
//!   `allowWatchBookmarks=true`: the resourceVersion the stream has
//!   reached, every [`super::StandIn::set_bookmark_every`]) and `ERROR`.
//! - `resourceVersion` absent or `0`: first an `ADDED` for every object
//!   there now, then what changes. A version: every change after it, in
//!   order; one older than the history kept (see
//!   [`super::StandIn::compact`]) is answered by a single `ERROR` event
//!   with a 410 Expired Status, as etcd's compaction makes the server do.
//! - `labelSelector` as in a LIST; an object that stops matching is sent
//!   as `DELETED`, one that starts matching as `ADDED`.
//! - `timeoutSeconds` ends the stream (default 30 min). An outage ends
//!   every stream, as the connections drop. A watch is long-running: the
//!   max-in-flight limits do not count it.

use std::collections::BTreeMap;
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::http::StatusCode;
use axum::response::Response;
use serde_json::{json, Value};

use super::{matches, reply, status_body, Inner, StandIn};

/// One change to a volring object (or a core one, `plural` then being
/// [`super::core::watch_key`]), kept for watches.
#[derive(Debug, Clone)]
pub(super) struct Event {
    pub rv: u64,
    pub plural: String,
    pub before: Option<Value>,
    pub after: Option<Value>,
}

/// How many changes are kept; older ones are compacted away.
const HISTORY: usize = 50_000;

/// Records a change (`after` None: deleted) and wakes the watches.
pub(super) fn record(g: &mut Inner, plural: &str, before: Option<Value>, after: Option<Value>) {
    g.events.push_back(Event { rv: g.rv, plural: plural.to_string(), before, after });
    while g.events.len() > HISTORY {
        let e = g.events.pop_front().expect("not empty");
        g.compacted = e.rv;
    }
    g.changed.notify_waiters();
}

/// The event a watch whose selectors pass `wanted` sends for `e`, if any.
fn event_for(e: &Event, wanted: &dyn Fn(&Value) -> bool) -> Option<Value> {
    let was = e.before.as_ref().is_some_and(wanted);
    let is = e.after.as_ref().is_some_and(wanted);
    let (kind, obj) = match (was, is) {
        (false, true) => ("ADDED", e.after.clone()?),
        (true, true) => ("MODIFIED", e.after.clone()?),
        (true, false) => {
            let mut last = e.after.clone().or_else(|| e.before.clone())?;
            last["metadata"]["resourceVersion"] = json!(e.rv.to_string());
            ("DELETED", last)
        }
        (false, false) => return None,
    };
    Some(json!({"type": kind, "object": obj}))
}

fn line(v: &Value) -> Result<Bytes, std::convert::Infallible> {
    let mut b = serde_json::to_vec(v).expect("serialises");
    b.push(b'\n');
    Ok(Bytes::from(b))
}

/// Serves one watch request of `plural`.
pub(super) fn serve(api: &StandIn, plural: &str, q: &BTreeMap<String, String>) -> Response {
    let selector = q.get("labelSelector").cloned().unwrap_or_default();
    let fields = match super::core::field_terms(q.get("fieldSelector").map_or("", String::as_str)) {
        Ok(t) => t,
        Err(m) => return reply(StatusCode::BAD_REQUEST, status_body(StatusCode::BAD_REQUEST, "BadRequest", &m)),
    };
    let wanted = move |o: &Value| matches(o, &selector) && super::core::fields_match(o, &fields);
    let bookmarks = q.get("allowWatchBookmarks").is_some_and(|b| b == "true" || b == "1");
    let timeout = Duration::from_secs(q.get("timeoutSeconds").and_then(|t| t.parse().ok()).unwrap_or(1800));
    let from = q.get("resourceVersion").cloned().unwrap_or_default();
    let (tx, rx) = tokio::sync::mpsc::channel(256);
    let mut cursor;
    {
        let g = api.lock();
        match from.as_str() {
            "" | "0" => {
                cursor = g.rv;
                let volring = g.objects.iter().filter(|((p, _), _)| p == plural).map(|(_, s)| &s.obj);
                let core = g.core.iter().filter(|((ns, p, _), _)| super::core::watch_key(ns, p) == plural).map(|(_, o)| o);
                for obj in volring.chain(core).filter(|o| wanted(o)) {
                    let _ = tx.try_send(line(&json!({"type": "ADDED", "object": obj})));
                }
            }
            v => match v.parse::<u64>() {
                Ok(v) => cursor = v,
                Err(_) => {
                    let code = StatusCode::BAD_REQUEST;
                    return reply(code, status_body(code, "BadRequest", &format!("invalid resource version: {v}")));
                }
            },
        }
    }
    let api = api.clone();
    let plural = plural.to_string();
    tokio::spawn(async move {
        let end = tokio::time::Instant::now() + timeout;
        let generation = api.lock().watch_generation;
        let mut next_bookmark = tokio::time::Instant::now() + api.bookmark_every();
        loop {
            let changed = api.changed();
            let changed = changed.notified();
            tokio::pin!(changed);
            changed.as_mut().enable();
            if api.flight.lock().unwrap().outage {
                return;
            }
            let (events, expired, rv) = {
                let g = api.lock();
                if g.watch_generation != generation {
                    return;
                }
                if g.watch_stall {
                    (vec![], false, cursor)
                } else if cursor < g.compacted {
                    (vec![], true, g.rv)
                } else {
                    let events: Vec<Value> =
                        g.events.iter().filter(|e| e.rv > cursor && e.plural == plural).filter_map(|e| event_for(e, &wanted)).collect();
                    (events, false, g.rv)
                }
            };
            if expired {
                let msg = format!("too old resource version: {cursor} ({rv})");
                let mut status = status_body(StatusCode::GONE, "Expired", &msg);
                status["code"] = json!(410);
                let _ = tx.send(line(&json!({"type": "ERROR", "object": status}))).await;
                return;
            }
            for e in events {
                if tx.send(line(&e)).await.is_err() {
                    return;
                }
            }
            if !api.lock().watch_stall {
                cursor = rv;
            }
            let now = tokio::time::Instant::now();
            if now >= end {
                return;
            }
            if now >= next_bookmark {
                next_bookmark = now + api.bookmark_every();
                if bookmarks {
                    let (kind, api_version) = match plural.strip_prefix("core:") {
                        Some(_) => ("PersistentVolumeClaim", "v1"),
                        None => (super::kind_of(&plural), "volring.io/v1alpha1"),
                    };
                    let b = json!({"type": "BOOKMARK", "object": {"kind": kind, "apiVersion": api_version,
                        "metadata": {"resourceVersion": cursor.to_string()}}});
                    if tx.send(line(&b)).await.is_err() {
                        return;
                    }
                    let mut g = api.lock();
                    let at = g.bookmarked.entry(plural.clone()).or_default();
                    *at = (*at).max(cursor);
                }
            }
            tokio::select! {
                _ = changed => {}
                _ = tokio::time::sleep_until(next_bookmark.min(end)) => {}
                _ = tx.closed() => return,
            }
        }
    });
    let mut r = Response::new(Body::from_stream(tokio_stream::wrappers::ReceiverStream::new(rx)));
    r.headers_mut().insert("content-type", axum::http::HeaderValue::from_static("application/json"));
    r
}
