//! A generic netlink socket: requests answered by an ack matched on the
//! sequence number, family lookup through the controller, and multicast
//! group membership for notices (the nbd driver's LINK_DEAD).
//!
//! The framing itself is pure code in [`crate::nlmsg`]; this file
//! moves datagrams and maps the kernel's answers to `io::Error`s (the errno
//! the kernel put in its NLMSG_ERROR, ENOENT for an unknown family).

use std::io;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::time::{Duration, Instant};

use rustix::net::netlink::{self, SocketAddrNetlink};
use rustix::net::{AddressFamily, RecvFlags, SendFlags, SocketFlags, SocketType};

use crate::nlmsg::{self, Family, NLMSG_DONE, NLMSG_ERROR};

/// Large enough for any reply of the controller or the nbd family (a STATUS
/// of every device is ~12 bytes a device).
const RECV_BUFFER: usize = 64 * 1024;
/// A request the kernel has not answered in this long is an error, not a hang.
const REPLY_TIMEOUT: Duration = Duration::from_secs(30);

/// One genl socket bound to a kernel-assigned port.
pub(crate) struct GenlSocket {
    fd: OwnedFd,
    seq: u32,
    buf: Vec<u8>,
}

fn invalid(e: impl std::fmt::Display) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, e.to_string())
}

impl GenlSocket {
    pub(crate) fn open() -> io::Result<Self> {
        let fd = rustix::net::socket_with(AddressFamily::NETLINK, SocketType::DGRAM, SocketFlags::CLOEXEC, Some(netlink::GENERIC))?;
        rustix::net::bind(&fd, &SocketAddrNetlink::new(0, 0))?;
        // Start from the clock so two sockets of one process rarely share numbers.
        let seq = rustix::time::clock_gettime(rustix::time::ClockId::Monotonic).tv_nsec as u32;
        Ok(GenlSocket { fd, seq, buf: vec![0; RECV_BUFFER] })
    }

    pub(crate) fn next_seq(&mut self) -> u32 {
        self.seq = self.seq.wrapping_add(1);
        self.seq
    }

    /// Joins a multicast group: notices of that group arrive on this socket.
    pub(crate) fn add_membership(&self, group: u32) -> io::Result<()> {
        // SAFETY: `group` outlives the call, its size is passed, and the
        // descriptor is an open netlink socket owned by `self`.
        let rc = unsafe {
            libc::setsockopt(
                self.fd.as_raw_fd(),
                libc::SOL_NETLINK,
                libc::NETLINK_ADD_MEMBERSHIP,
                (&group as *const u32).cast(),
                std::mem::size_of::<u32>() as libc::socklen_t,
            )
        };
        if rc < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }

    pub(crate) fn send(&self, msg: &[u8]) -> io::Result<()> {
        let n = rustix::net::sendto(&self.fd, msg, SendFlags::empty(), &SocketAddrNetlink::new(0, 0))?;
        if n != msg.len() {
            return Err(io::Error::new(io::ErrorKind::WriteZero, "short netlink send"));
        }
        Ok(())
    }

    /// The next datagram from the kernel, waiting at most `timeout` (`None`:
    /// forever). `Ok(None)` when the time ran out.
    pub(crate) fn recv(&mut self, timeout: Option<Duration>) -> io::Result<Option<&[u8]>> {
        let deadline = timeout.map(|t| Instant::now() + t);
        loop {
            // Polled at least once, so a zero timeout still takes what waits.
            let wait = deadline.map(|d| d.saturating_duration_since(Instant::now()));
            if !poll_in(&self.fd, wait)? {
                if wait.is_some_and(|w| w.is_zero()) {
                    return Ok(None);
                }
                continue;
            }
            let (n, _, from) = match rustix::net::recvfrom(&self.fd, &mut self.buf[..], RecvFlags::TRUNC | RecvFlags::DONTWAIT) {
                Ok(r) => r,
                Err(rustix::io::Errno::AGAIN | rustix::io::Errno::INTR) => continue,
                Err(e) => return Err(e.into()),
            };
            let from_kernel = from.and_then(|a| SocketAddrNetlink::try_from(a).ok()).is_some_and(|a| a.pid() == 0);
            if !from_kernel {
                continue;
            }
            if n > self.buf.len() {
                return Err(invalid(format!("netlink datagram of {n} bytes truncated")));
            }
            return Ok(Some(&self.buf[..n]));
        }
    }

    /// Sends the request `build(seq)` makes (which must ask for an ack) and
    /// collects the genl payloads of the replies bearing its sequence number
    /// until the ack. A negative errno in the ack is the error.
    pub(crate) fn transact(&mut self, build: impl FnOnce(u32) -> Vec<u8>) -> io::Result<Vec<Vec<u8>>> {
        let seq = self.next_seq();
        self.send(&build(seq))?;
        let deadline = Instant::now() + REPLY_TIMEOUT;
        let mut replies = Vec::new();
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let Some(dgram) = self.recv(Some(left))? else {
                return Err(io::Error::new(io::ErrorKind::TimedOut, "no netlink reply"));
            };
            for m in nlmsg::messages(dgram) {
                let m = m.map_err(invalid)?;
                if m.seq != seq {
                    continue; // a notice, or the answer to an abandoned request
                }
                match m.kind {
                    NLMSG_ERROR => {
                        let code = nlmsg::error_code(m.payload).map_err(invalid)?;
                        if code < 0 {
                            return Err(io::Error::from_raw_os_error(-code));
                        }
                        return Ok(replies);
                    }
                    NLMSG_DONE => return Ok(replies),
                    _ => replies.push(m.payload.to_vec()),
                }
            }
        }
    }

    /// The id and multicast groups of a genl family; ENOENT when the kernel
    /// has no such family (its module is not loaded).
    pub(crate) fn resolve_family(&mut self, name: &str) -> io::Result<Family> {
        let replies = self.transact(|seq| nlmsg::get_family_request(name, seq))?;
        let first = replies.first().ok_or_else(|| invalid("family lookup without a reply"))?;
        let (_, attrs) = nlmsg::genl(first).map_err(invalid)?;
        nlmsg::parse_family(attrs).map_err(invalid)
    }
}

impl AsFd for GenlSocket {
    fn as_fd(&self) -> std::os::fd::BorrowedFd<'_> {
        self.fd.as_fd()
    }
}

/// Whether `fd` became readable within `wait` (`None`: wait forever).
fn poll_in(fd: &OwnedFd, wait: Option<Duration>) -> io::Result<bool> {
    use rustix::event::{PollFd, PollFlags, Timespec};
    let mut fds = [PollFd::new(fd, PollFlags::IN)];
    let ts = wait.map(|w| Timespec { tv_sec: w.as_secs() as _, tv_nsec: w.subsec_nanos() as _ });
    match rustix::event::poll(&mut fds, ts.as_ref()) {
        Ok(n) => Ok(n > 0),
        Err(rustix::io::Errno::INTR) => Ok(false),
        Err(e) => Err(e.into()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The controller itself answers through the same socket code: its own
    /// family resolves, with its multicast group.
    #[test]
    fn genetlink_resolves_the_controller_family() {
        let mut s = GenlSocket::open().expect("socket");
        let f = s.resolve_family("nlctrl").expect("nlctrl");
        // GENL_ID_CTRL (linux/genetlink.h), from the header, not the code under test.
        const GENL_ID_CTRL: u16 = 0x10;
        assert_eq!(f.id, GENL_ID_CTRL);
        assert!(f.groups.iter().any(|(n, _)| n == "notify"), "groups {:?}", f.groups);
        let e = s.resolve_family("volring-nofam").unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::ENOENT));
    }
}
