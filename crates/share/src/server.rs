//! The NFS server process: nfs-ganesha run in the foreground by a
//! supervisor thread of the agent, restarted with backoff when it dies.
//!
//! Why a thread and not tokio: the thread spawns the server and waits for
//! it, and the kernel ties PR_SET_PDEATHSIG to the spawning thread — the
//! server dies with the agent (a new agent starts its own, and the clients'
//! hard mounts ride through the gap). Export changes rewrite the
//! configuration; an added export is a SIGHUP, which ganesha answers by
//! re-reading its exports without dropping its clients; a removed one
//! ends the process (see `set_exports`), which starts again on the new
//! file when exports remain and not at all when none does.

use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use super::ganesha::{self, Export, Settings};
use super::Error;

/// The first wait before a restart; doubled after each quick death.
const BACKOFF_MIN: Duration = Duration::from_millis(250);
/// The longest wait between restarts.
const BACKOFF_MAX: Duration = Duration::from_secs(5);
/// A server that ran this long before dying restarts at once (after
/// [`BACKOFF_MIN`]): it was not crash-looping.
const HEALTHY_RUN: Duration = Duration::from_secs(30);
/// How long a removal waits for the process it ended to be reaped.
const KILL_WAIT: Duration = Duration::from_secs(10);

/// Where the server's files go and which binary runs.
#[derive(Debug, Clone)]
pub(crate) struct ServerFiles {
    pub(crate) binary: PathBuf,
    /// Holds `ganesha.conf`, `ganesha.log`, `ganesha.pid` and `recovery/`.
    pub(crate) dir: PathBuf,
}

#[derive(Default)]
struct State {
    exports: Vec<Export>,
    pid: Option<u32>,
    /// The running server as a pidfd: a signal sent through it reaches
    /// that process or none, never a later process given the same pid.
    pidfd: Option<OwnedFd>,
    starts: u64,
    stopping: bool,
    /// The running process was ended on purpose (an export removed): its
    /// death is no crash, so no backoff.
    killed: bool,
}

struct Shared {
    settings: Settings,
    files: ServerFiles,
    state: Mutex<State>,
    wake: Condvar,
}

/// A supervised ganesha. Starts its process with the first export and
/// keeps it running until dropped.
pub(crate) struct NfsServer {
    shared: Arc<Shared>,
    thread: Mutex<Option<std::thread::JoinHandle<()>>>,
}

impl NfsServer {
    pub(crate) fn new(settings: Settings, files: ServerFiles) -> Result<Self, Error> {
        std::fs::create_dir_all(&settings.recovery_dir).map_err(|e| Error::io(&settings.recovery_dir, e))?;
        std::fs::create_dir_all(&files.dir).map_err(|e| Error::io(&files.dir, e))?;
        // Checked now, so a bad path fails the agent's start, not a stage.
        ganesha::render(&settings, &[])?;
        let shared = Arc::new(Shared { settings, files, state: Mutex::new(State::default()), wake: Condvar::new() });
        Ok(Self { shared, thread: Mutex::new(None) })
    }

    /// Serves exactly `exports` from now on: rewrites the configuration and
    /// has the running server re-read it (or starts the server).
    pub(crate) fn set_exports(&self, mut exports: Vec<Export>) -> Result<(), Error> {
        exports.sort();
        let text = ganesha::render(&self.shared.settings, &exports)?;
        let mut st = self.shared.lock();
        if st.exports == exports && (self.thread_running() || exports.is_empty()) {
            return Ok(());
        }
        write_atomic(&self.shared.config_path(), text.as_bytes())?;
        // An export that goes away must not be answered for: ganesha,
        // re-reading a configuration without it, tells the clients still
        // connected that their file handles are stale (ESTALE in their
        // applications, a dead mount), while those clients should instead
        // lose the connection and find the volume where it went (the
        // Service's new endpoint). So a removal ends the process (SIGKILL:
        // a shutdown would unexport first and answer the same way); the
        // supervisor starts it again on the file just written when exports
        // remain, and their clients ride through as through any restart
        // (hard mounts, NFSv4 grace). An addition is a reload (SIGHUP).
        let removed = st.exports.iter().any(|e| !exports.iter().any(|n| n.id == e.id && n.path == e.path));
        st.exports = exports;
        if let Some(fd) = &st.pidfd {
            // A server that has not yet set its handler dies of the HUP; the
            // supervisor then starts it again on the file just written.
            let signal = if removed { rustix::process::Signal::KILL } else { rustix::process::Signal::HUP };
            let _ = rustix::process::pidfd_send_signal(fd, signal);
            if removed {
                st.killed = true;
                // Until it is reaped (bounded): a process still exiting
                // may hold the removed export's files, and the caller
                // unmounts its filesystem next.
                let victim = st.pid;
                st = self
                    .shared
                    .wake
                    .wait_timeout_while(st, KILL_WAIT, |s| s.pid.is_some() && s.pid == victim)
                    .unwrap_or_else(|e| e.into_inner())
                    .0;
            }
        }
        let none = st.exports.is_empty();
        drop(st);
        if none {
            // No export: no server (the supervisor ends with the process).
            return Ok(());
        }
        self.ensure_thread()
    }

    /// Stops the running server (SIGTERM) for the supervisor to start it
    /// again on the current configuration: ganesha resolves an export's
    /// path only when it creates the export, and a reload keeps an
    /// unchanged export on what it resolved before. Clients ride through
    /// as through any restart (hard mounts, NFSv4 grace).
    pub(crate) fn restart(&self) {
        let st = self.shared.lock();
        if let Some(fd) = &st.pidfd {
            let _ = rustix::process::pidfd_send_signal(fd, rustix::process::Signal::TERM);
        }
    }

    /// The server's process id while it runs.
    pub(crate) fn pid(&self) -> Option<u32> {
        self.shared.lock().pid
    }

    fn thread_running(&self) -> bool {
        self.thread.lock().unwrap_or_else(|e| e.into_inner()).as_ref().is_some_and(|t| !t.is_finished())
    }

    fn ensure_thread(&self) -> Result<(), Error> {
        let mut t = self.thread.lock().unwrap_or_else(|e| e.into_inner());
        if t.as_ref().is_some_and(|t| !t.is_finished()) {
            return Ok(());
        }
        let shared = self.shared.clone();
        let handle = std::thread::Builder::new()
            .name("nfs-server".into())
            .spawn(move || shared.supervise())
            .map_err(|e| Error::io(Path::new("nfs-server thread"), e))?;
        *t = Some(handle);
        Ok(())
    }
}

impl Drop for NfsServer {
    fn drop(&mut self) {
        {
            let mut st = self.shared.lock();
            st.stopping = true;
            if let Some(fd) = &st.pidfd {
                let _ = rustix::process::pidfd_send_signal(fd, rustix::process::Signal::TERM);
            }
        }
        self.shared.wake.notify_all();
        if let Some(t) = self.thread.lock().unwrap_or_else(|e| e.into_inner()).take() {
            let _ = t.join();
        }
    }
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn config_path(&self) -> PathBuf {
        self.files.dir.join("ganesha.conf")
    }

    /// Runs the server until stopping, restarting it with backoff.
    fn supervise(&self) {
        let mut backoff = BACKOFF_MIN;
        loop {
            let started = Instant::now();
            let child = {
                let mut st = self.lock();
                if st.stopping || st.exports.is_empty() {
                    return;
                }
                match self.spawn() {
                    Ok(c) => {
                        st.pid = Some(c.id());
                        // Opened before the wait reaps it, so it names this child.
                        st.pidfd = rustix::process::Pid::from_raw(c.id() as i32)
                            .and_then(|p| rustix::process::pidfd_open(p, rustix::process::PidfdFlags::empty()).ok());
                        st.starts += 1;
                        tracing::info!(pid = c.id(), listen = %self.settings.listen, exports = st.exports.len(), "NFS server started");
                        Some(c)
                    }
                    Err(e) => {
                        tracing::error!(error = %e, "cannot start the NFS server");
                        None
                    }
                }
            };
            let status = child.map(|mut c| c.wait());
            let mut st = self.lock();
            st.pid = None;
            st.pidfd = None;
            self.wake.notify_all();
            let killed = std::mem::take(&mut st.killed);
            if st.stopping || (killed && st.exports.is_empty()) {
                return;
            }
            let ran = started.elapsed();
            backoff = if ran >= HEALTHY_RUN || killed { BACKOFF_MIN } else { (backoff * 2).min(BACKOFF_MAX) };
            tracing::warn!(status = ?status, ran_secs = ran.as_secs_f64(), retry_in_ms = backoff.as_millis() as u64,
                log = %self.files.dir.join("ganesha.log").display(), "NFS server exited; restarting");
            // Bounded wait; a stop wakes it early.
            let (st, _) = self.wake.wait_timeout_while(st, backoff, |s| !s.stopping).unwrap_or_else(|e| e.into_inner());
            if st.stopping {
                return;
            }
        }
    }

    fn spawn(&self) -> std::io::Result<Child> {
        let dir = &self.files.dir;
        let mut cmd = Command::new(&self.files.binary);
        cmd.arg("-F").arg("-f").arg(self.config_path()).arg("-L").arg(dir.join("ganesha.log")).arg("-p").arg(dir.join("ganesha.pid"));
        cmd.stdin(Stdio::null()).stdout(Stdio::null()).stderr(Stdio::null());
        volring_sys::kill_with_parent(&mut cmd);
        cmd.spawn()
    }
}

/// Writes `bytes` to `path` through a temporary file and a rename, so the
/// server never reads half a file.
fn write_atomic(path: &Path, bytes: &[u8]) -> Result<(), Error> {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, bytes).map_err(|e| Error::io(&tmp, e))?;
    std::fs::rename(&tmp, path).map_err(|e| Error::io(path, e))
}
