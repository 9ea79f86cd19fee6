//! The kernel's uevent netlink socket.

use std::io;
use std::os::fd::{AsFd, OwnedFd};

use rustix::net::netlink::{self, SocketAddrNetlink};
use rustix::net::{AddressFamily, RecvFlags, SocketFlags, SocketType};

/// The kernel's multicast group on `NETLINK_KOBJECT_UEVENT` (udevd
/// re-broadcasts on group 2, which is not joined).
const KERNEL_GROUP: u32 = 1;

/// Opens a non-blocking socket subscribed to kernel uevents, with a receive
/// buffer large enough for a burst of thousands of devices (forced past
/// `rmem_max` when running as root). A buffer that still overflows makes the
/// next receive fail with ENOBUFS: the caller then rescans.
pub fn uevent_socket(recv_buffer: usize) -> io::Result<OwnedFd> {
    let fd = rustix::net::socket_with(
        AddressFamily::NETLINK,
        SocketType::DGRAM,
        SocketFlags::CLOEXEC | SocketFlags::NONBLOCK,
        Some(netlink::KOBJECT_UEVENT),
    )?;
    if rustix::net::sockopt::set_socket_recv_buffer_size_force(&fd, recv_buffer).is_err() {
        rustix::net::sockopt::set_socket_recv_buffer_size(&fd, recv_buffer)?;
    }
    rustix::net::bind(&fd, &SocketAddrNetlink::new(0, KERNEL_GROUP))?;
    Ok(fd)
}

/// One datagram, if any is waiting. Datagrams not sent by the kernel
/// (port id 0) are dropped: only privileged senders can reach the group,
/// but volring does not have to trust them.
pub fn recv_uevent(fd: impl AsFd, buf: &mut [u8]) -> io::Result<Option<usize>> {
    loop {
        let (n, _, from) = match rustix::net::recvfrom(&fd, &mut *buf, RecvFlags::TRUNC) {
            Ok(r) => r,
            Err(rustix::io::Errno::AGAIN) => return Ok(None),
            Err(rustix::io::Errno::INTR) => continue,
            Err(e) => return Err(e.into()),
        };
        let from_kernel = from.and_then(|a| SocketAddrNetlink::try_from(a).ok()).is_some_and(|a| a.pid() == 0);
        if from_kernel {
            // With MSG_TRUNC, n is the datagram's real length: a longer one
            // than the buffer is passed on as such and refused by the parser.
            return Ok(Some(n));
        }
    }
}
