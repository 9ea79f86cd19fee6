//! What an [`IoRing`] may do: the operations it submits, probed at start
//! (a kernel that lacks one is refused with [`MissingOpcode`]) and the only
//! ones its `IORING_REGISTER_RESTRICTIONS` let through once it is enabled.

use io_uring::opcode;

use super::io_ring::IoRing;

impl<T: Copy> IoRing<T> {
    /// Every operation the ring submits, with its name: what it probes
    /// for and the only ones its restrictions let through.
    pub(crate) const OPCODES: [(u8, &'static str); 16] = [
        (opcode::PollAdd::CODE, "POLL_ADD"),
        (opcode::AcceptMulti::CODE, "ACCEPT"),
        (opcode::Timeout::CODE, "TIMEOUT"),
        (opcode::RecvMulti::CODE, "RECV"),
        (opcode::SendMsg::CODE, "SENDMSG"),
        (opcode::ReadFixed::CODE, "READ_FIXED"),
        (opcode::Read::CODE, "READ"),
        (opcode::WriteFixed::CODE, "WRITE_FIXED"),
        (opcode::Write::CODE, "WRITE"),
        (opcode::Fsync::CODE, "FSYNC"),
        (opcode::Fallocate::CODE, "FALLOCATE"),
        (opcode::Fadvise::CODE, "FADVISE"),
        (opcode::Shutdown::CODE, "SHUTDOWN"),
        (opcode::Close::CODE, "CLOSE"),
        (opcode::Splice::CODE, "SPLICE"),
        (opcode::AsyncCancel::CODE, "ASYNC_CANCEL"),
    ];
}

/// The kernel's io_uring lacks an operation the NBD server needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("the kernel's io_uring lacks IORING_OP_{name}, which the NBD server needs (Linux 6.0+)")]
pub(crate) struct MissingOpcode {
    pub(crate) name: &'static str,
}

/// Which of [`IoRing::OPCODES`] `supported` says no to first.
pub(crate) fn missing_opcode(supported: impl Fn(u8) -> bool) -> Option<&'static str> {
    IoRing::<u64>::OPCODES.iter().find(|(code, _)| !supported(*code)).map(|(_, name)| *name)
}

/// Registrations made after the ring is enabled: fixed files put in and
/// taken out, the receive pool handed over afresh.
const LATE_REGISTRATIONS: [u8; 3] = [
    6,  // IORING_REGISTER_FILES_UPDATE
    22, // IORING_REGISTER_PBUF_RING
    23, // IORING_UNREGISTER_PBUF_RING
];

/// What the ring may do once enabled: its own operations, with fixed
/// files and provided buffers, and its late registrations.
pub(crate) fn restrictions() -> Vec<io_uring::register::Restriction> {
    use io_uring::register::Restriction;
    use io_uring::squeue::Flags;
    let mut r: Vec<Restriction> = IoRing::<u64>::OPCODES.iter().map(|(code, _)| Restriction::sqe_op(*code)).collect();
    r.extend(LATE_REGISTRATIONS.iter().map(|op| Restriction::register_op(*op)));
    r.push(Restriction::sqe_flags_allowed((Flags::FIXED_FILE | Flags::BUFFER_SELECT | Flags::ASYNC).bits()));
    r
}
