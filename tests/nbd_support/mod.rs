//! Fixtures for the NBD tests: an in-process server on a scratch unix
//! socket, the `volring nbd serve` binary as a child process (for kill -9),
//! and a small raw client for requests no well-behaved client sends.

#![allow(dead_code)]

use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use volring_nbd::{ExportSpec, Exports, Listen, NbdServer, ServerConfig};

pub mod wire;

use wire::{cmd, opt, HeaderStyle, Request};

pub const MIB: u64 = 1 << 20;

/// A scratch directory with an image and an in-process server on a socket in it.
pub struct Served {
    pub dir: tempfile::TempDir,
    pub socket: PathBuf,
    pub server: Option<NbdServer>,
}

impl Served {
    /// A server with `exports` (name, size, read-only) as sparse images.
    pub fn new(exports: &[(&str, u64, bool)]) -> Self {
        Self::with_config(exports, |_| {})
    }

    pub fn with_config(exports: &[(&str, u64, bool)], tweak: impl FnOnce(&mut ServerConfig)) -> Self {
        let dir = tempfile::Builder::new().prefix("volring-nbd-").tempdir().expect("tempdir");
        let socket = dir.path().join("nbd.sock");
        let mut config = ServerConfig { listen: vec![Listen::Unix(socket.clone())], threads: 2, ..Default::default() };
        tweak(&mut config);
        let server = NbdServer::start(config, Arc::new(Exports::default())).expect("server starts");
        let s = Served { dir, socket, server: Some(server) };
        for &(name, size, ro) in exports {
            let path = s.image(name);
            std::fs::File::create(&path).and_then(|f| f.set_len(size)).expect("image");
            s.add(name, &path, ro, 0);
        }
        s
    }

    pub fn image(&self, name: &str) -> PathBuf {
        self.dir.path().join(format!("{name}.img"))
    }

    pub fn add(&self, name: &str, path: &Path, read_only: bool, limit: u32) {
        let spec = ExportSpec {
            name: name.into(),
            path: path.into(),
            read_only,
            direct_io: false,
            max_connections: limit,
            description: format!("test export {name}"),
        };
        self.server().add_export(&spec).expect("export added");
    }

    pub fn server(&self) -> &NbdServer {
        self.server.as_ref().expect("running")
    }

    pub fn uri(&self, export: &str) -> String {
        format!("nbd+unix:///{export}?socket={}", self.socket.display())
    }
}

impl Drop for Served {
    fn drop(&mut self) {
        if let Some(s) = self.server.take() {
            s.stop();
        }
    }
}

/// Runs a command with a time limit; returns (success, stdout, stderr).
pub fn run(program: &str, args: &[&str], limit: Duration) -> (bool, String, String) {
    let mut child = Command::new(program)
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("{program}: {e}"));
    let (mut out, mut err) = (child.stdout.take().expect("piped"), child.stderr.take().expect("piped"));
    let t_out = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = out.read_to_string(&mut s);
        s
    });
    let t_err = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = err.read_to_string(&mut s);
        s
    });
    let deadline = std::time::Instant::now() + limit;
    let status = loop {
        if let Some(st) = child.try_wait().expect("wait") {
            break Some(st);
        }
        if std::time::Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    let (o, e) = (t_out.join().unwrap_or_default(), t_err.join().unwrap_or_default());
    let e = if status.is_none() { format!("{e}\n(killed after {limit:?})") } else { e };
    (status.is_some_and(|s| s.success()), o, e)
}

/// `volring nbd serve` as a child process, for what needs a separate
/// process (kill -9). Killed by PID on drop.
pub struct ServeProcess {
    pub child: Child,
    pub socket: PathBuf,
    pub stdout: BufReader<std::process::ChildStdout>,
}

impl ServeProcess {
    pub fn start(socket: &Path, exports: &[String]) -> Self {
        let args: Vec<String> = exports.iter().flat_map(|e| ["--export".to_string(), e.clone()]).collect();
        Self::start_with(socket, &args)
    }

    /// `volring nbd serve --unix SOCKET --nbd-threads 2 ARGS...`
    pub fn start_with(socket: &Path, args: &[String]) -> Self {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_volring"));
        cmd.args(["nbd", "serve", "--unix"]).arg(socket).args(["--nbd-threads", "2"]).args(args);
        let mut child = cmd.stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::inherit()).spawn().expect("spawn volring nbd serve");
        let mut stdout = BufReader::new(child.stdout.take().expect("piped"));
        let mut line = String::new();
        stdout.read_line(&mut line).expect("first line");
        assert!(line.contains("listening"), "server said {line:?}");
        ServeProcess { child, socket: socket.into(), stdout }
    }

    pub fn kill_hard(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for ServeProcess {
    fn drop(&mut self) {
        if self.child.try_wait().ok().flatten().is_none() {
            let _ = rustix::process::kill_process(
                rustix::process::Pid::from_raw(self.child.id() as i32).expect("pid"),
                rustix::process::Signal::TERM,
            );
            for _ in 0..200 {
                if self.child.try_wait().ok().flatten().is_some() {
                    return;
                }
                std::thread::sleep(Duration::from_millis(10));
            }
            self.kill_hard();
        }
    }
}

/// One answer to a request.
#[derive(Debug, Default)]
pub struct Reply {
    pub cookie: u64,
    pub error: u32,
    pub data: Vec<u8>,
    /// (length, flags) of a BLOCK_STATUS reply.
    pub extents: Vec<(u64, u32)>,
    pub holes: u32,
    /// The reply came as a simple reply (16 bytes, no chunks).
    pub simple: bool,
}

/// A raw client: does the handshake, then sends and reads whatever it is told.
pub struct RawClient {
    pub s: UnixStream,
    pub style: HeaderStyle,
    pub size: u64,
    pub flags: u16,
    next: u64,
}

fn option(s: &mut UnixStream, code: u32, data: &[u8]) {
    let mut b = wire::IHAVEOPT.to_be_bytes().to_vec();
    b.extend_from_slice(&code.to_be_bytes());
    b.extend_from_slice(&(data.len() as u32).to_be_bytes());
    b.extend_from_slice(data);
    s.write_all(&b).expect("send option");
}

/// Reads one option reply: (type, data).
fn option_reply(s: &mut UnixStream) -> std::io::Result<(u32, Vec<u8>)> {
    let mut h = [0u8; 20];
    s.read_exact(&mut h)?;
    let kind = u32::from_be_bytes(h[12..16].try_into().unwrap());
    let len = u32::from_be_bytes(h[16..20].try_into().unwrap()) as usize;
    let mut d = vec![0u8; len];
    s.read_exact(&mut d)?;
    Ok((kind, d))
}

impl RawClient {
    /// Connects and negotiates `style`, `base:allocation` when `meta`, then GO.
    pub fn connect(socket: &Path, export: &str, style: HeaderStyle, meta: bool) -> std::io::Result<Self> {
        let mut s = UnixStream::connect(socket)?;
        s.set_read_timeout(Some(Duration::from_secs(20)))?;
        let mut greeting = [0u8; 18];
        s.read_exact(&mut greeting)?;
        s.write_all(&3u32.to_be_bytes())?;
        match style {
            HeaderStyle::Simple => {}
            HeaderStyle::Structured => option(&mut s, opt::STRUCTURED_REPLY, &[]),
            HeaderStyle::Extended => option(&mut s, opt::EXTENDED_HEADERS, &[]),
        }
        if style != HeaderStyle::Simple {
            let (k, _) = option_reply(&mut s)?;
            assert_eq!(k, wire::rep::ACK);
        }
        if meta {
            let mut d = (export.len() as u32).to_be_bytes().to_vec();
            d.extend_from_slice(export.as_bytes());
            d.extend_from_slice(&1u32.to_be_bytes());
            d.extend_from_slice(&(wire::BASE_ALLOCATION.len() as u32).to_be_bytes());
            d.extend_from_slice(wire::BASE_ALLOCATION.as_bytes());
            option(&mut s, opt::SET_META_CONTEXT, &d);
            while option_reply(&mut s)?.0 != wire::rep::ACK {}
        }
        let mut d = (export.len() as u32).to_be_bytes().to_vec();
        d.extend_from_slice(export.as_bytes());
        d.extend_from_slice(&0u16.to_be_bytes());
        option(&mut s, opt::GO, &d);
        let (mut size, mut flags) = (0, 0);
        loop {
            let (k, d) = option_reply(&mut s)?;
            match k {
                wire::rep::INFO if d.len() >= 12 && d[..2] == [0, 0] => {
                    size = u64::from_be_bytes(d[2..10].try_into().unwrap());
                    flags = u16::from_be_bytes(d[10..12].try_into().unwrap());
                }
                wire::rep::INFO => {}
                wire::rep::ACK => break,
                k => return Err(std::io::Error::other(format!("GO refused: {k:#x} {}", String::from_utf8_lossy(&d)))),
            }
        }
        Ok(RawClient { s, style, size, flags, next: 1 })
    }

    /// Sends a request (with `payload` for WRITE) and returns its cookie.
    pub fn send(&mut self, kind: u16, flags: u16, offset: u64, length: u64, payload: &[u8]) -> std::io::Result<u64> {
        let cookie = self.next;
        self.next += 1;
        let mut b = Vec::with_capacity(32 + payload.len());
        wire::encode_request(&Request { flags, kind, cookie, offset, length }, self.style, &mut b);
        b.extend_from_slice(payload);
        self.s.write_all(&b)?;
        Ok(cookie)
    }

    /// Reads one whole reply (every chunk of a structured one). `read_len`
    /// is the length of the READ it answers (simple replies carry no length).
    /// With structured replies the server may answer anything but a READ
    /// with a simple reply, so the first 16 bytes say which came (as
    /// libnbd reads them); extended headers allow only extended replies.
    pub fn reply(&mut self, read_len: Option<usize>) -> std::io::Result<Reply> {
        let mut r = Reply::default();
        let extended = self.style == HeaderStyle::Extended;
        let mut first = [0u8; 16];
        self.s.read_exact(&mut first)?;
        let magic = u32::from_be_bytes(first[..4].try_into().unwrap());
        let expected = match self.style {
            HeaderStyle::Simple => wire::SIMPLE_REPLY_MAGIC,
            HeaderStyle::Structured if magic == wire::SIMPLE_REPLY_MAGIC && read_len.is_none() => wire::SIMPLE_REPLY_MAGIC,
            HeaderStyle::Structured => wire::STRUCTURED_REPLY_MAGIC,
            HeaderStyle::Extended => wire::EXTENDED_REPLY_MAGIC,
        };
        assert_eq!(magic, expected, "reply magic for {:?} (a READ: {})", self.style, read_len.is_some());
        if magic == wire::SIMPLE_REPLY_MAGIC {
            r.simple = true;
            r.error = u32::from_be_bytes(first[4..8].try_into().unwrap());
            r.cookie = u64::from_be_bytes(first[8..16].try_into().unwrap());
            if r.error == 0 {
                if let Some(n) = read_len {
                    r.data = vec![0; n];
                    self.s.read_exact(&mut r.data)?;
                }
            }
            return Ok(r);
        }
        let mut h = first.to_vec();
        loop {
            h.resize(if extended { 32 } else { 20 }, 0);
            self.s.read_exact(&mut h[16..])?;
            let flags = u16::from_be_bytes(h[4..6].try_into().unwrap());
            let kind = u16::from_be_bytes(h[6..8].try_into().unwrap());
            r.cookie = u64::from_be_bytes(h[8..16].try_into().unwrap());
            let len = if extended {
                u64::from_be_bytes(h[24..32].try_into().unwrap())
            } else {
                u64::from(u32::from_be_bytes(h[16..20].try_into().unwrap()))
            };
            let mut p = vec![0u8; len as usize];
            self.s.read_exact(&mut p)?;
            match kind {
                wire::chunk::OFFSET_DATA => r.data.extend_from_slice(&p[8..]),
                wire::chunk::OFFSET_HOLE => {
                    r.holes += 1;
                    let n = u32::from_be_bytes(p[8..12].try_into().unwrap());
                    r.data.resize(r.data.len() + n as usize, 0);
                }
                wire::chunk::ERROR => r.error = u32::from_be_bytes(p[..4].try_into().unwrap()),
                wire::chunk::BLOCK_STATUS => {
                    for d in p[4..].chunks_exact(8) {
                        r.extents.push((
                            u64::from(u32::from_be_bytes(d[..4].try_into().unwrap())),
                            u32::from_be_bytes(d[4..].try_into().unwrap()),
                        ));
                    }
                }
                wire::chunk::BLOCK_STATUS_EXT => {
                    for d in p[8..].chunks_exact(16) {
                        r.extents
                            .push((u64::from_be_bytes(d[..8].try_into().unwrap()), u64::from_be_bytes(d[8..].try_into().unwrap()) as u32));
                    }
                }
                _ => {}
            }
            if flags & wire::chunk::FLAG_DONE != 0 {
                return Ok(r);
            }
            h.resize(16, 0);
            self.s.read_exact(&mut h)?;
            assert_eq!(u32::from_be_bytes(h[..4].try_into().unwrap()), expected, "every chunk of a reply has its magic");
        }
    }

    /// A request and its reply.
    pub fn call(&mut self, kind: u16, flags: u16, offset: u64, length: u64, payload: &[u8]) -> std::io::Result<Reply> {
        let c = self.send(kind, flags, offset, length, payload)?;
        let r = self.reply((kind == cmd::READ).then_some(length as usize))?;
        assert_eq!(r.cookie, c, "reply to the request just sent");
        Ok(r)
    }
}

/// A deterministic byte pattern for (seed, offset).
pub fn pattern(seed: u64, offset: u64, len: usize) -> Vec<u8> {
    (0..len as u64).map(|i| ((offset + i).wrapping_mul(0x9e37_79b9) ^ seed.wrapping_mul(31)) as u8).collect()
}

/// A small deterministic generator (xorshift), for random workloads.
pub struct Rng(pub u64);

impl Rng {
    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    pub fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// Resident set size of this process, from /proc/self/status.
pub fn rss_kib(pid: Option<u32>) -> u64 {
    let path = pid.map_or("/proc/self/status".to_string(), |p| format!("/proc/{p}/status"));
    std::fs::read_to_string(path)
        .ok()
        .and_then(|s| s.lines().find(|l| l.starts_with("VmRSS:")).and_then(|l| l.split_whitespace().nth(1)?.parse().ok()))
        .unwrap_or(0)
}

/// Field `name` (in KiB) of /proc/PID/status: VmRSS, VmHWM.
pub fn status_kib(pid: u32, name: &str) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| s.lines().find(|l| l.starts_with(name)).and_then(|l| l.split_whitespace().nth(1)?.parse().ok()))
        .unwrap_or(0)
}

/// The environment variable that turns the test binary into a server.
const CHILD_ENV: &str = "VOLRING_NBD_TEST_SERVER";

/// What a server child runs with: its limits and its exports.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct ChildSpec {
    pub socket: PathBuf,
    pub threads: usize,
    pub conn_bytes: usize,
    pub conn_requests: u32,
    pub server_bytes: usize,
    /// Freed buffers each ring keeps.
    pub heap_cache: usize,
    pub stall_timeout_ms: u64,
    /// (name, image path, description)
    pub exports: Vec<(String, PathBuf, String)>,
}

impl ChildSpec {
    /// The memory a server may hold beyond its budget, from its sizes:
    /// each ring's provided receive buffers (filled by any client, not
    /// charged: they are the ring's, not a connection's) and its cache of
    /// freed buffers, plus 16 MiB for what is neither a buffer nor
    /// received bytes (connection and request records, allocator slack,
    /// thread stacks touched under load).
    pub fn allowance_kib(&self) -> u64 {
        let ring = volring_ring::IoRingConfig::default();
        let per_ring = usize::from(ring.recv_bufs) * ring.recv_buf_size + self.heap_cache;
        ((self.threads * per_ring) as u64 + 16 * MIB) / 1024
    }
}

/// A server in a process of its own (this test binary, re-executed), so
/// its memory can be read from /proc without the tests' own. Killed by
/// PID on drop.
pub struct ChildServer {
    pub child: Child,
    pub spec: ChildSpec,
}

impl ChildServer {
    pub fn start(spec: ChildSpec) -> Self {
        let exe = std::env::current_exe().expect("test binary");
        let mut child = Command::new(exe)
            .env(CHILD_ENV, serde_json::to_string(&spec).expect("spec"))
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawn server child");
        let mut line = String::new();
        BufReader::new(child.stdout.take().expect("piped")).read_line(&mut line).expect("first line");
        assert!(line.contains("listening"), "server child said {line:?}");
        ChildServer { child, spec }
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    pub fn rss_kib(&self) -> u64 {
        status_kib(self.pid(), "VmRSS:")
    }

    /// Peak RSS since the process started.
    pub fn hwm_kib(&self) -> u64 {
        status_kib(self.pid(), "VmHWM:")
    }
}

impl Drop for ChildServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// When the test binary was started as a server child: serve until stdin
/// closes (the test ended or died), then exit. Returns otherwise.
pub fn child_server_main() {
    let Ok(spec) = std::env::var(CHILD_ENV) else { return };
    let spec: ChildSpec = serde_json::from_str(&spec).expect("child spec");
    let ring = volring_ring::IoRingConfig { heap_cache: spec.heap_cache, ..Default::default() };
    let config = ServerConfig {
        listen: vec![Listen::Unix(spec.socket.clone())],
        threads: spec.threads,
        max_queued_bytes: spec.conn_bytes,
        max_requests: spec.conn_requests,
        max_server_bytes: spec.server_bytes,
        stall_timeout: Duration::from_millis(spec.stall_timeout_ms),
        ring,
        ..Default::default()
    };
    let server = NbdServer::start(config, Arc::new(Exports::default())).expect("server starts");
    for (name, path, description) in &spec.exports {
        let e = ExportSpec {
            name: name.clone(),
            path: path.clone(),
            read_only: false,
            direct_io: false,
            max_connections: 0,
            description: description.clone(),
        };
        server.add_export(&e).expect("export added");
    }
    println!("listening");
    let mut sink = Vec::new();
    let _ = std::io::stdin().read_to_end(&mut sink);
    server.stop();
    std::process::exit(0);
}
