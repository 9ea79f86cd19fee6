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
//! slowly is not taken for a stalled one). The buffer was charged to the
//! connection and the server before it was allocated, as for any WRITE.
//!
//! After such a WRITE the multishot receive is not armed again at once:
//! it would take the next request's header and whatever of its payload had
//! arrived, and a stream of large WRITEs (a client copying an image) would
//! have the head of every payload copied. Instead the next header alone is
//! received, once, into a provided buffer (at most the header's length, so
//! no payload byte comes with it); a large WRITE's payload then goes
//! straight into its buffer, and any other request turns the multishot
//! receive back on (small requests would pay a receive each otherwise).
//! So in a stream of large WRITEs no payload byte passes through the pool,
//! and there is no cancel either.

use super::conn::{Conn, Phase};
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
    let buf = p.buf.ok_or_else(|| std::io::Error::other("a large payload without its buffer"))?;
    let at = p.data_off + p.filled;
    let take = (p.req.length as usize - p.filled).min(DIRECT_CHUNK);
    ring.submit(Token::RecvInto(ci), Op::RecvInto { socket: c.socket, into: (buf, at, at + take) })
}

/// How much of the next request header to receive alone: after a large
/// WRITE, when nothing else (a payload, bytes to read past) comes first.
pub(super) fn header_rest(c: &Conn) -> Option<u32> {
    if !c.bulk || c.payload.is_some() || c.discard > 0 || !matches!(c.phase, Phase::Serving { .. }) {
        return None;
    }
    let need = c.style().request_len();
    (c.inbuf.len() < need).then(|| (need - c.inbuf.len()) as u32)
}

/// Arms a receive of at most `len` bytes (the rest of a header) into a
/// provided buffer.
pub(super) fn arm_header(ring: &mut IoRing<Token>, ci: u32, c: &Conn, len: u32) -> std::io::Result<OpId> {
    ring.submit(Token::Recv(ci), Op::RecvOnce { socket: c.socket, len })
}
