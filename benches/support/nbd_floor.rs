//! The floor: the least an NBD server over a page-cache image can do, as a
//! peer of `nbd_peers`. Standard library only, no io_uring, no framework:
//! fixed newstyle handshake (NBD_OPT_GO / NBD_OPT_INFO / NBD_OPT_EXPORT_NAME;
//! everything else, structured replies included, is refused as unsupported),
//! then one thread per connection that `recv`s into a large buffer, `pwrite`s
//! each WRITE payload straight from that buffer, `pread`s each READ into the
//! reply buffer, and sends the replies of everything it parsed from one
//! receive with one write.
//!
//! The bench runs it by executing itself with `--nbd-floor SOCKET IMAGE`,
//! so it needs no build step of its own.

use std::fs::File;
use std::io::{Read, Write};
use std::os::unix::fs::FileExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::Path;
use std::sync::Arc;

const NBDMAGIC: u64 = 0x4e42_444d_4147_4943;
const IHAVEOPT: u64 = 0x4948_4156_454f_5054;
const REPLY_MAGIC: u64 = 0x0003_e889_0455_65a9;
const REQUEST_MAGIC: u32 = 0x2560_9513;
const SIMPLE_REPLY_MAGIC: u32 = 0x6744_6698;
const OPT_EXPORT_NAME: u32 = 1;
const OPT_ABORT: u32 = 2;
const OPT_INFO: u32 = 6;
const OPT_GO: u32 = 7;
const REP_ACK: u32 = 1;
const REP_INFO: u32 = 3;
const REP_ERR_UNSUP: u32 = (1 << 31) | 1;
const INFO_EXPORT: u16 = 0;
/// HAS_FLAGS | SEND_FLUSH | SEND_FUA | CAN_MULTI_CONN.
const TRANSMISSION_FLAGS: u16 = 1 | 4 | 8 | 256;
const CMD_READ: u16 = 0;
const CMD_WRITE: u16 = 1;
const CMD_DISC: u16 = 2;
const CMD_FLUSH: u16 = 3;
const CMD_FLAG_FUA: u16 = 1;
/// What one receive may fill (a 1 MiB write and the requests around it).
const RECV_BUFFER: usize = 8 << 20;
/// The protocol's largest request this server takes.
const MAX_REQUEST: usize = 32 << 20;

/// Serves `image` on the unix socket `socket` until killed.
pub fn serve(socket: &Path, image: &Path) -> std::io::Result<()> {
    let file = Arc::new(File::options().read(true).write(true).open(image)?);
    let _ = std::fs::remove_file(socket);
    let listener = UnixListener::bind(socket)?;
    for stream in listener.incoming() {
        let Ok(stream) = stream else { continue };
        let file = file.clone();
        std::thread::spawn(move || {
            let _ = connection(stream, &file);
        });
    }
    Ok(())
}

fn option_reply(s: &mut UnixStream, option: u32, kind: u32, data: &[u8]) -> std::io::Result<()> {
    let mut b = Vec::with_capacity(20 + data.len());
    b.extend_from_slice(&REPLY_MAGIC.to_be_bytes());
    b.extend_from_slice(&option.to_be_bytes());
    b.extend_from_slice(&kind.to_be_bytes());
    b.extend_from_slice(&(data.len() as u32).to_be_bytes());
    b.extend_from_slice(data);
    s.write_all(&b)
}

/// Fixed newstyle negotiation; true once the client is in transmission.
fn handshake(s: &mut UnixStream, size: u64) -> std::io::Result<bool> {
    let mut greeting = NBDMAGIC.to_be_bytes().to_vec();
    greeting.extend_from_slice(&IHAVEOPT.to_be_bytes());
    greeting.extend_from_slice(&3u16.to_be_bytes()); // FIXED_NEWSTYLE | NO_ZEROES
    s.write_all(&greeting)?;
    let mut client_flags = [0u8; 4];
    s.read_exact(&mut client_flags)?;
    let no_zeroes = client_flags[3] & 2 != 0;
    loop {
        let mut h = [0u8; 16];
        s.read_exact(&mut h)?;
        let option = u32::from_be_bytes(h[8..12].try_into().expect("4 bytes"));
        let len = u32::from_be_bytes(h[12..16].try_into().expect("4 bytes")) as usize;
        if u64::from_be_bytes(h[..8].try_into().expect("8 bytes")) != IHAVEOPT || len > 1 << 16 {
            return Ok(false);
        }
        let mut data = vec![0u8; len];
        s.read_exact(&mut data)?;
        match option {
            OPT_EXPORT_NAME => {
                let mut b = size.to_be_bytes().to_vec();
                b.extend_from_slice(&TRANSMISSION_FLAGS.to_be_bytes());
                if !no_zeroes {
                    b.extend_from_slice(&[0u8; 124]);
                }
                s.write_all(&b)?;
                return Ok(true);
            }
            OPT_GO | OPT_INFO => {
                let mut info = INFO_EXPORT.to_be_bytes().to_vec();
                info.extend_from_slice(&size.to_be_bytes());
                info.extend_from_slice(&TRANSMISSION_FLAGS.to_be_bytes());
                option_reply(s, option, REP_INFO, &info)?;
                option_reply(s, option, REP_ACK, &[])?;
                if option == OPT_GO {
                    return Ok(true);
                }
            }
            OPT_ABORT => {
                option_reply(s, option, REP_ACK, &[])?;
                return Ok(false);
            }
            _ => option_reply(s, option, REP_ERR_UNSUP, &[])?,
        }
    }
}

fn reply_header(out: &mut Vec<u8>, error: u32, cookie: &[u8]) {
    out.extend_from_slice(&SIMPLE_REPLY_MAGIC.to_be_bytes());
    out.extend_from_slice(&error.to_be_bytes());
    out.extend_from_slice(cookie);
}

fn errno(e: &std::io::Error) -> u32 {
    e.raw_os_error().unwrap_or(libc::EIO) as u32
}

fn connection(mut s: UnixStream, file: &File) -> std::io::Result<()> {
    let size = file.metadata()?.len();
    if !handshake(&mut s, size)? {
        return Ok(());
    }
    let mut buf = vec![0u8; RECV_BUFFER];
    let mut out: Vec<u8> = Vec::with_capacity(RECV_BUFFER);
    let mut filled = 0;
    loop {
        if filled == buf.len() {
            // One request larger than the buffer: room for all of it.
            buf.resize(buf.len() * 2, 0);
        }
        let n = s.read(&mut buf[filled..])?;
        if n == 0 {
            return Ok(());
        }
        filled += n;
        let mut at = 0;
        while filled - at >= 28 {
            let h = &buf[at..at + 28];
            if u32::from_be_bytes(h[..4].try_into().expect("4 bytes")) != REQUEST_MAGIC {
                return Ok(());
            }
            let flags = u16::from_be_bytes([h[4], h[5]]);
            let kind = u16::from_be_bytes([h[6], h[7]]);
            let cookie: [u8; 8] = h[8..16].try_into().expect("8 bytes");
            let offset = u64::from_be_bytes(h[16..24].try_into().expect("8 bytes"));
            let length = u32::from_be_bytes(h[24..28].try_into().expect("4 bytes")) as usize;
            if length > MAX_REQUEST {
                return Ok(());
            }
            match kind {
                CMD_WRITE => {
                    if filled - at < 28 + length {
                        if 28 + length > buf.len() {
                            buf.resize(28 + length, 0);
                        }
                        break;
                    }
                    let payload = &buf[at + 28..at + 28 + length];
                    let mut r = file.write_all_at(payload, offset);
                    if r.is_ok() && flags & CMD_FLAG_FUA != 0 {
                        r = file.sync_data();
                    }
                    reply_header(&mut out, r.as_ref().map_or_else(errno, |_| 0), &cookie);
                    at += 28 + length;
                }
                CMD_READ => {
                    let start = out.len();
                    reply_header(&mut out, 0, &cookie);
                    out.resize(start + 16 + length, 0);
                    if let Err(e) = file.read_exact_at(&mut out[start + 16..], offset) {
                        out.truncate(start);
                        reply_header(&mut out, errno(&e), &cookie);
                    }
                    at += 28;
                }
                CMD_FLUSH => {
                    let r = file.sync_data();
                    reply_header(&mut out, r.as_ref().map_or_else(errno, |_| 0), &cookie);
                    at += 28;
                }
                CMD_DISC => {
                    s.write_all(&out)?;
                    return Ok(());
                }
                _ => {
                    reply_header(&mut out, libc::EINVAL as u32, &cookie);
                    at += 28;
                }
            }
        }
        if !out.is_empty() {
            s.write_all(&out)?;
            out.clear();
        }
        buf.copy_within(at..filled, 0);
        filled -= at;
    }
}
