//! Outside strings → a remote volume's export: the URI from a volume
//! context, a secret from a volume context or a client's export name.
//! Never a panic; a URI that parses prints back to itself and parses to
//! the same value; a secret that parses round-trips through hex; the
//! constant-time check agrees with the plain decode, and a name split at
//! its separators gives back the whole (with a valid client part, if any).
//! The properties are checked by the crate's fuzz entry, which reaches the
//! crate-private parsers.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else { return };
    volring_nbd::remote::fuzz_outside_string(text);
});
