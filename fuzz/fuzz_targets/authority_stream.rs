//! Bytes of a CSI connection → `authority::Fixing`, the adapter between
//! the unix socket and tonic, read in chunkings and with read buffers the
//! input chooses, some reads answered "not yet". Properties:
//! - the output does not depend on the chunking (it equals the output of
//!   one whole read) and the adapter always makes progress;
//! - it is at most twice the input;
//! - a stream with no HEADERS frame (or no HTTP/2 preface) passes
//!   byte for byte;
//! - for a well-formed HTTP/2 stream (preface, whole frames of at most
//!   16 KiB, header blocks that are HEADERS then CONTINUATIONs of its
//!   stream), every other frame comes out whole and unchanged, in order,
//!   each header block comes out as whole frames, of its stream, with its
//!   flags (less padding) and priority, carrying `authority::fix` of its
//!   fragment; a block `fix` leaves alone comes out as the very frames
//!   that brought it.
//!
//! Layout: flags (bit 0: put the preface in front; bit 1: answer every
//! other read "not yet"), a count and that many chunk sizes, a count and
//! that many read-buffer sizes, then the stream.
#![no_main]

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll, Waker};

use libfuzzer_sys::fuzz_target;
use tokio::io::{AsyncRead, ReadBuf};
use volring_csi::authority::{fix, Fixing};

const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
const HEADERS: u8 = 0x1;
const CONTINUATION: u8 = 0x9;
const END_HEADERS: u8 = 0x4;
const PADDED: u8 = 0x8;
const PRIORITY: u8 = 0x20;
const MAX_FRAME: usize = 16_384;

/// The peer's side of the socket: hands out `data` in the given sizes.
struct Chunked<'a> {
    data: &'a [u8],
    sizes: &'a [usize],
    turn: usize,
    not_yet: bool,
}

impl AsyncRead for Chunked<'_> {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        let this = &mut *self;
        this.turn += 1;
        if this.not_yet && this.turn.is_multiple_of(2) {
            cx.waker().wake_by_ref();
            return Poll::Pending;
        }
        let n = this.sizes[this.turn % this.sizes.len()].min(buf.remaining()).min(this.data.len());
        let (now, later) = this.data.split_at(n);
        buf.put_slice(now);
        this.data = later;
        Poll::Ready(Ok(()))
    }
}

/// Everything the adapter yields, read `reads[i]` bytes at a time.
fn read_all(data: &[u8], sizes: &[usize], reads: &[usize], not_yet: bool) -> Vec<u8> {
    let mut fixing = Fixing::new(Chunked { data, sizes, turn: 0, not_yet });
    let mut cx = Context::from_waker(Waker::noop());
    let mut out = Vec::new();
    // Every useful poll yields a byte or reads one; more polls than that
    // (with room for the "not yet"s) is a livelock.
    let bound = 8 * (data.len() + 16);
    for turn in 0.. {
        assert!(turn < bound, "no progress after {turn} polls");
        let mut space = vec![0u8; reads[turn % reads.len()]];
        let mut buf = ReadBuf::new(&mut space);
        match Pin::new(&mut fixing).poll_read(&mut cx, &mut buf) {
            Poll::Pending => {}
            Poll::Ready(Err(e)) => panic!("{e}"),
            Poll::Ready(Ok(())) if buf.filled().is_empty() => return out,
            Poll::Ready(Ok(())) => out.extend_from_slice(buf.filled()),
        }
    }
    unreachable!()
}

/// A size from one input byte: 1 to 32, times a power of two up to 128.
fn size(b: u8) -> usize {
    (usize::from(b % 32) + 1) << (b >> 5)
}

/// Takes a count and that many sizes off the front of `data`.
fn sizes(data: &mut &[u8]) -> Option<Vec<usize>> {
    let (&n, rest) = data.split_first()?;
    let n = usize::from(n % 8) + 1;
    let (bytes, rest) = (rest.get(..n)?, &rest[n..]);
    *data = rest;
    Some(bytes.iter().map(|&b| size(b)).collect())
}

struct Frame<'a> {
    kind: u8,
    flags: u8,
    stream: [u8; 4],
    payload: &'a [u8],
    raw: &'a [u8],
}

/// The whole frames after the preface, and what is left after them.
fn frames(mut b: &[u8]) -> (Vec<Frame<'_>>, &[u8]) {
    let mut all = Vec::new();
    while b.len() >= 9 {
        let len = u32::from_be_bytes([0, b[0], b[1], b[2]]) as usize;
        let Some(raw) = b.get(..9 + len) else { break };
        all.push(Frame { kind: b[3], flags: b[4], stream: [b[5], b[6], b[7], b[8]], payload: &raw[9..], raw });
        b = &b[9 + len..];
    }
    (all, b)
}

#[derive(Debug, PartialEq)]
enum Item<'a> {
    Other(&'a [u8]),
    Block { stream: [u8; 4], flags: u8, priority: Option<&'a [u8]>, fragment: Vec<u8>, raw: Vec<u8> },
}

/// Frames grouped into header blocks and other frames; `None` unless
/// every frame is at most 16 KiB and every block well formed.
fn items<'a>(frames: &[Frame<'a>]) -> Option<Vec<Item<'a>>> {
    let mut all = Vec::new();
    let mut at = 0;
    while let Some(f) = frames.get(at) {
        at += 1;
        if f.payload.len() > MAX_FRAME {
            return None;
        }
        if f.kind != HEADERS {
            all.push(Item::Other(f.raw));
            continue;
        }
        let mut p = f.payload;
        let mut pad = 0;
        if f.flags & PADDED != 0 {
            let (&n, rest) = p.split_first()?;
            (pad, p) = (usize::from(n), rest);
        }
        let priority = if f.flags & PRIORITY != 0 {
            let (prio, rest) = p.split_at_checked(5)?;
            p = rest;
            Some(prio)
        } else {
            None
        };
        let mut fragment = p.get(..p.len().checked_sub(pad)?)?.to_vec();
        let mut raw = f.raw.to_vec();
        let mut flags = f.flags;
        while flags & END_HEADERS == 0 {
            let c = frames.get(at).filter(|c| c.kind == CONTINUATION && c.stream == f.stream && c.payload.len() <= MAX_FRAME)?;
            at += 1;
            fragment.extend_from_slice(c.payload);
            raw.extend_from_slice(c.raw);
            flags = c.flags;
        }
        all.push(Item::Block { stream: f.stream, flags: f.flags & !(PADDED | END_HEADERS), priority, fragment, raw });
    }
    Some(all)
}

fuzz_target!(|data: &[u8]| {
    let mut rest = data;
    let Some((&flags, after)) = rest.split_first() else { return };
    rest = after;
    let (Some(chunks), Some(reads)) = (sizes(&mut rest), sizes(&mut rest)) else { return };
    let stream = if flags & 1 != 0 { [PREFACE, rest].concat() } else { rest.to_vec() };

    let out = read_all(&stream, &chunks, &reads, flags & 2 != 0);
    assert_eq!(out, read_all(&stream, &[usize::MAX], &[1 << 16], false), "the chunking changed the output");
    assert!(out.len() <= 2 * stream.len(), "{} bytes became {}", stream.len(), out.len());

    let Some(body) = stream.strip_prefix(PREFACE) else {
        assert_eq!(out, stream, "not HTTP/2: passed unchanged");
        return;
    };
    let (sent, tail) = frames(body);
    if sent.iter().all(|f| f.kind != HEADERS) {
        assert_eq!(out, stream, "no HEADERS frame: passed unchanged");
        return;
    }
    let Some(want) = items(&sent).filter(|_| tail.is_empty()) else { return };
    let body = out.strip_prefix(PREFACE).expect("the preface is passed on");
    let (came, tail) = frames(body);
    assert!(tail.is_empty(), "a well-formed stream comes out as whole frames");
    let got = items(&came).expect("a well-formed stream comes out well formed");
    assert_eq!(want.len(), got.len());
    for (w, g) in want.iter().zip(&got) {
        match (w, g) {
            (Item::Other(w), Item::Other(g)) => assert_eq!(w, g),
            (
                Item::Block { stream, flags, priority, fragment, raw },
                Item::Block { stream: s, flags: f, priority: p, fragment: frag, raw: r },
            ) => {
                assert_eq!((stream, flags, priority), (s, f, p));
                match fix(fragment) {
                    Some(fixed) => assert_eq!(&fixed, frag),
                    None => assert_eq!(raw, r, "a block with nothing to fix comes out as it came"),
                }
            }
            _ => panic!("{w:?} came out as {g:?}"),
        }
    }
});
