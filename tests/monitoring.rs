//! deploy/monitoring against a live agent: every series the Grafana
//! dashboard and the alert rules name exists on a real scrape (with the CSI
//! driver and an NBD export running), the scrape passes `promtool check
//! metrics`, and the rules pass `promtool check rules`.

mod common;

use std::io::{Read, Write};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::{check, Scratch};
use libtest_mimic::{Failed, Trial};

const VOLRING: &str = env!("CARGO_BIN_EXE_volring");
const PATIENCE: Duration = Duration::from_secs(30);

struct Agent(Child);

impl Drop for Agent {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn free_port() -> std::io::Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

fn get(port: u16, path: &str) -> std::io::Result<(String, String)> {
    let mut c = std::net::TcpStream::connect(("127.0.0.1", port))?;
    c.set_read_timeout(Some(PATIENCE))?;
    c.write_all(format!("GET {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n").as_bytes())?;
    let mut reply = String::new();
    c.take(64 << 20).read_to_string(&mut reply)?;
    let (head, body) = reply.split_once("\r\n\r\n").unwrap_or((&reply, ""));
    Ok((head.to_string(), body.to_string()))
}

/// Runs promtool with `args` and `stdin`; `None` where promtool is missing
/// (allowed outside CI only).
fn promtool(args: &[&str], stdin: &str) -> Result<Option<String>, Failed> {
    let spawned = Command::new("promtool").args(args).stdin(Stdio::piped()).stdout(Stdio::piped()).stderr(Stdio::piped()).spawn();
    let mut child = match spawned {
        Ok(c) => c,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound && std::env::var_os("CI").is_none() => {
            eprintln!("promtool not found: skipped (apt-get install prometheus)");
            return Ok(None);
        }
        Err(e) => return Err(format!("promtool: {e}").into()),
    };
    let mut input = child.stdin.take().ok_or("promtool stdin")?;
    input.write_all(stdin.as_bytes())?;
    drop(input);
    let out = child.wait_with_output()?;
    let said = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    check(out.status.success(), format!("promtool {args:?}: {:?}\n{said}", out.status))?;
    Ok(Some(said))
}

/// Every `volring_*` name in `text`.
fn metric_names(text: &str) -> std::collections::BTreeSet<String> {
    let mut names = std::collections::BTreeSet::new();
    let mut rest = text;
    while let Some(i) = rest.find("volring_") {
        let tail = &rest[i..];
        let end = tail.find(|c: char| !(c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_')).unwrap_or(tail.len());
        names.insert(tail[..end].to_string());
        rest = &tail[end..];
    }
    names
}

/// Whether the classic exposition has series `name` (or declares its
/// family: a series per drifting volume has no samples while none drifts).
fn exposes(scrape: &str, name: &str) -> bool {
    let family = ["_bucket", "_sum", "_count"].iter().find_map(|s| name.strip_suffix(s)).unwrap_or(name);
    scrape.lines().any(|l| {
        l.strip_prefix(name).is_some_and(|r| r.starts_with('{') || r.starts_with(' '))
            || l.strip_prefix("# TYPE ").and_then(|r| r.split_whitespace().next()).is_some_and(|n| n == name || n == family)
    })
}

fn dashboard_and_rules_name_only_real_series() -> Result<(), Failed> {
    let scratch = Scratch::new();
    let image = scratch.path().join("export.img");
    std::fs::File::create(&image)?.set_len(16 << 20)?;
    let port = free_port()?;
    let child = Command::new(VOLRING)
        .args(["node", "--node-id", "monitoring-test", "--stats-interval", "1"])
        .arg("--state-dir")
        .arg(scratch.path().join("state"))
        .arg("--kubelet-root")
        .arg(scratch.dir("kubelet"))
        .arg("--csi-endpoint")
        .arg(format!("unix://{}", scratch.path().join("csi.sock").display()))
        .args(["--metrics-addr", &format!("127.0.0.1:{port}"), "--nbd-listen", "127.0.0.1:0"])
        .arg("--nbd-export")
        .arg(format!("demo={}", image.display()))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()?;
    let _agent = Agent(child);
    let deadline = Instant::now() + PATIENCE;
    while !get(port, "/readyz").is_ok_and(|(h, _)| h.starts_with("HTTP/1.1 200")) {
        check(Instant::now() < deadline, "the agent did not become ready")?;
        std::thread::sleep(Duration::from_millis(50));
    }
    let (head, scrape) = get(port, "/metrics")?;
    check(head.contains("text/plain; version=0.0.4"), format!("classic text by default: {head}"))?;
    if let Some(said) = promtool(&["check", "metrics"], &scrape)? {
        check(said.trim().is_empty(), format!("promtool check metrics on a live scrape (CSI and NBD on):\n{said}"))?;
    }

    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("deploy/monitoring");
    let dashboard = std::fs::read_to_string(root.join("dashboard.json"))?;
    let parsed: serde_json::Value = serde_json::from_str(&dashboard)?;
    check(parsed["panels"].as_array().is_some_and(|p| p.len() > 10), "dashboard panels")?;
    let rules = std::fs::read_to_string(root.join("rules.yaml"))?;
    let mut missing = Vec::new();
    let names: Vec<String> = metric_names(&dashboard).into_iter().chain(metric_names(&rules)).collect();
    check(names.len() > 20, format!("too few series named: {names:?}"))?;
    for name in &names {
        if !exposes(&scrape, name) {
            missing.push(name.clone());
        }
    }
    check(missing.is_empty(), format!("named by deploy/monitoring but not on /metrics: {missing:?}"))?;

    // The PrometheusRule's groups as a plain rules file, for promtool.
    let groups: String = rules
        .split_once("\nspec:\n")
        .ok_or("rules.yaml has no spec")?
        .1
        .lines()
        .map(|l| format!("{}\n", l.strip_prefix("  ").unwrap_or(l)))
        .collect();
    let file = scratch.path().join("rules.yaml");
    std::fs::write(&file, groups)?;
    promtool(&["check", "rules", &file.to_string_lossy()], "")?;
    Ok(())
}

fn main() {
    common::run_in_private_namespace(vec![Trial::test(
        "monitoring::dashboard_and_rules_name_only_real_series",
        dashboard_and_rules_name_only_real_series,
    )]);
}
