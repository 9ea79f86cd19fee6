//! `volring status`: what the node's state directory holds.

pub(crate) fn print_status(pool: &std::path::Path, state_dir: &std::path::Path, json: bool) -> anyhow::Result<()> {
    use std::io::Write;
    // Holding the agent's lock while reading means no agent runs, so a store
    // a crash left unrepaired may be repaired; beside a running agent the
    // store is only read.
    let lock = std::fs::File::open(state_dir.join("agent.lock")).ok();
    let no_agent = lock.as_ref().is_none_or(|f| rustix::fs::flock(f, rustix::fs::FlockOperation::NonBlockingLockExclusive).is_ok());
    let r = volring_volumes::status::report(pool, state_dir, no_agent)?;
    drop(lock);
    let mut out = std::io::stdout().lock();
    if json {
        serde_json::to_writer_pretty(&mut out, &r)?;
        writeln!(out)?;
        return Ok(());
    }
    writeln!(out, "VOLUMES ({}) in {}", r.volumes.len(), r.pool_dir.display())?;
    writeln!(out, "{:<40} {:>14} {:>14} {:<5}", "ID", "SIZE", "ALLOCATED", "FS")?;
    for v in &r.volumes {
        let alloc = v.allocated_bytes.map_or("missing".to_string(), |b| b.to_string());
        writeln!(out, "{:<40} {:>14} {:>14} {:<5}", v.id, v.size_bytes, alloc, v.fs_type.as_deref().unwrap_or("-"))?;
    }
    writeln!(out, "\nSTAGED ({}) in {}", r.staged.len(), r.store.display())?;
    writeln!(out, "{:<40} {:<11} {:<6} {:<14} {:<3} STAGING PATH / TARGETS", "ID", "PHASE", "ACCESS", "DEVICE", "RO")?;
    for s in &r.staged {
        let dev = match (&s.device, s.attached) {
            (Some(d), true) => d.display().to_string(),
            (Some(d), false) => format!("{} (gone)", d.display()),
            (None, _) => "-".to_string(),
        };
        let phase = format!("{:?}", s.phase).to_lowercase();
        let ro = if s.read_only { "ro" } else { "rw" };
        writeln!(out, "{:<40} {:<11} {:<6} {:<14} {:<3} {}", s.volume_id, phase, s.access, dev, ro, s.staging_path.display())?;
        for (t, ro) in &s.targets {
            writeln!(out, "{:>80} {}{}", "->", t.display(), if *ro { " (ro)" } else { "" })?;
        }
    }
    if !r.quarantined.is_empty() {
        writeln!(out, "\nQUARANTINED ({})", r.quarantined.len())?;
        for q in &r.quarantined {
            writeln!(out, "{}", serde_json::to_string(q)?)?;
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
