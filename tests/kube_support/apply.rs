//! Server-side apply on volring's resources: field ownership per manager,
//! conflicts and `force`, fields a manager stops applying removed, the
//! resourceVersion precondition, and the CRD's schema and labels checked.

use super::*;

pub(super) fn fields_of(obj: &Value, top: &str) -> BTreeSet<String> {
    obj[top].as_object().map(|m| m.keys().map(|k| format!("{top}.{k}")).collect()).unwrap_or_default()
}

pub(super) fn label_fields(obj: &Value) -> BTreeSet<String> {
    obj["metadata"]["labels"].as_object().map(|m| m.keys().map(|k| format!("label:{k}")).collect()).unwrap_or_default()
}

fn get_field<'a>(obj: &'a Value, f: &str) -> &'a Value {
    match f.strip_prefix("label:") {
        Some(k) => &obj["metadata"]["labels"][k],
        None => {
            let (top, k) = f.split_once('.').unwrap();
            &obj[top][k]
        }
    }
}

fn set_field(obj: &mut Value, f: &str, v: Option<Value>) {
    let (parent, k) = match f.strip_prefix("label:") {
        Some(k) => (&mut obj["metadata"]["labels"], k.to_string()),
        None => {
            let (top, k) = f.split_once('.').unwrap();
            (&mut obj[top], k.to_string())
        }
    };
    if !parent.is_object() {
        *parent = json!({});
    }
    let m = parent.as_object_mut().unwrap();
    match v {
        Some(v) => {
            m.insert(k, v);
        }
        None => {
            m.remove(&k);
        }
    }
}

pub(super) fn apply(
    g: &mut Inner,
    plural: &str,
    name: &str,
    status: bool,
    q: &BTreeMap<String, String>,
    headers: &HeaderMap,
    body: &[u8],
) -> Response {
    let ct = headers.get("content-type").and_then(|v| v.to_str().ok()).unwrap_or("");
    if ct != "application/apply-patch+yaml" {
        let code = StatusCode::UNSUPPORTED_MEDIA_TYPE;
        return reply(code, status_body(code, "UnsupportedMediaType", &format!("the body of the request was in an unknown format ({ct})")));
    }
    let Some(manager) = q.get("fieldManager").filter(|m| !m.is_empty()).cloned() else {
        let code = StatusCode::UNPROCESSABLE_ENTITY;
        return reply(code, status_body(code, "Invalid", "PatchOptions.meta.k8s.io \"\" is invalid: fieldManager: Required value"));
    };
    let force = q.get("force").is_some_and(|f| f == "true");
    let Ok(patch) = serde_json::from_slice::<Value>(body) else {
        return reply(
            StatusCode::BAD_REQUEST,
            status_body(StatusCode::BAD_REQUEST, "BadRequest", "the stand-in reads JSON apply bodies only"),
        );
    };
    if patch["metadata"]["name"].as_str() != Some(name) || patch["apiVersion"] != "volring.io/v1alpha1" || patch["kind"].as_str().is_none()
    {
        let code = StatusCode::BAD_REQUEST;
        return reply(code, status_body(code, "BadRequest", "apiVersion, kind and metadata.name must match the URL"));
    }
    let validation = match validate::FieldValidation::of(q) {
        Ok(v) => v,
        Err(m) => return reply(StatusCode::BAD_REQUEST, status_body(StatusCode::BAD_REQUEST, "BadRequest", &m)),
    };
    let schema = validate::crd_schema(plural);
    let mut patch = patch;
    let unknown = schema.as_ref().map(|s| validate::unknown_custom(&patch, s)).unwrap_or_default();
    if !unknown.is_empty() && validation == validate::FieldValidation::Strict {
        let list: Vec<String> = unknown.iter().map(|f| format!("unknown field \"{f}\"")).collect();
        let code = StatusCode::BAD_REQUEST;
        return reply(code, status_body(code, "BadRequest", &format!("strict decoding error: {}", list.join(", "))));
    }
    validate::prune(&mut patch, &unknown);
    let kind = patch["kind"].as_str().unwrap_or_default().to_string();
    let label_errors = validate::labels(&patch);
    if !label_errors.is_empty() {
        return invalid(&format!("{kind}.volring.io"), name, &label_errors);
    }
    let key = (plural.to_string(), name.to_string());
    let original = g.objects.get(&key).map(|s| (s.obj.clone(), s.managers.clone()));
    let existing = g.objects.get(&key);
    if status && existing.is_none() {
        return not_found(plural, name);
    }
    if let (Some(want), Some(s)) = (patch["metadata"]["resourceVersion"].as_str(), existing) {
        if s.obj["metadata"]["resourceVersion"].as_str() != Some(want) {
            let code = StatusCode::CONFLICT;
            return reply(
                code,
                status_body(code, "Conflict", "the object has been modified; please apply your changes to the latest version"),
            );
        }
    }
    let mut stored = match g.objects.remove(&key) {
        Some(s) => s,
        None => {
            g.uid += 1;
            let obj = json!({"apiVersion": patch["apiVersion"], "kind": patch["kind"],
                "metadata": {"name": name, "uid": format!("uid-{}", g.uid), "creationTimestamp": "2026-01-01T00:00:00Z", "generation": 0}});
            Stored { obj, managers: BTreeMap::new() }
        }
    };
    // The fields this apply sets: the main endpoint ignores status, the
    // status endpoint everything but status.
    let applied: BTreeSet<String> =
        if status { fields_of(&patch, "status") } else { fields_of(&patch, "spec").into_iter().chain(label_fields(&patch)).collect() };
    let mut conflicts = Vec::new();
    for f in &applied {
        for (m, owned) in &stored.managers {
            if m != &manager && owned.contains(f) && get_field(&stored.obj, f) != get_field(&patch, f) {
                conflicts.push(format!("conflict with \"{m}\": {f}"));
            }
        }
    }
    if !conflicts.is_empty() && !force {
        g.objects.insert(key, stored);
        let code = StatusCode::CONFLICT;
        return reply(
            code,
            status_body(code, "Conflict", &format!("Apply failed with {} conflicts: {}", conflicts.len(), conflicts.join(", "))),
        );
    }
    let before = stored.obj.clone();
    let scope = |f: &String| if status { f.starts_with("status.") } else { !f.starts_with("status.") };
    let previously: BTreeSet<String> =
        stored.managers.get(&manager).map(|o| o.iter().filter(|f| scope(f)).cloned().collect()).unwrap_or_default();
    for f in &applied {
        set_field(&mut stored.obj, f, Some(get_field(&patch, f).clone()));
        for (m, owned) in stored.managers.iter_mut() {
            if m != &manager && get_field(&before, f) != get_field(&patch, f) {
                owned.remove(f);
            }
        }
    }
    for f in previously.difference(&applied) {
        if !stored.managers.iter().any(|(m, o)| m != &manager && o.contains(f)) {
            set_field(&mut stored.obj, f, None);
        }
    }
    // A part left empty by that, which no one owns a field of, goes too.
    for top in ["spec", "status"] {
        let owned = stored.managers.iter().any(|(m, o)| m != &manager && o.iter().any(|f| f.starts_with(&format!("{top}."))))
            || applied.iter().any(|f| f.starts_with(&format!("{top}.")));
        if !owned && stored.obj[top].as_object().is_some_and(|m| m.is_empty()) {
            stored.obj.as_object_mut().expect("an object").remove(top);
        }
    }
    let mine = stored.managers.entry(manager).or_default();
    mine.retain(|f| !scope(f));
    mine.extend(applied);
    stored.managers.retain(|_, o| !o.is_empty());
    let created = before.get("spec").is_none() && !status && before["metadata"]["resourceVersion"].is_null();
    // The object as it would be stored, against its CRD's schema.
    let mut errors = Vec::new();
    if let Some(schema) = &schema {
        for r in schema["required"].as_array().into_iter().flatten().filter_map(|r| r.as_str()) {
            if stored.obj.get(r).is_none() {
                errors.push(format!("{r}: Required value"));
            }
        }
        for part in ["spec", "status"] {
            if let Some(v) = stored.obj.get(part) {
                validate::against_schema(v, &schema["properties"][part], part, &mut errors);
            }
        }
    }
    if !errors.is_empty() {
        if let Some((obj, managers)) = original {
            g.objects.insert(key, Stored { obj, managers });
        }
        return invalid(&format!("{kind}.volring.io"), name, &errors);
    }
    if stored.obj != before || created {
        if stored.obj.get("spec") != before.get("spec") {
            let gen = stored.obj["metadata"]["generation"].as_u64().unwrap_or(0) + 1;
            stored.obj["metadata"]["generation"] = json!(gen);
        }
        g.rv += 1;
        stored.obj["metadata"]["resourceVersion"] = json!(g.rv.to_string());
        let was = (!created).then_some(before);
        watch::record(g, plural, was, Some(stored.obj.clone()));
    }
    let out = stored.obj.clone();
    g.objects.insert(key, stored);
    let mut r = reply(if created { StatusCode::CREATED } else { StatusCode::OK }, out);
    if validation == validate::FieldValidation::Warn {
        warn(&mut r, &unknown);
    }
    r
}
