//! What each of a ring's operations is for.
//!
//! The ring keeps a token beside every operation it hands to the kernel
//! and gives it back with each completion (`volring_ring::Cqe`);
//! the kernel's `user_data` carries only the op table's slot and
//! generation, so a late completion of an ended operation matches nothing.
//! Nothing here is packed into integers.

/// An operation of an NBD ring, by what it serves: a connection (`ci`, its
/// slot in the ring's table), a request with file I/O in flight (`ri`), a
/// listener, or the ring itself.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Token {
    /// The multishot poll on the mailbox's eventfd.
    Wake,
    /// The multishot accept on listener `i`.
    Accept(u32),
    /// The ring's periodic timer.
    Tick,
    /// Connection `ci`'s multishot receive into provided buffers.
    Recv(u32),
    /// Connection `ci`'s receive of a WRITE payload straight into its buffer.
    RecvInto(u32),
    /// Connection `ci`'s sendmsg of queued replies.
    Send(u32),
    /// Connection `ci`'s splice of file pages into its pipe.
    SpliceIn(u32),
    /// Connection `ci`'s splice from its pipe into the socket.
    SpliceOut(u32),
    /// shutdown(2) of connection `ci`'s socket.
    Shutdown(u32),
    /// The close of connection `ci`'s socket (its slot is free after it).
    Close(u32),
    /// A file operation of request `ri`.
    Req(u32),
}

impl Token {
    /// Every kind, in the order of [`Token::kind`] (for diagnostics).
    pub(super) const KINDS: [&'static str; 11] =
        ["wake", "accept", "tick", "recv", "recv_into", "send", "splice_in", "splice_out", "shutdown", "close", "req"];

    /// The kind's index in [`Token::KINDS`].
    pub(super) fn kind(self) -> usize {
        match self {
            Token::Wake => 0,
            Token::Accept(_) => 1,
            Token::Tick => 2,
            Token::Recv(_) => 3,
            Token::RecvInto(_) => 4,
            Token::Send(_) => 5,
            Token::SpliceIn(_) => 6,
            Token::SpliceOut(_) => 7,
            Token::Shutdown(_) => 8,
            Token::Close(_) => 9,
            Token::Req(_) => 10,
        }
    }

    /// Bytes a completion of this kind moved through a client's socket:
    /// what a ring's requests and replies weigh (see `idle`).
    pub(super) fn socket_bytes(self, result: i32) -> u64 {
        match self {
            Token::Recv(_) | Token::RecvInto(_) | Token::Send(_) | Token::SpliceOut(_) => result.max(0) as u64,
            _ => 0,
        }
    }
}
