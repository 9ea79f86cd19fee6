//! The in-cluster half of the healer hook: which volumes the cluster says
//! are attached to this node by this driver.
//!
//! Why it is a cross-check and not the healer's list: the CSIDriver in
//! deploy/ says `attachRequired: false`, so kubelet mounts without a
//! VolumeAttachment and the cluster normally holds none for volring. The
//! node's store is what knows which volumes' data path this agent serves
//! (the nbd records), and the healer walks it at start whatever the
//! cluster says. When an operator turns attach on, VolumeAttachments do
//! exist: each one that names this node is handed over (a volume whose
//! heal failed or was skipped gets another try), and one whose volume the
//! store does not know is a pod that believes in a volume this node never
//! recorded — reported in the log and as a StorageNode condition, never
//! acted on.
//!
//! The API offers no field selector on a VolumeAttachment's spec (only
//! `metadata.name`) and the external-attacher sets no labels, so this is a
//! paginated LIST of all of them, filtered here by `spec.attacher` and
//! `spec.nodeName`.

use std::sync::Arc;
use std::time::Duration;

use serde_json::Value;

use super::kube_sink::{query_escape, KubeSink, PAGE};
use super::sink::SinkError;

/// Where VolumeAttachments are listed.
pub(crate) const PATH: &str = "/apis/storage.k8s.io/v1/volumeattachments";
/// A LIST that keeps handing out continue tokens is cut here.
const MAX_PAGES: usize = 10_000;

/// The volume a VolumeAttachment names, when it names `node` and `driver`
/// and says it is attached.
///
/// The volume id is the PersistentVolume's name: volring's CreateVolume
/// uses the name it is given (the PV's) as the id. A static PV whose
/// handle differs is then reported as unknown, never healed by mistake. An
/// inline volume carries its handle itself.
pub(crate) fn attached_volume(item: &Value, driver: &str, node: &str) -> Option<String> {
    let spec = item.get("spec")?;
    if spec.get("attacher")?.as_str()? != driver || spec.get("nodeName")?.as_str()? != node {
        return None;
    }
    if item.pointer("/status/attached").and_then(Value::as_bool) != Some(true) {
        return None;
    }
    let source = spec.get("source")?;
    let id = match source.get("persistentVolumeName").and_then(Value::as_str) {
        Some(pv) => pv,
        None => source.pointer("/inlineVolumeSpec/csi/volumeHandle")?.as_str()?,
    };
    (!id.is_empty()).then(|| id.to_string())
}

/// One page's volumes attached here, and the continue token ("" at the end).
pub(crate) fn page(body: &Value, driver: &str, node: &str) -> (Vec<String>, String) {
    let ids = body
        .get("items")
        .and_then(Value::as_array)
        .map(|items| items.iter().filter_map(|i| attached_volume(i, driver, node)).collect())
        .unwrap_or_default();
    let cont = body.pointer("/metadata/continue").and_then(Value::as_str).unwrap_or_default().to_string();
    (ids, cont)
}

/// Every volume `driver` has attached to `node`, sorted, without repeats.
pub async fn attached_here(sink: &KubeSink, driver: &str, node: &str) -> Result<Vec<String>, SinkError> {
    let mut out = Vec::new();
    let mut cont = String::new();
    for _ in 0..MAX_PAGES {
        let mut uri = format!("{PATH}?limit={PAGE}");
        if !cont.is_empty() {
            uri.push_str(&format!("&continue={}", query_escape(&cont)));
        }
        let (ids, next) = page(&sink.get_json(&uri).await?, driver, node);
        out.extend(ids);
        if next.is_empty() {
            out.sort();
            out.dedup();
            return Ok(out);
        }
        cont = next;
    }
    Err(SinkError::Unavailable(format!("the list of volumeattachments did not end after {MAX_PAGES} pages")))
}

/// The in-cluster healer hook: lists the VolumeAttachments of this driver
/// on this node (retrying a failed LIST, with backoff, for a minute or so)
/// and hands them to the driver's cross-check; what the store does not know
/// becomes the StorageNode's AttachmentsKnown condition and a log line.
pub async fn healer_hook(
    sink: Arc<KubeSink>,
    driver: Arc<volring_csi::Driver>,
    node: String,
    unknown: Arc<std::sync::Mutex<Option<Vec<String>>>>,
    signal: crate::node_feed::NodeSignal,
) {
    let mut wait = Duration::from_millis(500);
    let ids = loop {
        match attached_here(&sink, volring_csi::DRIVER_NAME, &node).await {
            Ok(ids) => break ids,
            Err(e) if wait < Duration::from_secs(30) => {
                tracing::warn!(error = %e, retry_in_ms = wait.as_millis() as u64, "healer hook: listing VolumeAttachments failed");
                tokio::time::sleep(wait).await;
                wait *= 2;
            }
            Err(e) => {
                tracing::error!(error = %e, "healer hook: cannot list VolumeAttachments; the store's walk at start stands alone");
                return;
            }
        }
    };
    let check = match tokio::task::spawn_blocking(move || driver.heal_attached(&ids)).await {
        Ok(c) => c,
        Err(e) => {
            tracing::error!(error = %e, "healer hook failed");
            return;
        }
    };
    if !check.unknown.is_empty() {
        tracing::warn!(volumes = ?check.unknown, "VolumeAttachments name this node for volumes it has no record of");
    }
    tracing::info!(
        handed_over = check.healed.len(),
        serving = check.serving.len(),
        kernel = check.kernel.len(),
        skipped = check.skipped.len(),
        unknown = check.unknown.len(),
        "healer hook: VolumeAttachments checked"
    );
    *unknown.lock().unwrap_or_else(|e| e.into_inner()) = Some(check.unknown);
    signal.signal();
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn va(attacher: &str, node: &str, pv: &str, attached: bool) -> Value {
        json!({"metadata": {"name": format!("csi-{pv}")},
            "spec": {"attacher": attacher, "nodeName": node, "source": {"persistentVolumeName": pv}},
            "status": {"attached": attached}})
    }

    #[test]
    fn only_this_drivers_attached_volumes_on_this_node() {
        assert_eq!(attached_volume(&va("volring.csi.io", "n1", "pvc-1", true), "volring.csi.io", "n1").as_deref(), Some("pvc-1"));
        assert_eq!(attached_volume(&va("other.csi.io", "n1", "pvc-1", true), "volring.csi.io", "n1"), None);
        assert_eq!(attached_volume(&va("volring.csi.io", "n2", "pvc-1", true), "volring.csi.io", "n1"), None);
        assert_eq!(attached_volume(&va("volring.csi.io", "n1", "pvc-1", false), "volring.csi.io", "n1"), None);
        let inline = json!({"spec": {"attacher": "d", "nodeName": "n", "source": {"inlineVolumeSpec": {"csi": {"volumeHandle": "v9"}}}},
            "status": {"attached": true}});
        assert_eq!(attached_volume(&inline, "d", "n").as_deref(), Some("v9"));
        assert_eq!(attached_volume(&json!({"spec": 3}), "d", "n"), None);
        let (ids, cont) = page(&json!({"metadata": {"continue": "t"}, "items": [va("d", "n", "a", true), 7]}), "d", "n");
        assert_eq!((ids, cont.as_str()), (vec!["a".to_string()], "t"));
    }
}
