//! Identity answers, and the capability lists of all three services.

use std::collections::HashMap;

use std::sync::Arc;

use super::base::Base;
use super::driver::{Expansion, Readiness};
use super::proto::*;
use super::DRIVER_NAME;

/// The identity service's answers, and what each service offers.
pub(crate) struct Identity {
    base: Arc<Base>,
    /// Whether the agent's subsystems are up; Probe reports it.
    ready: Readiness,
}

impl Identity {
    pub(crate) fn new(base: Arc<Base>, ready: Readiness) -> Self {
        Self { base, ready }
    }

    pub(crate) fn plugin_info(&self) -> GetPluginInfoResponse {
        GetPluginInfoResponse {
            name: DRIVER_NAME.to_string(),
            vendor_version: env!("CARGO_PKG_VERSION").to_string(),
            manifest: HashMap::from([("node".to_string(), self.base.config.node_id.clone())]),
        }
    }

    pub(crate) fn plugin_capabilities(&self) -> GetPluginCapabilitiesResponse {
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
    pub(crate) fn probe(&self) -> ProbeResponse {
        ProbeResponse { ready: Some(self.ready.get()) }
    }

    pub(crate) fn controller_capabilities(&self) -> ControllerGetCapabilitiesResponse {
        use controller_service_capability::{rpc::Type as T, Rpc, Type};
        let mut caps = vec![T::CreateDeleteVolume, T::ListVolumes, T::GetCapacity, T::ExpandVolume, T::SingleNodeMultiWriter];
        if self.base.config.expansion == Expansion::Node {
            caps.retain(|t| *t != T::ExpandVolume);
        }
        ControllerGetCapabilitiesResponse {
            capabilities: caps
                .into_iter()
                .map(|t| ControllerServiceCapability { r#type: Some(Type::Rpc(Rpc { r#type: t as i32 })) })
                .collect(),
        }
    }

    pub(crate) fn node_capabilities(&self) -> NodeGetCapabilitiesResponse {
        use node_service_capability::{rpc::Type as T, Rpc, Type};
        let caps = [T::StageUnstageVolume, T::GetVolumeStats, T::ExpandVolume, T::VolumeCondition, T::SingleNodeMultiWriter];
        NodeGetCapabilitiesResponse {
            capabilities: caps.into_iter().map(|t| NodeServiceCapability { r#type: Some(Type::Rpc(Rpc { r#type: t as i32 })) }).collect(),
        }
    }
}
