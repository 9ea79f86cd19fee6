#!/bin/bash
# Runs splicewrite.c (receive copy + pwrite vs blocking splice through a
# pipe) on loop-mounted ext4 and xfs, unix socket and TCP loopback, 4 KiB
# and 1 MiB payloads; receiver on CPU 1, sender on CPU 0. Root; the mounts
# live in a private mount namespace and the images are removed at the end.
# bash benches/support/splicewrite.sh [ROUNDS]
set -euo pipefail
rounds=${1:-5}
here=$(cd "$(dirname "$0")" && pwd)
work=$(mktemp -d /tmp/splicewrite.XXXXXX)
trap 'rm -rf "$work"' EXIT
cc -O2 -Wall -o "$work/splicewrite" "$here/splicewrite.c"
unshare -m --propagation private bash -euo pipefail -c '
work=$1 rounds=$2
for fs in ext4 xfs; do
  truncate -s 1G "$work/$fs.img"
  if [ $fs = xfs ]; then mkfs.xfs -q -f "$work/$fs.img"; else mkfs.ext4 -q -F "$work/$fs.img"; fi
  mkdir -p "$work/$fs"
  mount -o loop "$work/$fs.img" "$work/$fs"
  for t in unix tcp; do
    timeout 600 "$work/splicewrite" "$work/$fs" $t 4096 64 $rounds 1 0
    timeout 600 "$work/splicewrite" "$work/$fs" $t 1048576 256 $rounds 1 0
  done
  umount "$work/$fs"
  rm -f "$work/$fs.img"
done' _ "$work" "$rounds"
