//! Transmission-phase bytes → requests, in every header style, the way the
//! server walks a stream: header, then the WRITE payload it announces.
//! Parsing never panics; what parses re-encodes to the same bytes; reply
//! encoding of anything the server could say is well-formed.
#![no_main]

use libfuzzer_sys::fuzz_target;
use volring_nbd::wire::{self, cmd, encode_request, encode_small_reply, parse_request, Extent, HeaderStyle, ReplyBody};

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
        assert_eq!(&again[..], &rest[..style.request_len()], "round trip");
        rest = &rest[style.request_len()..];
        // The server never buffers a payload it has not checked: skip it.
        let skip = usize::try_from(req.payload_len()).unwrap_or(usize::MAX).min(rest.len());
        rest = &rest[skip..];
        let mut out = Vec::new();
        let extents = [Extent { length: req.length, flags: u32::from(req.flags) }];
        let body = match req.kind {
            cmd::READ => ReplyBody::Hole { offset: req.offset, length: req.length as u32 },
            cmd::BLOCK_STATUS => ReplyBody::Extents { context: 1, extents: &extents },
            cmd::WRITE => ReplyBody::Ack,
            _ => ReplyBody::Error { errno: wire::errno::EINVAL, message: "fuzz" },
        };
        encode_small_reply(style, req.cookie, req.offset, body, &mut out);
        let header = match style {
            HeaderStyle::Simple => wire::SIMPLE_REPLY_LEN,
            HeaderStyle::Structured => wire::STRUCTURED_REPLY_LEN,
            HeaderStyle::Extended => wire::EXTENDED_REPLY_LEN,
        };
        assert!(out.len() >= header && out.len() <= header + 64);
        assert_eq!(u64::from_be_bytes(out[8..16].try_into().unwrap()), req.cookie, "reply names its request");
    }
});
