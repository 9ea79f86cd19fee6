//! The kernel's nbd driver against `volring nbd attach`, in the VM (see
//! tests/vm/harness.rs and tests/vm/nbd_smoke.sh): attach over netlink,
//! ext4 on it, a writer that fsyncs in a loop, kill -9 of the serving
//! process, reattach with RECONFIGURE, the writer resumes and every byte
//! verifies. Skips (saying why) without the VM image; fails in CI.

#[path = "vm/harness.rs"]
mod harness;

use std::fs;
use std::time::Duration;

use harness::{image_or_skip, Vm};

const SMOKE: &str = include_str!("vm/nbd_smoke.sh");

fn smoke(test: &str, cpus: u32, env: &[(&str, &str)]) {
    let Some(image) = image_or_skip(test) else { return };
    let mut script = format!("export VOLRING='{}'\n", env!("CARGO_BIN_EXE_volring"));
    for (k, v) in env {
        script.push_str(&format!("export {k}='{v}'\n"));
    }
    script.push_str(SMOKE);
    let mut vm = Vm::new(&image).expect("vm");
    vm.cpus = cpus;
    let run = vm.run(&script, Duration::from_secs(900)).expect("vm run");
    let read = |n: &str| fs::read_to_string(run.results.join(n)).unwrap_or_default();
    eprintln!("note: {test}: {} {}(guest {:.1} s)", read("verdict").trim(), read("resume").trim(), run.elapsed.as_secs_f64());
    assert!(
        run.status == Some(0),
        "{test}:\n{}\n--- first.err\n{}\n--- second.err\n{}\n--- writer.err\n{}",
        run.describe(),
        read("first.err"),
        read("second.err"),
        read("writer.err")
    );
}

/// Two connections, a ring per vCPU.
#[test]
fn kill_and_reattach_two_connections() {
    smoke("vm_nbd::kill_and_reattach_two_connections", 2, &[("CONNS", "2"), ("THREADS", "0")]);
}

/// One ring serving two connections, 64 MiB of kernel writes (the setup
/// that once left the server answering nothing).
#[test]
fn kill_and_reattach_one_ring_two_connections_64mib() {
    smoke("vm_nbd::kill_and_reattach_one_ring_two_connections_64mib", 2, &[("CONNS", "2"), ("THREADS", "1"), ("FILES", "128"), ("FILE_KIB", "512")]);
}
