//! WRITEs through the NBD server onto images on real ext4 and xfs pools
//! (loop devices, mounted in a private mount namespace): small writes at
//! queue depth 32 (done on the ring thread on ext4; through io_uring on
//! xfs, but for those that move the file's times) and 1 MiB writes (their
//! payloads received straight into the write buffer) read back identical;
//! and on ext4 small writes are done on the ring thread unless inline
//! writes are turned off; 1 MiB writes are not copied out of the receive
//! buffers, and small ones that arrive whole in one are written from it
//! (xfs and ext4). Last, READs handed to io_uring's workers (a ring starved
//! of CPU) read back what was written, and the ring says it hands them
//! over.

mod common;
mod nbd_support;

use std::path::Path;
use std::time::Duration;

use common::{check, LoopDevice, Scratch};
use libtest_mimic::{Failed, Trial};
use nbd_support::wire::{cmd, encode_request, HeaderStyle, Request};
use nbd_support::{pattern, run, RawClient, Rng, Served, MIB};
use volring_nbd::stats::RingSnapshot;
use volring_nbd::{InlineWrites, OffloadReads};

const T: Duration = Duration::from_secs(120);
const SIZE: u64 = 32 * MIB;

/// A file system of kind `fs` on a loop device, mounted under `scratch`.
fn pool(scratch: &Scratch, fs: &str) -> (LoopDevice, std::path::PathBuf) {
    let dev = LoopDevice::new(512 * MIB);
    dev.mkfs(fs);
    let at = scratch.dir(fs);
    rustix::mount::mount(dev.path(), &at, fs, rustix::mount::MountFlags::empty(), None::<&std::ffi::CStr>)
        .unwrap_or_else(|e| panic!("mount {fs}: {e}"));
    (dev, at)
}

fn random(seed: u64, len: u64) -> Vec<u8> {
    let mut r = Rng(seed | 1);
    (0..len / 8).flat_map(|_| r.next().to_le_bytes()).collect()
}

/// A server (inline writes as given) with one export, a sparse image on `at`.
fn serve(at: &Path, inline: InlineWrites, size: u64) -> Served {
    let s = Served::with_config(&[], |c| c.inline_writes = inline);
    let img = at.join("disk.img");
    std::fs::File::create(&img).and_then(|f| f.set_len(size)).expect("image");
    s.add("disk", &img, false, 0);
    s
}

/// Copies `data` into the export with nbdcopy: `request` bytes a request,
/// `depth` requests in flight, one connection.
fn copy_in(s: &Served, data: &[u8], request: &str, depth: u32) -> Result<(), Failed> {
    let src = s.dir.path().join("src.raw");
    std::fs::write(&src, data)?;
    let args = [
        "--connections=1".to_string(),
        format!("--requests={depth}"),
        format!("--request-size={request}"),
        src.display().to_string(),
        s.uri("disk"),
    ];
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let (ok, _, err) = run("nbdcopy", &args, T);
    check(ok, format!("nbdcopy in ({request} x {depth}): {err}"))
}

/// Reads the export back through the server (nbdcopy) and the image file
/// directly; both must be `data`.
fn read_back(s: &Served, at: &Path, data: &[u8], what: &str) -> Result<(), Failed> {
    let back = s.dir.path().join("back.raw");
    let (ok, _, err) = run("nbdcopy", &["--connections=1", &s.uri("disk"), back.to_str().unwrap()], T);
    check(ok, format!("nbdcopy out: {err}"))?;
    check(std::fs::read(&back)? == data, format!("{what}: read back through NBD differs"))?;
    check(std::fs::read(at.join("disk.img"))? == data, format!("{what}: the image file differs"))
}

/// qemu-io over the same export: a read of a pattern it wrote itself
/// through the server, FUA and plain, small and large, in flight together.
fn qemu_io_mixed(s: &Served) -> Result<(), Failed> {
    let mut args: Vec<String> = vec!["-f".into(), "raw".into()];
    for i in 0..16u64 {
        let (len, fua) = if i % 4 == 3 { (256 * 1024, "") } else { (4096, if i % 2 == 0 { "-f " } else { "" }) };
        args.extend(["-c".into(), format!("aio_write {fua}-P {} {} {len}", 0x20 + i, i * MIB + 512)]);
    }
    args.extend(["-c".into(), "aio_flush".into()]);
    for i in 0..16u64 {
        let len = if i % 4 == 3 { 256 * 1024 } else { 4096 };
        args.extend(["-c".into(), format!("read -P {} {} {len}", 0x20 + i, i * MIB + 512)]);
    }
    args.push(s.uri("disk"));
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let (ok, out, err) = run("qemu-io", &args, T);
    check(ok && !out.contains("Pattern verification failed") && !err.contains("fail"), format!("qemu-io: {out}\n{err}"))
}

fn written_and_read_back_on(fs: &str) -> Result<(), Failed> {
    let scratch = Scratch::new();
    let (_dev, at) = pool(&scratch, fs);
    let s = serve(&at, InlineWrites::Auto, SIZE);
    let small = random(1, SIZE);
    copy_in(&s, &small, "4096", 32)?;
    read_back(&s, &at, &small, &format!("{fs}, 4 KiB writes at QD32"))?;
    let large = random(2, SIZE);
    copy_in(&s, &large, "1048576", 8)?;
    read_back(&s, &at, &large, &format!("{fs}, 1 MiB writes at QD8"))?;
    qemu_io_mixed(&s)?;
    let st = s.server().exports().get("disk").expect("export").snapshot();
    eprintln!("{fs}: {} of {} writes inline", st.inline_writes, st.writes);
    check(st.write_bytes >= 2 * SIZE && st.errors == 0, format!("metrics: {st:?}"))
}

fn ext4_writes_read_back_identical() -> Result<(), Failed> {
    written_and_read_back_on("ext4")
}

fn xfs_writes_read_back_identical() -> Result<(), Failed> {
    written_and_read_back_on("xfs")
}

/// On xfs, which takes RWF_NOWAIT writes, small writes go through the
/// ring, and the first of each tick of the coarse clock (and those near
/// one) is done on the ring thread, so that its time stamp does not send it
/// and the rest of its turn to io_uring's workers. Before, none was done
/// there (`inline_writes` stayed 0 on xfs).
fn xfs_time_stamps_are_written_on_the_ring_thread() -> Result<(), Failed> {
    let scratch = Scratch::new();
    let (_dev, at) = pool(&scratch, "xfs");
    let s = serve(&at, InlineWrites::Auto, SIZE);
    let data = random(3, SIZE);
    copy_in(&s, &data, "4096", 32)?;
    read_back(&s, &at, &data, "xfs, 4 KiB writes at QD32")?;
    let st = s.server().exports().get("disk").expect("export").snapshot();
    eprintln!("xfs: {} of {} writes on the ring thread", st.inline_writes, st.writes);
    // The first write after the probe stamps; more than one: later ticks
    // were stamped too (8,192 writes span many).
    check(st.inline_writes >= 2, format!("no later time stamp was written on the ring thread: {st:?}"))?;
    // About 3-5 % at HZ=250; at HZ=1000 a fifth of each tick is near one.
    check(st.inline_writes * 2 <= st.writes, format!("xfs writes no longer go mostly through the ring: {st:?}"))
}

/// On ext4 (no RWF_NOWAIT for buffered writes) small writes are done on the
/// ring thread (counted per export); with inline writes off none is, every
/// one goes through io_uring. The data is the same either way.
fn ext4_small_writes_inline_unless_off() -> Result<(), Failed> {
    let scratch = Scratch::new();
    let (_dev, at) = pool(&scratch, "ext4");
    for inline in [InlineWrites::Auto, InlineWrites::Off] {
        let s = serve(&at, inline, SIZE / 4);
        let data = random(3 + inline as u64, SIZE / 4);
        copy_in(&s, &data, "4096", 32)?;
        let st = s.server().exports().get("disk").expect("export").snapshot();
        eprintln!("inline writes {inline:?}: {} of {} writes inline", st.inline_writes, st.writes);
        match inline {
            // All but those a slow write sent back to io_uring for a while.
            InlineWrites::Auto => check(st.inline_writes > 0, format!("no write was done inline on ext4: {st:?}"))?,
            InlineWrites::Off => check(st.inline_writes == 0 && st.writes == 2048, format!("off: {st:?}"))?,
        }
        read_back(&s, &at, &data, &format!("ext4, inline writes {inline:?}"))?;
        drop(s);
        std::fs::remove_file(at.join("disk.img"))?;
    }
    Ok(())
}

/// Sends WRITEs of `(offset, length)` over one connection, every one
/// before any reply is read (a thread of its own writes them), and checks
/// every reply; `image` is updated with what each wrote.
fn pipelined_writes(s: &Served, writes: &[(u64, u64)], image: &mut [u8]) -> Result<(), Failed> {
    let mut c = RawClient::connect(&s.socket, "disk", HeaderStyle::Extended, false)?;
    let mut stream = c.s.try_clone()?;
    let list = writes.to_vec();
    let writer = std::thread::spawn(move || -> std::io::Result<()> {
        use std::io::Write;
        for (i, &(offset, length)) in list.iter().enumerate() {
            let mut b = Vec::new();
            let req = Request { flags: 0, kind: cmd::WRITE, cookie: i as u64 + 1, offset, length };
            encode_request(&req, HeaderStyle::Extended, &mut b);
            b.extend_from_slice(&pattern(i as u64, offset, length as usize));
            stream.write_all(&b)?;
        }
        Ok(())
    });
    for _ in writes {
        let r = c.reply(None)?;
        check(r.error == 0, format!("WRITE {} failed: error {}", r.cookie, r.error))?;
    }
    writer.join().map_err(|_| "the writer panicked")??;
    for (i, &(offset, length)) in writes.iter().enumerate() {
        image[offset as usize..(offset + length) as usize].copy_from_slice(&pattern(i as u64, offset, length as usize));
    }
    Ok(())
}

/// 1 MiB WRITEs are received without a second pass over their payloads:
/// once a large WRITE has come, each next request's header is received
/// alone and a large payload straight into its WRITE's buffer, so no
/// payload byte lands in the ring's receive buffers to be copied out. Only
/// the first large WRITE after the handshake or after small requests (its
/// head arrives while the multishot receive is armed) may be copied, in
/// part. Small WRITEs between large ones (received by the multishot
/// receive again: copied when a receive cut one in two) and large ones
/// after them read back as written. The count is the export's `copied_write_bytes`
/// (`volring_nbd_copied_write_bytes`).
fn large_writes_are_not_copied_out_of_receive_buffers() -> Result<(), Failed> {
    let s = Served::with_config(&[], |c| c.threads = 1);
    let img = s.dir.path().join("disk.img");
    std::fs::File::create(&img).and_then(|f| f.set_len(SIZE))?;
    s.add("disk", &img, false, 0);
    let copied = || s.server().exports().get("disk").expect("export").snapshot().copied_write_bytes;
    let mut image = random(6, SIZE);
    copy_in(&s, &image, "1048576", 8)?;
    let by_nbdcopy = copied();
    check(
        by_nbdcopy <= MIB,
        format!("32 WRITEs of 1 MiB from nbdcopy at QD8: {by_nbdcopy} payload bytes copied out of the receive buffers (at most the first WRITE's may be)"),
    )?;
    let large = |from: u64| (0..8).map(move |i| ((from + i) * MIB, MIB));
    let small = (0..64).map(|i| (16 * MIB + i * 4096 + 512, 4096));
    let writes: Vec<(u64, u64)> = large(0).chain(small).chain(large(20)).collect();
    pipelined_writes(&s, &writes, &mut image)?;
    let by_raw = copied() - by_nbdcopy;
    eprintln!("payload bytes copied out of the receive buffers: {by_nbdcopy} (nbdcopy), {by_raw} (raw client)");
    check(
        by_raw <= 2 * MIB + 64 * 4096,
        format!("16 WRITEs of 1 MiB and 64 of 4 KiB: {by_raw} payload bytes copied (at most 2 large WRITEs' and the small ones' may be)"),
    )?;
    check(std::fs::read(&img)? == image, "the image differs from what was written")
}

/// Small WRITEs that arrive whole in one receive are written from the
/// ring's receive buffer they landed in (xfs takes them through io_uring,
/// ext4 inline, see `ext4_small_writes_inline_unless_off`), not copied
/// into a buffer of their own first: at
/// most those whose payload a receive cut in two (or that came while the
/// connection holds its share of receive buffers) are copied. Checked for
/// nbdcopy's client (header and payload sent apart) and for a raw client
/// that sends eight whole WRITEs at a time; both read back as written.
/// The count is the export's `copied_write_bytes`.
fn small_writes_are_written_from_receive_buffers_on(fs: &str) -> Result<(), Failed> {
    let scratch = Scratch::new();
    let (_dev, at) = pool(&scratch, fs);
    let size = SIZE / 4;
    let s = serve(&at, InlineWrites::Auto, size);
    let copied = || s.server().exports().get("disk").expect("export").snapshot().copied_write_bytes;
    let mut image = random(7, size);
    copy_in(&s, &image, "4096", 32)?;
    let by_nbdcopy = copied();
    let writes: Vec<(u64, u64)> = (0..512).map(|i| (i * 8192 + 512, 4096)).collect();
    batched_writes(&s, &writes, &mut image)?;
    let by_raw = copied() - by_nbdcopy;
    eprintln!(
        "{fs}: payload bytes copied out of the receive buffers: {by_nbdcopy} of {size} (nbdcopy), {by_raw} of {} (raw client)",
        512 * 4096
    );
    // nbdcopy keeps 32 WRITEs in flight, each receive may take a buffer of
    // its own, and on a loaded machine (xfs handing writes to io_uring's
    // workers) past its share of buffers a connection's payloads are
    // copied: how many depends on how fast writes end, so only "most are
    // not" is checked. The raw client's batches never reach the share.
    check(by_nbdcopy < size / 2, format!("{fs}: nbdcopy's 4 KiB WRITEs at QD32: {by_nbdcopy} of {size} payload bytes copied"))?;
    check(
        by_raw <= 512 * 4096 / 8,
        format!("{fs}: 64 batches of eight 4 KiB WRITEs: {by_raw} of {} payload bytes copied (at most one a batch may be)", 512 * 4096),
    )?;
    read_back(&s, &at, &image, &format!("{fs}, 4 KiB writes from the receive buffers"))?;
    every_receive_buffer_given_back(&s)
}

/// Sends WRITEs of `(offset, length)` over one connection eight at a time,
/// each eight in one write of the socket, and reads their replies before
/// the next eight; `image` is updated with what each wrote. A batch (33 KB)
/// lands in at most two receives (a unix socket moves it in pieces of about
/// 32 KiB or more), so at most one payload a batch is cut by a receive, and
/// the connection never holds more than two receive buffers at once.
fn batched_writes(s: &Served, writes: &[(u64, u64)], image: &mut [u8]) -> Result<(), Failed> {
    use std::io::Write;
    let mut c = RawClient::connect(&s.socket, "disk", HeaderStyle::Extended, false)?;
    for (n, batch) in writes.chunks(8).enumerate() {
        let mut b = Vec::new();
        for (i, &(offset, length)) in batch.iter().enumerate() {
            let cookie = (n * 8 + i) as u64 + 1;
            encode_request(&Request { flags: 0, kind: cmd::WRITE, cookie, offset, length }, HeaderStyle::Extended, &mut b);
            b.extend_from_slice(&pattern(cookie, offset, length as usize));
        }
        c.s.write_all(&b)?;
        for _ in batch {
            let r = c.reply(None)?;
            check(r.error == 0, format!("WRITE {} failed: error {}", r.cookie, r.error))?;
        }
        for (i, &(offset, length)) in batch.iter().enumerate() {
            let cookie = (n * 8 + i) as u64 + 1;
            image[offset as usize..(offset + length) as usize].copy_from_slice(&pattern(cookie, offset, length as usize));
        }
    }
    Ok(())
}

/// With every client gone, each ring holds no receive buffer (a lent one
/// that was never recycled would shrink its pool for good), as its next
/// tick publishes it (bounded wait).
fn every_receive_buffer_given_back(s: &Served) -> Result<(), Failed> {
    let mut rings = Vec::new();
    for _ in 0..100 {
        std::thread::sleep(Duration::from_millis(50));
        rings = Vec::<RingSnapshot>::from(&**s.server().exports());
        if !rings.is_empty() && rings.iter().all(|r| r.recv_buffers_held == 0 && r.recv_buffers_lent == 0) {
            return Ok(());
        }
    }
    check(false, format!("receive buffers still held with no client: {rings:?}"))
}

fn xfs_small_writes_are_written_from_receive_buffers() -> Result<(), Failed> {
    small_writes_are_written_from_receive_buffers_on("xfs")
}

fn ext4_small_writes_are_written_from_receive_buffers() -> Result<(), Failed> {
    small_writes_are_written_from_receive_buffers_on("ext4")
}

/// Threads of io_uring's workers serving a ring of this process's NBD
/// server (named `iou-wrk-<tid of the ring thread>`).
fn ring_workers() -> usize {
    let comms: Vec<(String, String)> = std::fs::read_dir("/proc/self/task")
        .map(|d| {
            d.flatten()
                .filter_map(|t| Some((t.file_name().to_str()?.to_string(), std::fs::read_to_string(t.path().join("comm")).ok()?)))
                .collect()
        })
        .unwrap_or_default();
    let rings: Vec<&str> = comms.iter().filter(|(_, c)| c.starts_with("nbd-ring-")).map(|(tid, _)| tid.as_str()).collect();
    comms.iter().filter(|(_, c)| rings.iter().any(|tid| c.trim() == format!("iou-wrk-{tid}"))).count()
}

/// Page-cache READs handed to io_uring's workers (what a ring starved of
/// CPU does; `always` here) read back what was written, over several
/// connections at once, small and unaligned; and they did go to workers.
fn reads_in_io_uring_workers_read_back_what_was_written() -> Result<(), Failed> {
    let s = Served::with_config(&[], |c| {
        c.offload_reads = OffloadReads::Always;
        c.threads = 1;
    });
    let img = s.dir.path().join("disk.img");
    let data = random(5, SIZE / 4);
    // Written to the file, not through the server: no write of the server
    // starts a worker, so the workers counted below are the reads'.
    std::fs::write(&img, &data)?;
    s.add("disk", &img, false, 0);
    let threads: Vec<_> = (0..4u64)
        .map(|t| {
            let (socket, data) = (s.socket.clone(), data.clone());
            std::thread::spawn(move || -> Result<(), String> {
                let mut c = RawClient::connect(&socket, "disk", HeaderStyle::Structured, false).map_err(|e| e.to_string())?;
                let mut rng = Rng(0x77 + t);
                for _ in 0..500 {
                    let len = [4096, 512, 1 + rng.below(60_000)][rng.below(3) as usize];
                    let off = rng.below(data.len() as u64 - len);
                    let r = c.call(cmd::READ, 0, off, len, &[]).map_err(|e| e.to_string())?;
                    if r.error != 0 || r.data != data[off as usize..(off + len) as usize] {
                        return Err(format!("connection {t}: read {off}+{len} differs (error {})", r.error));
                    }
                }
                Ok(())
            })
        })
        .collect();
    let workers = ring_workers();
    for t in threads {
        t.join().map_err(|_| "a reader panicked")??;
    }
    // nbdcopy: requests in flight together, answered out of order.
    let back = s.dir.path().join("back.raw");
    let (ok, _, err) =
        run("nbdcopy", &["--connections=2", "--requests=16", "--request-size=4096", &s.uri("disk"), back.to_str().unwrap()], T);
    check(ok, format!("nbdcopy out: {err}"))?;
    check(std::fs::read(&back)? == data, "read back through NBD with reads offloaded differs")?;
    let workers = workers.max(ring_workers());
    check(workers > 0, "no io_uring worker served the ring's reads")?;
    // What an operator sees of it: the export's counter (volring_nbd_offloaded_reads).
    let st = s.server().exports().get("disk").expect("export").snapshot();
    check(st.offloaded_reads >= 2000, format!("the 2,000 raw reads were not counted as offloaded: {st:?}"))?;
    // And the ring's own gauge (volring_nbd_ring_offloading_reads), which
    // the ring publishes at its next tick (at most 250 ms away).
    let mut rings = Vec::new();
    for _ in 0..200 {
        rings = Vec::<RingSnapshot>::from(&**s.server().exports());
        if rings.first().is_some_and(|r| r.offloading_reads) {
            break;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    check(rings.len() == 1 && rings[0].offloading_reads, format!("the one ring does not say it offloads: {rings:?}"))?;
    // A stopped server's rings leave the catalog (and /metrics).
    let exports = s.server().exports().clone();
    drop(s);
    check(Vec::<RingSnapshot>::from(&*exports).is_empty(), "a stopped server's rings are still published")
}

/// The ring thread's calls of `io_uring_enter`, as it last published them
/// (at its tick, at most 250 ms ago).
fn ring_enters(s: &Served) -> u64 {
    Vec::<RingSnapshot>::from(&**s.server().exports()).first().map_or(0, |r| r.enters)
}

/// A client with one request at a time, on ext4 (where the ring writes
/// small WRITEs itself): each request costs the ring one kernel entry, the
/// wait that its reply's send is handed over in and the next request ends.
/// Before, the send took an enter of its own (submit, reap it at once) and
/// the sleep another: two per request. The idle poll is off, as on a ring
/// contended for its CPU, so every gap is a sleep.
fn a_lone_request_costs_the_ring_one_kernel_entry() -> Result<(), Failed> {
    const REQUESTS: u64 = 1000;
    let scratch = Scratch::new();
    let (_dev, at) = pool(&scratch, "ext4");
    let s = Served::with_config(&[], |c| {
        c.threads = 1;
        c.idle_poll = Duration::ZERO;
    });
    let img = at.join("disk.img");
    std::fs::File::create(&img).and_then(|f| f.set_len(SIZE))?;
    s.add("disk", &img, false, 0);
    let mut c = RawClient::connect(&s.socket, "disk", HeaderStyle::Simple, false)?;
    let block = pattern(9, 0, 4096);
    let mut write = |i: u64| -> Result<(), Failed> {
        let r = c.call(cmd::WRITE, 0, (i * 4096) % SIZE, 4096, &block)?;
        check(r.error == 0, format!("write {i}: error {}", r.error))
    };
    for i in 0..20 {
        write(i)?;
    }
    // Two ticks apart, so each count is one the ring published after the
    // requests before it.
    std::thread::sleep(Duration::from_millis(600));
    let before = ring_enters(&s);
    for i in 0..REQUESTS {
        write(i)?;
    }
    std::thread::sleep(Duration::from_millis(600));
    let spent = ring_enters(&s) - before;
    // The ticks in the 1.2 s add one enter or two each.
    // (Before the flush count restarted each turn, every eighth lone write
    // also paid a flush's enter: 1,127 for 1,000.)
    check(
        spent <= REQUESTS * 3 / 2,
        format!("{REQUESTS} lone requests cost the ring {spent} kernel entries (one each, and the ticks', expected)"),
    )?;
    check(spent >= REQUESTS, format!("{spent} entries for {REQUESTS} requests: the count is not the ring's"))
}

fn main() {
    let trials = vec![
        Trial::test("nbd_writes::ext4_writes_read_back_identical", ext4_writes_read_back_identical),
        Trial::test("nbd_writes::xfs_writes_read_back_identical", xfs_writes_read_back_identical),
        Trial::test("nbd_writes::ext4_small_writes_inline_unless_off", ext4_small_writes_inline_unless_off),
        Trial::test("nbd_writes::xfs_time_stamps_are_written_on_the_ring_thread", xfs_time_stamps_are_written_on_the_ring_thread),
        Trial::test("nbd_writes::large_writes_are_not_copied_out_of_receive_buffers", large_writes_are_not_copied_out_of_receive_buffers),
        Trial::test("nbd_writes::xfs_small_writes_are_written_from_receive_buffers", xfs_small_writes_are_written_from_receive_buffers),
        Trial::test("nbd_writes::ext4_small_writes_are_written_from_receive_buffers", ext4_small_writes_are_written_from_receive_buffers),
        Trial::test("nbd_writes::a_lone_request_costs_the_ring_one_kernel_entry", a_lone_request_costs_the_ring_one_kernel_entry),
        Trial::test(
            "nbd_writes::reads_in_io_uring_workers_read_back_what_was_written",
            reads_in_io_uring_workers_read_back_what_was_written,
        ),
    ];
    common::run_in_private_namespace(trials)
}
