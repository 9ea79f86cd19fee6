//! Bytes as read from a fanotify group → events. Never panics, always ends.
#![no_main]

use libfuzzer_sys::fuzz_target;
use volring_mounts::fuzz_fanotify_events;

fuzz_target!(|data: &[u8]| {
    // Each event is at least 24 bytes, so this bounds the iteration.
    assert!(fuzz_fanotify_events(data) <= data.len() / 24 + 1);
});
