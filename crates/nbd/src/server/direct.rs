//! Large WRITE payloads received straight into the buffer they are written
//! from.
//!
//! Multishot receives land in the ring's shared provided buffers (64 KiB
//! each), so an idle connection holds no memory; a WRITE's payload is then
//! copied from there into the request's own buffer. For a large payload
//! that copy is a second pass over every byte (the kernel's receive copy is
//! the first). Once a WRITE of at least [`DIRECT_MIN`] has started and
//! enough of its payload is still to come, the connection's multishot
//! receive is cancelled; when its last completion is in (the bytes it had
//! already taken are copied as before, in order), the rest of the payload
//! is received with MSG_WAITALL directly into the write buffer, a chunk of
//! at most [`DIRECT_CHUNK`] at a time so progress shows (a client sending
//! slowly is not taken for a stalled one), and the multishot receive is
//! armed again after the payload. The buffer was charged to the connection
//! and the server before it was allocated, as for any WRITE.

use super::conn::Conn;
use super::token::Token;
use volring_ring::{IoRing, Op, OpId};

/// WRITEs at least this long are received directly.
pub(super) const DIRECT_MIN: u64 = 128 * 1024;
/// Less than this left of the payload is not worth a cancel and re-arm.
const DIRECT_REST_MIN: usize = 32 * 1024;
/// Most bytes one direct receive asks for.
const DIRECT_CHUNK: usize = 1 << 20;

/// Whether the payload in progress should be received directly.
pub(super) fn wants_direct(c: &Conn) -> bool {
    c.payload.as_ref().is_some_and(|p| p.req.length >= DIRECT_MIN && p.req.length as usize - p.filled >= DIRECT_REST_MIN)
}

/// Arms a receive of the next chunk of `c`'s payload into its buffer.
pub(super) fn arm(ring: &mut IoRing<Token>, ci: u32, c: &Conn) -> std::io::Result<OpId> {
    let p = c.payload.as_ref().ok_or_else(|| std::io::Error::other("no payload to receive"))?;
    let at = p.data_off + p.filled;
    let take = (p.req.length as usize - p.filled).min(DIRECT_CHUNK);
    ring.submit(Token::RecvInto(ci), Op::RecvInto { socket: c.socket, into: (p.buf, at, at + take) })
}
