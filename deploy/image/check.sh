#!/usr/bin/env bash
# Checks the image deploy/image/build.sh wrote, without a cluster:
#
#   deploy/image/check.sh [ARCHIVE]   (default: target/image/volring-<version>.oci.tar)
#
# 1. The OCI layout: every blob's digest and size as the index, manifest
#    and config name them, and the config's diff_ids against the
#    uncompressed layers; `skopeo inspect` reads it where skopeo is
#    installed.
# 2. The layers unpacked into a root, and in it (unshare --root, the
#    image's PATH and nothing of the host's environment): `volring
#    --version`, `mkfs.ext4 -V`, `mkfs.xfs -V`, `ganesha.nfsd -v`, every
#    program deploy/image/packages.txt names, an ext4 and an xfs made on a
#    file, and `volring devices --json` against the host's /sys.
# 3. `volring node` with what the DaemonSet gives it: the host's /dev,
#    /sys (read-only), /proc (hostPID) and /run/udev, a kubelet directory
#    with shared (Bidirectional) propagation, the state directory, the CSI
#    socket's directory at /csi, and the DaemonSet's arguments. It must
#    become ready (/readyz) and answer CSI Probe and GetPluginInfo on its
#    socket (`volring csi probe` run inside the image); then SIGTERM to its
#    PID, and it must exit 0 within 30 s.
# 4. Where containerd is installed (CI installs it): the archive imported
#    with `ctr -n k8s.io images import` into a containerd of this check's
#    own, under the name kubelet asks for, then the agent run again by
#    runc as the DaemonSet runs it (privileged, the host's PID namespace,
#    the same mounts with rshared propagation on the kubelet directory),
#    answering CSI Probe, stopped by SIGTERM. In CI a missing containerd
#    fails the check.
#
# Runs as root in a mount and network namespace of its own (loopback only,
# so the agent's ports are its own); everything is under a tmpfs in that
# namespace, so nothing is left behind whatever happens, and a trap stops
# the agent by its PID.
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)

if [ -z "${VOLRING_IMAGE_CHECK_NS:-}" ]; then
  [ "$(id -u)" = 0 ] || { echo "check.sh: run as root" >&2; exit 1; }
  exec unshare --mount --net --propagation private env VOLRING_IMAGE_CHECK_NS=1 "$0" "$@"
fi

version=$(sed -n '/^\[workspace.package\]/,/^\[/s/^version *= *"\(.*\)"/\1/p' "$repo/Cargo.toml" | head -1)
archive=$(realpath "${1:-$repo/target/image/volring-$version.oci.tar}")
[ -f "$archive" ] || { echo "check.sh: no $archive (run deploy/image/build.sh)" >&2; exit 1; }

log() { printf '%s check.sh: %s\n' "$(date +%T)" "$*" >&2; }
fail() { log "FAILED: $*"; exit 1; }
passed=0
ok() { passed=$((passed + 1)); log "ok: $*"; }

work=$(mktemp -d /tmp/volring-image-check.XXXXXX)
mount -t tmpfs -o mode=0755 volring-image-check "$work"
agent=""
containerd_pid=""
made_run_containerd=""
ctr() { command ctr -a "$work/containerd/sock" -n k8s.io "$@"; }
cleanup() {
  local rc=$?
  if [ -n "$agent" ] && kill -0 "$agent" 2>/dev/null; then
    kill -KILL "$agent" 2>/dev/null || true
    wait "$agent" 2>/dev/null || true
  fi
  if [ -n "$containerd_pid" ]; then
    # The task's shim outlives containerd unless the task is deleted.
    ctr task kill -a -s SIGKILL volring-check >/dev/null 2>&1 || true
    ctr task delete -f volring-check >/dev/null 2>&1 || true
    ctr container rm volring-check >/dev/null 2>&1 || true
    kill "$containerd_pid" 2>/dev/null || true
    wait "$containerd_pid" 2>/dev/null || true
  fi
  if [ -n "$made_run_containerd" ]; then
    umount -l /run/containerd 2>/dev/null || true
    rmdir /run/containerd 2>/dev/null || true
  fi
  # The namespace's mounts go with it; unmount anyway, deepest first.
  umount -R -l "$work" 2>/dev/null || true
  rmdir "$work" 2>/dev/null || true
  [ $rc = 0 ] || log "failed (exit $rc)"
}
trap cleanup EXIT
ip link set lo up

# 1. The layout.
layout="$work/oci"
mkdir -p "$layout"
tar -xf "$archive" -C "$layout"
[ "$(cat "$layout/oci-layout")" = '{"imageLayoutVersion":"1.0.0"}' ] || fail "oci-layout"
blob() { echo "$layout/blobs/sha256/${1#sha256:}"; }
verify() { # DIGEST SIZE
  local f
  f=$(blob "$1")
  [ -f "$f" ] || fail "blob $1 missing"
  [ "sha256:$(sha256sum "$f" | cut -d' ' -f1)" = "$1" ] || fail "blob $1: wrong digest"
  [ "$(stat -c %s "$f")" = "$2" ] || fail "blob $1: size $(stat -c %s "$f"), the descriptor says $2"
}
index="$layout/index.json"
[ "$(jq '.manifests | length' "$index")" = 1 ] || fail "index.json: one manifest expected"
manifest=$(jq -r '.manifests[0].digest' "$index")
verify "$manifest" "$(jq -r '.manifests[0].size' "$index")"
name=$(jq -r '.manifests[0].annotations["io.containerd.image.name"]' "$index")
[ "$name" = "docker.io/library/volring:$version" ] || fail "index.json names $name"
config=$(jq -r '.config.digest' "$(blob "$manifest")")
verify "$config" "$(jq -r '.config.size' "$(blob "$manifest")")"
cfg=$(blob "$config")
[ "$(jq -c '.config.Entrypoint' "$cfg")" = '["/usr/local/bin/volring"]' ] || fail "entrypoint"
mapfile -t layers < <(jq -r '.layers[] | "\(.digest) \(.size) \(.mediaType)"' "$(blob "$manifest")")
mapfile -t diffs < <(jq -r '.rootfs.diff_ids[]' "$cfg")
[ "${#layers[@]}" = "${#diffs[@]}" ] || fail "${#layers[@]} layers, ${#diffs[@]} diff_ids"
root="$work/root"
mkdir -p "$root"
for i in "${!layers[@]}"; do
  read -r digest size media <<<"${layers[$i]}"
  [ "$media" = application/vnd.oci.image.layer.v1.tar+gzip ] || fail "layer $digest: $media"
  verify "$digest" "$size"
  [ "sha256:$(gzip -dc "$(blob "$digest")" | sha256sum | cut -d' ' -f1)" = "${diffs[$i]}" ] || fail "layer $i: diff_id"
  # No whiteouts: each layer only adds.
  # (Lists are read whole before grep: with pipefail, grep -q quitting
  # early would fail the writer and the pipeline.)
  entries=$(gzip -dc "$(blob "$digest")" | tar -t)
  if grep -q '\.wh\.' <<<"$entries"; then fail "layer $i has whiteouts"; fi
  gzip -dc "$(blob "$digest")" | tar -x --numeric-owner -C "$root"
done
ok "OCI layout: manifest $manifest, ${#layers[@]} layers, digests and diff_ids match"
if command -v skopeo >/dev/null; then
  skopeo inspect "oci-archive:$archive" | jq -e --arg d "$manifest" '.Digest == $d' >/dev/null || fail "skopeo inspect"
  ok "skopeo inspect oci-archive: digest $manifest"
fi

# 2. Programs inside the image: its PATH, an empty environment.
path=$(jq -r '.config.Env[] | select(startswith("PATH="))' "$cfg")
mkdir -p "$root/dev" "$root/proc" "$root/sys" "$root/tmp" "$root/run/udev" "$root/csi" \
  "$root/var/lib/kubelet" "$root/var/lib/volring"
mount --rbind /dev "$root/dev"
mount --rbind /proc "$root/proc"   # hostPID: the host's processes
mount --rbind /sys "$root/sys"
mount -o remount,bind,ro "$root/sys"
[ -d /run/udev ] && mount --bind -o ro /run/udev "$root/run/udev"
mount -t tmpfs tmpfs "$root/tmp"
in_image() { env -i "$path" NODE_NAME=volring-image-check unshare --root="$root" --wd=/ "$@"; }
# The same, in place of the calling (sub)shell: `in_image_exec ... &` gives
# $! as the program's own PID (env and unshare exec, they do not fork).
in_image_exec() { exec env -i "$path" NODE_NAME=volring-image-check unshare --root="$root" --wd=/ "$@"; }

out=$(in_image volring --version) || fail "volring --version"
case "$out" in *"$version"*) ok "volring --version: $out" ;; *) fail "volring --version says $out" ;; esac
out=$(in_image mkfs.ext4 -V 2>&1) || fail "mkfs.ext4 -V: $out"
ok "mkfs.ext4 -V: $(head -1 <<<"$out")"
out=$(in_image mkfs.xfs -V 2>&1) || fail "mkfs.xfs -V: $out"
ok "mkfs.xfs -V: $(head -1 <<<"$out")"
out=$(in_image ganesha.nfsd -v 2>&1) || fail "ganesha.nfsd -v: $out"
grep -qi 'ganesha' <<<"$out" || fail "ganesha.nfsd -v: $out"
ok "ganesha.nfsd -v: $(grep -i -m1 'release\|version' <<<"$out" || head -1 <<<"$out")"
[ -f "$root/usr/lib/x86_64-linux-gnu/ganesha/libfsalvfs.so" ] || fail "no FSAL_VFS plugin (nfs-ganesha-vfs)"
ok "FSAL_VFS plugin where the agent's ganesha.conf names it"
for p in $(sed 's/#.*//' "$here/packages.txt" | awk 'NF > 1 {for (i = 2; i <= NF; i++) print $i}'); do
  in_image /bin/sh -c "command -v $p" >/dev/null || fail "$p is not on the image's PATH"
done
ok "every program deploy/image/packages.txt names is on the image's PATH"
# The agent's own mkfs lines (FsKind::mkfs_command), on files.
truncate -s 64M "$root/tmp/ext4.img"
truncate -s 320M "$root/tmp/xfs.img"
in_image mkfs.ext4 -F -q -b 4096 -m 0 -E lazy_itable_init=1,lazy_journal_init=1,nodiscard /tmp/ext4.img || fail "mkfs.ext4 on a file"
in_image mkfs.xfs -f -q -K -s size=4096 /tmp/xfs.img || fail "mkfs.xfs on a file"
[ "$(blkid -o value -s TYPE "$root/tmp/ext4.img")/$(blkid -o value -s TYPE "$root/tmp/xfs.img")" = ext4/xfs ] || fail "blkid of the files made"
rm -f "$root/tmp/ext4.img" "$root/tmp/xfs.img"
ok "mkfs.ext4 and mkfs.xfs with the agent's options"
out=$(in_image volring devices --json) || fail "volring devices --json"
jq -e '.blockdevices | length > 0' <<<"$out" >/dev/null || fail "volring devices --json: no devices: $out"
ok "volring devices --json: $(jq '.blockdevices | length' <<<"$out") devices from the host's /sys"

# 3. The agent as the DaemonSet runs it.
kubelet="$work/kubelet"
mkdir -p "$kubelet/plugins/volring.csi.io" "$kubelet/plugins_registry" "$work/state"
mount --bind "$kubelet" "$kubelet"
mount --make-rshared "$kubelet"                                         # the host's kubelet dir is shared
mount --rbind "$kubelet" "$root/var/lib/kubelet"                        # Bidirectional
mount --make-rshared "$root/var/lib/kubelet"
mount --bind "$kubelet/plugins/volring.csi.io" "$root/csi"              # the socket's directory
mount --bind "$work/state" "$root/var/lib/volring"
args=$(awk '/^ *- name: volring$/ {c = 1} c && /^ *args:/ {a = 1; next} a && /^ *- / {sub(/^ *- /, ""); print; next} a && !/^ *- / && !/^ *#/ {exit}' \
  "$repo/deploy/base/daemonset.yaml" | sed 's/\$(POD_IP)/127.0.0.1/')
[ "$(head -1 <<<"$args")" = node ] || fail "could not read the agent's args from deploy/base/daemonset.yaml: $args"
# The host's mount namespace is PID 1's (hostPID). Where PID 1's cannot be
# opened (a sandbox whose init is not ours), this script's namespace, where
# the kubelet directory is, stands in for the host's; the same for the PID
# namespace (the same one: no PID namespace is made).
host=1
if ! readlink /proc/1/ns/mnt >/dev/null 2>&1; then
  host=$$
  log "/proc/1/ns/mnt cannot be opened here: --mount-namespace=/proc/$$/ns/mnt (this script's) stands in"
  args=$(sed "s|^--mount-namespace=/proc/1/ns/mnt\$|--mount-namespace=/proc/$$/ns/mnt|" <<<"$args")
fi
mapfile -t argv <<<"$args"
log "volring ${argv[*]}"
in_image_exec volring "${argv[@]}" </dev/null >"$work/agent.log" 2>&1 &
agent=$!
ready=""
for _ in $(seq 600); do
  kill -0 "$agent" 2>/dev/null || { cat "$work/agent.log" >&2; fail "the agent exited before it was ready"; }
  if curl -sf -o /dev/null http://127.0.0.1:9477/readyz; then ready=1; break; fi
  sleep 0.1
done
[ -n "$ready" ] || { cat "$work/agent.log" >&2; fail "the agent was not ready in 60 s"; }
[ "$(cat /proc/$agent/comm 2>/dev/null)" = volring ] || fail "pid $agent is $(cat /proc/$agent/comm 2>/dev/null), not the agent"
ok "volring node (pid $agent) ready: /readyz answers 200"
[ -S "$kubelet/plugins/volring.csi.io/csi.sock" ] || fail "no socket in the kubelet's plugin directory"
out=$(in_image volring csi --endpoint unix:///csi/csi.sock probe) || fail "csi probe: $out"
jq -e '.ready == true' <<<"$out" >/dev/null || fail "csi probe: $out"
ok "CSI Probe: $(jq -c . <<<"$out")"
out=$(in_image volring csi --endpoint unix:///csi/csi.sock plugin-info) || fail "csi plugin-info: $out"
jq -e '.name == "volring.csi.io"' <<<"$out" >/dev/null || fail "csi plugin-info: $out"
ok "CSI GetPluginInfo: $(jq -c . <<<"$out")"
scrape=$(curl -sf http://127.0.0.1:9477/metrics) || fail "GET /metrics"
grep -q '^volring_' <<<"$scrape" || fail "no volring_ series on /metrics"
ok "/metrics serves volring_ series"
kill -TERM "$agent"
for _ in $(seq 300); do kill -0 "$agent" 2>/dev/null || break; sleep 0.1; done
kill -0 "$agent" 2>/dev/null && fail "the agent did not exit within 30 s of SIGTERM"
rc=0
wait "$agent" || rc=$?
agent=""
[ $rc = 0 ] || { cat "$work/agent.log" >&2; fail "the agent exited $rc on SIGTERM"; }
ok "SIGTERM: the agent exited 0"

# 4. Through containerd and runc.
if ! type -P containerd >/dev/null || ! type -P ctr >/dev/null; then
  [ -z "${CI:-}" ] || fail "containerd is not installed (.ci/image installs it)"
  log "containerd not installed: the ctr import and the run under runc skipped (apt-get install containerd)"
else
  c="$work/containerd"
  mkdir -p "$c/root" "$c/state"
  [ -d /run/containerd ] || { mkdir /run/containerd; made_run_containerd=1; }
  # runc's and the shims' state, in this namespace only.
  mount -t tmpfs tmpfs /run/containerd
  printf 'version = 2\nroot = "%s"\nstate = "%s"\n[grpc]\n  address = "%s"\n' "$c/root" "$c/state" "$c/sock" > "$c/config.toml"
  containerd --config "$c/config.toml" >"$c/log" 2>&1 &
  containerd_pid=$!
  for _ in $(seq 100); do [ -S "$c/sock" ] && ctr version >/dev/null 2>&1 && break; sleep 0.1; done
  ctr version >/dev/null 2>&1 || { tail -20 "$c/log" >&2; fail "containerd did not start"; }
  ctr images import "$archive" >/dev/null || fail "ctr images import"
  ref="docker.io/library/volring:$version"
  names=$(ctr images ls -q)
  grep -qx "$ref" <<<"$names" || fail "ctr images import did not name it $ref: $names"
  [ "$(ctr images ls | awk -v r="$ref" '$1 == r {print $3}')" = "$manifest" ] || fail "containerd has another digest for $ref"
  ok "ctr -n k8s.io images import: $ref $manifest"
  out=$(ctr run --rm "$ref" volring-version /usr/local/bin/volring --version) || fail "ctr run volring --version"
  ok "ctr run (runc): $out"
  ctr run --privileged --with-ns "pid:/proc/$host/ns/pid" --env NODE_NAME=volring-image-check \
    --mount "type=bind,src=/dev,dst=/dev,options=rbind:rw" \
    --mount "type=bind,src=/sys,dst=/sys,options=rbind:ro" \
    --mount "type=bind,src=$kubelet,dst=/var/lib/kubelet,options=rbind:rshared:rw" \
    --mount "type=bind,src=$kubelet/plugins/volring.csi.io,dst=/csi,options=rbind:rw" \
    --mount "type=bind,src=$work/state,dst=/var/lib/volring,options=rbind:rw" \
    --net-host "$ref" volring-check /usr/local/bin/volring "${argv[@]}" </dev/null >"$work/agent-runc.log" 2>&1 &
  agent=$!
  ready=""
  for _ in $(seq 600); do
    kill -0 "$agent" 2>/dev/null || { cat "$work/agent-runc.log" >&2; fail "the agent under runc exited before it was ready"; }
    if curl -sf -o /dev/null http://127.0.0.1:9477/readyz; then ready=1; break; fi
    sleep 0.1
  done
  [ -n "$ready" ] || { cat "$work/agent-runc.log" >&2; fail "the agent under runc was not ready in 60 s"; }
  out=$(in_image volring csi --endpoint unix:///csi/csi.sock probe) || fail "csi probe (runc): $out"
  jq -e '.ready == true' <<<"$out" >/dev/null || fail "csi probe (runc): $out"
  ok "volring node under runc, privileged, host PID namespace: ready, CSI Probe $(jq -c . <<<"$out")"
  ctr task kill -s SIGTERM volring-check
  for _ in $(seq 300); do kill -0 "$agent" 2>/dev/null || break; sleep 0.1; done
  kill -0 "$agent" 2>/dev/null && fail "the agent under runc did not exit within 30 s of SIGTERM"
  rc=0
  wait "$agent" || rc=$?
  agent=""
  [ $rc = 0 ] || { cat "$work/agent-runc.log" >&2; fail "the agent under runc exited $rc on SIGTERM"; }
  ctr container rm volring-check >/dev/null 2>&1 || true
  ok "SIGTERM (ctr task kill): the agent under runc exited 0"
fi
echo "$passed passed, 0 failed"
