//! Connecting, reconfiguring and disconnecting `/dev/nbdN`, with the
//! backend identifier check that keeps a restarted agent from handing a
//! device sockets to the wrong image (the cookie check rbd-nbd needed);
//! and the listener for the nbd family's LINK_DEAD notices. Both go
//! through the one entry `volring_sys` gives for the family.

use std::os::fd::{AsRawFd, BorrowedFd};
use std::path::{Path, PathBuf};
use std::time::Duration;

use super::Error;
use crate::client::ExportDetails;
use crate::wire::tx;
use volring_sys::{DeviceStatus, NbdConfig, NbdNetlink, NbdNetlinkError};

/// Seconds the kernel waits for a request's reply before it requeues it
/// on another connection, or waits for a reconnect: a few seconds, so
/// requests in flight when the server died are resent promptly.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(5);
/// How long the kernel queues I/O while every connection is dead: long
/// enough for the agent to restart.
pub const DEFAULT_DEAD_CONN_TIMEOUT: Duration = Duration::from_secs(120);

/// How a device is connected.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConnectSpec {
    /// `None`: the kernel picks a free device.
    pub index: Option<u32>,
    pub size_bytes: u64,
    /// 512 to 4096, a power of two.
    pub block_size: u64,
    /// The export's transmission flags, as negotiated.
    pub server_flags: u64,
    /// NBD_CFLAG_* bits.
    pub client_flags: u64,
    pub timeout: Duration,
    pub dead_conn_timeout: Duration,
    /// What `/sys/block/nbdN/backend` shows; checked before any reconfigure.
    pub backend_id: String,
}

impl ConnectSpec {
    /// A spec for a negotiated export, with the default timeouts.
    pub fn for_export(details: &ExportDetails, backend_id: &str) -> Self {
        // The kernel takes 512..=PAGE_SIZE; 4096 unless the server needs more.
        let block_size = match details.block_sizes {
            Some((min, _, _)) if min > 4096 => u64::from(min),
            _ => 4096,
        };
        ConnectSpec {
            index: None,
            size_bytes: details.size,
            block_size,
            server_flags: u64::from(details.tx_flags),
            client_flags: 0,
            timeout: DEFAULT_TIMEOUT,
            dead_conn_timeout: DEFAULT_DEAD_CONN_TIMEOUT,
            backend_id: backend_id.to_string(),
        }
    }

    fn validate(&self) -> Result<(), Error> {
        if !(512..=4096).contains(&self.block_size) || !self.block_size.is_power_of_two() {
            return Err(Error::Invalid(format!("block size {} is not a power of two in 512..=4096", self.block_size)));
        }
        if self.size_bytes == 0 || !self.size_bytes.is_multiple_of(self.block_size) {
            return Err(Error::Invalid(format!(
                "size {} is not a positive multiple of the block size {}",
                self.size_bytes, self.block_size
            )));
        }
        if self.server_flags & u64::from(tx::HAS_FLAGS) == 0 {
            return Err(Error::Invalid("server flags without HAS_FLAGS".into()));
        }
        if self.backend_id.is_empty() || self.backend_id.len() > 255 || self.backend_id.contains(['\0', '\n']) {
            return Err(Error::Invalid("backend id must be 1 to 255 bytes without NUL or newline".into()));
        }
        Ok(())
    }

    /// The CONNECT attributes with these sockets.
    pub(crate) fn config(&self, sockets: &[BorrowedFd<'_>]) -> NbdConfig {
        NbdConfig {
            index: self.index,
            size_bytes: Some(self.size_bytes),
            block_size: Some(self.block_size),
            timeout: Some(self.timeout.as_secs().max(1)),
            server_flags: Some(self.server_flags),
            client_flags: Some(self.client_flags),
            dead_conn_timeout: Some(self.dead_conn_timeout.as_secs()),
            backend_id: Some(self.backend_id.clone()),
            sockets: sockets.iter().map(|s| s.as_raw_fd()).collect(),
        }
    }
}

/// Where the kernel shows block devices.
const SYS_BLOCK: &str = "/sys/block";

/// The backend a device serves, from sysfs (`None`: none set, or no device).
pub fn read_backend(sys_block: &Path, index: u32) -> Option<String> {
    let text = std::fs::read_to_string(sys_block.join(format!("nbd{index}/backend"))).ok()?;
    let id = text.trim_end_matches('\n');
    (!id.is_empty()).then(|| id.to_string())
}

/// The check before a reconfigure or a disconnect, on the backend `found`:
/// only the backend the device was connected with may be given sockets or
/// let go.
pub(crate) fn check_found(index: u32, expected: &str, found: Option<String>) -> Result<(), Error> {
    if found.as_deref() == Some(expected) {
        Ok(())
    } else {
        Err(Error::BackendMismatch { index, expected: expected.to_string(), found })
    }
}

/// The kernel's nbd driver, through netlink.
pub struct NbdControl {
    nl: NbdNetlink,
    sys_block: PathBuf,
}

impl NbdControl {
    /// [`Error::FamilyNotFound`] when the nbd module is not loaded.
    pub fn open() -> Result<Self, Error> {
        Ok(NbdControl { nl: NbdNetlink::open(false)?, sys_block: PathBuf::from(SYS_BLOCK) })
    }

    /// Connects a device to negotiated sockets; its index.
    pub fn connect(&mut self, spec: &ConnectSpec, sockets: &[BorrowedFd<'_>]) -> Result<u32, Error> {
        spec.validate()?;
        if sockets.is_empty() {
            return Err(Error::Invalid("connect needs at least one socket".into()));
        }
        let index = self.nl.connect(&spec.config(sockets))?;
        tracing::info!(index, backend = %spec.backend_id, connections = sockets.len(), size = spec.size_bytes, "nbd device connected");
        Ok(index)
    }

    /// Gives a connected device fresh sockets (they replace its dead ones)
    /// after checking it serves `backend_id`; a size, when given, is set too.
    pub fn reconfigure(&mut self, index: u32, backend_id: &str, size_bytes: Option<u64>, sockets: &[BorrowedFd<'_>]) -> Result<(), Error> {
        check_found(index, backend_id, read_backend(&self.sys_block, index))?;
        let config = NbdConfig {
            index: Some(index),
            size_bytes,
            // A kernel that knows backend ids (5.14+) refuses a reconfigure
            // of a device that has one unless it is named again, and matches.
            backend_id: Some(backend_id.to_string()),
            sockets: sockets.iter().map(|s| s.as_raw_fd()).collect(),
            ..NbdConfig::default()
        };
        self.nl.reconfigure(&config)?;
        tracing::info!(index, backend = %backend_id, sockets = sockets.len(), "nbd device reconfigured");
        Ok(())
    }

    /// Disconnects a device; with `expected`, only after checking it serves
    /// that backend (an index reused by another attachment is not torn down).
    pub fn disconnect(&mut self, index: u32, expected: Option<&str>) -> Result<(), Error> {
        if let Some(expected) = expected {
            check_found(index, expected, read_backend(&self.sys_block, index))?;
        }
        self.nl.disconnect(index)?;
        tracing::info!(index, "nbd device disconnected");
        Ok(())
    }

    pub fn status(&mut self, index: Option<u32>) -> Result<Vec<DeviceStatus>, Error> {
        Ok(self.nl.status(index)?)
    }

    /// The backend a device serves (see [`read_backend`]).
    pub(crate) fn backend(&self, index: u32) -> Option<String> {
        read_backend(&self.sys_block, index)
    }
}

impl From<NbdNetlinkError> for Error {
    /// A missing module is the error a caller acts on; the rest keep the
    /// step that failed.
    fn from(e: NbdNetlinkError) -> Self {
        match e {
            NbdNetlinkError::NoFamily => Error::FamilyNotFound,
            NbdNetlinkError::Kernel { op, source } => Error::Kernel { op, source },
            NbdNetlinkError::Malformed(what) => Error::Malformed(what),
        }
    }
}

/// The nbd family's multicast group: the kernel announces there each
/// device whose every connection died (NBD_CMD_LINK_DEAD), which is when
/// the device waits for a RECONFIGURE with fresh sockets.
pub struct LinkDeadListener {
    sock: NbdNetlink,
}

impl LinkDeadListener {
    /// [`Error::FamilyNotFound`] when the nbd module is not loaded.
    pub fn open() -> Result<Self, Error> {
        Ok(LinkDeadListener { sock: NbdNetlink::open(true)? })
    }

    /// The next dead device's index, waiting at most `timeout`.
    pub fn recv_timeout(&mut self, timeout: Duration) -> Result<Option<u32>, Error> {
        Ok(self.sock.next_link_dead(timeout)?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::OwnedFd;
    use std::os::unix::net::UnixStream;

    #[test]
    fn backend_must_match_exactly() {
        assert!(check_found(1, "vol-a", Some("vol-a".into())).is_ok());
        assert!(matches!(check_found(1, "vol-a", Some("vol-b".into())), Err(Error::BackendMismatch { index: 1, .. })));
        assert!(matches!(check_found(1, "vol-a", None), Err(Error::BackendMismatch { found: None, .. })));
    }

    #[test]
    fn sysfs_backend_is_read_without_its_newline() {
        let d = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(d.path().join("nbd3")).unwrap();
        std::fs::write(d.path().join("nbd3/backend"), "vol-x\n").unwrap();
        assert_eq!(read_backend(d.path(), 3).as_deref(), Some("vol-x"));
        std::fs::write(d.path().join("nbd3/backend"), "\n").unwrap();
        assert_eq!(read_backend(d.path(), 3), None);
        assert_eq!(read_backend(d.path(), 4), None);
    }

    #[test]
    fn spec_for_export_is_valid_and_checked() {
        let d = ExportDetails { size: 64 << 20, tx_flags: tx::HAS_FLAGS | tx::SEND_FLUSH, block_sizes: Some((1, 4096, 32 << 20)) };
        let s = ConnectSpec::for_export(&d, "vol-1");
        assert!(s.validate().is_ok());
        assert_eq!((s.block_size, s.server_flags), (4096, 0x5));
        assert!(ConnectSpec { block_size: 1000, ..s.clone() }.validate().is_err());
        assert!(ConnectSpec { size_bytes: 4097, ..s.clone() }.validate().is_err());
        assert!(ConnectSpec { backend_id: String::new(), ..s.clone() }.validate().is_err());
        assert!(ConnectSpec { server_flags: 0, ..s }.validate().is_err());
    }

    /// A spec gives the kernel the CONNECT attributes it names (the
    /// attributes' encoding, the command's number and LINK_DEAD notices
    /// are volring_sys's unit tests, where the framing lives).
    #[test]
    fn a_spec_gives_the_kernel_its_connect_attributes() {
        let (a, b) = UnixStream::pair().unwrap();
        let (fa, fb) = (OwnedFd::from(a), OwnedFd::from(b));
        use std::os::fd::{AsFd, AsRawFd};
        let d = ExportDetails { size: 256 << 20, tx_flags: tx::HAS_FLAGS | tx::SEND_FLUSH | tx::CAN_MULTI_CONN, block_sizes: None };
        let mut spec = ConnectSpec::for_export(&d, "pvc-1234");
        spec.index = Some(4);
        let back = spec.config(&[fa.as_fd(), fb.as_fd()]);
        assert_eq!(
            back,
            NbdConfig {
                index: Some(4),
                size_bytes: Some(256 << 20),
                block_size: Some(4096),
                timeout: Some(5),
                server_flags: Some(0x105),
                client_flags: Some(0),
                dead_conn_timeout: Some(120),
                backend_id: Some("pvc-1234".into()),
                sockets: vec![fa.as_raw_fd(), fb.as_raw_fd()],
            }
        );
    }
}
