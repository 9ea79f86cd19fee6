//! Which devices the start walk must give fresh sockets: only the dead.
//!
//! What the kernel tells about a device's connections, and what it does
//! not: NBD_CMD_STATUS's NBD_DEVICE_CONNECTED is `config_refs != 0`, so it
//! says the device is *configured* — true too while every socket is dead
//! and the kernel queues I/O for the dead-connection timeout. sysfs has
//! `pid` (the process that sent CONNECT, unchanged by RECONFIGURE) and
//! `backend`; neither tells a live socket from a dead one. What does tell
//! is the socket itself: when the kernel marks a connection dead
//! (`nbd_mark_nsock_dead`: the peer closed, or a request timed out) it
//! shuts the socket down, so it is no longer ESTABLISHED.
//!
//! - A local device's sockets are socketpairs whose other ends were the
//!   agent's own: they closed when that agent died. After a restart such a
//!   device is dead by construction (unless this very process serves it).
//! - A remote device's sockets are TCP connections the kernel holds to the
//!   owning node; they outlive the consuming agent. The agent records the
//!   inodes of the sockets it hands the kernel (a small file per device in
//!   the state directory); at start, a device whose recorded sockets are
//!   all still ESTABLISHED to the export's port (`/proc/net/tcp{,6}`) is
//!   healthy and left connected — a RECONFIGURE would change nothing (the
//!   kernel puts a fresh socket only in a dead slot, and drops it
//!   otherwise). One with fewer, or with no record (an older agent, a
//!   crash before the record was written), is reconnected: a needless
//!   RECONFIGURE costs a handshake, a missed one costs the device.

use std::collections::HashSet;
use std::os::fd::{AsFd, OwnedFd};
use std::path::{Path, PathBuf};

/// What the walk sees of a device that still carries its volume id.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Seen {
    /// This process keeps the device connected now (not owed a reconnect).
    pub(crate) serving_here: bool,
    /// A remote device's recorded sockets: `None` when nothing was recorded.
    pub sockets: Option<SocketsSeen>,
}

/// The sockets an agent handed the kernel for a remote device, and how
/// many of them are established now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct SocketsSeen {
    /// Connections the device has (what the kernel took).
    pub connections: usize,
    /// Recorded sockets ESTABLISHED to the export's port now.
    pub(crate) established: usize,
}

/// Leave the device as it is, or give it fresh sockets; with why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Verdict {
    Leave(String),
    Reconnect(String),
}

/// The rule (see the module comment).
pub(crate) fn verdict(remote: bool, seen: &Seen) -> Verdict {
    if seen.serving_here {
        return Verdict::Leave("this agent serves it".into());
    }
    if !remote {
        return Verdict::Reconnect("its sockets' other ends were the agent that is gone".into());
    }
    match seen.sockets {
        None => Verdict::Reconnect("its connections were not recorded: their state is unknown".into()),
        Some(s) if s.connections > 0 && s.established >= s.connections => {
            Verdict::Leave(format!("{} of {} connections to the export still established", s.connections, s.connections))
        }
        Some(s) => Verdict::Reconnect(format!("{} of {} connections to the export established: dead", s.established, s.connections)),
    }
}

/// TCP socket states in `/proc/net/tcp`: 01 is ESTABLISHED.
const ESTABLISHED: &str = "01";

/// The inodes of the sockets ESTABLISHED to remote port `port`, from the
/// text of `/proc/net/tcp` or `/proc/net/tcp6`.
pub(crate) fn established_inodes(text: &str, port: u16, into: &mut HashSet<u64>) {
    for line in text.lines().skip(1) {
        let f: Vec<&str> = line.split_whitespace().collect();
        let (Some(rem), Some(st), Some(inode)) = (f.get(2), f.get(3), f.get(9)) else { continue };
        let Some(rport) = rem.rsplit(':').next().and_then(|p| u16::from_str_radix(p, 16).ok()) else { continue };
        if *st == ESTABLISHED && rport == port {
            if let Ok(i) = inode.parse::<u64>() {
                if i != 0 {
                    into.insert(i);
                }
            }
        }
    }
}

/// This network namespace's sockets ESTABLISHED to `port`.
fn established_now(port: u16) -> HashSet<u64> {
    let mut out = HashSet::new();
    for f in ["/proc/net/tcp", "/proc/net/tcp6"] {
        if let Ok(text) = std::fs::read_to_string(f) {
            established_inodes(&text, port, &mut out);
        }
    }
    out
}

/// The port of an export URI's authority (`host:port`, `[v6]:port`).
pub(crate) fn authority_port(authority: &str) -> Option<u16> {
    authority.rsplit(':').next()?.parse().ok()
}

/// The record of one device's sockets: `<dir>/nbd<index>`, three lines
/// (backend id, connections, inodes separated by spaces).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct SocketRecord {
    pub backend_id: String,
    pub connections: usize,
    pub(crate) inodes: Vec<u64>,
}

impl SocketRecord {
    fn path(dir: &Path, index: u32) -> PathBuf {
        dir.join(format!("nbd{index}"))
    }

    pub(crate) fn encode(&self) -> String {
        let inodes: Vec<String> = self.inodes.iter().map(u64::to_string).collect();
        format!("{}\n{}\n{}\n", self.backend_id, self.connections, inodes.join(" "))
    }

    pub(crate) fn decode(text: &str) -> Option<Self> {
        let mut lines = text.lines();
        let backend_id = lines.next()?.to_string();
        let connections = lines.next()?.parse().ok()?;
        let inodes = lines.next().unwrap_or("").split_whitespace().map(str::parse).collect::<Result<_, _>>().ok()?;
        Some(SocketRecord { backend_id, connections, inodes })
    }

    pub(crate) fn read(dir: &Path, index: u32) -> Option<Self> {
        Self::decode(&std::fs::read_to_string(Self::path(dir, index)).ok()?)
    }

    /// Written after the kernel took the sockets (a record lost to a crash
    /// only costs a needless reconnect at the next start).
    pub(crate) fn write(&self, dir: &Path, index: u32) {
        let path = Self::path(dir, index);
        let tmp = dir.join(format!(".nbd{index}.tmp"));
        let r = std::fs::create_dir_all(dir).and_then(|()| std::fs::write(&tmp, self.encode())).and_then(|()| std::fs::rename(&tmp, &path));
        if let Err(e) = r {
            tracing::warn!(index, error = %e, path = %path.display(), "cannot record the nbd device's sockets (the next start reconnects it)");
        }
    }

    pub(crate) fn remove(dir: &Path, index: u32) {
        let _ = std::fs::remove_file(Self::path(dir, index));
    }
}

/// What the record of `/dev/nbd<index>` says of its sockets now, if it
/// is the record of `backend_id`'s device.
pub(crate) fn sockets_seen(dir: &Path, index: u32, backend_id: &str, port: u16) -> Option<SocketsSeen> {
    let rec = SocketRecord::read(dir, index).filter(|r| r.backend_id == backend_id)?;
    let now = established_now(port);
    Some(SocketsSeen { connections: rec.connections, established: rec.inodes.iter().filter(|i| now.contains(i)).count() })
}

/// After the kernel took sockets for `/dev/nbd<index>` (connect, or a
/// RECONFIGURE that may have put only some of `fresh` in dead slots and
/// dropped the rest): records the recorded ones still established and
/// every fresh one; what the kernel dropped closes and stops counting.
pub(crate) fn record_sockets(dir: &Path, index: u32, backend_id: &str, port: u16, connections: usize, fresh: &[u64]) {
    let now = established_now(port);
    let mut inodes: Vec<u64> = SocketRecord::read(dir, index)
        .filter(|r| r.backend_id == backend_id)
        .map(|r| r.inodes.into_iter().filter(|i| now.contains(i)).collect())
        .unwrap_or_default();
    for i in fresh {
        if !inodes.contains(i) {
            inodes.push(*i);
        }
    }
    SocketRecord { backend_id: backend_id.to_string(), connections, inodes }.write(dir, index);
}

/// The inodes of sockets about to be handed to the kernel.
pub(crate) fn inodes(sockets: &[OwnedFd]) -> Vec<u64> {
    sockets.iter().filter_map(|s| rustix::fs::fstat(s.as_fd()).ok()).map(|st| st.st_ino).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn seen(serving_here: bool, sockets: Option<(usize, usize)>) -> Seen {
        Seen { serving_here, sockets: sockets.map(|(connections, established)| SocketsSeen { connections, established }) }
    }

    fn leaves(v: Verdict) -> bool {
        matches!(v, Verdict::Leave(_))
    }

    /// Only what is dead is reconnected: a local device after a restart
    /// always (its server died with the agent), a remote device only when
    /// its connections are no longer all established or were never
    /// recorded; whatever this process serves, never.
    #[test]
    fn only_dead_devices_are_reconnected() {
        // Local (socketpairs to the agent that is gone): dead, whatever else.
        assert!(!leaves(verdict(false, &seen(false, None))));
        assert!(!leaves(verdict(false, &seen(false, Some((1, 1))))));
        // Served by this process: left alone, local or remote.
        assert!(leaves(verdict(false, &seen(true, None))));
        assert!(leaves(verdict(true, &seen(true, Some((1, 0))))));
        // Remote, the kernel's TCP sockets survived the consumer's restart.
        assert!(leaves(verdict(true, &seen(false, Some((1, 1))))));
        assert!(leaves(verdict(true, &seen(false, Some((2, 2))))));
        // Remote, a socket the kernel marked dead (shut down: not ESTABLISHED).
        assert!(!leaves(verdict(true, &seen(false, Some((1, 0))))));
        assert!(!leaves(verdict(true, &seen(false, Some((2, 1))))));
        // Remote, nothing recorded: unknown is reconnected (a RECONFIGURE
        // of a live device changes nothing; a missed dead one is lost).
        assert!(!leaves(verdict(true, &seen(false, None))));
        assert!(!leaves(verdict(true, &seen(false, Some((0, 0))))));
    }

    /// /proc/net/tcp's lines as the kernel writes them: only ESTABLISHED
    /// sockets to the export's port count, by inode.
    #[test]
    fn established_sockets_are_read_by_state_port_and_inode() {
        let tcp = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n\
   0: 0100007F:A1B2 0500000A:2A31 01 00000000:00000000 00:00000000 00000000     0        0 4242 1 0000000000000000 20 4 30 10 -1\n\
   1: 0100007F:A1B3 0500000A:2A31 08 00000000:00000000 00:00000000 00000000     0        0 4243 1 0000000000000000 20 4 30 10 -1\n\
   2: 0100007F:A1B4 0500000A:1F90 01 00000000:00000000 00:00000000 00000000     0        0 4244 1 0000000000000000 20 4 30 10 -1\n\
   3: 0100007F:A1B5 0500000A:2A31 04 00000000:00000000 00:00000000 00000000     0        0 4245 1 0000000000000000 20 4 30 10 -1\n";
        let tcp6 = "  sl  local_address                         remote_address                        st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n\
   0: 00000000000000000000000001000000:C350 00000000000000000000000001000000:2A31 01 00000000:00000000 00:00000000 00000000     0        0 5151 1 0000000000000000 20 4 30 10 -1\n";
        let mut got = HashSet::new();
        established_inodes(tcp, 10801, &mut got);
        established_inodes(tcp6, 10801, &mut got);
        assert_eq!(got, HashSet::from([4242, 5151]));
        assert_eq!(authority_port("10.0.0.5:10809"), Some(10809));
        assert_eq!(authority_port("[fd00::1]:10809"), Some(10809));
    }

    #[test]
    fn socket_records_round_trip_and_belong_to_their_backend() {
        let dir = tempfile::tempdir().unwrap();
        let r = SocketRecord { backend_id: "pvc-1".into(), connections: 2, inodes: vec![7, 9] };
        assert_eq!(SocketRecord::decode(&r.encode()), Some(r.clone()));
        r.write(dir.path(), 3);
        assert_eq!(SocketRecord::read(dir.path(), 3), Some(r));
        // Another volume's record for the same index says nothing.
        assert_eq!(sockets_seen(dir.path(), 3, "pvc-2", 10809), None);
        // No socket 7 or 9 is established to port 1 here.
        assert_eq!(sockets_seen(dir.path(), 3, "pvc-1", 1), Some(SocketsSeen { connections: 2, established: 0 }));
        SocketRecord::remove(dir.path(), 3);
        assert_eq!(SocketRecord::read(dir.path(), 3), None);
    }

    /// A real socket's inode is what /proc/net/tcp shows for it.
    #[test]
    fn a_live_tcp_connection_is_seen_by_its_inode() {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = l.local_addr().unwrap().port();
        let c = std::net::TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (_accepted, _) = l.accept().unwrap();
        let fd = OwnedFd::from(c);
        let ino = inodes(std::slice::from_ref(&fd));
        assert_eq!(ino.len(), 1);
        assert!(established_now(port).contains(&ino[0]), "socket inode {} not established to {port}", ino[0]);
        let dir = tempfile::tempdir().unwrap();
        record_sockets(dir.path(), 0, "pvc-1", port, 1, &ino);
        assert_eq!(sockets_seen(dir.path(), 0, "pvc-1", port), Some(SocketsSeen { connections: 1, established: 1 }));
        drop(fd);
        // Closed (FIN_WAIT and on): not established any more.
        assert_eq!(sockets_seen(dir.path(), 0, "pvc-1", port), Some(SocketsSeen { connections: 1, established: 0 }));
    }
}
