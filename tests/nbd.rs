//! The NBD server against real clients from Debian's packages (nbdinfo,
//! qemu-io, qemu-img, nbdcopy, nbdfuse) and a raw client for what they
//! never send. Mounts happen in a private mount namespace.

mod common;
mod nbd_support;

use std::io::{Read, Write};
use std::os::unix::fs::FileExt;
use std::time::{Duration, Instant};

use common::check;
use libtest_mimic::{Failed, Trial};
use nbd_support::{pattern, run, ChildServer, ChildSpec, RawClient, Rng, ServeProcess, Served, MIB};
use volring_nbd::wire::{cmd, cmd_flags as cf, errno, state, HeaderStyle};

const T: Duration = Duration::from_secs(60);

fn nbdinfo_shows_every_feature() -> Result<(), Failed> {
    let s = Served::new(&[("disk", 64 * MIB, false), ("golden", 8 * MIB, true)]);
    let (ok, out, err) = run("nbdinfo", &["--json", &s.uri("disk")], T);
    check(ok, format!("nbdinfo: {err}"))?;
    let v: serde_json::Value = serde_json::from_str(&out)?;
    check(v["protocol"] == "newstyle-fixed" && v["TLS"] == false && v["structured"] == true, format!("handshake: {v}"))?;
    let e = &v["exports"][0];
    for flag in ["can_cache", "can_df", "can_fast_zero", "can_flush", "can_fua", "can_multi_conn", "can_trim", "can_zero"] {
        check(e[flag] == true, format!("{flag} in {e}"))?;
    }
    check(e["is_read_only"] == false && e["export-size"] == 64 * MIB, format!("size and rw: {e}"))?;
    check(e["contexts"].as_array().is_some_and(|c| c.iter().any(|c| c == "base:allocation")), "base:allocation offered")?;
    check(
        e["block_size_minimum"] == 1 && e["block_size_preferred"] == 4096 && e["block_size_maximum"] == 32 * MIB,
        format!("block sizes: {e}"),
    )?;

    let (ok, out, err) = run("nbdinfo", &["--json", &s.uri("golden")], T);
    check(ok, format!("nbdinfo golden: {err}"))?;
    let v: serde_json::Value = serde_json::from_str(&out)?;
    let e = &v["exports"][0];
    check(e["is_read_only"] == true && e["can_trim"] == false && e["can_zero"] == false, format!("read-only export: {e}"))?;

    let (ok, out, err) = run("nbdinfo", &["--list", "--json", &format!("nbd+unix://?socket={}", s.socket.display())], T);
    check(ok, format!("nbdinfo --list: {err}"))?;
    let v: serde_json::Value = serde_json::from_str(&out)?;
    let names: Vec<&str> = v["exports"].as_array().into_iter().flatten().filter_map(|e| e["export-name"].as_str()).collect();
    check(names == ["disk", "golden"], format!("listed {names:?}"))?;
    check(out.contains("test export golden"), "descriptions through NBD_INFO_DESCRIPTION")?;

    // An unknown export is an error, not a hang.
    let (ok, _, err) = run("nbdinfo", &[&s.uri("nope")], T);
    check(!ok && !err.contains("killed after"), format!("unknown export: {err}"))
}

/// qemu-io negotiates extended headers (qemu 8.2+): patterns at many
/// offsets and sizes, unaligned, the largest block, and across the end.
fn qemu_io_patterns() -> Result<(), Failed> {
    let s = Served::new(&[("disk", 64 * MIB + 512, false)]);
    let uri = s.uri("disk");
    let size = 64 * MIB + 512;
    let cases: [(u64, u64); 10] = [
        (0, 1),
        (1, 511),
        (4095, 10_000),
        (MIB - 3, 7),
        (2 * MIB, 32 * MIB),
        (40 * MIB + 17, 65_536),
        (size - 4096, 4096),
        (size - 1, 1),
        (12_345, 4 * MIB + 3),
        (50 * MIB, 1),
    ];
    let mut args: Vec<String> = vec!["-f".into(), "raw".into()];
    for (i, &(off, len)) in cases.iter().enumerate() {
        let p = 0x11 + i as u8 * 13;
        args.extend(["-c".into(), format!("write -P {p} {off} {len}"), "-c".into(), format!("read -P {p} {off} {len}")]);
    }
    args.extend(["-c".into(), format!("write -z {} 1M", 10 * MIB), "-c".into(), format!("read -P 0 {} 1M", 10 * MIB)]);
    args.extend(["-c".into(), format!("write -f -P 0x5a {} 8192", 20 * MIB), "-c".into(), "flush".into()]);
    args.extend(["-c".into(), format!("discard {} 1M", 30 * MIB), "-c".into(), format!("read -P 0 {} 1M", 30 * MIB)]);
    args.push(uri.clone());
    let refs: Vec<&str> = args.iter().map(String::as_str).collect();
    let (ok, out, err) = run("qemu-io", &refs, T);
    check(ok && !out.contains("fail") && !err.contains("fail"), format!("qemu-io: {out}\n{err}"))?;
    check(out.matches("wrote").count() == cases.len() + 2, format!("every write done: {out}"))?;
    check(!out.contains("Pattern verification failed"), out.clone())?;
    // The file says the same as the server.
    let f = std::fs::File::open(s.image("disk"))?;
    for (i, &(off, len)) in cases.iter().enumerate().filter(|(_, c)| c.1 < MIB) {
        let mut b = vec![0u8; len as usize];
        f.read_exact_at(&mut b, off)?;
        let p = 0x11 + i as u8 * 13;
        // Later cases may overlap earlier ones only where listed last: check the untouched ones.
        if cases.iter().skip(i + 1).all(|&(o2, l2)| o2 >= off + len || o2 + l2 <= off) {
            check(b.iter().all(|&x| x == p), format!("file bytes at {off}+{len}"))?;
        }
    }
    // Across the end: refused with an error, and nothing is written past it.
    let (_, out, err) = run("qemu-io", &["-f", "raw", "-c", &format!("write -P 9 {} 4096", size - 2048), &uri], T);
    check(
        !out.contains("wrote") && (err.contains("error") || out.contains("error") || err.contains("Invalid") || out.contains("Invalid")),
        format!("past the end: {out}{err}"),
    )?;
    check(std::fs::metadata(s.image("disk"))?.len() == size, "the image did not grow")
}

/// Random writes, zeroes, trims and flushes through the raw client, in all
/// three header styles; then the image, the model and `qemu-img compare`
/// over NBD all agree.
fn random_workload_then_compare() -> Result<(), Failed> {
    let size = 32 * MIB;
    let s = Served::new(&[("disk", size, false)]);
    let mut model = vec![0u8; size as usize];
    let mut rng = Rng(0x5eed);
    for style in [HeaderStyle::Simple, HeaderStyle::Structured, HeaderStyle::Extended] {
        let mut c = RawClient::connect(&s.socket, "disk", style, false)?;
        // Queue depth 8: requests go out before earlier replies come back.
        let mut pending = std::collections::VecDeque::new();
        for i in 0..300u64 {
            let off = rng.below(size - 1);
            let len = (1 + rng.below(256 * 1024)).min(size - off);
            let (kind, flags, payload) = match rng.below(10) {
                0..=5 => (cmd::WRITE, if i % 7 == 0 { cf::FUA } else { 0 }, pattern(i, off, len as usize)),
                6 => (cmd::WRITE_ZEROES, if i % 2 == 0 { cf::NO_HOLE } else { 0 }, Vec::new()),
                7 => (cmd::TRIM, 0, Vec::new()),
                8 => (cmd::FLUSH, 0, Vec::new()),
                _ => (cmd::READ, 0, Vec::new()),
            };
            // Requests in flight together have no defined order: a write
            // is pipelined only past writes to other ranges; everything
            // else waits for the queue to drain.
            let overlaps = pending.iter().any(|&(o, l)| o < off + len && off < o + l);
            if kind != cmd::WRITE || overlaps || pending.len() >= 8 {
                while pending.pop_front().is_some() {
                    let r = c.reply(None)?;
                    check(r.error == 0, format!("{style:?}: error {}", r.error))?;
                }
            }
            let (o, l) = if kind == cmd::FLUSH { (0, 0) } else { (off, len) };
            let cookie = c.send(kind, flags, o, l, &payload)?;
            match kind {
                cmd::WRITE => model[off as usize..(off + len) as usize].copy_from_slice(&payload),
                // A trim leaves zeroes on a file (hole punching).
                cmd::WRITE_ZEROES | cmd::TRIM => model[off as usize..(off + len) as usize].fill(0),
                _ => {}
            }
            if kind == cmd::READ {
                let r = c.reply(Some(len as usize))?;
                check(r.cookie == cookie && r.error == 0, "read answered")?;
                check(r.data == model[off as usize..(off + len) as usize], format!("{style:?}: read {off}+{len} matches the model"))?;
            } else if kind == cmd::WRITE {
                pending.push_back((off, len));
            } else {
                check(c.reply(None)?.error == 0, format!("{style:?}: command {kind}"))?;
            }
        }
        while pending.pop_front().is_some() {
            check(c.reply(None)?.error == 0, "drain")?;
        }
        c.call(cmd::DISC, 0, 0, 0, &[]).ok();
    }
    let file = std::fs::read(s.image("disk"))?;
    check(file == model, "image equals the model")?;
    let (ok, out, err) = run("qemu-img", &["compare", "-f", "raw", "-F", "raw", s.image("disk").to_str().unwrap(), &s.uri("disk")], T);
    check(ok && out.contains("identical"), format!("qemu-img compare: {out}{err}"))
}

/// nbdcopy into and out of the server with four connections each.
fn nbdcopy_both_ways_multi_conn() -> Result<(), Failed> {
    let s = Served::new(&[("disk", 48 * MIB, false)]);
    let src = s.dir.path().join("src.raw");
    let mut data = Vec::with_capacity((48 * MIB) as usize);
    for i in 0..48u64 {
        // Every third MiB left as a hole.
        data.extend(if i % 3 == 1 { vec![0u8; MIB as usize] } else { pattern(i, i * MIB, MIB as usize) });
    }
    std::fs::write(&src, &data)?;
    let (ok, _, err) = run("nbdcopy", &["--connections=4", "--threads=4", "--requests=16", src.to_str().unwrap(), &s.uri("disk")], T);
    check(ok, format!("nbdcopy in: {err}"))?;
    check(std::fs::read(s.image("disk"))? == data, "the image has what was copied in")?;
    let back = s.dir.path().join("back.raw");
    let (ok, _, err) = run("nbdcopy", &["--connections=4", "--threads=4", &s.uri("disk"), back.to_str().unwrap()], T);
    check(ok, format!("nbdcopy out: {err}"))?;
    check(std::fs::read(&back)? == data, "what was copied out is the same")?;
    let st = s.server().exports().get("disk").expect("export").stats.snapshot("disk");
    check(st.connections_total == 8 && st.writes > 0 && st.reads > 0, format!("metrics: {st:?}"))?;
    check(st.read_bytes > 0 && st.latency_count > 0 && st.connections == 0, format!("metrics: {st:?}"))
}

/// Removes what a block-path test made, newest first, even on failure.
struct BlockPath {
    mnt: std::path::PathBuf,
    fuse: std::path::PathBuf,
    fuse_child: Option<std::process::Child>,
    loop_dev: Option<String>,
}

impl Drop for BlockPath {
    fn drop(&mut self) {
        let _ = rustix::mount::unmount(&self.mnt, rustix::mount::UnmountFlags::DETACH);
        if let Some(dev) = self.loop_dev.take() {
            let _ = std::process::Command::new("losetup").args(["-d", &dev]).status();
        }
        let _ = rustix::mount::unmount(&self.fuse, rustix::mount::UnmountFlags::DETACH);
        if let Some(mut c) = self.fuse_child.take() {
            for _ in 0..200 {
                if c.try_wait().ok().flatten().is_some() {
                    return;
                }
                std::thread::sleep(Duration::from_millis(10));
            }
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// No nbd kernel module here: nbdfuse exposes the export as a file, a loop
/// device makes it a block device, and ext4 lives on it.
fn block_path_through_nbdfuse() -> Result<(), Failed> {
    let s = Served::new(&[("disk", 128 * MIB, false)]);
    let fuse = s.dir.path().join("fuse");
    let mnt = s.dir.path().join("mnt");
    std::fs::create_dir_all(&fuse)?;
    std::fs::create_dir_all(&mnt)?;
    let pidfile = s.dir.path().join("nbdfuse.pid");
    let child = std::process::Command::new("nbdfuse")
        .arg("-P")
        .arg(&pidfile)
        .arg(&fuse)
        .arg(s.uri("disk"))
        .stdin(std::process::Stdio::null())
        .spawn()?;
    let mut bp = BlockPath { mnt: mnt.clone(), fuse: fuse.clone(), fuse_child: Some(child), loop_dev: None };
    let file = fuse.join("nbd");
    let start = Instant::now();
    while !(pidfile.exists() && file.exists()) {
        check(start.elapsed() < Duration::from_secs(20), "nbdfuse did not come up")?;
        std::thread::sleep(Duration::from_millis(20));
    }
    check(std::fs::metadata(&file)?.len() == 128 * MIB, "the FUSE file has the export's size")?;
    let (ok, dev, err) = run("losetup", &["--find", "--show", file.to_str().unwrap()], T);
    check(ok, format!("losetup: {err}"))?;
    let dev = dev.trim().to_string();
    bp.loop_dev = Some(dev.clone());
    let (ok, _, err) = run("mkfs.ext4", &["-q", "-F", &dev], T);
    check(ok, format!("mkfs.ext4: {err}"))?;
    rustix::mount::mount(dev.as_str(), &mnt, "ext4", rustix::mount::MountFlags::empty(), None)?;
    let payload = pattern(7, 0, 5 * MIB as usize + 123);
    std::fs::File::create(mnt.join("data"))?.write_all(&payload)?;
    rustix::fs::sync();
    rustix::mount::unmount(&mnt, rustix::mount::UnmountFlags::empty())?;
    // Again from scratch: the data came back through NBD, not from a cache of the mount.
    let (ok, _, err) = run("blockdev", &["--flushbufs", &dev], T);
    check(ok, format!("flushbufs: {err}"))?;
    rustix::mount::mount(dev.as_str(), &mnt, "ext4", rustix::mount::MountFlags::RDONLY, None)?;
    let back = std::fs::read(mnt.join("data"))?;
    check(back == payload, "the file reads back the same")?;
    rustix::mount::unmount(&mnt, rustix::mount::UnmountFlags::empty())?;
    let (ok, _, err) = run("e2fsck", &["-fn", &dev], T);
    check(ok, format!("e2fsck: {err}"))?;
    let st = s.server().exports().get("disk").expect("export").stats.snapshot("disk");
    check(st.writes > 0 && st.flushes > 0, format!("ext4 wrote and flushed through NBD: {st:?}"))?;
    drop(bp);
    Ok(())
}

/// Writes to distinct blocks with a FLUSH every 8; the server is killed
/// with SIGKILL mid-stream. After a restart every write acknowledged
/// before the last acknowledged flush is in the image.
fn acked_flush_survives_kill9() -> Result<(), Failed> {
    let dir = tempfile::Builder::new().prefix("volring-nbd-kill-").tempdir()?;
    let img = dir.path().join("disk.img");
    std::fs::File::create(&img)?.set_len(256 * MIB)?;
    let sock = dir.path().join("nbd.sock");
    let spec = format!("disk={}", img.display());
    let mut server = ServeProcess::start(&sock, std::slice::from_ref(&spec));
    let block = 64 * 1024u64;
    let (tx, rx) = std::sync::mpsc::channel::<u64>();
    let writer = {
        let sock = sock.clone();
        std::thread::spawn(move || -> std::io::Result<()> {
            let mut c = RawClient::connect(&sock, "disk", HeaderStyle::Structured, false)?;
            for i in 0..4000u64 {
                c.call(cmd::WRITE, 0, i * block, block, &pattern(i, i * block, block as usize))?;
                if i % 8 == 7 {
                    c.call(cmd::FLUSH, 0, 0, 0, &[])?;
                    let _ = tx.send(i + 1); // writes 0..=i are durable
                }
            }
            Ok(())
        })
    };
    let mut durable = 0;
    let start = Instant::now();
    while durable < 200 && start.elapsed() < Duration::from_secs(30) {
        if let Ok(n) = rx.recv_timeout(Duration::from_millis(50)) {
            durable = n;
        }
    }
    server.kill_hard();
    let _ = writer.join();
    while let Ok(n) = rx.try_recv() {
        durable = durable.max(n);
    }
    check(durable >= 200, format!("only {durable} writes acknowledged as flushed"))?;
    let server = ServeProcess::start(&sock, &[spec]);
    let mut c = RawClient::connect(&sock, "disk", HeaderStyle::Extended, false)?;
    for i in 0..durable {
        let r = c.call(cmd::READ, 0, i * block, block, &[])?;
        check(r.error == 0 && r.data == pattern(i, i * block, block as usize), format!("block {i} of {durable} flushed ones"))?;
    }
    drop(server);
    Ok(())
}

/// Every malformed or forbidden request gets its protocol error, in every
/// header style, and the connection keeps working afterwards.
fn hostile_requests_get_errors() -> Result<(), Failed> {
    let size = 8 * MIB;
    let s = Served::new(&[("disk", size, false), ("ro", MIB, true)]);
    for style in [HeaderStyle::Simple, HeaderStyle::Structured, HeaderStyle::Extended] {
        let mut c = RawClient::connect(&s.socket, "disk", style, false)?;
        // (what, command, flags, offset, length, payload, expected errno)
        type Case = (&'static str, u16, u16, u64, u64, Vec<u8>, u32);
        let cases: Vec<Case> = vec![
            ("read past the end", cmd::READ, 0, size - 10, 20, vec![], errno::EINVAL),
            ("offset overflow", cmd::READ, 0, u64::MAX - 5, 10, vec![], errno::EINVAL),
            ("zero-length read", cmd::READ, 0, 0, 0, vec![], errno::EINVAL),
            ("read above the maximum", cmd::READ, 0, 0, 33 * MIB, vec![], errno::EOVERFLOW),
            ("write past the end", cmd::WRITE, 0, size - 2, 4, vec![1; 4], errno::ENOSPC),
            ("zero-length write", cmd::WRITE, 0, 0, 0, vec![], errno::EINVAL),
            ("unknown command", 42, 0, 0, 512, vec![], errno::EINVAL),
            ("unknown flag", cmd::READ, 1 << 9, 0, 512, vec![], errno::EINVAL),
            ("trim past the end", cmd::TRIM, 0, size, 1, vec![], errno::EINVAL),
            ("block status with no context", cmd::BLOCK_STATUS, 0, 0, 4096, vec![], errno::EINVAL),
        ];
        for (what, kind, flags, off, len, payload, want) in cases {
            let r = c.call(kind, flags, off, len, &payload)?;
            check(r.error == want, format!("{style:?} {what}: errno {} (want {want})", r.error))?;
        }
        // A write above the maximum is refused and its payload read past.
        let big = vec![7u8; 33 * MIB as usize];
        let r = c.call(cmd::WRITE, 0, 0, big.len() as u64, &big)?;
        check(r.error == errno::EOVERFLOW, format!("{style:?} oversized write: {}", r.error))?;
        let r = c.call(cmd::WRITE, 0, 4096, 3, &[1, 2, 3])?;
        check(r.error == 0, "still in sync after the refused payload")?;
        let r = c.call(cmd::READ, 0, 4096, 3, &[])?;
        check(r.error == 0 && r.data == [1, 2, 3], "reads back")?;
        let mut ro = RawClient::connect(&s.socket, "ro", style, false)?;
        for (kind, payload) in [(cmd::WRITE, vec![0u8; 512]), (cmd::TRIM, vec![]), (cmd::WRITE_ZEROES, vec![])] {
            let r = ro.call(kind, 0, 0, 512, &payload)?;
            check(r.error == errno::EPERM, format!("{style:?} read-only {kind}: {}", r.error))?;
        }
    }
    Ok(())
}

/// A wrong magic or a request cut short ends that connection alone.
fn broken_streams_close_only_their_connection() -> Result<(), Failed> {
    let s = Served::new(&[("disk", MIB, false)]);
    let mut good = RawClient::connect(&s.socket, "disk", HeaderStyle::Structured, false)?;
    let mut bad = RawClient::connect(&s.socket, "disk", HeaderStyle::Structured, false)?;
    bad.s.write_all(&[0xde, 0xad, 0xbe, 0xef, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0])?;
    let mut b = [0u8; 1];
    check(matches!(bad.s.read(&mut b), Ok(0) | Err(_)), "bad magic: closed")?;
    let mut cut = RawClient::connect(&s.socket, "disk", HeaderStyle::Simple, false)?;
    cut.send(cmd::WRITE, 0, 0, 4096, &[1; 100])?;
    drop(cut);
    // Garbage in the handshake is a closed connection too.
    let mut raw = std::os::unix::net::UnixStream::connect(&s.socket)?;
    raw.set_read_timeout(Some(Duration::from_secs(10)))?;
    let mut greet = [0u8; 18];
    raw.read_exact(&mut greet)?;
    raw.write_all(&[0xff; 64])?;
    check(matches!(raw.read(&mut b), Ok(0) | Err(_)), "bad client flags: closed")?;
    for i in 0..50u64 {
        let r = good.call(cmd::WRITE, 0, i * 512, 512, &pattern(i, 0, 512))?;
        check(r.error == 0, "the good connection is unaffected")?;
    }
    Ok(())
}

/// A client that connects and says nothing is dropped after the handshake timeout.
fn stalled_handshake_is_dropped() -> Result<(), Failed> {
    let s = Served::with_config(&[("disk", MIB, false)], |c| c.handshake_timeout = Duration::from_millis(300));
    let mut raw = std::os::unix::net::UnixStream::connect(&s.socket)?;
    raw.set_read_timeout(Some(Duration::from_secs(30)))?;
    let mut greet = [0u8; 18];
    raw.read_exact(&mut greet)?;
    let start = Instant::now();
    let mut b = [0u8; 1];
    let r = raw.read(&mut b);
    // Only an upper bound (the timeout is 300 ms), generous for a loaded CI
    // host; our own read timing out is not the server closing.
    let timed_out = matches!(&r, Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut));
    check(
        matches!(r, Ok(0) | Err(_)) && !timed_out && start.elapsed() < Duration::from_secs(20),
        format!("closed after {:?}: {r:?}", start.elapsed()),
    )
}

/// A client that sends reads and never reads the replies: the server
/// stops reading from it, holds bounded memory, serves others meanwhile,
/// and drops it once its replies stall.
fn client_that_never_reads_is_bounded() -> Result<(), Failed> {
    const STALL: Duration = Duration::from_secs(10);
    let s = Served::with_config(&[("disk", 64 * MIB, false)], |c| {
        c.max_queued_bytes = 8 * MIB as usize;
        // Well past the fill below (which ends once the server stops
        // reading, 4 s at most), so the hog still sits, and holds what the
        // server queued for it, while its memory is measured (a 1.5 s stall
        // timeout under a 2 s fill dropped it before).
        c.stall_timeout = STALL;
    });
    std::fs::write(s.image("disk"), pattern(1, 0, 64 * MIB as usize))?;
    let before = nbd_support::rss_kib(None);
    let mut hog = RawClient::connect(&s.socket, "disk", HeaderStyle::Structured, false)?;
    hog.s.set_nonblocking(true)?;
    // Small reads go through buffers, large ones are spliced: both kinds.
    let mut sent = 0u64;
    let started = Instant::now();
    let mut progress = started;
    'fill: for i in 0..20_000u64 {
        let (off, len) = if i % 2 == 0 { ((i * 4096) % (60 * MIB), 4096) } else { ((i * MIB) % (60 * MIB), MIB) };
        let mut b = Vec::new();
        volring_nbd::wire::encode_request(
            &volring_nbd::wire::Request { flags: 0, kind: cmd::READ, cookie: i, offset: off, length: len },
            HeaderStyle::Structured,
            &mut b,
        );
        let mut at = 0;
        while at < b.len() {
            match hog.s.write(&b[at..]) {
                Ok(n) => {
                    at += n;
                    progress = Instant::now();
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    // The server has stopped reading once a second passes
                    // without progress.
                    if progress.elapsed() > Duration::from_secs(1) || started.elapsed() > Duration::from_secs(4) {
                        break 'fill;
                    }
                    std::thread::sleep(Duration::from_millis(5));
                }
                Err(_) => break 'fill,
            }
        }
        sent += 1;
    }
    check(sent > 100, format!("sent {sent} requests"))?;
    let grown = nbd_support::rss_kib(None).saturating_sub(before);
    check(grown < 96 * 1024, format!("server grew by {grown} KiB for a client that reads nothing"))?;
    let mut other = RawClient::connect(&s.socket, "disk", HeaderStyle::Extended, false)?;
    let r = other.call(cmd::READ, 0, 4096, 4096, &[])?;
    check(r.error == 0 && r.data == pattern(1, 0, 64 * MIB as usize)[4096..8192], "another client is served meanwhile")?;
    // The stalled connection is dropped while the hog still reads nothing:
    // its slot on the export is given back although a spliced reply sits
    // stuck on its full socket (the server shuts the socket down under the
    // splice rather than waiting for the reply to move, which a client that
    // never reads would make forever).
    let snapshot = || s.server().exports().get("disk").expect("export").stats.snapshot("disk");
    let deadline = Instant::now() + STALL + Duration::from_secs(30);
    while snapshot().connections > 1 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    let st = snapshot();
    check(st.connections <= 1, format!("the stalled connection still holds its slot, unread: {st:?}"))?;
    // Reading it now gives at most what was queued, then EOF (or a reset).
    hog.s.set_nonblocking(false)?;
    hog.s.set_read_timeout(Some(Duration::from_secs(30)))?;
    let mut sink = vec![0u8; 1 << 20];
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        match hog.s.read(&mut sink) {
            Ok(0) | Err(_) => break,
            Ok(_) if Instant::now() > deadline => return Err("the stalled connection was never closed".into()),
            Ok(_) => {}
        }
    }
    Ok(())
}

/// Exports come and go at run time; a limit caps connections.
fn exports_added_and_removed_at_run_time() -> Result<(), Failed> {
    let s = Served::new(&[]);
    let path = s.image("late");
    std::fs::File::create(&path)?.set_len(4 * MIB)?;
    check(RawClient::connect(&s.socket, "late", HeaderStyle::Structured, false).is_err(), "not there yet")?;
    s.add("late", &path, false, 2);
    let mut a = RawClient::connect(&s.socket, "late", HeaderStyle::Structured, false)?;
    let _b = RawClient::connect(&s.socket, "late", HeaderStyle::Structured, false)?;
    match RawClient::connect(&s.socket, "late", HeaderStyle::Structured, false) {
        Err(e) => check(e.to_string().contains("connection limit"), format!("third connection: {e}"))?,
        Ok(_) => return Err("a third connection got past limit=2".into()),
    }
    check(a.call(cmd::WRITE, 0, 0, 4, b"abcd")?.error == 0, "served")?;
    s.server().remove_export("late")?;
    let mut b = [0u8; 1];
    a.s.set_read_timeout(Some(Duration::from_secs(10)))?;
    check(matches!(a.s.read(&mut b), Ok(0) | Err(_)), "connections to a removed export are closed")?;
    check(RawClient::connect(&s.socket, "late", HeaderStyle::Structured, false).is_err(), "gone for new clients")?;
    s.add("late", &path, true, 0);
    let mut c = RawClient::connect(&s.socket, "late", HeaderStyle::Structured, false)?;
    let r = c.call(cmd::READ, 0, 0, 4, &[])?;
    check(r.data == b"abcd" && c.flags & volring_nbd::wire::tx::READ_ONLY != 0, "added again, read-only")
}

/// BLOCK_STATUS from SEEK_DATA/SEEK_HOLE, and hole chunks for sparse reads.
fn block_status_and_sparse_reads() -> Result<(), Failed> {
    let s = Served::new(&[("disk", 16 * MIB, false)]);
    let f = std::fs::OpenOptions::new().write(true).open(s.image("disk"))?;
    f.write_all_at(&[1u8; 4096], 4 * MIB)?;
    f.sync_all()?;
    for style in [HeaderStyle::Structured, HeaderStyle::Extended] {
        let mut c = RawClient::connect(&s.socket, "disk", style, true)?;
        let r = c.call(cmd::BLOCK_STATUS, 0, 0, 16 * MIB, &[])?;
        check(r.error == 0, "block status answered")?;
        let hz = state::HOLE | state::ZERO;
        check(r.extents.first() == Some(&(4 * MIB, hz)), format!("{style:?}: leading hole: {:?}", r.extents))?;
        check(r.extents.get(1).is_some_and(|&(l, fl)| fl == 0 && l >= 4096), format!("{style:?}: data: {:?}", r.extents))?;
        check(r.extents.iter().map(|e| e.0).sum::<u64>() == 16 * MIB, "extents cover the range")?;
        let one = c.call(cmd::BLOCK_STATUS, cf::REQ_ONE, 0, 16 * MIB, &[])?;
        check(one.extents.len() == 1, "REQ_ONE: one extent")?;
        let r = c.call(cmd::READ, 0, 8 * MIB, 2 * MIB, &[])?;
        check(
            r.error == 0 && r.holes == 1 && r.data == vec![0u8; 2 * MIB as usize],
            format!("{style:?}: a sparse read is one hole chunk"),
        )?;
        let r = c.call(cmd::READ, cf::DF, 4 * MIB - 100, 200, &[])?;
        check(r.error == 0 && r.data[100..] == [1u8; 100], "a read over data is data")?;
    }
    let (ok, out, err) = run("nbdinfo", &["--map", &s.uri("disk")], T);
    check(ok && out.contains("hole,zero") && out.contains("data"), format!("nbdinfo --map: {out}{err}"))
}

/// A file fragmented into 2,048 data extents: one BLOCK_STATUS answers a
/// bounded prefix (the ring thread makes a bounded number of lseeks for
/// it), and a client that asks on from where the reply ended gets the
/// exact map.
fn block_status_is_bounded_per_request() -> Result<(), Failed> {
    let size = 16 * MIB;
    let s = Served::new(&[("frag", size, false)]);
    let f = std::fs::OpenOptions::new().write(true).open(s.image("frag"))?;
    for i in 0..size / 8192 {
        f.write_all_at(&[7u8; 4096], i * 8192)?;
    }
    f.sync_all()?;
    let mut c = RawClient::connect(&s.socket, "frag", HeaderStyle::Extended, true)?;
    let first = c.call(cmd::BLOCK_STATUS, 0, 0, size, &[])?;
    check(first.error == 0 && !first.extents.is_empty(), "answered")?;
    let covered: u64 = first.extents.iter().map(|e| e.0).sum();
    check(first.extents.len() <= 32 && covered < size, format!("one reply: {} extents over {covered} bytes", first.extents.len()))?;
    let (mut pos, mut asks) = (0u64, 0);
    while pos < size {
        asks += 1;
        check(asks <= 4096, "the map ends")?;
        let r = c.call(cmd::BLOCK_STATUS, 0, pos, size - pos, &[])?;
        check(r.error == 0 && !r.extents.is_empty(), format!("status at {pos}"))?;
        for &(len, flags) in &r.extents {
            let want = if pos % 8192 == 0 { 0 } else { state::HOLE | state::ZERO };
            check(len == 4096 && flags == want, format!("extent at {pos}: {len} bytes, flags {flags}"))?;
            pos += len;
        }
    }
    Ok(())
}

/// A spliced READ is timed until its data is in the socket: a client that
/// waits before reading a 32 MiB reply (more than the socket holds) makes
/// the recorded latency at least that wait.
fn spliced_reads_are_timed_until_sent() -> Result<(), Failed> {
    let s = Served::new(&[("disk", 64 * MIB, false)]);
    std::fs::write(s.image("disk"), pattern(5, 0, 64 * MIB as usize))?;
    let mut c = RawClient::connect(&s.socket, "disk", HeaderStyle::Simple, false)?;
    let wait = Duration::from_millis(800);
    c.send(cmd::READ, 0, 0, 32 * MIB, &[])?;
    std::thread::sleep(wait);
    let r = c.reply(Some(32 * MIB as usize))?;
    check(r.error == 0 && r.data == pattern(5, 0, 32 * MIB as usize), "the read is answered")?;
    let export = s.server().exports().get("disk").expect("export");
    let start = Instant::now();
    let st = loop {
        let st = export.stats.snapshot("disk");
        if st.latency_count >= 1 || start.elapsed() > Duration::from_secs(10) {
            break st;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    check(
        st.latency_max_us >= wait.as_micros() as u64 / 2,
        format!("spliced READ recorded {} us (the client waited {wait:?})", st.latency_max_us),
    )
}

/// WRITE_ZEROES on tmpfs, which cannot zero a range in place: FAST_ZERO
/// is refused with ENOTSUP, a plain zeroing falls back to writing zeroes.
fn write_zeroes_without_filesystem_help() -> Result<(), Failed> {
    let scratch = common::Scratch::new();
    let dir = scratch.dir("t");
    rustix::mount::mount("tmpfs", &dir, "tmpfs", rustix::mount::MountFlags::empty(), Some(c"size=16m"))?;
    let img = dir.join("z.img");
    std::fs::write(&img, vec![9u8; 4 * MIB as usize])?;
    let s = Served::new(&[]);
    s.add("z", &img, false, 0);
    let mut c = RawClient::connect(&s.socket, "z", HeaderStyle::Structured, false)?;
    let r = c.call(cmd::WRITE_ZEROES, cf::NO_HOLE | cf::FAST_ZERO, 0, MIB, &[])?;
    check(r.error == errno::ENOTSUP, format!("fast zero on tmpfs: {}", r.error))?;
    let r = c.call(cmd::WRITE_ZEROES, cf::NO_HOLE | cf::FUA, 0, 2 * MIB + 5, &[])?;
    check(r.error == 0, format!("zeroes written by hand: {}", r.error))?;
    let data = std::fs::read(&img)?;
    check(data[..(2 * MIB + 5) as usize].iter().all(|&b| b == 0) && data[(2 * MIB + 5) as usize] == 9, "exactly the range is zero")?;
    let r = c.call(cmd::WRITE_ZEROES, cf::FAST_ZERO, 3 * MIB, 4096, &[])?;
    check(r.error == 0, "punching a hole is fast on tmpfs")?;
    drop(c);
    drop(s);
    Ok(())
}

/// An O_DIRECT export: aligned requests bypass the cache, unaligned ones
/// take the buffered descriptor; both see the same bytes.
fn direct_io_export() -> Result<(), Failed> {
    let s = Served::new(&[]);
    let img = s.image("d");
    std::fs::File::create(&img)?.set_len(16 * MIB)?;
    let spec = volring_nbd::ExportSpec { direct_io: true, ..format!("d={}", img.display()).parse()? };
    let e = s.server().add_export(&spec)?;
    check(e.direct_io(), "O_DIRECT works on this filesystem")?;
    let mut c = RawClient::connect(&s.socket, "d", HeaderStyle::Extended, false)?;
    let aligned = pattern(3, 0, MIB as usize);
    check(c.call(cmd::WRITE, cf::FUA, MIB, MIB, &aligned)?.error == 0, "aligned write")?;
    check(c.call(cmd::WRITE, 0, MIB + 100, 3, b"xyz")?.error == 0, "unaligned write")?;
    let r = c.call(cmd::READ, 0, MIB, MIB, &[])?;
    let mut want = aligned.clone();
    want[100..103].copy_from_slice(b"xyz");
    check(r.data == want, "aligned read sees the unaligned write")?;
    let r = c.call(cmd::READ, 0, MIB + 99, 5, &[])?;
    check(r.data == [want[99], b'x', b'y', b'z', want[103]], "unaligned read")?;
    let (ok, out, err) = run("qemu-img", &["compare", "-f", "raw", "-F", "raw", img.to_str().unwrap(), &s.uri("d")], T);
    check(ok && out.contains("identical"), format!("qemu-img compare: {out}{err}"))
}

/// `volring nbd serve --exports-file`: SIGHUP adds what the file gained
/// and removes what it lost.
fn exports_file_reloads_on_sighup() -> Result<(), Failed> {
    let dir = tempfile::Builder::new().prefix("volring-nbd-hup-").tempdir()?;
    for n in ["a", "b"] {
        std::fs::File::create(dir.path().join(format!("{n}.img")))?.set_len(MIB)?;
    }
    let list = dir.path().join("exports");
    std::fs::write(&list, format!("# served volumes\na={}\n", dir.path().join("a.img").display()))?;
    let sock = dir.path().join("nbd.sock");
    let server = ServeProcess::start_with(&sock, &["--exports-file".into(), list.display().to_string()]);
    let names = || -> Vec<String> {
        let (_, out, _) = run("nbdinfo", &["--list", "--json", &format!("nbd+unix://?socket={}", sock.display())], T);
        let v: serde_json::Value = serde_json::from_str(&out).unwrap_or_default();
        v["exports"].as_array().into_iter().flatten().filter_map(|e| e["export-name"].as_str().map(String::from)).collect()
    };
    check(names() == ["a"], "the file's export is served")?;
    std::fs::write(&list, format!("b={},ro\n", dir.path().join("b.img").display()))?;
    rustix::process::kill_process(rustix::process::Pid::from_raw(server.child.id() as i32).expect("pid"), rustix::process::Signal::HUP)?;
    let start = Instant::now();
    while names() != ["b"] {
        check(start.elapsed() < Duration::from_secs(10), format!("after SIGHUP: {:?}", names()))?;
        std::thread::sleep(Duration::from_millis(50));
    }
    Ok(())
}

/// TCP on 127.0.0.1 with a kernel-chosen port.
fn tcp_listener() -> Result<(), Failed> {
    let dir = tempfile::tempdir()?;
    let img = dir.path().join("t.img");
    std::fs::File::create(&img)?.set_len(MIB)?;
    let exports = std::sync::Arc::new(volring_nbd::Exports::new());
    let config = volring_nbd::ServerConfig { listen: vec!["127.0.0.1:0".parse()?], threads: 1, ..Default::default() };
    let server = volring_nbd::NbdServer::start(config, exports)?;
    server.add_export(&format!("t={}", img.display()).parse()?)?;
    let addr = server.addresses()[0].clone();
    check(addr.starts_with("127.0.0.1:") && !addr.ends_with(":0"), format!("bound {addr}"))?;
    let (ok, out, err) =
        run("qemu-io", &["-f", "raw", "-c", "write -P 0x42 0 64k", "-c", "read -P 0x42 0 64k", &format!("nbd://{addr}/t")], T);
    check(ok && out.contains("read 65536"), format!("qemu-io over TCP: {out}{err}"))?;
    server.stop();
    Ok(())
}

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

/// Serves a well-behaved client on every ring (writes of 1 MiB fill every
/// receive buffer, reads of 4 KiB), then waits for the rings to trim: the
/// RSS after that is the server's idle memory.
fn warm_up(srv: &ChildServer, export: &str) -> Result<u64, Failed> {
    let mut conns: Vec<RawClient> =
        (0..2).map(|_| RawClient::connect(&srv.spec.socket, export, HeaderStyle::Structured, false)).collect::<Result<_, _>>()?;
    for (i, c) in conns.iter_mut().enumerate() {
        for j in 0..24u64 {
            let off = (i as u64 * 24 + j) % 48 * MIB;
            check(c.call(cmd::WRITE, 0, off, MIB, &pattern(j, off, MIB as usize))?.error == 0, "warm-up write")?;
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
fn one_burst_of_reads_is_admitted_request_by_request() -> Result<(), Failed> {
    let dir = tempfile::Builder::new().prefix("volring-nbd-burst-").tempdir()?;
    let conn_bytes = 8 * MIB;
    let srv = child(dir.path(), conn_bytes, 64 * MIB, &[("disk".into(), 64 * MIB, String::new())]);
    let idle = warm_up(&srv, "disk")?;
    let mut hog = RawClient::connect(&srv.spec.socket, "disk", HeaderStyle::Simple, false)?;
    let mut burst = Vec::with_capacity(64 * 1024);
    let mut n = 0u64;
    while burst.len() + 28 <= 64 * 1024 {
        let req = volring_nbd::wire::Request { flags: 0, kind: cmd::READ, cookie: n, offset: n * 61_440 % (60 * MIB), length: 61_440 };
        volring_nbd::wire::encode_request(&req, HeaderStyle::Simple, &mut burst);
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
fn list_flood_in_the_handshake_is_bounded() -> Result<(), Failed> {
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
        bytes.extend_from_slice(&volring_nbd::wire::IHAVEOPT.to_be_bytes());
        bytes.extend_from_slice(&volring_nbd::wire::opt::LIST.to_be_bytes());
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
fn hostile_connections_stay_under_the_server_budget() -> Result<(), Failed> {
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
                        let req = volring_nbd::wire::Request {
                            flags: 0,
                            kind: cmd::READ,
                            cookie: n,
                            offset: (h * 7919 + n) * 4096 % (64 * MIB),
                            length: 4096,
                        };
                        volring_nbd::wire::encode_request(&req, HeaderStyle::Structured, &mut chunk);
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
fn many_hostile_connections_do_not_starve_others() -> Result<(), Failed> {
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

fn main() {
    nbd_support::child_server_main();
    let trials = vec![
        Trial::test("nbd::nbdinfo_shows_every_feature", nbdinfo_shows_every_feature),
        Trial::test("nbd::qemu_io_patterns", qemu_io_patterns),
        Trial::test("nbd::random_workload_then_compare", random_workload_then_compare),
        Trial::test("nbd::nbdcopy_both_ways_multi_conn", nbdcopy_both_ways_multi_conn),
        Trial::test("nbd::block_path_through_nbdfuse", block_path_through_nbdfuse),
        Trial::test("nbd::acked_flush_survives_kill9", acked_flush_survives_kill9),
        Trial::test("nbd::hostile_requests_get_errors", hostile_requests_get_errors),
        Trial::test("nbd::broken_streams_close_only_their_connection", broken_streams_close_only_their_connection),
        Trial::test("nbd::stalled_handshake_is_dropped", stalled_handshake_is_dropped),
        Trial::test("nbd::client_that_never_reads_is_bounded", client_that_never_reads_is_bounded),
        Trial::test("nbd::exports_added_and_removed_at_run_time", exports_added_and_removed_at_run_time),
        Trial::test("nbd::block_status_and_sparse_reads", block_status_and_sparse_reads),
        Trial::test("nbd::block_status_is_bounded_per_request", block_status_is_bounded_per_request),
        Trial::test("nbd::spliced_reads_are_timed_until_sent", spliced_reads_are_timed_until_sent),
        Trial::test("nbd::write_zeroes_without_filesystem_help", write_zeroes_without_filesystem_help),
        Trial::test("nbd::direct_io_export", direct_io_export),
        Trial::test("nbd::tcp_listener", tcp_listener),
        Trial::test("nbd::exports_file_reloads_on_sighup", exports_file_reloads_on_sighup),
        Trial::test("nbd::one_burst_of_reads_is_admitted_request_by_request", one_burst_of_reads_is_admitted_request_by_request),
        Trial::test("nbd::list_flood_in_the_handshake_is_bounded", list_flood_in_the_handshake_is_bounded),
        Trial::test("nbd::hostile_connections_stay_under_the_server_budget", hostile_connections_stay_under_the_server_budget),
        Trial::test("nbd::many_hostile_connections_do_not_starve_others", many_hostile_connections_do_not_starve_others),
    ];
    common::run_in_private_namespace(trials)
}
