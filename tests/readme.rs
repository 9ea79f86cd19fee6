//! Every shell example in README.md, deploy/README.md and docs/*.md, run as
//! a user would run it, so the documentation cannot drift from the binary.
//!
//! Each fenced `sh` block is cut into commands (continuation lines joined,
//! trailing comments dropped) and every command must have an entry in
//! [`EXAMPLES`]: how to run it, or why it cannot run here. A command with no
//! entry fails the test, and so does an entry no document has any more, so
//! a changed example is always looked at. Each block runs as one bash
//! script, in a new mount and network namespace of its own (`unshare`):
//! `/etc`, `/run`, `/srv`, `/mnt` and `/var/lib` are overlays on a scratch
//! directory, so the examples write where they say (`/srv/vol1.img`,
//! `/etc/bash_completion.d`, the agent's default state directory and CSI
//! socket) without touching the host, and the agent's default port 9477 is
//! the namespace's own. The whole script is killed, with everything it
//! started, at [`BLOCK_TIMEOUT`].
//!
//! What the test changes in a command, all of it listed here:
//! - `cargo run --release [-q] --` becomes `volring`, the binary this test
//!   was built with (`cargo run` would build and run the same one), whose
//!   directory is first on PATH (what `cargo install --path .` gives).
//! - A command that names this machine's disks (`vda`, `/dev/loop0`,
//!   `/dev/sdb`) gets loop devices the test attaches instead ([`Example::sub`]).
//! - A command that runs until Ctrl-C runs until it has shown what the
//!   README says it shows, then gets SIGINT and must exit.

mod common;

use std::io::Read;
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::{check, LoopDevice, Scratch};
use libtest_mimic::{Failed, Trial};

const VOLRING: &str = env!("CARGO_BIN_EXE_volring");
const ROOT: &str = env!("CARGO_MANIFEST_DIR");

/// Longest a block may run (the CSI walk-through with a debug build takes ~5 s).
const BLOCK_TIMEOUT: Duration = Duration::from_secs(240);

/// The documents whose shell blocks are run.
fn documents() -> Vec<String> {
    let mut docs = vec!["README.md".to_string(), "deploy/README.md".to_string()];
    let mut more: Vec<String> = std::fs::read_dir(Path::new(ROOT).join("docs"))
        .map(|d| {
            d.filter_map(|e| e.ok()).map(|e| format!("docs/{}", e.file_name().to_string_lossy())).filter(|n| n.ends_with(".md")).collect()
        })
        .unwrap_or_default();
    more.sort();
    docs.extend(more);
    docs
}

#[derive(Clone, Copy, Debug)]
enum How {
    /// Runs to completion with status 0; its output contains the text.
    Run(&'static str),
    /// Runs until Ctrl-C: started, watched until its output contains the
    /// text, then sent SIGINT; it must exit within 20 s with status 0.
    UntilCtrlC(&'static str),
    /// Like [`How::UntilCtrlC`], but left running (the README's "second
    /// terminal") for the commands after it, and stopped at the block's end.
    Server(&'static str),
    /// `mounts --watch`: a tmpfs is mounted under the scratch directory and
    /// left there for up to 1 s until an `attached` line with the mount read
    /// comes out, then unmounted (again, until one does), then SIGINT.
    Watch,
    /// Ends in `&`: started in the background; the shell snippet must
    /// succeed (it is retried for 10 s) before the next command, and the job
    /// is stopped with SIGINT at the block's end.
    Background(&'static str),
    /// Needs CAP_SYS_RESOURCE: run; without the capability the output must
    /// be the documented refusal (the text) instead.
    NeedsSysResource(&'static str),
    /// Not run, for this reason.
    Skip(&'static str),
}

struct Example {
    /// The command as the document has it (continuations joined, comment dropped).
    cmd: &'static str,
    how: How,
    /// Text replaced in the command before it runs: this machine's devices.
    sub: &'static [(&'static str, &'static str)],
    /// The block needs the agent running (`volring node`, the README's first command).
    agent: bool,
}

const fn ex(cmd: &'static str, how: How) -> Example {
    Example { cmd, how, sub: &[], agent: false }
}

const NO_CLUSTER: &str = "needs a Kubernetes cluster; tests/deploy/ checks every manifest it applies";
/// The remote-volume example spans two nodes and needs the nbd module.
const REMOTE: &str = "two nodes (the owner at 10.0.0.5) and the nbd module on the second: tests/nbd_remote.rs runs the export side here, tests/vm/remote.rs the attach in the 6.1 VM";
const BENCH: &str = "a bench: minutes of load on every core; run by hand, its figures are in docs/benchmarks.md";
/// Running a test suite (or part of one) from inside a test.
const SUITE: &str = "runs a test suite, or part of one, of its own; CI runs every suite";
const NBD_MODULE: &str = "needs the kernel's nbd module, which this machine's kernel lacks; tests/vm/nbd.rs runs the same attach, kill -9, reattach, status, watch and detach in the 6.1 VM";

/// How each documented command is run. `csi` in the CSI walk-through is the
/// alias its first line defines.
const EXAMPLES: &[Example] = &[
    // README.md: first run.
    ex("cargo run --release -- node --log-events", How::UntilCtrlC("INFO volring::agent: ready ")),
    ex(".ci/deps", How::Skip("installs Debian packages and downloads the VM image: CI's first step, not something a test may do to its machine")),
    ex("cargo test", How::Skip("the whole suite, of which this test is a part; CI runs it")),
    // README.md: Using it.
    ex("volring --help", How::Run("Usage: volring")),
    ex("volring mounts", How::Run("/proc")),
    ex("volring mounts -o TARGET,SOURCE,PROPAGATION --list", How::Run("PROPAGATION")),
    ex("volring mounts --target /var/lib", How::Run("/var/lib overlay")),
    ex("volring mounts --json", How::Run("\"filesystems\"")),
    ex("volring mounts --watch", How::Watch),
    ex("volring node --mount-watch reparse", How::UntilCtrlC("INFO volring::agent: ready ")),
    ex("volring node --io epoll", How::UntilCtrlC("INFO volring::agent: ready ")),
    ex("volring mounts --watch --mount-batch-us 1000", How::Watch),
    ex("volring devices", How::Run("MOUNTPOINTS")),
    ex("volring devices -o NAME,SIZE,UUID", How::Run("UUID")),
    ex("volring devices --json", How::Run("\"blockdevices\"")),
    ex("volring devices --exclude /dev/loop --exclude-os-disk", How::Run("NAME")),
    ex("volring stats", How::UntilCtrlC("r_await")),
    Example { cmd: "volring stats vda /dev/loop0", how: How::UntilCtrlC("r_await"), sub: &[("vda /dev/loop0", "${DISK_A#/dev/} $DISK_B")], agent: false },
    ex("volring completions bash > /etc/bash_completion.d/volring", How::Run("")),
    ex("volring man | man -l -", How::Run("volring")),
    ex("volring status", How::Run("STAGED (0)")),
    ex("volring get blockdevices", How::Run("# blockdevices from the node's store")),
    ex("volring get sn -o yaml", How::Run("# storagenodes from the node's store")),
    ex("volring top", How::Skip("interactive: draws on a terminal until q; tests/cli_top.rs drives it in a pseudo-terminal")),
    ex("volring top --once --json", How::Run("\"source\": \"kernel")),
    ex("volring df", How::Run("USE%")),
    ex("volring stats --by volume --count 1", How::Run("VOLUME")),
    ex("volring nbd serve --unix /run/volring/nbd.sock --export vol1=/srv/vol1.img", How::Server("\"listening\":[\"unix:/run/volring/nbd.sock\"]")),
    ex("volring node --metrics-addr 127.0.0.1:9477 --stats-interval 1 --stats-method auto", How::UntilCtrlC("metrics=\"http://127.0.0.1:9477/metrics\"")),
    // README.md: the CSI walk-through, with the agent of the first command running.
    Example { cmd: "alias csi='cargo run --release -q -- csi'", how: How::Run(""), sub: &[], agent: true },
    ex("csi probe", How::Run("\"ready\": true")),
    ex("csi create --name pvc-demo --size 1G", How::Run("\"volume_id\": \"pvc-demo\"")),
    ex("csi stage --id pvc-demo --staging /var/lib/kubelet/plugins/volring.csi.io/staging/pvc-demo", How::Run("{}")),
    ex(
        "csi publish --id pvc-demo --staging /var/lib/kubelet/plugins/volring.csi.io/staging/pvc-demo --target /var/lib/kubelet/pods/demo/volumes/pvc-demo",
        How::Run("{}"),
    ),
    ex("echo hello > /var/lib/kubelet/pods/demo/volumes/pvc-demo/hello", How::Run("")),
    ex("csi stats --id pvc-demo --path /var/lib/kubelet/pods/demo/volumes/pvc-demo", How::Run("\"INODES\"")),
    ex("csi expand --id pvc-demo --size 2G", How::Run("\"capacity_bytes\": 2147483648")),
    ex(
        "csi node-expand --id pvc-demo --path /var/lib/kubelet/pods/demo/volumes/pvc-demo",
        How::NeedsSysResource("FailedPrecondition: growing a mounted ext4 filesystem needs CAP_SYS_RESOURCE"),
    ),
    ex("csi unpublish --id pvc-demo --target /var/lib/kubelet/pods/demo/volumes/pvc-demo", How::Run("{}")),
    ex("csi unstage --id pvc-demo --staging /var/lib/kubelet/plugins/volring.csi.io/staging/pvc-demo", How::Run("{}")),
    ex("csi delete --id pvc-demo", How::Run("{}")),
    // docs/nbd.md: the NBD server (its first and third commands are the README's too).
    ex("truncate -s 10G /srv/vol1.img", How::Run("")),
    Example {
        cmd: "volring nbd serve --unix /run/volring/nbd.sock --export vol1=/srv/vol1.img --export golden=/dev/sdb,ro,limit=4 --tcp 127.0.0.1:10809 --stats-interval 10",
        how: How::Server("\"listening\":[\"unix:/run/volring/nbd.sock\",\"127.0.0.1:10809\"]"),
        sub: &[("/dev/sdb", "$DISK_A")],
        agent: false,
    },
    ex("nbdinfo 'nbd+unix:///vol1?socket=/run/volring/nbd.sock'", How::Run("export-size: 10737418240")),
    ex("qemu-img convert -f raw -O qcow2 'nbd+unix:///golden?socket=/run/volring/nbd.sock' golden.qcow2", How::Run("")),
    ex("mkdir -p /mnt/nbd", How::Run("")),
    ex("nbdfuse /mnt/nbd 'nbd+unix:///vol1?socket=/run/volring/nbd.sock' &", How::Background("test \"$(stat -c %s /mnt/nbd/nbd)\" = 10737418240")),
    ex("volring node --nbd-listen unix:/run/volring/nbd.sock --nbd-export vol1=/srv/vol1.img", How::UntilCtrlC("nbd=\"unix:/run/volring/nbd.sock\"")),
    // docs/nbd.md: /dev/nbdN through the kernel's driver (`nbd status` is in the README too).
    ex("volring nbd attach --export vol1=/srv/vol1.img --backend-id pvc-1 --connections 2 &", How::Skip(NBD_MODULE)),
    ex("kill -9 %1", How::Skip(NBD_MODULE)),
    ex("volring nbd attach --export vol1=/srv/vol1.img --backend-id pvc-1 --index 0 --reattach &", How::Skip(NBD_MODULE)),
    ex("volring nbd status", How::Skip(NBD_MODULE)),
    ex("volring nbd watch", How::Skip(NBD_MODULE)),
    ex("volring nbd detach --index 0 --backend-id pvc-1", How::Skip(NBD_MODULE)),
    // docs/testing.md: one suite, one trial; the VM; fuzzing.
    ex("cargo test --test csi -- --list", How::Skip(SUITE)),
    ex("cargo test --test csi csi::lifecycle_block", How::Skip(SUITE)),
    ex("cargo test --test vm vm_nbd::", How::Skip(SUITE)),
    ex("cargo test --test readme docs_nbd_md", How::Skip(SUITE)),
    ex("bash tests/vm/fetch.sh", How::Skip("downloads ~210 MB of Debian packages; CI runs it from .ci/deps")),
    ex("cargo test --test vm", How::Skip("a test suite of its own (boots the VM); CI runs it")),
    ex("(cd fuzz && cargo +nightly fuzz run mountinfo)", How::Skip("fuzzing runs until stopped and needs the nightly toolchain; run by hand")),
    // docs/benchmarks.md: the benches.
    ex("cargo bench --bench mount_storm", How::Skip(BENCH)),
    ex("cargo bench --bench mount_storm -- --watcher process --volring-bin OLD:NEW", How::Skip(BENCH)),
    ex("cargo bench --bench mount_storm -- --watcher moves", How::Skip(BENCH)),
    ex("cargo bench --bench node_storm", How::Skip(BENCH)),
    ex("cargo bench --bench mounts", How::Skip(BENCH)),
    ex("cargo bench --features libmount-peer --bench parse_vs_libmount", How::Skip(BENCH)),
    ex("cargo bench --bench device_stats", How::Skip(BENCH)),
    ex("cargo bench --bench devices", How::Skip(BENCH)),
    ex("cargo bench --bench csi_volumes", How::Skip(BENCH)),
    ex("cargo bench --bench volume_series", How::Skip(BENCH)),
    ex("cargo bench --bench state_scale", How::Skip(BENCH)),
    ex("cargo bench --bench nbd_peers", How::Skip(BENCH)),
    ex("cargo bench --bench nbd_peers --no-run", How::Skip(BENCH)),
    ex(
        "VOLRING_BENCH_SECS=3 VOLRING_BENCH_ROUNDS=3 VOLRING_BENCH_ONLY=all VOLRING_BENCH_PEERS=volring,floor,nbdkit VOLRING_BENCH_BASELINE=/tmp/volring-b6aead9,/tmp/volring-ac8946f target/release/deps/nbd_peers-* --bench",
        How::Skip(BENCH),
    ),
    ex("VOLRING_BENCH_BACKGROUND_LOAD=2 VOLRING_BENCH_ONLY=all cargo bench --bench nbd_peers", How::Skip(BENCH)),
    ex("target/release/deps/mount_storm-* --bench --watcher process --sizes 1000,10000 --runs 5 --volring-bin OLD:NEW", How::Skip(BENCH)),
    ex("VOLRING_BENCH_AGENT=OLD target/release/deps/csi_volumes-* --bench [--volumes 400 --publish 100 --calls 8000]", How::Skip(BENCH)),
    ex("VOLRING_BENCH_AGENT=NEW target/release/deps/csi_volumes-* --bench [...]", How::Skip(BENCH)),
    ex("VOLRING_BENCH_POOLS=ext4,xfs VOLRING_BENCH_ONLY=writes cargo bench --bench nbd_peers", How::Skip(BENCH)),
    ex(
        "VOLRING_BENCH_ONLY=reads VOLRING_BENCH_PEERS=volring,nbdkit VOLRING_BENCH_BASELINE=/path/to/old/volring cargo bench --bench nbd_peers",
        How::Skip(BENCH),
    ),
    ex("cargo bench --bench nbd_wire", How::Skip(BENCH)),
    ex("cargo bench --bench probe_vs_blkid", How::Skip(BENCH)),
    ex("cargo bench --bench publisher -- --runs 1", How::Skip(BENCH)),
    ex("cargo bench --bench vm_nbd_fio", How::Skip(BENCH)),
    // docs/nbd.md: remote nbd volumes (two nodes, an address that is not this machine's).
    ex("volring node --nbd-export-listen 10.0.0.5:10809", How::Skip(REMOTE)),
    ex("volring csi create --name pvc-r --size 1G --param attach=nbd", How::Skip(REMOTE)),
    ex(
        "volring csi stage --id pvc-r --staging /var/lib/kubelet/plugins/volring.csi.io/staging/pvc-r --context volring.io/nbd-uri=nbd://10.0.0.5:10809/pvc-r --context volring.io/nbd-secret=<64 hex digits>",
        How::Skip(REMOTE),
    ),
    ex("nbdinfo \"nbd://10.0.0.5:10809/pvc-r/<secret>\"", How::Skip(REMOTE)),
    // deploy/README.md.
    ex("docker build -f deploy/Dockerfile -t volring:0.1.0 .", How::Skip("needs docker and network access to base images, neither of which CI's machine has")),
    ex("kubectl apply -k deploy/", How::Skip(NO_CLUSTER)),
    ex("kubectl apply -k deploy/monitoring", How::Skip(NO_CLUSTER)),
    ex("deploy/image/build.sh", How::Skip("builds the image as root from Debian's archive, minutes; .ci/image runs it twice, then deploy/image/check.sh")),
    ex("ctr -n k8s.io images import target/image/volring-0.1.0.oci.tar", How::Skip("on a cluster's node; deploy/image/check.sh imports the archive into a containerd of its own")),
    ex("kind load image-archive target/image/volring-0.1.0.oci.tar", How::Skip(NO_CLUSTER)),
    ex(
        "skopeo copy oci-archive:target/image/volring-0.1.0.oci.tar docker://registry.example.com/volring:0.1.0",
        How::Skip("needs a registry; deploy/image/check.sh reads the archive with skopeo inspect"),
    ),
    ex("kubectl apply -k deploy/overlays/single-node-monitoring", How::Skip(NO_CLUSTER)),
    ex("kubectl delete -k deploy/", How::Skip(NO_CLUSTER)),
];

/// A fenced shell block: where it starts and its commands.
struct Block {
    at: String,
    commands: Vec<String>,
    /// Where a following block that continues this one starts: the servers
    /// started before are stopped there (the README's "instead of").
    stop_before: Vec<usize>,
}

/// First commands of blocks that continue the block before them (they use
/// the files it made), run in the same script after its servers stopped.
const CONTINUES: &[&str] = &["volring node --nbd-listen unix:/run/volring/nbd.sock --nbd-export vol1=/srv/vol1.img"];

/// Cuts a `#` comment that is outside quotes and starts a word.
fn strip_comment(line: &str) -> &str {
    let (mut single, mut double, mut prev) = (false, false, ' ');
    for (i, c) in line.char_indices() {
        match c {
            '\'' if !double => single = !single,
            '"' if !single => double = !double,
            '#' if !single && !double && prev.is_whitespace() => return &line[..i],
            _ => {}
        }
        prev = c;
    }
    line
}

/// The fenced `sh` blocks of a document; blocks of any other language
/// (the README's ```json event) are passed over whole.
fn blocks(doc: &str, text: &str) -> Vec<Block> {
    let mut out = Vec::new();
    // None: outside a block; Some(None): inside another language's block.
    let mut current: Option<Option<Block>> = None;
    let mut pending = String::new();
    for (n, line) in text.lines().enumerate() {
        if let Some(lang) = line.strip_prefix("```") {
            current = match current.take() {
                Some(b) => {
                    out.extend(b);
                    None
                }
                None if matches!(lang.trim(), "sh" | "bash" | "shell") => {
                    Some(Some(Block { at: format!("{doc}:{}", n + 1), commands: Vec::new(), stop_before: Vec::new() }))
                }
                None => Some(None),
            };
            continue;
        }
        let Some(Some(b)) = current.as_mut() else { continue };
        let body = strip_comment(line).trim_end();
        if let Some(cont) = body.strip_suffix('\\') {
            pending.push_str(cont.trim());
            pending.push(' ');
            continue;
        }
        pending.push_str(body.trim());
        let cmd = std::mem::take(&mut pending).split_whitespace().collect::<Vec<_>>().join(" ");
        if !cmd.is_empty() {
            b.commands.push(cmd);
        }
    }
    out
}

fn example(cmd: &str) -> Option<&'static Example> {
    EXAMPLES.iter().find(|e| e.cmd == cmd)
}

fn all_blocks() -> Result<Vec<Block>, Failed> {
    let mut all: Vec<Block> = Vec::new();
    for doc in documents() {
        let text = std::fs::read_to_string(Path::new(ROOT).join(&doc))?;
        for b in blocks(&doc, &text) {
            match all.last_mut() {
                Some(prev) if b.commands.first().is_some_and(|c| CONTINUES.contains(&c.as_str())) => {
                    prev.stop_before.push(prev.commands.len());
                    prev.commands.extend(b.commands);
                }
                _ => all.push(b),
            }
        }
    }
    Ok(all)
}

/// Every documented command has an entry, and every entry is documented.
fn every_example_is_classified() -> Result<(), Failed> {
    let blocks = all_blocks()?;
    let mut missing = Vec::new();
    for b in &blocks {
        for c in &b.commands {
            if example(c).is_none() {
                missing.push(format!("{}: {c}", b.at));
            }
        }
    }
    check(
        missing.is_empty(),
        format!("commands with no entry in tests/readme.rs EXAMPLES (say how to run them, or why not):\n{}", missing.join("\n")),
    )?;
    let stale: Vec<&str> = EXAMPLES.iter().map(|e| e.cmd).filter(|c| !blocks.iter().any(|b| b.commands.iter().any(|x| x == *c))).collect();
    check(stale.is_empty(), format!("entries in EXAMPLES that no document shows any more: {stale:?}"))
}

fn quote(s: &str) -> String {
    format!("'{}'", s.replace('\'', "'\\''"))
}

/// Shell helpers the block's script uses. `wait_for FILE TEXT PID` polls
/// for 60 s; `stop PID` sends SIGINT and waits 20 s for the exit.
const PRELUDE: &str = r#"
set -u -o pipefail
shopt -s expand_aliases
fail() { echo "EXAMPLE FAILED: $*" >&2; exit 1; }
wait_for() {
    for _ in $(seq 600); do
        grep -qF -- "$2" "$1" && return 0
        kill -0 "$3" 2>/dev/null || { cat "$1" >&2; fail "exited before printing [$2]"; }
        sleep 0.1
    done
    cat "$1" >&2; fail "no [$2] in 60 s"
}
stop() {
    kill "-${2:-INT}" "$1" 2>/dev/null
    for _ in $(seq 200); do
        kill -0 "$1" 2>/dev/null || { wait "$1"; return $?; }
        sleep 0.1
    done
    kill -KILL "$1"; fail "pid $1 ignored SIGINT for 20 s"
}
servers=()
stop_servers() {
    for ((i=${#servers[@]}-1; i>=0; i--)); do stop ${servers[$i]} || true; done
    servers=()
}
trap stop_servers EXIT
for d in /etc /run /srv /mnt /var/lib; do
    n=${d//\//_}
    mkdir -p "$OVERLAYS/u$n" "$OVERLAYS/w$n"
    mount -t overlay overlay -o "lowerdir=$d,upperdir=$OVERLAYS/u$n,workdir=$OVERLAYS/w$n" "$d" || fail "overlay on $d"
done
ip link set lo up || fail "lo up"
# What the README's first command (the agent) leaves on a node: its state
# directory. `status` and `get` refuse a state directory that does not exist.
mkdir -p /var/lib/volring || fail "state dir"
has_sys_resource() { (( (0x$(awk '/^CapEff/ {print $2}' /proc/self/status) >> 24) & 1 )); }
n=0
"#;

/// The script for one block: each command checked as its entry says.
fn script(b: &Block) -> Result<String, Failed> {
    let mut s = String::from(PRELUDE);
    let entries: Vec<&Example> =
        b.commands.iter().map(|c| example(c).ok_or_else(|| format!("{}: no entry for {c}", b.at))).collect::<Result<_, _>>()?;
    if entries.iter().any(|e| e.agent) {
        s.push_str("volring node --log-events > agent.out 2>&1 & servers+=($!)\nwait_for agent.out 'INFO volring::agent: ready ' $!\n");
    }
    for (i, e) in entries.into_iter().enumerate() {
        if b.stop_before.contains(&i) {
            s.push_str("stop_servers\n");
        }
        let mut cmd = e.cmd.replace("cargo run --release -q --", "volring").replace("cargo run --release --", "volring");
        for (from, to) in e.sub {
            cmd = cmd.replace(from, to);
        }
        let what = quote(&format!("{}: {}", b.at, e.cmd));
        s.push_str("n=$((n+1)); out=cmd$n.out\n");
        match e.how {
            How::Run(text) => {
                s.push_str(&format!("{{ {cmd}\n}} > $out 2>&1 || {{ cat $out >&2; fail {what}; }}\n"));
                if !text.is_empty() {
                    s.push_str(&format!("grep -qF -- {} $out || {{ cat $out >&2; fail {what} ': no' {}; }}\n", quote(text), quote(text)));
                }
            }
            How::NeedsSysResource(refusal) => s.push_str(&format!(
                "if has_sys_resource; then {{ {cmd}\n}} > $out 2>&1 || {{ cat $out >&2; fail {what}; }}\nelse {{ {cmd}\n}} > $out 2>&1 && fail {what} ': succeeded without CAP_SYS_RESOURCE'; grep -qF -- {} $out || {{ cat $out >&2; fail {what} ': not the documented refusal'; }}; fi\n",
                quote(refusal)
            )),
            How::UntilCtrlC(text) => s.push_str(&format!(
                "{cmd} > $out 2>&1 & p=$!\nwait_for $out {} $p\nstop $p || {{ cat $out >&2; fail {what} ': exit status' $?; }}\n",
                quote(text)
            )),
            How::Server(text) => s.push_str(&format!("{cmd} > $out 2>&1 & p=$!; servers+=($p)\nwait_for $out {} $p\n", quote(text))),
            How::Watch => s.push_str(&format!(
                "{cmd} > $out 2>&1 & p=$!\nmkdir -p watched\nseen='^[{{]\"event\":\"attached\",\"id\":[0-9]*,\"mount\":[{{]'\nfor _ in $(seq 20); do mount -t tmpfs readme-watch watched || fail {what} ': mount tmpfs'; for _ in $(seq 10); do grep -q \"$seen\" $out && break; sleep 0.1; done; umount watched; grep -q \"$seen\" $out && break; kill -0 $p || break; done\nwait_for $out '\"event\":\"attached\"' $p\ncp $out watch.jsonl\nstop $p || fail {what} ': exit status' $?\n"
            )),
            How::Background(ready) => s.push_str(&format!(
                "{cmd} servers+=(\"$! TERM\")\nfor _ in $(seq 100); do {ready} 2>/dev/null && break; sleep 0.1; done\n{ready} || fail {what} ': not ready: ' {}\n",
                quote(ready)
            )),
            How::Skip(why) => s.push_str(&format!("echo skipped: {what} {}\n", quote(why))),
        }
    }
    s.push_str("stop_servers\necho BLOCK-OK\n");
    Ok(s)
}

/// Runs one block's script in its own mount and network namespace, with
/// loop devices standing in for this machine's disks; kills its whole
/// process group at the deadline.
fn run_block(b: &Block) -> Result<String, Failed> {
    let scratch = Scratch::new();
    let (disk_a, disk_b) = (LoopDevice::new(64 << 20), LoopDevice::new(64 << 20));
    let work = scratch.dir("work");
    let bin = Path::new(VOLRING).parent().ok_or("binary dir")?;
    let path = format!("{}:{}", bin.display(), std::env::var("PATH").unwrap_or_default());
    let mut child = Command::new("unshare")
        .args(["--mount", "--net", "--propagation", "private", "--", "bash", "-c", &script(b)?])
        .current_dir(&work)
        .env("PATH", path)
        .env("OVERLAYS", scratch.dir("overlays"))
        .env("DISK_A", disk_a.path())
        .env("DISK_B", disk_b.path())
        .env("NO_COLOR", "1")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .process_group(0)
        .spawn()?;
    let deadline = Instant::now() + BLOCK_TIMEOUT;
    let status = loop {
        if let Some(s) = child.try_wait()? {
            break Some(s);
        }
        if Instant::now() > deadline {
            let _ = rustix::process::kill_process_group(
                rustix::process::Pid::from_raw(child.id() as i32).ok_or("pid")?,
                rustix::process::Signal::KILL,
            );
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let (mut out, mut err) = (String::new(), String::new());
    child.stdout.take().ok_or("stdout")?.read_to_string(&mut out)?;
    child.stderr.take().ok_or("stderr")?.read_to_string(&mut err)?;
    let watch = std::fs::read_to_string(work.join("watch.jsonl")).unwrap_or_default();
    match status {
        None => Err(format!("{}: the block did not finish in {BLOCK_TIMEOUT:?}\n{out}\n{err}", b.at).into()),
        Some(s) if !s.success() || !out.contains("BLOCK-OK") => Err(format!("{}: {s}\n{out}\n{err}", b.at).into()),
        Some(_) => Ok(watch),
    }
}

/// The README's change event has the fields a real one has: `mounts --watch`
/// (run by the "Using it" block) printed one, compared key by key.
fn event_example_matches(watch: &str) -> Result<(), Failed> {
    let readme = std::fs::read_to_string(Path::new(ROOT).join("README.md"))?;
    let json = readme.split("```json\n").nth(1).and_then(|r| r.split("```").next()).ok_or("README has no ```json block")?;
    let doc: serde_json::Value = serde_json::from_str(json.trim())?;
    let real: serde_json::Value = watch
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        // Read while it was mounted (one gone first has `"mount": null`).
        .find(|v| v["event"] == "attached" && v["mount"].is_object())
        .ok_or_else(|| format!("no attached event from mounts --watch: {watch}"))?;
    let keys = |v: &serde_json::Value| -> Vec<String> {
        let mut k: Vec<String> = v.as_object().map(|o| o.keys().cloned().collect()).unwrap_or_default();
        k.sort();
        k
    };
    check(keys(&doc) == keys(&real), format!("event fields: README {:?}, real {:?}", keys(&doc), keys(&real)))?;
    check(
        keys(&doc["mount"]) == keys(&real["mount"]),
        format!("mount fields: README {:?}, real {:?}", keys(&doc["mount"]), keys(&real["mount"])),
    )
}

fn main() {
    let mut trials = vec![Trial::test("readme::every_example_is_classified", every_example_is_classified)];
    let blocks = all_blocks().expect("read the documents");
    for b in blocks {
        let runnable = b.commands.iter().any(|c| example(c).is_some_and(|e| !matches!(e.how, How::Skip(_))));
        let name = format!("readme::block::{}", b.at.replace(['/', '.', ':'], "_"));
        let has_watch = b.commands.iter().any(|c| example(c).is_some_and(|e| matches!(e.how, How::Watch)));
        let trial = Trial::test(name, move || {
            let watch = run_block(&b)?;
            if has_watch {
                event_example_matches(&watch)?;
            }
            Ok(())
        });
        trials.push(trial.with_ignored_flag(!runnable));
    }
    common::run_in_private_namespace(trials)
}
