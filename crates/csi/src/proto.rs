//! The CSI v1 messages and services, generated from `proto/csi.proto` at
//! build time.

#![allow(clippy::all, missing_docs)]

tonic::include_proto!("csi.v1");

/// Serialises enum fields (stored by prost as `i32`) by their proto names,
/// so `volring csi` prints `"STAGE_UNSTAGE_VOLUME"`, not `1`.
pub(crate) mod names {
    use serde::Serializer;

    macro_rules! by_name {
        ($name:ident, $ty:ty) => {
            pub(crate) fn $name<S: Serializer>(v: &i32, s: S) -> Result<S::Ok, S::Error> {
                match <$ty>::try_from(*v) {
                    Ok(e) => s.serialize_str(e.as_str_name()),
                    Err(_) => s.serialize_i32(*v),
                }
            }
        };
    }

    by_name!(plugin_service, super::plugin_capability::service::Type);
    by_name!(volume_expansion, super::plugin_capability::volume_expansion::Type);
    by_name!(access_mode, super::volume_capability::access_mode::Mode);
    by_name!(controller_rpc, super::controller_service_capability::rpc::Type);
    by_name!(node_rpc, super::node_service_capability::rpc::Type);
    by_name!(usage_unit, super::volume_usage::Unit);
}
