//! Where the agent's log lines go: stderr, unless stderr cannot take them
//! (its pipe closed by a restarting log collector, a full disk behind a
//! redirect). Then the line is dropped and counted, and the agent goes on:
//! a log sink must never be what stops it. tracing-subscriber's own writer
//! reports a failed write by printing to stderr, which panics when stderr
//! is the thing that failed (the agent exited 101 on `2>&1 | head -1`).

use std::io::Write;
use std::sync::atomic::{AtomicU64, Ordering};

/// Log lines dropped since start because stderr refused them
/// (`volring_log_lines_lost_total`).
static LOST: AtomicU64 = AtomicU64::new(0);

/// How many log lines could not be written so far.
pub(crate) fn lines_lost() -> u64 {
    LOST.load(Ordering::Relaxed)
}

/// A `MakeWriter` for stderr that never fails: what stderr refuses is
/// counted in `lines_lost` and dropped.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Stderr;

/// One event's writer (tracing-subscriber formats an event into a buffer
/// and writes it with one `write_all`).
#[derive(Debug)]
pub(crate) struct LossyWriter;

impl Write for LossyWriter {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        if std::io::stderr().lock().write_all(buf).is_err() {
            let lines = buf.iter().filter(|&&b| b == b'\n').count().max(1);
            LOST.fetch_add(lines as u64, Ordering::Relaxed);
        }
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        let _ = std::io::stderr().flush();
        Ok(())
    }
}

impl<'a> tracing_subscriber::fmt::MakeWriter<'a> for Stderr {
    type Writer = LossyWriter;

    fn make_writer(&'a self) -> Self::Writer {
        LossyWriter
    }
}
