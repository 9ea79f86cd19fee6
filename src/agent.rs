//! `volring node`: wires the ring threads to the async side and runs until
//! told to stop.
//!
//! Today the agent watches the mount table and logs what changes; later
//! subsystems (devices, NBD, CSI, the CR updater) hang off the same runtime.

use std::time::Duration;

use crate::mounts::{MountTable, MountWatcher, WatchConfig, WatchEvent};

/// What `volring node` was asked to do.
#[derive(Debug, Clone, Default)]
pub struct AgentConfig {
    pub mounts: WatchConfig,
    /// Log a line per mount event (they are always counted).
    pub log_events: bool,
}

/// Runs the agent until SIGINT or SIGTERM.
pub async fn run(config: AgentConfig) -> anyhow::Result<()> {
    let (watcher, mut table, events) = MountWatcher::start(config.mounts.clone())?;
    tracing::info!(mounts = table.len(), mode = ?watcher.mode(), backend = ?watcher.stats().backend, "watching the mount table");

    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    let mut report = tokio::time::interval(Duration::from_secs(60));
    report.tick().await;
    loop {
        tokio::select! {
            ev = events.recv() => match ev {
                Some(ev) => apply(&mut table, &ev, config.log_events),
                None => anyhow::bail!("mount watcher stopped"),
            },
            _ = report.tick() => {
                let s = watcher.stats();
                tracing::info!(mounts = table.len(), events = s.mount_events, resyncs = s.resyncs, cpu_ms = s.cpu.as_millis() as u64, "mount watcher");
            }
            _ = tokio::signal::ctrl_c() => break,
            _ = term.recv() => break,
        }
    }
    let stats = watcher.stop()?;
    tracing::info!(events = stats.mount_events, resyncs = stats.resyncs, cpu_ms = stats.cpu.as_millis() as u64, "stopped");
    Ok(())
}

fn apply(table: &mut MountTable, ev: &WatchEvent, log: bool) {
    if let WatchEvent::Resync { reason, changes, .. } = ev {
        tracing::warn!(?reason, changes = changes.len(), "mount table resync");
    }
    for e in ev.changes() {
        table.apply(e);
        if log {
            let target = e.subject().map(|m| m.mount_point_path().display().to_string());
            let devices: Vec<_> = e.devices.iter().filter_map(|d| d.path.clone()).collect();
            tracing::info!(kind = ?e.kind, id = e.id, target, ?devices, "mount");
        }
    }
}
