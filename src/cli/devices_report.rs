//! Text renderings for `volring devices` and `volring stats` (pure): the
//! CLI's presentation of what the devices crate reports.

use std::fmt::Write;

use std::collections::BTreeSet;

use volring_devices::TableType;
use volring_devices::{Device, Inventory, IoRates, StatSnapshot};
use volring_mounts::DevNum;

/// A size the way lsblk prints it: `0B`, `512B`, `1K`, `9.8G`.
pub(crate) fn human_size(bytes: u64) -> String {
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

/// A column of `volring devices`, named as lsblk names it (`ID` is
/// volring's stable id, which lsblk does not have).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Column {
    Name,
    Kname,
    Path,
    MajMin,
    Size,
    Type,
    Fstype,
    Label,
    Uuid,
    Pttype,
    Ptuuid,
    Partuuid,
    Mountpoint,
    Mountpoints,
    Ro,
    Rm,
    Rota,
    Model,
    Serial,
    Wwn,
    Vendor,
    Rev,
    LogSec,
    PhySec,
    Pkname,
    Id,
    Fssize,
    Fsused,
    Fsavail,
    Fsuse,
}

/// Every column: its lsblk name and what it shows (for `--help`).
pub(crate) const COLUMNS: [(Column, &str, &str); 30] = [
    (Column::Name, "NAME", "device name, partitions drawn under their disk"),
    (Column::Kname, "KNAME", "kernel name"),
    (Column::Path, "PATH", "path of the device node"),
    (Column::MajMin, "MAJ:MIN", "major:minor device number"),
    (Column::Size, "SIZE", "size, in powers of 1024"),
    (Column::Type, "TYPE", "disk, part, loop, dm, md, nbd, rom; * marks the OS disk"),
    (Column::Fstype, "FSTYPE", "filesystem signature (? when the device could not be read)"),
    (Column::Label, "LABEL", "filesystem label"),
    (Column::Uuid, "UUID", "filesystem UUID"),
    (Column::Pttype, "PTTYPE", "partition table type: gpt, dos"),
    (Column::Ptuuid, "PTUUID", "partition table id"),
    (Column::Partuuid, "PARTUUID", "partition GUID from the disk's GPT"),
    (Column::Mountpoint, "MOUNTPOINT", "first mount point; [SWAP] for active swap"),
    (Column::Mountpoints, "MOUNTPOINTS", "all mount points; [SWAP] for active swap"),
    (Column::Ro, "RO", "read-only device: 1 or 0"),
    (Column::Rm, "RM", "removable device: 1 or 0"),
    (Column::Rota, "ROTA", "rotational device: 1 or 0"),
    (Column::Model, "MODEL", "device model"),
    (Column::Serial, "SERIAL", "device serial number"),
    (Column::Wwn, "WWN", "world wide name"),
    (Column::Vendor, "VENDOR", "device vendor"),
    (Column::Rev, "REV", "firmware revision"),
    (Column::LogSec, "LOG-SEC", "logical sector size"),
    (Column::PhySec, "PHY-SEC", "physical sector size"),
    (Column::Pkname, "PKNAME", "parent (disk) kernel name"),
    (Column::Id, "ID", "volring's stable id (? when it is unknown)"),
    (Column::Fssize, "FSSIZE", "filesystem size, of the first mount point"),
    (Column::Fsused, "FSUSED", "filesystem size used"),
    (Column::Fsavail, "FSAVAIL", "filesystem size available (to unprivileged users, as df's Avail)"),
    (Column::Fsuse, "FSUSE%", "filesystem use percentage"),
];

/// What `volring devices` shows without `-o`: lsblk's default columns
/// and the ones lsblk -f adds, then the hardware and the stable id.
pub(crate) const DEFAULT_COLUMNS: [Column; 14] = [
    Column::Name,
    Column::MajMin,
    Column::Rm,
    Column::Size,
    Column::Ro,
    Column::Type,
    Column::Fstype,
    Column::Label,
    Column::Uuid,
    Column::Pttype,
    Column::Mountpoints,
    Column::Model,
    Column::Serial,
    Column::Id,
];

impl Column {
    pub(crate) fn name(self) -> &'static str {
        COLUMNS.iter().find(|c| c.0 == self).map_or("?", |c| c.1)
    }
}

/// Parses `-o`: `COL,COL` (lsblk names, any case), or `+COL,...` to add
/// to the default columns, as lsblk takes it.
pub(crate) fn parse_columns(spec: &str) -> Result<Vec<Column>, String> {
    let (mut cols, list) = match spec.strip_prefix('+') {
        Some(rest) => (DEFAULT_COLUMNS.to_vec(), rest),
        None => (Vec::new(), spec),
    };
    for word in list.split(',').map(str::trim).filter(|w| !w.is_empty()) {
        let col = COLUMNS.iter().find(|c| c.1.eq_ignore_ascii_case(word)).map(|c| c.0).ok_or_else(|| {
            let names: Vec<&str> = COLUMNS.iter().map(|c| c.1).collect();
            format!("unknown column {word:?}; columns: {}", names.join(","))
        })?;
        cols.push(col);
    }
    if cols.is_empty() {
        return Err("no columns".into());
    }
    Ok(cols)
}

/// A column list as `-o` takes it (see [`parse_columns`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Columns(pub(crate) Vec<Column>);

/// `DEFAULT_COLUMNS`: what `volring devices` shows without `-o`.
impl Default for Columns {
    fn default() -> Self {
        Columns(DEFAULT_COLUMNS.to_vec())
    }
}

impl std::str::FromStr for Columns {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        parse_columns(s).map(Columns)
    }
}

/// The devices `volring stats NAME...` asks for: a kernel name (`vda`),
/// the same under `/dev/`, or any path that `resolve` (canonicalize, at
/// the caller's edge) turns into `/dev/<kernel name>` such as
/// `/dev/mapper/NAME`. `None` when no name was given: all devices.
pub(crate) fn select_devices(
    inv: &Inventory,
    names: &[String],
    resolve: impl Fn(&str) -> Option<std::path::PathBuf>,
) -> Result<Option<BTreeSet<DevNum>>, String> {
    if names.is_empty() {
        return Ok(None);
    }
    let mut out = BTreeSet::new();
    for n in names {
        let bare = n.strip_prefix("/dev/").unwrap_or(n);
        let found = inv.by_name(bare).or_else(|| inv.devices.values().find(|d| d.path.as_os_str() == n.as_str())).or_else(|| {
            let real = resolve(n)?;
            let kname = real.strip_prefix("/dev").ok()?.to_str()?.to_string();
            inv.by_name(&kname)
        });
        match found {
            Some(d) => out.insert(d.dev),
            None => return Err(format!("no block device {n:?} (names as in `volring devices`, with or without /dev/)")),
        };
    }
    Ok(Some(out))
}

/// The `-o` help text: every column and what it shows.
pub(crate) fn columns_help() -> String {
    let mut s = String::from("Columns (lsblk names):\n");
    for (_, name, what) in COLUMNS {
        let _ = writeln!(s, "  {name:<12} {what}");
    }
    s
}

/// Is swap the device is used as right now (`/proc/swaps`), as opposed to
/// a swap signature mkswap left there, which says nothing about use.
pub(crate) fn swap_state(d: &Device, active_swap: &BTreeSet<DevNum>) -> Option<&'static str> {
    if active_swap.contains(&d.dev) {
        Some("active")
    } else if d.fstype() == Some("swap") {
        Some("inactive")
    } else {
        None
    }
}

/// One cell. `?` stands for a value that exists but could not be read.
fn cell(col: Column, d: &Device, inv: &Inventory, active_swap: &BTreeSet<DevNum>, bytes: bool) -> String {
    let unread = d.probe_error.is_some();
    let probed = |v: Option<&str>| match v {
        Some(v) => v.to_string(),
        None if unread => "?".into(),
        None => String::new(),
    };
    let flag = |b: bool| if b { "1" } else { "0" }.to_string();
    let fs = d.content.filesystem.as_ref();
    let table = d.content.table.as_ref();
    let disk = d.partition.as_ref().and_then(|(_, p)| inv.by_name(p));
    let mut mounts: Vec<String> = d.mountpoints.iter().map(|p| p.display().to_string()).collect();
    if active_swap.contains(&d.dev) {
        mounts.push("[SWAP]".into());
    }
    match col {
        Column::Name | Column::Kname => d.name.clone(),
        Column::Path => d.path.display().to_string(),
        Column::MajMin => d.dev.to_string(),
        Column::Size if bytes => d.size_bytes.to_string(),
        Column::Size => human_size(d.size_bytes),
        Column::Type => {
            let mut kind = d.kind.to_string();
            if d.os_disk {
                kind.push('*');
            }
            kind
        }
        Column::Fstype => probed(d.fstype()),
        Column::Label => probed(fs.and_then(|f| f.label.as_deref())),
        Column::Uuid => probed(fs.and_then(|f| f.uuid.as_deref())),
        Column::Pttype => probed(table.map(|t| match t.table {
            TableType::Gpt => "gpt",
            TableType::Mbr => "dos",
        })),
        Column::Ptuuid => probed(table.map(|t| t.id.as_str())),
        Column::Partuuid => match (&d.part_uuid, disk) {
            (Some(u), _) => u.clone(),
            (None, Some(k)) if d.partition.is_some() && k.probe_error.is_some() => "?".into(),
            _ => String::new(),
        },
        Column::Mountpoint => mounts.into_iter().next().unwrap_or_default(),
        Column::Mountpoints => mounts.join(","),
        Column::Ro => flag(d.read_only),
        Column::Rm => flag(d.removable),
        Column::Rota => flag(d.rotational),
        Column::Model => d.model.clone().unwrap_or_default(),
        Column::Serial => d.serial.clone().unwrap_or_default(),
        Column::Wwn => d.wwn.clone().unwrap_or_default(),
        Column::Vendor => d.vendor.clone().unwrap_or_default(),
        Column::Rev => d.firmware.clone().unwrap_or_default(),
        Column::LogSec => d.logical_block_size.to_string(),
        Column::PhySec => d.physical_block_size.to_string(),
        Column::Pkname => d.partition.as_ref().map(|(_, p)| p.clone()).unwrap_or_default(),
        Column::Id if d.id.is_empty() => "?".into(),
        Column::Id => d.id.clone(),
        Column::Fssize | Column::Fsused | Column::Fsavail | Column::Fsuse => fs_space(col, d, bytes),
    }
}

/// The FS* columns, as lsblk computes them: statvfs(2) of the device's
/// first mount point; empty when it is not mounted (or swap).
fn fs_space(col: Column, d: &Device, bytes: bool) -> String {
    let Some(s) = d.mountpoints.first().and_then(|m| rustix::fs::statvfs(m).ok()) else { return String::new() };
    let unit = s.f_frsize;
    let size = s.f_blocks.saturating_mul(unit);
    let free = s.f_bfree.saturating_mul(unit);
    let shown = |b: u64| if bytes { b.to_string() } else { human_size(b) };
    match col {
        Column::Fssize => shown(size),
        Column::Fsused => shown(size - free.min(size)),
        Column::Fsavail => shown(s.f_bavail.saturating_mul(unit)),
        // lsblk: (size - free) / size, rounded to a whole per cent.
        _ if size == 0 => "0%".into(),
        _ => format!("{:.0}%", (size - free.min(size)) as f64 / size as f64 * 100.0),
    }
}

/// lsblk's switches for the table.
#[derive(Clone, Copy, Debug)]
pub(crate) struct TableStyle {
    /// The header line (lsblk -n leaves it out).
    pub(crate) headings: bool,
    /// SIZE in bytes, not in powers of 1024 (lsblk -b).
    pub(crate) bytes: bool,
}

impl Default for TableStyle {
    fn default() -> Self {
        Self { headings: true, bytes: false }
    }
}

/// lsblk-like: one row per device, partitions right under their disk, in
/// the columns asked for. What could not be read follows the table, one
/// `# ` line per device and cause, so a partial answer never passes for a
/// whole one. `active_swap` holds the devices in `/proc/swaps`.
/// `style`: lsblk's `-n` and `-b`.
pub(crate) fn device_table_with(inv: &Inventory, cols: &[Column], active_swap: &BTreeSet<DevNum>, style: TableStyle) -> String {
    let mut rows: Vec<Vec<String>> = Vec::new();
    let row = |d: &Device, prefix: &str| -> Vec<String> {
        cols.iter()
            .map(|&c| {
                let v = cell(c, d, inv, active_swap, style.bytes);
                if c == Column::Name {
                    format!("{prefix}{v}")
                } else {
                    v
                }
            })
            .collect()
    };
    for d in inv.devices.values().filter(|d| d.partition.as_ref().is_none_or(|(_, p)| inv.by_name(p).is_none())) {
        rows.push(row(d, ""));
        let parts: Vec<_> = inv.devices.values().filter(|p| p.partition.as_ref().is_some_and(|(_, disk)| *disk == d.name)).collect();
        for (i, p) in parts.iter().enumerate() {
            rows.push(row(p, if i + 1 == parts.len() { "└─" } else { "├─" }));
        }
    }
    let header: Vec<&str> = cols.iter().map(|c| c.name()).collect();
    let mut widths: Vec<usize> = header.iter().map(|h| if style.headings { h.len() } else { 0 }).collect();
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
    if style.headings {
        line(&header);
    }
    for r in &rows {
        line(&r.iter().map(String::as_str).collect::<Vec<_>>());
    }
    out.push_str(&unread_notes(inv));
    out
}

/// One `# NAME: ...` line per thing the scan could not read: devices it
/// could not list, first blocks it could not read, attributes, unknown ids.
pub(crate) fn unread_notes(inv: &Inventory) -> String {
    let mut out = String::new();
    for (name, e) in &inv.errors {
        let _ = writeln!(out, "# {name}: not listed: {e}");
    }
    for d in inv.devices.values() {
        if let Some(e) = &d.probe_error {
            let _ = writeln!(out, "# {}: FSTYPE, LABEL, UUID, PTTYPE unknown: {e}", d.name);
        }
        for e in &d.attr_errors {
            let _ = writeln!(out, "# {}: attribute {e}", d.name);
        }
        if d.id.is_empty() {
            let why = inv.id_unknown(d).unwrap_or_else(|| "not computed".into());
            let _ = writeln!(out, "# {}: ID unknown: {why}", d.name);
        }
    }
    out
}

/// A wall-clock time as ISO 8601 UTC with milliseconds, the way a sample
/// is stamped (`iostat -t` prints local time; UTC sorts and compares).
pub(crate) fn utc_timestamp(unix_secs: f64) -> String {
    let ms = (unix_secs.max(0.0) * 1000.0).round() as u64;
    // The store's date (one days-to-civil in the tree), "YYYY-MM-DD HH:MM:SSZ",
    // with the milliseconds put in and ISO 8601's `T`.
    let text = volring_volumes::store::utc_text(ms / 1000);
    let (date, time) = text.split_once(' ').unwrap_or((&text, "00:00:00Z"));
    format!("{date}T{}.{:03}Z", time.trim_end_matches('Z'), ms % 1000)
}

/// The iostat -x columns `volring stats` prints, in iostat's order.
pub(crate) const STAT_COLUMNS: [&str; 22] = [
    "r/s", "rkB/s", "rrqm/s", "%rrqm", "r_await", "rareq-sz", "w/s", "wkB/s", "wrqm/s", "%wrqm", "w_await", "wareq-sz", "d/s", "dkB/s",
    "drqm/s", "%drqm", "d_await", "dareq-sz", "f/s", "f_await", "aqu-sz", "%util",
];

fn stat_values(r: &IoRates) -> [f64; 22] {
    [
        r.reads_per_sec,
        r.read_kib_per_sec,
        r.reads_merged_per_sec,
        r.reads_merged_pct,
        r.read_await_ms,
        r.read_req_kib,
        r.writes_per_sec,
        r.write_kib_per_sec,
        r.writes_merged_per_sec,
        r.writes_merged_pct,
        r.write_await_ms,
        r.write_req_kib,
        r.discards_per_sec,
        r.discard_kib_per_sec,
        r.discards_merged_per_sec,
        r.discards_merged_pct,
        r.discard_await_ms,
        r.discard_req_kib,
        r.flushes_per_sec,
        r.flush_await_ms,
        r.queue_size,
        r.util_pct,
    ]
}

/// iostat -x -t like: a timestamp line, then one row per device that has
/// rates, in iostat's column order and names. Idle devices are left out
/// when `only_active` (iostat -z).
pub(crate) fn stats_table(s: &StatSnapshot, only_active: bool) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "{}  sample {}, {} devices via {} in {:.2} ms",
        utc_timestamp(s.unix_time),
        s.generation,
        s.devices.len(),
        s.method,
        s.cost.as_secs_f64() * 1000.0
    );
    let width = s.devices.iter().map(|d| d.name.len()).max().unwrap_or(0).max(12);
    let _ = write!(out, "{:<width$}", "Device");
    for c in STAT_COLUMNS {
        let _ = write!(out, " {c:>9}");
    }
    out.push('\n');
    for d in &s.devices {
        let Some(r) = d.rates else { continue };
        let v = stat_values(&r);
        if only_active && v.iter().all(|x| *x == 0.0) {
            continue;
        }
        let _ = write!(out, "{:<width$}", d.name);
        for x in v {
            let _ = write!(out, " {x:>9.2}");
        }
        out.push('\n');
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

    #[test]
    fn columns_by_lsblk_name_and_plus_adds_to_the_default() {
        assert_eq!(parse_columns("name,maj:min,RO").unwrap(), [Column::Name, Column::MajMin, Column::Ro]);
        let plus = parse_columns("+WWN").unwrap();
        assert_eq!(plus.len(), DEFAULT_COLUMNS.len() + 1);
        assert_eq!(plus.last(), Some(&Column::Wwn));
        assert!(parse_columns("NAME,BOGUS").unwrap_err().contains("BOGUS"));
        assert!(parse_columns("").is_err());
        for (c, name, _) in COLUMNS {
            assert_eq!(parse_columns(name).unwrap(), [c]);
        }
    }

    #[test]
    fn timestamps_in_utc() {
        assert_eq!(utc_timestamp(0.0), "1970-01-01T00:00:00.000Z");
        assert_eq!(utc_timestamp(951_782_400.5), "2000-02-29T00:00:00.500Z");
        assert_eq!(utc_timestamp(1_795_478_399.999), "2026-11-23T23:59:59.999Z");
    }
}
