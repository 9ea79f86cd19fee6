//! The receive pool's recovery when the kernel loses provided buffers.

use std::io::Write;
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::time::Duration;

use super::*;

fn small_ring() -> IoRing {
    let cfg = IoRingConfig {
        sq_entries: 32,
        cq_entries: 64,
        files: 8,
        arena_slots: 1,
        arena_slot_size: 4096,
        heap_cache: 0,
        recv_bufs: 4,
        recv_buf_size: 4096,
    };
    IoRing::new(&cfg).expect("io_uring with provided buffer rings")
}

/// Waits (bounded) for the completions of `token`'s op until its last one.
fn until_ended(ring: &mut IoRing, token: u64) -> Vec<Cqe> {
    let mut seen = Vec::new();
    for _ in 0..50 {
        ring.submit_and_wait_for(1, Some(Duration::from_millis(100))).expect("wait");
        let mut out = Vec::new();
        ring.complete(&mut out);
        let ended = out.iter().any(|c| c.token == token && !c.more);
        seen.extend(out);
        if ended {
            return seen;
        }
    }
    panic!("op {token} did not end: {seen:?}");
}

/// As Debian 12's 6.1 kernel does when multishot receives are cancelled:
/// the kernel's ring is empty although the pool gave it every buffer. The
/// ring must notice (not re-arm into ENOBUFS forever) and hand the pool
/// over afresh; afterwards receives land in buffers again.
#[test]
fn buffers_the_kernel_lost_are_noticed_and_handed_over_afresh() {
    let mut ring = small_ring();
    let (mut peer, ours) = UnixStream::pair().unwrap();
    let socket = ring.register_file(ours.as_raw_fd()).unwrap();
    // The kernel's view: a registered ring with nothing in it.
    ring.core.submitter().unregister_buf_ring(ring.recv.group).unwrap();
    ring.recv.forget_all();
    // SAFETY: the ring memory belongs to `ring.recv`, which outlives this use.
    unsafe { ring.core.submitter().register_buf_ring_with_flags(ring.recv.ring_addr(), ring.recv.entries(), ring.recv.group, 0) }.unwrap();

    peer.write_all(b"first").unwrap();
    ring.recv_multi(1, socket).unwrap();
    let done = until_ended(&mut ring, 1);
    assert_eq!(done.last().map(|c| c.result), Some(-libc::ENOBUFS), "{done:?}");
    assert!(ring.stats().recv_pool_lost, "every buffer was given and none came back: lost");
    assert_eq!(ring.stats().armed_recvs, 0);

    ring.reset_recv_pool().unwrap();
    assert!(!ring.stats().recv_pool_lost);
    assert_eq!(ring.stats().recv_pool_resets, 1);
    let op = ring.recv_multi(2, socket).unwrap();
    let got = until_ended_or_data(&mut ring, 2);
    let bid = got.recv_buf.expect("a provided buffer again");
    assert_eq!(ring.received(bid, got.result as usize).0, b"first");
    ring.recycle(bid);
    ring.cancel(op).unwrap();
    until_ended(&mut ring, 2);
}

/// An ordinary ENOBUFS (the driver still holds buffers) is not a loss, and
/// a buffer recycled twice enters the ring once.
#[test]
fn a_pool_drained_by_the_driver_is_not_a_loss() {
    let mut ring = small_ring();
    let (mut peer, ours) = UnixStream::pair().unwrap();
    let socket = ring.register_file(ours.as_raw_fd()).unwrap();
    let mut held = Vec::new();
    // Four buffers, taken one 4 KiB chunk each and kept by the driver.
    for i in 0..4u64 {
        peer.write_all(&[i as u8; 4096]).unwrap();
        let op = ring.recv_multi(10 + i, socket).unwrap();
        let c = until_ended_or_data(&mut ring, 10 + i);
        held.push(c.recv_buf.expect("a buffer"));
        if c.more {
            ring.cancel(op).unwrap();
            until_ended(&mut ring, 10 + i);
        }
    }
    peer.write_all(b"more").unwrap();
    ring.recv_multi(20, socket).unwrap();
    let done = until_ended(&mut ring, 20);
    assert_eq!(done.last().map(|c| c.result), Some(-libc::ENOBUFS), "{done:?}");
    assert!(!ring.stats().recv_pool_lost, "the driver held every buffer: an ordinary ENOBUFS");
    ring.recycle(held[0]);
    ring.recycle(held[0]);
    assert_eq!(ring.recv.taken(), 3, "a second recycle of one buffer is ignored");
}

/// Waits (bounded) for the first completion of `token` that carries data.
fn until_ended_or_data(ring: &mut IoRing, token: u64) -> Cqe {
    for _ in 0..50 {
        ring.submit_and_wait_for(1, Some(Duration::from_millis(100))).expect("wait");
        let mut out = Vec::new();
        ring.complete(&mut out);
        if let Some(c) = out.into_iter().find(|c| c.token == token && (c.recv_buf.is_some() || !c.more)) {
            return c;
        }
    }
    panic!("op {token} gave nothing");
}

/// A multishot receive whose completions are all posted before the driver
/// reaps any: the data completions (F_MORE) and the last one (ENOBUFS, the
/// pool ran dry) come out of one reap. The last one takes the op out of the
/// table; the data completions before it must still be delivered under the
/// op's token. They once were dropped: their bytes never reached the NBD
/// server and their buffers were never recycled, so the pool looked held
/// by the driver, every later receive ended at once with ENOBUFS and the
/// ring spun re-arming it (the "6.1 stall": a slow ring thread, as under
/// TCG, reaps in large batches).
#[test]
fn completions_reaped_together_with_their_ops_last_one_are_delivered() {
    let mut ring = small_ring();
    let (mut peer, ours) = UnixStream::pair().unwrap();
    let socket = ring.register_file(ours.as_raw_fd()).unwrap();
    // More than the four 4 KiB buffers hold, so the receive ends ENOBUFS.
    let sent: Vec<u8> = (0..5 * 4096).map(|i| (i % 251) as u8).collect();
    peer.write_all(&sent).unwrap();
    ring.recv_multi(30, socket).unwrap();
    // Submitted, then left alone: the kernel posts every completion
    // (receives with data waiting complete at submission) before the reap.
    ring.submit_and_wait_for(0, None).unwrap();
    std::thread::sleep(Duration::from_millis(50));
    let done = until_ended(&mut ring, 30);
    assert!(done.iter().all(|c| c.token == 30), "{done:?}");
    assert_eq!(done.last().map(|c| c.result), Some(-libc::ENOBUFS), "{done:?}");
    let mut got = Vec::new();
    for c in done.iter().filter(|c| c.recv_buf.is_some()) {
        let bid = c.recv_buf.expect("filtered");
        got.extend_from_slice(ring.received(bid, c.result as usize).0);
        ring.recycle(bid);
    }
    assert_eq!(got.len(), 4 * 4096, "every buffer's bytes delivered: {done:?}");
    assert_eq!(got[..], sent[..4 * 4096]);
    assert_eq!(ring.stats().recv_taken, 0, "every buffer handed out came back");
}

#[test]
fn the_ring_refuses_operations_outside_its_list() {
    let mut ring = small_ring();
    // NOP is not one of the server's operations: the restriction refuses it.
    let ud = u64::MAX - 7;
    // SAFETY: a NOP points at no memory.
    unsafe { ring.core.push(&opcode::Nop::new().build().user_data(ud)) }.expect("queued");
    ring.core.submit_and_wait(1, Some(Duration::from_secs(2))).expect("wait");
    let mut reaped = Vec::new();
    ring.core.reap(&mut reaped);
    let nop = reaped.iter().find(|r| r.user_data == ud).expect("the NOP completed");
    assert_eq!(nop.res, -libc::EACCES, "a NOP on the NBD server's ring");
    // Its own operations still run.
    ring.timeout(1, Duration::from_millis(1)).expect("timeout");
    let done = until_ended(&mut ring, 1);
    assert_eq!(done.last().map(|c| c.result), Some(-libc::ETIME));
}

#[test]
fn a_missing_operation_is_named() {
    assert_eq!(missing_opcode(|_| true), None);
    let splice = opcode::Splice::CODE;
    assert_eq!(missing_opcode(|code| code != splice), Some("SPLICE"));
    let e = MissingOpcode { name: "SPLICE" };
    assert!(e.to_string().contains("IORING_OP_SPLICE"), "{e}");
}

#[test]
fn more_ops_than_the_completion_queue_holds_wait_and_none_is_lost() {
    let cfg = IoRingConfig {
        sq_entries: 8,
        cq_entries: 16,
        files: 8,
        arena_slots: 1,
        arena_slot_size: 4096,
        heap_cache: 0,
        recv_bufs: 4,
        recv_buf_size: 4096,
    };
    let mut ring: IoRing = IoRing::new(&cfg).expect("ring");
    let n = 200u64;
    for t in 0..n {
        ring.timeout(t, Duration::from_millis(20)).expect("timeout");
    }
    let (in_kernel, waiting) = ring.in_kernel();
    let mut seen = std::collections::BTreeSet::new();
    for _ in 0..200 {
        ring.submit_and_wait_for(1, Some(Duration::from_millis(100))).expect("wait");
        assert!(!ring.core.cq_overflowed(), "completions went past the queue");
        assert!(in_kernel <= 16, "{in_kernel} entries in the kernel for a queue of 16");
        assert!(waiting > 0, "the rest wait");
        let mut out = Vec::new();
        ring.complete(&mut out);
        for c in out {
            assert_eq!(c.result, -libc::ETIME);
            assert!(seen.insert(c.token), "token {} twice", c.token);
        }
        assert!(ring.in_kernel().0 <= 16);
        if seen.len() as u64 == n {
            break;
        }
    }
    assert_eq!(seen.len() as u64, n, "every timeout completed once");
    assert_eq!(ring.stats().in_flight, 0);
}

/// A read handed to io_uring's workers (IOSQE_ASYNC, which the ring's
/// restrictions must let through) reads what a plain one does.
#[test]
fn a_read_in_a_worker_reads_the_file() {
    let mut ring = small_ring();
    let mut file = tempfile::tempfile().expect("temporary file");
    let data: Vec<u8> = (0..8192u32).map(|i| (i * 7 % 251) as u8).collect();
    file.write_all(&data).expect("write");
    let slot = ring.register_file(file.as_raw_fd()).expect("fixed file");
    for (token, offset, worker) in [(1u64, 4096u64, true), (2, 100, false), (3, 0, true)] {
        let buf = ring.buffers().alloc(4096);
        if worker {
            ring.read_async(token, slot, (buf, 0, 4096), offset).expect("read in a worker");
        } else {
            ring.read(token, slot, (buf, 0, 4096), offset).expect("read");
        }
        let done = until_ended(&mut ring, token);
        assert_eq!(done.iter().find(|c| c.token == token).map(|c| c.result), Some(4096), "{done:?}");
        let got = ring.buffers().get(buf).expect("the buffer").to_vec();
        assert_eq!(&got[..4096], &data[offset as usize..offset as usize + 4096], "read {token}");
        ring.buffers().free(buf);
    }
}

/// Sends `pieces` pieces of `piece` bytes to a MSG_WAITALL receive of
/// them all, one every `gap`, while `poll` runs; returns what it returned
/// and whether the receive then ends with every byte in place.
fn poll_a_trickled_payload(piece: usize, pieces: usize, gap: Duration, poll: impl FnOnce(&mut IoRing) -> bool) -> (bool, bool) {
    let mut ring = small_ring();
    let (mut peer, ours) = UnixStream::pair().unwrap();
    let socket = ring.register_file(ours.as_raw_fd()).unwrap();
    let buf = ring.buffers().alloc(piece * pieces);
    ring.submit(1, Sqe::RecvInto { socket, into: (buf, 0, piece * pieces) }).unwrap();
    let writer = std::thread::spawn(move || {
        for i in 0..pieces {
            if i > 0 {
                std::thread::sleep(gap);
            }
            peer.write_all(&vec![i as u8; piece]).unwrap();
        }
        peer
    });
    let found = poll(&mut ring);
    let _peer = writer.join().unwrap();
    let done = until_ended(&mut ring, 1);
    let whole = done.iter().any(|c| c.token == 1 && c.result == (piece * pieces) as i32)
        && ring.buffers().get(buf).expect("given back").chunks(piece).enumerate().all(|(i, p)| p.iter().all(|&b| b == i as u8));
    (found, whole)
}

/// While a MSG_WAITALL receive takes a payload piece by piece, each piece
/// is task work, not a completion: a plain poll runs out at the end of its
/// window, before the last piece, while a poll whose window starts again at
/// each piece lasts until the payload is whole, for at most the time it was
/// given. Eight pieces 100 ms apart take at least 700 ms: past the 400 ms
/// window, and past the 500 ms limit of the last case by 200 ms; each gap
/// is 300 ms inside the window. The window starts again only where the
/// kernel defers task work to the ring's thread (DEFER_TASKRUN, Linux 6.1).
#[test]
fn a_poll_restarted_by_each_arrival_lasts_as_long_as_the_bytes_keep_coming() {
    const WINDOW: Duration = Duration::from_millis(400);
    const GAP: Duration = Duration::from_millis(100);
    let (_, deferred) = RingSetup { entries: 8, cq_entries: None, server: true, disabled: false }.build().expect("a ring");
    if deferred {
        let (found, whole) = poll_a_trickled_payload(1024, 8, GAP, |r| r.poll_for(WINDOW, Duration::from_secs(1)).unwrap());
        assert!(found && whole, "the poll lasted until the payload was whole: {found} {whole}");
    }
    let (found, whole) = poll_a_trickled_payload(1024, 8, GAP, |r| r.poll_for(WINDOW, WINDOW).unwrap());
    assert!(!found && whole, "a plain poll ran out before the last piece: {found} {whole}");
    let (found, whole) = poll_a_trickled_payload(1024, 8, GAP, |r| r.poll_for(WINDOW, Duration::from_millis(500)).unwrap());
    assert!(!found && whole, "a poll ends at its limit however steadily bytes come: {found} {whole}");
}

/// A poll sees a request that arrives while it polls. With DEFER_TASKRUN
/// the bytes become a completion only when the ring's own thread runs the
/// task work the socket's wake-up queued; the poll sees that work through
/// the ring's TASKRUN flag and runs it. (Without TASKRUN_FLAG in the ring's
/// setup nothing tells the poll, which runs out empty: this test then fails
/// after its ten-second window.)
#[test]
fn a_poll_finds_a_receive_that_arrives_while_it_polls() {
    let mut ring = small_ring();
    let (mut peer, ours) = UnixStream::pair().unwrap();
    let socket = ring.register_file(ours.as_raw_fd()).unwrap();
    let op = ring.recv_multi(1, socket).unwrap();
    let started = std::time::Instant::now();
    assert!(!ring.poll_for(Duration::from_millis(5), Duration::ZERO).unwrap(), "nothing was sent: the poll runs out");
    let took = started.elapsed();
    assert!(took >= Duration::from_millis(5), "the poll ran its whole window: {took:?}");
    assert!(took < Duration::from_secs(5), "and then stopped: {took:?}");
    let started = std::time::Instant::now();
    assert!(!ring.poll_for(Duration::from_secs(3600), Duration::ZERO).unwrap(), "a window past a second is cut to one");
    assert!(started.elapsed() < Duration::from_secs(5), "{:?}", started.elapsed());

    let writer = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(20));
        peer.write_all(b"ping").unwrap();
        peer
    });
    let found = ring.poll_for(Duration::from_secs(10), Duration::ZERO).unwrap();
    let _peer = writer.join().unwrap();
    assert!(found, "the bytes arrived while the ring polled");
    let mut out = Vec::new();
    ring.complete(&mut out);
    let got = out.iter().find(|c| c.token == 1 && c.recv_buf.is_some()).expect("the receive's completion was ready to reap");
    let bid = got.recv_buf.unwrap();
    assert_eq!(ring.received(bid, got.result as usize).0, b"ping");
    ring.recycle(bid);
    ring.cancel(op).unwrap();
    until_ended(&mut ring, 1);
}

/// A receive once takes at most the length asked for into a provided
/// buffer and leaves the rest in the socket (what a receive straight into
/// a buffer of the caller's then gets); while armed it counts as a receive
/// from the pool, so the pool is not handed over under it.
#[test]
fn a_receive_once_takes_no_byte_past_its_length() {
    let mut ring = small_ring();
    let (mut peer, ours) = UnixStream::pair().unwrap();
    let socket = ring.register_file(ours.as_raw_fd()).unwrap();
    ring.submit(1, Sqe::RecvOnce { socket, len: 5 }).unwrap();
    assert_eq!(ring.stats().armed_recvs, 1);
    assert!(ring.reset_recv_pool().is_err(), "a receive from the pool is armed");
    peer.write_all(b"head-and-the-rest").unwrap();
    let done = until_ended(&mut ring, 1);
    let c = done.iter().find(|c| c.token == 1).expect("its completion");
    assert!(!c.more, "once: {done:?}");
    let bid = c.recv_buf.expect("a provided buffer");
    assert_eq!(ring.received(bid, c.result as usize).0, b"head-");
    ring.recycle(bid);
    assert_eq!(ring.stats().armed_recvs, 0);
    let buf = ring.buffers().alloc(64);
    ring.submit(2, Sqe::RecvInto { socket, into: (buf, 0, 12) }).unwrap();
    let done = until_ended(&mut ring, 2);
    assert_eq!(done.iter().find(|c| c.token == 2).map(|c| c.result), Some(12), "{done:?}");
    assert_eq!(&ring.buffers().get_mut(buf).expect("given back")[..12], b"and-the-rest");
}

/// A write from a provided receive buffer keeps the buffer out of the
/// kernel's hands until it ends, even when the driver recycles it first
/// (as the NBD server does right after splitting a receive into requests):
/// a receive landing in it meanwhile would change the bytes being written.
/// A buffer the driver does not hold cannot be lent.
#[test]
fn a_provided_buffer_lent_to_a_write_is_recycled_when_the_write_ends() {
    let mut ring = small_ring();
    let (mut peer, ours) = UnixStream::pair().unwrap();
    let socket = ring.register_file(ours.as_raw_fd()).unwrap();
    let file = tempfile::tempfile().expect("temporary file");
    let slot = ring.register_file(file.as_raw_fd()).expect("fixed file");
    peer.write_all(b"headerPAYLOAD").unwrap();
    ring.recv_once(1, socket, 13).unwrap();
    let got = until_ended_or_data(&mut ring, 1);
    let bid = got.recv_buf.expect("a provided buffer");
    assert!(ring.submit(9, Sqe::WriteReceived { file: slot, from: ((bid + 1) % 4, 0, 4), offset: 0, dsync: false }).is_err());
    ring.submit(2, Sqe::WriteReceived { file: slot, from: (bid, 6, 13), offset: 100, dsync: false }).expect("lent");
    ring.recycle(bid);
    let stats = ring.stats();
    assert_eq!((stats.recv_taken, stats.recv_lent), (1, 1), "recycled while a write reads it: still out of the kernel's hands");
    assert!(
        ring.submit(3, Sqe::WriteReceived { file: slot, from: (bid, 0, 6), offset: 0, dsync: false }).is_err(),
        "recycled: not the driver's to lend"
    );
    let done = until_ended(&mut ring, 2);
    assert_eq!(done.iter().find(|c| c.token == 2).map(|c| c.result), Some(7), "{done:?}");
    let stats = ring.stats();
    assert_eq!((stats.recv_taken, stats.recv_lent), (0, 0), "back to the kernel with the write's end");
    let mut written = [0u8; 7];
    rustix::io::pread(&file, &mut written, 100).expect("read back");
    assert_eq!(&written, b"PAYLOAD");
}

/// A trim gives the receive pool's pages back once no receive from it is
/// armed and the driver holds no buffer (a stream of receives leaves every
/// buffer resident: the NBD server kept its 8 MiB pool after the bench's
/// hostile clients had left), and not before: the kernel could write a
/// buffer as its page is dropped. Receives armed after land in fresh pages.
#[test]
fn an_idle_trim_gives_the_receive_pools_pages_back_only_with_no_receive_armed() {
    let mut ring = small_ring();
    let (mut peer, ours) = UnixStream::pair().unwrap();
    let socket = ring.register_file(ours.as_raw_fd()).unwrap();
    peer.write_all(b"resident").unwrap();
    let op = ring.recv_multi(1, socket).unwrap();
    let got = until_ended_or_data(&mut ring, 1);
    let bid = got.recv_buf.expect("a provided buffer");
    ring.recycle(bid);
    // Armed: the pages stay, bytes and all (read here only because the peer
    // sends nothing more: the buffer is the kernel's again).
    ring.trim(0);
    assert_eq!(ring.received(bid, 8).0, b"resident", "a trim with a receive armed dropped the pool's pages");
    ring.cancel(op).unwrap();
    until_ended(&mut ring, 1);
    assert_eq!(ring.stats().armed_recvs, 0);
    ring.trim(0);
    assert_eq!(ring.received(bid, 8).0, [0u8; 8], "no receive armed: the pool's pages went back");
    // A receive armed afterwards lands in the pool as before.
    peer.write_all(b"again").unwrap();
    let op = ring.recv_multi(2, socket).unwrap();
    let got = until_ended_or_data(&mut ring, 2);
    let bid = got.recv_buf.expect("a provided buffer");
    assert_eq!(ring.received(bid, got.result as usize).0, b"again");
    ring.cancel(op).unwrap();
    until_ended(&mut ring, 2);
    // No receive armed, but the driver still holds the buffer: its bytes stay.
    ring.trim(0);
    assert_eq!(ring.received(bid, 5).0, b"again", "a trim dropped a buffer the driver holds");
    // Given back: the next trim drops the pages again.
    ring.recycle(bid);
    ring.trim(0);
    assert_eq!(ring.received(bid, 5).0, [0u8; 5], "re-armed and ended: the pool's pages go back again");
}

/// A send `at_once` ends in the very enter that hands it to the kernel:
/// with the bytes sent while the socket has room, then EAGAIN once it is
/// full (the peer reads nothing). Until it is reaped it counts as
/// settling. An ordinary send to the full socket waits for room instead,
/// and ends only when the peer reads.
#[test]
fn an_at_once_send_ends_in_the_submit_that_hands_it_over() {
    let mut ring = small_ring();
    let (mut peer, ours) = UnixStream::pair().unwrap();
    let socket = ring.register_file(ours.as_raw_fd()).unwrap();
    let mut full = false;
    let mut sent = 0usize;
    for i in 0..10_000u64 {
        let buf = ring.buffers().alloc(4096);
        ring.submit(i, Sqe::Send { socket, parts: &[(buf, 0, 4096)], at_once: true }).unwrap();
        assert_eq!(ring.stats().settling, 1, "queued at once");
        ring.submit_and_wait_for(0, None).unwrap();
        let mut out = Vec::new();
        ring.complete(&mut out);
        let c = out.iter().find(|c| c.token == i).unwrap_or_else(|| panic!("send {i} did not end in its submit: {out:?}"));
        assert_eq!(ring.stats().settling, 0, "reaped");
        ring.buffers().free(buf);
        if c.result == -libc::EAGAIN {
            full = true;
            break;
        }
        assert!(c.result > 0, "{c:?}");
        sent += c.result as usize;
    }
    assert!(full && sent > 0, "the socket filled after {sent} bytes");

    let buf = ring.buffers().alloc(4096);
    ring.submit(u64::MAX, Sqe::Send { socket, parts: &[(buf, 0, 4096)], at_once: false }).unwrap();
    assert_eq!(ring.stats().settling, 0, "an ordinary send does not settle at once");
    ring.submit_and_wait_for(0, None).unwrap();
    let mut out = Vec::new();
    ring.complete(&mut out);
    assert!(out.iter().all(|c| c.token != u64::MAX), "it waits for room: {out:?}");
    let reader = std::thread::spawn(move || {
        let mut all = vec![0u8; sent + 4096];
        std::io::Read::read_exact(&mut peer, &mut all).map(|_| peer)
    });
    let done = until_ended(&mut ring, u64::MAX);
    assert_eq!(done.iter().find(|c| c.token == u64::MAX).map(|c| c.result), Some(4096), "{done:?}");
    let _peer = reader.join().unwrap().expect("the peer read every byte");
    ring.buffers().free(buf);
}

/// A poll with nothing queued makes no system call unless the kernel
/// flags task work (a receive's completion): it only looks at the rings.
#[test]
fn a_poll_with_nothing_queued_does_not_enter_the_kernel() {
    let mut ring = small_ring();
    let (_peer, ours) = UnixStream::pair().unwrap();
    let socket = ring.register_file(ours.as_raw_fd()).unwrap();
    let op = ring.recv_multi(1, socket).unwrap();
    ring.submit_and_wait_for(0, None).unwrap();
    let before = ring.stats().enters;
    assert!(!ring.poll_for(Duration::from_millis(5), Duration::ZERO).unwrap(), "nothing was sent");
    assert_eq!(ring.stats().enters, before, "the poll entered the kernel with nothing to hand over");
    ring.cancel(op).unwrap();
    until_ended(&mut ring, 1);
}

/// A wait with a window, for one completion more than an at-once send
/// posts, ends when the window passes, with the send's completion there:
/// with min_wait (Linux 6.12+) and with the ordinary timeout older kernels
/// get. (Before 6.12 an enter that also submits dropped min_wait's EINVAL
/// and did not wait at all.) Nothing else comes for seconds: a wait that
/// did not end at the window would run into the peer's late bytes.
#[test]
fn a_wait_with_a_window_ends_when_it_passes_on_every_kernel() {
    for no_min_wait in [false, true] {
        let mut ring = small_ring();
        ring.no_min_wait |= no_min_wait;
        let (mut peer, ours) = UnixStream::pair().unwrap();
        let socket = ring.register_file(ours.as_raw_fd()).unwrap();
        let op = ring.recv_multi(1, socket).unwrap();
        let buf = ring.buffers().alloc(64);
        ring.submit(2, Sqe::Send { socket, parts: &[(buf, 0, 64)], at_once: true }).unwrap();
        let late = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_secs(2));
            let _ = peer.write_all(b"late");
            peer
        });
        let started = std::time::Instant::now();
        ring.submit_and_wait(2, Some(Duration::from_millis(20))).unwrap();
        let took = started.elapsed();
        let mut out = Vec::new();
        ring.complete(&mut out);
        assert!(out.iter().any(|c| c.token == 2 && c.result == 64), "the send's completion: {out:?}");
        assert!(took >= Duration::from_millis(15), "no_min_wait {no_min_wait}: it did not wait ({took:?})");
        assert!(took < Duration::from_millis(1500), "no_min_wait {no_min_wait}: it waited past the window ({took:?})");
        let _peer = late.join().unwrap();
        ring.cancel(op).unwrap();
        until_ended(&mut ring, 1);
        ring.buffers().free(buf);
    }
}
