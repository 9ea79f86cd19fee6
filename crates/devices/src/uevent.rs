//! Kernel uevents as they arrive on a `NETLINK_KOBJECT_UEVENT` socket.
//!
//! A kernel message is `ACTION@DEVPATH` then `KEY=VALUE` strings, each NUL
//! terminated. udevd's re-broadcasts (which start with `libudev`) go to
//! another multicast group and are refused here: volring works whether or
//! not udev runs. Pure, so it is fuzzed.

use serde::Serialize;

use volring_mounts::DevNum;

/// The kernel's own bound on one uevent's environment (`UEVENT_BUFFER_SIZE`
/// is 2 KiB); anything larger is not from the kernel.
pub(crate) const MAX_UEVENT: usize = 8192;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub(crate) enum Action {
    Add,
    Remove,
    Change,
    Move,
    Online,
    Offline,
    Bind,
    Unbind,
}

impl Action {
    fn parse(s: &[u8]) -> Option<Self> {
        Some(match s {
            b"add" => Action::Add,
            b"remove" => Action::Remove,
            b"change" => Action::Change,
            b"move" => Action::Move,
            b"online" => Action::Online,
            b"offline" => Action::Offline,
            b"bind" => Action::Bind,
            b"unbind" => Action::Unbind,
            _ => return None,
        })
    }
}

/// One kernel uevent, the fields volring uses.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub(crate) struct UEvent {
    pub(crate) action: Action,
    pub(crate) devpath: String,
    pub(crate) subsystem: Option<String>,
    /// Kernel name under /dev (`loop3`, `mapper/..` never: dm uses `dm-N`).
    pub(crate) devname: Option<String>,
    /// `disk` or `partition` for block devices.
    pub(crate) devtype: Option<String>,
    pub(crate) dev: Option<DevNum>,
    pub(crate) seqnum: Option<u64>,
}

impl UEvent {
    pub(crate) fn is_block(&self) -> bool {
        self.subsystem.as_deref() == Some("block")
    }

    /// The kernel name: DEVNAME, else the last part of DEVPATH.
    pub(crate) fn name(&self) -> &str {
        self.devname.as_deref().unwrap_or_else(|| self.devpath.rsplit('/').next().unwrap_or(""))
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub(crate) enum UEventError {
    #[error("larger than any kernel uevent")]
    TooLarge,
    #[error("a udevd message, not the kernel's")]
    FromUdev,
    #[error("no ACTION@DEVPATH header")]
    NoHeader,
    #[error("unknown action")]
    UnknownAction,
    #[error("ACTION or DEVPATH disagrees with the header")]
    Inconsistent,
    #[error("a field is not valid UTF-8")]
    NotUtf8,
}

/// The fuzz entry (fuzz/fuzz_targets/uevent.rs): parses one datagram as
/// the hot-plug watcher does and hands back the accepted event's devpath
/// and kernel name, so the parser itself stays private to this crate.
pub fn fuzz_uevent(msg: &[u8]) -> Option<(String, String)> {
    let ev = parse(msg).ok()?;
    let name = ev.name().to_string();
    Some((ev.devpath, name))
}

/// Parses one datagram.
pub(crate) fn parse(msg: &[u8]) -> Result<UEvent, UEventError> {
    if msg.len() > MAX_UEVENT {
        return Err(UEventError::TooLarge);
    }
    if msg.starts_with(b"libudev\0") {
        return Err(UEventError::FromUdev);
    }
    let mut parts = msg.split(|&b| b == 0).filter(|p| !p.is_empty());
    let header = parts.next().ok_or(UEventError::NoHeader)?;
    let at = memchr::memchr(b'@', header).ok_or(UEventError::NoHeader)?;
    let action = Action::parse(&header[..at]).ok_or(UEventError::UnknownAction)?;
    let devpath = text(&header[at + 1..])?;
    if devpath.is_empty() {
        return Err(UEventError::NoHeader);
    }
    let mut ev = UEvent { action, devpath, subsystem: None, devname: None, devtype: None, dev: None, seqnum: None };
    let (mut major, mut minor) = (None, None);
    for kv in parts {
        let Some(eq) = memchr::memchr(b'=', kv) else { continue };
        let (k, v) = (&kv[..eq], &kv[eq + 1..]);
        match k {
            b"ACTION" if Action::parse(v) != Some(action) => return Err(UEventError::Inconsistent),
            b"DEVPATH" if v != ev.devpath.as_bytes() => return Err(UEventError::Inconsistent),
            b"SUBSYSTEM" => ev.subsystem = Some(text(v)?),
            b"DEVNAME" => ev.devname = Some(text(v)?),
            b"DEVTYPE" => ev.devtype = Some(text(v)?),
            b"MAJOR" => major = number(v).and_then(|n| u32::try_from(n).ok()),
            b"MINOR" => minor = number(v).and_then(|n| u32::try_from(n).ok()),
            b"SEQNUM" => ev.seqnum = number(v),
            _ => {}
        }
    }
    if let (Some(major), Some(minor)) = (major, minor) {
        ev.dev = Some(DevNum { major, minor });
    }
    Ok(ev)
}

fn text(b: &[u8]) -> Result<String, UEventError> {
    std::str::from_utf8(b).map(str::to_string).map_err(|_| UEventError::NotUtf8)
}

fn number(b: &[u8]) -> Option<u64> {
    std::str::from_utf8(b).ok()?.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_loop_add() {
        let m = b"add@/devices/virtual/block/loop3\0ACTION=add\0DEVPATH=/devices/virtual/block/loop3\0SUBSYSTEM=block\0MAJOR=7\0MINOR=3\0DEVNAME=loop3\0DEVTYPE=disk\0DISKSEQ=12\0SEQNUM=4242\0";
        let e = parse(m).unwrap();
        assert_eq!(e.action, Action::Add);
        assert!(e.is_block());
        assert_eq!(e.name(), "loop3");
        assert_eq!(e.dev, Some(DevNum { major: 7, minor: 3 }));
        assert_eq!(e.seqnum, Some(4242));
    }

    #[test]
    fn refusals() {
        assert_eq!(parse(b"libudev\0\xfe\xed"), Err(UEventError::FromUdev));
        assert_eq!(parse(b""), Err(UEventError::NoHeader));
        assert_eq!(parse(b"add"), Err(UEventError::NoHeader));
        assert_eq!(parse(b"add@"), Err(UEventError::NoHeader));
        assert_eq!(parse(b"explode@/x"), Err(UEventError::UnknownAction));
        assert_eq!(parse(b"add@/x\0ACTION=remove\0"), Err(UEventError::Inconsistent));
        assert_eq!(parse(b"add@/x\0DEVPATH=/y\0"), Err(UEventError::Inconsistent));
        assert_eq!(parse(&vec![b'a'; MAX_UEVENT + 1]), Err(UEventError::TooLarge));
        // A MAJOR that does not parse leaves the number unknown, not wrong.
        assert_eq!(parse(b"add@/x\0MAJOR=seven\0MINOR=1\0").unwrap().dev, None);
    }
}
