//! Throughput through the kernel's nbd driver (`/dev/nbdN`) in the 6.1 VM
//! (tests/vm/harness.rs), volring's server against qemu-nbd's on the same
//! guest in the same run: each serves a sparse image on the guest's scratch
//! ext4, each attached over netlink with one connection (volring's by
//! `volring nbd attach`, qemu-nbd's by this binary, which negotiates on
//! qemu-nbd's unix socket and hands the socket to NBD_CMD_CONNECT), and the
//! same fio jobs (O_DIRECT on the device) run against one then the other,
//! round by round. The images are sparse and not filled first (filling
//! 256 MiB twice costs minutes under TCG): reads of what the write jobs
//! did not reach read holes, from both servers alike. Printed: each workload's median MiB/s and IOPS per
//! server, the ratio volring / qemu-nbd, and each server process's CPU time
//! per request (from /proc/PID/stat around each run).
//!
//! TCG makes absolute numbers meaningless (every guest instruction is
//! emulated); the ratio is what this measures.
//!
//! `cargo bench --bench vm_nbd_fio` (needs tests/vm/fetch.sh;
//! VOLRING_BENCH_SECS per fio run, default 4; VOLRING_BENCH_ROUNDS,
//! default 3).

#[path = "../tests/vm/harness.rs"]
mod harness;

use std::collections::BTreeMap;
use std::fs;
use std::os::fd::AsFd;
use std::os::unix::net::UnixStream;
use std::time::Duration;

use volring_nbd::attach::{ConnectSpec, NbdControl};

/// fio jobs: name, rw, block size, queue depth.
/// Sequential writes last: on 6.1 they stalled volring's server until the
/// ring stopped dropping a multishot receive's completions (the bug
/// tests/vm/volumes.rs's xfs case hit), and a stalled server ends its
/// device for the jobs after it.
const JOBS: &[(&str, &str, &str, u32)] = &[
    ("rand-read-4k", "randread", "4k", 32),
    ("seq-read-1m", "read", "1M", 8),
    ("rand-write-4k", "randwrite", "4k", 32),
    ("seq-write-1m", "write", "1M", 8),
];

/// In the guest: `vm_nbd_fio attach-unix SOCKET EXPORT INDEX BACKEND`
/// connects /dev/nbd<INDEX> to the export behind a unix socket.
fn attach_unix(args: &[String]) -> Result<(), String> {
    let [sock, export, index, backend] = args else { return Err("attach-unix SOCKET EXPORT INDEX BACKEND".into()) };
    let mut s = UnixStream::connect(sock).map_err(|e| format!("connect {sock}: {e}"))?;
    let details = volring_nbd::client::negotiate(&mut s, export, Duration::from_secs(10)).map_err(|e| format!("negotiate: {e}"))?;
    // The kernel waits on the socket itself: no timeouts of ours.
    for t in [rustix::net::sockopt::Timeout::Recv, rustix::net::sockopt::Timeout::Send] {
        rustix::net::sockopt::set_socket_timeout(&s, t, None).map_err(|e| format!("clear timeout: {e}"))?;
    }
    let mut spec = ConnectSpec::for_export(&details, backend);
    spec.index = Some(index.parse().map_err(|_| format!("index {index:?}"))?);
    // As `volring nbd attach` is run: a dead device fails its I/O soon.
    spec.dead_conn_timeout = Duration::from_secs(10);
    let mut control = NbdControl::open().map_err(|e| e.to_string())?;
    let i = control.connect(&spec, &[s.as_fd()]).map_err(|e| e.to_string())?;
    println!("attached /dev/nbd{i}");
    Ok(())
}

fn script(volring: &str, me: &str, secs: u32, rounds: u32) -> String {
    let jobs: String = JOBS.iter().map(|(n, rw, bs, qd)| format!("{n}:{rw}:{bs}:{qd} ")).collect();
    format!(
        r#"set -u
R=$VM_RESULTS
fail() {{ echo "FAIL: $*"; exit 1; }}
modprobe nbd nbds_max=4 || fail modprobe
truncate -s 256M /tmp/volring.img /tmp/qemu.img
'{volring}' nbd attach --export v=/tmp/volring.img --backend-id bench-volring --index 0 --nbd-threads 1 --dead-conn-timeout 10 >"$R/volring.out" 2>"$R/volring.err" &
vpid=$!
qemu-nbd -k /tmp/qemu.sock -f raw -x q /tmp/qemu.img >"$R/qemu.err" 2>&1 &
qpid=$!
i=0
while ! grep -q attached "$R/volring.out" 2>/dev/null || [ ! -S /tmp/qemu.sock ]; do
  i=$((i + 1)); [ $i -gt 300 ] && fail "servers not up: $(cat "$R/volring.err" "$R/qemu.err")"; sleep 0.1
done
'{me}' attach-unix /tmp/qemu.sock q 1 bench-qemu >"$R/attach.out" 2>&1 || fail "attach qemu-nbd: $(cat "$R/attach.out")"
cpu() {{ awk '{{ print $14 + $15 }}' /proc/$1/stat; }}
dead=
for j in {jobs}; do
  name=${{j%%:*}}; rest=${{j#*:}}; rw=${{rest%%:*}}; rest=${{rest#*:}}; bs=${{rest%%:*}}; qd=${{rest#*:}}
  r=1
  while [ $r -le {rounds} ]; do
    for s in volring:0:$vpid qemu:1:$qpid; do
      srv=${{s%%:*}}; rest=${{s#*:}}; d=${{rest%%:*}}; pid=${{rest#*:}}
      case " $dead " in *" $srv "*) continue ;; esac
      c0=$(cpu $pid)
      if ! fio --name=$name --filename=/dev/nbd$d --rw=$rw --bs=$bs --iodepth=$qd --ioengine=libaio --direct=1 \
        --time_based --runtime={secs} --size=256M --output-format=terse --terse-version=3 >"$R/fio.out" 2>"$R/fio.err"; then
        # A device whose server stalled is dead from here on: say so, go on with the other.
        echo "$name $srv $(head -c 300 "$R/fio.err" | tr '\n' ' ')" >>"$R/failed"
        dead="$dead $srv"
        continue
      fi
      c1=$(cpu $pid)
      # terse v3: 7 read KiB/s, 8 read IOPS, 48 write KiB/s, 49 write IOPS.
      awk -F';' -v r=$r -v n=$name -v s=$srv -v c=$((c1 - c0)) '{{ print r, n, s, $7 + $48, $8 + $49, c }}' "$R/fio.out" >>"$R/rows"
    done
    r=$((r + 1))
  done
done
'{volring}' nbd detach --index 0 >/dev/null 2>&1
'{volring}' nbd detach --index 1 >/dev/null 2>&1
kill $vpid $qpid
"#
    )
}

/// One (job, server)'s runs: MiB/s, IOPS, server CPU ms per 1000 requests.
type Samples = (Vec<f64>, Vec<f64>, Vec<f64>);

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if args.get(1).map(String::as_str) == Some("attach-unix") {
        if let Err(e) = attach_unix(&args[2..]) {
            eprintln!("attach-unix: {e}");
            std::process::exit(1);
        }
        return;
    }
    let Some(image) = harness::image_or_skip("vm_nbd_fio") else { return };
    let env = |k: &str, d: u32| std::env::var(k).ok().and_then(|v| v.parse().ok()).unwrap_or(d);
    let (secs, rounds) = (env("VOLRING_BENCH_SECS", 4), env("VOLRING_BENCH_ROUNDS", 3));
    let volring = env!("CARGO_BIN_EXE_volring");
    let me = std::env::current_exe().expect("current_exe");
    let mut vm = harness::Vm::new(&image).expect("vm");
    vm.cpus = 2;
    let run = vm.run(&script(volring, &me.to_string_lossy(), secs, rounds), Duration::from_secs(1800)).expect("vm run");
    if run.status != Some(0) {
        let err = fs::read_to_string(run.results.join("volring.err")).unwrap_or_default();
        panic!("guest run failed:\n{}\n--- volring.err\n{err}", run.describe());
    }
    let rows = fs::read_to_string(run.results.join("rows")).expect("rows");
    let mut by: BTreeMap<(String, String), Samples> = BTreeMap::new();
    for l in rows.lines() {
        let f: Vec<&str> = l.split_whitespace().collect();
        let [_, job, srv, kib, iops, ticks] = f[..] else { continue };
        let (kib, iops, ticks): (f64, f64, f64) = (kib.parse().unwrap_or(0.0), iops.parse().unwrap_or(0.0), ticks.parse().unwrap_or(0.0));
        let e = by.entry((job.to_string(), srv.to_string())).or_default();
        e.0.push(kib / 1024.0);
        e.1.push(iops);
        // Ticks are 1/100 s (USER_HZ); requests = IOPS x seconds.
        e.2.push(ticks * 10.0 / (iops * f64::from(secs)).max(1.0) * 1000.0);
    }
    println!(
        "fio on /dev/nbdN in the 6.1 VM (TCG, 2 vCPUs), {rounds} rounds x {secs} s, medians; CPU = server process ms per 1000 fio I/Os (a 1 MiB I/O is 8 nbd requests)"
    );
    println!(
        "{:<14} {:>12} {:>12} {:>9} {:>12} {:>12} {:>9} {:>8}",
        "job", "volring MiB/s", "qemu MiB/s", "ratio", "volring IOPS", "qemu IOPS", "v CPU", "q CPU"
    );
    for (job, ..) in JOBS {
        let get = |s: &str| by.get(&(job.to_string(), s.to_string())).cloned();
        let (Some(mut v), Some(mut q)) = (get("volring"), get("qemu")) else { continue };
        let (vm_, qm) = (median(&mut v.0), median(&mut q.0));
        println!(
            "{job:<14} {vm_:>12.1} {qm:>12.1} {:>9.2} {:>12.0} {:>12.0} {:>9.1} {:>8.1}",
            vm_ / qm.max(1e-9),
            median(&mut v.1),
            median(&mut q.1),
            median(&mut v.2),
            median(&mut q.2)
        );
    }
    let failed = fs::read_to_string(run.results.join("failed")).unwrap_or_default();
    for l in failed.lines() {
        println!("failed (and no later run on that server): {l}");
    }
    println!("(guest {:.0} s)", run.elapsed.as_secs_f64());
}
