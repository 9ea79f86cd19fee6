//! The op table: every operation a ring has handed to the kernel, by the
//! `user_data` its completions carry.
//!
//! A `user_data` is the op's slab key (low 32 bits) and a generation (high 32
//! bits) taken from a counter that moves on every insert. Slab keys are
//! reused as soon as an op ends, so the key alone would let a late
//! completion of an ended op (one that was abandoned, or whose cancel raced
//! with its end) be taken for the newer op in the same slot; with the
//! generation it matches nothing and is counted as stale instead. The
//! counter wraps after 2^32 − 1 inserts, so a completion would have to
//! arrive four billion operations late to be mistaken — far beyond any
//! cancel deadline in this crate.
//!
//! Generation `u32::MAX` is never issued: user_data values with it are free
//! for an engine's own fixed operations ([`WAKE`], [`IGNORED`]).

use slab::Slab;

/// The multishot poll on a ring thread's command eventfd.
pub(super) const WAKE: u64 = u64::MAX;
/// Operations whose completions nobody waits for (cancel requests).
pub(super) const IGNORED: u64 = u64::MAX - 1;
/// The one request that cancels every op of a ring being dropped.
pub(super) const CANCEL_ALL: u64 = u64::MAX - 2;

const RESERVED_GEN: u32 = u32::MAX;

/// Slots an idle table keeps however few ops it holds: room for a ring's
/// steady work without growing again.
const KEPT_SLOTS: usize = 64;

struct Entry<T> {
    generation: u32,
    op: T,
}

/// One completion matched to its op.
#[derive(Debug)]
pub(super) struct Reaped<T> {
    pub(super) user_data: u64,
    /// The kernel's result: bytes, events, an fd, or a negative errno.
    pub(super) res: i32,
    /// io_uring's CQE flags (buffer id, `MORE`); 0 for the epoll engine.
    pub(super) flags: u32,
    /// A multishot op stays in the table; the op is `last` then.
    pub(super) more: bool,
    /// The op, on its last completion: it has left the table and nothing in
    /// the kernel refers to what it holds any more.
    pub(super) last: Option<T>,
}

/// Operations in flight, each holding what the kernel may touch until its
/// last completion.
pub(super) struct OpTable<T> {
    slab: Slab<Entry<T>>,
    next_generation: u32,
    stale: u64,
}

impl<T> Default for OpTable<T> {
    fn default() -> Self {
        Self::with_capacity(0)
    }
}

/// The one place a `user_data` is made and taken apart: slab key in the
/// low 32 bits, generation in the high 32. Drivers never see it: their
/// tokens (typed, see `Cqe`) stay in the table beside the op.
fn join(key: usize, generation: u32) -> u64 {
    (u64::from(generation) << 32) | key as u64
}

fn split(user_data: u64) -> (usize, u32) {
    ((user_data & 0xffff_ffff) as usize, (user_data >> 32) as u32)
}

/// Whether `user_data` is one of an engine's fixed values ([`WAKE`],
/// [`IGNORED`], ...): generation `u32::MAX`, which no op gets.
pub(super) fn is_reserved(user_data: u64) -> bool {
    split(user_data).1 == RESERVED_GEN
}

impl<T> OpTable<T> {
    pub(super) fn with_capacity(n: usize) -> Self {
        Self { slab: Slab::with_capacity(n), next_generation: 0, stale: 0 }
    }

    /// Records `op`; returns the user_data its submission must carry.
    pub(super) fn insert(&mut self, op: T) -> u64 {
        self.next_generation = self.next_generation.wrapping_add(1);
        if self.next_generation == RESERVED_GEN {
            self.next_generation = 0;
        }
        let generation = self.next_generation;
        let key = self.slab.insert(Entry { generation, op });
        debug_assert!(key <= u32::MAX as usize, "more than 2^32 ops in flight");
        join(key, generation)
    }

    fn entry(&self, user_data: u64) -> Option<&Entry<T>> {
        let (key, generation) = split(user_data);
        self.slab.get(key).filter(|e| e.generation == generation)
    }

    pub(super) fn contains(&self, user_data: u64) -> bool {
        self.entry(user_data).is_some()
    }

    pub(super) fn get(&self, user_data: u64) -> Option<&T> {
        self.entry(user_data).map(|e| &e.op)
    }

    pub(super) fn get_mut(&mut self, user_data: u64) -> Option<&mut T> {
        let (key, generation) = split(user_data);
        self.slab.get_mut(key).filter(|e| e.generation == generation).map(|e| &mut e.op)
    }

    /// Takes an op out: only for one the kernel never received (its
    /// submission failed) or whose last completion was reaped.
    pub(super) fn remove(&mut self, user_data: u64) -> Option<T> {
        self.contains(user_data).then(|| self.slab.remove(split(user_data).0).op)
    }

    /// Matches a completion: `None` when it belongs to no live op (stale).
    pub(super) fn complete(&mut self, user_data: u64, res: i32, flags: u32, more: bool) -> Option<Reaped<T>> {
        if !self.contains(user_data) {
            self.stale += 1;
            return None;
        }
        let last = if more { None } else { self.remove(user_data) };
        Some(Reaped { user_data, res, flags, more, last })
    }

    pub(super) fn len(&self) -> usize {
        self.slab.len()
    }

    pub(super) fn is_empty(&self) -> bool {
        self.slab.is_empty()
    }

    /// Completions that matched no live op, since the table was made.
    pub(super) fn stale(&self) -> u64 {
        self.stale
    }

    /// Slots the table has room for (live or free).
    #[cfg(test)]
    pub(super) fn capacity(&self) -> usize {
        self.slab.capacity()
    }

    /// Gives back the slots of a past burst, for an idle ring: a burst of
    /// thousands of ops (40 clients each with hundreds of requests) left
    /// the table that large for good, pinning its pages and the
    /// allocator's around them. An op the kernel holds keeps its key, so
    /// the table shrinks only down to its highest live key; the free
    /// slots below are then handed out lowest first. Returns the bytes
    /// freed.
    pub(super) fn shrink(&mut self) -> usize {
        let before = self.slab.capacity();
        if before <= KEPT_SLOTS {
            return 0;
        }
        self.slab.shrink_to_fit();
        if self.slab.capacity() < KEPT_SLOTS {
            // Exactly: `reserve` would double past the kept slots, and the
            // next idle tick would shrink them again.
            self.slab.reserve_exact(KEPT_SLOTS - self.slab.len());
        }
        before.saturating_sub(self.slab.capacity()) * std::mem::size_of::<Entry<T>>()
    }

    pub(super) fn user_datas(&self) -> Vec<u64> {
        self.slab.iter().map(|(key, e)| join(key, e.generation)).collect()
    }

    /// Gives up on every op left: what they hold is never freed, since the
    /// kernel may still write it. Returns how many there were.
    pub(super) fn leak_all(&mut self) -> usize {
        let n = self.slab.len();
        std::mem::forget(std::mem::take(&mut self.slab));
        n
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stale_completion_never_matches_the_op_that_reused_its_slot() {
        let mut t = OpTable::default();
        let old = t.insert("old");
        assert_eq!(t.complete(old, 0, 0, false).and_then(|r| r.last), Some("old"));
        let new = t.insert("new");
        assert_eq!(split(new).0, split(old).0, "the slab reuses the slot");
        assert_ne!(new, old);
        assert!(t.complete(old, 5, 0, false).is_none(), "the late completion is stale");
        assert_eq!(t.stale(), 1);
        assert_eq!(t.get(new), Some(&"new"), "and the new op is untouched");
    }

    #[test]
    fn multishot_ops_stay_until_their_last_completion() {
        let mut t = OpTable::default();
        let ud = t.insert(7u8);
        let r = t.complete(ud, 1, 0, true).unwrap();
        assert!(r.last.is_none());
        assert_eq!(t.len(), 1);
        assert_eq!(t.complete(ud, 1, 0, false).unwrap().last, Some(7));
        assert!(t.is_empty());
    }

    #[test]
    fn a_table_shrinks_after_a_burst_down_to_its_highest_live_key() {
        let mut t = OpTable::default();
        let burst: Vec<u64> = (0..5000u32).map(|i| t.insert(i)).collect();
        // Two ops outlive the burst: one low, one at key 99.
        for (i, &ud) in burst.iter().enumerate() {
            if i != 3 && i != 99 {
                assert!(t.complete(ud, 0, 0, false).is_some());
            }
        }
        assert!(t.capacity() >= 5000);
        let freed = t.shrink();
        assert!(t.capacity() < 200, "the table kept {} slots for 2 ops", t.capacity());
        assert!(freed >= 4800 * std::mem::size_of::<Entry<u32>>());
        assert_eq!((t.get(burst[3]), t.get(burst[99])), (Some(&3), Some(&99)), "live ops keep their keys");
        let next = t.insert(7);
        assert_eq!(split(next).0, 0, "the lowest free key is handed out first");
        assert_eq!(t.shrink(), 0, "nothing is past the highest live key now");
        assert!(t.capacity() >= KEPT_SLOTS);
    }

    #[test]
    fn a_table_shrunk_below_the_kept_slots_keeps_exactly_those() {
        let mut t = OpTable::default();
        let burst: Vec<u64> = (0..5000u32).map(|i| t.insert(i)).collect();
        for (i, &ud) in burst.iter().enumerate() {
            if i != 40 {
                t.complete(ud, 0, 0, false);
            }
        }
        assert!(t.shrink() > 0);
        assert_eq!(t.capacity(), KEPT_SLOTS);
        assert_eq!(t.shrink(), 0, "the next idle tick finds nothing to give back");
        assert_eq!(t.capacity(), KEPT_SLOTS);
        assert_eq!(t.get(burst[40]), Some(&40));
    }

    #[test]
    fn reserved_user_data_is_never_issued() {
        let mut t = OpTable::<()> { next_generation: RESERVED_GEN - 1, ..Default::default() };
        let a = t.insert(());
        let b = t.insert(());
        for ud in [a, b] {
            assert!(!is_reserved(ud));
        }
        assert!(is_reserved(WAKE) && is_reserved(IGNORED));
        assert!(!t.contains(WAKE) && !t.contains(IGNORED));
    }
}
