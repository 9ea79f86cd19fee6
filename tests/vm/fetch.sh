#!/usr/bin/env bash
# Fetches what the VM tests boot: Debian 12's own kernel (which has the nbd
# module this machine's kernel lacks), qemu 7.2 with its firmware, and a
# static busybox for the initramfs. Everything is downloaded as .deb files
# (`apt-get download`, never installed) and unpacked with `dpkg-deb -x` into
# the cache directory, because installing qemu-system-x86 with apt would
# remove the qemu-utils 10 the NBD tests use. Only the shared libraries the
# unpacked qemu links against are installed, with --no-remove so apt can
# never take anything away to satisfy them.
#
# Idempotent: a second run finds every piece in place and only rebuilds the
# initramfs when tests/vm/init.sh changed.
#
# Cache: $VOLRING_VM_DIR, else target/vm-cache beside this checkout.
set -euo pipefail

here="$(cd "$(dirname "$0")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
cache="${VOLRING_VM_DIR:-$repo/target/vm-cache}"
mkdir -p "$cache/debs" "$cache/root"
cache="$(cd "$cache" && pwd)"

log() { echo "vm-fetch: $*" >&2; }

export DEBIAN_FRONTEND=noninteractive
apt_updated=0
apt_update_once() {
  if [ "$apt_updated" = 0 ]; then
    apt-get update -q >/dev/null
    apt_updated=1
  fi
}

# The concrete kernel package behind the metapackage (linux-image-amd64
# depends on exactly one linux-image-<abi>-amd64).
kernel_pkg_of_meta() {
  apt-cache depends linux-image-amd64 2>/dev/null |
    awk '/Depends: linux-image-[0-9]/ { print $2; exit }'
}

# The kernel package is ~400 MB, mostly drivers for hardware a VM never has.
# Keeps the filesystems, block and device-mapper drivers, virtio (virtio_net
# and the virtual network devices among the top-level drivers/net modules),
# 9p and the libraries they need; depmod then describes only what is left.
# Bump prune_rev when this changes: the kernel is unpacked again.
prune_rev=2
prune_modules() {
  local k="$cache/root/lib/modules/$1/kernel" d
  rm -rf "$k/sound" "$k/net/wireless" "$k/net/mac80211" "$k/net/bluetooth"
  for d in "$k"/drivers/*; do
    case "${d##*/}" in
    block | md | virtio | char | nvdimm | dax | scsi | net) ;;
    *) rm -rf "$d" ;;
    esac
  done
  rm -rf "$k/drivers/scsi"/*/ "$k/drivers/net"/*/ 2>/dev/null || true
  depmod -b "$cache/root" "$1"
}

# Candidate versions of every package, from one apt-cache call (each call
# reads the package lists: ~1 s).
declare -A candidate=()
read_candidates() {
  local pkg="" line
  while IFS= read -r line; do
    case "$line" in
    [a-z0-9]*:) pkg="${line%:}" ;;
    *Candidate:*) candidate[$pkg]="${line##* }" ;;
    esac
  done < <(apt-cache policy "$@" 2>/dev/null)
}

# Unpacks one package into the cache root unless it already was. The stamp
# names the exact version, so a newer candidate is unpacked over the old one.
fetch_pkg() {
  local pkg="$1" ver="${candidate[$1]:-}" deb
  if [ -z "$ver" ] || [ "$ver" = "(none)" ]; then
    log "no candidate for $pkg"
    return 1
  fi
  local stamp="$cache/debs/$pkg.unpacked" want="$ver"
  case "$pkg" in linux-image-*) want="$ver prune $prune_rev" ;; esac
  if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
    return 0
  fi
  log "downloading $pkg $ver"
  (cd "$cache/debs" && rm -f "${pkg}"_*.deb &&
    apt-get download -q -o APT::Sandbox::User=root "$pkg=$ver" >/dev/null)
  deb="$(ls "$cache/debs/${pkg}"_*.deb | head -n1)"
  dpkg-deb -x "$deb" "$cache/root"
  dpkg-deb -f "$deb" Depends >"$cache/debs/$pkg.depends"
  rm -f "$deb"
  case "$pkg" in linux-image-*) prune_modules "${pkg#linux-image-}" ;; esac
  echo "$want" >"$stamp"
}

# Shared libraries the unpacked qemu needs: its own Depends line, less the
# packages unpacked above. Installed only when one is missing, so a cached
# run does not touch apt.
install_qemu_libs() {
  local missing=() dep
  while read -r dep; do
    [ -n "$dep" ] || continue
    case "$dep" in
    qemu-system-* | seabios | ipxe-qemu) continue ;;
    esac
    if ! dpkg-query -W -f='${Status}' "$dep" 2>/dev/null | grep -q 'ok installed'; then
      missing+=("$dep")
    fi
  done < <(tr ',' '\n' <"$cache/debs/qemu-system-x86.depends" |
    sed -e 's/([^)]*)//g' -e 's/|.*//' -e 's/ //g')
  # kmod: modprobe inside the guest (the guest runs this machine's tools);
  # xz-utils: uncompressing the kernel below.
  for dep in kmod xz-utils; do
    dpkg-query -W -f='${Status}' "$dep" 2>/dev/null | grep -q 'ok installed' || missing+=("$dep")
  done
  if [ "${#missing[@]}" -gt 0 ]; then
    log "installing qemu's libraries: ${missing[*]}"
    apt_update_once
    apt-get install -y -q --no-install-recommends --no-remove "${missing[@]}" >/dev/null
  fi
}

kernel_pkg="$(cat "$cache/kernel.pkg" 2>/dev/null || true)"
if [ -z "$kernel_pkg" ]; then
  kernel_pkg="$(kernel_pkg_of_meta)"
  if [ -z "$kernel_pkg" ]; then
    apt_update_once
    kernel_pkg="$(kernel_pkg_of_meta)"
  fi
  [ -n "$kernel_pkg" ] || { log "cannot resolve linux-image-amd64"; exit 1; }
fi

pkgs=("$kernel_pkg" qemu-system-x86 qemu-system-common qemu-system-data
  seabios ipxe-qemu busybox-static)
read_candidates "${pkgs[@]}"
if [ "${#candidate[@]}" -lt "${#pkgs[@]}" ]; then
  apt_update_once
  read_candidates "${pkgs[@]}"
fi
for pkg in "${pkgs[@]}"; do
  fetch_pkg "$pkg"
done
echo "$kernel_pkg" >"$cache/kernel.pkg"
install_qemu_libs

root="$cache/root"
kver="${kernel_pkg#linux-image-}"
moddir="$root/lib/modules/$kver"
[ -d "$moddir" ] || { log "no modules at $moddir"; exit 1; }
# modules.dep ships with the package; depmod only if it is missing.
[ -f "$moddir/modules.dep" ] || depmod -b "$root" "$kver"
ln -sfn "root/boot/vmlinuz-$kver" "$cache/vmlinuz"
# The kernel uncompressed: qemu boots the ELF directly (PVH entry, the
# kernel has CONFIG_PVH), skipping the BIOS boot path and the in-guest xz
# decompression, which under TCG halves the boot (measured 10 s against
# 23 s on a loaded machine).
if [ ! -f "$cache/vmlinux" ] || [ "$cache/vmlinux" -ot "$root/boot/vmlinuz-$kver" ]; then
  log "uncompressing the kernel"
  off="$(LC_ALL=C grep -aboP '\xfd7zXZ\x00' "$root/boot/vmlinuz-$kver" | head -n1 | cut -d: -f1)"
  [ -n "$off" ] || { log "no xz stream in vmlinuz-$kver"; exit 1; }
  # xz stops at the end of its stream and complains of the bytes after it.
  tail -c +"$((off + 1))" "$root/boot/vmlinuz-$kver" | xz -dc >"$cache/vmlinux.tmp" 2>/dev/null || true
  [ "$(head -c 4 "$cache/vmlinux.tmp" | od -An -c | tr -d ' ')" = '177ELF' ] ||
    { log "vmlinuz-$kver did not uncompress to an ELF kernel"; exit 1; }
  mv "$cache/vmlinux.tmp" "$cache/vmlinux"
fi
ln -sfn "root/lib/modules" "$cache/modules"
ln -sfn "root/usr/bin/qemu-system-x86_64" "$cache/qemu"
ln -sfn "root/usr/share/qemu" "$cache/firmware"
echo "$kver" >"$cache/kernel.version"

# The initramfs: busybox, init.sh as /init, and the modules needed to mount a
# 9p root over virtio plus overlayfs, each with its dependencies in load
# order. Rebuilt when init.sh or the kernel changed.
initrd="$cache/initramfs.cpio"
want="$(cat "$here/init.sh" "$cache/kernel.pkg" "$cache/debs/busybox-static.unpacked" | sha256sum | cut -d' ' -f1)"
if [ ! -f "$initrd" ] || [ "$(cat "$cache/initramfs.sum" 2>/dev/null)" != "$want" ]; then
  log "building the initramfs"
  stage="$(mktemp -d "$cache/initramfs.XXXXXX")"
  trap 'rm -rf "$stage"' EXIT
  mkdir -p "$stage"/{bin,dev,proc,sys,mnt,newroot,modules}
  cp "$root/bin/busybox" "$stage/bin/busybox"
  ln -s busybox "$stage/bin/sh"
  cp "$here/init.sh" "$stage/init"
  chmod 755 "$stage/init"
  # Resolve each wanted module and its dependencies from modules.dep.
  : >"$stage/modules/load"
  declare -A seen=()
  add_mod() {
    local rel="$1" line deps d
    [ -n "${seen[$rel]:-}" ] && return 0
    seen[$rel]=1
    line="$(grep -m1 "^$rel:" "$moddir/modules.dep" || true)"
    deps="${line#*:}"
    for d in $deps; do add_mod "$d"; done
    cp "$moddir/$rel" "$stage/modules/"
    basename "$rel" >>"$stage/modules/load"
  }
  # crc32c (the generic one and the SSE4.2 one, which wins when the CPU
  # has it): ext4 asks the crypto API for it at its first mount (the
  # scratch disk's), and the kernel would load it by running modprobe
  # from the 9p root, which took 1-2 s of each boot under TCG.
  for name in virtio_pci virtio_blk 9pnet_virtio 9p overlay crc32c_generic crc32c-intel ext4; do
    rel="$(grep -m1 -E "/$name\.ko(\.[a-z]+)?:" "$moddir/modules.dep" | cut -d: -f1 || true)"
    if [ -n "$rel" ]; then add_mod "$rel"; fi # absent: built into the kernel
  done
  (cd "$stage" && find . | "$root/bin/busybox" cpio -o -H newc >"$initrd.tmp" 2>/dev/null)
  mv "$initrd.tmp" "$initrd"
  echo "$want" >"$cache/initramfs.sum"
  rm -rf "$stage"
  trap - EXIT
fi
log "ready in $cache (kernel $kver)"
