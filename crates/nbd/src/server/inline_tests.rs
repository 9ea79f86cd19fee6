//! The inline write path's decisions: probing, refusals, back-offs and
//! the starved ring's hand-off.

use super::*;

/// An export "a" of an 8 KiB image of zeroes in `dir`.
fn export_in(dir: &std::path::Path) -> std::sync::Arc<crate::export::Export> {
    let path = dir.join("img");
    std::fs::write(&path, vec![0u8; 8192]).unwrap();
    let spec = crate::export::ExportSpec {
        name: "a".into(),
        path,
        read_only: false,
        direct_io: false,
        max_connections: 0,
        description: String::new(),
    };
    crate::export::Exports::default().add(&spec, None).unwrap()
}

/// A plain (not FUA) write of `data` at `offset` to `export`'s file.
fn write_of<'a>(export: &'a crate::export::Export, data: &'a [u8], offset: u64, offload: bool) -> InlineWrite<'a> {
    InlineWrite { export, fd: std::os::fd::AsFd::as_fd(export.file()), data, offset, fua: false, offload, lone: false, large_out: false }
}

/// An export in a fresh directory whose file system refused RWF_NOWAIT
/// (as ext4 does), its write path, and a ring's side of inline writes.
fn refusing_export() -> (tempfile::TempDir, std::sync::Arc<crate::export::Export>, WritePath, RingInline) {
    let dir = tempfile::tempdir().unwrap();
    let export = export_in(dir.path());
    let mut p = WritePath::new(InlineWrites::Auto);
    p.nowait_done(Err(Errno::OPNOTSUPP));
    (dir, export, p, RingInline::default())
}

/// A large write is done here only while no other connection of the ring
/// sent requests lately (`Senders`) and the ring was not starved: done
/// here, its copy holds another connection's requests back, and a starved
/// ring gains a worker's CPU share; a small one is done here either way.
#[test]
fn a_large_write_is_left_to_the_workers_while_the_ring_is_shared_or_starved() {
    let (dir, export, mut p, mut ring) = refusing_export();
    let now = Instant::now();
    let (large, small) = (vec![5u8; 1 << 20], [6u8; 4096]);
    let large_out = |data, large_out| InlineWrite { large_out, ..write_of(&export, data, 0, false) };
    assert_eq!(ring.write(&mut p, large_out(&large, true), now), None, "shared or starved: through the ring");
    assert_eq!(ring.write(&mut p, large_out(&small, true), now), Some(4096), "a small one stays here");
    assert_eq!(ring.write(&mut p, large_out(&large, false), now), Some(1 << 20), "alone and served: done here");
    assert_eq!(export.stats.snapshot("a").inline_writes, 2);
    assert_eq!(std::fs::read(dir.path().join("img")).unwrap(), large);
}

/// A write the path would do blocking here goes to the ring instead
/// while the ring is starved of CPU and serving several requests at once
/// (`starve::ReadPath::offload_writes`), and is done here again after.
#[test]
fn a_starved_ring_leaves_blocking_writes_to_the_workers() {
    let (dir, export, mut p, mut ring) = refusing_export();
    let now = Instant::now();
    let data = [7u8; 4096];
    let write = |offload| write_of(&export, &data, 0, offload);
    assert_eq!(ring.write(&mut p, write(true), now), None, "offloaded: through the ring");
    assert_eq!(ring.write(&mut p, write(false), now), Some(4096), "served: done here");
    // What an operator sees of it (volring_nbd_offloaded_writes).
    let st = export.stats.snapshot("a");
    assert_eq!((st.offloaded_writes, st.inline_writes), (1, 1), "{st:?}");
    assert_eq!(std::fs::read(dir.path().join("img")).unwrap()[..4096], data);
}

#[test]
fn a_file_system_that_takes_nowait_writes_keeps_the_ring() {
    let now = Instant::now();
    let mut p = WritePath::new(InlineWrites::Auto);
    assert_eq!(p.route(4096, false, now), Route::Nowait);
    p.nowait_done(Ok(4096));
    assert_eq!(p.route(4096, false, now), Route::Ring);
    // Later answers of a nowait write change nothing once decided.
    p.nowait_done(Err(Errno::OPNOTSUPP));
    assert_eq!(p.route(4096, false, now), Route::Ring);
}

#[test]
fn eopnotsupp_makes_small_writes_inline_and_large_or_fua_ones_ring() {
    let now = Instant::now();
    let mut p = WritePath::new(InlineWrites::Auto);
    // FUA writes never probe.
    assert_eq!(p.route(4096, true, now), Route::Ring);
    assert_eq!(p.route(1 << 20, false, now), Route::Nowait);
    p.nowait_done(Err(Errno::OPNOTSUPP));
    assert!(p.inline_now());
    assert_eq!(p.route(4096, false, now), Route::Blocking);
    assert_eq!(p.route(INLINE_MAX, false, now), Route::Blocking);
    assert_eq!(p.route(INLINE_MAX + 1, false, now), Route::Ring);
    assert_eq!(p.route(4096, true, now), Route::Ring);
}

/// A 1 MiB write (or one of the kernel nbd client's 1,280 KiB) to a file
/// system that refuses RWF_NOWAIT is done here too, refused try included:
/// handed to a worker it cost a hand-off per write, and the ring, contended
/// by that worker, stopped polling while the next payload streamed in.
#[test]
fn a_large_write_to_a_file_system_that_blocks_is_done_here() {
    let now = Instant::now();
    let mut p = WritePath::new(InlineWrites::Auto);
    assert_eq!(p.route(1 << 20, false, now), Route::Nowait);
    p.nowait_done(Err(Errno::OPNOTSUPP));
    assert_eq!(p.refused(1 << 20), Route::Blocking, "the refused try itself is written here");
    assert_eq!(p.route(1 << 20, false, now), Route::Blocking);
    assert_eq!(p.route(1280 << 10, false, now), Route::Blocking);
    assert_eq!(p.route(1 << 20, true, now), Route::Ring, "a durable one waits on the device");
    // A ring path's large writes stay with io_uring, stamp or not.
    let mut ring = ring_path(4_000_000, false);
    assert_eq!(ring.route(1 << 20, false, now), Route::Ring);
}

#[test]
fn eagain_every_time_gives_up_after_the_probes() {
    let now = Instant::now();
    let mut p = WritePath::new(InlineWrites::Auto);
    for _ in 0..PROBES - 1 {
        assert_eq!(p.route(4096, false, now), Route::Nowait);
        p.nowait_done(Err(Errno::AGAIN));
    }
    // An error that says nothing about blocking does not count.
    p.nowait_done(Err(Errno::NOSPC));
    assert_eq!(p.route(4096, false, now), Route::Nowait);
    p.nowait_done(Err(Errno::AGAIN));
    assert_eq!(p.route(4096, false, now), Route::Blocking);
}

#[test]
fn a_streak_as_long_as_a_client_queue_keeps_the_ring() {
    // A loaded xfs refuses every write in flight while one of them
    // waits (4 connections x QD8: 32): none is done blocking here, and
    // the first write it takes keeps the ring for good.
    let mut p = WritePath::new(InlineWrites::Auto);
    let (tries, blocking, ring, _) = drive(&mut p, 32, |_| Err(Errno::AGAIN));
    assert_eq!((tries, blocking, ring), (32, 0, 32));
    assert!(!p.inline_now());
    let (_, blocking, _, _) = drive(&mut p, 1000, |i| if i % 10 == 0 { Err(Errno::AGAIN) } else { Ok(4096) });
    assert_eq!(blocking, 0);
    assert_eq!(p.route(4096, false, Instant::now()), Route::Ring);
}

#[test]
fn a_success_after_eagains_keeps_the_ring() {
    let now = Instant::now();
    let mut p = WritePath::new(InlineWrites::Auto);
    p.nowait_done(Err(Errno::AGAIN));
    p.nowait_done(Err(Errno::AGAIN));
    p.nowait_done(Ok(512));
    assert_eq!(p.route(4096, false, now), Route::Ring);
}

#[test]
fn a_slow_write_that_slept_backs_off_for_a_while() {
    let now = Instant::now();
    let mut p = WritePath::new(InlineWrites::Auto);
    p.nowait_done(Err(Errno::OPNOTSUPP));
    // Slow without sleeping and on the CPU (a long copy): stays inline.
    p.blocking_done(SLOW * 5, false, false, false, now);
    assert_eq!(p.route(4096, false, now), Route::Blocking);
    // Slept but fast: stays inline.
    p.blocking_done(SLOW / 2, true, false, false, now);
    assert_eq!(p.route(4096, false, now), Route::Blocking);
    // Slow and slept: the ring until the backoff ends, then inline again.
    p.blocking_done(SLOW * 2, true, false, false, now);
    assert!(!p.inline_now());
    assert_eq!(p.route(4096, false, now), Route::Ring);
    assert_eq!(p.route(4096, false, now + BACKOFF / 2), Route::Ring);
    assert_eq!(p.route(4096, false, now + BACKOFF), Route::Blocking);
    assert!(p.inline_now());
}

/// A ring thread preempted in the middle of its inline writes (a
/// contended CPU) hands them to io_uring's workers for a while: more
/// threads get more of a contended CPU than one does.
#[test]
fn a_slow_write_that_was_preempted_backs_off_for_a_while() {
    let now = Instant::now();
    let mut p = WritePath::new(InlineWrites::Auto);
    p.nowait_done(Err(Errno::OPNOTSUPP));
    // Preempted but fast: stays inline.
    p.blocking_done(SLOW / 2, false, true, false, now);
    assert_eq!(p.route(4096, false, now), Route::Blocking);
    p.blocking_done(SLOW * 2, false, true, false, now);
    assert!(!p.inline_now());
    assert_eq!(p.route(4096, false, now + BACKOFF / 2), Route::Ring);
    assert_eq!(p.route(4096, false, now + BACKOFF), Route::Blocking);
}

/// A lone write (a QD1 client) that was preempted keeps writes inline: a
/// worker would be preempted as well and adds a hand-off each way. One
/// that slept still backs off: the ring must not wait on a slow device.
#[test]
fn a_lone_write_that_was_preempted_stays_inline() {
    let now = Instant::now();
    let mut p = WritePath::new(InlineWrites::Auto);
    p.nowait_done(Err(Errno::OPNOTSUPP));
    assert!(!p.blocking_done(SLOW * 2, false, true, true, now), "lone and preempted: no backoff");
    assert!(p.inline_now());
    assert_eq!(p.route(4096, false, now), Route::Blocking);
    assert!(p.blocking_done(SLOW * 2, true, false, true, now), "lone but slept: backs off");
    assert_eq!(p.route(4096, false, now + BACKOFF / 2), Route::Ring);
}

/// Off the CPU without a voluntary switch is preemption; with one, it
/// is a sleep; on the CPU the whole time, neither.
#[test]
fn the_snapshot_tells_preemption_from_sleep() {
    let now = Instant::now();
    let s = Snapshot { turn: now, switches: Some(10), wall: now - SLOW * 3, cpu: Duration::from_millis(5) };
    // 3 ms or more of wall time, 0.5 ms of it on the CPU, no switch: preempted.
    assert_eq!(s.since(Some(10), Duration::from_micros(5_500)), (false, true));
    // The same with a voluntary switch: slept.
    assert_eq!(s.since(Some(11), Duration::from_micros(5_500)), (true, false));
    // On the CPU the whole time (a long copy): neither.
    assert_eq!(s.since(Some(10), Duration::from_secs(3600)), (false, false));
    // Switches unreadable: counted as a sleep, as before.
    assert_eq!(s.since(None, Duration::from_secs(3600)), (true, false));
}

#[test]
fn off_never_probes_nor_inlines() {
    let now = Instant::now();
    let mut p = WritePath::new(InlineWrites::Off);
    assert_eq!(p.route(4096, false, now), Route::Ring);
    p.nowait_done(Err(Errno::OPNOTSUPP));
    assert_eq!(p.route(4096, false, now), Route::Ring);
    // Nor does it stamp the file's times here.
    p.nowait_done(Ok(4096));
    p.clock(Reading { coarse: 4_000_000, near_tick: true }, false);
    assert_eq!(p.route(4096, false, now), Route::Ring);
    assert_eq!("auto".parse::<InlineWrites>().ok(), Some(InlineWrites::Auto));
    assert_eq!("off".parse::<InlineWrites>().ok(), Some(InlineWrites::Off));
    assert!("on".parse::<InlineWrites>().is_err());
}

/// Routes `writes` 4 KiB writes through `p` with the file system
/// answering `answer` to each RWF_NOWAIT try; counts (tries, blocking,
/// ring) and says after which write the path first went to the ring.
fn drive(p: &mut WritePath, writes: u32, answer: impl Fn(u32) -> Result<usize, Errno>) -> (u32, u32, u32, Option<u32>) {
    let now = Instant::now();
    let (mut tries, mut blocking, mut ring, mut to_ring) = (0, 0, 0, None);
    for i in 0..writes {
        let route = match p.route(4096, false, now) {
            Route::Nowait => {
                tries += 1;
                let res = answer(i);
                p.nowait_done(res);
                if res.is_ok() {
                    continue;
                }
                p.refused(4096)
            }
            route => route,
        };
        match route {
            Route::Blocking => blocking += 1,
            Route::Ring => {
                ring += 1;
                to_ring.get_or_insert(i);
            }
            Route::Nowait => unreachable!("refused() never asks again"),
        }
    }
    (tries, blocking, ring, to_ring)
}

#[test]
fn a_passing_eagain_streak_is_undone_at_the_next_try() {
    let mut p = WritePath::new(InlineWrites::Auto);
    // Loaded: the probe gives up, every refused write done here.
    let (tries, blocking, ring, _) = drive(&mut p, PROBES as u32, |_| Err(Errno::AGAIN));
    assert_eq!((tries, blocking, ring), (PROBES as u32, 1, PROBES as u32 - 1));
    assert!(p.inline_now());
    // The load is gone: after the first gap they go through the ring
    // again, and stay.
    let (tries, blocking, _, to_ring) = drive(&mut p, 100, |_| Ok(4096));
    assert_eq!((tries, blocking, to_ring), (1, FIRST_GAP, Some(FIRST_GAP + 1)));
    assert!(!p.inline_now());
    assert_eq!(p.route(4096, false, Instant::now()), Route::Ring);
}

#[test]
fn a_late_success_is_found_within_reprobe_max_writes() {
    let mut p = WritePath::new(InlineWrites::Auto);
    // Long refused (ext4's answer), so the tries are as far apart as they get.
    drive(&mut p, 50 * REPROBE_MAX, |_| Err(Errno::OPNOTSUPP));
    assert_eq!(p.gap, REPROBE_MAX);
    // Then the file system takes them (the export's file moved, a kernel
    // that takes them): the ring again after at most REPROBE_MAX writes.
    let (tries, blocking, _, to_ring) = drive(&mut p, 3 * REPROBE_MAX, |_| Ok(4096));
    assert_eq!(tries, 1);
    assert!(blocking <= REPROBE_MAX, "{blocking} writes blocking before the next try");
    assert_eq!(to_ring, Some(blocking + 1));
}

#[test]
fn a_file_system_that_never_takes_them_is_tried_rarely_but_for_ever() {
    let writes = 1_000_000;
    for refusal in [Errno::OPNOTSUPP, Errno::AGAIN] {
        let mut p = WritePath::new(InlineWrites::Auto);
        let (tries, blocking, ring, _) = drive(&mut p, writes, |_| Err(refusal));
        // Every write but the first few EAGAINs is done here, the
        // refused tries included: none is handed to a worker.
        assert_eq!(ring, if refusal == Errno::AGAIN { PROBES as u32 - 1 } else { 0 }, "{refusal:?}");
        assert_eq!(blocking + ring, writes);
        // Past the probe, at most 0.1% of writes pay a refused syscall...
        let probe = if refusal == Errno::AGAIN { PROBES as u32 } else { 1 };
        assert!((tries - probe) * 1000 <= writes, "{refusal:?}: {tries} tries in {writes} writes");
        // ...and the question is still asked once per REPROBE_MAX writes.
        assert!(tries >= writes / (REPROBE_MAX + 1), "{refusal:?}: {tries} tries in {writes} writes");
    }
}

#[test]
fn the_gap_between_tries_doubles_up_to_the_cap() {
    let mut p = WritePath::new(InlineWrites::Auto);
    let now = Instant::now();
    assert_eq!(p.route(4096, false, now), Route::Nowait);
    p.nowait_done(Err(Errno::OPNOTSUPP));
    let mut gaps = Vec::new();
    let mut since = 0;
    for _ in 0..5 * REPROBE_MAX {
        match p.route(4096, false, now) {
            Route::Blocking => since += 1,
            Route::Nowait => {
                gaps.push(since);
                since = 0;
                p.nowait_done(Err(Errno::OPNOTSUPP));
            }
            Route::Ring => panic!("a small write refused is done here"),
        }
    }
    assert_eq!(&gaps[..10], &[8, 16, 32, 64, 128, 256, 512, 1024, 1024, 1024]);
}

#[test]
fn an_unanswered_try_is_asked_again_and_fua_writes_do_not_count() {
    let mut p = WritePath::new(InlineWrites::Auto);
    let now = Instant::now();
    p.nowait_done(Err(Errno::OPNOTSUPP));
    assert_eq!(p.route(4096, false, now), Route::Blocking);
    // FUA writes go through the ring and leave the count alone.
    for _ in 0..10 {
        assert_eq!(p.route(4096, true, now), Route::Ring);
    }
    for _ in 1..FIRST_GAP {
        assert_eq!(p.route(4096, false, now), Route::Blocking);
    }
    assert_eq!(p.route(4096, false, now), Route::Nowait);
    // The try never ran (no buffer, say): the next write tries.
    assert_eq!(p.route(1 << 20, false, now), Route::Nowait);
    // An error that says nothing about blocking waits longer too (no
    // file system failing every write is asked on every write)...
    p.nowait_done(Err(Errno::IO));
    assert!(p.inline_now());
    assert_eq!(p.gap, 2 * FIRST_GAP);
    // ...and a write over the largest refused still goes through the ring.
    assert_eq!(p.refused(INLINE_MAX + 1), Route::Ring);
    assert_eq!(p.refused(4096), Route::Blocking);
}

#[test]
fn no_tries_during_a_backoff() {
    let mut p = WritePath::new(InlineWrites::Auto);
    let now = Instant::now();
    p.nowait_done(Err(Errno::OPNOTSUPP));
    assert_eq!(p.route(4096, false, now), Route::Blocking);
    p.blocking_done(SLOW * 2, true, false, false, now);
    for _ in 0..10 {
        assert_eq!(p.route(4096, false, now), Route::Ring);
    }
    // After it, the count goes on where it was.
    for _ in 1..FIRST_GAP {
        assert_eq!(p.route(4096, false, now + BACKOFF), Route::Blocking);
    }
    assert_eq!(p.route(4096, false, now + BACKOFF), Route::Nowait);
    p.nowait_done(Ok(4096));
    assert_eq!(p.route(4096, false, now + BACKOFF), Route::Ring);
}

/// A path whose file system takes RWF_NOWAIT writes, told the clock.
fn ring_path(coarse: u64, near_tick: bool) -> WritePath {
    let mut p = WritePath::new(InlineWrites::Auto);
    p.nowait_done(Ok(4096));
    p.clock(Reading { coarse, near_tick }, false);
    p
}

/// No time stamp is written on the ring thread while one of the ring's
/// writes is in io_uring's workers: it may hold the inode's lock.
#[test]
fn no_stamp_here_while_a_write_is_in_the_workers() {
    let now = Instant::now();
    let mut p = ring_path(4_000_000, false);
    p.clock(Reading { coarse: 4_000_000, near_tick: false }, true);
    assert_eq!(p.route(4096, false, now), Route::Ring);
    p.clock(Reading { coarse: 4_000_000, near_tick: true }, true);
    assert_eq!(p.route(4096, false, now), Route::Ring);
    // Once it is done, the stamp it did not take is taken.
    p.clock(Reading { coarse: 4_000_000, near_tick: false }, false);
    assert_eq!(p.route(4096, false, now), Route::Blocking);
}

/// Through the ring, the first small write after the coarse clock moved is
/// done here (it moves the file's times, which a RWF_NOWAIT write may not),
/// and the rest of the tick's go through the ring. Before the rule every
/// write went through the ring, and the first of each tick took the rest
/// of the turn's to io_uring's workers behind it.
#[test]
fn the_first_write_of_a_tick_is_done_here() {
    let now = Instant::now();
    let mut p = ring_path(4_000_000, false);
    assert_eq!(p.route(4096, false, now), Route::Blocking);
    assert_eq!(p.route(4096, false, now), Route::Ring);
    assert_eq!(p.route(STAMP_MAX, false, now), Route::Ring);
    // The next tick: a large or FUA write does not take the stamp...
    p.clock(Reading { coarse: 8_000_000, near_tick: false }, false);
    assert_eq!(p.route(STAMP_MAX + 1, false, now), Route::Ring);
    assert_eq!(p.route(4096, true, now), Route::Ring);
    // ...the next small one does, once.
    assert_eq!(p.route(4096, false, now), Route::Blocking);
    assert_eq!(p.route(4096, false, now), Route::Ring);
    assert!(!p.inline_now(), "still a ring path");
}

/// While the tick is near (the vDSO's clock may not show it yet), every
/// small write is done here: whichever comes first after the kernel's
/// clock moved carries the stamp.
#[test]
fn every_write_near_the_tick_is_done_here() {
    let now = Instant::now();
    let mut p = ring_path(4_000_000, false);
    assert_eq!(p.route(4096, false, now), Route::Blocking);
    p.clock(Reading { coarse: 4_000_000, near_tick: true }, false);
    for _ in 0..5 {
        assert_eq!(p.route(4096, false, now), Route::Blocking);
    }
    assert_eq!(p.route(STAMP_MAX + 1, false, now), Route::Ring);
    p.clock(Reading { coarse: 8_000_000, near_tick: false }, false);
    assert_eq!(p.route(4096, false, now), Route::Blocking);
    assert_eq!(p.route(4096, false, now), Route::Ring);
}

/// A slow stamp write that slept sends the stamps to the ring's workers
/// for a while; the path stays a ring path (it does not turn inline).
#[test]
fn a_slow_stamp_backs_off_and_the_path_stays_on_the_ring() {
    let now = Instant::now();
    let mut p = ring_path(4_000_000, false);
    assert_eq!(p.route(4096, false, now), Route::Blocking);
    assert!(!p.blocking_done(SLOW / 2, true, false, false, now), "fast: no backoff");
    assert!(!p.blocking_done(SLOW * 2, false, true, false, now), "preempted, not slept: no backoff");
    assert!(p.blocking_done(SLOW * 2, true, false, false, now));
    p.clock(Reading { coarse: 8_000_000, near_tick: true }, false);
    assert_eq!(p.route(4096, false, now + BACKOFF / 2), Route::Ring);
    assert_eq!(p.route(4096, false, now + BACKOFF), Route::Blocking);
    p.clock(Reading { coarse: 12_000_000, near_tick: false }, false);
    assert_eq!(p.route(4096, false, now + BACKOFF), Route::Blocking);
    assert_eq!(p.route(4096, false, now + BACKOFF), Route::Ring);
    assert!(!p.inline_now());
}

/// An export on a real file, a ring path whose first reading is a new
/// coarse value, and a ring: what the stamp tests write through.
fn stamp_site() -> (tempfile::TempDir, std::sync::Arc<crate::export::Export>, WritePath, RingInline) {
    let dir = tempfile::tempdir().unwrap();
    let export = export_in(dir.path());
    (dir, export, ring_path(0, false), RingInline::default())
}

/// A ring path writes the stamp here on a real file.
#[test]
fn a_stamp_write_is_written() {
    let (dir, export, mut p, mut ring) = stamp_site();
    let data = [9u8; 4096];
    let write = write_of(&export, &data, 4096, false);
    // The ring's first reading is a new coarse value for this path.
    assert_eq!(ring.write(&mut p, write, Instant::now()), Some(4096));
    assert_eq!(export.stats.snapshot("a").inline_writes, 1);
    assert_eq!(std::fs::read(dir.path().join("img")).unwrap()[4096..], data);
}

/// What a ring submitted earlier and has not seen complete may be in
/// io_uring's workers: no stamp of that export is written here meanwhile;
/// another export's are.
#[test]
fn writes_of_earlier_submissions_still_in_flight_hold_the_stamps_back() {
    let (_dir, export, mut p, mut ring) = stamp_site();
    let data = [3u8; 4096];
    let write = || write_of(&export, &data, 0, false);
    let now = Instant::now();
    // Queued, not submitted yet: it holds nothing.
    let queued = ring.queued(export.id);
    let other = ring.queued(export.id + 1);
    assert_eq!(ring.write(&mut p, write(), now), Some(4096), "the first stamp");
    ring.submitted_all();
    // Submitted, and not complete: the next stamps wait for it. (Past any
    // backoff a slow first write on a loaded machine may have set.)
    let later = now + BACKOFF + Duration::from_millis(10);
    p.stamped = 0;
    assert_eq!(ring.write(&mut p, write(), later), None);
    // Another export's write landing changes nothing for this one.
    ring.landed(other);
    assert_eq!(ring.write(&mut p, write(), later + Duration::from_millis(5)), None);
    ring.landed(queued);
    assert_eq!(ring.write(&mut p, write(), later + Duration::from_millis(10)), Some(4096));
    assert_eq!(export.stats.snapshot("a").inline_writes, 2);
    ring.all_landed();
}

/// A starved ring still writes a ring path's time stamp itself: left to a
/// worker it would take the turn's writes along, and here it costs what
/// an RWF_NOWAIT write through the ring costs the ring.
#[test]
fn a_starved_ring_still_writes_the_stamp() {
    let (_dir, export, mut p, mut ring) = stamp_site();
    let data = [5u8; 4096];
    let w = write_of(&export, &data, 0, true);
    assert_eq!(ring.write(&mut p, w, Instant::now()), Some(4096));
    let st = export.stats.snapshot("a");
    assert_eq!((st.inline_writes, st.offloaded_writes), (1, 0), "{st:?}");
}
