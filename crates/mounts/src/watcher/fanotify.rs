//! The fanotify + statmount strategy.

use std::collections::{HashMap, HashSet, VecDeque};
use std::os::fd::OwnedFd;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use super::emitter::Emitter;
use super::remount::{RemountDetector, Verdict};
use super::{Command, ResyncCause, WatchConfig};
use crate::diff::diff;
use crate::event::{Changes, EventKind, MountEvent, ResyncReason};
use crate::fanotify::{events, FanEvent};
use crate::source::Statmounter;
use crate::table::MountTable;
use crate::Error;
use volring_ring::{self as ring, Completion, Driver, Flow, Reactor};

const FAN_READY: ring::Token = 1;
const FAN_READ: ring::Token = 2;
const TABLE_CHANGED: ring::Token = 3;
const REMOUNT_CHECK: ring::Token = 4;
const PERIODIC: ring::Token = 5;
const RETRY: ring::Token = 6;
/// A turn of the ring while fanotify credits are left, so they expire on an
/// idle ring too (see `remount`).
const CREDIT_TURN: ring::Token = 7;

/// One read takes up to this many bytes of events (about 1,600 events).
const READ_SIZE: usize = 64 * 1024;
/// More than any one event; fanotify copies only whole events.
const SHORT_READ_MARGIN: usize = 4096;
/// Reads of the fanotify fd on the ring thread itself before a remount
/// check decides: 16 × 64 KiB holds more than a full fanotify queue.
const SYNC_READS: usize = 16;
/// Remount checks put off while a queued fanotify read is in flight (its
/// events may explain the POLLPRI) before the check decides regardless.
const MAX_DEFERRED_CHECKS: u32 = 8;
/// Mounts read lately, newest kept, that a POLLPRI paid by an older event
/// reads again (see `remount`).
const RECENT: usize = 16;

/// `Ok` when this kernel can watch mounts with fanotify and statmount; else
/// which interface is missing and from which kernel on it exists.
pub(super) fn support() -> Result<(), Error> {
    open_group().map(drop)
}

/// The fanotify group, or `Unsupported` on a kernel without statmount and
/// listmount (6.8) or without fanotify mount events (6.15): there the kernel
/// refuses FAN_REPORT_MNT / FAN_MARK_MNTNS as unknown flags (EINVAL).
fn open_group() -> Result<OwnedFd, Error> {
    if !Statmounter::supported() {
        return Err(Error::Unsupported { what: "statmount and listmount", needs: "6.8" });
    }
    volring_sys::fanotify::watch_mount_namespace().map_err(|e| match e.raw_os_error() {
        Some(libc::EINVAL) => Error::Unsupported { what: "fanotify mount events", needs: "6.15" },
        _ => Error::Io("fanotify mount watch", e),
    })
}

pub(super) struct FanotifyDriver {
    fan: Arc<OwnedFd>,
    mountinfo: Arc<OwnedFd>,
    kernel: Statmounter,
    table: MountTable,
    emitter: Emitter,
    read_buf: Option<Vec<u8>>,
    /// Ids touched by the batch being handled, in first-seen order.
    batch: Vec<Touched>,
    batch_index: HashMap<u64, usize>,
    remounts: RemountDetector,
    check_armed: bool,
    /// A POLLPRI is unpaired (it came in this turn, or the fanotify read
    /// the check waited for came back, or the check timer fired): decided
    /// at the end of the ring turn, after every completion of the turn (a
    /// late fanotify read among them).
    check_due: bool,
    checks_deferred: u32,
    /// A POLLPRI was paid by an event of an earlier turn: read `recent`
    /// again at the end of this turn.
    recheck_due: bool,
    /// The mounts fanotify events had read lately, oldest first, with the
    /// ring turn of that read.
    recent: VecDeque<(u64, u64)>,
    /// Ring turns ended so far.
    turn: u64,
    /// The whole table was read in this turn.
    resynced: bool,
    /// The fanotify fd said it has events, and no read has been queued for
    /// them yet (one was in flight).
    fan_ready: bool,
    /// The fanotify fd was read on the ring thread in this turn.
    drained: bool,
    credit_turn_armed: bool,
    grace: Duration,
    resync_interval: Option<Duration>,
    batch_window: Duration,
    /// Mounts already reported detached whose own fanotify events may still
    /// be queued (a resync found them gone): those events must not report
    /// them again. A mount statmount finds gone before its detach event is
    /// read is not put here: that event reports it, after its last moves.
    reported_gone: RecentIds,
}

/// What the kernel said of one mount id in one batch.
#[derive(Clone, Copy)]
struct Touched {
    id: u64,
    /// An attach that was not a move: the mount is new.
    attach: bool,
    /// A detach that was not a move: the kernel's word that the mount is
    /// gone, with no event of it after.
    detach: bool,
    /// Events that were moves (attach and detach at once). Each is reported,
    /// also when the mount moved on before statmount could see where to.
    moves: u32,
}

/// A bounded set of recent mount ids, oldest dropped first. Mount ids are
/// 64-bit and never reused, so a hit is always the same mount.
struct RecentIds {
    ids: HashSet<u64>,
    order: VecDeque<u64>,
}

impl RecentIds {
    /// More than one fanotify queue's worth (16,384 events) is never pending.
    const CAPACITY: usize = 16_384;

    fn new() -> Self {
        Self { ids: HashSet::new(), order: VecDeque::new() }
    }

    fn insert(&mut self, id: u64) {
        if self.ids.insert(id) {
            if self.order.len() == Self::CAPACITY {
                if let Some(old) = self.order.pop_front() {
                    self.ids.remove(&old);
                }
            }
            self.order.push_back(id);
        }
    }

    fn contains(&self, id: u64) -> bool {
        self.ids.contains(&id)
    }
}

/// A move the kernel reported whose destination was never observable.
fn moved_unseen(id: u64) -> MountEvent {
    MountEvent { kind: EventKind::Moved, id, mount: None, previous: None, changes: Changes::MOUNT_POINT, devices: Vec::new() }
}

impl FanotifyDriver {
    /// Opens the fanotify group before taking the snapshot, so no change can
    /// fall between the two: one seen twice is a no-op.
    pub(super) fn new(config: &WatchConfig, emitter: Emitter) -> Result<Self, Error> {
        let fan = open_group()?;
        let mountinfo: OwnedFd = std::fs::File::open("/proc/thread-self/mountinfo").map_err(|e| Error::Io("open mountinfo", e))?.into();
        let mut kernel = Statmounter::default();
        let table = kernel.snapshot()?;
        Ok(Self {
            fan: Arc::new(fan),
            mountinfo: Arc::new(mountinfo),
            kernel,
            table,
            emitter,
            read_buf: Some(vec![0; READ_SIZE]),
            batch: Vec::new(),
            batch_index: HashMap::new(),
            remounts: RemountDetector::new(),
            check_armed: false,
            check_due: false,
            checks_deferred: 0,
            recheck_due: false,
            recent: VecDeque::with_capacity(RECENT),
            turn: 0,
            resynced: false,
            fan_ready: false,
            drained: false,
            credit_turn_armed: false,
            grace: config.remount_grace,
            resync_interval: config.resync_interval,
            batch_window: config.batch_window,
            reported_gone: RecentIds::new(),
        })
    }

    pub(super) fn table(&self) -> &MountTable {
        &self.table
    }

    fn read(&mut self, ring: &mut Reactor) {
        if let Some(buf) = self.read_buf.take() {
            if let Err(e) = ring.submit(FAN_READ, ring::ReactorOp::Read { fd: self.fan.clone(), buf, offset: None }) {
                tracing::error!(error = %e, "cannot queue a fanotify read");
                self.emitter.counters().errors.fetch_add(1, Ordering::Relaxed);
                self.read_buf = Some(vec![0; READ_SIZE]);
            }
        }
    }

    /// Folds one read's events into the batch; true on overflow.
    fn collect(&mut self, buf: &[u8]) -> bool {
        let mut overflow = false;
        let mut n = 0;
        for ev in events(buf) {
            match ev {
                Ok(FanEvent::Mount { id, attach, detach }) => {
                    n += 1;
                    let moved = attach && detach;
                    let (attach, detach) = (attach && !moved, detach && !moved);
                    match self.batch_index.get(&id) {
                        Some(&i) => {
                            let t = &mut self.batch[i];
                            t.attach |= attach;
                            t.detach |= detach;
                            t.moves += moved as u32;
                        }
                        None => {
                            self.batch_index.insert(id, self.batch.len());
                            self.batch.push(Touched { id, attach, detach, moves: moved as u32 });
                        }
                    }
                }
                Ok(FanEvent::Overflow) => overflow = true,
                Err(e) => {
                    // The rest of this read cannot be trusted: resync instead.
                    tracing::warn!(error = %e, "malformed fanotify data; resyncing");
                    self.emitter.counters().errors.fetch_add(1, Ordering::Relaxed);
                    overflow = true;
                }
            }
        }
        self.emitter.counters().fanotify_events.fetch_add(n, Ordering::Relaxed);
        self.remounts.fanotify(n);
        overflow
    }

    /// Reads what the fanotify fd holds, here and now (it is non-blocking),
    /// so a remount check counts the events the kernel has queued and the
    /// ring has not read yet. Only when no queued read is in flight: events
    /// must be handled in the order the kernel gave them. False when one is.
    fn read_now(&mut self, ring: &mut Reactor) -> bool {
        let Some(mut buf) = self.read_buf.take() else {
            return false;
        };
        self.drained = true;
        for _ in 0..SYNC_READS {
            match rustix::io::read(&*self.fan, &mut buf[..]) {
                Ok(n) if n > 0 => {
                    self.handle(&buf[..n], ring);
                    if n + SHORT_READ_MARGIN <= READ_SIZE {
                        break;
                    }
                }
                Ok(_) | Err(rustix::io::Errno::AGAIN) => break,
                Err(rustix::io::Errno::INTR) => {}
                Err(e) => {
                    tracing::warn!(error = %e, "fanotify read failed");
                    self.emitter.counters().errors.fetch_add(1, Ordering::Relaxed);
                    break;
                }
            }
        }
        self.read_buf = Some(buf);
        true
    }

    /// The remount check, at the end of the turn an unpaired POLLPRI came
    /// in: what the fanotify fd holds is read first (the events of the
    /// changes that POLLPRI may stand for), and a POLLPRI still unpaired
    /// re-reads the table at once, while a mount remounted and then
    /// unmounted can still be seen read-only (issue 27).
    fn check_remounts(&mut self, ring: &mut Reactor) {
        if !self.read_now(ring) && self.checks_deferred < MAX_DEFERRED_CHECKS {
            // A queued read is in flight: its events come first. Its
            // completion brings the check back; the timer, if it is late.
            self.checks_deferred += 1;
            if !self.check_armed {
                self.check_armed = ring.submit(REMOUNT_CHECK, ring::ReactorOp::Timeout(self.grace)).is_ok();
            }
            return;
        }
        self.checks_deferred = 0;
        let v = self.remounts.decide();
        self.act(v, ring);
    }

    fn act(&mut self, v: Verdict, ring: &mut Reactor) {
        match v {
            Verdict::Nothing => {}
            Verdict::Check => self.check_due = true,
            Verdict::Recheck => self.recheck_due = true,
            Verdict::Resync => self.resync(ResyncCause::Unpaired, ring),
        }
    }

    /// Looks at each id of the batch once, in the order first seen.
    fn apply_batch(&mut self, ring: &mut Reactor) {
        let batch = std::mem::take(&mut self.batch);
        self.batch_index.clear();
        for &Touched { id, attach, detach, moves } in &batch {
            self.emitter.counters().statmount_calls.fetch_add(1, Ordering::Relaxed);
            match self.kernel.stat(id) {
                Ok(Some(m)) => {
                    self.note_read(id);
                    let m = Arc::new(m);
                    match self.table.insert(m.clone()) {
                        Some(old) => {
                            let seen = MountEvent::between(&old, &m);
                            let seen_moves = seen.as_ref().is_some_and(|e| e.kind == EventKind::Moved) as u32;
                            // Moves whose place statmount could not see (the
                            // mount moved on, or back): one event each, first,
                            // so the last event of the id holds its state.
                            for _ in seen_moves..moves {
                                self.emitter.emit(moved_unseen(id), ring, RETRY);
                            }
                            if let Some(e) = seen {
                                self.emitter.emit(e, ring, RETRY);
                            }
                        }
                        None => {
                            self.emitter.emit(MountEvent::attached(id, Some(m)), ring, RETRY);
                            for _ in 0..moves {
                                self.emitter.emit(moved_unseen(id), ring, RETRY);
                            }
                        }
                    }
                }
                Ok(None) if self.reported_gone.contains(id) => {}
                Ok(None) if !detach => {
                    // Gone, but its detach event is still unread: statmount
                    // is ahead of the queue, and moves may be queued before
                    // that event too. Report this batch's moves only; the
                    // detach event reports the mount gone, after every move,
                    // with the state kept in the table until then.
                    if attach && self.table.get(id).is_none() {
                        self.emitter.emit(MountEvent::attached(id, None), ring, RETRY);
                    }
                    for _ in 0..moves {
                        self.emitter.emit(moved_unseen(id), ring, RETRY);
                    }
                }
                Ok(None) => match self.table.remove(id) {
                    Some(old) => {
                        self.reported_gone.insert(id);
                        for _ in 0..moves {
                            self.emitter.emit(moved_unseen(id), ring, RETRY);
                        }
                        self.emitter.emit(MountEvent::detached(id, Some(old)), ring, RETRY);
                    }
                    None => {
                        // Came and went before we could look: still say both.
                        self.reported_gone.insert(id);
                        if attach {
                            self.emitter.emit(MountEvent::attached(id, None), ring, RETRY);
                        }
                        for _ in 0..moves {
                            self.emitter.emit(moved_unseen(id), ring, RETRY);
                        }
                        self.emitter.emit(MountEvent::detached(id, None), ring, RETRY);
                    }
                },
                Err(e) => {
                    tracing::warn!(mount_id = id, error = %e, "statmount failed");
                    self.emitter.counters().errors.fetch_add(1, Ordering::Relaxed);
                }
            }
        }
        self.batch = batch;
        self.batch.clear();
    }

    /// `id` was read (statmount) in this turn.
    fn note_read(&mut self, id: u64) {
        match self.recent.iter_mut().find(|(r, _)| *r == id) {
            Some(entry) => entry.1 = self.turn,
            None => {
                if self.recent.len() == RECENT {
                    self.recent.pop_front();
                }
                self.recent.push_back((id, self.turn));
            }
        }
    }

    /// Reads again the mounts fanotify events read in earlier turns, and
    /// reports what changed: a POLLPRI was paid by one of those events,
    /// and may stand for a later change fanotify does not report (a
    /// remount right after the mount). A mount gone is left to its detach
    /// event, and a move to its move event.
    fn recheck_recent(&mut self, ring: &mut Reactor) {
        let table = &self.table;
        self.recent.retain(|(id, _)| table.get(*id).is_some());
        for i in 0..self.recent.len() {
            let (id, read) = self.recent[i];
            if read == self.turn {
                continue;
            }
            self.emitter.counters().statmount_calls.fetch_add(1, Ordering::Relaxed);
            match self.kernel.stat(id) {
                Ok(Some(m)) => {
                    self.recent[i].1 = self.turn;
                    let Some(old) = self.table.get(id) else { continue };
                    let m = Arc::new(m);
                    match MountEvent::between(old, &m) {
                        Some(e) if e.kind != EventKind::Moved => {
                            self.table.insert(m);
                            self.emitter.emit(e, ring, RETRY);
                        }
                        _ => {}
                    }
                }
                Ok(None) => {}
                Err(e) => {
                    tracing::warn!(mount_id = id, error = %e, "statmount failed");
                    self.emitter.counters().errors.fetch_add(1, Ordering::Relaxed);
                }
            }
        }
    }

    /// Re-reads the whole table and reports the difference.
    fn resync(&mut self, cause: ResyncCause, ring: &mut Reactor) {
        self.emitter.counters().resynced(cause);
        // Only an overflow is delivered as one `resync` event: events were
        // lost, so the consumer must take the batch as the whole truth.
        let reason = (cause == ResyncCause::Overflow).then_some(ResyncReason::Overflow);
        self.resynced = true;
        let new = match self.kernel.snapshot() {
            Ok(t) => t,
            Err(e) => {
                tracing::error!(error = %e, "mount table resync failed");
                self.emitter.counters().errors.fetch_add(1, Ordering::Relaxed);
                return;
            }
        };
        let changes = diff(&self.table, &new);
        for e in changes.iter().filter(|e| e.kind == EventKind::Detached) {
            self.reported_gone.insert(e.id);
        }
        self.table = new;
        match reason {
            Some(reason) => self.emitter.emit_resync(reason, changes, ring, RETRY),
            None => changes.into_iter().for_each(|e| self.emitter.emit(e, ring, RETRY)),
        }
    }

    /// Handles one read's events.
    fn handle(&mut self, events: &[u8], ring: &mut Reactor) {
        if self.collect(events) {
            self.emitter.counters().overflows.fetch_add(1, Ordering::Relaxed);
            self.batch.clear();
            self.batch_index.clear();
            self.resync(ResyncCause::Overflow, ring);
        } else {
            self.apply_batch(ring);
        }
    }

    fn on_read(&mut self, c: Completion, ring: &mut Reactor) {
        let buf = c.buf.unwrap_or_default();
        match c.result {
            Ok(n) if n > 0 => {
                self.handle(&buf[..(n as usize).min(buf.len())], ring);
                self.read_buf = Some(buf);
                // A read that nearly filled the buffer may have left events
                // behind: read on. A short one emptied the queue, and the
                // multishot POLLIN reports whatever comes next.
                if n as usize + SHORT_READ_MARGIN > READ_SIZE {
                    self.read(ring);
                }
                // A remount check put off for this read is due now.
                self.check_due |= self.remounts.waiting();
            }
            Ok(_) => self.read_buf = Some(buf),
            Err(e) => {
                if e.kind() != std::io::ErrorKind::WouldBlock {
                    tracing::warn!(error = %e, "fanotify read failed");
                    self.emitter.counters().errors.fetch_add(1, Ordering::Relaxed);
                }
                self.read_buf = Some(if buf.len() == READ_SIZE { buf } else { vec![0; READ_SIZE] });
            }
        }
    }
}

impl Driver for FanotifyDriver {
    type Command = Command;

    fn start(&mut self, ring: &mut Reactor) -> std::io::Result<()> {
        ring.set_batch_window(self.batch_window);
        ring.submit(FAN_READY, ring::ReactorOp::Poll { fd: self.fan.clone(), events: ring::Events::IN })?;
        ring.submit(TABLE_CHANGED, ring::ReactorOp::Poll { fd: self.mountinfo.clone(), events: ring::Events::PRI })?;
        if let Some(every) = self.resync_interval {
            ring.submit(PERIODIC, ring::ReactorOp::Timeout(every))?;
        }
        // Anything queued between the mark and the first poll.
        self.read(ring);
        Ok(())
    }

    fn on_command(&mut self, cmd: Command, ring: &mut Reactor) -> Flow {
        match cmd {
            Command::Resync => self.resync(ResyncCause::Requested, ring),
        }
        self.emitter.flow()
    }

    fn on_completion(&mut self, c: Completion, ring: &mut Reactor) -> Flow {
        match c.token {
            FAN_READY => self.fan_ready = true,
            FAN_READ => self.on_read(c, ring),
            TABLE_CHANGED => {
                let v = self.remounts.table_changed();
                self.act(v, ring);
            }
            REMOUNT_CHECK => {
                self.check_armed = false;
                self.check_due |= self.remounts.waiting();
            }
            CREDIT_TURN => self.credit_turn_armed = false,
            PERIODIC => {
                self.resync(ResyncCause::Periodic, ring);
                if let Some(every) = self.resync_interval {
                    let _ = ring.submit(PERIODIC, ring::ReactorOp::Timeout(every));
                }
            }
            RETRY => self.emitter.retry(ring, RETRY),
            _ => {}
        }
        self.emitter.flow()
    }

    fn end_of_batch(&mut self, ring: &mut Reactor) -> Flow {
        if std::mem::take(&mut self.check_due) {
            self.check_remounts(ring);
        }
        if std::mem::take(&mut self.recheck_due) && !self.resynced {
            self.recheck_recent(ring);
        }
        // Events the check did not read here are read through the ring,
        // once the read in flight (if any) is back.
        if self.drained {
            self.fan_ready = false;
        } else if self.fan_ready && self.read_buf.is_some() {
            self.fan_ready = false;
            self.read(ring);
        }
        self.resynced = false;
        self.drained = false;
        self.turn += 1;
        if self.remounts.end_of_turn() && !self.credit_turn_armed {
            self.credit_turn_armed = ring.submit(CREDIT_TURN, ring::ReactorOp::Timeout(self.grace)).is_ok();
        }
        self.emitter.announce();
        self.emitter.flow()
    }
}
