//! The fixed-newstyle handshake as a pure state machine: bytes in, reply
//! bytes out, and at the end the export and the headers the client chose.
//! The server feeds it whatever the socket gave; it never blocks and never
//! buffers more than one option (`MAX_OPTION_LEN`, 16 KiB).

use super::wire::{self, handshake_flags as hf, info, opt, rep, tx, HeaderStyle};
use super::Error;

/// Largest option payload kept in memory; a larger one is read past and
/// refused with `NBD_REP_ERR_TOO_BIG`. Names are at most 4 KiB by the spec,
/// so this leaves room for a meta-context query list.
pub(crate) const MAX_OPTION_LEN: usize = 16 * 1024;
/// Size of the option header the client sends.
const OPTION_HEADER_LEN: usize = 16;
/// The context id the server hands out for `base:allocation`.
pub(crate) const BASE_ALLOCATION_ID: u32 = 1;

/// What the handshake needs to know about an export.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExportInfo {
    pub size: u64,
    pub read_only: bool,
    pub description: String,
    /// Minimum, preferred and maximum block size.
    pub block_sizes: (u32, u32, u32),
}

/// Where the handshake looks exports up.
pub trait Catalog {
    /// What the server keeps for a chosen export (an `Arc<Export>`).
    type Handle;
    fn find(&self, name: &str) -> Option<(Self::Handle, ExportInfo)>;
    /// Every export's name and description, for NBD_OPT_LIST.
    fn names(&self) -> Vec<(String, String)>;
    /// Takes a connection slot on the export, or says why not (it is full,
    /// or another holder has the volume): the reason goes into the GO
    /// refusal's message. `name` is the name as the client sent it (a
    /// guarded catalog reads the consuming node's name from it).
    fn admit(&self, export: &Self::Handle, name: &str) -> Result<(), String>;
    /// The name the server keeps (and logs) for the name a client sent:
    /// a guarded catalog drops the secret from it.
    fn public_name<'a>(&self, name: &'a str) -> &'a str {
        name
    }
}

/// What the client negotiated, handed to the transmission phase.
#[derive(Debug)]
pub struct Negotiated<H> {
    pub export: H,
    pub name: String,
    pub info: ExportInfo,
    pub style: HeaderStyle,
    /// The id of `base:allocation` when the client selected it.
    pub base_allocation: Option<u32>,
    pub tx_flags: u16,
}

/// Why a handshake ended without a transmission phase.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ending {
    /// The client sent NBD_OPT_ABORT (and got its ACK).
    Aborted,
    /// NBD_OPT_EXPORT_NAME named an export that does not exist or is full:
    /// the protocol has no error reply for it, so the session ends.
    ExportRefused,
}

/// What one call of [`Handshake::step`] produced.
#[derive(Debug)]
pub enum Outcome<H> {
    /// Not enough input for the next message.
    NeedMore,
    /// One option handled; its reply (if any) is in `out`.
    Continue,
    /// The client entered transmission on this export; `out` holds the last
    /// handshake bytes to send.
    Enter(Negotiated<H>),
    /// Send `out`, then close.
    End(Ending),
}

#[derive(Debug)]
enum State {
    ClientFlags,
    OptionHeader,
    /// Reading past an option too large to keep.
    Skipping {
        option: u32,
        remaining: u64,
    },
    Done,
}

/// One connection's negotiation.
#[derive(Debug)]
pub struct Handshake {
    state: State,
    no_zeroes: bool,
    style: HeaderStyle,
    /// Export name and whether `base:allocation` was selected for it.
    meta: Option<(String, bool)>,
}

/// A negotiation that has not started: the greeting is sent, the client's
/// flags are awaited.
impl Default for Handshake {
    fn default() -> Self {
        Self { state: State::ClientFlags, no_zeroes: false, style: HeaderStyle::Simple, meta: None }
    }
}

/// The server's first bytes: NBDMAGIC, IHAVEOPT, handshake flags.
pub(crate) fn greeting() -> [u8; 18] {
    let mut g = [0u8; 18];
    g[..8].copy_from_slice(&wire::NBDMAGIC.to_be_bytes());
    g[8..16].copy_from_slice(&wire::IHAVEOPT.to_be_bytes());
    g[16..].copy_from_slice(&(hf::FIXED_NEWSTYLE | hf::NO_ZEROES).to_be_bytes());
    g
}

/// The transmission flags of an export for a client that negotiated `style`.
/// CAN_MULTI_CONN is honest because every connection to an export shares
/// one open file: a flush on any of them syncs the whole inode.
pub(crate) fn transmission_flags(info: &ExportInfo, style: HeaderStyle) -> u16 {
    let mut f = tx::HAS_FLAGS | tx::SEND_FLUSH | tx::SEND_FUA | tx::SEND_CACHE | tx::CAN_MULTI_CONN;
    if info.read_only {
        f |= tx::READ_ONLY;
    } else {
        f |= tx::SEND_TRIM | tx::SEND_WRITE_ZEROES | tx::SEND_FAST_ZERO;
    }
    if style.structured() {
        f |= tx::SEND_DF;
    }
    f
}

fn option_reply(out: &mut Vec<u8>, option: u32, kind: u32, data: &[u8]) {
    out.extend_from_slice(&wire::OPTION_REPLY_MAGIC.to_be_bytes());
    out.extend_from_slice(&option.to_be_bytes());
    out.extend_from_slice(&kind.to_be_bytes());
    out.extend_from_slice(&(data.len() as u32).to_be_bytes());
    out.extend_from_slice(data);
}

fn option_error(out: &mut Vec<u8>, option: u32, kind: u32, message: &str) {
    option_reply(out, option, kind, message.as_bytes());
}

/// A cursor over an option's payload; every read is bounds-checked.
struct Fields<'a>(&'a [u8]);

impl<'a> Fields<'a> {
    fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        if self.0.len() < n {
            return None;
        }
        let (a, b) = self.0.split_at(n);
        self.0 = b;
        Some(a)
    }
    fn u16(&mut self) -> Option<u16> {
        self.take(2).map(|b| u16::from_be_bytes([b[0], b[1]]))
    }
    fn u32(&mut self) -> Option<u32> {
        self.take(4).map(|b| u32::from_be_bytes([b[0], b[1], b[2], b[3]]))
    }
    /// A string with a 32-bit length prefix, at most 4 KiB, valid UTF-8.
    fn string(&mut self) -> Option<&'a str> {
        let n = self.u32()? as usize;
        if n > 4096 {
            return None;
        }
        std::str::from_utf8(self.take(n)?).ok()
    }
    fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

impl Handshake {
    /// Consumes what it can of `input` and returns how many bytes it used.
    /// Replies are appended to `out`. An error means: close the connection.
    pub fn step<C: Catalog>(&mut self, input: &[u8], catalog: &C, out: &mut Vec<u8>) -> Result<(usize, Outcome<C::Handle>), Error> {
        match self.state {
            State::Done => Err(Error::Protocol("handshake already finished")),
            State::ClientFlags => {
                if input.len() < 4 {
                    return Ok((0, Outcome::NeedMore));
                }
                let flags = u32::from_be_bytes([input[0], input[1], input[2], input[3]]);
                if flags & !(hf::C_FIXED_NEWSTYLE | hf::C_NO_ZEROES) != 0 {
                    return Err(Error::ClientFlags(flags));
                }
                self.no_zeroes = flags & hf::C_NO_ZEROES != 0;
                self.state = State::OptionHeader;
                Ok((4, Outcome::Continue))
            }
            State::Skipping { option, remaining } => {
                let n = (input.len() as u64).min(remaining);
                let left = remaining - n;
                if left > 0 {
                    self.state = State::Skipping { option, remaining: left };
                    return Ok((n as usize, if n == 0 { Outcome::NeedMore } else { Outcome::Continue }));
                }
                self.state = State::OptionHeader;
                option_error(out, option, rep::ERR_TOO_BIG, "option data too large");
                Ok((n as usize, Outcome::Continue))
            }
            State::OptionHeader => {
                if input.len() < OPTION_HEADER_LEN {
                    return Ok((0, Outcome::NeedMore));
                }
                let mut f = Fields(&input[..OPTION_HEADER_LEN]);
                let magic = u64::from(f.u32().unwrap_or(0)) << 32 | u64::from(f.u32().unwrap_or(0));
                if magic != wire::IHAVEOPT {
                    return Err(Error::OptionMagic(magic));
                }
                let option = f.u32().unwrap_or(0);
                let len = f.u32().unwrap_or(0) as usize;
                if len > MAX_OPTION_LEN {
                    if option == opt::EXPORT_NAME {
                        return Err(Error::Protocol("NBD_OPT_EXPORT_NAME with an oversized name"));
                    }
                    self.state = State::Skipping { option, remaining: len as u64 };
                    return Ok((OPTION_HEADER_LEN, Outcome::Continue));
                }
                let total = OPTION_HEADER_LEN + len;
                if input.len() < total {
                    return Ok((0, Outcome::NeedMore));
                }
                let outcome = self.option(option, &input[OPTION_HEADER_LEN..total], catalog, out);
                if !matches!(outcome, Outcome::Continue) {
                    self.state = State::Done;
                }
                Ok((total, outcome))
            }
        }
    }

    fn option<C: Catalog>(&mut self, option: u32, data: &[u8], catalog: &C, out: &mut Vec<u8>) -> Outcome<C::Handle> {
        match option {
            opt::EXPORT_NAME => self.export_name(data, catalog, out),
            opt::ABORT => {
                option_reply(out, option, rep::ACK, &[]);
                Outcome::End(Ending::Aborted)
            }
            opt::LIST => {
                if !data.is_empty() {
                    option_error(out, option, rep::ERR_INVALID, "NBD_OPT_LIST takes no data");
                } else {
                    for (name, description) in catalog.names() {
                        // The rest of an NBD_REP_SERVER after the name is for humans.
                        let mut d = Vec::with_capacity(4 + name.len() + description.len());
                        d.extend_from_slice(&(name.len() as u32).to_be_bytes());
                        d.extend_from_slice(name.as_bytes());
                        d.extend_from_slice(&description.as_bytes()[..description.len().min(4096)]);
                        option_reply(out, option, rep::SERVER, &d);
                    }
                    option_reply(out, option, rep::ACK, &[]);
                }
                Outcome::Continue
            }
            opt::STARTTLS => {
                option_error(out, option, rep::ERR_POLICY, "TLS is not offered: serve on a unix socket or a trusted network");
                Outcome::Continue
            }
            opt::INFO | opt::GO => self.info_or_go(option, data, catalog, out),
            opt::STRUCTURED_REPLY | opt::EXTENDED_HEADERS => {
                let wanted = if option == opt::EXTENDED_HEADERS { HeaderStyle::Extended } else { HeaderStyle::Structured };
                if !data.is_empty() {
                    option_error(out, option, rep::ERR_INVALID, "option takes no data");
                } else if self.style == HeaderStyle::Extended && wanted == HeaderStyle::Structured {
                    option_error(out, option, rep::ERR_EXT_HEADER_REQD, "extended headers already negotiated");
                } else if self.style == wanted {
                    option_error(out, option, rep::ERR_INVALID, "already negotiated");
                } else {
                    self.style = wanted;
                    option_reply(out, option, rep::ACK, &[]);
                }
                Outcome::Continue
            }
            opt::LIST_META_CONTEXT | opt::SET_META_CONTEXT => {
                self.meta_context(option, data, catalog, out);
                Outcome::Continue
            }
            _ => {
                option_error(out, option, rep::ERR_UNSUP, "unknown option");
                Outcome::Continue
            }
        }
    }

    fn export_name<C: Catalog>(&mut self, data: &[u8], catalog: &C, out: &mut Vec<u8>) -> Outcome<C::Handle> {
        let Ok(name) = std::str::from_utf8(data) else {
            return Outcome::End(Ending::ExportRefused);
        };
        let Some((handle, info)) = catalog.find(name) else {
            return Outcome::End(Ending::ExportRefused);
        };
        if catalog.admit(&handle, name).is_err() {
            return Outcome::End(Ending::ExportRefused);
        }
        let tx_flags = transmission_flags(&info, self.style);
        out.extend_from_slice(&info.size.to_be_bytes());
        out.extend_from_slice(&tx_flags.to_be_bytes());
        if !self.no_zeroes {
            out.extend_from_slice(&[0u8; 124]);
        }
        Outcome::Enter(self.negotiated(handle, name, catalog.public_name(name), info, tx_flags))
    }

    /// `name` as the client sent it (what SET_META_CONTEXT named), `public`
    /// what the server keeps.
    fn negotiated<H>(&self, export: H, name: &str, public: &str, info: ExportInfo, tx_flags: u16) -> Negotiated<H> {
        let base_allocation = match &self.meta {
            Some((meta_export, true)) if meta_export == name => Some(BASE_ALLOCATION_ID),
            _ => None,
        };
        Negotiated { export, name: public.to_string(), info, style: self.style, base_allocation, tx_flags }
    }

    fn info_or_go<C: Catalog>(&mut self, option: u32, data: &[u8], catalog: &C, out: &mut Vec<u8>) -> Outcome<C::Handle> {
        let mut f = Fields(data);
        let parsed = (|| {
            let name = f.string()?;
            let count = f.u16()?;
            let mut wants = Vec::with_capacity(usize::from(count).min(16));
            for _ in 0..count {
                wants.push(f.u16()?);
            }
            f.is_empty().then_some((name, wants))
        })();
        let Some((name, wants)) = parsed else {
            option_error(out, option, rep::ERR_INVALID, "malformed NBD_OPT_INFO/GO data");
            return Outcome::Continue;
        };
        let Some((handle, info)) = catalog.find(name) else {
            option_error(out, option, rep::ERR_UNKNOWN, &format!("no export named {name:?}"));
            return Outcome::Continue;
        };
        if option == opt::GO {
            if let Err(why) = catalog.admit(&handle, name) {
                option_error(out, option, rep::ERR_POLICY, &format!("export {:?}: {why}", catalog.public_name(name)));
                return Outcome::Continue;
            }
        }
        let tx_flags = transmission_flags(&info, self.style);
        let mut item = Vec::with_capacity(14);
        item.extend_from_slice(&info::EXPORT.to_be_bytes());
        item.extend_from_slice(&info.size.to_be_bytes());
        item.extend_from_slice(&tx_flags.to_be_bytes());
        option_reply(out, option, rep::INFO, &item);
        if wants.contains(&info::NAME) {
            let mut item = info::NAME.to_be_bytes().to_vec();
            item.extend_from_slice(name.as_bytes());
            option_reply(out, option, rep::INFO, &item);
        }
        if wants.contains(&info::DESCRIPTION) && !info.description.is_empty() {
            let mut item = info::DESCRIPTION.to_be_bytes().to_vec();
            item.extend_from_slice(&info.description.as_bytes()[..info.description.len().min(4096)]);
            option_reply(out, option, rep::INFO, &item);
        }
        // Block sizes go out whether asked for or not: they are harmless to a
        // client that ignores them and the minimum is 1, so nothing is refused.
        let (min, pref, max) = info.block_sizes;
        let mut item = info::BLOCK_SIZE.to_be_bytes().to_vec();
        for v in [min, pref, max] {
            item.extend_from_slice(&v.to_be_bytes());
        }
        option_reply(out, option, rep::INFO, &item);
        if option == opt::INFO {
            option_reply(out, option, rep::ACK, &[]);
            return Outcome::Continue;
        }
        option_reply(out, option, rep::ACK, &[]);
        Outcome::Enter(self.negotiated(handle, name, catalog.public_name(name), info, tx_flags))
    }

    fn meta_context<C: Catalog>(&mut self, option: u32, data: &[u8], catalog: &C, out: &mut Vec<u8>) {
        if !self.style.structured() {
            option_error(out, option, rep::ERR_INVALID, "meta contexts need structured replies first");
            return;
        }
        let mut f = Fields(data);
        let parsed = (|| {
            let name = f.string()?;
            let count = f.u32()?;
            // Each query takes at least its 4-byte length: bound the loop by the data.
            if count as usize > data.len() / 4 {
                return None;
            }
            let mut matched = false;
            let mut any_query = false;
            for _ in 0..count {
                let q = f.string()?;
                any_query = true;
                matched |= q == wire::BASE_ALLOCATION || (option == opt::LIST_META_CONTEXT && q == "base:");
            }
            f.is_empty().then_some((name, matched || (!any_query && option == opt::LIST_META_CONTEXT)))
        })();
        let Some((name, selected)) = parsed else {
            option_error(out, option, rep::ERR_INVALID, "malformed meta context request");
            return;
        };
        if catalog.find(name).is_none() {
            option_error(out, option, rep::ERR_UNKNOWN, &format!("no export named {name:?}"));
            return;
        }
        if selected {
            let id = if option == opt::SET_META_CONTEXT { BASE_ALLOCATION_ID } else { 0 };
            let mut item = id.to_be_bytes().to_vec();
            item.extend_from_slice(wire::BASE_ALLOCATION.as_bytes());
            option_reply(out, option, rep::META_CONTEXT, &item);
        }
        if option == opt::SET_META_CONTEXT {
            self.meta = Some((name.to_string(), selected));
        }
        option_reply(out, option, rep::ACK, &[]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::Cell;

    struct One {
        full: Cell<bool>,
    }

    impl Catalog for One {
        type Handle = ();
        fn find(&self, name: &str) -> Option<((), ExportInfo)> {
            (name == "disk")
                .then(|| ((), ExportInfo { size: 1 << 20, read_only: false, description: "d".into(), block_sizes: (1, 4096, 1 << 25) }))
        }
        fn names(&self) -> Vec<(String, String)> {
            vec![("disk".into(), "d".into())]
        }
        fn admit(&self, _: &(), _: &str) -> Result<(), String> {
            if self.full.get() {
                Err("full".into())
            } else {
                Ok(())
            }
        }
    }

    fn option(code: u32, data: &[u8]) -> Vec<u8> {
        let mut b = wire::IHAVEOPT.to_be_bytes().to_vec();
        b.extend_from_slice(&code.to_be_bytes());
        b.extend_from_slice(&(data.len() as u32).to_be_bytes());
        b.extend_from_slice(data);
        b
    }

    fn go_data(name: &str) -> Vec<u8> {
        let mut d = (name.len() as u32).to_be_bytes().to_vec();
        d.extend_from_slice(name.as_bytes());
        d.extend_from_slice(&0u16.to_be_bytes());
        d
    }

    /// Runs the whole input through, returning replies and the last outcome.
    fn run(hs: &mut Handshake, cat: &One, input: &[u8]) -> (Vec<u8>, Outcome<()>) {
        let mut out = Vec::new();
        let mut pos = 0;
        loop {
            let (used, outcome) = hs.step(&input[pos..], cat, &mut out).unwrap();
            pos += used;
            match outcome {
                Outcome::Continue => continue,
                other => return (out, other),
            }
        }
    }

    fn reply_types(out: &[u8]) -> Vec<u32> {
        let mut types = Vec::new();
        let mut p = 0;
        while p + 20 <= out.len() {
            types.push(u32::from_be_bytes(out[p + 12..p + 16].try_into().unwrap()));
            let len = u32::from_be_bytes(out[p + 16..p + 20].try_into().unwrap()) as usize;
            p += 20 + len;
        }
        types
    }

    #[test]
    fn go_enters_transmission_with_the_chosen_headers() {
        let cat = One { full: Cell::new(false) };
        let mut hs = Handshake::default();
        let mut input = 3u32.to_be_bytes().to_vec();
        input.extend(option(opt::EXTENDED_HEADERS, &[]));
        let mut set = go_data("disk");
        set.truncate(4 + 4);
        set.extend_from_slice(&1u32.to_be_bytes());
        set.extend_from_slice(&(wire::BASE_ALLOCATION.len() as u32).to_be_bytes());
        set.extend_from_slice(wire::BASE_ALLOCATION.as_bytes());
        input.extend(option(opt::SET_META_CONTEXT, &set));
        input.extend(option(opt::GO, &go_data("disk")));
        let (out, outcome) = run(&mut hs, &cat, &input);
        let Outcome::Enter(n) = outcome else { panic!("{outcome:?}") };
        assert_eq!(n.style, HeaderStyle::Extended);
        assert_eq!(n.base_allocation, Some(BASE_ALLOCATION_ID));
        assert_eq!(reply_types(&out), [rep::ACK, rep::META_CONTEXT, rep::ACK, rep::INFO, rep::INFO, rep::ACK]);
    }

    #[test]
    fn unknown_export_and_unknown_option_get_errors_not_a_hang() {
        let cat = One { full: Cell::new(false) };
        let mut hs = Handshake::default();
        let mut input = 1u32.to_be_bytes().to_vec();
        input.extend(option(opt::GO, &go_data("nope")));
        input.extend(option(99, b"x"));
        input.extend(option(opt::STARTTLS, &[]));
        input.extend(option(opt::ABORT, &[]));
        let (out, outcome) = run(&mut hs, &cat, &input);
        assert!(matches!(outcome, Outcome::End(Ending::Aborted)));
        assert_eq!(reply_types(&out), [rep::ERR_UNKNOWN, rep::ERR_UNSUP, rep::ERR_POLICY, rep::ACK]);
    }

    #[test]
    fn a_full_export_refuses_go_with_policy() {
        let cat = One { full: Cell::new(true) };
        let mut hs = Handshake::default();
        let mut input = 1u32.to_be_bytes().to_vec();
        input.extend(option(opt::GO, &go_data("disk")));
        input.extend(option(opt::ABORT, &[]));
        let (out, _) = run(&mut hs, &cat, &input);
        assert_eq!(reply_types(&out), [rep::ERR_POLICY, rep::ACK]);
    }

    #[test]
    fn oversized_option_is_skipped_without_buffering() {
        let cat = One { full: Cell::new(false) };
        let mut hs = Handshake::default();
        let mut out = Vec::new();
        assert!(matches!(hs.step(&1u32.to_be_bytes(), &cat, &mut out).unwrap(), (4, Outcome::Continue)));
        let mut hdr = wire::IHAVEOPT.to_be_bytes().to_vec();
        hdr.extend_from_slice(&opt::LIST.to_be_bytes());
        hdr.extend_from_slice(&(1u32 << 30).to_be_bytes());
        assert!(matches!(hs.step(&hdr, &cat, &mut out).unwrap(), (16, Outcome::Continue)));
        let chunk = vec![0u8; 1 << 16];
        let mut left = 1u64 << 30;
        while left > 0 {
            let (used, _) = hs.step(&chunk, &cat, &mut out).unwrap();
            left -= used as u64;
        }
        assert_eq!(reply_types(&out), [rep::ERR_TOO_BIG]);
    }

    #[test]
    fn export_name_without_zeroes_and_bad_flags() {
        let cat = One { full: Cell::new(false) };
        let mut hs = Handshake::default();
        let mut input = 3u32.to_be_bytes().to_vec();
        input.extend(option(opt::EXPORT_NAME, b"disk"));
        let (out, outcome) = run(&mut hs, &cat, &input);
        assert!(matches!(outcome, Outcome::Enter(_)));
        assert_eq!(out.len(), 10);
        let mut hs = Handshake::default();
        assert!(hs.step(&0x80u32.to_be_bytes(), &cat, &mut Vec::new()).is_err());
        let mut hs = Handshake::default();
        let mut input = 1u32.to_be_bytes().to_vec();
        input.extend(option(opt::EXPORT_NAME, b"nope"));
        assert!(matches!(run(&mut hs, &cat, &input).1, Outcome::End(Ending::ExportRefused)));
    }
}
