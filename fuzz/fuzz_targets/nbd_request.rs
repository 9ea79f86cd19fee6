//! Transmission-phase bytes → requests, in every header style, the way the
//! server walks a stream: header, then the WRITE payload it announces.
//! Parsing never panics; what parses re-encodes to the same bytes; reply
//! encoding of anything the server could say is well-formed.
#![no_main]

use libfuzzer_sys::fuzz_target;
use volring_nbd::wire::{encode_request, encode_small_reply, parse_request, Extent, HeaderStyle, ReplyBody};

// The protocol's numbers as the fuzz target knows them (doc/proto.md of the
// NBD project), not borrowed from the code under test.
const READ: u16 = 0;
const WRITE: u16 = 1;
const BLOCK_STATUS: u16 = 7;
const EINVAL: u32 = 22;

/// Bytes of a request header: compact, or extended with a 64-bit length.
fn request_len(style: HeaderStyle) -> usize {
    if style == HeaderStyle::Extended {
        32
    } else {
        28
    }
}

fuzz_target!(|data: &[u8]| {
    let Some((&sel, stream)) = data.split_first() else { return };
    let style = match sel % 3 {
        0 => HeaderStyle::Simple,
        1 => HeaderStyle::Structured,
        _ => HeaderStyle::Extended,
    };
    let mut rest = stream;
    for _ in 0..4096 {
        let req = match parse_request(rest, style) {
            Ok(Some(r)) => r,
            Ok(None) | Err(_) => break,
        };
        let mut again = Vec::new();
        encode_request(&req, style, &mut again);
        assert_eq!(&again[..], &rest[..request_len(style)], "round trip");
        rest = &rest[request_len(style)..];
        // The server never buffers a payload it has not checked: skip it
        // (only a WRITE carries one, as long as its length).
        let payload = if req.kind == WRITE { req.length } else { 0 };
        let skip = usize::try_from(payload).unwrap_or(usize::MAX).min(rest.len());
        rest = &rest[skip..];
        let mut out = Vec::new();
        let extents = [Extent { length: req.length, flags: u32::from(req.flags) }];
        let body = match req.kind {
            READ => ReplyBody::Hole { offset: req.offset, length: req.length as u32 },
            BLOCK_STATUS => ReplyBody::Extents { context: 1, extents: &extents },
            WRITE => ReplyBody::Ack,
            _ => ReplyBody::Error { errno: EINVAL, message: "fuzz" },
        };
        encode_small_reply(style, req.cookie, req.offset, body, &mut out);
        let header = match style {
            HeaderStyle::Simple => 16,
            HeaderStyle::Structured => 20,
            HeaderStyle::Extended => 32,
        };
        assert!(out.len() >= header && out.len() <= header + 64);
        assert_eq!(u64::from_be_bytes(out[8..16].try_into().unwrap()), req.cookie, "reply names its request");
    }
});
