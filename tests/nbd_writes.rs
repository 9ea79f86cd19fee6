//! WRITEs through the NBD server onto images on real ext4 and xfs pools
//! (loop devices, mounted in a private mount namespace): small writes at
//! queue depth 32 (done on the ring thread on ext4, through io_uring on
//! xfs) and 1 MiB writes (their payloads received straight into the write
//! buffer) read back identical; and on ext4 small writes are done on the
//! ring thread unless inline writes are turned off.

mod common;
mod nbd_support;

use std::path::Path;
use std::time::Duration;

use common::{check, LoopDevice, Scratch};
use libtest_mimic::{Failed, Trial};
use nbd_support::{run, Rng, Served, MIB};
use volring_nbd::InlineWrites;

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
    let st = s.server().exports().get("disk").expect("export").stats.snapshot("disk");
    eprintln!("{fs}: {} of {} writes inline", st.inline_writes, st.writes);
    check(st.write_bytes >= 2 * SIZE && st.errors == 0, format!("metrics: {st:?}"))
}

fn ext4_writes_read_back_identical() -> Result<(), Failed> {
    written_and_read_back_on("ext4")
}

fn xfs_writes_read_back_identical() -> Result<(), Failed> {
    written_and_read_back_on("xfs")
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
        let st = s.server().exports().get("disk").expect("export").stats.snapshot("disk");
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

fn main() {
    let trials = vec![
        Trial::test("nbd_writes::ext4_writes_read_back_identical", ext4_writes_read_back_identical),
        Trial::test("nbd_writes::xfs_writes_read_back_identical", xfs_writes_read_back_identical),
        Trial::test("nbd_writes::ext4_small_writes_inline_unless_off", ext4_small_writes_inline_unless_off),
    ];
    common::run_in_private_namespace(trials)
}
