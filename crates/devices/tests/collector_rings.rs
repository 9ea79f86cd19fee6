//! The stat collector's thread holds one ring: its reactor does the timer,
//! the mailbox and the batched stat reads (it used to open a second
//! io_uring, a batch reader, beside the reactor).
//!
//! Its own test binary, one test, so no other test of the process opens or
//! closes an io_uring while the fds are counted. It reads the counters of
//! the block devices the host already has (nothing is made, so nothing is
//! left behind).

use std::sync::Arc;
use std::time::Duration;

use volring_devices::{CollectorConfig, StatCollector, StatMethod};
use volring_mounts::DevNum;
use volring_ring::BackendChoice;

/// The io_uring instances this process holds: fds whose link names one.
fn io_urings() -> usize {
    std::fs::read_dir("/proc/self/fd")
        .expect("/proc/self/fd")
        .filter_map(|e| std::fs::read_link(e.ok()?.path()).ok())
        .filter(|target| target.as_os_str() == "anon_inode:[io_uring]")
        .count()
}

/// Up to four of the host's block devices, by number and name.
fn host_devices() -> Vec<(DevNum, Arc<str>)> {
    let mut out = Vec::new();
    for e in std::fs::read_dir("/sys/class/block").expect("/sys/class/block").flatten().take(64) {
        let name = e.file_name().to_string_lossy().into_owned();
        let Ok(dev) = std::fs::read_to_string(e.path().join("dev")) else { continue };
        let Some((major, minor)) = dev.trim().split_once(':') else { continue };
        let (Ok(major), Ok(minor)) = (major.parse(), minor.parse()) else { continue };
        out.push((DevNum { major, minor }, Arc::from(name)));
        if out.len() == 4 {
            break;
        }
    }
    out
}

fn config(method: StatMethod, io: BackendChoice) -> CollectorConfig {
    // A long interval: the samples that matter are the first (taken before
    // `start` returns) and the ones asked for; the timer is armed all the same.
    CollectorConfig { interval: Duration::from_secs(3600), method, io, ..CollectorConfig::default() }
}

#[test]
fn the_collector_thread_holds_one_io_uring() {
    let devices = host_devices();
    let before = io_urings();
    let (collector, reader) = match StatCollector::start(config(StatMethod::Auto, BackendChoice::IoUring), devices.clone()) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("skipped: no io_uring here ({e})");
            return;
        }
    };
    // `start` returns after the first sample: with `Auto` it timed every
    // method, the io_uring batch among them.
    let first = reader.latest();
    assert_eq!(first.generation, 1, "the first sample was taken during start");
    assert_eq!(io_urings() - before, 1, "the reactor's ring, and no second one for the batched reads");
    // A new device set is read through the same ring (the old collector
    // made a new batch reader for it).
    assert!(collector.track(devices.clone()));
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while reader.latest().generation < 2 {
        assert!(std::time::Instant::now() < deadline, "the new set was never sampled");
        std::thread::sleep(Duration::from_millis(5));
    }
    assert_eq!(io_urings() - before, 1);
    collector.stop().expect("stop");
    assert_eq!(io_urings(), before, "the ring went with the thread");

    // Forced through the batch: every tracked device's counters come back.
    let (collector, reader) = StatCollector::start(config(StatMethod::Ring, BackendChoice::IoUring), devices.clone()).expect("start");
    let snap = reader.latest();
    assert_eq!(io_urings() - before, 1);
    assert_eq!(snap.method, "ring");
    assert!(snap.errors.is_empty(), "{:?}", snap.errors);
    assert_eq!(snap.devices.len(), devices.len());
    collector.stop().expect("stop");

    // On the epoll engine the batch is preads: no io_uring at all.
    let (collector, reader) = StatCollector::start(config(StatMethod::Ring, BackendChoice::Epoll), devices.clone()).expect("start");
    let snap = reader.latest();
    assert_eq!(io_urings(), before);
    assert!(snap.errors.is_empty(), "{:?}", snap.errors);
    assert_eq!(snap.devices.len(), devices.len());
    collector.stop().expect("stop");
}
