//! The agent's admission policy (deploy/base/admission-policy.yaml), as
//! `kubectl kustomize` renders it, evaluated the way the API server does:
//! the match constraints and conditions pick the request, the variables are
//! computed in order, and every validation must be true (an evaluation
//! error denies: `failurePolicy: Fail`). The expressions run on the `cel`
//! crate against the objects crates/share really writes (made by its own
//! functions) and against writes the agent must not make.

use serde_json::{json, Value};
use volring_share::kube::{desired_service, desired_slice, SharedVolume};

/// The agent's ServiceAccount as the API server names it in a request.
const AGENT: &str = "system:serviceaccount:volring:volring-agent";

/// One admission request: who, what, and the objects before and after.
pub struct Request {
    pub operation: &'static str,
    pub user: &'static str,
    /// `(group, version, kind)`.
    pub kind: (&'static str, &'static str, &'static str),
    pub resource: &'static str,
    pub namespace: String,
    pub name: String,
    pub object: Value,
    pub old: Value,
}

/// What the policy decides: not matched, admitted, or denied with the
/// failing validation's message (or the evaluation error).
#[derive(Debug, PartialEq, Eq)]
pub enum Verdict {
    NotMatched,
    Admitted,
    Denied(String),
}

fn eval(expr: &str, ctx: &cel::Context) -> Result<cel::Value, String> {
    let program = cel::Program::compile(expr).map_err(|e| format!("{expr}: does not parse: {e}"))?;
    program.execute(ctx).map_err(|e| format!("{expr}: {e}"))
}

fn value(v: &Value) -> Result<cel::Value, String> {
    cel::to_value(v).map_err(|e| format!("{v}: {e}"))
}

/// Whether `rules` (matchConstraints.resourceRules) cover the request.
fn matches(policy: &Value, r: &Request) -> bool {
    policy["spec"]["matchConstraints"]["resourceRules"].as_array().into_iter().flatten().any(|rule| {
        let has = |key: &str, want: &str| rule[key].as_array().is_some_and(|a| a.iter().any(|x| x == want || x == "*"));
        has("apiGroups", r.kind.0) && has("apiVersions", r.kind.1) && has("operations", r.operation) && has("resources", r.resource)
    })
}

/// The policy's decision on `r`.
pub fn decide(policy: &Value, r: &Request) -> Result<Verdict, String> {
    if !matches(policy, r) {
        return Ok(Verdict::NotMatched);
    }
    let mut ctx = cel::Context::default();
    let request = json!({
        "operation": r.operation,
        "userInfo": {"username": r.user},
        "kind": {"group": r.kind.0, "version": r.kind.1, "kind": r.kind.2},
        "resource": {"group": r.kind.0, "version": r.kind.1, "resource": r.resource},
        "namespace": r.namespace,
        "name": r.name,
    });
    ctx.add_variable_from_value("request", value(&request)?);
    ctx.add_variable_from_value("object", value(&r.object)?);
    ctx.add_variable_from_value("oldObject", value(&r.old)?);
    let spec = &policy["spec"];
    for c in spec["matchConditions"].as_array().into_iter().flatten() {
        match eval(c["expression"].as_str().unwrap_or(""), &ctx) {
            Ok(cel::Value::Bool(true)) => {}
            Ok(cel::Value::Bool(false)) => return Ok(Verdict::NotMatched),
            Ok(other) => return Err(format!("matchCondition {}: not a bool: {other:?}", c["name"])),
            Err(e) => return Ok(Verdict::Denied(format!("matchCondition error: {e}"))),
        }
    }
    // Variables in order, each seeing the ones before it.
    let mut computed: Vec<(String, cel::Value)> = Vec::new();
    for v in spec["variables"].as_array().into_iter().flatten() {
        let name = v["name"].as_str().ok_or("a variable without a name")?.to_string();
        let mut c = cel::Context::default();
        c.add_variable_from_value("request", value(&request)?);
        c.add_variable_from_value("object", value(&r.object)?);
        c.add_variable_from_value("oldObject", value(&r.old)?);
        c.add_variable_from_value("variables", variables(&computed));
        let got = eval(v["expression"].as_str().unwrap_or(""), &c)?;
        computed.push((name, got));
    }
    ctx.add_variable_from_value("variables", variables(&computed));
    for v in spec["validations"].as_array().into_iter().flatten() {
        let expr = v["expression"].as_str().unwrap_or("");
        match eval(expr, &ctx) {
            Ok(cel::Value::Bool(true)) => {}
            Ok(cel::Value::Bool(false)) => return Ok(Verdict::Denied(v["message"].as_str().unwrap_or(expr).to_string())),
            Ok(other) => return Err(format!("{expr}: not a bool: {other:?}")),
            Err(e) => return Ok(Verdict::Denied(format!("evaluation error: {e}"))),
        }
    }
    Ok(Verdict::Admitted)
}

/// `variables` as a CEL map of the values computed so far.
fn variables(computed: &[(String, cel::Value)]) -> cel::Value {
    let map: std::collections::HashMap<cel::objects::Key, cel::Value> =
        computed.iter().map(|(k, v)| (cel::objects::Key::from(k.clone()), v.clone())).collect();
    cel::Value::Map(cel::objects::Map { map: std::sync::Arc::new(map) })
}

fn vol() -> SharedVolume {
    SharedVolume {
        volume_id: "pvc-0001".into(),
        pvc_namespace: "apps".into(),
        pvc_name: "data".into(),
        server: "192.0.2.10".parse().expect("ip"),
        server_port: 2049,
    }
}

fn owner() -> k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference {
    k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference {
        api_version: "v1".into(),
        kind: "PersistentVolumeClaim".into(),
        name: "data".into(),
        uid: "3f0c".into(),
        ..Default::default()
    }
}

/// `o` as the API server holds it: serialized, with a resourceVersion.
fn stored(o: impl serde::Serialize, kind: &str, api: &str) -> Value {
    let mut v = serde_json::to_value(o).expect("serializes");
    v["apiVersion"] = api.into();
    v["kind"] = kind.into();
    v["metadata"]["resourceVersion"] = "7".into();
    v
}

const SERVICE: (&str, &str, &str) = ("", "v1", "Service");
const SLICE: (&str, &str, &str) = ("discovery.k8s.io", "v1", "EndpointSlice");

fn req(operation: &'static str, kind: (&'static str, &'static str, &'static str), object: Value, old: Value) -> Request {
    let resource = if kind == SLICE { "endpointslices" } else { "services" };
    let meta = if object.is_null() { &old["metadata"] } else { &object["metadata"] };
    Request {
        operation,
        user: AGENT,
        kind,
        resource,
        namespace: meta["namespace"].as_str().unwrap_or("").to_string(),
        name: meta["name"].as_str().unwrap_or("").to_string(),
        object,
        old,
    }
}

/// Every write crates/share makes for a shared volume: the Service's
/// create and update (the ClusterIP kept), the slice's create, update (a
/// failover, a withdrawal emptying it) and delete (an address-type change).
pub fn the_agents_own_writes() -> Vec<(&'static str, Request)> {
    let v = vol();
    let svc = stored(desired_service(&v, &owner()), "Service", "v1");
    let mut svc_have = svc.clone();
    svc_have["spec"]["clusterIP"] = "10.96.0.7".into();
    let mut moved = v.clone();
    moved.server = "192.0.2.20".parse().expect("ip");
    let slice = stored(desired_slice(&v, &owner(), true), "EndpointSlice", "discovery.k8s.io/v1");
    let idle = stored(desired_slice(&v, &owner(), false), "EndpointSlice", "discovery.k8s.io/v1");
    let other = stored(desired_slice(&moved, &owner(), true), "EndpointSlice", "discovery.k8s.io/v1");
    vec![
        ("Service create", req("CREATE", SERVICE, svc.clone(), Value::Null)),
        ("Service update", req("UPDATE", SERVICE, svc_have.clone(), svc_have.clone())),
        ("slice create", req("CREATE", SLICE, slice.clone(), Value::Null)),
        ("slice failover", req("UPDATE", SLICE, other.clone(), slice.clone())),
        ("slice withdrawal", req("UPDATE", SLICE, idle.clone(), slice.clone())),
        ("slice delete (address type)", req("DELETE", SLICE, Value::Null, slice)),
    ]
}

/// Writes the agent must not make, each with the reason it is refused.
pub fn writes_it_must_not_make() -> Vec<(&'static str, Request)> {
    let v = vol();
    let svc = stored(desired_service(&v, &owner()), "Service", "v1");
    let slice = stored(desired_slice(&v, &owner(), true), "EndpointSlice", "discovery.k8s.io/v1");
    let kubernetes = json!({"apiVersion": "v1", "kind": "Service",
        "metadata": {"name": "kubernetes", "namespace": "default", "labels": {"component": "apiserver", "provider": "kubernetes"}},
        "spec": {"type": "ClusterIP", "clusterIP": "10.96.0.1", "ports": [{"name": "https", "port": 443, "targetPort": 6443}]}});
    // The same Service with volring's label and owner added: a takeover.
    let mut taken = kubernetes.clone();
    taken["metadata"]["labels"]["volring.io/volume"] = "pvc-0001".into();
    taken["metadata"]["ownerReferences"] = json!([{"apiVersion": "v1", "kind": "PersistentVolumeClaim", "name": "kubernetes", "uid": "x"}]);
    let mut unlabelled = svc.clone();
    unlabelled["metadata"]["labels"] = json!({});
    let mut unowned = svc.clone();
    unowned["metadata"].as_object_mut().expect("metadata").remove("ownerReferences");
    let mut foreign_owner = svc.clone();
    foreign_owner["metadata"]["ownerReferences"][0]["name"] = "other".into();
    let mut not_managed = slice.clone();
    not_managed["metadata"]["labels"]["endpointslice.kubernetes.io/managed-by"] = "endpointslice-controller.k8s.io".into();
    let mut feeds_another = slice.clone();
    feeds_another["metadata"]["labels"]["kubernetes.io/service-name"] = "kubernetes".into();
    let mut in_system = svc.clone();
    in_system["metadata"]["namespace"] = "kube-system".into();
    let mut kubernetes_slice = slice.clone();
    kubernetes_slice["metadata"]["namespace"] = "default".into();
    kubernetes_slice["metadata"]["name"] = "kubernetes".into();
    kubernetes_slice["metadata"]["labels"]["kubernetes.io/service-name"] = "kubernetes".into();
    kubernetes_slice["metadata"]["ownerReferences"][0]["name"] = "kubernetes".into();
    let mut mirrored = slice.clone();
    mirrored["metadata"]["labels"] =
        json!({"kubernetes.io/service-name": "data", "endpointslice.kubernetes.io/managed-by": "endpointslicemirroring-controller.k8s.io"});
    vec![
        ("default/kubernetes taken over", req("UPDATE", SERVICE, taken, kubernetes.clone())),
        ("default/kubernetes deleted", req("DELETE", SERVICE, Value::Null, kubernetes)),
        ("a Service without volring's label", req("CREATE", SERVICE, unlabelled, Value::Null)),
        ("a Service without an owner", req("CREATE", SERVICE, unowned, Value::Null)),
        ("a Service owned by another PVC's name", req("CREATE", SERVICE, foreign_owner, Value::Null)),
        ("a Service in kube-system", req("CREATE", SERVICE, in_system, Value::Null)),
        ("a slice managed by another controller", req("CREATE", SLICE, not_managed.clone(), Value::Null)),
        ("a slice feeding another Service", req("CREATE", SLICE, feeds_another, Value::Null)),
        ("a slice for default/kubernetes", req("CREATE", SLICE, kubernetes_slice, Value::Null)),
        ("another controller's slice taken over", req("UPDATE", SLICE, slice.clone(), not_managed)),
        ("the mirroring controller's slice deleted", req("DELETE", SLICE, Value::Null, mirrored)),
    ]
}

/// Checks the rendered policy and binding, then decides every case.
pub fn check_policy(objects: &[Value]) -> Result<(), String> {
    let find = |kind: &str| objects.iter().find(|o| o["kind"] == kind && o["apiVersion"] == "admissionregistration.k8s.io/v1");
    let policy = find("ValidatingAdmissionPolicy").ok_or("no ValidatingAdmissionPolicy rendered")?;
    let binding = find("ValidatingAdmissionPolicyBinding").ok_or("no ValidatingAdmissionPolicyBinding rendered")?;
    let mut problems = Vec::new();
    if binding["spec"]["policyName"] != policy["metadata"]["name"] {
        problems.push(format!("the binding names {}, the policy is {}", binding["spec"]["policyName"], policy["metadata"]["name"]));
    }
    if binding["spec"]["validationActions"] != json!(["Deny"]) {
        problems.push(format!("the binding's actions are {} (Deny expected)", binding["spec"]["validationActions"]));
    }
    if policy["spec"]["failurePolicy"] != "Fail" {
        problems.push("failurePolicy is not Fail".into());
    }
    // The ServiceAccount the condition names is the one the agent runs as.
    let sa = objects.iter().find(|o| o["kind"] == "DaemonSet" && o["metadata"]["name"] == "volring");
    let sa = sa.map(|d| {
        (d["metadata"]["namespace"].as_str().unwrap_or(""), d["spec"]["template"]["spec"]["serviceAccountName"].as_str().unwrap_or(""))
    });
    if sa.map(|(ns, n)| format!("system:serviceaccount:{ns}:{n}")).as_deref() != Some(AGENT) {
        problems.push(format!("the agent runs as {sa:?}, the policy matches {AGENT}"));
    }
    for (what, r) in the_agents_own_writes() {
        match decide(policy, &r) {
            Ok(Verdict::Admitted) => {}
            other => problems.push(format!("the agent's own {what} is not admitted: {other:?}")),
        }
        let mut someone_else = r;
        someone_else.user = "system:serviceaccount:kube-system:endpointslice-controller";
        if decide(policy, &someone_else) != Ok(Verdict::NotMatched) {
            problems.push(format!("{what} by another account is matched"));
        }
    }
    for (what, r) in writes_it_must_not_make() {
        match decide(policy, &r) {
            Ok(Verdict::Denied(why)) if !why.starts_with("evaluation error") => {}
            other => problems.push(format!("{what}: {other:?} (denied by a validation expected)")),
        }
    }
    if problems.is_empty() {
        Ok(())
    } else {
        Err(problems.join("\n"))
    }
}
