//! Generic netlink messages as pure code over bytes: the netlink and genl
//! headers, attribute framing (nested attributes included), the controller's
//! family lookup and the nbd family's commands and replies.
//!
//! Written by hand rather than through a netlink crate: the nbd family needs
//! a dozen attributes, and every byte the kernel sends back is parsed here
//! with bounds checks (fuzzed as `nbd_netlink`).

/// A netlink message the kernel sent that does not parse: the one error of
/// this pure layer (the nbd attach code wraps it in its own).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("malformed netlink message: {0}")]
pub(crate) struct Malformed(pub(crate) &'static str);

/// `struct nlmsghdr` and `struct genlmsghdr`.
pub(crate) const NLMSG_HDRLEN: usize = 16;
pub(crate) const GENL_HDRLEN: usize = 4;
/// Message types and flags (linux/netlink.h).
pub(crate) const NLMSG_ERROR: u16 = 2;
pub(crate) const NLMSG_DONE: u16 = 3;
pub(crate) const NLM_F_REQUEST: u16 = 1;
pub(crate) const NLM_F_ACK: u16 = 4;
/// Attribute type bits (linux/netlink.h).
const NLA_F_NESTED: u16 = 1 << 15;
const NLA_TYPE_MASK: u16 = !(1 << 15 | 1 << 14);

/// The generic netlink controller (linux/genetlink.h).
pub(crate) const GENL_ID_CTRL: u16 = 0x10;
pub(crate) const CTRL_CMD_GETFAMILY: u8 = 3;
pub(crate) const CTRL_ATTR_FAMILY_ID: u16 = 1;
pub(crate) const CTRL_ATTR_FAMILY_NAME: u16 = 2;
pub(crate) const CTRL_ATTR_MCAST_GROUPS: u16 = 7;
pub(crate) const CTRL_ATTR_MCAST_GRP_NAME: u16 = 1;
pub(crate) const CTRL_ATTR_MCAST_GRP_ID: u16 = 2;

/// The nbd family's name, to resolve its id with.
pub(crate) const NBD_FAMILY: &str = "nbd";
/// The nbd family's multicast group (LINK_DEAD notices).
pub(crate) const NBD_MCAST_GROUP: &str = "nbd_mc_group";

/// The nbd family's commands (linux/nbd-netlink.h `enum nbd_commands`):
/// one type, so a request cannot carry a number that is no command.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub(crate) enum NbdCmd {
    Connect = 1,
    Disconnect = 2,
    Reconfigure = 3,
    LinkDead = 4,
    Status = 5,
}

/// The nbd family's attribute layout (linux/nbd-netlink.h): the values of
/// `enum nbd_attrs`, the socket and device list items. Private: only the
/// encoder and parsers below read or write it.
mod nbd {
    pub(crate) const VERSION: u8 = 1;

    pub(crate) const ATTR_INDEX: u16 = 1;
    pub(crate) const ATTR_SIZE_BYTES: u16 = 2;
    pub(crate) const ATTR_BLOCK_SIZE_BYTES: u16 = 3;
    pub(crate) const ATTR_TIMEOUT: u16 = 4;
    pub(crate) const ATTR_SERVER_FLAGS: u16 = 5;
    pub(crate) const ATTR_CLIENT_FLAGS: u16 = 6;
    pub(crate) const ATTR_SOCKETS: u16 = 7;
    pub(crate) const ATTR_DEAD_CONN_TIMEOUT: u16 = 8;
    pub(crate) const ATTR_DEVICE_LIST: u16 = 9;
    pub(crate) const ATTR_BACKEND_IDENTIFIER: u16 = 10;

    pub(crate) const SOCK_ITEM: u16 = 1;
    pub(crate) const SOCK_FD: u16 = 1;
    pub(crate) const DEVICE_ITEM: u16 = 1;
    pub(crate) const DEVICE_INDEX: u16 = 1;
    pub(crate) const DEVICE_CONNECTED: u16 = 2;

    /// A client flag (linux/nbd.h) the unit tests set.
    #[cfg(test)]
    pub(crate) const CFLAG_DISCONNECT_ON_CLOSE: u64 = 1 << 1;
}

fn align4(n: usize) -> usize {
    (n + 3) & !3
}

/// Builds one request: headers first, attributes appended, lengths patched
/// in by [`Builder::finish`].
pub(crate) struct Builder {
    buf: Vec<u8>,
    /// Start offsets of nests not closed yet.
    open: Vec<usize>,
}

impl Builder {
    /// A genl request of `family`'s `cmd`; the sequence number is set by
    /// [`Builder::finish`].
    pub(crate) fn new(family: u16, flags: u16, cmd: u8, version: u8) -> Self {
        let mut buf = Vec::with_capacity(128);
        buf.extend_from_slice(&0u32.to_ne_bytes());
        buf.extend_from_slice(&family.to_ne_bytes());
        buf.extend_from_slice(&flags.to_ne_bytes());
        buf.extend_from_slice(&0u32.to_ne_bytes()); // seq
        buf.extend_from_slice(&0u32.to_ne_bytes()); // port: the kernel fills it
        buf.extend_from_slice(&[cmd, version, 0, 0]);
        Builder { buf, open: Vec::new() }
    }

    pub(crate) fn put(&mut self, kind: u16, payload: &[u8]) -> &mut Self {
        let len = 4 + payload.len();
        self.buf.extend_from_slice(&(len as u16).to_ne_bytes());
        self.buf.extend_from_slice(&kind.to_ne_bytes());
        self.buf.extend_from_slice(payload);
        self.buf.resize(align4(self.buf.len()), 0);
        self
    }

    /// The unit tests encode replies the kernel sends with these.
    #[cfg(test)]
    fn u8(&mut self, kind: u16, v: u8) -> &mut Self {
        self.put(kind, &[v])
    }
    #[cfg(test)]
    fn u16(&mut self, kind: u16, v: u16) -> &mut Self {
        self.put(kind, &v.to_ne_bytes())
    }
    pub(crate) fn u32(&mut self, kind: u16, v: u32) -> &mut Self {
        self.put(kind, &v.to_ne_bytes())
    }
    pub(crate) fn u64(&mut self, kind: u16, v: u64) -> &mut Self {
        self.put(kind, &v.to_ne_bytes())
    }
    /// A NUL-terminated string, as the kernel's NLA_STRING/NLA_NUL_STRING want.
    pub(crate) fn string(&mut self, kind: u16, s: &str) -> &mut Self {
        let mut v = Vec::with_capacity(s.len() + 1);
        v.extend_from_slice(s.as_bytes());
        v.push(0);
        self.put(kind, &v)
    }

    pub(crate) fn begin_nest(&mut self, kind: u16) -> &mut Self {
        self.open.push(self.buf.len());
        self.buf.extend_from_slice(&0u16.to_ne_bytes());
        self.buf.extend_from_slice(&(kind | NLA_F_NESTED).to_ne_bytes());
        self
    }

    pub(crate) fn end_nest(&mut self) -> &mut Self {
        let start = self.open.pop().expect("end_nest without begin_nest");
        let len = (self.buf.len() - start) as u16;
        self.buf[start..start + 2].copy_from_slice(&len.to_ne_bytes());
        self
    }

    /// The message with its length and sequence number.
    pub(crate) fn finish(mut self, seq: u32) -> Vec<u8> {
        assert!(self.open.is_empty(), "unclosed nest");
        let len = self.buf.len() as u32;
        self.buf[0..4].copy_from_slice(&len.to_ne_bytes());
        self.buf[8..12].copy_from_slice(&seq.to_ne_bytes());
        self.buf
    }
}

/// One netlink message out of a datagram.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Message<'a> {
    pub(crate) kind: u16,
    pub(crate) flags: u16,
    pub(crate) seq: u32,
    pub(crate) port: u32,
    /// Everything after the netlink header.
    pub(crate) payload: &'a [u8],
}

/// Splits a datagram into its messages.
pub(crate) fn messages(mut buf: &[u8]) -> impl Iterator<Item = Result<Message<'_>, Malformed>> {
    std::iter::from_fn(move || {
        if buf.is_empty() {
            return None;
        }
        if buf.len() < NLMSG_HDRLEN {
            buf = &[];
            return Some(Err(Malformed("short netlink header")));
        }
        let len = u32::from_ne_bytes(buf[0..4].try_into().unwrap()) as usize;
        if len < NLMSG_HDRLEN || len > buf.len() {
            buf = &[];
            return Some(Err(Malformed("netlink length out of bounds")));
        }
        let m = Message {
            kind: u16::from_ne_bytes(buf[4..6].try_into().unwrap()),
            flags: u16::from_ne_bytes(buf[6..8].try_into().unwrap()),
            seq: u32::from_ne_bytes(buf[8..12].try_into().unwrap()),
            port: u32::from_ne_bytes(buf[12..16].try_into().unwrap()),
            payload: &buf[NLMSG_HDRLEN..len],
        };
        buf = &buf[align4(len).min(buf.len())..];
        Some(Ok(m))
    })
}

/// The errno of an NLMSG_ERROR message (0 is an ack).
pub(crate) fn error_code(payload: &[u8]) -> Result<i32, Malformed> {
    let b = payload.get(0..4).ok_or(Malformed("short error message"))?;
    Ok(i32::from_ne_bytes(b.try_into().unwrap()))
}

/// A genl message: its command and attributes.
pub(crate) fn genl(payload: &[u8]) -> Result<(u8, &[u8]), Malformed> {
    if payload.len() < GENL_HDRLEN {
        return Err(Malformed("short genl header"));
    }
    Ok((payload[0], &payload[GENL_HDRLEN..]))
}

/// One attribute: its type (flag bits removed) and payload.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Attr<'a> {
    pub(crate) kind: u16,
    pub(crate) data: &'a [u8],
}

impl<'a> Attr<'a> {
    pub(crate) fn u8(&self) -> Result<u8, Malformed> {
        self.data.first().copied().ok_or(Malformed("short u8 attribute"))
    }
    pub(crate) fn u16(&self) -> Result<u16, Malformed> {
        let b = self.data.get(0..2).ok_or(Malformed("short u16 attribute"))?;
        Ok(u16::from_ne_bytes(b.try_into().unwrap()))
    }
    pub(crate) fn u32(&self) -> Result<u32, Malformed> {
        let b = self.data.get(0..4).ok_or(Malformed("short u32 attribute"))?;
        Ok(u32::from_ne_bytes(b.try_into().unwrap()))
    }
    pub(crate) fn u64(&self) -> Result<u64, Malformed> {
        let b = self.data.get(0..8).ok_or(Malformed("short u64 attribute"))?;
        Ok(u64::from_ne_bytes(b.try_into().unwrap()))
    }
    /// A string without its terminating NUL (and anything after one).
    pub(crate) fn str(&self) -> Result<&'a str, Malformed> {
        let end = self.data.iter().position(|&b| b == 0).unwrap_or(self.data.len());
        std::str::from_utf8(&self.data[..end]).map_err(|_| Malformed("attribute string is not UTF-8"))
    }
    pub(crate) fn nested(&self) -> impl Iterator<Item = Result<Attr<'a>, Malformed>> {
        attrs(self.data)
    }
}

/// The attributes in `buf`, in order.
pub(crate) fn attrs(mut buf: &[u8]) -> impl Iterator<Item = Result<Attr<'_>, Malformed>> {
    std::iter::from_fn(move || {
        if buf.len() < 4 {
            // Trailing padding shorter than a header is ignored.
            return None;
        }
        let len = u16::from_ne_bytes(buf[0..2].try_into().unwrap()) as usize;
        let kind = u16::from_ne_bytes(buf[2..4].try_into().unwrap()) & NLA_TYPE_MASK;
        if len < 4 || len > buf.len() {
            buf = &[];
            return Some(Err(Malformed("attribute length out of bounds")));
        }
        let a = Attr { kind, data: &buf[4..len] };
        buf = &buf[align4(len).min(buf.len())..];
        Some(Ok(a))
    })
}

/// What CTRL_CMD_GETFAMILY answers.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub(crate) struct Family {
    pub(crate) id: u16,
    pub(crate) name: String,
    /// Multicast groups by name.
    pub(crate) groups: Vec<(String, u32)>,
}

pub(crate) fn get_family_request(name: &str, seq: u32) -> Vec<u8> {
    let mut b = Builder::new(GENL_ID_CTRL, NLM_F_REQUEST | NLM_F_ACK, CTRL_CMD_GETFAMILY, 1);
    b.string(CTRL_ATTR_FAMILY_NAME, name);
    b.finish(seq)
}

/// Parses the controller's family reply (the genl payload's attributes).
pub(crate) fn parse_family(attributes: &[u8]) -> Result<Family, Malformed> {
    let mut f = Family::default();
    let mut have_id = false;
    for a in attrs(attributes) {
        let a = a?;
        match a.kind {
            CTRL_ATTR_FAMILY_ID => {
                f.id = a.u16()?;
                have_id = true;
            }
            CTRL_ATTR_FAMILY_NAME => f.name = a.str()?.to_string(),
            CTRL_ATTR_MCAST_GROUPS => {
                for g in a.nested() {
                    let (mut name, mut id) = (None, None);
                    for ga in g?.nested() {
                        let ga = ga?;
                        match ga.kind {
                            CTRL_ATTR_MCAST_GRP_NAME => name = Some(ga.str()?.to_string()),
                            CTRL_ATTR_MCAST_GRP_ID => id = Some(ga.u32()?),
                            _ => {}
                        }
                    }
                    if let (Some(n), Some(i)) = (name, id) {
                        f.groups.push((n, i));
                    }
                }
            }
            _ => {}
        }
    }
    if !have_id {
        return Err(Malformed("family reply without an id"));
    }
    Ok(f)
}

/// NBD_CMD_CONNECT / NBD_CMD_RECONFIGURE attributes. `None` fields are not
/// sent (the kernel keeps what it has on reconfigure).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct NbdConfig {
    pub index: Option<u32>,
    pub size_bytes: Option<u64>,
    pub block_size: Option<u64>,
    /// Seconds.
    pub timeout: Option<u64>,
    pub server_flags: Option<u64>,
    pub client_flags: Option<u64>,
    /// Seconds.
    pub dead_conn_timeout: Option<u64>,
    pub backend_id: Option<String>,
    /// Socket descriptors, already negotiated to the transmission phase.
    pub sockets: Vec<i32>,
}

/// One request of the nbd family: CONNECT and RECONFIGURE send the whole
/// config; DISCONNECT and STATUS only its `index` (STATUS without one asks
/// for every device).
pub(crate) fn nbd_request(family: u16, cmd: NbdCmd, c: &NbdConfig, seq: u32) -> Vec<u8> {
    let mut b = Builder::new(family, NLM_F_REQUEST | NLM_F_ACK, cmd as u8, nbd::VERSION);
    if let Some(v) = c.index {
        b.u32(nbd::ATTR_INDEX, v);
    }
    for (kind, v) in [
        (nbd::ATTR_SIZE_BYTES, c.size_bytes),
        (nbd::ATTR_BLOCK_SIZE_BYTES, c.block_size),
        (nbd::ATTR_TIMEOUT, c.timeout),
        (nbd::ATTR_SERVER_FLAGS, c.server_flags),
        (nbd::ATTR_CLIENT_FLAGS, c.client_flags),
        (nbd::ATTR_DEAD_CONN_TIMEOUT, c.dead_conn_timeout),
    ] {
        if let Some(v) = v {
            b.u64(kind, v);
        }
    }
    if let Some(id) = &c.backend_id {
        b.string(nbd::ATTR_BACKEND_IDENTIFIER, id);
    }
    if !c.sockets.is_empty() {
        b.begin_nest(nbd::ATTR_SOCKETS);
        for &fd in &c.sockets {
            b.begin_nest(nbd::SOCK_ITEM).u32(nbd::SOCK_FD, fd as u32).end_nest();
        }
        b.end_nest();
    }
    b.finish(seq)
}

/// The pure decoding of an [`NbdConfig`] (the kernel's view of a request);
/// what the fuzzer and the round-trip tests check the encoder against.
fn parse_nbd_config(attributes: &[u8]) -> Result<NbdConfig, Malformed> {
    let mut c = NbdConfig::default();
    for a in attrs(attributes) {
        let a = a?;
        match a.kind {
            nbd::ATTR_INDEX => c.index = Some(a.u32()?),
            nbd::ATTR_SIZE_BYTES => c.size_bytes = Some(a.u64()?),
            nbd::ATTR_BLOCK_SIZE_BYTES => c.block_size = Some(a.u64()?),
            nbd::ATTR_TIMEOUT => c.timeout = Some(a.u64()?),
            nbd::ATTR_SERVER_FLAGS => c.server_flags = Some(a.u64()?),
            nbd::ATTR_CLIENT_FLAGS => c.client_flags = Some(a.u64()?),
            nbd::ATTR_DEAD_CONN_TIMEOUT => c.dead_conn_timeout = Some(a.u64()?),
            nbd::ATTR_BACKEND_IDENTIFIER => c.backend_id = Some(a.str()?.to_string()),
            nbd::ATTR_SOCKETS => {
                for item in a.nested() {
                    let item = item?;
                    if item.kind != nbd::SOCK_ITEM {
                        return Err(Malformed("socket list entry is not a SOCK_ITEM"));
                    }
                    for s in item.nested() {
                        let s = s?;
                        if s.kind == nbd::SOCK_FD {
                            c.sockets.push(s.u32()? as i32);
                        }
                    }
                }
            }
            _ => {}
        }
    }
    Ok(c)
}

/// The device index in a CONNECT reply or a LINK_DEAD notice.
fn parse_index(attributes: &[u8]) -> Result<u32, Malformed> {
    for a in attrs(attributes) {
        let a = a?;
        if a.kind == nbd::ATTR_INDEX {
            return a.u32();
        }
    }
    Err(Malformed("no NBD_ATTR_INDEX"))
}

/// One device in a STATUS reply.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct DeviceStatus {
    pub index: u32,
    pub connected: bool,
}

fn parse_status(attributes: &[u8]) -> Result<Vec<DeviceStatus>, Malformed> {
    let mut out = Vec::new();
    for a in attrs(attributes) {
        let a = a?;
        if a.kind != nbd::ATTR_DEVICE_LIST {
            continue;
        }
        for item in a.nested() {
            let item = item?;
            if item.kind != nbd::DEVICE_ITEM {
                continue;
            }
            let (mut index, mut connected) = (None, false);
            for d in item.nested() {
                let d = d?;
                match d.kind {
                    nbd::DEVICE_INDEX => index = Some(d.u32()?),
                    nbd::DEVICE_CONNECTED => connected = d.u8()? != 0,
                    _ => {}
                }
            }
            let index = index.ok_or(Malformed("device item without an index"))?;
            out.push(DeviceStatus { index, connected });
        }
    }
    Ok(out)
}

/// The kernel's view of a request [`nbd_request`] built: the command and
/// config of the first message in `msg`. The encoder's oracle (the round
/// trip tests and the fuzzer decode what it wrote).
pub(crate) fn parse_nbd_request(msg: &[u8]) -> Result<(u8, NbdConfig), Malformed> {
    let m = messages(msg).next().ok_or(Malformed("no netlink message"))??;
    let (cmd, attributes) = genl(m.payload)?;
    Ok((cmd, parse_nbd_config(attributes)?))
}

/// The device index of a CONNECT reply (a reply payload, as
/// [`GenlSocket::transact`](crate::genetlink::GenlSocket::transact) returns it).
pub(crate) fn parse_connect_reply(payload: &[u8]) -> Result<u32, Malformed> {
    parse_index(genl(payload)?.1)
}

/// The devices of one STATUS reply payload.
pub(crate) fn parse_status_reply(payload: &[u8]) -> Result<Vec<DeviceStatus>, Malformed> {
    parse_status(genl(payload)?.1)
}

/// The device a LINK_DEAD notice names, if the datagram holds one (acks,
/// errors and other commands: `None`).
pub(crate) fn parse_link_dead(dgram: &[u8]) -> Result<Option<u32>, Malformed> {
    for m in messages(dgram) {
        let m = m?;
        if m.kind == NLMSG_ERROR || m.kind == NLMSG_DONE {
            continue;
        }
        let (cmd, attributes) = genl(m.payload)?;
        if cmd == NbdCmd::LinkDead as u8 {
            return parse_index(attributes).map(Some);
        }
    }
    Ok(None)
}

/// The `nbd_netlink` fuzz target's entry: every parser of this module on
/// arbitrary bytes, each of which answers or refuses. It panics only when a
/// config that decodes does not re-encode to one that decodes the same,
/// which is what the fuzzer looks for.
pub fn fuzz_nbd_netlink(data: &[u8]) {
    let _ = parse_link_dead(data);
    for m in messages(data).take(64) {
        let Ok(m) = m else { break };
        assert!(m.payload.len() <= data.len());
        let _ = error_code(m.payload);
        let Ok((_, attributes)) = genl(m.payload) else { continue };
        let _ = parse_family(attributes);
        let _ = parse_status(attributes);
        let _ = parse_index(attributes);
        for a in attrs(attributes).take(256) {
            let Ok(a) = a else { break };
            let _ = (a.u8(), a.u16(), a.u32(), a.u64(), a.str());
            for n in a.nested().take(256) {
                if n.is_err() {
                    break;
                }
            }
        }
        if let Ok(c) = parse_nbd_config(attributes) {
            // Strings cut at a NUL or of invalid UTF-8 do not round-trip by
            // design; the rest must.
            if c.backend_id.as_deref().is_none_or(|s| !s.contains('\0')) && c.sockets.len() < 1000 {
                let again = nbd_request(1, NbdCmd::Connect, &c, 1);
                let (_, back) = parse_nbd_request(&again).expect("re-decodes");
                assert_eq!(back, c);
            }
        }
    }
}

/// Encodes a STATUS reply as the kernel does (the unit tests' input).
#[cfg(test)]
fn status_reply(family: u16, devices: &[DeviceStatus], seq: u32) -> Vec<u8> {
    let mut b = Builder::new(family, 0, NbdCmd::Status as u8, nbd::VERSION);
    b.begin_nest(nbd::ATTR_DEVICE_LIST);
    for d in devices {
        b.begin_nest(nbd::DEVICE_ITEM).u32(nbd::DEVICE_INDEX, d.index).u8(nbd::DEVICE_CONNECTED, d.connected as u8).end_nest();
    }
    b.end_nest();
    b.finish(seq)
}

#[cfg(test)]
#[path = "nlmsg_tests.rs"]
mod tests;
