//! What the publisher's tests share: objects, a fast configuration,
//! bounded waits, and this machine's devices made into cloned nodes'.

#![allow(dead_code)]

use std::time::Duration;

use serde_json::json;
use sha2::Digest;
use volring_kube::UpdaterConfig;
use volring_kube::{Key, Kind, Object};

use crate::kube_support::Server;

/// The labels volring puts on its objects, as docs/kubernetes.md names them
/// (the tests' own: a label the code renamed would orphan every object
/// stored under the old one, and selectors written against it).
pub const NODE_LABEL: &str = "volring.io/node";
pub const KIND_LABEL: &str = "volring.io/kind";

/// A BlockDevice's name: `bd-` and the first 16 hex digits of the SHA-256
/// of the node, a zero byte and the stable id (the tests' own, so a name
/// the code changed is caught: it would orphan every stored object).
pub fn block_device_name(node: &str, stable_id: &str) -> String {
    let mut h = sha2::Sha256::new();
    h.update(node.as_bytes());
    h.update([0u8]);
    h.update(stable_id.as_bytes());
    format!("bd-{}", h.finalize().iter().take(8).map(|b| format!("{b:02x}")).collect::<String>())
}

/// The name versions before issue 29 gave a BlockDevice: the same from the
/// stable id alone.
pub fn legacy_block_device_name(stable_id: &str) -> String {
    format!("bd-{}", sha2::Sha256::digest(stable_id.as_bytes()).iter().take(8).map(|b| format!("{b:02x}")).collect::<String>())
}

/// A BlockDevice of `node` numbered `i`, whose status carries `gen`.
pub fn bd(node: &str, i: usize, gen: usize) -> Object {
    let stable = format!("serial-test-{node}-{i}");
    Object {
        key: Key { kind: Kind::BlockDevice, name: block_device_name(node, &stable) },
        labels: [(NODE_LABEL.to_string(), node.to_string()), (KIND_LABEL.to_string(), "blockdevice".to_string())].into(),
        spec: json!({"nodeName": node, "path": format!("/dev/sd{i}"), "stableId": stable,
            "capacity": {"storage": 1u64 << 30, "logicalSectorSize": 512, "physicalSectorSize": 4096},
            "details": {"deviceType": "disk", "driveType": "SSD", "removable": false, "readOnly": false},
            "devlinks": [], "partitioned": false}),
        status: json!({"state": "Active", "claimState": "Unclaimed", "mountPoints": [format!("/mnt/{gen}")], "holders": []}),
    }
}

/// Fast enough for tests; the defaults are what the agent uses.
pub fn config(node: &str) -> UpdaterConfig {
    let mut c = UpdaterConfig::new(node);
    c.qps = 1000.0;
    c.burst = 1000;
    c.window = Duration::from_millis(300);
    c.backoff_min = Duration::from_millis(50);
    c
}

/// Waits (bounded) until `f` holds.
pub async fn until(what: &str, mut f: impl FnMut() -> bool) {
    for _ in 0..600 {
        if f() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("timed out waiting for {what}");
}

pub fn stored_status(s: &Server, o: &Object) -> serde_json::Value {
    s.api.object("blockdevices", &o.key.name).map(|v| v["status"].clone()).unwrap_or_default()
}

/// This machine's first device, made into `n` devices of `node` as cloned
/// nodes have them: no serial or WWN, so the id falls through to a
/// partition GUID written into the image (`partuuid-clone-<i>`), the same
/// on every clone.
pub fn cloned_inventory(node: &str, n: usize) -> volring_devices::Inventory {
    let mountinfo = std::fs::read("/proc/self/mountinfo").unwrap();
    let (table, _) = volring_mounts::MountTable::from_mountinfo(&mountinfo);
    let cfg = volring_devices::ScanConfig { probe: false, ..Default::default() };
    let real = volring_devices::Inventory::scan(&cfg, &table).unwrap();
    let base = real.devices.values().next().expect("this machine has a block device").clone();
    let mut inv = volring_devices::Inventory { devices: Default::default(), errors: vec![] };
    for i in 0..n {
        let mut d = base.clone();
        (d.wwn, d.serial, d.loop_backing, d.dm) = (None, None, None, None);
        d.part_uuid = Some(format!("partuuid-clone-{i}"));
        d.name = format!("vdz{i}");
        d.path = format!("/dev/vdz{i}").into();
        d.dev = volring_mounts::DevNum { major: 252, minor: 1000 + i as u32 };
        d.id = volring_devices::stable_id(&d, node);
        assert_eq!(d.id, format!("partuuid-partuuid-clone-{i}"), "the id does not name the node");
        inv.devices.insert(d.dev, d);
    }
    inv
}

pub fn bd_names_of(server: &Server, node: &str) -> Vec<String> {
    let mut v: Vec<String> = server
        .api
        .objects("blockdevices")
        .into_iter()
        .filter(|o| o["metadata"]["labels"][NODE_LABEL] == node)
        .map(|o| o["metadata"]["name"].as_str().unwrap().to_string())
        .collect();
    v.sort();
    v
}
