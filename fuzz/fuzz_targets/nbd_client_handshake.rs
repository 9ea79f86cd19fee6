//! Server bytes → the client side of the handshake. Whatever a server sends,
//! in whatever pieces, the state machine answers with bytes, finishes or
//! refuses: it never panics, never claims more input than it was given,
//! never finishes twice, and what it sends stays small.
#![no_main]

use libfuzzer_sys::fuzz_target;
use volring_nbd::client::{ClientHandshake, ClientOutcome};

fuzz_target!(|data: &[u8]| {
    let Some((&cut, data)) = data.split_first() else { return };
    let piece = usize::from(cut % 64) + 1;
    let Ok(mut hs) = ClientHandshake::new("export") else { return };
    let mut buffered: Vec<u8> = Vec::new();
    let mut out = Vec::new();
    let mut sent = 0usize;
    for chunk in data.chunks(piece) {
        buffered.extend_from_slice(chunk);
        out.clear();
        match hs.step(&buffered, &mut out) {
            Err(_) => return,
            Ok((used, outcome)) => {
                assert!(used <= buffered.len());
                buffered.drain(..used);
                sent += out.len();
                assert!(sent < 1024, "a client sends two options at most");
                if let ClientOutcome::Done(_) = outcome {
                    out.clear();
                    assert!(hs.step(&buffered, &mut out).is_err(), "finished once");
                    return;
                }
            }
        }
    }
});
