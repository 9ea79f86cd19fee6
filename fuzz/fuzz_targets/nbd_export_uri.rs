//! Outside strings → a remote volume's export: the URI from a volume
//! context, a secret from a volume context or a client's export name.
//! Never a panic; a URI that parses prints back to itself and parses to
//! the same value; a secret that parses round-trips through hex; the
//! constant-time check agrees with the plain decode, and a name split at
//! its separators gives back the whole (with a valid client part, if any).
#![no_main]

use libfuzzer_sys::fuzz_target;
use volring_nbd::remote::{split_wire_name, valid_client, valid_export, wire_name, ExportUri, Secret, WireName};

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else { return };
    if let Ok(u) = ExportUri::parse(text) {
        assert!(valid_export(&u.export) && u.port > 0);
        let again = ExportUri::parse(&u.to_string()).expect("a parsed URI prints as one");
        assert_eq!(again, u);
    }
    let fixed = Secret::from_hex(&"5a".repeat(32)).expect("a fixed secret");
    let parsed = Secret::from_hex(text);
    assert_eq!(fixed.matches(text), parsed.as_ref().is_ok_and(|s| *s == fixed));
    if let Ok(s) = parsed {
        assert_eq!(Secret::from_hex(&s.to_hex()).expect("hex round trip"), s);
        assert!(s.matches(text) && s.matches(&s.to_hex()));
    }
    if let Some(w) = split_wire_name(text) {
        let mut whole = format!("{}/{}", w.export, w.secret);
        if let Some(c) = w.client {
            assert!(valid_client(c));
            whole = format!("{whole}/{c}");
        }
        assert_eq!(whole, text);
        if valid_export(w.export) {
            if let Ok(s) = Secret::from_hex(w.secret) {
                let again = wire_name(w.export, &s, w.client);
                let hex = s.to_hex();
                assert_eq!(split_wire_name(&again), Some(WireName { export: w.export, secret: &hex, client: w.client }));
            }
        }
    }
});
