//! `volring_device_info`: one series per device whose labels say what the
//! device is (the node_exporter convention: value 1, join it onto the
//! counters by `device`).

use std::fmt::Error as FmtError;

use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::MetricType;

use volring_devices::{Inventory, Use};

pub(super) fn encode(e: &mut DescriptorEncoder<'_>, inv: &Inventory) -> Result<(), FmtError> {
    let mut fam = e.encode_descriptor(
        "volring_device_info",
        "What a device is: model, serial, wwn, filesystem, stable id, first mount point, CSI volume (value 1)",
        None,
        MetricType::Gauge,
    )?;
    for d in inv.devices.values() {
        let fs = d.content.filesystem.as_ref().map_or("", |f| f.fstype.as_str());
        let mountpoint = d.mountpoints.first().map(|p| p.to_string_lossy()).unwrap_or_default();
        let volume = d.uses.iter().find_map(|u| match u {
            Use::Volume(v) => Some(v.as_str()),
            _ => None,
        });
        let labels = [
            ("device", d.name.as_str()),
            ("model", d.model.as_deref().unwrap_or("")),
            ("serial", d.serial.as_deref().unwrap_or("")),
            ("wwn", d.wwn.as_deref().unwrap_or("")),
            ("fstype", fs),
            ("stable_id", d.id.as_str()),
            ("mountpoint", &mountpoint),
            ("csi_volume", volume.unwrap_or("")),
        ];
        ConstGauge::new(1i64).encode(fam.encode_family(&labels)?)?;
    }
    Ok(())
}
