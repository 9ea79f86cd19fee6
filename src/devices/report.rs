//! Text renderings for `volring devices` and `volring stats` (pure).

use std::fmt::Write;

use super::inventory::Inventory;
use super::stats::StatSnapshot;

/// A size the way lsblk prints it: `0B`, `512B`, `1K`, `9.8G`.
pub fn human_size(bytes: u64) -> String {
    const UNITS: [&str; 7] = ["B", "K", "M", "G", "T", "P", "E"];
    let mut v = bytes as f64;
    let mut u = 0;
    while v >= 1024.0 && u < UNITS.len() - 1 {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 || (v - v.round()).abs() < 0.05 {
        format!("{}{}", v.round() as u64, UNITS[u])
    } else {
        format!("{v:.1}{}", UNITS[u])
    }
}

/// lsblk-like: one row per device, partitions right under their disk.
pub fn device_table(inv: &Inventory) -> String {
    let mut rows: Vec<[String; 9]> = Vec::new();
    let row = |d: &super::Device, prefix: &str| {
        let mut mounts: Vec<String> = d.mountpoints.iter().map(|p| p.display().to_string()).collect();
        if mounts.is_empty() && d.fstype() == Some("swap") {
            mounts.push("[SWAP?]".into());
        }
        let mut kind = d.kind.as_str().to_string();
        if d.os_disk {
            kind.push('*');
        }
        [
            format!("{prefix}{}", d.name),
            d.dev.to_string(),
            human_size(d.size_bytes),
            kind,
            d.fstype().unwrap_or("").to_string(),
            mounts.join(","),
            d.model.clone().unwrap_or_default(),
            d.serial.clone().unwrap_or_default(),
            d.id.clone(),
        ]
    };
    for d in inv.devices.values().filter(|d| d.partition.as_ref().is_none_or(|(_, p)| inv.by_name(p).is_none())) {
        rows.push(row(d, ""));
        let parts: Vec<_> = inv.devices.values().filter(|p| p.partition.as_ref().is_some_and(|(_, disk)| *disk == d.name)).collect();
        for (i, p) in parts.iter().enumerate() {
            rows.push(row(p, if i + 1 == parts.len() { "└─" } else { "├─" }));
        }
    }
    let header = ["NAME", "MAJ:MIN", "SIZE", "TYPE", "FSTYPE", "MOUNTPOINTS", "MODEL", "SERIAL", "ID"];
    let mut widths: Vec<usize> = header.iter().map(|h| h.len()).collect();
    for r in &rows {
        for (w, c) in widths.iter_mut().zip(r) {
            *w = (*w).max(c.chars().count());
        }
    }
    let mut out = String::new();
    let mut line = |cells: &[&str]| {
        let mut l = String::new();
        for (i, (c, w)) in cells.iter().zip(&widths).enumerate() {
            if i + 1 == cells.len() {
                l.push_str(c);
            } else {
                let _ = write!(l, "{c:<w$} ", w = *w);
            }
        }
        out.push_str(l.trim_end());
        out.push('\n');
    };
    line(&header);
    for r in &rows {
        line(&r.iter().map(String::as_str).collect::<Vec<_>>());
    }
    for (name, e) in &inv.errors {
        let _ = writeln!(out, "# {name}: {e}");
    }
    out
}

/// iostat -x like: one row per device that has rates.
pub fn stats_table(s: &StatSnapshot, only_active: bool) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "# sample {} at {:.3}s, {} devices via {} in {:.2} ms",
        s.generation,
        s.taken_at.as_secs_f64(),
        s.devices.len(),
        s.method,
        s.cost.as_secs_f64() * 1000.0
    );
    let _ = writeln!(
        out,
        "{:<12} {:>9} {:>9} {:>11} {:>11} {:>8} {:>8} {:>6}",
        "Device", "r/s", "w/s", "rkB/s", "wkB/s", "r_await", "w_await", "%util"
    );
    for d in &s.devices {
        let Some(r) = d.rates else { continue };
        if only_active && r.reads_per_sec == 0.0 && r.writes_per_sec == 0.0 && r.util_pct == 0.0 {
            continue;
        }
        let _ = writeln!(
            out,
            "{:<12} {:>9.2} {:>9.2} {:>11.2} {:>11.2} {:>8.2} {:>8.2} {:>6.2}",
            d.name,
            r.reads_per_sec,
            r.writes_per_sec,
            r.read_kib_per_sec,
            r.write_kib_per_sec,
            r.read_await_ms,
            r.write_await_ms,
            r.util_pct
        );
    }
    for (name, e) in &s.errors {
        let _ = writeln!(out, "# {name}: {e}");
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_like_lsblk() {
        assert_eq!(human_size(0), "0B");
        assert_eq!(human_size(512), "512B");
        assert_eq!(human_size(1024), "1K");
        assert_eq!(human_size(64 << 20), "64M");
        assert_eq!(human_size(10_485_760_000), "9.8G");
    }
}
