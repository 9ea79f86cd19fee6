//! /proc/swaps text → swap areas. Never panics; never more areas than
//! lines after the header; unescaping only shortens a path, and without
//! any backslash in the input a path comes back as it was written.
#![no_main]

use std::os::unix::ffi::OsStrExt;

use libfuzzer_sys::fuzz_target;
use volring_devices::fuzz_proc_swaps;

fuzz_target!(|data: &[u8]| {
    let paths = fuzz_proc_swaps(data);
    assert!(paths.len() <= data.split(|&b| b == b'\n').skip(1).count());
    for path in &paths {
        let p = path.as_os_str().as_bytes();
        assert!(!p.is_empty());
        assert!(data.split(|&b| b == b'\n').any(|l| l.len() >= p.len()));
        if !data.contains(&b'\\') {
            assert!(data.windows(p.len()).any(|w| w == p));
        }
    }
});
