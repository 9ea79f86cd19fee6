//! Growing a staged `attach: nbd` volume: the image, then the device, then
//! (the caller's part) the filesystem.
//!
//! Why it takes more than a loop device's LOOP_SET_CAPACITY: the size a
//! connection serves is fixed when it negotiates (the server's export
//! checks every request against the size it opened the image with), and
//! the NBD protocol has no way to tell a client the export grew. So the
//! export is re-opened at the new size, the device's connections to the old
//! one are closed by the server (after answering what it read), the kernel
//! marks them dead and announces LINK_DEAD, queueing I/O for the
//! dead-connection timeout meanwhile, and fresh sockets to the new export
//! replace them (NBD_CMD_RECONFIGURE). Only then is the device told its new
//! size, with a second RECONFIGURE carrying NBD_ATTR_SIZE_BYTES: the kernel
//! (every version with the netlink interface, 4.12+, 6.1 included) applies
//! it to a live device and announces the new capacity, mounted or not. The
//! order matters: a larger device with an old connection left would send
//! requests past the old end to a server that refuses them.
//!
//! A request the server had not read when it closed a connection is resent
//! by the kernel after the request timeout (`--nbd-request-timeout`), so a
//! writer may pause that long during a grow; nothing fails.

use std::time::{Duration, Instant};

use super::{Error, NbdSide, Result, Served};
use volring_nbd::attach::local_sockets as connected_sockets;
use volring_nbd::attach::{self as nbdattach, LinkDeadListener};
use volring_volumes::attach::{self, Attachment};
use volring_volumes::{AttachKind, StagedVolume};

/// How long the kernel may take to see the old connections close (it
/// reads EOF on a socketpair at once; anything near this is a stuck ring).
const DROP_TIMEOUT: Duration = Duration::from_secs(10);

/// Why an nbd device could not grow.
#[derive(Debug, thiserror::Error)]
pub(crate) enum GrowError {
    /// No server in this agent serves the device (an agent restarted with
    /// `--nbd-no-heal`, or a device the healer could not reconnect).
    #[error("/dev/nbd{0} is not served by this agent; stage the volume again")]
    NotServed(u32),
    /// The old connections did not all close in time; the device got fresh
    /// sockets at its old size.
    #[error("/dev/nbd{index}: {dropped} of {connections} connections closed within {DROP_TIMEOUT:?}; the device keeps its old size")]
    Stuck { index: u32, dropped: usize, connections: usize },
    /// The kernel took the size without applying it (a kernel whose
    /// reconfigure ignores NBD_ATTR_SIZE_BYTES).
    #[error("/dev/nbd{index} still has {have} bytes after asking for {want}: this kernel does not resize nbd devices through NBD_CMD_RECONFIGURE")]
    KernelRefused { index: u32, have: u64, want: u64 },
    #[error("{0}")]
    Attach(#[from] nbdattach::Error),
    #[error("{0}")]
    Volume(#[from] volring_volumes::Error),
    /// The export could not be re-opened at the image's new size.
    #[error("re-open the export of {}: {source}", image.display())]
    Export { image: std::path::PathBuf, source: volring_nbd::Error },
}

impl From<GrowError> for Error {
    fn from(e: GrowError) -> Self {
        match e {
            // The node's state, not the request, is at fault: restaging (or
            // a kernel that resizes) makes the same call succeed.
            GrowError::NotServed(_) | GrowError::KernelRefused { .. } => Error::FailedPrecondition(e.to_string()),
            GrowError::Volume(v) => v.into(),
            e => Error::Internal(e.to_string()),
        }
    }
}

impl NbdSide {
    /// Makes a staged volume's device see its image's size (a loop device's
    /// LOOP_SET_CAPACITY, an nbd device's reconnect and resize); its size.
    pub(crate) fn refresh_device(&self, rec: &StagedVolume, a: &Attachment) -> Result<u64> {
        match a.kind {
            AttachKind::Loop => Ok(attach::refresh_capacity(a)?),
            AttachKind::Nbd => Ok(self.grow(rec, a)?),
        }
    }

    /// Makes `/dev/nbd<index>` serve all of `rec`'s image as it is now
    /// (see the module comment); its size in bytes. Idempotent: a device
    /// already at the image's size is left alone.
    pub(crate) fn grow(&self, rec: &StagedVolume, dev: &Attachment) -> std::result::Result<u64, GrowError> {
        let index = dev.number;
        let inner = self.inner.get().ok_or(GrowError::NotServed(index))?;
        // Held throughout: the LINK_DEAD watcher waits, and then finds
        // nothing dead (the kernel ignores sockets it has no slot for).
        let mut live = inner.live.lock().unwrap_or_else(|e| e.into_inner());
        // A remote volume grows where its image lives; this agent serves
        // only its own images' devices.
        let att = match live.get_mut(&index).map(|l| &mut l.served) {
            Some(Served::Local(att)) => att,
            Some(Served::Remote(_)) | None => return Err(GrowError::NotServed(index)),
        };
        let image = std::fs::metadata(&rec.image)
            .map_err(|source| volring_volumes::Error::Io { what: "stat", path: rec.image.clone(), source })?
            .len();
        // The device takes whole blocks (4096 unless the export needs more).
        let block = nbdattach::ConnectSpec::for_export(&att.details, &att.backend_id).block_size;
        let want = image - image % block;
        let mut control = inner.control.lock().unwrap_or_else(|e| e.into_inner());
        let served = inner.server.exports().get(&rec.volume_id).map(|e| e.size);
        if served != Some(image) {
            // Joined before the connections close, so no notice is missed.
            let mut notices = LinkDeadListener::open()?;
            if served.is_some() {
                inner.server.remove_export(&rec.volume_id).map_err(|source| GrowError::Export { image: rec.image.clone(), source })?;
            }
            inner.export(rec).map_err(|source| GrowError::Export { image: rec.image.clone(), source })?;
            let dropped = await_dead(&mut notices, index, att.connections)?;
            let (sockets, details) = connected_sockets(&inner.server, &att.export, att.connections)?;
            let fds: Vec<_> = sockets.iter().map(std::os::fd::AsFd::as_fd).collect();
            control.reconfigure(index, &att.backend_id, None, &fds)?;
            att.details = details;
            if dropped < att.connections {
                return Err(GrowError::Stuck { index, dropped, connections: att.connections });
            }
        }
        let have = attach::device_bytes(dev)?;
        if have < want {
            control.reconfigure(index, &att.backend_id, Some(want), &[])?;
            let now = attach::device_bytes(dev)?;
            if now < want {
                return Err(GrowError::KernelRefused { index, have: now, want });
            }
            tracing::info!(index, volume = %rec.volume_id, from = have, to = now, "nbd device grown");
            return Ok(now);
        }
        Ok(have)
    }
}

/// Counts LINK_DEAD notices for `index` until `connections` arrived or
/// [`DROP_TIMEOUT`] passed (the kernel sends one per connection it finds
/// dead).
fn await_dead(notices: &mut LinkDeadListener, index: u32, connections: usize) -> std::result::Result<usize, GrowError> {
    let deadline = Instant::now() + DROP_TIMEOUT;
    let mut dropped = 0;
    while dropped < connections {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            break;
        }
        if notices.recv_timeout(left)? == Some(index) {
            dropped += 1;
        }
    }
    Ok(dropped)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn what_the_caller_can_fix_is_a_precondition_the_rest_internal() {
        let code = |e: GrowError| Error::from(e).code();
        assert_eq!(code(GrowError::NotServed(3)), tonic::Code::FailedPrecondition);
        assert_eq!(code(GrowError::KernelRefused { index: 3, have: 1 << 20, want: 2 << 20 }), tonic::Code::FailedPrecondition);
        assert_eq!(code(GrowError::Stuck { index: 3, dropped: 1, connections: 2 }), tonic::Code::Internal);
        let gone = volring_nbd::Error::NoSuchExport("v".into());
        assert_eq!(code(GrowError::Export { image: "/p/v.img".into(), source: gone }), tonic::Code::Internal);
        let msg = Error::from(GrowError::KernelRefused { index: 3, have: 1 << 20, want: 2 << 20 }).to_string();
        assert!(msg.contains("does not resize nbd devices"), "{msg}");
    }
}
