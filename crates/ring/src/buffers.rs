//! Memory the kernel reads and writes while operations are in flight.
//!
//! [`Buffers`] hands out page-aligned buffers by id: small ones from an
//! arena registered with the ring (so reads and writes of the image use
//! READ_FIXED/WRITE_FIXED and skip the per-call page pinning), larger ones
//! from a size-class cache on the heap. A buffer that an operation still
//! uses cannot be borrowed and is only released after its last completion,
//! so freeing early is safe. [`RecvPool`] is the provided-buffer ring that
//! multishot receives pick from: idle connections hold no memory at all.
//!
//! Memory goes back to the system when the load is gone, and a buffer
//! takes exactly its class from it (no allocator headers or alignment
//! slack): buffers of 128 KiB and more are their own mappings, unmapped
//! when freed; smaller ones are slots carved from 1 MiB mappings, whose
//! pages are handed back (MADV_DONTNEED) when freed past the bounded cache
//! or by [`Buffers::trim`]. [`Buffers::cost_of`] is what a buffer of a
//! length takes, so callers can charge it before they allocate.

use std::alloc::Layout;
use std::io;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU16, Ordering};

use io_uring::types::BufRingEntry;

const PAGE: usize = 4096;
/// Heap classes are powers of two from 4 KiB up to 64 MiB.
const CLASSES: usize = 15;
/// Classes from this one up (128 KiB) are mappings of their own, unmapped
/// when freed: a buffer costs exactly its class, and whether its memory
/// comes back never rests on the allocator's thresholds (glibc raises them
/// as large blocks are freed; `allocator` pins them for everything else).
const MAP_CLASS: usize = 5;
/// Smaller classes are carved from mappings of this size.
const CHUNK: usize = 1 << 20;

/// A buffer's handle; only meaningful to the [`Buffers`] that made it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct BufId(pub(super) u32);

#[derive(Clone, Copy)]
enum Mem {
    Arena(u32),
    Heap { ptr: NonNull<u8>, class: usize },
}

struct Slot {
    mem: Mem,
    len: usize,
    /// Operations that still use this buffer.
    busy: u32,
    /// Freed by its owner while busy: release at the last completion.
    orphan: bool,
}

/// An anonymous mapping, unmapped on drop.
pub(super) struct Mapping {
    ptr: NonNull<u8>,
    len: usize,
}

impl Mapping {
    pub(super) fn new(len: usize) -> io::Result<Self> {
        // SAFETY: a fresh private anonymous mapping; no existing memory is touched.
        let p = unsafe {
            rustix::mm::mmap_anonymous(
                std::ptr::null_mut(),
                len,
                rustix::mm::ProtFlags::READ | rustix::mm::ProtFlags::WRITE,
                rustix::mm::MapFlags::PRIVATE,
            )?
        };
        Ok(Self { ptr: NonNull::new(p.cast()).ok_or_else(|| io::Error::other("mmap returned null"))?, len })
    }

    pub(super) fn as_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    /// Gives the mapping's pages back to the kernel; they read as zeroes
    /// when next touched. Only for memory nothing (the kernel included) is
    /// reading or writing now: bytes written while a page is dropped are
    /// lost. Never for memory registered with the kernel (the arena): its
    /// pinned pages would stop being the ones the process sees.
    fn discard(&mut self) -> io::Result<()> {
        // SAFETY: the range is exactly this private anonymous mapping, which
        // stays mapped and is not registered (pinned) with the kernel;
        // MADV_DONTNEED only drops its pages (zero-filled on the next touch),
        // `&mut self` keeps every slice of it out of scope, and the caller
        // has made sure the kernel uses none of it.
        unsafe { rustix::mm::madvise(self.ptr.as_ptr().cast(), self.len, rustix::mm::Advice::LinuxDontNeed) }?;
        Ok(())
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: the mapping was made by `new` with this length and is not
        // used after drop (owners leak it instead while the kernel may hold it).
        unsafe {
            let _ = rustix::mm::munmap(self.ptr.as_ptr().cast(), self.len);
        }
    }
}

/// Buffers by id, for one ring.
pub struct Buffers {
    slots: Vec<Option<Slot>>,
    free_ids: Vec<u32>,
    arena: Mapping,
    arena_slot: usize,
    arena_free: Vec<u32>,
    /// Freed blocks kept for reuse, their pages resident.
    cache: [Vec<NonNull<u8>>; CLASSES],
    cached_bytes: usize,
    cache_limit: usize,
    /// Heap bytes freed since the last [`Buffers::trim`].
    freed_since_trim: usize,
    /// Mappings small classes are carved from, for the life of the ring
    /// (address space only: free slots' pages are handed back).
    chunks: Vec<Mapping>,
    /// Free slots of small classes whose pages were handed back.
    cold: [Vec<NonNull<u8>>; MAP_CLASS],
}

fn class_of(len: usize) -> Option<usize> {
    let size = len.max(PAGE).next_power_of_two();
    let class = (size.trailing_zeros() - PAGE.trailing_zeros()) as usize;
    (class < CLASSES).then_some(class)
}

fn class_layout(class: usize) -> Layout {
    Layout::from_size_align(PAGE << class, PAGE).expect("valid layout")
}

/// A fresh private anonymous mapping of `len` bytes, kept until unmapped by hand.
fn map(len: usize) -> Option<NonNull<u8>> {
    // SAFETY: a fresh private anonymous mapping; no existing memory is touched.
    let p = unsafe {
        rustix::mm::mmap_anonymous(
            std::ptr::null_mut(),
            len,
            rustix::mm::ProtFlags::READ | rustix::mm::ProtFlags::WRITE,
            rustix::mm::MapFlags::PRIVATE,
        )
    };
    p.ok().and_then(|p| NonNull::new(p.cast::<u8>()))
}

impl Buffers {
    /// `arena_slots` buffers of `arena_slot` bytes (a multiple of 4 KiB) for
    /// registration; heap buffers beyond that, with up to `cache_limit` bytes
    /// of freed ones kept for reuse.
    pub(super) fn new(arena_slots: u32, arena_slot: usize, cache_limit: usize) -> io::Result<Self> {
        let arena_slot = arena_slot.max(PAGE).next_multiple_of(PAGE);
        let arena = Mapping::new(arena_slot * arena_slots.max(1) as usize)?;
        Ok(Self {
            slots: Vec::new(),
            free_ids: Vec::new(),
            arena,
            arena_slot,
            arena_free: (0..arena_slots).rev().collect(),
            cache: Default::default(),
            cached_bytes: 0,
            cache_limit,
            freed_since_trim: 0,
            chunks: Vec::new(),
            cold: Default::default(),
        })
    }

    /// A block of a class that no buffer uses: a cold slot or a fresh
    /// mapping. Zeroed or left by an earlier user; page-aligned.
    fn heap_alloc(&mut self, class: usize) -> NonNull<u8> {
        let size = PAGE << class;
        if class >= MAP_CLASS {
            return map(size).unwrap_or_else(|| std::alloc::handle_alloc_error(class_layout(class)));
        }
        if let Some(p) = self.cold[class].pop() {
            return p;
        }
        let Some(chunk) = Mapping::new(CHUNK).ok() else { std::alloc::handle_alloc_error(class_layout(class)) };
        let base = chunk.as_ptr();
        // Slots after the first are kept for later; untouched, they take no memory.
        for i in (1..CHUNK / size).rev() {
            // SAFETY: pointer arithmetic only; i * size < CHUNK, inside the mapping.
            self.cold[class].push(NonNull::new(unsafe { base.add(i * size) }).expect("inside a mapping"));
        }
        self.chunks.push(chunk);
        NonNull::new(base).expect("mappings are not null")
    }

    /// Gives a block's memory back to the system.
    ///
    /// # Safety
    /// `ptr` came from `heap_alloc(class)` of this `Buffers` and nothing uses it any more.
    unsafe fn heap_free(&mut self, ptr: NonNull<u8>, class: usize) {
        let size = PAGE << class;
        if class >= MAP_CLASS {
            // SAFETY: per the contract, a mapping of exactly this size made by heap_alloc.
            unsafe {
                let _ = rustix::mm::munmap(ptr.as_ptr().cast(), size);
            }
        } else {
            // SAFETY: per the contract the slot is unused; its pages read as
            // zeroes from now on, which is a valid state for a buffer.
            unsafe {
                let _ = rustix::mm::madvise(ptr.as_ptr().cast(), size, rustix::mm::Advice::LinuxDontNeed);
            }
            self.cold[class].push(ptr);
        }
    }

    /// Bytes a buffer of `len` takes from the system (its heap class),
    /// whether it ends up in the arena or not: what a caller charges
    /// before it allocates.
    pub fn cost_of(len: usize) -> usize {
        PAGE << class_of(len).unwrap_or(CLASSES - 1)
    }

    /// Empties the cache of freed buffers and asks the allocator to give
    /// its free pages back; for a ring with nothing to do. Returns the
    /// bytes released from the cache.
    pub(crate) fn trim(&mut self) -> usize {
        let released = self.cached_bytes;
        for class in 0..CLASSES {
            while let Some(p) = self.cache[class].pop() {
                // SAFETY: cached blocks came from heap_alloc(class) and are unused.
                unsafe { self.heap_free(p, class) };
            }
        }
        self.cached_bytes = 0;
        if self.freed_since_trim > 0 {
            self.freed_since_trim = 0;
            crate::allocator::release_free_pages();
        }
        released
    }

    /// Counts memory the owner freed outside the buffers (request tables,
    /// vectors of a past burst), so the next [`Buffers::trim`] also asks
    /// the allocator to return free pages when no buffer was freed.
    pub(crate) fn note_freed(&mut self, bytes: usize) {
        self.freed_since_trim += bytes;
    }

    /// The arena as iovecs, one per slot, in slot order (for registration).
    pub(super) fn arena_iovecs(&self) -> Vec<libc::iovec> {
        let n = self.arena.len / self.arena_slot;
        (0..n)
            .map(|i| {
                // SAFETY: pointer arithmetic only; every offset stays inside the arena mapping.
                let base = unsafe { self.arena.as_ptr().add(i * self.arena_slot) };
                libc::iovec { iov_base: base.cast(), iov_len: self.arena_slot }
            })
            .collect()
    }

    /// A buffer of `len` bytes, page-aligned. Its contents are whatever the
    /// last user left (never uninitialised memory).
    pub fn alloc(&mut self, len: usize) -> BufId {
        self.alloc_in(len, true)
    }

    /// A buffer that never takes a registered arena slot: for bytes only
    /// ever sent (reply headers), so the arena stays for file I/O.
    pub fn alloc_heap(&mut self, len: usize) -> BufId {
        self.alloc_in(len, false)
    }

    fn alloc_in(&mut self, len: usize, arena: bool) -> BufId {
        let mem = match self.arena_free.pop() {
            Some(i) if arena && len <= self.arena_slot => Mem::Arena(i),
            other => {
                if let Some(i) = other {
                    self.arena_free.push(i);
                }
                let class = class_of(len).unwrap_or(CLASSES - 1);
                let ptr = match self.cache[class].pop() {
                    Some(p) => {
                        self.cached_bytes -= PAGE << class;
                        p
                    }
                    None => self.heap_alloc(class),
                };
                Mem::Heap { ptr, class }
            }
        };
        let len = match &mem {
            Mem::Arena(_) => len.min(self.arena_slot),
            Mem::Heap { class, .. } => len.min(PAGE << class),
        };
        let slot = Slot { mem, len, busy: 0, orphan: false };
        match self.free_ids.pop() {
            Some(id) => {
                self.slots[id as usize] = Some(slot);
                BufId(id)
            }
            None => {
                self.slots.push(Some(slot));
                BufId(self.slots.len() as u32 - 1)
            }
        }
    }

    fn slot(&self, id: BufId) -> Option<&Slot> {
        self.slots.get(id.0 as usize)?.as_ref()
    }

    fn ptr(&self, mem: Mem) -> *mut u8 {
        match mem {
            // SAFETY: pointer arithmetic only; slot index < number of arena slots.
            Mem::Arena(i) => unsafe { self.arena.as_ptr().add(i as usize * self.arena_slot) },
            Mem::Heap { ptr, .. } => ptr.as_ptr(),
        }
    }

    /// The buffer's bytes, unless an operation is using it.
    pub fn get(&self, id: BufId) -> Option<&[u8]> {
        let s = self.slot(id).filter(|s| s.busy == 0)?;
        // SAFETY: the memory is initialised, `len` bytes long, owned by this
        // slot, and no kernel operation uses it (busy == 0).
        Some(unsafe { std::slice::from_raw_parts(self.ptr(s.mem), s.len) })
    }

    /// The buffer's bytes for writing, unless an operation is using it.
    pub fn get_mut(&mut self, id: BufId) -> Option<&mut [u8]> {
        let s = self.slot(id).filter(|s| s.busy == 0)?;
        let (p, len) = (self.ptr(s.mem), s.len);
        // SAFETY: as in `get`, and `&mut self` makes the borrow unique.
        Some(unsafe { std::slice::from_raw_parts_mut(p, len) })
    }

    pub fn len(&self, id: BufId) -> usize {
        self.slot(id).map_or(0, |s| s.len)
    }

    /// Gives the buffer back; if an operation still uses it, that happens at
    /// its last completion.
    pub fn free(&mut self, id: BufId) {
        let Some(Some(s)) = self.slots.get_mut(id.0 as usize) else { return };
        if s.busy > 0 {
            s.orphan = true;
            return;
        }
        self.release(id);
    }

    fn release(&mut self, id: BufId) {
        let Some(s) = self.slots[id.0 as usize].take() else { return };
        self.free_ids.push(id.0);
        match s.mem {
            Mem::Arena(i) => self.arena_free.push(i),
            Mem::Heap { ptr, class } => {
                self.freed_since_trim += PAGE << class;
                if self.cached_bytes + (PAGE << class) <= self.cache_limit {
                    self.cached_bytes += PAGE << class;
                    self.cache[class].push(ptr);
                } else {
                    // SAFETY: made by heap_alloc(class) in `alloc`; the slot is gone.
                    unsafe { self.heap_free(ptr, class) };
                }
            }
        }
    }

    /// Pointer, length and registered index (arena slots) of a range of the
    /// buffer, marking it busy. `None` when the id is stale or the range is
    /// outside the buffer.
    pub(super) fn lend(&mut self, id: BufId, start: usize, end: usize) -> Option<(*mut u8, u32, Option<u16>)> {
        let s = self.slots.get_mut(id.0 as usize)?.as_mut()?;
        if start > end || end > s.len {
            return None;
        }
        s.busy += 1;
        let index = match s.mem {
            Mem::Arena(i) => u16::try_from(i).ok(),
            Mem::Heap { .. } => None,
        };
        let mem = s.mem;
        // SAFETY: pointer arithmetic only; start <= len of this buffer.
        let p = unsafe { self.ptr(mem).add(start) };
        Some((p, (end - start) as u32, index))
    }

    /// An operation that used the buffer has ended.
    pub(super) fn give_back(&mut self, id: BufId) {
        let Some(Some(s)) = self.slots.get_mut(id.0 as usize) else { return };
        s.busy = s.busy.saturating_sub(1);
        if s.busy == 0 && s.orphan {
            self.release(id);
        }
    }
}

impl Drop for Buffers {
    fn drop(&mut self) {
        // Small classes go with their chunks; large ones are unmapped here.
        let large: Vec<(NonNull<u8>, usize)> = self
            .slots
            .drain(..)
            .flatten()
            .filter_map(|s| match s.mem {
                Mem::Heap { ptr, class } if class >= MAP_CLASS => Some((ptr, class)),
                _ => None,
            })
            .collect();
        for (ptr, class) in large {
            // SAFETY: made by heap_alloc(class); the ring that used it has
            // ended every operation (or leaked us).
            unsafe { self.heap_free(ptr, class) };
        }
        for class in MAP_CLASS..CLASSES {
            while let Some(p) = self.cache[class].pop() {
                // SAFETY: cached blocks came from heap_alloc(class) and are unused.
                unsafe { self.heap_free(p, class) };
            }
        }
    }
}

/// A provided-buffer ring: the kernel picks a buffer for each multishot
/// receive completion and the driver gives it back with [`RecvPool::recycle`].
pub(super) struct RecvPool {
    ring: Mapping,
    data: Mapping,
    entries: u16,
    size: usize,
    tail: u16,
    pub(super) group: u16,
    /// Buffers a completion handed to the driver and not recycled yet.
    taken: Vec<bool>,
    taken_count: u16,
    /// Writes in flight from each buffer: a buffer recycled while any
    /// is goes back to the kernel when the last one ends (`recycle_due`),
    /// so no receive overwrites bytes a write is still reading.
    lent: Vec<u16>,
    recycle_due: Vec<bool>,
    /// Buffers with at least one write in flight.
    lent_count: u16,
    /// Diagnostic counters: hand-outs, hand-outs of a buffer already out,
    /// recycles, and recycles of a buffer that was not out.
    pub(super) counts: [u64; 4],
}

impl RecvPool {
    pub(super) fn new(entries: u16, size: usize, group: u16) -> io::Result<Self> {
        if !entries.is_power_of_two() {
            return Err(io::Error::new(io::ErrorKind::InvalidInput, "provided buffer count must be a power of two"));
        }
        let ring = Mapping::new((usize::from(entries) * std::mem::size_of::<BufRingEntry>()).next_multiple_of(PAGE))?;
        let data = Mapping::new(usize::from(entries) * size)?;
        let n = usize::from(entries);
        let mut pool = Self {
            ring,
            data,
            entries,
            size,
            tail: 0,
            group,
            taken: vec![false; n],
            taken_count: 0,
            lent: vec![0; n],
            recycle_due: vec![false; n],
            lent_count: 0,
            counts: [0; 4],
        };
        pool.refill();
        Ok(pool)
    }

    /// Puts every buffer the driver does not hold into an empty ring, from
    /// the start: for a ring (re-)registered with the kernel, whose head is 0.
    pub(super) fn refill(&mut self) {
        self.tail = 0;
        for bid in 0..self.entries {
            if !self.taken[usize::from(bid)] {
                self.push(bid);
            }
        }
        self.publish();
    }

    /// A completion handed buffer `bid` to the driver.
    pub(super) fn mark_taken(&mut self, bid: u16) {
        let slot = &mut self.taken[usize::from(bid % self.entries)];
        self.counts[0] += 1;
        if !*slot {
            *slot = true;
            self.taken_count += 1;
        } else {
            self.counts[1] += 1;
        }
    }

    /// Gives every buffer's pages back to the kernel, for a ring with no
    /// receive from the pool armed (the caller's to know: then the kernel
    /// picks no buffer). True when done; false, with nothing done, while the
    /// driver holds a buffer or lends one to a write. A receive armed later
    /// writes into fresh zeroed pages.
    pub(super) fn discard_pages(&mut self) -> io::Result<bool> {
        if self.taken_count > 0 || self.lent_count > 0 {
            return Ok(false);
        }
        self.data.discard()?;
        Ok(true)
    }

    /// Buffers the driver holds (taken and not recycled).
    pub(super) fn taken(&self) -> u16 {
        self.taken_count
    }

    /// Makes the ring look empty to a kernel that registers it next, as a
    /// kernel that lost every buffer sees it (tests only).
    #[cfg(test)]
    pub(super) fn forget_all(&mut self) {
        self.tail = 0;
        self.publish();
    }

    pub(super) fn ring_addr(&self) -> u64 {
        self.ring.as_ptr() as u64
    }

    pub(super) fn entries(&self) -> u16 {
        self.entries
    }

    fn push(&mut self, bid: u16) {
        let base = self.ring.as_ptr().cast::<BufRingEntry>();
        let idx = usize::from(self.tail & (self.entries - 1));
        // SAFETY: idx < entries, inside the ring mapping; the kernel only reads
        // entries between its head and the published tail, and this one is past it.
        let entry = unsafe { &mut *base.add(idx) };
        // SAFETY: pointer arithmetic only; bid < entries, inside the data mapping.
        entry.set_addr(unsafe { self.data.as_ptr().add(usize::from(bid) * self.size) } as u64);
        entry.set_len(self.size as u32);
        entry.set_bid(bid);
        self.tail = self.tail.wrapping_add(1);
    }

    fn publish(&self) {
        // SAFETY: the tail field lives in the first entry of our mapping and
        // the kernel reads it atomically; u16 alignment holds.
        let tail = unsafe { &*BufRingEntry::tail(self.ring.as_ptr().cast::<BufRingEntry>()).cast::<AtomicU16>() };
        tail.store(self.tail, Ordering::Release);
    }

    /// The first `len` bytes the kernel wrote into buffer `bid`.
    pub(super) fn data(&self, bid: u16, len: usize) -> &[u8] {
        let bid = bid % self.entries;
        // SAFETY: the kernel finished writing this buffer (its completion was
        // reaped) and does not reuse it until `recycle`; len is clamped.
        unsafe { std::slice::from_raw_parts(self.data.as_ptr().add(usize::from(bid) * self.size), len.min(self.size)) }
    }

    /// Lends bytes `start..end` of buffer `bid` to a write: their address
    /// and length, or None when the buffer is not the driver's (not handed
    /// out, or already recycled) or the range is outside it. The buffer
    /// stays out of the kernel's hands until [`RecvPool::give_back`].
    pub(super) fn lend(&mut self, bid: u16, start: usize, end: usize) -> Option<(*const u8, u32)> {
        let i = usize::from(bid);
        if bid >= self.entries || !self.taken[i] || self.recycle_due[i] || start >= end || end > self.size {
            return None;
        }
        self.lent[i] += 1;
        if self.lent[i] == 1 {
            self.lent_count += 1;
        }
        // SAFETY: pointer arithmetic only; bid < entries and end <= size, so
        // the range is inside the data mapping.
        Some((unsafe { self.data.as_ptr().add(i * self.size + start) }.cast_const(), (end - start) as u32))
    }

    /// A write lent bytes of buffer `bid` ended; a buffer recycled meanwhile
    /// goes back to the kernel with the last one.
    pub(super) fn give_back(&mut self, bid: u16) {
        let i = usize::from(bid % self.entries);
        if self.lent[i] == 0 {
            return;
        }
        self.lent[i] -= 1;
        if self.lent[i] == 0 {
            self.lent_count -= 1;
            if std::mem::take(&mut self.recycle_due[i]) {
                self.recycle(bid);
            }
        }
    }

    /// Buffers with a write in flight.
    pub(super) fn lent(&self) -> u16 {
        self.lent_count
    }

    pub(super) fn recycle(&mut self, bid: u16) {
        let bid = bid % self.entries;
        if self.lent[usize::from(bid)] > 0 {
            // A write still reads it: back with the last one.
            self.recycle_due[usize::from(bid)] = true;
            return;
        }
        let slot = &mut self.taken[usize::from(bid)];
        if !*slot {
            // Not handed out (or already back): pushing it again would put
            // one buffer in the ring twice, for two receives at once.
            self.counts[3] += 1;
            return;
        }
        self.counts[2] += 1;
        *slot = false;
        self.taken_count -= 1;
        self.push(bid);
        self.publish();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn freeing_a_busy_buffer_waits_for_its_operation() {
        let mut b = Buffers::new(2, 8192, 1 << 20).unwrap();
        let id = b.alloc(100);
        b.get_mut(id).unwrap()[0] = 7;
        let (_, len, index) = b.lend(id, 0, 100).unwrap();
        assert_eq!((len, index.is_some()), (100, true));
        assert!(b.get(id).is_none(), "busy buffers are not readable");
        b.free(id);
        let other = b.alloc(100);
        assert_ne!(other, id, "an orphan keeps its id until its operation ends");
        b.give_back(id);
        let again = b.alloc(100);
        assert_eq!(again, id);
    }

    /// Two writes from one receive buffer: recycled while both read it, it
    /// goes back with the second's end, not the first's; a buffer the
    /// driver does not hold, or a range outside it, is not lent.
    #[test]
    fn a_lent_receive_buffer_goes_back_with_its_last_write() {
        let mut pool = RecvPool::new(4, 4096, 0).unwrap();
        assert!(pool.lend(1, 0, 10).is_none(), "not handed out");
        pool.mark_taken(1);
        assert!(pool.lend(1, 4000, 5000).is_none(), "outside the buffer");
        assert!(pool.lend(1, 0, 100).is_some() && pool.lend(1, 100, 200).is_some());
        pool.recycle(1);
        assert_eq!((pool.taken(), pool.lent()), (1, 1));
        assert!(pool.lend(1, 0, 10).is_none(), "recycled: no longer the driver's");
        pool.give_back(1);
        assert_eq!((pool.taken(), pool.lent()), (1, 1), "one write still reads it");
        pool.give_back(1);
        assert_eq!((pool.taken(), pool.lent()), (0, 0), "back to the kernel with the last one");
        pool.give_back(1);
        assert_eq!(pool.lent(), 0, "a stray give-back changes nothing");
    }

    #[test]
    fn large_buffers_come_from_the_heap_cache() {
        let mut b = Buffers::new(1, 4096, 4 << 20).unwrap();
        let big = b.alloc(1 << 20);
        assert_eq!(b.len(big), 1 << 20);
        assert_eq!(b.get(big).unwrap().as_ptr() as usize % PAGE, 0);
        let (_, _, index) = b.lend(big, 0, 10).unwrap();
        assert!(index.is_none());
        b.give_back(big);
        b.free(big);
        assert_eq!(b.cached_bytes, 1 << 20);
        let again = b.alloc(700_000);
        assert_eq!(b.cached_bytes, 0);
        assert_eq!(b.len(again), 700_000);
        assert!(b.lend(again, 0, 800_000).is_none(), "ranges are bounds-checked");
    }

    #[test]
    fn cost_is_the_class_and_trim_empties_the_cache() {
        assert_eq!(Buffers::cost_of(1), 4096);
        assert_eq!(Buffers::cost_of(4096 + 64), 8192);
        assert_eq!(Buffers::cost_of(1 << 20), 1 << 20);
        let mut b = Buffers::new(1, 4096, 8 << 20).unwrap();
        let ids: Vec<_> = (0..4).map(|_| b.alloc(1 << 20)).collect();
        for id in ids {
            b.free(id);
        }
        assert_eq!(b.cached_bytes, 4 << 20);
        assert_eq!(b.trim(), 4 << 20);
        assert_eq!(b.cached_bytes, 0);
        let id = b.alloc(300_000);
        b.get_mut(id).unwrap()[299_999] = 1;
        b.free(id);
    }
}
