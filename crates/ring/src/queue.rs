//! Bounded, lock-free hand-off from a ring thread to its consumers.
//!
//! The producer never blocks: [`Sender::push`] gives the item back when
//! the queue is full, and the producer decides what to do with it (the mount
//! watcher folds it into a coalesced diff; nothing is dropped silently).
//! Consumers wait either asynchronously or on a thread, with no lock on the
//! fast path: an `ArrayQueue` plus an `event_listener::Event` for wakeups.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crossbeam_queue::ArrayQueue;
use event_listener::{Event, Listener};

struct Shared<T> {
    queue: ArrayQueue<T>,
    ready: Event,
    closed: AtomicBool,
}

/// The producing end; owned by a ring thread.
pub struct Sender<T> {
    shared: Arc<Shared<T>>,
    /// Items pushed by [`Sender::push`] that no wakeup announced yet.
    unannounced: usize,
}

/// The consuming end.
pub struct Receiver<T> {
    shared: Arc<Shared<T>>,
}

/// A queue that holds at most `capacity` items.
pub fn bounded<T>(capacity: usize) -> (Sender<T>, Receiver<T>) {
    let shared = Arc::new(Shared { queue: ArrayQueue::new(capacity.max(1)), ready: Event::new(), closed: AtomicBool::new(false) });
    (Sender { shared: shared.clone(), unannounced: 0 }, Receiver { shared })
}

impl<T> Sender<T> {
    /// Enqueues without blocking and without waking a consumer; returns
    /// the item when the queue is full. Consumers wake at the next
    /// [`Sender::announce`], so a producer that hands over many items per
    /// turn wakes them once, not once per item (a futex wake each: 11% of
    /// a mount storm); one that hands over one announces right after.
    pub fn push(&mut self, item: T) -> Result<(), T> {
        self.shared.queue.push(item)?;
        self.unannounced += 1;
        Ok(())
    }

    /// Wakes consumers for what [`Sender::push`] queued since the last call.
    pub fn announce(&mut self) {
        if self.unannounced > 0 {
            self.shared.ready.notify_additional(std::mem::take(&mut self.unannounced));
        }
    }

    pub fn is_full(&self) -> bool {
        self.shared.queue.is_full()
    }

    /// True once the receiver is gone: nobody will read what is sent.
    pub fn is_closed(&self) -> bool {
        Arc::strong_count(&self.shared) == 1
    }
}

impl<T> Drop for Sender<T> {
    fn drop(&mut self) {
        self.shared.closed.store(true, Ordering::Release);
        self.shared.ready.notify(usize::MAX);
    }
}

impl<T> Receiver<T> {
    fn try_recv(&self) -> Option<T> {
        self.shared.queue.pop()
    }

    /// What is queued now, without waiting: at most as many items as the
    /// queue held when called, so a producer that keeps pushing cannot
    /// keep the caller here.
    pub fn drain(&self) -> impl Iterator<Item = T> + '_ {
        let queued = self.shared.queue.len();
        std::iter::from_fn(|| self.try_recv()).take(queued)
    }

    fn closed(&self) -> bool {
        self.shared.closed.load(Ordering::Acquire)
    }

    /// `Some(item)`, or `Some(None)` at the end of the stream; `None` when
    /// the caller has to wait.
    fn ready_or_closed(&self) -> Option<Option<T>> {
        if let Some(item) = self.try_recv() {
            return Some(Some(item));
        }
        self.closed().then(|| self.try_recv())
    }

    /// What `ready_or_closed` says, or a listener to wait on. The second look
    /// comes after the listener is registered, so a push in between is never
    /// missed.
    fn next_or_listen(&self) -> Result<Option<T>, event_listener::EventListener> {
        if let Some(r) = self.ready_or_closed() {
            return Ok(r);
        }
        let listener = self.shared.ready.listen();
        self.ready_or_closed().ok_or(listener)
    }

    /// Waits for the next item; `None` once the sender is gone and the queue
    /// is drained.
    pub async fn recv(&self) -> Option<T> {
        loop {
            match self.next_or_listen() {
                Ok(r) => return r,
                Err(listener) => listener.await,
            }
        }
    }

    /// Blocks the calling thread for at most `timeout`; `None` on timeout or
    /// when the sender is gone and the queue is drained.
    pub fn recv_timeout(&self, timeout: Duration) -> Option<T> {
        let deadline = Instant::now() + timeout;
        loop {
            match self.next_or_listen() {
                Ok(r) => return r,
                Err(listener) => listener.wait_deadline(deadline)?,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn full_queue_gives_the_item_back() {
        let (mut tx, rx) = bounded(2);
        assert!(tx.push(1).is_ok());
        assert!(tx.push(2).is_ok());
        assert_eq!(tx.push(3), Err(3));
        assert_eq!(rx.try_recv(), Some(1));
        assert!(tx.push(3).is_ok());
        tx.announce();
        assert_eq!(rx.recv_timeout(Duration::from_millis(1)), Some(2));
        assert_eq!(rx.recv_timeout(Duration::from_millis(1)), Some(3));
        assert_eq!(rx.recv_timeout(Duration::from_millis(1)), None);
    }

    #[test]
    fn pushed_items_wake_a_consumer_when_announced() {
        let (mut tx, rx) = bounded::<u32>(4);
        let t = std::thread::spawn(move || rx.recv_timeout(Duration::from_secs(10)).map(|a| (a, rx.try_recv())));
        std::thread::sleep(Duration::from_millis(20));
        tx.push(1).unwrap();
        tx.push(2).unwrap();
        tx.announce();
        assert_eq!(t.join().unwrap(), Some((1, Some(2))));
    }

    #[test]
    fn wakes_a_blocked_consumer_and_reports_close() {
        let (mut tx, rx) = bounded::<u32>(4);
        let t = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(20));
            tx.push(7).unwrap();
            tx.announce();
        });
        assert_eq!(rx.recv_timeout(Duration::from_secs(10)), Some(7));
        t.join().unwrap();
        assert_eq!(rx.recv_timeout(Duration::from_secs(10)), None);
    }

    #[test]
    fn drain_takes_what_is_queued_and_no_more() {
        let (mut tx, rx) = bounded::<u32>(4);
        tx.push(1).unwrap();
        tx.push(2).unwrap();
        let mut drained = rx.drain();
        assert_eq!(drained.next(), Some(1));
        tx.push(3).unwrap();
        assert_eq!(drained.next(), Some(2));
        assert_eq!(drained.next(), None, "what came after the call waits for the next drain");
        assert_eq!(rx.drain().collect::<Vec<_>>(), [3]);
    }
}
