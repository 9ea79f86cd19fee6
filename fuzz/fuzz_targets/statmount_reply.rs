//! Bytes as returned by statmount(2) → a mount, or a typed error.
#![no_main]

use libfuzzer_sys::fuzz_target;
use volring::mounts::statmount::decode;

fuzz_target!(|data: &[u8]| {
    if let Ok(m) = decode(data) {
        assert!(m.mount_point().len() <= data.len());
    }
});
