//! The kustomizations: they name files that exist, render with
//! `kubectl kustomize` into objects that check out, and the admission
//! policy admits only the agent's own writes.

use super::objects::check_object;
use super::*;

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

pub(super) fn kustomizations_name_files_that_exist() -> Result<(), Failed> {
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
pub(super) fn every_kustomization_renders_and_checks() -> Result<(), Failed> {
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
pub(super) fn a_wrong_rendering_is_caught() -> Result<(), Failed> {
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
pub(super) fn the_admission_policy_admits_only_the_agents_own_writes() -> Result<(), Failed> {
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
