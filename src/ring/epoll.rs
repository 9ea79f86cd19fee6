//! The fallback engine: epoll for readiness, plain syscalls for reads, a
//! deadline list for timeouts. Used where io_uring is unavailable.

use std::io;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rustix::event::epoll;

use super::{RawCompletion, WAKE_SLOT};

pub(super) struct EpollEngine {
    epoll: OwnedFd,
    _wake: Arc<OwnedFd>,
    /// Results of reads done at submission, delivered on the next wait.
    ready: Vec<RawCompletion>,
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
    pub(super) fn new(wake: &Arc<OwnedFd>) -> io::Result<Self> {
        let epoll = epoll::create(epoll::CreateFlags::CLOEXEC)?;
        epoll::add(&epoll, wake.as_fd(), epoll::EventData::new_u64(WAKE_SLOT), epoll::EventFlags::IN)?;
        Ok(Self { epoll, _wake: wake.clone(), ready: Vec::new(), timers: Vec::new() })
    }

    /// Level-triggered: the fd is reported for as long as it is ready, which is
    /// what a multishot poll that the driver drains amounts to.
    pub(super) fn poll(&mut self, slot: u64, fd: BorrowedFd<'_>, events: u32) -> io::Result<()> {
        epoll::add(&self.epoll, fd, epoll::EventData::new_u64(slot), to_epoll(events))?;
        Ok(())
    }

    pub(super) fn read(&mut self, slot: u64, fd: BorrowedFd<'_>, buf: &mut [u8], offset: Option<u64>) {
        let r = match offset {
            Some(off) => rustix::io::pread(fd, buf, off),
            None => rustix::io::read(fd, buf),
        };
        let res = match r {
            Ok(n) => n.min(i32::MAX as usize) as i32,
            Err(e) => -e.raw_os_error(),
        };
        self.ready.push(RawCompletion { slot, res, more: false });
    }

    pub(super) fn timeout(&mut self, slot: u64, after: Duration) {
        self.timers.push((Instant::now() + after, slot));
    }

    pub(super) fn wait(&mut self, out: &mut Vec<RawCompletion>) -> io::Result<()> {
        let timeout = if !self.ready.is_empty() {
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
            out.push(RawCompletion { slot: ev.data.u64(), res: from_epoll(ev.flags) as i32, more: true });
        }
        out.append(&mut self.ready);
        let now = Instant::now();
        self.timers.retain(|&(t, slot)| {
            if t <= now {
                out.push(RawCompletion { slot, res: 0, more: false });
                false
            } else {
                true
            }
        });
        Ok(())
    }
}
