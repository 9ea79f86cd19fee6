//! One operation per volume at a time, without waiting.
//!
//! The CSI spec asks a plugin to answer `Aborted` when an operation on the
//! same volume is in flight (the CO retries with backoff), so the lock is a
//! try-lock: a call never queues behind another, and calls on different
//! volumes never touch each other's entries.

use std::collections::HashSet;
use std::sync::{Arc, Mutex};

#[derive(Default, Clone)]
pub struct VolumeLocks {
    held: Arc<Mutex<HashSet<String>>>,
}

/// Held while an operation runs; releases the volume when dropped (also
/// when the operation panics).
pub struct VolumeGuard {
    held: Arc<Mutex<HashSet<String>>>,
    id: String,
}

impl VolumeLocks {
    pub fn new() -> Self {
        Self::default()
    }

    /// Takes the volume, or `None` when another operation holds it.
    pub fn try_lock(&self, id: &str) -> Option<VolumeGuard> {
        let mut held = self.held.lock().unwrap_or_else(|e| e.into_inner());
        held.insert(id.to_string()).then(|| VolumeGuard { held: self.held.clone(), id: id.to_string() })
    }

    pub fn held(&self) -> usize {
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
