//! Hot-plug: kernel uevents, read through the ring, turned into device
//! events on a bounded lock-free queue (the same kind as mount events).
//!
//! A loop device shows what the event stream looks like: creating one is
//! an `add` of an empty device, attaching a file a `change` to a non-zero
//! size, detaching a `change` back to zero. Like lsblk and node-disk-manager,
//! volring treats an empty device as absent, so the stream it emits is
//! `Added` when a device gets a size, `Removed` when it loses it or goes.

use std::collections::HashMap;
use std::io;
use std::os::fd::OwnedFd;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use super::device::DeviceEvent;
use super::inventory::{describe, ScanConfig};
use super::uevent::{self, Action, MAX_UEVENT};
use volring_mounts::DevNum;
use volring_ring::queue::{self, Receiver, Sender};
use volring_ring::{Completion, Driver, Events, Flow, Reactor, ReactorOp, RingStats, RingThread};

/// Counters of the hot-plug thread. Who reads them (`/metrics`) makes them
/// and hands them to [`DeviceWatcher::start`].
#[derive(Debug, Default)]
pub struct HotplugStats {
    pub uevents: AtomicU64,
    pub refused: AtomicU64,
    pub emitted: AtomicU64,
    pub dropped: AtomicU64,
}

pub struct DeviceWatcher {
    ring: RingThread<HotplugDriver>,
}

impl DeviceWatcher {
    /// Starts listening. Events are relative to the devices that have a size
    /// once the socket is open: start it before scanning, and nothing
    /// plugged in between is missed. The thread counts into `stats`.
    pub fn start(cfg: ScanConfig, capacity: usize, stats: Arc<HotplugStats>) -> io::Result<(Self, Receiver<DeviceEvent>)> {
        let (tx, rx) = queue::bounded(capacity);
        let io = cfg.io;
        let make = move || {
            let sock = Arc::new(volring_sys::netlink::uevent_socket(4 << 20)?);
            let present = sized_devices(&cfg.sys);
            Ok(HotplugDriver { cfg, sock, tx, present, stats, buf: vec![0; MAX_UEVENT], lost: false })
        };
        let ring = RingThread::spawn_with("volring-hotplug", make, io, 16)?;
        Ok((Self { ring }, rx))
    }

    pub fn ring_stats(&self) -> &Arc<RingStats> {
        self.ring.stats()
    }

    pub fn stop(self) -> io::Result<()> {
        self.ring.stop().map(|_| ())
    }
}

/// The devices with a non-zero size now, by name.
fn sized_devices(sys: &std::path::Path) -> HashMap<String, DevNum> {
    let names = super::sysfs::list(sys).unwrap_or_default();
    names
        .into_iter()
        .filter_map(|n| {
            let dir = sys.join("class/block").join(&n);
            let size: u64 = std::fs::read_to_string(dir.join("size")).ok()?.trim().parse().ok()?;
            let dev = super::sysfs::parse_devnum(&std::fs::read_to_string(dir.join("dev")).ok()?)?;
            (size > 0).then_some((n, dev))
        })
        .collect()
}

struct HotplugDriver {
    cfg: ScanConfig,
    sock: Arc<OwnedFd>,
    tx: Sender<DeviceEvent>,
    present: HashMap<String, DevNum>,
    stats: Arc<HotplugStats>,
    buf: Vec<u8>,
    /// An event could not be delivered: a `Rescan` is owed.
    lost: bool,
}

const SOCKET: u64 = 1;

impl HotplugDriver {
    fn emit(&mut self, ev: DeviceEvent) {
        if self.lost {
            if self.tx.push(DeviceEvent::Rescan { reason: "queue full" }).is_err() {
                self.stats.dropped.fetch_add(1, Ordering::Relaxed);
                return;
            }
            self.tx.announce();
            self.lost = false;
        }
        match self.tx.push(ev) {
            Ok(()) => {
                self.tx.announce();
                self.stats.emitted.fetch_add(1, Ordering::Relaxed);
            }
            Err(_) => {
                self.stats.dropped.fetch_add(1, Ordering::Relaxed);
                self.lost = true;
            }
        }
    }

    fn on_uevent(&mut self, len: usize) {
        self.stats.uevents.fetch_add(1, Ordering::Relaxed);
        let parsed = if len > self.buf.len() { Err(uevent::UEventError::TooLarge) } else { uevent::parse(&self.buf[..len]) };
        let ev = match parsed {
            Ok(ev) if ev.is_block() => ev,
            Ok(_) => return,
            Err(e) => {
                self.stats.refused.fetch_add(1, Ordering::Relaxed);
                tracing::debug!(error = %e, "uevent refused");
                return;
            }
        };
        let name = ev.name().to_string();
        let now = if ev.action == Action::Remove {
            None
        } else {
            match describe(&self.cfg, &name) {
                Ok(d) => d.filter(|d| d.size_bytes > 0),
                Err(e) => {
                    tracing::debug!(device = %name, error = %e, "device unreadable after uevent");
                    None
                }
            }
        };
        let was = self.present.contains_key(&name);
        let seqnum = ev.seqnum;
        match now {
            Some(d) => {
                self.present.insert(name, d.dev);
                let device = Box::new(d);
                self.emit(if was { DeviceEvent::Changed { device, seqnum } } else { DeviceEvent::Added { device, seqnum } });
            }
            None if was => {
                let dev = self.present.remove(&name);
                self.emit(DeviceEvent::Removed { name, dev, seqnum });
            }
            None => {}
        }
    }
}

impl Driver for HotplugDriver {
    type Command = ();

    fn start(&mut self, ring: &mut Reactor) -> io::Result<()> {
        ring.submit(SOCKET, ReactorOp::Poll { fd: self.sock.clone(), events: Events::IN })
    }

    fn on_command(&mut self, _cmd: (), _ring: &mut Reactor) -> Flow {
        Flow::Continue
    }

    fn on_completion(&mut self, c: Completion, ring: &mut Reactor) -> Flow {
        if c.token != SOCKET {
            return Flow::Continue;
        }
        if let Err(e) = c.result {
            tracing::error!(error = %e, "uevent poll failed; re-arming");
            if ring.submit(SOCKET, ReactorOp::Poll { fd: self.sock.clone(), events: Events::IN }).is_err() {
                return Flow::Stop;
            }
            return Flow::Continue;
        }
        // Drain everything waiting, bounded so one burst cannot starve the loop.
        for _ in 0..4096 {
            match volring_sys::netlink::recv_uevent(&*self.sock, &mut self.buf) {
                Ok(Some(n)) => self.on_uevent(n),
                Ok(None) => break,
                Err(e) if e.raw_os_error() == Some(libc::ENOBUFS) => {
                    tracing::warn!("uevent socket overflowed; asking for a rescan");
                    // Lost events leave `present` stale too: re-read it, or the
                    // next events would be classified against a wrong set.
                    self.present = sized_devices(&self.cfg.sys);
                    self.emit(DeviceEvent::Rescan { reason: "uevent socket overflowed" });
                }
                Err(e) => {
                    tracing::error!(error = %e, "uevent socket failed");
                    return Flow::Stop;
                }
            }
        }
        if self.tx.is_closed() {
            return Flow::Stop;
        }
        Flow::Continue
    }
}
