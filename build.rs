//! Compiles proto/csi.proto with protox (pure Rust), so building volring
//! needs no system protoc. The messages also derive `serde::Serialize` so
//! that `volring csi` can print any reply as JSON; enum fields are printed
//! by name (see `csi::proto`).

fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!("cargo:rerun-if-changed=proto/csi.proto");
    git_commit();
    let fds = protox::compile(["proto/csi.proto"], ["proto"])?;
    let enum_fields = [
        (".csi.v1.PluginCapability.Service.type", "plugin_service"),
        (".csi.v1.PluginCapability.VolumeExpansion.type", "volume_expansion"),
        (".csi.v1.VolumeCapability.AccessMode.mode", "access_mode"),
        (".csi.v1.ControllerServiceCapability.RPC.type", "controller_rpc"),
        (".csi.v1.NodeServiceCapability.RPC.type", "node_rpc"),
        (".csi.v1.VolumeUsage.unit", "usage_unit"),
    ];
    let mut config = tonic_prost_build::configure()
        .build_client(true)
        .build_server(true)
        .type_attribute(".csi.v1", "#[derive(serde::Serialize)]")
        .field_attribute(".csi.v1.Snapshot.creation_time", "#[serde(skip)]");
    for (field, names) in enum_fields {
        config = config.field_attribute(field, format!("#[serde(serialize_with = \"crate::csi::proto::names::{names}\")]"));
    }
    config.compile_fds(fds)?;
    Ok(())
}

/// `volring --version` names the commit it was built from (HEAD's short
/// hash; uncommitted changes are not noted). Outside a git checkout (a
/// source tarball, the image build without `.git`) it says nothing.
fn git_commit() {
    let git = |args: &[&str]| {
        std::process::Command::new("git")
            .args(args)
            .output()
            .ok()
            .filter(|o| o.status.success())
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
    };
    let Some(hash) = git(&["rev-parse", "--short=12", "HEAD"]) else {
        return;
    };
    println!("cargo:rustc-env=VOLRING_GIT_COMMIT={hash}");
    // Rebuilt when HEAD moves (a commit, a checkout), not on every build.
    if let Some(dir) = git(&["rev-parse", "--git-dir"]) {
        let dir = std::path::Path::new(&dir);
        if dir.join("HEAD").exists() {
            println!("cargo:rerun-if-changed={}", dir.join("HEAD").display());
        }
        if let Some(head) = git(&["symbolic-ref", "-q", "HEAD"]) {
            if dir.join(&head).exists() {
                println!("cargo:rerun-if-changed={}", dir.join(head).display());
            }
        }
    }
}
