//! Mount namespaces.

use std::io;

/// Gives the calling thread a new mount namespace whose mounts are all
/// private, so nothing mounted afterwards reaches the host's table; threads
/// it starts afterwards inherit it. Called before a process starts threads,
/// it is the whole process's; called on one thread of a busy process, that
/// thread mounts and watches without its siblings' mounts showing up (a
/// thread started earlier keeps the old namespace: it is per task,
/// inherited at clone).
///
/// One call for both: the kernel unshares a thread's fs struct (cwd, root,
/// umask) whenever it unshares its mount namespace, so asking for CLONE_FS
/// as well (as this does, to say so) changes nothing.
pub fn enter_private_mount_namespace() -> io::Result<()> {
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
