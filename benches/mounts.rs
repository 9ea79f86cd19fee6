//! criterion: parsing mountinfo, diffing tables, and a statmount snapshot.
//!
//! `cargo bench --bench mounts` (root: the snapshot group mounts tmpfs and
//! binds in a private mount namespace entered before criterion starts).

mod support;

use std::hint::black_box;

use criterion::{BenchmarkId, Criterion, Throughput};
use volring_mounts::{diff, load, mountinfo_lines, mountinfo_mounts, read_mountinfo, MountTable};

const SIZES: [usize; 4] = [1_000, 5_000, 10_000, 20_000];

fn parse_group(c: &mut Criterion) {
    let mut g = c.benchmark_group("mountinfo_parse");
    for n in SIZES {
        let text = support::kubelet_mountinfo(n);
        g.throughput(Throughput::Elements(n as u64));
        g.bench_with_input(BenchmarkId::new("zero_copy_lines", n), &text, |b, t| {
            b.iter(|| mountinfo_lines(black_box(t)).filter(|l| l.is_ok()).count())
        });
        g.bench_with_input(BenchmarkId::new("owned_mounts", n), &text, |b, t| b.iter(|| mountinfo_mounts(black_box(t))));
        g.bench_with_input(BenchmarkId::new("indexed_table", n), &text, |b, t| b.iter(|| MountTable::from_mountinfo(black_box(t))));
    }
    g.finish();
}

fn diff_group(c: &mut Criterion) {
    let mut g = c.benchmark_group("mount_table_diff");
    let text = support::kubelet_mountinfo(10_000);
    let (old, _) = MountTable::from_mountinfo(&text);
    // The same table re-read (fresh allocations, as a resync makes), with one
    // mount's options changed: the 5,001st line's.
    let changed: Vec<String> = String::from_utf8_lossy(&text)
        .lines()
        .enumerate()
        .map(|(i, l)| if i == 5_000 { l.replacen(" rw,", " ro,", 1) } else { l.to_string() })
        .collect();
    let (new, _) = MountTable::from_mountinfo((changed.join("\n") + "\n").as_bytes());
    assert_eq!(diff(&old, &new).len(), 1);
    g.throughput(Throughput::Elements(10_000));
    g.bench_function("10k_vs_10k_one_change", |b| b.iter(|| diff(black_box(&old), black_box(&new))));
    g.finish();
}

fn snapshot_group(c: &mut Criterion, farm: &mut support::MountFarm) {
    let mut g = c.benchmark_group("mount_table_snapshot");
    g.sample_size(10);
    // load(true) is the statmount read `volring mounts` makes; it would
    // fall back to mountinfo on a kernel without listmount (before 6.8),
    // which this group must not measure under the statmount name.
    assert!(volring_sys::mount_api::listmount_available(), "the snapshot group needs listmount/statmount (Linux 6.8+)");
    let info = std::fs::File::open("/proc/self/mountinfo").expect("mountinfo");
    let mut buf = Vec::new();
    for n in SIZES {
        farm.grow_to(n);
        g.throughput(Throughput::Elements(n as u64));
        g.bench_function(BenchmarkId::new("listmount_statmount", n), |b| b.iter(|| load(true).expect("snapshot")));
        g.bench_function(BenchmarkId::new("mountinfo_read_parse", n), |b| {
            b.iter(|| {
                read_mountinfo(&info, &mut buf).expect("read");
                MountTable::from_mountinfo(&buf)
            })
        });
    }
    g.finish();
}

fn main() {
    let private = volring_sys::ns::enter_private_mount_namespace();
    let mut c = Criterion::default().configure_from_args();
    parse_group(&mut c);
    diff_group(&mut c);
    match private {
        Ok(()) => snapshot_group(&mut c, &mut support::MountFarm::new()),
        Err(e) => eprintln!("skipping mount_table_snapshot: no private mount namespace ({e}); run as root"),
    }
    c.final_summary();
}
