//! [`Reactor`]: what a ring thread's driver submits through — poll, read,
//! timeout, and batches of reads waited for in place ([`ReadBatch`]) — on
//! either engine, with the driver's tokens in the completions.

use std::io;
use std::os::fd::{OwnedFd, RawFd};
use std::sync::{Arc, Once};
use std::time::Duration;

use super::batch::{pread_all, BatchOp, BatchRead, Batches, HoldsBatchOp, ReadBatch};
use super::ops::{Reaped, WAKE};
use super::{epoll, uring, Backend, BackendChoice, Completion, Events, Token};

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
    /// A read of a batch ([`Reactor::read_batch`]): started and reaped by
    /// the batch itself, never handed to the driver.
    Batch(BatchOp),
}

pub(super) struct Op {
    pub token: Token,
    pub pending: Pending,
}

impl Op {
    /// Whether the op is one a driver asked for (poll, read, timeout):
    /// batch reads are started by their batch only.
    pub(super) fn is_single(&self) -> bool {
        !matches!(self.pending, Pending::Batch(_))
    }
}

impl HoldsBatchOp for Op {
    fn from_batch(op: BatchOp) -> Self {
        Op { token: 0, pending: Pending::Batch(op) }
    }

    fn into_batch(self) -> Result<BatchOp, Self> {
        match self.pending {
            Pending::Batch(op) => Ok(op),
            pending => Err(Op { pending, ..self }),
        }
    }
}

#[allow(clippy::large_enum_variant)] // one per ring thread, made once: boxing buys nothing
enum Engine {
    Uring(uring::UringEngine),
    Epoll(epoll::EpollEngine),
}

/// What a driver asks of its reactor ([`Reactor::submit`]).
pub enum ReactorOp {
    /// Waits for `events` on `fd` until cancelled: one completion per
    /// readiness, re-armed by the ring if the kernel ends the multishot.
    Poll { fd: Arc<OwnedFd>, events: Events },
    /// Reads into `buf` (its whole length) at `offset`, or at the file
    /// position when `offset` is `None`; the completion brings `buf` back.
    Read { fd: Arc<OwnedFd>, buf: Vec<u8>, offset: Option<u64> },
    /// Completes once after the given time.
    Timeout(Duration),
}

/// The operation interface a driver gets: submit, and the ring delivers.
pub struct Reactor {
    engine: Engine,
    reaped: Vec<Reaped<Op>>,
    /// Completions of the driver's ops that came during a batch of reads,
    /// delivered at the next wait.
    deferred: Vec<Reaped<Op>>,
    batches: Batches,
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
        Ok(Self { engine, reaped: Vec::with_capacity(256), deferred: Vec::new(), batches: Batches::default() })
    }

    pub(crate) fn backend(&self) -> Backend {
        match self.engine {
            Engine::Uring(_) => Backend::IoUring,
            Engine::Epoll(_) => Backend::Epoll,
        }
    }

    /// Lets each wait, once it has begun, gather completions for up to
    /// `window` (or until 256 are there) before the driver sees them, so a
    /// storm of events costs one turn per window instead of one wakeup per
    /// event. A wait idle for longer than the window returns with the first
    /// completion. Zero (the default) turns at every completion.
    /// io_uring only, on kernels with `min_wait` (6.12+): elsewhere ignored.
    pub fn set_batch_window(&mut self, window: Duration) {
        if let Engine::Uring(e) = &mut self.engine {
            e.set_batch_window(window);
        }
    }

    #[cfg(test)]
    /// Operations submitted and not yet ended (multishot polls count until
    /// they are cancelled).
    pub(crate) fn in_flight(&self) -> usize {
        match &self.engine {
            Engine::Uring(e) => e.in_flight(),
            Engine::Epoll(e) => e.in_flight(),
        }
    }

    fn start(&mut self, op: Op) -> io::Result<()> {
        match &mut self.engine {
            Engine::Uring(e) => e.submit(op),
            Engine::Epoll(e) => e.submit(op),
        }
    }

    /// Starts `op`; its completion comes back under `token`.
    pub fn submit(&mut self, token: Token, op: ReactorOp) -> io::Result<()> {
        let pending = match op {
            ReactorOp::Poll { fd, events } => Pending::Poll { fd, events: events.bits() },
            ReactorOp::Read { fd, buf, offset } => Pending::Read { fd, buf, offset },
            ReactorOp::Timeout(after) => Pending::Timeout { after, spec: None },
        };
        self.start(Op { token, pending })
    }

    /// Blocks until at least one event (not at all when a batch of reads
    /// left completions to deliver), then turns what ended into
    /// completions. `woken` is set when the mailbox eventfd fired.
    pub(super) fn wait(&mut self, out: &mut Vec<Completion>, woken: &mut bool) -> io::Result<()> {
        let mut reaped = std::mem::take(&mut self.reaped);
        reaped.append(&mut self.deferred);
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
                    self.start(Op { token, pending: Pending::Poll { fd, events } })?;
                }
            }
            Pending::Read { buf, .. } => out.push(Completion { token, result, buf: Some(buf) }),
            // A read abandoned at its batch's deadline let go: its buffer is free.
            Pending::Batch(_) => self.batches.late_completion(),
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

impl ReadBatch for Reactor {
    /// Runs the batch on this reactor's own ring (`pread` on the epoll
    /// engine); the driver's completions that arrive meanwhile wait for the
    /// ring's next turn.
    fn read_batch(&mut self, reads: &mut [BatchRead<'_>], timeout: Duration) -> io::Result<()> {
        match &mut self.engine {
            Engine::Uring(e) => e.read_batch(&mut self.batches, reads, timeout, &mut self.deferred),
            Engine::Epoll(_) => {
                pread_all(reads);
                Ok(())
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsRawFd;

    fn uring_reactor(wake: &OwnedFd) -> Reactor {
        Reactor::new(BackendChoice::IoUring, wake.as_raw_fd()).expect("io_uring reactor")
    }

    fn eventfd() -> OwnedFd {
        rustix::event::eventfd(0, rustix::event::EventfdFlags::CLOEXEC).expect("eventfd")
    }

    #[test]
    fn a_batch_window_gathers_completions_into_one_turn() {
        let wake = eventfd();
        let mut r = uring_reactor(&wake);
        let Engine::Uring(e) = &r.engine else { unreachable!() };
        if !e.min_wait() {
            eprintln!("skipped: this kernel has no io_uring min_wait (6.12+)");
            return;
        }
        // Eight reads whose data another thread writes 3 ms apart, well
        // inside one 1 s window; without the window the first wait returns
        // with the first read. (Not timeouts: a timeout op ends any wait.)
        r.set_batch_window(Duration::from_secs(1));
        let pipes: Vec<_> = (0..8).map(|_| rustix::pipe::pipe_with(rustix::pipe::PipeFlags::CLOEXEC).expect("pipe")).collect();
        for (i, (rd, _)) in pipes.iter().enumerate() {
            let fd = Arc::new(rd.try_clone().expect("dup"));
            r.submit(i as Token, ReactorOp::Read { fd, buf: vec![0; 8], offset: None }).unwrap();
        }
        let (mut out, mut woken) = (Vec::new(), false);
        std::thread::scope(|s| {
            s.spawn(|| {
                for (_, w) in &pipes {
                    std::thread::sleep(Duration::from_millis(3));
                    rustix::io::write(w, b"x").expect("write");
                }
            });
            r.wait(&mut out, &mut woken).unwrap();
        });
        let mut tokens: Vec<Token> = out.iter().map(|c| c.token).collect();
        tokens.sort_unstable();
        assert_eq!(tokens, (0..8).collect::<Vec<_>>(), "one turn reaps the whole burst");
        assert!(out.iter().all(|c| matches!(c.result, Ok(1))));
        assert!(!woken);
        assert_eq!(r.in_flight(), 0);
    }

    #[test]
    fn a_wait_idle_longer_than_the_window_returns_with_the_first_completion() {
        let wake = eventfd();
        let mut r = uring_reactor(&wake);
        r.set_batch_window(Duration::from_millis(1));
        // Data comes to one pipe 20 ms in, long after the window; the other
        // pipe stays empty. One wait returns with the one read: it neither
        // ends empty when the window does nor waits for a full batch.
        let pipes: Vec<_> = (0..2).map(|_| rustix::pipe::pipe_with(rustix::pipe::PipeFlags::CLOEXEC).expect("pipe")).collect();
        for (i, (rd, _)) in pipes.iter().enumerate() {
            r.submit(i as Token, ReactorOp::Read { fd: Arc::new(rd.try_clone().expect("dup")), buf: vec![0; 8], offset: None }).unwrap();
        }
        let (mut out, mut woken) = (Vec::new(), false);
        std::thread::scope(|s| {
            s.spawn(|| {
                std::thread::sleep(Duration::from_millis(20));
                rustix::io::write(&pipes[0].1, b"x").expect("write");
            });
            r.wait(&mut out, &mut woken).unwrap();
        });
        assert_eq!(out.iter().map(|c| c.token).collect::<Vec<_>>(), vec![0]);
        assert_eq!(r.in_flight(), 1);
    }

    #[test]
    fn a_batch_keeps_the_drivers_completions_for_the_next_wait() {
        let wake = eventfd();
        let mut r = uring_reactor(&wake);
        // A poll on a ready pipe completes as soon as it is submitted: during
        // the batch, whose one read (of a pipe nobody writes) waits out its
        // deadline.
        let (ready, ready_w) = rustix::pipe::pipe_with(rustix::pipe::PipeFlags::CLOEXEC).expect("pipe");
        rustix::io::write(&ready_w, b"x").expect("write");
        r.submit(7, ReactorOp::Poll { fd: Arc::new(ready), events: crate::Events::IN }).unwrap();
        let (quiet, _quiet_w) = rustix::pipe::pipe_with(rustix::pipe::PipeFlags::CLOEXEC).expect("pipe");
        let mut reads = [BatchRead::new(std::os::fd::AsFd::as_fd(&quiet), 0, vec![0; 16])];
        r.read_batch(&mut reads, Duration::from_millis(10)).unwrap();
        assert_eq!(reads[0].result.as_ref().unwrap_err().kind(), io::ErrorKind::TimedOut);
        assert_eq!(reads[0].buf.len(), 16, "the cancelled read's buffer came back");
        assert_eq!(r.deferred.len(), 1, "the poll's completion was kept");
        let (mut out, mut woken) = (Vec::new(), false);
        r.wait(&mut out, &mut woken).unwrap();
        assert_eq!(out.iter().map(|c| c.token).collect::<Vec<_>>(), vec![7], "and delivered at the next wait, without blocking");
        assert!(matches!(out[0].result, Ok(ev) if ev & crate::Events::IN.bits() != 0));
        assert_eq!(r.in_flight(), 1, "only the poll is left");
    }

    #[test]
    fn the_ring_defers_task_work_where_the_kernel_allows_it() {
        let allowed = io_uring::IoUring::<io_uring::squeue::Entry>::builder().setup_single_issuer().setup_defer_taskrun().build(8).is_ok();
        let (_ring, deferred) = uring::build_ring().expect("ring");
        assert_eq!(deferred, allowed);
    }
}
