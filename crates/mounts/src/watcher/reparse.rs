//! The fallback strategy: POLLPRI on mountinfo, re-read, diff.
//!
//! Correct but costly: every change re-reads the whole table (about 37 ms at
//! 10,000 mounts here), and changes that come faster than that are seen only
//! as their net effect. Signals that pile up while a re-read runs are folded:
//! one re-read per batch of completions, since it reads the latest table.

use std::os::fd::OwnedFd;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use super::emitter::Emitter;
use super::{Command, ResyncCause};
use crate::diff::diff;
use crate::source::read_mountinfo;
use crate::table::MountTable;
use crate::Error;
use volring_ring::{self as ring, Completion, Driver, Flow, Reactor};

const TABLE_CHANGED: ring::Token = 1;
const RETRY: ring::Token = 2;

pub(super) struct ReparseDriver {
    mountinfo: Arc<OwnedFd>,
    buf: Vec<u8>,
    table: MountTable,
    emitter: Emitter,
    /// The table changed since the last re-read.
    dirty: bool,
}

impl ReparseDriver {
    pub(super) fn new(emitter: Emitter) -> Result<Self, Error> {
        let mountinfo: OwnedFd = std::fs::File::open("/proc/thread-self/mountinfo").map_err(|e| Error::Io("open mountinfo", e))?.into();
        let mut d = Self { mountinfo: Arc::new(mountinfo), buf: Vec::new(), table: MountTable::default(), emitter, dirty: false };
        d.table = d.read_table()?;
        Ok(d)
    }

    pub(super) fn table(&self) -> &MountTable {
        &self.table
    }

    fn read_table(&mut self) -> Result<MountTable, Error> {
        read_mountinfo(&*self.mountinfo, &mut self.buf).map_err(|e| Error::Io("read mountinfo", e))?;
        let (table, errors) = MountTable::from_mountinfo(&self.buf);
        if let Some(first) = errors.first() {
            self.emitter.counters().parse_errors.fetch_add(errors.len() as u64, Ordering::Relaxed);
            tracing::warn!(count = errors.len(), first = %first, "malformed mountinfo lines skipped");
        }
        Ok(table)
    }

    fn reparse(&mut self, cause: ResyncCause, ring: &mut Reactor) {
        self.emitter.counters().resynced(cause);
        match self.read_table() {
            Ok(new) => {
                let changes = diff(&self.table, &new);
                self.table = new;
                changes.into_iter().for_each(|e| self.emitter.emit(e, ring, RETRY));
            }
            Err(e) => {
                tracing::error!(error = %e, "mountinfo re-read failed");
                self.emitter.counters().errors.fetch_add(1, Ordering::Relaxed);
            }
        }
    }
}

impl Driver for ReparseDriver {
    type Command = Command;

    fn start(&mut self, ring: &mut Reactor) -> std::io::Result<()> {
        ring.submit(TABLE_CHANGED, ring::ReactorOp::Poll { fd: self.mountinfo.clone(), events: ring::Events::PRI })
    }

    fn on_command(&mut self, cmd: Command, ring: &mut Reactor) -> Flow {
        match cmd {
            Command::Resync => self.reparse(ResyncCause::Requested, ring),
        }
        self.emitter.flow()
    }

    fn on_completion(&mut self, c: Completion, ring: &mut Reactor) -> Flow {
        match c.token {
            TABLE_CHANGED => self.dirty = true,
            RETRY => self.emitter.retry(ring, RETRY),
            _ => {}
        }
        self.emitter.flow()
    }

    fn end_of_batch(&mut self, ring: &mut Reactor) -> Flow {
        if std::mem::take(&mut self.dirty) {
            self.reparse(ResyncCause::Reparse, ring);
        }
        self.emitter.announce();
        self.emitter.flow()
    }
}
