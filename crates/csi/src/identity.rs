//! Identity answers, and the capability lists of all three services.

use std::collections::HashMap;

use super::driver::Expansion;
use super::proto::*;
use super::{Driver, DRIVER_NAME};

impl Driver {
    pub(super) fn plugin_info(&self) -> GetPluginInfoResponse {
        GetPluginInfoResponse {
            name: DRIVER_NAME.to_string(),
            vendor_version: env!("CARGO_PKG_VERSION").to_string(),
            manifest: HashMap::from([("node".to_string(), self.config.node_id.clone())]),
        }
    }

    pub(super) fn plugin_capabilities(&self) -> GetPluginCapabilitiesResponse {
        use plugin_capability::{service, volume_expansion, Service, Type, VolumeExpansion};
        let service = |t: service::Type| PluginCapability { r#type: Some(Type::Service(Service { r#type: t as i32 })) };
        GetPluginCapabilitiesResponse {
            capabilities: vec![
                service(service::Type::ControllerService),
                service(service::Type::VolumeAccessibilityConstraints),
                PluginCapability { r#type: Some(Type::VolumeExpansion(VolumeExpansion { r#type: volume_expansion::Type::Online as i32 })) },
            ],
        }
    }

    /// Ready once the agent's mount watcher and the pool are up.
    pub(super) fn probe(&self) -> ProbeResponse {
        ProbeResponse { ready: Some(self.ready.get()) }
    }

    pub(super) fn controller_capabilities(&self) -> ControllerGetCapabilitiesResponse {
        use controller_service_capability::{rpc::Type as T, Rpc, Type};
        let mut caps = vec![T::CreateDeleteVolume, T::ListVolumes, T::GetCapacity, T::ExpandVolume, T::SingleNodeMultiWriter];
        if self.config.expansion == Expansion::Node {
            caps.retain(|t| *t != T::ExpandVolume);
        }
        ControllerGetCapabilitiesResponse {
            capabilities: caps
                .into_iter()
                .map(|t| ControllerServiceCapability { r#type: Some(Type::Rpc(Rpc { r#type: t as i32 })) })
                .collect(),
        }
    }

    pub(super) fn node_capabilities(&self) -> NodeGetCapabilitiesResponse {
        use node_service_capability::{rpc::Type as T, Rpc, Type};
        let caps = [T::StageUnstageVolume, T::GetVolumeStats, T::ExpandVolume, T::VolumeCondition, T::SingleNodeMultiWriter];
        NodeGetCapabilitiesResponse {
            capabilities: caps.into_iter().map(|t| NodeServiceCapability { r#type: Some(Type::Rpc(Rpc { r#type: t as i32 })) }).collect(),
        }
    }
}
