//! Requests: checks, the file operations that serve them, and their replies.

use std::os::fd::AsFd;
use std::time::Instant;

use super::conn::DATA_OFFSET;
use super::conn::{Parsed, Phase};
use super::exports::Attachments;
use super::inline::{in_workers, InlineWrite, RingInline};
use super::output::Output;
use super::shared::Shared;
use super::starve::{at_once, Admitted, OffloadReads, ReadPath, Served, MIN_IN_FLIGHT};
use super::token::Token;
use crate::export::{Export, MAX_BLOCK};
use crate::stats::Kind;
use crate::wire::{self, chunk, cmd, cmd_flags as cf, errno, Extent, HeaderStyle, ReplyBody, ReplyHeader, Request};
use volring_ring::{BufId, Buffers, Op};

/// Reads at least this long ask the file whether the range is a hole first,
/// and answer a hole with one chunk and no data.
const HOLE_CHECK_MIN: u64 = 64 * 1024;
/// lseek calls one BLOCK_STATUS may make (two per data extent): the file
/// is asked on the ring thread, so a fragmented file must not stall it.
/// The spec lets a reply cover less than was asked; clients ask on.
const MAX_STATUS_SEEKS: u32 = 32;
/// lseek calls (hole checks, BLOCK_STATUS) one loop turn may make; past
/// it holes are answered as data, which the protocol allows.
const SEEKS_PER_TURN: u32 = 128;
/// Chunk of zeroes written when the file cannot zero a range by itself.
const ZERO_CHUNK: usize = 1 << 20;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Step {
    /// The main operation.
    Io,
    /// Writing zeroes by hand (the filesystem could not zero the range).
    ZeroFill,
    /// fdatasync after a trim or zeroing with FUA.
    Sync,
}

/// A request with file I/O in flight.
pub(super) struct Req {
    pub conn: u32,
    pub req: Request,
    pub file: u32,
    pub buf: Option<BufId>,
    /// A WRITE written from a provided receive buffer: its id and where
    /// the payload starts in it (`buf` is then None).
    pub lent: Option<(u16, usize)>,
    pub data_off: usize,
    /// Bytes done so far (reads and writes can complete short).
    pub done: u64,
    pub step: Step,
    pub started: Instant,
    /// Its export and the submission a write of it that io_uring's
    /// workers may do was queued in (see [`in_workers`]), until its
    /// completion comes (see `RingInline::landed`).
    pub ring_turn: Option<(u64, u64)>,
}

/// The range check shared by every command with an offset and a length.
impl Req {
    fn new(conn: u32, req: Request, file: u32, buf: Option<BufId>, data_off: usize, started: Instant) -> Self {
        Req { conn, req, file, buf, lent: None, data_off, done: 0, step: Step::Io, started, ring_turn: None }
    }
}

fn in_bounds(size: u64, r: &Request) -> bool {
    r.offset.checked_add(r.length).is_some_and(|end| end <= size)
}

fn io_err(res: i32) -> u32 {
    errno::from_host(-res)
}

/// The requests of a ring with file I/O in flight, and what serving them
/// needs beside the connections.
pub(super) struct Requests {
    table: Vec<Option<Req>>,
    free: Vec<u32>,
    /// lseek calls left in this loop turn.
    pub seeks_left: u32,
    /// A buffer of zeroes that WRITE_ZEROES writes from when the file cannot
    /// zero a range itself; shared, never written after it is made.
    zeroes: Option<BufId>,
    /// Small buffered writes done on the ring thread.
    inline: RingInline,
    /// Whether page-cache reads go to io_uring's workers.
    reads: ReadPath,
    /// Requests admitted in this loop turn and in the one before it.
    admitted: Admitted,
}

impl Requests {
    /// The requests of the calling ring thread.
    pub(super) fn new(offload_reads: OffloadReads) -> Self {
        let reads = ReadPath::new(offload_reads);
        let (inline, admitted) = (RingInline::default(), Admitted::default());
        Requests { table: Vec::new(), free: Vec::new(), seeks_left: SEEKS_PER_TURN, zeroes: None, inline, reads, admitted }
    }

    /// A new loop turn at `now`: its share of lseek calls, whether the ring
    /// is starved of CPU, and a fresh count of the requests it admits.
    pub(super) fn new_turn(&mut self, now: Instant) {
        self.seeks_left = SEEKS_PER_TURN;
        self.admitted.turn();
        self.reads.turn(now);
        self.inline.submitted_all();
    }

    /// Whether the ring thread waits for its CPU (see `starve`).
    pub(super) fn contended(&self) -> bool {
        self.reads.contended()
    }

    /// How the ring thread was served by its CPU since its last tick.
    pub(super) fn served_since_tick(&mut self, now: Instant) -> Served {
        self.reads.served_since_tick(now)
    }

    /// Windows in which the ring was judged starved of CPU, since it started.
    pub(super) fn starved_windows(&self) -> u64 {
        self.reads.starved_windows
    }

    /// Whether the ring's page-cache reads go to io_uring's workers now.
    pub(super) fn offloading(&self) -> bool {
        self.reads.offloading()
    }

    /// Gives back the slots of a past burst when none is in use; returns
    /// the bytes freed.
    pub(super) fn trim(&mut self) -> usize {
        if self.free.len() == self.table.len() {
            self.inline.all_landed();
        }
        if self.free.len() == self.table.len() && self.table.capacity() > 1024 {
            let freed = self.table.capacity() * std::mem::size_of::<Option<Req>>() + self.free.capacity() * 4;
            self.table = Vec::new();
            self.free = Vec::new();
            return freed;
        }
        0
    }

    /// Acts on what the byte splitter found on connection `ci`.
    pub(super) fn take_parsed(&mut self, sh: &mut Shared, out: &mut Output, exports: &mut Attachments, ci: u32, parsed: Parsed) {
        match parsed {
            Parsed::Request(req, at) => self.start_request(sh, out, ci, req, at),
            Parsed::Refuse(req, code, why, at) => out.reply_small(sh, ci, &req, ReplyBody::Error { errno: code, message: why }, at),
            Parsed::Write(p) => {
                let buf = p.buf.expect("a complete payload is in its buffer");
                self.start_write(sh, out, exports, Req::new(ci, p.req, p.file, Some(buf), p.data_off, p.started));
            }
            Parsed::WriteLent { req, bid, start, file, started } => {
                let r = Req { lent: Some((bid, start)), ..Req::new(ci, req, file, None, DATA_OFFSET, started) };
                self.start_write(sh, out, exports, r);
            }
        }
    }

    fn start_request(&mut self, sh: &mut Shared, out: &mut Output, ci: u32, req: Request, at: Instant) {
        let Some(Phase::Serving { attached, style, base_allocation }) = sh.conns[ci as usize].as_ref().map(|c| &c.phase) else {
            return;
        };
        let (style, base_allocation) = (*style, *base_allocation);
        let spliced = attached.spliced(req.offset, req.length);
        // The export's few plain fields, not the export: a clone of its Arc
        // is two shared-counter updates on every request, and only hole
        // checks and BLOCK_STATUS need the export itself (taken there).
        let (size, read_only, block_device) = (attached.export.size, attached.export.read_only, attached.export.block_device);
        let (file, buffered) = (attached.file, attached.buffered);
        let (read_file, read_off) = attached.route(req.offset, req.length);
        let refuse = |sh: &mut Shared, out: &mut Output, code: u32, why: &'static str| {
            out.reply_small(sh, ci, &req, ReplyBody::Error { errno: code, message: why }, at)
        };
        if let Some((code, why)) = refusal(&req, style, size, read_only) {
            return refuse(sh, out, code, why);
        }
        match req.kind {
            cmd::READ => {
                // A hole check is one lseek; past this turn's share of them
                // a hole is read as data (zeroes), which is always correct.
                if style.structured() && !block_device && req.length >= HOLE_CHECK_MIN && self.seeks_left > 0 {
                    self.seeks_left -= 1;
                    if sh.export_of(ci).is_some_and(|e| is_hole(&e, req.offset, req.length)) {
                        let body = ReplyBody::Hole { offset: req.offset, length: req.length as u32 };
                        return out.reply_small(sh, ci, &req, body, at);
                    }
                }
                if spliced {
                    return reply_spliced(sh, out, ci, &req, read_file, style, at);
                }
                let buf = sh.ring.buffers().alloc(read_off + req.length as usize);
                let ri = self.new_req(sh, Req::new(ci, req, read_file, Some(buf), read_off, at));
                self.submit_io(sh, out, ri);
            }
            cmd::FLUSH => {
                let ri = self.new_req(sh, Req::new(ci, req, file, None, 0, at));
                self.submit_io(sh, out, ri);
            }
            cmd::TRIM | cmd::WRITE_ZEROES | cmd::CACHE => {
                let ri = self.new_req(sh, Req::new(ci, req, buffered.unwrap_or(file), None, 0, at));
                self.submit_io(sh, out, ri);
            }
            cmd::BLOCK_STATUS => {
                let Some(context) = base_allocation else {
                    return refuse(sh, out, errno::EINVAL, "no metadata context was selected");
                };
                let limit = if req.has(cf::REQ_ONE) { 1 } else { usize::MAX };
                let seeks = self.seeks_left.min(MAX_STATUS_SEEKS);
                let Some(export) = sh.export_of(ci) else { return };
                let mut used = 0;
                let found = extents(&export, req.offset, req.length, limit, seeks, &mut used);
                self.seeks_left -= used;
                match found {
                    Ok(list) => out.reply_small(sh, ci, &req, ReplyBody::Extents { context, extents: &list }, at),
                    Err(e) => refuse(sh, out, errno::from_host(e.raw_os_error().unwrap_or(libc::EIO)), "block status failed"),
                }
            }
            _ => unreachable!("filtered above"),
        }
    }

    fn start_write(&mut self, sh: &mut Shared, out: &mut Output, exports: &mut Attachments, r: Req) {
        let ci = r.conn;
        let ri = self.new_req(sh, r);
        if !self.try_inline(sh, out, exports, ci, ri) {
            self.submit_io(sh, out, ri);
        }
    }

    /// Does WRITE request `ri` of connection `ci` on the ring thread if its
    /// export's write path says so (see `inline`); false: the caller
    /// submits it to the ring.
    fn try_inline(&mut self, sh: &mut Shared, out: &mut Output, exports: &mut Attachments, ci: u32, ri: u32) -> bool {
        let Some(r) = self.table[ri as usize].as_ref() else { return false };
        if r.req.kind != cmd::WRITE || r.data_off != DATA_OFFSET || r.done != 0 {
            return false; // O_DIRECT writes: io_uring does them asynchronously
        }
        let Some(conn) = sh.conn(ci) else { return false };
        let Some(attached) = conn.attached() else { return false };
        let depth = conn.depth.max(conn.split_requests).max(conn.last_depth);
        let export = attached.export.clone();
        let buffered = attached.buffered == Some(r.file);
        let Some(path) = exports.write_path(export.id) else { return false };
        let len = r.req.length as usize;
        let data = match (r.lent, r.buf) {
            // Still the connection's: an inline write runs while the
            // receive it came in is being split (`done` is 0 here).
            (Some((bid, start)), _) => &sh.ring.received(bid, start + len).0[start..],
            (None, Some(b)) => match sh.ring.buffers().get(b) {
                Some(bytes) => &bytes[r.data_off..r.data_off + len],
                None => return false,
            },
            (None, None) => return false,
        };
        let fd = match export.buffered() {
            Some(fd) if buffered => fd.as_fd(),
            _ => export.file().as_fd(),
        };
        let serving = at_once(self.table.len() - self.free.len(), self.admitted, depth);
        let (offload, lone) = (self.reads.offload_writes(serving), serving < MIN_IN_FLIGHT);
        let large_out = sh.senders.others_than(ci) || self.reads.starved_spell();
        let w = InlineWrite { export: &export, fd, data, offset: r.req.offset, fua: r.req.has(cf::FUA), offload, lone, large_out };
        let Some(res) = self.inline.write(path, w, sh.now) else { return false };
        self.on_done(sh, out, ri, res);
        if self.inline.flush_due() {
            // What the connection has queued leaves now, not at the end of the turn.
            out.send_next(sh, ci);
            if let Err(e) = sh.ring.submit_and_wait(0, None) {
                tracing::warn!(error = %e, "NBD ring submit failed");
            }
            self.inline.submitted_all();
        }
        true
    }

    fn new_req(&mut self, sh: &mut Shared, r: Req) -> u32 {
        let (ci, req, buf) = (r.conn, &r.req, r.buf);
        if let Some(c) = sh.conns[ci as usize].as_mut() {
            c.account.requests += 1;
            if let (Some(b), true) = (buf, req.kind != cmd::WRITE) {
                // A WRITE's buffer was charged when its payload started.
                let cost = Buffers::cost_of(sh.ring.buffers().len(b));
                c.account.charge(&sh.budget, cost, cost);
            }
        }
        self.admitted.admit();
        match self.free.pop() {
            Some(i) => {
                self.table[i as usize] = Some(r);
                i
            }
            None => {
                self.table.push(Some(r));
                self.table.len() as u32 - 1
            }
        }
    }

    /// Submits the next operation of request `ri` for its current step.
    fn submit_io(&mut self, sh: &mut Shared, out: &mut Output, ri: u32) {
        let Some(r) = self.table[ri as usize].as_ref() else { return };
        let t = Token::Req(ri);
        let (off, len, done) = (r.req.offset, r.req.length, r.done);
        let res = match (r.req.kind, r.step) {
            (_, Step::Sync) | (cmd::FLUSH, _) => sh.ring.submit(t, Op::Fsync { file: r.file, data_only: true }),
            (cmd::READ, _) => {
                let (b, start) = (r.buf.expect("reads own a buffer"), r.data_off + done as usize);
                let slice = (b, start, r.data_off + len as usize);
                // Only page-cache reads: an O_DIRECT read never runs on the ring thread.
                let in_flight = self.table.len() - self.free.len();
                if r.data_off == DATA_OFFSET && self.reads.offload(in_flight) {
                    sh.record_offloaded_read(r.conn);
                    sh.ring.submit(t, Op::Read { file: r.file, into: slice, offset: off + done, in_worker: true })
                } else {
                    sh.ring.submit(t, Op::Read { file: r.file, into: slice, offset: off + done, in_worker: false })
                }
            }
            (cmd::WRITE, _) => {
                let (dsync, offset) = (r.req.has(cf::FUA), off + done);
                match (r.lent, r.buf) {
                    (Some((bid, at)), _) => {
                        let from = (bid, at + done as usize, at + len as usize);
                        sh.ring.submit(t, Op::WriteReceived { file: r.file, from, offset, dsync })
                    }
                    (None, b) => {
                        let (b, start) = (b.expect("writes own a buffer or a lent one"), r.data_off + done as usize);
                        sh.ring.submit(t, Op::Write { file: r.file, from: (b, start, r.data_off + len as usize), offset, dsync })
                    }
                }
            }
            (cmd::WRITE_ZEROES, Step::ZeroFill) => {
                let b = self.zeroes.expect("made before the first zero fill");
                let n = (len - done).min(ZERO_CHUNK as u64) as usize;
                sh.ring.submit(t, Op::Write { file: r.file, from: (b, 0, n), offset: off + done, dsync: false })
            }
            (cmd::TRIM, _) => sh
                .ring
                .submit(t, Op::Fallocate { file: r.file, mode: libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE, offset: off, len }),
            (cmd::WRITE_ZEROES, _) => {
                let mode = if r.req.has(cf::NO_HOLE) { libc::FALLOC_FL_ZERO_RANGE } else { libc::FALLOC_FL_PUNCH_HOLE };
                sh.ring.submit(t, Op::Fallocate { file: r.file, mode: mode | libc::FALLOC_FL_KEEP_SIZE, offset: off, len })
            }
            (cmd::CACHE, _) => sh.ring.submit(
                t,
                Op::Fadvise { file: r.file, offset: off, len: len.min(u64::from(u32::MAX)) as u32, advice: libc::POSIX_FADV_WILLNEED },
            ),
            _ => unreachable!("only file commands get a request slot"),
        };
        if let Err(e) = res {
            tracing::warn!(error = %e, "NBD ring submission failed");
            return self.fail(sh, out, ri, errno::EIO, "server could not submit the I/O");
        }
        let Some(r) = self.table[ri as usize].as_mut() else { return };
        if in_workers(&r.req) && r.step != Step::Sync {
            if let Some(export) = sh.conn(r.conn).and_then(|c| c.attached()).map(|a| a.export.id) {
                r.ring_turn = Some(self.inline.queued(export));
            }
        }
    }

    /// A file operation of request `ri` completed with `res`.
    pub(super) fn on_done(&mut self, sh: &mut Shared, out: &mut Output, ri: u32, res: i32) {
        let Some(r) = self.table[ri as usize].as_mut() else { return };
        if let Some(mark) = r.ring_turn.take() {
            self.inline.landed(mark);
        }
        let (kind, step) = (r.req.kind, r.step);
        match (kind, step) {
            (cmd::READ | cmd::WRITE, _) | (cmd::WRITE_ZEROES, Step::ZeroFill) => {
                if res < 0 {
                    return self.fail(sh, out, ri, io_err(res), "I/O error");
                }
                if res == 0 {
                    return self.fail(sh, out, ri, errno::EIO, "short transfer at the end of the file");
                }
                r.done += res as u64;
                if r.done < r.req.length {
                    return self.submit_io(sh, out, ri);
                }
                match kind {
                    cmd::READ => self.reply_read(sh, out, ri),
                    cmd::WRITE_ZEROES if r.req.has(cf::FUA) => {
                        r.step = Step::Sync;
                        self.submit_io(sh, out, ri)
                    }
                    _ => self.succeed(sh, out, ri),
                }
            }
            (cmd::WRITE_ZEROES, Step::Io) if res == -libc::EOPNOTSUPP || res == -libc::EINVAL => {
                if r.req.has(cf::FAST_ZERO) {
                    return self.fail(sh, out, ri, errno::ENOTSUP, "zeroing this range would not be fast");
                }
                // The filesystem cannot zero ranges: write zeroes, from one
                // buffer every zero fill of this ring shares (it is only read).
                r.step = Step::ZeroFill;
                if self.zeroes.is_none() {
                    let b = sh.ring.buffers().alloc_heap(ZERO_CHUNK);
                    if let Some(bytes) = sh.ring.buffers().get_mut(b) {
                        bytes.fill(0);
                    }
                    self.zeroes = Some(b);
                }
                self.submit_io(sh, out, ri)
            }
            (cmd::TRIM | cmd::WRITE_ZEROES, Step::Io) => {
                // A trim the file cannot do is still a valid answer: trim is advisory.
                if res < 0 && !(kind == cmd::TRIM && res == -libc::EOPNOTSUPP) {
                    return self.fail(sh, out, ri, io_err(res), "could not punch or zero the range");
                }
                if r.req.has(cf::FUA) {
                    r.step = Step::Sync;
                    return self.submit_io(sh, out, ri);
                }
                self.succeed(sh, out, ri)
            }
            (cmd::CACHE, _) => self.succeed(sh, out, ri),
            _ => {
                if res < 0 {
                    return self.fail(sh, out, ri, io_err(res), "flush failed");
                }
                self.succeed(sh, out, ri)
            }
        }
    }

    /// Puts the header in front of the data already in the buffer and queues
    /// header and data as one part.
    fn reply_read(&mut self, sh: &mut Shared, out: &mut Output, ri: u32) {
        let Some(r) = self.table[ri as usize].take() else { return };
        self.free.push(ri);
        let style = sh.conn(r.conn).map_or(HeaderStyle::Simple, |c| c.style());
        let b = r.buf.expect("reads own a buffer");
        let len = r.req.length as usize;
        let Some(bytes) = sh.ring.buffers().get_mut(b) else { return };
        let start = if style == HeaderStyle::Simple {
            let h = ReplyHeader { style, cookie: r.req.cookie, offset: 0, chunk_type: 0, flags: 0, error: 0, payload: 0 };
            r.data_off - h.write_before(&mut bytes[..r.data_off])
        } else {
            bytes[r.data_off - 8..r.data_off].copy_from_slice(&r.req.offset.to_be_bytes());
            let h = ReplyHeader {
                style,
                cookie: r.req.cookie,
                offset: r.req.offset,
                chunk_type: chunk::OFFSET_DATA,
                flags: chunk::FLAG_DONE,
                error: 0,
                payload: 8 + len as u64,
            };
            r.data_off - 8 - h.write_before(&mut bytes[..r.data_off - 8])
        };
        sh.record(r.conn, Kind::Read, len as u64, true, r.started);
        out.queue(sh, r.conn, b, start, r.data_off + len);
        self.request_ended(sh, r.conn, None);
    }

    fn succeed(&mut self, sh: &mut Shared, out: &mut Output, ri: u32) {
        self.end_with(sh, out, ri, ReplyBody::Ack);
    }

    fn fail(&mut self, sh: &mut Shared, out: &mut Output, ri: u32, code: u32, why: &'static str) {
        self.end_with(sh, out, ri, ReplyBody::Error { errno: code, message: why });
    }

    fn end_with(&mut self, sh: &mut Shared, out: &mut Output, ri: u32, body: ReplyBody<'_>) {
        let Some(r) = self.table[ri as usize].take() else { return };
        self.free.push(ri);
        if let Some(mark) = r.ring_turn {
            self.inline.landed(mark); // failed before its completion came
        }
        let freed = r.buf.map(|b| {
            let n = Buffers::cost_of(sh.ring.buffers().len(b));
            sh.ring.buffers().free(b);
            n
        });
        // A lent payload was charged as if it had a buffer of its own.
        let freed = freed.or_else(|| {
            let (bid, _) = r.lent?;
            if sh.conn_mut(r.conn).is_some_and(|c| c.unlend(bid)) {
                sh.ring.recycle(bid);
            }
            Some(Buffers::cost_of(r.data_off + r.req.length as usize))
        });
        out.reply_small(sh, r.conn, &r.req, body, r.started);
        self.request_ended(sh, r.conn, Some(freed.unwrap_or(0)));
    }

    /// Bookkeeping when a request with a slot is answered; `freed` is the
    /// cost of a buffer released without being queued for sending.
    fn request_ended(&mut self, sh: &mut Shared, ci: u32, freed: Option<usize>) {
        if let Some(c) = sh.conns[ci as usize].as_mut() {
            c.account.requests = c.account.requests.saturating_sub(1);
            if let Some(n) = freed {
                c.account.release(&sh.budget, n, n);
            }
        }
        sh.mark(ci);
    }
}

/// Queues a READ's header, then the file range itself as a splice.
/// A failure of the splice can no longer be reported (the header has
/// promised the data), so it drops the connection; page-cache reads
/// fail only on I/O errors of the backing device.
fn reply_spliced(sh: &mut Shared, out: &mut Output, ci: u32, req: &Request, file: u32, style: HeaderStyle, at: Instant) {
    let len = req.length;
    let h = if style == HeaderStyle::Simple {
        ReplyHeader { style, cookie: req.cookie, offset: 0, chunk_type: 0, flags: 0, error: 0, payload: 0 }
    } else {
        ReplyHeader {
            style,
            cookie: req.cookie,
            offset: req.offset,
            chunk_type: chunk::OFFSET_DATA,
            flags: chunk::FLAG_DONE,
            error: 0,
            payload: 8 + len,
        }
    };
    let extra = if style == HeaderStyle::Simple { 0 } else { 8 };
    out.scratch.clear();
    out.scratch.resize(h.size() + extra, 0);
    h.write_before(&mut out.scratch[..h.size()]);
    if extra > 0 {
        let at = h.size();
        out.scratch[at..].copy_from_slice(&req.offset.to_be_bytes());
    }
    out.queue_scratch(sh, ci);
    out.queue_splice(sh, ci, file, req.offset, len, at);
}

/// True when no byte of the range is allocated.
fn is_hole(e: &Export, offset: u64, len: u64) -> bool {
    match rustix::fs::seek(e.any_fd(), rustix::fs::SeekFrom::Data(offset)) {
        Ok(data) => data >= offset + len,
        Err(err) => err == rustix::io::Errno::NXIO,
    }
}

/// `base:allocation` extents of a range from SEEK_DATA/SEEK_HOLE, with at
/// most `seeks` lseek calls (counted in `used`); a block device is reported
/// as all data. When the calls run out the reply covers less of the range,
/// or (before the first extent is known) reports the rest as data: both
/// are answers the protocol allows, and neither stalls the ring.
fn extents(e: &Export, offset: u64, len: u64, limit: usize, seeks: u32, used: &mut u32) -> std::io::Result<Vec<Extent>> {
    use rustix::fs::{seek, SeekFrom};
    let end = offset + len;
    if e.block_device {
        return Ok(vec![Extent { length: len, flags: 0 }]);
    }
    let mut out = Vec::new();
    let mut pos = offset;
    let fd = e.any_fd();
    let mut lseek = |whence: SeekFrom| -> Option<std::io::Result<u64>> {
        if *used >= seeks {
            return None;
        }
        *used += 1;
        Some(match seek(fd, whence) {
            Ok(p) => Ok(p.min(end)),
            Err(rustix::io::Errno::NXIO) => Ok(end),
            Err(err) => Err(err.into()),
        })
    };
    while pos < end && out.len() < limit {
        let Some(data) = lseek(SeekFrom::Data(pos)) else { break };
        let data = data?;
        if data > pos {
            out.push(Extent { length: data - pos, flags: wire::state::HOLE | wire::state::ZERO });
            pos = data;
            continue;
        }
        let Some(hole) = lseek(SeekFrom::Hole(pos)) else { break };
        let hole = hole?;
        out.push(Extent { length: hole.max(pos + 1) - pos, flags: 0 });
        pos = hole.max(pos + 1);
    }
    if out.is_empty() {
        out.push(Extent { length: len, flags: 0 });
    }
    Ok(out)
}

/// Why a request (other than a WRITE) on an export of `size` bytes is
/// refused, with the NBD error it gets: an unknown command, flags the
/// command does not take, a READ over the block size, a zero length, a range
/// past the end, or a change to a read-only export. `None`: it is served.
#[inline]
fn refusal(req: &Request, style: HeaderStyle, size: u64, read_only: bool) -> Option<(u32, &'static str)> {
    let allowed = match req.kind {
        cmd::READ => cf::DF,
        cmd::FLUSH => 0,
        cmd::TRIM => cf::FUA,
        cmd::WRITE_ZEROES => cf::FUA | cf::NO_HOLE | cf::FAST_ZERO,
        cmd::CACHE => 0,
        cmd::BLOCK_STATUS => cf::REQ_ONE,
        _ => return Some((errno::EINVAL, "unknown command")),
    };
    if req.flags & !allowed != 0 || (req.has(cf::DF) && !style.structured()) {
        return Some((errno::EINVAL, "unsupported command flags"));
    }
    if req.kind == cmd::READ && req.length > u64::from(MAX_BLOCK) {
        return Some((errno::EOVERFLOW, "READ longer than the maximum block size"));
    }
    if req.kind != cmd::FLUSH {
        if req.length == 0 {
            return Some((errno::EINVAL, "zero-length request"));
        }
        if !in_bounds(size, req) {
            let code = if req.kind == cmd::WRITE_ZEROES { errno::ENOSPC } else { errno::EINVAL };
            return Some((code, "request beyond the end of the export"));
        }
    }
    if read_only && matches!(req.kind, cmd::TRIM | cmd::WRITE_ZEROES) {
        return Some((errno::EPERM, "export is read-only"));
    }
    None
}
