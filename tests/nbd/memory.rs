//! The server's memory budgets, per connection and for the server, against
//! hostile readers and list floods; memory comes back when they go.

use super::*;

/// A server child with these limits and `exports` (name, size,
/// description) as sparse images in `dir`.
fn child(dir: &std::path::Path, conn_bytes: u64, server_bytes: u64, exports: &[(String, u64, String)]) -> ChildServer {
    let mut list = Vec::new();
    for (name, size, description) in exports {
        let path = dir.join(format!("{name}.img"));
        std::fs::File::create(&path).and_then(|f| f.set_len(*size)).expect("image");
        list.push((name.clone(), path, description.clone()));
    }
    ChildServer::start(ChildSpec {
        socket: dir.join("nbd.sock"),
        threads: 2,
        conn_bytes: conn_bytes as usize,
        conn_requests: 512,
        server_bytes: server_bytes as usize,
        heap_cache: 2 << 20,
        stall_timeout_ms: 120_000,
        exports: list,
    })
}

/// Serves a well-behaved client on every ring (writes of 1 MiB, received
/// straight into their buffers; 16 MiB of writes just under 64 KiB, each
/// with its header filling one receive buffer, so every receive buffer is
/// filled twice over, as a stream of small requests fills them; reads of
/// 4 KiB), then waits for the rings to trim: the RSS after that is the
/// server's idle memory.
fn warm_up(srv: &ChildServer, export: &str) -> Result<u64, Failed> {
    let mut conns: Vec<RawClient> =
        (0..2).map(|_| RawClient::connect(&srv.spec.socket, export, HeaderStyle::Structured, false)).collect::<Result<_, _>>()?;
    for (i, c) in conns.iter_mut().enumerate() {
        for j in 0..24u64 {
            let off = (i as u64 * 24 + j) % 48 * MIB;
            check(c.call(cmd::WRITE, 0, off, MIB, &pattern(j, off, MIB as usize))?.error == 0, "warm-up write")?;
        }
        // 64 KiB on the wire each, header and payload: one receive buffer.
        let len = 65_536 - 28;
        for j in 0..256u64 {
            let off = j * 65_536;
            check(c.call(cmd::WRITE, 0, off, len, &pattern(j, off, len as usize))?.error == 0, "warm-up small write")?;
        }
        for j in 0..256u64 {
            check(c.call(cmd::READ, 0, j * 4096, 4096, &[])?.error == 0, "warm-up read")?;
        }
    }
    drop(conns);
    settled_rss(srv)
}

/// RSS once the rings have noticed they are idle and trimmed (an idle ring
/// trims on its next tick, 50-250 ms): at least 1.2 s after the clients
/// left, and then only once the RSS has stopped falling for a second (30 s
/// at most), so a ring delayed by a loaded host has trimmed too.
fn settled_rss(srv: &ChildServer) -> Result<u64, Failed> {
    std::thread::sleep(Duration::from_millis(1200));
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut low = srv.rss_kib();
    let mut since = Instant::now();
    while since.elapsed() < Duration::from_secs(1) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(100));
        let rss = srv.rss_kib();
        if rss < low {
            (low, since) = (rss, Instant::now());
        }
    }
    Ok(low)
}

/// Per client, the bytes written on it that its peer (the server's end)
/// has not read yet: the receive queue of the peer socket, from the
/// kernel's socket diagnostics as iproute2's `ss` shows them. `None` once
/// the server has closed its end.
fn unread_by_server(clients: &[&std::os::unix::net::UnixStream]) -> Result<Vec<Option<u64>>, Failed> {
    let out = std::process::Command::new("ss").args(["-xHn"]).output()?;
    check(out.status.success(), format!("ss -xHn: {}", String::from_utf8_lossy(&out.stderr)))?;
    // Netid State Recv-Q Send-Q Local Port Peer Port: the server's end
    // (bound to the socket path) names our socket's inode as its peer's
    // port, the last field.
    let text = String::from_utf8_lossy(&out.stdout);
    let mut queued = std::collections::HashMap::new();
    for line in text.lines() {
        let f: Vec<&str> = line.split_whitespace().collect();
        if let (true, Some(peer), Ok(q)) = (f.len() >= 8 && f[4] != "*", f.last(), f.get(2).unwrap_or(&"").parse::<u64>()) {
            queued.insert(peer.to_string(), q);
        }
    }
    clients.iter().map(|c| Ok(queued.get(&rustix::fs::fstat(c)?.st_ino.to_string()).copied())).collect()
}

/// Every thread of `pid` asleep (state S), and their CPU ticks in all.
fn threads_asleep(pid: u32) -> (bool, u64) {
    let mut asleep = true;
    let mut ticks = 0;
    for task in std::fs::read_dir(format!("/proc/{pid}/task")).into_iter().flatten().flatten() {
        let stat = std::fs::read_to_string(task.path().join("stat")).unwrap_or_default();
        // The fields after the command name's closing parenthesis: state
        // first, utime and stime 11th and 12th after it.
        let rest: Vec<&str> = stat.rsplit_once(") ").map(|(_, r)| r.split_whitespace().collect()).unwrap_or_default();
        asleep &= rest.first() == Some(&"S");
        ticks += rest.get(11..13).map_or(0, |t| t.iter().filter_map(|v| v.parse::<u64>().ok()).sum());
    }
    (asleep, ticks)
}

/// The server's peak RSS (VmHWM, which the kernel keeps: no peak is missed
/// between samples) once it has taken what it will of what `clients` sent
/// and has done with it. First the server must have read at least
/// `must_take` bytes of each client's `sent` (proof that it took the burst,
/// so the bound cannot pass before the server even looked; with 0, a
/// connection the server closed counts too); then it must be settled:
/// every thread asleep (not runnable, not in I/O), no CPU spent and
/// nothing more read between two looks 200 ms apart. 30 s at most.
fn peak_once_taken(srv: &ChildServer, clients: &[&std::os::unix::net::UnixStream], sent: u64, must_take: u64) -> Result<u64, Failed> {
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut last = None;
    loop {
        let unread = unread_by_server(clients)?;
        let took = unread.iter().all(|u| u.is_some_and(|u| sent.saturating_sub(u) >= must_take) || must_take == 0);
        let (asleep, ticks) = threads_asleep(srv.pid());
        let now = (unread, ticks);
        if took && asleep && last.as_ref() == Some(&now) {
            eprintln!("server settled; bytes it left unread per client: {:?}", now.0);
            return Ok(srv.hwm_kib());
        }
        check(
            Instant::now() < deadline,
            format!("the server never took {must_take} of {sent} bytes and settled: unread {:?}, asleep {asleep}", now.0),
        )?;
        last = (took && asleep).then_some(now);
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// Polls (at most 30 s) until the server's RSS is within 20% of `idle`.
fn memory_comes_back(srv: &ChildServer, idle: u64) -> Result<(), Failed> {
    let start = Instant::now();
    loop {
        let rss = srv.rss_kib();
        if rss * 10 <= idle * 12 {
            return Ok(());
        }
        if start.elapsed() > Duration::from_secs(30) {
            return Err(format!("RSS stayed at {rss} KiB after the clients left (idle: {idle} KiB)").into());
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// One 64 KiB burst of 60 KiB READs (2,340 of them) from a client that
/// never reads its replies: the server takes requests only while they fit
/// the connection's budget, one at a time, not the whole burst at once.
pub(super) fn one_burst_of_reads_is_admitted_request_by_request() -> Result<(), Failed> {
    let dir = tempfile::Builder::new().prefix("volring-nbd-burst-").tempdir()?;
    let conn_bytes = 8 * MIB;
    let srv = child(dir.path(), conn_bytes, 64 * MIB, &[("disk".into(), 64 * MIB, String::new())]);
    let idle = warm_up(&srv, "disk")?;
    let mut hog = RawClient::connect(&srv.spec.socket, "disk", HeaderStyle::Simple, false)?;
    let mut burst = Vec::with_capacity(64 * 1024);
    let mut n = 0u64;
    while burst.len() + 28 <= 64 * 1024 {
        let req = nbd_support::wire::Request { flags: 0, kind: cmd::READ, cookie: n, offset: n * 61_440 % (60 * MIB), length: 61_440 };
        nbd_support::wire::encode_request(&req, HeaderStyle::Simple, &mut burst);
        n += 1;
    }
    hog.s.write_all(&burst)?;
    // The server must have taken at least the requests whose replies fill
    // the connection's budget before its peak means anything.
    let per_request = burst.len() as u64 / n;
    let peak = peak_once_taken(&srv, &[&hog.s], burst.len() as u64, conn_bytes / 61_440 * per_request)?;
    let grown = peak.saturating_sub(idle);
    let bound = conn_bytes / 1024 + srv.spec.allowance_kib();
    eprintln!("burst: idle {idle} KiB, grew {grown} KiB, bound {bound} KiB");
    check(grown <= bound, format!("{n} pipelined READs grew the server by {grown} KiB (bound {bound} KiB, idle {idle} KiB)"))?;
    let mut other = RawClient::connect(&srv.spec.socket, "disk", HeaderStyle::Structured, false)?;
    check(other.call(cmd::READ, 0, 0, 4096, &[])?.error == 0, "another client is served meanwhile")?;
    drop((hog, other));
    memory_comes_back(&srv, idle)
}

/// 64 KiB of NBD_OPT_LIST options (4,096 of them) against 51 exports,
/// from a client that never reads: the handshake stops being read while
/// its replies wait, so memory stays flat.
pub(super) fn list_flood_in_the_handshake_is_bounded() -> Result<(), Failed> {
    let dir = tempfile::Builder::new().prefix("volring-nbd-list-").tempdir()?;
    let exports: Vec<(String, u64, String)> =
        (0..51).map(|i| (format!("vol{i:02}"), if i == 0 { 64 * MIB } else { MIB }, format!("volume {i} {}", "x".repeat(200)))).collect();
    let srv = child(dir.path(), 16 * MIB, 64 * MIB, &exports);
    let idle = warm_up(&srv, "vol00")?;
    let mut flood = std::os::unix::net::UnixStream::connect(&srv.spec.socket)?;
    flood.set_read_timeout(Some(Duration::from_secs(10)))?;
    let mut greeting = [0u8; 18];
    flood.read_exact(&mut greeting)?;
    let mut bytes = 3u32.to_be_bytes().to_vec();
    while bytes.len() + 16 <= 64 * 1024 + 4 {
        bytes.extend_from_slice(&nbd_support::wire::IHAVEOPT.to_be_bytes());
        bytes.extend_from_slice(&nbd_support::wire::opt::LIST.to_be_bytes());
        bytes.extend_from_slice(&0u32.to_be_bytes());
    }
    flood.write_all(&bytes)?;
    // Four LISTs (16 bytes each, after the 4 bytes of client flags) queue
    // some 48 KiB of replies, less than the handshake may hold before it
    // stops being read: the server must have taken at least those.
    let peak = peak_once_taken(&srv, &[&flood], bytes.len() as u64, 4 + 4 * 16)?;
    let grown = peak.saturating_sub(idle);
    let bound = srv.spec.allowance_kib();
    eprintln!("LIST flood: idle {idle} KiB, grew {grown} KiB, bound {bound} KiB");
    check(grown <= bound, format!("a LIST flood grew the server by {grown} KiB (bound {bound} KiB, idle {idle} KiB)"))?;
    let mut other = RawClient::connect(&srv.spec.socket, "vol07", HeaderStyle::Extended, false)?;
    check(other.call(cmd::READ, 0, 0, 4096, &[])?.error == 0, "another client is served during the flood")?;
    drop((flood, other));
    memory_comes_back(&srv, idle)
}

/// Eight connections each pipelining 20,000 4 KiB READs and reading no
/// reply: the server's memory stays under its budget (plus the fixed
/// allowance), a well-behaved client is served while they sit, and the
/// memory comes back once they leave.
pub(super) fn hostile_connections_stay_under_the_server_budget() -> Result<(), Failed> {
    let dir = tempfile::Builder::new().prefix("volring-nbd-hostile-").tempdir()?;
    let server_bytes = 48 * MIB;
    let srv = child(dir.path(), 16 * MIB, server_bytes, &[("disk".into(), 64 * MIB, String::new())]);
    let idle = warm_up(&srv, "disk")?;
    let sitting = hostile_readers(&srv, 8)?;
    let mut good = RawClient::connect(&srv.spec.socket, "disk", HeaderStyle::Structured, false)?;
    for i in 0..16u64 {
        let r = good.call(cmd::READ, 0, i * 4096, 4096, &[])?;
        check(r.error == 0 && r.data.len() == 4096, "a well-behaved client is served while the hostile ones sit")?;
    }
    // Each hostile client wrote until the server stopped reading it; the
    // peak is read once the server has settled.
    let peak = peak_once_taken(&srv, &sitting.iter().map(|c| &c.s).collect::<Vec<_>>(), 0, 0)?;
    let grown = peak.saturating_sub(idle);
    let bound = server_bytes / 1024 + srv.spec.allowance_kib();
    eprintln!("8 hostile: idle {idle} KiB, grew {grown} KiB, bound {bound} KiB");
    check(grown <= bound, format!("8 hostile connections grew the server by {grown} KiB (bound {bound} KiB, idle {idle} KiB)"))?;
    drop(sitting);
    drop(good);
    memory_comes_back(&srv, idle)
}

/// `n` connections each pipelining up to 20,000 4 KiB READs until the
/// server stops reading them, none reading a reply; kept open.
fn hostile_readers(srv: &ChildServer, n: u64) -> Result<Vec<RawClient>, Failed> {
    let hostile: Vec<_> = (0..n)
        .map(|h| {
            let socket = srv.spec.socket.clone();
            std::thread::spawn(move || -> std::io::Result<(RawClient, u64)> {
                let mut c = RawClient::connect(&socket, "disk", HeaderStyle::Structured, false)?;
                c.s.set_write_timeout(Some(Duration::from_secs(2)))?;
                let mut sent = 0u64;
                let mut chunk = Vec::new();
                for batch in 0..200u64 {
                    chunk.clear();
                    for i in 0..100u64 {
                        let n = batch * 100 + i;
                        let req = nbd_support::wire::Request {
                            flags: 0,
                            kind: cmd::READ,
                            cookie: n,
                            offset: (h * 7919 + n) * 4096 % (64 * MIB),
                            length: 4096,
                        };
                        nbd_support::wire::encode_request(&req, HeaderStyle::Structured, &mut chunk);
                    }
                    // The server stops reading: the write times out and this client sits.
                    if c.s.write_all(&chunk).is_err() {
                        break;
                    }
                    sent += 100;
                }
                Ok((c, sent))
            })
        })
        .collect();
    let mut sitting = Vec::new();
    for t in hostile {
        let (c, sent) = t.join().map_err(|_| "hostile client panicked")??;
        check(sent >= 100, format!("a hostile client sent only {sent} requests"))?;
        sitting.push(c);
    }
    Ok(sitting)
}

/// 40 such connections fill even the share kept for light connections:
/// the server drops the heaviest stalled ones, so a new client is still
/// served and memory stays under the budget.
pub(super) fn many_hostile_connections_do_not_starve_others() -> Result<(), Failed> {
    let dir = tempfile::Builder::new().prefix("volring-nbd-starve-").tempdir()?;
    let server_bytes = 48 * MIB;
    let srv = child(dir.path(), 16 * MIB, server_bytes, &[("disk".into(), 64 * MIB, String::new())]);
    let idle = warm_up(&srv, "disk")?;
    let sitting = hostile_readers(&srv, 40)?;
    let mut good = RawClient::connect(&srv.spec.socket, "disk", HeaderStyle::Structured, false)?;
    for i in 0..16u64 {
        let r = good.call(cmd::READ, 0, i * 4096, 4096, &[])?;
        check(r.error == 0 && r.data.len() == 4096, "a well-behaved client is served while 40 hostile ones sit")?;
    }
    let peak = peak_once_taken(&srv, &sitting.iter().map(|c| &c.s).collect::<Vec<_>>(), 0, 0)?;
    let grown = peak.saturating_sub(idle);
    let bound = server_bytes / 1024 + srv.spec.allowance_kib();
    eprintln!("40 hostile: idle {idle} KiB, grew {grown} KiB, bound {bound} KiB");
    check(grown <= bound, format!("40 hostile connections grew the server by {grown} KiB (bound {bound} KiB)"))?;
    drop((sitting, good));
    memory_comes_back(&srv, idle)
}
