//! The node's store: one redb file, `STATE_DIR/state.redb`, holding the
//! desired state of every volume (the intents), the volumes' last known
//! health, and what had to be quarantined.
//!
//! One file and one transaction per change: a volume's record and its
//! attachment change together or not at all, which per-volume JSON files
//! could not promise. Every commit is durable before it returns (redb's
//! immediate durability: the data, then the header that points at it), so an
//! intent written before a step is on disk before the step runs.
//!
//! The agent is the one writer. `volring status` opens the file read-only
//! beside it (redb's single-writer mode lets readers follow the writer's
//! commits). After a crash the file needs redb's repair before anything can
//! read it; [`Store::read_only`] does that repair itself, but only when it can
//! take the agent's lock, i.e. when no agent is running.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use redb::{Builder, ConcurrencyMode, Database, ReadableDatabase, ReadableTable, TableDefinition};

/// Desired state: volume id → the volume's record (JSON, so an operator's
/// tools and older agents can read it, and a new field needs no migration).
const VOLUMES: TableDefinition<&str, &[u8]> = TableDefinition::new("volumes");
/// Records that could not be decoded: id → [`QuarantinedRecord`] (JSON).
const QUARANTINE: TableDefinition<&str, &[u8]> = TableDefinition::new("quarantine");
/// The reconciler's last verdict per volume (JSON); written only on change.
const HEALTH: TableDefinition<&str, &[u8]> = TableDefinition::new("health");
/// Legacy JSON record files already imported: file name → FNV-1a of its bytes.
const IMPORTED: TableDefinition<&str, u64> = TableDefinition::new("imported");
/// With no cluster, the objects the publisher would have written to the API
/// server: `Kind/name` → the object (JSON, as the API would return it).
const PUBLISHED: TableDefinition<&str, &[u8]> = TableDefinition::new("published");
/// What was rebuilt after the store was lost or damaged: when (UTC,
/// `YYYYmmddTHHMMSSZ`) → [`Recovery`] (JSON), for `volring status`.
const RECOVERED: TableDefinition<&str, &[u8]> = TableDefinition::new("recovered");
/// The reconciler's last repairs, a bounded ring
/// ([`crate::state::history`]): sequence number (20 digits, so the keys
/// sort in order) → the repair (JSON), for `volring status`.
const REPAIRS: TableDefinition<&str, &[u8]> = TableDefinition::new("repairs");

/// The store's file name inside the state directory.
pub const FILE: &str = "state.redb";

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("state store {path}: {detail}")]
    Store { path: PathBuf, detail: String },
    #[error("state store {path} is being written by a running agent and needs no repair, but could not be read: {detail}")]
    Busy { path: PathBuf, detail: String },
    /// The file is not a store redb can read (a damaged header, garbage,
    /// a torn page): set it aside and rebuild, never guess from it.
    #[error("state store {path} is damaged: {detail}")]
    Damaged { path: PathBuf, detail: String },
}

impl Error {
    pub(crate) fn is_damage(&self) -> bool {
        matches!(self, Error::Damaged { .. })
    }
}

/// Whether redb's error says the file itself is bad (rather than the
/// machine: a full disk, a permission, a lock).
fn damage(e: &redb::DatabaseError) -> bool {
    match e {
        redb::DatabaseError::UpgradeRequired(_) => true,
        redb::DatabaseError::Storage(s) => storage_damage(s),
        _ => false,
    }
}

fn storage_damage(s: &redb::StorageError) -> bool {
    match s {
        redb::StorageError::Corrupted(_) => true,
        redb::StorageError::Io(e) => matches!(e.kind(), std::io::ErrorKind::InvalidData | std::io::ErrorKind::UnexpectedEof),
        _ => false,
    }
}

/// Why and how the desired state was rebuilt from the kernel after the
/// store was lost or damaged (kept in the new store for `volring status`).
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Recovery {
    pub at: String,
    /// `missing` or `damaged: <redb's error>`.
    pub cause: String,
    /// Where the damaged file was set aside, when it was.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub set_aside: Option<PathBuf>,
    /// The volumes whose records were rebuilt from the kernel.
    pub adopted: Vec<String>,
    /// What the kernel shows that could not be proven to be a volume's
    /// (left alone, reported).
    pub refused: Vec<String>,
}

/// The UTC time now as `YYYYmmddTHHMMSSZ`.
pub(crate) fn timestamp() -> String {
    let secs = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0);
    let (y, m, d, rem) = civil(secs);
    format!("{y:04}{m:02}{d:02}T{:02}{:02}{:02}Z", rem / 3600, rem % 3600 / 60, rem % 60)
}

/// `secs` since the epoch as UTC `YYYY-mm-dd HH:MM:SSZ`, for people.
pub fn utc_text(secs: u64) -> String {
    let (y, m, d, rem) = civil(secs);
    format!("{y:04}-{m:02}-{d:02} {:02}:{:02}:{:02}Z", rem / 3600, rem % 3600 / 60, rem % 60)
}

/// Year, month, day and seconds into the day of `secs` since the epoch.
fn civil(secs: u64) -> (i64, i64, i64, u64) {
    let (days, rem) = ((secs / 86_400) as i64, secs % 86_400);
    // Howard Hinnant's days-to-civil.
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    (y, m, d, rem)
}

/// The prefix of a damaged store's name once set aside.
pub(crate) const DAMAGED: &str = "state.redb.damaged-";

/// Moves the damaged store at `path` aside (`state.redb.damaged-<UTC
/// time>` beside it, kept for the operator) durably, and returns where.
pub(crate) fn set_aside(path: &Path) -> std::io::Result<PathBuf> {
    let dir = path.parent().unwrap_or(Path::new("."));
    let stamp = timestamp();
    let mut to = dir.join(format!("{DAMAGED}{stamp}"));
    for n in 1..1000 {
        if std::fs::symlink_metadata(&to).is_err() {
            break;
        }
        to = dir.join(format!("{DAMAGED}{stamp}.{n}"));
    }
    std::fs::rename(path, &to)?;
    crate::persist::sync_dir(dir)?;
    Ok(to)
}

/// The damaged stores set aside in `state_dir`, oldest first.
pub(crate) fn set_aside_in(state_dir: &Path) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(state_dir)
        .into_iter()
        .flatten()
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().starts_with(DAMAGED))
        .map(|e| e.path())
        .collect();
    v.sort();
    v
}

/// A record the store could not decode, kept with why.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct QuarantinedRecord {
    pub id: String,
    pub reason: String,
    /// The record's bytes, as text (lossy), for the operator.
    pub raw: String,
}

/// Everything the store holds, read in one transaction.
#[derive(Debug, Default, Clone)]
pub struct Contents {
    pub volumes: Vec<(String, Vec<u8>)>,
    pub quarantined: Vec<QuarantinedRecord>,
    pub health: Vec<(String, Vec<u8>)>,
    pub published: Vec<(String, Vec<u8>)>,
    pub recovered: Vec<Recovery>,
    /// The reconciler's repair ring, oldest first (raw JSON).
    pub repairs: Vec<(String, Vec<u8>)>,
}

/// One change to the store; a batch of them is one transaction.
#[derive(Debug, Clone)]
pub enum Change<'a> {
    PutVolume(&'a str, &'a [u8]),
    RemoveVolume(&'a str),
    Quarantine(&'a QuarantinedRecord),
    PutHealth(&'a str, &'a [u8]),
    RemoveHealth(&'a str),
    Imported(&'a str, u64),
    PutPublished(&'a str, &'a [u8]),
    RemovePublished(&'a str),
    PutRepair(&'a str, &'a [u8]),
    RemoveRepair(&'a str),
    PutRecovery(&'a Recovery),
}

/// Upper bounds of the commit-duration buckets, microseconds: a commit is
/// an fsync of the store's file, so a slow or saturated disk under the
/// state directory shows here first (every step that changes the machine
/// waits for its intent to commit).
const COMMIT_BUCKETS_US: [u64; 10] = [100, 250, 500, 1_000, 2_500, 5_000, 10_000, 50_000, 250_000, 1_000_000];

/// Commit durations since the store was opened, for `/metrics`.
#[derive(Debug, Clone, PartialEq)]
pub struct CommitStats {
    /// Per bucket: upper bound in seconds (the last one `f64::MAX`), and
    /// the commits in that bucket alone (not cumulative).
    pub buckets: Vec<(f64, u64)>,
    /// All commits' durations together, seconds.
    pub sum_seconds: f64,
}

/// The node's store, open for writing (the agent).
pub struct Store {
    db: Database,
    path: PathBuf,
    /// Commits per duration bucket (the last past every bound).
    commit_buckets: [AtomicU64; COMMIT_BUCKETS_US.len() + 1],
    commit_sum_us: AtomicU64,
}

impl Store {
    /// Opens (creating if needed) the store at `path`, repairing it after a
    /// crash.
    pub fn open(path: &Path) -> Result<Self, Error> {
        let err = |detail: String| Error::Store { path: path.to_path_buf(), detail };
        let opened = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| builder().create(path)));
        let db = match opened {
            Ok(Ok(db)) => db,
            Ok(Err(e)) if damage(&e) => return Err(Error::Damaged { path: path.to_path_buf(), detail: e.to_string() }),
            Ok(Err(e)) => return Err(err(e.to_string())),
            Err(_) => return Err(Error::Damaged { path: path.to_path_buf(), detail: "redb panicked opening it".into() }),
        };
        let tx = db.begin_write().map_err(|e| err(e.to_string()))?;
        {
            // Every table exists from the start, so readers never meet a
            // missing one.
            tx.open_table(VOLUMES).map_err(|e| err(e.to_string()))?;
            tx.open_table(QUARANTINE).map_err(|e| err(e.to_string()))?;
            tx.open_table(HEALTH).map_err(|e| err(e.to_string()))?;
            tx.open_table(IMPORTED).map_err(|e| err(e.to_string()))?;
            tx.open_table(PUBLISHED).map_err(|e| err(e.to_string()))?;
            tx.open_table(RECOVERED).map_err(|e| err(e.to_string()))?;
            tx.open_table(REPAIRS).map_err(|e| err(e.to_string()))?;
        }
        tx.commit().map_err(|e| err(e.to_string()))?;
        Ok(Self { db, path: path.to_path_buf(), commit_buckets: Default::default(), commit_sum_us: AtomicU64::new(0) })
    }

    pub(crate) fn path(&self) -> &Path {
        &self.path
    }

    /// Applies `changes` in one durable transaction.
    pub fn apply(&self, changes: &[Change<'_>]) -> Result<(), Error> {
        let start = Instant::now();
        let err = |detail: String| Error::Store { path: self.path.clone(), detail };
        let tx = self.db.begin_write().map_err(|e| err(e.to_string()))?;
        {
            let mut volumes = tx.open_table(VOLUMES).map_err(|e| err(e.to_string()))?;
            let mut quarantine = tx.open_table(QUARANTINE).map_err(|e| err(e.to_string()))?;
            let mut health = tx.open_table(HEALTH).map_err(|e| err(e.to_string()))?;
            let mut imported = tx.open_table(IMPORTED).map_err(|e| err(e.to_string()))?;
            let mut published = tx.open_table(PUBLISHED).map_err(|e| err(e.to_string()))?;
            let mut recovered = tx.open_table(RECOVERED).map_err(|e| err(e.to_string()))?;
            let mut repairs = tx.open_table(REPAIRS).map_err(|e| err(e.to_string()))?;
            for c in changes {
                let r = match *c {
                    Change::PutVolume(id, bytes) => volumes.insert(id, bytes).map(drop),
                    Change::RemoveVolume(id) => volumes.remove(id).map(drop),
                    Change::Quarantine(q) => {
                        let bytes = serde_json::to_vec(q).expect("a quarantined record serialises");
                        volumes.remove(q.id.as_str()).and_then(|_| quarantine.insert(q.id.as_str(), bytes.as_slice())).map(drop)
                    }
                    Change::PutHealth(id, bytes) => health.insert(id, bytes).map(drop),
                    Change::RemoveHealth(id) => health.remove(id).map(drop),
                    Change::Imported(name, hash) => imported.insert(name, hash).map(drop),
                    Change::PutPublished(key, bytes) => published.insert(key, bytes).map(drop),
                    Change::RemovePublished(key) => published.remove(key).map(drop),
                    Change::PutRepair(key, bytes) => repairs.insert(key, bytes).map(drop),
                    Change::RemoveRepair(key) => repairs.remove(key).map(drop),
                    Change::PutRecovery(r) => {
                        let bytes = serde_json::to_vec(r).expect("a recovery serialises");
                        recovered.insert(r.at.as_str(), bytes.as_slice()).map(drop)
                    }
                };
                r.map_err(|e| err(e.to_string()))?;
            }
        }
        tx.commit().map_err(|e| err(e.to_string()))?;
        let us = u64::try_from(start.elapsed().as_micros()).unwrap_or(u64::MAX);
        let bucket = COMMIT_BUCKETS_US.iter().position(|&b| us <= b).unwrap_or(COMMIT_BUCKETS_US.len());
        self.commit_buckets[bucket].fetch_add(1, Ordering::Relaxed);
        self.commit_sum_us.fetch_add(us, Ordering::Relaxed);
        Ok(())
    }

    /// How long this store's commits took so far (see [`CommitStats`]).
    pub fn commit_stats(&self) -> CommitStats {
        CommitStats {
            buckets: COMMIT_BUCKETS_US
                .iter()
                .map(|&b| b as f64 / 1e6)
                .chain([f64::MAX])
                .zip(self.commit_buckets.iter().map(|n| n.load(Ordering::Relaxed)))
                .collect(),
            sum_seconds: self.commit_sum_us.load(Ordering::Relaxed) as f64 / 1e6,
        }
    }

    /// Reads everything in one transaction.
    pub(crate) fn contents(&self) -> Result<Contents, Error> {
        read_all(&self.db, &self.path)
    }

    /// Opens the store and reads it all once, so damage anywhere in it
    /// (not only in the header `open` checks) shows now, as
    /// [`Error::Damaged`], rather than in the middle of a call.
    pub(crate) fn open_checked(path: &Path) -> Result<(Self, Contents), Error> {
        let store = Self::open(path)?;
        let read = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| store.contents()));
        match read {
            Ok(Ok(c)) => Ok((store, c)),
            Ok(Err(Error::Store { detail, .. })) if detail.contains("orrupt") => Err(Error::Damaged { path: path.to_path_buf(), detail }),
            Ok(Err(e)) => Err(e),
            Err(_) => Err(Error::Damaged { path: path.to_path_buf(), detail: "redb panicked reading it".into() }),
        }
    }

    /// The stored verdicts alone (the reconciler's start needs no records).
    pub(crate) fn health(&self) -> Result<Vec<(String, Vec<u8>)>, Error> {
        let err = |detail: String| Error::Store { path: self.path.clone(), detail };
        let tx = self.db.begin_read().map_err(|e| err(e.to_string()))?;
        let t = tx.open_table(HEALTH).map_err(|e| err(e.to_string()))?;
        let mut v = Vec::new();
        for row in t.iter().map_err(|e| err(e.to_string()))? {
            let (k, val) = row.map_err(|e| err(e.to_string()))?;
            v.push((k.value().to_string(), val.value().to_vec()));
        }
        Ok(v)
    }

    /// One published object's bytes.
    pub fn published(&self, key: &str) -> Result<Option<Vec<u8>>, Error> {
        let err = |detail: String| Error::Store { path: self.path.clone(), detail };
        let tx = self.db.begin_read().map_err(|e| err(e.to_string()))?;
        let t = tx.open_table(PUBLISHED).map_err(|e| err(e.to_string()))?;
        Ok(t.get(key).map_err(|e| err(e.to_string()))?.map(|v| v.value().to_vec()))
    }

    /// The published objects whose key starts with `prefix`, in key order.
    pub fn published_under(&self, prefix: &str) -> Result<Vec<(String, Vec<u8>)>, Error> {
        let err = |detail: String| Error::Store { path: self.path.clone(), detail };
        let tx = self.db.begin_read().map_err(|e| err(e.to_string()))?;
        let t = tx.open_table(PUBLISHED).map_err(|e| err(e.to_string()))?;
        let mut v = Vec::new();
        for row in t.range(prefix..).map_err(|e| err(e.to_string()))? {
            let (k, val) = row.map_err(|e| err(e.to_string()))?;
            if !k.value().starts_with(prefix) {
                break;
            }
            v.push((k.value().to_string(), val.value().to_vec()));
        }
        Ok(v)
    }

    /// The hash recorded for an imported legacy file of this name.
    pub(crate) fn imported(&self, name: &str) -> Result<Option<u64>, Error> {
        let err = |detail: String| Error::Store { path: self.path.clone(), detail };
        let tx = self.db.begin_read().map_err(|e| err(e.to_string()))?;
        let t = tx.open_table(IMPORTED).map_err(|e| err(e.to_string()))?;
        Ok(t.get(name).map_err(|e| err(e.to_string()))?.map(|v| v.value()))
    }

    /// Reads the store at `path` without writing it — beside a running agent,
    /// or after one. A store left unrepaired by a crash is repaired first,
    /// but only when `no_writer` is true (the caller holds the agent's lock).
    /// A store that does not exist reads as empty.
    pub fn read_only(path: &Path, no_writer: bool) -> Result<Contents, Error> {
        if !path.exists() {
            return Ok(Contents::default());
        }
        let err = |detail: String| Error::Store { path: path.to_path_buf(), detail };
        let opened = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| builder().open_read_only(path)))
            .map_err(|_| Error::Damaged { path: path.to_path_buf(), detail: "redb panicked opening it".into() })?;
        match opened {
            Ok(db) => read_all(&db, path),
            Err(redb::DatabaseError::RepairAborted) if no_writer => {
                tracing::info!(store = %path.display(), "the store was not closed cleanly; repairing it before reading");
                drop(builder().open(path).map_err(|e| err(e.to_string()))?);
                let db = builder().open_read_only(path).map_err(|e| err(e.to_string()))?;
                read_all(&db, path)
            }
            Err(e) if damage(&e) => Err(Error::Damaged { path: path.to_path_buf(), detail: e.to_string() }),
            // Only beside a running agent is an unreadable store its
            // business; with none, redb's own word is the answer.
            Err(e) if !no_writer => Err(Error::Busy { path: path.to_path_buf(), detail: e.to_string() }),
            Err(e) => Err(err(e.to_string())),
        }
    }
}

fn builder() -> Builder {
    let mut b = Builder::new();
    b.set_concurrency_mode(ConcurrencyMode::SingleWriter);
    b
}

fn read_all(db: &impl ReadableDatabase, path: &Path) -> Result<Contents, Error> {
    let err = |detail: String| Error::Store { path: path.to_path_buf(), detail };
    let tx = db.begin_read().map_err(|e| err(e.to_string()))?;
    let mut out = Contents::default();
    let pairs = |def: TableDefinition<&str, &[u8]>| -> Result<Vec<(String, Vec<u8>)>, Error> {
        let t = match tx.open_table(def) {
            Ok(t) => t,
            Err(redb::TableError::TableDoesNotExist(_)) => return Ok(Vec::new()),
            Err(e) => return Err(err(e.to_string())),
        };
        let mut v = Vec::new();
        for row in t.iter().map_err(|e| err(e.to_string()))? {
            let (k, val) = row.map_err(|e| err(e.to_string()))?;
            v.push((k.value().to_string(), val.value().to_vec()));
        }
        Ok(v)
    };
    out.volumes = pairs(VOLUMES)?;
    out.health = pairs(HEALTH)?;
    out.published = pairs(PUBLISHED)?;
    out.repairs = pairs(REPAIRS)?;
    out.recovered = pairs(RECOVERED)?.iter().filter_map(|(_, b)| serde_json::from_slice(b).ok()).collect();
    for (id, bytes) in pairs(QUARANTINE)? {
        let q = serde_json::from_slice(&bytes).unwrap_or_else(|e| QuarantinedRecord {
            id: id.clone(),
            reason: format!("quarantine entry itself unreadable: {e}"),
            raw: String::from_utf8_lossy(&bytes).into_owned(),
        });
        out.quarantined.push(q);
    }
    Ok(out)
}

/// FNV-1a, 64 bits: tells whether a legacy file was already imported as is.
pub fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &b| (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn changes_are_one_transaction_and_survive_reopen() {
        let d = tempfile::tempdir().unwrap();
        let path = d.path().join(FILE);
        let s = Store::open(&path).unwrap();
        s.apply(&[Change::PutVolume("a", b"{1}"), Change::PutVolume("b", b"{2}"), Change::PutHealth("a", b"ok")]).unwrap();
        let q = QuarantinedRecord { id: "b".into(), reason: "torn".into(), raw: "{2}".into() };
        s.apply(&[Change::Quarantine(&q), Change::Imported("a.json", 7)]).unwrap();
        // A reader beside the writer sees every commit.
        let seen = Store::read_only(&path, false).unwrap();
        assert_eq!(seen.volumes, vec![("a".to_string(), b"{1}".to_vec())]);
        assert_eq!(seen.quarantined, vec![q.clone()]);
        assert_eq!(seen.health, vec![("a".to_string(), b"ok".to_vec())]);
        drop(s);
        let s = Store::open(&path).unwrap();
        assert_eq!(s.imported("a.json").unwrap(), Some(7));
        s.apply(&[Change::RemoveVolume("a"), Change::RemoveHealth("a")]).unwrap();
        let c = s.contents().unwrap();
        assert!(c.volumes.is_empty() && c.health.is_empty() && c.quarantined == vec![q]);
        let commits = s.commit_stats();
        assert_eq!(commits.buckets.iter().map(|(_, n)| n).sum::<u64>(), 1, "commits since this open: {commits:?}");
        assert_eq!(commits.buckets.len(), COMMIT_BUCKETS_US.len() + 1);
        assert_eq!(commits.buckets.last().map(|(b, _)| *b), Some(f64::MAX));
        assert!(commits.sum_seconds > 0.0 && commits.sum_seconds < 60.0, "{commits:?}");
    }

    #[test]
    fn a_damaged_store_is_named_so_and_set_aside() {
        let d = tempfile::tempdir().unwrap();
        let path = d.path().join(FILE);
        let s = Store::open(&path).unwrap();
        s.apply(&[Change::PutVolume("a", b"{1}")]).unwrap();
        drop(s);
        let mut bytes = std::fs::read(&path).unwrap();
        bytes[..512].fill(0xa5);
        std::fs::write(&path, &bytes).unwrap();
        let e = Store::open_checked(&path).err().expect("a garbage header does not open");
        assert!(e.is_damage(), "{e}");
        let e = Store::read_only(&path, true).expect_err("nor reads");
        assert!(!matches!(e, Error::Busy { .. }), "{e}");
        let to = set_aside(&path).unwrap();
        assert!(!path.exists() && to.exists() && set_aside_in(d.path()) == vec![to]);
        assert_eq!(timestamp().len(), 16);
    }

    #[test]
    fn a_missing_store_reads_empty() {
        let d = tempfile::tempdir().unwrap();
        let c = Store::read_only(&d.path().join(FILE), true).unwrap();
        assert!(c.volumes.is_empty());
    }
}
