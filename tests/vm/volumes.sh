#!/bin/sh
# Runs in the VM (tests/vm/volumes.rs boots it): one `attach: nbd` CSI
# volume through `volring node` on the kernel's nbd driver, as KIND (ext4,
# xfs or block): stage, write DATA_MIB of checksummed data, unstage (the
# device must be disconnected), check the image (e2fsck -fn, xfs_repair -n),
# stage again, verify every byte. Before the unstage it is grown by GROW_MIB
# online (EXPANSION=node: NodeExpandVolume grows image, device and
# filesystem; controller: ControllerExpandVolume grows image and device,
# NodeExpandVolume the filesystem) and written past its old end. For xfs, last: shut the filesystem down under the mount and
# check NodeGetVolumeStats says abnormal and unstage still works. After the
# first writes, and again after the re-stage's reads, the agent's /metrics
# must carry the attach server's series for the volume (server="attach",
# volume="vol") with those requests counted, and its rings' series.
#
# (Grown before the first unstage, so one write pass and one read pass
# cover both: the VM runs under TCG.)
#
# Environment: VOLRING, KIND, SIZE_MIB, DATA_MIB (default 64), GROW_MIB
# (default 64), EXPANSION (node or controller), AGENT_FLAGS (more flags of
# `volring node`). Results in $VM_RESULTS.

set -u
: "${VOLRING:?}" "${VM_RESULTS:?}" "${KIND:?}"
SIZE_MIB=${SIZE_MIB:-160}
DATA_MIB=${DATA_MIB:-64}
GROW_MIB=${GROW_MIB:-64}
EXPANSION=${EXPANSION:-controller}
AGENT_FLAGS=${AGENT_FLAGS:-}
R=$VM_RESULTS
# On failure: what each of the agent's threads is doing (state, wait
# channel, CPU ticks 1 s apart, kernel stack) -- a stalled NBD ring shows
# whether it blocks, spins or waits.
threads() {
  [ -n "${agent:-}" ] && kill -0 "$agent" 2>/dev/null || return 0
  for pass in 1 2; do
    for t in /proc/"$agent"/task/*; do
      echo "agent pass $pass tid $(basename "$t") $(cut -d' ' -f2,3,14,15 "$t/stat") wchan=$(cat "$t/wchan")"
      [ $pass = 2 ] && sed 's/^/    /' "$t/stack" 2>/dev/null
    done
    [ $pass = 1 ] && sleep 1
  done
}
fail() { echo "FAIL: $*"; echo "FAIL: $*" >>"$R/verdict"; threads; exit 1; }
t0=$(now)
lap() { echo "$1 at $(echo "$(now) - $t0" | bc) s" >>"$R/timeline"; }

modprobe nbd nbds_max=4 || fail "modprobe nbd"
K=/tmp/kubelet
S=$K/plugins/stage/vol
T=$K/pods/p/volumes/vol
E=unix:///tmp/volring-csi.sock
mkdir -p "$K" /tmp/vr
csi() { timeout 120 "$VOLRING" csi --endpoint "$E" "$@"; }
M=127.0.0.1:9477
"$VOLRING" node --metrics-addr "$M" --node-id vm --stats-interval 5 --csi-endpoint "$E" \
  --kubelet-root "$K" --state-dir /tmp/vr --expansion "$EXPANSION" $AGENT_FLAGS >"$R/agent.out" 2>"$R/agent.err" &
agent=$!
wait_ready $agent "$R/agent.err" "$E"
lap ready

case "$KIND" in
  block) access=--block fs= ;;
  *) access="--fs $KIND" fs=$KIND ;;
esac
img=/tmp/vr/pool/vol.img
csi create --name vol --size "${SIZE_MIB}M" --param attach=nbd $access >"$R/create.out" 2>&1 || fail "create: $(cat "$R/create.out")"

stage() {
  csi stage --id vol --staging "$S" $access >"$R/stage.out" 2>&1 || fail "stage: $(cat "$R/stage.out")"
  dev=
  for b in /sys/block/nbd*/backend; do
    [ "$(cat "$b" 2>/dev/null)" = vol ] && dev=/dev/$(basename "$(dirname "$b")")
  done
  [ -n "$dev" ] || fail "no nbd device carries backend vol"
  if [ "$KIND" = block ]; then
    csi publish --id vol --staging "$S" --target "$T" --block >"$R/publish.out" 2>&1 || fail "publish: $(cat "$R/publish.out")"
    [ -b "$T" ] || fail "$T is not a block device"
  else
    src=$(awk -v s="$S" '$2 == s { print $1 }' /proc/mounts | tail -1)
    [ "$src" = "$dev" ] || fail "staged on '$src', not $dev"
  fi
}

unstage() {
  name=${dev#/dev/}
  if [ "$KIND" = block ]; then
    csi unpublish --id vol --target "$T" >"$R/unpublish.out" 2>&1 || fail "unpublish: $(cat "$R/unpublish.out")"
  fi
  csi unstage --id vol --staging "$S" >"$R/unstage.out" 2>&1 || fail "unstage: $(cat "$R/unstage.out")"
  [ -e "/sys/block/$name/backend" ] && [ -n "$(cat "/sys/block/$name/backend")" ] && fail "$dev still carries a backend after unstage"
  case "$KIND" in
    ext4) e2fsck -fn "$img" >"$R/fsck.out" 2>&1 || fail "e2fsck: $(cat "$R/fsck.out")" ;;
    xfs) xfs_repair -n -f "$img" >"$R/fsck.out" 2>&1 || fail "xfs_repair: $(cat "$R/fsck.out")" ;;
  esac
}

# Writes $2 MiB as 4 MiB pieces numbered from $1, each checksummed in
# $R/sums; a file per piece, or the piece's place on the block device.
write_pieces() {
  n=$1
  end=$(($1 + $2 / 4))
  while [ $n -lt $end ]; do
    # One random MiB made once, each piece its number and four copies
    # (random data and sha256 of it are slow under TCG; pieces still differ),
    # 4 MiB in all: the number, then /tmp/rand4 (four copies) cut 16 bytes
    # short. Appended from the file, not through a pipe: cat into head
    # moved the 4 MiB in ~2,000 small reads and writes a piece, switching
    # between the two processes each time, a busybox process's time that
    # was most of a vCPU while the pieces were written.
    printf '%016d' "$n" >/tmp/piece
    head -c 4194288 /tmp/rand4 >>/tmp/piece
    if [ "$KIND" = block ]; then
      dd if=/tmp/piece of="$T" bs=1M seek=$((n * 4)) conv=notrunc,fsync status=none || fail "write piece $n"
    else
      dd if=/tmp/piece of="$S/p$n" bs=1M conv=fsync status=none || fail "write piece $n"
    fi
    echo "$n $(md5sum </tmp/piece | cut -d' ' -f1)" >>"$R/sums"
    n=$((n + 1))
  done
}

# Every piece read back: a block device's one by one at its offset, a
# filesystem's files with one md5sum for all of them.
verify() {
  if [ "$KIND" != block ]; then
    awk '{ print $2 "  p" $1 }' "$R/sums" >/tmp/md5s
    (cd "$S" && md5sum -c --quiet /tmp/md5s) >"$R/verify" 2>&1 || fail "$1: pieces differ: $(head -5 "$R/verify")"
    return
  fi
  bad=0
  while read -r n sum; do
    set -- "$1" $(dd if="$T" bs=1M skip=$((n * 4)) count=4 iflag=direct status=none | md5sum)
    [ "$2" = "$sum" ] || bad=$((bad + 1))
  done <"$R/sums"
  [ $bad -eq 0 ] || fail "$1: $bad of $(wc -l <"$R/sums") pieces differ"
}

# attach_metrics FAMILY: one scrape of /metrics (bounded: 60 s) must show
# the attach server's FAMILY (reads or writes) of export vol, labelled
# with the server and the volume id, above 0, and its ring 0's series.
attach_metrics() {
  curl -sS --max-time 60 "http://$M/metrics" >"$R/metrics" 2>"$R/metrics.err" || fail "scrape /metrics: $(cat "$R/metrics.err")"
  n=$(awk -v s="volring_nbd_$1_total{export=\"vol\",server=\"attach\",volume=\"vol\"}" '$1 == s { print $2 }' "$R/metrics")
  [ "${n:-0}" -gt 0 ] || fail "no $1 of vol by the attach server on /metrics: $(grep "_$1_total{" "$R/metrics" | head -5)"
  grep -q '^volring_nbd_ring_starved_windows_total{ring="0",server="attach"} ' "$R/metrics" ||
    fail "no ring series of the attach server on /metrics: $(grep '^volring_nbd_ring_starved' "$R/metrics" | head -5)"
  echo "/metrics: $n $1 of vol by the attach server" >>"$R/metrics.seen"
}

size_of() { echo $(($(cat "/sys/block/${dev#/dev/}/size") * 512)); }

head -c 1048576 /dev/urandom >/tmp/rand
cat /tmp/rand /tmp/rand /tmp/rand /tmp/rand >/tmp/rand4
: >"$R/sums"
stage
lap staged
echo "staged on $dev" >"$R/device"
write_pieces 0 "$DATA_MIB"
lap written
attach_metrics writes

# Grow online, under the data just written.
before=$(size_of)
# What the filesystem reports before (xfs and ext4 keep some of the device
# for themselves, so its size is compared with its own earlier size).
fs_before=0
[ "$KIND" != block ] && fs_before=$(stat -f -c '%b * %S' "$S" | bc)
new=$((SIZE_MIB + GROW_MIB))
path=$S
[ "$KIND" = block ] && path=$T
if [ "$EXPANSION" = controller ]; then
  csi expand --id vol --size "${new}M" >"$R/expand.out" 2>&1 || fail "expand: $(cat "$R/expand.out")"
  [ "$(size_of)" -eq $((new << 20)) ] || fail "the device has $(size_of) bytes after ControllerExpandVolume, not $((new << 20))"
fi
if [ "$KIND" != block ] || [ "$EXPANSION" = node ]; then
  csi node-expand --id vol --path "$path" --size "${new}M" >"$R/node-expand.out" 2>&1 || fail "node-expand: $(cat "$R/node-expand.out")"
fi
after=$(size_of)
[ "$after" -eq $((new << 20)) ] || fail "the device has $after bytes after growing, not $((new << 20))"
if [ "$KIND" != block ]; then
  fs_bytes=$(stat -f -c '%b * %S' "$S" | bc)
  [ "$fs_bytes" -gt "$fs_before" ] || fail "the filesystem has $fs_bytes bytes after growing, $fs_before before (device $before -> $after)"
  echo "grown: device $before -> $after bytes, $KIND $fs_bytes bytes" >>"$R/grow"
  # ext4: fill past the old end (the new space is really there); xfs (at
  # least 300 MiB, too slow to fill under TCG): some more data.
  fill=16
  [ "$KIND" = ext4 ] && fill=$((SIZE_MIB - DATA_MIB + 16))
  write_pieces $((DATA_MIB / 4)) $fill
else
  echo "grown: device $before -> $after bytes" >>"$R/grow"
  # Pieces past the old end of the device.
  write_pieces $((SIZE_MIB / 4)) 16
fi
lap "grown, written"

# From the image, not the page cache: unstage (disconnects the device),
# check the image, stage again, read everything back.
unstage
lap "unstaged, checked"
stage
verify "after re-stage"
lap "re-staged, verified"
attach_metrics reads

if [ "$KIND" = xfs ]; then
  csi stats --id vol --path "$S" >"$R/stats-before.out" 2>&1 || fail "stats: $(cat "$R/stats-before.out")"
  grep -q '"abnormal": *true' "$R/stats-before.out" && fail "abnormal before the shutdown: $(cat "$R/stats-before.out")"
  xfs_io -x -c shutdown "$S" || fail "xfs_io shutdown"
  csi stats --id vol --path "$S" >"$R/stats.out" 2>&1 || fail "stats after shutdown: $(cat "$R/stats.out")"
  grep -q '"abnormal": *true' "$R/stats.out" || fail "a shut-down xfs is not abnormal: $(cat "$R/stats.out")"
  grep -q 'shut down' "$R/stats.out" || fail "the condition does not say why: $(cat "$R/stats.out")"
  csi unstage --id vol --staging "$S" >"$R/unstage.out" 2>&1 || fail "unstage after shutdown: $(cat "$R/unstage.out")"
  echo "xfs shut down: $(tr -d '\n' <"$R/stats.out" | grep -o '"message": *"[^"]*"')" >>"$R/grow"
  lap "shutdown reported, unstaged"
else
  unstage
  lap "unstaged, checked"
fi
dmesg >"$R/dmesg"
if grep -E 'I/O error|EXT4-fs error|Buffer I/O|Corruption' "$R/dmesg" | grep -q nbd; then
  fail "I/O errors in dmesg: $(grep -E 'I/O error|EXT4-fs error|Corruption' "$R/dmesg" | head -5)"
fi
kill $agent
wait $agent 2>/dev/null
lap "agent stopped"
echo "ok: $KIND on $dev: $DATA_MIB MiB written, unstaged, checked, re-staged and verified; grown by $GROW_MIB MiB ($EXPANSION expansion) and verified" | tee "$R/verdict"
