//! deploy/monitoring against a live agent: every series the Grafana
//! dashboard and the alert rules name exists on a real scrape (with the CSI
//! driver and an NBD export running), the scrape passes `promtool check
//! metrics`, the rules pass `promtool check rules`, and every PromQL
//! expression of the dashboard parses (promtool, as recording rules).

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
    // A counter's name carries one `_total` (the encoder adds it): before,
    // `volring_nbd_connections_total_total`.
    let doubled: Vec<&str> = scrape.lines().filter(|l| l.contains("_total_total")).collect();
    check(doubled.is_empty(), format!("doubled suffix on /metrics: {doubled:?}"))?;
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

/// Values for Grafana's built-in variables, as Grafana would substitute
/// them (durations; milliseconds and seconds as plain numbers).
const GRAFANA_BUILTINS: &[(&str, &str)] = &[
    ("__rate_interval", "1m"),
    ("__interval", "15s"),
    ("__range", "1h"),
    ("__interval_ms", "15000"),
    ("__range_ms", "3600000"),
    ("__range_s", "3600"),
];

/// Every `expr` in a dashboard (panels, rows' panels, whatever nests
/// them), with where it sits.
fn dashboard_exprs(v: &serde_json::Value, at: &str, out: &mut Vec<(String, String)>) {
    match v {
        serde_json::Value::Object(m) => {
            for (k, x) in m {
                match (k.as_str(), x) {
                    ("expr", serde_json::Value::String(e)) => out.push((at.to_string(), e.clone())),
                    _ => dashboard_exprs(x, &format!("{at}/{k}"), out),
                }
            }
        }
        serde_json::Value::Array(a) => a.iter().enumerate().for_each(|(i, x)| dashboard_exprs(x, &format!("{at}[{i}]"), out)),
        _ => {}
    }
}

/// `expr` with its Grafana variables (`$name`, `${name}`, `${name:format}`)
/// replaced: built-ins by their values, the dashboard's own template
/// variables by `.*` (what "All" selects; they sit in regex matchers).
/// A variable that is neither is an error: Grafana would leave it as is.
fn substitute(expr: &str, template_vars: &[String]) -> Result<String, String> {
    let mut out = String::with_capacity(expr.len());
    let mut rest = expr;
    while let Some(i) = rest.find('$') {
        out.push_str(&rest[..i]);
        let tail = &rest[i + 1..];
        let (name, used) = match tail.strip_prefix('{') {
            Some(braced) => {
                let end = braced.find('}').ok_or_else(|| format!("unclosed ${{ in {expr:?}"))?;
                (braced[..end].split(':').next().unwrap_or(""), end + 2)
            }
            None => {
                let end = tail.find(|c: char| !(c.is_ascii_alphanumeric() || c == '_')).unwrap_or(tail.len());
                (&tail[..end], end)
            }
        };
        let value = match GRAFANA_BUILTINS.iter().find(|(n, _)| *n == name) {
            Some((_, v)) => *v,
            None if template_vars.iter().any(|v| v == name) => ".*",
            None => return Err(format!("${name} is neither a Grafana variable nor one of the dashboard's {template_vars:?}: {expr:?}")),
        };
        out.push_str(value);
        rest = &tail[used..];
    }
    out.push_str(rest);
    Ok(out)
}

/// The dashboard's expressions as one rules file, each a recording rule
/// (`dashboard:expr_N`), for `promtool check rules` to parse; with the
/// list of which N is which, for a failure message.
fn dashboard_as_rules(dashboard: &str) -> Result<(String, String, usize), Failed> {
    let parsed: serde_json::Value = serde_json::from_str(dashboard)?;
    let vars: Vec<String> =
        parsed["templating"]["list"].as_array().into_iter().flatten().filter_map(|v| v["name"].as_str().map(str::to_string)).collect();
    let mut exprs = Vec::new();
    dashboard_exprs(&parsed, "", &mut exprs);
    let mut rules = String::from("groups:\n  - name: dashboard\n    rules:\n");
    let mut index = String::new();
    for (n, (at, expr)) in exprs.iter().enumerate() {
        let promql = substitute(expr, &vars)?;
        // A JSON string is a YAML double-quoted scalar.
        rules.push_str(&format!("      - record: dashboard:expr_{n}\n        expr: {}\n", serde_json::to_string(&promql)?));
        index.push_str(&format!("  expr_{n} at {at}: {promql}\n"));
    }
    Ok((rules, index, exprs.len()))
}

/// Parses the dashboard's every expression with promtool; `Ok(None)` where
/// promtool is missing outside CI.
fn check_dashboard_parses(dashboard: &str, scratch: &Scratch) -> Result<Option<usize>, Failed> {
    let (rules, index, n) = dashboard_as_rules(dashboard)?;
    let file = scratch.path().join("dashboard-rules.yaml");
    std::fs::write(&file, rules)?;
    match promtool(&["check", "rules", &file.to_string_lossy()], "") {
        Ok(said) => Ok(said.map(|_| n)),
        Err(e) => Err(format!("{}\nthe expressions:\n{index}", e.message().unwrap_or("")).into()),
    }
}

fn every_dashboard_expression_parses() -> Result<(), Failed> {
    let scratch = Scratch::new();
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("deploy/monitoring/dashboard.json");
    let Some(n) = check_dashboard_parses(&std::fs::read_to_string(path)?, &scratch)? else { return Ok(()) };
    check(n >= 20, format!("only {n} expressions found in the dashboard"))
}

/// The check itself can fail: a dashboard with one expression that does
/// not parse, and one with a variable nobody defines.
fn a_broken_dashboard_expression_is_caught() -> Result<(), Failed> {
    let scratch = Scratch::new();
    let dashboard = |expr: &str| {
        serde_json::json!({
            "templating": { "list": [{ "name": "instance" }] },
            "panels": [{ "targets": [
                { "expr": "sum(rate(volring_device_reads_completed_total{instance=~\"$instance\"}[$__rate_interval]))" },
                { "expr": expr },
            ]}],
        })
        .to_string()
    };
    let Some(n) = check_dashboard_parses(&dashboard("up{instance=~\"${instance}\"}"), &scratch)? else { return Ok(()) };
    check(n == 2, format!("{n} expressions in a dashboard of 2"))?;
    match check_dashboard_parses(&dashboard("sum(rate(volring_device_reads_completed_total[$__rate_interval])"), &scratch) {
        Err(e) => check(e.message().is_some_and(|m| m.contains("expr_1")), format!("the failure names the expression: {e:?}"))?,
        Ok(_) => return Err("an unclosed parenthesis parsed".into()),
    }
    match check_dashboard_parses(&dashboard("up{instance=~\"$instanse\"}"), &scratch) {
        Err(e) => check(e.message().is_some_and(|m| m.contains("$instanse")), format!("the failure names the variable: {e:?}")),
        Ok(_) => Err("an undefined variable passed".into()),
    }
}

fn main() {
    common::run_in_private_namespace(vec![
        Trial::test("monitoring::dashboard_and_rules_name_only_real_series", dashboard_and_rules_name_only_real_series),
        Trial::test("monitoring::every_dashboard_expression_parses", every_dashboard_expression_parses),
        Trial::test("monitoring::a_broken_dashboard_expression_is_caught", a_broken_dashboard_expression_is_caught),
    ]);
}
