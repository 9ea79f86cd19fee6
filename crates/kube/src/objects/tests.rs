//! The objects' builders and CRDs, tested (a file of its own: objects.rs
//! stays readable).

use super::*;

#[test]
fn deploy_crds_match_the_types() {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../../deploy/crds/volring.io.yaml");
    let on_disk = std::fs::read_to_string(path).unwrap_or_default();
    assert!(on_disk == crds_yaml(), "{path} differs from the types; regenerate it with `volring crds > {path}`");
}

/// Issue 29: integer formats the API server knows (no `uint32` /
/// `uint64`, which it warns about on every apply), unsigned ones at
/// least 0; `spec.nodeName` selectable (`--field-selector`).
#[test]
fn crds_use_formats_the_api_server_knows_and_select_by_node() {
    use kube::CustomResourceExt;
    for crd in [BlockDevice::crd(), StorageNode::crd()] {
        let v = serde_json::to_value(&crd).unwrap();
        let version = &v["spec"]["versions"][0];
        assert_eq!(version["selectableFields"], serde_json::json!([{"jsonPath": ".spec.nodeName"}]), "{}", crd.spec.names.kind);
        let mut formats = Vec::new();
        fn walk(v: &serde_json::Value, at: &str, out: &mut Vec<(String, String, serde_json::Value)>) {
            match v {
                serde_json::Value::Object(m) => {
                    if let Some(f) = m.get("format").and_then(|f| f.as_str()) {
                        out.push((at.to_string(), f.to_string(), m.get("minimum").cloned().unwrap_or_default()));
                    }
                    m.iter().for_each(|(k, v)| walk(v, &format!("{at}.{k}"), out));
                }
                serde_json::Value::Array(a) => a.iter().for_each(|v| walk(v, at, out)),
                _ => {}
            }
        }
        walk(&version["schema"], "", &mut formats);
        assert!(!formats.is_empty());
        for (at, f, min) in formats {
            assert!(["int32", "int64"].contains(&f.as_str()), "{at}: format {f}");
            assert_eq!(min.as_f64(), Some(0.0), "{at}: unsigned, so at least 0");
        }
    }
}

#[test]
fn every_object_of_a_node_carries_the_hostname_label() {
    let sn = storage_node("n1", None, vec![]);
    assert_eq!(sn.labels.get(HOSTNAME_LABEL).map(String::as_str), Some("n1"));
    assert_eq!(sn.labels.get(NODE_LABEL).map(String::as_str), Some("n1"));
    // Read back, it is one of volring's labels: compared, kept.
    let mut v = sn.main_body();
    v["status"] = sn.status.clone();
    assert_eq!(Object::from_api(Kind::StorageNode, &v).unwrap(), sn);
}

#[test]
fn names_are_stable_and_valid() {
    let a = block_device_name("n1", "wwn-0x5000-S1");
    assert_eq!(a, block_device_name("n1", "wwn-0x5000-S1"));
    assert_ne!(a, block_device_name("n1", "wwn-0x5000-S2"));
    assert_eq!(a.len(), 19);
    assert!(a.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-'));
}

/// Cloned nodes share partition GUIDs and filesystem UUIDs: the same id
/// on two nodes is two objects (the old name, from the id alone, was one).
#[test]
fn names_differ_across_nodes_and_between_duplicates() {
    let id = "partuuid-0e1f-same-on-every-clone";
    assert_ne!(block_device_name("n1", id), block_device_name("n2", id));
    assert_ne!(block_device_name("a", "bc"), block_device_name("ab", "c"));
    let d = duplicate_block_device_name("n1", id, "sdb");
    assert_ne!(d, duplicate_block_device_name("n1", id, "sdc"));
    assert_ne!(d, block_device_name("n1", id));
    assert_eq!(d.len(), 19);
    let legacy = Object {
        key: Key { kind: Kind::BlockDevice, name: legacy_block_device_name(id) },
        labels: labels(Kind::BlockDevice, "n1"),
        spec: serde_json::json!({"stableId": id}),
        status: serde_json::Value::Null,
    };
    assert!(legacy.superseded());
    let current = Object { key: Key { kind: Kind::BlockDevice, name: block_device_name("n1", id) }, ..legacy };
    assert!(!current.superseded());
}

fn vol(id: &str, health: &str) -> VolumeEntry {
    VolumeEntry {
        id: id.into(),
        access: "mount".into(),
        fs_type: Some("ext4".into()),
        read_only: false,
        phase: "staged".into(),
        device: None,
        staging_path: format!("/s/{id}"),
        targets: vec![],
        health: health.into(),
        drift: vec![],
        message: None,
        persistent_volume: None,
        persistent_volume_claim: None,
        pods: vec![],
    }
}

#[test]
fn storage_node_lists_drifting_first_and_bounds_the_list() {
    let mut vols: Vec<_> = (0..MAX_LISTED_VOLUMES + 5).map(|i| vol(&format!("v{i:05}"), "Healthy")).collect();
    vols.push(vol("zz-bad", "Drifting"));
    let o = storage_node("n1", None, vols);
    let s: StorageNodeStatus = serde_json::from_value(o.status.clone()).unwrap();
    assert_eq!(s.volumes.len(), MAX_LISTED_VOLUMES);
    assert_eq!(s.volumes[0].id, "zz-bad");
    assert_eq!((s.volumes_total, s.volumes_drifting, s.volumes_omitted), (MAX_LISTED_VOLUMES as u32 + 6, 1, 6));
    assert_eq!(s.conditions[0].status, "False");
    // Built twice from the same facts: equal, so no write.
    let again = storage_node("n1", None, (0..3).map(|i| vol(&format!("v{i}"), "Healthy")).collect());
    assert_eq!(again, storage_node("n1", None, (0..3).rev().map(|i| vol(&format!("v{i}"), "Healthy")).collect()));
}

#[test]
fn api_round_trip_keeps_only_what_volring_writes() {
    let o = storage_node("n1", None, vec![vol("a", "Healthy")]);
    let mut from_server = o.main_body();
    from_server["metadata"]["resourceVersion"] = "17".into();
    from_server["metadata"]["labels"]["other.io/x"] = "y".into();
    from_server["status"] = o.status.clone();
    assert_eq!(Object::from_api(Kind::StorageNode, &from_server).unwrap(), o);
}

#[test]
fn a_retired_block_device_is_inactive_and_keeps_its_facts() {
    let o = Object {
        key: Key { kind: Kind::BlockDevice, name: "bd-1".into() },
        labels: labels(Kind::BlockDevice, "n"),
        spec: serde_json::json!({"path": "/dev/sdb"}),
        status: serde_json::json!({"state": "Active", "claimState": "InUse"}),
    };
    let r = o.retired().unwrap();
    assert_eq!(r.status, serde_json::json!({"state": "Inactive", "claimState": "InUse"}));
    assert_eq!(r.spec, o.spec);
}

/// Its volume unstaged, a volume's device leaves the node: the object
/// is released, not left Claimed by a volume that is gone.
#[test]
fn a_retired_claimed_block_device_is_released() {
    let o = Object {
        key: Key { kind: Kind::BlockDevice, name: "bd-2".into() },
        labels: labels(Kind::BlockDevice, "n"),
        spec: serde_json::json!({"path": "/dev/loop3"}),
        status: serde_json::json!({"state": "Active", "claimState": "Claimed", "volume": "v1", "persistentVolume": "pv1",
            "persistentVolumeClaim": {"namespace": "ns", "name": "c"}, "mountPoints": ["/s"]}),
    };
    let r = o.retired().unwrap();
    assert_eq!(r.status, serde_json::json!({"state": "Inactive", "claimState": "Unclaimed", "mountPoints": ["/s"]}));
}
