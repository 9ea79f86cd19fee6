//! lsblk's filesystem columns in `volring devices`: FSSIZE, FSUSED,
//! FSAVAIL and FSUSE% of a mounted ext4 on a loop device, the same
//! figures lsblk prints for it (human-readable and with -b), and empty
//! cells for a device nothing mounts.

mod common;

use std::process::Command;

use common::{check, LoopDevice, Scratch};
use libtest_mimic::{Failed, Trial};

const COLUMNS: &str = "NAME,FSSIZE,FSUSED,FSAVAIL,FSUSE%";

/// The cells of `prog -n -o COLUMNS [-b] DEVICE`, split on blanks.
fn cells(prog: &str, device: &str, bytes: bool) -> Result<Vec<String>, Failed> {
    let mut c = Command::new(prog);
    if prog == "volring" {
        c = Command::new(env!("CARGO_BIN_EXE_volring"));
        c.arg("devices");
    }
    c.args(["-n", "-o", COLUMNS]);
    if bytes {
        c.arg("-b");
    }
    let out = c.arg(device).output()?;
    check(out.status.success(), format!("{prog}: {}", String::from_utf8_lossy(&out.stderr)))?;
    // The table only: not the `# ...` notes after it.
    let text = String::from_utf8(out.stdout)?;
    Ok(text.lines().filter(|l| !l.starts_with('#')).flat_map(str::split_whitespace).map(str::to_string).collect())
}

fn fs_columns_like_lsblk() -> Result<(), Failed> {
    let s = Scratch::new();
    let lo = LoopDevice::new(64 << 20);
    lo.mkfs("ext4");
    let idle = LoopDevice::new(16 << 20);
    let at = s.dir("mnt");
    let ok = Command::new("mount").arg(lo.path()).arg(&at).status()?.success();
    check(ok, "mount")?;
    let written = Command::new("dd")
        .args(["if=/dev/zero", "bs=1M", "count=20", "conv=fsync"])
        .arg(format!("of={}", at.join("f").display()))
        .output()?;
    check(written.status.success(), "dd")?;
    for bytes in [false, true] {
        let ours = cells("volring", lo.path(), bytes)?;
        let theirs = cells("lsblk", lo.path(), bytes)?;
        check(ours.len() == 5, format!("five cells: {ours:?}"))?;
        check(ours == theirs, format!("-b {bytes}: volring {ours:?}, lsblk {theirs:?}"))?;
    }
    let pct: u64 = cells("volring", lo.path(), false)?[4].trim_end_matches('%').parse()?;
    check(pct >= 30, format!("20 of ~60 MiB used: {pct}%"))?;
    // Not mounted: only the name.
    check(cells("volring", idle.path(), false)? == [idle.name()], "empty cells for an unmounted device")?;
    common::umount(&at);
    Ok(())
}

fn main() {
    common::run_in_private_namespace(vec![Trial::test("lsblk::fs_columns_like_lsblk", fs_columns_like_lsblk)]);
}
