//! The `volring` binary's subcommands (main.rs holds the argument types
//! and the dispatch), and what they share: stdout that may close, the
//! runtime, the "needs root" hint.

pub(crate) mod args;
pub(crate) mod devices;
pub(crate) mod devices_report;
pub(crate) mod df;
pub(crate) mod holders;
pub(crate) mod mounts;
pub(crate) mod mounts_report;
pub(crate) mod nbd;
pub(crate) mod serve;
pub(crate) mod status;
pub(crate) mod top;
mod top_ui;
pub(crate) mod volumes;

use anyhow::Context;

/// The reader of stdout went away (`volring mounts --watch | head -1`): the
/// command stops and exits quietly with status 0. Only stdout writes make
/// it, so an EPIPE from anything else stays an error.
#[derive(Debug)]
pub(crate) struct StdoutClosed;

impl std::fmt::Display for StdoutClosed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("stdout was closed")
    }
}

impl std::error::Error for StdoutClosed {}

/// Nothing matched (`mounts --target` of a path that does not exist, a
/// `--source` nothing is mounted from): exit status 1 with nothing said,
/// as findmnt.
#[derive(Debug)]
pub(crate) struct NothingFound;

impl std::fmt::Display for NothingFound {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("nothing found")
    }
}

impl std::error::Error for NothingFound {}

/// An error writing stdout, as the command's error.
pub(crate) fn stdout_error(e: std::io::Error) -> anyhow::Error {
    if e.kind() == std::io::ErrorKind::BrokenPipe {
        StdoutClosed.into()
    } else {
        anyhow::Error::new(e).context("write to stdout")
    }
}

/// `e` and its causes on one line, each cause once: an error whose text
/// already ends with its source's text (thiserror's `"{path}: {source}"`
/// with `#[source]`) would otherwise print that cause twice.
pub(crate) fn one_line(e: &anyhow::Error) -> String {
    let mut line = String::new();
    for cause in e.chain() {
        let text = cause.to_string();
        if line.ends_with(&text) {
            continue;
        }
        if !line.is_empty() {
            line.push_str(": ");
        }
        line.push_str(&text);
    }
    line
}

/// Whether a permission refusal is among the causes of `e`.
pub(crate) fn denied(e: &anyhow::Error) -> bool {
    e.chain().any(|c| {
        c.downcast_ref::<std::io::Error>().is_some_and(|io| io.kind() == std::io::ErrorKind::PermissionDenied)
            || c.downcast_ref::<rustix::io::Errno>().is_some_and(|n| *n == rustix::io::Errno::PERM || *n == rustix::io::Errno::ACCESS)
            || {
                let text = c.to_string();
                text.contains("Permission denied") || text.contains("Operation not permitted")
            }
    })
}

pub(crate) fn runtime() -> anyhow::Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().context("tokio runtime")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, thiserror::Error)]
    #[error("{path}: {source}")]
    struct Open {
        path: String,
        #[source]
        source: std::io::Error,
    }

    /// The NBD export error as the agent and `nbd serve` reported it: the
    /// io error's text came out twice.
    #[test]
    fn each_cause_once() {
        let io = std::io::Error::from(std::io::ErrorKind::NotFound);
        let io_text = io.to_string();
        let e = anyhow::Error::new(Open { path: "/srv/vol1.img".into(), source: io }).context("NBD export vol1");
        let line = one_line(&e);
        assert_eq!(line, format!("NBD export vol1: /srv/vol1.img: {io_text}"));
        assert_eq!(line.matches(&io_text).count(), 1);
        let plain = anyhow::anyhow!("bind").context("cannot bind CSI socket /x");
        assert_eq!(one_line(&plain), "cannot bind CSI socket /x: bind");
    }
}
