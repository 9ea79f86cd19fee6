//! Lets clients that put the socket path in `:authority` be served.
//!
//! Over a unix socket there is no host, and gRPC clients differ in what
//! they send as `:authority`: grpc-go sends "localhost", grpc-java the
//! socket path, C-core (grpcio) the path percent-encoded. h2, under tonic,
//! parses the value as a URI authority and resets the stream when that
//! fails, with no setting to relax it; a `/`, or a `%` in a host, fails.
//!
//! So the CSI socket's connections are read through [`Fixing`]: in every
//! request header block, an `:authority` value that is not a plain host
//! has each byte other than `A-Z a-z 0-9 - . _ ~` replaced by `-`
//! (`/run/csi.sock` becomes `-run-csi.sock`), and is sent on as a plain
//! string of the same length. The length is what counts: HPACK charges a
//! dynamic-table entry the lengths of its decoded name and value, so h2's
//! table keeps the very sizes, and hence the indices, the client's encoder
//! counts on, and an entry the client later names by index arrives fixed,
//! as it was stored. (Renaming the field instead does not work: a regular
//! header among the pseudo-headers makes the block malformed.) Anything the
//! adapter does not understand (no HTTP/2 preface, a malformed block, a
//! frame or header block over 1 MiB) passes unchanged: what h2 would have
//! seen without it.
use std::io;
use std::pin::Pin;
use std::task::{ready, Context, Poll};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

/// `:authority` in HPACK's Huffman code.
const HUFFMAN_AUTHORITY: &[u8] = &[0xb8, 0x3b, 0x53, 0x39, 0xec, 0x32, 0x7d, 0x7f];
/// HPACK's Huffman code (RFC 7541, appendix B): (code, length in bits)
/// for bytes 0 to 255 and EOS (256).
#[rustfmt::skip]
const HUFFMAN: [(u32, u8); 257] = [
    (0x1ff8, 13), (0x7fffd8, 23), (0xfffffe2, 28), (0xfffffe3, 28), (0xfffffe4, 28), (0xfffffe5, 28), (0xfffffe6, 28), (0xfffffe7, 28),
    (0xfffffe8, 28), (0xffffea, 24), (0x3ffffffc, 30), (0xfffffe9, 28), (0xfffffea, 28), (0x3ffffffd, 30), (0xfffffeb, 28), (0xfffffec, 28),
    (0xfffffed, 28), (0xfffffee, 28), (0xfffffef, 28), (0xffffff0, 28), (0xffffff1, 28), (0xffffff2, 28), (0x3ffffffe, 30), (0xffffff3, 28),
    (0xffffff4, 28), (0xffffff5, 28), (0xffffff6, 28), (0xffffff7, 28), (0xffffff8, 28), (0xffffff9, 28), (0xffffffa, 28), (0xffffffb, 28),
    (0x14, 6), (0x3f8, 10), (0x3f9, 10), (0xffa, 12), (0x1ff9, 13), (0x15, 6), (0xf8, 8), (0x7fa, 11),
    (0x3fa, 10), (0x3fb, 10), (0xf9, 8), (0x7fb, 11), (0xfa, 8), (0x16, 6), (0x17, 6), (0x18, 6),
    (0x0, 5), (0x1, 5), (0x2, 5), (0x19, 6), (0x1a, 6), (0x1b, 6), (0x1c, 6), (0x1d, 6),
    (0x1e, 6), (0x1f, 6), (0x5c, 7), (0xfb, 8), (0x7ffc, 15), (0x20, 6), (0xffb, 12), (0x3fc, 10),
    (0x1ffa, 13), (0x21, 6), (0x5d, 7), (0x5e, 7), (0x5f, 7), (0x60, 7), (0x61, 7), (0x62, 7),
    (0x63, 7), (0x64, 7), (0x65, 7), (0x66, 7), (0x67, 7), (0x68, 7), (0x69, 7), (0x6a, 7),
    (0x6b, 7), (0x6c, 7), (0x6d, 7), (0x6e, 7), (0x6f, 7), (0x70, 7), (0x71, 7), (0x72, 7),
    (0xfc, 8), (0x73, 7), (0xfd, 8), (0x1ffb, 13), (0x7fff0, 19), (0x1ffc, 13), (0x3ffc, 14), (0x22, 6),
    (0x7ffd, 15), (0x3, 5), (0x23, 6), (0x4, 5), (0x24, 6), (0x5, 5), (0x25, 6), (0x26, 6),
    (0x27, 6), (0x6, 5), (0x74, 7), (0x75, 7), (0x28, 6), (0x29, 6), (0x2a, 6), (0x7, 5),
    (0x2b, 6), (0x76, 7), (0x2c, 6), (0x8, 5), (0x9, 5), (0x2d, 6), (0x77, 7), (0x78, 7),
    (0x79, 7), (0x7a, 7), (0x7b, 7), (0x7ffe, 15), (0x7fc, 11), (0x3ffd, 14), (0x1ffd, 13), (0xffffffc, 28),
    (0xfffe6, 20), (0x3fffd2, 22), (0xfffe7, 20), (0xfffe8, 20), (0x3fffd3, 22), (0x3fffd4, 22), (0x3fffd5, 22), (0x7fffd9, 23),
    (0x3fffd6, 22), (0x7fffda, 23), (0x7fffdb, 23), (0x7fffdc, 23), (0x7fffdd, 23), (0x7fffde, 23), (0xffffeb, 24), (0x7fffdf, 23),
    (0xffffec, 24), (0xffffed, 24), (0x3fffd7, 22), (0x7fffe0, 23), (0xffffee, 24), (0x7fffe1, 23), (0x7fffe2, 23), (0x7fffe3, 23),
    (0x7fffe4, 23), (0x1fffdc, 21), (0x3fffd8, 22), (0x7fffe5, 23), (0x3fffd9, 22), (0x7fffe6, 23), (0x7fffe7, 23), (0xffffef, 24),
    (0x3fffda, 22), (0x1fffdd, 21), (0xfffe9, 20), (0x3fffdb, 22), (0x3fffdc, 22), (0x7fffe8, 23), (0x7fffe9, 23), (0x1fffde, 21),
    (0x7fffea, 23), (0x3fffdd, 22), (0x3fffde, 22), (0xfffff0, 24), (0x1fffdf, 21), (0x3fffdf, 22), (0x7fffeb, 23), (0x7fffec, 23),
    (0x1fffe0, 21), (0x1fffe1, 21), (0x3fffe0, 22), (0x1fffe2, 21), (0x7fffed, 23), (0x3fffe1, 22), (0x7fffee, 23), (0x7fffef, 23),
    (0xfffea, 20), (0x3fffe2, 22), (0x3fffe3, 22), (0x3fffe4, 22), (0x7ffff0, 23), (0x3fffe5, 22), (0x3fffe6, 22), (0x7ffff1, 23),
    (0x3ffffe0, 26), (0x3ffffe1, 26), (0xfffeb, 20), (0x7fff1, 19), (0x3fffe7, 22), (0x7ffff2, 23), (0x3fffe8, 22), (0x1ffffec, 25),
    (0x3ffffe2, 26), (0x3ffffe3, 26), (0x3ffffe4, 26), (0x7ffffde, 27), (0x7ffffdf, 27), (0x3ffffe5, 26), (0xfffff1, 24), (0x1ffffed, 25),
    (0x7fff2, 19), (0x1fffe3, 21), (0x3ffffe6, 26), (0x7ffffe0, 27), (0x7ffffe1, 27), (0x3ffffe7, 26), (0x7ffffe2, 27), (0xfffff2, 24),
    (0x1fffe4, 21), (0x1fffe5, 21), (0x3ffffe8, 26), (0x3ffffe9, 26), (0xffffffd, 28), (0x7ffffe3, 27), (0x7ffffe4, 27), (0x7ffffe5, 27),
    (0xfffec, 20), (0xfffff3, 24), (0xfffed, 20), (0x1fffe6, 21), (0x3fffe9, 22), (0x1fffe7, 21), (0x1fffe8, 21), (0x7ffff3, 23),
    (0x3fffea, 22), (0x3fffeb, 22), (0x1ffffee, 25), (0x1ffffef, 25), (0xfffff4, 24), (0xfffff5, 24), (0x3ffffea, 26), (0x7ffff4, 23),
    (0x3ffffeb, 26), (0x7ffffe6, 27), (0x3ffffec, 26), (0x3ffffed, 26), (0x7ffffe7, 27), (0x7ffffe8, 27), (0x7ffffe9, 27), (0x7ffffea, 27),
    (0x7ffffeb, 27), (0xffffffe, 28), (0x7ffffec, 27), (0x7ffffed, 27), (0x7ffffee, 27), (0x7ffffef, 27), (0x7fffff0, 27), (0x3ffffee, 26),
    (0x3fffffff, 30),
];
const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
const HEADERS: u8 = 0x1;
const CONTINUATION: u8 = 0x9;
const END_HEADERS: u8 = 0x4;
const PADDED: u8 = 0x8;
const PRIORITY: u8 = 0x20;
/// Every HTTP/2 peer accepts frames this large (SETTINGS_MAX_FRAME_SIZE's floor).
const FRAME_PAYLOAD: usize = 16_384;
/// Larger frames or header blocks are passed on untouched, unbuffered.
const MAX_HELD: usize = 1 << 20;

enum Mode {
    Preface,
    Frames,
    Passthrough,
}

/// A header block being gathered from HEADERS and CONTINUATION frames.
struct Block {
    /// The frames as they came, for passing on unchanged.
    original: Vec<u8>,
    fragment: Vec<u8>,
    stream: [u8; 4],
    flags: u8,
    priority: Option<[u8; 5]>,
}

/// The read side of a connection with `:authority` fixed; writes go
/// straight through.
pub struct Fixing<S> {
    inner: S,
    mode: Mode,
    raw: Vec<u8>,
    out: Vec<u8>,
    sent: usize,
    block: Option<Block>,
    eof: bool,
}

impl<S> Fixing<S> {
    pub fn new(inner: S) -> Self {
        Self { inner, mode: Mode::Preface, raw: Vec::new(), out: Vec::new(), sent: 0, block: None, eof: false }
    }

    /// Moves what can be decided from `raw` to `out`.
    fn process(&mut self) {
        loop {
            match self.mode {
                Mode::Passthrough => {
                    self.out.append(&mut self.raw);
                    return;
                }
                Mode::Preface => {
                    let n = self.raw.len().min(PREFACE.len());
                    if self.raw[..n] != PREFACE[..n] {
                        self.mode = Mode::Passthrough;
                    } else if n == PREFACE.len() {
                        self.out.extend(self.raw.drain(..n));
                        self.mode = Mode::Frames;
                    } else {
                        return;
                    }
                }
                Mode::Frames => {
                    let Some(head) = self.raw.get(..9) else { return };
                    let len = u32::from_be_bytes([0, head[0], head[1], head[2]]) as usize;
                    if len > MAX_HELD {
                        self.give_up();
                        continue;
                    }
                    if self.raw.len() < 9 + len {
                        return;
                    }
                    let frame: Vec<u8> = self.raw.drain(..9 + len).collect();
                    self.frame(frame);
                }
            }
        }
    }

    /// Passes everything on unchanged from here on.
    fn give_up(&mut self) {
        if let Some(b) = self.block.take() {
            self.out.extend(b.original);
        }
        self.mode = Mode::Passthrough;
    }

    fn frame(&mut self, frame: Vec<u8>) {
        let (kind, flags, stream) = (frame[3], frame[4], [frame[5], frame[6], frame[7], frame[8]]);
        let payload = &frame[9..];
        match self.block.as_mut() {
            None if kind == HEADERS => {
                let pad = if flags & PADDED != 0 { payload.first().map_or(usize::MAX, |&p| p as usize + 1) } else { 0 };
                let at = usize::from(flags & PADDED != 0);
                let prio = if flags & PRIORITY != 0 { 5 } else { 0 };
                let Some(fragment) = payload.len().checked_sub(pad.saturating_sub(at)).and_then(|end| payload.get(at + prio..end)) else {
                    self.out.extend(frame); // malformed: h2 says so
                    return;
                };
                let priority = payload.get(at..at + 5).filter(|_| prio == 5).map(|p| [p[0], p[1], p[2], p[3], p[4]]);
                let block = Block { fragment: fragment.to_vec(), original: frame, stream, flags, priority };
                if flags & END_HEADERS != 0 {
                    self.emit(block);
                } else {
                    self.block = Some(block);
                }
            }
            None => self.out.extend(frame),
            Some(b) if kind == CONTINUATION && stream == b.stream => {
                b.fragment.extend_from_slice(payload);
                b.original.extend_from_slice(&frame);
                if b.original.len() > MAX_HELD {
                    self.give_up();
                } else if flags & END_HEADERS != 0 {
                    let b = self.block.take().expect("present");
                    self.emit(b);
                }
            }
            Some(_) => {
                // Not the continuation HTTP/2 requires: h2 rejects it.
                let b = self.block.take().expect("present");
                self.out.extend(b.original);
                self.out.extend(frame);
            }
        }
    }

    /// Passes a whole header block on, with `:authority` fixed.
    fn emit(&mut self, b: Block) {
        let Some(block) = fix(&b.fragment) else {
            self.out.extend(b.original);
            return;
        };
        let first_room = FRAME_PAYLOAD - b.priority.map_or(0, |p| p.len());
        let mut rest: &[u8] = &block;
        let mut first = true;
        loop {
            let room = if first { first_room } else { FRAME_PAYLOAD };
            let (chunk, after) = rest.split_at(rest.len().min(room));
            let last = after.is_empty();
            let (kind, mut flags) = if first { (HEADERS, b.flags & !(PADDED | END_HEADERS)) } else { (CONTINUATION, 0) };
            if last {
                flags |= END_HEADERS;
            }
            let prio: &[u8] = match (first, &b.priority) {
                (true, Some(p)) => p,
                _ => &[],
            };
            let len = (prio.len() + chunk.len()) as u32;
            self.out.extend_from_slice(&len.to_be_bytes()[1..]);
            self.out.extend_from_slice(&[kind, flags]);
            self.out.extend_from_slice(&b.stream);
            self.out.extend_from_slice(prio);
            self.out.extend_from_slice(chunk);
            if last {
                return;
            }
            rest = after;
            first = false;
        }
    }
}

/// An HPACK integer with an `n`-bit prefix at the start of `b`: its
/// value and the bytes it took. At most four continuation bytes.
fn integer(b: &[u8], n: u8) -> Option<(usize, usize)> {
    let max = (1usize << n) - 1;
    let first = usize::from(*b.first()?) & max;
    if first < max {
        return Some((first, 1));
    }
    let mut value = max;
    for (i, &c) in b.iter().enumerate().skip(1).take(4) {
        value += usize::from(c & 0x7f) << (7 * (i - 1));
        if c & 0x80 == 0 {
            return Some((value, i + 1));
        }
    }
    None
}

/// An HPACK string at the start of `b`: whether it is Huffman-coded,
/// its bytes, and the bytes it took.
fn string(b: &[u8]) -> Option<(bool, &[u8], usize)> {
    let huffman = *b.first()? & 0x80 != 0;
    let (len, n) = integer(b, 7)?;
    let end = n.checked_add(len)?;
    Some((huffman, b.get(n..end)?, end))
}

/// The symbol of each (length, code) pair of [`HUFFMAN`].
fn huffman_symbols() -> &'static std::collections::HashMap<(u8, u32), usize> {
    static SYMBOLS: std::sync::OnceLock<std::collections::HashMap<(u8, u32), usize>> = std::sync::OnceLock::new();
    SYMBOLS.get_or_init(|| HUFFMAN.iter().enumerate().map(|(sym, &(code, len))| ((len, code), sym)).collect())
}

/// Decodes a Huffman-coded string; `None` when it is not valid HPACK
/// Huffman code (EOS inside, or padding that is not a short run of 1s).
fn huffman_decode(code: &[u8]) -> Option<Vec<u8>> {
    let mut out = Vec::with_capacity(code.len() * 8 / 5);
    let (mut acc, mut bits) = (0u32, 0u8);
    for &byte in code {
        for shift in (0..8).rev() {
            acc = (acc << 1) | u32::from((byte >> shift) & 1);
            bits += 1;
            if let Some(&sym) = huffman_symbols().get(&(bits, acc)) {
                if sym == 256 {
                    return None;
                }
                out.push(sym as u8);
                (acc, bits) = (0, 0);
            } else if bits >= 30 {
                return None;
            }
        }
    }
    (bits < 8 && acc == (1 << bits) - 1).then_some(out)
}

/// True for what h2 takes as an authority here: host characters and at
/// most one `:` (a port).
fn plain_host(v: &[u8]) -> bool {
    !v.is_empty() && v.iter().all(|&c| host_byte(c) || c == b':') && v.iter().filter(|&&c| c == b':').count() <= 1
}

fn host_byte(c: u8) -> bool {
    c.is_ascii_alphanumeric() || b"-._~".contains(&c)
}

/// The header block with every literal `:authority` value (field named
/// by static index 1, or by a plain or Huffman-coded literal name) that
/// is not a plain host made one, at the same length; `None` when there
/// is nothing to fix or the block is malformed.
pub fn fix(block: &[u8]) -> Option<Vec<u8>> {
    let mut out = Vec::with_capacity(block.len() + 16);
    let mut changed = false;
    let mut i = 0;
    while i < block.len() {
        let rep = &block[i..];
        let first = rep[0];
        if first & 0x80 != 0 || first & 0xe0 == 0x20 {
            // An indexed field (its entry is stored as it was sent on) or
            // a table size update: copied.
            let (_, n) = integer(rep, if first & 0x80 != 0 { 7 } else { 5 })?;
            out.extend_from_slice(&rep[..n]);
            i += n;
            continue;
        }
        // A literal: with incremental indexing (01), without (0000) or never indexed (0001).
        let (index, n) = integer(rep, if first & 0x40 != 0 { 6 } else { 4 })?;
        let mut value_at = n;
        let named_authority = if index == 0 {
            let (huffman, name, m) = string(&rep[n..])?;
            value_at += m;
            if huffman {
                name == HUFFMAN_AUTHORITY
            } else {
                name == b":authority"
            }
        } else {
            index == 1
        };
        let (huffman, value, m) = string(&rep[value_at..])?;
        let end = value_at + m;
        let value = if named_authority && huffman { huffman_decode(value)? } else { value.to_vec() };
        if named_authority && !value.is_empty() && !plain_host(&value) {
            out.extend_from_slice(&rep[..value_at]);
            let (len, at) = (value.len(), out.len());
            out.push(0);
            // A plain string length (7-bit prefix, H clear).
            if len < 127 {
                out[at] = len as u8;
            } else {
                out[at] = 127;
                let mut rest = len - 127;
                while rest >= 128 {
                    out.push((rest % 128) as u8 | 0x80);
                    rest /= 128;
                }
                out.push(rest as u8);
            }
            out.extend(value.iter().map(|&c| if host_byte(c) { c } else { b'-' }));
            changed = true;
        } else {
            out.extend_from_slice(&rep[..end]);
        }
        i += end;
    }
    changed.then_some(out)
}

impl<S: AsyncRead + Unpin> AsyncRead for Fixing<S> {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        loop {
            if this.sent < this.out.len() {
                let n = buf.remaining().min(this.out.len() - this.sent);
                buf.put_slice(&this.out[this.sent..this.sent + n]);
                this.sent += n;
                if this.sent == this.out.len() {
                    this.out.clear();
                    this.sent = 0;
                }
                return Poll::Ready(Ok(()));
            }
            if this.eof {
                return Poll::Ready(Ok(()));
            }
            let mut chunk = [0u8; 8192];
            let mut read = ReadBuf::new(&mut chunk);
            ready!(Pin::new(&mut this.inner).poll_read(cx, &mut read))?;
            if read.filled().is_empty() {
                this.eof = true;
                this.give_up();
            } else {
                this.raw.extend_from_slice(read.filled());
            }
            this.process();
        }
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Fixing<S> {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().inner).poll_write(cx, buf)
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_shutdown(cx)
    }

    fn poll_write_vectored(self: Pin<&mut Self>, cx: &mut Context<'_>, bufs: &[io::IoSlice<'_>]) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }
}

impl tonic::transport::server::Connected for Fixing<tokio::net::UnixStream> {
    type ConnectInfo = <tokio::net::UnixStream as tonic::transport::server::Connected>::ConnectInfo;

    fn connect_info(&self) -> Self::ConnectInfo {
        self.inner.connect_info()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A plain HPACK string.
    fn plain(s: &[u8]) -> Vec<u8> {
        let mut v = vec![s.len() as u8];
        v.extend_from_slice(s);
        v
    }

    #[test]
    fn huffman_code_decodes() {
        assert_eq!(huffman_decode(HUFFMAN_AUTHORITY).as_deref(), Some(&b":authority"[..]));
        // RFC 7541 C.4.1: "www.example.com".
        let www = [0xf1, 0xe3, 0xc2, 0xe5, 0xf2, 0x3a, 0x6b, 0xa0, 0xab, 0x90, 0xf4, 0xff];
        assert_eq!(huffman_decode(&www).as_deref(), Some(&b"www.example.com"[..]));
        assert_eq!(huffman_decode(&[0xff, 0xff, 0xff, 0xff]), None, "EOS is not a symbol");
        assert_eq!(huffman_decode(&[0xf1, 0x00]), None, "padding must be 1s");
    }

    #[test]
    fn fixes_authority_in_every_literal_form_and_nothing_else() {
        let path = b"/var/lib/kubelet/plugins/volring.csi.io/csi.sock";
        let fixed = b"-var-lib-kubelet-plugins-volring.csi.io-csi.sock";
        // A 130-byte path: its length takes more than the prefix.
        let long = [&b"/"[..], &[b'p'; 129]].concat();
        let long_fixed = [&b"-"[..], &[b'p'; 129]].concat();
        // :method POST (indexed 3), :authority by static name with
        // incremental indexing, by literal name without indexing, by
        // Huffman-coded name never indexed, a valid one left alone, an
        // indexed reference to a dynamic entry (copied: stored fixed).
        // Sent with the three values given, and as it should be passed on.
        let block = |first: &[u8], second: &[u8], third: &[u8]| {
            let mut b = vec![0x83, 0x41];
            b.extend(plain(first));
            b.push(0x00);
            b.extend(plain(b":authority"));
            b.extend(long_string(second));
            b.push(0x10);
            b.push(0x80 | HUFFMAN_AUTHORITY.len() as u8);
            b.extend_from_slice(HUFFMAN_AUTHORITY);
            b.extend(plain(third));
            b.push(0x01);
            b.extend(plain(b"localhost:443"));
            b.push(0xbe);
            b.push(0x44); // :path by static name, incremental
            b.extend(plain(b"/csi.v1.Identity/Probe"));
            b
        };
        let (sent, want) = (block(path, &long, b"%2Frun%2Fcsi.sock"), block(fixed, &long_fixed, b"-2Frun-2Fcsi.sock"));
        assert_eq!(fix(&sent).expect("fixed"), want);
        // A Huffman-coded value ("www.example.com" is valid: kept; a
        // coded path is sent fixed, plain).
        let www = [0xf1, 0xe3, 0xc2, 0xe5, 0xf2, 0x3a, 0x6b, 0xa0, 0xab, 0x90, 0xf4, 0xff];
        let mut coded = vec![0x41, 0x80 | www.len() as u8];
        coded.extend(www);
        assert_eq!(fix(&coded), None);
        // Nothing to fix, or a truncated block: passed on as it is.
        assert_eq!(fix(&[0x83, 0x86]), None);
        assert_eq!(fix(&sent[..sent.len() - 3]), None);
        assert_eq!(fix(&[0x41, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff]), None);
    }

    fn long_string(s: &[u8]) -> Vec<u8> {
        assert!((127..127 + 128).contains(&s.len()));
        let mut v = vec![0x7f, (s.len() - 127) as u8];
        v.extend_from_slice(s);
        v
    }

    #[tokio::test]
    async fn frames_are_rewritten_split_and_passed() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let mut block = vec![0x83, 0x41];
        block.extend(plain(b"/x.sock"));
        // A block larger than one frame once renamed: a long header value.
        block.push(0x40);
        block.extend(plain(b"x-pad"));
        block.extend([0x7f, 0x81, 0x7f]); // value length 127 + 1 + 127*128 = 16384
        block.extend(std::iter::repeat_n(b'p', 16384));
        let mut input = PREFACE.to_vec();
        let frame = |kind: u8, flags: u8, payload: &[u8]| {
            let mut f = (payload.len() as u32).to_be_bytes()[1..].to_vec();
            f.extend([kind, flags, 0, 0, 0, 1]);
            f.extend_from_slice(payload);
            f
        };
        let settings = frame(0x4, 0, &[]);
        input.extend(&settings);
        // HEADERS (padded, END_STREAM) with a CONTINUATION.
        let mut first = vec![3u8];
        first.extend_from_slice(&block[..100]);
        first.extend([0, 0, 0]);
        input.extend(frame(HEADERS, PADDED | 0x1, &first));
        input.extend(frame(CONTINUATION, END_HEADERS, &block[100..]));
        let (mut client, server) = tokio::io::duplex(1 << 20);
        client.write_all(&input).await.unwrap();
        drop(client);
        let mut seen = Vec::new();
        Fixing::new(server).read_to_end(&mut seen).await.unwrap();
        // Preface and SETTINGS untouched; then frames whose block is the renamed one.
        assert_eq!(&seen[..PREFACE.len() + settings.len()], [PREFACE, &settings[..]].concat());
        let mut at = PREFACE.len() + settings.len();
        let mut got = Vec::new();
        let mut frames = Vec::new();
        while at < seen.len() {
            let len = u32::from_be_bytes([0, seen[at], seen[at + 1], seen[at + 2]]) as usize;
            assert!(len <= FRAME_PAYLOAD);
            frames.push((seen[at + 3], seen[at + 4]));
            got.extend_from_slice(&seen[at + 9..at + 9 + len]);
            at += 9 + len;
        }
        assert_eq!(got, fix(&block).unwrap());
        assert_eq!(frames, [(HEADERS, 0x1), (CONTINUATION, END_HEADERS)]);
    }
}
