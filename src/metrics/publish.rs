//! The Kubernetes publisher on `/metrics`: what it wrote, what the API
//! server pushed back (429, refusals, conflicts, 5xx) and how much waits.
//! A 422 loop or a 429 storm otherwise shows only in the logs.

use std::fmt::Error as FmtError;
use std::sync::atomic::Ordering;

use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::MetricType;

use super::{counter, how_many};
use crate::publisher::updater::Stats;

pub(super) fn encode(e: &mut DescriptorEncoder<'_>, s: &Stats) -> Result<(), FmtError> {
    let g = |a: &std::sync::atomic::AtomicU64| a.load(Ordering::Relaxed);
    let mut fam = e.encode_descriptor("volring_publish_writes", "Objects written, by part (main: labels and spec; status)", None, MetricType::Counter)?;
    for (part, v) in [("main", &s.writes_main), ("status", &s.writes_status)] {
        ConstCounter::new(g(v)).encode(fam.encode_family(&[("part", part)])?)?;
    }
    for (name, help, v) in [
        ("volring_publish_requests", "Requests made to the sink (API server or store)", &s.requests),
        ("volring_publish_deletes", "Objects deleted (gone devices, superseded names)", &s.deletes),
        ("volring_publish_submitted", "Object states handed to the publisher", &s.submitted),
        ("volring_publish_coalesced", "States that replaced a pending state of the same object", &s.coalesced),
        ("volring_publish_unchanged", "Objects due that equalled what is stored (nothing written)", &s.unchanged),
        ("volring_publish_throttled", "Requests answered 429 (every request then waits its Retry-After)", &s.throttled),
        ("volring_publish_refused", "Writes refused (4xx such as 422) and dropped", &s.refused),
        ("volring_publish_conflicts", "Writes answered 409 (the object is re-read once)", &s.conflicts),
        ("volring_publish_unavailable", "Requests failed by 5xx or the connection, backed off", &s.unavailable),
        ("volring_publish_abandoned", "Objects left unwritten when a shutdown's deadline passed", &s.abandoned),
    ] {
        counter(e, name, help, g(v))?;
    }
    how_many(e, "volring_publish_queued", "Objects waiting to be written", usize::try_from(g(&s.queued)).unwrap_or(usize::MAX))
}
