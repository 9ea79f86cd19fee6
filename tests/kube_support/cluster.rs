//! The stand-in's read-only core/v1 objects for the agent's name lookup:
//! PersistentVolumes (cluster-scoped: GET by name, LIST) and Pods (LIST of
//! all namespaces with the field selector `spec.nodeName=<node>`, as the
//! real server allows it on pods; any other field a 400). Seeded by the
//! test, as the provisioner and the scheduler would have made them. LISTs
//! honour `limit` with an opaque `continue` token.

use std::collections::BTreeMap;

use axum::http::{Method, StatusCode};
use axum::response::Response;
use serde_json::{json, Value};

use super::{query_pairs, reply, status_body, Inner};

/// Answers `/api/v1/<rest>` when it is one of these; `None` otherwise.
pub(super) fn serve(g: &Inner, method: &Method, rest: &str, query: &str) -> Option<Response> {
    let (plural, name) = match rest.split_once('/') {
        Some((p, n)) => (p, Some(n)),
        None => (rest, None),
    };
    if !matches!(plural, "persistentvolumes" | "pods") {
        return None;
    }
    if method != Method::GET {
        let code = StatusCode::METHOD_NOT_ALLOWED;
        return Some(reply(code, status_body(code, "MethodNotAllowed", "read-only in the stand-in")));
    }
    let of_kind = || g.cluster.iter().filter(move |((p, _), _)| p == plural).map(|(_, o)| o);
    if let Some(n) = name {
        if plural == "pods" {
            return Some(bad("the stand-in serves pods as a LIST only"));
        }
        return Some(match g.cluster.get(&(plural.to_string(), n.to_string())) {
            Some(o) => reply(StatusCode::OK, o.clone()),
            None => reply(StatusCode::NOT_FOUND, status_body(StatusCode::NOT_FOUND, "NotFound", &format!("{plural} \"{n}\" not found"))),
        });
    }
    let q = query_pairs(query);
    let mut items: Vec<Value> = of_kind().cloned().collect();
    if let Some(sel) = q.get("fieldSelector").filter(|s| !s.is_empty()) {
        let Some(node) = sel.strip_prefix("spec.nodeName=").filter(|_| plural == "pods") else {
            return Some(bad(&format!("\"{sel}\" is not a known field selector: only \"spec.nodeName\"")));
        };
        items.retain(|o| o["spec"]["nodeName"] == node);
    }
    let start: usize = q.get("continue").and_then(|c| c.parse().ok()).unwrap_or(0);
    let limit: usize = q.get("limit").and_then(|l| l.parse().ok()).filter(|&l| l > 0).unwrap_or(usize::MAX);
    let page: Vec<Value> = items.iter().skip(start).take(limit).cloned().collect();
    let next = start + page.len();
    let mut meta = json!({"resourceVersion": g.rv.to_string()});
    if next < items.len() {
        meta["continue"] = json!(next.to_string());
    }
    let kind = if plural == "pods" { "PodList" } else { "PersistentVolumeList" };
    Some(reply(StatusCode::OK, json!({"apiVersion": "v1", "kind": kind, "metadata": meta, "items": page})))
}

/// Key of a seeded object: (plural, name), a pod's name with its namespace.
pub(super) fn key(plural: &str, obj: &Value) -> (String, String) {
    let name = obj["metadata"]["name"].as_str().expect("metadata.name").to_string();
    match obj["metadata"]["namespace"].as_str() {
        Some(ns) if plural == "pods" => (plural.to_string(), format!("{ns}/{name}")),
        _ => (plural.to_string(), name),
    }
}

pub(super) type Objects = BTreeMap<(String, String), Value>;

fn bad(msg: &str) -> Response {
    reply(StatusCode::BAD_REQUEST, status_body(StatusCode::BAD_REQUEST, "BadRequest", msg))
}
