//! Requests: checks, the file operations that serve them, and their replies.

use std::time::Instant;

use super::conn::{Parsed, Payload, Phase};
use super::token::Token;
use super::worker::Worker;
use crate::export::{Export, MAX_BLOCK};
use crate::stats::Kind;
use crate::wire::{self, chunk, cmd, cmd_flags as cf, errno, Extent, HeaderStyle, ReplyBody, ReplyHeader, Request};
use volring_ring::buffers::{BufId, Buffers};

/// Reads at least this long ask the file whether the range is a hole first,
/// and answer a hole with one chunk and no data.
const HOLE_CHECK_MIN: u64 = 64 * 1024;
/// lseek calls one BLOCK_STATUS may make (two per data extent): the file
/// is asked on the ring thread, so a fragmented file must not stall it.
/// The spec lets a reply cover less than was asked; clients ask on.
const MAX_STATUS_SEEKS: u32 = 32;
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
    pub data_off: usize,
    /// Bytes done so far (reads and writes can complete short).
    pub done: u64,
    pub step: Step,
    pub started: Instant,
}

fn kind_of(command: u16) -> Kind {
    match command {
        cmd::READ => Kind::Read,
        cmd::WRITE => Kind::Write,
        cmd::FLUSH => Kind::Flush,
        cmd::TRIM => Kind::Trim,
        cmd::WRITE_ZEROES => Kind::Zero,
        _ => Kind::Other,
    }
}

/// The range check shared by every command with an offset and a length.
fn in_bounds(size: u64, r: &Request) -> bool {
    r.offset.checked_add(r.length).is_some_and(|end| end <= size)
}

fn io_err(res: i32) -> u32 {
    errno::from_host(-res)
}

impl Worker {
    /// Acts on what the byte splitter found on connection `ci`.
    pub(super) fn take_parsed(&mut self, ci: u32, parsed: Parsed) {
        match parsed {
            Parsed::Request(req, at) => self.start_request(ci, req, at),
            Parsed::Refuse(req, code, why, at) => self.reply_small(ci, &req, ReplyBody::Error { errno: code, message: why }, at),
            Parsed::Write(p) => self.start_write(ci, p),
        }
    }

    fn start_request(&mut self, ci: u32, req: Request, at: Instant) {
        let Some(Phase::Serving { attached, style, base_allocation }) = self.conns[ci as usize].as_ref().map(|c| &c.phase) else {
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
        let refuse =
            |w: &mut Worker, code: u32, why: &'static str| w.reply_small(ci, &req, ReplyBody::Error { errno: code, message: why }, at);
        let allowed = match req.kind {
            cmd::READ => cf::DF,
            cmd::FLUSH => 0,
            cmd::TRIM => cf::FUA,
            cmd::WRITE_ZEROES => cf::FUA | cf::NO_HOLE | cf::FAST_ZERO,
            cmd::CACHE => 0,
            cmd::BLOCK_STATUS => cf::REQ_ONE,
            _ => return refuse(self, errno::EINVAL, "unknown command"),
        };
        if req.flags & !allowed != 0 || (req.has(cf::DF) && !style.structured()) {
            return refuse(self, errno::EINVAL, "unsupported command flags");
        }
        if req.kind == cmd::READ && req.length > u64::from(MAX_BLOCK) {
            return refuse(self, errno::EOVERFLOW, "READ longer than the maximum block size");
        }
        if req.kind != cmd::FLUSH {
            if req.length == 0 {
                return refuse(self, errno::EINVAL, "zero-length request");
            }
            if !in_bounds(size, &req) {
                let code = if req.kind == cmd::WRITE_ZEROES { errno::ENOSPC } else { errno::EINVAL };
                return refuse(self, code, "request beyond the end of the export");
            }
        }
        if read_only && matches!(req.kind, cmd::TRIM | cmd::WRITE_ZEROES) {
            return refuse(self, errno::EPERM, "export is read-only");
        }
        match req.kind {
            cmd::READ => {
                // A hole check is one lseek; past this turn's share of them
                // a hole is read as data (zeroes), which is always correct.
                if style.structured() && !block_device && req.length >= HOLE_CHECK_MIN && self.seeks_left > 0 {
                    self.seeks_left -= 1;
                    if self.export_of(ci).is_some_and(|e| is_hole(&e, req.offset, req.length)) {
                        let body = ReplyBody::Hole { offset: req.offset, length: req.length as u32 };
                        return self.reply_small(ci, &req, body, at);
                    }
                }
                if spliced {
                    return self.reply_spliced(ci, &req, read_file, style, at);
                }
                let buf = self.ring.buffers_mut().alloc(read_off + req.length as usize);
                let ri = self.new_req(ci, req, read_file, Some(buf), read_off, at);
                self.submit_io(ri);
            }
            cmd::FLUSH => {
                let ri = self.new_req(ci, req, file, None, 0, at);
                self.submit_io(ri);
            }
            cmd::TRIM | cmd::WRITE_ZEROES | cmd::CACHE => {
                let ri = self.new_req(ci, req, buffered.unwrap_or(file), None, 0, at);
                self.submit_io(ri);
            }
            cmd::BLOCK_STATUS => {
                let Some(context) = base_allocation else {
                    return refuse(self, errno::EINVAL, "no metadata context was selected");
                };
                let limit = if req.has(cf::REQ_ONE) { 1 } else { usize::MAX };
                let seeks = self.seeks_left.min(MAX_STATUS_SEEKS);
                let Some(export) = self.export_of(ci) else { return };
                let mut used = 0;
                let found = extents(&export, req.offset, req.length, limit, seeks, &mut used);
                self.seeks_left -= used;
                match found {
                    Ok(list) => self.reply_small(ci, &req, ReplyBody::Extents { context, extents: &list }, at),
                    Err(e) => refuse(self, errno::from_host(e.raw_os_error().unwrap_or(libc::EIO)), "block status failed"),
                }
            }
            _ => unreachable!("filtered above"),
        }
    }

    fn start_write(&mut self, ci: u32, p: Payload) {
        let ri = self.new_req(ci, p.req, p.file, Some(p.buf), p.data_off, p.started);
        if !self.try_inline_write(ci, ri) {
            self.submit_io(ri);
        }
    }

    fn new_req(&mut self, ci: u32, req: Request, file: u32, buf: Option<BufId>, data_off: usize, started: Instant) -> u32 {
        if let Some(c) = self.conns[ci as usize].as_mut() {
            c.account.requests += 1;
            if let (Some(b), true) = (buf, req.kind != cmd::WRITE) {
                // A WRITE's buffer was charged when its payload started.
                let cost = Buffers::cost_of(self.ring.buffers().len(b));
                c.account.charge(&self.budget, cost, cost);
            }
        }
        let r = Req { conn: ci, req, file, buf, data_off, done: 0, step: Step::Io, started };
        match self.free_reqs.pop() {
            Some(i) => {
                self.reqs[i as usize] = Some(r);
                i
            }
            None => {
                self.reqs.push(Some(r));
                self.reqs.len() as u32 - 1
            }
        }
    }

    /// Submits the next operation of request `ri` for its current step.
    fn submit_io(&mut self, ri: u32) {
        let Some(r) = self.reqs[ri as usize].as_ref() else { return };
        let t = Token::Req(ri);
        let (off, len, done) = (r.req.offset, r.req.length, r.done);
        let res = match (r.req.kind, r.step) {
            (_, Step::Sync) | (cmd::FLUSH, _) => self.ring.fsync(t, r.file, true),
            (cmd::READ, _) => {
                let (b, start) = (r.buf.expect("reads own a buffer"), r.data_off + done as usize);
                self.ring.read(t, r.file, (b, start, r.data_off + len as usize), off + done)
            }
            (cmd::WRITE, _) => {
                let (b, start, fua) = (r.buf.expect("writes own a buffer"), r.data_off + done as usize, r.req.has(cf::FUA));
                self.ring.write(t, r.file, (b, start, r.data_off + len as usize), off + done, fua)
            }
            (cmd::WRITE_ZEROES, Step::ZeroFill) => {
                let b = self.zeroes.expect("made before the first zero fill");
                let n = (len - done).min(ZERO_CHUNK as u64) as usize;
                self.ring.write(t, r.file, (b, 0, n), off + done, false)
            }
            (cmd::TRIM, _) => self.ring.fallocate(t, r.file, libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE, off, len),
            (cmd::WRITE_ZEROES, _) => {
                let mode = if r.req.has(cf::NO_HOLE) { libc::FALLOC_FL_ZERO_RANGE } else { libc::FALLOC_FL_PUNCH_HOLE };
                self.ring.fallocate(t, r.file, mode | libc::FALLOC_FL_KEEP_SIZE, off, len)
            }
            (cmd::CACHE, _) => self.ring.fadvise(t, r.file, off, len.min(u64::from(u32::MAX)) as u32, libc::POSIX_FADV_WILLNEED),
            _ => unreachable!("only file commands get a request slot"),
        };
        if let Err(e) = res {
            tracing::warn!(error = %e, "NBD ring submission failed");
            self.fail(ri, errno::EIO, "server could not submit the I/O");
        }
    }

    /// A file operation of request `ri` completed with `res`.
    pub(super) fn on_request_done(&mut self, ri: u32, res: i32) {
        let Some(r) = self.reqs[ri as usize].as_mut() else { return };
        let (kind, step) = (r.req.kind, r.step);
        match (kind, step) {
            (cmd::READ | cmd::WRITE, _) | (cmd::WRITE_ZEROES, Step::ZeroFill) => {
                if res < 0 {
                    return self.fail(ri, io_err(res), "I/O error");
                }
                if res == 0 {
                    return self.fail(ri, errno::EIO, "short transfer at the end of the file");
                }
                r.done += res as u64;
                if r.done < r.req.length {
                    return self.submit_io(ri);
                }
                match kind {
                    cmd::READ => self.reply_read(ri),
                    cmd::WRITE_ZEROES if r.req.has(cf::FUA) => {
                        r.step = Step::Sync;
                        self.submit_io(ri)
                    }
                    _ => self.succeed(ri),
                }
            }
            (cmd::WRITE_ZEROES, Step::Io) if res == -libc::EOPNOTSUPP || res == -libc::EINVAL => {
                if r.req.has(cf::FAST_ZERO) {
                    return self.fail(ri, errno::ENOTSUP, "zeroing this range would not be fast");
                }
                // The filesystem cannot zero ranges: write zeroes, from one
                // buffer every zero fill of this ring shares (it is only read).
                r.step = Step::ZeroFill;
                if self.zeroes.is_none() {
                    let b = self.ring.buffers_mut().alloc_heap(ZERO_CHUNK);
                    if let Some(bytes) = self.ring.buffers_mut().get_mut(b) {
                        bytes.fill(0);
                    }
                    self.zeroes = Some(b);
                }
                self.submit_io(ri)
            }
            (cmd::TRIM | cmd::WRITE_ZEROES, Step::Io) => {
                // A trim the file cannot do is still a valid answer: trim is advisory.
                if res < 0 && !(kind == cmd::TRIM && res == -libc::EOPNOTSUPP) {
                    return self.fail(ri, io_err(res), "could not punch or zero the range");
                }
                if r.req.has(cf::FUA) {
                    r.step = Step::Sync;
                    return self.submit_io(ri);
                }
                self.succeed(ri)
            }
            (cmd::CACHE, _) => self.succeed(ri),
            _ => {
                if res < 0 {
                    return self.fail(ri, io_err(res), "flush failed");
                }
                self.succeed(ri)
            }
        }
    }

    fn style_of(&self, ci: u32) -> HeaderStyle {
        match self.conns[ci as usize].as_ref().map(|c| &c.phase) {
            Some(Phase::Serving { style, .. }) => *style,
            _ => HeaderStyle::Simple,
        }
    }

    /// Puts the header in front of the data already in the buffer and queues
    /// header and data as one part.
    fn reply_read(&mut self, ri: u32) {
        let Some(r) = self.reqs[ri as usize].take() else { return };
        self.free_reqs.push(ri);
        let style = self.style_of(r.conn);
        let b = r.buf.expect("reads own a buffer");
        let len = r.req.length as usize;
        let Some(bytes) = self.ring.buffers_mut().get_mut(b) else { return };
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
        self.record(r.conn, Kind::Read, len as u64, true, r.started);
        self.queue(r.conn, b, start, r.data_off + len);
        self.request_ended(r.conn, None);
    }

    /// Queues a READ's header, then the file range itself as a splice.
    /// A failure of the splice can no longer be reported (the header has
    /// promised the data), so it drops the connection; page-cache reads
    /// fail only on I/O errors of the backing device.
    fn reply_spliced(&mut self, ci: u32, req: &Request, file: u32, style: HeaderStyle, at: Instant) {
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
        self.scratch.clear();
        self.scratch.resize(h.size() + extra, 0);
        h.write_before(&mut self.scratch[..h.size()]);
        if extra > 0 {
            let at = h.size();
            self.scratch[at..].copy_from_slice(&req.offset.to_be_bytes());
        }
        self.queue_scratch(ci);
        self.queue_splice(ci, file, req.offset, len, at);
    }

    fn succeed(&mut self, ri: u32) {
        self.end_with(ri, ReplyBody::Ack);
    }

    fn fail(&mut self, ri: u32, code: u32, why: &'static str) {
        self.end_with(ri, ReplyBody::Error { errno: code, message: why });
    }

    fn end_with(&mut self, ri: u32, body: ReplyBody<'_>) {
        let Some(r) = self.reqs[ri as usize].take() else { return };
        self.free_reqs.push(ri);
        let freed = r.buf.map(|b| {
            let n = Buffers::cost_of(self.ring.buffers().len(b));
            self.ring.buffers_mut().free(b);
            n
        });
        self.reply_small(r.conn, &r.req, body, r.started);
        self.request_ended(r.conn, Some(freed.unwrap_or(0)));
    }

    /// Bookkeeping when a request with a slot is answered; `freed` is the
    /// cost of a buffer released without being queued for sending.
    fn request_ended(&mut self, ci: u32, freed: Option<usize>) {
        if let Some(c) = self.conns[ci as usize].as_mut() {
            c.account.requests = c.account.requests.saturating_sub(1);
            if let Some(n) = freed {
                c.account.release(&self.budget, n, n);
            }
        }
        self.mark(ci);
    }

    /// Encodes a reply without bulk data and queues it.
    pub(super) fn reply_small(&mut self, ci: u32, req: &Request, body: ReplyBody<'_>, started: Instant) {
        let ok = matches!(body, ReplyBody::Ack | ReplyBody::Extents { .. } | ReplyBody::Hole { .. });
        let bytes = if matches!(req.kind, cmd::READ | cmd::WRITE) && ok { req.length } else { 0 };
        self.record(ci, kind_of(req.kind), bytes, ok, started);
        let style = self.style_of(ci);
        self.scratch.clear();
        wire::encode_small_reply(style, req.cookie, req.offset, body, &mut self.scratch);
        self.queue_scratch(ci);
    }

    /// The export connection `ci` is attached to.
    fn export_of(&self, ci: u32) -> Option<std::sync::Arc<Export>> {
        self.conns[ci as usize].as_ref().and_then(|c| c.attached()).map(|a| a.export.clone())
    }

    pub(super) fn record(&mut self, ci: u32, kind: Kind, bytes: u64, ok: bool, started: Instant) {
        let Some(id) = self.conns[ci as usize].as_ref().and_then(|c| c.attached()).map(|a| a.export.id) else { return };
        let us = self.now.saturating_duration_since(started).as_micros() as u64;
        // The export's Arc is cloned only for its first request on this ring.
        if let Some((_, pending)) = self.stats.get_mut(&id) {
            return pending.record(kind, bytes, ok, us);
        }
        let Some(export) = self.export_of(ci) else { return };
        self.stats.entry(id).or_insert_with(|| (export, Default::default())).1.record(kind, bytes, ok, us);
    }
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
