//! /proc/diskstats text and sysfs `stat` lines → counters. Never panics;
//! every line yields exactly one result.
#![no_main]

use libfuzzer_sys::fuzz_target;
use volring_devices::{parse_diskstats, IoCounters};

fuzz_target!(|data: &[u8]| {
    let lines = data.split(|&b| b == b'\n').filter(|l| !l.iter().all(u8::is_ascii_whitespace)).count();
    assert_eq!(parse_diskstats(data).count(), lines);
    let _ = IoCounters::parse(data);
});
