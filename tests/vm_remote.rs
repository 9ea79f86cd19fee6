//! Remote nbd volumes in the VM (see tests/vm/harness.rs and
//! tests/vm/remote.sh): the guest kernel's nbd driver attached over TCP to
//! another agent's export, a wrong secret refused, data written and
//! verified with checksums, and the owning agent killed -9 and restarted
//! under a writer while the consuming agent lives. Skips (saying why)
//! without the VM image; fails in CI.
//!
//! Both agents run in one guest, the owner's export on the guest's own
//! 127.0.0.1, rather than the owner on the host behind the harness's user
//! network: a guestfwd can only forward to a chardev (one connection,
//! made when qemu starts, never again after the server restarts) or to a
//! command spawned per connection (a relay process this machine has none
//! of: no socat or nc), and the restart test needs new connections to a
//! server that comes and goes. Loopback TCP is still TCP to the kernel's
//! driver: the same sockets, FIN on the owner's death, reconnects.

#[path = "vm/harness.rs"]
mod harness;

use std::fs;
use std::time::Duration;

use harness::{image_or_skip, Vm};

const SCRIPT: &str = include_str!("vm/remote.sh");

fn remote(test: &str, env: &[(&str, &str)]) {
    let Some(image) = image_or_skip(test) else { return };
    let script = harness::script(env!("CARGO_BIN_EXE_volring"), env, SCRIPT);
    let mut vm = Vm::new(&image).expect("vm");
    vm.cpus = 2;
    let run = vm.run(&script, Duration::from_secs(900)).expect("vm run");
    let read = |n: &str| fs::read_to_string(run.results.join(n)).unwrap_or_default();
    eprintln!("note: {test}: {}\n{}{}(guest {:.1} s)", read("verdict").trim(), read("notes"), read("resume"), run.elapsed.as_secs_f64());
    let tail = |n: &str| {
        let s = read(n);
        let lines: Vec<&str> = s.lines().collect();
        lines[lines.len().saturating_sub(15)..].join("\n")
    };
    assert!(
        run.status == Some(0),
        "{test}:\n{}\n--- consumer.err\n{}\n--- owner1.err\n{}\n--- owner2.err\n{}\n--- writer.err\n{}",
        run.describe(),
        tail("consumer.err"),
        tail("owner1.err"),
        tail("owner2.err"),
        read("writer.err")
    );
}

/// The owner's export restarts 3 times under a writer on the consumer;
/// the consumer reconnects each time and no write fails.
#[test]
fn owner_restarts_under_a_remote_writer() {
    let cycles = std::env::var("VOLRING_REMOTE_CYCLES").unwrap_or_else(|_| "3".into());
    let conns = std::env::var("VOLRING_REMOTE_CONNS").unwrap_or_else(|_| "1".into());
    remote("vm_remote::owner_restarts_under_a_remote_writer", &[("CYCLES", &cycles), ("CONNS", &conns)]);
}

/// The control: the consumer does not reconnect (--nbd-no-heal, 4 s
/// dead-connection timeout) and the same restart fails the writer.
#[test]
fn without_reconnecting_the_writer_fails() {
    remote("vm_remote::without_reconnecting_the_writer_fails", &[("NO_HEAL", "1")]);
}
