//! nfs-ganesha's configuration, generated (pure: settings and exports in,
//! text out).
//!
//! What the settings choose, and why:
//! - NFSv4 only (`Protocols = 4`), TCP only, NLM and RQUOTA off: v4 carries
//!   locks in the protocol itself and needs neither rpcbind nor the side
//!   protocols, so the server is one TCP port on one address.
//! - `Only_Numeric_Owners`: nodes share no idmapd domain; owners travel as
//!   numbers.
//! - `Attr_Expiration_Time`: ganesha caches the attributes of what it
//!   serves; the owning node's own pods write to the same filesystem beside
//!   it (through their bind mounts), so the cache must not hide their
//!   writes from NFS clients for long.
//! - The v4 recovery database under the agent's state directory (`fs`
//!   backend), so a restarted server knows its clients and gives them the
//!   grace period to reclaim their opens and locks.
//! - `Export_Id` is recorded per volume and kept across restarts: ganesha's
//!   file handles carry it, and a changed id would turn every client's
//!   handles stale.
//! - The other id in a handle is the filesystem's: the VFS FSAL writes one
//!   flag byte, the filesystem id, then the kernel's handle (inode and
//!   generation). Debian's ganesha is built with libblkid and takes that id
//!   from the filesystem's UUID (16 bytes) — the same on every node the
//!   volume moves to, for ext4 and xfs alike — and only when blkid cannot
//!   name the device falls back to statfs' f_fsid, which for xfs is the
//!   device number (a moved volume's handles would then go stale). No
//!   setting pins it to a value of ours: `fsid_type` in the FSAL block only
//!   re-encodes the id found, `Filesystem_id` in the EXPORT block changes
//!   only the fsid attribute, and `Fsid_Device` makes it the device number.
//!   So the FSAL component logs at INFO: the "Added filesystem ... fsid="
//!   line of each export, a blkid failure, and "Could not map fsid" for a
//!   client's handle this server cannot place are in `ganesha.log`.

use std::fmt::Write;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use super::Error;

/// The server-wide settings.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Settings {
    /// The one address and TCP port the server listens on.
    pub listen: SocketAddr,
    /// Where the FSAL plugins (libfsalvfs.so) are.
    pub plugins_dir: PathBuf,
    /// The v4 recovery database (client records for the grace period).
    pub recovery_dir: PathBuf,
    /// Seconds a client's lease lasts without renewal.
    pub lease_secs: u32,
    /// Seconds after a start during which clients reclaim state.
    pub grace_secs: u32,
    /// Seconds ganesha trusts the attributes it cached.
    pub attr_expiry_secs: u32,
}

/// One exported directory.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct Export {
    /// 1..=65535 (0 is ganesha's pseudo-filesystem root).
    pub id: u16,
    /// The staged filesystem on this node.
    pub path: PathBuf,
    /// The path clients mount (`server:/pseudo`).
    pub pseudo: String,
}

/// Renders the configuration file for `settings` and `exports`. Paths are
/// written quoted; one that could break out of its quotes (a quote, a
/// backslash, a control character) is refused, as are a zero or repeated
/// export id and a repeated pseudo path.
pub fn render(settings: &Settings, exports: &[Export]) -> Result<String, Error> {
    let mut out = String::new();
    let (addr, port) = (settings.listen.ip(), settings.listen.port());
    let plugins = quoted(&settings.plugins_dir)?;
    let recovery = quoted(&settings.recovery_dir)?;
    // `write!` into a String cannot fail.
    let _ = writeln!(out, "# Written by volring: every start and every export change rewrites it.");
    let _ = writeln!(
        out,
        "NFS_CORE_PARAM {{\n  NFS_Port = {port};\n  Bind_Addr = {addr};\n  Protocols = 4;\n  Enable_NLM = false;\n  Enable_RQUOTA = false;\n  Enable_UDP = false;\n  Plugins_Dir = {plugins};\n}}"
    );
    let _ = writeln!(out, "NFS_KRB5 {{\n  Active_krb5 = false;\n}}");
    let _ = writeln!(
        out,
        "NFSv4 {{\n  Lease_Lifetime = {};\n  Grace_Period = {};\n  RecoveryBackend = fs;\n  RecoveryRoot = {recovery};\n  Only_Numeric_Owners = true;\n}}",
        settings.lease_secs, settings.grace_secs
    );
    let _ = writeln!(out, "LOG {{\n  Default_Log_Level = EVENT;\n  COMPONENTS {{\n    FSAL = INFO;\n  }}\n}}");
    let mut ids = std::collections::BTreeSet::new();
    let mut pseudos = std::collections::BTreeSet::new();
    for e in exports {
        if e.id == 0 || !ids.insert(e.id) {
            return Err(Error::Config(format!("export id {} is zero or used twice", e.id)));
        }
        if !e.pseudo.starts_with('/') || e.pseudo == "/" || !pseudos.insert(e.pseudo.as_str()) {
            return Err(Error::Config(format!("pseudo path {:?} is not absolute, is the root, or is used twice", e.pseudo)));
        }
        let path = quoted(&e.path)?;
        let pseudo = quoted(Path::new(&e.pseudo))?;
        let _ = writeln!(
            out,
            "EXPORT {{\n  Export_Id = {};\n  Path = {path};\n  Pseudo = {pseudo};\n  Access_Type = RW;\n  Squash = No_Root_Squash;\n  Protocols = 4;\n  Transports = TCP;\n  SecType = sys;\n  Attr_Expiration_Time = {};\n  FSAL {{\n    Name = VFS;\n  }}\n}}",
            e.id, settings.attr_expiry_secs
        );
    }
    Ok(out)
}

/// `p` in double quotes, or an error when it holds what ganesha's parser
/// would read as the end of the string or an escape.
fn quoted(p: &Path) -> Result<String, Error> {
    let s = p.to_str().ok_or_else(|| Error::Config(format!("{} is not UTF-8", p.display())))?;
    if !s.starts_with('/') || s.chars().any(|c| c == '"' || c == '\\' || c.is_control()) {
        return Err(Error::Config(format!("{s:?} cannot be written into ganesha's configuration")));
    }
    Ok(format!("\"{s}\""))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn settings() -> Settings {
        Settings {
            listen: "127.0.0.1:20490".parse().unwrap(),
            plugins_dir: "/usr/lib/x86_64-linux-gnu/ganesha".into(),
            recovery_dir: "/var/lib/volring/nfs/recovery".into(),
            lease_secs: 10,
            grace_secs: 15,
            attr_expiry_secs: 0,
        }
    }

    fn export(id: u16, path: &str, pseudo: &str) -> Export {
        Export { id, path: path.into(), pseudo: pseudo.into() }
    }

    #[test]
    fn one_port_v4_only() {
        let c = render(&settings(), &[export(1, "/var/lib/kubelet/stage/pvc-1", "/pvc-1")]).unwrap();
        for want in [
            "NFS_Port = 20490;",
            "Bind_Addr = 127.0.0.1;",
            "Protocols = 4;",
            "Enable_NLM = false;",
            "Enable_RQUOTA = false;",
            "Enable_UDP = false;",
            "Export_Id = 1;",
            "Path = \"/var/lib/kubelet/stage/pvc-1\";",
            "Pseudo = \"/pvc-1\";",
            "Attr_Expiration_Time = 0;",
            "Grace_Period = 15;",
            "RecoveryRoot = \"/var/lib/volring/nfs/recovery\";",
            "Name = VFS;",
            "FSAL = INFO;",
        ] {
            assert!(c.contains(want), "{want} missing from\n{c}");
        }
        assert_eq!(c.matches("EXPORT {").count(), 1);
        // Braces balance, so the parser sees every block closed.
        assert_eq!(c.matches('{').count(), c.matches('}').count());
        // No exports: the server-wide blocks alone.
        assert!(!render(&settings(), &[]).unwrap().contains("EXPORT"));
    }

    #[test]
    fn refuses_what_would_break_the_file() {
        let s = settings();
        for bad in ["/a\"b", "/a\\b", "/a\nb", "relative"] {
            assert!(render(&s, &[export(1, bad, "/p")]).is_err(), "{bad:?}");
        }
        assert!(render(&s, &[export(0, "/a", "/p")]).is_err());
        assert!(render(&s, &[export(1, "/a", "/p"), export(1, "/b", "/q")]).is_err());
        assert!(render(&s, &[export(1, "/a", "/p"), export(2, "/b", "/p")]).is_err());
        assert!(render(&s, &[export(1, "/a", "/")]).is_err());
        let mut v6 = s.clone();
        v6.listen = "[::1]:2049".parse().unwrap();
        assert!(render(&v6, &[]).unwrap().contains("Bind_Addr = ::1;"));
    }
}
