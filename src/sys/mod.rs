//! Raw system calls and ioctls that neither `rustix` nor `libc` wrap safely yet.
//!
//! This is one of the two places (with `ring/`) where `unsafe` may appear. Every
//! block carries a `// SAFETY:` line. Everything exported here is a safe function
//! that returns `std::io::Result`: the errno is the error type of this layer.

pub mod fanotify;
#[cfg(feature = "libmount-peer")]
pub mod libmount;
pub mod loopdev;
pub mod mount_api;
pub mod netlink;
pub mod ns;
pub mod process;

use std::time::Duration;

/// CPU time consumed so far by the calling thread (user + system).
///
/// Watchers report this so a storm's cost can be read off the watcher itself,
/// not guessed from the process total.
pub fn thread_cpu_time() -> Duration {
    let ts = rustix::time::clock_gettime(rustix::time::ClockId::ThreadCPUTime);
    Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32)
}
