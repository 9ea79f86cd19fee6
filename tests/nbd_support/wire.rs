//! The NBD protocol's numbers as the tests' client knows them, written out
//! from the protocol document (doc/proto.md of the NBD project, with the
//! extended-headers extension) rather than borrowed from the server: a
//! wrong number in the server is then caught by these tests, not mirrored.
//! Everything on the wire is big-endian.

#![allow(dead_code)]

pub const NBDMAGIC: u64 = 0x4e42_444d_4147_4943;
pub const IHAVEOPT: u64 = 0x4948_4156_454f_5054;
pub const OPTION_REPLY_MAGIC: u64 = 0x0003_e889_0455_65a9;
pub const REQUEST_MAGIC: u32 = 0x2560_9513;
pub const EXTENDED_REQUEST_MAGIC: u32 = 0x21e4_1c71;
pub const SIMPLE_REPLY_MAGIC: u32 = 0x6744_6698;
pub const STRUCTURED_REPLY_MAGIC: u32 = 0x668e_33ef;
pub const EXTENDED_REPLY_MAGIC: u32 = 0x6e8a_278c;

/// The one metadata context the server offers.
pub const BASE_ALLOCATION: &str = "base:allocation";

/// Transmission flags, sent with the export's size.
pub mod tx {
    pub const HAS_FLAGS: u16 = 1 << 0;
    pub const READ_ONLY: u16 = 1 << 1;
    pub const SEND_FLUSH: u16 = 1 << 2;
    pub const ROTATIONAL: u16 = 1 << 4;
    pub const CAN_MULTI_CONN: u16 = 1 << 8;
}

/// Option numbers.
pub mod opt {
    pub const EXPORT_NAME: u32 = 1;
    pub const LIST: u32 = 3;
    pub const GO: u32 = 7;
    pub const STRUCTURED_REPLY: u32 = 8;
    pub const SET_META_CONTEXT: u32 = 10;
    pub const EXTENDED_HEADERS: u32 = 11;
}

/// Option reply types.
pub mod rep {
    pub const ACK: u32 = 1;
    pub const INFO: u32 = 3;
    pub const ERR_UNSUP: u32 = 0x8000_0001;
    pub const ERR_POLICY: u32 = 0x8000_0002;
    pub const ERR_SHUTDOWN: u32 = 0x8000_0007;
}

/// Command types.
pub mod cmd {
    pub const READ: u16 = 0;
    pub const WRITE: u16 = 1;
    pub const DISC: u16 = 2;
    pub const FLUSH: u16 = 3;
    pub const TRIM: u16 = 4;
    pub const CACHE: u16 = 5;
    pub const WRITE_ZEROES: u16 = 6;
    pub const BLOCK_STATUS: u16 = 7;
}

/// Command flags.
pub mod cmd_flags {
    pub const FUA: u16 = 1 << 0;
    pub const NO_HOLE: u16 = 1 << 1;
    pub const DF: u16 = 1 << 2;
    pub const REQ_ONE: u16 = 1 << 3;
    pub const FAST_ZERO: u16 = 1 << 4;
    pub const PAYLOAD_LEN: u16 = 1 << 5;
}

/// Structured reply chunk types and flags.
pub mod chunk {
    pub const FLAG_DONE: u16 = 1 << 0;
    pub const OFFSET_DATA: u16 = 1;
    pub const OFFSET_HOLE: u16 = 2;
    pub const BLOCK_STATUS: u16 = 5;
    pub const BLOCK_STATUS_EXT: u16 = 6;
    pub const ERROR: u16 = 0x8001;
}

/// Error numbers on the wire (not the host's errno values).
pub mod errno {
    pub const EPERM: u32 = 1;
    pub const EINVAL: u32 = 22;
    pub const ENOSPC: u32 = 28;
    pub const EOVERFLOW: u32 = 75;
    pub const ENOTSUP: u32 = 95;
}

/// `base:allocation` extent flags.
pub mod state {
    pub const HOLE: u32 = 1 << 0;
    pub const ZERO: u32 = 1 << 1;
}

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

/// Appends a request header: 28 bytes compact, 32 extended.
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
