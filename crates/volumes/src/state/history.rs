//! The reconciler's last repairs: a bounded ring kept in the node's store,
//! so `volring status` (reading the store beside the agent, or after it
//! stopped) can say what was repaired, when, and how it went.
//!
//! A verdict ([`super::actual::VolumeHealth`]) keeps only a volume's last
//! repair and goes with the volume; the ring keeps the node's last
//! [`KEEP`] attempts across volumes, unstaged ones included. A repair that
//! keeps failing the same way (retried with backoff) is one entry whose
//! `attempts` grows, so it cannot push every other entry out.

use std::collections::VecDeque;

use serde::{Deserialize, Serialize};

use super::actual::{Action, Drift};
use crate::store::{Change, Store};

/// How many repairs the ring keeps.
pub(crate) const KEEP: usize = 32;

/// How a repair attempt went.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "result")]
pub enum RepairResult {
    Repaired,
    Failed { error: String },
}

/// One repair attempt.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RepairEvent {
    /// Grows by one per entry, across restarts.
    pub seq: u64,
    /// When (unix seconds; the last attempt's, for folded failures).
    pub at_unix: u64,
    pub volume: String,
    pub action: Action,
    /// The drift the attempt was for.
    pub drift: Vec<Drift>,
    #[serde(flatten)]
    pub result: RepairResult,
    /// Identical failures in a row, folded into this entry.
    #[serde(default = "one")]
    pub attempts: u32,
}

fn one() -> u32 {
    1
}

/// The store's key of entry `seq`: fixed width, so keys sort by `seq`.
fn key(seq: u64) -> String {
    format!("{seq:020}")
}

/// Decodes the store's raw rows, oldest first; undecodable rows are
/// skipped (an operator's view must not fail on one bad entry).
pub(crate) fn decode(rows: &[(String, Vec<u8>)]) -> Vec<RepairEvent> {
    let mut v: Vec<RepairEvent> = rows.iter().filter_map(|(_, b)| serde_json::from_slice(b).ok()).collect();
    v.sort_by_key(|e| e.seq);
    v
}

/// The ring, owned by the reconciler's thread.
#[derive(Debug, Default)]
pub(crate) struct RepairHistory {
    ring: VecDeque<RepairEvent>,
    /// Store rows to write (`Some`) or remove (`None`) at the next flush.
    pending: Vec<(String, Option<Vec<u8>>)>,
}

impl RepairHistory {
    /// The ring as an earlier run left it in `store`.
    pub(crate) fn load(store: &Store) -> Self {
        let rows = store.contents().map(|c| c.repairs).unwrap_or_default();
        let mut ring: VecDeque<RepairEvent> = decode(&rows).into();
        let mut pending = Vec::new();
        while ring.len() > KEEP {
            if let Some(old) = ring.pop_front() {
                pending.push((key(old.seq), None));
            }
        }
        Self { ring, pending }
    }

    /// Records an attempt on `volume`; written at the next [`Self::flush`].
    pub(crate) fn record(&mut self, at_unix: u64, volume: &str, action: Action, drift: Vec<Drift>, result: RepairResult) {
        if let Some(last) = self.ring.back_mut() {
            let same_failure = matches!(result, RepairResult::Failed { .. })
                && last.volume == volume
                && last.action == action
                && last.drift == drift
                && last.result == result;
            if same_failure {
                last.attempts = last.attempts.saturating_add(1);
                last.at_unix = at_unix;
                let row = (key(last.seq), Some(serde_json::to_vec(&*last).expect("a repair serialises")));
                self.pending.push(row);
                return;
            }
        }
        let seq = self.ring.back().map_or(1, |e| e.seq + 1);
        let e = RepairEvent { seq, at_unix, volume: volume.to_string(), action, drift, result, attempts: 1 };
        self.pending.push((key(seq), Some(serde_json::to_vec(&e).expect("a repair serialises"))));
        self.ring.push_back(e);
        while self.ring.len() > KEEP {
            if let Some(old) = self.ring.pop_front() {
                self.pending.push((key(old.seq), None));
            }
        }
    }

    /// Oldest first (what the unit tests compare).
    #[cfg(test)]
    fn entries(&self) -> impl Iterator<Item = &RepairEvent> {
        self.ring.iter()
    }

    /// Writes what changed since the last flush, in one transaction. A
    /// store that refuses is logged: the ring is a record for people, the
    /// repairs themselves are done.
    pub(crate) fn flush(&mut self, store: &Store) {
        if self.pending.is_empty() {
            return;
        }
        let changes: Vec<Change<'_>> = self
            .pending
            .iter()
            .map(|(k, v)| match v {
                Some(b) => Change::PutRepair(k, b),
                None => Change::RemoveRepair(k),
            })
            .collect();
        if let Err(e) = store.apply(&changes) {
            tracing::error!(error = %e, "could not store the reconciler's repair history");
        }
        self.pending.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn failed(e: &str) -> RepairResult {
        RepairResult::Failed { error: e.into() }
    }

    /// The ring keeps the last KEEP entries in the store across a reload,
    /// and folds a failure repeated on backoff into one entry.
    #[test]
    fn bounded_persisted_and_folded() {
        let d = tempfile::tempdir().unwrap();
        let store = Store::open(&d.path().join(crate::store::FILE)).unwrap();
        let mut h = RepairHistory::load(&store);
        for i in 0..(KEEP as u64 + 5) {
            h.record(i, &format!("v{i}"), Action::Restage, vec![Drift::StagingMissing], RepairResult::Repaired);
        }
        for t in 0..10 {
            h.record(100 + t, "bad", Action::Restage, vec![Drift::DeviceDetached], failed("EBUSY"));
        }
        h.record(200, "bad", Action::Restage, vec![Drift::DeviceDetached], failed("ENOENT"));
        h.flush(&store);
        let stored = decode(&store.contents().unwrap().repairs);
        assert_eq!(stored.len(), KEEP);
        assert_eq!(stored, h.entries().cloned().collect::<Vec<_>>());
        let folded = &stored[KEEP - 2];
        assert_eq!((folded.volume.as_str(), folded.attempts, folded.at_unix), ("bad", 10, 109));
        assert_eq!(stored[KEEP - 1].result, failed("ENOENT"));
        assert_eq!(stored[0].volume, format!("v{}", 7));
        let again = RepairHistory::load(&store);
        assert_eq!(again.entries().count(), KEEP);
        let json = serde_json::to_value(&stored[KEEP - 1]).unwrap();
        assert_eq!(json["result"], "failed");
        assert_eq!(json["drift"][0]["kind"], "device_detached");
    }
}
