//! The workspace's crate graph is the layer diagram (docs/architecture.md).
//! Cargo already refuses a cycle; this test refuses an upward edge, so a
//! lower crate that starts to import a higher one fails here even when no
//! cycle closes (e.g. `volring-nbd` reaching for `volring-volumes`).

use std::process::Command;

/// Lowest first: a crate may depend only on crates before it.
const LAYERS: &[&str] = &[
    "volring-sys",
    "volring-ring",
    "volring-mounts",
    "volring-devices",
    "volring-nbd",
    "volring-volumes",
    "volring-share",
    "volring-csi",
    "volring-kube",
    "volring",
];

/// Only these two crates may hold `unsafe` (their manifests allow it; every
/// other crate inherits the workspace's `unsafe_code = "deny"`).
const UNSAFE_HOMES: &[&str] = &["volring-sys", "volring-ring"];

fn metadata() -> serde_json::Value {
    let out = Command::new(env!("CARGO"))
        .args(["metadata", "--format-version", "1", "--no-deps", "--offline"])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .expect("run cargo metadata");
    assert!(out.status.success(), "cargo metadata: {}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).expect("cargo metadata's JSON")
}

#[test]
fn every_dependency_points_down_the_layers() {
    let meta = metadata();
    let packages = meta["packages"].as_array().expect("packages");
    let mut seen = Vec::new();
    for p in packages {
        let name = p["name"].as_str().expect("name");
        let Some(level) = LAYERS.iter().position(|l| *l == name) else {
            panic!("workspace crate {name} is not in the layer list: place it in LAYERS and docs/architecture.md");
        };
        seen.push(name.to_string());
        for d in p["dependencies"].as_array().expect("dependencies") {
            let dep = d["name"].as_str().expect("dependency name");
            if let Some(dl) = LAYERS.iter().position(|l| *l == dep) {
                assert!(dl < level, "{name} depends on {dep}, which sits above or beside it in the layers");
            }
        }
    }
    seen.sort();
    let mut all: Vec<String> = LAYERS.iter().map(|s| s.to_string()).collect();
    all.sort();
    assert_eq!(seen, all, "the workspace's crates and the layer list differ");
}

#[test]
fn unsafe_is_allowed_only_in_sys_and_ring() {
    let meta = metadata();
    for p in meta["packages"].as_array().expect("packages") {
        let name = p["name"].as_str().expect("name");
        let manifest = std::fs::read_to_string(p["manifest_path"].as_str().expect("manifest_path")).expect("read manifest");
        let allows = manifest.contains("unsafe_code = \"allow\"");
        let inherits = manifest.contains("[lints]\nworkspace = true");
        if UNSAFE_HOMES.contains(&name) {
            assert!(
                allows && manifest.contains("undocumented_unsafe_blocks = \"deny\""),
                "{name}: its own lints must allow unsafe and deny undocumented blocks"
            );
        } else {
            assert!(inherits && !allows, "{name} must inherit the workspace lints (unsafe denied)");
        }
    }
}
