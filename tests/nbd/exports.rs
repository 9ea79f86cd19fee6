//! Exports and their features: added and removed at run time, block
//! status, spliced reads, write zeroes, direct I/O, reload on SIGHUP, TCP.

use super::*;

/// Exports come and go at run time; a limit caps connections.
pub(super) fn exports_added_and_removed_at_run_time() -> Result<(), Failed> {
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
    check(r.data == b"abcd" && c.flags & nbd_support::wire::tx::READ_ONLY != 0, "added again, read-only")
}

/// BLOCK_STATUS from SEEK_DATA/SEEK_HOLE, and hole chunks for sparse reads.
pub(super) fn block_status_and_sparse_reads() -> Result<(), Failed> {
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
pub(super) fn block_status_is_bounded_per_request() -> Result<(), Failed> {
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
pub(super) fn spliced_reads_are_timed_until_sent() -> Result<(), Failed> {
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
        let st = export.snapshot();
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
pub(super) fn write_zeroes_without_filesystem_help() -> Result<(), Failed> {
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
pub(super) fn direct_io_export() -> Result<(), Failed> {
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
pub(super) fn exports_file_reloads_on_sighup() -> Result<(), Failed> {
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
pub(super) fn tcp_listener() -> Result<(), Failed> {
    let dir = tempfile::tempdir()?;
    let img = dir.path().join("t.img");
    std::fs::File::create(&img)?.set_len(MIB)?;
    let exports = std::sync::Arc::new(volring_nbd::Exports::default());
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
