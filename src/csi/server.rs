//! Serving the three CSI services on a unix socket.
//!
//! Binding and serving are two steps so that the agent can bind every
//! listener before it starts anything: a socket it cannot have is a fatal
//! error at start, not a task that dies unseen. The socket file belongs to
//! whoever bound it, and only that process removes it ([`BoundSocket`]).

use std::future::Future;
use std::io;
use std::os::unix::fs::{FileTypeExt, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use super::proto::controller_server::ControllerServer;
use super::proto::identity_server::IdentityServer;
use super::proto::node_server::NodeServer;
use super::service::{ControllerService, IdentityService, NodeService};
use super::Driver;

/// `unix:///run/csi/csi.sock`, `unix:/run/csi/csi.sock` or a bare absolute
/// path, to the socket path.
pub fn parse_endpoint(s: &str) -> Result<PathBuf, String> {
    let path = s.strip_prefix("unix://").or_else(|| s.strip_prefix("unix:")).unwrap_or(s);
    if !path.starts_with('/') {
        return Err(format!("CSI endpoint {s:?}: expected unix:///absolute/path"));
    }
    Ok(PathBuf::from(path))
}

/// A socket file this process bound. Dropping it removes the file, but only
/// while the path still names that very socket (same device and inode): a
/// socket another server bound there since, or any other file, is left alone.
/// The socket's inode is held open (`O_PATH`) until then, so its number
/// cannot be reused by a newer file even after the listener has closed.
#[derive(Debug)]
pub struct BoundSocket {
    path: PathBuf,
    inode: std::os::fd::OwnedFd,
}

impl BoundSocket {
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// True while `path` is still the socket this process bound.
    pub fn is_ours(&self) -> bool {
        let Ok(ours) = rustix::fs::fstat(&self.inode) else { return false };
        std::fs::symlink_metadata(&self.path).is_ok_and(|m| m.file_type().is_socket() && m.dev() == ours.st_dev && m.ino() == ours.st_ino)
    }
}

impl Drop for BoundSocket {
    fn drop(&mut self) {
        if self.is_ours() {
            let _ = std::fs::remove_file(&self.path);
        } else {
            tracing::warn!(endpoint = %self.path.display(), "the CSI socket path no longer names this agent's socket; left alone");
        }
    }
}

/// Serves until `shutdown` completes. The socket file stays: its
/// [`BoundSocket`] removes it.
pub async fn serve(driver: Arc<Driver>, listener: tokio::net::UnixListener, shutdown: impl Future<Output = ()>) -> io::Result<()> {
    use tokio_stream::StreamExt;
    tracing::info!(endpoint = %driver.config().endpoint.display(), "serving CSI");
    let incoming = tokio_stream::wrappers::UnixListenerStream::new(listener).map(|r| r.map(authority::Renaming::new));
    tonic::transport::Server::builder()
        .add_service(IdentityServer::new(IdentityService(driver.clone())))
        .add_service(ControllerServer::new(ControllerService(driver.clone())))
        .add_service(NodeServer::new(NodeService(driver)))
        .serve_with_incoming_shutdown(incoming, shutdown)
        .await
        .map_err(io::Error::other)
}

/// Binds the socket with mode 0660 (must run inside a tokio runtime). A
/// stale socket (one nobody answers on, left by a crash) is removed; a live
/// one, or any other kind of file, is an error: two agents must not share a
/// socket path.
///
/// The check, the removal and the bind run under an exclusive lock on the
/// socket's directory, so two agents starting at once cannot each remove
/// the other's fresh socket as stale. Only binders take that lock, and
/// only for the moment of binding.
pub fn bind(path: &Path) -> io::Result<(tokio::net::UnixListener, BoundSocket)> {
    let dir = path.parent().filter(|d| !d.as_os_str().is_empty()).unwrap_or(Path::new("/"));
    std::fs::create_dir_all(dir)?;
    let dir_fd = std::fs::File::open(dir)?;
    rustix::fs::flock(&dir_fd, rustix::fs::FlockOperation::LockExclusive)?;
    match std::fs::symlink_metadata(path) {
        Ok(m) if m.file_type().is_socket() => {
            if std::os::unix::net::UnixStream::connect(path).is_ok() {
                return Err(io::Error::new(io::ErrorKind::AddrInUse, "address in use by a running server"));
            }
            tracing::info!(endpoint = %path.display(), "removing a stale socket");
            std::fs::remove_file(path)?;
        }
        Ok(_) => return Err(io::Error::new(io::ErrorKind::AlreadyExists, "the path exists and is not a socket")),
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => return Err(e),
    }
    let listener = tokio::net::UnixListener::bind(path)?;
    use rustix::fs::OFlags;
    let inode = rustix::fs::open(path, OFlags::PATH | OFlags::NOFOLLOW | OFlags::CLOEXEC, rustix::fs::Mode::empty())?;
    let bound = BoundSocket { path: path.to_path_buf(), inode };
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o660))?;
    drop(dir_fd);
    Ok((listener, bound))
}

/// Lets clients that put the socket path in `:authority` be served.
///
/// Over a unix socket there is no host, and gRPC clients differ in what
/// they send as `:authority`: grpc-go sends "localhost", grpc-java the
/// socket path, C-core (grpcio) the path percent-encoded. h2, under tonic,
/// parses the value as a URI authority and resets the stream when that
/// fails, with no setting to relax it; a path (`/`) or a percent sign in a
/// host both fail. h2 does accept a request with no `:authority`.
///
/// So the CSI socket's connections are read through [`Renaming`]: in every
/// request header block, the field named `:authority` is renamed to
/// [`RENAMED`], a header of the same length, and h2 sees a request with no
/// authority (tonic routes by path alone). Only names change, never a
/// length that counts: HPACK charges a dynamic-table entry the lengths of
/// its decoded name and value, and the new name is as long as the old and
/// the value is copied bit for bit (Huffman or not), so h2's table keeps
/// the very sizes, and hence the indices, the client's encoder counts on. An
/// entry the client later names by index arrives renamed, as it was stored.
/// Anything the adapter does not understand (no HTTP/2 preface, a
/// malformed block, a frame or header block over 1 MiB) passes unchanged,
/// which is what h2 would have seen without it.
mod authority {
    use std::io;
    use std::pin::Pin;
    use std::task::{ready, Context, Poll};

    use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

    /// What `:authority` becomes (as long as `:authority`).
    pub const RENAMED: &[u8; 10] = b"x-uds-auth";
    /// `:authority` in HPACK's Huffman code (RFC 7541, appendix B).
    const HUFFMAN_AUTHORITY: &[u8] = &[0xb8, 0x3b, 0x53, 0x39, 0xec, 0x32, 0x7d, 0x7f];
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

    /// The read side of a connection with `:authority` renamed; writes go
    /// straight through.
    pub struct Renaming<S> {
        inner: S,
        mode: Mode,
        raw: Vec<u8>,
        out: Vec<u8>,
        sent: usize,
        block: Option<Block>,
        eof: bool,
    }

    impl<S> Renaming<S> {
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
                    let Some(fragment) = payload.len().checked_sub(pad.saturating_sub(at)).and_then(|end| payload.get(at + prio..end))
                    else {
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

        /// Passes a whole header block on, renamed when it names `:authority`.
        fn emit(&mut self, b: Block) {
            let Some(block) = rename(&b.fragment) else {
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

    /// The header block with every literal field named `:authority` (by
    /// static index 1, or by a plain or Huffman-coded literal name) renamed
    /// to [`RENAMED`]; `None` when there is none, or the block is malformed.
    pub fn rename(block: &[u8]) -> Option<Vec<u8>> {
        let mut out = Vec::with_capacity(block.len() + 16);
        let mut changed = false;
        let mut i = 0;
        while i < block.len() {
            let rep = &block[i..];
            let first = rep[0];
            if first & 0x80 != 0 || first & 0xe0 == 0x20 {
                // An indexed field (its entry is stored as it was sent) or a
                // table size update: copied.
                let (_, n) = integer(rep, if first & 0x80 != 0 { 7 } else { 5 })?;
                out.extend_from_slice(&rep[..n]);
                i += n;
                continue;
            }
            // A literal: with incremental indexing (01), without (0000) or never indexed (0001).
            let (prefix, kind) = if first & 0x40 != 0 { (6, first & 0xc0) } else { (4, first & 0xf0) };
            let (index, n) = integer(rep, prefix)?;
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
            let (_, _, m) = string(&rep[value_at..])?;
            let end = value_at + m;
            if named_authority {
                out.push(kind);
                out.push(RENAMED.len() as u8);
                out.extend_from_slice(RENAMED);
                out.extend_from_slice(&rep[value_at..end]);
                changed = true;
            } else {
                out.extend_from_slice(&rep[..end]);
            }
            i += end;
        }
        changed.then_some(out)
    }

    impl<S: AsyncRead + Unpin> AsyncRead for Renaming<S> {
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

    impl<S: AsyncWrite + Unpin> AsyncWrite for Renaming<S> {
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

    impl tonic::transport::server::Connected for Renaming<tokio::net::UnixStream> {
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
        fn renames_authority_in_every_literal_form_and_nothing_else() {
            let path = b"/var/lib/kubelet/plugins/volring.csi.io/csi.sock";
            // :method POST (indexed 3), :authority by static name with
            // incremental indexing, then by literal name without indexing,
            // by Huffman-coded name never indexed, and an indexed reference
            // to the dynamic entry (copied: stored renamed).
            let mut block = vec![0x83, 0x41];
            block.extend(plain(path));
            block.push(0x00);
            block.extend(plain(b":authority"));
            block.extend(plain(b"localhost"));
            block.push(0x10);
            block.push(0x80 | HUFFMAN_AUTHORITY.len() as u8);
            block.extend_from_slice(HUFFMAN_AUTHORITY);
            block.extend(plain(b"%2Frun%2Fcsi.sock"));
            block.push(0xbe);
            block.push(0x44); // :path by static name, incremental
            block.extend(plain(b"/csi.v1.Identity/Probe"));
            let out = rename(&block).expect("renamed");
            let mut want = vec![0x83, 0x40];
            want.extend(plain(RENAMED));
            want.extend(plain(path));
            want.push(0x00);
            want.extend(plain(RENAMED));
            want.extend(plain(b"localhost"));
            want.push(0x10);
            want.extend(plain(RENAMED));
            want.extend(plain(b"%2Frun%2Fcsi.sock"));
            want.push(0xbe);
            want.push(0x44);
            want.extend(plain(b"/csi.v1.Identity/Probe"));
            assert_eq!(out, want);
            // Nothing to rename, or a truncated block: passed on as it is.
            assert_eq!(rename(&[0x83, 0x86]), None);
            assert_eq!(rename(&block[..block.len() - 3]), None);
            assert_eq!(rename(&[0x41, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff]), None);
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
            Renaming::new(server).read_to_end(&mut seen).await.unwrap();
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
            assert_eq!(got, rename(&block).unwrap());
            assert_eq!(frames, [(HEADERS, 0x1), (CONTINUATION, END_HEADERS)]);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoints() {
        assert_eq!(parse_endpoint("unix:///run/csi.sock").unwrap(), Path::new("/run/csi.sock"));
        assert_eq!(parse_endpoint("unix:/run/csi.sock").unwrap(), Path::new("/run/csi.sock"));
        assert_eq!(parse_endpoint("/run/csi.sock").unwrap(), Path::new("/run/csi.sock"));
        assert!(parse_endpoint("tcp://127.0.0.1:1").is_err());
        assert!(parse_endpoint("unix://relative").is_err());
    }

    #[tokio::test]
    async fn only_the_socket_this_process_bound_is_removed() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("csi.sock");
        let (listener, bound) = bind(&path).unwrap();
        // A live socket is refused, and the refusal touches nothing.
        assert_eq!(bind(&path).unwrap_err().kind(), io::ErrorKind::AddrInUse);
        assert!(bound.is_ours());
        drop(listener);
        // Someone else's socket now at the path (bound over the stale one).
        let (other_listener, other) = bind(&path).unwrap();
        drop(bound);
        assert!(path.exists(), "another process's socket was removed");
        drop(other_listener);
        drop(other);
        assert!(!path.exists());
        // A regular file is never replaced nor removed.
        std::fs::write(&path, b"not a socket").unwrap();
        assert_eq!(bind(&path).unwrap_err().kind(), io::ErrorKind::AlreadyExists);
        assert_eq!(std::fs::read(&path).unwrap(), b"not a socket");
    }
}
