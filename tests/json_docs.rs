//! docs/json.md against the real commands: every field it names as always
//! present is in the output (devices, mounts, stats and status run here; the
//! rest need a cluster, an agent or the nbd module).

use std::process::Command;

use libtest_mimic::{Failed, Trial};
use serde_json::Value;

const VOLRING: &str = env!("CARGO_BIN_EXE_volring");

fn run(args: &[&str]) -> Result<String, Failed> {
    let out = Command::new(VOLRING).args(args).output()?;
    if !out.status.success() {
        return Err(format!("volring {args:?}: {}", String::from_utf8_lossy(&out.stderr)).into());
    }
    Ok(String::from_utf8(out.stdout)?)
}

fn has(v: &Value, keys: &[&str], what: &str) -> Result<(), Failed> {
    let missing: Vec<&&str> = keys.iter().filter(|k| v.get(**k).is_none()).collect();
    if missing.is_empty() {
        Ok(())
    } else {
        Err(format!("{what}: docs/json.md names {missing:?}, the output lacks them: {v}").into())
    }
}

fn documented_fields_are_present() -> Result<(), Failed> {
    let doc = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/docs/json.md"))?;
    for section in ["## `volring mounts --json`", "## `volring devices --json`", "## `volring stats --json`", "## `volring status --json`"]
    {
        if !doc.contains(section) {
            return Err(format!("docs/json.md has no section {section}").into());
        }
    }
    let m: Value = serde_json::from_str(&run(&["mounts", "--json"])?)?;
    let first = m["filesystems"].get(0).ok_or("no mounts")?;
    has(first, &["target", "source", "fstype", "options", "super_options", "root", "maj:min", "id", "parent", "propagation"], "mount")?;

    let d: Value = serde_json::from_str(&run(&["devices", "--json"])?)?;
    has(&d, &["blockdevices", "errors"], "devices")?;
    let dev = d["blockdevices"].get(0).ok_or("no devices")?;
    has(
        dev,
        &[
            "name",
            "dev",
            "kind",
            "path",
            "size_bytes",
            "logical_block_size",
            "physical_block_size",
            "rotational",
            "removable",
            "read_only",
            "id",
            "holders",
            "slaves",
            "links",
            "mountpoints",
            "uses",
            "os_disk",
            "content",
        ],
        "device",
    )?;

    let s = run(&["stats", "--json", "--count", "1", "--interval", "0.2"])?;
    let sample: Value = serde_json::from_str(s.lines().next().ok_or("no sample")?)?;
    has(&sample, &["devices", "taken_at", "unix_time", "cost", "method", "generation", "errors", "calibration"], "stats")?;

    let dir = tempfile::tempdir()?;
    let st: Value = serde_json::from_str(&run(&["status", "--json", "--state-dir", &dir.path().to_string_lossy()])?)?;
    has(&st, &["pool_dir", "store", "volumes", "staged", "quarantined", "problems"], "status")
}

fn main() {
    let args = libtest_mimic::Arguments::from_args();
    libtest_mimic::run(&args, vec![Trial::test("json_docs::documented_fields_are_present", documented_fields_are_present)]).exit();
}
