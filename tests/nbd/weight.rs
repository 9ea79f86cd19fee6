//! A ring thread's scheduler weight follows its busy connections: the
//! server as a child process, its ring threads' nice read from /proc while
//! raw clients keep reading, and again once they are quiet.

use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::common::check;
use super::nbd_support::wire::{cmd, encode_request, HeaderStyle, Request};
use super::nbd_support::{RawClient, ServeProcess, MIB};
use libtest_mimic::Failed;

/// Clients kept busy at once: with the server's two rings, at least one
/// ring carries four of them.
const CLIENTS: usize = 8;

/// Each thread of `pid`: its id, command name and nice (field 19 of its
/// stat, counted after the command name's closing parenthesis).
fn threads(pid: u32) -> Vec<(String, String, i64)> {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else { return Vec::new() };
    let mut all = Vec::new();
    for t in tasks.flatten() {
        let comm = std::fs::read_to_string(t.path().join("comm")).unwrap_or_default();
        let stat = std::fs::read_to_string(t.path().join("stat")).unwrap_or_default();
        let after = stat.rsplit_once(')').map_or("", |(_, rest)| rest);
        // After ")": state is field 3, so nice (19) is the 17th.
        if let Some(n) = after.split_whitespace().nth(16).and_then(|n| n.parse().ok()) {
            all.push((t.file_name().to_string_lossy().into_owned(), comm.trim().to_string(), n));
        }
    }
    all
}

/// The nice this test runs at, which the server inherits: the rings start
/// there and come back there (a harness run under `nice` moves both).
fn base() -> i64 {
    i64::from(rustix::process::getpriority_process(None).unwrap_or(0))
}

/// The nice of each of `pid`'s NBD ring threads, relative to [`base`].
fn ring_nices(pid: u32) -> Vec<i64> {
    let base = base();
    threads(pid).into_iter().filter(|(_, comm, _)| comm.starts_with("nbd-ring")).map(|(_, _, n)| n - base).collect()
}

/// From one look at `pid`'s threads: whether its rings have io_uring
/// workers (`iou-wrk-<ring's tid>`), and each worker whose nice differs
/// from its ring's, as (worker's nice, ring's nice).
fn ring_workers(pid: u32) -> (bool, Vec<(i64, i64)>) {
    let all = threads(pid);
    let rings: Vec<(&str, i64)> = all.iter().filter(|(_, c, _)| c.starts_with("nbd-ring")).map(|(t, _, n)| (t.as_str(), *n)).collect();
    let workers: Vec<(i64, i64)> = all
        .iter()
        .filter_map(|(_, comm, n)| {
            let ring = rings.iter().find(|(tid, _)| comm.strip_prefix("iou-wrk-") == Some(tid))?;
            Some((*n, ring.1))
        })
        .collect();
    (!workers.is_empty(), workers.into_iter().filter(|(w, r)| w != r).collect())
}

/// Reading clients on `sock` until `stop` is set.
fn busy_clients(sock: &Path, stop: &Arc<AtomicBool>) -> Vec<std::thread::JoinHandle<std::io::Result<u64>>> {
    (0..CLIENTS)
        .map(|i| {
            let (sock, stop) = (sock.to_path_buf(), stop.clone());
            std::thread::spawn(move || {
                let mut c = RawClient::connect(&sock, "disk", HeaderStyle::Structured, false)?;
                let mut reads = 0u64;
                // Bounded even if the stop never comes.
                let until = Instant::now() + Duration::from_secs(60);
                while !stop.load(Ordering::Relaxed) && Instant::now() < until {
                    let r = c.call(cmd::READ, 0, (i as u64 + reads) * 4096 % MIB, 4096, &[])?;
                    if r.error != 0 {
                        return Err(std::io::Error::other(format!("READ answered errno {}", r.error)));
                    }
                    reads += 1;
                }
                Ok(reads)
            })
        })
        .collect()
}

/// Polls `pid`'s ring nices until `done` holds for them (at most `limit`).
fn nices_until(pid: u32, limit: Duration, done: impl Fn(&[i64]) -> bool) -> Vec<i64> {
    let start = Instant::now();
    loop {
        let nices = ring_nices(pid);
        if done(&nices) || start.elapsed() > limit {
            return nices;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn serve(dir: &Path, extra: &[&str]) -> Result<ServeProcess, Failed> {
    let img = dir.join("disk.img");
    std::fs::File::create(&img)?.set_len(MIB)?;
    let mut args = vec!["--export".to_string(), format!("disk={}", img.display())];
    args.extend(extra.iter().map(|s| s.to_string()));
    Ok(ServeProcess::start_with(&dir.join("nbd.sock"), &args))
}

/// With eight clients reading, a ring carrying several of them runs at
/// the weight of that many threads (nice below 0); once they stop, every
/// ring is back where it started (nice 0 relative to the harness).
pub(super) fn a_ring_takes_the_weight_of_its_busy_connections() -> Result<(), Failed> {
    let dir = tempfile::Builder::new().prefix("volring-nbd-weight-").tempdir()?;
    let server = serve(dir.path(), &[])?;
    let pid = server.child.id();
    check(ring_nices(pid) == [0, 0], format!("rings start at nice 0: {:?}", ring_nices(pid)))?;
    let stop = Arc::new(AtomicBool::new(false));
    let clients = busy_clients(&server.socket, &stop);
    let busy = nices_until(pid, Duration::from_secs(20), |n| n.iter().any(|&x| x <= -3));
    stop.store(true, Ordering::Relaxed);
    for c in clients {
        let reads = c.join().map_err(|_| "client panicked")??;
        check(reads > 0, "every client read")?;
    }
    // The lowest a ring may go is the weight of about nine threads.
    check(busy.iter().any(|&x| x <= -3) && busy.iter().all(|&x| x >= -10), format!("nices while busy: {busy:?}"))?;
    let quiet = nices_until(pid, Duration::from_secs(20), |n| !n.is_empty() && n.iter().all(|&x| x == 0));
    check(quiet.len() == 2 && quiet.iter().all(|&x| x == 0), format!("nices once quiet: {quiet:?}"))?;
    Ok(())
}

/// One client that keeps eight READs in flight (sent in one write, so one
/// receive carries them) gives its ring the weight of two threads (nice
/// -3), where a server with a pool of threads per connection would run
/// several for it; the other ring stays at 0, and once the client stops
/// both are back at 0.
pub(super) fn a_deep_connection_takes_two_threads_weight() -> Result<(), Failed> {
    let dir = tempfile::Builder::new().prefix("volring-nbd-weight-").tempdir()?;
    let server = serve(dir.path(), &[])?;
    let pid = server.child.id();
    let stop = Arc::new(AtomicBool::new(false));
    let (sock, until_stop) = (server.socket.clone(), stop.clone());
    let client = std::thread::spawn(move || -> std::io::Result<u64> {
        use std::io::Write;
        let mut c = RawClient::connect(&sock, "disk", HeaderStyle::Structured, false)?;
        let mut batches = 0u64;
        // Bounded even if the stop never comes.
        let until = Instant::now() + Duration::from_secs(60);
        while !until_stop.load(Ordering::Relaxed) && Instant::now() < until {
            let mut b = Vec::new();
            for i in 0..8u64 {
                let req = Request { flags: 0, kind: cmd::READ, cookie: i + 1, offset: i * 4096, length: 4096 };
                encode_request(&req, HeaderStyle::Structured, &mut b);
            }
            c.s.write_all(&b)?;
            for _ in 0..8 {
                let r = c.reply(Some(4096))?;
                if r.error != 0 {
                    return Err(std::io::Error::other(format!("READ answered errno {}", r.error)));
                }
            }
            batches += 1;
        }
        Ok(batches)
    });
    let busy = nices_until(pid, Duration::from_secs(20), |n| n.contains(&-3));
    stop.store(true, Ordering::Relaxed);
    let batches = client.join().map_err(|_| "client panicked")??;
    check(batches > 0, "the client read")?;
    check(busy.len() == 2 && busy.contains(&-3) && busy.contains(&0), format!("nices with one deep client: {busy:?}"))?;
    let quiet = nices_until(pid, Duration::from_secs(20), |n| !n.is_empty() && n.iter().all(|&x| x == 0));
    check(quiet.len() == 2 && quiet.iter().all(|&x| x == 0), format!("nices once quiet: {quiet:?}"))
}

/// A ring's io_uring workers run at its weight: with every read handed to
/// the workers, the workers started before the ring's first tick (at nice
/// 0) are reniced with it, and those started after inherit it.
pub(super) fn a_rings_workers_take_its_weight() -> Result<(), Failed> {
    let dir = tempfile::Builder::new().prefix("volring-nbd-weight-").tempdir()?;
    let server = serve(dir.path(), &["--nbd-offload-reads", "always"])?;
    let pid = server.child.id();
    let stop = Arc::new(AtomicBool::new(false));
    let clients = busy_clients(&server.socket, &stop);
    // Judged on one look at the threads: a tick between two looks could
    // show a ring already reniced and its workers not yet.
    let start = Instant::now();
    let (nices, workers, off) = loop {
        let (nices, (workers, off)) = (ring_nices(pid), ring_workers(pid));
        let settled = nices.iter().any(|&x| x <= -3) && workers && off.is_empty();
        if settled || start.elapsed() > Duration::from_secs(20) {
            break (nices, workers, off);
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    stop.store(true, Ordering::Relaxed);
    for c in clients {
        c.join().map_err(|_| "client panicked")??;
    }
    check(nices.iter().any(|&x| x <= -3), format!("ring nices while busy: {nices:?}"))?;
    check(workers, "no io_uring worker served the offloaded reads")?;
    check(off.is_empty(), format!("workers not at their ring's nice (worker, ring): {off:?}"))
}

/// `--nbd-no-ring-weight` keeps every ring at its nice through the same load.
pub(super) fn no_ring_weight_keeps_rings_at_their_nice() -> Result<(), Failed> {
    let dir = tempfile::Builder::new().prefix("volring-nbd-weight-").tempdir()?;
    let server = serve(dir.path(), &["--nbd-no-ring-weight"])?;
    let pid = server.child.id();
    let stop = Arc::new(AtomicBool::new(false));
    let clients = busy_clients(&server.socket, &stop);
    // A ring with the rule on lowers its nice within a tick (250 ms);
    // two seconds of load is eight ticks.
    let seen = nices_until(pid, Duration::from_secs(2), |n| n.iter().any(|&x| x != 0));
    stop.store(true, Ordering::Relaxed);
    for c in clients {
        c.join().map_err(|_| "client panicked")??;
    }
    check(seen.len() == 2 && seen.iter().all(|&x| x == 0), format!("nices with the rule off: {seen:?}"))?;
    Ok(())
}

/// The first CPU this test may run on, alone in a set.
fn first_cpu() -> std::io::Result<rustix::thread::CpuSet> {
    let mine = rustix::thread::sched_getaffinity(None)?;
    let first = (0..rustix::thread::CpuSet::MAX_CPU).find(|&c| mine.is_set(c)).unwrap_or(0);
    let mut one = rustix::thread::CpuSet::new();
    one.set(first);
    Ok(one)
}

/// Pins every thread of `pid` (the server's rings among them) to `cpu`;
/// a thread that ended meanwhile is skipped.
fn pin_threads(pid: u32, cpu: &rustix::thread::CpuSet) -> std::io::Result<()> {
    for t in std::fs::read_dir(format!("/proc/{pid}/task"))?.flatten() {
        let tid = t.file_name().to_str().and_then(|t| t.parse().ok()).and_then(rustix::process::Pid::from_raw);
        if let Some(tid) = tid {
            match rustix::thread::sched_setaffinity(Some(tid), cpu) {
                Ok(()) | Err(rustix::io::Errno::SRCH) => {}
                Err(e) => return Err(e.into()),
            }
        }
    }
    Ok(())
}

/// One client at queue depth 1 is one busy connection: alone it leaves
/// its ring at nice 0. With the server's rings pinned to one CPU that two
/// spinners share, the client's ring waits for its CPU most of the time,
/// and it asks for more (a starved tick: nice -4 or lower; the other ring
/// stays at 0); once the client stops, both are back at 0.
pub(super) fn a_starved_ring_takes_more_than_its_connections_weight() -> Result<(), Failed> {
    let dir = tempfile::Builder::new().prefix("volring-nbd-weight-").tempdir()?;
    let server = serve(dir.path(), &[])?;
    let pid = server.child.id();
    let cpu = first_cpu()?;
    pin_threads(pid, &cpu)?;
    let stop = Arc::new(AtomicBool::new(false));
    // Bounded even if the stop never comes.
    let until = Instant::now() + Duration::from_secs(60);
    let spinners: Vec<_> = (0..2)
        .map(|_| {
            let stop = stop.clone();
            std::thread::spawn(move || {
                let _ = rustix::thread::sched_setaffinity(None, &cpu);
                let mut spins = 0u64;
                while !stop.load(Ordering::Relaxed) && Instant::now() < until {
                    spins = std::hint::black_box(spins.wrapping_add(1));
                }
            })
        })
        .collect();
    let (sock, client_stop) = (server.socket.clone(), stop.clone());
    let client = std::thread::spawn(move || -> std::io::Result<u64> {
        let mut c = RawClient::connect(&sock, "disk", HeaderStyle::Structured, false)?;
        let mut reads = 0u64;
        while !client_stop.load(Ordering::Relaxed) && Instant::now() < until {
            let r = c.call(cmd::READ, 0, reads * 4096 % MIB, 4096, &[])?;
            if r.error != 0 {
                return Err(std::io::Error::other(format!("READ answered errno {}", r.error)));
            }
            reads += 1;
        }
        Ok(reads)
    });
    let starved = nices_until(pid, Duration::from_secs(20), |n| n.iter().any(|&x| x <= -4));
    stop.store(true, Ordering::Relaxed);
    for s in spinners {
        s.join().map_err(|_| "a spinner panicked")?;
    }
    let reads = client.join().map_err(|_| "client panicked")??;
    check(reads > 0, "the client read")?;
    // The client's ring asked for more; the other, with no busy
    // connection, asked for nothing.
    check(starved.len() == 2 && starved.contains(&0) && starved.iter().any(|&x| (-10..=-4).contains(&x)), format!("nices: {starved:?}"))?;
    let quiet = nices_until(pid, Duration::from_secs(20), |n| n == [0, 0]);
    check(quiet == [0, 0], format!("nices once quiet: {quiet:?}"))
}
