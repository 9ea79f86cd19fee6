//! Client bytes → the fixed-newstyle handshake. Whatever a client sends, in
//! whatever pieces the socket delivers it, the state machine answers with
//! bytes or an error: it never panics, never claims more input than it was
//! given, always makes progress when it says so, and keeps its replies small.
#![no_main]

use libfuzzer_sys::fuzz_target;
use volring_nbd::handshake::{Catalog, ExportInfo, Handshake, Outcome};

/// The most option data the server promises to hold in memory (16 KiB, its
/// documented limit): the bound the target holds it to, written here so a
/// change to the limit in the code under test is seen, not followed.
const MAX_OPTION_LEN: usize = 16 * 1024;

struct Two;

impl Catalog for Two {
    type Handle = u8;
    fn find(&self, name: &str) -> Option<(u8, ExportInfo)> {
        let info = |ro| ExportInfo { size: 1 << 30, read_only: ro, description: "fuzz".into(), block_sizes: (1, 4096, 1 << 25) };
        match name {
            "" => Some((0, info(false))),
            "ro" => Some((1, info(true))),
            _ => None,
        }
    }
    fn names(&self) -> Vec<(String, String)> {
        vec![(String::new(), "default".into()), ("ro".into(), "read-only".into())]
    }
    fn admit(&self, h: &u8, _: &str) -> Result<(), String> {
        if *h == 0 {
            Ok(())
        } else {
            Err("full".into())
        }
    }
}

fuzz_target!(|data: &[u8]| {
    // The first byte picks how the stream is cut into socket reads.
    let Some((&cut, data)) = data.split_first() else { return };
    let piece = usize::from(cut % 64) + 1;
    let mut hs = Handshake::default();
    let mut buffered: Vec<u8> = Vec::new();
    let mut out = Vec::new();
    for chunk in data.chunks(piece) {
        buffered.extend_from_slice(chunk);
        loop {
            out.clear();
            match hs.step(&buffered, &Two, &mut out) {
                Err(_) => return,
                Ok((used, outcome)) => {
                    assert!(used <= buffered.len(), "claimed {used} of {}", buffered.len());
                    assert!(out.len() <= 2 * MAX_OPTION_LEN, "reply of {} bytes", out.len());
                    buffered.drain(..used);
                    match outcome {
                        Outcome::NeedMore => break,
                        Outcome::Continue => assert!(used > 0, "Continue without progress"),
                        Outcome::Enter(n) => {
                            assert!(n.export == 0, "a full export was entered");
                            return;
                        }
                        Outcome::End(_) => return,
                    }
                }
            }
        }
        // Nothing is kept beyond one option's worth of bytes.
        assert!(buffered.len() <= 16 + MAX_OPTION_LEN + piece, "holding {} bytes", buffered.len());
    }
});
