//! What the stand-in refuses, as the real API server refuses it (the
//! messages follow apimachinery's, field path first):
//!
//! - Endpoints addresses (ready or not) that are no IP, unspecified
//!   (`0.0.0.0`, `::`), loopback (127.0.0.0/8, ::1), link-local
//!   (169.254.0.0/16, fe80::/10) or link-local multicast (224.0.0.0/24,
//!   ff02::/10): 422 Invalid, "may not be in the loopback range
//!   (127.0.0.0/8, ::1/128)" and the like. Ports outside 1–65535 and
//!   protocols other than TCP, UDP and SCTP too. The same for
//!   EndpointSlices, whose addresses must also be of their `addressType`.
//! - Unknown fields, by the request's `fieldValidation`: `Strict`, a 400
//!   "strict decoding error: unknown field"; `Warn` (the default since
//!   1.27) and `Ignore` drop them, `Warn` saying so in a `Warning` header.
//!   For volring's resources a field is known when the CRD's schema (the
//!   one `volring crds` prints) has it; for core kinds when k8s-openapi's
//!   type does.
//! - volring objects that do not match their CRD's schema (type, required,
//!   enum, minimum): 422 Invalid.
//! - Label keys and values that are not qualified names / label values (a
//!   value longer than 63 characters, say): 422 Invalid.

use std::net::IpAddr;

use serde::de::DeserializeOwned;
use serde::Serialize;
use serde_json::Value;

/// How a request wants unknown fields handled (`fieldValidation`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum FieldValidation {
    Strict,
    Warn,
    Ignore,
}

impl FieldValidation {
    pub(super) fn of(q: &std::collections::BTreeMap<String, String>) -> Result<Self, String> {
        match q.get("fieldValidation").map(String::as_str) {
            None | Some("") | Some("Warn") => Ok(FieldValidation::Warn),
            Some("Strict") => Ok(FieldValidation::Strict),
            Some("Ignore") => Ok(FieldValidation::Ignore),
            Some(other) => {
                Err(format!("fieldValidation: Unsupported value: \"{other}\": supported values: \"Ignore\", \"Strict\", \"Warn\""))
            }
        }
    }
}

/// Why an address may not be an endpoint, as `ValidateNonSpecialIP` says.
fn special_ip(ip: &str) -> Option<&'static str> {
    let Ok(a) = ip.parse::<IpAddr>() else { return Some("must be a valid IP address") };
    let (unspecified, loopback, link_local, link_local_multicast) = match a {
        IpAddr::V4(v) => (v.is_unspecified(), v.is_loopback(), v.is_link_local(), v.octets()[..3] == [224, 0, 0]),
        IpAddr::V6(v) => {
            let s = v.segments();
            // A v4-mapped address is judged as the v4 one.
            if let Some(v4) = v.to_ipv4_mapped() {
                return special_ip(&v4.to_string());
            }
            (v.is_unspecified(), v.is_loopback(), s[0] & 0xffc0 == 0xfe80, s[0] == 0xff02)
        }
    };
    if unspecified {
        Some("may not be unspecified (0.0.0.0)")
    } else if loopback {
        Some("may not be in the loopback range (127.0.0.0/8, ::1/128)")
    } else if link_local {
        Some("may not be in the link-local range (169.254.0.0/16, fe80::/10)")
    } else if link_local_multicast {
        Some("may not be in the link-local multicast range (224.0.0.0/24, ff02::/10)")
    } else {
        None
    }
}

fn port_errors(ports: &Value, at: &str, errs: &mut Vec<String>) {
    for (i, p) in ports.as_array().into_iter().flatten().enumerate() {
        match p["port"].as_i64() {
            Some(1..=65535) => {}
            _ => errs.push(format!("{at}[{i}].port: Invalid value: {}: must be between 1 and 65535, inclusive", p["port"])),
        }
        if let Some(proto) = p["protocol"].as_str() {
            if !["TCP", "UDP", "SCTP"].contains(&proto) {
                errs.push(format!("{at}[{i}].protocol: Unsupported value: \"{proto}\": supported values: \"SCTP\", \"TCP\", \"UDP\""));
            }
        }
    }
}

/// An Endpoints object's invalid fields.
pub(super) fn endpoints(obj: &Value) -> Vec<String> {
    let mut errs = Vec::new();
    for (i, s) in obj["subsets"].as_array().into_iter().flatten().enumerate() {
        for list in ["addresses", "notReadyAddresses"] {
            for (j, a) in s[list].as_array().into_iter().flatten().enumerate() {
                let ip = a["ip"].as_str().unwrap_or_default();
                if let Some(why) = special_ip(ip) {
                    errs.push(format!("subsets[{i}].{list}[{j}].ip: Invalid value: \"{ip}\": {why}"));
                }
            }
        }
        port_errors(&s["ports"], &format!("subsets[{i}].ports"), &mut errs);
    }
    errs
}

/// An EndpointSlice's invalid fields.
pub(super) fn endpoint_slice(obj: &Value) -> Vec<String> {
    let mut errs = Vec::new();
    let family = obj["addressType"].as_str().unwrap_or_default();
    if !["IPv4", "IPv6", "FQDN"].contains(&family) {
        errs.push(format!("addressType: Unsupported value: \"{family}\": supported values: \"FQDN\", \"IPv4\", \"IPv6\""));
    }
    for (i, e) in obj["endpoints"].as_array().into_iter().flatten().enumerate() {
        let addrs = e["addresses"].as_array().cloned().unwrap_or_default();
        if addrs.is_empty() || addrs.len() > 100 {
            errs.push(format!("endpoints[{i}].addresses: Invalid value: {}: must have at least 1 and at most 100 addresses", addrs.len()));
        }
        for (j, a) in addrs.iter().enumerate() {
            let ip = a.as_str().unwrap_or_default();
            let at = format!("endpoints[{i}].addresses[{j}]");
            if family == "FQDN" {
                continue;
            }
            match ip.parse::<IpAddr>() {
                Ok(IpAddr::V4(_)) if family == "IPv6" => errs.push(format!("{at}: Invalid value: \"{ip}\": must be an IPv6 address")),
                Ok(IpAddr::V6(_)) if family == "IPv4" => errs.push(format!("{at}: Invalid value: \"{ip}\": must be an IPv4 address")),
                _ => {
                    if let Some(why) = special_ip(ip) {
                        errs.push(format!("{at}: Invalid value: \"{ip}\": {why}"));
                    }
                }
            }
        }
    }
    port_errors(&obj["ports"], "ports", &mut errs);
    errs
}

/// `[prefix/]name` with name at most 63 of `[A-Za-z0-9._-]`, alphanumeric
/// at both ends; the prefix a DNS subdomain.
fn qualified_name(key: &str) -> bool {
    let (prefix, name) = match key.rsplit_once('/') {
        Some((p, n)) => (Some(p), n),
        None => (None, key),
    };
    let prefix_ok = prefix.is_none_or(|p| {
        !p.is_empty()
            && p.len() <= 253
            && p.split('.').all(|l| {
                !l.is_empty()
                    && l.len() <= 63
                    && l.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
                    && !l.starts_with('-')
                    && !l.ends_with('-')
            })
    });
    prefix_ok && !name.is_empty() && label_value(name)
}

/// At most 63 of `[A-Za-z0-9._-]`, alphanumeric at both ends (or empty).
fn label_value(v: &str) -> bool {
    let b = v.as_bytes();
    v.len() <= 63
        && b.iter().all(|c| c.is_ascii_alphanumeric() || matches!(c, b'-' | b'_' | b'.'))
        && b.first().is_none_or(u8::is_ascii_alphanumeric)
        && b.last().is_none_or(u8::is_ascii_alphanumeric)
}

/// An object's invalid labels.
pub(super) fn labels(obj: &Value) -> Vec<String> {
    let mut errs = Vec::new();
    for (k, v) in obj["metadata"]["labels"].as_object().into_iter().flatten() {
        if !qualified_name(k) {
            errs.push(format!("metadata.labels: Invalid value: \"{k}\": name part must consist of alphanumeric characters, '-', '_' or '.', and must start and end with an alphanumeric character (and be at most 63 characters)"));
        }
        match v.as_str() {
            Some(s) if label_value(s) => {}
            _ => errs.push(format!("metadata.labels: Invalid value: {v}: a valid label must be an empty string or consist of alphanumeric characters, '-', '_' or '.', and must start and end with an alphanumeric character (and be at most 63 characters)")),
        }
    }
    errs
}

/// Where `original` has something `back` (its typed round trip) lacks, as
/// field paths (`spec.foo`).
fn lost(original: &Value, back: &Value, at: &str, out: &mut Vec<String>) {
    let join = |k: &str| if at.is_empty() { k.to_string() } else { format!("{at}.{k}") };
    match (original, back) {
        (Value::Object(a), Value::Object(b)) => {
            for (k, v) in a {
                match b.get(k) {
                    Some(w) => lost(v, w, &join(k), out),
                    None if v.is_null() => {}
                    None => out.push(join(k)),
                }
            }
        }
        (Value::Array(a), Value::Array(b)) if a.len() == b.len() => {
            for (i, (v, w)) in a.iter().zip(b).enumerate() {
                lost(v, w, &format!("{at}[{i}]"), out);
            }
        }
        _ => {}
    }
}

/// A core object's fields its k8s-openapi type does not have (paths), or
/// why it does not parse as that type.
pub(super) fn unknown_core<T: DeserializeOwned + Serialize>(obj: &Value) -> Result<Vec<String>, String> {
    let typed: T = serde_json::from_value(obj.clone()).map_err(|e| e.to_string())?;
    let back = serde_json::to_value(&typed).map_err(|e| e.to_string())?;
    let mut out = Vec::new();
    lost(obj, &back, "", &mut out);
    Ok(out)
}

/// The paths in `obj` its CRD's `schema` does not know; `metadata` is
/// checked as an ObjectMeta, `apiVersion` and `kind` are known.
pub(super) fn unknown_custom(obj: &Value, schema: &Value) -> Vec<String> {
    let mut out = Vec::new();
    for (k, v) in obj.as_object().into_iter().flatten() {
        match k.as_str() {
            "apiVersion" | "kind" => {}
            "metadata" => {
                let meta = unknown_core::<k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta>(v).unwrap_or_default();
                out.extend(meta.into_iter().map(|p| format!("metadata.{p}")));
            }
            _ => unknown_under(v, &schema["properties"][k], k, &mut out),
        }
    }
    out
}

fn unknown_under(v: &Value, schema: &Value, at: &str, out: &mut Vec<String>) {
    if schema.is_null() {
        out.push(at.to_string());
        return;
    }
    match v {
        Value::Object(m) if schema["x-kubernetes-preserve-unknown-fields"] != true => {
            let props = &schema["properties"];
            let additional = &schema["additionalProperties"];
            for (k, w) in m {
                let sub = if props.get(k).is_some() { &props[k] } else { additional };
                if sub.is_null() || sub == &Value::Bool(false) {
                    out.push(format!("{at}.{k}"));
                } else {
                    unknown_under(w, sub, &format!("{at}.{k}"), out);
                }
            }
        }
        Value::Array(a) => {
            for (i, w) in a.iter().enumerate() {
                unknown_under(w, &schema["items"], &format!("{at}[{i}]"), out);
            }
        }
        _ => {}
    }
}

/// Removes the fields at `paths` (as [`unknown_custom`] names them).
pub(super) fn prune(obj: &mut Value, paths: &[String]) {
    fn segments(p: &str) -> Vec<String> {
        let mut parts = Vec::new();
        for seg in p.split('.') {
            // `a[3]` is key `a`, then index 3.
            let mut pieces = seg.split('[');
            parts.push(pieces.next().unwrap_or_default().to_string());
            parts.extend(pieces.map(|i| format!("[{}", i.trim_end_matches(']'))));
        }
        parts
    }
    fn remove(v: &mut Value, path: &[String]) {
        match path {
            [] => {}
            [last] => {
                if let Some(m) = v.as_object_mut() {
                    m.remove(last);
                }
            }
            [first, rest @ ..] => {
                let next = match first.strip_prefix('[') {
                    Some(i) => i.parse::<usize>().ok().and_then(|i| v.get_mut(i)),
                    None => v.get_mut(first.as_str()),
                };
                if let Some(n) = next {
                    remove(n, rest);
                }
            }
        }
    }
    for p in paths {
        remove(obj, &segments(p));
    }
}

/// Where `v` breaks `schema` (a structural OpenAPI v3 schema: type,
/// nullable, required, enum, minimum, properties, items).
pub(super) fn against_schema(v: &Value, schema: &Value, at: &str, errs: &mut Vec<String>) {
    if schema.is_null() {
        return;
    }
    if v.is_null() {
        if schema["nullable"] != true {
            errs.push(format!(
                "{at}: Invalid value: \"null\": {at} in body must be of type {}: \"null\"",
                schema["type"].as_str().unwrap_or("object")
            ));
        }
        return;
    }
    let kind = match v {
        Value::Object(_) => "object",
        Value::Array(_) => "array",
        Value::String(_) => "string",
        Value::Bool(_) => "boolean",
        Value::Number(n) if n.is_i64() || n.is_u64() => "integer",
        Value::Number(_) => "number",
        Value::Null => unreachable!(),
    };
    if let Some(want) = schema["type"].as_str() {
        let fits = want == kind || (want == "number" && kind == "integer");
        if !fits {
            errs.push(format!("{at}: Invalid value: \"{kind}\": {at} in body must be of type {want}: \"{kind}\""));
            return;
        }
    }
    if let Some(options) = schema["enum"].as_array() {
        if !options.contains(v) {
            let list: Vec<String> = options.iter().map(|o| o.to_string()).collect();
            errs.push(format!("{at}: Unsupported value: {v}: supported values: {}", list.join(", ")));
        }
    }
    if let (Some(min), Some(n)) = (schema["minimum"].as_f64(), v.as_f64()) {
        if n < min {
            errs.push(format!("{at}: Invalid value: {v}: {at} in body should be greater than or equal to {min}"));
        }
    }
    if v.as_u64().is_some_and(|n| n > i64::MAX as u64) {
        errs.push(format!("{at}: Invalid value: {v}: must be a 64-bit integer"));
    }
    match v {
        Value::Object(m) => {
            for r in schema["required"].as_array().into_iter().flatten().filter_map(|r| r.as_str()) {
                if !m.contains_key(r) {
                    errs.push(format!("{at}.{r}: Required value"));
                }
            }
            for (k, w) in m {
                against_schema(w, &schema["properties"][k], &format!("{at}.{k}"), errs);
            }
        }
        Value::Array(a) => {
            for (i, w) in a.iter().enumerate() {
                against_schema(w, &schema["items"], &format!("{at}[{i}]"), errs);
            }
        }
        _ => {}
    }
}

/// The OpenAPI schema of a volring resource (by plural), from the CRD
/// `volring crds` prints.
pub(super) fn crd_schema(plural: &str) -> Option<Value> {
    let crds = super::crds();
    let crd = crds.iter().find(|c| c.spec.names.plural == plural)?;
    let v = serde_json::to_value(crd).ok()?;
    Some(v["spec"]["versions"][0]["schema"]["openAPIV3Schema"].clone())
}
