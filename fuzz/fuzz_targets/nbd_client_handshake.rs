//! Server bytes → the client side of the handshake. Whatever a server sends,
//! in whatever pieces, the state machine answers with bytes, finishes or
//! refuses: it never panics, never claims more input than it was given,
//! never finishes twice, and what it sends stays small. The properties are
//! checked by the crate's fuzz entry, which reaches the crate-private
//! state machine.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    volring_nbd::client::fuzz_server_bytes(data);
});
