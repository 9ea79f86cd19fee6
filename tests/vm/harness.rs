//! Runs scripts in a VM booted on Debian 12's own 6.1 kernel.
//!
//! This machine's kernel lacks modules the NBD tests need (nbd) and is newer
//! than what many nodes run, so the kernel-facing tests also run in a guest:
//! qemu under TCG (this machine's /dev/kvm is a paravirtual variant stock
//! kernels cannot use), the host's / as a read-only 9p root with a tmpfs
//! overlay (so the project's binaries and Debian's tools run unchanged), the
//! guest's modules from the cache, a scratch ext4 disk as /tmp. The pieces
//! come from `tests/vm/fetch.sh`; `tests/vm/init.sh` is the guest's init.
//!
//! A run's output comes back over a read-write 9p share: the script's stdout
//! and stderr, its exit status, and whatever it writes to `$VM_RESULTS`.
//! qemu is killed by PID when the run times out, when the run is dropped, and
//! (PR_SET_PDEATHSIG) when the test process dies.

#![allow(dead_code)]

use std::fs;
use std::io;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// The last `n` lines of `text` (a log's end, for a failure message).
pub fn tail(text: &str, n: usize) -> String {
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

/// The unpacked kernel, initramfs and qemu.
#[derive(Debug, Clone)]
pub struct VmImage {
    pub dir: PathBuf,
    pub qemu: PathBuf,
    pub firmware: PathBuf,
    pub kernel: PathBuf,
    pub initrd: PathBuf,
    pub modules: PathBuf,
    pub kernel_version: String,
}

impl VmImage {
    /// The cache `tests/vm/fetch.sh` filled: `$VOLRING_VM_DIR`, else
    /// `target/vm-cache` of this checkout. Says what is missing.
    pub fn locate() -> Result<Self, String> {
        let dir = match std::env::var_os("VOLRING_VM_DIR") {
            Some(d) => PathBuf::from(d),
            None => Path::new(env!("CARGO_MANIFEST_DIR")).join("target/vm-cache"),
        };
        let image = Self {
            qemu: dir.join("qemu"),
            firmware: dir.join("firmware"),
            kernel: dir.join("vmlinux"),
            initrd: dir.join("initramfs.cpio"),
            modules: dir.join("modules"),
            kernel_version: fs::read_to_string(dir.join("kernel.version")).unwrap_or_default().trim().to_string(),
            dir,
        };
        for p in [&image.qemu, &image.firmware, &image.kernel, &image.initrd, &image.modules] {
            if !p.exists() {
                return Err(format!("{} is missing (run tests/vm/fetch.sh)", p.display()));
            }
        }
        if image.kernel_version.is_empty() {
            return Err(format!("{} has no kernel.version (run tests/vm/fetch.sh)", image.dir.display()));
        }
        Ok(image)
    }
}

/// The shell functions the guest scripts share (writer, waits, checks).
const LIB: &str = include_str!("lib.sh");

/// A guest script: `VOLRING` (the binary under test) and `env` exported,
/// tests/vm/lib.sh, then `body`.
///
/// The guest runs the debug binary as built. A stripped copy would not
/// load faster: `objcopy --strip-debug` or `--strip-all` leaves the LOAD
/// segments as they are (only unmapped sections go), and on the host
/// `volring --version` took 926-959 minor page faults with each of the
/// three binaries.
pub fn script(volring: &str, env: &[(&str, &str)], body: &str) -> String {
    let mut script = format!("export VOLRING='{volring}'\n");
    for (k, v) in env {
        script.push_str(&format!("export {k}='{v}'\n"));
    }
    script.push_str(LIB);
    script.push_str(body);
    script
}

/// True when CI runs us: there a missing VM is a failure, not a skip.
pub fn in_ci() -> bool {
    std::env::var("CI").is_ok_and(|v| v == "true")
}

/// The image, or `None` after printing why the VM tests skip. Panics instead
/// in CI, where `.ci/run` fetches the image first, so a skip there would hide
/// a broken setup.
pub fn image_or_skip(test: &str) -> Option<VmImage> {
    match VmImage::locate() {
        Ok(image) => Some(image),
        Err(why) if in_ci() => panic!("{test}: no VM image in CI: {why}"),
        Err(why) => {
            eprintln!("skip: {test}: no VM image: {why}");
            None
        }
    }
}

/// One guest to boot; each `run` boots it afresh.
pub struct Vm {
    image: VmImage,
    pub cpus: u32,
    pub memory_mib: u32,
    /// Size of the sparse scratch disk mounted at /tmp in the guest.
    pub disk_mib: u64,
    /// More qemu arguments. The guest has no network device unless one is
    /// added here (`-nodefaults`); the init loads the driver of a virtio one
    /// (virtio-net-pci), the script configures its address.
    pub extra_args: Vec<String>,
    /// How long a boot may take to reach the init before [`Vm::start`]
    /// boots it again ([`BOOT_LIMIT`]).
    pub boot_limit: Duration,
}

/// What a run left behind.
pub struct GuestRun {
    /// The script's exit status; `None` when the guest never wrote one
    /// (timed out, crashed, or the init failed).
    pub status: Option<i32>,
    pub timed_out: bool,
    /// The script's stdout and stderr.
    pub stdout: String,
    /// The serial console: kernel messages and the init's.
    pub console: String,
    /// qemu's own stderr.
    pub qemu_stderr: String,
    /// What the script wrote to `$VM_RESULTS`.
    pub results: PathBuf,
    pub qemu_pid: u32,
    /// Wall time from qemu's start to its exit (or its kill).
    pub elapsed: Duration,
    /// 2 when the first boot hung before the init (see [`Vm::start`]).
    pub boots: u32,
    work: tempfile::TempDir,
}

impl GuestRun {
    /// Everything a failure message needs.
    pub fn describe(&self) -> String {
        format!(
            "status {:?}, timed out {}, {:.1} s, boots {}\n--- stdout\n{}\n--- console\n{}\n--- qemu\n{}",
            self.status,
            self.timed_out,
            self.elapsed.as_secs_f64(),
            self.boots,
            self.stdout,
            self.console,
            self.qemu_stderr
        )
    }

    /// The run's work directory (removed when this is dropped).
    pub fn dir(&self) -> &Path {
        self.work.path()
    }

    /// The results file `name` the script wrote (empty when it wrote none).
    pub fn read(&self, name: &str) -> String {
        fs::read_to_string(self.results.join(name)).unwrap_or_default()
    }

    /// `Ok` when the script exited 0.
    pub fn ok(&self) -> Result<(), String> {
        if self.status == Some(0) {
            Ok(())
        } else {
            Err(self.describe())
        }
    }
}

/// `script`, or with `VOLRING_VM_PERF` (a host directory) set, `script`
/// run under `perf record -a -g` in the guest (the host's perf, the
/// guest's kernel: both 6.1): the profile and the guest's kallsyms are
/// copied to that directory when the guest ends, for `perf report -i
/// DATA --kallsyms KALLSYMS` on the host (the guest's root is the host's,
/// so the binaries resolve). A profiling aid only; no trial sets it.
fn perf_wrapped(script: &str) -> String {
    if std::env::var_os("VOLRING_VM_PERF").is_none() {
        return script.to_string();
    }
    format!(
        "if [ -z \"${{VM_PERF_ON:-}}\" ]; then\n  export VM_PERF_ON=1\n  \
         perf record -q -a -g -e cpu-clock -F 199 -o /tmp/perf.data -- /bin/sh \"$0\"\n  s=$?\n  \
         cp /proc/kallsyms \"$VM_RESULTS/perf.kallsyms\"\n  cp /tmp/perf.data \"$VM_RESULTS/perf.data\"\n  exit $s\nfi\n{script}"
    )
}

/// Kills qemu by PID unless it already exited, so a panic anywhere in `run`
/// leaves no guest behind.
struct Running(Child);

impl Drop for Running {
    fn drop(&mut self) {
        if matches!(self.0.try_wait(), Ok(None)) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
}

impl Vm {
    pub fn new(image: &VmImage) -> io::Result<Self> {
        if !image.qemu.exists() {
            return Err(io::Error::new(io::ErrorKind::NotFound, format!("{} missing", image.qemu.display())));
        }
        Ok(Self { image: image.clone(), cpus: 2, memory_mib: 2048, disk_mib: 4096, extra_args: Vec::new(), boot_limit: BOOT_LIMIT })
    }

    /// The work directory (script, scratch disk, the share that receives the
    /// output) and the qemu command that boots the guest on it, set to die
    /// with the thread that spawns it.
    pub fn prepare(&self, script: &str) -> io::Result<(tempfile::TempDir, Command)> {
        let work = tempfile::Builder::new().prefix("volring-vm-").tempdir()?;
        let xfer = work.path().join("xfer");
        fs::create_dir(&xfer)?;
        fs::write(xfer.join("script"), perf_wrapped(script))?;
        let disk = work.path().join("disk.img");
        fs::File::create(&disk)?.set_len(self.disk_mib << 20)?;
        let mkfs = Command::new("mkfs.ext4").args(["-q", "-F", "-E", "lazy_itable_init=1"]).arg(&disk).output()?;
        if !mkfs.status.success() {
            return Err(io::Error::other(format!("mkfs.ext4 scratch disk: {}", String::from_utf8_lossy(&mkfs.stderr))));
        }
        let console = work.path().join("console.log");
        let qemu_err = work.path().join("qemu.stderr");

        let share = |path: &Path, tag: &str, ro: bool| {
            format!(
                "local,path={},mount_tag={tag},security_model=none,multidevs=remap{}",
                path.display(),
                if ro { ",readonly=on" } else { "" }
            )
        };
        let mut cmd = Command::new(&self.image.qemu);
        cmd.arg("-L").arg(&self.image.firmware);
        cmd.args(["-nodefaults", "-no-user-config", "-nographic", "-no-reboot"]);
        // Without ERMS and FSRM: with them the guest's kernel and libc copy
        // and clear memory with `rep movsb`/`rep stosb`, which TCG runs a
        // byte at a time; without them they use 8-byte moves. A guest
        // writing 256 MiB with fsync and hashing 32 MiB took 14.2-14.6 s of
        // qemu CPU with them and 10.6-11.3 s without (two runs each, host
        // load 9-13); a boot alone ~5 s either way.
        cmd.args(["-machine", "pc", "-accel", "tcg", "-cpu", "max,-erms,-fsrm"]);
        cmd.args(["-smp", &self.cpus.to_string(), "-m", &self.memory_mib.to_string()]);
        cmd.arg("-kernel").arg(&self.image.kernel);
        cmd.arg("-initrd").arg(&self.image.initrd);
        // no_timer_check: under TCG on a loaded host the kernel's check of
        // the IO-APIC timer can miss its ticks and panic the boot ("IO-APIC +
        // timer doesn't work!", seen with the host at load 20).
        // cryptomgr.notests: the crypto self-tests Debian's kernel runs at
        // boot; in CI one boot of `-cpu max` spun in `cryptomgr_test` for
        // the trial's whole 600 s (stuck from 2 s into the boot, a soft
        // lockup reported every 28 s, never reaching the init), and no
        // trial tests the kernel's crypto.
        cmd.args(["-append", "console=ttyS0 panic=-1 loglevel=4 no_timer_check cryptomgr.notests=1"]);
        cmd.arg("-serial").arg(format!("file:{}", console.display()));
        cmd.args(["-virtfs", &share(Path::new("/"), "hostroot", true)]);
        cmd.args(["-virtfs", &share(&fs::canonicalize(&self.image.modules)?, "modules", true)]);
        cmd.args(["-virtfs", &share(&xfer, "xfer", false)]);
        cmd.arg("-drive").arg(format!("file={},if=virtio,format=raw,cache=unsafe", disk.display()));
        cmd.args(&self.extra_args);
        cmd.stdin(Stdio::null()).stdout(Stdio::null()).stderr(fs::File::create(&qemu_err)?);
        volring_sys::kill_with_parent(&mut cmd);

        Ok((work, cmd))
    }

    /// Boots the guest, runs `script` under /bin/sh as root in it, powers it
    /// off. Kills qemu once `timeout` passed.
    pub fn run(&self, script: &str, timeout: Duration) -> io::Result<GuestRun> {
        self.start(script)?.wait(timeout)
    }

    /// Boots the guest on `script` and returns once its kernel started the
    /// init (or qemu ended), so the caller can play the other side of what
    /// the script does (a server on the host, files exchanged through
    /// [`Guest::xfer`]) while it runs.
    ///
    /// A kernel that hangs before the init (a soft lockup on the console
    /// before the init's first line, or no init after `boot_limit`) is
    /// killed and booted once more, saying so, and `start` returns as soon
    /// as that second qemu runs (a second hang is the trial's timeout to
    /// report): no code of this project ran yet, and a hung boot under
    /// TCG is the emulator's or the guest kernel's, not the trial's. A
    /// false soft lockup (a vCPU starved on a loaded host) costs one boot.
    /// [`Guest::elapsed`] counts from the boot that runs the script.
    pub fn start(&self, script: &str) -> io::Result<Guest> {
        let mut guest = self.boot(script)?;
        if let Some(why) = guest.hung_before_init(self.boot_limit) {
            eprintln!(
                "note: the guest's kernel hung before its init ({why}, {:.0} s); booting it again. Its console:\n{}",
                guest.elapsed().as_secs_f64(),
                tail(&guest.console(), 8)
            );
            drop(guest);
            guest = self.boot(script)?;
            guest.boots = 2;
        }
        Ok(guest)
    }

    fn boot(&self, script: &str) -> io::Result<Guest> {
        let (work, mut cmd) = self.prepare(script)?;
        let start = Instant::now();
        let qemu = Running(cmd.spawn()?);
        Ok(Guest { work, qemu, start, boots: 1 })
    }
}

/// How long a boot may take to reach the init before it counts as hung.
/// The init's first line comes 2-5 s into a quiet boot; the whole boot to
/// the script has taken over 120 s on a loaded host.
pub const BOOT_LIMIT: Duration = Duration::from_secs(300);

/// The init's first console line (tests/vm/init.sh).
const INIT_STARTED: &str = "vm-init: stage 1";

/// A guest booted by [`Vm::start`]; qemu is killed (by PID) if this is
/// dropped before [`Guest::wait`].
pub struct Guest {
    // Before `work`: a guest dropped unwaited has its qemu killed before
    // its work directory is removed (fields drop in this order).
    qemu: Running,
    work: tempfile::TempDir,
    start: Instant,
    /// 2 when the first boot hung before the init (see [`Vm::start`]).
    pub boots: u32,
}

impl Guest {
    /// The read-write share: the guest sees it as /run/vm (cache=none, so
    /// a file the host writes here is seen by the guest's next open), its
    /// `$VM_RESULTS` is `results/` in it.
    pub fn xfer(&self) -> PathBuf {
        self.work.path().join("xfer")
    }

    pub fn qemu_pid(&self) -> u32 {
        self.qemu.0.id()
    }

    /// Time since qemu started (what [`Guest::wait`]'s timeout counts).
    pub fn elapsed(&self) -> Duration {
        self.start.elapsed()
    }

    /// The script's stdout so far (the share is cache=none in the guest,
    /// so its writes reach this file as they happen).
    pub fn stdout(&self) -> String {
        fs::read(self.xfer().join("stdout")).map(|b| String::from_utf8_lossy(&b).into_owned()).unwrap_or_default()
    }

    /// The serial console so far.
    pub fn console(&self) -> String {
        fs::read(self.work.path().join("console.log")).map(|b| String::from_utf8_lossy(&b).into_owned()).unwrap_or_default()
    }

    /// Waits (bounded by `limit`, one look every 100 ms) for the kernel to
    /// start the init. `Some(why)` when it hung first; `None` once the init
    /// runs, or when qemu ended (the caller's wait reports how).
    fn hung_before_init(&mut self, limit: Duration) -> Option<&'static str> {
        loop {
            let console = self.console();
            if console.contains(INIT_STARTED) || self.finished() {
                return None;
            }
            if console.contains("soft lockup") {
                return Some("a soft lockup");
            }
            if self.elapsed() >= limit {
                return Some("no init");
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Whether qemu has exited (the script ended, or the guest died).
    pub fn finished(&mut self) -> bool {
        !matches!(self.qemu.0.try_wait(), Ok(None))
    }

    /// Waits for the guest to power off; kills qemu once `timeout` (counted
    /// from its start) passed.
    pub fn wait(self, timeout: Duration) -> io::Result<GuestRun> {
        let Guest { work, mut qemu, start, boots } = self;
        let xfer = work.path().join("xfer");
        let qemu_pid = qemu.0.id();
        let deadline = start + timeout;
        let mut timed_out = false;
        // Bounded by the deadline: one check every 50 ms.
        loop {
            if qemu.0.try_wait()?.is_some() {
                break;
            }
            if Instant::now() >= deadline {
                timed_out = true;
                qemu.0.kill()?;
                qemu.0.wait()?;
                break;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let elapsed = start.elapsed();
        drop(qemu);

        let read = |p: &Path| fs::read(p).map(|b| String::from_utf8_lossy(&b).into_owned()).unwrap_or_default();
        let status = read(&xfer.join("status")).trim().parse().ok();
        if let Some(dir) = std::env::var_os("VOLRING_VM_PERF") {
            let dir = PathBuf::from(dir);
            let _ = fs::create_dir_all(&dir);
            for f in ["perf.data", "perf.kallsyms"] {
                let _ = fs::copy(xfer.join("results").join(f), dir.join(format!("{qemu_pid}.{f}")));
            }
        }
        Ok(GuestRun {
            status,
            timed_out,
            stdout: read(&xfer.join("stdout")),
            console: read(&work.path().join("console.log")),
            qemu_stderr: read(&work.path().join("qemu.stderr")),
            results: xfer.join("results"),
            qemu_pid,
            elapsed,
            boots,
            work,
        })
    }
}

/// The newest build of each named test executable (`target/debug/deps/
/// <name>-<hash>`), found beside this test's own executable. `cargo test`
/// builds every test before running any, so they are there; a name not
/// found is an error naming the build command.
pub fn test_binaries(names: &[&str]) -> Result<Vec<(String, PathBuf)>, String> {
    let exe = std::env::current_exe().map_err(|e| format!("current_exe: {e}"))?;
    let deps = exe.parent().ok_or("test executable has no directory")?;
    let entries: Vec<_> = fs::read_dir(deps).map_err(|e| format!("{}: {e}", deps.display()))?.flatten().collect();
    let mut found = Vec::new();
    for name in names {
        let prefix = format!("{name}-");
        let newest = entries
            .iter()
            .filter(|e| {
                let f = e.file_name();
                let f = f.to_string_lossy();
                f.strip_prefix(&prefix).is_some_and(|h| h.len() == 16 && h.bytes().all(|b| b.is_ascii_hexdigit()))
            })
            .filter_map(|e| Some((e.metadata().ok()?.modified().ok()?, e.path())))
            .max();
        match newest {
            Some((_, p)) => found.push((name.to_string(), p)),
            None => return Err(format!("no built test `{name}` in {} (cargo test --no-run --test {name})", deps.display())),
        }
    }
    Ok(found)
}
