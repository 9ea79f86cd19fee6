//! `volring mounts` as a findmnt user drives it: columns, the tree,
//! `--target`/`--source`, and `--watch` as text or JSON. Real mounts in a
//! private mount namespace.

mod common;

use std::process::Command;

use common::{check, Scratch};
use libtest_mimic::{Failed, Trial};

const VOLRING: &str = env!("CARGO_BIN_EXE_volring");

fn run(args: &[&str]) -> Result<String, Failed> {
    let out = Command::new(VOLRING).args(args).output()?;
    check(out.status.success(), format!("volring {args:?}: {}", String::from_utf8_lossy(&out.stderr)))?;
    Ok(String::from_utf8(out.stdout)?)
}

fn columns_target_source_and_tree() -> Result<(), Failed> {
    let s = Scratch::new();
    let top = s.tmpfs("top");
    let inner = top.join("inner");
    std::fs::create_dir(&inner)?;
    common::tmpfs_at(&inner);
    let file = inner.join("deep/er");
    std::fs::create_dir(inner.join("deep"))?;
    std::fs::write(&file, b"x")?;
    let target = file.to_string_lossy().to_string();

    // The mount a path is on, with chosen columns (findmnt --target -o).
    let out = run(&["mounts", "--target", &target, "-o", "TARGET,FSTYPE", "--raw"])?;
    let want = format!("TARGET FSTYPE\n{} tmpfs\n", inner.display());
    check(out == want, format!("--target: {out:?}, want {want:?}"))?;
    // Agrees with findmnt.
    let theirs = Command::new("findmnt").args(["--raw", "-n", "-o", "TARGET", "--target", &target]).output()?;
    check(String::from_utf8(theirs.stdout)?.trim() == inner.to_string_lossy(), "findmnt --target agrees")?;

    // --source: only mounts of that source.
    let out = run(&["mounts", "--source", "tmpfs", "-o", "SOURCE", "--raw"])?;
    check(out.lines().skip(1).all(|l| l == "tmpfs") && out.lines().count() >= 3, format!("--source: {out}"))?;

    // The tree draws the inner mount under the outer one.
    let out = run(&["mounts", "--tree", "-o", "TARGET"])?;
    let outer = out.lines().position(|l| l.ends_with(&*top.to_string_lossy())).ok_or(format!("no {} in tree:\n{out}", top.display()))?;
    let under = out.lines().nth(outer + 1).unwrap_or("");
    check(under.contains("└─") && under.ends_with(&*inner.to_string_lossy()), format!("inner not drawn under outer:\n{out}"))?;
    // An unknown column is an error that names it.
    let bad = Command::new(VOLRING).args(["mounts", "-o", "TARGET,BOGUS"]).output()?;
    check(!bad.status.success() && String::from_utf8_lossy(&bad.stderr).contains("BOGUS"), "unknown column named")?;
    common::umount(&inner);
    Ok(())
}

fn main() {
    common::run_in_private_namespace(vec![Trial::test("cli_mounts::columns_target_source_and_tree", columns_target_source_and_tree)]);
}
