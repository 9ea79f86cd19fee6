//! The one way to hand work to a ring thread: a bounded lock-free queue and
//! an eventfd the ring keeps a multishot poll on.
//!
//! The sender never blocks: a full mailbox gives the item back and the
//! sender decides (retry, count and drop, fail). One eventfd write per send
//! wakes the ring; the ring reads the counter once per wakeup and then
//! empties the queue, so a burst of sends costs one ring turn.

use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd, RawFd};

use crossbeam_queue::ArrayQueue;

pub struct Mailbox<T> {
    queue: ArrayQueue<T>,
    wake: OwnedFd,
}

impl<T> Mailbox<T> {
    /// A mailbox that holds at most `capacity` items (at least one).
    pub fn new(capacity: usize) -> io::Result<Self> {
        let wake = rustix::event::eventfd(0, rustix::event::EventfdFlags::CLOEXEC | rustix::event::EventfdFlags::NONBLOCK)?;
        Ok(Self { queue: ArrayQueue::new(capacity.max(1)), wake })
    }

    /// Queues `item` and wakes the ring; gives `item` back when full.
    pub fn send(&self, item: T) -> Result<(), T> {
        self.queue.push(item)?;
        self.wake();
        Ok(())
    }

    /// Wakes the ring without a message (to make it look at a stop flag).
    pub fn wake(&self) {
        // EAGAIN only when the counter is about to overflow: the ring is awake then.
        let _ = rustix::io::write(&self.wake, &1u64.to_ne_bytes());
    }

    /// Called by the ring on a wakeup, before it empties the queue: a send
    /// after this wakes it again.
    pub fn clear_wakeup(&self) {
        let mut drain = [0u8; 8];
        let _ = rustix::io::read(&self.wake, &mut drain);
    }

    /// The next item, for the ring.
    pub fn recv(&self) -> Option<T> {
        self.queue.pop()
    }

    #[cfg(test)]
    pub(crate) fn is_empty(&self) -> bool {
        self.queue.is_empty()
    }
}

impl<T> AsFd for Mailbox<T> {
    /// The eventfd to poll for readability.
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.wake.as_fd()
    }
}

impl<T> AsRawFd for Mailbox<T> {
    fn as_raw_fd(&self) -> RawFd {
        self.wake.as_raw_fd()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn full_mailbox_gives_the_item_back_and_the_eventfd_counts_wakeups() {
        let m = Mailbox::new(1).unwrap();
        assert!(m.send(1).is_ok());
        assert_eq!(m.send(2), Err(2));
        let mut n = [0u8; 8];
        assert_eq!(rustix::io::read(&m.wake, &mut n).unwrap(), 8);
        assert_eq!(u64::from_ne_bytes(n), 1);
        assert_eq!(m.recv(), Some(1));
        assert!(m.is_empty());
    }
}
