//! Mount namespaces.

use std::io;

/// Moves the calling process into a new mount namespace whose mounts are all
/// private, so nothing mounted afterwards reaches the host's table.
///
/// Call it before the process starts threads: a thread started earlier keeps
/// the old namespace (the namespace is per task, inherited at clone).
pub fn enter_private_mount_namespace() -> io::Result<()> {
    // SAFETY: CLONE_NEWNS touches no memory of ours; unsharing the mount
    // namespace (and with it the fs struct) cannot invalidate Rust invariants.
    unsafe { rustix::thread::unshare_unsafe(rustix::thread::UnshareFlags::NEWNS) }?;
    rustix::mount::mount_change("/", rustix::mount::MountPropagationFlags::PRIVATE | rustix::mount::MountPropagationFlags::REC)?;
    Ok(())
}
