//! CSI request bytes → decoded message → validation. Whatever a CO (or an
//! attacker on the socket) sends, validation returns a typed answer without
//! panicking, and what it accepts keeps its promises: paths stay inside the
//! kubelet root with no `..`, sizes respect the range and the limits.
#![no_main]

use std::path::{Component, Path};

use libfuzzer_sys::fuzz_target;
use prost::Message;
use volring_csi::proto::{ControllerExpandVolumeRequest, CreateVolumeRequest, NodePublishVolumeRequest, NodeStageVolumeRequest};
use volring_csi::validate;

const ROOT: &str = "/var/lib/kubelet";

fn path(p: &str) {
    if let Ok(ok) = validate::path_under(p, Path::new(ROOT), "path") {
        assert!(ok.starts_with(ROOT) && ok != Path::new(ROOT), "{p:?} -> {ok:?}");
        assert!(ok.components().all(|c| matches!(c, Component::RootDir | Component::Normal(_))), "{ok:?}");
    }
}

fn id(s: &str) {
    if validate::volume_id(s).is_ok() {
        assert!(!s.is_empty() && s.len() <= validate::MAX_ID_LEN && !s.contains('/') && s != "." && s != "..");
    }
}

fuzz_target!(|data: &[u8]| {
    let Some((&which, rest)) = data.split_first() else { return };
    match which % 4 {
        0 => {
            if let Ok(r) = NodeStageVolumeRequest::decode(rest) {
                id(&r.volume_id);
                path(&r.staging_target_path);
                let _ = validate::capability(r.volume_capability.as_ref());
            }
        }
        1 => {
            if let Ok(r) = NodePublishVolumeRequest::decode(rest) {
                id(&r.volume_id);
                path(&r.staging_target_path);
                path(&r.target_path);
                if let Ok(a) = validate::capability(r.volume_capability.as_ref()) {
                    let _ = (a.read_only(), a.is_mount());
                }
            }
        }
        2 => {
            if let Ok(r) = CreateVolumeRequest::decode(rest) {
                let _ = validate::volume_name(&r.name);
                let _ = validate::capabilities(&r.volume_capabilities);
                let min = 16 << 20;
                // A pool whose filesystem holds less than the policy ceiling
                // (ext4's 16 TiB), as well as one that holds more.
                let max = if which & 0x80 != 0 { (16 << 40) - (1 << 20) } else { validate::MAX_SIZE };
                if let Ok(size) = validate::capacity(r.capacity_range.as_ref(), min, max) {
                    assert!(size >= min && size <= max && size % 4096 == 0);
                    if let Some(c) = &r.capacity_range {
                        assert!(size >= c.required_bytes as u64);
                        assert!(c.limit_bytes == 0 || size <= c.limit_bytes as u64);
                    }
                }
            }
        }
        _ => {
            if let Ok(r) = ControllerExpandVolumeRequest::decode(rest) {
                id(&r.volume_id);
                if let Some(c) = &r.capacity_range {
                    if validate::capacity_range(c).is_ok() {
                        assert!(c.required_bytes >= 0 && c.limit_bytes >= 0);
                    }
                }
                let _ = validate::capacity(r.capacity_range.as_ref(), 0, validate::MAX_SIZE);
            }
        }
    }
});
