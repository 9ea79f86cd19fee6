//! One operation per volume at a time.
//!
//! The CSI spec asks a plugin to answer `Aborted` when an operation on the
//! same volume is in flight (the CO retries with backoff), so between CSI
//! calls the lock is a try-lock: a call never queues behind another, and
//! calls on different volumes never touch each other's entries. The
//! reconciler takes the same lock for a repair; a call that finds a repair
//! running waits for it (bounded) instead, as the repair is not the CO's
//! and would otherwise look like a call the CO never made.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Who holds a volume.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Holder {
    Call,
    Repair,
}

type Held = Arc<Mutex<HashMap<String, Holder>>>;

#[derive(Default, Clone)]
pub(crate) struct VolumeLocks {
    held: Held,
}

/// Held while an operation runs; releases the volume when dropped (also
/// when the operation panics).
pub(crate) struct VolumeGuard {
    held: Held,
    id: String,
}

impl VolumeLocks {
    pub(crate) fn new() -> Self {
        Self::default()
    }

    /// Takes the volume for a CSI call, or `None` when another operation
    /// holds it (calls wait with `lock_for_call`; the unit tests take it so).
    #[cfg(test)]
    fn try_lock(&self, id: &str) -> Option<VolumeGuard> {
        self.take(id, Holder::Call)
    }

    /// Takes the volume for the reconciler, or `None` when it is held.
    pub(crate) fn try_lock_for_repair(&self, id: &str) -> Option<VolumeGuard> {
        self.take(id, Holder::Repair)
    }

    /// Takes the volume for a CSI call, waiting up to `wait` while a repair
    /// holds it; `None` when a call holds it (or the repair outlasts `wait`).
    pub(crate) fn lock_for_call(&self, id: &str, wait: Duration) -> Option<VolumeGuard> {
        let deadline = Instant::now() + wait;
        loop {
            match self.holder(id) {
                Some(Holder::Call) => return None,
                Some(Holder::Repair) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(10)),
                Some(Holder::Repair) => return None,
                None => {
                    if let Some(g) = self.take(id, Holder::Call) {
                        return Some(g);
                    }
                }
            }
        }
    }

    fn holder(&self, id: &str) -> Option<Holder> {
        self.held.lock().unwrap_or_else(|e| e.into_inner()).get(id).copied()
    }

    fn take(&self, id: &str, who: Holder) -> Option<VolumeGuard> {
        let mut held = self.held.lock().unwrap_or_else(|e| e.into_inner());
        if held.contains_key(id) {
            return None;
        }
        held.insert(id.to_string(), who);
        Some(VolumeGuard { held: self.held.clone(), id: id.to_string() })
    }

    /// How many volumes are held (the unit tests check guards release).
    #[cfg(test)]
    fn held(&self) -> usize {
        self.held.lock().unwrap_or_else(|e| e.into_inner()).len()
    }
}

impl Drop for VolumeGuard {
    fn drop(&mut self) {
        self.held.lock().unwrap_or_else(|e| e.into_inner()).remove(&self.id);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_holder_per_volume() {
        let locks = VolumeLocks::new();
        let a = locks.try_lock("a").unwrap();
        assert!(locks.try_lock("a").is_none());
        let b = locks.try_lock("b").unwrap();
        drop(a);
        assert!(locks.try_lock("a").is_some());
        drop(b);
        assert_eq!(locks.held(), 0);
    }

    #[test]
    fn a_call_waits_for_a_repair_not_for_a_call() {
        let locks = VolumeLocks::new();
        let call = locks.try_lock("a").unwrap();
        assert!(locks.lock_for_call("a", Duration::from_secs(5)).is_none(), "a call never waits for a call");
        drop(call);
        let repair = locks.try_lock_for_repair("a").unwrap();
        assert!(locks.lock_for_call("a", Duration::from_millis(30)).is_none(), "bounded");
        let t = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(50));
            drop(repair);
        });
        assert!(locks.lock_for_call("a", Duration::from_secs(10)).is_some(), "taken once the repair ends");
        t.join().unwrap();
    }

    #[test]
    fn released_on_panic() {
        let locks = VolumeLocks::new();
        let l = locks.clone();
        let _ = std::thread::spawn(move || {
            let _g = l.try_lock("v").unwrap();
            panic!("handler bug");
        })
        .join();
        assert!(locks.try_lock("v").is_some());
    }
}
