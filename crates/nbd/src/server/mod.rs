//! The NBD server: ring threads (one per core by default), each owning its
//! connections, their sockets and its registered view of the exports.
//!
//! Ring 0 holds a multishot accept on every listener and deals accepted
//! sockets out round-robin; a ring registers the socket as a fixed file and
//! from then on receives, sends and touches the image only through its own
//! io_uring. Requests on a connection run concurrently and are answered as
//! they complete; replies that are ready together leave in one sendmsg.

mod accept;
mod budget;
mod conn;
mod diag;
mod direct;
mod exports;
mod idle;
pub(crate) mod inline;
mod listener;
mod output;
mod receive;
mod requests;
mod shared;
mod stamp;
pub(crate) mod starve;
mod token;
mod weight;
mod worker;

use std::net::SocketAddr;
use std::os::fd::{AsRawFd, OwnedFd};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use super::export::{Export, ExportSpec, Exports};
use super::stats::RingCounters;
use super::Error;
use inline::InlineWrites;
use listener::Listener;
use starve::OffloadReads;
use volring_ring::IoRingConfig;
use volring_ring::Mailbox;

/// Where the server listens.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Listen {
    Tcp(SocketAddr),
    Unix(PathBuf),
}

impl std::str::FromStr for Listen {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self, Error> {
        if let Some(path) = s.strip_prefix("unix:") {
            return Ok(Listen::Unix(PathBuf::from(path)));
        }
        s.parse().map(Listen::Tcp).map_err(|_| Error::Listen { addr: s.to_string(), why: "expected HOST:PORT or unix:PATH".into() })
    }
}

/// How the server runs.
#[derive(Debug, Clone)]
pub struct ServerConfig {
    pub listen: Vec<Listen>,
    /// Ring threads; 0 means one per core, at most `DEFAULT_MAX_RINGS` (the
    /// count the default config carries).
    pub threads: usize,
    /// Whether small buffered writes may be done on the ring thread when
    /// the file system would hand them to io_uring's workers (ext4).
    pub inline_writes: InlineWrites,
    /// Whether a ring thread starved of CPU hands its page-cache reads to
    /// io_uring's workers (threads the scheduler shares CPU with too).
    pub offload_reads: OffloadReads,
    /// A client that has not finished negotiating by then is dropped.
    pub handshake_timeout: Duration,
    /// A connection with nothing in flight and no traffic for this long is
    /// closed; `None` keeps idle connections (mounted filesystems idle).
    pub idle_timeout: Option<Duration>,
    /// A connection whose replies make no progress (the client stopped
    /// reading) for this long is closed.
    pub stall_timeout: Duration,
    /// Bytes of replies (spliced ones included) and request buffers one
    /// connection may hold: its next request is not read while it would
    /// go past this (one request larger than this is taken alone).
    pub max_queued_bytes: usize,
    /// Requests one connection may have in flight before the server stops
    /// reading from it.
    pub max_requests: u32,
    /// Memory every connection together may hold in buffers and unread
    /// bytes, across rings. Past three quarters of it only connections
    /// holding under 1/64 of it are read (the heaviest stop first).
    pub max_server_bytes: usize,
    /// After a busy loop turn, a ring waits this long for more completions
    /// before the next turn (zero: never). At queue depth 32 it turns a
    /// stream of single requests into bursts: 4 KiB random reads went from
    /// 150-186k to ~204k IOPS with 20 µs. A quiet ring never waits.
    pub batch_wait: Duration,
    /// How long a quiet ring that has just served a stream of requests
    /// polls for the next one before it sleeps (zero: never poll). See
    /// `idle`: where idle CPUs halt, the wake-up is most of a QD1 read.
    pub idle_poll: Duration,
    /// Whether each ring thread asks the scheduler for the weight of as
    /// many threads as it has busy connections (see `weight`): on a
    /// contended CPU a ring then gets what a thread per connection would.
    pub ring_weight: bool,
    pub ring: IoRingConfig,
}

impl Default for ServerConfig {
    fn default() -> Self {
        Self {
            listen: Vec::new(),
            threads: default_rings(),
            inline_writes: InlineWrites::Auto,
            offload_reads: OffloadReads::Auto,
            handshake_timeout: Duration::from_secs(10),
            idle_timeout: None,
            stall_timeout: Duration::from_secs(60),
            max_queued_bytes: 96 << 20,
            max_requests: 512,
            max_server_bytes: 128 << 20,
            batch_wait: Duration::from_micros(20),
            idle_poll: idle::DEFAULT_WINDOW,
            ring_weight: true,
            // Freed buffers kept per ring for reuse; emptied when idle.
            ring: IoRingConfig { heap_cache: 16 << 20, ..IoRingConfig::default() },
        }
    }
}

/// Rings started when the thread count is left to the server: one per
/// core, at most this many. Each ring holds up to 32 MiB of its own
/// (registered buffers, receive buffers, a cache of freed buffers) outside
/// the connections' budget, so a large machine does not pay for 64 rings.
pub(crate) const DEFAULT_MAX_RINGS: usize = 4;

/// Messages to a ring thread, through its [`Mailbox`].
enum Command {
    /// An accepted socket for this ring to serve.
    Adopt(OwnedFd),
}

/// What every ring of a server is told without a message, so it cannot be
/// lost to a full mailbox: a ring looks at it whenever its mailbox wakes
/// it (`Mailbox::wake`).
#[derive(Default)]
struct Control {
    stop: AtomicBool,
    /// Exports removed so far: a ring that sees it move closes its
    /// connections to removed exports (`Export::is_removed`).
    removals: AtomicU64,
}

impl Control {
    fn stopping(&self) -> bool {
        self.stop.load(Ordering::Acquire)
    }

    fn removals(&self) -> u64 {
        self.removals.load(Ordering::Acquire)
    }
}

/// Commands one ring's mailbox holds before a sender is refused.
const MAILBOX: usize = 4096;

/// A running server.
pub struct NbdServer {
    exports: Arc<Exports>,
    mailboxes: Arc<Vec<Mailbox<Command>>>,
    control: Arc<Control>,
    threads: Vec<JoinHandle<()>>,
    listeners: Vec<Listener>,
    addrs: Vec<String>,
    /// Each ring's own counters, published in `exports` while the server runs.
    rings: Vec<Arc<RingCounters>>,
    /// The ring the next [`NbdServer::serve_connected`] socket goes to.
    next_connected: std::sync::atomic::AtomicUsize,
}

impl NbdServer {
    /// Serves a socket connected by other means (one end of a socketpair):
    /// the server greets it and negotiates as with an accepted client.
    /// Sockets are dealt to the rings round-robin; a ring whose mailbox
    /// is full is passed over for the next (nothing waits).
    pub(crate) fn serve_connected(&self, fd: OwnedFd) -> Result<(), Error> {
        let n = self.mailboxes.len();
        let first = self.next_connected.fetch_add(1, Ordering::Relaxed);
        let mut cmd = Command::Adopt(fd);
        for i in 0..n {
            match self.mailboxes[(first + i) % n].send(cmd) {
                Ok(()) => return Ok(()),
                Err(back) => cmd = back,
            }
        }
        Err(Error::Protocol("no ring took the connection (every mailbox full)"))
    }

    /// Binds every listener of `config.listen` and starts the ring
    /// threads. With no listener, connections come only through
    /// `NbdServer::serve_connected` (a process serving its own
    /// `/dev/nbdN` over socketpairs, `attach::local_sockets`).
    ///
    /// Its rings pin glibc's mmap and trim thresholds at 128 KiB for the
    /// whole process ([`volring_ring::IoRing::new`]): without that, an
    /// idle ring's trim could not give a burst's memory back.
    pub fn start(config: ServerConfig, exports: Arc<Exports>) -> Result<Self, Error> {
        let mut listeners = Vec::new();
        let mut addrs = Vec::new();
        for l in &config.listen {
            let (listener, addr) = Listener::bind(l)?;
            listeners.push(listener);
            addrs.push(addr);
        }
        let threads = if config.threads == 0 { default_rings() } else { config.threads };
        let mut boxes = Vec::with_capacity(threads);
        for _ in 0..threads {
            boxes.push(Mailbox::new(MAILBOX).map_err(Error::io("eventfd"))?);
        }
        let mailboxes = Arc::new(boxes);
        let control = Arc::new(Control::default());
        let budget = Arc::new(budget::ServerBudget::new(config.max_server_bytes));
        let accept: Vec<i32> = listeners.iter().map(|l| l.fd.as_raw_fd()).collect();
        let rings: Vec<Arc<RingCounters>> = (0..threads).map(|_| Arc::default()).collect();
        let mut handles = Vec::with_capacity(threads);
        for id in 0..threads {
            let (ready_tx, ready_rx) = std::sync::mpsc::sync_channel(1);
            let ctx = worker::Context {
                id,
                config: config.clone(),
                exports: exports.clone(),
                mailboxes: mailboxes.clone(),
                control: control.clone(),
                listeners: if id == 0 { accept.clone() } else { Vec::new() },
                budget: budget.clone(),
                counters: rings[id].clone(),
            };
            let h = std::thread::Builder::new()
                .name(format!("nbd-ring-{id}"))
                .spawn(move || worker::run(ctx, ready_tx))
                .map_err(Error::io("spawn ring thread"))?;
            match ready_rx.recv() {
                Ok(Ok(())) => handles.push(h),
                Ok(Err(e)) => {
                    let _ = h.join();
                    let server = NbdServer {
                        exports,
                        mailboxes,
                        control,
                        threads: handles,
                        listeners,
                        addrs,
                        rings,
                        next_connected: Default::default(),
                    };
                    drop(server);
                    // Out of memory is not an old kernel: the ring says what ran out.
                    let what = match e.kind() {
                        std::io::ErrorKind::OutOfMemory => "NBD ring",
                        _ => "NBD ring (needs io_uring with multishot receive, Linux 6.0+)",
                    };
                    return Err(Error::Io { what: what.into(), source: e });
                }
                Err(_) => return Err(Error::Protocol("ring thread died during start")),
            }
        }
        tracing::info!(addrs = ?addrs, threads, "NBD server listening");
        exports.set_rings(rings.clone());
        Ok(NbdServer { exports, mailboxes, control, threads: handles, listeners, addrs, rings, next_connected: Default::default() })
    }

    /// What the listeners are bound to (TCP with the real port).
    pub fn addresses(&self) -> &[String] {
        &self.addrs
    }

    pub fn exports(&self) -> &Arc<Exports> {
        &self.exports
    }

    pub fn add_export(&self, spec: &ExportSpec) -> Result<Arc<Export>, Error> {
        let e = self.exports.add(spec, None)?;
        tracing::info!(export = %e.name, path = %e.path.display(), size = e.size, read_only = e.read_only, direct = e.direct_io(), "export added");
        Ok(e)
    }

    /// Removes an export: new connections are refused at once, and every
    /// ring closes its connections to it once their requests are answered.
    pub fn remove_export(&self, name: &str) -> Result<(), Error> {
        self.exports.remove(name)?;
        self.control.removals.fetch_add(1, Ordering::AcqRel);
        for m in self.mailboxes.iter() {
            m.wake();
        }
        tracing::info!(export = %name, "export removed");
        Ok(())
    }

    /// Stops accepting, answers what is in flight, closes every connection
    /// and joins the ring threads.
    pub fn stop(mut self) {
        self.shutdown();
    }

    fn shutdown(&mut self) {
        self.control.stop.store(true, Ordering::Release);
        for m in self.mailboxes.iter() {
            m.wake();
        }
        for h in self.threads.drain(..) {
            let _ = h.join();
        }
        // Each removes its socket file only if it is still the one it bound.
        self.listeners.clear();
        // Rings that no longer run have no series on `/metrics`.
        self.exports.unset_rings(&self.rings);
    }
}

impl Drop for NbdServer {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// The rings a server starts with `threads: 0`, and the default config's
/// count: one per core, at most `DEFAULT_MAX_RINGS`.
pub(crate) fn default_rings() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get()).min(DEFAULT_MAX_RINGS)
}
