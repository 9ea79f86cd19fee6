//! Bytes from the API server (or the node's store) → `Object::from_api`,
//! the publisher's reading of a LIST item or GET reply, and the
//! Retry-After header → `retry_after_of`. Whatever comes, nothing panics,
//! and what is read keeps its promises:
//! - only `volring.io/` labels are kept, and reading back the object in
//!   its API form gives the same object (so a restart compares like with
//!   like and writes nothing);
//! - a retired BlockDevice keeps its key, labels and spec;
//! - a Retry-After is never longer than a minute;
//! - a VolumeAttachment LIST page (the healer hook's) yields only
//!   non-empty volume ids, and only from items naming the driver and node.
#![no_main]

use libfuzzer_sys::fuzz_target;
use volring_kube::attachments;
use volring_kube::embedded_sink::api_form;
use volring_kube::kube_sink::retry_after_of;
use volring_kube::Kind;
use volring_kube::Object;

fuzz_target!(|data: &[u8]| {
    let Some((&k, rest)) = data.split_first() else { return };
    let kind = Kind::ALL[usize::from(k) % Kind::ALL.len()];
    if let Ok(s) = std::str::from_utf8(rest) {
        assert!(retry_after_of(Some(s)) <= std::time::Duration::from_secs(60));
    }
    let Ok(v) = serde_json::from_slice::<serde_json::Value>(rest) else { return };
    let (ids, _) = attachments::page(&v, "volring.csi.io", "n1");
    assert!(ids.iter().all(|i| !i.is_empty()));
    if let Some(items) = v.get("items").and_then(|i| i.as_array()) {
        assert!(ids.len() <= items.len());
    }
    let Some(o) = Object::from_api(kind, &v) else { return };
    assert!(o.labels.keys().all(|l| l.starts_with("volring.io/")));
    let back = Object::from_api(kind, &api_form(&o)).expect("an object in API form reads back");
    assert_eq!(back, o);
    if let Some(r) = o.retired() {
        assert_eq!((&r.key, &r.labels, &r.spec), (&o.key, &o.labels, &o.spec));
    }
});
