//! `volring mounts` as a findmnt user drives it: columns, the tree,
//! `--target`/`--source`, and `--watch` as text or JSON. Real mounts in a
//! private mount namespace.

mod common;

use std::io::Read;
use std::os::fd::OwnedFd;
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use common::{check, Scratch};
use libtest_mimic::{Failed, Trial};

const VOLRING: &str = env!("CARGO_BIN_EXE_volring");

fn run(args: &[&str]) -> Result<String, Failed> {
    let out = Command::new(VOLRING).args(args).output()?;
    check(out.status.success(), format!("volring {args:?}: {}", String::from_utf8_lossy(&out.stderr)))?;
    Ok(String::from_utf8(out.stdout)?)
}

fn columns_target_source_and_tree() -> Result<(), Failed> {
    let s = Scratch::new();
    let top = s.tmpfs("top");
    let inner = top.join("inner");
    std::fs::create_dir(&inner)?;
    common::tmpfs_at(&inner);
    let file = inner.join("deep/er");
    std::fs::create_dir(inner.join("deep"))?;
    std::fs::write(&file, b"x")?;
    let target = file.to_string_lossy().to_string();

    // The mount a path is on, with chosen columns (findmnt --target -o).
    let out = run(&["mounts", "--target", &target, "-o", "TARGET,FSTYPE", "--raw"])?;
    let want = format!("TARGET FSTYPE\n{} tmpfs\n", inner.display());
    check(out == want, format!("--target: {out:?}, want {want:?}"))?;
    // Agrees with findmnt.
    let theirs = Command::new("findmnt").args(["--raw", "-n", "-o", "TARGET", "--target", &target]).output()?;
    check(String::from_utf8(theirs.stdout)?.trim() == inner.to_string_lossy(), "findmnt --target agrees")?;

    // --source: only mounts of that source.
    let out = run(&["mounts", "--source", "tmpfs", "-o", "SOURCE", "--raw"])?;
    check(out.lines().skip(1).all(|l| l == "tmpfs") && out.lines().count() >= 3, format!("--source: {out}"))?;

    // The tree draws the inner mount under the outer one.
    let out = run(&["mounts", "--tree", "-o", "TARGET"])?;
    let outer = out.lines().position(|l| l.ends_with(&*top.to_string_lossy())).ok_or(format!("no {} in tree:\n{out}", top.display()))?;
    let under = out.lines().nth(outer + 1).unwrap_or("");
    check(under.contains("└─") && under.ends_with(&*inner.to_string_lossy()), format!("inner not drawn under outer:\n{out}"))?;
    // An unknown column is an error that names it.
    let bad = Command::new(VOLRING).args(["mounts", "-o", "TARGET,BOGUS"]).output()?;
    check(!bad.status.success() && String::from_utf8_lossy(&bad.stderr).contains("BOGUS"), "unknown column named")?;
    common::umount(&inner);
    Ok(())
}

/// `--target` of a path that does not exist: rc 1 and nothing, as findmnt
/// (before: `/` and rc 0), and so is a `--source` nothing is mounted from;
/// `-t`/`--types` keeps the mounts of those types (before: no such flag).
fn missing_target_and_types() -> Result<(), Failed> {
    let out = Command::new(VOLRING).args(["mounts", "--target", "/nonexistent/volring", "--raw"]).output()?;
    let theirs = Command::new("findmnt").args(["--target", "/nonexistent/volring"]).output()?;
    check(
        out.status.code() == Some(1) && out.stdout.is_empty(),
        format!("rc {:?}, stdout {:?}", out.status, String::from_utf8_lossy(&out.stdout)),
    )?;
    check(theirs.status.code() == Some(1), format!("findmnt: {:?}", theirs.status))?;
    let s = Scratch::new();
    s.tmpfs("typed");
    let out = run(&["mounts", "-t", "tmpfs,proc", "--raw", "-o", "FSTYPE"])?;
    let types: std::collections::BTreeSet<&str> = out.lines().skip(1).collect();
    check(types.contains("tmpfs") && types.iter().all(|t| ["tmpfs", "proc"].contains(t)), format!("-t tmpfs,proc: {types:?}"))?;
    // A leading `no` negates the list, as findmnt reads it.
    let out = run(&["mounts", "--types", "noproc,sysfs", "--raw", "-o", "FSTYPE"])?;
    let types: std::collections::BTreeSet<&str> = out.lines().skip(1).collect();
    check(types.contains("tmpfs") && !types.contains("proc") && !types.contains("sysfs"), format!("-t noproc,sysfs: {types:?}"))?;
    // No mount of a source: rc 1 and nothing, as findmnt.
    let out = Command::new(VOLRING).args(["mounts", "--source", "/dev/no-such-source", "--raw"]).output()?;
    check(
        out.status.code() == Some(1) && out.stdout.is_empty(),
        format!("--source nothing: {:?} {:?}", out.status, String::from_utf8_lossy(&out.stdout)),
    )
}

/// A `volring` whose stdout is a pseudo-terminal, as when an operator
/// types the command: what it writes is read from the master side by a
/// thread, so a test waits on a channel with a deadline, never on a read.
struct OnTerminal {
    child: std::process::Child,
    output: mpsc::Receiver<Vec<u8>>,
    seen: String,
}

impl OnTerminal {
    fn spawn(args: &[&str]) -> Result<Self, Failed> {
        use rustix::fs::{Mode, OFlags};
        use rustix::pty::{grantpt, openpt, ptsname, unlockpt, OpenptFlags};
        let master = openpt(OpenptFlags::RDWR | OpenptFlags::NOCTTY)?;
        grantpt(&master)?;
        unlockpt(&master)?;
        let name = ptsname(&master, Vec::new())?;
        let slave: OwnedFd = rustix::fs::open(name.as_c_str(), OFlags::RDWR | OFlags::NOCTTY | OFlags::CLOEXEC, Mode::empty())?;
        // The command (and with it this process's copy of the slave) is
        // dropped once spawned: the master then reads EIO when the child
        // is gone, which ends the reader thread.
        let child = Command::new(VOLRING).args(args).stdin(Stdio::null()).stdout(Stdio::from(slave)).stderr(Stdio::null()).spawn()?;
        let (tx, output) = mpsc::channel();
        let mut master = std::fs::File::from(master);
        std::thread::spawn(move || {
            let mut buf = [0u8; 4096];
            while let Ok(n @ 1..) = master.read(&mut buf) {
                if tx.send(buf[..n].to_vec()).is_err() {
                    break;
                }
            }
        });
        Ok(Self { child, output, seen: String::new() })
    }

    /// Reads until `enough` holds for what was seen (with the terminal's
    /// CR LF turned back into LF) or `limit` passes; returns whether it held.
    fn read_until(&mut self, limit: Duration, enough: impl Fn(&str) -> bool) -> bool {
        let deadline = Instant::now() + limit;
        while !enough(&self.seen) {
            let Some(left) = deadline.checked_duration_since(Instant::now()) else { return false };
            match self.output.recv_timeout(left) {
                Ok(bytes) => self.seen.push_str(&String::from_utf8_lossy(&bytes).replace("\r\n", "\n")),
                Err(mpsc::RecvTimeoutError::Timeout) => return false,
                Err(mpsc::RecvTimeoutError::Disconnected) => return enough(&self.seen),
            }
        }
        true
    }
}

impl Drop for OnTerminal {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// What only happens on a terminal: the table is a tree unless asked
/// otherwise (piped, it is raw), and `--watch` prints readable lines, not
/// JSON.
fn on_a_terminal_tree_and_text_watch() -> Result<(), Failed> {
    let s = Scratch::new();
    let top = s.tmpfs("top");
    let inner = top.join("inner");
    std::fs::create_dir(&inner)?;
    common::tmpfs_at(&inner);

    let mut table = OnTerminal::spawn(&["mounts", "-o", "TARGET"])?;
    let inner_text = inner.to_string_lossy().to_string();
    let done = table.read_until(Duration::from_secs(30), |seen| seen.lines().any(|l| l.ends_with(&inner_text)));
    check(done, format!("the table on a terminal never named {inner_text}:\n{}", table.seen))?;
    let lines: Vec<&str> = table.seen.lines().collect();
    let outer =
        lines.iter().position(|l| l.ends_with(&*top.to_string_lossy())).ok_or(format!("no {} in:\n{}", top.display(), table.seen))?;
    let under = lines.get(outer + 1).copied().unwrap_or("");
    check(under.contains("└─") && under.ends_with(&inner_text), format!("on a terminal the default is the tree:\n{}", table.seen))?;
    let piped = run(&["mounts", "-o", "TARGET"])?;
    check(!piped.contains("└─") && !piped.contains("├─"), format!("piped, the default is raw:\n{piped}"))?;
    common::umount(&inner);

    // Text --watch: a probe mount is made or removed in turn, each state
    // held 500 ms (a re-parse watcher must see it), until its line shows.
    let mut watch = OnTerminal::spawn(&["mounts", "--watch"])?;
    let probe = s.dir("probe");
    let probe_text = probe.to_string_lossy().to_string();
    let wanted = format!(" attached {probe_text} tmpfs");
    let line_for = |seen: &str| seen.lines().find(|l| l.contains(&wanted)).map(str::to_string);
    let (deadline, mut mounted) = (Instant::now() + Duration::from_secs(30), false);
    while line_for(&watch.seen).is_none() && Instant::now() < deadline {
        if mounted {
            common::umount(&probe);
        } else {
            common::tmpfs_at(&probe);
        }
        mounted = !mounted;
        watch.read_until(Duration::from_millis(500), |seen| line_for(seen).is_some());
    }
    if mounted {
        common::umount(&probe);
    }
    let line = line_for(&watch.seen).ok_or(format!("no text line for {probe_text} in 30 s:\n{}", watch.seen))?;
    // `HH:MM:SS.mmm attached PATH ...`: a clock stamp first, no JSON.
    let stamp = line.split(' ').next().unwrap_or("");
    let stamp_ok = stamp.len() == 12 && stamp.as_bytes()[2] == b':' && stamp.as_bytes()[8] == b'.';
    check(stamp_ok && !watch.seen.contains('{'), format!("--watch on a terminal is text with a clock: {line:?}\n{}", watch.seen))
}

fn main() {
    common::run_in_private_namespace(vec![
        Trial::test("cli_mounts::columns_target_source_and_tree", columns_target_source_and_tree),
        Trial::test("cli_mounts::missing_target_and_types", missing_target_and_types),
        Trial::test("cli_mounts::on_a_terminal_tree_and_text_watch", on_a_terminal_tree_and_text_watch),
    ]);
}
