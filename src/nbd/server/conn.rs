//! One connection's state, and the split of received bytes into requests
//! and write payloads. No I/O here: the worker submits what this produces.

use std::sync::Arc;
use std::time::Instant;

use crate::nbd::export::{Export, DIRECT_ALIGN, MAX_BLOCK};
use crate::nbd::handshake::Handshake;
use crate::nbd::wire::{self, cmd, errno, HeaderStyle, Request};
use crate::nbd::Error;
use crate::ring::buffers::{BufId, Buffers};
use crate::ring::io_ring::OpId;

/// Where a request's data starts in its buffer: room for any reply header
/// before it; a page for O_DIRECT, whose memory must be aligned.
pub(super) const DATA_OFFSET: usize = 64;
pub(super) const DIRECT_DATA_OFFSET: usize = DIRECT_ALIGN as usize;
/// A refused WRITE's payload is read past when it is at most this long;
/// beyond it the connection is closed (the stream cannot be resynced cheaply).
const MAX_DISCARD: u64 = 1 << 30;

/// The export as one ring sees it: its fixed-file slots.
pub(super) struct Attached {
    pub export: Arc<Export>,
    /// Slot of the descriptor aligned requests use.
    pub file: u32,
    /// Slot of the buffered descriptor when `file` is O_DIRECT.
    pub buffered: Option<u32>,
}

impl Attached {
    /// The slot and data offset for a request of this range.
    pub fn route(&self, offset: u64, len: u64) -> (u32, usize) {
        match self.buffered {
            Some(b) if offset % DIRECT_ALIGN != 0 || len % DIRECT_ALIGN != 0 => (b, DATA_OFFSET),
            Some(_) => (self.file, DIRECT_DATA_OFFSET),
            None => (self.file, DATA_OFFSET),
        }
    }
}

pub(super) enum Phase {
    Handshake(Box<Handshake>),
    Serving { attached: Attached, style: HeaderStyle, base_allocation: Option<u32> },
}

/// A WRITE whose payload is still arriving.
pub(super) struct Payload {
    pub req: Request,
    pub buf: BufId,
    pub data_off: usize,
    pub file: u32,
    pub filled: usize,
    pub started: Instant,
}

/// One piece of the outgoing stream.
#[derive(Debug, Clone, Copy)]
pub(super) enum Part {
    /// Bytes of a buffer.
    Buf(BufId, usize, usize),
    /// A range of a file, spliced into the socket without a copy.
    Splice { file: u32, offset: u64, len: u64 },
}

/// A splice sequence in progress: file → pipe → socket, a pipeful at a time.
pub(super) struct Splicing {
    pub pipe: crate::ring::io_ring::PipeId,
    pub file: u32,
    pub offset: u64,
    /// Bytes still to move from the file.
    pub left: u64,
    /// Bytes in the pipe not yet in the socket.
    pub in_pipe: u32,
}

/// What the byte splitter found, for the worker to act on.
pub(super) enum Parsed {
    /// A request with no payload (or a WRITE whose payload is complete).
    Request(Request, Instant),
    Write(Payload),
    /// A request refused before any I/O, with its wire errno.
    Refuse(Request, u32, &'static str, Instant),
}

pub(super) struct Conn {
    pub socket: u32,
    pub phase: Phase,
    /// Bytes of a header (or handshake option) not complete yet.
    pub inbuf: Vec<u8>,
    pub payload: Option<Payload>,
    /// Payload bytes of a refused WRITE still to read past.
    pub discard: u64,
    /// Reply parts waiting for the next send.
    pub out: Vec<Part>,
    pub splice: Option<Splicing>,
    /// Parts of the send in flight.
    pub sending: Vec<(BufId, usize, usize)>,
    pub send_in_flight: bool,
    pub recv_op: Option<OpId>,
    /// A cancel of `recv_op` is on its way.
    pub recv_cancelled: bool,
    /// Socket operations not finished: receive, send, shutdown.
    pub socket_ops: u32,
    /// Requests taken and not yet answered.
    pub requests: u32,
    /// Bytes this connection holds in reply and request buffers.
    pub held_bytes: usize,
    /// Reading stopped because `held_bytes` or `requests` hit their limit.
    pub paused: bool,
    /// No more requests are read; the connection closes once drained.
    pub closing: bool,
    /// The socket failed: nothing more can be sent.
    pub broken: bool,
    pub shutdown_sent: bool,
    pub close_sent: bool,
    pub since: Instant,
    pub last_activity: Instant,
    pub last_send_progress: Instant,
    /// Queued on the worker's list of connections to look at after this batch.
    pub dirty: bool,
}

impl Conn {
    pub fn new(socket: u32, now: Instant) -> Self {
        Conn {
            socket,
            phase: Phase::Handshake(Box::default()),
            inbuf: Vec::new(),
            payload: None,
            discard: 0,
            out: Vec::new(),
            splice: None,
            sending: Vec::new(),
            send_in_flight: false,
            recv_op: None,
            recv_cancelled: false,
            socket_ops: 0,
            requests: 0,
            held_bytes: 0,
            paused: false,
            closing: false,
            broken: false,
            shutdown_sent: false,
            close_sent: false,
            since: now,
            last_activity: now,
            last_send_progress: now,
            dirty: false,
        }
    }

    pub fn attached(&self) -> Option<&Attached> {
        match &self.phase {
            Phase::Serving { attached, .. } => Some(attached),
            Phase::Handshake(_) => None,
        }
    }

    /// Splits transmission-phase bytes into requests and payloads. Header
    /// fragments wait in `inbuf`; payload bytes go straight into the
    /// WRITE's own buffer. Stops at a DISC or a protocol error.
    pub fn feed(&mut self, mut data: &[u8], bufs: &mut Buffers, now: Instant, out: &mut Vec<Parsed>) -> Result<(), Error> {
        let Phase::Serving { attached, style, .. } = &self.phase else {
            return Err(Error::Protocol("request before the handshake ended"));
        };
        let style = *style;
        let need = style.request_len();
        while !data.is_empty() && !self.closing {
            if let Some(p) = &mut self.payload {
                let want = p.req.length as usize - p.filled;
                let take = want.min(data.len());
                let dst = bufs.get_mut(p.buf).ok_or(Error::Protocol("write buffer busy"))?;
                let at = p.data_off + p.filled;
                dst[at..at + take].copy_from_slice(&data[..take]);
                p.filled += take;
                data = &data[take..];
                if p.filled == p.req.length as usize {
                    out.push(Parsed::Write(self.payload.take().expect("checked above")));
                }
                continue;
            }
            if self.discard > 0 {
                let take = (self.discard.min(data.len() as u64)) as usize;
                self.discard -= take as u64;
                data = &data[take..];
                continue;
            }
            let req = if self.inbuf.is_empty() && data.len() >= need {
                let r = wire::parse_request(data, style)?.expect("enough bytes");
                data = &data[need..];
                r
            } else {
                let take = (need - self.inbuf.len()).min(data.len());
                self.inbuf.extend_from_slice(&data[..take]);
                data = &data[take..];
                if self.inbuf.len() < need {
                    break;
                }
                let r = wire::parse_request(&self.inbuf, style)?.expect("enough bytes");
                self.inbuf.clear();
                r
            };
            if req.kind == cmd::DISC {
                self.closing = true;
                break;
            }
            if req.kind != cmd::WRITE {
                out.push(Parsed::Request(req, now));
                continue;
            }
            match check_write(attached, &req) {
                Ok(()) => {
                    let (file, data_off) = attached.route(req.offset, req.length);
                    let buf = bufs.alloc(data_off + req.length as usize);
                    self.held_bytes += bufs.len(buf);
                    self.payload = Some(Payload { req, buf, data_off, file, filled: 0, started: now });
                }
                Err((code, why)) => {
                    if req.length > MAX_DISCARD {
                        return Err(Error::Protocol("oversized WRITE payload"));
                    }
                    self.discard = req.length;
                    out.push(Parsed::Refuse(req, code, why, now));
                }
            }
        }
        Ok(())
    }
}

/// Whether a WRITE can be taken before its payload is read.
fn check_write(a: &Attached, req: &Request) -> Result<(), (u32, &'static str)> {
    const KNOWN: u16 = wire::cmd_flags::FUA;
    if req.flags & !KNOWN != 0 {
        return Err((errno::EINVAL, "unsupported flags on WRITE"));
    }
    if a.export.read_only {
        return Err((errno::EPERM, "export is read-only"));
    }
    if req.length == 0 {
        return Err((errno::EINVAL, "zero-length WRITE"));
    }
    if req.length > u64::from(MAX_BLOCK) {
        return Err((errno::EOVERFLOW, "WRITE longer than the maximum block size"));
    }
    match req.offset.checked_add(req.length) {
        Some(end) if end <= a.export.size => Ok(()),
        _ => Err((errno::ENOSPC, "WRITE beyond the end of the export")),
    }
}
