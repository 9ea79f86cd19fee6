//! The VM itself and the project's kernel-facing suites on Debian 12's 6.1
//! kernel (see tests/vm/harness.rs):
//!
//! - the guest boots and has the nbd module this machine's kernel lacks;
//! - a guest that hangs is killed at its timeout;
//! - the project's kernel-facing suites (mount_watch, devices, ring, agent)
//!   pass on 6.1, where statmount, listmount, fanotify mount events and newer
//!   io_uring opcodes are missing and the fallbacks run.
//!
//! Without the image (`tests/vm/fetch.sh`) each test prints why it skips;
//! in CI a missing image fails.

use std::fs;
use std::path::Path;
use std::sync::OnceLock;
use std::time::Duration;

use crate::harness::{self, image_or_skip, test_binaries, GuestRun, Vm};
use libtest_mimic::{Arguments, Failed};

/// The suites run in the guest, each its own trial here.
pub const SUITES: &[&str] = &["mount_watch", "devices", "ring", "agent"];
/// Bounds the one guest that runs all of them.
const SUITES_TIMEOUT: Duration = Duration::from_secs(1200);

/// What the shared guest checks after the suites (see [`shared_run`]):
/// its kernel, the nbd module this machine's kernel lacks, /tmp on ext4.
const BOOT_CHECK: &str =
    "uname -r\nmodprobe nbd nbds_max=4\ntest -b /dev/nbd0\necho nbd0 ok\ngrep -q ' /tmp ext4 ' /proc/mounts\necho tmp ext4\n";

pub fn boots_and_loads_nbd() -> Result<(), Failed> {
    let Some(image) = image_or_skip("boot::modprobe_nbd") else { return Ok(()) };
    let run = shared_run().as_ref().map_err(|e| -> Failed { e.clone().into() })?;
    let status = fs::read_to_string(run.results.join("boot.status")).unwrap_or_default();
    let log = fs::read_to_string(run.results.join("boot.log")).unwrap_or_default();
    if status.trim() != "0" || !log.contains(&image.kernel_version) || !log.contains("nbd0 ok") || !log.contains("tmp ext4") {
        return Err(format!("boot check: status {:?}\n{log}\n--- run\n{}", status.trim(), run.describe()).into());
    }
    eprintln!(
        "note: guest {} booted, ran the suites and the boot check, powered off in {:.1} s",
        image.kernel_version,
        run.elapsed.as_secs_f64()
    );
    Ok(())
}

pub fn hung_guest_is_killed() -> Result<(), Failed> {
    let Some(image) = image_or_skip("harness::hung_guest_is_killed") else { return Ok(()) };
    // The kill must be of a hung script, not of a guest still booting (a
    // boot under TCG on a loaded host has taken from under 45 s to more
    // than 120 s): the timeout is set once the script runs, 5 s past then,
    // and the run must end killed at it.
    let mut guest = Vm::new(&image)?.start("echo started\nexec sleep 100000\n")?;
    // Bounded: the guest has 600 s to reach the script; one look every 100 ms.
    while !guest.stdout().contains("started") {
        if guest.finished() {
            return Err(format!("the guest ended before its script ran:\n{}", guest.wait(Duration::ZERO)?.describe()).into());
        }
        if guest.elapsed() > Duration::from_secs(600) {
            return Err(format!("the guest never reached its script in 600 s:\n{}", guest.wait(Duration::ZERO)?.describe()).into());
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let timeout = guest.elapsed() + Duration::from_secs(5);
    let run = guest.wait(timeout)?;
    if !run.timed_out || run.status.is_some() {
        return Err(format!("the hung guest was not reported as timed out:\n{}", run.describe()).into());
    }
    if run.elapsed < timeout {
        return Err(format!("the guest was killed after {:?}, before its timeout {timeout:?}", run.elapsed).into());
    }
    if Path::new(&format!("/proc/{}", run.qemu_pid)).exists() {
        return Err(format!("qemu {} still exists after the run returned", run.qemu_pid).into());
    }
    Ok(())
}

/// A boot judged hung before the init is killed and booted afresh, and the
/// second boot runs the script: a boot limit of 1 s, which no TCG boot
/// meets (the BIOS alone takes longer), makes the first boot count as hung.
pub fn hung_boot_is_booted_again() -> Result<(), Failed> {
    let Some(image) = image_or_skip("harness::hung_boot_is_booted_again") else { return Ok(()) };
    let mut vm = Vm::new(&image)?;
    vm.cpus = 1;
    vm.boot_limit = Duration::from_secs(1);
    let guest = vm.start("echo second boot ran the script\n")?;
    let boots = guest.boots;
    let run = guest.wait(Duration::from_secs(600))?;
    run.ok()?;
    if boots != 2 || !run.stdout.contains("second boot ran the script") {
        return Err(format!("boots {boots}; the run:\n{}", run.describe()).into());
    }
    Ok(())
}

/// qemu spawned by a thread that then ends gets SIGKILL (PR_SET_PDEATHSIG):
/// a test process that dies leaves no guest running.
pub fn qemu_dies_with_the_thread_that_spawned_it() -> Result<(), Failed> {
    use std::os::unix::process::ExitStatusExt;
    let Some(image) = image_or_skip("harness::qemu_dies_with_its_spawner") else { return Ok(()) };
    let (work, mut cmd) = Vm::new(&image)?.prepare("exec sleep 100000\n")?;
    let mut child = std::thread::spawn(move || cmd.spawn()).join().map_err(|_| "spawning thread panicked")??;
    // Bounded: 30 s for the kernel to deliver the signal (it does so as the
    // thread exits, before join returns; the wait covers a slow reap only).
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    let status = loop {
        if let Some(s) = child.try_wait()? {
            break s;
        }
        if std::time::Instant::now() >= deadline {
            let _ = child.kill();
            let _ = child.wait();
            return Err("qemu outlived the thread that spawned it".into());
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    drop(work);
    if status.signal() != Some(libc::SIGKILL) {
        return Err(format!("qemu ended with {status}, want SIGKILL").into());
    }
    Ok(())
}

/// The suites this run selected (a filter on the command line leaves the
/// others out of the shared guest).
static SELECTED: OnceLock<Vec<&'static str>> = OnceLock::new();

/// One guest (one boot) for every selected suite and then the boot check,
/// each one's output and status into the results share.
static RUN: OnceLock<Result<GuestRun, String>> = OnceLock::new();

/// Removes the shared guest's work directory (its sparse scratch disk
/// held 87 MB after the suites), once every trial ran: a static is never
/// dropped, so its temporary directory outlived the process.
pub fn remove_shared_run() {
    if let Some(Ok(run)) = RUN.get() {
        let _ = fs::remove_dir_all(run.dir());
    }
}

fn shared_run() -> &'static Result<GuestRun, String> {
    RUN.get_or_init(|| {
        let image = harness::VmImage::locate().map_err(|e| format!("no VM image: {e}"))?;
        // A suite not built is left out; its trial skips (or fails in CI).
        let bins: Vec<_> = SELECTED.get().into_iter().flatten().filter_map(|name| test_binaries(&[name]).ok()?.pop()).collect();
        // VOLRING_TEST_IN_GUEST tells the suites that time runs 10-50x
        // slower here: their waits (which end as soon as the condition holds)
        // allow more before they call something missing.
        let mut script = String::from("export VOLRING_TEST_IN_GUEST=1\nmodprobe loop 2>/dev/null\nmodprobe dm-mod 2>/dev/null\n");
        script.push_str(&format!("cd '{}' || exit 1\n", env!("CARGO_MANIFEST_DIR")));
        for (name, bin) in &bins {
            script.push_str(&format!(
                "echo \"== {name}\"\n'{}' >\"$VM_RESULTS/{name}.log\" 2>&1\necho $? >\"$VM_RESULTS/{name}.status\"\n",
                bin.display()
            ));
        }
        // After the suites: nbd devices appearing must not change what they see.
        script.push_str(&format!(
            "echo \"== boot\"\n(set -e\n{BOOT_CHECK}) >\"$VM_RESULTS/boot.log\" 2>&1\necho $? >\"$VM_RESULTS/boot.status\"\n"
        ));
        let run = Vm::new(&image).map_err(|e| e.to_string())?.run(&script, SUITES_TIMEOUT).map_err(|e| e.to_string())?;
        eprintln!("note: guest ran {} suites and the boot check in {:.1} s", bins.len(), run.elapsed.as_secs_f64());
        Ok(run)
    })
}

/// The libtest summary line of a suite's log.
fn summary(log: &str) -> &str {
    log.lines().rev().find(|l| l.starts_with("test result:")).unwrap_or("(no summary line)")
}

pub fn suite_passes_on_6_1(name: &'static str) -> Result<(), Failed> {
    let Some(_) = image_or_skip(&format!("guest::{name}")) else { return Ok(()) };
    if let Err(why) = test_binaries(&[name]) {
        // `cargo test` builds every suite first; `cargo test --test vm` alone
        // does not. In CI that is a broken setup, not a skip.
        if !harness::in_ci() {
            eprintln!("skip: guest::{name}: {why}");
            return Ok(());
        }
    }
    let run = shared_run().as_ref().map_err(|e| -> Failed { e.clone().into() })?;
    let status = fs::read_to_string(run.results.join(format!("{name}.status"))).unwrap_or_default();
    let log = fs::read_to_string(run.results.join(format!("{name}.log"))).unwrap_or_default();
    eprintln!("note: guest::{name}: {}", summary(&log));
    if status.trim() != "0" {
        return Err(format!("{name} in the guest: status {:?}\n{log}\n--- run\n{}", status.trim(), run.describe()).into());
    }
    Ok(())
}

/// Whether libtest-mimic will run the trial `name` (its filter, `--exact`
/// and `--skip`).
fn selected(args: &Arguments, name: &str) -> bool {
    let matches = |f: &str| if args.exact { name == f } else { name.contains(f) };
    args.filter.as_deref().is_none_or(matches) && !args.skip.iter().any(|s| matches(s))
}

/// Records which suites this run selected, before any trial runs.
pub fn select(args: &Arguments) {
    let _ = SELECTED.set(SUITES.iter().copied().filter(|name| selected(args, &format!("guest::{name}"))).collect());
}
