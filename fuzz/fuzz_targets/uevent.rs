//! A netlink datagram → a uevent or a typed refusal. Never panics.
#![no_main]

use libfuzzer_sys::fuzz_target;
use volring_devices::fuzz_uevent;

fuzz_target!(|data: &[u8]| {
    if let Some((devpath, _name)) = fuzz_uevent(data) {
        assert!(!devpath.is_empty());
    }
});
