//! The hostile-client part of `nbd_peers`: volring with its default
//! limits against clients that pipeline, announce payloads that never
//! come, or flood the handshake, none reading a reply.

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::{Duration, Instant};

use super::{idle_connection, rss_kib, start, IMAGE};

fn hwm_kib(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| s.lines().find(|l| l.starts_with("VmHWM:")).and_then(|l| l.split_whitespace().nth(1)?.parse().ok()))
        .unwrap_or(0)
}

/// Writes `bytes` until done or until the server stops reading for 2 s.
fn push(s: &mut UnixStream, bytes: &[u8]) {
    let _ = s.set_write_timeout(Some(Duration::from_secs(2)));
    let _ = s.write_all(bytes);
}

/// A compact request header.
fn request(kind: u16, cookie: u64, offset: u64, length: u32) -> [u8; 28] {
    let mut b = [0u8; 28];
    b[..4].copy_from_slice(&0x2560_9513u32.to_be_bytes());
    b[6..8].copy_from_slice(&kind.to_be_bytes());
    b[8..16].copy_from_slice(&cookie.to_be_bytes());
    b[16..24].copy_from_slice(&offset.to_be_bytes());
    b[24..28].copy_from_slice(&length.to_be_bytes());
    b
}

/// volring with its default limits against 64 connections pipelining
/// 20,000 4 KiB READs each, 16 announcing 32 MiB WRITEs whose payload never
/// comes, and 16 flooding the handshake with NBD_OPT_LIST, none reading a
/// reply: peak RSS (VmHWM) while they sit, and RSS once they left.
pub(super) fn hostile_clients(dir: &Path, img: &Path) {
    // A directory of its own: the socket of an earlier volring may linger.
    let dir = dir.join("hostile");
    std::fs::create_dir_all(&dir).expect("bench dir");
    let peer = start("volring", &dir, img, "0-1");
    let pid = peer.child.id();
    {
        // Warm: a well-behaved client moves 64 MiB through the server.
        let mut c = idle_connection(&peer.socket).expect("warm-up client");
        let payload = vec![0x5au8; 1 << 20];
        for i in 0..64u64 {
            let mut b = request(1, i, i << 20, 1 << 20).to_vec();
            b.extend_from_slice(&payload);
            c.write_all(&b).expect("warm-up write");
            let mut reply = [0u8; 16];
            c.read_exact(&mut reply).expect("warm-up reply");
        }
    }
    std::thread::sleep(Duration::from_millis(1500));
    let idle = rss_kib(pid);
    let socket = peer.socket.clone();
    let mut threads = Vec::new();
    for h in 0..64u64 {
        let socket = socket.clone();
        threads.push(std::thread::spawn(move || -> Option<UnixStream> {
            let mut s = idle_connection(&socket).ok()?;
            let mut burst = Vec::with_capacity(20_000 * 28);
            for i in 0..20_000u64 {
                burst.extend_from_slice(&request(0, i, ((h * 7919 + i) << 12) % IMAGE, 4096));
            }
            push(&mut s, &burst);
            Some(s)
        }));
    }
    for _ in 0..16 {
        let socket = socket.clone();
        threads.push(std::thread::spawn(move || -> Option<UnixStream> {
            let mut s = idle_connection(&socket).ok()?;
            let mut b = request(1, 1, 0, 32 << 20).to_vec();
            b.extend_from_slice(&[0u8; 1 << 20]);
            push(&mut s, &b);
            Some(s)
        }));
    }
    for _ in 0..16 {
        let socket = socket.clone();
        threads.push(std::thread::spawn(move || -> Option<UnixStream> {
            let mut s = UnixStream::connect(&socket).ok()?;
            let mut greeting = [0u8; 18];
            s.read_exact(&mut greeting).ok()?;
            let mut b = 3u32.to_be_bytes().to_vec();
            for _ in 0..4096 {
                b.extend_from_slice(&0x4948_4156_454f_5054u64.to_be_bytes());
                b.extend_from_slice(&3u32.to_be_bytes());
                b.extend_from_slice(&0u32.to_be_bytes());
            }
            push(&mut s, &b);
            Some(s)
        }));
    }
    let sitting: Vec<UnixStream> = threads.into_iter().filter_map(|t| t.join().ok().flatten()).collect();
    std::thread::sleep(Duration::from_millis(1000));
    let served = idle_connection(&peer.socket).and_then(|mut c| {
        c.write_all(&request(0, 9, 0, 4096))?;
        let mut reply = vec![0u8; 16 + 4096];
        c.read_exact(&mut reply)?;
        Ok(reply[4..8] == [0, 0, 0, 0])
    });
    let peak = hwm_kib(pid);
    drop(sitting);
    let start = Instant::now();
    while rss_kib(pid) * 10 > idle * 12 && start.elapsed() < Duration::from_secs(20) {
        std::thread::sleep(Duration::from_millis(100));
    }
    let after = rss_kib(pid);
    println!(
        "hostile clients (64 x 20,000 pipelined 4 KiB READs, 16 x 32 MiB WRITEs without payload, 16 LIST floods), default limits: \
         volring idle {:.1} MiB, peak {:.1} MiB, {:.1} MiB {:.1} s after they left; a new client served meanwhile: {}",
        idle as f64 / 1024.0,
        peak as f64 / 1024.0,
        after as f64 / 1024.0,
        start.elapsed().as_secs_f64(),
        served.unwrap_or(false)
    );
    println!("target: peak <= 256 MiB -> {}", if peak <= 256 * 1024 { "met" } else { "NOT met" });
    println!(
        "target: back within 20% of idle once they left -> {} ({:+.1}%)",
        if after * 10 <= idle * 12 { "met" } else { "NOT met" },
        (after as f64 / idle.max(1) as f64 - 1.0) * 100.0
    );
}
