#!/bin/sh
# Init of the test VM (tests/vm/harness.rs boots it; tests/vm/fetch.sh packs
# it as /init of the initramfs).
#
# Stage 1 runs from the initramfs under busybox: it loads the modules a 9p
# root needs, mounts the host's / read-only over 9p with a tmpfs overlay on
# top (so the project's binaries and Debian's tools run unchanged and the
# guest may write anywhere without touching the host), and switch_roots into
# it. Stage 2 runs as PID 1 in that root: the guest kernel's modules from the
# cache appear at /lib/modules, a scratch disk formatted by the host becomes
# /tmp (tmpfs has no O_DIRECT), the read-write "xfer" share holds the script
# to run and receives its output, its exit status and its results. Then the
# guest powers itself off with sysrq (no init system to ask).
#
# Shares (mount tags): hostroot (the host's /, read-only), modules (the
# cache's lib/modules, read-only), xfer (read-write). Disk: /dev/vda.

if [ "$1" != stage2 ]; then
  export PATH=/bin
  /bin/busybox --install -s /bin
  mount -t proc proc /proc
  mount -t sysfs sysfs /sys
  mount -t devtmpfs devtmpfs /dev
  echo "vm-init: stage 1 at $(cut -d' ' -f1 /proc/uptime) s"
  while read -r m; do
    # A module built into this kernel or already loaded is not an error.
    insmod "/modules/$m" 2>/dev/null || echo "vm-init: insmod $m failed"
  done </modules/load
  mkdir -p /mnt/lower /mnt/rw
  p9="trans=virtio,version=9p2000.L,msize=262144"
  if ! mount -t 9p -o "$p9,ro,cache=loose" hostroot /mnt/lower; then
    echo "vm-init: cannot mount the host root"
    echo o >/proc/sysrq-trigger
  fi
  mount -t tmpfs -o mode=0755 tmpfs /mnt/rw
  mkdir -p /mnt/rw/upper /mnt/rw/work
  if ! mount -t overlay overlay \
    -o lowerdir=/mnt/lower,upperdir=/mnt/rw/upper,workdir=/mnt/rw/work /newroot; then
    echo "vm-init: overlay failed"
    echo o >/proc/sysrq-trigger
  fi
  mkdir -p /newroot/.vm /newroot/lib/modules /newroot/run/vm
  cp /bin/busybox /newroot/.vm/busybox
  cp /init /newroot/.vm/init
  mount -t 9p -o "$p9,ro" modules /newroot/lib/modules
  mount -t 9p -o "$p9,rw,cache=none" xfer /newroot/run/vm
  for d in proc sys dev; do
    mount --move "/$d" "/newroot/$d"
  done
  exec switch_root /newroot /.vm/busybox sh /.vm/init stage2
  echo "vm-init: switch_root failed"
  echo o >/proc/sysrq-trigger
  exit 1
fi

# Stage 2: PID 1 in the overlay root.
bb=/.vm/busybox
export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
export HOME=/root
mkdir -p /dev/pts /dev/shm
$bb mount -t devpts -o gid=5,mode=620,ptmxmode=666 devpts /dev/pts
$bb mount -t tmpfs tmpfs /dev/shm
$bb mount -t tmpfs -o mode=0755 tmpfs /run/lock 2>/dev/null
[ -d /sys/fs/cgroup ] && $bb mount -t cgroup2 cgroup2 /sys/fs/cgroup 2>/dev/null
if [ -b /dev/vda ]; then
  $bb mount -t ext4 /dev/vda /tmp || echo "vm-init: /tmp stays on the overlay (tmpfs)"
  chmod 1777 /tmp
fi
# No udev here: load the drivers of the virtio devices present (a network
# card a test added, say) from their modaliases, in one modprobe call. Only
# virtio: loading every platform driver the machine model offers costs
# seconds under TCG.
modprobe -qab $(cat /sys/bus/virtio/devices/*/modalias 2>/dev/null) 2>/dev/null
# The loader, the libraries and the dynamically linked tools the scripts
# run most, copied up into the overlay's tmpfs (a chown copies a file up
# whole): from the 9p root every run of such a tool walks, opens, reads
# the links of (/lib64, /lib) and closes each of its files with a round
# trip to qemu's 9p server. The copies are the same files.
L=/usr/lib/x86_64-linux-gnu
hot="/bin /lib /lib64 /sbin /usr/lib64/ld-linux-x86-64.so.2 /etc/ld.so.cache /etc/alternatives/awk
  $L/ld-linux-x86-64.so.2 $L/libc.so.6 $L/libm.so.6 $L/libgcc_s.so.1 $L/libselinux.so.1 $L/libpcre2-8.so.0
  $L/libacl.so.1 $L/libattr.so.1 /usr/bin/awk /usr/bin/mawk /usr/bin/date /usr/bin/dd /usr/bin/sha256sum
  /usr/bin/bc /usr/bin/sed /usr/bin/sort /usr/bin/tr /usr/bin/tee"
# shellcheck disable=SC2046,SC2086
$bb chown -h 0:0 $hot $(readlink -f $hot) 2>/dev/null
$bb ip link set lo up
$bb hostname volring-vm
echo "vm-init: stage 2 at $(cut -d' ' -f1 /proc/uptime) s, kernel $(uname -r)"

mkdir -p /run/vm/results
(
  cd /run/vm || exit 1
  VM_RESULTS=/run/vm/results exec /bin/sh /run/vm/script
) >/run/vm/stdout 2>&1 </dev/null
echo $? >/run/vm/status.tmp
mv /run/vm/status.tmp /run/vm/status
echo "vm-init: script exited $(cat /run/vm/status) at $(cut -d' ' -f1 /proc/uptime) s"
sync
$bb umount /tmp 2>/dev/null
echo o >/proc/sysrq-trigger
# sysrq poweroff is asynchronous: PID 1 must not exit before it lands.
while :; do $bb sleep 1; done
