#!/bin/sh
# Runs in each of the two VMs of tests/vm/share.rs: a client node of one
# shared (MULTI_NODE_MULTI_WRITER) volume that the host's agent exports
# over NFSv4. The guest's own `volring node` stages it (the kernel NFS
# client, through qemu's guestfwd at 10.0.2.100:2049 to the host's
# ganesha) and publishes it; the two guests then meet on the volume:
# each other's files, alternate appends, rename and unlink, flock and
# fcntl locks that exclude each other, and writers that must not fail
# while the host kills and restarts the NFS server and its agent.
#
# The guests coordinate through marker files on the volume (bounded
# waits); the host reads and writes the same filesystem where it is staged.
# While the volume's server is down, a side channel to the host (see
# `host`) carries the two markers that cannot go through the volume.
# Environment: VOLRING (the binary), NODE (1 or 2), VOLUME, GRACE (the
# server's grace period, s). Results in $VM_RESULTS: verdict, manifest (the
# writer's files and checksums), stats.json, agent.err.

set -u
: "${VOLRING:?}" "${VM_RESULTS:?}" "${NODE:?}" "${VOLUME:?}"
R=$VM_RESULTS
OTHER=$((3 - NODE))
fail() {
  echo "FAIL(node $NODE): $*"
  echo "FAIL: $*" >>"$R/verdict"
  # What this node saw of the shared log (through its page cache, and
  # as the server has it: O_DIRECT), and what its NFS client said.
  [ -n "${M:-}" ] && [ -e "$M/log" ] && {
    echo "log as node $NODE reads it:"; timeout 20 cat "$M/log" | od -c | tail -6
    echo "log on the server:"; timeout 20 dd if="$M/log" iflag=direct bs=1M status=none | od -c | tail -6
  } >>"$R/verdict" 2>&1
  dmesg | grep -i -E "nfs|rpc|lease" | tail -8 >>"$R/verdict"
  exit 1
}
note() { echo "node $NODE $(cut -d' ' -f1 /proc/uptime): $*"; }

# One line to the host over the side channel (10.0.2.100:7000, which stays
# up while the volume's server is down); prints the host's phase.
host() {
  /usr/bin/python3 -c 'import socket, sys
s = socket.create_connection(("10.0.2.100", 7000), timeout=10)
s.sendall((sys.argv[1] + "\n").encode())
s.shutdown(socket.SHUT_WR)
sys.stdout.write(s.makefile().read().strip())' "$1" 2>/dev/null
}

# Waits until $1 (a test on the volume) holds, every 0.25 s, at most $2 s.
wait_for() {
  i=0
  while ! eval "$1"; do
    i=$((i + 1))
    [ $i -gt $(($2 * 4)) ] && fail "waited $2 s for: $1"
    sleep 0.25
  done
}

ip link set eth0 up && ip addr add 10.0.2.15/24 dev eth0 || fail "network: $(ip link 2>&1)"
modprobe nfsv4 || fail "modprobe nfsv4"
# Two guests booted from one image share a hostname; NFSv4 tells clients
# apart by their owner string, which this makes unique.
echo "volring-node$NODE" >/sys/module/nfs/parameters/nfs4_unique_id || fail "nfs4_unique_id"

K=/tmp/kubelet
S=$K/plugins/kubernetes.io/csi/volring.csi.io/stage/$VOLUME
T=$K/pods/pod$NODE/volumes/$VOLUME
E=unix:///tmp/volring-csi.sock
mkdir -p "$K" /tmp/vr
csi() { timeout 300 "$VOLRING" csi --endpoint "$E" "$@"; }
"$VOLRING" node --metrics-addr off --node-id "vm$NODE" --stats-interval 5 --csi-endpoint "$E" \
  --kubelet-root "$K" --state-dir /tmp/vr >"$R/agent.out" 2>"$R/agent.err" &
agent=$!
wait_ready $agent "$R/agent.err" "$E"

RWX="--fs ext4 --mode multi-node-multi-writer"
csi stage --id "$VOLUME" --staging "$S" $RWX --context share=nfs --context nfsServer=10.0.2.100:2049 \
  --context "nfsExport=/$VOLUME" >"$R/stage.out" 2>&1 || fail "stage: $(cat "$R/stage.out")"
csi stage --id "$VOLUME" --staging "$S" $RWX --context share=nfs --context nfsServer=10.0.2.100:2049 \
  --context "nfsExport=/$VOLUME" >>"$R/stage.out" 2>&1 || fail "stage again: $(cat "$R/stage.out")"
grep -q " $S nfs4 .*hard" /proc/mounts || fail "no hard nfs4 mount at $S: $(grep nfs /proc/mounts)"
csi publish --id "$VOLUME" --staging "$S" --target "$T" $RWX >"$R/publish.out" 2>&1 || fail "publish: $(cat "$R/publish.out")"
csi stats --id "$VOLUME" --path "$T" >"$R/stats.json" 2>&1 || fail "stats: $(cat "$R/stats.json")"
grep -q '"abnormal": *false' "$R/stats.json" || fail "stats not normal: $(cat "$R/stats.json")"
grep -q '"unit": *"BYTES"\|"unit": *1' "$R/stats.json" || fail "no byte usage: $(cat "$R/stats.json")"
M=$T
note "published"

# 1. Each other's files.
echo "hello from node $NODE" >"$M/hello-$NODE" || fail "write hello"
wait_for "[ -s '$M/hello-$OTHER' ]" 300
[ "$(cat "$M/hello-$OTHER")" = "hello from node $OTHER" ] || fail "hello-$OTHER reads '$(cat "$M/hello-$OTHER")'"
note "files exchanged"

# 2. Appends, alternately: node 1 on even line counts, node 2 on odd.
# The turn passes with a mark made after the append's close (turn-N: N
# lines are in, the writer closed the file), not with the line itself:
# NFS promises a reader what a writer wrote only from close to the
# reader's next open. A node that appended as soon as it saw the other's
# line could append while that writer was still between its WRITE and
# the attributes the server sends back with it; the Linux client takes
# the change in those attributes for its own write (weak cache
# consistency), keeps the page it has cached, and reads zeros where the
# other node's line is on the server. Seen under host load: node 2's
# `cat` read 364 bytes of lines and 16 zero bytes for 300 s, while an
# O_DIRECT read showed node 1's line on the server.
ROUNDS=4
r=0
while [ $r -lt $ROUNDS ]; do
  turn=$((2 * r + NODE - 1))
  [ $turn -gt 0 ] && wait_for "[ -e '$M/turn-$turn' ]" 300
  # After the other's close, this open must see every line: no waiting.
  have=$(cat "$M/log" 2>/dev/null | wc -l)
  [ "$have" -eq $turn ] || fail "turn $turn: the log has $have lines"
  # fsync'd, so a write the NFS client could not get to the server fails
  # here instead of leaving the other node waiting (a shell does not check
  # close(2), where an NFS client reports a lost write).
  printf 'node %s round %s\n' "$NODE" "$r" | dd of="$M/log" oflag=append conv=notrunc,fsync status=none ||
    fail "append round $r"
  touch "$M/turn-$((turn + 1))" || fail "mark turn $((turn + 1))"
  r=$((r + 1))
done
wait_for "[ -e '$M/turn-$((2 * ROUNDS))' ]" 300
expect=""
r=0
while [ $r -lt $ROUNDS ]; do
  expect="${expect}node 1 round $r
node 2 round $r
"
  r=$((r + 1))
done
[ "$(cat "$M/log")
" = "$expect" ] || fail "log is: $(cat "$M/log")"
note "appends alternated"

# 3. Rename and unlink: node 1 creates, node 2 renames, node 1 reads and
# unlinks, node 2 sees it gone.
if [ "$NODE" = 1 ]; then
  echo "moved" >"$M/ren-src"
  wait_for "[ -e '$M/ren-dst' ] && [ ! -e '$M/ren-src' ]" 300
  [ "$(cat "$M/ren-dst")" = moved ] || fail "ren-dst holds '$(cat "$M/ren-dst")'"
  rm "$M/ren-dst" || fail "unlink"
  touch "$M/unlinked"
else
  wait_for "[ -e '$M/ren-src' ]" 300
  mv "$M/ren-src" "$M/ren-dst" || fail "rename"
  wait_for "[ -e '$M/unlinked' ]" 300
  [ ! -e "$M/ren-dst" ] || fail "ren-dst still there after node 1 unlinked it"
fi
note "rename and unlink seen"

# 4. Locks. flock: node 1 holds, node 2 is refused, then gets it once
# released. fcntl (POSIX) locks the other way round.
PY=/usr/bin/python3
hold_fcntl='import fcntl, os, sys, time
f = open(sys.argv[1], "a"); fcntl.lockf(f, fcntl.LOCK_EX)
open(sys.argv[2], "w").close()
for _ in range(1200):
    if os.path.exists(sys.argv[3]): sys.exit(0)
    time.sleep(0.25)
sys.exit(3)'
try_fcntl='import fcntl, sys
f = open(sys.argv[1], "a")
try: fcntl.lockf(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
except OSError: sys.exit(1)
sys.exit(0)'
if [ "$NODE" = 1 ]; then
  exec 9>>"$M/flock"
  flock -x 9 || fail "flock"
  touch "$M/flock-held"
  wait_for "[ -e '$M/flock-tried' ]" 300
  flock -u 9
  exec 9>&-
  wait_for "[ -e '$M/fcntl-held' ]" 300
  $PY -c "$try_fcntl" "$M/fcntl" && fail "fcntl lock granted while node 2 holds it"
  touch "$M/fcntl-tried"
  wait_for "[ -e '$M/fcntl-released' ]" 300
  timeout 300 $PY -c "$try_fcntl" "$M/fcntl" || fail "fcntl lock refused after node 2 released it"
else
  wait_for "[ -e '$M/flock-held' ]" 300
  flock -n "$M/flock" true && fail "flock granted while node 1 holds it"
  touch "$M/flock-tried"
  timeout 300 flock -w 290 "$M/flock" true || fail "flock not granted after node 1 released it"
  $PY -c "$hold_fcntl" "$M/fcntl" "$M/fcntl-held" "$M/fcntl-tried" || fail "holding the fcntl lock"
  touch "$M/fcntl-released"
fi
note "locks excluded each other"

# 5. Writers while the host kills the NFS server, then its agent, and
# restarts them: every write and fsync must succeed, every file verify.
# The host writes `restarted-2` once the agent is back; each writer then
# writes 3 more files.
: >"$R/manifest"
touch "$M/writing-$NODE"
i=0
after=0
while :; do
  i=$((i + 1))
  [ $i -gt 400 ] && fail "wrote 400 files without seeing the restart"
  dd if=/dev/urandom of=/tmp/src bs=64k count=4 2>/dev/null
  f="w$NODE-$i"
  t0=$(cut -d' ' -f1 /proc/uptime)
  dd if=/tmp/src of="$M/$f" bs=64k conv=fsync 2>"$R/dd.err" || fail "write $f: $(cat "$R/dd.err")"
  echo "$(md5sum </tmp/src | cut -d' ' -f1) $f" >>"$R/manifest"
  echo "$f $t0 $(cut -d' ' -f1 /proc/uptime)" >>"$R/timing"
  if [ -e "$M/restarted-2" ]; then
    after=$((after + 1))
    [ $after -ge 3 ] && break
  fi
done
note "wrote $i files; the slowest write+fsync took $(awk '{ d = $3 - $2; if (d > m) m = d } END { printf "%.1f", m }' "$R/timing") s"
echo 3 >/proc/sys/vm/drop_caches
while read -r sum f; do
  [ "$(md5sum <"$M/$f" | cut -d' ' -f1)" = "$sum" ] || fail "$f does not verify"
done <"$R/manifest"
touch "$M/verified-$NODE"
wait_for "[ -e '$M/verified-$OTHER' ]" 600

# 6. The volume's condition: the host writes `going-down`; once both
# guests answered `saw-down` (on the side channel: a mark written on the
# volume could block this guest when the server dies right after the host
# saw it) it kills its agent (and server), and says `down` on the side
# channel. Stats must then say abnormal (the driver waits 5 s for the
# server); the host stays away until both guests told it so, and stats are
# normal again once it is back.
wait_for "[ -e '$M/going-down' ]" 300
i=0
until host saw-down >/dev/null; do
  i=$((i + 1))
  [ $i -gt 40 ] && fail "could not tell the host going-down was seen"
  sleep 0.25
done
i=0
until [ "$(host ask)" = down ]; do
  i=$((i + 1))
  [ $i -gt 1200 ] && fail "the host never said its server is down"
  sleep 0.25
done
i=0
while :; do
  csi stats --id "$VOLUME" --path "$T" >"$R/stats-down.json" 2>&1 || fail "stats while down: $(cat "$R/stats-down.json")"
  grep -q '"abnormal": *true' "$R/stats-down.json" && break
  i=$((i + 1))
  [ $i -gt 60 ] && fail "stats normal while the server is down: $(cat "$R/stats-down.json")"
  sleep 1
done
i=0
until host abnormal >/dev/null; do
  i=$((i + 1))
  [ $i -gt 40 ] && fail "could not tell the host the volume is abnormal"
  sleep 0.25
done
i=0
until csi stats --id "$VOLUME" --path "$T" >"$R/stats-up.json" 2>&1 && grep -q '"abnormal": *false' "$R/stats-up.json"; do
  i=$((i + 1))
  [ $i -gt 60 ] && fail "stats not normal again: $(cat "$R/stats-up.json")"
  sleep 1
done
note "condition abnormal while the server was away, normal after"

csi unpublish --id "$VOLUME" --target "$T" >"$R/unpublish.out" 2>&1 || fail "unpublish: $(cat "$R/unpublish.out")"
csi unstage --id "$VOLUME" --staging "$S" >"$R/unstage.out" 2>&1 || fail "unstage: $(cat "$R/unstage.out")"
grep -q nfs4 /proc/mounts && fail "still mounted: $(grep nfs4 /proc/mounts)"
kill $agent
echo ok >"$R/verdict"
note "done"
