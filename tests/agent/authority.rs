//! Any `:authority` a gRPC client sends on the CSI socket is served (the
//! header rewritten in the HTTP/2 stream by hand).

use super::*;

/// The HTTP/2 client side of a test: what h2 writes is passed on with the
/// `:authority` value of request headers replaced by `authority` (h2 will
/// not send a value that is not a URI authority, other clients do). One
/// request per connection: the client's own HPACK table then never matters.
struct SendAuthority<S> {
    inner: S,
    authority: Vec<u8>,
    written: Vec<u8>,
    ready: Vec<u8>,
    preface_passed: bool,
}

impl<S> SendAuthority<S> {
    /// Moves complete frames from `written` to `ready`, rewriting HEADERS.
    fn frames(&mut self) {
        if !self.preface_passed {
            if self.written.len() < 24 {
                return;
            }
            self.ready.extend(self.written.drain(..24));
            self.preface_passed = true;
        }
        while self.written.len() >= 9 {
            let len = u32::from_be_bytes([0, self.written[0], self.written[1], self.written[2]]) as usize;
            if self.written.len() < 9 + len {
                return;
            }
            let mut frame: Vec<u8> = self.written.drain(..9 + len).collect();
            // h2 sends small request headers as one unpadded HEADERS frame.
            if frame[3] == 0x1 && frame[4] & 0x4 != 0 && frame[4] & 0x28 == 0 {
                let block = with_authority(&frame[9..], &self.authority);
                frame.truncate(9);
                frame[..3].copy_from_slice(&(block.len() as u32).to_be_bytes()[1..]);
                frame.extend(block);
            }
            self.ready.extend(frame);
        }
    }
}

/// An HPACK integer with an `n`-bit prefix: value and length.
fn hpack_int(b: &[u8], n: u8) -> (usize, usize) {
    let max = (1usize << n) - 1;
    let mut v = usize::from(b[0]) & max;
    if v < max {
        return (v, 1);
    }
    let mut i = 1;
    loop {
        v += usize::from(b[i] & 0x7f) << (7 * (i - 1));
        i += 1;
        if b[i - 1] & 0x80 == 0 {
            return (v, i);
        }
    }
}

/// The header block with the value of the literal field named by static
/// index 1 (`:authority`) replaced by `value`, as a plain string.
fn with_authority(block: &[u8], value: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    let mut i = 0;
    while i < block.len() {
        let b = block[i];
        if b & 0x80 != 0 || b & 0xe0 == 0x20 {
            let (_, n) = hpack_int(&block[i..], if b & 0x80 != 0 { 7 } else { 5 });
            out.extend_from_slice(&block[i..i + n]);
            i += n;
            continue;
        }
        let (index, mut n) = hpack_int(&block[i..], if b & 0x40 != 0 { 6 } else { 4 });
        if index == 0 {
            let (len, m) = hpack_int(&block[i + n..], 7);
            n += m + len;
        }
        let (len, m) = hpack_int(&block[i + n..], 7);
        if index == 1 {
            out.extend_from_slice(&block[i..i + n]);
            out.push(value.len() as u8); // short test values: one byte
            out.extend_from_slice(value);
        } else {
            out.extend_from_slice(&block[i..i + n + m + len]);
        }
        i += n + m + len;
    }
    out
}

impl<S: tokio::io::AsyncRead + Unpin> tokio::io::AsyncRead for SendAuthority<S> {
    fn poll_read(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.get_mut().inner).poll_read(cx, buf)
    }
}

impl<S: tokio::io::AsyncWrite + Unpin> tokio::io::AsyncWrite for SendAuthority<S> {
    fn poll_write(self: std::pin::Pin<&mut Self>, _cx: &mut std::task::Context<'_>, buf: &[u8]) -> std::task::Poll<std::io::Result<usize>> {
        let this = self.get_mut();
        this.written.extend_from_slice(buf);
        this.frames();
        std::task::Poll::Ready(Ok(buf.len()))
    }

    fn poll_flush(self: std::pin::Pin<&mut Self>, cx: &mut std::task::Context<'_>) -> std::task::Poll<std::io::Result<()>> {
        let this = self.get_mut();
        while !this.ready.is_empty() {
            let n = std::task::ready!(std::pin::Pin::new(&mut this.inner).poll_write(cx, &this.ready))?;
            this.ready.drain(..n);
        }
        std::pin::Pin::new(&mut this.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: std::pin::Pin<&mut Self>, cx: &mut std::task::Context<'_>) -> std::task::Poll<std::io::Result<()>> {
        std::task::ready!(self.as_mut().poll_flush(cx))?;
        std::pin::Pin::new(&mut self.get_mut().inner).poll_shutdown(cx)
    }
}

/// Identity/Probe over a raw HTTP/2 connection whose `:authority` is
/// `authority`: the grpc-status of the reply, or what went wrong.
async fn probe_with_authority(socket: &Path, authority: &str) -> Result<String, String> {
    use tonic::codegen::{http, Bytes};
    let stream = tokio::net::UnixStream::connect(socket).await.map_err(|e| e.to_string())?;
    let io = SendAuthority {
        inner: stream,
        authority: authority.as_bytes().to_vec(),
        written: Vec::new(),
        ready: Vec::new(),
        preface_passed: false,
    };
    let (mut client, conn) = h2::client::handshake(io).await.map_err(|e| e.to_string())?;
    let conn = tokio::spawn(conn);
    let request = http::Request::builder()
        .method("POST")
        .uri("http://localhost/csi.v1.Identity/Probe")
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .body(())
        .map_err(|e| e.to_string())?;
    let (response, mut body) = client.send_request(request, false).map_err(|e| e.to_string())?;
    // An empty ProbeRequest: uncompressed, zero bytes long.
    body.send_data(Bytes::from_static(&[0, 0, 0, 0, 0]), true).map_err(|e| e.to_string())?;
    let response = response.await.map_err(|e| format!("the request failed: {e}"))?;
    let mut reply = response.into_body();
    let mut data = Vec::new();
    while let Some(chunk) = reply.data().await {
        let chunk = chunk.map_err(|e| e.to_string())?;
        let _ = reply.flow_control().release_capacity(chunk.len());
        data.extend_from_slice(&chunk);
    }
    let trailers = reply.trailers().await.map_err(|e| e.to_string())?.ok_or("no trailers")?;
    conn.abort();
    let status = trailers.get("grpc-status").and_then(|v| v.to_str().ok()).unwrap_or("none").to_string();
    // ProbeResponse { ready: true } after the 5-byte gRPC prefix.
    if status == "0" && data.get(5..) != Some(&[0x0a, 0x02, 0x08, 0x01][..]) {
        return Err(format!("unexpected reply {data:?}"));
    }
    Ok(status)
}

/// Clients send as `:authority` "localhost" (grpc-go), the socket path
/// (grpc-java) or the path percent-encoded (C-core, grpcio): all are served.
pub(super) fn any_authority_a_grpc_client_sends_is_served() -> Result<(), Failed> {
    let site = Site::new();
    let (mut p, _c) = site.start("state", "csi.sock", &[])?;
    let path = site.path("csi.sock").display().to_string();
    let encoded = path.replace('/', "%2F");
    for authority in ["localhost", &path, &encoded] {
        let status = site.rt.block_on(probe_with_authority(&site.path("csi.sock"), authority));
        check(status.as_deref() == Ok("0"), format!(":authority {authority:?}: {status:?}"))?;
    }
    check(p.stop().is_some_and(|s| s.success()), "the agent stops cleanly")
}
