//! A device's first bytes → signatures. Never panics, whatever the buffer
//! length or logical block size, and never reports more GPT partitions than
//! the buffer can hold.
#![no_main]

use libfuzzer_sys::fuzz_target;
use volring::devices::probe::probe;

fuzz_target!(|data: &[u8]| {
    let (lb, buf) = match data.split_first() {
        Some((&b, rest)) => ([512u32, 4096, 1024, 2048, 0, 7][b as usize % 6], rest),
        None => (512, data),
    };
    let c = probe(buf, lb);
    if let Some(t) = c.table {
        assert!(t.partitions.len() <= buf.len() / 128 + 4);
    }
});
