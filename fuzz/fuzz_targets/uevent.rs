//! A netlink datagram → a uevent or a typed refusal. Never panics.
#![no_main]

use libfuzzer_sys::fuzz_target;
use volring_devices::uevent::parse;

fuzz_target!(|data: &[u8]| {
    if let Ok(ev) = parse(data) {
        assert!(!ev.devpath.is_empty());
        let _ = ev.name();
    }
});
