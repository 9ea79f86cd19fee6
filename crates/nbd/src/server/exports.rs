//! The exports as one ring sees them: each one's descriptors registered
//! as fixed files (once, however many connections use it) and how its
//! buffered writes are done on this ring.

use std::collections::HashMap;
use std::io;
use std::os::fd::AsRawFd;
use std::sync::Arc;

use super::conn::Attached;
use super::inline::{InlineWrites, WritePath};
use super::shared::Shared;
use super::token::Token;
use crate::export::{Export, Exports};
use volring_ring::IoRing;

/// An export's descriptors as registered in this ring.
struct Registered {
    file: u32,
    buffered: Option<u32>,
    users: u32,
    /// How this export's buffered writes are done on this ring.
    writes: WritePath,
}

pub(super) struct Attachments {
    exports: Arc<Exports>,
    registered: HashMap<u64, Registered>,
    /// The server's inline-writes setting, for each newly attached export.
    inline: InlineWrites,
}

impl Attachments {
    pub(super) fn new(exports: Arc<Exports>, inline: InlineWrites) -> Self {
        Attachments { exports, registered: HashMap::new(), inline }
    }

    /// Every export of the server (what a handshake offers).
    pub(super) fn exports(&self) -> &Exports {
        &self.exports
    }

    /// How export `id`'s buffered writes are done on this ring.
    pub(super) fn write_path(&mut self, id: u64) -> Option<&mut WritePath> {
        self.registered.get_mut(&id).map(|r| &mut r.writes)
    }

    /// Registers an export's descriptors in this ring (once per export).
    pub(super) fn attach(&mut self, ring: &mut IoRing<Token>, export: Arc<Export>) -> io::Result<Attached> {
        if let Some(r) = self.registered.get_mut(&export.id) {
            r.users += 1;
            return Ok(Attached { export, file: r.file, buffered: r.buffered });
        }
        let file = ring.register_file(export.file().as_raw_fd())?;
        let buffered = match export.buffered() {
            Some(fd) => match ring.register_file(fd.as_raw_fd()) {
                Ok(s) => Some(s),
                Err(e) => {
                    let _ = ring.unregister_file(file);
                    return Err(e);
                }
            },
            None => None,
        };
        let writes = WritePath::new(self.inline);
        self.registered.insert(export.id, Registered { file, buffered, users: 1, writes });
        Ok(Attached { export, file, buffered })
    }

    pub(super) fn detach(&mut self, sh: &mut Shared, export: &Export) {
        let Some(r) = self.registered.get_mut(&export.id) else { return };
        r.users -= 1;
        if r.users == 0 {
            // Nothing of this export stays on this ring: not its counters
            // (folded now), not its descriptors (a removed export's file
            // must not be held open here).
            if let Some((e, mut pending)) = sh.stats.remove(&export.id) {
                e.stats.fold(&mut pending);
            }
            let r = self.registered.remove(&export.id).expect("present");
            let _ = sh.ring.unregister_file(r.file);
            if let Some(b) = r.buffered {
                let _ = sh.ring.unregister_file(b);
            }
        }
    }
}
