//! The `api_object` fuzz target's entry: bytes from the API server (or the
//! node's store) read the way the publisher reads them. The readers it
//! drives stay private to the crate.

use super::attachments;
use super::embedded_sink::api_form;
use super::kube_sink::retry_after_of;
use super::objects::{Kind, Object};

/// A selector byte (the kind), then the bytes of a LIST item, GET reply,
/// VolumeAttachment LIST page or Retry-After header. Whatever comes,
/// nothing panics, and what is read keeps its promises (a broken one
/// panics, which the fuzzer reports):
/// - only `volring.io/` labels are kept, and reading back the object in
///   its API form gives the same object (so a restart compares like with
///   like and writes nothing);
/// - a retired BlockDevice keeps its key, labels and spec;
/// - a Retry-After is never longer than a minute;
/// - a VolumeAttachment LIST page (the healer hook's) yields only
///   non-empty volume ids, and only from items naming the driver and node.
pub fn fuzz_api_object(data: &[u8]) {
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
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The entry's promises hold on a few fixed inputs (a run of the fuzzer
    /// tries many more).
    #[test]
    fn holds_on_samples() {
        let samples: [&[u8]; 5] =
            [b"", b"30", b"{}", br#"{"items": [{}]}"#, br#"{"metadata": {"name": "x", "labels": {"a": "b"}}, "spec": {}}"#];
        for k in 0u8..2 {
            for rest in samples {
                let mut data = vec![k];
                data.extend_from_slice(rest);
                fuzz_api_object(&data);
            }
        }
    }
}
