//! `volring devices` (like lsblk) and `volring stats` (like iostat -x).

use std::io::Write;

use volring_devices::{CollectorConfig, Inventory, ScanConfig, StatCollector};

use super::devices_report as report;
use volring_mounts as mounts;

use super::*;

pub(crate) fn print_devices(
    json: bool,
    columns: &[report::Column],
    cfg: &ScanConfig,
    named: &[String],
    style: report::TableStyle,
) -> anyhow::Result<()> {
    let (table, _) = mounts::load(true)?;
    let mut inv = Inventory::scan(cfg, &table)?;
    // Named devices, as lsblk: those and their partitions.
    if let Some(wanted) = report::select_devices(&inv, named, |p| std::fs::canonicalize(p).ok()).map_err(anyhow::Error::msg)? {
        let disks: std::collections::BTreeSet<String> =
            inv.devices.values().filter(|d| wanted.contains(&d.dev)).map(|d| d.name.clone()).collect();
        inv.devices.retain(|dev, d| wanted.contains(dev) || d.partition.as_ref().is_some_and(|(_, disk)| disks.contains(disk)));
    }
    let swaps = volring_devices::active_swap_devices(std::path::Path::new("/proc/swaps")).unwrap_or_else(|e| {
        tracing::warn!(error = %e, "/proc/swaps not read: active swap is not shown");
        Default::default()
    });
    let mut out = std::io::stdout().lock();
    let written = if json {
        // Each device as the library describes it, plus `swap`: "active"
        // (in /proc/swaps) or "inactive" (only a signature).
        let devices: Vec<serde_json::Value> = inv
            .devices
            .values()
            .map(|d| {
                let mut v = serde_json::to_value(d).unwrap_or_default();
                if let (Some(state), Some(o)) = (report::swap_state(d, &swaps), v.as_object_mut()) {
                    o.insert("swap".into(), state.into());
                }
                v
            })
            .collect();
        serde_json::to_writer_pretty(&mut out, &serde_json::json!({ "blockdevices": devices, "errors": inv.errors }))
            .map_err(std::io::Error::from)
            .and_then(|_| writeln!(out))
    } else {
        out.write_all(report::device_table_with(&inv, columns, &swaps, style).as_bytes())
    };
    written.and_then(|_| out.flush()).map_err(stdout_error)
}

/// Samples until Ctrl-C (or `count`). On a terminal each sample replaces
/// the last; into a pipe or file, samples follow each other.
pub(crate) async fn watch_stats(
    cfg: CollectorConfig,
    count: Option<u64>,
    all: bool,
    json: bool,
    scan: ScanConfig,
    named: &[String],
) -> anyhow::Result<()> {
    use std::io::IsTerminal;
    let (table, _) = mounts::load(true)?;
    let inv = Inventory::scan(&scan, &table)?;
    let wanted = report::select_devices(&inv, named, |p| std::fs::canonicalize(p).ok()).map_err(anyhow::Error::msg)?;
    // Devices asked for by name are shown even when idle, as iostat does.
    let all = all || !named.is_empty();
    let devices = inv
        .devices
        .values()
        .filter(|d| wanted.as_ref().is_none_or(|w| w.contains(&d.dev)))
        .map(|d| (d.dev, std::sync::Arc::from(d.name.as_str())))
        .collect();
    let interval = cfg.interval;
    let (collector, reader) = StatCollector::start(cfg, devices)?;
    let tty = std::io::stdout().is_terminal();
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    let mut tick = tokio::time::interval(interval / 4);
    let (mut last, mut shown) = (0, 0u64);
    let result = loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = tokio::signal::ctrl_c() => break Ok(()),
            _ = term.recv() => break Ok(()),
        }
        let snap = reader.latest();
        // The first sample has no rates yet: wait for the second.
        if snap.generation == last || snap.generation < 2 {
            continue;
        }
        last = snap.generation;
        let mut out = std::io::stdout().lock();
        let written = if json {
            serde_json::to_writer(&mut out, &*snap).map_err(std::io::Error::from).and_then(|_| writeln!(out))
        } else {
            let text = report::stats_table(&snap, !all);
            if tty {
                write!(out, "\x1b[H\x1b[2J{text}")
            } else {
                writeln!(out, "{text}")
            }
        };
        if let Err(e) = written.and_then(|_| out.flush()) {
            break Err(stdout_error(e));
        }
        shown += 1;
        if count.is_some_and(|c| shown >= c) {
            break Ok(());
        }
    };
    collector.stop()?;
    result
}
