//! `volring status`: what the node's state directory holds.

use volring_volumes::state::actual::VolumeHealth;
use volring_volumes::state::history::RepairResult;
use volring_volumes::store::utc_text;

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
            volring_volumes::state::actual::Drift::TargetMissing { path }
            | volring_volumes::state::actual::Drift::TargetForeign { path } => {
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
        lines.push(format!("last repair {}: {}", utc_text(r.at_unix), r.describe()));
    }
    lines
}

/// The state directory's report, read beside a running agent or without.
pub(crate) fn read_report(
    pool: &std::path::Path,
    state_dir: &std::path::Path,
    kubelet_root: &std::path::Path,
) -> anyhow::Result<volring_volumes::status::StatusReport> {
    // Holding the agent's lock while reading means no agent runs, so a store
    // a crash left unrepaired may be repaired; beside a running agent the
    // store is only read.
    let lock = std::fs::File::open(state_dir.join("agent.lock")).ok();
    let no_agent = lock.as_ref().is_none_or(|f| rustix::fs::flock(f, rustix::fs::FlockOperation::NonBlockingLockExclusive).is_ok());
    Ok(volring_volumes::status::report(pool, state_dir, Some(kubelet_root), no_agent)?)
}

pub(crate) fn print_status(
    pool: &std::path::Path,
    state_dir: &std::path::Path,
    kubelet_root: &std::path::Path,
    json: bool,
) -> anyhow::Result<()> {
    use std::io::Write;
    let r = read_report(pool, state_dir, kubelet_root)?;
    let mut out = std::io::stdout().lock();
    if json {
        serde_json::to_writer_pretty(&mut out, &r)?;
        writeln!(out)?;
        return Ok(());
    }
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
    writeln!(out, "VOLUMES ({}) in {}", r.volumes.len(), r.pool_dir.display())?;
    writeln!(out, "{:<40} {:>14} {:>14} {:<5}", "ID", "SIZE", "ALLOCATED", "FS")?;
    for v in &r.volumes {
        let alloc = v.allocated_bytes.map_or("missing".to_string(), |b| b.to_string());
        writeln!(out, "{:<40} {:>14} {:>14} {:<5}", v.id, v.size_bytes, alloc, v.fs_type.as_deref().unwrap_or("-"))?;
    }
    writeln!(out, "\nSTAGED ({}) in {}", r.staged.len(), r.store.display())?;
    writeln!(out, "{:<40} {:<11} {:<6} {:<14} {:<3} {:<16} STAGING PATH / TARGETS", "ID", "PHASE", "ACCESS", "DEVICE", "RO", "HEALTH")?;
    for s in &r.staged {
        let mut health = s.health.as_ref().and_then(|h| serde_json::from_value::<VolumeHealth>(h.clone()).ok());
        // A verdict that saw a stage mid-way is older than a record that
        // says the stage finished (the reconciler writes a new one when it
        // hears of the mount).
        if let Some(h) = health.as_mut().filter(|_| s.phase == volring_volumes::StagePhase::Staged) {
            h.drift.retain(|d| !matches!(d, volring_volumes::state::actual::Drift::Interrupted { .. }));
        }
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
        if let Some(h) = &health {
            for line in health_lines(h) {
                writeln!(out, "    {line}")?;
            }
        }
    }
    if !r.quarantined.is_empty() {
        writeln!(out, "\nQUARANTINED ({})", r.quarantined.len())?;
        for q in &r.quarantined {
            writeln!(out, "{}  moved to {}: {}", q.volume_id().unwrap_or(&q.name), q.path.display(), q.reason)?;
        }
    }
    if !r.repairs.is_empty() {
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
            writeln!(out, "{:<20} {:<40} {:<14} {:<32} {result}", utc_text(e.at_unix), e.volume, action, e.kinds())?;
        }
    }
    if !r.problems.is_empty() {
        writeln!(out, "\nPROBLEMS ({})", r.problems.len())?;
        for p in &r.problems {
            writeln!(out, "{}: {}", p.path.display(), p.detail)?;
        }
    }
    Ok(())
}

/// `volring recover`: what the kernel shows of staged volumes the store
/// has no record of (all of them when it cannot be read), as records; with
/// `apply`, written (a damaged store set aside first). Needs the agent
/// stopped to write.
pub(crate) fn recover(
    pool: &std::path::Path,
    state_dir: &std::path::Path,
    kubelet_root: &std::path::Path,
    apply: bool,
    json: bool,
) -> anyhow::Result<()> {
    use std::io::Write;
    use volring_volumes::store::{self, Store};
    let lock = std::fs::File::open(state_dir.join("agent.lock")).ok();
    let no_agent = lock.as_ref().is_none_or(|f| rustix::fs::flock(f, rustix::fs::FlockOperation::NonBlockingLockExclusive).is_ok());
    if apply && !no_agent {
        anyhow::bail!("an agent holds {}: stop it first (a starting agent rebuilds a lost store by itself)", state_dir.display());
    }
    let path = state_dir.join(store::FILE);
    let (store_error, known): (Option<String>, Vec<String>) = match Store::read_only(&path, no_agent) {
        Ok(c) => (None, c.volumes.into_iter().map(|(id, _)| id).collect()),
        Err(e) => (Some(e.to_string()), Vec::new()),
    };
    let missing = !path.exists();
    let mut out = std::io::stdout().lock();
    let (found, written) = if apply {
        let records = volring_volumes::StagedRecords::open(state_dir)?;
        let found = volring_volumes::recover::from_kernel(pool, kubelet_root, &|id| records.contains(id));
        let recovery = store::Recovery {
            at: store::timestamp(),
            cause: records.loss().map_or("operator: volring recover --apply".into(), |l| l.cause()),
            set_aside: match records.loss() {
                Some(volring_volumes::staged::StoreLoss::Damaged { set_aside, .. }) => Some(set_aside.clone()),
                _ => None,
            },
            adopted: found.adopted.iter().map(|r| r.volume_id.clone()).collect(),
            refused: found.refused.clone(),
        };
        // Nothing found and nothing damaged: nothing to write or say.
        let damaged = matches!(records.loss(), Some(volring_volumes::staged::StoreLoss::Damaged { .. }));
        let ids = if found.adopted.is_empty() && found.refused.is_empty() && !damaged {
            Vec::new()
        } else {
            records.adopt(&found.adopted, &recovery)?
        };
        (found, Some(ids))
    } else {
        (volring_volumes::recover::from_kernel(pool, kubelet_root, &|id| known.iter().any(|k| k == id)), None)
    };
    drop(lock);
    if json {
        let v = serde_json::json!({
            "store": path, "store_missing": missing, "store_error": store_error,
            "adopted": found.adopted, "refused": found.refused, "written": written,
        });
        serde_json::to_writer_pretty(&mut out, &v)?;
        writeln!(out)?;
        return Ok(());
    }
    match (&store_error, missing) {
        (Some(e), _) => writeln!(out, "the store cannot be read: {e}")?,
        (None, true) => writeln!(out, "there is no store at {}", path.display())?,
        (None, false) => writeln!(out, "the store holds {} staged records; only volumes without one are looked at", known.len())?,
    }
    for r in &found.adopted {
        let targets: Vec<String> = r.published.keys().map(|t| t.display().to_string()).collect();
        writeln!(
            out,
            "{} {}: {} {} at {}{}",
            if written.is_some() { "rebuilt" } else { "would rebuild" },
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
    for r in &found.refused {
        writeln!(out, "not provable, left alone: {r}")?;
    }
    if written.is_none() && !found.adopted.is_empty() {
        writeln!(out, "dry run: nothing written (--apply writes, with the agent stopped)")?;
    }
    Ok(())
}
