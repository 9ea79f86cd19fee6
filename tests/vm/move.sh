#!/bin/sh
# Runs in the VM (tests/vm/move_.rs boots it): the node a volume moves to.
# The owning node is the host: its agent holds the volume's image, serves
# it on its nbd export (reached at 10.0.2.100:10809 through qemu's
# guestfwd) and stages it itself when the test asks. The guest asks the
# host for each owner step (file `ask-STEP` in $VM_RESULTS; the host
# answers `done-STEP`, `ok` or why not):
#
# - owner-staged: the owner stages the volume and writes owner.bin; the
#   guest's stage over the export is then refused (FailedPrecondition) and
#   no nbd device is connected;
# - owner-unstaged: the owner lets it go; the guest stages it on /dev/nbdN,
#   verifies owner.bin and writes consumer.bin;
# - owner-refused: the owner's own stage is refused while the guest holds
#   the volume;
# - the guest unstages (the kernel sends NBD_CMD_DISC on its sockets);
# - owner-back: the owner stages it again and verifies consumer.bin.
#
# Environment: VOLRING, URI, SECRET. Results in $VM_RESULTS.

set -u
: "${VOLRING:?}" "${VM_RESULTS:?}" "${URI:?}" "${SECRET:?}"
R=$VM_RESULTS
fail() { echo "FAIL: $*"; echo "FAIL: $*" >>"$R/verdict"; exit 1; }

ip link set eth0 up && ip addr add 10.0.2.15/24 dev eth0 || fail "network: $(ip link 2>&1)"
modprobe nbd nbds_max=4 || fail "modprobe nbd"
CE=unix:///tmp/consumer.sock
K=/tmp/kubelet
S=$K/plugins/stage/pvc-m
mkdir -p "$K" /tmp/consumer
ccsi() { "$VOLRING" csi --endpoint "$CE" "$@"; }
stage() {
  timeout 120 "$VOLRING" csi --endpoint "$CE" stage --id pvc-m --staging "$S" --fs ext4 \
    --context "volring.io/nbd-uri=$URI" --context "volring.io/nbd-secret=$SECRET"
}
connected() {
  for b in /sys/block/nbd*/backend; do
    [ -s "$b" ] && echo "$b = $(cat "$b")"
  done
}

"$VOLRING" node --metrics-addr off --node-id consumer --stats-interval 5 --csi-endpoint "$CE" --kubelet-root "$K" \
  --state-dir /tmp/consumer --nbd-request-timeout 3 --no-publish >"$R/consumer.out" 2>"$R/consumer.err" &
consumer=$!
wait_ready $consumer "$R/consumer.err" "$CE"

ask owner-staged
if stage >"$R/stage-refused.out" 2>&1; then fail "staged over the export while the owner has it staged"; fi
grep -q FailedPrecondition "$R/stage-refused.out" || fail "the refusal: $(cat "$R/stage-refused.out")"
[ -z "$(connected)" ] || fail "a device was connected while the owner has the volume: $(connected)"
echo "refused while the owner has it staged: $(tr -d '\n' <"$R/stage-refused.out" | head -c 300)" | tee "$R/notes"

ask owner-unstaged
stage >"$R/stage.out" 2>&1 || fail "stage after the owner let go: $(cat "$R/stage.out"); $(tail -5 "$R/consumer.err")"
dev=$(awk -v s="$S" '$2 == s { print $1 }' /proc/mounts | head -1)
case "$dev" in /dev/nbd*) ;; *) fail "staged on '$dev', not an nbd device" ;; esac
(cd "$S" && sha256sum -c --quiet "$R/owner.sum") >"$R/verify-owner" 2>&1 || fail "owner.bin differs here: $(cat "$R/verify-owner")"
head -c $((8 << 20)) /dev/urandom >"$S/consumer.bin" && sync || fail "write consumer.bin"
(cd "$S" && sha256sum consumer.bin) >"$R/consumer.sum"
echo "moved: staged on $dev, owner.bin verified, consumer.bin written" | tee -a "$R/notes"

ask owner-refused
ccsi unstage --id pvc-m --staging "$S" >"$R/unstage.out" 2>&1 || fail "unstage: $(cat "$R/unstage.out")"
[ -z "$(connected)" ] || fail "still connected after the unstage: $(connected)"
ask owner-back
dmesg | grep -E 'I/O error|EXT4-fs error' | grep -q nbd && fail "I/O errors: $(dmesg | grep -E 'I/O error|EXT4-fs error' | head -3)"
kill $consumer
wait $consumer 2>/dev/null
echo "ok: owner -> consumer -> owner, each side refused while the other held the volume" | tee "$R/verdict"
