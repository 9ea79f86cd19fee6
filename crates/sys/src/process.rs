//! Child processes that must not outlive their parent.

use std::os::unix::process::CommandExt;
use std::process::Command;

/// Makes the child get SIGKILL when the thread that spawned it dies, so a
/// test process killed by its runner (or crashing) leaves no qemu or server
/// behind. The kernel ties the signal to the spawning *thread*: spawn from a
/// thread that outlives the child (the one that waits for it).
pub fn kill_with_parent(cmd: &mut Command) -> &mut Command {
    // SAFETY: the closure runs between fork and exec and only makes one
    // async-signal-safe system call (prctl); it allocates nothing and touches
    // no lock.
    unsafe {
        cmd.pre_exec(|| {
            rustix::process::set_parent_process_death_signal(Some(rustix::process::Signal::KILL))?;
            Ok(())
        })
    }
}
