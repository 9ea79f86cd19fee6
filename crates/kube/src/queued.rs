//! How many objects the running agent's publisher still holds, recorded in
//! the state directory so `volring get` can say that what it prints is not
//! all there is yet: objects queued for the cluster (paced by
//! `--publish-qps`, or waiting for an API server that does not answer) or
//! for the node's store (waiting for their window).
//!
//! The record names the agent's pid and that process's start time; one
//! whose process is gone (an agent that died without removing it), or
//! whose pid another process has since taken, is not believed.

use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use super::stats::Stats;

/// The record's file name in the state directory.
pub(crate) const FILE: &str = "publish-queued.json";

/// How often the agent looks at its count (written only when it changed).
const EVERY: Duration = Duration::from_millis(250);

/// Where the publisher writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Target {
    Cluster,
    Store,
}

impl Target {
    fn as_str(self) -> &'static str {
        match self {
            Target::Cluster => "the cluster",
            Target::Store => "the node's store",
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub(crate) struct Queued {
    /// Objects submitted and not yet written.
    pub queued: u64,
    pub target: Target,
    /// The agent that counts them.
    pub(crate) pid: u32,
    /// When that process started (clock ticks since boot, `/proc/PID/stat`
    /// field 22): a pid reused after the agent died has another.
    #[serde(default)]
    pub(crate) started: u64,
}

/// Process `pid`'s start time, if it runs (field 22 of `/proc/PID/stat`,
/// counted after the command name's closing parenthesis: the name itself
/// may hold spaces and parentheses).
fn start_time(pid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    parse_start_time(&stat)
}

fn parse_start_time(stat: &str) -> Option<u64> {
    let (_, after_name) = stat.rsplit_once(')')?;
    after_name.split_whitespace().nth(19)?.parse().ok()
}

fn path(state_dir: &Path) -> PathBuf {
    state_dir.join(FILE)
}

/// Writes the record (a whole file, renamed into place: a reader never
/// sees half of one).
pub(crate) fn write(state_dir: &Path, q: &Queued) -> std::io::Result<()> {
    let tmp = state_dir.join(format!(".{FILE}.tmp"));
    std::fs::write(&tmp, serde_json::to_vec(q).map_err(std::io::Error::other)?)?;
    std::fs::rename(&tmp, path(state_dir))
}

/// Removes the record (the agent's publisher stopped).
pub(crate) fn remove(state_dir: &Path) {
    let _ = std::fs::remove_file(path(state_dir));
}

/// The running agent's record, if there is one and its agent still runs.
pub(crate) fn read(state_dir: &Path) -> Option<Queued> {
    let bytes = std::fs::read(path(state_dir)).ok()?;
    if bytes.len() > 4096 {
        return None;
    }
    let q: Queued = serde_json::from_slice(&bytes).ok()?;
    let started = start_time(q.pid)?;
    // A record without a start time (an older agent's, or one that could
    // not read its own) is believed on its pid alone, as before.
    (q.started == 0 || started == q.started).then_some(q)
}

/// What `volring get` adds when the agent still holds objects.
pub(crate) fn note(state_dir: &Path) -> Option<String> {
    let q = read(state_dir).filter(|q| q.queued > 0)?;
    let s = if q.queued == 1 { "" } else { "s" };
    Some(format!("# the agent still has {} object{s} queued for {}: not shown yet", q.queued, q.target.as_str()))
}

/// Keeps the record to `stats`' queued count until cancelled (the caller
/// aborts the task); the record is removed when the task is dropped.
pub async fn follow(stats: Arc<Stats>, state_dir: PathBuf, target: Target) {
    /// Removes the record when the task ends (an abort drops it).
    struct Removed(PathBuf);
    impl Drop for Removed {
        fn drop(&mut self) {
            remove(&self.0);
        }
    }
    let _removed = Removed(state_dir.clone());
    let pid = std::process::id();
    let started = start_time(pid).unwrap_or_else(|| {
        tracing::debug!("cannot read this process's start time: the queued record names the pid only");
        0
    });
    let mut last = None;
    loop {
        let queued = stats.queued.load(Ordering::Relaxed);
        if last != Some(queued) {
            let q = Queued { queued, target, pid, started };
            let dir = state_dir.clone();
            match tokio::task::spawn_blocking(move || write(&dir, &q)).await {
                Ok(Ok(())) => last = Some(queued),
                Ok(Err(e)) => tracing::debug!(error = %e, "cannot record the publisher's queue"),
                Err(_) => {}
            }
        }
        tokio::time::sleep(EVERY).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_record_of_a_live_agent_is_noted_and_one_of_a_gone_agent_is_not() {
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(note(dir.path()), None);
        let me = std::process::id();
        let started = start_time(me).unwrap();
        write(dir.path(), &Queued { queued: 3, target: Target::Cluster, pid: me, started }).unwrap();
        assert_eq!(note(dir.path()).unwrap(), "# the agent still has 3 objects queued for the cluster: not shown yet");
        write(dir.path(), &Queued { queued: 0, target: Target::Store, pid: me, started }).unwrap();
        assert_eq!(note(dir.path()), None, "nothing queued: nothing said");
        // pid_max is at most 2^22: no process has this pid.
        write(dir.path(), &Queued { queued: 5, target: Target::Store, pid: u32::MAX, started }).unwrap();
        assert_eq!(note(dir.path()), None);
        // A dead agent's pid, since taken by another process (here: this
        // one, started at another time): not believed.
        write(dir.path(), &Queued { queued: 5, target: Target::Store, pid: me, started: started + 1 }).unwrap();
        assert_eq!(note(dir.path()), None, "a reused pid");
        std::fs::write(dir.path().join(FILE), b"not json").unwrap();
        assert_eq!(note(dir.path()), None);
        remove(dir.path());
        assert!(!dir.path().join(FILE).exists());
    }

    #[test]
    fn the_start_time_is_read_past_a_name_with_spaces_and_parentheses() {
        let stat = "4242 (a (b) c) S 1 4242 4242 0 -1 4194560 100 0 0 0 5 3 0 0 20 0 1 0 987654 1000000 100";
        assert_eq!(parse_start_time(stat), Some(987_654));
        assert_eq!(parse_start_time("4242 (x) S 1"), None);
        assert_eq!(parse_start_time("no parenthesis"), None);
    }
}
