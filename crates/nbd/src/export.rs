//! What the server serves: image files and block devices, by name.
//!
//! An export opens its file once; every connection on every ring thread
//! uses that one open file, which is what makes CAN_MULTI_CONN true (a
//! flush through any connection syncs the inode all of them write to).

use std::collections::BTreeMap;
use std::fs::OpenOptions;
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, RwLock};

use super::handshake::{Catalog, ExportInfo};
use super::remote::Secret;
use super::stats::{ExportSnapshot, ExportStats, RingCounters, RingSnapshot};
use super::Error;

/// Largest request payload: what qemu and the kernel client use.
pub(crate) const MAX_BLOCK: u32 = 32 << 20;
/// Alignment O_DIRECT needs of offsets, lengths and memory; requests that
/// do not meet it go through the export's buffered descriptor.
pub(crate) const DIRECT_ALIGN: u64 = 4096;

/// `NAME=PATH[,ro][,direct][,limit=N][,description=TEXT]`, as on the command line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExportSpec {
    pub name: String,
    pub path: PathBuf,
    pub read_only: bool,
    pub direct_io: bool,
    /// Connections at once; 0 means no limit.
    pub max_connections: u32,
    pub description: String,
}

impl FromStr for ExportSpec {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self, Error> {
        let bad = |why: &str| Error::Spec { spec: s.to_string(), why: why.to_string() };
        let (name, rest) = s.split_once('=').ok_or_else(|| bad("expected NAME=PATH"))?;
        if name.is_empty() || name.len() > 4096 || name.chars().any(|c| c.is_control()) {
            return Err(bad("a name is 1 to 4096 printable characters"));
        }
        let mut parts = rest.split(',');
        let path = parts.next().filter(|p| !p.is_empty()).ok_or_else(|| bad("missing PATH"))?;
        let mut spec = ExportSpec {
            name: name.to_string(),
            path: PathBuf::from(path),
            read_only: false,
            direct_io: false,
            max_connections: 0,
            description: String::new(),
        };
        for opt in parts {
            match opt.split_once('=') {
                None if opt == "ro" => spec.read_only = true,
                None if opt == "rw" => spec.read_only = false,
                None if opt == "direct" => spec.direct_io = true,
                Some(("limit", n)) => spec.max_connections = n.parse().map_err(|_| bad("limit=N takes a number"))?,
                Some(("description", d)) => spec.description = d.to_string(),
                _ => return Err(bad(&format!("unknown option {opt:?} (ro, rw, direct, limit=N, description=TEXT)"))),
            }
        }
        Ok(spec)
    }
}

/// One served file or device.
pub struct Export {
    /// Unique for the life of the process (names can be reused).
    pub id: u64,
    pub name: String,
    pub path: PathBuf,
    pub size: u64,
    pub read_only: bool,
    pub block_device: bool,
    pub description: String,
    pub max_connections: u32,
    /// The descriptor requests use: O_DIRECT when asked for and supported.
    file: OwnedFd,
    /// A buffered descriptor for requests O_DIRECT cannot take (unaligned),
    /// and for SEEK_DATA; `None` when `file` is buffered already.
    buffered: Option<OwnedFd>,
    removed: AtomicBool,
    pub(crate) stats: ExportStats,
    /// Who else decides whether a client may have it (a guarded catalog's
    /// [`Admission`]); told of every admitted connection's end.
    admission: Option<Arc<dyn Admission>>,
}

impl std::fmt::Debug for Export {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Export").field("name", &self.name).field("path", &self.path).field("size", &self.size).finish_non_exhaustive()
    }
}

fn open(path: &Path, read_only: bool, direct: bool) -> std::io::Result<std::fs::File> {
    let mut o = OpenOptions::new();
    o.read(true).write(!read_only);
    if direct {
        o.custom_flags(libc::O_DIRECT);
    }
    o.open(path)
}

impl Export {
    fn open(spec: &ExportSpec, id: u64) -> Result<Self, Error> {
        let err = |source| Error::Open { path: spec.path.clone(), source };
        let buffered = open(&spec.path, spec.read_only, false).map_err(err)?;
        let meta = buffered.metadata().map_err(err)?;
        let block_device = meta.file_type().is_block_device();
        if !block_device && !meta.is_file() {
            return Err(Error::Spec { spec: spec.path.display().to_string(), why: "not a regular file or block device".into() });
        }
        // A block device reports its size through lseek, a file through stat.
        let size = rustix::fs::seek(&buffered, rustix::fs::SeekFrom::End(0)).map_err(|e| err(e.into()))?;
        let (file, extra) = if spec.direct_io {
            match open(&spec.path, spec.read_only, true) {
                Ok(d) => (OwnedFd::from(d), Some(OwnedFd::from(buffered))),
                // tmpfs and friends refuse O_DIRECT: serve buffered, say so.
                Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {
                    tracing::warn!(export = %spec.name, path = %spec.path.display(), "O_DIRECT not supported here; serving buffered");
                    (OwnedFd::from(buffered), None)
                }
                Err(e) => return Err(err(e)),
            }
        } else {
            (OwnedFd::from(buffered), None)
        };
        Ok(Export {
            id,
            name: spec.name.clone(),
            path: spec.path.clone(),
            size,
            read_only: spec.read_only,
            block_device,
            description: spec.description.clone(),
            max_connections: spec.max_connections,
            file,
            buffered: extra,
            removed: AtomicBool::new(false),
            stats: ExportStats::default(),
            admission: None,
        })
    }

    /// The descriptor for aligned requests (O_DIRECT when enabled).
    pub(crate) fn file(&self) -> &OwnedFd {
        &self.file
    }

    /// The buffered descriptor, when `file` is O_DIRECT.
    pub(crate) fn buffered(&self) -> Option<&OwnedFd> {
        self.buffered.as_ref()
    }

    pub fn direct_io(&self) -> bool {
        self.buffered.is_some()
    }

    /// A copy of the export's counters and latencies, under its name.
    pub fn snapshot(&self) -> ExportSnapshot {
        self.stats.snapshot(&self.name)
    }

    /// A descriptor that supports lseek(SEEK_DATA) and fadvise.
    pub(crate) fn any_fd(&self) -> std::os::fd::BorrowedFd<'_> {
        self.buffered.as_ref().unwrap_or(&self.file).as_fd()
    }

    pub(crate) fn is_removed(&self) -> bool {
        self.removed.load(Ordering::Acquire)
    }

    pub(crate) fn info(&self) -> ExportInfo {
        ExportInfo { size: self.size, read_only: self.read_only, description: self.description.clone(), block_sizes: (1, 4096, MAX_BLOCK) }
    }

    /// Takes a connection slot; false when the limit is reached or the export is gone.
    #[cfg(test)]
    fn admit(&self) -> bool {
        self.admit_why(None).is_ok()
    }

    /// Takes a connection slot, or says why not: the export is gone, full,
    /// or its [`Admission`] refuses `client` (the name the client gave
    /// itself, if any).
    pub(crate) fn admit_why(&self, client: Option<&str>) -> Result<(), String> {
        if self.is_removed() {
            return Err("no longer served".into());
        }
        let limit = if self.max_connections == 0 { u64::MAX } else { u64::from(self.max_connections) };
        let taken = self.stats.connections.fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| (n < limit).then_some(n + 1)).is_ok();
        if !taken {
            return Err("has reached its connection limit".into());
        }
        if let Some(a) = &self.admission {
            if let Err(why) = a.admit(&self.name, client) {
                let _ = self.stats.connections.fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| n.checked_sub(1));
                return Err(why);
            }
        }
        self.stats.connections_total.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }

    /// Gives a connection slot back (a connection that ended without the
    /// client's NBD_CMD_DISC: see [`Export::release_after`]).
    pub(crate) fn release(&self) {
        self.release_after(false);
    }

    /// Gives a connection slot back; `disconnected`: the client ended the
    /// connection with NBD_CMD_DISC (it let go of the export on purpose).
    pub(crate) fn release_after(&self, disconnected: bool) {
        let _ = self.stats.connections.fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| n.checked_sub(1));
        if let Some(a) = &self.admission {
            a.released(&self.name, disconnected);
        }
    }
}

/// Who may hold a guarded export besides its secret: the owning node's
/// arbiter between serving a volume to other nodes and mounting it itself
/// (`csi::fence`). Called on the ring thread of the connection, once per
/// connection at its GO and once at its end, so an implementation may
/// block briefly (a store commit when the holder changes) but never wait
/// on the async side.
pub trait Admission: Send + Sync {
    /// A client that named the right secret asks for `export`, naming
    /// itself `client` (the consuming node, when it says): `Ok` once it may
    /// have it (anything that must outlive a crash is recorded before this
    /// returns), else why not.
    fn admit(&self, export: &str, client: Option<&str>) -> Result<(), String>;
    /// A connection `admit` let in has ended; `disconnected`: with the
    /// client's NBD_CMD_DISC.
    fn released(&self, export: &str, disconnected: bool);
}

/// The exports of one server, by name; shared by the ring threads and
/// whoever adds and removes exports.
///
/// A guarded catalog ([`Exports::guarded`], the one a node's TCP export
/// listener serves) holds only exports added with a secret, finds one only
/// for a client that names `<export>/<secret>[/<client>]` with the right
/// secret (compared in constant time), answers a wrong secret exactly as an
/// unknown export, and lists nothing.
#[derive(Default)]
pub struct Exports {
    map: RwLock<BTreeMap<String, Arc<Export>>>,
    next_id: AtomicU64,
    /// `Some` for a guarded catalog: each export's secret, by export name.
    secrets: Option<RwLock<BTreeMap<String, Secret>>>,
    /// Asked before a guarded export is handed out; set once, before the
    /// first export is added (exports copy it when added).
    admission: std::sync::OnceLock<Arc<dyn Admission>>,
    /// The counters of the rings of the server serving this catalog, in
    /// ring order (empty while none runs): each ring writes only its own,
    /// and `/metrics` reads them through the catalog it already holds.
    rings: RwLock<Vec<Arc<RingCounters>>>,
}

impl Exports {
    /// A catalog whose every export needs its secret (see the type's doc).
    pub fn guarded() -> Self {
        Self { secrets: Some(RwLock::default()), ..Self::default() }
    }

    /// From now on, exports added to this guarded catalog are handed out
    /// only when `admission` agrees (see [`Admission`]). Refused once
    /// an export is in (it would be served unfenced) or when already set.
    pub fn set_admission(&self, admission: Arc<dyn Admission>) -> Result<(), Error> {
        if self.secrets.is_none() {
            return Err(Error::Secret("only a guarded catalog takes an admission"));
        }
        if !self.map.read().unwrap_or_else(|p| p.into_inner()).is_empty() {
            return Err(Error::Secret("an admission is set before the first export"));
        }
        self.admission.set(admission).map_err(|_| Error::Secret("the admission is already set"))
    }

    /// Opens and adds an export; the name must be free. A guarded catalog
    /// takes only an export with the secret a client must present, and an
    /// unguarded one only an export without (its exports need none).
    pub fn add(&self, spec: &ExportSpec, secret: Option<Secret>) -> Result<Arc<Export>, Error> {
        match (&self.secrets, secret) {
            (None, None) => self.insert(spec),
            (None, Some(_)) => Err(Error::Secret("this catalog serves exports without secrets")),
            (Some(_), None) => Err(Error::Secret("a guarded catalog serves only exports with a secret")),
            (Some(secrets), Some(secret)) => {
                if !super::remote::valid_export(&spec.name) {
                    return Err(Error::Spec {
                        spec: spec.name.clone(),
                        why: "a guarded export's name is 1 to 128 of [A-Za-z0-9._-]".into(),
                    });
                }
                let e = self.insert(spec)?;
                secrets.write().unwrap_or_else(|p| p.into_inner()).insert(spec.name.clone(), secret);
                Ok(e)
            }
        }
    }

    fn insert(&self, spec: &ExportSpec) -> Result<Arc<Export>, Error> {
        if self.get(&spec.name).is_some() {
            return Err(Error::Exists(spec.name.clone()));
        }
        let mut export = Export::open(spec, self.next_id.fetch_add(1, Ordering::Relaxed))?;
        export.admission = self.admission.get().cloned();
        let export = Arc::new(export);
        let mut map = self.map.write().unwrap_or_else(|p| p.into_inner());
        if map.contains_key(&spec.name) {
            return Err(Error::Exists(spec.name.clone()));
        }
        map.insert(spec.name.clone(), export.clone());
        Ok(export)
    }

    /// Takes an export out: new connections are refused at once; the server
    /// closes the existing ones (see `NbdServer::remove_export`).
    pub(crate) fn remove(&self, name: &str) -> Result<Arc<Export>, Error> {
        let export =
            self.map.write().unwrap_or_else(|p| p.into_inner()).remove(name).ok_or_else(|| Error::NoSuchExport(name.to_string()))?;
        export.removed.store(true, Ordering::Release);
        if let Some(secrets) = &self.secrets {
            secrets.write().unwrap_or_else(|p| p.into_inner()).remove(name);
        }
        Ok(export)
    }

    /// A guarded lookup: the export `name` names, if it presents the
    /// export's secret. The map lookup is by the export part only (volume
    /// ids are not secret); the secret is compared whole, in constant time.
    fn find_guarded(&self, secrets: &RwLock<BTreeMap<String, Secret>>, name: &str) -> Option<Arc<Export>> {
        let wire = super::remote::split_wire_name(name)?;
        let secret = secrets.read().unwrap_or_else(|p| p.into_inner()).get(wire.export).cloned();
        let e = self.get(wire.export);
        // Compared even when the export is unknown, so a miss costs what a
        // wrong secret costs.
        let dummy: Secret = "0".repeat(64).parse().ok()?;
        let ok = secret.as_ref().unwrap_or(&dummy).matches(wire.secret);
        match (ok, secret.is_some()) {
            (true, true) => e,
            _ => None,
        }
    }

    pub fn get(&self, name: &str) -> Option<Arc<Export>> {
        self.map.read().unwrap_or_else(|p| p.into_inner()).get(name).cloned()
    }

    pub fn all(&self) -> Vec<Arc<Export>> {
        self.map.read().unwrap_or_else(|p| p.into_inner()).values().cloned().collect()
    }

    /// A server starting on this catalog publishes its rings' counters
    /// here (a catalog is served by one server at a time; a later one's
    /// rings replace an earlier one's).
    pub(crate) fn set_rings(&self, rings: Vec<Arc<RingCounters>>) {
        *self.rings.write().unwrap_or_else(|p| p.into_inner()) = rings;
    }

    /// A stopping server takes its rings back out, unless another server
    /// has published its own since.
    pub(crate) fn unset_rings(&self, rings: &[Arc<RingCounters>]) {
        let mut current = self.rings.write().unwrap_or_else(|p| p.into_inner());
        if current.len() == rings.len() && current.iter().zip(rings).all(|(a, b)| Arc::ptr_eq(a, b)) {
            current.clear();
        }
    }
}

/// Each ring's counters of the server serving the catalog, in ring order:
/// what `/metrics` encodes as the `volring_nbd_ring_*` families. (A
/// conversion rather than a method, so that the one new public name is
/// the snapshot type: the workspace's public surface is capped,
/// tests/surface.rs.)
impl From<&Exports> for Vec<RingSnapshot> {
    fn from(exports: &Exports) -> Self {
        let rings = exports.rings.read().unwrap_or_else(|p| p.into_inner());
        rings.iter().enumerate().map(|(i, r)| r.snapshot(i)).collect()
    }
}

impl Catalog for Exports {
    type Handle = Arc<Export>;

    fn find(&self, name: &str) -> Option<(Arc<Export>, ExportInfo)> {
        let e = match &self.secrets {
            Some(secrets) => self.find_guarded(secrets, name)?,
            None => self.get(name)?,
        };
        let info = e.info();
        Some((e, info))
    }

    /// A guarded catalog's names are not for listing.
    fn names(&self) -> Vec<(String, String)> {
        if self.secrets.is_some() {
            return Vec::new();
        }
        self.map.read().unwrap_or_else(|p| p.into_inner()).values().map(|e| (e.name.clone(), e.description.clone())).collect()
    }

    /// A guarded export is admitted for the client the name gives (see
    /// [`Admission`]); an unguarded one for nobody in particular.
    fn admit(&self, export: &Arc<Export>, name: &str) -> Result<(), String> {
        let client = match &self.secrets {
            Some(_) => super::remote::split_wire_name(name).and_then(|w| w.client),
            None => None,
        };
        export.admit_why(client)
    }

    /// The secret never leaves the handshake (the server logs the name).
    fn public_name<'a>(&self, name: &'a str) -> &'a str {
        match (&self.secrets, super::remote::split_wire_name(name)) {
            (Some(_), Some(wire)) => wire.export,
            _ => name,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn specs_parse_and_refuse_nonsense() {
        let s: ExportSpec = "vol1=/srv/a.img,ro,limit=4,direct".parse().unwrap();
        assert_eq!((s.name.as_str(), s.read_only, s.direct_io, s.max_connections), ("vol1", true, true, 4));
        assert_eq!(s.path, PathBuf::from("/srv/a.img"));
        for bad in ["noequals", "=x", "a=", "a=/x,limit=many", "a=/x,bogus"] {
            assert!(bad.parse::<ExportSpec>().is_err(), "{bad}");
        }
    }

    #[test]
    fn limit_admits_up_to_n_and_removal_refuses_all() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("img");
        std::fs::write(&path, vec![0u8; 8192]).unwrap();
        let exports = Exports::default();
        let spec =
            ExportSpec { name: "a".into(), path, read_only: false, direct_io: false, max_connections: 2, description: String::new() };
        let e = exports.add(&spec, None).unwrap();
        assert_eq!(e.size, 8192);
        assert!(matches!(exports.add(&spec, None), Err(Error::Exists(_))));
        assert!(e.admit() && e.admit());
        assert!(!e.admit());
        e.release();
        assert!(e.admit());
        exports.remove("a").unwrap();
        e.release();
        assert!(!e.admit(), "a removed export takes no new connections");
        assert!(exports.find("a").is_none());
    }

    #[test]
    fn a_guarded_catalog_finds_only_with_the_secret_and_lists_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("img");
        std::fs::write(&path, vec![0u8; 8192]).unwrap();
        let spec = |name: &str| ExportSpec {
            name: name.into(),
            path: path.clone(),
            read_only: false,
            direct_io: false,
            max_connections: 0,
            description: String::new(),
        };
        let g = Exports::guarded();
        let secret = Secret::generate().unwrap();
        assert!(matches!(g.add(&spec("v"), None), Err(Error::Secret(_))), "no export without a secret");
        assert!(Exports::default().add(&spec("v"), Some(secret.clone())).is_err(), "no secret in an open catalog");
        assert!(g.add(&spec("a/b"), Some(secret.clone())).is_err(), "a name holding the separator");
        g.add(&spec("v"), Some(secret.clone())).unwrap();
        let good = super::super::remote::wire_name("v", &secret, None);
        assert!(g.find(&good).is_some());
        assert_eq!(g.public_name(&good), "v");
        let other = Secret::generate().unwrap();
        for bad in
            ["v".to_string(), "v/".into(), super::super::remote::wire_name("v", &other, None), format!("{good}0"), format!("w/{secret:x}")]
        {
            assert!(g.find(&bad).is_none(), "{bad:?} found");
        }
        assert!(g.names().is_empty());
        g.remove("v").unwrap();
        assert!(g.find(&good).is_none());
        // The same name again takes the new secret only.
        g.add(&spec("v"), Some(other.clone())).unwrap();
        assert!(g.find(&good).is_none() && g.find(&super::super::remote::wire_name("v", &other, None)).is_some());
    }

    /// The admission hears the name the client gave itself in a guarded
    /// catalog, and nothing in an open one.
    #[test]
    fn the_client_name_reaches_the_admission() {
        struct Seen(std::sync::Mutex<Vec<Option<String>>>);
        impl Admission for Seen {
            fn admit(&self, _: &str, client: Option<&str>) -> Result<(), String> {
                self.0.lock().unwrap().push(client.map(str::to_string));
                match client {
                    Some("refused") => Err("no".into()),
                    _ => Ok(()),
                }
            }
            fn released(&self, _: &str, _: bool) {}
        }
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("img");
        std::fs::write(&path, vec![0u8; 8192]).unwrap();
        let spec =
            ExportSpec { name: "v".into(), path, read_only: false, direct_io: false, max_connections: 0, description: String::new() };
        let g = Exports::guarded();
        let seen = Arc::new(Seen(Default::default()));
        g.set_admission(seen.clone()).unwrap();
        let secret = Secret::generate().unwrap();
        let e = g.add(&spec, Some(secret.clone())).unwrap();
        let wire = |c| super::super::remote::wire_name("v", &secret, c);
        let (h, _) = g.find(&wire(Some("node-b"))).expect("found with a client name");
        assert!(g.admit(&h, &wire(Some("node-b"))).is_ok() && g.admit(&h, &wire(None)).is_ok());
        assert!(g.admit(&h, &wire(Some("refused"))).is_err());
        assert_eq!(*seen.0.lock().unwrap(), [Some("node-b".to_string()), None, Some("refused".to_string())]);
        assert_eq!(e.stats.connections.load(Ordering::Acquire), 2, "a refused client holds no slot");
        assert_eq!(g.public_name(&wire(Some("node-b"))), "v", "neither secret nor client is kept");
    }
}
