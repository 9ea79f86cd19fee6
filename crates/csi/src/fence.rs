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
//! A remote holder is one consuming node, by the name its client gives
//! itself on the wire (`<export>/<secret>/<node>`, see `nbd::remote`): the
//! secret is per volume, so without the name two consuming nodes would be
//! one holder and could both mount the volume. Another node's GO, or a
//! client that gives no name, is refused while a named node holds it. A
//! holder recorded without a name (a client that gave none, or a record
//! from before names) is kept for clients without one; the first named
//! client takes it over only while no connection is open, which is how a
//! consuming node upgraded to naming itself gets its volume back.
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
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use super::{Error, Result};
use volring_volumes::store::{Change, Store};

const PREFIX: &str = "NbdHolder/";

/// How long a local stage or a delete waits for a remote holder's open
/// connections to end: a consuming node that has just unstaged sent
/// NBD_CMD_DISC, but the export's ring may not have read it yet, and a
/// volume withdrawn before it does would keep a holder that let go.
const SETTLE: Duration = Duration::from_secs(3);

/// Who holds an exported volume.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(tag = "holder", rename_all = "camelCase")]
pub enum Holder {
    /// Staged on this node.
    Local,
    /// Handed out by the export to another node's client; `since`: unix
    /// seconds of the GO that took it; `node`: the name the client gave
    /// itself (`None`: it gave none).
    Remote {
        since: u64,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        node: Option<String>,
    },
}

impl Holder {
    /// Who it is, for messages: "this node", "node NAME", or "another node
    /// (it gave no name)".
    pub fn who(&self) -> String {
        match self {
            Holder::Local => "this node".into(),
            Holder::Remote { node: Some(n), .. } => format!("node {n}"),
            Holder::Remote { node: None, .. } => "another node (it gave no name)".into(),
        }
    }
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
    /// Told whenever a connection ends (see [`SETTLE`]).
    ended: Condvar,
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
                    holders.insert(id.to_string(), Holder::Remote { since: 0, node: None })
                }
            };
        }
        Ok(Self { store, state: Mutex::new(State { holders, connections: HashMap::new() }), ended: Condvar::new() })
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The state once `id`'s remote holder has no open connection, or
    /// after [`SETTLE`] (a holder still connected then is alive). Blocks:
    /// for CSI calls, which run off the async runtime.
    fn settled(&self, id: &str) -> MutexGuard<'_, State> {
        let deadline = Instant::now() + SETTLE;
        let mut s = self.lock();
        loop {
            let busy = matches!(s.holders.get(id), Some(Holder::Remote { .. })) && s.connections.get(id).is_some_and(|n| *n > 0);
            let left = deadline.saturating_duration_since(Instant::now());
            if !busy || left.is_zero() {
                return s;
            }
            s = self.ended.wait_timeout(s, left).unwrap_or_else(|e| e.into_inner()).0;
        }
    }

    /// Before a volume stops being served (a delete): waits, bounded, for
    /// a remote holder's connections that are ending, so a DISC on its way
    /// releases the holder instead of being cut off by the withdrawal.
    pub(crate) fn settle(&self, id: &str) {
        drop(self.settled(id));
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
    pub(crate) fn holder(&self, id: &str) -> Option<Holder> {
        self.lock().holders.get(id).cloned()
    }

    /// Before a local stage of exported volume `id`: the volume becomes
    /// this node's, unless another node holds it (FAILED_PRECONDITION, the
    /// code the spec gives a volume published at another node: the CO
    /// must get it released there first).
    pub(crate) fn take_local(&self, id: &str) -> Result<()> {
        let mut s = self.settled(id);
        match s.holders.get(id) {
            Some(Holder::Local) => Ok(()),
            Some(h @ Holder::Remote { .. }) => {
                let open = s.connections.get(id).copied().unwrap_or(0);
                Err(Error::FailedPrecondition(format!(
                    "volume {id} is attached on {} through this node's nbd export ({open} connection(s) open now); \
                     it is staged here only after that node unstages it (or, were that node dead, after the holder is released)",
                    h.who()
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
    pub(crate) fn drop_local(&self, id: &str) -> Result<()> {
        let mut s = self.lock();
        if s.holders.get(id) == Some(&Holder::Local) {
            self.remove(id)?;
            s.holders.remove(id);
        }
        Ok(())
    }

    /// The volume is deleted: whatever held it is moot.
    pub(crate) fn forget(&self, id: &str) -> Result<()> {
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
    pub(crate) fn resume(&self, staged: impl Fn(&str) -> bool, exported_staged: &[String]) -> Result<()> {
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

impl volring_nbd::Admission for Fence {
    fn admit(&self, export: &str, client: Option<&str>) -> std::result::Result<(), String> {
        let mut s = self.lock();
        let open = s.connections.get(export).copied().unwrap_or(0);
        match s.holders.get(export) {
            Some(Holder::Local) => return Err("is staged on its owning node; it is served to another node once unstaged there".into()),
            Some(Holder::Remote { node, .. }) if node.as_deref() == client => {}
            Some(Holder::Remote { node: None, .. }) if open == 0 => {
                let h = Holder::Remote { since: now(), node: client.map(str::to_string) };
                self.put(export, &h).map_err(|e| format!("cannot record the holder: {e}"))?;
                s.holders.insert(export.to_string(), h);
                tracing::warn!(
                    volume = export,
                    node = client,
                    "a holder recorded without a node name is taken over by the first named node (no connection was open)"
                );
            }
            Some(h) => {
                let holder = h.who();
                return Err(format!(
                    "is held by {holder} through this node's export ({open} connection(s) open); \
                     another node gets it once that one unstages it (or, were it dead, once the holder is released)"
                ));
            }
            None => {
                let h = Holder::Remote { since: now(), node: client.map(str::to_string) };
                // Recorded before the client hears yes.
                self.put(export, &h).map_err(|e| format!("cannot record the holder: {e}"))?;
                s.holders.insert(export.to_string(), h);
                tracing::info!(volume = export, node = client, "held by another node through the nbd export");
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
        self.ended.notify_all();
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
    use volring_nbd::Admission;

    fn fence(dir: &std::path::Path) -> Fence {
        Fence::open(Arc::new(Store::open(&dir.join("s.redb")).unwrap())).unwrap()
    }

    #[test]
    fn one_holder_at_a_time_and_recorded() {
        let dir = tempfile::tempdir().unwrap();
        let f = fence(dir.path());
        f.take_local("a").unwrap();
        f.take_local("a").unwrap();
        assert!(f.admit("a", None).is_err(), "a volume staged here is not handed out");
        f.admit("b", None).unwrap();
        f.admit("b", None).unwrap();
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
        assert!(f.take_local("b").is_err() && f.admit("a", None).is_err());
        // The holder reconnects and lets go with DISC.
        f.admit("b", None).unwrap();
        f.released("b", true);
        assert_eq!(f.holder("b"), None);
        f.take_local("b").unwrap();
        f.drop_local("a").unwrap();
        f.admit("a", None).unwrap();
    }

    #[test]
    fn operator_release_and_start_walk() {
        let dir = tempfile::tempdir().unwrap();
        let f = fence(dir.path());
        f.admit("gone", None).unwrap();
        f.released("gone", false);
        assert!(f.release_remote("gone").unwrap());
        assert!(!f.release_remote("gone").unwrap());
        f.take_local("gone").unwrap();
        f.take_local("stray").unwrap();
        f.admit("r", None).unwrap();
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

    /// Two consuming nodes present the same volume secret: the one that
    /// holds the volume keeps it (across reconnects and an owner restart),
    /// the other and a client without a name are refused until it lets go.
    #[test]
    fn one_consuming_node_at_a_time() {
        let dir = tempfile::tempdir().unwrap();
        let f = fence(dir.path());
        f.admit("v", Some("node-b")).unwrap();
        f.admit("v", Some("node-b")).unwrap();
        let e = f.admit("v", Some("node-c")).unwrap_err();
        assert!(e.contains("node node-b"), "{e}");
        assert!(f.admit("v", None).is_err(), "a nameless client while node-b holds it");
        // node-b's connections drop without DISC: away, not gone.
        f.released("v", false);
        f.released("v", false);
        assert!(f.admit("v", Some("node-c")).is_err());
        drop(f);
        let f = fence(dir.path());
        assert!(matches!(f.holder("v"), Some(Holder::Remote { node: Some(n), .. }) if n == "node-b"), "the name is recorded");
        assert!(f.admit("v", Some("node-c")).is_err(), "after an owner restart");
        f.admit("v", Some("node-b")).unwrap();
        f.released("v", true);
        f.admit("v", Some("node-c")).unwrap();
        assert!(matches!(f.holder("v"), Some(Holder::Remote { node: Some(n), .. }) if n == "node-c"));
    }

    /// A holder recorded without a name keeps nameless clients; a named one
    /// takes it over only while no connection is open.
    #[test]
    fn a_nameless_holder_is_taken_over_only_when_idle() {
        let dir = tempfile::tempdir().unwrap();
        let f = fence(dir.path());
        // A record from before names decodes as a nameless holder.
        f.store.apply(&[Change::PutPublished(&format!("{PREFIX}old"), br#"{"holder":"remote","since":7}"#)]).unwrap();
        drop(f);
        let f = fence(dir.path());
        assert_eq!(f.holder("old"), Some(Holder::Remote { since: 7, node: None }));
        f.admit("old", None).unwrap();
        assert!(f.admit("old", Some("node-b")).is_err(), "taken over while a nameless client is connected");
        f.released("old", false);
        f.admit("old", Some("node-b")).unwrap();
        assert!(f.admit("old", None).is_err() && f.admit("old", Some("node-c")).is_err());
        assert!(matches!(f.holder("old"), Some(Holder::Remote { node: Some(n), .. }) if n == "node-b"));
    }

    /// A local stage right after the consuming node's DISC was sent, but
    /// before the export's ring read it, waits for it instead of failing;
    /// a holder still connected after the wait is refused.
    #[test]
    fn a_stage_waits_for_a_disc_on_its_way() {
        let dir = tempfile::tempdir().unwrap();
        let f = Arc::new(fence(dir.path()));
        f.admit("v", Some("node-b")).unwrap();
        let ring = {
            let f = f.clone();
            std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(200));
                f.released("v", true);
            })
        };
        f.take_local("v").expect("staged once node-b's DISC was read");
        ring.join().unwrap();
        assert_eq!(f.holder("v"), Some(Holder::Local));
        f.drop_local("v").unwrap();
        f.admit("v", Some("node-b")).unwrap();
        let t = Instant::now();
        assert!(f.take_local("v").is_err(), "a holder still connected keeps the volume");
        assert!(t.elapsed() >= SETTLE && t.elapsed() < SETTLE * 3, "{:?}", t.elapsed());
    }
}
