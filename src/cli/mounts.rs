//! `volring mounts`: the table (findmnt's columns, tree, filters) and
//! `--watch`.

use std::io::Write;

use volring_mounts::{self as mounts, MountWatcher, WatchConfig};

use super::*;

pub(crate) fn print_table(
    json: bool,
    statmount: bool,
    columns: &[super::mounts_report::Column],
    layout: super::mounts_report::Layout,
    filter: &super::mounts_report::Filter,
    types: Option<&str>,
) -> anyhow::Result<()> {
    // findmnt --target of a path that does not exist finds nothing (rather
    // than the mount its nearest existing parent is on).
    if let Some(t) = &filter.target {
        use std::os::unix::ffi::OsStrExt;
        if std::fs::symlink_metadata(std::ffi::OsStr::from_bytes(t)).is_err() {
            return Err(NothingFound.into());
        }
    }
    let (table, errors) = mounts::load(statmount)?;
    for e in &errors {
        tracing::warn!("{e}");
    }
    let mut rows = filter.select(&table);
    if let Some(types) = types {
        rows.retain(|m| fs_type_matches(types, m.fs_type()));
    }
    if rows.is_empty() && (filter.target.is_some() || filter.source.is_some() || types.is_some()) {
        return Err(NothingFound.into());
    }
    let mut out = std::io::stdout().lock();
    let mut write = || -> std::io::Result<()> {
        if json {
            serde_json::to_writer_pretty(&mut out, &serde_json::json!({ "filesystems": rows }))?;
            writeln!(out)?;
        } else {
            out.write_all(super::mounts_report::render(&rows, columns, layout, filter).as_bytes())?;
        }
        out.flush()
    };
    write().map_err(stdout_error)
}

/// findmnt's `-t` list: `ext4,xfs` keeps those types; a leading `no`
/// (`noproc,sysfs`) leaves out every type in the list instead.
pub(crate) fn fs_type_matches(list: &str, fs_type: &[u8]) -> bool {
    let (negated, list) = match list.strip_prefix("no") {
        Some(rest) => (true, rest),
        None => (false, list),
    };
    let listed = list.split(',').map(|t| t.strip_prefix("no").filter(|_| negated).unwrap_or(t)).any(|t| t.as_bytes() == fs_type);
    listed != negated
}

pub(crate) async fn stream(config: WatchConfig, json: bool) -> anyhow::Result<()> {
    let (watcher, _initial, events) = MountWatcher::start(config)?;
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    // One write(2) per wakeup, not per event: in a storm the watcher queues
    // many events per wakeup of this task. What is already queued is taken
    // too (bounded by the queue's length), then flushed once.
    let mut out = std::io::BufWriter::with_capacity(64 * 1024, std::io::stdout());
    let result = loop {
        tokio::select! {
            ev = events.recv() => {
                let Some(ev) = ev else { break Ok(()) };
                let queued = events.drain();
                let written = if json {
                    std::iter::once(ev)
                        .chain(queued)
                        .try_for_each(|ev| serde_json::to_writer(&mut out, &ev).map_err(std::io::Error::from).and_then(|_| out.write_all(b"\n")))
                        .and_then(|_| out.flush())
                } else {
                    let (mut text, stamp) = (String::new(), clock());
                    std::iter::once(ev).chain(queued).for_each(|ev| super::mounts_report::event_lines(&ev, &stamp, &mut text));
                    out.write_all(text.as_bytes()).and_then(|_| out.flush())
                };
                if let Err(e) = written {
                    break Err(stdout_error(e));
                }
            }
            _ = tokio::signal::ctrl_c() => break Ok(()),
            _ = term.recv() => break Ok(()),
        }
    };
    watcher.stop()?;
    result
}

/// `HH:MM:SS.mmm` (UTC) for a text event line.
pub(crate) fn clock() -> String {
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
    let (s, ms) = (now.as_secs() % 86_400, now.subsec_millis());
    format!("{:02}:{:02}:{:02}.{ms:03}", s / 3600, s / 60 % 60, s % 60)
}
