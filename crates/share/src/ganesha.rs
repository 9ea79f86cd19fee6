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
//! - Access control: an export admits nobody by itself (`Access_Type =
//!   None`); its CLIENT block admits, read-write, exactly the addresses of
//!   the nodes that staged the volume (and any the StorageClass lists), so
//!   a process that merely reaches the port mounts nothing. ganesha's
//!   pseudo root lists only the exports the asking client may mount, so a
//!   client not in a list does not even see the volume. A list changed is
//!   a reload (SIGHUP), which keeps every client's state.
//! - Root squash by default ([`Squash`]): NFS with `SecType = sys` trusts
//!   the uid a client sends, so without it root on any admitted node is
//!   root on the volume's files, including files other pods on other nodes
//!   made setuid; a StorageClass that needs root over NFS (an image that
//!   chowns its data directory at start) says `nfsSquash: none`.

use std::fmt::Write;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use super::Error;

/// The server-wide settings.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Settings {
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
pub(crate) struct Export {
    /// 1..=65535 (0 is ganesha's pseudo-filesystem root).
    pub id: u16,
    /// The staged filesystem on this node.
    pub path: PathBuf,
    /// The path clients mount (`server:/pseudo`).
    pub pseudo: String,
    /// The only clients admitted: IP addresses or `address/prefix`
    /// networks ([`valid_client`]). Empty: nobody.
    pub clients: Vec<String>,
    pub squash: Squash,
}

/// What the server makes of a client's root (uid 0) on an export: the
/// StorageClass parameter `nfsSquash` (`root`, the default; `none`;
/// `all`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Squash {
    /// Root becomes the anonymous user; other uids are taken as sent.
    #[default]
    Root,
    /// Root stays root.
    None,
    /// Every uid becomes the anonymous user.
    All,
}

/// The parameter value: `root`, `none` or `all`.
impl std::str::FromStr for Squash {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self, Error> {
        match s {
            "root" => Ok(Squash::Root),
            "none" => Ok(Squash::None),
            "all" => Ok(Squash::All),
            other => Err(Error::Config(format!("nfsSquash {other:?}: root, none or all"))),
        }
    }
}

impl Squash {
    fn ganesha(self) -> &'static str {
        match self {
            Squash::Root => "Root_Squash",
            Squash::None => "No_Root_Squash",
            Squash::All => "All_Squash",
        }
    }
}

/// Whether `c` is a client entry this module writes into a CLIENT block:
/// an IP address, or an `address/prefix` network (prefix within the
/// address's length). Host names, wildcards and netgroups are refused:
/// they would be resolved or matched by ganesha in ways the agent cannot
/// check, and a typo must not admit the world.
pub fn valid_client(c: &str) -> bool {
    let (addr, prefix) = match c.split_once('/') {
        Some((a, p)) => (a, Some(p)),
        None => (c, None),
    };
    let Ok(ip) = addr.parse::<std::net::IpAddr>() else { return false };
    let max = if ip.is_ipv4() { 32 } else { 128 };
    prefix.is_none_or(|p| p.bytes().all(|b| b.is_ascii_digit()) && p.parse::<u8>().is_ok_and(|p| p <= max))
}

/// Renders the configuration file for `settings` and `exports`. Paths are
/// written quoted; one that could break out of its quotes (a quote, a
/// backslash, a control character) is refused, as are a zero or repeated
/// export id and a repeated pseudo path.
pub(crate) fn render(settings: &Settings, exports: &[Export]) -> Result<String, Error> {
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
        if let Some(bad) = e.clients.iter().find(|c| !valid_client(c)) {
            return Err(Error::Config(format!("NFS client {bad:?} of export {} is no IP address or network", e.id)));
        }
        let squash = e.squash.ganesha();
        let _ = writeln!(
            out,
            "EXPORT {{\n  Export_Id = {};\n  Path = {path};\n  Pseudo = {pseudo};\n  Access_Type = None;\n  Squash = {squash};\n  Protocols = 4;\n  Transports = TCP;\n  SecType = sys;\n  Attr_Expiration_Time = {};",
            e.id, settings.attr_expiry_secs
        );
        if !e.clients.is_empty() {
            let _ = writeln!(
                out,
                "  CLIENT {{\n    Clients = {};\n    Access_Type = RW;\n    Squash = {squash};\n    Protocols = 4;\n  }}",
                e.clients.join(", ")
            );
        }
        let _ = writeln!(out, "  FSAL {{\n    Name = VFS;\n  }}\n}}");
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
        Export { id, path: path.into(), pseudo: pseudo.into(), clients: vec!["192.0.2.10".into()], squash: Squash::Root }
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

#[cfg(test)]
mod access {
    use super::*;

    fn settings() -> Settings {
        Settings {
            listen: "127.0.0.1:20490".parse().unwrap(),
            plugins_dir: "/usr/lib/ganesha".into(),
            recovery_dir: "/var/lib/volring/nfs/recovery".into(),
            lease_secs: 10,
            grace_secs: 15,
            attr_expiry_secs: 0,
        }
    }

    fn export(clients: &[&str], squash: Squash) -> Export {
        Export { id: 7, path: "/s/pvc-1".into(), pseudo: "/pvc-1".into(), clients: clients.iter().map(|c| c.to_string()).collect(), squash }
    }

    /// Issue 27: an export admits only its clients, root squashed unless
    /// the StorageClass says otherwise; no client, nobody.
    #[test]
    fn only_the_listed_clients_are_admitted() {
        let c = render(&settings(), &[export(&["192.0.2.10", "fd00::7", "10.1.0.0/16"], Squash::Root)]).unwrap();
        assert!(c.contains("Access_Type = None;"), "{c}");
        assert!(!c.contains("No_Root_Squash"), "{c}");
        assert!(
            c.contains("CLIENT {\n    Clients = 192.0.2.10, fd00::7, 10.1.0.0/16;\n    Access_Type = RW;\n    Squash = Root_Squash;"),
            "{c}"
        );
        assert_eq!(c.matches('{').count(), c.matches('}').count());
        let nobody = render(&settings(), &[export(&[], Squash::Root)]).unwrap();
        assert!(!nobody.contains("CLIENT") && !nobody.contains("Access_Type = RW"), "{nobody}");
        let none = render(&settings(), &[export(&["192.0.2.10"], Squash::None)]).unwrap();
        assert_eq!(none.matches("Squash = No_Root_Squash;").count(), 2, "{none}");
        assert!(render(&settings(), &[export(&["192.0.2.10"], Squash::All)]).unwrap().contains("Squash = All_Squash;"));
    }

    #[test]
    fn client_entries_are_addresses_or_networks() {
        for ok in ["192.0.2.1", "::1", "fd00::/8", "10.0.0.0/8", "192.0.2.1/32"] {
            assert!(valid_client(ok), "{ok}");
        }
        for bad in ["", "*", "node-a", "@netgroup", "10.0.0.0/33", "fd00::/129", "10.0.0.0/", "10.0.0.0/+8", "1.2.3.4; Access_Type = RW"] {
            assert!(!valid_client(bad), "{bad}");
            assert!(matches!(render(&settings(), &[export(&[bad], Squash::Root)]), Err(Error::Config(_))), "{bad}");
        }
        assert_eq!("root".parse::<Squash>().unwrap(), Squash::Root);
        assert_eq!("none".parse::<Squash>().unwrap(), Squash::None);
        assert!("no_root_squash".parse::<Squash>().is_err());
        assert_eq!(Squash::default(), Squash::Root);
    }
}
