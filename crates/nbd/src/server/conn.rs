//! One connection's state, and the split of received bytes into requests
//! and write payloads. No I/O here: the worker submits what this produces.

use std::sync::Arc;
use std::time::Instant;

use super::budget::{Account, Gate, Refusal};
use super::direct::DIRECT_MIN;
use crate::export::{Export, DIRECT_ALIGN, MAX_BLOCK};
use crate::handshake::Handshake;
use crate::wire::{self, cmd, errno, HeaderStyle, Request};
use crate::Error;
use volring_ring::OpId;
use volring_ring::{BufId, Buffers};

/// Where a request's data starts in its buffer: room for any reply header
/// before it; a page for O_DIRECT, whose memory must be aligned.
pub(super) const DATA_OFFSET: usize = 64;
pub(super) const DIRECT_DATA_OFFSET: usize = DIRECT_ALIGN as usize;
/// A refused WRITE's payload is read past when it is at most this long;
/// beyond it the connection is closed (the stream cannot be resynced cheaply).
const MAX_DISCARD: u64 = 1 << 30;
/// Reads at least this long from a buffered descriptor are spliced from the
/// page cache into the socket instead of copied twice through a buffer.
pub(super) const SPLICE_MIN: u64 = 64 * 1024;
/// What a reply without bulk data is charged at admission (a header, an
/// error message or a short extent list).
const SMALL_REPLY: usize = 128;
/// WRITE payloads at most this long to a page-cache route take no buffer
/// of their own until their bytes arrive: one that arrives whole in a
/// provided receive buffer is written from there (see [`Lend`]). O_DIRECT
/// routes always get an aligned buffer of their own.
pub(super) const LEND_MAX: u64 = 64 * 1024;
// A payload received directly (`direct`) needs its buffer from the start.
const _: () = assert!(LEND_MAX < DIRECT_MIN);
/// Provided receive buffers one connection's writes may hold at once; past
/// it payloads are copied out. Bounds what a client whose writes hang (a
/// stuck device) keeps from the ring's other connections.
pub(super) const LENT_PER_CONN: usize = 4;

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
    pub(crate) fn route(&self, offset: u64, len: u64) -> (u32, usize) {
        match self.buffered {
            Some(b) if !offset.is_multiple_of(DIRECT_ALIGN) || !len.is_multiple_of(DIRECT_ALIGN) => (b, DATA_OFFSET),
            Some(_) => (self.file, DIRECT_DATA_OFFSET),
            None => (self.file, DATA_OFFSET),
        }
    }

    /// Whether a READ of this range is spliced from the page cache (no
    /// buffer) rather than read into a buffer.
    pub(crate) fn spliced(&self, offset: u64, len: u64) -> bool {
        len >= SPLICE_MIN && self.route(offset, len).1 == DATA_OFFSET
    }

    /// What a request will hold before its reply has left: (bytes against
    /// the connection's limit, memory against the server's). Requests
    /// that will be refused cost a small reply.
    fn cost(&self, req: &Request) -> (usize, usize) {
        let small = (SMALL_REPLY, 0);
        match req.kind {
            cmd::READ if req.length > 0 && req.length <= u64::from(MAX_BLOCK) => {
                if self.spliced(req.offset, req.length) {
                    (req.length as usize + SMALL_REPLY, 0)
                } else {
                    let n = Buffers::cost_of(self.route(req.offset, req.length).1 + req.length as usize);
                    (n, n)
                }
            }
            cmd::WRITE if check_write(self, req).is_ok() => {
                let n = Buffers::cost_of(self.route(req.offset, req.length).1 + req.length as usize);
                (n, n)
            }
            _ => small,
        }
    }
}

pub(super) enum Phase {
    Handshake(Box<Handshake>),
    Serving { attached: Attached, style: HeaderStyle, base_allocation: Option<u32> },
}

/// Why a connection is not being read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Blocked {
    /// Its next request did not fit a limit.
    Refused(Refusal),
    /// Handshake replies it has not read yet.
    Replies,
}

/// A WRITE whose payload is still arriving.
pub(super) struct Payload {
    pub req: Request,
    /// Where the payload is put together: none yet for a small payload
    /// none of whose bytes has come (it may still come whole in one
    /// provided buffer and be written from there).
    pub buf: Option<BufId>,
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
    /// A range of a file, spliced into the socket without a copy; the
    /// READ it answers is timed until the last byte is in the socket.
    Splice { file: u32, offset: u64, len: u64, started: Instant },
}

/// A splice sequence in progress: file → pipe → socket, a pipeful at a time.
pub(super) struct Splicing {
    pub pipe: volring_ring::PipeId,
    pub file: u32,
    pub offset: u64,
    /// Bytes still to move from the file.
    pub left: u64,
    /// Bytes in the pipe not yet in the socket.
    pub in_pipe: u32,
    pub len: u64,
    pub started: Instant,
}

/// Bytes being split that a WRITE may be written from in place: they are
/// in provided receive buffer `bid`, the first of them at `base`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Lend {
    pub bid: u16,
    pub base: usize,
}

/// A provided receive buffer a connection's writes are made from. The
/// connection keeps it from being recycled until the last of them has
/// ended, so a write that completes short is tried again from the same
/// bytes. (The ring keeps a lent buffer from the kernel in any case, for
/// as long as a write reads it.)
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct LentBuf {
    pub bid: u16,
    /// Writes from it not ended yet.
    pub writes: u16,
    /// All its received bytes were split: recycled with the last write.
    pub split: bool,
}

/// What the byte splitter found, for the worker to act on.
pub(super) enum Parsed {
    /// A request with no payload (or a WRITE whose payload is complete).
    Request(Request, Instant),
    /// A WRITE whose payload is complete in its own buffer.
    Write(Payload),
    /// A WRITE whose payload is whole in provided buffer `bid` from
    /// `start`: written from there, no copy (the connection counts the
    /// buffer among those it holds until the write ends).
    WriteLent { req: Request, bid: u16, start: usize, file: u32, started: Instant },
    /// A request refused before any I/O, with its wire errno.
    Refuse(Request, u32, &'static str, Instant),
}

/// What one call of [`Conn::feed`] ended on.
pub(super) enum Fed {
    /// Everything given was taken; more bytes are needed.
    More,
    /// A request to act on before feeding the rest.
    Parsed(Parsed),
    /// The next request does not fit: the bytes from there on are not taken.
    Blocked(Refusal),
    /// DISC: nothing after it is read.
    Closing,
}

/// Where a connection is in its life. It moves forward only, except
/// between [`State::Reading`] and [`State::Paused`]; each move is a method
/// (here, or on the worker when it submits something).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum State {
    /// Its bytes are read: handshake options, then requests (see [`Phase`]).
    Reading,
    /// Not read until what stopped it eases; replies still leave.
    Paused(Blocked),
    /// Nothing more is read (the client said goodbye, an idle or removed
    /// export, a stopping server); it closes once its requests are
    /// answered and its replies sent.
    Draining,
    /// The socket failed or the connection is dropped: nothing more is
    /// sent; it closes once its requests with file I/O have ended.
    Broken,
    /// shutdown(2) was submitted; the socket is closed once every socket
    /// operation has ended.
    ShuttingDown,
    /// The close was submitted; the slot is free when it completes.
    Closing,
}

impl State {
    /// Whether replies may still be queued and sent.
    pub(crate) fn sends(self) -> bool {
        matches!(self, State::Reading | State::Paused(_) | State::Draining)
    }
}

/// The receive armed on the socket.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Rx {
    Idle,
    /// A multishot receive into the ring's provided buffers.
    Multishot(OpId),
    /// A receive of a WRITE payload straight into its buffer.
    Direct(OpId),
    /// A receive of the rest of one request header alone, into a
    /// provided buffer (see `direct`: after a large WRITE).
    Header(OpId),
    /// A cancel is on its way; the receive's last completion makes it idle.
    Cancelling,
}

/// What is leaving the socket.
pub(super) enum Tx {
    Idle,
    /// A sendmsg of the parts in [`Conn::sending`].
    Sending,
    Splicing(Splicing),
}

impl Tx {
    pub(crate) fn name(&self) -> &'static str {
        match self {
            Tx::Idle => "idle",
            Tx::Sending => "sending",
            Tx::Splicing(_) => "splicing",
        }
    }
}

pub(super) struct Conn {
    pub socket: u32,
    pub state: State,
    pub phase: Phase,
    pub rx: Rx,
    pub tx: Tx,
    /// Received bytes not taken yet: a header (or handshake option) not
    /// complete yet, or everything from the request that did not fit on.
    pub inbuf: Vec<u8>,
    /// Memory of `inbuf` charged to the server.
    pub inbuf_charged: usize,
    pub payload: Option<Payload>,
    /// Payload bytes of a refused WRITE still to read past.
    pub discard: u64,
    /// Payload bytes `feed` copied into WRITE buffers, not counted in the
    /// export's stats yet.
    pub copied: u64,
    /// The last request admitted was a WRITE large enough to be received
    /// directly: the next header is received alone (see `direct`).
    pub bulk: bool,
    /// Provided receive buffers its writes in flight are written from (at
    /// most [`LENT_PER_CONN`]).
    pub lent: Vec<LentBuf>,
    /// Requests taken from the bytes being split now, and the most taken
    /// from one receive since the ring's last tick: how many its client had
    /// in flight at once (see `weight::threads_for`).
    pub split_requests: u16,
    pub depth: u16,
    /// `depth` as it stood at the ring's last tick: a deep client stays
    /// known as one across the tick that resets `depth` (see
    /// `starve::at_once`).
    pub last_depth: u16,
    /// Reply parts waiting for the next send.
    pub out: Vec<Part>,
    /// Parts of the send in flight (kept for its capacity when idle).
    pub sending: Vec<(BufId, usize, usize)>,
    /// Socket operations not finished: receive, send, splice, shutdown.
    pub socket_ops: u32,
    /// The last send found the socket full: the next one waits for room
    /// instead of going `at_once` (see `Output::send_next`).
    pub socket_full: bool,
    /// What this connection holds against its limits and the server's.
    pub account: Account,
    /// The buffer small replies are appended to while it is last in `out`.
    pub tail: Option<BufId>,
    /// Stopped by the server's budget: its release count then (the
    /// connection is on its ring's list of waiters).
    pub server_wait: Option<u64>,
    /// The client sent NBD_CMD_DISC: it let go of the export on purpose
    /// (what tells a holder's clean release from a dropped connection).
    pub disconnected: bool,
    pub since: Instant,
    pub last_activity: Instant,
    pub last_send_progress: Instant,
    /// Queued on the worker's list of connections to look at after this batch.
    pub dirty: bool,
}

impl Conn {
    pub(crate) fn new(socket: u32, now: Instant) -> Self {
        Conn {
            socket,
            state: State::Reading,
            phase: Phase::Handshake(Box::default()),
            rx: Rx::Idle,
            tx: Tx::Idle,
            inbuf: Vec::new(),
            inbuf_charged: 0,
            payload: None,
            discard: 0,
            copied: 0,
            bulk: false,
            lent: Vec::new(),
            split_requests: 0,
            depth: 0,
            last_depth: 0,
            out: Vec::new(),
            sending: Vec::new(),
            socket_ops: 0,
            socket_full: false,
            account: Account::default(),
            tail: None,
            server_wait: None,
            disconnected: false,
            since: now,
            last_activity: now,
            last_send_progress: now,
            dirty: false,
        }
    }

    /// Reading → Paused: what it received waits in `inbuf`.
    pub(crate) fn pause(&mut self, why: Blocked) {
        if self.state == State::Reading {
            self.state = State::Paused(why);
        }
    }

    /// Paused → Reading, once what stopped it has eased.
    pub(crate) fn resume_if_ready(&mut self, limits: &super::budget::Limits) -> bool {
        let State::Paused(why) = self.state else { return false };
        let ready = match why {
            Blocked::Refused(Refusal::Conn) => self.account.drained_enough(limits),
            Blocked::Refused(Refusal::Server) => self.server_wait.is_none(),
            Blocked::Replies => self.out.is_empty() && matches!(self.tx, Tx::Idle),
        };
        if ready {
            self.state = State::Reading;
        }
        ready
    }

    /// Reading or Paused → Draining.
    pub(crate) fn drain(&mut self) {
        if matches!(self.state, State::Reading | State::Paused(_)) {
            self.state = State::Draining;
        }
    }

    /// Any state before the shutdown → Broken (queued replies are the
    /// caller's to drop).
    pub(crate) fn break_off(&mut self) {
        if self.state.sends() {
            self.state = State::Broken;
        }
    }

    /// Whether a closing connection may shut its socket down: its requests
    /// answered and, unless it is broken, its replies gone. (A broken one
    /// does not wait for its splice: a client that never reads would hold
    /// it, and its export slot, forever; the shutdown ends it.)
    pub(crate) fn drained(&self) -> bool {
        self.account.requests == 0
            && match self.state {
                State::Draining => self.out.is_empty() && matches!(self.tx, Tx::Idle),
                State::Broken => true,
                _ => false,
            }
    }

    /// The reply headers it negotiated (simple until it has).
    pub(crate) fn style(&self) -> HeaderStyle {
        match &self.phase {
            Phase::Serving { style, .. } => *style,
            Phase::Handshake(_) => HeaderStyle::Simple,
        }
    }

    pub(crate) fn attached(&self) -> Option<&Attached> {
        match &self.phase {
            Phase::Serving { attached, .. } => Some(attached),
            Phase::Handshake(_) => None,
        }
    }

    /// The bytes received into provided buffer `bid` have all been split:
    /// true when writes from it are still in flight, which then recycle it
    /// when the last one ends (see [`Conn::unlend`]).
    pub(crate) fn keep_lent(&mut self, bid: u16) -> bool {
        match self.lent.iter_mut().find(|e| e.bid == bid) {
            Some(e) => {
                e.split = true;
                true
            }
            None => false,
        }
    }

    /// A write (all its tries, short ones included) from provided buffer
    /// `bid` ended: true when the buffer is now to be recycled (it was the
    /// last one, and the buffer's bytes had all been split).
    pub(crate) fn unlend(&mut self, bid: u16) -> bool {
        let Some(i) = self.lent.iter().position(|e| e.bid == bid) else { return false };
        self.lent[i].writes -= 1;
        if self.lent[i].writes > 0 {
            return false;
        }
        self.lent.swap_remove(i).split
    }

    /// Charges `inbuf`'s memory to the server after it changed size.
    pub(crate) fn sync_inbuf(&mut self, server: &super::budget::ServerBudget) {
        if self.inbuf.is_empty() && self.inbuf.capacity() > 4096 {
            self.inbuf = Vec::new();
        }
        let now = self.inbuf.capacity();
        if now > self.inbuf_charged {
            self.account.charge(server, 0, now - self.inbuf_charged);
        } else {
            self.account.release(server, 0, self.inbuf_charged - now);
        }
        self.inbuf_charged = now;
    }

    /// Splits transmission-phase bytes into requests and payloads, up to
    /// the first request to act on, and returns how many bytes it took.
    /// Header fragments wait in `inbuf`; a small payload that is whole in
    /// `data` is written from there when `lend` says where `data` lies
    /// (see [`Lend`]); other payload bytes go straight into the WRITE's own
    /// buffer. Each request is admitted through `gate` before anything is
    /// allocated for it: one that does not fit is left untaken.
    pub(crate) fn feed(
        &mut self,
        data: &[u8],
        bufs: &mut Buffers,
        gate: Gate<'_>,
        now: Instant,
        lend: Option<Lend>,
    ) -> Result<(usize, Fed), Error> {
        let Phase::Serving { style, .. } = &self.phase else {
            return Err(Error::Protocol("request before the handshake ended"));
        };
        let style = *style;
        let need = style.request_len();
        let mut used = 0;
        while used < data.len() {
            if self.state != State::Reading {
                return Ok((used, Fed::Closing));
            }
            let rest = &data[used..];
            if self.payload.is_some() {
                let (took, write) = self.take_payload(rest, bufs, lend.map(|l| Lend { base: l.base + used, ..l }))?;
                used += took;
                match write {
                    Some(w) => return Ok((used, Fed::Parsed(w))),
                    None => continue,
                }
            }
            if self.discard > 0 {
                let take = (self.discard.min(rest.len() as u64)) as usize;
                self.discard -= take as u64;
                used += take;
                continue;
            }
            let from_inbuf = !(self.inbuf.is_empty() && rest.len() >= need);
            let (req, took) = if !from_inbuf {
                (wire::parse_request(rest, style)?.expect("enough bytes"), need)
            } else {
                let take = (need - self.inbuf.len()).min(rest.len());
                self.inbuf.extend_from_slice(&rest[..take]);
                if self.inbuf.len() < need {
                    return Ok((used + take, Fed::More));
                }
                (wire::parse_request(&self.inbuf, style)?.expect("enough bytes"), take)
            };
            if req.kind == cmd::DISC {
                self.inbuf.clear();
                self.drain();
                self.disconnected = true;
                return Ok((used + took, Fed::Closing));
            }
            let Phase::Serving { attached, .. } = &self.phase else { return Err(Error::Protocol("request before the handshake ended")) };
            let (held, mem) = attached.cost(&req);
            if let Err(why) = self.account.admit(gate, held, mem) {
                // A header put together in `inbuf` stays there, whole.
                return Ok((if from_inbuf { used + took } else { used }, Fed::Blocked(why)));
            }
            self.inbuf.clear();
            used += took;
            self.bulk = false;
            if req.kind != cmd::WRITE {
                return Ok((used, Fed::Parsed(Parsed::Request(req, now))));
            }
            let checked = check_write(attached, &req).map(|()| attached.route(req.offset, req.length));
            if let Some(fed) = self.begin_write(req, checked, mem, bufs, gate.server, now)? {
                return Ok((used, fed));
            }
        }
        Ok((used, Fed::More))
    }

    /// A WRITE was admitted: with `checked` its (file, data offset), its
    /// payload is taken next (into a buffer charged `mem` now: allocated now
    /// unless it may still be written from where it arrives); refused, its
    /// payload is read past. Returns the refusal to answer, if any.
    fn begin_write(
        &mut self,
        req: Request,
        checked: Result<(u32, usize), (u32, &'static str)>,
        mem: usize,
        bufs: &mut Buffers,
        server: &super::budget::ServerBudget,
        now: Instant,
    ) -> Result<Option<Fed>, Error> {
        match checked {
            Ok((file, data_off)) => {
                self.bulk = req.length >= DIRECT_MIN;
                // Written in place only from page-cache files: O_DIRECT
                // needs the payload aligned, which it is in no receive.
                let lazy = data_off == DATA_OFFSET && req.length <= LEND_MAX;
                let buf = (!lazy).then(|| bufs.alloc(data_off + req.length as usize));
                self.account.charge(server, mem, mem);
                self.payload = Some(Payload { req, buf, data_off, file, filled: 0, started: now });
                Ok(None)
            }
            Err((code, why)) => {
                if req.length > MAX_DISCARD {
                    return Err(Error::Protocol("oversized WRITE payload"));
                }
                self.discard = req.length;
                Ok(Some(Fed::Parsed(Parsed::Refuse(req, code, why, now))))
            }
        }
    }

    /// Takes bytes of the payload in progress from `rest`: all of it, written
    /// from where it lies, when it is whole there and `lend` says where that
    /// is (and the connection may hold one more receive buffer); otherwise
    /// what `rest` has of it, copied into the WRITE's own buffer. Returns
    /// the bytes taken, and the WRITE once its payload is complete.
    fn take_payload(&mut self, rest: &[u8], bufs: &mut Buffers, lend: Option<Lend>) -> Result<(usize, Option<Parsed>), Error> {
        let Some(p) = self.payload.as_mut() else { return Ok((0, None)) };
        let want = p.req.length as usize - p.filled;
        if let Some(l) = lend.filter(|_| p.buf.is_none() && rest.len() >= want) {
            if lend_from(&mut self.lent, l.bid) {
                let p = self.payload.take().expect("checked above");
                let (req, file, started) = (p.req, p.file, p.started);
                return Ok((want, Some(Parsed::WriteLent { req, bid: l.bid, start: l.base, file, started })));
            }
        }
        let size = p.data_off + p.req.length as usize;
        let buf = *p.buf.get_or_insert_with(|| bufs.alloc(size));
        let take = want.min(rest.len());
        let dst = bufs.get_mut(buf).ok_or(Error::Protocol("write buffer busy"))?;
        let at = p.data_off + p.filled;
        dst[at..at + take].copy_from_slice(&rest[..take]);
        self.copied += take as u64;
        p.filled += take;
        if p.filled < p.req.length as usize {
            return Ok((take, None));
        }
        Ok((take, self.payload.take().map(Parsed::Write)))
    }
}

/// Counts one more write from provided buffer `bid` in a connection's
/// `lent`, if the buffer is one it holds already or it holds fewer than
/// [`LENT_PER_CONN`].
fn lend_from(lent: &mut Vec<LentBuf>, bid: u16) -> bool {
    if let Some(e) = lent.iter_mut().find(|e| e.bid == bid) {
        e.writes += 1;
        return true;
    }
    if lent.len() >= LENT_PER_CONN {
        return false;
    }
    lent.push(LentBuf { bid, writes: 1, split: false });
    true
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

#[cfg(test)]
#[path = "conn_tests.rs"]
mod tests;
