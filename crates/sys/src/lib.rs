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
pub mod process;

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
