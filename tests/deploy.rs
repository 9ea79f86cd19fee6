//! deploy/ as the API server reads it: every document parses, every object
//! is of a kind this test knows, and every field in it exists in that
//! kind's schema (the Kubernetes types from k8s-openapi: a field they do
//! not know is dropped on the round trip and shows as a difference). The
//! kustomizations name only files that exist, and every one that can be
//! applied renders with `kubectl kustomize` into objects checked the same
//! way and against the rendered CRDs, with the agent's image as
//! deploy/image/build.sh tags it and every other image pinned by digest.
//! Every program the agent runs is in the image's package list. No cluster
//! is involved.

mod deploy_support;

use std::path::{Path, PathBuf};

use libtest_mimic::{Failed, Trial};
use serde::de::DeserializeOwned;
use serde::Serialize;
use serde_json::Value;

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("deploy")
}

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

fn check_object(doc: &Value) -> Result<(), String> {
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

fn every_object_is_a_known_kind_with_known_fields() -> Result<(), Failed> {
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
fn a_misspelt_field_is_caught() -> Result<(), Failed> {
    let doc: Value = serde_saphyr::from_str(
        "apiVersion: apps/v1\nkind: DaemonSet\nmetadata: {name: x}\nspec:\n  selector: {matchLabels: {a: b}}\n  template:\n    metadata: {labels: {a: b}}\n    spec:\n      serviceAcountName: x\n      containers: [{name: c, image: i}]\n",
    )
    .map_err(|e| e.to_string())?;
    match check_object(&doc) {
        Err(e) if e.contains("serviceAcountName") => Ok(()),
        other => Err(format!("expected the misspelt field to be named, got {other:?}").into()),
    }
}

/// Every kustomization under deploy/ (a directory with a
/// kustomization.yaml), as a path relative to deploy/ ("" for deploy/).
fn kustomizations() -> Vec<String> {
    let mut out = Vec::new();
    let mut dirs = vec![root()];
    while let Some(d) = dirs.pop() {
        if d.join("kustomization.yaml").is_file() {
            out.push(d.strip_prefix(root()).unwrap_or(&d).to_string_lossy().into_owned());
        }
        for e in std::fs::read_dir(&d).into_iter().flatten().flatten() {
            if e.path().is_dir() {
                dirs.push(e.path());
            }
        }
    }
    out.sort();
    out
}

fn kustomization(dir: &str) -> Result<Value, Failed> {
    let text = std::fs::read_to_string(root().join(dir).join("kustomization.yaml"))?;
    Ok(serde_saphyr::from_str(&text).map_err(|e| format!("deploy/{dir}/kustomization.yaml: {e}"))?)
}

/// A Component is applied through another kustomization, never on its own.
fn is_component(k: &Value) -> bool {
    k["kind"].as_str() == Some("Component")
}

fn kustomizations_name_files_that_exist() -> Result<(), Failed> {
    let all = kustomizations();
    if all.len() < 10 {
        return Err(format!("only {} kustomizations under deploy/: {all:?}", all.len()).into());
    }
    for rel in all {
        let dir = root().join(&rel);
        let k = kustomization(&rel)?;
        let strings =
            |key: &str| -> Vec<String> { k[key].as_array().into_iter().flatten().filter_map(|r| r.as_str().map(String::from)).collect() };
        let mut named = strings("resources");
        named.extend(strings("components"));
        for g in k["configMapGenerator"].as_array().into_iter().flatten() {
            named.extend(g["files"].as_array().into_iter().flatten().filter_map(|f| f.as_str().map(String::from)));
        }
        for n in named {
            let p = dir.join(&n);
            let ok = p.is_file() || p.join("kustomization.yaml").is_file();
            if !ok {
                return Err(format!("{}: {n} does not exist", dir.display()).into());
            }
        }
    }
    Ok(())
}

/// `kubectl kustomize DIR`: what `kubectl apply -k DIR` sends. None when
/// kubectl is missing outside CI.
fn render(dir: &Path) -> Result<Option<Vec<Value>>, Failed> {
    let out = match std::process::Command::new("kubectl").arg("kustomize").arg(dir).output() {
        Ok(o) => o,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound && std::env::var_os("CI").is_none() => return Ok(None),
        Err(e) => return Err(format!("kubectl: {e} (kubectl ships with the machine's image; kustomize is built into it)").into()),
    };
    if !out.status.success() {
        return Err(format!("kubectl kustomize {}: {}", dir.display(), String::from_utf8_lossy(&out.stderr).trim()).into());
    }
    let text = String::from_utf8(out.stdout)?;
    let docs: Vec<Value> = serde_saphyr::from_multiple(&text).map_err(|e| format!("kubectl kustomize {}: {e}", dir.display()))?;
    Ok(Some(docs.into_iter().filter(|d| !d.is_null()).collect()))
}

/// The package version, which is the image's tag (deploy/image/build.sh).
fn version() -> &'static str {
    env!("CARGO_PKG_VERSION")
}

fn args_of<'a>(objects: &'a [Value], kind: &str, name: &str, container: &str) -> Vec<&'a str> {
    objects
        .iter()
        .filter(|o| o["kind"] == kind && o["metadata"]["name"] == name)
        .flat_map(|o| o["spec"]["template"]["spec"]["containers"].as_array().into_iter().flatten())
        .filter(|c| c["name"] == container)
        .flat_map(|c| c["args"].as_array().into_iter().flatten())
        .filter_map(|a| a.as_str())
        .collect()
}

fn object<'a>(objects: &'a [Value], kind: &str, name: &str) -> Option<&'a Value> {
    objects.iter().find(|o| o["kind"] == kind && o["metadata"]["name"] == name)
}

/// Kinds that are cluster-scoped among those deploy/ ships.
const CLUSTER_SCOPED: &[&str] = &[
    "Namespace",
    "ClusterRole",
    "ClusterRoleBinding",
    "CustomResourceDefinition",
    "CSIDriver",
    "StorageClass",
    "ValidatingAdmissionPolicy",
    "ValidatingAdmissionPolicyBinding",
];

/// What one rendered kustomization must be, whatever its switches.
fn check_rendered(dir: &str, objects: &[Value]) -> Vec<String> {
    let mut problems = Vec::new();
    let mut say = |s: String| problems.push(format!("deploy/{dir}: {s}"));
    // Kinds: a built-in one this test knows the schema of, one of the
    // Prometheus Operator, or one a rendered CRD defines.
    let crd_kinds: Vec<(String, String)> = objects
        .iter()
        .filter(|o| o["kind"] == "CustomResourceDefinition")
        .flat_map(|c| {
            let group = c["spec"]["group"].as_str().unwrap_or("").to_string();
            let kind = c["spec"]["names"]["kind"].as_str().unwrap_or("").to_string();
            c["spec"]["versions"]
                .as_array()
                .into_iter()
                .flatten()
                .map(move |v| (format!("{group}/{}", v["name"].as_str().unwrap_or("")), kind.clone()))
        })
        .collect();
    let crd_plurals: Vec<String> = objects
        .iter()
        .filter(|o| o["kind"] == "CustomResourceDefinition")
        .filter_map(|c| c["spec"]["names"]["plural"].as_str().map(String::from))
        .collect();
    for o in objects {
        let (api, kind, name) =
            (o["apiVersion"].as_str().unwrap_or(""), o["kind"].as_str().unwrap_or(""), o["metadata"]["name"].as_str().unwrap_or("?"));
        let defined = crd_kinds.iter().any(|(a, k)| a == api && k == kind);
        if !defined {
            if let Err(e) = check_object(o) {
                say(format!("{kind}/{name}: {e}"));
            }
        }
        if !CLUSTER_SCOPED.contains(&kind) && o["metadata"]["namespace"] != "volring" {
            say(format!("{kind}/{name} is namespaced but not in the volring namespace"));
        }
        // Pods: the agent's image is the one the build makes, every other
        // image is pinned by tag and digest, none is pulled when present.
        let pod = &o["spec"]["template"]["spec"];
        let containers = pod["containers"].as_array().into_iter().flatten().chain(pod["initContainers"].as_array().into_iter().flatten());
        for c in containers {
            let image = c["image"].as_str().unwrap_or("");
            let cname = c["name"].as_str().unwrap_or("?");
            if c["imagePullPolicy"] != "IfNotPresent" {
                say(format!("{kind}/{name} container {cname}: imagePullPolicy {} (IfNotPresent expected)", c["imagePullPolicy"]));
            }
            if image.starts_with("volring:") || image.starts_with("volring@") {
                if image != format!("volring:{}", version()) {
                    say(format!("{kind}/{name} container {cname}: image {image}, the build makes volring:{}", version()));
                }
                continue;
            }
            let pinned = image.split_once('@').is_some_and(|(named, digest)| {
                named.rsplit('/').next().is_some_and(|last| last.contains(':'))
                    && digest
                        .strip_prefix("sha256:")
                        .is_some_and(|h| h.len() == 64 && h.bytes().all(|b| b.is_ascii_hexdigit() && !b.is_ascii_uppercase()))
            });
            if !pinned {
                say(format!("{kind}/{name} container {cname}: image {image} is not pinned by tag and digest"));
            }
        }
        if let Some(sa) = pod["serviceAccountName"].as_str() {
            if object(objects, "ServiceAccount", sa).is_none() {
                say(format!("{kind}/{name} runs as ServiceAccount {sa}, which is not rendered"));
            }
        }
        // RBAC on volring.io names only resources whose CRD is rendered.
        if kind == "ClusterRole" || kind == "Role" {
            for r in o["rules"].as_array().into_iter().flatten() {
                if !r["apiGroups"].as_array().is_some_and(|g| g.iter().any(|g| g == "volring.io")) {
                    continue;
                }
                for res in r["resources"].as_array().into_iter().flatten().filter_map(|x| x.as_str()) {
                    let plural = res.split('/').next().unwrap_or(res);
                    if !crd_plurals.iter().any(|p| p == plural) {
                        say(format!("{kind}/{name} grants {res} but no CRD defines {plural}"));
                    }
                }
            }
        }
    }
    for (kind, name) in [("DaemonSet", "volring"), ("DaemonSet", "volring-csi"), ("CSIDriver", "volring.csi.io"), ("Namespace", "volring")]
    {
        if object(objects, kind, name).is_none() && dir != "crds" {
            say(format!("no {kind}/{name}"));
        }
    }
    // The switches the directory's name promises.
    let monitoring = dir == "monitoring" || dir.ends_with("-monitoring");
    let no_publisher = dir.contains("no-publisher");
    let single_node = dir.contains("single-node");
    let has = |kind: &str| objects.iter().any(|o| o["kind"] == kind);
    if dir != "crds" {
        if monitoring != (has("ServiceMonitor") && has("PrometheusRule") && object(objects, "ConfigMap", "volring-dashboard").is_some()) {
            say(format!("monitoring objects {}", if monitoring { "missing" } else { "present" }));
        }
        let agent = args_of(objects, "DaemonSet", "volring", "volring");
        if no_publisher != agent.contains(&"--no-publish") {
            say(format!("agent args {agent:?} (--no-publish expected: {no_publisher})"));
        }
        if no_publisher != crd_plurals.is_empty() {
            say(format!("CRDs {crd_plurals:?} with the publisher {}", if no_publisher { "off" } else { "on" }));
        }
        let resizer = args_of(objects, "DaemonSet", "volring-csi", "resizer");
        let elected = resizer.contains(&"--leader-election=true");
        let lease_rule = object(objects, "Role", "volring-csi").is_some_and(|r| {
            r["rules"]
                .as_array()
                .into_iter()
                .flatten()
                .any(|x| x["apiGroups"].as_array().is_some_and(|g| g.iter().any(|g| g == "coordination.k8s.io")))
        });
        if resizer.is_empty() || single_node == elected || elected != lease_rule {
            say(format!("resizer args {resizer:?}, lease rights {lease_rule}, single node: {single_node}"));
        }
    }
    problems
}

/// Every kustomization that can be applied renders with `kubectl
/// kustomize` (kustomize 5, as in kubectl 1.29 to 1.33: no root inside a
/// root it builds on), and what it renders is right: known kinds with known
/// fields or kinds a rendered CRD defines, RBAC only on rendered CRDs, the
/// agent's image as the build tags it, every other image pinned by digest,
/// and the switches its name promises (monitoring, no-publisher,
/// single-node).
fn every_kustomization_renders_and_checks() -> Result<(), Failed> {
    let mut problems = Vec::new();
    let mut rendered = 0;
    for dir in kustomizations() {
        if is_component(&kustomization(&dir)?) {
            continue;
        }
        let Some(objects) = render(&root().join(&dir))? else {
            eprintln!("kubectl not found: skipped");
            return Ok(());
        };
        rendered += 1;
        problems.extend(check_rendered(&dir, &objects));
        if dir != "crds" {
            if let Err(e) = deploy_support::check_policy(&objects) {
                problems.push(format!("deploy/{dir}: the admission policy: {e}"));
            }
        }
    }
    if rendered < 9 {
        problems.push(format!("only {rendered} kustomizations rendered"));
    }
    if !problems.is_empty() {
        return Err(problems.join("\n").into());
    }
    Ok(())
}

/// The checks can fail: an unpinned sidecar, the wrong agent tag, a
/// missing switch and a namespace-less object are each named.
fn a_wrong_rendering_is_caught() -> Result<(), Failed> {
    let Some(mut objects) = render(&root())? else {
        eprintln!("kubectl not found: skipped");
        return Ok(());
    };
    if !check_rendered("", &objects).is_empty() {
        return Err(format!("deploy/ itself fails: {:?}", check_rendered("", &objects)).into());
    }
    for o in objects.iter_mut().filter(|o| o["kind"] == "DaemonSet" && o["metadata"]["name"] == "volring") {
        let c = &mut o["spec"]["template"]["spec"]["containers"];
        c[0]["image"] = Value::from("volring:0.0.1");
        c[1]["image"] = Value::from("registry.k8s.io/sig-storage/csi-node-driver-registrar:v2.17.0");
    }
    for o in objects.iter_mut().filter(|o| o["kind"] == "ServiceAccount") {
        o["metadata"].as_object_mut().ok_or("metadata")?.remove("namespace");
    }
    let said = check_rendered("overlays/no-publisher", &objects).join("\n");
    for want in [
        "image volring:0.0.1",
        "csi-node-driver-registrar:v2.17.0 is not pinned",
        "--no-publish expected: true",
        "not in the volring namespace",
    ] {
        if !said.contains(want) {
            return Err(format!("expected {want:?} among:\n{said}").into());
        }
    }
    Ok(())
}

/// Issue 29, least privilege: the rendered admission policy admits every
/// write crates/share makes for a shared volume, does not match other
/// accounts, and denies the agent's ServiceAccount each write it must not
/// make (default/kubernetes taken over or deleted, an unlabelled or
/// unowned Service, a slice another controller manages or one feeding
/// another Service, anything in kube-system). And the evaluation can
/// deny: without the policy's validations the same cases are admitted.
fn the_admission_policy_admits_only_the_agents_own_writes() -> Result<(), Failed> {
    let Some(objects) = render(&root().join("base"))? else {
        eprintln!("kubectl not found: skipped");
        return Ok(());
    };
    deploy_support::check_policy(&objects)?;
    let mut gutted = objects.clone();
    for o in gutted.iter_mut().filter(|o| o["kind"] == "ValidatingAdmissionPolicy") {
        o["spec"]["validations"] = Value::Array(Vec::new());
    }
    let said = deploy_support::check_policy(&gutted).err().unwrap_or_default();
    if !said.contains("default/kubernetes taken over") || !said.contains("a slice feeding another Service") {
        return Err(format!("a policy without validations passed the check: {said:?}").into());
    }
    Ok(())
}

/// The programs the agent runs, from its source: `volumes::run("NAME", …)`,
/// the mkfs programs (`FsKind::mkfs_command`), the nfs-ganesha daemon
/// (`--nfs-ganesha`'s default). The process-spawning sites are listed, so
/// a new one fails this test until it is looked at (and its program put in
/// deploy/image/packages.txt).
fn programs_the_agent_runs() -> Result<Vec<String>, Failed> {
    const SPAWN_SITES: &[(&str, &str)] =
        &[("crates/volumes/src/lib.rs", "Command::new(program)"), ("crates/share/src/server.rs", "Command::new(&self.files.binary)")];
    let top = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut files = Vec::new();
    let mut dirs = vec![top.join("src"), top.join("crates")];
    while let Some(d) = dirs.pop() {
        for e in std::fs::read_dir(&d)?.flatten() {
            let p = e.path();
            if p.is_dir() {
                dirs.push(p);
            } else if p.extension().is_some_and(|x| x == "rs") {
                files.push(p);
            }
        }
    }
    let mut programs = std::collections::BTreeSet::new();
    let mut sites = Vec::new();
    // The literal after `marker`, with `keep` (the part of the marker that
    // belongs to the name) in front.
    let literal_after = |text: &str, marker: &str, keep: &str, out: &mut std::collections::BTreeSet<String>| {
        for (i, _) in text.match_indices(marker) {
            let rest = &text[i + marker.len()..];
            match rest.find('"') {
                Some(end) if rest[..end].bytes().all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b)) => {
                    out.insert(format!("{keep}{}", &rest[..end]));
                }
                _ => {}
            }
        }
    };
    for f in &files {
        let whole = std::fs::read_to_string(f)?;
        // A crate's unit tests may run peers (nbdkit, qemu-nbd): not the agent's programs.
        let text = whole.split("#[cfg(test)]\nmod tests").next().unwrap_or_default();
        let rel = f.strip_prefix(Path::new(env!("CARGO_MANIFEST_DIR"))).unwrap_or(f).to_string_lossy().into_owned();
        for (i, _) in text.match_indices("Command::new(") {
            let end = text[i..].find(')').map(|e| i + e + 1).unwrap_or(text.len());
            sites.push((rel.clone(), text[i..end].to_string()));
        }
        literal_after(text, " run(\"", "", &mut programs);
        literal_after(text, "(run(\"", "", &mut programs);
        literal_after(text, "\"mkfs.", "mkfs.", &mut programs);
        literal_after(text, "VOLRING_NFS_GANESHA\", default_value = \"", "", &mut programs);
    }
    let programs: Vec<String> = programs.into_iter().collect();
    let unknown: Vec<String> = sites
        .iter()
        .filter(|(f, call)| !SPAWN_SITES.iter().any(|(sf, sc)| f == sf && call == sc))
        .map(|(f, c)| format!("{f}: {c}"))
        .collect();
    if !unknown.is_empty() {
        return Err(format!(
            "process spawns this test does not know (list them in SPAWN_SITES, their programs in deploy/image/packages.txt): {unknown:?}"
        )
        .into());
    }
    Ok(programs)
}
/// deploy/image/packages.txt: each package with the programs the agent
/// runs from it.
fn image_packages() -> Result<Vec<(String, Vec<String>)>, Failed> {
    let text = std::fs::read_to_string(root().join("image/packages.txt"))?;
    Ok(text
        .lines()
        .map(|l| l.split('#').next().unwrap_or(""))
        .filter_map(|l| {
            let mut words = l.split_whitespace().map(String::from);
            words.next().map(|p| (p, words.collect()))
        })
        .collect())
}

/// The Debian package that ships PROGRAM in a bin directory on this
/// machine (`dpkg -S`); None when no installed package does.
fn debian_package_of(program: &str) -> Result<Option<String>, Failed> {
    let out = std::process::Command::new("dpkg").args(["-S", &format!("bin/{program}")]).output()?;
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        let Some((packages, path)) = line.split_once(": ") else { continue };
        if line.starts_with("diversion ") || !path.ends_with(&format!("bin/{program}")) {
            continue;
        }
        if Path::new(path).file_name().is_some_and(|n| n == program) {
            return Ok(packages.split(", ").next().map(|p| p.split(':').next().unwrap_or(p).to_string()));
        }
    }
    Ok(None)
}

/// Every program the agent runs is in the image: listed in
/// deploy/image/packages.txt (which build.sh and the Dockerfile install,
/// and build.sh checks on the image's PATH) beside the package that ships
/// it here (`dpkg -S`); the list names no program the agent does not run.
fn every_program_the_agent_runs_is_in_the_image() -> Result<(), Failed> {
    let programs = programs_the_agent_runs()?;
    let mut problems = Vec::new();
    for want in ["mkfs.ext4", "mkfs.xfs", "resize2fs", "xfs_growfs", "ganesha.nfsd"] {
        if !programs.iter().any(|p| p == want) {
            problems.push(format!("the scan of src/ and crates/ did not find {want} (found {programs:?}): the scan is out of date"));
        }
    }
    let listed = image_packages()?;
    for p in &programs {
        let Some((package, _)) = listed.iter().find(|(_, progs)| progs.contains(p)) else {
            problems.push(format!("{p}: the agent runs it, deploy/image/packages.txt does not list it"));
            continue;
        };
        match debian_package_of(p)? {
            Some(shipped) if shipped == *package => {}
            Some(shipped) => problems.push(format!("{p}: listed under {package}, but {shipped} ships it (dpkg -S)")),
            None if std::env::var_os("CI").is_some() => {
                problems.push(format!("{p}: no installed package ships it (.ci/deps installs {package})"))
            }
            None => eprintln!("{p}: not installed here, its package not checked (apt-get install {package})"),
        }
    }
    for (package, progs) in &listed {
        for p in progs.iter().filter(|p| !programs.contains(p)) {
            problems.push(format!("{p}: listed under {package} in deploy/image/packages.txt, but the agent does not run it"));
        }
    }
    for reader in ["Dockerfile", "image/build.sh"] {
        if !std::fs::read_to_string(root().join(reader))?.contains("packages.txt") {
            problems.push(format!("deploy/{reader} does not read deploy/image/packages.txt"));
        }
    }
    if !problems.is_empty() {
        return Err(problems.join("\n").into());
    }
    Ok(())
}

fn main() {
    let args = libtest_mimic::Arguments::from_args();
    let trials = vec![
        Trial::test("deploy::every_object_is_a_known_kind_with_known_fields", every_object_is_a_known_kind_with_known_fields),
        Trial::test("deploy::a_misspelt_field_is_caught", a_misspelt_field_is_caught),
        Trial::test("deploy::kustomizations_name_files_that_exist", kustomizations_name_files_that_exist),
        Trial::test("deploy::every_kustomization_renders_and_checks", every_kustomization_renders_and_checks),
        Trial::test("deploy::a_wrong_rendering_is_caught", a_wrong_rendering_is_caught),
        Trial::test(
            "deploy::the_admission_policy_admits_only_the_agents_own_writes",
            the_admission_policy_admits_only_the_agents_own_writes,
        ),
        Trial::test("deploy::every_program_the_agent_runs_is_in_the_image", every_program_the_agent_runs_is_in_the_image),
    ];
    libtest_mimic::run(&args, trials).exit();
}
