//! The process allocator's part in giving memory back: what a ring with
//! nothing to do asks of glibc's malloc, beside the pages [`Buffers`]
//! hands back itself.
//!
//! [`Buffers`]: crate::Buffers
//! [`IoRing`]: crate::IoRing

/// Where glibc's malloc starts both thresholds, and where they stay.
#[cfg(target_env = "gnu")]
const THRESHOLD: libc::c_int = 128 * 1024;

/// Keeps glibc's mmap and trim thresholds at their starting values
/// (128 KiB) for the whole process, so an idle ring's trim really gives
/// memory back. Idempotent; every [`IoRing`] calls it as it is made.
///
/// glibc raises both when it frees a large block it had mapped: the mmap
/// threshold to that block's size, the trim threshold to twice it. A
/// ring's trim frees exactly such blocks (a past burst's request table,
/// dropped whole). From then on, blocks that large come from the ring
/// thread's arena instead, and that arena's free top stays resident up to
/// the raised trim threshold: `malloc_trim` trims the top of the main
/// arena only. After 40 hostile clients had left, each ring thread's arena
/// held 1.9 MiB resident with 0.6-0.8 MiB in use, the RSS the NBD memory
/// test found never came back. Setting the thresholds turns their
/// adjustment off, for every thread of the process: blocks of 128 KiB and
/// more are then always mappings of their own, unmapped when freed.
pub(crate) fn pin_thresholds() {
    #[cfg(target_env = "gnu")]
    {
        static PINNED: std::sync::Once = std::sync::Once::new();
        PINNED.call_once(|| {
            for param in [libc::M_MMAP_THRESHOLD, libc::M_TRIM_THRESHOLD] {
                // SAFETY: mallopt only changes the allocator's tuning; it
                // takes no pointer and glibc locks its own state.
                if unsafe { libc::mallopt(param, THRESHOLD) } != 1 {
                    tracing::warn!(param, "glibc refused an allocator threshold: idle NBD rings may keep freed memory resident");
                }
            }
        });
    }
}

/// Asks the allocator to hand its free pages back to the kernel, in every
/// arena (the request records and vectors of a past burst are its, not
/// the buffers').
pub(crate) fn release_free_pages() {
    #[cfg(target_env = "gnu")]
    // SAFETY: malloc_trim only releases free memory; no pointer we hold changes.
    unsafe {
        libc::malloc_trim(0);
    }
}

#[cfg(all(test, target_env = "gnu"))]
mod tests {
    use super::*;

    /// Whether glibc gave `block` a mapping of its own: such a block has
    /// the rest of its last page as slack (a 1 MiB block: 4,080 bytes),
    /// where one from an arena has at most 24 bytes.
    fn mapped_alone(block: &[u8]) -> bool {
        // SAFETY: a Vec<u8>'s buffer comes from the global allocator, which
        // for this alignment is malloc; the block is live while borrowed.
        let usable = unsafe { libc::malloc_usable_size(block.as_ptr().cast_mut().cast()) };
        usable - block.len() >= 1024
    }

    #[test]
    fn a_large_block_freed_does_not_draw_later_ones_into_an_arena() {
        pin_thresholds();
        // A past burst's table: mapped, then freed (which, unpinned, raised
        // the threshold to 8 MiB).
        drop(std::hint::black_box(vec![1u8; 8 << 20]));
        let later = std::hint::black_box(vec![1u8; 1 << 20]);
        assert!(mapped_alone(&later), "a 1 MiB block came from an arena, whose free top malloc_trim leaves resident");
        let small = std::hint::black_box(vec![1u8; 4096]);
        assert!(!mapped_alone(&small), "small blocks still come from the arena");
    }
}
