//! The ring thread on both engines: readiness, reads, timeouts, commands.

use std::os::fd::OwnedFd;
use std::sync::Arc;
use std::time::{Duration, Instant};

use volring::ring::{events, queue, Backend, BackendChoice, Completion, Driver, Flow, Reactor, RingThread};

const READY: u64 = 1;
const READ: u64 = 2;
const TIMER: u64 = 3;

/// Echoes what it reads from a pipe, and reports timer and commands.
struct Echo {
    pipe: Arc<OwnedFd>,
    out: queue::Sender<String>,
    reading: bool,
}

impl Driver for Echo {
    type Command = String;

    fn start(&mut self, ring: &mut Reactor) -> std::io::Result<()> {
        ring.poll(READY, self.pipe.clone(), events::IN)?;
        ring.timeout(TIMER, Duration::from_millis(20))
    }

    fn on_command(&mut self, cmd: String, _ring: &mut Reactor) -> Flow {
        if cmd == "stop" {
            return Flow::Stop;
        }
        let _ = self.out.try_send(format!("cmd:{cmd}"));
        Flow::Continue
    }

    fn on_completion(&mut self, c: Completion, ring: &mut Reactor) -> Flow {
        match c.token {
            READY if !self.reading => {
                self.reading = true;
                ring.read(READ, self.pipe.clone(), vec![0; 64], None).expect("read queued");
            }
            READ => {
                self.reading = false;
                let buf = c.buf.expect("read returns its buffer");
                assert_eq!(buf.len(), 64, "the buffer comes back whole");
                let n = c.result.expect("read ok") as usize;
                let _ = self.out.try_send(format!("read:{}", String::from_utf8_lossy(&buf[..n])));
            }
            TIMER => {
                assert!(c.result.is_ok(), "a timeout that expires is not an error");
                let _ = self.out.try_send("timer".into());
            }
            _ => {}
        }
        Flow::Continue
    }
}

fn exercise(choice: BackendChoice, expect: Backend) {
    let (r, w) = rustix::pipe::pipe_with(rustix::pipe::PipeFlags::CLOEXEC | rustix::pipe::PipeFlags::NONBLOCK).expect("pipe");
    let (tx, rx) = queue::bounded(16);
    let t0 = Instant::now();
    let ring = RingThread::spawn("test-ring", Echo { pipe: Arc::new(r), out: tx, reading: false }, choice, 4).expect("ring starts");
    assert_eq!(ring.backend(), expect);
    assert_eq!(rx.recv_timeout(Duration::from_secs(5)).as_deref(), Some("timer"));
    assert!(t0.elapsed() >= Duration::from_millis(20));
    rustix::io::write(&w, b"hello").expect("write");
    assert_eq!(rx.recv_timeout(Duration::from_secs(5)).as_deref(), Some("read:hello"));
    rustix::io::write(&w, b"again").expect("write");
    assert_eq!(rx.recv_timeout(Duration::from_secs(5)).as_deref(), Some("read:again"));
    ring.send("x".into()).expect("command queued");
    assert_eq!(rx.recv_timeout(Duration::from_secs(5)).as_deref(), Some("cmd:x"));
    ring.send("stop".into()).expect("command queued");
    ring.stop().expect("stops cleanly");
    assert_eq!(rx.recv_timeout(Duration::from_millis(100)), None, "the driver is gone and said nothing more");
}

#[test]
fn io_uring_engine() {
    exercise(BackendChoice::IoUring, Backend::IoUring);
}

#[test]
fn epoll_engine() {
    exercise(BackendChoice::Epoll, Backend::Epoll);
}

#[test]
fn a_failing_driver_start_is_reported() {
    struct Fails;
    impl Driver for Fails {
        type Command = ();
        fn start(&mut self, _: &mut Reactor) -> std::io::Result<()> {
            Err(std::io::Error::other("no"))
        }
        fn on_command(&mut self, _: (), _: &mut Reactor) -> Flow {
            Flow::Continue
        }
        fn on_completion(&mut self, _: Completion, _: &mut Reactor) -> Flow {
            Flow::Continue
        }
    }
    let err = RingThread::spawn("fails", Fails, BackendChoice::Auto, 1).err().expect("start error");
    assert_eq!(err.to_string(), "no");
}
