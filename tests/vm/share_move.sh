#!/bin/sh
# Runs in the VM of tests/vm/share_move.rs: a shared (RWX) volume's NFS
# server moves from its owning node to this one while a client keeps its
# mount. The host is node A: its agent owns the volume's image, stages it
# (loop), exports it with its ganesha and serves the image over nbd. This
# guest is node B (its own `volring node`, its own ganesha) and also the
# client node: a kernel NFS mount of one fixed address, 127.0.0.1:2050,
# the stand-in for the volume's Service (ClusterIP:2049). A socat
# listener plays kube-proxy: it leads to A's ganesha (10.0.2.100:2049,
# qemu's guestfwd to the host) until the move, then to B's
# (127.0.0.1:2049). Connections it already forwarded stay with their
# old backend, as conntrack keeps an established flow on its endpoint.
#
# The client holds a file open (fd 3) and its cwd in the volume and a
# writer writes files; the move (the host unstages A; B stages the
# volume over nbd with share=nfs and exports it) must cost no write, the
# open file and the cwd must keep working, and everything written before
# and after must verify. Environment: VOLRING, URI, SECRET, VOLUME, FS.
# Results in $VM_RESULTS.

set -u
: "${VOLRING:?}" "${VM_RESULTS:?}" "${URI:?}" "${SECRET:?}" "${VOLUME:?}" "${FS:?}"
R=$VM_RESULTS
fail() {
  echo "FAIL: $*"
  echo "FAIL: $*" >>"$R/verdict"
  dmesg | grep -i -E "nfs|rpc|stale|nbd|xfs" | tail -12 >>"$R/verdict"
  [ -e /tmp/b/nfs/ganesha.log ] && tail -8 /tmp/b/nfs/ganesha.log >>"$R/verdict"
  exit 1
}
note() { echo "$(cut -d' ' -f1 /proc/uptime) $*" | tee -a "$R/notes"; }
# service TARGET: the fixed address now leads to TARGET (host:port).
service() {
  [ -n "${svc:-}" ] && kill "$svc" 2>/dev/null
  # Started away from the volume (no cwd, no fd 3 in it): it outlives the
  # client's umount.
  (cd / && exec socat TCP-LISTEN:2050,bind=127.0.0.1,reuseaddr,fork "TCP:$1" 3>&- 2>>"$R/service.err") &
  svc=$!
}

ip link set eth0 up && ip addr add 10.0.2.15/24 dev eth0 && ip link set lo up || fail "network: $(ip link 2>&1)"
modprobe nbd nbds_max=4 || fail "modprobe nbd"
modprobe nfsv4 || fail "modprobe nfsv4"
[ "$FS" = ext4 ] || modprobe "$FS" || fail "modprobe $FS"

# Node B: its agent serves NFS on 127.0.0.1:2049 and advertises the guest's
# address (the API server refuses a loopback one in an EndpointSlice).
E=unix:///tmp/b.sock
K=/tmp/kubelet
S=$K/plugins/stage/$VOLUME
mkdir -p "$K" /tmp/b /tmp/c
# In the cluster: the API stand-in on the host, through guestfwd.
printf 'apiVersion: v1\nkind: Config\nclusters:\n- name: s\n  cluster:\n    server: http://10.0.2.100:6443\nusers:\n- name: u\n  user: {}\ncontexts:\n- name: c\n  context:\n    cluster: s\n    user: u\ncurrent-context: c\n' >/tmp/kc
KUBECONFIG=/tmp/kc KUBERNETES_SERVICE_HOST=10.0.2.100 KUBERNETES_SERVICE_PORT=6443 \
  "$VOLRING" node --metrics-addr off --node-id node-b --stats-interval 5 --csi-endpoint "$E" --kubelet-root "$K" \
  --state-dir /tmp/b --nbd-request-timeout 3 --no-publish --nfs-listen 127.0.0.1:2049 --nfs-advertise 10.0.2.15:2049 --nfs-clients 127.0.0.1 --nfs-grace 10 --nfs-lease 10 \
  --nfs-service-poll 0.2 >"$R/b.out" 2>"$R/b.err" &
b=$!
wait_ready $b "$R/b.err" "$E"

# The client, through the Service to A.
service 10.0.2.100:2049
C=/tmp/c
timeout 120 mount -t nfs4 -o vers=4.1,port=2050,proto=tcp,hard,timeo=100,retrans=3,actimeo=1,lookupcache=positive \
  "127.0.0.1:/$VOLUME" "$C" 2>"$R/mount.err" || fail "mount through the service: $(cat "$R/mount.err")"
mkdir -p "$C/d/w" || fail "mkdir on the volume"
cd "$C/d" || fail "cd"
exec 3>>held.log || fail "open held.log"
echo "line 1 before the move" >&3 || fail "write held.log"
# A POSIX lock held across the move (what the client sees of it is
# measured, in $R/lock: B's ganesha does not know this client, so nothing
# the client reclaims is granted).
(cd / && exec /usr/bin/python3 -c 'import fcntl, os, sys, time
r = open(sys.argv[2], "a")
f = open(sys.argv[1], "a")
fcntl.lockf(f, fcntl.LOCK_EX)
f.write("locked before the move\n"); f.flush()
r.write("held\n"); r.flush()
for _ in range(3000):
    if os.path.exists("/tmp/moved"):
        break
    time.sleep(0.1)
def step(what, fn):
    try:
        fn(); r.write(what + ": ok\n")
    except OSError as e:
        r.write(what + ": " + os.strerror(e.errno) + "\n")
    r.flush()
step("write through the locked fd", lambda: (f.write("after the move\n"), f.flush(), os.fsync(f.fileno())))
pid = os.fork()
if pid == 0:
    g = open(sys.argv[1], "a")
    try:
        fcntl.lockf(g, fcntl.LOCK_EX | fcntl.LOCK_NB); r.write("another process locks it: granted (the lock was lost)\n")
    except OSError as e:
        r.write("another process locks it: " + os.strerror(e.errno) + "\n")
    r.flush(); os._exit(0)
os.waitpid(pid, 0)
step("the holder locks it again", lambda: fcntl.lockf(f, fcntl.LOCK_EX | fcntl.LOCK_NB))
' "$C/d/lock" "$R/lock" 3>&- 2>>"$R/lock.err") &
locker=$!
i=0
while ! grep -q held "$R/lock" 2>/dev/null; do
  i=$((i + 1))
  [ $i -gt 600 ] && fail "no lock in 60 s: $(cat "$R/lock.err")"
  sleep 0.1
done
FILE_KIB=128 MAXF=400 PER_CYCLE=3
start_writer file "$C/d/w"
more_writes 0
note "mounted from A; the writer wrote $(wc -l <"$R/writes") files"

# The move. A lets go (unexport, unmount, the fence released)...
before=$(wc -l <"$R/writes")
t0=$(now)
ask owner-unstaged
note "A unstaged"
service 127.0.0.1:2049
# ... and B stages it over nbd and exports it.
timeout 180 "$VOLRING" csi --endpoint "$E" stage --id "$VOLUME" --staging "$S" --fs "$FS" --mode multi-node-multi-writer \
  --context "volring.io/nbd-uri=$URI" --context "volring.io/nbd-secret=$SECRET" --context share=nfs \
  --context nfsPvcNamespace=apps --context nfsPvcName=data --context nfsSquash=none \
  >"$R/stage.out" 2>&1 || fail "B's stage: $(cat "$R/stage.out"); $(tail -5 "$R/b.err")"
dev=$(awk -v s="$S" '$2 == s { print $1 }' /proc/mounts | head -1)
case "$dev" in /dev/nbd*) ;; *) fail "B staged on '$dev', not an nbd device" ;; esac
note "B staged on $dev and exports it"
ask endpoints-moved
note "the EndpointSlice names B, the ClusterIP stayed"
more_writes "$before"
t1=$(now)
note "the writer resumed: $(wc -l <"$R/writes") files, the move took $(awk -v a="$t0" -v b="$t1" 'BEGIN { printf "%.1f", b - a }') s for the writer"
echo "line 2 after the move" >&3 || fail "the open file after the move: $(dmesg | grep -i nfs | tail -3)"
touch /tmp/moved
timeout -s KILL 120 sh -c "while kill -0 $locker 2>/dev/null; do sleep 0.2; done" || fail "the lock holder hangs: $(cat "$R/lock")"
note "the lock across the move: $(tail -n +2 "$R/lock" | tr '\n' ';') $(dmesg | grep -i 'lock' | grep -i nfs | head -2 | tr '\n' ';')"
exec 3>&-
[ "$(timeout -s KILL 60 cat held.log)" = "$(printf 'line 1 before the move\nline 2 after the move')" ] ||
  fail "held.log through the cwd: $(timeout -s KILL 20 cat held.log 2>&1)"
touch /tmp/stop-writer
wait $writer || fail "the writer failed: $(cat "$R/writer.err")"
verify_files "$C/d/w" "after the move"
(cd "$S/d/w" && sha256sum -c --quiet /tmp/sums) >"$R/verify-b" 2>&1 || fail "B's own view differs: $(head -3 "$R/verify-b")"
dmesg | grep -qi stale && fail "the client saw stale handles: $(dmesg | grep -i stale | head -3)"
# B's ganesha: the filesystem id it serves the volume with (the host
# compares it with A's), and no client handle it could not place.
grep "Added filesystem" /tmp/b/nfs/ganesha.log >"$R/b-fsid"
grep -q "Could not map fsid" /tmp/b/nfs/ganesha.log && fail "B's ganesha: $(grep "Could not map fsid" /tmp/b/nfs/ganesha.log | head -2)"
note "verified $(wc -l <"$R/writes") files, held.log and the cwd after the move"

cd /
timeout -s KILL 60 umount "$C" 2>"$R/umount.err" || fail "umount the client: $(cat "$R/umount.err"); $(fuser -vm "$C" 2>&1)"
timeout 120 "$VOLRING" csi --endpoint "$E" unstage --id "$VOLUME" --staging "$S" >"$R/unstage.out" 2>&1 ||
  fail "B's unstage: $(cat "$R/unstage.out")"
kill $svc $b
wait $b 2>/dev/null
echo "ok: moved A -> B under a mounted client ($FS)" | tee "$R/verdict"
