//! The NBD codec's per-request cost: parsing a pipelined burst of request
//! headers and encoding small replies (the server's CPU per request is what
//! decides IOPS on a 2-core node).

use criterion::{criterion_group, criterion_main, BatchSize, Criterion, Throughput};
use volring_nbd::wire::{encode_request, encode_small_reply, parse_request, HeaderStyle, ReplyBody, Request};

// The protocol's numbers as the bench's client knows them (doc/proto.md of
// the NBD project), not borrowed from the code under test.
const IHAVEOPT: u64 = 0x4948_4156_454f_5054;
const OPT_GO: u32 = 7;
const OPT_STRUCTURED_REPLY: u32 = 8;
const CMD_READ: u16 = 0;

/// Bytes of a request header: compact, or extended with a 64-bit length.
fn request_len(style: HeaderStyle) -> usize {
    if style == HeaderStyle::Extended {
        32
    } else {
        28
    }
}

fn burst(style: HeaderStyle, n: u64) -> Vec<u8> {
    let mut b = Vec::new();
    for i in 0..n {
        encode_request(&Request { flags: 0, kind: CMD_READ, cookie: i, offset: (i * 7919) << 12, length: 4096 }, style, &mut b);
    }
    b
}

fn parse(c: &mut Criterion) {
    let mut g = c.benchmark_group("nbd_wire");
    for style in [HeaderStyle::Structured, HeaderStyle::Extended] {
        let bytes = burst(style, 32);
        g.throughput(Throughput::Elements(32));
        g.bench_function(format!("parse 32 requests ({style:?})"), |b| {
            b.iter(|| {
                let mut rest = &bytes[..];
                let mut n = 0u64;
                while let Ok(Some(r)) = parse_request(rest, style) {
                    n += r.cookie;
                    rest = &rest[request_len(style)..];
                }
                n
            })
        });
        g.bench_function(format!("encode 32 acks ({style:?})"), |b| {
            b.iter_batched_ref(
                || Vec::with_capacity(32 * 32),
                |out| {
                    for i in 0..32u64 {
                        encode_small_reply(style, i, 0, ReplyBody::Ack, out);
                    }
                },
                BatchSize::SmallInput,
            )
        });
    }
    g.throughput(Throughput::Elements(1));
    g.bench_function("handshake to GO", |b| {
        use volring_nbd::handshake::{Catalog, ExportInfo, Handshake, Outcome};
        struct One;
        impl Catalog for One {
            type Handle = ();
            fn find(&self, _: &str) -> Option<((), ExportInfo)> {
                Some(((), ExportInfo { size: 1 << 30, read_only: false, description: String::new(), block_sizes: (1, 4096, 1 << 25) }))
            }
            fn names(&self) -> Vec<(String, String)> {
                Vec::new()
            }
            fn admit(&self, _: &(), _: &str) -> Result<(), String> {
                Ok(())
            }
        }
        let mut input = 3u32.to_be_bytes().to_vec();
        for (code, data) in [(OPT_STRUCTURED_REPLY, Vec::new()), (OPT_GO, vec![0, 0, 0, 4, b'd', b'i', b's', b'k', 0, 0])] {
            input.extend_from_slice(&IHAVEOPT.to_be_bytes());
            input.extend_from_slice(&code.to_be_bytes());
            input.extend_from_slice(&(data.len() as u32).to_be_bytes());
            input.extend_from_slice(&data);
        }
        b.iter(|| {
            let mut hs = Handshake::default();
            let mut out = Vec::new();
            let mut pos = 0;
            loop {
                let (used, o) = hs.step(&input[pos..], &One, &mut out).expect("valid");
                pos += used;
                if matches!(o, Outcome::Enter(_)) {
                    break out.len();
                }
            }
        })
    });
    g.finish();
}

criterion_group!(benches, parse);
criterion_main!(benches);
