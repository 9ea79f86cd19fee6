//! Bytes as returned by statmount(2) → a mount, or a typed error.
//!
//! The kernel returns names raw, so a decoded mount point, root and source
//! must appear verbatim in the reply: the decoder copies them, never rewrites
//! them (unescaping them once turned a directory named `a\040b` into `a b`).
#![no_main]

use libfuzzer_sys::fuzz_target;
use volring_mounts::statmount::decode;

fn verbatim_in(needle: &[u8], hay: &[u8]) -> bool {
    needle.is_empty() || hay.windows(needle.len()).any(|w| w == needle)
}

fuzz_target!(|data: &[u8]| {
    if let Ok(m) = decode(data) {
        assert!(m.mount_point().len() <= data.len());
        assert!(verbatim_in(m.mount_point(), data), "mount point rewritten");
        assert!(verbatim_in(m.root(), data), "root rewritten");
        assert!(m.source() == b"none" || verbatim_in(m.source(), data), "source rewritten");
    }
});
