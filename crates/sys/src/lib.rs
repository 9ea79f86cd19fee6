//! Raw system calls and ioctls that neither `rustix` nor `libc` wrap safely yet.
//!
//! This is one of the two places (with `ring/`) where `unsafe` may appear. Every
//! block carries a `// SAFETY:` line. Everything exported here is a safe function
//! that returns `std::io::Result`: the errno is the error type of this layer.

// Everything is crate-private unless another crate uses it: a `pub`
// item no other crate can reach is an error (`-D warnings`).
#![warn(unreachable_pub)]

pub mod fanotify;
mod genetlink;
#[cfg(feature = "libmount-peer")]
pub mod libmount;
pub mod loopdev;
pub mod mount_api;
mod nbd_netlink;
pub mod netlink;
mod nlmsg;
pub mod ns;

pub use nbd_netlink::{NbdNetlink, NbdNetlinkError};
pub use nlmsg::{fuzz_nbd_netlink, DeviceStatus, NbdConfig};

use std::time::Duration;

/// CPU time consumed so far by the calling thread (user + system).
///
/// Watchers report this so a storm's cost can be read off the watcher itself,
/// not guessed from the process total.
pub fn thread_cpu_time() -> Duration {
    let ts = rustix::time::clock_gettime(rustix::time::ClockId::ThreadCPUTime);
    Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32)
}

/// Voluntary context switches of the calling thread so far (times it
/// slept in the kernel). The NBD server reads it around a blocking write
/// to tell a write that waited on the disk from one that was only slow.
pub fn thread_voluntary_switches() -> std::io::Result<u64> {
    // SAFETY: rusage is a plain C struct for which all-zero is valid.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: `usage` is a valid, writable rusage for the call's duration.
    if unsafe { libc::getrusage(libc::RUSAGE_THREAD, &mut usage) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(usage.ru_nvcsw as u64)
}

/// Makes the child get SIGKILL when the thread that spawned it dies, so a
/// test process killed by its runner (or crashing) leaves no qemu or server
/// behind. The kernel ties the signal to the spawning *thread*: spawn from a
/// thread that outlives the child (the one that waits for it).
pub fn kill_with_parent(cmd: &mut std::process::Command) -> &mut std::process::Command {
    use std::os::unix::process::CommandExt;
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
