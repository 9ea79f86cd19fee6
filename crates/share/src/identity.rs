//! The node's NFSv4 client identity, made unique before its first mount of
//! a shared volume.
//!
//! Why: a Linux NFSv4 client names itself to a server by a string built
//! from its host name, plus the `nfs4_unique_id` module parameter when it
//! is set. Two client nodes with the same host name (cloned images,
//! containers with a fixed one) are then one client to the server: each
//! one's SETCLIENTID/EXCHANGE_ID replaces the other's, and their opens and
//! locks are lost (both saw EIO at once in issue 27's trial). The machine
//! id (`/etc/machine-id`, 32 hex digits, made at install) tells them
//! apart, which is what nfs-utils' own `nfs4_unique_id` advice uses; it is
//! written only when the parameter is empty, so an operator's value wins.
//! The parameter exists once the nfs module is loaded: asking the kernel
//! for the `nfs4` filesystem type (an `fsopen` that is closed again, no
//! mount made) loads it.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

/// What [`ensure`] found or did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Identity {
    /// Already set (by the operator, or an earlier agent): left alone.
    Kept(String),
    /// Was empty; set to this.
    Set(String),
    /// Not set, and why it could not be.
    Unset(String),
}

/// The module parameter under `sys` (`/sys` on a node).
fn parameter(sys: &Path) -> PathBuf {
    sys.join("module/nfs/parameters/nfs4_unique_id")
}

/// The first machine id among `candidates` that is one (32 lower-case hex
/// digits).
fn machine_id(candidates: &[PathBuf]) -> Option<String> {
    candidates.iter().find_map(|p| {
        let id = std::fs::read_to_string(p).ok()?.trim().to_string();
        (id.len() == 32 && id.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))).then_some(id)
    })
}

/// Sets `nfs4_unique_id` under `sys` to the machine id when it is empty.
/// `load` is called when the parameter is not there (the module not
/// loaded yet) before looking again.
pub(crate) fn ensure(sys: &Path, machine_ids: &[PathBuf], load: impl FnOnce()) -> Identity {
    let param = parameter(sys);
    if !param.exists() {
        load();
    }
    let have = match std::fs::read_to_string(&param) {
        Ok(s) => s.trim().to_string(),
        Err(e) => return Identity::Unset(format!("{}: {e} (no NFS client in this kernel?)", param.display())),
    };
    if !have.is_empty() {
        return Identity::Kept(have);
    }
    let Some(id) = machine_id(machine_ids) else {
        return Identity::Unset(format!("no machine id in {machine_ids:?}"));
    };
    match std::fs::write(&param, &id) {
        Ok(()) => Identity::Set(id),
        Err(e) => Identity::Unset(format!("{}: {e}", param.display())),
    }
}

/// [`ensure`] on this node, once per process, and logged: the host's
/// machine id is read through pid 1's root first (the agent's container
/// has its own `/etc`; the DaemonSet shares the host's pid namespace).
pub(crate) fn ensure_on_this_node() {
    static DONE: OnceLock<()> = OnceLock::new();
    DONE.get_or_init(|| {
        let ids = [PathBuf::from("/proc/1/root/etc/machine-id"), PathBuf::from("/etc/machine-id")];
        let load = || {
            // Asking for the filesystem type loads nfs (and nfsv4); the
            // context is closed unused.
            let _ = rustix::mount::fsopen("nfs4", rustix::mount::FsOpenFlags::FSOPEN_CLOEXEC);
        };
        match ensure(Path::new("/sys"), &ids, load) {
            Identity::Kept(id) => tracing::info!(nfs4_unique_id = %id, "this node's NFSv4 client identity (already set)"),
            Identity::Set(id) => {
                tracing::info!(nfs4_unique_id = %id, "this node's NFSv4 client identity set from its machine id")
            }
            Identity::Unset(why) => tracing::warn!(
                why = %why,
                "this node's NFSv4 client identity is its host name only: two nodes with the same host name lose each other's NFS locks"
            ),
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    const ID: &str = "0123456789abcdef0123456789abcdef";

    #[test]
    fn set_only_when_empty() {
        let dir = tempfile::tempdir().unwrap();
        let sys = dir.path().join("sys");
        let mid = dir.path().join("machine-id");
        std::fs::write(&mid, format!("{ID}\n")).unwrap();
        let ids = [dir.path().join("missing"), mid.clone()];
        // The module not loaded, and loading it does not help.
        let mut loaded = false;
        assert!(matches!(ensure(&sys, &ids, || loaded = true), Identity::Unset(_)));
        assert!(loaded);
        // Loading makes the parameter, empty (the kernel prints a newline).
        let param = parameter(&sys);
        let make = || {
            std::fs::create_dir_all(param.parent().unwrap()).unwrap();
            std::fs::write(&param, "\n").unwrap();
        };
        assert_eq!(ensure(&sys, &ids, make), Identity::Set(ID.into()));
        assert_eq!(std::fs::read_to_string(&param).unwrap(), ID);
        // Set: kept, whatever the machine id says.
        std::fs::write(&param, "operator-chose\n").unwrap();
        assert_eq!(ensure(&sys, &ids, || panic!("loaded")), Identity::Kept("operator-chose".into()));
        // A machine id that is none is not written.
        std::fs::write(&param, "").unwrap();
        std::fs::write(&mid, "not-an-id\n").unwrap();
        assert!(matches!(ensure(&sys, &ids, || {}), Identity::Unset(_)));
        assert_eq!(std::fs::read_to_string(&param).unwrap(), "");
    }
}
