//! The agent as a list of components: each one is registered right after
//! it started, with how to stop it; the list stops them newest first, each
//! within its own bound, so one that hangs is named in the log and the
//! others still stop.
//!
//! One [`Stopping`] signal says the agent is to stop: SIGINT or SIGTERM,
//! or a server that ended on its own (the agent then exits non-zero, and
//! the DaemonSet restarts it). The tasks the components spawn run on one
//! [`TaskTracker`], so what is left of them after the stop is counted.

use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::task::JoinHandle;
use tokio_util::sync::{CancellationToken, WaitForCancellationFutureOwned};
use tokio_util::task::TaskTracker;

use super::TARGET;

type StopFuture = Pin<Box<dyn Future<Output = anyhow::Result<()>> + Send>>;

/// One started component: its name (in the log) and how to stop it.
struct Component {
    name: &'static str,
    /// How long its stop may take before the next one starts anyway.
    wait: Duration,
    stop: Box<dyn FnOnce() -> StopFuture + Send>,
}

/// How long the tasks left after every component stopped are waited for.
const TASKS_WAIT: Duration = Duration::from_secs(5);

/// The running components, oldest first.
pub(crate) struct Components {
    running: Vec<Component>,
    tasks: TaskTracker,
    stopping: Stopping,
}

/// What a stop of every component came to.
#[derive(Debug, Default)]
pub(crate) struct Stopped {
    /// The first stop that failed (in stop order); the others are logged.
    pub error: Option<anyhow::Error>,
    /// The components that did not stop within their bound.
    pub late: Vec<&'static str>,
}

impl Components {
    pub(crate) fn new() -> Self {
        Self { running: Vec::new(), tasks: TaskTracker::new(), stopping: Stopping::default() }
    }

    /// The agent's one stop signal.
    pub(crate) fn stopping(&self) -> &Stopping {
        &self.stopping
    }

    /// Where the components' tasks are spawned.
    pub(crate) fn tasks(&self) -> &TaskTracker {
        &self.tasks
    }

    /// The names of the running components, oldest first.
    pub(crate) fn names(&self) -> Vec<&'static str> {
        self.running.iter().map(|c| c.name).collect()
    }

    /// Registers a component that has just started: `stop` runs when the
    /// agent stops, before the stops of every component started earlier,
    /// and is given up on after `wait`.
    pub(crate) fn started<F, Fut>(&mut self, name: &'static str, wait: Duration, stop: F)
    where
        F: FnOnce() -> Fut + Send + 'static,
        Fut: Future<Output = anyhow::Result<()>> + Send + 'static,
    {
        tracing::debug!(target: TARGET, component = name, "started");
        self.running.push(Component { name, wait, stop: Box::new(move || Box::pin(stop())) });
    }

    /// [`Components::started`] for a stop that blocks (it joins threads):
    /// it runs on the blocking pool, never on the runtime's workers.
    pub(crate) fn started_blocking<F>(&mut self, name: &'static str, wait: Duration, stop: F)
    where
        F: FnOnce() -> anyhow::Result<()> + Send + 'static,
    {
        self.started(name, wait, move || async move {
            tokio::task::spawn_blocking(stop).await.map_err(|e| anyhow::anyhow!("stopping the {name}: {e}"))?
        });
    }

    /// Spawns a server: `serve` is given the future that completes when
    /// its stop is asked (for a graceful end of accepting). A server that
    /// ends before that stops the agent with an error that says so.
    pub(crate) fn serve<S, F>(&self, what: &'static str, serve: S) -> Server
    where
        S: FnOnce(WaitForCancellationFutureOwned) -> F,
        F: Future<Output = std::io::Result<()>> + Send + 'static,
    {
        let stop = CancellationToken::new();
        let mut task = self.tasks.spawn(serve(stop.clone().cancelled_owned()));
        let (asked, stopping) = (stop.clone(), self.stopping.clone());
        let watch = self.tasks.spawn(async move {
            tokio::select! {
                biased;
                _ = asked.cancelled() => Some(task),
                r = &mut task => {
                    stopping.fail(server_ended(what, r));
                    None
                }
            }
        });
        Server { stop, watch }
    }

    /// Stops every component, newest first, each within its bound (one
    /// that overruns is logged and left behind), then waits a little for
    /// what is left of their tasks.
    pub(crate) async fn stop(self) -> Stopped {
        let mut out = Stopped::default();
        for c in self.running.into_iter().rev() {
            tracing::debug!(target: TARGET, component = c.name, "stopping");
            match tokio::time::timeout(c.wait, (c.stop)()).await {
                Ok(Ok(())) => tracing::debug!(target: TARGET, component = c.name, "component stopped"),
                Ok(Err(e)) if out.error.is_none() => out.error = Some(e),
                Ok(Err(e)) => tracing::warn!(target: TARGET, component = c.name, error = %e, "stopping a component failed"),
                Err(_) => {
                    tracing::warn!(target: TARGET, component = c.name, wait_ms = c.wait.as_millis() as u64,
                        "component did not stop in time; stopping the others");
                    out.late.push(c.name);
                }
            }
        }
        self.tasks.close();
        if tokio::time::timeout(TASKS_WAIT, self.tasks.wait()).await.is_err() {
            tracing::warn!(target: TARGET, tasks = self.tasks.len(), "tasks still running after every component stopped");
        }
        out
    }
}

/// A server task and its watcher (see [`Components::serve`]).
pub(crate) struct Server {
    stop: CancellationToken,
    watch: JoinHandle<Option<JoinHandle<std::io::Result<()>>>>,
}

impl Server {
    /// Asks the server to stop; gives back its task, maybe still running
    /// (to await or abort), or `None` when it had already ended.
    pub(crate) async fn stop(self) -> Option<JoinHandle<std::io::Result<()>>> {
        self.stop.cancel();
        self.watch.await.ok().flatten()
    }

    /// Ends the server at once: the task is aborted and awaited.
    pub(crate) async fn abort(self) {
        if let Some(task) = self.stop().await {
            task.abort();
            let _ = task.await;
        }
    }
}

fn server_ended(what: &str, r: Result<std::io::Result<()>, tokio::task::JoinError>) -> anyhow::Error {
    match r {
        Ok(Ok(())) => anyhow::anyhow!("the {what} server stopped"),
        Ok(Err(e)) => anyhow::anyhow!("the {what} server failed: {e}"),
        Err(e) => anyhow::anyhow!("the {what} server task ended: {e}"),
    }
}

/// The agent's stop signal: asked by a signal, or by a failure (the first
/// one is what the agent exits with).
#[derive(Clone, Default)]
pub(crate) struct Stopping {
    token: CancellationToken,
    failure: Arc<Mutex<Option<anyhow::Error>>>,
}

impl Stopping {
    /// Stops the agent cleanly.
    pub(crate) fn stop(&self) {
        self.token.cancel();
    }

    /// Stops the agent with `error` (unless an earlier failure did).
    pub(crate) fn fail(&self, error: anyhow::Error) {
        self.failure.lock().unwrap_or_else(|e| e.into_inner()).get_or_insert(error);
        self.token.cancel();
    }

    /// Completes once a stop was asked.
    pub(crate) async fn asked(&self) {
        self.token.cancelled().await
    }

    /// What the agent exits with: the first failure, if any.
    pub(crate) fn outcome(&self) -> anyhow::Result<()> {
        match self.failure.lock().unwrap_or_else(|e| e.into_inner()).take() {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }
}

/// A value whose drop blocks (it joins threads), dropped on the blocking
/// pool when it is dropped unused (on a start that failed half way).
pub(crate) struct OffRuntime<T: Send + 'static>(Option<T>);

impl<T: Send + 'static> OffRuntime<T> {
    pub(crate) fn new(t: T) -> Self {
        Self(Some(t))
    }

    pub(crate) fn into_inner(mut self) -> T {
        self.0.take().expect("taken once")
    }
}

impl<T: Send + 'static> std::ops::Deref for OffRuntime<T> {
    type Target = T;
    fn deref(&self) -> &T {
        self.0.as_ref().expect("not taken")
    }
}

impl<T: Send + 'static> Drop for OffRuntime<T> {
    fn drop(&mut self) {
        if let Some(t) = self.0.take() {
            // The runtime waits for it before the process exits.
            drop(tokio::task::spawn_blocking(move || drop(t)));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    type Log = Arc<Mutex<Vec<String>>>;

    fn note(log: &Log, what: String) {
        log.lock().unwrap().push(what);
    }

    /// Starts `names` in order, each recording its start and its stop; the
    /// ones in `hang` never finish stopping.
    fn start(names: &[&'static str], hang: &[&str], log: &Log) -> Components {
        let mut parts = Components::new();
        for &name in names {
            note(log, format!("start {name}"));
            let (log, hangs) = (log.clone(), hang.contains(&name));
            parts.started(name, Duration::from_millis(200), move || async move {
                note(&log, format!("stop {name}"));
                if hangs {
                    std::future::pending::<()>().await;
                }
                note(&log, format!("stopped {name}"));
                Ok(())
            });
        }
        parts
    }

    #[tokio::test]
    async fn stops_in_the_reverse_of_the_start_order() {
        let log = Log::default();
        let parts = start(&["nbd", "driver", "mounts", "csi", "publisher"], &[], &log);
        assert_eq!(parts.names(), ["nbd", "driver", "mounts", "csi", "publisher"]);
        let stopped = parts.stop().await;
        assert!(stopped.error.is_none() && stopped.late.is_empty(), "{stopped:?}");
        let log = log.lock().unwrap().clone();
        let want: Vec<String> = ["start nbd", "start driver", "start mounts", "start csi", "start publisher"]
            .into_iter()
            .map(String::from)
            .chain(["publisher", "csi", "mounts", "driver", "nbd"].into_iter().flat_map(|n| [format!("stop {n}"), format!("stopped {n}")]))
            .collect();
        assert_eq!(log, want);
    }

    #[tokio::test]
    async fn a_component_that_does_not_stop_is_named_and_the_others_stop() {
        let log = Log::default();
        let parts = start(&["a", "b", "c"], &["b"], &log);
        let t0 = std::time::Instant::now();
        let stopped = parts.stop().await;
        assert_eq!(stopped.late, ["b"]);
        assert!(stopped.error.is_none());
        // b's own bound (200 ms) was waited for, not forever.
        assert!(t0.elapsed() < Duration::from_secs(3), "{:?}", t0.elapsed());
        let log = log.lock().unwrap().clone();
        assert_eq!(&log[3..], ["stop c", "stopped c", "stop b", "stop a", "stopped a"]);
    }

    #[tokio::test]
    async fn the_first_failed_stop_is_returned_and_the_rest_still_stop() {
        let log = Log::default();
        let mut parts = start(&["a"], &[], &log);
        parts.started("b", Duration::from_secs(1), || async { Err(anyhow::anyhow!("b broke")) });
        parts.started("c", Duration::from_secs(1), || async { Err(anyhow::anyhow!("c broke")) });
        let stopped = parts.stop().await;
        assert_eq!(stopped.error.map(|e| e.to_string()).as_deref(), Some("c broke"));
        assert_eq!(log.lock().unwrap().last().map(String::as_str), Some("stopped a"));
    }

    #[tokio::test]
    async fn a_blocking_stop_runs_off_the_runtime() {
        let mut parts = Components::new();
        let on = Arc::new(Mutex::new(None));
        let seen = on.clone();
        parts.started_blocking("ring", Duration::from_secs(5), move || {
            // A join would block here: not on the runtime's (this test's) thread.
            std::thread::sleep(Duration::from_millis(20));
            *seen.lock().unwrap() = Some(std::thread::current().id());
            Ok(())
        });
        let stopped = parts.stop().await;
        assert!(stopped.late.is_empty());
        let ran_on = on.lock().unwrap().expect("the stop ran");
        assert_ne!(ran_on, std::thread::current().id());
    }

    #[tokio::test]
    async fn a_server_that_ends_by_itself_stops_the_agent_with_an_error() {
        let parts = Components::new();
        let server = parts.serve("metrics", |_stop| async { Err(std::io::Error::other("port gone")) });
        tokio::time::timeout(Duration::from_secs(5), parts.stopping().asked()).await.expect("a stop was asked");
        let err = parts.stopping().outcome().expect_err("a failure");
        assert_eq!(err.to_string(), "the metrics server failed: port gone");
        assert!(server.stop().await.is_none(), "the task already ended");
        parts.stop().await;
    }

    #[tokio::test]
    async fn a_server_asked_to_stop_is_no_failure() {
        let parts = Components::new();
        let server = parts.serve("CSI", |stop| async move {
            stop.await;
            Ok(())
        });
        let task = server.stop().await.expect("the task is handed back");
        assert!(task.await.unwrap().is_ok());
        assert!(parts.stopping().outcome().is_ok());
        parts.stop().await;
    }
}
