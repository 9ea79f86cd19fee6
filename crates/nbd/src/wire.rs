//! NBD wire facts and the transmission-phase codec: pure functions over
//! bytes, no I/O. Numbers are the protocol's (doc/proto.md of the NBD
//! project, with the extended-headers extension); everything is big-endian.

use super::Error;

pub(crate) const NBDMAGIC: u64 = 0x4e42_444d_4147_4943;
pub(crate) const IHAVEOPT: u64 = 0x4948_4156_454f_5054;
pub(crate) const OPTION_REPLY_MAGIC: u64 = 0x0003_e889_0455_65a9;
pub(crate) const REQUEST_MAGIC: u32 = 0x2560_9513;
pub(crate) const EXTENDED_REQUEST_MAGIC: u32 = 0x21e4_1c71;
pub(crate) const SIMPLE_REPLY_MAGIC: u32 = 0x6744_6698;
pub(crate) const STRUCTURED_REPLY_MAGIC: u32 = 0x668e_33ef;
pub(crate) const EXTENDED_REPLY_MAGIC: u32 = 0x6e8a_278c;

/// Handshake flags (server) and client flags.
pub(crate) mod handshake_flags {
    pub(crate) const FIXED_NEWSTYLE: u16 = 1 << 0;
    pub(crate) const NO_ZEROES: u16 = 1 << 1;
    pub(crate) const C_FIXED_NEWSTYLE: u32 = 1 << 0;
    pub(crate) const C_NO_ZEROES: u32 = 1 << 1;
}

/// Transmission flags, sent with the export's size.
pub(crate) mod tx {
    pub(crate) const HAS_FLAGS: u16 = 1 << 0;
    pub(crate) const READ_ONLY: u16 = 1 << 1;
    pub(crate) const SEND_FLUSH: u16 = 1 << 2;
    pub(crate) const SEND_FUA: u16 = 1 << 3;
    pub(crate) const SEND_TRIM: u16 = 1 << 5;
    pub(crate) const SEND_WRITE_ZEROES: u16 = 1 << 6;
    pub(crate) const SEND_DF: u16 = 1 << 7;
    pub(crate) const CAN_MULTI_CONN: u16 = 1 << 8;
    pub(crate) const SEND_CACHE: u16 = 1 << 10;
    pub(crate) const SEND_FAST_ZERO: u16 = 1 << 11;
}

/// Option numbers.
pub(crate) mod opt {
    pub(crate) const EXPORT_NAME: u32 = 1;
    pub(crate) const ABORT: u32 = 2;
    pub(crate) const LIST: u32 = 3;
    pub(crate) const STARTTLS: u32 = 5;
    pub(crate) const INFO: u32 = 6;
    pub(crate) const GO: u32 = 7;
    pub(crate) const STRUCTURED_REPLY: u32 = 8;
    pub(crate) const LIST_META_CONTEXT: u32 = 9;
    pub(crate) const SET_META_CONTEXT: u32 = 10;
    pub(crate) const EXTENDED_HEADERS: u32 = 11;
}

/// Option reply types.
pub(crate) mod rep {
    pub(crate) const ACK: u32 = 1;
    pub(crate) const SERVER: u32 = 2;
    pub(crate) const INFO: u32 = 3;
    pub(crate) const META_CONTEXT: u32 = 4;
    pub(crate) const ERR_UNSUP: u32 = 0x8000_0001;
    pub(crate) const ERR_POLICY: u32 = 0x8000_0002;
    pub(crate) const ERR_INVALID: u32 = 0x8000_0003;
    pub(crate) const ERR_UNKNOWN: u32 = 0x8000_0006;
    pub(crate) const ERR_TOO_BIG: u32 = 0x8000_0009;
    pub(crate) const ERR_EXT_HEADER_REQD: u32 = 0x8000_000a;
}

/// `NBD_INFO_*` items of INFO and GO.
pub(crate) mod info {
    pub(crate) const EXPORT: u16 = 0;
    pub(crate) const NAME: u16 = 1;
    pub(crate) const DESCRIPTION: u16 = 2;
    pub(crate) const BLOCK_SIZE: u16 = 3;
}

/// Command types.
pub(crate) mod cmd {
    pub(crate) const READ: u16 = 0;
    pub(crate) const WRITE: u16 = 1;
    pub(crate) const DISC: u16 = 2;
    pub(crate) const FLUSH: u16 = 3;
    pub(crate) const TRIM: u16 = 4;
    pub(crate) const CACHE: u16 = 5;
    pub(crate) const WRITE_ZEROES: u16 = 6;
    pub(crate) const BLOCK_STATUS: u16 = 7;
}

/// Command flags.
pub(crate) mod cmd_flags {
    pub(crate) const FUA: u16 = 1 << 0;
    pub(crate) const NO_HOLE: u16 = 1 << 1;
    pub(crate) const DF: u16 = 1 << 2;
    pub(crate) const REQ_ONE: u16 = 1 << 3;
    pub(crate) const FAST_ZERO: u16 = 1 << 4;
}

/// Structured reply chunk types and flags.
pub(crate) mod chunk {
    pub(crate) const FLAG_DONE: u16 = 1 << 0;
    pub(crate) const NONE: u16 = 0;
    pub(crate) const OFFSET_DATA: u16 = 1;
    pub(crate) const OFFSET_HOLE: u16 = 2;
    pub(crate) const BLOCK_STATUS: u16 = 5;
    pub(crate) const BLOCK_STATUS_EXT: u16 = 6;
    pub(crate) const ERROR: u16 = 0x8001;
}

/// Error numbers on the wire (not the host's errno values).
pub(crate) mod errno {
    pub(crate) const EPERM: u32 = 1;
    pub(crate) const EIO: u32 = 5;
    pub(crate) const ENOMEM: u32 = 12;
    pub(crate) const EINVAL: u32 = 22;
    pub(crate) const ENOSPC: u32 = 28;
    pub(crate) const EOVERFLOW: u32 = 75;
    pub(crate) const ENOTSUP: u32 = 95;
    pub(crate) const ESHUTDOWN: u32 = 108;

    /// The wire number for a host error; anything without its own number is EIO.
    pub(crate) fn from_host(e: i32) -> u32 {
        match e {
            libc::EPERM | libc::EACCES | libc::EROFS => EPERM,
            libc::ENOMEM => ENOMEM,
            libc::EINVAL => EINVAL,
            libc::ENOSPC | libc::EDQUOT | libc::EFBIG => ENOSPC,
            libc::EOVERFLOW => EOVERFLOW,
            libc::EOPNOTSUPP => ENOTSUP,
            libc::ESHUTDOWN => ESHUTDOWN,
            _ => EIO,
        }
    }
}

/// `base:allocation` extent flags.
pub(crate) mod state {
    pub(crate) const HOLE: u32 = 1 << 0;
    pub(crate) const ZERO: u32 = 1 << 1;
}

pub(crate) const BASE_ALLOCATION: &str = "base:allocation";

/// Header sizes: compact request, extended request, simple reply,
/// structured chunk, extended chunk.
pub(crate) const REQUEST_LEN: usize = 28;
pub(crate) const EXTENDED_REQUEST_LEN: usize = 32;
pub(crate) const SIMPLE_REPLY_LEN: usize = 16;
pub(crate) const STRUCTURED_REPLY_LEN: usize = 20;
pub(crate) const EXTENDED_REPLY_LEN: usize = 32;

/// Which headers a connection negotiated.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum HeaderStyle {
    /// Compact requests, simple replies only.
    #[default]
    Simple,
    /// Compact requests, structured replies.
    Structured,
    /// 64-bit requests and reply chunks.
    Extended,
}

impl HeaderStyle {
    pub(crate) fn request_len(self) -> usize {
        match self {
            HeaderStyle::Extended => EXTENDED_REQUEST_LEN,
            _ => REQUEST_LEN,
        }
    }

    pub(crate) fn structured(self) -> bool {
        self != HeaderStyle::Simple
    }
}

/// One transmission-phase request header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Request {
    pub flags: u16,
    pub kind: u16,
    pub cookie: u64,
    pub offset: u64,
    /// Effect length; for WRITE also the payload that follows.
    pub length: u64,
}

impl Request {
    pub(crate) fn has(&self, flag: u16) -> bool {
        self.flags & flag != 0
    }
}

fn be16(b: &[u8]) -> u16 {
    u16::from_be_bytes([b[0], b[1]])
}
fn be32(b: &[u8]) -> u32 {
    u32::from_be_bytes([b[0], b[1], b[2], b[3]])
}
fn be64(b: &[u8]) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[..8]);
    u64::from_be_bytes(a)
}

/// Parses one request header from the front of `buf`: `Ok(None)` when more
/// bytes are needed. A wrong magic is an error: the stream cannot be resynced.
pub fn parse_request(buf: &[u8], style: HeaderStyle) -> Result<Option<Request>, Error> {
    let need = style.request_len();
    if buf.len() < need {
        return Ok(None);
    }
    let magic = be32(buf);
    let expect = if style == HeaderStyle::Extended { EXTENDED_REQUEST_MAGIC } else { REQUEST_MAGIC };
    if magic != expect {
        return Err(Error::BadMagic(magic));
    }
    let length = if style == HeaderStyle::Extended { be64(&buf[24..]) } else { u64::from(be32(&buf[24..])) };
    Ok(Some(Request { flags: be16(&buf[4..]), kind: be16(&buf[6..]), cookie: be64(&buf[8..]), offset: be64(&buf[16..]), length }))
}

/// Encodes a request header (the client side: tests, benches and fuzz seeds).
pub fn encode_request(req: &Request, style: HeaderStyle, out: &mut Vec<u8>) {
    let extended = style == HeaderStyle::Extended;
    out.extend_from_slice(&(if extended { EXTENDED_REQUEST_MAGIC } else { REQUEST_MAGIC }).to_be_bytes());
    out.extend_from_slice(&req.flags.to_be_bytes());
    out.extend_from_slice(&req.kind.to_be_bytes());
    out.extend_from_slice(&req.cookie.to_be_bytes());
    out.extend_from_slice(&req.offset.to_be_bytes());
    if extended {
        out.extend_from_slice(&req.length.to_be_bytes());
    } else {
        out.extend_from_slice(&(req.length as u32).to_be_bytes());
    }
}

/// One reply header (simple, structured chunk or extended chunk), written
/// right in front of the payload already in a buffer, so header and data
/// leave in one piece. `payload` is the number of bytes that follow it;
/// simple replies ignore `chunk_type`, `flags` and `payload` (their data
/// has no length field) and only they use `error`.
pub(crate) struct ReplyHeader {
    pub style: HeaderStyle,
    pub cookie: u64,
    pub offset: u64,
    pub chunk_type: u16,
    pub flags: u16,
    pub error: u32,
    pub payload: u64,
}

impl ReplyHeader {
    pub(crate) fn size(&self) -> usize {
        match self.style {
            HeaderStyle::Simple => SIMPLE_REPLY_LEN,
            HeaderStyle::Structured => STRUCTURED_REPLY_LEN,
            HeaderStyle::Extended => EXTENDED_REPLY_LEN,
        }
    }

    /// Writes the header into the last `self.size()` bytes of `dst` and
    /// returns its length.
    pub(crate) fn write_before(&self, dst: &mut [u8]) -> usize {
        let n = self.size();
        let start = dst.len() - n;
        let h = &mut dst[start..];
        match self.style {
            HeaderStyle::Simple => {
                h[0..4].copy_from_slice(&SIMPLE_REPLY_MAGIC.to_be_bytes());
                h[4..8].copy_from_slice(&self.error.to_be_bytes());
                h[8..16].copy_from_slice(&self.cookie.to_be_bytes());
            }
            HeaderStyle::Structured => {
                h[0..4].copy_from_slice(&STRUCTURED_REPLY_MAGIC.to_be_bytes());
                h[4..6].copy_from_slice(&self.flags.to_be_bytes());
                h[6..8].copy_from_slice(&self.chunk_type.to_be_bytes());
                h[8..16].copy_from_slice(&self.cookie.to_be_bytes());
                h[16..20].copy_from_slice(&(self.payload as u32).to_be_bytes());
            }
            HeaderStyle::Extended => {
                h[0..4].copy_from_slice(&EXTENDED_REPLY_MAGIC.to_be_bytes());
                h[4..6].copy_from_slice(&self.flags.to_be_bytes());
                h[6..8].copy_from_slice(&self.chunk_type.to_be_bytes());
                h[8..16].copy_from_slice(&self.cookie.to_be_bytes());
                h[16..24].copy_from_slice(&self.offset.to_be_bytes());
                h[24..32].copy_from_slice(&self.payload.to_be_bytes());
            }
        }
        n
    }
}

/// A whole reply with a small payload (errors, acks, block status), appended
/// to `out`. The answer to anything but a successful READ.
pub fn encode_small_reply(style: HeaderStyle, cookie: u64, offset: u64, body: ReplyBody<'_>, out: &mut Vec<u8>) {
    let mut payload = Vec::new();
    let (chunk_type, error) = match body {
        ReplyBody::Ack => (chunk::NONE, 0),
        ReplyBody::Error { errno, message } => {
            payload.extend_from_slice(&errno.to_be_bytes());
            let msg = &message.as_bytes()[..message.len().min(4096)];
            payload.extend_from_slice(&(msg.len() as u16).to_be_bytes());
            payload.extend_from_slice(msg);
            (chunk::ERROR, errno)
        }
        ReplyBody::Hole { offset, length } => {
            payload.extend_from_slice(&offset.to_be_bytes());
            payload.extend_from_slice(&length.to_be_bytes());
            (chunk::OFFSET_HOLE, 0)
        }
        ReplyBody::Extents { context, extents } => {
            payload.extend_from_slice(&context.to_be_bytes());
            if style == HeaderStyle::Extended {
                payload.extend_from_slice(&(extents.len() as u32).to_be_bytes());
                for e in extents {
                    payload.extend_from_slice(&e.length.to_be_bytes());
                    payload.extend_from_slice(&u64::from(e.flags).to_be_bytes());
                }
                (chunk::BLOCK_STATUS_EXT, 0)
            } else {
                for e in extents {
                    payload.extend_from_slice(&(e.length.min(u64::from(u32::MAX)) as u32).to_be_bytes());
                    payload.extend_from_slice(&e.flags.to_be_bytes());
                }
                (chunk::BLOCK_STATUS, 0)
            }
        }
    };
    let style_payload = if style == HeaderStyle::Simple { 0 } else { payload.len() as u64 };
    let h = ReplyHeader { style, cookie, offset, chunk_type, flags: chunk::FLAG_DONE, error, payload: style_payload };
    let start = out.len();
    out.resize(start + h.size(), 0);
    h.write_before(&mut out[start..]);
    if style != HeaderStyle::Simple {
        out.extend_from_slice(&payload);
    }
}

/// What a small reply carries.
#[derive(Debug)]
pub enum ReplyBody<'a> {
    Ack,
    Error {
        errno: u32,
        message: &'a str,
    },
    /// One hole chunk covering a whole READ (structured replies only).
    Hole {
        offset: u64,
        length: u32,
    },
    Extents {
        context: u32,
        extents: &'a [Extent],
    },
}

/// One `base:allocation` extent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Extent {
    pub length: u64,
    pub flags: u32,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn request_round_trips_in_both_styles() {
        for style in [HeaderStyle::Structured, HeaderStyle::Extended] {
            let req = Request { flags: cmd_flags::FUA, kind: cmd::WRITE, cookie: 0xdead_beef, offset: 4096, length: 512 };
            let mut b = Vec::new();
            encode_request(&req, style, &mut b);
            assert_eq!(b.len(), style.request_len());
            assert_eq!(parse_request(&b, style).unwrap(), Some(req));
            assert_eq!(parse_request(&b[..b.len() - 1], style).unwrap(), None);
        }
    }

    #[test]
    fn wrong_magic_is_an_error_not_a_guess() {
        let mut b = Vec::new();
        encode_request(&Request { flags: 0, kind: 0, cookie: 1, offset: 0, length: 1 }, HeaderStyle::Simple, &mut b);
        b.extend_from_slice(&[0; 4]); // as long as an extended header
        assert!(matches!(parse_request(&b, HeaderStyle::Extended), Err(Error::BadMagic(REQUEST_MAGIC))));
        b[0] = 0;
        assert!(parse_request(&b, HeaderStyle::Simple).is_err());
    }

    #[test]
    fn header_is_written_right_before_the_payload() {
        // Room for any reply header with the 8-byte offset of a data chunk.
        const MAX_REPLY_HEADER: usize = EXTENDED_REPLY_LEN + 8;
        let mut buf = [0u8; MAX_REPLY_HEADER];
        let h = ReplyHeader {
            style: HeaderStyle::Structured,
            cookie: 7,
            offset: 0,
            chunk_type: chunk::OFFSET_DATA,
            flags: chunk::FLAG_DONE,
            error: 0,
            payload: 8 + 4096,
        };
        let n = h.write_before(&mut buf);
        assert_eq!(n, STRUCTURED_REPLY_LEN);
        let hdr = &buf[MAX_REPLY_HEADER - n..];
        assert_eq!(be32(hdr), STRUCTURED_REPLY_MAGIC);
        assert_eq!(be16(&hdr[4..]), chunk::FLAG_DONE);
        assert_eq!(be16(&hdr[6..]), chunk::OFFSET_DATA);
        assert_eq!(be64(&hdr[8..]), 7);
        assert_eq!(be32(&hdr[16..]), 8 + 4096);
    }

    #[test]
    fn extents_use_the_wide_chunk_with_extended_headers() {
        let ext = [Extent { length: 1 << 20, flags: state::HOLE | state::ZERO }];
        let mut narrow = Vec::new();
        encode_small_reply(HeaderStyle::Structured, 1, 0, ReplyBody::Extents { context: 1, extents: &ext }, &mut narrow);
        assert_eq!(be16(&narrow[6..]), chunk::BLOCK_STATUS);
        assert_eq!(narrow.len(), STRUCTURED_REPLY_LEN + 4 + 8);
        let mut wide = Vec::new();
        encode_small_reply(HeaderStyle::Extended, 1, 0, ReplyBody::Extents { context: 1, extents: &ext }, &mut wide);
        assert_eq!(be16(&wide[6..]), chunk::BLOCK_STATUS_EXT);
        assert_eq!(wide.len(), EXTENDED_REPLY_LEN + 8 + 16);
        assert_eq!(be64(&wide[24..]), 8 + 16);
    }

    #[test]
    fn simple_error_reply_carries_the_errno_and_no_payload() {
        let mut b = Vec::new();
        encode_small_reply(HeaderStyle::Simple, 9, 0, ReplyBody::Error { errno: errno::EINVAL, message: "bad" }, &mut b);
        assert_eq!(b.len(), SIMPLE_REPLY_LEN);
        assert_eq!(be32(&b[4..]), errno::EINVAL);
    }
}
