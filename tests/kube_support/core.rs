//! The stand-in's core/v1 namespaced resources, for the shared-volume
//! controller: services, endpoints and persistentvolumeclaims under
//! `/api/v1/namespaces/{ns}/{plural}[/{name}]`, and discovery.k8s.io/v1
//! endpointslices under `/apis/discovery.k8s.io/v1/namespaces/...`, with
//! the real server's
//! HTTP semantics as the controller can observe them:
//!
//! - GET 200 or 404 (a Status); POST creates (201; 409 AlreadyExists when
//!   the name is taken; 400 when the body's namespace or name disagree with
//!   the URL) and fills in uid, resourceVersion, creationTimestamp and, for
//!   a Service without one, a ClusterIP from 10.96.0.0/16.
//! - PUT replaces (200; 404 when absent; 409 Conflict when the body's
//!   resourceVersion is stale; 422 Invalid when a Service's ClusterIP is
//!   changed, an empty one keeps the old as the API server does).
//! - PATCH with `application/merge-patch+json` only (415 otherwise): the
//!   body merged into the object as RFC 7386 has it (null removes a key),
//!   name, namespace, uid and creationTimestamp kept; 404 when absent.
//! - DELETE (200), and then what the garbage collector does: objects whose
//!   ownerReferences name the deleted uid are deleted too.
//! - A lag knob: a created object stays invisible to the next N GETs, as
//!   behind a lagging cache, so the controller's re-read is exercised.
//! - What is written (POST, PUT, the result of a PATCH) is validated as
//!   the real server does (`validate.rs`): unknown fields by
//!   `fieldValidation`, labels, and an Endpoints' addresses and ports (no
//!   loopback, link-local or unspecified address: 422 Invalid).
//! - LIST of a namespace's objects (`{Kind}List` with the list's
//!   resourceVersion) with a `fieldSelector` of `metadata.name` or
//!   `metadata.namespace` (`=`, `==`, `!=`; any other field is a 400, as
//!   the real server answers for a field it has no index for), and every
//!   change recorded for watches ([`watch_key`]), so a client can follow
//!   one PVC as kubelet follows a pod's secrets.

use std::collections::BTreeMap;

use axum::http::{Method, StatusCode};
use axum::response::Response;
use k8s_openapi::api::core::v1::{Endpoints, PersistentVolumeClaim, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use serde_json::{json, Value};

use super::validate::{self, FieldValidation};
use super::{invalid, reply, status_body, warn, Inner};

/// The watch history's key for a namespace's objects of `plural`.
pub(super) fn watch_key(ns: &str, plural: &str) -> String {
    format!("core:{ns}/{plural}")
}

/// A `fieldSelector` the real server accepts for core objects: terms of
/// `metadata.name` or `metadata.namespace`, with `=`, `==` or `!=`.
pub(super) fn field_terms(selector: &str) -> Result<Vec<(String, bool, String)>, String> {
    let mut out = Vec::new();
    for term in selector.split(',').filter(|t| !t.is_empty()) {
        let (field, equal, value) = if let Some((f, v)) = term.split_once("!=") {
            (f, false, v)
        } else if let Some((f, v)) = term.split_once("==") {
            (f, true, v)
        } else if let Some((f, v)) = term.split_once('=') {
            (f, true, v)
        } else {
            return Err(format!("invalid selector: '{term}'; can't understand '{term}'"));
        };
        if !matches!(field, "metadata.name" | "metadata.namespace") {
            return Err(format!("field label not supported: {field}"));
        }
        out.push((field.to_string(), equal, value.to_string()));
    }
    Ok(out)
}

/// Whether `obj` passes the terms of [`field_terms`].
pub(super) fn fields_match(obj: &Value, terms: &[(String, bool, String)]) -> bool {
    terms.iter().all(|(field, equal, value)| {
        let have = match field.as_str() {
            "metadata.name" => obj["metadata"]["name"].as_str(),
            _ => obj["metadata"]["namespace"].as_str(),
        };
        (have == Some(value.as_str())) == *equal
    })
}

/// (namespace, plural, name).
pub(super) type Key = (String, String, String);

/// The kind a plural names, as messages say it.
fn kind(plural: &str) -> &'static str {
    match plural {
        "services" => "Service",
        "endpoints" => "Endpoints",
        "endpointslices" => "EndpointSlice.discovery.k8s.io",
        _ => "PersistentVolumeClaim",
    }
}

/// Checks an object about to be stored: unknown fields (pruned, or a 400
/// under Strict; the dropped ones returned for a Warning), labels, and
/// the kind's own rules.
fn admit(plural: &str, obj: &mut Value, validation: FieldValidation) -> Result<Vec<String>, Box<Response>> {
    let unknown = match plural {
        "services" => validate::unknown_core::<Service>(obj),
        "endpoints" => validate::unknown_core::<Endpoints>(obj),
        "endpointslices" => validate::unknown_core::<EndpointSlice>(obj),
        _ => validate::unknown_core::<PersistentVolumeClaim>(obj),
    }
    .map_err(|e| Box::new(bad(&format!("the body does not decode as a {}: {e}", kind(plural)))))?;
    if !unknown.is_empty() && validation == FieldValidation::Strict {
        let list: Vec<String> = unknown.iter().map(|f| format!("unknown field \"{f}\"")).collect();
        return Err(Box::new(bad(&format!("strict decoding error: {}", list.join(", ")))));
    }
    validate::prune(obj, &unknown);
    let mut errors = validate::labels(obj);
    if plural == "endpoints" {
        errors.extend(validate::endpoints(obj));
    }
    if plural == "endpointslices" {
        errors.extend(validate::endpoint_slice(obj));
    }
    if errors.is_empty() {
        Ok(unknown)
    } else {
        Err(Box::new(invalid(kind(plural), obj["metadata"]["name"].as_str().unwrap_or_default(), &errors)))
    }
}

pub(super) fn serve(g: &mut Inner, method: &Method, rest: &str, q: &BTreeMap<String, String>, body: &[u8], merge_patch: bool) -> Response {
    let validation = match FieldValidation::of(q) {
        Ok(v) => v,
        Err(m) => return bad(&m),
    };
    let parts: Vec<&str> = rest.split('/').collect();
    let (ns, plural, name) = match parts.as_slice() {
        [ns, plural] => (*ns, *plural, None),
        [ns, plural, name] => (*ns, *plural, Some(*name)),
        _ => return not_served(),
    };
    if !matches!(plural, "services" | "endpoints" | "persistentvolumeclaims" | "endpointslices") {
        return not_served();
    }
    let key = |n: &str| (ns.to_string(), plural.to_string(), n.to_string());
    match (method.clone(), name) {
        (Method::GET, None) => {
            let terms = match field_terms(q.get("fieldSelector").map_or("", String::as_str)) {
                Ok(t) => t,
                Err(m) => return bad(&m),
            };
            let items: Vec<Value> = g
                .core
                .iter()
                .filter(|((n, p, _), o)| {
                    n == ns
                        && p == plural
                        && fields_match(o, &terms)
                        && super::matches(o, q.get("labelSelector").map_or("", String::as_str))
                })
                .map(|(_, o)| o.clone())
                .collect();
            let list_kind = format!("{}List", kind(plural).split('.').next().unwrap_or_default());
            let api_version = if plural == "endpointslices" { "discovery.k8s.io/v1" } else { "v1" };
            reply(
                StatusCode::OK,
                json!({"kind": list_kind, "apiVersion": api_version, "metadata": {"resourceVersion": g.rv.to_string()}, "items": items}),
            )
        }
        (Method::GET, Some(n)) => {
            let k = key(n);
            if let Some(left) = g.core_hidden.get_mut(&k) {
                *left -= 1;
                if *left == 0 {
                    g.core_hidden.remove(&k);
                }
                return not_found(plural, n);
            }
            match g.core.get(&k) {
                Some(o) => reply(StatusCode::OK, o.clone()),
                None => not_found(plural, n),
            }
        }
        (Method::POST, None) => {
            let Ok(mut obj) = serde_json::from_slice::<Value>(body) else { return bad("body is not JSON") };
            let Some(n) = obj["metadata"]["name"].as_str().map(str::to_string) else { return bad("metadata.name is required") };
            if obj["metadata"]["namespace"].as_str().is_some_and(|x| x != ns) {
                return bad("the namespace of the object does not match the namespace on the request");
            }
            let k = key(&n);
            if g.core.contains_key(&k) {
                let msg = format!("{plural} \"{n}\" already exists");
                return reply(StatusCode::CONFLICT, status_body(StatusCode::CONFLICT, "AlreadyExists", &msg));
            }
            let unknown = match admit(plural, &mut obj, validation) {
                Ok(u) => u,
                Err(r) => return *r,
            };
            g.rv += 1;
            g.uid += 1;
            obj["metadata"]["namespace"] = json!(ns);
            obj["metadata"]["uid"] = json!(format!("uid-{}", g.uid));
            obj["metadata"]["resourceVersion"] = json!(g.rv.to_string());
            obj["metadata"]["creationTimestamp"] = json!("2026-01-01T00:00:00Z");
            if plural == "services" && obj["spec"]["clusterIP"].as_str().is_none_or(str::is_empty) {
                g.next_cluster_ip += 1;
                let ip = format!("10.96.{}.{}", g.next_cluster_ip / 250, g.next_cluster_ip % 250 + 1);
                obj["spec"]["clusterIP"] = json!(ip);
                obj["spec"]["clusterIPs"] = json!([ip]);
                obj["spec"]["sessionAffinity"] = json!("None");
            }
            if g.core_lag > 0 {
                g.core_hidden.insert(k.clone(), g.core_lag);
            }
            g.core.insert(k, obj.clone());
            super::watch::record(g, &watch_key(ns, plural), None, Some(obj.clone()));
            let mut r = reply(StatusCode::CREATED, obj);
            if validation == FieldValidation::Warn {
                warn(&mut r, &unknown);
            }
            r
        }
        (Method::PUT, Some(n)) => {
            let Ok(mut obj) = serde_json::from_slice::<Value>(body) else { return bad("body is not JSON") };
            if obj["metadata"]["name"].as_str() != Some(n) {
                return bad("the name of the object does not match the name on the URL");
            }
            let k = key(n);
            let Some(old) = g.core.get(&k).cloned() else { return not_found(plural, n) };
            if let Some(rv) = obj["metadata"]["resourceVersion"].as_str() {
                if Some(rv) != old["metadata"]["resourceVersion"].as_str() {
                    let msg = format!("Operation cannot be fulfilled on {plural} \"{n}\": the object has been modified");
                    return reply(StatusCode::CONFLICT, status_body(StatusCode::CONFLICT, "Conflict", &msg));
                }
            }
            if plural == "services" {
                let old_ip = old["spec"]["clusterIP"].clone();
                match obj["spec"]["clusterIP"].as_str() {
                    None | Some("") => {
                        obj["spec"]["clusterIP"] = old_ip;
                        obj["spec"]["clusterIPs"] = old["spec"]["clusterIPs"].clone();
                    }
                    Some(ip) if Some(ip) != old_ip.as_str() => {
                        let code = StatusCode::UNPROCESSABLE_ENTITY;
                        return reply(code, status_body(code, "Invalid", "spec.clusterIP: Invalid value: field is immutable"));
                    }
                    Some(_) => {}
                }
            }
            replace(g, k, old, obj, &["uid", "creationTimestamp", "namespace"], validation)
        }
        (Method::PATCH, Some(n)) => {
            if !merge_patch {
                let code = StatusCode::UNSUPPORTED_MEDIA_TYPE;
                return reply(code, status_body(code, "UnsupportedMediaType", "the stand-in serves merge patches only"));
            }
            let Ok(patch) = serde_json::from_slice::<Value>(body) else { return bad("body is not JSON") };
            let k = key(n);
            let Some(old) = g.core.get(&k).cloned() else { return not_found(plural, n) };
            let mut obj = old.clone();
            merge(&mut obj, &patch);
            replace(g, k, old, obj, &["name", "uid", "creationTimestamp", "namespace"], validation)
        }
        (Method::DELETE, Some(n)) => match g.core.remove(&key(n)) {
            Some(obj) => {
                g.rv += 1;
                let uid = obj["metadata"]["uid"].clone();
                super::watch::record(g, &watch_key(ns, plural), Some(obj.clone()), None);
                // The garbage collector: dependents of the deleted object.
                let owned =
                    |o: &Value| o["metadata"]["ownerReferences"].as_array().is_some_and(|refs| refs.iter().any(|r| r["uid"] == uid));
                let gone: Vec<Key> = g.core.iter().filter(|(_, o)| owned(o)).map(|(k, _)| k.clone()).collect();
                for k in gone {
                    if let Some(o) = g.core.remove(&k) {
                        super::watch::record(g, &watch_key(&k.0, &k.1), Some(o), None);
                    }
                }
                reply(StatusCode::OK, obj)
            }
            None => not_found(plural, n),
        },
        _ => not_served(),
    }
}

/// Stores `obj` in place of `old` at `k` (a PUT or a PATCH): admitted as a
/// write, with `kept` metadata fields of `old`, a new resourceVersion, and
/// the change recorded for watches.
fn replace(g: &mut Inner, k: Key, old: Value, mut obj: Value, kept: &[&str], validation: FieldValidation) -> Response {
    let plural = k.1.clone();
    let unknown = match admit(&plural, &mut obj, validation) {
        Ok(u) => u,
        Err(r) => return *r,
    };
    g.rv += 1;
    for f in kept {
        obj["metadata"][*f] = old["metadata"][*f].clone();
    }
    obj["metadata"]["resourceVersion"] = json!(g.rv.to_string());
    let watch = watch_key(&k.0, &plural);
    g.core.insert(k, obj.clone());
    super::watch::record(g, &watch, Some(old), Some(obj.clone()));
    let mut r = reply(StatusCode::OK, obj);
    if validation == FieldValidation::Warn {
        warn(&mut r, &unknown);
    }
    r
}

/// RFC 7386: objects merge key by key, null removes, anything else replaces.
fn merge(target: &mut Value, patch: &Value) {
    let Some(p) = patch.as_object() else {
        *target = patch.clone();
        return;
    };
    if !target.is_object() {
        *target = json!({});
    }
    let Some(t) = target.as_object_mut() else { return };
    for (k, v) in p {
        if v.is_null() {
            t.remove(k);
        } else {
            merge(t.entry(k.clone()).or_insert(Value::Null), v);
        }
    }
}

fn not_served() -> Response {
    reply(StatusCode::METHOD_NOT_ALLOWED, status_body(StatusCode::METHOD_NOT_ALLOWED, "MethodNotAllowed", "not served by the stand-in"))
}

fn not_found(plural: &str, name: &str) -> Response {
    reply(StatusCode::NOT_FOUND, status_body(StatusCode::NOT_FOUND, "NotFound", &format!("{plural} \"{name}\" not found")))
}

fn bad(msg: &str) -> Response {
    reply(StatusCode::BAD_REQUEST, status_body(StatusCode::BAD_REQUEST, "BadRequest", msg))
}
