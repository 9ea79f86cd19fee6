//! Compiles proto/csi.proto with protox (pure Rust), so building volring-csi
//! needs no system protoc. The messages also derive `serde::Serialize` so
//! that `volring csi` can print any reply as JSON; enum fields are printed
//! by name (see `csi::proto`).

fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!("cargo:rerun-if-changed=proto/csi.proto");
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
        config = config.field_attribute(field, format!("#[serde(serialize_with = \"crate::proto::names::{names}\")]"));
    }
    config.compile_fds(fds)?;
    Ok(())
}
