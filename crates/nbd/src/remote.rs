//! Exports served to other nodes: the export URI a volume's context
//! carries, and the per-volume secret that guards it.
//!
//! NBD has no authentication of its own besides TLS, and the kernel's
//! driver (whose sockets the agent negotiates for it) cannot do TLS. So a
//! remote export is guarded by a secret the client must name: the export
//! name on the wire is `<export>/<secret>` (what `nbd://host:port/<export>/
//! <secret>` gives qemu-io or nbdinfo), optionally followed by
//! `/<client>`, the consuming node's name, which the owning node's fence
//! holds the volume for (a secret is per volume, not per node, so without
//! it two consuming nodes could not be told apart); the server compares the secret in
//! constant time and answers a wrong one exactly as it answers an unknown
//! export. The secret is 32 random bytes (64 hex digits), made by the
//! owning node's CreateVolume and carried to the consuming node in the
//! volume context, which only the CO sees.
//!
//! Everything here is pure: parsing outside bytes (a URI from a volume
//! context, a name from a client) into typed values, fuzzed.

use std::fmt;
use std::str::FromStr;

use subtle::ConstantTimeEq;

use super::Error;

/// The port NBD servers listen on unless told otherwise (IANA).
pub(crate) const DEFAULT_PORT: u16 = 10809;
/// Bytes of randomness in a secret.
pub(crate) const SECRET_BYTES: usize = 32;
/// Longest URI accepted (a host name of 253 bytes, a port and an export
/// name of 128 bytes fit with room to spare).
pub(crate) const MAX_URI_LEN: usize = 1024;

/// `nbd://HOST[:PORT]/EXPORT`: where a remote volume is served. The export
/// is a volume id; the secret is never part of the URI (it travels in its
/// own volume-context key, so the URI can be logged).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExportUri {
    /// A DNS name, an IPv4 address, or an IPv6 address (without brackets).
    pub host: String,
    pub port: u16,
    pub export: String,
}

fn uri_error(uri: &str, why: &'static str) -> Error {
    // A URI too long to be real is not echoed whole into an error.
    let mut shown: String = uri.chars().take(200).collect();
    if shown.len() < uri.len() {
        shown.push('…');
    }
    Error::Uri { uri: shown, why }
}

/// What an export name (a volume id) may hold: the CSI volume id rule, so
/// `/` (the secret's separator) and anything needing escapes never occur.
pub(crate) fn valid_export(name: &str) -> bool {
    !name.is_empty() && name.len() <= 128 && name.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
}

fn valid_hostname(h: &str) -> bool {
    h.len() <= 253
        && h.split('.').all(|label| {
            !label.is_empty()
                && label.len() <= 63
                && !label.starts_with('-')
                && !label.ends_with('-')
                && label.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-')
        })
}

impl FromStr for ExportUri {
    type Err = Error;

    /// Parses a URI from a volume context. Only what the agent itself
    /// writes is accepted: the `nbd` scheme, a host, an optional port, one
    /// path segment naming the export; no user info, query or fragment
    /// (so a secret cannot hide in one and be logged with the URI).
    fn from_str(uri: &str) -> Result<Self, Error> {
        if uri.len() > MAX_URI_LEN {
            return Err(uri_error(uri, "longer than 1024 bytes"));
        }
        let rest = uri.strip_prefix("nbd://").ok_or_else(|| uri_error(uri, "the scheme must be nbd://"))?;
        if rest.contains(['?', '#', '@', '%']) {
            return Err(uri_error(uri, "no user info, query, fragment or escapes"));
        }
        let (authority, export) = rest.split_once('/').ok_or_else(|| uri_error(uri, "no /EXPORT"))?;
        if !valid_export(export) {
            return Err(uri_error(uri, "the export must be 1 to 128 of [A-Za-z0-9._-]"));
        }
        let (host, port) = if let Some(v6) = authority.strip_prefix('[') {
            let (addr, after) = v6.split_once(']').ok_or_else(|| uri_error(uri, "unclosed [ in the host"))?;
            if addr.parse::<std::net::Ipv6Addr>().is_err() {
                return Err(uri_error(uri, "not an IPv6 address inside [ ]"));
            }
            let port = match after {
                "" => None,
                p => Some(p.strip_prefix(':').ok_or_else(|| uri_error(uri, "junk after ]"))?),
            };
            (addr, port)
        } else {
            match authority.split_once(':') {
                Some((h, p)) => (h, Some(p)),
                None => (authority, None),
            }
        };
        if !authority.starts_with('[') && host.parse::<std::net::Ipv4Addr>().is_err() && !valid_hostname(host) {
            return Err(uri_error(uri, "the host must be a DNS name, an IPv4 address or [IPv6]"));
        }
        let port = match port {
            None => DEFAULT_PORT,
            Some(p) => match p.parse::<u16>() {
                Ok(n) if n > 0 && !p.starts_with('+') => n,
                _ => return Err(uri_error(uri, "the port must be 1 to 65535")),
            },
        };
        Ok(ExportUri { host: host.to_string(), port, export: export.to_string() })
    }
}

impl ExportUri {
    /// The address to connect to, as `ToSocketAddrs` takes it.
    pub fn authority(&self) -> String {
        if self.host.contains(':') {
            format!("[{}]:{}", self.host, self.port)
        } else {
            format!("{}:{}", self.host, self.port)
        }
    }
}

impl fmt::Display for ExportUri {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "nbd://{}/{}", self.authority(), self.export)
    }
}

/// A per-volume secret, read from its hex with `parse`. Its `Debug` never shows it, so a record or a
/// request that holds one can be logged.
#[derive(Clone, PartialEq, Eq)]
pub struct Secret([u8; SECRET_BYTES]);

/// The secret as 64 lower-case hex digits (`format!("{secret:x}")`), what
/// a volume context and a client's export name carry; read back with
/// `parse`.
impl fmt::LowerHex for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.iter().try_for_each(|b| write!(f, "{b:02x}"))
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Secret(..)")
    }
}

impl FromStr for Secret {
    type Err = Error;

    /// Exactly 64 lower- or upper-case hex digits.
    fn from_str(s: &str) -> Result<Self, Error> {
        let b = s.as_bytes();
        if b.len() != 2 * SECRET_BYTES {
            return Err(Error::Secret("a secret is 64 hex digits"));
        }
        let mut out = [0u8; SECRET_BYTES];
        for (i, pair) in b.chunks_exact(2).enumerate() {
            let hi = hex_value(pair[0]).ok_or(Error::Secret("a secret is 64 hex digits"))?;
            let lo = hex_value(pair[1]).ok_or(Error::Secret("a secret is 64 hex digits"))?;
            out[i] = hi << 4 | lo;
        }
        Ok(Secret(out))
    }
}

impl Secret {
    /// A fresh secret from the kernel's random source.
    pub fn generate() -> Result<Self, Error> {
        let mut b = [0u8; SECRET_BYTES];
        getrandom::getrandom(&mut b).map_err(|e| Error::Io { what: "getrandom".into(), source: std::io::Error::other(e.to_string()) })?;
        Ok(Secret(b))
    }

    /// Whether `presented` (hex, from a client) is this secret. The time it
    /// takes does not depend on where the two differ: a wrong secret of the
    /// right length is decoded and compared whole, and the decode itself
    /// has no data-dependent branch past the length.
    pub(crate) fn matches(&self, presented: &str) -> bool {
        let b = presented.as_bytes();
        if b.len() != 2 * SECRET_BYTES {
            return false;
        }
        let mut got = [0u8; SECRET_BYTES];
        let mut bad = 0u8;
        for (i, pair) in b.chunks_exact(2).enumerate() {
            let (hi, hi_bad) = hex_value_ct(pair[0]);
            let (lo, lo_bad) = hex_value_ct(pair[1]);
            got[i] = hi << 4 | lo;
            bad |= hi_bad | lo_bad;
        }
        bool::from(self.0.ct_eq(&got) & bad.ct_eq(&0))
    }
}

fn hex_value(c: u8) -> Option<u8> {
    let (v, bad) = hex_value_ct(c);
    (bad == 0).then_some(v)
}

/// A hex digit's value and 1 if it is not one, computed without branches
/// on the digit (masks from comparisons done in arithmetic).
fn hex_value_ct(c: u8) -> (u8, u8) {
    // in_range(c, lo, hi) is 0xff when lo <= c <= hi, else 0.
    let in_range = |lo: u8, hi: u8| -> u8 {
        let below = (u16::from(c).wrapping_sub(u16::from(lo)) >> 8) as u8; // 0xff if c < lo
        let above = (u16::from(hi).wrapping_sub(u16::from(c)) >> 8) as u8; // 0xff if c > hi
        !(below | above)
    };
    let digit = in_range(b'0', b'9');
    let lower = in_range(b'a', b'f');
    let upper = in_range(b'A', b'F');
    let v = (digit & c.wrapping_sub(b'0')) | (lower & c.wrapping_sub(b'a' - 10)) | (upper & c.wrapping_sub(b'A' - 10));
    (v, !(digit | lower | upper) & 1)
}

/// What a client name (the consuming node's name on the wire) may hold:
/// 1 to 253 of `[A-Za-z0-9._-]` (every Kubernetes node name fits).
pub fn valid_client(name: &str) -> bool {
    !name.is_empty() && name.len() <= 253 && name.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
}

/// The name a client sends for a guarded export: `<export>/<secret>`, then
/// `/<client>` when the client names itself.
pub(crate) fn wire_name(export: &str, secret: &Secret, client: Option<&str>) -> String {
    match client {
        Some(c) => format!("{export}/{secret:x}/{c}"),
        None => format!("{export}/{secret:x}"),
    }
}

/// A client's export name for a guarded export, split.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct WireName<'a> {
    pub export: &'a str,
    /// The secret as presented (compared by the catalog, in constant time).
    pub secret: &'a str,
    /// The consuming node's name, when the client gave one.
    pub client: Option<&'a str>,
}

/// A client's export name split into the export, the secret it presents
/// and the name it gives itself; `None` when it has no `/` (it names no
/// guarded export) or its client part is not a [`valid_client`].
pub(crate) fn split_wire_name(name: &str) -> Option<WireName<'_>> {
    let (export, rest) = name.split_once('/')?;
    match rest.split_once('/') {
        None => Some(WireName { export, secret: rest, client: None }),
        Some((secret, client)) => valid_client(client).then_some(WireName { export, secret, client: Some(client) }),
    }
}

/// The fuzz entry (`fuzz/fuzz_targets/nbd_export_uri.rs`): the parsers here
/// run over one outside string, panicking when a property fails. A URI
/// that parses prints back to itself and parses to the same value; a secret
/// that parses round-trips through hex; the constant-time check agrees with
/// the plain decode; and a name split at its separators gives back the
/// whole (with a valid client part, if any).
pub fn fuzz_outside_string(text: &str) {
    if let Ok(u) = ExportUri::from_str(text) {
        assert!(valid_export(&u.export) && u.port > 0);
        let again = ExportUri::from_str(&u.to_string()).expect("a parsed URI prints as one");
        assert_eq!(again, u);
    }
    let fixed = Secret::from_str(&"5a".repeat(32)).expect("a fixed secret");
    let parsed = Secret::from_str(text);
    assert_eq!(fixed.matches(text), parsed.as_ref().is_ok_and(|s| *s == fixed));
    if let Ok(s) = parsed {
        assert_eq!(Secret::from_str(&format!("{s:x}")).expect("hex round trip"), s);
        assert!(s.matches(text) && s.matches(&format!("{s:x}")));
    }
    if let Some(w) = split_wire_name(text) {
        let mut whole = format!("{}/{}", w.export, w.secret);
        if let Some(c) = w.client {
            assert!(valid_client(c));
            whole = format!("{whole}/{c}");
        }
        assert_eq!(whole, text);
        if valid_export(w.export) {
            if let Ok(s) = Secret::from_str(w.secret) {
                let again = wire_name(w.export, &s, w.client);
                let hex = format!("{s:x}");
                assert_eq!(split_wire_name(&again), Some(WireName { export: w.export, secret: &hex, client: w.client }));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uris_parse_to_host_port_and_export() {
        let u = ExportUri::from_str("nbd://10.0.0.5:10900/pvc-1").unwrap();
        assert_eq!((u.host.as_str(), u.port, u.export.as_str()), ("10.0.0.5", 10900, "pvc-1"));
        assert_eq!(u.to_string(), "nbd://10.0.0.5:10900/pvc-1");
        let u = ExportUri::from_str("nbd://node-a.example/v.1_x").unwrap();
        assert_eq!((u.port, u.authority()), (DEFAULT_PORT, "node-a.example:10809".to_string()));
        let u = ExportUri::from_str("nbd://[fd00::1]:99/v").unwrap();
        assert_eq!((u.host.as_str(), u.authority()), ("fd00::1", "[fd00::1]:99".to_string()));
        assert_eq!(ExportUri::from_str(&u.to_string()).unwrap(), u);
    }

    #[test]
    fn uris_outside_the_agents_own_form_are_refused() {
        for bad in [
            "",
            "nbd://",
            "nbds://h/v",
            "nbd+unix:///v?socket=/x",
            "http://h/v",
            "nbd://h",
            "nbd://h/",
            "nbd://h/v/extra",
            "nbd://h/v?secret=x",
            "nbd://h/v#f",
            "nbd://user@h/v",
            "nbd://h/v%2f",
            "nbd://h:0/v",
            "nbd://h:65536/v",
            "nbd://h:+5/v",
            "nbd://h:/v",
            "nbd://[fd00::1/v",
            "nbd://[nothex]/v",
            "nbd://[::1]x/v",
            "nbd://-h/v",
            "nbd://h..x/v",
            "nbd://h_x/v",
            "nbd://:10809/v",
        ] {
            assert!(ExportUri::from_str(bad).is_err(), "{bad:?} parsed");
        }
        let long = format!("nbd://h/{}", "v".repeat(2000));
        let e = ExportUri::from_str(&long).unwrap_err().to_string();
        assert!(e.len() < 400, "the error quotes a bounded part: {e}");
    }

    #[test]
    fn secrets_round_trip_and_compare_whole() {
        let s = Secret::generate().unwrap();
        let t = Secret::generate().unwrap();
        assert_ne!(s, t, "two fresh secrets differ");
        let hex = format!("{s:x}");
        assert_eq!(hex.len(), 64);
        assert_eq!(Secret::from_str(&hex).unwrap(), s);
        assert_eq!(Secret::from_str(&hex.to_uppercase()).unwrap(), s);
        assert!(s.matches(&hex) && s.matches(&hex.to_uppercase()));
        assert!(!s.matches(&format!("{t:x}")));
        // One digit off anywhere, a short or long one, non-hex of the right length.
        for i in [0, 31, 63] {
            let mut b = hex.clone().into_bytes();
            b[i] = if b[i] == b'0' { b'1' } else { b'0' };
            assert!(!s.matches(std::str::from_utf8(&b).unwrap()), "digit {i}");
        }
        assert!(!s.matches(&hex[..63]) && !s.matches(&format!("{hex}0")) && !s.matches(""));
        let mut g = hex.clone().into_bytes();
        g[10] = b'g';
        assert!(!s.matches(std::str::from_utf8(&g).unwrap()));
        assert!(Secret::from_str(std::str::from_utf8(&g).unwrap()).is_err());
        assert_eq!(format!("{s:?}"), "Secret(..)");
    }

    #[test]
    fn hex_digits_decode_exactly() {
        for c in 0..=255u8 {
            let want = (c as char).to_digit(16).map(|d| d as u8);
            assert_eq!(hex_value(c), want, "{c}");
        }
    }

    #[test]
    fn wire_names_split_into_export_secret_and_client() {
        let s = Secret::from_str(&"ab".repeat(32)).unwrap();
        let hex = "ab".repeat(32);
        let n = wire_name("pvc-1", &s, None);
        assert_eq!(split_wire_name(&n), Some(WireName { export: "pvc-1", secret: &hex, client: None }));
        let n = wire_name("pvc-1", &s, Some("node-b.example"));
        assert_eq!(n, format!("pvc-1/{hex}/node-b.example"));
        assert_eq!(split_wire_name(&n), Some(WireName { export: "pvc-1", secret: &hex, client: Some("node-b.example") }));
        assert_eq!(split_wire_name("pvc-1"), None);
        // A client part that is not a node name names nothing.
        for bad in ["", "a/b", "sp ace", "n\n", &"n".repeat(254)] {
            assert_eq!(split_wire_name(&format!("pvc-1/{hex}/{bad}")), None, "{bad:?}");
        }
        assert!(valid_client(&"n".repeat(253)) && !valid_client("é"));
    }
}
