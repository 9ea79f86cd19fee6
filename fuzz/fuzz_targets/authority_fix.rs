//! HPACK header blocks → `authority::fix`, the `:authority` rewrite of
//! the CSI socket. Whatever a client sends, the rewrite answers without
//! panicking, and what it sends on keeps its promises, checked against an
//! independent HPACK decoder (two decoders, one fed the blocks as they
//! came, one as they are passed on, over two blocks of one connection so
//! the second can name entries the first stored):
//! - a block it changes grows at most twofold (Huffman code shrinks a
//!   string by at most 5/8) and has nothing left to fix;
//! - every header decodes to the same name, and to the same value except
//!   an `:authority` that was not a plain host, which becomes that value
//!   with each byte outside `A-Z a-z 0-9 - . _ ~` made `-`;
//! - a block the decoder accepts as it came, it accepts as passed on.
#![no_main]

use libfuzzer_sys::fuzz_target;
use loona_hpack::Decoder;
use volring_csi::authority::fix;

/// What h2 allows a peer's encoder by default (SETTINGS_HEADER_TABLE_SIZE).
const TABLE_SIZE: usize = 4096;

fn host_byte(c: u8) -> bool {
    c.is_ascii_alphanumeric() || b"-._~".contains(&c)
}

fn plain_host(v: &[u8]) -> bool {
    !v.is_empty() && v.iter().all(|&c| host_byte(c) || c == b':') && v.iter().filter(|&&c| c == b':').count() <= 1
}

fuzz_target!(|data: &[u8]| {
    let Some((&cut, rest)) = data.split_first() else { return };
    let (one, two) = rest.split_at(usize::from(cut) * rest.len() / 255);
    let (mut came, mut passed) = (Decoder::new(), Decoder::new());
    came.set_max_allowed_table_size(TABLE_SIZE);
    passed.set_max_allowed_table_size(TABLE_SIZE);
    for block in [one, two] {
        let fixed = fix(block);
        if let Some(out) = &fixed {
            assert_ne!(out.as_slice(), block, "a block said to be fixed is changed");
            assert!(out.len() <= 2 * block.len(), "{} bytes became {}", block.len(), out.len());
            assert_eq!(fix(out), None, "a fixed block has nothing left to fix");
        }
        let on = fixed.as_deref().unwrap_or(block);
        // Once the decoder rejects a block its table is undefined (h2
        // ends the connection): the rest of the input proves nothing.
        let Ok(want) = came.decode(block) else { return };
        let got = passed.decode(on).unwrap_or_else(|e| panic!("accepted as it came, rejected as passed on: {e:?}"));
        assert_eq!(want.len(), got.len());
        for ((name, value), (got_name, got_value)) in want.iter().zip(&got) {
            assert_eq!(name, got_name);
            if value != got_value {
                assert_eq!(name.as_slice(), b":authority", "only :authority is rewritten");
                assert!(!plain_host(value), "a plain host is left alone: {value:?}");
                let mapped: Vec<u8> = value.iter().map(|&c| if host_byte(c) { c } else { b'-' }).collect();
                assert_eq!(got_value, &mapped);
            }
        }
    }
});
