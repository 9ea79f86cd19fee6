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

/// Gives the calling thread (only) a new private mount namespace; threads it
/// starts afterwards inherit it. Lets one thread of a busy process mount and
/// watch without its siblings' mounts showing up.
pub fn enter_private_mount_namespace_on_this_thread() -> io::Result<()> {
    // SAFETY: CLONE_FS gives this thread its own cwd/root/umask and CLONE_NEWNS
    // its own mount namespace; no memory of ours depends on either.
    unsafe { rustix::thread::unshare_unsafe(rustix::thread::UnshareFlags::FS | rustix::thread::UnshareFlags::NEWNS) }?;
    rustix::mount::mount_change("/", rustix::mount::MountPropagationFlags::PRIVATE | rustix::mount::MountPropagationFlags::REC)?;
    Ok(())
}

/// Moves the calling thread (only) into the mount namespace at `path`
/// (`/proc/1/ns/mnt` for the host's, from a container with hostPID).
///
/// A thread shares its fs struct with its siblings, and the kernel refuses a
/// mount namespace switch while it is shared, so the thread takes its own
/// copy first. Only this thread sees the other namespace afterwards.
pub fn join_mount_namespace_on_this_thread(path: &std::path::Path) -> io::Result<()> {
    use std::os::fd::AsFd;
    let ns = std::fs::File::open(path)?;
    // SAFETY: CLONE_FS gives this thread its own cwd/root/umask; no memory of
    // ours depends on them being shared.
    unsafe { rustix::thread::unshare_unsafe(rustix::thread::UnshareFlags::FS) }?;
    rustix::thread::move_into_link_name_space(ns.as_fd(), Some(rustix::thread::LinkNameSpaceType::Mount))?;
    Ok(())
}
