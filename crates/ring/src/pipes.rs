//! The splice pipes of an [`IoRing`](super::io_ring::IoRing): file pages go
//! into a pipe and out to a socket without being copied. A pipe is lent to
//! one splice sequence at a time; each splice in flight marks it busy, so a
//! pipe given back while the kernel still uses it is pooled (if emptied) or
//! closed (if not) only at its last completion.

use std::io;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};

use super::io_op::PipeId;

/// Capacity asked of each splice pipe (the unprivileged maximum).
pub(crate) const PIPE_SIZE: usize = 1 << 20;

struct Pipe {
    read: OwnedFd,
    write: OwnedFd,
    busy: u32,
    /// Given back while busy: closed (if dirty) or pooled at the last completion.
    returned: Option<bool>,
}

/// Every pipe a ring made, by [`PipeId`]; a closed one leaves its slot empty.
#[derive(Default)]
pub(crate) struct PipePool {
    pipes: Vec<Option<Pipe>>,
    idle: Vec<u32>,
}

impl PipePool {
    /// An empty pipe for one splice sequence.
    pub(crate) fn take(&mut self) -> io::Result<PipeId> {
        if let Some(i) = self.idle.pop() {
            return Ok(PipeId(i));
        }
        let (read, write) = rustix::pipe::pipe_with(rustix::pipe::PipeFlags::CLOEXEC)?;
        // A larger pipe moves a whole 1 MiB read in one splice; if the
        // system refuses, the default size only means more splices.
        let _ = rustix::pipe::fcntl_setpipe_size(&write, PIPE_SIZE);
        self.pipes.push(Some(Pipe { read, write, busy: 0, returned: None }));
        Ok(PipeId(self.pipes.len() as u32 - 1))
    }

    /// Returns a pipe; `empty` says whether everything put in it was
    /// spliced out (a pipe with leftovers is closed, never reused).
    pub(crate) fn put(&mut self, pipe: PipeId, empty: bool) {
        let Some(Some(p)) = self.pipes.get_mut(pipe.0 as usize) else { return };
        if p.busy > 0 {
            p.returned = Some(empty);
            return;
        }
        self.retire(pipe.0, empty);
    }

    fn retire(&mut self, i: u32, empty: bool) {
        if empty {
            if let Some(Some(p)) = self.pipes.get_mut(i as usize) {
                p.returned = None;
            }
            self.idle.push(i);
        } else {
            self.pipes[i as usize] = None;
        }
    }

    /// One end of `pipe` for a splice about to start, marked busy until
    /// [`PipePool::release`]; `None` for a pipe that is gone.
    pub(crate) fn acquire(&mut self, pipe: PipeId, write_end: bool) -> Option<RawFd> {
        let p = self.pipes.get_mut(pipe.0 as usize).and_then(Option::as_mut)?;
        p.busy += 1;
        Some(if write_end { p.write.as_raw_fd() } else { p.read.as_raw_fd() })
    }

    /// A splice on pipe `i` ended (or never started).
    pub(crate) fn release(&mut self, i: u32) {
        if let Some(Some(p)) = self.pipes.get_mut(i as usize) {
            p.busy -= 1;
            if let (0, Some(empty)) = (p.busy, p.returned) {
                self.retire(i, empty);
            }
        }
    }
}
