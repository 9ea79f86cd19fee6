#!/bin/sh
# Runs in the VM (tests/vm/healer.rs boots it): the start walk and a
# remote nbd volume. Two `volring node`s in the guest, over TCP on its
# loopback: an owner exporting an `attach: nbd` volume
# (--nbd-export-listen 127.0.0.1:10809) and a consumer that stages it
# (ext4 on /dev/nbdN, TCP sockets the kernel holds to the owner).
#
# - healthy: the consumer is killed -9 and started again. The kernel's TCP
#   connection to the owner outlived it (still ESTABLISHED), so the new
#   consumer's start walk must leave the device alone: it logs "nbd device
#   left connected", never "nbd device reconnected", and the kernel logs no
#   "reconnected socket" (a RECONFIGURE that replaced a socket); a write +
#   fsync goes through.
# - dead: the consumer is killed -9, then the owner killed -9 and started
#   again while no consumer runs: the kernel marks the connection dead and
#   shuts it down (the LINK_DEAD notice reaches nobody). The next
#   consumer's walk must reconnect it ("nbd device reconnected", one more
#   "reconnected socket" from the kernel), and a write + fsync goes through.
#
# Environment: VOLRING. Results in $VM_RESULTS.

set -u
: "${VOLRING:?}" "${VM_RESULTS:?}"
R=$VM_RESULTS
fail() { echo "FAIL: $*"; echo "FAIL: $*" >>"$R/verdict"; exit 1; }

ip link set lo up || fail "loopback: $(ip link 2>&1)"
modprobe nbd nbds_max=4 || fail "modprobe nbd"
OE=unix:///tmp/owner.sock
CE=unix:///tmp/consumer.sock
K=/tmp/kubelet
S=$K/plugins/stage/pvc-r
mkdir -p "$K" /tmp/owner-kubelet /tmp/owner /tmp/consumer

n_owner=0
start_owner() {
  n_owner=$((n_owner + 1))
  "$VOLRING" node --metrics-addr off --node-id owner --stats-interval 5 --no-publish --nbd-threads 1 \
    --nbd-export-listen 127.0.0.1:10809 --csi-endpoint "$OE" --kubelet-root /tmp/owner-kubelet --state-dir /tmp/owner \
    >"$R/owner$n_owner.out" 2>"$R/owner$n_owner.err" &
  owner=$!
  wait_ready $owner "$R/owner$n_owner.err" "$OE"
}
n_consumer=0
start_consumer() {
  n_consumer=$((n_consumer + 1))
  "$VOLRING" node --metrics-addr off --node-id consumer --stats-interval 5 --no-publish --csi-endpoint "$CE" \
    --kubelet-root "$K" --state-dir /tmp/consumer --nbd-dead-conn-timeout 120 --nbd-request-timeout 3 \
    >"$R/consumer$n_consumer.out" 2>"$R/consumer$n_consumer.err" &
  consumer=$!
  wait_ready $consumer "$R/consumer$n_consumer.err" "$CE"
}
# established: the guest's ESTABLISHED TCP connections to the owner's
# port (10809 is 2A39), either side.
established() { awk '$4 == "01" && ($2 ~ /:2A39$/ || $3 ~ /:2A39$/)' /proc/net/tcp | wc -l; }
reconnected_sockets() { dmesg | grep -c "reconnected socket"; }
write_one() {
  timeout 60 dd if=/dev/urandom of="$S/$1" bs=64k count=16 conv=fsync status=none || fail "write $1: $(tail -5 "$R/consumer$n_consumer.err")"
}

start_owner
"$VOLRING" csi --endpoint "$OE" create --name pvc-r --size 64M --param attach=nbd >"$R/create.out" 2>&1 \
  || fail "create: $(cat "$R/create.out")"
URI=$(tr -d ' \n' <"$R/create.out" | grep -o '"volring.io/nbd-uri":"[^"]*"' | cut -d'"' -f4)
SECRET=$(tr -d ' \n' <"$R/create.out" | grep -o '"volring.io/nbd-secret":"[^"]*"' | cut -d'"' -f4)
[ -n "$URI" ] && [ -n "$SECRET" ] || fail "no export in the volume context: $(cat "$R/create.out")"

start_consumer
timeout 120 "$VOLRING" csi --endpoint "$CE" stage --id pvc-r --staging "$S" --fs ext4 \
  --context "volring.io/nbd-uri=$URI" --context "volring.io/nbd-secret=$SECRET" >"$R/stage.out" 2>&1 \
  || fail "stage: $(cat "$R/stage.out"); $(tail -5 "$R/consumer1.err")"
dev=$(awk -v s="$S" '$2 == s { print $1 }' /proc/mounts | head -1)
case "$dev" in /dev/nbd*) ;; *) fail "staged on '$dev', not an nbd device" ;; esac
[ "$(established)" -ge 2 ] || fail "no TCP connection to the owner: $(cat /proc/net/tcp)"
[ -s /tmp/consumer/nbd-sockets/${dev#/dev/} ] || fail "the consumer recorded no sockets for $dev: $(ls -l /tmp/consumer)"
write_one a

# Healthy: only the consumer restarts.
before=$(reconnected_sockets)
kill -9 $consumer
wait $consumer 2>/dev/null
start_consumer
plain "$R/consumer2.err" | grep -q "nbd device left connected" \
  || fail "the restarted consumer did not leave the healthy device connected: $(plain "$R/consumer2.err" | grep -i nbd | tail -5)"
plain "$R/consumer2.err" | grep -q "nbd device reconnected" && fail "the restarted consumer reconnected a healthy device: $(plain "$R/consumer2.err" | grep "nbd device" | tail -3)"
write_one b
[ "$(reconnected_sockets)" = "$before" ] || fail "the kernel replaced a socket of the healthy device: $(dmesg | grep 'reconnected socket' | tail -3)"
echo "healthy: $(plain "$R/consumer2.err" | grep "nbd device left connected" | sed 's/.*INFO *//')" | tee "$R/notes"

# Dead: the owner restarts while no consumer runs.
kill -9 $consumer
wait $consumer 2>/dev/null
kill -9 $owner
wait $owner 2>/dev/null
start_owner
i=0
while [ "$(established)" -gt 0 ]; do
  # The new owner has no connection yet; the kernel's old one must be gone.
  i=$((i + 1))
  [ $i -gt 600 ] && fail "the kernel's connection to the killed owner stayed established: $(cat /proc/net/tcp)"
  sleep 0.1
done
before=$(reconnected_sockets)
start_consumer
# The reconnect may end after the start pass (it goes on in the background).
i=0
while ! plain "$R/consumer3.err" | grep -q "nbd device reconnected"; do
  i=$((i + 1))
  [ $i -gt 600 ] && fail "the restarted consumer did not reconnect the dead device: $(plain "$R/consumer3.err" | grep -i nbd | tail -5)"
  sleep 0.1
done
write_one c
[ "$(reconnected_sockets)" -gt "$before" ] || fail "the kernel replaced no socket of the dead device: $(dmesg | tail -5)"
echo "dead: $(plain "$R/consumer3.err" | grep "nbd device reconnected" | sed 's/.*INFO *//')" | tee -a "$R/notes"

"$VOLRING" csi --endpoint "$CE" unstage --id pvc-r --staging "$S" >"$R/unstage.out" 2>&1 || fail "unstage: $(cat "$R/unstage.out")"
dmesg >"$R/dmesg"
grep -E 'I/O error|EXT4-fs error' "$R/dmesg" | grep -q nbd && fail "I/O errors in dmesg: $(grep -E 'I/O error|EXT4-fs error' "$R/dmesg" | head -5)"
kill $consumer $owner
wait 2>/dev/null
echo "ok: a consumer restart left the healthy remote device connected (no RECONFIGURE) and reconnected it once the owner had restarted meanwhile" | tee "$R/verdict"
