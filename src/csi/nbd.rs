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

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::time::Duration;

#[path = "nbd_expand.rs"]
mod expand;
pub use expand::GrowError;

use super::{Driver, Error, Result};
use crate::nbd::attach::{self as nbdattach, LinkDeadListener, LocalAttachment, NbdControl};
use crate::nbd::{ExportSpec, Exports, NbdServer, ServerConfig};
use crate::volumes::attach::{self, Attachment};
use crate::volumes::{AttachKind, StagedVolume};

/// How nbd volumes are attached; set from the node's flags.
#[derive(Debug, Clone)]
pub struct NbdAttachConfig {
    /// NBD_ATTR_DEAD_CONN_TIMEOUT: how long the kernel queues I/O while the
    /// agent is away (an agent restart must fit in it).
    pub dead_conn_timeout: Duration,
    /// NBD_ATTR_TIMEOUT: a request unanswered this long is resent (after a
    /// crash, the requests the dead agent held are resent this soon after
    /// the reconnect).
    pub request_timeout: Duration,
    /// Sockets per device. One by default: the server gives each of its
    /// rings connections, and one ring serving two connections is a known
    /// stall on 6.1 (tests/vm_nbd.rs).
    pub connections: usize,
    /// Reconnect recorded devices at start and on LINK_DEAD. Off only to
    /// show what an agent restart does without it.
    pub heal: bool,
}

impl Default for NbdAttachConfig {
    fn default() -> Self {
        Self {
            dead_conn_timeout: nbdattach::control::DEFAULT_DEAD_CONN_TIMEOUT,
            request_timeout: nbdattach::control::DEFAULT_TIMEOUT,
            connections: 1,
            heal: true,
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
}

struct Inner {
    server: NbdServer,
    control: Mutex<NbdControl>,
    /// The devices this process serves, by index (what LINK_DEAD refreshes).
    live: Mutex<HashMap<u32, LocalAttachment>>,
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
    /// Reconnecting failed.
    Failed(String),
}

impl NbdSide {
    pub fn new(config: NbdAttachConfig) -> Self {
        Self { config, inner: OnceLock::new(), starting: Mutex::new(()) }
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
        // connections. (A ring serving two connections stalls on 6.1, the
        // known bug in tests/vm_nbd.rs, so more volumes than rings can hit
        // it there until the server is fixed.)
        let threads = self.config.connections.max(1).max(crate::nbd::server::default_rings());
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

    /// Attaches `rec`'s image to a new `/dev/nbdN` carrying the volume id.
    pub fn attach(&self, rec: &StagedVolume) -> Result<Attachment> {
        let inner = self.inner()?;
        inner.export(rec)?;
        let cfg = &self.config;
        let att = {
            let mut control = inner.control.lock().unwrap_or_else(|e| e.into_inner());
            LocalAttachment::attach(&mut control, &inner.server, &rec.volume_id, &rec.volume_id, cfg.connections, |s| {
                s.timeout = cfg.request_timeout;
                s.dead_conn_timeout = cfg.dead_conn_timeout;
            })
            .map_err(attach_error)?
        };
        let index = att.index;
        inner.live.lock().unwrap_or_else(|e| e.into_inner()).insert(index, att);
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
        let result = self.inner().and_then(|inner| {
            inner.export(rec)?;
            let att = {
                let mut control = inner.control.lock().unwrap_or_else(|e| e.into_inner());
                LocalAttachment::reattach(&mut control, &inner.server, index, &rec.volume_id, &rec.volume_id, self.config.connections)
                    .map_err(attach_error)?
            };
            inner.live.lock().unwrap_or_else(|e| e.into_inner()).insert(index, att);
            Ok(())
        });
        match result {
            Ok(()) => Healed::Reconnected(index),
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

    /// Whether this process serves `/dev/nbd<index>` now.
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

/// Gives a device of ours whose connections died fresh sockets; ends when
/// the side is dropped.
fn watch_link_dead(mut l: LinkDeadListener, inner: Weak<Inner>) {
    loop {
        let got = l.recv_timeout(Duration::from_millis(500));
        let Some(inner) = inner.upgrade() else { return };
        match got {
            Ok(Some(index)) => {
                let mut live = inner.live.lock().unwrap_or_else(|e| e.into_inner());
                let Some(att) = live.get_mut(&index) else { continue };
                tracing::warn!(index, backend = %att.backend_id, "nbd connection died; reconnecting");
                let mut control = inner.control.lock().unwrap_or_else(|e| e.into_inner());
                if let Err(e) = att.refresh(&mut control, &inner.server) {
                    tracing::error!(index, error = %e, "nbd reconnect failed");
                }
            }
            Ok(None) => {}
            Err(e) => {
                tracing::error!(error = %e, "LINK_DEAD listener failed");
                drop(inner);
                std::thread::sleep(Duration::from_millis(500));
            }
        }
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
    /// The start walk over every staged nbd record: runs before the
    /// reconciler's first pass (and so before Probe answers ready).
    pub fn heal_nbd(&self) -> Vec<(String, Healed)> {
        let mut out = Vec::new();
        if !self.nbd.config().heal {
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
