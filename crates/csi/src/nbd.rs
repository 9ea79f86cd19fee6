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
//! whose device still carries the volume id and whose connections are
//! dead it reconnects (`nbd_alive.rs`: a local device's always are after a
//! restart, a remote device's TCP connections usually outlive the agent
//! and are then left alone); a device that carries another id is reported
//! and left alone; a device the kernel tore down is left to the
//! reconciler, which re-stages the record. Local volumes go first, remote
//! ones concurrently and in the background past a short bound
//! (`nbd_walk.rs`). While the agent lives, a LINK_DEAD notice for one of
//! its devices is answered the same way.
//!
//! A volume another node holds (`remote` in its record, from the volume
//! context's export URI and secret) is attached the same way to TCP
//! sockets negotiated with that node's export (`nbd::attach::remote_sockets`). Its
//! server can go away while this agent lives (the owning node's agent
//! restarts): LINK_DEAD marks the device, and the reconnect is retried
//! every half second until the export answers again or the device is gone,
//! so the kernel's queued I/O completes as soon as the export is back.

use std::path::PathBuf;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

#[path = "nbd_alive.rs"]
mod alive;
#[path = "nbd_expand.rs"]
mod expand;
#[path = "nbd_served.rs"]
mod served;
#[path = "nbd_walk.rs"]
mod walk;
use served::{attach_error, device_size, remote_error, remote_source, unavailable, Inner, Live, NoSteps, RealSteps, Served};
use walk::Plan;
pub(crate) use walk::REMOTE_WAIT;

use super::{Error, Result};
use volring_nbd::attach::{self as nbdattach, LinkDeadListener, LocalAttachment, NbdControl, RemoteAttachment};
use volring_nbd::client::ExportDetails;
use volring_nbd::remote::ExportUri;
use volring_nbd::{Exports, NbdServer, ServerConfig};
use volring_volumes::attach::{self, Attachment};
use volring_volumes::{AttachKind, StagedVolume};

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
    /// The node's NBD server's settings (the node's `--nbd-*` flags: ring
    /// count, idle poll, ring weight, limits); its listeners are ignored and
    /// its ring count is raised to `connections`.
    pub server: ServerConfig,
}

impl Default for NbdAttachConfig {
    fn default() -> Self {
        Self {
            dead_conn_timeout: nbdattach::DEFAULT_DEAD_CONN_TIMEOUT,
            request_timeout: nbdattach::DEFAULT_TIMEOUT,
            connections: 1,
            heal: true,
            client: None,
            server: ServerConfig::default(),
        }
    }
}

/// The node's one NBD server for every nbd volume, so its rings serve all
/// their connections: the node's `--nbd-*` tuning (rings, idle poll, ring
/// weight, inline writes, read offload, memory limits), as many rings as
/// `--nbd-threads` says (0: one per core, at most 4) and never fewer than
/// one device's connections, no listener of its own, and the timeouts of
/// a server whose clients are the kernel's: an idle mounted volume's
/// connection is never closed for idling (`--idle-timeout` is for
/// `--nbd-listen`'s clients), and the handshake and stall limits stay the
/// server's defaults.
pub(crate) fn attach_server_config(config: &NbdAttachConfig) -> ServerConfig {
    let (tuned, defaults) = (&config.server, ServerConfig::default());
    let rings = if tuned.threads == 0 { defaults.threads } else { tuned.threads };
    ServerConfig {
        threads: config.connections.max(1).max(rings),
        listen: Vec::new(),
        idle_timeout: None,
        handshake_timeout: defaults.handshake_timeout,
        stall_timeout: defaults.stall_timeout,
        ..tuned.clone()
    }
}

/// The agent's nbd side: started on first use (a node with no nbd volume
/// needs neither the module nor the server).
#[derive(Default)]
pub(crate) struct NbdSide {
    config: NbdAttachConfig,
    inner: OnceLock<Arc<Inner>>,
    /// Serialises the start (so two stages do not start two servers).
    starting: Mutex<()>,
    /// The start walk ran (it runs once per process).
    walked: std::sync::atomic::AtomicBool,
    /// Where the sockets handed to the kernel for remote devices are
    /// recorded (`alive`), when the driver has a state directory.
    records: Option<PathBuf>,
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
    /// The kernel's own connection to the remote export outlived the agent
    /// that made it and is still established: nothing to reconnect, so the
    /// device is left as it is (and kept, as if reconnected here).
    LeftConnected { index: u32, why: String },
    /// The remote export's reconnect was still running when the start pass
    /// stopped waiting: it goes on in the background (and, if the export
    /// does not answer, is retried like a LINK_DEAD one).
    Pending(u32),
    /// Reconnecting failed.
    Failed(String),
}

impl NbdSide {
    pub(crate) fn new(config: NbdAttachConfig) -> Self {
        Self { config, inner: OnceLock::new(), starting: Mutex::new(()), walked: Default::default(), records: None }
    }

    /// Records remote devices' sockets under `state_dir` (so the next
    /// start can tell a live connection from a dead one).
    pub(crate) fn with_state_dir(mut self, state_dir: &std::path::Path) -> Self {
        self.records = Some(state_dir.join("nbd-sockets"));
        self
    }

    pub(crate) fn config(&self) -> &NbdAttachConfig {
        &self.config
    }

    /// The attach server's catalog once it has started: an export per
    /// local volume it serves, named by the volume id, and its rings'
    /// counters. `None` before the first nbd volume started it (nothing
    /// is started to answer).
    pub(crate) fn exports(&self) -> Option<Arc<Exports>> {
        self.inner.get().map(|i| i.server.exports().clone())
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
        let server = NbdServer::start(attach_server_config(&self.config), Arc::new(Exports::default()))
            .map_err(|e| Error::Internal(format!("start the nbd server: {e}")))?;
        let inner = Arc::new(Inner {
            server,
            control: Mutex::new(control),
            live: Mutex::new(std::collections::HashMap::new()),
            connecting: Mutex::new(std::collections::HashSet::new()),
            records: self.records.clone(),
            config: self.config.clone(),
        });
        if let Some(l) = listener {
            let weak = Arc::downgrade(&inner);
            std::thread::Builder::new()
                .name("nbd-link-dead".into())
                .spawn(move || served::watch_link_dead(l, weak))
                .map_err(|e| Error::Internal(format!("spawn the LINK_DEAD listener: {e}")))?;
        }
        let _ = self.inner.set(inner.clone());
        Ok(inner)
    }

    /// Attaches `rec`'s image (or its remote export) to a new `/dev/nbdN`
    /// carrying the volume id.
    pub(crate) fn attach(&self, rec: &StagedVolume) -> Result<Attachment> {
        let cfg = &self.config;
        // A remote export is reached first: an unreachable or refusing one
        // is the answer whether or not this node has the nbd driver.
        let remote = match &rec.remote {
            Some(r) => {
                let source = remote_source(r, cfg.client.as_deref())?;
                let (sockets, details) = nbdattach::remote_sockets(&source, cfg.connections).map_err(|e| remote_error(&source, e))?;
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
                    nbdattach::let_go(sockets);
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
                let fresh = alive::inodes(&sockets);
                match RemoteAttachment::connect(&mut control, &source, &rec.volume_id, sockets, details, tune) {
                    Ok(att) => {
                        drop(control);
                        inner.record_sockets(&att, &fresh);
                        Served::Remote(att)
                    }
                    Err(e) => {
                        drop(control);
                        nbdattach::let_go(kept);
                        return Err(attach_error(e));
                    }
                }
            }
            None => {
                inner.serve(rec)?;
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
    pub(crate) fn detach(&self, index: u32, volume_id: &str) -> Result<()> {
        if attach::nbd_existing(index, volume_id).is_none() {
            self.forget(index, volume_id);
            return Ok(());
        }
        let inner = self.inner()?;
        {
            let mut control = inner.control.lock().unwrap_or_else(|e| e.into_inner());
            control.disconnect(index, Some(volume_id)).map_err(attach_error)?;
        }
        self.forget(index, volume_id);
        Ok(())
    }

    fn forget(&self, index: u32, volume_id: &str) {
        if let Some(dir) = &self.records {
            if alive::SocketRecord::read(dir, index).is_some_and(|r| r.backend_id == volume_id) {
                alive::SocketRecord::remove(dir, index);
            }
        }
        if let Some(inner) = self.inner.get() {
            inner.live.lock().unwrap_or_else(|e| e.into_inner()).remove(&index);
            let _ = inner.server.remove_export(volume_id);
        }
    }

    /// The walk's first look at one record: sysfs and the sockets' state
    /// only, nothing that waits. A healthy remote device is taken on here
    /// as it is (kept, retried on LINK_DEAD) and reported left connected.
    fn plan(&self, rec: &StagedVolume) -> Plan {
        let Some(index) = rec.nbd_index else { return Plan::Done(Healed::Gone) };
        if attach::nbd_existing(index, &rec.volume_id).is_none() {
            let found = nbdattach::read_backend(std::path::Path::new("/sys/block"), index);
            return Plan::Done(match found {
                Some(other) => Healed::Drift { index, found: Some(other) },
                None => Healed::Gone,
            });
        }
        if rec.remote.is_none() && std::fs::symlink_metadata(&rec.image).is_err_and(|e| e.kind() == std::io::ErrorKind::NotFound) {
            return Plan::Done(Healed::ImageGone(index));
        }
        let serving_here =
            self.inner.get().is_some_and(|i| i.live.lock().unwrap_or_else(|e| e.into_inner()).get(&index).is_some_and(|d| !d.stale));
        // The LINK_DEAD listener is joined (the side started) before the
        // sockets are looked at, so a connection dying after the look is
        // announced to it.
        if rec.remote.is_some() && !serving_here {
            if let Err(e) = self.inner() {
                return Plan::Done(Healed::Failed(e.to_string()));
            }
        }
        let seen = || match (&rec.remote, &self.records) {
            (Some(r), Some(dir)) => r
                .uri
                .parse::<ExportUri>()
                .ok()
                .and_then(|u| alive::authority_port(&u.authority()))
                .and_then(|port| alive::sockets_seen(dir, index, &rec.volume_id, port)),
            _ => None,
        };
        let sockets = seen();
        match alive::verdict(rec.remote.is_some(), &alive::Seen { serving_here, sockets }) {
            alive::Verdict::Leave(why) if serving_here => Plan::Done(Healed::LeftConnected { index, why }),
            alive::Verdict::Leave(why) => {
                let taken = self.inner().and_then(|inner| {
                    let r = rec.remote.as_ref().ok_or_else(|| Error::Internal("not a remote volume".into()))?;
                    let source = remote_source(r, self.config.client.as_deref())?;
                    let connections = sockets.map_or(self.config.connections, |s| s.connections);
                    let att = RemoteAttachment {
                        index,
                        source,
                        backend_id: rec.volume_id.clone(),
                        connections,
                        details: ExportDetails { size: device_size(index), tx_flags: 0, block_sizes: None },
                    };
                    inner.live.lock().unwrap_or_else(|e| e.into_inner()).insert(index, Live { served: Served::Remote(att), stale: false });
                    // A connection that died between the look and the
                    // entry above announced it to nobody: looked at again.
                    if seen().is_none_or(|s| s.established < s.connections) {
                        if let Some(d) = inner.live.lock().unwrap_or_else(|e| e.into_inner()).get_mut(&index) {
                            d.stale = true;
                        }
                        return Err(Error::Unavailable("its connection died while the walk looked at it; reconnecting".into()));
                    }
                    Ok(())
                });
                Plan::Done(match taken {
                    Ok(()) => Healed::LeftConnected { index, why },
                    Err(Error::Unavailable(why)) => Healed::Retrying { index, why },
                    Err(e) => Healed::Failed(e.to_string()),
                })
            }
            alive::Verdict::Reconnect(why) if rec.remote.is_some() => Plan::Remote(index, why),
            alive::Verdict::Reconnect(why) => Plan::Local(index, why),
        }
    }

    /// The start walk's step for one record (see the module comment), on
    /// the calling thread: a remote one waits on its export up to the
    /// connect timeout. The walks themselves use [`walk`].
    pub(crate) fn heal(&self, rec: &StagedVolume) -> Healed {
        match self.plan(rec) {
            Plan::Done(h) => h,
            Plan::Local(index, _) => match self.inner() {
                Ok(inner) => inner.heal_local(rec, index),
                Err(e) => Healed::Failed(e.to_string()),
            },
            Plan::Remote(index, _) => match self.inner() {
                Ok(inner) => inner.heal_remote(rec, index),
                Err(e) => Healed::Failed(e.to_string()),
            },
        }
    }

    /// Plans every record (each under its repair lock, held until its
    /// step ends) and walks them: locals first, remotes concurrently,
    /// waiting for those at most `wait` (see `nbd_walk.rs`).
    pub(crate) fn heal_all(&self, recs: Vec<(StagedVolume, super::VolumeGuard)>, wait: Duration) -> Vec<(String, Healed)> {
        let planned: Vec<_> = recs
            .into_iter()
            .map(|(rec, g)| {
                let plan = self.plan(&rec);
                (rec, g, plan)
            })
            .collect();
        if planned.iter().all(|(_, _, p)| matches!(p, Plan::Done(_))) {
            return walk::walk(Arc::new(NoSteps), planned, walk::Bounds::waiting(wait));
        }
        match self.inner() {
            Ok(inner) => walk::walk(Arc::new(RealSteps(inner)), planned, walk::Bounds::waiting(wait)),
            Err(e) => {
                let failed = planned
                    .into_iter()
                    .map(|(r, g, p)| match p {
                        Plan::Done(h) => (r, g, Plan::Done(h)),
                        _ => (r, g, Plan::Done(Healed::Failed(e.to_string()))),
                    })
                    .collect();
                walk::walk(Arc::new(NoSteps), failed, walk::Bounds::waiting(wait))
            }
        }
    }

    /// Whether the kernel says `/dev/nbd<index>` has a live connection.
    /// `None` when it cannot be asked (no module, no server yet).
    pub(crate) fn connected(&self, index: u32) -> Option<bool> {
        let inner = self.inner.get()?;
        let mut control = inner.control.lock().unwrap_or_else(|e| e.into_inner());
        let s = control.status(Some(index)).ok()?;
        s.iter().find(|d| d.index == index).map(|d| d.connected)
    }

    /// Whether `/dev/nbd<index>` is owed fresh sockets this process is
    /// still trying to give it (its export does not answer yet).
    pub(crate) fn owed(&self, index: u32) -> bool {
        self.inner.get().is_some_and(|i| i.live.lock().unwrap_or_else(|e| e.into_inner()).get(&index).is_some_and(|d| d.stale))
    }

    /// Whether this process keeps `/dev/nbd<index>` connected (or is
    /// retrying its reconnect).
    pub(crate) fn serving(&self, index: u32) -> bool {
        self.inner.get().is_some_and(|i| i.live.lock().unwrap_or_else(|e| e.into_inner()).contains_key(&index))
    }

    /// True the first time it is asked with healing on: the start walk
    /// runs once per process.
    pub(crate) fn first_walk(&self) -> bool {
        self.config.heal && !self.walked.swap(true, std::sync::atomic::Ordering::AcqRel)
    }

    /// Why a staged nbd volume cannot serve I/O, if it cannot: its
    /// connection is dead (and nobody here will revive it).
    pub(crate) fn problem(&self, a: &Attachment) -> Option<String> {
        if a.kind != AttachKind::Nbd {
            return None;
        }
        match self.connected(a.number) {
            Some(false) => Some(format!("{}: the nbd connection is dead", a.path().display())),
            _ if !self.serving(a.number) => Some(format!("{}: no server in this agent serves it", a.path().display())),
            _ if self.owed(a.number) => {
                Some(format!("{}: its connections are dead; reconnecting (the kernel queues its I/O meanwhile)", a.path().display()))
            }
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The node's flags reach its attach server, except what would hurt a
    /// kernel client: an idle timeout (a mounted volume idles for hours)
    /// and the listener's handshake and stall limits.
    #[test]
    fn the_attach_server_takes_the_nodes_tuning_but_not_its_client_timeouts() {
        let server = ServerConfig {
            threads: 2,
            idle_poll: Duration::from_micros(7),
            ring_weight: false,
            idle_timeout: Some(Duration::from_secs(30)),
            handshake_timeout: Duration::from_millis(100),
            stall_timeout: Duration::from_millis(200),
            listen: vec![volring_nbd::Listen::Tcp("127.0.0.1:10809".parse().expect("address"))],
            ..ServerConfig::default()
        };
        let c = attach_server_config(&NbdAttachConfig { connections: 4, server, ..NbdAttachConfig::default() });
        assert_eq!((c.threads, c.idle_poll, c.ring_weight), (4, Duration::from_micros(7), false));
        assert_eq!(c.idle_timeout, None);
        let defaults = ServerConfig::default();
        assert_eq!((c.handshake_timeout, c.stall_timeout), (defaults.handshake_timeout, defaults.stall_timeout));
        assert!(c.listen.is_empty());
        let one = attach_server_config(&NbdAttachConfig { connections: 1, ..NbdAttachConfig::default() });
        assert_eq!(one.threads, defaults.threads.max(1));
    }
}
