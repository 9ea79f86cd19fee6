#!/bin/bash
# Host-side peer comparison of where the nbd healer's start walk sits:
# two `volring node` binaries started alternately on copies of one seeded
# state directory, each timed from just before its exec to its walk's
# decision on the recorded nbd volume and to "ready" (log timestamps;
# the exec is at most a fork after t0). Run as root in a private mount
# namespace:  unshare -m --propagation private benches/heal_start_cmp.sh OLD NEW STATE [N]
# STATE: a state directory whose store records an `attach: nbd` volume on a
# device this kernel does not have (the one tests/heal_start.rs seeds:
# copy its scratch `state` while it runs). Prints medians per binary.
set -u
OLD=$1 NEW=$2 STATE=$3 N=${4:-25}
W=$(mktemp -d)
trap 'rm -rf "$W"' EXIT
now() { date +%s.%N; }
at() { date -d "$(grep -m1 "$1" "$W/run/err" | cut -d' ' -f1)" +%s.%N; }
for i in $(seq 1 "$N"); do
  for which in old new; do
    [ $which = old ] && B=$OLD || B=$NEW
    rm -rf "$W/run"; mkdir -p "$W/run/kubelet"; cp -a "$STATE" "$W/run/state"; rm -f "$W/run/state/agent.lock"
    t0=$(now)
    NO_COLOR=1 RUST_LOG=volring=info "$B" node --node-id cmp --metrics-addr off --no-publish --stats-interval 5 \
      --csi-endpoint "unix://$W/run/csi.sock" --kubelet-root "$W/run/kubelet" --state-dir "$W/run/state" 2>"$W/run/err" >/dev/null &
    pid=$!
    for _ in $(seq 1 600); do grep -q "agent: ready" "$W/run/err" && break; sleep 0.05; done
    kill -9 $pid; wait $pid 2>/dev/null
    echo "$which $(echo "$(at 'recorded nbd device is gone') - $t0" | bc) $(echo "$(at 'agent: ready') - $t0" | bc)" >>"$W/times"
  done
done
for which in old new; do
  walk=$(grep "^$which " "$W/times" | awk '{ print $2 }' | sort -n)
  ready=$(grep "^$which " "$W/times" | awk '{ print $3 }' | sort -n)
  n=$(echo "$walk" | wc -l); m=$(((n + 1) / 2)); p=$(((n * 9 + 9) / 10))
  pick() { echo "$1" | sed -n "${2}p"; }
  echo "$which: exec -> walk min $(pick "$walk" 1) median $(pick "$walk" $m) p90 $(pick "$walk" $p) max $(pick "$walk" "$n") s; exec -> ready median $(pick "$ready" $m) s; over $n"
done
