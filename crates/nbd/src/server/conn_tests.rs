//! The byte splitter's choice between writing a payload from the receive
//! buffer it arrived in and copying it into a buffer of its own.

use std::sync::Arc;
use std::time::Instant;

use super::*;
use crate::export::{ExportSpec, Exports};
use crate::server::budget::{Limits, ServerBudget};

const PAYLOAD: usize = 512;

/// A connection serving a 1 MiB export in page-cache mode, its buffers, and
/// what admission needs (limits far above what the tests take).
struct Fixture {
    conn: Conn,
    /// The buffers copied payloads go to (those of a small ring).
    ring: volring_ring::IoRing,
    limits: Limits,
    budget: ServerBudget,
    _dir: tempfile::TempDir,
}

impl Fixture {
    fn new() -> Self {
        let dir = tempfile::tempdir().expect("temporary directory");
        let path = dir.path().join("img");
        std::fs::write(&path, vec![0u8; 1 << 20]).expect("image");
        let spec =
            ExportSpec { name: "a".into(), path, read_only: false, direct_io: false, max_connections: 0, description: String::new() };
        let export: Arc<Export> = Exports::default().add(&spec, None).expect("export");
        let mut conn = Conn::new(0, Instant::now());
        let attached = Attached { export, file: 0, buffered: None };
        conn.phase = Phase::Serving { attached, style: HeaderStyle::Simple, base_allocation: None };
        let limits = Limits { conn_bytes: 1 << 30, conn_requests: 1 << 20 };
        let cfg = volring_ring::IoRingConfig { recv_bufs: 4, ..volring_ring::IoRingConfig::default() };
        let ring = volring_ring::IoRing::new(&cfg).expect("an io_uring");
        Fixture { conn, ring, limits, budget: ServerBudget::new(1 << 30), _dir: dir }
    }

    /// Feeds `data`, which lies in receive buffer `lend.bid` at `lend.base`
    /// when `lend` is given.
    fn feed(&mut self, data: &[u8], lend: Option<Lend>) -> (usize, Fed) {
        let gate = Gate { limits: &self.limits, server: &self.budget };
        self.conn.feed(data, self.ring.buffers(), gate, Instant::now(), lend).expect("valid requests")
    }
}

/// WRITE `i` of PAYLOAD bytes: its header alone, and header and payload.
fn write(i: u64) -> (Vec<u8>, Vec<u8>) {
    let mut header = Vec::new();
    let req = Request { flags: 0, kind: cmd::WRITE, cookie: i, offset: i * 4096, length: PAYLOAD as u64 };
    wire::encode_request(&req, HeaderStyle::Simple, &mut header);
    let mut whole = header.clone();
    whole.extend(std::iter::repeat_n(i as u8, PAYLOAD));
    (header, whole)
}

fn lent(fed: &Fed) -> Option<(u16, usize)> {
    match fed {
        Fed::Parsed(Parsed::WriteLent { bid, start, .. }) => Some((*bid, *start)),
        _ => None,
    }
}

#[test]
fn a_payload_whole_in_a_receive_buffer_is_lent_and_the_rest_copied() {
    let mut f = Fixture::new();
    let (header, whole) = write(1);
    // Whole, at offset 100 of buffer 3: written from there, nothing copied.
    let (used, fed) = f.feed(&whole, Some(Lend { bid: 3, base: 100 }));
    assert_eq!((used, lent(&fed)), (whole.len(), Some((3, 100 + header.len()))));
    assert_eq!(f.conn.copied, 0);
    // The header alone: no buffer taken yet; the payload then whole in the
    // next receive is lent from where it starts.
    let (used, fed) = f.feed(&header, Some(Lend { bid: 5, base: 0 }));
    assert!(matches!(fed, Fed::More) && used == header.len());
    assert!(f.conn.payload.as_ref().is_some_and(|p| p.buf.is_none()), "no buffer before a payload byte arrives");
    let (used, fed) = f.feed(&whole[header.len()..], Some(Lend { bid: 6, base: 0 }));
    assert_eq!((used, lent(&fed)), (PAYLOAD, Some((6, 0))));
    // Cut in two by the receive: copied into a buffer of its own.
    let (_, fed) = f.feed(&whole[..header.len() + 10], Some(Lend { bid: 7, base: 0 }));
    assert!(matches!(fed, Fed::More));
    let (_, fed) = f.feed(&whole[header.len() + 10..], Some(Lend { bid: 8, base: 0 }));
    assert!(matches!(fed, Fed::Parsed(Parsed::Write(ref p)) if p.buf.is_some()));
    assert_eq!(f.conn.copied, PAYLOAD as u64);
    // Bytes not in a receive buffer (a paused connection's) are copied.
    let (_, fed) = f.feed(&whole, None);
    assert!(matches!(fed, Fed::Parsed(Parsed::Write(_))));
    assert_eq!(f.conn.copied, 2 * PAYLOAD as u64);
}

#[test]
fn one_connection_holds_at_most_its_share_of_receive_buffers() {
    let mut f = Fixture::new();
    for i in 0..LENT_PER_CONN as u16 {
        let (_, fed) = f.feed(&write(u64::from(i)).1, Some(Lend { bid: i, base: 0 }));
        assert_eq!(lent(&fed), Some((i, write(0).0.len())), "buffer {i}");
    }
    // A buffer it already holds lends again; a new one does not.
    let (_, fed) = f.feed(&write(9).1, Some(Lend { bid: 0, base: 4096 }));
    assert!(lent(&fed).is_some(), "a buffer already held");
    let (_, fed) = f.feed(&write(10).1, Some(Lend { bid: 20, base: 0 }));
    assert!(matches!(fed, Fed::Parsed(Parsed::Write(_))), "past the share: copied");
    // A buffer is given up when its last write ends, not before.
    let header = write(0).0.len();
    assert!(!f.conn.unlend(0), "buffer 0 still has a write in flight");
    let (_, fed) = f.feed(&write(11).1, Some(Lend { bid: 21, base: 0 }));
    assert!(lent(&fed).is_none(), "buffer 0 still has a write in flight: no room");
    assert!(!f.conn.unlend(1), "buffer 1 is still being split: whoever split it recycles it");
    let (_, fed) = f.feed(&write(12).1, Some(Lend { bid: 22, base: 0 }));
    assert_eq!(lent(&fed), Some((22, header)), "buffer 1's only write ended: room for another");
}

/// A buffer whose bytes were all split while writes from it are in flight
/// is recycled by the last of them, not before: a write that completes
/// short is tried again from the same bytes.
#[test]
fn a_split_buffer_is_recycled_by_its_last_write() {
    let mut f = Fixture::new();
    let (_, whole) = write(1);
    let mut two = whole.clone();
    two.extend_from_slice(&write(2).1);
    let (used, fed) = f.feed(&two, Some(Lend { bid: 2, base: 0 }));
    assert!(lent(&fed).is_some());
    let (_, fed) = f.feed(&two[used..], Some(Lend { bid: 2, base: used }));
    assert!(lent(&fed).is_some());
    assert!(!f.conn.keep_lent(3), "no write from buffer 3: recycled at once");
    assert!(f.conn.keep_lent(2), "two writes from buffer 2 in flight: kept");
    assert!(!f.conn.unlend(2), "one write from it still in flight");
    assert!(f.conn.unlend(2), "the last write recycles it");
    assert!(f.conn.lent.is_empty());
}
