//! [`Reactor`]: what a ring thread's driver submits through — poll, read,
//! timeout — on either engine, with the driver's tokens in the completions.

use std::io;
use std::os::fd::{OwnedFd, RawFd};
use std::sync::{Arc, Once};
use std::time::Duration;

use super::ops::{Reaped, WAKE};
use super::{epoll, uring, Backend, BackendChoice, Completion, Token};

/// What one reactor op holds until its last completion: the fd stays open
/// and the buffer stays alive for exactly that long.
pub(super) enum Pending {
    Poll {
        fd: Arc<OwnedFd>,
        events: u32,
    },
    Read {
        fd: Arc<OwnedFd>,
        buf: Vec<u8>,
        offset: Option<u64>,
    },
    /// The io_uring engine keeps the timespec the kernel reads here (boxed:
    /// the op itself moves when the table grows).
    Timeout {
        after: Duration,
        spec: Option<Box<io_uring::types::Timespec>>,
    },
}

pub(super) struct Op {
    pub token: Token,
    pub pending: Pending,
}

#[allow(clippy::large_enum_variant)] // one per ring thread, made once: boxing buys nothing
enum Engine {
    Uring(uring::UringEngine),
    Epoll(epoll::EpollEngine),
}

/// The operation interface a driver gets: submit, and the ring delivers.
pub struct Reactor {
    engine: Engine,
    reaped: Vec<Reaped<Op>>,
}

impl Reactor {
    /// A reactor whose waits also end when `wake` (the mailbox eventfd)
    /// becomes readable; `wake` must stay open as long as the reactor.
    pub(super) fn new(choice: BackendChoice, wake: RawFd) -> io::Result<Self> {
        let engine = match choice {
            BackendChoice::Epoll => Engine::Epoll(epoll::EpollEngine::new(wake)?),
            BackendChoice::IoUring => Engine::Uring(uring::UringEngine::new(wake)?),
            BackendChoice::Auto => match uring::UringEngine::new(wake) {
                Ok(e) => Engine::Uring(e),
                Err(err) => {
                    static ONCE: Once = Once::new();
                    ONCE.call_once(
                        || tracing::warn!(error = %err, "io_uring unavailable; ring threads fall back to epoll and plain syscalls"),
                    );
                    Engine::Epoll(epoll::EpollEngine::new(wake)?)
                }
            },
        };
        Ok(Self { engine, reaped: Vec::with_capacity(256) })
    }

    pub fn backend(&self) -> Backend {
        match self.engine {
            Engine::Uring(_) => Backend::IoUring,
            Engine::Epoll(_) => Backend::Epoll,
        }
    }

    /// Operations submitted and not yet ended (multishot polls count until
    /// they are cancelled).
    pub fn in_flight(&self) -> usize {
        match &self.engine {
            Engine::Uring(e) => e.in_flight(),
            Engine::Epoll(e) => e.in_flight(),
        }
    }

    fn submit(&mut self, op: Op) -> io::Result<()> {
        match &mut self.engine {
            Engine::Uring(e) => e.submit(op),
            Engine::Epoll(e) => e.submit(op),
        }
    }

    /// Waits for `events` on `fd` until cancelled: one completion per
    /// readiness, re-armed by the ring if the kernel ends the multishot.
    pub fn poll(&mut self, token: Token, fd: Arc<OwnedFd>, events: u32) -> io::Result<()> {
        self.submit(Op { token, pending: Pending::Poll { fd, events } })
    }

    /// Reads into `buf` (its whole length) at `offset`, or at the file
    /// position when `offset` is `None`.
    pub fn read(&mut self, token: Token, fd: Arc<OwnedFd>, buf: Vec<u8>, offset: Option<u64>) -> io::Result<()> {
        self.submit(Op { token, pending: Pending::Read { fd, buf, offset } })
    }

    /// Completes once after `after`.
    pub fn timeout(&mut self, token: Token, after: Duration) -> io::Result<()> {
        self.submit(Op { token, pending: Pending::Timeout { after, spec: None } })
    }

    /// Blocks until at least one event, then turns what ended into
    /// completions. `woken` is set when the mailbox eventfd fired.
    pub(super) fn wait(&mut self, out: &mut Vec<Completion>, woken: &mut bool) -> io::Result<()> {
        let mut reaped = std::mem::take(&mut self.reaped);
        let r = match &mut self.engine {
            Engine::Uring(e) => e.wait(&mut reaped),
            Engine::Epoll(e) => e.wait(&mut reaped),
        };
        let mut result = r;
        for c in reaped.drain(..) {
            if c.user_data == WAKE {
                *woken = true;
            } else if let Err(e) = self.deliver(c, out) {
                result = result.and(Err(e));
            }
        }
        self.reaped = reaped;
        result
    }

    fn deliver(&mut self, c: Reaped<Op>, out: &mut Vec<Completion>) -> io::Result<()> {
        let result = if c.res < 0 { Err(io::Error::from_raw_os_error(-c.res)) } else { Ok(c.res as u32) };
        let Some(op) = c.last else {
            // A multishot poll that stays armed.
            let token = match &self.engine {
                Engine::Uring(e) => e.token(c.user_data),
                Engine::Epoll(e) => e.token(c.user_data),
            };
            if let Some(token) = token {
                out.push(Completion { token, result, buf: None });
            }
            return Ok(());
        };
        let token = op.token;
        match op.pending {
            Pending::Poll { fd, events } => {
                // The kernel ended the multishot (overflow, or the file said
                // so): arm a fresh one. An error ends the poll for good.
                let rearm = result.is_ok();
                out.push(Completion { token, result, buf: None });
                if rearm {
                    self.submit(Op { token, pending: Pending::Poll { fd, events } })?;
                }
            }
            Pending::Read { buf, .. } => out.push(Completion { token, result, buf: Some(buf) }),
            Pending::Timeout { .. } => {
                let result = match result {
                    Err(e) if e.raw_os_error() == Some(libc::ETIME) => Ok(0),
                    other => other,
                };
                out.push(Completion { token, result, buf: None });
            }
        }
        Ok(())
    }
}
