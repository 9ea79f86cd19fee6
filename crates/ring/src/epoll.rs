//! The fallback engine: epoll for readiness, plain syscalls for reads, a
//! deadline list for timeouts. Used where io_uring is unavailable. Its ops
//! live in the same kind of table as the io_uring engine's; nothing here is
//! ever held by the kernel (reads are done at submission), so dropping it
//! needs no cancellation.

use std::io;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd, RawFd};
use std::time::Instant;

use rustix::event::epoll;

use super::ops::{OpTable, Reaped, WAKE};
use super::reactor::{Op, Pending};
use super::Token;

pub(super) struct EpollEngine {
    epoll: OwnedFd,
    ops: OpTable<Op>,
    /// Results of reads done at submission, delivered on the next wait.
    ready: Vec<(u64, i32)>,
    timers: Vec<(Instant, u64)>,
}

fn to_epoll(events: u32) -> epoll::EventFlags {
    let mut f = epoll::EventFlags::empty();
    if events & libc::POLLIN as u32 != 0 {
        f |= epoll::EventFlags::IN;
    }
    if events & libc::POLLPRI as u32 != 0 {
        f |= epoll::EventFlags::PRI;
    }
    if events & libc::POLLOUT as u32 != 0 {
        f |= epoll::EventFlags::OUT;
    }
    f
}

fn from_epoll(f: epoll::EventFlags) -> u32 {
    let mut e = 0u32;
    for (flag, bit) in [
        (epoll::EventFlags::IN, libc::POLLIN),
        (epoll::EventFlags::PRI, libc::POLLPRI),
        (epoll::EventFlags::OUT, libc::POLLOUT),
        (epoll::EventFlags::ERR, libc::POLLERR),
        (epoll::EventFlags::HUP, libc::POLLHUP),
    ] {
        if f.contains(flag) {
            e |= bit as u32;
        }
    }
    e
}

impl EpollEngine {
    pub(super) fn new(wake: RawFd) -> io::Result<Self> {
        let epoll = epoll::create(epoll::CreateFlags::CLOEXEC)?;
        // SAFETY: the reactor's owner keeps the mailbox eventfd open for as
        // long as the reactor; it is only borrowed for this call.
        let wake = unsafe { BorrowedFd::borrow_raw(wake) };
        epoll::add(&epoll, wake, epoll::EventData::new_u64(WAKE), epoll::EventFlags::IN)?;
        Ok(Self { epoll, ops: OpTable::default(), ready: Vec::new(), timers: Vec::new() })
    }

    #[cfg(test)]
    pub(super) fn in_flight(&self) -> usize {
        self.ops.len()
    }

    pub(super) fn token(&self, ud: u64) -> Option<Token> {
        self.ops.get(ud).map(|op| op.token)
    }

    /// Polls are level-triggered: the fd is reported for as long as it is
    /// ready, which is what a multishot poll that the driver drains amounts
    /// to. Reads happen now; their results come with the next wait.
    pub(super) fn submit(&mut self, op: Op) -> io::Result<()> {
        if !op.is_single() {
            return Err(io::Error::new(io::ErrorKind::InvalidInput, "batch reads start in their batch"));
        }
        let ud = self.ops.insert(op);
        let op = self.ops.get_mut(ud).expect("just inserted");
        match &mut op.pending {
            Pending::Poll { fd, events } => {
                if let Err(e) = epoll::add(&self.epoll, fd.as_fd(), epoll::EventData::new_u64(ud), to_epoll(*events)) {
                    self.ops.remove(ud);
                    return Err(e.into());
                }
            }
            Pending::Read { fd, buf, offset } => {
                let r = match offset {
                    Some(off) => rustix::io::pread(fd.as_fd(), buf, *off),
                    None => rustix::io::read(fd.as_fd(), buf),
                };
                let res = match r {
                    Ok(n) => n.min(i32::MAX as usize) as i32,
                    Err(e) => -e.raw_os_error(),
                };
                self.ready.push((ud, res));
            }
            Pending::Timeout { after, .. } => self.timers.push((Instant::now() + *after, ud)),
            // Refused above: the epoll engine reads a batch with `pread`.
            Pending::Batch(_) => {}
        }
        Ok(())
    }

    /// Waits for readiness or the next timer; without waiting when reads
    /// done at submission or `out` (completions left to deliver) are there.
    pub(super) fn wait(&mut self, out: &mut Vec<Reaped<Op>>) -> io::Result<()> {
        let timeout = if !self.ready.is_empty() || !out.is_empty() {
            Some(rustix::time::Timespec { tv_sec: 0, tv_nsec: 0 })
        } else {
            self.timers.iter().map(|(t, _)| *t).min().map(|t| {
                let d = t.saturating_duration_since(Instant::now());
                rustix::time::Timespec { tv_sec: d.as_secs() as i64, tv_nsec: d.subsec_nanos() as i64 }
            })
        };
        let mut events = Vec::with_capacity(64);
        match epoll::wait(&self.epoll, rustix::buffer::spare_capacity(&mut events), timeout.as_ref()) {
            Ok(_) => {}
            Err(rustix::io::Errno::INTR) => {}
            Err(e) => return Err(e.into()),
        }
        for ev in &events {
            let ud = ev.data.u64();
            let res = from_epoll(ev.flags) as i32;
            if ud == WAKE {
                out.push(Reaped { user_data: WAKE, res, flags: 0, more: true, last: None });
            } else {
                out.extend(self.ops.complete(ud, res, 0, true));
            }
        }
        for (ud, res) in self.ready.drain(..) {
            out.extend(self.ops.complete(ud, res, 0, false));
        }
        let now = Instant::now();
        let ops = &mut self.ops;
        self.timers.retain(|&(t, ud)| {
            if t <= now {
                out.extend(ops.complete(ud, 0, 0, false));
                false
            } else {
                true
            }
        });
        Ok(())
    }
}
