//! Signals and closed pipes: SIGHUP is ignored, a closed stdout or stderr
//! does not stop a command or the agent; `volring nbd serve`'s checks before
//! it listens.

use super::*;

pub(super) fn sighup_is_logged_and_ignored() -> Result<(), Failed> {
    let site = Site::new();
    let (mut p, _c) = site.start("state", "csi.sock", &[])?;
    p.signal(rustix::process::Signal::HUP);
    let deadline = Instant::now() + patience();
    while p.stderr.find(&["SIGHUP"]).is_none() {
        if let Some(s) = p.exited() {
            return Err(format!("SIGHUP ended the agent ({s})").into());
        }
        check(Instant::now() < deadline, "no word about SIGHUP")?;
        std::thread::sleep(Duration::from_millis(10));
    }
    check(p.exited().is_none(), "the agent exited after SIGHUP")?;
    check(site.rt.block_on(probe(&site.path("csi.sock"))).is_some(), "the agent still answers after SIGHUP")?;
    let status = p.stop().ok_or("the agent did not stop")?;
    check(status.success(), format!("exit status {status}"))
}

/// `volring mounts --watch | head -1`: after the reader has gone, the next
/// event ends the command quietly.
pub(super) fn mounts_watch_into_a_closed_pipe_exits_quietly() -> Result<(), Failed> {
    let scratch = Scratch::new();
    // Where fanotify mount events are missing (kernels before 6.15), `auto`
    // rightly warns that it falls back; asking for the fallback by name keeps
    // stderr a clean signal there too.
    let mut args = vec!["mounts", "--watch"];
    if volring_mounts::MountWatcher::fanotify_support().is_err() {
        args.extend(["--mount-watch", "reparse"]);
    }
    let mut p = Proc::spawn(Command::new(VOLRING).args(&args).env("RUST_BACKTRACE", "1").stdout(Stdio::piped()));
    let mut out = BufReader::new(p.child.stdout.take().expect("stdout"));
    let (tx, rx) = std::sync::mpsc::channel();
    let reader = std::thread::spawn(move || {
        let mut first = String::new();
        let _ = out.read_line(&mut first);
        let _ = tx.send(first);
        // `out` drops here: the reader goes away like `head -1`.
    });
    let dir = scratch.dir("m");
    let deadline = Instant::now() + patience();
    let mut first = None;
    let mut mounted = false;
    // Mount or unmount in turn until the command has printed one event and
    // ended at the next, holding each state 500 ms: in the re-parse mode (the
    // 6.1 guest) a mount made and gone between two re-parses shows no change.
    let status = 'watch: loop {
        if Instant::now() >= deadline {
            if mounted {
                common::umount(&dir);
            }
            return Err(format!("mounts --watch neither printed nor ended in {:?} (first line {first:?})", patience()).into());
        }
        if mounted {
            common::umount(&dir);
        } else {
            common::tmpfs_at(&dir);
        }
        mounted = !mounted;
        let held = Instant::now() + Duration::from_millis(500);
        while Instant::now() < held {
            if first.is_none() {
                first = rx.try_recv().ok();
            }
            if let Some(s) = p.exited() {
                break 'watch s;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    };
    if mounted {
        common::umount(&dir);
    }
    let _ = reader.join();
    let first = first.or_else(|| rx.try_recv().ok()).unwrap_or_default();
    check(first.starts_with('{'), format!("the first event line: {first:?}"))?;
    check(status.success(), format!("exit status {status}; stderr:\n{}", p.stderr.text()))?;
    check(p.stderr.all().is_empty(), format!("stderr not empty:\n{}", p.stderr.text()))
}

/// A log collector that restarts closes the agent's stderr (and stdout)
/// under it: the agent keeps serving, drops the lines it cannot write and
/// counts them on /metrics, and still exits 0 on SIGTERM. (Before: exit 101
/// at the next log line, tracing-subscriber's report of the failed write
/// being an `eprintln!` into the same closed pipe.)
pub(super) fn a_closed_stderr_does_not_stop_the_agent() -> Result<(), Failed> {
    let site = Site::new();
    let port = std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
    let addr: std::net::SocketAddr = ([127, 0, 0, 1], port).into();
    let (reader, writer) = std::io::pipe()?;
    let mut cmd = site.node("state", "csi.sock", &["--metrics-addr", &addr.to_string(), "--log-events"]);
    cmd.stdin(Stdio::null()).stdout(writer.try_clone()?).stderr(writer);
    let child = cmd.spawn()?;
    drop(cmd); // the Command holds write ends too
    let stderr = Lines::default();
    stderr.0 .1.store(true, std::sync::atomic::Ordering::Release); // nothing to collect
    let mut p = Proc { child, stderr };
    let mut first = String::new();
    BufReader::new(reader).read_line(&mut first)?; // `| head -1`, and the reader is gone
    check(first.contains("starting"), format!("first line: {first:?}"))?;
    let deadline = Instant::now() + patience();
    loop {
        if let Ok(Some(s)) = p.child.try_wait() {
            return Err(format!("the agent exited ({s}) once its stderr closed").into());
        }
        if http_get(addr, "/readyz").is_ok_and(|r| r.starts_with("HTTP/1.1 200")) {
            break;
        }
        check(Instant::now() < deadline, "the agent did not become ready")?;
        std::thread::sleep(Duration::from_millis(25));
    }
    // SIGHUP is logged: one more line into the closed pipe.
    p.signal(rustix::process::Signal::HUP);
    let lost = loop {
        let body = http_get(addr, "/metrics")?;
        let lost = body.lines().find_map(|l| l.strip_prefix("volring_log_lines_lost_total ")).and_then(|n| n.parse::<u64>().ok());
        if lost.is_some_and(|n| n > 0) || Instant::now() > deadline {
            break lost;
        }
        std::thread::sleep(Duration::from_millis(25));
    };
    check(lost.is_some_and(|n| n > 0), format!("lost log lines counted: {lost:?}"))?;
    let healthz = http_get(addr, "/healthz")?;
    check(healthz.starts_with("HTTP/1.1 200"), format!("/healthz: {healthz:.200}"))?;
    let status = p.stop().ok_or("the agent did not stop")?;
    check(status.success(), format!("exit status {status} with its stderr closed"))
}

/// A server keeps serving when its stdout goes away, and says nothing
/// about it (no panic at the next stats line or at exit).
pub(super) fn nbd_serve_with_a_closed_stdout() -> Result<(), Failed> {
    let scratch = Scratch::new();
    let image = scratch.path().join("disk.img");
    std::fs::File::create(&image)?.set_len(1 << 20)?;
    let sock = scratch.path().join("nbd.sock");
    let mut p = Proc::spawn(
        Command::new(VOLRING)
            .args(["nbd", "serve", "--stats-interval", "0.01", "--export"])
            .arg(format!("disk={}", image.display()))
            .arg("--unix")
            .arg(&sock)
            .env("RUST_BACKTRACE", "1")
            .stdout(Stdio::piped()),
    );
    let mut out = BufReader::new(p.child.stdout.take().expect("stdout"));
    let mut line = String::new();
    out.read_line(&mut line)?;
    check(line.contains("listening"), format!("first line {line:?}"))?;
    drop(out);
    // A connection proves the server is still up after a stats tick has
    // found stdout closed: ticks come every 10 ms and the handshake waits
    // for the ring thread.
    for _ in 0..3 {
        let mut s = std::os::unix::net::UnixStream::connect(&sock)?;
        let mut magic = [0u8; 8];
        s.read_exact(&mut magic)?;
        check(&magic == b"NBDMAGIC", "the server greets")?;
        std::thread::sleep(Duration::from_millis(20));
    }
    let status = p.stop().ok_or("nbd serve did not stop")?;
    check(status.success(), format!("exit status {status}; stderr:\n{}", p.stderr.text()))?;
    let noise: Vec<_> = p.stderr.all().into_iter().filter(|l| l.contains("panicked") || l.contains("Broken pipe")).collect();
    check(noise.is_empty(), format!("stderr: {noise:?}"))
}

/// `nbd serve` checks its exports before it listens: a missing image or
/// exports file fails without a "listening" line or a socket left behind
/// (before: "NBD server listening", then the error).
pub(super) fn nbd_serve_checks_exports_before_listening() -> Result<(), Failed> {
    let scratch = Scratch::new();
    let sock = scratch.path().join("nbd.sock");
    let missing = scratch.path().join("missing.img");
    for args in [
        vec!["--export".to_string(), format!("a={}", missing.display())],
        vec!["--exports-file".to_string(), missing.display().to_string()],
    ] {
        let out = Command::new(VOLRING).args(["nbd", "serve", "--unix"]).arg(&sock).args(&args).stdin(Stdio::null()).output()?;
        let (said, err) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        check(!out.status.success(), format!("{args:?}: rc {:?}", out.status))?;
        check(!said.contains("listening") && !err.contains("listening"), format!("{args:?}: listened first:\n{said}{err}"))?;
        check(err.contains("missing.img"), format!("{args:?}: the missing file is named: {err}"))?;
    }
    Ok(())
}

/// `nbd serve` as a user without CAP_IPC_LOCK whose RLIMIT_MEMLOCK is
/// below the ring's registered buffers is told that, not that io_uring
/// needs Linux 6.0 (the ENOMEM comes from IORING_REGISTER_BUFFERS).
pub(super) fn nbd_serve_memlock_is_named() -> Result<(), Failed> {
    let scratch = Scratch::new();
    let image = scratch.path().join("disk.img");
    std::fs::File::create(&image)?.set_len(1 << 20)?;
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(scratch.path(), std::fs::Permissions::from_mode(0o777))?;
    std::fs::set_permissions(&image, std::fs::Permissions::from_mode(0o666))?;
    let out = Command::new("setpriv")
        .args([
            "--reuid=65534",
            "--regid=65534",
            "--clear-groups",
            "prlimit",
            "--memlock=1048576",
            "--",
            VOLRING,
            "nbd",
            "serve",
            "--export",
        ])
        .arg(format!("a={}", image.display()))
        .arg("--unix")
        .arg(scratch.path().join("nbd.sock"))
        .stdin(Stdio::null())
        .output()?;
    let err = String::from_utf8_lossy(&out.stderr);
    check(!out.status.success(), format!("rc {:?}: {err}", out.status))?;
    check(err.contains("RLIMIT_MEMLOCK") && !err.contains("Linux 6.0"), format!("stderr: {err}"))
}
