//! Delivery to the consumer: never blocks the ring, never drops a change.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use super::backlog::Backlog;
use super::Counters;
use crate::devname::devices_of;
use crate::event::{MountEvent, ResyncReason, WatchEvent};
use volring_ring::{queue, Flow, Reactor, ReactorOp, Token};

/// How soon to retry handing a backlog to a consumer that was full.
const RETRY: Duration = Duration::from_millis(5);

pub(super) struct Emitter {
    tx: queue::Sender<WatchEvent>,
    backlog: Backlog,
    /// Set when the backlog holds the remains of an overflow resync, so the
    /// consumer learns that the kernel lost events, not only that it lagged.
    backlog_reason: ResyncReason,
    retry_armed: bool,
    counters: Arc<Counters>,
    resolve_devices: bool,
}

impl Emitter {
    pub(super) fn new(tx: queue::Sender<WatchEvent>, counters: Arc<Counters>, resolve_devices: bool) -> Self {
        Self {
            tx,
            backlog: Backlog::default(),
            backlog_reason: ResyncReason::ConsumerLagged,
            retry_armed: false,
            counters,
            resolve_devices,
        }
    }

    pub(super) fn counters(&self) -> &Counters {
        &self.counters
    }

    /// Keep running while someone reads; stop once the consumer is gone.
    pub(super) fn flow(&self) -> Flow {
        if self.tx.is_closed() {
            Flow::Stop
        } else {
            Flow::Continue
        }
    }

    fn resolve(&self, e: &mut MountEvent) {
        if self.resolve_devices && e.devices.is_empty() {
            if let Some(m) = e.subject() {
                e.devices = devices_of(m);
            }
        }
    }

    /// Sends one event, or folds it into the backlog while the consumer lags.
    pub(super) fn emit(&mut self, mut e: MountEvent, ring: &mut Reactor, retry: Token) {
        self.counters.mount_events.fetch_add(1, Ordering::Relaxed);
        if !self.backlog.is_empty() {
            self.backlog.add(e);
            return;
        }
        self.resolve(&mut e);
        match self.tx.push(WatchEvent::Mount(e)) {
            Ok(()) => {
                self.counters.deliveries.fetch_add(1, Ordering::Relaxed);
            }
            Err(WatchEvent::Mount(e)) => {
                self.backlog.add(e);
                self.arm_retry(ring, retry);
            }
            Err(WatchEvent::Resync { .. }) => unreachable!("sent a single event"),
        }
    }

    /// Sends a resync batch, or folds it into the backlog.
    pub(super) fn emit_resync(&mut self, reason: ResyncReason, mut changes: Vec<MountEvent>, ring: &mut Reactor, retry: Token) {
        self.counters.mount_events.fetch_add(changes.len() as u64, Ordering::Relaxed);
        if self.backlog.is_empty() {
            changes.iter_mut().for_each(|e| self.resolve(e));
            match self.tx.push(WatchEvent::resync(reason, changes)) {
                Ok(()) => {
                    self.counters.deliveries.fetch_add(1, Ordering::Relaxed);
                    return;
                }
                Err(WatchEvent::Resync { changes: c, .. }) => changes = c,
                Err(WatchEvent::Mount(_)) => unreachable!("sent a resync"),
            }
        }
        if reason == ResyncReason::Overflow {
            self.backlog_reason = ResyncReason::Overflow;
        }
        for e in changes {
            self.backlog.add(e);
        }
        self.arm_retry(ring, retry);
    }

    /// Wakes the consumer once for everything sent this ring turn; the
    /// drivers call it at the end of each turn.
    pub(super) fn announce(&mut self) {
        self.tx.announce();
    }

    fn arm_retry(&mut self, ring: &mut Reactor, retry: Token) {
        if !self.retry_armed {
            self.retry_armed = ring.submit(retry, ReactorOp::Timeout(RETRY)).is_ok();
        }
    }

    /// Called on the retry timer: hands the net backlog over as one resync.
    pub(super) fn retry(&mut self, ring: &mut Reactor, retry: Token) {
        self.retry_armed = false;
        if self.backlog.is_empty() {
            return;
        }
        if self.tx.is_full() {
            self.arm_retry(ring, retry);
            return;
        }
        let mut changes = self.backlog.take();
        changes.iter_mut().for_each(|e| self.resolve(e));
        let reason = std::mem::replace(&mut self.backlog_reason, ResyncReason::ConsumerLagged);
        match self.tx.push(WatchEvent::resync(reason, changes)) {
            Ok(()) => {
                self.counters.deliveries.fetch_add(1, Ordering::Relaxed);
                self.counters.lagged_batches.fetch_add(1, Ordering::Relaxed);
            }
            Err(WatchEvent::Resync { changes, .. }) => {
                // Only this thread sends, and the queue had room; a consumer
                // cannot take room away. Keep the batch all the same.
                self.backlog_reason = reason;
                changes.into_iter().for_each(|e| self.backlog.add(e));
                self.arm_retry(ring, retry);
            }
            Err(WatchEvent::Mount(_)) => unreachable!("sent a resync"),
        }
    }
}
