//! Every manifest under deploy/ parses into objects of known kinds whose
//! every field survives a round trip through k8s-openapi's types.

use super::*;

/// Where `original` has something `back` (its round trip) lacks or
/// changes, as a JSON path.
fn lost(original: &Value, back: &Value, at: &str) -> Option<String> {
    match (original, back) {
        (Value::Object(a), Value::Object(b)) => a.iter().find_map(|(k, v)| match b.get(k) {
            Some(w) => lost(v, w, &format!("{at}.{k}")),
            None if v.is_null() => None,
            None => Some(format!("{at}.{k}")),
        }),
        (Value::Array(a), Value::Array(b)) if a.len() == b.len() => {
            a.iter().zip(b).enumerate().find_map(|(i, (v, w))| lost(v, w, &format!("{at}[{i}]")))
        }
        (a, b) if a == b => None,
        // kustomize writes the file's 0.0 as 0; the API's number is the same.
        (Value::Number(a), Value::Number(b)) if a.as_f64() == b.as_f64() => None,
        // YAML's 1 and the API's "1" (a Quantity or label) are one value.
        (Value::Number(n), Value::String(s)) | (Value::String(s), Value::Number(n)) if n.to_string() == *s => None,
        _ => Some(at.to_string()),
    }
}

fn round_trip<T: DeserializeOwned + Serialize>(doc: &Value) -> Result<(), String> {
    let typed: T = serde_json::from_value(doc.clone()).map_err(|e| format!("does not parse as its kind: {e}"))?;
    let back = serde_json::to_value(&typed).map_err(|e| e.to_string())?;
    match lost(doc, &back, "") {
        None => Ok(()),
        Some(path) => Err(format!("field {path} is not in the schema (or its value changed)")),
    }
}

/// Keys of the Prometheus Operator kinds this repo uses (the operator's
/// CRDs are not a dependency here, so their few fields are listed).
fn operator_kind(doc: &Value) -> Result<(), String> {
    let allowed = |v: &Value, keys: &[&str], what: &str| -> Result<(), String> {
        let obj = v.as_object().ok_or(format!("{what} is not a map"))?;
        match obj.keys().find(|k| !keys.contains(&k.as_str())) {
            Some(k) => Err(format!("{what}.{k} is not a field")),
            None => Ok(()),
        }
    };
    allowed(doc, &["apiVersion", "kind", "metadata", "spec"], "")?;
    let spec = &doc["spec"];
    match doc["kind"].as_str() {
        Some("ServiceMonitor") => {
            allowed(spec, &["selector", "endpoints", "namespaceSelector", "jobLabel"], "spec")?;
            for e in spec["endpoints"].as_array().ok_or("spec.endpoints")? {
                allowed(e, &["port", "path", "interval", "scrapeTimeout", "scheme"], "spec.endpoints[]")?;
            }
        }
        Some("PrometheusRule") => {
            allowed(spec, &["groups"], "spec")?;
            for g in spec["groups"].as_array().ok_or("spec.groups")? {
                allowed(g, &["name", "interval", "rules"], "spec.groups[]")?;
                for r in g["rules"].as_array().ok_or("rules")? {
                    allowed(r, &["alert", "record", "expr", "for", "labels", "annotations"], "spec.groups[].rules[]")?;
                }
            }
        }
        other => return Err(format!("unknown kind {other:?}")),
    }
    Ok(())
}

pub(super) fn check_object(doc: &Value) -> Result<(), String> {
    use k8s_openapi::api::{admissionregistration, apps, core, rbac, storage};
    use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
    let kind = (doc["apiVersion"].as_str().unwrap_or(""), doc["kind"].as_str().unwrap_or(""));
    match kind {
        ("v1", "Namespace") => round_trip::<core::v1::Namespace>(doc),
        ("v1", "ServiceAccount") => round_trip::<core::v1::ServiceAccount>(doc),
        ("v1", "Service") => round_trip::<core::v1::Service>(doc),
        ("v1", "ConfigMap") => round_trip::<core::v1::ConfigMap>(doc),
        ("apps/v1", "DaemonSet") => round_trip::<apps::v1::DaemonSet>(doc),
        ("rbac.authorization.k8s.io/v1", "ClusterRole") => round_trip::<rbac::v1::ClusterRole>(doc),
        ("rbac.authorization.k8s.io/v1", "ClusterRoleBinding") => round_trip::<rbac::v1::ClusterRoleBinding>(doc),
        ("rbac.authorization.k8s.io/v1", "Role") => round_trip::<rbac::v1::Role>(doc),
        ("rbac.authorization.k8s.io/v1", "RoleBinding") => round_trip::<rbac::v1::RoleBinding>(doc),
        ("admissionregistration.k8s.io/v1", "ValidatingAdmissionPolicy") => {
            round_trip::<admissionregistration::v1::ValidatingAdmissionPolicy>(doc)
        }
        ("admissionregistration.k8s.io/v1", "ValidatingAdmissionPolicyBinding") => {
            round_trip::<admissionregistration::v1::ValidatingAdmissionPolicyBinding>(doc)
        }
        ("storage.k8s.io/v1", "CSIDriver") => round_trip::<storage::v1::CSIDriver>(doc),
        ("storage.k8s.io/v1", "StorageClass") => round_trip::<storage::v1::StorageClass>(doc),
        ("apiextensions.k8s.io/v1", "CustomResourceDefinition") => round_trip::<CustomResourceDefinition>(doc),
        ("monitoring.coreos.com/v1", _) => operator_kind(doc),
        (v, k) => Err(format!("unknown kind {v}/{k}")),
    }
}

/// Every manifest under deploy/ (kustomization files aside).
fn manifests() -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut dirs = vec![root()];
    while let Some(d) = dirs.pop() {
        for e in std::fs::read_dir(&d).into_iter().flatten().flatten() {
            let p = e.path();
            if p.is_dir() {
                dirs.push(p);
            } else if p.extension().is_some_and(|x| x == "yaml") && p.file_name().is_some_and(|n| n != "kustomization.yaml") {
                out.push(p);
            }
        }
    }
    out.sort();
    out
}

pub(super) fn every_object_is_a_known_kind_with_known_fields() -> Result<(), Failed> {
    let mut seen = 0;
    let mut problems = Vec::new();
    for file in manifests() {
        let text = std::fs::read_to_string(&file)?;
        let docs: Vec<Value> = serde_saphyr::from_multiple(&text).map_err(|e| format!("{}: {e}", file.display()))?;
        for doc in docs {
            seen += 1;
            let name = doc["metadata"]["name"].as_str().unwrap_or("?").to_string();
            if let Err(e) = check_object(&doc) {
                problems.push(format!("{} {}/{name}: {e}", file.display(), doc["kind"].as_str().unwrap_or("?")));
            }
        }
    }
    if !problems.is_empty() {
        return Err(problems.join("\n").into());
    }
    if seen < 15 {
        return Err(format!("only {seen} objects under deploy/").into());
    }
    Ok(())
}

/// The check can fail: a misspelt field is found.
pub(super) fn a_misspelt_field_is_caught() -> Result<(), Failed> {
    let doc: Value = serde_saphyr::from_str(
        "apiVersion: apps/v1\nkind: DaemonSet\nmetadata: {name: x}\nspec:\n  selector: {matchLabels: {a: b}}\n  template:\n    metadata: {labels: {a: b}}\n    spec:\n      serviceAcountName: x\n      containers: [{name: c, image: i}]\n",
    )
    .map_err(|e| e.to_string())?;
    match check_object(&doc) {
        Err(e) if e.contains("serviceAcountName") => Ok(()),
        other => Err(format!("expected the misspelt field to be named, got {other:?}").into()),
    }
}
