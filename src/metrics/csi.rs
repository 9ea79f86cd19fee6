//! The CSI driver on `/metrics`: calls by RPC and gRPC code, their latency,
//! the volumes staged and published, and the pool's capacity and use.

use std::fmt::Error as FmtError;

use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::MetricType;

use super::how_many;
use volring_csi::Driver;
use volring_share::follow::ShareHost;

/// Every RPC gets an `OK` series (0 included, so a rate can be taken
/// before the first call) and one per other code it has ended with.
pub(super) fn encode(e: &mut DescriptorEncoder<'_>, d: &Driver) -> Result<(), FmtError> {
    let stats = d.stats();
    let mut fam = e.encode_descriptor("volring_csi_requests", "CSI calls finished, by RPC and gRPC code", None, MetricType::Counter)?;
    for r in &stats.rpcs {
        for &(code, n) in &r.by_code {
            if n > 0 || code == "OK" {
                ConstCounter::new(n).encode(fam.encode_family(&[("rpc", r.rpc), ("code", code)])?)?;
            }
        }
    }
    let mut fam =
        e.encode_descriptor("volring_csi_request_duration_seconds", "Time a CSI call took, by RPC", None, MetricType::Histogram)?;
    for r in &stats.rpcs {
        let count = r.buckets.iter().map(|(_, n)| n).sum();
        fam.encode_family(&[("rpc", r.rpc)])?.encode_histogram::<prometheus_client::encoding::NoLabelSet>(
            r.sum_seconds,
            count,
            &r.buckets,
            None,
        )?;
    }
    let commits = &stats.store_commits;
    let count = commits.buckets.iter().map(|(_, n)| n).sum();
    e.encode_descriptor(
        "volring_store_commit_duration_seconds",
        "Time one commit of the node's store took (an fsync; every change to the machine waits for its intent to commit)",
        None,
        MetricType::Histogram,
    )?
    .encode_histogram::<prometheus_client::encoding::NoLabelSet>(commits.sum_seconds, count, &commits.buckets, None)?;
    how_many(e, "volring_csi_volumes_staged", "Volumes staged on this node", stats.staged)?;
    how_many(e, "volring_csi_volumes_published", "Staged volumes published to at least one target", stats.published)?;
    how_many(e, "volring_csi_pool_volumes", "Volumes in the pool", stats.pool_volumes)?;
    let (provisioned, available) = (stats.provisioned, stats.available);
    let bytes = |v: u64| i64::try_from(v).unwrap_or(i64::MAX);
    let mut g =
        |name: &str, help: &str, v: u64| ConstGauge::new(bytes(v)).encode(e.encode_descriptor(name, help, None, MetricType::Gauge)?);
    g("volring_csi_pool_provisioned_bytes", "The pool's volumes' sizes together (images are sparse)", provisioned)?;
    if let Some(free) = available {
        g("volring_csi_pool_available_bytes", "Bytes the pool's filesystem has left", free)?;
    }
    shares(e, d)
}

/// `volring_share_export_info`: one series per volume this node exports
/// over NFS (value 1, labelled as the `volring_volume_*` series are, so
/// the two join on `volume`: the I/O NFS clients do reaches the exported
/// volume's device). Declared also when the node serves no NFS.
fn shares(e: &mut DescriptorEncoder<'_>, d: &Driver) -> Result<(), FmtError> {
    let mut fam = e.encode_descriptor(
        "volring_share_export_info",
        "A volume this node exports over NFS, with the PVC it was made for (value 1)",
        None,
        MetricType::Gauge,
    )?;
    if !d.shares().enabled() {
        return Ok(());
    }
    for s in d.exported_shares() {
        let (ns, pvc) = s.pvc.as_ref().map_or(("", ""), |(n, c)| (n.as_str(), c.as_str()));
        let labels = [("volume", s.volume_id.as_str()), ("persistentvolumeclaim", pvc), ("namespace", ns)];
        ConstGauge::new(1i64).encode(fam.encode_family(&labels)?)?;
    }
    Ok(())
}
