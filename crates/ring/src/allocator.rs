//! The process allocator's part in giving memory back: what a ring with
//! nothing to do asks of glibc's malloc, beside the pages [`Buffers`]
//! hands back itself.
//!
//! [`Buffers`]: crate::Buffers

/// Where glibc's malloc starts both thresholds, and where they stay.
#[cfg(target_env = "gnu")]
const THRESHOLD: libc::c_int = 128 * 1024;

/// Keeps the allocator's mmap and trim thresholds at their starting
/// values (128 KiB), once per process, so a ring's idle trim really gives
/// memory back.
///
/// glibc raises both when it frees a large block it had mapped: the mmap
/// threshold to that block's size, the trim threshold to twice it. A
/// ring's trim frees exactly such blocks (a past burst's request and op
/// tables). From then on, blocks that large come from the ring thread's
/// arena instead, and that arena's free top stays resident up to the
/// raised trim threshold: `malloc_trim` trims the top of the main arena
/// only. That was 1.5-2 MiB per ring after 40 hostile clients had left,
/// the RSS the NBD memory test found never came back. Setting the
/// thresholds turns their adjustment off.
pub(crate) fn pin_thresholds() {
    #[cfg(target_env = "gnu")]
    {
        static PINNED: std::sync::Once = std::sync::Once::new();
        PINNED.call_once(|| {
            for param in [libc::M_MMAP_THRESHOLD, libc::M_TRIM_THRESHOLD] {
                // SAFETY: mallopt only changes the allocator's tuning; it
                // takes no pointer and glibc locks its own state.
                if unsafe { libc::mallopt(param, THRESHOLD) } != 1 {
                    tracing::debug!(param, "the allocator refused a threshold");
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

    /// Whether glibc mapped the block at `p` on its own: the `IS_MMAPPED`
    /// bit (0x2) of its chunk's size word, just before the block.
    fn mapped_alone(p: *const u8) -> bool {
        // SAFETY: `p` came from malloc, which puts the chunk's size word in
        // the 8 bytes before every block it hands out.
        let size_word = unsafe { p.cast::<usize>().sub(1).read() };
        size_word & 2 != 0
    }

    #[test]
    fn a_large_block_freed_does_not_draw_later_ones_into_an_arena() {
        pin_thresholds();
        // A past burst's table: mapped, then freed (which, unpinned, raised
        // the threshold to 8 MiB).
        drop(std::hint::black_box(vec![1u8; 8 << 20]));
        let later = std::hint::black_box(vec![1u8; 1 << 20]);
        assert!(mapped_alone(later.as_ptr()), "a 1 MiB block came from an arena, whose free top malloc_trim leaves resident");
        let small = std::hint::black_box(vec![1u8; 4096]);
        assert!(!mapped_alone(small.as_ptr()), "small blocks still come from the arena");
    }
}
