//! `volring status`: what the node's state directory holds.

use std::fs::File;
use std::io::{self, Write};
use std::path::PathBuf;

use volring_volumes::status::{StagedStatus, StatusReport};
use volring_volumes::store::utc_text;
use volring_volumes::RepairResult;
use volring_volumes::{Drift, VolumeHealth};

/// How many of the kept repairs the text shows (`--json` has all).
const REPAIRS_SHOWN: usize = 10;

/// The HEALTH column: `ok`, the drift kinds, or `repair_failed`.
fn verdict(h: &VolumeHealth) -> String {
    let mut kinds: Vec<&str> = h.drift.iter().map(|d| d.kind()).collect();
    kinds.dedup();
    if h.repair_error.is_some() {
        kinds.push("repair_failed");
    }
    if kinds.is_empty() {
        "ok".into()
    } else {
        kinds.join(",")
    }
}

/// Under a volume: each drift in words, the last repair, a failed one's
/// error — everything `--json`'s `health` holds.
fn health_lines(h: &VolumeHealth) -> Vec<String> {
    let mut lines = Vec::new();
    for d in &h.drift {
        let path = match d {
            Drift::TargetMissing { path } | Drift::TargetForeign { path } => {
                format!(" ({})", path.display())
            }
            _ => String::new(),
        };
        let one = VolumeHealth { drift: vec![d.clone()], ..VolumeHealth::default() };
        lines.push(format!("drift {}{path}: {}", d.kind(), one.problem().unwrap_or_default()));
    }
    if let Some(e) = &h.repair_error {
        lines.push(format!("repair failed: {e}"));
    }
    if let Some(r) = &h.last_repair {
        lines.push(format!("last repair {}: {r}", utc_text(r.at_unix)));
    }
    lines
}

/// The directories `status` and `recover` read: one set of flags, so the
/// two commands cannot drift apart in name, default or meaning.
#[derive(clap::Args, Debug, Clone)]
pub(crate) struct NodeDirs {
    /// The agent's state directory.
    #[arg(long, default_value = "/var/lib/volring")]
    pub(crate) state_dir: PathBuf,
    /// The image pool, if not <state-dir>/pool.
    #[arg(long)]
    pub(crate) pool_dir: Option<PathBuf>,
    /// kubelet's root directory (where staged volumes are mounted).
    #[arg(long, default_value = "/var/lib/kubelet")]
    pub(crate) kubelet_root: PathBuf,
}

impl NodeDirs {
    fn pool(&self) -> PathBuf {
        self.pool_dir.clone().unwrap_or_else(|| self.state_dir.join("pool"))
    }

    /// Whether no agent holds the state directory now. The lock file stays
    /// open (and, when taken, locked) while the returned handle lives, so a
    /// store a crash left unrepaired may be repaired by this process alone;
    /// beside a running agent the store is only read.
    fn take_if_free(&self) -> (Option<File>, bool) {
        let lock = File::open(self.state_dir.join("agent.lock")).ok();
        let no_agent = lock.as_ref().is_none_or(|f| rustix::fs::flock(f, rustix::fs::FlockOperation::NonBlockingLockExclusive).is_ok());
        (lock, no_agent)
    }
}

/// The state directory's report, read beside a running agent or without.
pub(crate) fn read_report(dirs: &NodeDirs) -> anyhow::Result<StatusReport> {
    let (_lock, no_agent) = dirs.take_if_free();
    Ok(volring_volumes::status::report(&dirs.pool(), &dirs.state_dir, Some(&dirs.kubelet_root), no_agent)?)
}

/// `volring status`: the report as tables, or as one JSON document.
pub(crate) fn print_status(dirs: &NodeDirs, json: bool) -> anyhow::Result<()> {
    let r = read_report(dirs)?;
    let mut out = std::io::stdout().lock();
    if json {
        serde_json::to_writer_pretty(&mut out, &r)?;
        writeln!(out)?;
        return Ok(());
    }
    write_store_notes(&mut out, &r)?;
    write_volumes(&mut out, &r)?;
    write_staged(&mut out, &r)?;
    write_quarantined(&mut out, &r)?;
    write_repairs(&mut out, &r)?;
    write_problems(&mut out, &r)?;
    Ok(())
}

/// A store that cannot be read, and each rebuild of it from the kernel.
fn write_store_notes(out: &mut impl Write, r: &StatusReport) -> io::Result<()> {
    if let Some(e) = &r.store_error {
        writeln!(
            out,
            "STORE UNREADABLE: {e}\n  the staged volumes below are what the kernel shows; `volring recover` rebuilds the records\n"
        )?;
    }
    for rec in &r.recoveries {
        writeln!(
            out,
            "STORE RECOVERED at {} ({}): {} staged volumes rebuilt from the kernel, {} not provable{}",
            rec.at,
            rec.cause,
            rec.adopted.len(),
            rec.refused.len(),
            rec.set_aside.as_ref().map_or(String::new(), |p| format!("; the damaged store is kept at {}", p.display()))
        )?;
        for what in &rec.refused {
            writeln!(out, "  not rebuilt: {what}")?;
        }
    }
    Ok(())
}

fn write_volumes(out: &mut impl Write, r: &StatusReport) -> io::Result<()> {
    writeln!(out, "VOLUMES ({}) in {}", r.volumes.len(), r.pool_dir.display())?;
    writeln!(out, "{:<40} {:>14} {:>14} {:<5}", "ID", "SIZE", "ALLOCATED", "FS")?;
    for v in &r.volumes {
        let alloc = v.allocated_bytes.map_or("missing".to_string(), |b| b.to_string());
        writeln!(out, "{:<40} {:>14} {:>14} {:<5}", v.id, v.size_bytes, alloc, v.fs_type.as_deref().unwrap_or("-"))?;
    }
    Ok(())
}

fn write_staged(out: &mut impl Write, r: &StatusReport) -> io::Result<()> {
    writeln!(out, "\nSTAGED ({}) in {}", r.staged.len(), r.store.display())?;
    writeln!(out, "{:<40} {:<11} {:<6} {:<14} {:<3} {:<16} STAGING PATH / TARGETS", "ID", "PHASE", "ACCESS", "DEVICE", "RO", "HEALTH")?;
    for s in &r.staged {
        let health = staged_health(s);
        let dev = match (&s.device, s.attached) {
            (Some(d), true) => d.display().to_string(),
            (Some(d), false) => format!("{} (gone)", d.display()),
            (None, _) => "-".to_string(),
        };
        let phase = format!("{:?}{}", s.phase, if s.from_kernel { "*" } else { "" }).to_lowercase();
        let ro = if s.read_only { "ro" } else { "rw" };
        let verdict = health.as_ref().map_or("-".to_string(), verdict);
        writeln!(
            out,
            "{:<40} {:<11} {:<6} {:<14} {:<3} {:<16} {}",
            s.volume_id,
            phase,
            s.access,
            dev,
            ro,
            verdict,
            s.staging_path.display()
        )?;
        for (t, ro) in &s.targets {
            writeln!(out, "{:>97} {}{}", "->", t.display(), if *ro { " (ro)" } else { "" })?;
        }
        for line in health.as_ref().map(health_lines).unwrap_or_default() {
            writeln!(out, "    {line}")?;
        }
    }
    Ok(())
}

/// A staged volume's last verdict, without an `Interrupted` drift the
/// record has since outlived: a verdict that saw a stage mid-way is older
/// than a record that says the stage finished (the reconciler writes a new
/// one when it hears of the mount).
fn staged_health(s: &StagedStatus) -> Option<VolumeHealth> {
    let mut health = s.health.as_ref().and_then(|h| serde_json::from_value::<VolumeHealth>(h.clone()).ok());
    if let Some(h) = health.as_mut().filter(|_| s.phase == volring_volumes::StagePhase::Staged) {
        h.drift.retain(|d| !matches!(d, Drift::Interrupted { .. }));
    }
    health
}

fn write_quarantined(out: &mut impl Write, r: &StatusReport) -> io::Result<()> {
    if !r.quarantined.is_empty() {
        writeln!(out, "\nQUARANTINED ({})", r.quarantined.len())?;
        for q in &r.quarantined {
            writeln!(out, "{}  moved to {}: {}", q.volume_id().unwrap_or(&q.name), q.path.display(), q.reason)?;
        }
    }
    Ok(())
}

fn write_repairs(out: &mut impl Write, r: &StatusReport) -> io::Result<()> {
    if r.repairs.is_empty() {
        return Ok(());
    }
    let shown = r.repairs.len().min(REPAIRS_SHOWN);
    writeln!(out, "\nREPAIRS (last {shown} of {} kept)", r.repairs.len())?;
    writeln!(out, "{:<20} {:<40} {:<14} {:<32} RESULT", "TIME", "VOLUME", "ACTION", "DRIFT")?;
    for e in &r.repairs[r.repairs.len() - shown..] {
        let result = match &e.result {
            RepairResult::Repaired => "repaired".to_string(),
            RepairResult::Failed { error } if e.attempts > 1 => format!("failed ({} times): {error}", e.attempts),
            RepairResult::Failed { error } => format!("failed: {error}"),
        };
        let action = serde_json::to_value(e.action).ok().and_then(|v| v.as_str().map(str::to_string)).unwrap_or_default();
        let kinds = e.drift.iter().map(Drift::kind).collect::<Vec<_>>().join(",");
        writeln!(out, "{:<20} {:<40} {:<14} {kinds:<32} {result}", utc_text(e.at_unix), e.volume, action)?;
    }
    Ok(())
}

fn write_problems(out: &mut impl Write, r: &StatusReport) -> io::Result<()> {
    if !r.problems.is_empty() {
        writeln!(out, "\nPROBLEMS ({})", r.problems.len())?;
        for p in &r.problems {
            writeln!(out, "{}: {}", p.path.display(), p.detail)?;
        }
    }
    Ok(())
}

/// What `recover` found, and the ids it wrote (`None` on a dry run).
struct Recovered {
    store: PathBuf,
    store_missing: bool,
    store_error: Option<String>,
    known: usize,
    found: volring_volumes::recover::Found,
    written: Option<Vec<String>>,
}

/// `volring recover`: what the kernel shows of staged volumes the store
/// has no record of (all of them when it cannot be read), as records; with
/// `apply`, written (a damaged store set aside first). Needs the agent
/// stopped to write.
pub(crate) fn recover(dirs: &NodeDirs, apply: bool, json: bool) -> anyhow::Result<()> {
    let (lock, no_agent) = dirs.take_if_free();
    if apply && !no_agent {
        anyhow::bail!("an agent holds {}: stop it first (a starting agent rebuilds a lost store by itself)", dirs.state_dir.display());
    }
    let rec = find_and_adopt(dirs, apply, no_agent)?;
    drop(lock);
    let mut out = std::io::stdout().lock();
    if json {
        let v = serde_json::json!({
            "store": rec.store, "store_missing": rec.store_missing, "store_error": rec.store_error,
            "adopted": rec.found.adopted, "refused": rec.found.refused, "written": rec.written,
        });
        serde_json::to_writer_pretty(&mut out, &v)?;
        writeln!(out)?;
        return Ok(());
    }
    write_recovered(&mut out, &rec)?;
    Ok(())
}

/// Reads the store (a repair only when `no_agent`), asks the kernel for
/// staged volumes without a record, and with `apply` writes them as
/// records of one recovery.
fn find_and_adopt(dirs: &NodeDirs, apply: bool, no_agent: bool) -> anyhow::Result<Recovered> {
    use volring_volumes::store::{self, Store};
    use volring_volumes::StoreLoss;
    let pool = dirs.pool();
    let path = dirs.state_dir.join(store::FILE);
    let (store_error, known): (Option<String>, Vec<String>) = match Store::read_only(&path, no_agent) {
        Ok(c) => (None, c.volumes.into_iter().map(|(id, _)| id).collect()),
        Err(e) => (Some(e.to_string()), Vec::new()),
    };
    let store_missing = !path.exists();
    let (found, written) = if apply {
        let records = volring_volumes::StagedRecords::open(&dirs.state_dir)?;
        let found = volring_volumes::recover::from_kernel(&pool, &dirs.kubelet_root, &|id| records.contains(id));
        // Nothing found and nothing damaged: nothing to write or say.
        let damaged = matches!(records.loss(), Some(StoreLoss::Damaged { .. }));
        let ids = if found.adopted.is_empty() && found.refused.is_empty() && !damaged { Vec::new() } else { records.adopt(&found)? };
        (found, Some(ids))
    } else {
        (volring_volumes::recover::from_kernel(&pool, &dirs.kubelet_root, &|id| known.iter().any(|k| k == id)), None)
    };
    Ok(Recovered { store: path, store_missing, store_error, known: known.len(), found, written })
}

fn write_recovered(out: &mut impl Write, rec: &Recovered) -> io::Result<()> {
    match (&rec.store_error, rec.store_missing) {
        (Some(e), _) => writeln!(out, "the store cannot be read: {e}")?,
        (None, true) => writeln!(out, "there is no store at {}", rec.store.display())?,
        (None, false) => writeln!(out, "the store holds {} staged records; only volumes without one are looked at", rec.known)?,
    }
    for r in &rec.found.adopted {
        let targets: Vec<String> = r.published.keys().map(|t| t.display().to_string()).collect();
        writeln!(
            out,
            "{} {}: {} {} at {}{}",
            if rec.written.is_some() { "rebuilt" } else { "would rebuild" },
            r.volume_id,
            r.device_name().unwrap_or_default(),
            match &r.access {
                volring_volumes::AccessKind::Block => "block".to_string(),
                volring_volumes::AccessKind::Mount { fs_type, .. } => fs_type.clone(),
            },
            r.staging_path.display(),
            if targets.is_empty() { String::new() } else { format!(", published at {}", targets.join(", ")) }
        )?;
    }
    for r in &rec.found.refused {
        writeln!(out, "not provable, left alone: {r}")?;
    }
    if rec.written.is_none() && !rec.found.adopted.is_empty() {
        writeln!(out, "dry run: nothing written (--apply writes, with the agent stopped)")?;
    }
    Ok(())
}
