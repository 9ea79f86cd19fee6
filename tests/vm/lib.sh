# Shapes the guest scripts share. tests/vm/harness.rs (`script`) puts this
# before every script it builds, so a script calls these as its own; each
# script defines `fail MESSAGE` (record, dump what it needs, exit 1), which
# these call. Under TCG every process a script starts costs real time (a
# run of the debug `volring` binary seconds), so these start as few as
# they can.

# The small tools the scripts run most (every poll loop runs sleep and
# grep or wc each time round) are busybox's when the guest has it. Under
# TCG a run of a dynamically linked tool costs 0.1-0.3 s of guest CPU (the
# loader's lookups and relocations), a run of the static busybox the init
# keeps on tmpfs a fifth of that (measured: 20 runs of `sleep 0` 2.5 s
# against 0.6-0.8 s, of `wc -l` 6.4 s against 1.4 s, at host load 10), and
# a poll every 0.1 s of the dynamic tools took most of a vCPU from the
# writer and the agent. date stays coreutils': busybox's has no %N.
if [ -x /.vm/busybox ]; then
  for tool in sleep wc grep cat head tail cut; do
    eval "$tool() { /.vm/busybox $tool \"\$@\"; }"
  done
fi

now() { date +%s.%N; }

# ask STEP: a trial's host side does STEP (it watches for $R/ask-STEP and
# answers in $R/done-STEP); fails unless it answers ok within 120 s.
ask() {
  touch "$R/ask-$1"
  i=0
  while [ ! -e "$R/done-$1" ]; do
    i=$((i + 1))
    [ $i -gt 1200 ] && fail "the host did not answer $1 within 120 s"
    sleep 0.1
  done
  grep -q '^ok' "$R/done-$1" || fail "host step $1: $(cat "$R/done-$1")"
}

# plain FILE: FILE without terminal colour codes.
plain() { sed 's/\x1b\[[0-9;]*m//g' "$1"; }

# wait_ready PID LOG ENDPOINT: waits (bounded: 60 s for each step) until
# the agent PID logged its "ready" line to LOG and then until Probe on
# ENDPOINT answers ready. The probe is what must hold; the log is looked
# at first (grep is cheap) so that probes, each a run of the debug binary,
# do not compete with the starting agent for the guest's CPUs. Sets
# t_ready to when the probe answered ready.
wait_ready() {
  i=0
  while ! grep -q 'agent: ready' "$2" 2>/dev/null; do
    i=$((i + 1))
    [ $i -gt 600 ] && fail "agent $1 logged no ready line in 60 s: $(tail -5 "$2")"
    kill -0 "$1" 2>/dev/null || fail "agent $1 exited: $(tail -5 "$2")"
    sleep 0.1
  done
  i=0
  while ! "$VOLRING" csi --endpoint "$3" probe 2>/dev/null | grep -q true; do
    i=$((i + 1))
    [ $i -gt 600 ] && fail "agent $1 logged ready, Probe did not say so in 60 s: $(tail -5 "$2")"
    kill -0 "$1" 2>/dev/null || fail "agent $1 exited: $(tail -5 "$2")"
    sleep 0.1
  done
  t_ready=$(now)
}

# start_writer MODE TARGET: a writer in the background (its PID in
# $writer): one FILE_KIB piece of random data at a time, written with dd
# conv=fsync, to TARGET/f<i> (MODE file) or at piece i's offset on the
# block device TARGET (MODE block). A line "i sha256 completion-time" in
# $R/writes for each completed write (the time taken as soon as dd
# returned); the first failure goes to $R/writer.err and ends the writer
# with status 1. Stops once /tmp/stop-writer exists or MAXF pieces are
# written.
#
# dd and sha256sum are busybox's when the guest has it: the same write(2)s
# of 64 KiB and fsync(2) (conv=fsync), the same digest, without loading
# coreutils' dynamically linked binaries twice per piece. 30 pieces of
# 512 KiB to the guest's ext4 took 397-779 jiffies of guest CPU with
# coreutils' and 351-539 with busybox's (the same guest, interleaved, host
# load 4-5).
start_writer() {
  : >"$R/writes"
  rm -f /tmp/stop-writer
  if [ -x /.vm/busybox ]; then wdd="/.vm/busybox dd" wsum="/.vm/busybox sha256sum"; else wdd=dd wsum=sha256sum; fi
  (
    mode=$1 target=$2 i=1
    while [ $i -le "$MAXF" ] && [ ! -e /tmp/stop-writer ]; do
      head -c $((FILE_KIB * 1024)) /dev/urandom >/tmp/src
      if [ "$mode" = block ]; then
        set -- of="$target" seek=$(((i - 1) * FILE_KIB / 64)) conv=notrunc,fsync
      else
        set -- of="$target/f$i" conv=fsync
      fi
      # shellcheck disable=SC2086
      if ! $wdd if=/tmp/src bs=64k "$@" status=none 2>>"$R/writer.err"; then
        echo "write $i failed" >>"$R/writer.err"
        exit 1
      fi
      t=$(now)
      # shellcheck disable=SC2086
      set -- $($wsum </tmp/src)
      echo "$i $1 $t" >>"$R/writes"
      i=$((i + 1))
    done
  ) &
  writer=$!
}

# more_writes N: waits (bounded: 300 s) until the writer completed N +
# PER_CYCLE writes; fails if it ended first.
more_writes() {
  i=0
  while [ "$(wc -l <"$R/writes")" -lt $(($1 + PER_CYCLE)) ]; do
    i=$((i + 1))
    [ $i -gt 600 ] && fail "writer too slow ($(wc -l <"$R/writes") writes)"
    kill -0 $writer 2>/dev/null || fail "writer ended early: $(cat "$R/writer.err")"
    sleep 0.5
  done
}

# verify_files DIR WHAT [NAME]: every file the writer wrote to DIR has its
# checksum (one sha256sum for all of them); fails naming WHAT and the
# first files that differ. NAME: the printf format of piece i's file name
# (default f%d, as the writer names them).
verify_files() {
  awk -v name="${3:-f%d}" '{ printf "%s  " name "\n", $2, $1 }' "$R/writes" >/tmp/sums
  (cd "$1" && sha256sum -c --quiet /tmp/sums) >"$R/verify" 2>&1 || fail "$2: files differ: $(head -5 "$R/verify")"
}

# dist FILE: min, median (the lower middle of an even count), p90 (nearest
# rank) and max of the figures in FILE, one a line.
dist() { sort -n "$1" | awk '{ v[NR] = $1 } END { printf "min %.3f median %.3f p90 %.3f max %.3f s over %d", v[1], v[int((NR + 1) / 2)], v[int(NR * 0.9 + 0.999)], v[NR], NR }'; }
