//! `volring mounts` as people read it: findmnt's columns (`-o`), its tree,
//! its `--raw` list, `--target`/`--source` filters, and watch events as
//! text lines. Pure rendering of a table already read: the CLI's
//! presentation of what the mounts crate reports.

use std::collections::BTreeMap;
use std::sync::Arc;

use volring_mounts::{EventKind, Mount, MountEvent, MountTable, WatchEvent};

/// A column, by findmnt's name for it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Column {
    Target,
    Source,
    FsType,
    Options,
    VfsOptions,
    FsOptions,
    Id,
    Parent,
    MajMin,
    FsRoot,
    Propagation,
}

/// The columns `volring mounts` shows unless told otherwise.
pub(crate) const DEFAULT_COLUMNS: [Column; 4] = [Column::Target, Column::Source, Column::FsType, Column::Options];

impl Column {
    const ALL: [(Column, &'static str); 11] = [
        (Column::Target, "TARGET"),
        (Column::Source, "SOURCE"),
        (Column::FsType, "FSTYPE"),
        (Column::Options, "OPTIONS"),
        (Column::VfsOptions, "VFS-OPTIONS"),
        (Column::FsOptions, "FS-OPTIONS"),
        (Column::Id, "ID"),
        (Column::Parent, "PARENT"),
        (Column::MajMin, "MAJ:MIN"),
        (Column::FsRoot, "FSROOT"),
        (Column::Propagation, "PROPAGATION"),
    ];

    pub(crate) fn name(self) -> &'static str {
        Self::ALL.iter().find(|(c, _)| *c == self).map_or("", |(_, n)| n)
    }

    /// The columns `-o` names (`TARGET,SOURCE`, any case); without `-o`,
    /// the default ones (`DEFAULT_COLUMNS`).
    pub(crate) fn parse_list(spec: Option<&str>) -> Result<Vec<Column>, String> {
        let Some(s) = spec else { return Ok(DEFAULT_COLUMNS.to_vec()) };
        s.split(',')
            .filter(|c| !c.is_empty())
            .map(|c| {
                Self::ALL.iter().find(|(_, n)| n.eq_ignore_ascii_case(c.trim())).map(|(col, _)| *col).ok_or_else(|| {
                    format!("unknown column {c:?}; known: {}", Self::ALL.iter().map(|(_, n)| *n).collect::<Vec<_>>().join(","))
                })
            })
            .collect()
    }

    fn value(self, m: &Mount, out: &mut String) {
        match self {
            Column::Target => escape_raw(m.mount_point(), out),
            Column::Source => escape_raw(m.source(), out),
            Column::FsType => escape_raw(m.fs_type(), out),
            Column::Options => escape_raw(merged_options(m).as_bytes(), out),
            Column::VfsOptions => escape_raw(m.options(), out),
            Column::FsOptions => escape_raw(m.super_options(), out),
            Column::Id => out.push_str(&m.id.to_string()),
            Column::Parent => out.push_str(&m.parent.to_string()),
            Column::MajMin => out.push_str(&format!("{}:{}", m.dev.major, m.dev.minor)),
            Column::FsRoot => escape_raw(m.root(), out),
            Column::Propagation => out.push_str(&m.propagation.to_string()),
        }
    }
}

/// Which mounts to show.
#[derive(Debug, Default, Clone)]
pub(crate) struct Filter {
    /// The mount a path is on (the top mount at the deepest mount point that
    /// contains it), like `findmnt --target`.
    pub(crate) target: Option<Vec<u8>>,
    /// Mounts of this source.
    pub(crate) source: Option<Vec<u8>>,
}

impl Filter {
    fn is_empty(&self) -> bool {
        self.target.is_none() && self.source.is_none()
    }

    /// The mounts of `table` this filter keeps, in mount-point order.
    pub(crate) fn select<'a>(&self, table: &'a MountTable) -> Vec<&'a Arc<Mount>> {
        let target = self.target.as_deref().and_then(|t| holding(table, t));
        sorted(table)
            .into_iter()
            .filter(|m| self.target.is_none() || target == Some(m.id))
            .filter(|m| self.source.as_deref().is_none_or(|s| m.source() == s))
            .collect()
    }
}

/// The top mount at the deepest mount point that contains `path`.
fn holding(table: &MountTable, path: &[u8]) -> Option<u64> {
    let mut p = path.strip_suffix(b"/").filter(|p| !p.is_empty()).unwrap_or(path);
    loop {
        if let Some(m) = table.top_at(p) {
            return Some(m.id);
        }
        let cut = p.iter().rposition(|&b| b == b'/')?;
        p = if cut == 0 { b"/" } else { &p[..cut] };
    }
}

/// How the rows are laid out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Layout {
    /// One line per mount, fields separated by one space, escaped (like
    /// `findmnt --raw`), with a header line.
    Raw,
    /// Aligned columns, the target drawn as a tree of parents and children
    /// (plain `findmnt`).
    Tree,
    /// Aligned columns, no tree (`findmnt --list`).
    List,
}

/// Renders `rows` (from `table`) with `columns`.
pub(crate) fn render(rows: &[&Arc<Mount>], columns: &[Column], layout: Layout, filter: &Filter) -> String {
    let cell = |m: &Mount, c: Column| {
        let mut s = String::new();
        c.value(m, &mut s);
        s
    };
    let mut lines: Vec<Vec<String>> = Vec::with_capacity(rows.len() + 1);
    lines.push(columns.iter().map(|c| c.name().to_string()).collect());
    if layout == Layout::Tree && filter.is_empty() {
        let by_id: BTreeMap<_, _> = rows.iter().map(|m| (m.id, *m)).collect();
        let mut children: BTreeMap<_, Vec<&Arc<Mount>>> = BTreeMap::new();
        let mut roots = Vec::new();
        for m in rows {
            match by_id.contains_key(&m.parent) && m.parent != m.id {
                true => children.entry(m.parent).or_default().push(m),
                false => roots.push(*m),
            }
        }
        // Depth-first, bounded by the number of rows (a cycle cannot loop).
        let mut stack: Vec<(&Arc<Mount>, String, bool)> = roots.iter().rev().map(|m| (*m, String::new(), true)).collect();
        let mut budget = rows.len();
        while let Some((m, prefix, last)) = stack.pop() {
            if budget == 0 {
                break;
            }
            budget -= 1;
            let depth_mark = if prefix.is_empty() && roots.iter().any(|r| r.id == m.id) {
                ""
            } else if last {
                "└─"
            } else {
                "├─"
            };
            let line = columns
                .iter()
                .map(|&c| if c == Column::Target { format!("{prefix}{depth_mark}{}", cell(m, c)) } else { cell(m, c) })
                .collect();
            lines.push(line);
            let kids = children.get(&m.id).map(Vec::as_slice).unwrap_or(&[]);
            let child_prefix = if depth_mark.is_empty() { prefix.clone() } else { format!("{prefix}{}", if last { "  " } else { "│ " }) };
            for (i, k) in kids.iter().enumerate().rev() {
                stack.push((k, child_prefix.clone(), i + 1 == kids.len()));
            }
        }
    } else {
        lines.extend(rows.iter().map(|m| columns.iter().map(|&c| cell(m, c)).collect()));
    }
    let mut out = String::new();
    match layout {
        Layout::Raw => {
            for l in &lines {
                out.push_str(&l.join(" "));
                out.push('\n');
            }
        }
        Layout::Tree | Layout::List => {
            let mut widths = vec![0usize; columns.len()];
            for l in &lines {
                for (w, c) in widths.iter_mut().zip(l) {
                    *w = (*w).max(c.chars().count());
                }
            }
            for l in &lines {
                let mut s = String::new();
                for (i, (c, w)) in l.iter().zip(&widths).enumerate() {
                    s.push_str(c);
                    if i + 1 < l.len() {
                        s.push_str(&" ".repeat(w - c.chars().count() + 1));
                    }
                }
                out.push_str(s.trim_end());
                out.push('\n');
            }
        }
    }
    out
}

/// A watch event as one or more text lines (a resync gives one per change
/// after its own): `attached /mnt/a tmpfs tmpfs`, `changed /mnt/a
/// options,propagation`, `moved /mnt/a -> /mnt/b`.
pub(crate) fn event_lines(ev: &WatchEvent, stamp: &str, out: &mut String) {
    match ev {
        WatchEvent::Mount(e) => event_line(e, stamp, out),
        WatchEvent::Resync { reason, changes, .. } => {
            out.push_str(&format!("{stamp} resync ({reason:?}): {} changes\n", changes.len()));
            for e in changes {
                event_line(e, stamp, out);
            }
        }
    }
}

fn event_line(e: &MountEvent, stamp: &str, out: &mut String) {
    let kind = match e.kind {
        EventKind::Attached => "attached",
        EventKind::Detached => "detached",
        EventKind::Moved => "moved",
        EventKind::Changed => "changed",
    };
    out.push_str(stamp);
    out.push(' ');
    out.push_str(kind);
    out.push(' ');
    match (e.kind, e.previous.as_ref(), e.subject()) {
        (EventKind::Moved, Some(old), Some(new)) => {
            escape_raw(old.mount_point(), out);
            out.push_str(" -> ");
            escape_raw(new.mount_point(), out);
        }
        (_, _, Some(m)) => {
            escape_raw(m.mount_point(), out);
            out.push(' ');
            escape_raw(m.source(), out);
            out.push(' ');
            escape_raw(m.fs_type(), out);
        }
        (_, _, None) => out.push_str(&format!("(mount {} gone before it was read)", e.id)),
    }
    if e.kind == EventKind::Changed {
        let names: Vec<String> = e.changes.iter_names().map(|(n, _)| n.to_ascii_lowercase()).collect();
        out.push(' ');
        out.push_str(&names.join(","));
    }
    out.push('\n');
}

/// All mounts of `table` in id order (stable output for people and tests).
pub(crate) fn sorted(table: &MountTable) -> Vec<&Arc<Mount>> {
    let mut v: Vec<_> = table.iter().collect();
    v.sort_unstable_by_key(|m| m.id);
    v
}

/// Options as findmnt shows them: per-mount, then the superblock's
/// (without its leading ro/rw, which the per-mount flag already says).
fn merged_options(m: &Mount) -> String {
    let mut s = String::from_utf8_lossy(m.options()).into_owned();
    let sup = m.super_options();
    let rest = sup.splitn(2, |&b| b == b',').nth(1).unwrap_or(&[]);
    if !rest.is_empty() {
        s.push(',');
        s.push_str(&String::from_utf8_lossy(rest));
    }
    s
}

/// Escapes what would break a space-separated line, as `findmnt --raw`
/// does (`\x20` for a space), for the raw table.
fn escape_raw(raw: &[u8], out: &mut String) {
    use std::fmt::Write;
    for &b in raw {
        if b.is_ascii_graphic() && b != b'\\' {
            out.push(b as char);
        } else {
            let _ = write!(out, "\\x{b:02x}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const INFO: &[u8] = b"1 0 0:1 / / rw - rootfs rootfs rw
2 1 7:0 / /data rw,noatime shared:3 - ext4 /dev/loop0 rw
3 2 0:30 / /data/with\\040space rw - tmpfs tmpfs rw
4 1 7:1 / /srv rw - xfs /dev/loop1 rw
";

    fn table() -> MountTable {
        MountTable::from_mountinfo(INFO).0
    }

    #[test]
    fn the_tree_nests_children_under_their_parents() {
        let t = table();
        let rows = sorted(&t);
        let out = render(&rows, &[Column::Target, Column::FsType], Layout::Tree, &Filter::default());
        let want = "TARGET               FSTYPE
/                    rootfs
├─/data              ext4
│ └─/data/with\\x20space tmpfs
└─/srv               xfs
";
        // Widths come from the widest cell; compare the structure line by line.
        let got: Vec<Vec<&str>> = out.lines().map(|l| l.split_whitespace().collect()).collect();
        let exp: Vec<Vec<&str>> = want.lines().map(|l| l.split_whitespace().collect()).collect();
        assert_eq!(got, exp, "{out}");
    }

    #[test]
    fn raw_is_one_escaped_line_per_mount_and_columns_are_chosen() {
        let t = table();
        let cols = Column::parse_list(Some("target,maj:min,propagation")).unwrap();
        let out = render(&sorted(&t), &cols, Layout::Raw, &Filter::default());
        assert_eq!(out.lines().next(), Some("TARGET MAJ:MIN PROPAGATION"));
        assert!(out.contains("/data 7:0 shared:3\n"), "{out}");
        assert!(out.contains("/data/with\\x20space 0:30 \n"), "{out}");
        assert!(Column::parse_list(Some("TARGET,NOPE")).unwrap_err().contains("NOPE"));
    }

    #[test]
    fn target_finds_the_mount_a_path_is_on_and_source_filters() {
        let t = table();
        let f = Filter { target: Some(b"/data/with space/deep/file".to_vec()), source: None };
        let rows = f.select(&t);
        assert_eq!(rows.iter().map(|m| m.mount_point()).collect::<Vec<_>>(), vec![&b"/data/with space"[..]]);
        let f = Filter { target: Some(b"/elsewhere".to_vec()), source: None };
        assert_eq!(f.select(&t).iter().map(|m| m.mount_point()).collect::<Vec<_>>(), vec![&b"/"[..]]);
        let f = Filter { target: None, source: Some(b"/dev/loop1".to_vec()) };
        assert_eq!(f.select(&t).iter().map(|m| m.mount_point()).collect::<Vec<_>>(), vec![&b"/srv"[..]]);
    }

    #[test]
    fn watch_events_read_as_text() {
        // The /srv mount of `table()`, attached to an empty table.
        let srv = MountTable::from_mountinfo(b"4 1 7:1 / /srv rw - xfs /dev/loop1 rw\n").0;
        let [attached] = <[MountEvent; 1]>::try_from(volring_mounts::diff(&MountTable::default(), &srv)).unwrap();
        let mut out = String::new();
        event_lines(&WatchEvent::Mount(attached), "12:00:00.000", &mut out);
        assert_eq!(out, "12:00:00.000 attached /srv /dev/loop1 xfs\n");
    }

    #[test]
    fn raw_escape_is_findmnt_style() {
        let mut s = String::new();
        escape_raw(b"/a b\\c\n\xff", &mut s);
        assert_eq!(s, r"/a\x20b\x5cc\x0a\xff");
    }

    #[test]
    fn options_merge_the_superblock_s_after_the_mount_s() {
        let t = MountTable::from_mountinfo(b"102 36 0:55 / /tmp/x rw - fuse.sshfs user@host:/a\\134b rw,user_id=0\n").0;
        let f = t.iter().next().unwrap();
        assert_eq!(f.fs_type(), b"fuse.sshfs");
        assert_eq!(merged_options(f), "rw,user_id=0");
    }
}
