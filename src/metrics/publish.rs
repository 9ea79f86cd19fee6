//! The Kubernetes publisher on `/metrics`: what it wrote, what the API
//! server pushed back (429, refusals, conflicts, 5xx) and how much waits.
//! A 422 loop or a 429 storm otherwise shows only in the logs.

use std::fmt::Error as FmtError;
use std::sync::atomic::Ordering;

use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::MetricType;

use super::{counter, how_many};
use volring_kube::Stats;

pub(super) fn encode(e: &mut DescriptorEncoder<'_>, s: &Stats) -> Result<(), FmtError> {
    let g = |a: &std::sync::atomic::AtomicU64| a.load(Ordering::Relaxed);
    let mut fam = e.encode_descriptor(
        "volring_publish_writes",
        "Objects written, by part (main: labels and spec; status)",
        None,
        MetricType::Counter,
    )?;
    for (part, v) in [("main", &s.writes_main), ("status", &s.writes_status)] {
        ConstCounter::new(g(v)).encode(fam.encode_family(&[("part", part)])?)?;
    }
    for (name, help, v) in [
        ("volring_publish_requests", "Requests made to the sink (API server or store)", &s.requests),
        ("volring_publish_deletes", "Objects deleted (gone devices, superseded names)", &s.deletes),
        ("volring_publish_submitted", "Object states handed to the publisher", &s.submitted),
        ("volring_publish_coalesced", "States that replaced a pending state of the same object", &s.coalesced),
        ("volring_publish_unchanged", "Objects due that equalled what is stored (nothing written)", &s.unchanged),
        (
            "volring_publish_throttled",
            "Requests answered 429 (that object waits its Retry-After; the in-flight limit halves)",
            &s.throttled,
        ),
        ("volring_publish_refused", "Writes refused (4xx such as 422) and dropped", &s.refused),
        ("volring_publish_conflicts", "Writes answered 409 (the object is re-read once)", &s.conflicts),
        ("volring_publish_unavailable", "Requests failed by 5xx or the connection, backed off", &s.unavailable),
        ("volring_publish_abandoned", "Objects left unwritten when a shutdown's deadline passed", &s.abandoned),
        ("volring_publish_probes", "Requests sent alone to a server that stopped answering", &s.probes),
        ("volring_publish_repairs", "Objects written again because someone else changed or deleted them", &s.repairs),
    ] {
        counter(e, name, help, g(v))?;
    }
    how_many(e, "volring_publish_queued", "Objects waiting to be written", usize::try_from(g(&s.queued)).unwrap_or(usize::MAX))?;
    how_many(
        e,
        "volring_publish_in_flight_limit",
        "Requests allowed in flight now (lower while the API server pushes back)",
        usize::try_from(g(&s.limit)).unwrap_or(usize::MAX),
    )
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use prometheus_client::collector::Collector;
    use prometheus_client::registry::Registry;

    use super::*;

    #[derive(Debug)]
    struct Only(Arc<Stats>);

    impl Collector for Only {
        fn encode(&self, mut e: DescriptorEncoder<'_>) -> Result<(), FmtError> {
            encode(&mut e, &self.0)
        }
    }

    #[test]
    fn the_publishers_counters_are_exported() {
        let s = Arc::new(Stats::default());
        for (a, v) in [
            (&s.writes_main, 7),
            (&s.writes_status, 9),
            (&s.refused, 2),
            (&s.throttled, 4),
            (&s.conflicts, 1),
            (&s.queued, 12),
            (&s.probes, 3),
            (&s.repairs, 5),
            (&s.limit, 2),
        ] {
            a.store(v, Ordering::Relaxed);
        }
        let mut registry = Registry::default();
        registry.register_collector(Box::new(Only(s)));
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, &registry).unwrap();
        for line in [
            "volring_publish_writes_total{part=\"main\"} 7",
            "volring_publish_writes_total{part=\"status\"} 9",
            "volring_publish_refused_total 2",
            "volring_publish_throttled_total 4",
            "volring_publish_conflicts_total 1",
            "volring_publish_unavailable_total 0",
            "volring_publish_abandoned_total 0",
            "volring_publish_queued 12",
            "volring_publish_probes_total 3",
            "volring_publish_repairs_total 5",
            "volring_publish_in_flight_limit 2",
        ] {
            assert!(out.lines().any(|l| l == line), "{line} in\n{out}");
        }
    }
}
