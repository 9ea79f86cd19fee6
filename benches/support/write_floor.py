#!/usr/bin/env python3
"""How much of a write's server CPU is kernel work every NBD server pays?

Serves a 1 GiB image on a loop-mounted ext4 or xfs pool with nbdkit and
volring exactly as benches/nbd_peers.rs does (server on CPU 1, fio's nbd
engine on CPU 0, same fio arguments), runs the three write rows of issue 12
under `perf record -g -p SERVER`, and splits each server's samples by call
stack:

  fs        the file system's buffered write: a stack through
            ext4_buffered_write_iter / xfs_file_buffered_write /
            iomap_file_buffered_write / generic_perform_write (locks,
            timestamps, page-cache lookup and the copy into the page cache)
  rxcopy    the socket receive copy (skb_copy_datagram_iter and below;
            skb_splice_bits for a spliced receive)
  rxwake    waking the client from the receive path (its send buffer has
            room again: sk_write_space, from freeing the skb it sent)
  rxfree    freeing the received skbs and their pages (memcg uncharge)
  rxother   the rest of the receive syscalls (dequeue, socket locks, the
            server's own sleep when the payload is not there yet)
  tx        sending replies
  sched     context switches and wakeups outside the above
  kernel    any other kernel frame at the leaf (syscall entry, io_uring, ...)
  user      the server's own code

CPU per op comes from /proc/PID/stat over the fio run, as the bench does;
each category's µs/op is its share of the samples times that. The floor of
a row is (fs + rxcopy of nbdkit) / nbdkit's CPU per op: what a server that
did nothing but the file system's buffered write and one receive copy would
score against nbdkit. Goal 0.7 is out of reach for any page-cache server in
a row whose floor is above it. The wider "socket floor" adds what every
receiver of those bytes over this socket also pays per byte: freeing the
skbs the client sent and waking the client when its send buffer drains.

Root, inside a private mount namespace:
  unshare -m --propagation private python3 benches/support/write_floor.py \
      --volring target/release/volring [--pools ext4,xfs] [--secs 8] [--rounds 3]
Images and perf data live in a temporary directory under /tmp, removed at
the end.
"""

import argparse
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

IMAGE = 1 << 30
ROWS = [
    ("4K QD32", "randwrite", "4k", 32, 1),
    ("4 conn x QD8", "randwrite", "4k", 8, 4),
    ("1M QD8", "write", "1M", 8, 1),
]
FS = {"ext4_buffered_write_iter", "xfs_file_buffered_write", "iomap_file_buffered_write", "generic_perform_write"}
RXCOPY = {"skb_copy_datagram_iter", "__skb_datagram_iter", "skb_splice_bits"}
RX = {"unix_stream_recvmsg", "unix_stream_read_generic", "unix_stream_splice_read", "tcp_recvmsg", "sock_recvmsg",
      "__sys_recvfrom", "___sys_recvmsg", "sock_read_iter", "io_recv", "io_recvmsg", "io_read"}
TX = {"unix_stream_sendmsg", "sock_sendmsg", "sock_write_iter", "__sys_sendto", "___sys_sendmsg", "io_send", "io_sendmsg"}
RXWAKE = {"unix_write_space", "sock_def_write_space", "sk_stream_write_space", "__wake_up_sync_key"}
RXFREE = {"consume_skb", "kfree_skb_reason", "sk_skb_reason_drop", "__kfree_skb", "skb_release_data",
          "skb_release_head_state", "kfree_skbmem", "skb_free_head"}
SCHED = {"__schedule", "schedule", "try_to_wake_up", "finish_task_switch", "futex_wait", "futex_wake"}
CATS = ["fs", "rxcopy", "rxwake", "rxfree", "rxother", "tx", "sched", "kernel", "user"]


def sh(*args, **kw):
    return subprocess.run(args, check=True, **kw)


def cpu_seconds(pid):
    with open(f"/proc/{pid}/stat") as f:
        rest = f.read().rsplit(") ", 1)[1].split()
    return (int(rest[11]) + int(rest[12])) / 100.0


def make_pool(work, fs, fill):
    backing = os.path.join(work, f"pool-{fs}.img")
    with open(backing, "wb") as f:
        f.truncate(4 * IMAGE)
    sh(f"mkfs.{fs}", "-q", "-f" if fs == "xfs" else "-F", backing)
    mnt = os.path.join(work, f"pool-{fs}")
    os.makedirs(mnt)
    sh("mount", "-o", "loop", backing, mnt)
    img = os.path.join(mnt, "disk.img")
    with open(img, "wb") as f:
        # The bench writes its image 1 MiB at a time; the size of these
        # writes sets the size of the page-cache folios the WRITEs land in.
        for _ in range(IMAGE >> 20):
            block = os.urandom(1 << 20)
            for o in range(0, 1 << 20, fill):
                f.write(block[o:o + fill])
        f.flush()
        os.fsync(f.fileno())
    warm(img)
    return backing, mnt, img


def warm(img):
    with open(img, "rb") as f:
        while f.read(1 << 20):
            pass


def start(name, volring, mnt, img):
    sock = os.path.join(mnt, f"{name}.sock")
    if name == "volring":
        args = [volring, "nbd", "serve", "--nbd-threads", "1", "--unix", sock, "--export", f"disk={img}"]
    else:
        args = ["nbdkit", "-f", "-U", sock, "-t", "16", "file", img]
    log = open(os.path.join(os.path.dirname(mnt), f"{name}.log"), "w+")
    p = subprocess.Popen(["taskset", "-c", "1"] + args, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
    for _ in range(400):
        if os.path.exists(sock):
            break
        time.sleep(0.05)
    else:
        raise SystemExit(f"{name} never came up")
    time.sleep(0.3)
    return p, sock


def run(pid, sock, row, secs, perf_data):
    _, rw, bs, depth, jobs = row
    perf = subprocess.Popen(["perf", "record", "-q", "-F", "2000", "-g", "-p", str(pid), "-o", perf_data],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(1.0)
    before = cpu_seconds(pid)
    out = subprocess.run(
        ["taskset", "-c", "0", "fio", "--name=bench", "--ioengine=nbd", "--output-format=json", "--time_based",
         "--group_reporting", f"--uri=nbd+unix:///disk?socket={sock}", f"--rw={rw}", f"--bs={bs}",
         f"--iodepth={depth}", f"--numjobs={jobs}", f"--runtime={secs}", f"--size={IMAGE}"],
        check=True, capture_output=True, text=True).stdout
    cpu = cpu_seconds(pid) - before
    perf.send_signal(signal.SIGINT)
    perf.wait()
    doc = json.loads(out[out.index("{"):])
    job = doc["jobs"][0]["write"]
    ops = max(job["total_ios"], 1)
    return cpu / ops, job["iops"], split(perf_data)


DETAILED = False


def split(perf_data):
    """Samples per category, by each sample's call stack."""
    text = subprocess.run(["perf", "script", "-i", perf_data, "--no-inline", "-F", "comm,tid,ip,sym"],
                          capture_output=True, text=True, errors="replace").stdout
    counts = dict.fromkeys(CATS, 0)
    detail = {}
    for block in text.split("\n\n"):
        lines = [l.strip() for l in block.strip().splitlines()]
        if len(lines) < 2:
            continue
        frames = []
        for l in lines[1:]:
            parts = l.split(None, 1)
            frames.append((parts[0], re.sub(r"\+0x[0-9a-f]+$", "", parts[1]) if len(parts) > 1 else "?"))
        syms = {s for _, s in frames}
        if syms & FS:
            c = "fs"
        elif syms & RXCOPY:
            c = "rxcopy"
        elif syms & RX:
            c = "rxwake" if syms & RXWAKE else "rxfree" if syms & RXFREE else "rxother"
        elif syms & TX:
            c = "tx"
        elif syms & SCHED:
            c = "sched"
        elif frames[0][0].startswith("ffff"):
            c = "kernel"
        else:
            c = "user"
        counts[c] += 1
        # Where in the category the sample sits: for fs the callee of the
        # outermost file-system frame, elsewhere the leaf.
        where = frames[0][1]
        if c == "fs":
            inner = [i for i, (_, s) in enumerate(frames) if s in ("generic_perform_write", "iomap_write_iter")]
            top = max(inner) if inner else max(i for i, (_, s) in enumerate(frames) if s in FS)
            where = frames[top - 1][1] if top > 0 else frames[top][1]
            if DETAILED:
                where += ">" + frames[0][1]
        elif c == "sched" and DETAILED:
            # Which thread slept, and what it was waiting for.
            calls = [i for i, (_, s) in enumerate(frames) if s in ("schedule", "__schedule")]
            waiter = frames[max(calls) + 1][1] if calls and max(calls) + 1 < len(frames) else "?"
            where = lines[0].split()[0] + ":" + waiter
        key = (c, where)
        detail[key] = detail.get(key, 0) + 1
    counts["detail"] = detail
    return counts


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--volring", required=True)
    ap.add_argument("--pools", default="ext4,xfs")
    ap.add_argument("--secs", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--rows", default="0,1,2", help="which rows (0: 4K QD32, 1: 4 conn x QD8, 2: 1M QD8)")
    ap.add_argument("--fill", type=int, default=1 << 20, help="bytes per write when making the image (bench: 1 MiB)")
    ap.add_argument("--detailed", action="store_true", help="file-system samples by callee and leaf")
    a = ap.parse_args()
    global DETAILED
    DETAILED = a.detailed
    rows = [ROWS[int(i)] for i in a.rows.split(",")]
    work = tempfile.mkdtemp(prefix="write-floor-", dir="/tmp")
    results = []
    try:
        for fs in a.pools.split(","):
            backing, mnt, img = make_pool(work, fs, a.fill)
            servers = {n: start(n, os.path.abspath(a.volring), mnt, img) for n in ("volring", "nbdkit")}
            try:
                for row in rows:
                    per = {n: {"cpu": [], "iops": [], "counts": dict.fromkeys(CATS, 0), "detail": {}} for n in servers}
                    for r in range(a.rounds):
                        order = list(servers) if r % 2 == 0 else list(reversed(list(servers)))
                        for n in order:
                            warm(img)
                            p, sock = servers[n]
                            data = os.path.join(work, "perf.data")
                            cpu, iops, counts = run(p.pid, sock, row, a.secs, data)
                            os.unlink(data)
                            per[n]["cpu"].append(cpu)
                            per[n]["iops"].append(iops)
                            for k, v in counts.pop("detail").items():
                                per[n]["detail"][k] = per[n]["detail"].get(k, 0) + v
                            for k, v in counts.items():
                                per[n]["counts"][k] += v
                    results.append(report(fs, row[0], per))
            finally:
                for p, _ in servers.values():
                    p.kill()
                    p.wait()
                sh("umount", "-l", mnt)
                os.unlink(backing)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print("\nsummary (µs/op, medians of CPU per op; shared = fs + rxcopy; floor = nbdkit shared / nbdkit total;"
          " socket = shared + rxwake + rxfree)")
    print(f"{'row':<22}{'volring':>9}{'v shared':>9}{'nbdkit':>9}{'n shared':>9}{'n socket':>9}{'cpu ratio':>10}"
          f"{'floor':>7}{'sock floor':>11}")
    for r in results:
        print(f"{r['row']:<22}{r['v']:>9.2f}{r['vs']:>9.2f}{r['n']:>9.2f}{r['ns']:>9.2f}{r['nk']:>9.2f}"
              f"{r['v'] / r['n']:>10.2f}{r['ns'] / r['n']:>7.2f}{r['nk'] / r['n']:>11.2f}")


def report(fs, label, per):
    load = open("/proc/loadavg").read().split()[0]
    print(f"\n{fs} {label} (load {load}):")
    out = {"row": f"{fs} {label}"}
    for n, d in per.items():
        cpu = statistics.median(d["cpu"]) * 1e6
        total = max(sum(d["counts"].values()), 1)
        us = {k: cpu * v / total for k, v in d["counts"].items()}
        parts = "  ".join(f"{k} {us[k]:.2f}" for k in CATS)
        print(f"  {n:<8} {statistics.median(d['iops']) / 1e3:7.1f}k IOPS  CPU {cpu:6.2f} µs/op  ({total} samples)  {parts}")
        for c in CATS:
            top = sorted(((v, w) for (k, w), v in d["detail"].items() if k == c), reverse=True)[:10 if DETAILED else 6]
            if us[c] >= 0.05 * cpu:
                print(f"      {c:<8} " + ", ".join(f"{w} {cpu * v / total:.1f}" for v, w in top))
        out[n[0]] = cpu
        out[n[0] + "s"] = us["fs"] + us["rxcopy"]
        out[n[0] + "k"] = us["fs"] + us["rxcopy"] + us["rxwake"] + us["rxfree"]
    print(f"  shared (fs + rxcopy): volring {out['vs']:.2f}, nbdkit {out['ns']:.2f} µs/op; "
          f"CPU ratio {out['v'] / out['n']:.2f}; floor {out['ns'] / out['n']:.2f}; "
          f"socket floor {out['nk'] / out['n']:.2f}")
    sys.stdout.flush()
    return out


if __name__ == "__main__":
    main()
