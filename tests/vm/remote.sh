#!/bin/sh
# Runs in the VM (tests/vm/remote.rs boots it): the consuming node of a
# remote nbd volume. The owning node is the host: tests/vm/remote.rs runs
# its `volring node --nbd-export-listen 127.0.0.1:PORT` there, created the
# volume (URI and SECRET from its volume context), and qemu's guestfwd turns
# each guest connection to 10.0.2.100:10809 into a relay process to that
# port. The guest's `volring node` stages the volume: /dev/nbdN attached
# through the kernel's netlink interface to TCP sockets it negotiated with
# the owner's export.
#
# - a wrong secret is refused and no device is connected;
# - the right one stages ext4 on /dev/nbdN over TCP; a writer writes and
#   fsyncs checksummed files in a loop;
# - CYCLES times the guest asks the host (file `kill-C` in $VM_RESULTS) to
#   kill -9 the owner and start it again (the host answers with `back-C`);
#   the consumer's LINK_DEAD handler reconnects (retrying until the export
#   is back) and every write succeeds;
# - then: errors_count 0, no I/O error in dmesg, unstage, re-stage over TCP
#   (from the owner's disk, not this page cache) and every checksum
#   verified; the host runs e2fsck -n on the owner's image after the guest.
#
# KIND=block: the volume is a raw block volume (volumeMode Block): staged
# without a filesystem, published as a block device node at $T, written in
# 1 MiB pieces at their offsets; the host checks the pieces in the owner's
# image. KIND=ext4 (the default) stages ext4.
#
# NO_HEAL=1 is the control: the consumer runs with --nbd-no-heal (and a
# short dead-connection timeout) and the writer must fail.
#
# Environment: VOLRING, URI, SECRET, KIND (ext4), CYCLES (3), FILE_KIB (1024), PER_CYCLE
# (4), CONNS (consumer's --nbd-attach-connections, 1), MIN_MIB (data
# written at least, 64). Results in $VM_RESULTS.

set -u
: "${VOLRING:?}" "${VM_RESULTS:?}" "${URI:?}" "${SECRET:?}"
CYCLES=${CYCLES:-3}
FILE_KIB=${FILE_KIB:-1024}
PER_CYCLE=${PER_CYCLE:-4}
NO_HEAL=${NO_HEAL:-0}
KIND=${KIND:-ext4}
CONNS=${CONNS:-1}
MIN_MIB=${MIN_MIB:-64}
if [ "$NO_HEAL" = 1 ]; then DCT=4; else DCT=120; fi
R=$VM_RESULTS
fail() { echo "FAIL: $*"; echo "FAIL: $*" >>"$R/verdict"; exit 1; }
# phase WHAT: the guest's uptime at each step, for the test's wall-time note.
phase() { echo "$(cut -d' ' -f1 /proc/uptime) s: $* (guest idle $(awk '/^cpu / { printf "%.1f s, iowait %.1f", $5 / 100, $6 / 100 }' /proc/stat) s$(cpu_of consumer))" >>"$R/phases"; }
# cpu_of NAME: ", NAME cpu S s" for the process whose pid is in $NAME.
cpu_of() {
  eval "p=\${$1:-}"
  [ -n "$p" ] && [ -r /proc/$p/stat ] && awk -v n="$1" '{ printf ", %s cpu %.1f s", n, ($14 + $15) / 100 }' /proc/$p/stat
}
phase "script starts"

ip link set eth0 up && ip addr add 10.0.2.15/24 dev eth0 || fail "network: $(ip link 2>&1)"
modprobe nbd nbds_max=4 || fail "modprobe nbd"
GPORT=10809
CE=unix:///tmp/consumer.sock
K=/tmp/kubelet
S=$K/plugins/stage/pvc-r
T=$K/pods/p1/volumeDevices/pvc-r
mkdir -p "$K" /tmp/consumer
ccsi() { "$VOLRING" csi --endpoint "$CE" "$@"; }
[ "$URI" = "nbd://10.0.2.100:$GPORT/pvc-r" ] || fail "the owner advertises '$URI'"

if [ "$KIND" = block ]; then access=--block; else access="--fs $KIND"; fi
# stage ARGS...: NodeStage of the remote volume over TCP (and NodePublish
# of a block volume's device node at $T).
stage() {
  timeout 120 "$VOLRING" csi --endpoint "$CE" stage --id pvc-r --staging "$S" $access \
    --context "volring.io/nbd-uri=$URI" "$@" || return 1
  [ "$KIND" = block ] || return 0
  ccsi publish --id pvc-r --staging "$S" --target "$T" --block || return 1
  [ -b "$T" ] || { echo "$T is not a block device"; return 1; }
}
# unstage: NodeUnpublish (block) and NodeUnstage.
unstage() {
  if [ "$KIND" = block ]; then ccsi unpublish --id pvc-r --target "$T" || return 1; fi
  ccsi unstage --id pvc-r --staging "$S"
}

heal=""
[ "$NO_HEAL" = 1 ] && heal=--nbd-no-heal
"$VOLRING" node --metrics-addr off --node-id consumer --stats-interval 5 --csi-endpoint "$CE" --kubelet-root "$K" \
  --state-dir /tmp/consumer --nbd-dead-conn-timeout $DCT --nbd-request-timeout 3 --nbd-attach-connections "$CONNS" --no-publish $heal \
  >"$R/consumer.out" 2>"$R/consumer.err" &
consumer=$!
wait_ready $consumer "$R/consumer.err" "$CE"

phase "consumer ready"

# A wrong secret: refused (NotFound), and no device connected.
WRONG=$(echo "$SECRET" | tr '0-9a-f' '1-9a-f0')
if stage --context "volring.io/nbd-secret=$WRONG" >"$R/stage-wrong.out" 2>&1; then
  fail "staged with a wrong secret"
fi
grep -q NotFound "$R/stage-wrong.out" || fail "wrong secret: $(cat "$R/stage-wrong.out")"
for b in /sys/block/nbd*/backend; do
  [ -s "$b" ] && fail "a device was connected with a wrong secret: $b = $(cat "$b")"
done
echo "wrong secret refused: $(tr -d '\n' <"$R/stage-wrong.out" | head -c 200)" | tee "$R/notes"

stage --context "volring.io/nbd-secret=$SECRET" >"$R/stage.out" 2>&1 \
  || fail "stage: $(cat "$R/stage.out"); $(tail -5 "$R/consumer.err")"
if [ "$KIND" = block ]; then
  dev=
  for b in /sys/block/nbd*/backend; do
    [ "$(cat "$b" 2>/dev/null)" = pvc-r ] && dev=/dev/$(basename "$(dirname "$b")")
  done
  [ "$(stat -c %t:%T "$T")" = "$(stat -c %t:%T "$dev")" ] || fail "$T is not $dev"
else
  dev=$(awk -v s="$S" '$2 == s { print $1 }' /proc/mounts | head -1)
fi
case "$dev" in /dev/nbd*) ;; *) fail "staged on '$dev', not an nbd device" ;; esac
name=${dev#/dev/}
[ "$(cat /sys/block/$name/backend)" = pvc-r ] || fail "backend is $(cat /sys/block/$name/backend)"
# The kernel holds TCP connections to the host's forwarded port (hex in
# /proc/net/tcp: 10.0.2.100 is 6402000A).
hexport=$(printf '%04X' $GPORT)
conns=$(awk -v p="6402000A:$hexport" '$3 == p && $4 == "01"' /proc/net/tcp | wc -l)
[ "$conns" -ge 1 ] || fail "no established TCP connection to 10.0.2.100:$GPORT: $(cat /proc/net/tcp)"
grep -q "$SECRET" "$R/consumer.err" && fail "the secret is in the consumer's log"
phase "staged"
echo "staged on $dev over $conns TCP connection(s) to $URI" | tee -a "$R/notes"

# The writer (lib.sh): files in the staged filesystem, or pieces at their
# offsets on the published device, until told to stop.
MAXF=$((150 * 1024 / FILE_KIB))
MINF=$((MIN_MIB * 1024 / FILE_KIB))
if [ "$KIND" = block ]; then start_writer block "$T"; else start_writer file "$S"; fi

# restart_owner C: the host kills the owner -9 and starts it again; returns
# once the host says it is back (ready), with t_back the guest's time then.
restart_owner() {
  touch "$R/kill-$1"
  i=0
  while [ ! -e "$R/back-$1" ]; do
    i=$((i + 1))
    [ $i -gt 1200 ] && fail "cycle $1: the host did not restart the owner within 60 s"
    sleep 0.05
  done
  t_back=$(now)
}

if [ "$NO_HEAL" = 1 ]; then
  more_writes 0
  t_kill=$(now)
  restart_owner 1
  i=0
  while kill -0 $writer 2>/dev/null; do
    i=$((i + 1))
    [ $i -gt 1200 ] && fail "without reconnecting the writer still waits after 120 s"
    sleep 0.1
  done
  if wait $writer; then fail "without reconnecting every write still succeeded"; fi
  phase "writer failed"
  dmesg >"$R/dmesg"
  grep -q "I/O error, dev $name" "$R/dmesg" || fail "no I/O error in dmesg without reconnecting"
  echo "ok: without reconnecting the writer failed $(echo "$(now) - $t_kill" | bc) s after the owner's kill was asked for: $(tail -1 "$R/writer.err")" | tee "$R/verdict"
  kill -9 $consumer
  exit 0
fi

: >"$R/resume"
c=1
done_writes=0
while [ $c -le "$CYCLES" ]; do
  more_writes $done_writes
  restart_owner $c
  # The first write completed after the reconnect. The times come from
  # the logs, so this polls slowly (its processes would slow the writer).
  i=0
  while :; do
    if [ "$(grep -c "nbd device reconnected" "$R/consumer.err")" -ge "$c" ]; then
      ts=$(plain "$R/consumer.err" | grep "nbd device reconnected" | tail -1 | cut -d' ' -f1)
      t_rec=$(date -d "$ts" +%s.%N) || fail "cycle $c: no time in the reconnect line: $ts"
      t_resume=$(awk -v b="$t_rec" '$3 >= b { print $3; exit }' "$R/writes")
      [ -n "$t_resume" ] && break
    fi
    i=$((i + 1))
    [ $i -gt 240 ] && fail "cycle $c: writer did not resume within 60 s of the owner's return: $(plain "$R/consumer.err" | tail -5)"
    kill -0 $writer 2>/dev/null || fail "cycle $c: writer failed: $(cat "$R/writer.err")"
    sleep 0.25
  done
  echo "cycle $c: $(cat "$R/back-$c"); reconnected $(echo "$t_rec - $t_back" | bc) s after the guest saw the owner back, writer resumed $(echo "$t_resume - $t_rec" | bc) s after the reconnect" | tee -a "$R/resume"
  echo "$(echo "$t_resume - $t_rec" | bc)" >>"$R/latency"
  done_writes=$(wc -l <"$R/writes")
  c=$((c + 1))
done
# At least MIN_MIB written in all.
more_writes $done_writes
i=0
while [ "$(wc -l <"$R/writes")" -lt "$MINF" ]; do
  i=$((i + 1))
  [ $i -gt 600 ] && fail "writer too slow ($(wc -l <"$R/writes") of $MINF writes)"
  kill -0 $writer 2>/dev/null || fail "writer ended early: $(cat "$R/writer.err")"
  sleep 0.5
done
touch /tmp/stop-writer
wait $writer || fail "writer failed: $(cat "$R/writer.err")"
phase "writer done"
FILES=$(wc -l <"$R/writes")
if [ "$KIND" = ext4 ]; then
  errors=$(cat /sys/fs/ext4/$name/errors_count 2>/dev/null || echo missing)
  [ "$errors" = 0 ] || fail "ext4 errors_count $errors"
  ccsi stats --id pvc-r --path "$S" >"$R/stats.out" 2>&1
else
  ccsi stats --id pvc-r --path "$T" >"$R/stats.out" 2>&1
fi
grep -q '"abnormal": *true' "$R/stats.out" && fail "condition abnormal after reconnecting: $(cat "$R/stats.out")"

# From the owner's disk, not this page cache: unstage, stage again over
# TCP, read back.
unstage >"$R/unstage.out" 2>&1 || fail "unstage: $(cat "$R/unstage.out")"
[ -s /sys/block/$name/backend ] && fail "$dev still carries a backend after unstage"
stage --context "volring.io/nbd-secret=$SECRET" >"$R/stage2.out" 2>&1 || fail "re-stage: $(cat "$R/stage2.out")"
# A block volume's pieces are read in one pass and cut at their offsets
# into the files verify_files (lib.sh) checks.
if [ "$KIND" = block ]; then
  mkdir -p /tmp/pieces
  dd if="$T" bs=$((FILE_KIB * 1024)) count=$(wc -l <"$R/writes") iflag=direct status=none | (cd /tmp/pieces && split -a 4 -b $((FILE_KIB * 1024)) --numeric-suffixes=1 - p) \
    || fail "read back $T"
  verify_files /tmp/pieces "after the re-stage" p%04d
else
  verify_files "$S" "after the re-stage"
fi
phase "re-staged and verified"
unstage >"$R/unstage2.out" 2>&1 || fail "unstage 2: $(cat "$R/unstage2.out")"
dmesg >"$R/dmesg"
if grep -E 'I/O error|EXT4-fs error|Buffer I/O' "$R/dmesg" | grep -q nbd; then
  fail "I/O errors in dmesg: $(grep -E 'I/O error|EXT4-fs error' "$R/dmesg" | head -5)"
fi
kill $consumer
wait $consumer 2>/dev/null
echo "writer resumed after the consumer's reconnect: $(dist "$R/latency")" | tee -a "$R/resume"
echo "ok: $KIND, $FILES writes of $FILE_KIB KiB ($((FILES * FILE_KIB / 1024)) MiB) through /dev/$name over TCP to the host's owner, $CYCLES owner kill -9/restarts ridden through, data verified after re-stage" | tee "$R/verdict"
