//! Volumes attached through the kernel's nbd driver (`attach: nbd`): the
//! image is served by an NBD server inside the agent, over socketpairs, to
//! a `/dev/nbdN` configured over netlink with the volume id as its backend
//! identifier, a dead-connection timeout long enough for an agent restart
//! and a short request timeout.
//!
//! Why: a loop device dies with nothing, but an nbd device dies with the
//! process serving it — unless that process comes back in time and gives
//! the device fresh sockets (NBD_CMD_RECONFIGURE). The healer here does
//! that at start, before Probe answers ready: for each staged nbd record
//! whose device still carries the volume id it reconnects; a device that
//! carries another id is reported and left alone; a device the kernel tore
//! down is left to the reconciler, which re-stages the record. While the
//! agent lives, a LINK_DEAD notice for one of its devices is answered the
//! same way.
//!
//! A volume another node holds (`remote` in its record, from the volume
//! context's export URI and secret) is attached the same way to TCP
//! sockets negotiated with that node's export (`nbd::attach::remote`). Its
//! server can go away while this agent lives (the owning node's agent
//! restarts): LINK_DEAD marks the device, and the reconnect is retried
//! every half second until the export answers again or the device is gone,
//! so the kernel's queued I/O completes as soon as the export is back.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::time::Duration;

#[path = "nbd_expand.rs"]
mod expand;
pub use expand::GrowError;

use super::{Driver, Error, Result};
use volring_nbd::attach::{self as nbdattach, LinkDeadListener, LocalAttachment, NbdControl, RemoteAttachment, RemoteSource};
use volring_nbd::client::ExportDetails;
use volring_nbd::remote::{ExportUri, Secret};
use volring_nbd::{ExportSpec, Exports, NbdServer, ServerConfig};
use volring_volumes::attach::{self, Attachment};
use volring_volumes::{AttachKind, RemoteExport, StagedVolume};

/// How often a device whose reconnect failed (its remote export is away)
/// is tried again.
const RETRY_EVERY: Duration = Duration::from_millis(500);

/// How nbd volumes are attached; set from the node's flags.
#[derive(Debug, Clone)]
pub struct NbdAttachConfig {
    /// NBD_ATTR_DEAD_CONN_TIMEOUT: how long the kernel queues I/O while the
    /// agent is away (an agent restart must fit in it).
    pub dead_conn_timeout: Duration,
    /// NBD_ATTR_TIMEOUT: a request unanswered this long after it was sent
    /// is resent. After a crash it is what brings back the requests the
    /// dead agent held: the kernel requeues nothing when fresh sockets
    /// arrive (RECONFIGURE), only when this timer expires.
    pub request_timeout: Duration,
    /// Sockets per device. One by default (a device's connections share
    /// the server's rings; two connections on one ring stalled on 6.1 until
    /// the ring stopped dropping completions reaped with a multishot's
    /// last one — tests/vm/nbd.rs keeps that setup running).
    pub connections: usize,
    /// Reconnect recorded devices at start and on LINK_DEAD. Off only to
    /// show what an agent restart does without it.
    pub heal: bool,
    /// The name this node gives another node's export (its node id, when
    /// that is a valid client name): the owning node hands a volume to one
    /// named node at a time.
    pub client: Option<String>,
}

impl Default for NbdAttachConfig {
    fn default() -> Self {
        Self {
            dead_conn_timeout: nbdattach::control::DEFAULT_DEAD_CONN_TIMEOUT,
            request_timeout: nbdattach::control::DEFAULT_TIMEOUT,
            connections: 1,
            heal: true,
            client: None,
        }
    }
}

/// The agent's nbd side: started on first use (a node with no nbd volume
/// needs neither the module nor the server).
#[derive(Default)]
pub struct NbdSide {
    config: NbdAttachConfig,
    inner: OnceLock<Arc<Inner>>,
    /// Serialises the start (so two stages do not start two servers).
    starting: Mutex<()>,
    /// The start walk ran (it runs once per process).
    walked: std::sync::atomic::AtomicBool,
}

struct Inner {
    server: NbdServer,
    control: Mutex<NbdControl>,
    /// The devices this process serves, by index (what LINK_DEAD refreshes).
    live: Mutex<HashMap<u32, Live>>,
}

/// Who serves a device this process keeps connected.
#[derive(Debug, Clone)]
enum Served {
    /// This agent's own server, over socketpairs.
    Local(LocalAttachment),
    /// Another node's export, over TCP.
    Remote(RemoteAttachment),
}

#[derive(Debug, Clone)]
struct Live {
    served: Served,
    /// Its connections died and fresh ones are still owed (retried).
    stale: bool,
}

/// What the start walk found for one record.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Healed {
    /// The device carries the volume id and has fresh sockets.
    Reconnected(u32),
    /// The device carries another identifier (or none while still
    /// configured): not touched.
    Drift { index: u32, found: Option<String> },
    /// No configured device carries the volume id: the reconciler re-stages.
    Gone,
    /// The device carries the volume id but the volume's image is gone
    /// (deleted under it): nothing could serve it, so the device is left
    /// as it is (the kernel keeps queueing its I/O until its dead-connection
    /// timeout) and reported.
    ImageGone(u32),
    /// The remote export did not answer: the device stays as it is (the
    /// kernel queues its I/O) and the reconnect is retried until it does.
    Retrying { index: u32, why: String },
    /// Reconnecting failed.
    Failed(String),
}

impl NbdSide {
    pub fn new(config: NbdAttachConfig) -> Self {
        Self { config, inner: OnceLock::new(), starting: Mutex::new(()), walked: Default::default() }
    }

    pub fn config(&self) -> &NbdAttachConfig {
        &self.config
    }

    /// The server, control socket and LINK_DEAD listener, started once.
    fn inner(&self) -> Result<Arc<Inner>> {
        if let Some(i) = self.inner.get() {
            return Ok(i.clone());
        }
        let _g = self.starting.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(i) = self.inner.get() {
            return Ok(i.clone());
        }
        let control = NbdControl::open().map_err(unavailable)?;
        // Joined before any device is attached, so no notice is missed.
        let listener = if self.config.heal { Some(LinkDeadListener::open().map_err(unavailable)?) } else { None };
        // One server for every nbd volume of the node, so its rings serve
        // all their connections: as many rings as the server's default
        // (one per core, at most 4), and never fewer than one device's
        // connections.
        let threads = self.config.connections.max(1).max(volring_nbd::server::default_rings());
        let server = NbdServer::start_unlistened(ServerConfig { threads, ..ServerConfig::default() }, Arc::new(Exports::new()))
            .map_err(|e| Error::Internal(format!("start the nbd server: {e}")))?;
        let inner = Arc::new(Inner { server, control: Mutex::new(control), live: Mutex::new(HashMap::new()) });
        if let Some(l) = listener {
            let weak = Arc::downgrade(&inner);
            std::thread::Builder::new()
                .name("nbd-link-dead".into())
                .spawn(move || watch_link_dead(l, weak))
                .map_err(|e| Error::Internal(format!("spawn the LINK_DEAD listener: {e}")))?;
        }
        let _ = self.inner.set(inner.clone());
        Ok(inner)
    }

    /// Attaches `rec`'s image (or its remote export) to a new `/dev/nbdN`
    /// carrying the volume id.
    pub fn attach(&self, rec: &StagedVolume) -> Result<Attachment> {
        let cfg = &self.config;
        // A remote export is reached first: an unreachable or refusing one
        // is the answer whether or not this node has the nbd driver.
        let remote = match &rec.remote {
            Some(r) => {
                let source = remote_source(r, cfg.client.as_deref())?;
                let (sockets, details) =
                    nbdattach::remote::connected_sockets(&source, cfg.connections).map_err(|e| remote_error(&source, e))?;
                Some((source, sockets, details))
            }
            None => None,
        };
        let inner = match self.inner() {
            Ok(i) => i,
            Err(e) => {
                // No device was made: the owning node hears that this
                // node does not hold the volume.
                if let Some((_, sockets, _)) = remote {
                    nbdattach::remote::let_go(sockets);
                }
                return Err(e);
            }
        };
        let tune = |s: &mut nbdattach::ConnectSpec| {
            s.timeout = cfg.request_timeout;
            s.dead_conn_timeout = cfg.dead_conn_timeout;
        };
        let served = match remote {
            // Connected before the control lock: a slow peer does not hold
            // up other volumes' attaches.
            Some((source, sockets, details)) => {
                let mut control = inner.control.lock().unwrap_or_else(|e| e.into_inner());
                let kept: Vec<std::os::fd::OwnedFd> = sockets.iter().filter_map(|s| s.try_clone().ok()).collect();
                match RemoteAttachment::connect(&mut control, &source, &rec.volume_id, sockets, details, tune) {
                    Ok(att) => Served::Remote(att),
                    Err(e) => {
                        drop(control);
                        nbdattach::remote::let_go(kept);
                        return Err(attach_error(e));
                    }
                }
            }
            None => {
                inner.export(rec)?;
                let mut control = inner.control.lock().unwrap_or_else(|e| e.into_inner());
                let att = LocalAttachment::attach(&mut control, &inner.server, &rec.volume_id, &rec.volume_id, cfg.connections, tune)
                    .map_err(attach_error)?;
                Served::Local(att)
            }
        };
        let index = served.index();
        inner.live.lock().unwrap_or_else(|e| e.into_inner()).insert(index, Live { served, stale: false });
        attach::nbd_existing(index, &rec.volume_id)
            .ok_or_else(|| Error::Internal(format!("/dev/nbd{index} connected but does not carry backend {}", rec.volume_id)))
    }

    /// Disconnects `/dev/nbd<index>` if it still carries `volume_id`; a
    /// device that no longer does is not ours and is left alone.
    pub fn detach(&self, index: u32, volume_id: &str) -> Result<()> {
        if attach::nbd_existing(index, volume_id).is_none() {
            self.forget(index, volume_id);
            return Ok(());
        }
        let inner = self.inner()?;
        {
            let mut control = inner.control.lock().unwrap_or_else(|e| e.into_inner());
            nbdattach::control::check_backend(index, volume_id, control.backend(index)).map_err(attach_error)?;
            control.disconnect(index).map_err(attach_error)?;
        }
        self.forget(index, volume_id);
        Ok(())
    }

    fn forget(&self, index: u32, volume_id: &str) {
        if let Some(inner) = self.inner.get() {
            inner.live.lock().unwrap_or_else(|e| e.into_inner()).remove(&index);
            let _ = inner.server.remove_export(volume_id);
        }
    }

    /// The start walk's step for one record (see the module comment).
    pub fn heal(&self, rec: &StagedVolume) -> Healed {
        let Some(index) = rec.nbd_index else { return Healed::Gone };
        if attach::nbd_existing(index, &rec.volume_id).is_none() {
            let found = nbdattach::control::read_backend(std::path::Path::new("/sys/block"), index);
            return match found {
                Some(other) => Healed::Drift { index, found: Some(other) },
                None => Healed::Gone,
            };
        }
        if rec.remote.is_none() && std::fs::symlink_metadata(&rec.image).is_err_and(|e| e.kind() == std::io::ErrorKind::NotFound) {
            return Healed::ImageGone(index);
        }
        let result = self.inner().and_then(|inner| {
            let served = match &rec.remote {
                Some(r) => {
                    let source = remote_source(r, self.config.client.as_deref())?;
                    match nbdattach::remote::connected_sockets(&source, self.config.connections) {
                        Ok((sockets, details)) => {
                            let mut control = inner.control.lock().unwrap_or_else(|e| e.into_inner());
                            let att = RemoteAttachment::reconnect(&mut control, index, &source, &rec.volume_id, sockets, details)
                                .map_err(attach_error)?;
                            Served::Remote(att)
                        }
                        Err(e) => {
                            // The export is away: the device keeps queueing
                            // I/O, and the retry loop reconnects it once the
                            // export answers.
                            let att = RemoteAttachment {
                                index,
                                source: source.clone(),
                                backend_id: rec.volume_id.clone(),
                                connections: self.config.connections,
                                details: ExportDetails { size: device_size(index), tx_flags: 0, block_sizes: None },
                            };
                            inner
                                .live
                                .lock()
                                .unwrap_or_else(|e| e.into_inner())
                                .insert(index, Live { served: Served::Remote(att), stale: true });
                            return Ok(Some(remote_error(&source, e).to_string()));
                        }
                    }
                }
                None => {
                    inner.export(rec)?;
                    let mut control = inner.control.lock().unwrap_or_else(|e| e.into_inner());
                    Served::Local(
                        LocalAttachment::reattach(
                            &mut control,
                            &inner.server,
                            index,
                            &rec.volume_id,
                            &rec.volume_id,
                            self.config.connections,
                        )
                        .map_err(attach_error)?,
                    )
                }
            };
            inner.live.lock().unwrap_or_else(|e| e.into_inner()).insert(index, Live { served, stale: false });
            Ok(None)
        });
        match result {
            Ok(None) => Healed::Reconnected(index),
            Ok(Some(why)) => Healed::Retrying { index, why },
            Err(e) => Healed::Failed(e.to_string()),
        }
    }

    /// Whether the kernel says `/dev/nbd<index>` has a live connection.
    /// `None` when it cannot be asked (no module, no server yet).
    pub fn connected(&self, index: u32) -> Option<bool> {
        let inner = self.inner.get()?;
        let mut control = inner.control.lock().unwrap_or_else(|e| e.into_inner());
        let s = control.status(Some(index)).ok()?;
        s.iter().find(|d| d.index == index).map(|d| d.connected)
    }

    /// Whether this process keeps `/dev/nbd<index>` connected (or is
    /// retrying its reconnect).
    pub fn serving(&self, index: u32) -> bool {
        self.inner.get().is_some_and(|i| i.live.lock().unwrap_or_else(|e| e.into_inner()).contains_key(&index))
    }
}

impl Inner {
    /// Serves the volume's image as export `<volume id>` (once).
    fn export(&self, rec: &StagedVolume) -> Result<()> {
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
        self.server.add_export(&spec).map_err(|e| Error::Internal(format!("serve {}: {e}", rec.image.display())))?;
        Ok(())
    }
}

impl Served {
    fn index(&self) -> u32 {
        match self {
            Served::Local(a) => a.index,
            Served::Remote(a) => a.index,
        }
    }

    fn backend_id(&self) -> &str {
        match self {
            Served::Local(a) => &a.backend_id,
            Served::Remote(a) => &a.backend_id,
        }
    }
}

/// Gives devices of ours whose connections died fresh sockets, retrying
/// the ones whose server is away; ends when the side is dropped.
fn watch_link_dead(mut l: LinkDeadListener, inner: Weak<Inner>) {
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

impl Inner {
    /// One try at every device owed fresh sockets. Remote sockets are
    /// connected with no lock held (a peer that does not answer holds up
    /// nothing else); a device no longer carrying its volume id (torn down,
    /// or given to someone else) is forgotten, not touched.
    fn reconnect_stale(&self) {
        let owed: Vec<Live> = self.live.lock().unwrap_or_else(|e| e.into_inner()).values().filter(|d| d.stale).cloned().collect();
        for d in owed {
            let index = d.served.index();
            if attach::nbd_existing(index, d.served.backend_id()).is_none() {
                tracing::warn!(index, backend = %d.served.backend_id(), "nbd device gone while its reconnect was owed; forgotten");
                self.live.lock().unwrap_or_else(|e| e.into_inner()).remove(&index);
                continue;
            }
            let result = match d.served.clone() {
                Served::Local(mut a) => {
                    let mut control = self.control.lock().unwrap_or_else(|e| e.into_inner());
                    a.refresh(&mut control, &self.server).map(|()| Served::Local(a))
                }
                Served::Remote(mut a) => nbdattach::remote::connected_sockets(&a.source, a.connections).and_then(|(sockets, details)| {
                    let mut control = self.control.lock().unwrap_or_else(|e| e.into_inner());
                    a.refresh_with(&mut control, sockets, details).map(|()| Served::Remote(a))
                }),
            };
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
}

/// The device's size as the kernel has it (what a device configured by
/// an earlier process was given).
fn device_size(index: u32) -> u64 {
    std::fs::read_to_string(format!("/sys/block/nbd{index}/size")).ok().and_then(|s| s.trim().parse::<u64>().ok()).map_or(0, |s| s * 512)
}

/// A record's remote export as a connectable source.
fn remote_source(r: &RemoteExport, client: Option<&str>) -> Result<RemoteSource> {
    let uri = ExportUri::parse(&r.uri).map_err(|e| Error::Internal(format!("recorded export: {e}")))?;
    let secret = Secret::from_hex(&r.secret).map_err(|e| Error::Internal(format!("recorded export {}: {e}", r.uri)))?;
    Ok(RemoteSource { uri, secret, client: client.map(str::to_string) })
}

/// A remote export that cannot be reached is Unavailable (the CO retries);
/// one that refuses us (unknown export or wrong secret, told apart by
/// nobody) is NotFound: no such volume is served to this secret. One that
/// knows the secret but will not hand the volume out (the owning node has
/// it staged, `fence`) is FailedPrecondition, the spec's code for a volume
/// in use at another node: it is let go there first.
fn remote_error(source: &RemoteSource, e: nbdattach::Error) -> Error {
    match e {
        nbdattach::Error::Negotiation(volring_nbd::Error::Refused { reply: volring_nbd::wire::rep::ERR_POLICY, .. }) => {
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
fn unavailable(e: nbdattach::Error) -> Error {
    match e {
        nbdattach::Error::FamilyNotFound => {
            Error::FailedPrecondition("attach: nbd needs the kernel's nbd driver, and this node has none (modprobe nbd)".into())
        }
        e => Error::Internal(format!("nbd netlink: {e}")),
    }
}

fn attach_error(e: nbdattach::Error) -> Error {
    match e {
        nbdattach::Error::BackendMismatch { .. } => Error::FailedPrecondition(e.to_string()),
        e => unavailable(e),
    }
}

impl Driver {
    /// The start walk over every staged nbd record, once per process: the
    /// agent runs it as soon as the store is open, and the reconciler's
    /// start runs it if nobody did, so it always precedes the first pass
    /// (and Probe's ready). Later calls return nothing.
    pub fn heal_nbd(&self) -> Vec<(String, Healed)> {
        let mut out = Vec::new();
        if !self.nbd.config().heal || self.nbd.walked.swap(true, std::sync::atomic::Ordering::AcqRel) {
            return out;
        }
        for rec in self.records.all().into_iter().filter(|r| r.attach == AttachKind::Nbd && r.nbd_index.is_some()) {
            let Some(_g) = self.locks.try_lock_for_repair(&rec.volume_id) else { continue };
            let h = self.nbd.heal(&rec);
            match &h {
                Healed::Reconnected(i) => tracing::info!(volume = %rec.volume_id, index = i, "nbd device reconnected"),
                Healed::Drift { index, found } => tracing::error!(volume = %rec.volume_id, index, ?found,
                    "the recorded nbd device carries another backend identifier; not touched"),
                Healed::Gone => tracing::warn!(volume = %rec.volume_id, "the recorded nbd device is gone; re-staging"),
                Healed::ImageGone(index) => tracing::error!(volume = %rec.volume_id, index, image = %rec.image.display(),
                    "the recorded volume's image is gone; its nbd device is left as it is"),
                Healed::Retrying { index, why } => {
                    tracing::warn!(volume = %rec.volume_id, index, why = %why, "the remote export does not answer yet; retrying")
                }
                Healed::Failed(e) => tracing::error!(volume = %rec.volume_id, error = %e, "nbd reconnect failed"),
            }
            out.push((rec.volume_id.clone(), h));
        }
        out
    }

    /// Why a staged nbd volume cannot serve I/O, if it cannot: its
    /// connection is dead (and nobody here will revive it).
    pub(super) fn nbd_problem(&self, a: &Attachment) -> Option<String> {
        if a.kind != AttachKind::Nbd {
            return None;
        }
        match self.nbd.connected(a.number) {
            Some(false) => Some(format!("{}: the nbd connection is dead", a.path().display())),
            _ if !self.nbd.serving(a.number) => Some(format!("{}: no server in this agent serves it", a.path().display())),
            _ => None,
        }
    }
}
