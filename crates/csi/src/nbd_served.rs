//! The running half of the nbd side: the server, the control socket and
//! the devices this process keeps connected, with the LINK_DEAD watcher
//! that gives dead ones fresh sockets (see `nbd.rs` for why).

use std::collections::{HashMap, HashSet};
use std::path::PathBuf;
use std::sync::{Arc, Mutex, Weak};

use super::alive;
use super::walk;
use super::{Healed, NbdAttachConfig, RETRY_EVERY};
use crate::{Error, Result};
use volring_nbd::attach::{self as nbdattach, LinkDeadListener, LocalAttachment, NbdControl, RemoteAttachment, RemoteSource};
use volring_nbd::client::ExportDetails;
use volring_nbd::remote::{ExportUri, Secret};

use volring_nbd::{ExportSpec, NbdServer};
use volring_volumes::attach;
use volring_volumes::{RemoteExport, StagedVolume};

/// `NBD_REP_ERR_POLICY`, the option reply of a server that will not serve
/// the export to this client now (the NBD protocol's doc/proto.md): kept
/// here, not borrowed from the server's code, so a wrong number there is
/// seen rather than followed.
const NBD_REP_ERR_POLICY: u32 = 0x8000_0002;

pub(super) struct Inner {
    pub(super) server: NbdServer,
    pub(super) control: Mutex<NbdControl>,
    /// The devices this process serves, by index (what LINK_DEAD refreshes).
    pub(super) live: Mutex<HashMap<u32, Live>>,
    /// Remote devices whose reconnect is running now (on a thread of its
    /// own): not started again meanwhile.
    pub(super) connecting: Mutex<HashSet<u32>>,
    /// As `NbdSide::records`.
    pub(super) records: Option<PathBuf>,
    pub(super) config: NbdAttachConfig,
}

/// Who serves a device this process keeps connected.
#[derive(Debug, Clone)]
pub(super) enum Served {
    /// This agent's own server, over socketpairs.
    Local(LocalAttachment),
    /// Another node's export, over TCP.
    Remote(RemoteAttachment),
}

#[derive(Debug, Clone)]
pub(super) struct Live {
    pub(super) served: Served,
    /// Its connections died and fresh ones are still owed (retried).
    pub(super) stale: bool,
}

/// The walk's steps on this agent's server and the kernel.
pub(super) struct RealSteps(pub(super) Arc<Inner>);

impl walk::Steps for RealSteps {
    fn local(&self, rec: &StagedVolume, index: u32) -> Healed {
        self.0.heal_local(rec, index)
    }

    fn remote(&self, rec: &StagedVolume, index: u32) -> Healed {
        self.0.heal_remote(rec, index)
    }

    fn defer(&self, rec: &StagedVolume, index: u32) -> Healed {
        self.0.defer_remote(rec, index)
    }
}

/// For a walk with nothing to reconnect (and no nbd driver to ask).
pub(super) struct NoSteps;

impl walk::Steps for NoSteps {
    fn local(&self, _: &StagedVolume, _: u32) -> Healed {
        Healed::Failed("nothing to reconnect with".into())
    }

    fn remote(&self, _: &StagedVolume, _: u32) -> Healed {
        Healed::Failed("nothing to reconnect with".into())
    }
}

impl Inner {
    /// Fresh socketpairs from this agent's server for a local device.
    pub(super) fn heal_local(&self, rec: &StagedVolume, index: u32) -> Healed {
        let result = self.serve(rec).and_then(|()| {
            let mut control = self.control.lock().unwrap_or_else(|e| e.into_inner());
            LocalAttachment::reattach(&mut control, &self.server, index, &rec.volume_id, &rec.volume_id, self.config.connections)
                .map_err(attach_error)
        });
        match result {
            Ok(att) => {
                self.live.lock().unwrap_or_else(|e| e.into_inner()).insert(index, Live { served: Served::Local(att), stale: false });
                Healed::Reconnected(index)
            }
            Err(e) => Healed::Failed(e.to_string()),
        }
    }

    /// Fresh TCP sockets to the owning node's export for a remote device
    /// (one try, bounded by the connect timeout); an export that does not
    /// answer leaves the device owed a reconnect, retried every
    /// `RETRY_EVERY`.
    pub(super) fn heal_remote(&self, rec: &StagedVolume, index: u32) -> Healed {
        let Some(r) = &rec.remote else { return Healed::Failed("not a remote volume".into()) };
        let source = match remote_source(r, self.config.client.as_deref()) {
            Ok(s) => s,
            Err(e) => return Healed::Failed(e.to_string()),
        };
        match nbdattach::remote_sockets(&source, self.config.connections) {
            Ok((sockets, details)) => {
                let fresh = alive::inodes(&sockets);
                let mut control = self.control.lock().unwrap_or_else(|e| e.into_inner());
                match RemoteAttachment::reconnect(&mut control, index, &source, &rec.volume_id, sockets, details) {
                    Ok(att) => {
                        drop(control);
                        self.record_sockets(&att, &fresh);
                        self.live
                            .lock()
                            .unwrap_or_else(|e| e.into_inner())
                            .insert(index, Live { served: Served::Remote(att), stale: false });
                        Healed::Reconnected(index)
                    }
                    Err(e) => Healed::Failed(attach_error(e).to_string()),
                }
            }
            Err(e) => {
                // The export is away: the device keeps queueing I/O, and
                // the retry loop reconnects it once the export answers.
                let why = remote_error(&source, e).to_string();
                self.owe(rec, index, source, why)
            }
        }
    }

    /// The walk ran out of time before this remote device's turn: the
    /// retry loop reconnects it (as when its export does not answer).
    pub(super) fn defer_remote(&self, rec: &StagedVolume, index: u32) -> Healed {
        let Some(r) = &rec.remote else { return Healed::Failed("not a remote volume".into()) };
        match remote_source(r, self.config.client.as_deref()) {
            Ok(source) => self.owe(rec, index, source, "the healer's walk ran out of time before its turn".into()),
            Err(e) => Healed::Failed(e.to_string()),
        }
    }

    /// Records `index` as owed fresh sockets from `source`, for the retry loop.
    fn owe(&self, rec: &StagedVolume, index: u32, source: RemoteSource, why: String) -> Healed {
        let att = RemoteAttachment {
            index,
            source,
            backend_id: rec.volume_id.clone(),
            connections: self.config.connections,
            details: ExportDetails { size: device_size(index), tx_flags: 0, block_sizes: None },
        };
        self.live.lock().unwrap_or_else(|e| e.into_inner()).insert(index, Live { served: Served::Remote(att), stale: true });
        Healed::Retrying { index, why }
    }

    /// Records the sockets the kernel took for a remote device.
    pub(super) fn record_sockets(&self, att: &RemoteAttachment, fresh: &[u64]) {
        let (Some(dir), Some(port)) = (&self.records, alive::authority_port(&att.source.uri.authority())) else { return };
        alive::record_sockets(dir, att.index, &att.backend_id, port, att.connections, fresh);
    }

    /// Serves the volume's image as export `<volume id>` (once).
    pub(super) fn export(&self, rec: &StagedVolume) -> std::result::Result<(), volring_nbd::Error> {
        if self.server.exports().get(&rec.volume_id).is_some() {
            return Ok(());
        }
        let spec = ExportSpec {
            name: rec.volume_id.clone(),
            path: rec.image.clone(),
            read_only: rec.read_only,
            direct_io: false,
            max_connections: 0,
            description: format!("volume {}", rec.volume_id),
        };
        self.server.add_export(&spec)?;
        Ok(())
    }

    /// [`Inner::export`], its failure as the driver reports it.
    pub(super) fn serve(&self, rec: &StagedVolume) -> Result<()> {
        self.export(rec).map_err(|e| Error::Internal(format!("serve {}: {e}", rec.image.display())))
    }

    /// One try at every device owed fresh sockets. Local ones here (no
    /// network); each remote one on a thread of its own, with no lock held
    /// (a peer that does not answer holds up nothing else, and one whose
    /// try is still running is not tried again meanwhile; at most
    /// `MAX_REMOTE_HEALS` at once, the rest in a later round). A device no
    /// longer carrying its volume id (torn down, or given to someone else)
    /// is forgotten, not touched.
    pub(super) fn reconnect_stale(self: &Arc<Self>) {
        let owed: Vec<Live> = self.live.lock().unwrap_or_else(|e| e.into_inner()).values().filter(|d| d.stale).cloned().collect();
        for d in owed {
            let index = d.served.index();
            if attach::nbd_existing(index, d.served.backend_id()).is_none() {
                tracing::warn!(index, backend = %d.served.backend_id(), "nbd device gone while its reconnect was owed; forgotten");
                self.live.lock().unwrap_or_else(|e| e.into_inner()).remove(&index);
                continue;
            }
            match d.served {
                Served::Local(mut a) => {
                    let mut control = self.control.lock().unwrap_or_else(|e| e.into_inner());
                    let result = a.refresh(&mut control, &self.server);
                    drop(control);
                    self.refreshed(index, result.map(|()| Served::Local(a)));
                }
                Served::Remote(a) => {
                    // Bounded like the walk: the rest wait for a later round.
                    {
                        let mut connecting = self.connecting.lock().unwrap_or_else(|e| e.into_inner());
                        if connecting.len() >= walk::MAX_REMOTE_HEALS || !connecting.insert(index) {
                            continue;
                        }
                    }
                    let me = self.clone();
                    let spawned = std::thread::Builder::new().name("nbd-reconnect".into()).spawn(move || {
                        me.refresh_remote(a);
                        me.connecting.lock().unwrap_or_else(|e| e.into_inner()).remove(&index);
                    });
                    if let Err(e) = spawned {
                        tracing::warn!(index, error = %e, "cannot spawn the nbd reconnect; retrying");
                        self.connecting.lock().unwrap_or_else(|e| e.into_inner()).remove(&index);
                    }
                }
            }
        }
    }

    pub(super) fn refresh_remote(&self, mut a: RemoteAttachment) {
        let index = a.index;
        let result = nbdattach::remote_sockets(&a.source, a.connections).and_then(|(sockets, details)| {
            let fresh = alive::inodes(&sockets);
            let mut control = self.control.lock().unwrap_or_else(|e| e.into_inner());
            a.refresh_with(&mut control, sockets, details)?;
            drop(control);
            self.record_sockets(&a, &fresh);
            Ok(Served::Remote(a))
        });
        self.refreshed(index, result);
    }

    pub(super) fn refreshed(&self, index: u32, result: std::result::Result<Served, nbdattach::Error>) {
        match result {
            Ok(served) => {
                tracing::info!(index, backend = %served.backend_id(), "nbd device reconnected");
                let mut live = self.live.lock().unwrap_or_else(|e| e.into_inner());
                if live.contains_key(&index) {
                    live.insert(index, Live { served, stale: false });
                }
            }
            Err(e) => tracing::debug!(index, error = %e, "nbd reconnect failed; retrying"),
        }
    }
}

impl Served {
    pub(super) fn index(&self) -> u32 {
        match self {
            Served::Local(a) => a.index,
            Served::Remote(a) => a.index,
        }
    }

    pub(super) fn backend_id(&self) -> &str {
        match self {
            Served::Local(a) => &a.backend_id,
            Served::Remote(a) => &a.backend_id,
        }
    }
}

/// Gives devices of ours whose connections died fresh sockets, retrying
/// the ones whose server is away; ends when the side is dropped.
pub(super) fn watch_link_dead(mut l: LinkDeadListener, inner: Weak<Inner>) {
    loop {
        let got = l.recv_timeout(RETRY_EVERY);
        let Some(inner) = inner.upgrade() else { return };
        match got {
            Ok(Some(index)) => {
                let mut live = inner.live.lock().unwrap_or_else(|e| e.into_inner());
                if let Some(d) = live.get_mut(&index) {
                    tracing::warn!(index, backend = %d.served.backend_id(), "nbd connection died; reconnecting");
                    d.stale = true;
                }
            }
            Ok(None) => {}
            Err(e) => {
                tracing::error!(error = %e, "LINK_DEAD listener failed");
                drop(inner);
                std::thread::sleep(RETRY_EVERY);
                continue;
            }
        }
        inner.reconnect_stale();
    }
}

/// The device's size as the kernel has it (what a device configured by
/// an earlier process was given).
pub(super) fn device_size(index: u32) -> u64 {
    std::fs::read_to_string(format!("/sys/block/nbd{index}/size")).ok().and_then(|s| s.trim().parse::<u64>().ok()).map_or(0, |s| s * 512)
}

/// A record's remote export as a connectable source.
pub(super) fn remote_source(r: &RemoteExport, client: Option<&str>) -> Result<RemoteSource> {
    let uri = r.uri.parse::<ExportUri>().map_err(|e| Error::Internal(format!("recorded export: {e}")))?;
    let secret = r.secret.parse::<Secret>().map_err(|e| Error::Internal(format!("recorded export {}: {e}", r.uri)))?;
    Ok(RemoteSource { uri, secret, client: client.map(str::to_string) })
}

/// A remote export that cannot be reached is Unavailable (the CO retries);
/// one that refuses us (unknown export or wrong secret, told apart by
/// nobody) is NotFound: no such volume is served to this secret. One that
/// knows the secret but will not hand the volume out (the owning node has
/// it staged, `fence`) is FailedPrecondition, the spec's code for a volume
/// in use at another node: it is let go there first.
pub(super) fn remote_error(source: &RemoteSource, e: nbdattach::Error) -> Error {
    match e {
        nbdattach::Error::Negotiation(volring_nbd::Error::Refused { reply: NBD_REP_ERR_POLICY, .. }) => {
            Error::FailedPrecondition(format!("{} will not hand the volume out now: the owning node has it staged", source.uri))
        }
        nbdattach::Error::Negotiation(volring_nbd::Error::Refused { .. }) => {
            Error::NotFound(format!("{} refused the export (no such volume, or the volume context's secret is not its own)", source.uri))
        }
        nbdattach::Error::Io { .. } | nbdattach::Error::Negotiation(_) => Error::Unavailable(format!("{}: {e}", source.uri)),
        e => attach_error(e),
    }
}

/// No nbd module (or no netlink family) is the node's condition, not the
/// request's fault.
pub(super) fn unavailable(e: nbdattach::Error) -> Error {
    match e {
        nbdattach::Error::FamilyNotFound => {
            Error::FailedPrecondition("attach: nbd needs the kernel's nbd driver, and this node has none (modprobe nbd)".into())
        }
        e => Error::Internal(format!("nbd netlink: {e}")),
    }
}

pub(super) fn attach_error(e: nbdattach::Error) -> Error {
    match e {
        nbdattach::Error::BackendMismatch { .. } => Error::FailedPrecondition(e.to_string()),
        e => unavailable(e),
    }
}
