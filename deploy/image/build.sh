#!/usr/bin/env bash
# Builds the volring container image without Docker, from Debian packages
# alone, as an OCI image archive:
#
#   deploy/image/build.sh [--binary PATH | --debug] [--out DIR]
#
#   --binary PATH  package this volring binary (default: cargo build --release)
#   --debug        build and package the debug binary (cargo build), for a
#                  quick CI check of the image; not for a cluster
#   --out DIR      where the archive goes (default: target/image)
#
# Writes DIR/volring-<version>.oci.tar, loadable by `ctr images import`,
# `podman load`, `skopeo copy oci-archive:...`, `kind load image-archive`.
#
# The root file system is Debian bookworm (mmdebstrap, variant apt) with
# the packages in deploy/image/packages.txt; the build fails when a program
# listed there is not in the image. Two layers: Debian (changes when
# Debian's packages do) and the binary (/usr/local/bin/volring, the
# entrypoint).
#
# Reproducible: SOURCE_DATE_EPOCH (default: the time of HEAD's commit) is
# every timestamp; tar entries are sorted with numeric owners and clamped
# mtimes; caches, logs and ids that differ between runs are removed. Two
# builds from the same commit against the same state of the Debian archive
# give the same digest. The package versions are listed in
# DIR/volring-<version>.packages (dpkg-query), which tells two images apart
# when Debian moved in between.
#
# Needs root (mmdebstrap's chroot), mmdebstrap, GNU tar, gzip, sha256sum;
# the Debian mirror is the one in this machine's apt sources.
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
out="$repo/target/image"
binary=""
profile=release

while [ $# -gt 0 ]; do
  case "$1" in
    --binary) binary=$(realpath "$2"); shift 2 ;;
    --debug) profile=debug; shift ;;
    --out) out=$(realpath -m "$2"); shift 2 ;;
    -h|--help) sed -n '2,14p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "build.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done

log() { printf '%s build.sh: %s\n' "$(date +%T)" "$*" >&2; }
die() { log "error: $*"; exit 1; }

[ "$(id -u)" = 0 ] || die "run as root (mmdebstrap builds the root file system in a chroot)"
for tool in mmdebstrap tar gzip sha256sum; do
  command -v "$tool" >/dev/null || die "$tool is not installed (apt-get install mmdebstrap)"
done

version=$(sed -n '/^\[workspace.package\]/,/^\[/s/^version *= *"\(.*\)"/\1/p' "$repo/Cargo.toml" | head -1)
[ -n "$version" ] || die "no version in Cargo.toml"
if [ -z "${SOURCE_DATE_EPOCH:-}" ]; then
  SOURCE_DATE_EPOCH=$(git -C "$repo" log -1 --format=%ct 2>/dev/null || stat -c %Y "$repo/Cargo.toml")
fi
export SOURCE_DATE_EPOCH
export LC_ALL=C.UTF-8 TZ=UTC
created=$(date -u -d "@$SOURCE_DATE_EPOCH" +%Y-%m-%dT%H:%M:%SZ)
name="volring:$version"

# The packages and the programs the agent runs, from the one list.
list=$(sed 's/#.*//' "$here/packages.txt")
packages=$(awk 'NF {print $1}' <<<"$list" | sort -u | paste -sd, -)
programs=$(awk 'NF > 1 {for (i = 2; i <= NF; i++) print $i}' <<<"$list" | sort -u)
[ -n "$packages" ] || die "no packages in $here/packages.txt"

# The binary.
if [ -z "$binary" ]; then
  target_dir=${CARGO_TARGET_DIR:-$repo/target}
  if [ "$profile" = release ]; then
    log "cargo build --release --locked --bin volring"
    (cd "$repo" && cargo build --release --locked --bin volring)
  else
    log "cargo build --locked --bin volring (debug)"
    (cd "$repo" && cargo build --locked --bin volring)
  fi
  binary="$target_dir/$profile/volring"
fi
[ -x "$binary" ] || die "no binary at $binary"
binver=$("$binary" --version) || die "$binary --version failed"
case "$binver" in
  *" $version"*) ;;
  *) die "$binary says '$binver', Cargo.toml says $version" ;;
esac

# The mirror: this machine's apt sources (deb822 or one-line format).
sources=""
for f in /etc/apt/sources.list.d/*.sources /etc/apt/sources.list /etc/apt/sources.list.d/*.list; do
  [ -f "$f" ] && grep -Eq '^[[:space:]]*(deb |Types:.*\bdeb\b)' "$f" && grep -q bookworm "$f" && sources="$sources $f"
done
[ -n "$sources" ] || die "no bookworm apt source in /etc/apt (mmdebstrap takes its mirror from there)"

mkdir -p "$out"
work=$(mktemp -d "$out/.work.XXXXXX")
cleanup() {
  # mmdebstrap unmounts what it mounted; make sure before removing.
  if [ -d "$work/rootfs" ]; then
    for m in $(awk -v r="$work/rootfs" 'index($2, r) == 1 {print $2}' /proc/self/mounts | sort -r); do
      umount -l "$m" 2>/dev/null || true
    done
  fi
  rm -rf "$work"
}
trap cleanup EXIT

start=$(date +%s)
rootfs="$work/rootfs"
log "mmdebstrap bookworm (variant apt) + $packages"
# /usr is merged by mmdebstrap's hook (the usrmerge package would bring
# perl). Documentation, manuals and translations are left out (the copyright
# files stay); recommends are not installed.
# shellcheck disable=SC2086
mmdebstrap --quiet --variant=apt --mode=root --format=directory \
  --hook-dir=/usr/share/mmdebstrap/hooks/merged-usr \
  --include="$packages" \
  --aptopt='APT::Install-Recommends "false"' \
  --dpkgopt='path-exclude=/usr/share/man/*' \
  --dpkgopt='path-exclude=/usr/share/info/*' \
  --dpkgopt='path-exclude=/usr/share/locale/*' \
  --dpkgopt='path-exclude=/usr/share/doc/*' \
  --dpkgopt='path-include=/usr/share/doc/*/copyright' \
  --dpkgopt='path-exclude=/usr/share/lintian/*' \
  --customize-hook='chroot "$1" dpkg-query -W -f "\${Package} \${Version} \${Architecture}\n" > "$1/.packages"' \
  bookworm "$rootfs" $sources </dev/null

# Every program the agent runs must resolve through PATH in the image.
missing=""
for p in $programs; do
  chroot "$rootfs" /bin/sh -c "command -v $p" >/dev/null || missing="$missing $p"
done
[ -z "$missing" ] || die "not in the image:$missing (deploy/image/packages.txt names them)"

mv "$rootfs/.packages" "$work/packages"
# What differs between two runs and nothing needs: apt's lists and caches,
# logs, ld.so's aux cache, dbus's and systemd's machine ids, backup files
# of dpkg's databases, the apt sources naming this machine's mirror.
rm -rf "$rootfs"/var/lib/apt/lists/* "$rootfs"/var/cache/apt/* "$rootfs"/var/cache/ldconfig/aux-cache \
  "$rootfs"/var/cache/debconf/*-old "$rootfs"/var/lib/dpkg/*-old \
  "$rootfs"/etc/apt/sources.list "$rootfs"/etc/apt/sources.list.d/* \
  "$rootfs"/var/lib/dbus/machine-id "$rootfs"/etc/machine-id \
  "$rootfs"/etc/*- "$rootfs"/etc/ssh/ssh_host_* "$rootfs"/tmp/* "$rootfs"/run/* \
  "$rootfs"/dev/* "$rootfs"/proc/* "$rootfs"/sys/* 2>/dev/null || true
find "$rootfs/var/log" -type f -delete
find "$rootfs" -name '__pycache__' -type d -prune -exec rm -rf {} +
# An empty machine-id: the runtime's; dbus reads /etc/machine-id.
: > "$rootfs/etc/machine-id"

# Deterministic tar of a directory's contents: sorted, clamped mtimes,
# numeric owners (the rootfs has files owned by system users), no atime,
# ctime or names of owners.
det_tar() { # DIR OUT [owner options]
  local dir=$1 dest=$2; shift 2
  (cd "$dir" && find . -mindepth 1 -printf '%P\0' | sort -z) |
    tar -C "$dir" --create --format=posix --numeric-owner "$@" \
      --pax-option=exthdr.name=%d/PaxHeaders/%f,delete=atime,delete=ctime \
      --mtime="@$SOURCE_DATE_EPOCH" --clamp-mtime \
      --no-recursion --null --verbatim-files-from --files-from=- -f "$dest"
}

layout="$work/oci"
mkdir -p "$layout/blobs/sha256"
blob() { # FILE -> prints sha256 and moves the file into blobs/
  local d
  d=$(sha256sum "$1" | cut -d' ' -f1)
  mv "$1" "$layout/blobs/sha256/$d"
  echo "$d"
}
size() { stat -c %s "$layout/blobs/sha256/$1"; }

log "layer 1: Debian"
det_tar "$rootfs" "$work/base.tar"
base_diff=$(sha256sum "$work/base.tar" | cut -d' ' -f1)
gzip -n -6 "$work/base.tar"
base=$(blob "$work/base.tar.gz")

log "layer 2: the binary"
app="$work/app"
install -d -m 0755 "$app/usr" "$app/usr/local" "$app/usr/local/bin"
install -m 0755 "$binary" "$app/usr/local/bin/volring"
det_tar "$app" "$work/app.tar" --owner=0 --group=0
app_diff=$(sha256sum "$work/app.tar" | cut -d' ' -f1)
gzip -n -6 "$work/app.tar"
appl=$(blob "$work/app.tar.gz")

path=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
printf '%s' "{\"created\":\"$created\",\"architecture\":\"amd64\",\"os\":\"linux\",\
\"config\":{\"Entrypoint\":[\"/usr/local/bin/volring\"],\"Env\":[\"PATH=$path\"],\"WorkingDir\":\"/\",\
\"Labels\":{\"org.opencontainers.image.title\":\"volring\",\"org.opencontainers.image.version\":\"$version\"}},\
\"rootfs\":{\"type\":\"layers\",\"diff_ids\":[\"sha256:$base_diff\",\"sha256:$app_diff\"]},\
\"history\":[{\"created\":\"$created\",\"created_by\":\"mmdebstrap bookworm: $packages\"},\
{\"created\":\"$created\",\"created_by\":\"volring $version\"}]}" > "$work/config.json"
config=$(blob "$work/config.json")

gz=application/vnd.oci.image.layer.v1.tar+gzip
printf '%s' "{\"schemaVersion\":2,\"mediaType\":\"application/vnd.oci.image.manifest.v1+json\",\
\"config\":{\"mediaType\":\"application/vnd.oci.image.config.v1+json\",\"digest\":\"sha256:$config\",\"size\":$(size "$config")},\
\"layers\":[{\"mediaType\":\"$gz\",\"digest\":\"sha256:$base\",\"size\":$(size "$base")},\
{\"mediaType\":\"$gz\",\"digest\":\"sha256:$appl\",\"size\":$(size "$appl")}]}" > "$work/manifest.json"
manifest=$(blob "$work/manifest.json")

# The name: io.containerd.image.name for ctr/kind (the name kubelet asks
# containerd for when a pod says `image: volring:<version>`), ref.name for
# podman and skopeo.
printf '%s' "{\"schemaVersion\":2,\"mediaType\":\"application/vnd.oci.image.index.v1+json\",\
\"manifests\":[{\"mediaType\":\"application/vnd.oci.image.manifest.v1+json\",\"digest\":\"sha256:$manifest\",\"size\":$(size "$manifest"),\
\"platform\":{\"architecture\":\"amd64\",\"os\":\"linux\"},\
\"annotations\":{\"io.containerd.image.name\":\"docker.io/library/$name\",\"org.opencontainers.image.ref.name\":\"$name\"}}]}" > "$layout/index.json"
printf '%s' '{"imageLayoutVersion":"1.0.0"}' > "$layout/oci-layout"

archive="$out/volring-$version.oci.tar"
det_tar "$layout" "$work/image.tar" --owner=0 --group=0
mv "$work/image.tar" "$archive"
mv "$work/packages" "$out/volring-$version.packages"
echo "sha256:$manifest" > "$out/volring-$version.digest"

secs=$(($(date +%s) - start))
unpacked=$(du -sb "$rootfs" | cut -f1)
cat <<EOF
image:     $name ($(basename "$binary") from $binver, $profile)
archive:   $archive ($(stat -c %s "$archive") bytes)
digest:    sha256:$manifest
layers:    $(size "$base") + $(size "$appl") bytes compressed; Debian root $unpacked bytes unpacked
packages:  $out/volring-$version.packages ($(wc -l < "$out/volring-$version.packages") Debian packages)
built in:  ${secs}s (the image; the binary's build not counted)
EOF
