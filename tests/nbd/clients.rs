//! Real clients end to end: nbdinfo, qemu-io, qemu-img, nbdcopy, a block
//! path through nbdfuse, and a flush acknowledged before a kill -9.

use super::*;

pub(super) fn nbdinfo_shows_every_feature() -> Result<(), Failed> {
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
pub(super) fn qemu_io_patterns() -> Result<(), Failed> {
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
pub(super) fn random_workload_then_compare() -> Result<(), Failed> {
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

/// A payload-less ack goes as a 16-byte simple reply when structured
/// replies are negotiated (libnbd then reads it in one receive, not two);
/// a READ and an error stay structured, and extended headers stay extended.
pub(super) fn structured_acks_are_simple_replies() -> Result<(), Failed> {
    let s = Served::new(&[("disk", 8 * MIB, false)]);
    for style in [HeaderStyle::Simple, HeaderStyle::Structured, HeaderStyle::Extended] {
        let mut c = RawClient::connect(&s.socket, "disk", style, false)?;
        let acked = |r: &nbd_support::Reply| r.error == 0 && r.simple == (style != HeaderStyle::Extended);
        let w = c.call(cmd::WRITE, 0, 4096, 4096, &pattern(1, 4096, 4096))?;
        check(acked(&w), format!("{style:?}: WRITE ack {w:?}"))?;
        let w = c.call(cmd::WRITE, cf::FUA, 0, 512, &pattern(2, 0, 512))?;
        check(acked(&w), format!("{style:?}: FUA WRITE ack {w:?}"))?;
        for (kind, flags) in [(cmd::FLUSH, 0), (cmd::TRIM, 0), (cmd::WRITE_ZEROES, cf::NO_HOLE), (cmd::CACHE, 0)] {
            let (off, len) = if kind == cmd::FLUSH { (0, 0) } else { (MIB, 8192) };
            let r = c.call(kind, flags, off, len, &[])?;
            check(acked(&r), format!("{style:?}: command {kind} ack {r:?}"))?;
        }
        let r = c.call(cmd::READ, 0, 4096, 4096, &[])?;
        check(r.error == 0 && r.simple == (style == HeaderStyle::Simple), format!("{style:?}: READ reply {r:?}"))?;
        check(r.data == pattern(1, 4096, 4096), format!("{style:?}: READ data"))?;
        // Past the end: an error, with a message where the style carries one.
        let e = c.call(cmd::WRITE, 0, 8 * MIB, 512, &[0u8; 512])?;
        check(e.error != 0 && e.simple == (style == HeaderStyle::Simple), format!("{style:?}: error reply {e:?}"))?;
        // Nothing follows the last reply: a stray byte would show here.
        c.send(cmd::DISC, 0, 0, 0, &[])?;
        let mut rest = Vec::new();
        std::io::Read::read_to_end(&mut c.s, &mut rest)?;
        check(rest.is_empty(), format!("{style:?}: {} bytes after the last reply", rest.len()))?;
    }
    Ok(())
}

/// nbdcopy into and out of the server with four connections each.
pub(super) fn nbdcopy_both_ways_multi_conn() -> Result<(), Failed> {
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
    let st = s.server().exports().get("disk").expect("export").snapshot();
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
pub(super) fn block_path_through_nbdfuse() -> Result<(), Failed> {
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
    let st = s.server().exports().get("disk").expect("export").snapshot();
    check(st.writes > 0 && st.flushes > 0, format!("ext4 wrote and flushed through NBD: {st:?}"))?;
    drop(bp);
    Ok(())
}

/// Writes to distinct blocks with a FLUSH every 8; the server is killed
/// with SIGKILL mid-stream. After a restart every write acknowledged
/// before the last acknowledged flush is in the image.
pub(super) fn acked_flush_survives_kill9() -> Result<(), Failed> {
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
