//! The client's side of the fixed-newstyle handshake, as a pure state
//! machine: bytes from the server in, bytes to send out, and at the end the
//! export's size and transmission flags. It negotiates what the kernel's
//! nbd driver speaks (simple replies, compact requests), so the socket can
//! then be handed to the kernel: NBD_OPT_GO first, NBD_OPT_EXPORT_NAME when
//! the server does not know GO.
//!
//! [`negotiate`] drives it over a blocking socket.

use std::io::{Read, Write};
use std::os::fd::AsFd;
use std::time::Duration;

use super::wire::{self, handshake_flags as hf, info, opt, rep};
use super::Error;

/// Largest option reply kept; the spec's longest (an INFO with a
/// description, an error message) are far shorter.
pub(crate) const MAX_REPLY_LEN: usize = 64 * 1024;
const REPLY_HEADER_LEN: usize = 20;

/// What the server told about the export.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ExportDetails {
    pub size: u64,
    pub tx_flags: u16,
    /// Minimum, preferred and maximum block size, when the server said.
    pub block_sizes: Option<(u32, u32, u32)>,
}

/// What one [`ClientHandshake::step`] call produced.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ClientOutcome {
    /// Send `out` (possibly empty) and feed more input.
    NeedMore,
    /// Send `out`; the socket is in the transmission phase.
    Done(ExportDetails),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    Greeting,
    GoReplies,
    /// After NBD_OPT_EXPORT_NAME: size, flags and (unless NO_ZEROES) padding.
    ExportName,
    Done,
}

/// One connection's negotiation, client side.
#[derive(Debug)]
pub(crate) struct ClientHandshake {
    name: String,
    state: State,
    no_zeroes: bool,
    size_flags: Option<(u64, u16)>,
    block_sizes: Option<(u32, u32, u32)>,
}

fn be16(b: &[u8]) -> u16 {
    u16::from_be_bytes(b[..2].try_into().unwrap())
}
fn be32(b: &[u8]) -> u32 {
    u32::from_be_bytes(b[..4].try_into().unwrap())
}
fn be64(b: &[u8]) -> u64 {
    u64::from_be_bytes(b[..8].try_into().unwrap())
}

fn put_option(out: &mut Vec<u8>, option: u32, data: &[u8]) {
    out.extend_from_slice(&wire::IHAVEOPT.to_be_bytes());
    out.extend_from_slice(&option.to_be_bytes());
    out.extend_from_slice(&(data.len() as u32).to_be_bytes());
    out.extend_from_slice(data);
}

impl ClientHandshake {
    pub(crate) fn new(export: &str) -> Result<Self, Error> {
        if export.len() > 4096 {
            return Err(Error::Protocol("export name longer than 4096 bytes"));
        }
        Ok(ClientHandshake { name: export.to_string(), state: State::Greeting, no_zeroes: false, size_flags: None, block_sizes: None })
    }

    /// Takes what it can of `input` (returning how much), appending what to
    /// send to `out`. Never reads past the end of the handshake: bytes after
    /// it belong to the transmission phase.
    pub(crate) fn step(&mut self, input: &[u8], out: &mut Vec<u8>) -> Result<(usize, ClientOutcome), Error> {
        let mut used = 0;
        loop {
            let rest = &input[used..];
            match self.state {
                State::Done => return Err(Error::Protocol("handshake already finished")),
                State::Greeting => {
                    if rest.len() < 18 {
                        return Ok((used, ClientOutcome::NeedMore));
                    }
                    if be64(rest) != wire::NBDMAGIC {
                        return Err(Error::Protocol("server greeting without NBDMAGIC"));
                    }
                    if be64(&rest[8..]) != wire::IHAVEOPT {
                        return Err(Error::Protocol("oldstyle server (no IHAVEOPT)"));
                    }
                    let flags = be16(&rest[16..]);
                    if flags & hf::FIXED_NEWSTYLE == 0 {
                        return Err(Error::Protocol("server is not fixed-newstyle"));
                    }
                    self.no_zeroes = flags & hf::NO_ZEROES != 0;
                    let mut cflags = hf::C_FIXED_NEWSTYLE;
                    if self.no_zeroes {
                        cflags |= hf::C_NO_ZEROES;
                    }
                    out.extend_from_slice(&cflags.to_be_bytes());
                    // GO: name, then one info request (block sizes).
                    let mut data = Vec::with_capacity(self.name.len() + 8);
                    data.extend_from_slice(&(self.name.len() as u32).to_be_bytes());
                    data.extend_from_slice(self.name.as_bytes());
                    data.extend_from_slice(&1u16.to_be_bytes());
                    data.extend_from_slice(&info::BLOCK_SIZE.to_be_bytes());
                    put_option(out, opt::GO, &data);
                    used += 18;
                    self.state = State::GoReplies;
                }
                State::GoReplies => {
                    if rest.len() < REPLY_HEADER_LEN {
                        return Ok((used, ClientOutcome::NeedMore));
                    }
                    if be64(rest) != wire::OPTION_REPLY_MAGIC {
                        return Err(Error::Protocol("option reply without its magic"));
                    }
                    if be32(&rest[8..]) != opt::GO {
                        return Err(Error::Protocol("reply to an option not asked"));
                    }
                    let kind = be32(&rest[12..]);
                    let len = be32(&rest[16..]) as usize;
                    if len > MAX_REPLY_LEN {
                        return Err(Error::Protocol("option reply too long"));
                    }
                    if rest.len() < REPLY_HEADER_LEN + len {
                        return Ok((used, ClientOutcome::NeedMore));
                    }
                    let data = &rest[REPLY_HEADER_LEN..REPLY_HEADER_LEN + len];
                    used += REPLY_HEADER_LEN + len;
                    match kind {
                        rep::INFO => self.on_info(data)?,
                        rep::ACK => {
                            let (size, tx_flags) = self.size_flags.ok_or(Error::Protocol("GO acknowledged without export info"))?;
                            self.state = State::Done;
                            return Ok((used, ClientOutcome::Done(ExportDetails { size, tx_flags, block_sizes: self.block_sizes })));
                        }
                        rep::ERR_UNSUP => {
                            // An older server: the export name option ends
                            // the handshake without a reply of its own.
                            put_option(out, opt::EXPORT_NAME, self.name.as_bytes());
                            self.state = State::ExportName;
                        }
                        k if k & 0x8000_0000 != 0 => return Err(Error::Refused { option: opt::GO, reply: k }),
                        _ => {} // unknown non-error replies are ignored, as the spec says
                    }
                }
                State::ExportName => {
                    let need = if self.no_zeroes { 10 } else { 134 };
                    if rest.len() < need {
                        return Ok((used, ClientOutcome::NeedMore));
                    }
                    let details = ExportDetails { size: be64(rest), tx_flags: be16(&rest[8..]), block_sizes: None };
                    used += need;
                    self.state = State::Done;
                    return Ok((used, ClientOutcome::Done(details)));
                }
            }
        }
    }

    fn on_info(&mut self, data: &[u8]) -> Result<(), Error> {
        if data.len() < 2 {
            return Err(Error::Protocol("empty INFO reply"));
        }
        match be16(data) {
            info::EXPORT if data.len() == 12 => self.size_flags = Some((be64(&data[2..]), be16(&data[10..]))),
            info::EXPORT => return Err(Error::Protocol("INFO_EXPORT of the wrong length")),
            info::BLOCK_SIZE if data.len() == 14 => self.block_sizes = Some((be32(&data[2..]), be32(&data[6..]), be32(&data[10..]))),
            info::BLOCK_SIZE => return Err(Error::Protocol("INFO_BLOCK_SIZE of the wrong length")),
            _ => {}
        }
        Ok(())
    }
}

/// Negotiates `export` on a connected blocking socket, giving up after
/// `timeout` without progress. The socket is then in the transmission
/// phase with simple replies, as the kernel's driver expects.
pub fn negotiate<S: Read + Write + AsFd>(sock: &mut S, export: &str, timeout: Duration) -> Result<ExportDetails, Error> {
    use rustix::net::sockopt::{set_socket_timeout, Timeout};
    for t in [Timeout::Recv, Timeout::Send] {
        set_socket_timeout(&*sock, t, Some(timeout)).map_err(|e| Error::io("socket timeout")(e.into()))?;
    }
    let mut hs = ClientHandshake::new(export)?;
    let mut inbuf = Vec::with_capacity(256);
    let mut out = Vec::new();
    let mut chunk = [0u8; 4096];
    loop {
        let (used, outcome) = hs.step(&inbuf, &mut out)?;
        inbuf.drain(..used);
        if !out.is_empty() {
            sock.write_all(&out).map_err(Error::io("send handshake"))?;
            out.clear();
        }
        if let ClientOutcome::Done(d) = outcome {
            if !inbuf.is_empty() {
                return Err(Error::Protocol("server sent bytes past the handshake"));
            }
            return Ok(d);
        }
        let n = sock.read(&mut chunk).map_err(Error::io("receive handshake"))?;
        if n == 0 {
            return Err(Error::Protocol("server closed during the handshake"));
        }
        if inbuf.len() + n > MAX_REPLY_LEN + 2 * REPLY_HEADER_LEN {
            return Err(Error::Protocol("handshake reply too long"));
        }
        inbuf.extend_from_slice(&chunk[..n]);
    }
}

/// The fuzz entry (`fuzz/fuzz_targets/nbd_client_handshake.rs`): server
/// bytes, cut into socket reads of `1 + data[0] % 64` bytes, fed to the
/// client's state machine. It answers with bytes, finishes or refuses,
/// panicking when a property fails: it never claims more input than it was
/// given, never finishes twice, and what it sends stays small.
pub fn fuzz_server_bytes(data: &[u8]) {
    let Some((&cut, data)) = data.split_first() else { return };
    let piece = usize::from(cut % 64) + 1;
    let Ok(mut hs) = ClientHandshake::new("export") else { return };
    let mut buffered: Vec<u8> = Vec::new();
    let mut out = Vec::new();
    let mut sent = 0usize;
    for chunk in data.chunks(piece) {
        buffered.extend_from_slice(chunk);
        out.clear();
        match hs.step(&buffered, &mut out) {
            Err(_) => return,
            Ok((used, outcome)) => {
                assert!(used <= buffered.len());
                buffered.drain(..used);
                sent += out.len();
                assert!(sent < 1024, "a client sends two options at most");
                if let ClientOutcome::Done(_) = outcome {
                    out.clear();
                    assert!(hs.step(&buffered, &mut out).is_err(), "finished once");
                    return;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The state machine fed a byte at a time agrees with one fed everything,
    /// and never takes bytes past the handshake.
    #[test]
    fn handshake_state_machine_takes_input_in_any_split() {
        let mut server = Vec::new();
        server.extend_from_slice(&wire::NBDMAGIC.to_be_bytes());
        server.extend_from_slice(&wire::IHAVEOPT.to_be_bytes());
        server.extend_from_slice(&3u16.to_be_bytes());
        let mut info = |payload: &[u8], kind: u32| {
            server.extend_from_slice(&wire::OPTION_REPLY_MAGIC.to_be_bytes());
            server.extend_from_slice(&opt::GO.to_be_bytes());
            server.extend_from_slice(&kind.to_be_bytes());
            server.extend_from_slice(&(payload.len() as u32).to_be_bytes());
            server.extend_from_slice(payload);
        };
        let mut export = vec![0, 0];
        export.extend_from_slice(&(5u64 << 20).to_be_bytes());
        export.extend_from_slice(&0x0d_u16.to_be_bytes());
        info(&export, rep::INFO);
        info(&[], rep::ACK);
        server.extend_from_slice(b"transmission bytes");
        let mut hs = ClientHandshake::new("x").unwrap();
        let mut out = Vec::new();
        let mut pending = Vec::new();
        let mut taken = 0;
        let mut done = None;
        for &b in &server {
            pending.push(b);
            let (used, o) = hs.step(&pending, &mut out).unwrap();
            taken += used;
            pending.drain(..used);
            if let ClientOutcome::Done(d) = o {
                done = Some(d);
                break;
            }
        }
        let d = done.expect("finished");
        assert_eq!((d.size, d.tx_flags), (5 << 20, 0x0d));
        assert_eq!(taken, server.len() - b"transmission bytes".len());
    }
}
