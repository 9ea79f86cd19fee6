//! One request through the stand-in: the outage and max-in-flight checks,
//! injected faults, then the route to its resource (volring's custom
//! resources, VolumeAttachments, the core kinds) and LIST with its label
//! and field selectors and pages.

use super::apply::apply;
use super::*;

pub(super) async fn handle(State(api): State<StandIn>, method: Method, uri: Uri, headers: HeaderMap, body: Bytes) -> Response {
    let path = uri.path().to_string();
    let query = uri.query().unwrap_or("").to_string();
    let started = Instant::now();
    let user_agent = headers.get(axum::http::header::USER_AGENT).map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned());
    let q = query_pairs(&query);
    if method == Method::GET && q.get("watch").is_some_and(|w| w == "true" || w == "1") {
        // Long-running: not counted by the max-in-flight filter.
        // volring's resources, or one namespace's PVCs (`core.rs`).
        let core_pvcs = path.strip_prefix("/api/v1/namespaces/").and_then(|r| r.strip_suffix("/persistentvolumeclaims"));
        let plural = path
            .strip_prefix(PREFIX)
            .filter(|p| !p.contains('/'))
            .map(str::to_string)
            .or_else(|| core_pvcs.filter(|ns| !ns.contains('/')).map(|ns| core::watch_key(ns, "persistentvolumeclaims")));
        let resp = match plural {
            _ if api.flight.lock().unwrap().outage => unavailable(),
            Some(p) => watch::serve(&api, &p, &q),
            None => reply(
                StatusCode::METHOD_NOT_ALLOWED,
                status_body(StatusCode::METHOD_NOT_ALLOWED, "MethodNotAllowed", "watch not served here by the stand-in"),
            ),
        };
        let status = resp.status().as_u16();
        api.lock().log.push(Logged { at: Instant::now(), started, method, path, query, status, user_agent });
        return resp;
    }
    let mutating = !matches!(method, Method::GET | Method::HEAD | Method::OPTIONS);
    let admitted = {
        let mut f = api.flight.lock().unwrap();
        let (class_now, class_max) = if mutating { (f.mutating, f.max_mutating) } else { (f.readonly, f.max_readonly) };
        if f.outage {
            Err(unavailable())
        } else if class_max.is_some_and(|m| class_now >= m) {
            Err(too_many_requests())
        } else {
            f.now += 1;
            f.max = f.max.max(f.now);
            if mutating {
                f.mutating += 1;
            } else {
                f.readonly += 1;
            }
            Ok(f.hold)
        }
    };
    let hold = match admitted {
        Ok(hold) => hold,
        Err(resp) => {
            let status = resp.status().as_u16();
            api.lock().log.push(Logged { at: Instant::now(), started, method, path, query, status, user_agent });
            return resp;
        }
    };
    // Out of the count when served, or when the client gave up on it.
    let counted = InFlight { flight: api.flight.clone(), mutating };
    if !hold.is_zero() {
        tokio::time::sleep(hold).await;
    }
    drop(counted);
    let mut g = api.lock();
    let resp = serve(&mut g, &method, &path, &query, &headers, &body);
    let status = resp.status().as_u16();
    g.log.push(Logged { at: Instant::now(), started, method, path, query, status, user_agent });
    resp
}

/// One admitted request, counted in flight until dropped.
struct InFlight {
    flight: Arc<Mutex<Flight>>,
    mutating: bool,
}

impl Drop for InFlight {
    fn drop(&mut self) {
        let mut f = self.flight.lock().unwrap_or_else(|e| e.into_inner());
        f.now -= 1;
        if self.mutating {
            f.mutating -= 1;
        } else {
            f.readonly -= 1;
        }
    }
}

/// What kube-apiserver's max-in-flight filter answers a request over its
/// limit.
fn too_many_requests() -> Response {
    let code = StatusCode::TOO_MANY_REQUESTS;
    let mut body = status_body(code, "TooManyRequests", "Too many requests, please try again later.");
    body["details"] = json!({"retryAfterSeconds": 1});
    let mut r = reply(code, body);
    r.headers_mut().insert("retry-after", HeaderValue::from_static("1"));
    r
}

/// What a client reads while the server is down (no Retry-After).
fn unavailable() -> Response {
    let code = StatusCode::SERVICE_UNAVAILABLE;
    reply(code, status_body(code, "ServiceUnavailable", "the server is currently unable to handle the request"))
}

fn take_fault(g: &mut Inner, method: &Method, path: &str) -> Option<Fault> {
    let i = g.faults.iter().position(|f| f.method.as_ref().is_none_or(|m| m == method) && path.contains(&f.path_contains))?;
    let f = g.faults[i].clone();
    if g.faults[i].times <= 1 {
        g.faults.remove(i);
    } else {
        g.faults[i].times -= 1;
    }
    Some(f)
}

fn serve(g: &mut Inner, method: &Method, path: &str, query: &str, headers: &HeaderMap, body: &[u8]) -> Response {
    if let Some(f) = take_fault(g, method, path) {
        let code = StatusCode::from_u16(f.status).unwrap();
        let mut r = reply(code, status_body(code, "Injected", "injected by the test"));
        if let Some(s) = f.retry_after {
            r.headers_mut().insert("retry-after", HeaderValue::from_str(&s.to_string()).unwrap());
        }
        return r;
    }
    if let Some(r) = path.strip_prefix("/api/v1/").and_then(|rest| cluster::serve(g, method, rest, query)) {
        return r;
    }
    if let Some(rest) = path.strip_prefix("/api/v1/namespaces/") {
        let merge = headers.get("content-type").is_some_and(|v| v.as_bytes() == b"application/merge-patch+json");
        return core::serve(g, method, rest, &query_pairs(query), body, merge);
    }
    if let Some(rest) = path.strip_prefix("/apis/discovery.k8s.io/v1/namespaces/").filter(|r| r.split('/').nth(1) == Some("endpointslices"))
    {
        return core::serve(g, method, rest, &query_pairs(query), body, false);
    }
    if let Some(rest) = path.strip_prefix(STORAGE_PREFIX) {
        return storage(g, method, rest, query);
    }
    let Some(rest) = path.strip_prefix(PREFIX) else {
        return reply(
            StatusCode::NOT_FOUND,
            status_body(StatusCode::NOT_FOUND, "NotFound", "the server could not find the requested resource"),
        );
    };
    let parts: Vec<&str> = rest.split('/').collect();
    let q = query_pairs(query);
    match (method.clone(), parts.as_slice()) {
        (Method::GET, [plural]) => list(g, plural, &q),
        (Method::GET, [plural, name]) => match g.objects.get(&(plural.to_string(), name.to_string())) {
            Some(s) => reply(StatusCode::OK, s.obj.clone()),
            None => not_found(plural, name),
        },
        (Method::DELETE, [plural, name]) => match g.objects.remove(&(plural.to_string(), name.to_string())) {
            Some(s) => {
                g.rv += 1;
                watch::record(g, plural, Some(s.obj.clone()), None);
                reply(StatusCode::OK, s.obj)
            }
            None => not_found(plural, name),
        },
        (Method::PATCH, [plural, name]) => apply(g, plural, name, false, &q, headers, body),
        (Method::PATCH, [plural, name, "status"]) => apply(g, plural, name, true, &q, headers, body),
        _ => reply(
            StatusCode::METHOD_NOT_ALLOWED,
            status_body(StatusCode::METHOD_NOT_ALLOWED, "MethodNotAllowed", "not served by the stand-in"),
        ),
    }
}

/// storage.k8s.io/v1: LIST and GET of volumeattachments. Like the real
/// server, the only field selector a VolumeAttachment supports is
/// `metadata.name`; any other is a 400.
fn storage(g: &Inner, method: &Method, rest: &str, query: &str) -> Response {
    let parts: Vec<&str> = rest.split('/').collect();
    let q = query_pairs(query);
    match (method, parts.as_slice()) {
        (&Method::GET, ["volumeattachments"]) => {
            let fields = q.get("fieldSelector").cloned().unwrap_or_default();
            for term in fields.split(',').filter(|t| !t.is_empty()) {
                let field = term.split(['=', '!']).next().unwrap_or_default();
                if field != "metadata.name" {
                    let code = StatusCode::BAD_REQUEST;
                    return reply(code, status_body(code, "BadRequest", &format!("field label not supported: {field}")));
                }
            }
            list_of(g, "volumeattachments", "storage.k8s.io/v1", "VolumeAttachmentList", &q, &fields)
        }
        (&Method::GET, ["volumeattachments", name]) => match g.objects.get(&("volumeattachments".to_string(), name.to_string())) {
            Some(s) => reply(StatusCode::OK, s.obj.clone()),
            None => not_found("volumeattachments", name),
        },
        _ => reply(
            StatusCode::METHOD_NOT_ALLOWED,
            status_body(StatusCode::METHOD_NOT_ALLOWED, "MethodNotAllowed", "not served by the stand-in"),
        ),
    }
}

/// The fields each volring resource lets a LIST select by: `metadata.name`,
/// and what its CRD declares in `selectableFields`.
fn selectable(plural: &str) -> Vec<String> {
    let crds = super::crds();
    let crd = crds.iter().find(|c| c.spec.names.plural == plural);
    let declared = crd.into_iter().flat_map(|c| c.spec.versions.iter()).flat_map(|v| v.selectable_fields.iter().flatten());
    std::iter::once("metadata.name".to_string()).chain(declared.map(|f| f.json_path.trim_start_matches('.').to_string())).collect()
}

fn list(g: &Inner, plural: &str, q: &BTreeMap<String, String>) -> Response {
    let fields = q.get("fieldSelector").cloned().unwrap_or_default();
    let allowed = selectable(plural);
    for term in fields.split(',').filter(|t| !t.is_empty()) {
        let field = term.split(['=', '!']).next().unwrap_or_default();
        if !allowed.iter().any(|a| a == field) {
            let code = StatusCode::BAD_REQUEST;
            return reply(code, status_body(code, "BadRequest", &format!("field label not supported: {field}")));
        }
    }
    list_of(g, plural, "volring.io/v1alpha1", "List", q, &fields)
}

/// `fields`: `path=x`, `path==x`, `path!=x` terms (checked by the caller);
/// a path's value is compared as the API server does, as a string.
fn fields_match(obj: &Value, fields: &str) -> bool {
    fields.split(',').filter(|t| !t.is_empty()).all(|t| {
        let (path, want, equal) = match t.split_once("!=") {
            Some((p, v)) => (p, v, false),
            None => {
                let (p, v) = t.split_once('=').unwrap_or((t, ""));
                (p, v.trim_start_matches('='), true)
            }
        };
        let pointer = format!("/{}", path.replace('.', "/"));
        let have = match obj.pointer(&pointer) {
            Some(Value::String(s)) => s.clone(),
            Some(Value::Null) | None => String::new(),
            Some(v) => v.to_string(),
        };
        (have == want) == equal
    })
}

fn list_of(g: &Inner, plural: &str, api_version: &str, kind: &str, q: &BTreeMap<String, String>, fields: &str) -> Response {
    let selector = q.get("labelSelector").cloned().unwrap_or_default();
    let limit: usize = q.get("limit").and_then(|l| l.parse().ok()).filter(|&l| l > 0).unwrap_or(usize::MAX);
    let after = q.get("continue").cloned().unwrap_or_default();
    let mut items = Vec::new();
    let mut more = None;
    for ((p, name), s) in &g.objects {
        if p != plural
            || (!after.is_empty() && name.as_str() <= after.as_str())
            || !matches(&s.obj, &selector)
            || !fields_match(&s.obj, fields)
        {
            continue;
        }
        if items.len() == limit {
            more = Some(items.last().and_then(|i: &Value| i["metadata"]["name"].as_str()).unwrap_or_default().to_string());
            break;
        }
        items.push(s.obj.clone());
    }
    let mut meta = json!({"resourceVersion": g.rv.to_string()});
    if let Some(c) = more {
        meta["continue"] = json!(c);
    }
    reply(StatusCode::OK, json!({"apiVersion": api_version, "kind": kind, "metadata": meta, "items": items}))
}
