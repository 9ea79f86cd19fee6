//! Decoding fanotify mount events — pure, over the bytes a read returned.
//!
//! Each event: `struct fanotify_event_metadata` (24 bytes: event_len u32,
//! vers u8, reserved u8, metadata_len u16, mask u64, fd i32, pid i32), then
//! info records (`type u8, pad u8, len u16`, payload). A mount event carries a
//! `FAN_EVENT_INFO_TYPE_MNT` record whose u64 mount id sits 8 bytes in.

use super::Error;
use volring_sys::fanotify::MountEvents;

/// Event bit: the group's queue overflowed and events were lost.
const FAN_Q_OVERFLOW: u64 = 0x0000_4000;
/// Info record type that carries a 64-bit mount id.
const FAN_EVENT_INFO_TYPE_MNT: u8 = 7;

const METADATA_LEN: usize = 24;

/// One decoded event.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum FanEvent {
    /// A mount was attached and/or detached (a move reports both at once).
    Mount { id: u64, attach: bool, detach: bool },
    /// The queue overflowed: events were lost; resync.
    Overflow,
}

/// The fuzz entry (fuzz/fuzz_targets/fanotify_events.rs): decodes every
/// event in `buf` as the watcher does and says how many items (events and
/// at most one error) came out.
pub fn fuzz_fanotify_events(buf: &[u8]) -> usize {
    events(buf).count()
}

/// Iterates the events in `buf`. Stops at the first malformed event with an
/// error: past it no offset can be trusted.
pub(crate) fn events(buf: &[u8]) -> impl Iterator<Item = Result<FanEvent, Error>> + '_ {
    let mut rest = buf;
    std::iter::from_fn(move || loop {
        if rest.is_empty() {
            return None;
        }
        match next_event(rest) {
            Ok((len, ev)) => {
                rest = &rest[len..];
                if let Some(ev) = ev {
                    return Some(Ok(ev));
                }
            }
            Err(e) => {
                rest = &[];
                return Some(Err(e));
            }
        }
    })
}

fn next_event(b: &[u8]) -> Result<(usize, Option<FanEvent>), Error> {
    if b.len() < METADATA_LEN {
        return Err(Error::Fanotify("event shorter than its metadata"));
    }
    let event_len = u32::from_ne_bytes(b[0..4].try_into().expect("4")) as usize;
    let meta_len = u16::from_ne_bytes(b[6..8].try_into().expect("2")) as usize;
    let mask = u64::from_ne_bytes(b[8..16].try_into().expect("8"));
    if event_len < METADATA_LEN || event_len > b.len() || meta_len < METADATA_LEN || meta_len > event_len {
        return Err(Error::Fanotify("event length out of bounds"));
    }
    if mask & FAN_Q_OVERFLOW != 0 {
        return Ok((event_len, Some(FanEvent::Overflow)));
    }
    let mut info = &b[meta_len..event_len];
    let mut id = None;
    while !info.is_empty() {
        if info.len() < 4 {
            return Err(Error::Fanotify("info record header truncated"));
        }
        let len = u16::from_ne_bytes(info[2..4].try_into().expect("2")) as usize;
        if len < 4 || len > info.len() {
            return Err(Error::Fanotify("info record length out of bounds"));
        }
        if info[0] == FAN_EVENT_INFO_TYPE_MNT {
            let v = info.get(8..16).ok_or(Error::Fanotify("mount info record too short"))?;
            if len < 16 {
                return Err(Error::Fanotify("mount info record too short"));
            }
            id = Some(u64::from_ne_bytes(v.try_into().expect("8")));
        }
        info = &info[len..];
    }
    let kinds = MountEvents::from_bits_truncate(mask);
    let (attach, detach) = (kinds.contains(MountEvents::ATTACH), kinds.contains(MountEvents::DETACH));
    Ok((event_len, id.filter(|_| attach || detach).map(|id| FanEvent::Mount { id, attach, detach })))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn event(mask: u64, id: u64) -> Vec<u8> {
        let mut b = Vec::new();
        b.extend_from_slice(&40u32.to_ne_bytes());
        b.extend_from_slice(&[3, 0]);
        b.extend_from_slice(&24u16.to_ne_bytes());
        b.extend_from_slice(&mask.to_ne_bytes());
        b.extend_from_slice(&(-1i32).to_ne_bytes());
        b.extend_from_slice(&0i32.to_ne_bytes());
        b.extend_from_slice(&[FAN_EVENT_INFO_TYPE_MNT, 0]);
        b.extend_from_slice(&16u16.to_ne_bytes());
        b.extend_from_slice(&[0; 4]);
        b.extend_from_slice(&id.to_ne_bytes());
        b
    }

    #[test]
    fn decodes_attach_detach_move_and_overflow() {
        let mut buf = event(MountEvents::ATTACH.bits(), 10);
        buf.extend(event(MountEvents::all().bits(), 11));
        let mut of = event(FAN_Q_OVERFLOW, 0);
        of[0..4].copy_from_slice(&24u32.to_ne_bytes());
        of.truncate(24);
        buf.extend(of);
        buf.extend(event(MountEvents::DETACH.bits(), 10));
        let got: Vec<_> = events(&buf).collect::<Result<_, _>>().unwrap();
        assert_eq!(
            got,
            vec![
                FanEvent::Mount { id: 10, attach: true, detach: false },
                FanEvent::Mount { id: 11, attach: true, detach: true },
                FanEvent::Overflow,
                FanEvent::Mount { id: 10, attach: false, detach: true },
            ]
        );
    }

    #[test]
    fn malformed_events_end_the_batch_with_an_error() {
        let good = event(MountEvents::ATTACH.bits(), 1);
        let mut bad = good.clone();
        bad[0..4].copy_from_slice(&1000u32.to_ne_bytes());
        let mut buf = good.clone();
        buf.extend(bad);
        let got: Vec<_> = events(&buf).collect();
        assert!(got[0].is_ok() && got[1].is_err() && got.len() == 2);
        let mut short_info = good.clone();
        short_info[26..28].copy_from_slice(&2u16.to_ne_bytes());
        assert!(events(&short_info).next().unwrap().is_err());
        assert!(events(&good[..30]).next().unwrap().is_err());
    }
}
