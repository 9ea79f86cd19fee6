//! What `/metrics` says about CSI calls: per RPC, how many ended with each
//! gRPC code and how long they took. Kept by the call wrapper
//! ([`super::service`]) in fixed tables of atomics, so recording costs a
//! few relaxed adds and nothing is allocated per call.

use std::sync::atomic::{AtomicU64, Ordering};

use super::RpcSnapshot;

/// Every RPC the driver serves, in the order `/metrics` lists them.
pub(crate) const RPCS: &[&str] = &[
    "GetPluginInfo",
    "GetPluginCapabilities",
    "Probe",
    "CreateVolume",
    "DeleteVolume",
    "ControllerExpandVolume",
    "ValidateVolumeCapabilities",
    "ListVolumes",
    "GetCapacity",
    "ControllerGetCapabilities",
    "ControllerPublishVolume",
    "ControllerUnpublishVolume",
    "CreateSnapshot",
    "DeleteSnapshot",
    "ListSnapshots",
    "ControllerGetVolume",
    "ControllerModifyVolume",
    "NodeStageVolume",
    "NodeUnstageVolume",
    "NodePublishVolume",
    "NodeUnpublishVolume",
    "NodeGetVolumeStats",
    "NodeExpandVolume",
    "NodeGetCapabilities",
    "NodeGetInfo",
];

/// Upper bounds of the latency buckets, microseconds: from a capability
/// query (tens of µs) to a stage that formats a large xfs (seconds).
pub(crate) const LATENCY_BUCKETS_US: [u64; 12] =
    [100, 250, 1_000, 2_500, 10_000, 25_000, 100_000, 250_000, 1_000_000, 2_500_000, 10_000_000, 30_000_000];

/// The gRPC status codes by number (0 OK ... 16 Unauthenticated), as
/// `/metrics` labels them.
pub(crate) const CODES: [&str; 17] = [
    "OK",
    "Cancelled",
    "Unknown",
    "InvalidArgument",
    "DeadlineExceeded",
    "NotFound",
    "AlreadyExists",
    "PermissionDenied",
    "ResourceExhausted",
    "FailedPrecondition",
    "Aborted",
    "OutOfRange",
    "Unimplemented",
    "Internal",
    "Unavailable",
    "DataLoss",
    "Unauthenticated",
];

/// One RPC's counters.
#[derive(Default)]
pub(crate) struct RpcCounters {
    /// Calls ended, by gRPC code number.
    pub(crate) by_code: [AtomicU64; CODES.len()],
    /// Calls per latency bucket ([`LATENCY_BUCKETS_US`], then one past the
    /// last bound), not cumulative.
    pub(crate) buckets: [AtomicU64; LATENCY_BUCKETS_US.len() + 1],
    /// All calls' durations together, microseconds.
    pub(crate) sum_us: AtomicU64,
}

/// Counters for every RPC in [`RPCS`].
pub(crate) struct RpcStats {
    per_rpc: Vec<RpcCounters>,
}

impl Default for RpcStats {
    fn default() -> Self {
        Self { per_rpc: RPCS.iter().map(|_| RpcCounters::default()).collect() }
    }
}

impl RpcStats {
    /// Counts one finished call. An RPC name outside [`RPCS`] is not
    /// counted (the service table and the list are kept together by a test).
    pub(crate) fn record(&self, rpc: &str, code: tonic::Code, micros: u64) {
        let Some(c) = RPCS.iter().position(|r| *r == rpc).map(|i| &self.per_rpc[i]) else {
            return;
        };
        let code = (code as usize).min(CODES.len() - 1);
        c.by_code[code].fetch_add(1, Ordering::Relaxed);
        let bucket = LATENCY_BUCKETS_US.iter().position(|&b| micros <= b).unwrap_or(LATENCY_BUCKETS_US.len());
        c.buckets[bucket].fetch_add(1, Ordering::Relaxed);
        c.sum_us.fetch_add(micros, Ordering::Relaxed);
    }

    /// Each RPC with its counters, in [`RPCS`] order.
    pub(crate) fn each(&self) -> impl Iterator<Item = (&'static str, &RpcCounters)> {
        RPCS.iter().copied().zip(&self.per_rpc)
    }

    /// Every RPC's counters as they are now, in [`RPCS`] order.
    pub(crate) fn snapshot(&self) -> Vec<RpcSnapshot> {
        self.each()
            .map(|(rpc, c)| RpcSnapshot {
                rpc,
                by_code: CODES.iter().copied().zip(c.by_code.iter().map(|n| n.load(Ordering::Relaxed))).collect(),
                buckets: LATENCY_BUCKETS_US
                    .iter()
                    .map(|&b| b as f64 / 1e6)
                    .chain([f64::MAX])
                    .zip(c.buckets.iter().map(|n| n.load(Ordering::Relaxed)))
                    .collect(),
                sum_seconds: c.sum_us.load(Ordering::Relaxed) as f64 / 1e6,
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn calls_are_counted_by_code_and_bucket() {
        let s = RpcStats::default();
        s.record("NodeStageVolume", tonic::Code::Ok, 50);
        s.record("NodeStageVolume", tonic::Code::FailedPrecondition, 3_000);
        s.record("NodeStageVolume", tonic::Code::Ok, u64::MAX / 4);
        s.record("NoSuchRpc", tonic::Code::Ok, 1);
        let (_, c) = s.each().find(|(r, _)| *r == "NodeStageVolume").unwrap();
        assert_eq!(c.by_code[0].load(Ordering::Relaxed), 2);
        assert_eq!(c.by_code[9].load(Ordering::Relaxed), 1);
        assert_eq!(c.buckets[0].load(Ordering::Relaxed), 1);
        assert_eq!(c.buckets[4].load(Ordering::Relaxed), 1);
        assert_eq!(c.buckets[LATENCY_BUCKETS_US.len()].load(Ordering::Relaxed), 1);
        let total: u64 = s.each().flat_map(|(_, c)| c.by_code.iter()).map(|n| n.load(Ordering::Relaxed)).sum();
        assert_eq!(total, 3, "an unknown RPC is not counted");
        let snap = s.snapshot();
        let stage = snap.iter().find(|r| r.rpc == "NodeStageVolume").unwrap();
        assert_eq!((stage.by_code[0], stage.by_code[9]), (("OK", 2), ("FailedPrecondition", 1)));
        assert_eq!(stage.buckets.len(), LATENCY_BUCKETS_US.len() + 1);
        assert_eq!((stage.buckets[0], stage.buckets[LATENCY_BUCKETS_US.len()]), ((1e-4, 1), (f64::MAX, 1)));
        assert_eq!(snap.len(), RPCS.len());
    }

    #[test]
    fn every_served_rpc_is_listed() {
        let service = include_str!("service.rs").split("#[cfg(test)]").next().unwrap_or_default();
        let served: Vec<&str> = service
            .lines()
            .filter_map(|l| l.trim_start().split_once(", \"").map(|(_, r)| r))
            .filter_map(|r| r.split_once('"').map(|(name, _)| name))
            .filter(|n| n.chars().next().is_some_and(|c| c.is_ascii_uppercase()) && n.chars().all(|c| c.is_ascii_alphanumeric()))
            .collect();
        assert_eq!(served.len(), RPCS.len(), "served: {served:?}");
        for r in served {
            assert!(RPCS.contains(&r), "{r} is served but not in RPCS");
        }
    }
}
