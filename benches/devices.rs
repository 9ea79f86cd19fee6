//! Pure costs of the device layer: parsing 4,096 lines of /proc/diskstats,
//! one sysfs stat line, iostat rates, and the signature probe over a
//! device's first 68 KiB (a hit, and noise that matches nothing).
//!
//! `cargo bench --bench devices`

use std::time::Duration;

use criterion::{black_box, criterion_group, criterion_main, Criterion, Throughput};
use volring_devices::{parse_diskstats, IoCounters, IoRates};
use volring_devices::{probe, PROBE_LEN};

fn diskstats_text(n: usize) -> Vec<u8> {
    let mut s = String::new();
    for i in 0..n {
        s.push_str(&format!(
            " {:4} {:7} loop{i} {} 0 {} {} {} 0 {} {} 0 {} {} 0 0 0 0 {} {}\n",
            7,
            i,
            i * 37,
            i * 296,
            i % 97,
            i * 11,
            i * 88,
            i % 53,
            i % 131,
            i % 211,
            i % 7,
            i % 3
        ));
    }
    s.into_bytes()
}

fn benches(c: &mut Criterion) {
    let mut g = c.benchmark_group("devices");
    let text = diskstats_text(4096);
    g.throughput(Throughput::Elements(4096));
    g.bench_function("parse_diskstats_4096", |b| b.iter(|| parse_diskstats(black_box(&text)).filter(|(_, l)| l.is_ok()).count()));
    g.throughput(Throughput::Elements(1));
    let line = b"  397830    13869 22356402  1241567    33116    51014 21843920    93329        0    41868  1341210    21542       16  9430992     5833    10308      479\n";
    g.bench_function("parse_sysfs_stat", |b| b.iter(|| IoCounters::parse(black_box(line))));
    let a = IoCounters::parse(line).expect("line");
    let z = IoCounters { reads: a.reads + 1000, read_sectors: a.read_sectors + 8000, io_ticks: a.io_ticks + 300, ..a };
    g.bench_function("rates", |b| b.iter(|| IoRates::between(black_box(&a), black_box(&z), Duration::from_secs(1))));
    let mut ext4 = vec![0u8; PROBE_LEN];
    ext4[1024 + 0x38..1024 + 0x3A].copy_from_slice(&0xEF53u16.to_le_bytes());
    ext4[1024 + 0x60..1024 + 0x64].copy_from_slice(&0x2C2u32.to_le_bytes());
    ext4[1024 + 0x68..1024 + 0x78].copy_from_slice(&[7; 16]);
    g.bench_function("probe_ext4", |b| b.iter(|| probe(black_box(&ext4), 512)));
    let noise: Vec<u8> = (0..PROBE_LEN).map(|i| (i.wrapping_mul(2_654_435_761) >> 11) as u8).collect();
    g.bench_function("probe_noise", |b| b.iter(|| probe(black_box(&noise), 512)));
    g.finish();
}

criterion_group!(group, benches);
criterion_main!(group);
