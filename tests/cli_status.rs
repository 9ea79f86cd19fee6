//! `volring status` as text says everything `--json` says of a volume's
//! health: the drift the reconciler found (under `--no-repair` it stays),
//! a failed repair, and the reconciler's last repairs with their time and
//! result. Before, the text showed none of it.

mod common;
mod csi_support;

use std::process::Command;
use std::time::{Duration, Instant};

use common::check;
use csi_support::{mount_cap, Agent, MIB};
use libtest_mimic::{Failed, Trial};
use serde_json::Value;

fn status(a: &Agent, json: bool) -> Result<String, Failed> {
    let mut c = Command::new(env!("CARGO_BIN_EXE_volring"));
    c.arg("status").arg("--state-dir").arg(&a.state).arg("--kubelet-root").arg(&a.kubelet);
    if json {
        c.arg("--json");
    }
    let out = c.output()?;
    check(out.status.success(), format!("volring status: {}", String::from_utf8_lossy(&out.stderr)))?;
    Ok(String::from_utf8(out.stdout)?)
}

/// Polls `status --json` until `ready` holds of it (bounded).
fn wait_for(a: &Agent, what: &str, ready: impl Fn(&Value) -> bool) -> Result<Value, Failed> {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let v: Value = serde_json::from_str(&status(a, true)?)?;
        if ready(&v) {
            return Ok(v);
        }
        check(Instant::now() < deadline, format!("{what}; status --json: {v}"))?;
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Under `--no-repair` a staging mount that vanished stays drift: the JSON
/// has `staging_missing`, and now the text has it too.
fn text_shows_the_drift_json_shows() -> Result<(), Failed> {
    let a = Agent::start_with(&[("VOLRING_NO_REPAIR", "true")]);
    a.create("pvc-drift", 32 * MIB, "")?;
    let staging = a.k("plugins/stage/drift");
    a.stage("pvc-drift", &staging, mount_cap(""))?;
    rustix::mount::unmount(staging.as_str(), rustix::mount::UnmountFlags::empty())?;
    wait_for(&a, "the drift is recorded", |v| v["staged"][0]["health"]["drift"][0]["kind"] == "staging_missing")?;
    let text = status(&a, false)?;
    let line = text.lines().find(|l| l.starts_with("pvc-drift") && l.contains(" staged ")).unwrap_or_default();
    check(line.contains("staging_missing"), format!("the volume's line names its drift:\n{text}"))?;
    check(
        text.lines().any(|l| l.trim_start().starts_with("drift staging_missing") && l.contains("the staging mount is gone")),
        format!("the drift in words under the volume:\n{text}"),
    )?;
    a.stage("pvc-drift", &staging, mount_cap(""))?;
    a.unstage("pvc-drift", &staging)?;
    Ok(())
}

/// With repairs on, the reconciler re-mounts a vanished staging mount; the
/// text lists that repair with its time, drift and result, and the JSON
/// has it under `repairs`.
fn text_lists_the_last_repairs() -> Result<(), Failed> {
    let a = Agent::start();
    a.create("pvc-fix", 32 * MIB, "")?;
    let staging = a.k("plugins/stage/fix");
    a.stage("pvc-fix", &staging, mount_cap(""))?;
    let text = status(&a, false)?;
    check(!text.contains("REPAIRS"), format!("no repairs yet:\n{text}"))?;
    check(!text.contains("drift "), format!("no drift at first:\n{text}"))?;
    rustix::mount::unmount(staging.as_str(), rustix::mount::UnmountFlags::empty())?;
    let v = wait_for(&a, "the repair is recorded", |v| v["repairs"].as_array().is_some_and(|r| !r.is_empty()))?;
    let r = &v["repairs"][0];
    check(r["volume"] == "pvc-fix" && r["result"] == "repaired" && r["action"] == "restage", format!("the repair: {r}"))?;
    check(r["drift"].to_string().contains("staging_missing"), format!("what it repaired: {r}"))?;
    let text = status(&a, false)?;
    let head = text.lines().position(|l| l.starts_with("REPAIRS (last 1 of 1 kept)"));
    check(head.is_some(), format!("a REPAIRS section:\n{text}"))?;
    let row = head.and_then(|i| text.lines().nth(i + 2)).unwrap_or_default();
    check(
        row.contains("pvc-fix") && row.contains("restage") && row.contains("staging_missing") && row.ends_with("repaired"),
        format!("the repair's row:\n{text}"),
    )?;
    // A UTC time: `YYYY-mm-dd HH:MM:SSZ`.
    check(row.len() > 20 && row.as_bytes()[4] == b'-' && row[..20].trim_end().ends_with('Z'), format!("the time: {row}"))?;
    check(text.contains("last repair "), format!("the volume's last repair under it:\n{text}"))?;
    a.unstage("pvc-fix", &staging)?;
    Ok(())
}

fn main() {
    common::run_in_private_namespace(vec![
        Trial::test("status::text_shows_the_drift_json_shows", text_shows_the_drift_json_shows),
        Trial::test("status::text_lists_the_last_repairs", text_lists_the_last_repairs),
    ]);
}
