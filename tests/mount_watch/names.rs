//! Names holding every byte mountinfo escapes: both strategies build the
//! same table of them.

use super::*;

/// Every byte mountinfo escapes (space, tab, newline, backslash), the literal
/// text `\040`, and a byte that is not UTF-8.
const ODD: &[u8] = b" sp\ttab\nnl\\bs\\040lit\xff";

fn odd_path(dir: &std::path::Path, prefix: &str) -> std::path::PathBuf {
    use std::os::unix::ffi::OsStrExt;
    let mut name = prefix.as_bytes().to_vec();
    name.extend_from_slice(ODD);
    dir.join(std::ffi::OsStr::from_bytes(&name))
}

/// Makes mounts whose mount points, roots, sources, fs types and superblock
/// options hold `ODD`; returns the mount points made.
fn odd_mounts(s: &Scratch, tag: &str) -> Result<Vec<std::path::PathBuf>, Failed> {
    use std::os::unix::ffi::OsStrExt;
    let mut made = Vec::new();
    // A tmpfs at an odd mount point, with an odd source.
    let point = odd_path(s.path(), &format!("{tag}-point"));
    std::fs::create_dir(&point)?;
    let mut source = b"src".to_vec();
    source.extend_from_slice(ODD);
    rustix::mount::mount(std::ffi::OsStr::from_bytes(&source), &point, "tmpfs", MountFlags::empty(), Some(c"size=1m"))?;
    made.push(point.clone());
    // Its odd subdirectory bound elsewhere: an odd root, at a plain and at an odd target.
    let sub = odd_path(&point, "sub");
    std::fs::create_dir(&sub)?;
    for target in [s.dir(&format!("{tag}-plain-bind")), odd_path(s.path(), &format!("{tag}-bind"))] {
        std::fs::create_dir_all(&target)?;
        mount_bind(&sub, &target)?;
        made.push(target);
    }
    // An overlay whose directories (in its options, escaped by the kernel)
    // hold every odd byte overlayfs accepts there (no backslash: it is
    // overlayfs's own escape character in lowerdir).
    let odd_no_bs: Vec<u8> = ODD.iter().copied().filter(|&b| b != b'\\').collect();
    let layer = |name: &str| {
        let mut n = format!("{tag}-{name}").into_bytes();
        n.extend_from_slice(&odd_no_bs);
        s.path().join(std::ffi::OsStr::from_bytes(&n))
    };
    let (lower, upper, work, ov) = (layer("lower"), layer("upper"), layer("work"), layer("ov"));
    for d in [&lower, &upper, &work, &ov] {
        std::fs::create_dir(d)?;
    }
    let mut opts = b"lowerdir=".to_vec();
    for (i, (key, dir)) in [("", &lower), (",upperdir=", &upper), (",workdir=", &work)].into_iter().enumerate() {
        if i > 0 {
            opts.extend_from_slice(key.as_bytes());
        }
        opts.extend_from_slice(bytes(dir));
    }
    let opts = std::ffi::CString::new(opts)?;
    rustix::mount::mount("overlay", &ov, "overlay", MountFlags::empty(), Some(opts.as_c_str()))?;
    made.push(ov);
    // FUSE with an odd subtype and source. The connection is closed at once
    // (aborted), so nothing that touches the mount can hang on a daemon.
    let fuse_point = s.dir(&format!("{tag}-fuse"));
    let fuse = std::fs::OpenOptions::new().read(true).write(true).open("/dev/fuse")?;
    let mut fs_type = b"fuse.sub".to_vec();
    fs_type.extend_from_slice(ODD);
    let data = std::ffi::CString::new(format!("fd={},rootmode=40000,user_id=0,group_id=0", std::os::fd::AsRawFd::as_raw_fd(&fuse)))?;
    rustix::mount::mount(
        std::ffi::OsStr::from_bytes(&source),
        &fuse_point,
        std::ffi::OsStr::from_bytes(&fs_type),
        MountFlags::NOSUID | MountFlags::NODEV,
        Some(data.as_c_str()),
    )?;
    drop(fuse);
    made.push(fuse_point);
    Ok(made)
}

/// What both strategies report of a mount, with ids translated to the
/// mountinfo ids both know (statmount tables key by the unique 64-bit id).
#[derive(PartialEq, Eq, PartialOrd, Ord)]
struct Row {
    info_id: Option<u32>,
    parent_info_id: Option<u32>,
    dev: String,
    propagation: volring_mounts::Propagation,
    root: Vec<u8>,
    mount_point: Vec<u8>,
    options: Vec<u8>,
    fs_type: Vec<u8>,
    source: Vec<u8>,
    super_options: Vec<u8>,
}

impl std::fmt::Debug for Row {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let e = |b: &[u8]| b.escape_ascii().to_string();
        write!(
            f,
            "{:?} parent={:?} {} [{:?}] root={} point={} opts={} type={} src={} sup={}",
            self.info_id,
            self.parent_info_id,
            self.dev,
            self.propagation,
            e(&self.root),
            e(&self.mount_point),
            e(&self.options),
            e(&self.fs_type),
            e(&self.source),
            e(&self.super_options)
        )
    }
}

fn rows(t: &MountTable) -> Vec<Row> {
    let mut v: Vec<Row> = t
        .iter()
        .map(|m| Row {
            info_id: m.info_id,
            parent_info_id: t.get(m.parent).and_then(|p| p.info_id),
            dev: m.dev.to_string(),
            propagation: m.propagation,
            root: m.root().to_vec(),
            mount_point: m.mount_point().to_vec(),
            options: m.options().to_vec(),
            fs_type: m.fs_type().to_vec(),
            source: m.source().to_vec(),
            super_options: m.super_options().to_vec(),
        })
        .collect();
    v.sort();
    v
}

/// Both tables hold the same mounts with the same fields; names the first
/// rows that differ.
fn same_tables(what: &str, (a_name, a): (&str, &MountTable), (b_name, b): (&str, &MountTable)) -> Result<(), Failed> {
    let (ra, rb) = (rows(a), rows(b));
    if ra == rb {
        return Ok(());
    }
    let only = |x: &[Row], y: &[Row]| x.iter().filter(|r| !y.contains(r)).take(3).map(|r| format!("\n    {r:?}")).collect::<String>();
    let (only_a, only_b) = (only(&ra, &rb), only(&rb, &ra));
    Err(format!("{what}: tables differ ({} vs {} mounts)\n  only in {a_name}:{only_a}\n  only in {b_name}:{only_b}", ra.len(), rb.len())
        .into())
}

/// fanotify+statmount and mountinfo re-parsing give identical tables for
/// names holding escaped bytes, whether a mount was there when watching began
/// (snapshot) or came after (event).
pub(super) fn odd_names_same_in_both_strategies(backend: BackendChoice) -> Result<(), Failed> {
    let s = Scratch::new();
    let before = odd_mounts(&s, "before")?;
    let mut fan = Watch::start(WatchMode::Fanotify, backend, &s);
    let mut reparse = Watch::start(WatchMode::Reparse, backend, &s);
    same_tables("initial snapshots", ("statmount", &fan.table), ("mountinfo", &reparse.table))?;
    let after = odd_mounts(&s, "after")?;
    let (ef, er) = (fan.take(after.len()), reparse.take(after.len()));
    check(ef.len() == after.len() && er.len() == after.len(), format!("attaches seen: fanotify {}, reparse {}", ef.len(), er.len()))?;
    same_tables("tables kept from events", ("statmount", &fan.table), ("mountinfo", &reparse.table))?;
    let (fresh_stat, _) = volring_mounts::load(true)?;
    let (fresh_info, errors) = volring_mounts::load(false)?;
    check(errors.is_empty(), format!("mountinfo parse errors: {errors:?}"))?;
    same_tables("fresh loads", ("statmount", &fresh_stat), ("mountinfo", &fresh_info))?;
    same_tables("kept from events vs fresh", ("events", &fan.table), ("fresh", &fresh_stat))?;
    // And the bytes are the names as made, not merely equal to each other.
    let mut source = b"src".to_vec();
    source.extend_from_slice(ODD);
    for p in before.iter().chain(&after) {
        let m = fan.table.top_at(bytes(p)).ok_or_else(|| format!("no mount at {}", p.display()))?;
        check(m.mount_point() == bytes(p), format!("mount point {:?}", m.mount_point().escape_ascii().to_string()))?;
        if m.fs_type() == b"tmpfs" {
            check(m.source() == source.as_slice(), format!("source {:?}", m.source().escape_ascii().to_string()))?;
            let root_ok = m.root() == b"/" || m.root().strip_prefix(b"/sub") == Some(ODD);
            check(root_ok, format!("root {:?}", m.root().escape_ascii().to_string()))?;
        }
    }
    Ok(())
}
