//! volring's mountinfo parser against util-linux libmount, on the same bytes,
//! interleaved in one run; prints medians and ratios.
//!
//! `cargo bench --features libmount-peer --bench parse_vs_libmount [-- --sizes 1000,20000]`
//!
//! Both sides read the same file from tmpfs and build a table: libmount its
//! list of `libmnt_fs` (every field unescaped and copied), volring either the
//! owned `Mount`s (the like-for-like row) or the indexed `MountTable`. Each
//! table is freed after its timer stops, on both sides, and the heap is
//! settled (`malloc_trim`) before each timer starts, so neither side pays
//! for the other's frees.

mod support;

use std::hint::black_box;
use std::time::Instant;

use volring_mounts::{mountinfo_mounts, read_mountinfo, MountTable};
use volring_sys::libmount;

const ROUNDS: usize = 31;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() {
    if std::env::args().any(|a| a == "--list") {
        return;
    }
    let dir = tempfile::Builder::new().prefix("volring-parse-").tempdir_in("/dev/shm").or_else(|_| tempfile::tempdir()).expect("tmp dir");
    println!("mountinfo parse, kubelet-like lines, median of {ROUNDS} interleaved rounds (ms)");
    println!(
        "{:>7} {:>10} {:>14} {:>14} {:>16} {:>16}",
        "lines", "libmount", "volring_owned", "volring_table", "ratio_owned", "ratio_table"
    );
    let args: Vec<String> = std::env::args().collect();
    let sizes: Vec<usize> = args
        .iter()
        .position(|a| a == "--sizes")
        .and_then(|i| args.get(i + 1))
        .map(|v| v.split(',').filter_map(|x| x.parse().ok()).collect())
        .unwrap_or_else(|| vec![1_000, 5_000, 10_000, 20_000]);
    for n in sizes {
        let path = dir.path().join(format!("mountinfo-{n}"));
        std::fs::write(&path, support::kubelet_mountinfo(n)).expect("write");
        let file = std::fs::File::open(&path).expect("open");
        let mut buf = Vec::new();
        let (mut lm, mut owned, mut table) = (Vec::new(), Vec::new(), Vec::new());
        for _ in 0..ROUNDS {
            libmount::settle_heap();
            let t = Instant::now();
            let got = libmount::Table::parse_file(&path).expect("libmount");
            lm.push(t.elapsed().as_secs_f64() * 1e3);
            assert_eq!(black_box(got).entries(), n);

            libmount::settle_heap();
            let t = Instant::now();
            read_mountinfo(&file, &mut buf).expect("read");
            let (v, errors) = mountinfo_mounts(&buf);
            owned.push(t.elapsed().as_secs_f64() * 1e3);
            assert!(errors.is_empty() && black_box(v).len() == n);

            libmount::settle_heap();
            let t = Instant::now();
            read_mountinfo(&file, &mut buf).expect("read");
            let (tb, errors) = MountTable::from_mountinfo(&buf);
            table.push(t.elapsed().as_secs_f64() * 1e3);
            assert!(errors.is_empty() && black_box(tb).len() == n);
        }
        let (l, o, t) = (median(lm), median(owned), median(table));
        println!("{n:>7} {l:>10.3} {o:>14.3} {t:>14.3} {:>15.2}x {:>15.2}x", l / o, l / t);
    }
}
