#!/bin/sh
# Runs in the VM (tests/vm/nbd.rs boots it): the kernel's nbd driver against
# `volring nbd attach`, served from that process over socketpairs.
#
#   attach (netlink CONNECT, backend id) -> mkfs.ext4 -> a writer writes and
#   fsyncs files in a loop -> kill -9 the serving process -> a new process
#   re-attaches with RECONFIGURE -> the writer resumes -> every write
#   succeeded, the data verify, no I/O error, errors_count 0, e2fsck clean.
#   Also: a reattach with another backend id is refused; detach.
#
# Environment: VOLRING (the binary), CONNS (connections, default 2),
# THREADS (--nbd-threads, default 0: one per vCPU), FILES (default 96),
# FILE_KIB (default 512), KILL_AT (files written before the kill, default 24),
# DOWN (seconds the server stays dead, default 2), CYCLES (kill/reattach
# rounds, default 3), NO_REATTACH=1 with DEAD_CONN_TIMEOUT=N: the control
# run, where nobody re-attaches and the writer must fail. Results in $VM_RESULTS.

set -u
: "${VOLRING:?}" "${VM_RESULTS:?}"
CONNS=${CONNS:-2}
THREADS=${THREADS:-0}
FILES=${FILES:-96}
FILE_KIB=${FILE_KIB:-512}
KILL_AT=${KILL_AT:-24}
DOWN=${DOWN:-2}
CYCLES=${CYCLES:-3}
R=$VM_RESULTS
# What every live serving process's threads are doing (state, wait
# channel, kernel stack, CPU ticks twice 1 s apart): a stalled ring shows
# whether it blocks, spins or waits.
threads() {
  for pidfile in "$R"/*.pid; do
    pid=$(cat "$pidfile")
    kill -0 "$pid" 2>/dev/null || continue
    for pass in 1 2; do
      for t in /proc/"$pid"/task/*; do
        echo "$(basename "$pidfile") pass $pass tid $(basename "$t") $(cut -d' ' -f2,3,14,15 "$t/stat") wchan=$(cat "$t/wchan")"
        [ $pass = 2 ] && sed 's/^/    /' "$t/stack" 2>/dev/null
      done
      [ $pass = 1 ] && sleep 1
    done
  done
}
fail() { echo "FAIL: $*"; echo "FAIL: $*" >>"$R/verdict"; threads; exit 1; }

modprobe nbd nbds_max=4 || fail "modprobe nbd"
img=/tmp/vol.img
truncate -s 256M "$img"
mkdir -p /mnt/v

# Starts a serving process; waits (bounded) for its "attached" line.
serve() { # name, extra args...
  name=$1; shift
  "$VOLRING" nbd attach --export "vol=$img" --connections "$CONNS" --nbd-threads "$THREADS" \
    --timeout 3 "$@" >"$R/$name.out" 2>"$R/$name.err" &
  echo $! >"$R/$name.pid"
  i=0
  while ! grep -q '"attached"' "$R/$name.out" 2>/dev/null; do
    i=$((i + 1))
    [ $i -gt 600 ] && fail "$name: no attached line after 60 s: $(cat "$R/$name.err")"
    kill -0 "$(cat "$R/$name.pid")" 2>/dev/null || fail "$name exited: $(cat "$R/$name.err")"
    sleep 0.1
  done
}

serve first --backend-id pvc-smoke --index 0 --dead-conn-timeout "${DEAD_CONN_TIMEOUT:-60}"
[ "$(cat /sys/block/nbd0/backend)" = pvc-smoke ] || fail "backend is $(cat /sys/block/nbd0/backend)"
"$VOLRING" nbd status --json >"$R/status.json" || fail "status"
grep -q '"connected":true' "$R/status.json" || fail "status: $(cat "$R/status.json")"
mkfs.ext4 -q -F /dev/nbd0 || fail "mkfs"
mount /dev/nbd0 /mnt/v || fail "mount"

# The writer (lib.sh): FILES files, each fsynced.
MAXF=$FILES
start_writer file /mnt/v

if [ "${NO_REATTACH:-0}" = 1 ]; then
  # The control: nobody re-attaches. Once the dead-connection timeout
  # passes the kernel fails the I/O, and the writer sees it.
  i=0
  while [ "$(wc -l <"$R/writes")" -lt "$KILL_AT" ]; do
    i=$((i + 1))
    [ $i -gt 600 ] && fail "writer too slow ($(wc -l <"$R/writes") writes)"
    sleep 0.5
  done
  kill -9 "$(cat "$R/first.pid")"
  t_kill=$(now)
  i=0
  while kill -0 $writer 2>/dev/null; do
    i=$((i + 1))
    [ $i -gt 1200 ] && fail "without a reattach the writer still waits after 120 s"
    sleep 0.1
  done
  if wait $writer; then fail "without a reattach every write still succeeded"; fi
  dmesg | grep -q 'I/O error, dev nbd0' || fail "no I/O error in dmesg without a reattach"
  echo "ok: without a reattach the writer failed $(echo "$(now) - $t_kill" | bc) s after the kill: $(tail -1 "$R/writer.err")" | tee "$R/verdict"
  exit 0
fi

# CYCLES times: kill -9 the serving process once KILL_AT more files are
# written, keep it dead DOWN seconds, re-attach, time the writer's resume.
# The writes are counted every 0.5 s, as lib.sh's more_writes does: each
# count is a fork, a run of wc and a 9p open (100 counts took 0.7-1.0 s
# of a guest, sleeps aside), CPU the writer and the server share (the
# kill's moment is only "after KILL_AT writes"; the resume is timed from
# the writes' own completion times, not from this poll).
current=first
: >"$R/resume"
c=1
while [ $c -le "$CYCLES" ]; do
  i=0
  while [ "$(wc -l <"$R/writes")" -lt $((c * KILL_AT)) ]; do
    i=$((i + 1))
    [ $i -gt 600 ] && fail "cycle $c: writer too slow ($(wc -l <"$R/writes") writes)"
    kill -0 $writer 2>/dev/null || fail "writer died before kill $c: $(cat "$R/writer.err")"
    sleep 0.5
  done
  kill -9 "$(cat "$R/$current.pid")"
  t_kill=$(now)
  sleep "$DOWN"
  if [ $c -eq 1 ]; then
    # A reattach with the wrong backend id is refused, and changes nothing.
    if "$VOLRING" nbd attach --export "vol=$img" --backend-id pvc-other --index 0 --reattach >"$R/wrong.out" 2>"$R/wrong.err"; then
      fail "reattach with the wrong backend id succeeded"
    fi
    grep -q 'serves backend' "$R/wrong.err" || fail "wrong backend: $(cat "$R/wrong.err")"
  fi
  current=again$c
  serve $current --backend-id pvc-smoke --index 0 --reattach
  # When the kernel took the new sockets, as the serving process saw it.
  t_back=$(sed -n 's/.*"at":\([0-9.]*\).*/\1/p' "$R/$current.out" | head -1)
  [ -n "$t_back" ] || fail "no time in $(cat "$R/$current.out")"
  # The writer resumes: the first write completed after the reattach (a
  # write that completed before the kill may be logged a moment later, so
  # the completion time decides, not the line count; as in healer.sh).
  i=0
  while [ -z "$(awk -v b="$t_back" '$3 >= b { print $3; exit }' "$R/writes")" ]; do
    i=$((i + 1))
    [ $i -gt 1200 ] && fail "cycle $c: writer did not resume within 60 s of the reattach"
    kill -0 $writer 2>/dev/null || break
    sleep 0.05
  done
  t_resume=$(awk -v b="$t_back" '$3 >= b { print $3; exit }' "$R/writes")
  [ -n "$t_resume" ] || fail "cycle $c: no write completed after the reattach: $(cat "$R/writer.err")"
  echo "cycle $c: down $(echo "$t_back - $t_kill" | bc) s, resumed $(echo "$t_resume - $t_back" | bc) s after the reattach" | tee -a "$R/resume"
  c=$((c + 1))
done

wait $writer || fail "writer failed: $(cat "$R/writer.err")"
[ "$(wc -l <"$R/writes")" -eq "$FILES" ] || fail "$(wc -l <"$R/writes") of $FILES writes"

# Verify from the device, not the page cache.
umount /mnt/v || fail "umount"
mount /dev/nbd0 /mnt/v || fail "remount"
verify_files /mnt/v "after the remount"
errors=$(cat /sys/fs/ext4/nbd0/errors_count 2>/dev/null || echo missing)
[ "$errors" = 0 ] || fail "ext4 errors_count $errors"
umount /mnt/v || fail "umount 2"
e2fsck -fn /dev/nbd0 >"$R/fsck" 2>&1 || fail "e2fsck: $(cat "$R/fsck")"
dmesg >"$R/dmesg"
if grep -E 'I/O error|EXT4-fs error|Buffer I/O' "$R/dmesg" | grep -q nbd0; then
  fail "I/O errors in dmesg: $(grep -E 'I/O error|EXT4-fs error' "$R/dmesg" | head -5)"
fi

"$VOLRING" nbd detach --index 0 --backend-id pvc-smoke >"$R/detach.out" 2>&1 || fail "detach: $(cat "$R/detach.out")"
kill "$(cat "$R/$current.pid")" 2>/dev/null
wait "$(cat "$R/$current.pid")" 2>/dev/null
# The 6.1 kernel loses provided receive buffers when multishot receives
# are cancelled; the server notices and hands its pool over afresh.
resets=$(cat "$R"/*.err 2>/dev/null | grep -c "handed to the kernel afresh")
echo "ok: $FILES writes of $FILE_KIB KiB, $CONNS connections, threads $THREADS, $CYCLES kill/reattach cycles, $resets receive pool resets" | tee "$R/verdict"
