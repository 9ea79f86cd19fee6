//! The NFS client side: a node that does not hold a shared volume mounts
//! the owning node's export with the kernel's NFSv4 client.
//!
//! Where the export is comes from the volume context (`nfsServer`,
//! `nfsExport`), which the CO copies from CreateVolume's answer; parsing it
//! is pure ([`remote`]), fuzzed, and refuses anything that is not an
//! address and an absolute export path.
//!
//! The mount options, and why:
//! - `hard`: a server that restarts (the agent or ganesha on the owning
//!   node) makes I/O wait, never fail; `timeo=100,retrans=3` (10 s per try)
//!   keeps a TCG guest's slow replies from counting as timeouts.
//! - `vers=4.1`: sessions, so no callback connection back to the client is
//!   needed (the owning node may not reach the client), and locks live in
//!   the protocol with the grace period to reclaim them.
//! - `actimeo=1,lookupcache=positive`: two nodes writing one volume see
//!   each other's files and sizes within a second, and a file the other
//!   node just created is never hidden by a cached "no such file".

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};

use super::{Error, CTX_EXPORT, CTX_SERVER, PARAM_SHARE, SHARE_NFS};
use volring_volumes::mounting::MountOptions;

/// Longest export path accepted from a context.
const MAX_EXPORT_LEN: usize = 1024;

/// An export to mount.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Remote {
    pub server: SocketAddr,
    pub export: String,
}

/// The export a volume context names: `None` for a volume that is not
/// shared; an error for a shared one whose server or export is missing or
/// malformed. The server must be an IP address and port (the owning node
/// advertises one; no name is resolved here).
pub fn remote(context: &HashMap<String, String>) -> Result<Option<Remote>, Error> {
    if context.get(PARAM_SHARE).map(String::as_str) != Some(SHARE_NFS) {
        return Ok(None);
    }
    let bad = |why: String| Error::Config(format!("volume context of a shared volume: {why}"));
    let server = context.get(CTX_SERVER).ok_or_else(|| bad(format!("{CTX_SERVER} is missing (does the owning node serve NFS?)")))?;
    let server: SocketAddr = server.parse().map_err(|_| bad(format!("{CTX_SERVER} {server:?} is not address:port")))?;
    if server.port() == 0 || server.ip().is_unspecified() || server.ip().is_multicast() {
        return Err(bad(format!("{CTX_SERVER} {server} cannot be mounted from")));
    }
    let export = context.get(CTX_EXPORT).ok_or_else(|| bad(format!("{CTX_EXPORT} is missing")))?;
    let ok_char = |c: char| c.is_ascii_alphanumeric() || matches!(c, '/' | '.' | '_' | '-');
    if export.len() > MAX_EXPORT_LEN || !export.starts_with('/') || !export.chars().all(ok_char) || export.split('/').any(|c| c == "..") {
        return Err(bad(format!("{CTX_EXPORT} {:?} is not an absolute path of A-Z a-z 0-9 . _ - /", truncate(export))));
    }
    Ok(Some(Remote { server, export: export.clone() }))
}

fn truncate(s: &str) -> &str {
    match s.char_indices().nth(64) {
        Some((i, _)) => &s[..i],
        None => s,
    }
}

/// The mount source, `addr:/export` (an IPv6 address in brackets): what
/// the kernel is given and what messages name the export by.
impl std::fmt::Display for Remote {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.server.ip() {
            IpAddr::V4(a) => write!(f, "{a}:{}", self.export),
            IpAddr::V6(a) => write!(f, "[{a}]:{}", self.export),
        }
    }
}

impl Remote {
    /// The kernel NFS client's options for this export.
    pub fn options(&self, read_only: bool) -> MountOptions {
        let mut o = MountOptions { flags: rustix::mount::MountFlags::empty(), data: String::new() };
        if read_only {
            o.flags |= rustix::mount::MountFlags::RDONLY;
        }
        for opt in [
            "vers=4.1".to_string(),
            format!("addr={}", self.server.ip()),
            format!("port={}", self.server.port()),
            "proto=tcp".into(),
            "hard".into(),
            "timeo=100".into(),
            "retrans=3".into(),
            "actimeo=1".into(),
            "lookupcache=positive".into(),
        ] {
            o = o.with_data(&opt);
        }
        o
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ctx(pairs: &[(&str, &str)]) -> HashMap<String, String> {
        pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
    }

    #[test]
    fn contexts() {
        assert_eq!(remote(&ctx(&[])).unwrap(), None);
        assert_eq!(remote(&ctx(&[("share", "other"), ("nfsServer", "1.2.3.4:2049")])).unwrap(), None);
        let r = remote(&ctx(&[("share", "nfs"), ("nfsServer", "10.0.2.100:2049"), ("nfsExport", "/pvc-1")])).unwrap().unwrap();
        assert_eq!(r.to_string(), "10.0.2.100:/pvc-1");
        let o = r.options(false);
        for want in ["vers=4.1", "addr=10.0.2.100", "port=2049", "hard", "proto=tcp"] {
            assert!(o.data.split(',').any(|x| x == want), "{want} in {}", o.data);
        }
        assert!(r.options(true).flags.contains(rustix::mount::MountFlags::RDONLY));
        let v6 = remote(&ctx(&[("share", "nfs"), ("nfsServer", "[fd00::1]:2049"), ("nfsExport", "/v")])).unwrap().unwrap();
        assert_eq!(v6.to_string(), "[fd00::1]:/v");
        for (server, export) in [
            ("", "/v"),
            ("host:2049", "/v"),
            ("1.2.3.4", "/v"),
            ("1.2.3.4:0", "/v"),
            ("0.0.0.0:2049", "/v"),
            ("1.2.3.4:2049", "v"),
            ("1.2.3.4:2049", "/a/../b"),
            ("1.2.3.4:2049", "/a,b"),
            ("1.2.3.4:2049", "/a b"),
        ] {
            let c = ctx(&[("share", "nfs"), ("nfsServer", server), ("nfsExport", export)]);
            assert!(remote(&c).is_err(), "{server:?} {export:?}");
        }
        assert!(remote(&ctx(&[("share", "nfs")])).is_err());
    }
}
