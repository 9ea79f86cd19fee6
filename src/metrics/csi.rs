//! The CSI driver on `/metrics`: calls by RPC and gRPC code, their latency,
//! the volumes staged and published, and the pool's capacity and use.

use std::fmt::Error as FmtError;
use std::sync::atomic::Ordering;

use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::MetricType;

use super::how_many;
use volring_csi::rpc_stats::{CODES, LATENCY_BUCKETS_US};
use volring_csi::Driver;

/// Every RPC gets an `OK` series (0 included, so a rate can be taken
/// before the first call) and one per other code it has ended with.
pub(super) fn encode(e: &mut DescriptorEncoder<'_>, d: &Driver) -> Result<(), FmtError> {
    let stats = d.rpc_stats();
    let mut fam = e.encode_descriptor("volring_csi_requests", "CSI calls finished, by RPC and gRPC code", None, MetricType::Counter)?;
    for (rpc, c) in stats.each() {
        for (code, n) in CODES.iter().zip(&c.by_code) {
            let n = n.load(Ordering::Relaxed);
            if n > 0 || *code == "OK" {
                ConstCounter::new(n).encode(fam.encode_family(&[("rpc", rpc), ("code", *code)])?)?;
            }
        }
    }
    let mut fam =
        e.encode_descriptor("volring_csi_request_duration_seconds", "Time a CSI call took, by RPC", None, MetricType::Histogram)?;
    let mut buckets: Vec<(f64, u64)> = Vec::with_capacity(LATENCY_BUCKETS_US.len() + 1);
    for (rpc, c) in stats.each() {
        buckets.clear();
        buckets.extend(
            LATENCY_BUCKETS_US
                .iter()
                .map(|&b| b as f64 / 1e6)
                .chain([f64::MAX])
                .zip(&c.buckets)
                .map(|(b, n)| (b, n.load(Ordering::Relaxed))),
        );
        let count = buckets.iter().map(|(_, n)| n).sum();
        let sum = c.sum_us.load(Ordering::Relaxed) as f64 / 1e6;
        fam.encode_family(&[("rpc", rpc)])?.encode_histogram::<prometheus_client::encoding::NoLabelSet>(sum, count, &buckets, None)?;
    }
    let (staged, published) = d.staged_and_published();
    how_many(e, "volring_csi_volumes_staged", "Volumes staged on this node", staged)?;
    how_many(e, "volring_csi_volumes_published", "Staged volumes published to at least one target", published)?;
    let (volumes, provisioned, available) = d.pool_usage();
    how_many(e, "volring_csi_pool_volumes", "Volumes in the pool", volumes)?;
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
