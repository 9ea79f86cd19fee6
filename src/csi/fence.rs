//! The owning node's fence between mounting a volume itself and serving it
//! to other nodes over its NBD export.
//!
//! Why: a volume's image lives on one node, and an ext4 or xfs filesystem
//! written by two kernels at once is corrupt. The owning node stages its
//! own volumes locally (loop or socketpair nbd), and its export listener
//! serves the same image to other nodes' kernels; before this fence both
//! could happen at once. Every write from anywhere reaches the image
//! through this node, so this node can arbitrate: one holder at a time,
//! `Local` (staged here) or `Remote` (handed out by the export), decided
//! under one lock and recorded in the node's store before the answer goes
//! out, so a crash of the agent at any step leaves the holder on record.
//!
//! A remote holder is taken at a client's NBD GO and kept after its
//! connections drop: the consuming kernel queues I/O and its agent
//! reconnects (the healer), so a connection gone without NBD_CMD_DISC is a
//! holder away, not a holder gone. It is let go when its last connection
//! ends with NBD_CMD_DISC (the consuming node's NodeUnstage disconnects the
//! device, and the kernel sends DISC on every socket), or by the operator
//! ([`Fence::release_remote`]) once the consuming node is known dead —
//! refused while a connection is open. A local holder is taken before the
//! staged record is first written and let go after it is removed, so a
//! staged record always has its holder; at start, a local holder without a
//! staged (or quarantined) record is dropped, and a staged exported volume
//! without one gets it.
//!
//! Only volumes the node exports (an `nbd_secret` in the pool record) are
//! fenced: nothing else can be reached from another node.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use super::{Error, Result};
use crate::state::store::{Change, Store};

const PREFIX: &str = "NbdHolder/";

/// Who holds an exported volume.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(tag = "holder", rename_all = "camelCase")]
pub enum Holder {
    /// Staged on this node.
    Local,
    /// Handed out by the export to another node's client; `since`: unix
    /// seconds of the GO that took it.
    Remote { since: u64 },
}

#[derive(Default)]
struct State {
    holders: HashMap<String, Holder>,
    /// Open export connections, by volume (not recorded: none survive a
    /// restart).
    connections: HashMap<String, u32>,
}

pub struct Fence {
    store: Arc<Store>,
    state: Mutex<State>,
}

fn store_err(e: impl std::fmt::Display) -> Error {
    Error::Internal(format!("the node's store: {e}"))
}

impl Fence {
    /// Loads the recorded holders. A record that does not decode is
    /// reported and kept out of use — its volume is then treated as held
    /// remotely, the side that refuses both a local stage and a new client
    /// until the operator looks.
    pub fn open(store: Arc<Store>) -> Result<Self> {
        let mut holders = HashMap::new();
        for (key, bytes) in store.published_under(PREFIX).map_err(store_err)? {
            let Some(id) = key.strip_prefix(PREFIX) else { continue };
            match serde_json::from_slice::<Holder>(&bytes) {
                Ok(h) => holders.insert(id.to_string(), h),
                Err(e) => {
                    tracing::error!(volume = id, error = %e, "the recorded holder does not decode; the volume stays fenced");
                    holders.insert(id.to_string(), Holder::Remote { since: 0 })
                }
            };
        }
        Ok(Self { store, state: Mutex::new(State { holders, connections: HashMap::new() }) })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn put(&self, id: &str, h: &Holder) -> Result<()> {
        let bytes = serde_json::to_vec(h).map_err(store_err)?;
        self.store.apply(&[Change::PutPublished(&format!("{PREFIX}{id}"), &bytes)]).map_err(store_err)
    }

    fn remove(&self, id: &str) -> Result<()> {
        self.store.apply(&[Change::RemovePublished(&format!("{PREFIX}{id}"))]).map_err(store_err)
    }

    /// Every recorded holder, by volume id.
    pub fn all(&self) -> std::collections::BTreeMap<String, Holder> {
        self.lock().holders.iter().map(|(k, v)| (k.clone(), v.clone())).collect()
    }

    /// Who holds `id` now.
    pub fn holder(&self, id: &str) -> Option<Holder> {
        self.lock().holders.get(id).cloned()
    }

    /// Before a local stage of exported volume `id`: the volume becomes
    /// this node's, unless another node holds it (FAILED_PRECONDITION, the
    /// code the spec gives a volume published at another node: the CO
    /// must get it released there first).
    pub fn take_local(&self, id: &str) -> Result<()> {
        let mut s = self.lock();
        match s.holders.get(id) {
            Some(Holder::Local) => Ok(()),
            Some(Holder::Remote { .. }) => {
                let open = s.connections.get(id).copied().unwrap_or(0);
                Err(Error::FailedPrecondition(format!(
                    "volume {id} is attached on another node through this node's nbd export ({open} connection(s) open now); \
                     it is staged here only after that node unstages it (or, were that node dead, after the holder is released)"
                )))
            }
            None => {
                self.put(id, &Holder::Local)?;
                s.holders.insert(id.to_string(), Holder::Local);
                Ok(())
            }
        }
    }

    /// After a local stage's record is gone (unstaged, or a first stage
    /// rolled back): other nodes may have the volume.
    pub fn drop_local(&self, id: &str) -> Result<()> {
        let mut s = self.lock();
        if s.holders.get(id) == Some(&Holder::Local) {
            self.remove(id)?;
            s.holders.remove(id);
        }
        Ok(())
    }

    /// The volume is deleted: whatever held it is moot.
    pub fn forget(&self, id: &str) -> Result<()> {
        let mut s = self.lock();
        if s.holders.remove(id).is_some() {
            self.remove(id)?;
        }
        Ok(())
    }

    /// The operator's release of a remote holder known dead (its node gone
    /// for good, its kernel device torn down). Refused while a connection
    /// is open: a holder still connected is alive. True when a remote
    /// holder was released.
    pub fn release_remote(&self, id: &str) -> Result<bool> {
        let mut s = self.lock();
        if !matches!(s.holders.get(id), Some(Holder::Remote { .. })) {
            return Ok(false);
        }
        let open = s.connections.get(id).copied().unwrap_or(0);
        if open > 0 {
            return Err(Error::FailedPrecondition(format!(
                "volume {id}'s remote holder has {open} connection(s) open: it is alive; unstage it there"
            )));
        }
        self.remove(id)?;
        s.holders.remove(id);
        tracing::warn!(volume = id, "remote holder released by the operator");
        Ok(true)
    }

    /// At start (the caller holds no volume lock; nothing is served yet):
    /// `staged(id)` says whether `id` has a staged or quarantined record
    /// here. Local holders of volumes not staged are dropped (a crash
    /// between taking the holder and writing the record, or between
    /// removing the record and dropping the holder); the staged exported
    /// volumes in `exported_staged` without a holder get the local one (a
    /// stage made before this fence existed). A volume held remotely and
    /// staged here is reported: both are kept, so nothing new gets it.
    pub fn resume(&self, staged: impl Fn(&str) -> bool, exported_staged: &[String]) -> Result<()> {
        let mut s = self.lock();
        let stray: Vec<String> = s.holders.iter().filter(|(id, h)| **h == Holder::Local && !staged(id)).map(|(id, _)| id.clone()).collect();
        for id in stray {
            tracing::info!(volume = %id, "local holder of a volume no longer staged here; dropped");
            self.remove(&id)?;
            s.holders.remove(&id);
        }
        for id in exported_staged {
            match s.holders.get(id.as_str()) {
                None => {
                    self.put(id, &Holder::Local)?;
                    s.holders.insert(id.clone(), Holder::Local);
                }
                Some(Holder::Remote { .. }) => tracing::error!(volume = %id,
                    "volume staged here while another node holds it through the export; nothing new gets it until one side lets go"),
                Some(Holder::Local) => {}
            }
        }
        Ok(())
    }
}

fn now() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

impl crate::nbd::Admission for Fence {
    fn admit(&self, export: &str) -> std::result::Result<(), String> {
        let mut s = self.lock();
        match s.holders.get(export) {
            Some(Holder::Local) => return Err("is staged on its owning node; it is served to another node once unstaged there".into()),
            Some(Holder::Remote { .. }) => {}
            None => {
                let h = Holder::Remote { since: now() };
                // Recorded before the client hears yes.
                self.put(export, &h).map_err(|e| format!("cannot record the holder: {e}"))?;
                s.holders.insert(export.to_string(), h);
                tracing::info!(volume = export, "held by another node through the nbd export");
            }
        }
        *s.connections.entry(export.to_string()).or_default() += 1;
        Ok(())
    }

    fn released(&self, export: &str, disconnected: bool) {
        let mut s = self.lock();
        let left = match s.connections.get_mut(export) {
            Some(n) => {
                *n = n.saturating_sub(1);
                *n
            }
            None => 0,
        };
        if left > 0 {
            return;
        }
        s.connections.remove(export);
        if !disconnected || !matches!(s.holders.get(export), Some(Holder::Remote { .. })) {
            return;
        }
        match self.remove(export) {
            Ok(()) => {
                s.holders.remove(export);
                tracing::info!(volume = export, "the other node let go of the volume (NBD_CMD_DISC)");
            }
            Err(e) => tracing::error!(volume = export, error = %e, "cannot record the release; the volume stays held"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::nbd::Admission;

    fn fence(dir: &std::path::Path) -> Fence {
        Fence::open(Arc::new(Store::open(&dir.join("s.redb")).unwrap())).unwrap()
    }

    #[test]
    fn one_holder_at_a_time_and_recorded() {
        let dir = tempfile::tempdir().unwrap();
        let f = fence(dir.path());
        f.take_local("a").unwrap();
        f.take_local("a").unwrap();
        assert!(f.admit("a").is_err(), "a volume staged here is not handed out");
        f.admit("b").unwrap();
        f.admit("b").unwrap();
        let e = f.take_local("b").unwrap_err();
        assert_eq!(e.code(), tonic::Code::FailedPrecondition, "{e}");
        // One connection ends cleanly, the other is still open: held.
        f.released("b", true);
        assert!(f.take_local("b").is_err());
        assert!(f.release_remote("b").is_err(), "a connected holder is not released by hand");
        // The last one drops without DISC: still held (it will reconnect).
        f.released("b", false);
        assert!(f.take_local("b").is_err());
        drop(f);
        // A restart finds both holders.
        let f = fence(dir.path());
        assert_eq!(f.holder("a"), Some(Holder::Local));
        assert!(matches!(f.holder("b"), Some(Holder::Remote { .. })));
        assert!(f.take_local("b").is_err() && f.admit("a").is_err());
        // The holder reconnects and lets go with DISC.
        f.admit("b").unwrap();
        f.released("b", true);
        assert_eq!(f.holder("b"), None);
        f.take_local("b").unwrap();
        f.drop_local("a").unwrap();
        f.admit("a").unwrap();
    }

    #[test]
    fn operator_release_and_start_walk() {
        let dir = tempfile::tempdir().unwrap();
        let f = fence(dir.path());
        f.admit("gone").unwrap();
        f.released("gone", false);
        assert!(f.release_remote("gone").unwrap());
        assert!(!f.release_remote("gone").unwrap());
        f.take_local("gone").unwrap();
        f.take_local("stray").unwrap();
        f.admit("r").unwrap();
        f.released("r", false);
        f.resume(|id| id == "gone", &["gone".into(), "old".into()]).unwrap();
        drop(f);
        let f = fence(dir.path());
        assert_eq!(f.holder("stray"), None, "a local holder without a staged record is dropped");
        assert_eq!(f.holder("gone"), Some(Holder::Local));
        assert_eq!(f.holder("old"), Some(Holder::Local), "a stage from before the fence gets its holder");
        assert!(matches!(f.holder("r"), Some(Holder::Remote { .. })), "remote holders survive the walk");
        f.forget("r").unwrap();
        drop(f);
        assert_eq!(fence(dir.path()).holder("r"), None);
    }
}
