//! The alerts of deploy/monitoring/rules.yaml under `promtool test rules`
//! (tests/monitoring/rules_test.yaml: outside deploy/, which holds only
//! objects for a cluster): every alert has a case on an idle
//! node, where it stays quiet, and a case where its condition holds, where
//! it fires. And an idle agent counts no overflow resync of its mount
//! watcher, the one reason `VolringMountResyncStorm` counts.

mod common;

use std::collections::BTreeSet;
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use common::{check, Scratch};
use libtest_mimic::{Failed, Trial};
use serde_json::Value;

fn monitoring() -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("deploy/monitoring")
}

/// promtool's unit tests of the rules: not a cluster object, so not in deploy/.
fn rules_test() -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/monitoring/rules_test.yaml")
}

/// The PrometheusRule's groups as a plain rules file, as promtool reads it.
fn plain_rules(rules: &str) -> Result<String, Failed> {
    Ok(rules
        .split_once("\nspec:\n")
        .ok_or("rules.yaml has no spec")?
        .1
        .lines()
        .map(|l| format!("{}\n", l.strip_prefix("  ").unwrap_or(l)))
        .collect())
}

/// promtool's output, or `None` where it is missing outside CI.
fn promtool(args: &[&str], dir: &Path) -> Result<Option<(bool, String)>, Failed> {
    match Command::new("promtool").args(args).current_dir(dir).output() {
        Ok(out) => {
            let said = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
            Ok(Some((out.status.success(), said)))
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound && std::env::var_os("CI").is_none() => {
            eprintln!("promtool not found: skipped (apt-get install prometheus)");
            Ok(None)
        }
        Err(e) => Err(format!("promtool: {e}").into()),
    }
}

/// Every alert has a quiet case and a firing case in the test file.
fn every_alert_has_a_quiet_and_a_firing_case() -> Result<(), Failed> {
    let rules_text = std::fs::read_to_string(monitoring().join("rules.yaml"))?;
    let rules: Value = serde_saphyr::from_str(&rules_text).map_err(|e| format!("rules.yaml: {e}"))?;
    let tests: Value = serde_saphyr::from_str(&std::fs::read_to_string(rules_test())?).map_err(|e| format!("rules_test.yaml: {e}"))?;
    let alerts: BTreeSet<String> = rules["spec"]["groups"]
        .as_array()
        .ok_or("no groups")?
        .iter()
        .flat_map(|g| g["rules"].as_array().cloned().unwrap_or_default())
        .filter_map(|r| r["alert"].as_str().map(str::to_string))
        .collect();
    check(alerts.len() >= 12, format!("the alerts of rules.yaml: {alerts:?}"))?;
    let (mut quiet, mut firing) = (BTreeSet::new(), BTreeSet::new());
    for t in tests["tests"].as_array().ok_or("no tests")? {
        for case in t["alert_rule_test"].as_array().cloned().unwrap_or_default() {
            let name = case["alertname"].as_str().unwrap_or_default().to_string();
            match case["exp_alerts"].as_array() {
                Some(a) if !a.is_empty() => firing.insert(name),
                _ => quiet.insert(name),
            };
        }
    }
    let no_quiet: Vec<_> = alerts.difference(&quiet).collect();
    let no_firing: Vec<_> = alerts.difference(&firing).collect();
    check(no_quiet.is_empty(), format!("alerts without a quiet case in rules_test.yaml: {no_quiet:?}"))?;
    check(no_firing.is_empty(), format!("alerts without a firing case in rules_test.yaml: {no_firing:?}"))?;
    let stray: Vec<_> = quiet.union(&firing).filter(|a| !alerts.contains(*a)).collect();
    check(stray.is_empty(), format!("rules_test.yaml tests alerts rules.yaml does not have: {stray:?}"))
}

/// `promtool test rules` passes: each alert quiet on the idle node, firing
/// in trouble. With the old storm rule (all resyncs counted) the idle case
/// fails: the periodic resync alone is 20 in 10 minutes.
fn promtool_test_rules_passes() -> Result<(), Failed> {
    let scratch = Scratch::new();
    let rules = std::fs::read_to_string(monitoring().join("rules.yaml"))?;
    std::fs::write(scratch.path().join("volring-rules.yaml"), plain_rules(&rules)?)?;
    std::fs::copy(rules_test(), scratch.path().join("rules_test.yaml"))?;
    let Some((ok, said)) = promtool(&["test", "rules", "rules_test.yaml"], scratch.path())? else { return Ok(()) };
    check(ok && said.contains("SUCCESS"), format!("promtool test rules:\n{said}"))?;

    // The test file tells the old rule from the new one.
    let old = rules.replace(r#"volring_mount_resyncs_total{reason="overflow"}"#, "volring_mount_resyncs_total");
    check(old != rules, "the storm rule counts overflow resyncs only")?;
    std::fs::write(scratch.path().join("volring-rules.yaml"), plain_rules(&old)?)?;
    let Some((ok, said)) = promtool(&["test", "rules", "rules_test.yaml"], scratch.path())? else { return Ok(()) };
    check(
        !ok && said.contains("idle node") && said.contains("VolringMountResyncStorm"),
        format!("the old rule fires on the idle node:\n{said}"),
    )
}

fn scrape(port: u16) -> std::io::Result<String> {
    use std::io::{Read, Write};
    let mut c = std::net::TcpStream::connect(("127.0.0.1", port))?;
    c.set_read_timeout(Some(Duration::from_secs(30)))?;
    c.write_all(b"GET /metrics HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")?;
    let mut reply = String::new();
    c.take(64 << 20).read_to_string(&mut reply)?;
    Ok(reply.split_once("\r\n\r\n").map(|(_, b)| b.to_string()).unwrap_or_default())
}

fn sample(scrape: &str, series: &str) -> Option<f64> {
    scrape.lines().find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.trim().parse().ok())
}

struct Agent(std::process::Child);

impl Drop for Agent {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// An idle agent exports its resyncs by reason, and counts no overflow.
fn an_idle_agent_counts_no_overflow_resync() -> Result<(), Failed> {
    let scratch = Scratch::new();
    let port = std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
    let child = Command::new(env!("CARGO_BIN_EXE_volring"))
        .args(["node", "--node-id", "alerts-test"])
        .arg("--state-dir")
        .arg(scratch.path().join("state"))
        .arg("--kubelet-root")
        .arg(scratch.dir("kubelet"))
        .arg("--csi-endpoint")
        .arg(format!("unix://{}", scratch.path().join("csi.sock").display()))
        .args(["--metrics-addr", &format!("127.0.0.1:{port}")])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()?;
    let _agent = Agent(child);
    let deadline = Instant::now() + Duration::from_secs(30);
    let text = loop {
        if let Ok(t) = scrape(port) {
            if t.contains("volring_mount_resyncs_total{") {
                break t;
            }
        }
        check(Instant::now() < deadline, "the agent's /metrics did not answer")?;
        std::thread::sleep(Duration::from_millis(50));
    };
    for reason in ["overflow", "periodic", "unpaired_remount", "requested", "reparse"] {
        let v = sample(&text, &format!("volring_mount_resyncs_total{{reason=\"{reason}\"}}"));
        check(v.is_some(), format!("a series for reason {reason}:\n{text}"))?;
    }
    let overflow = sample(&text, "volring_mount_resyncs_total{reason=\"overflow\"}");
    check(overflow == Some(0.0), format!("an idle agent counts no overflow resync: {overflow:?}"))
}

fn main() {
    common::run_in_private_namespace(vec![
        Trial::test("alerts::every_alert_has_a_quiet_and_a_firing_case", every_alert_has_a_quiet_and_a_firing_case),
        Trial::test("alerts::promtool_test_rules_passes", promtool_test_rules_passes),
        Trial::test("alerts::an_idle_agent_counts_no_overflow_resync", an_idle_agent_counts_no_overflow_resync),
    ]);
}
