//! docs/json.md against the real commands. The field tables are read from
//! the page itself (nothing here lists a field): every object a row speaks
//! of must carry the fields marked `always`, and must carry no field its
//! table does not name. Each section's command runs here, as root in a
//! private mount namespace: the printing commands, `mounts --watch` over
//! mounts this test makes, an agent for `get` (its store) and the CSI RPCs,
//! and `nbd status` where the kernel has the nbd module (nbd attach and
//! watch need a device: their rows are reported as not exercised).

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::io::BufRead;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::{check, Scratch};
use libtest_mimic::{Failed, Trial};
use serde_json::Value;

const VOLRING: &str = env!("CARGO_BIN_EXE_volring");
const PATIENCE: Duration = Duration::from_secs(30);

/// One row of a field table.
#[derive(Debug)]
struct Row {
    /// The table's `where` cell as written (rows are grouped by it).
    place: String,
    /// Which documents of the command it speaks of (`None`: all).
    kinds: Option<Vec<String>>,
    path: String,
    field: String,
    always: bool,
}

/// A `## ` section of the page and its table.
struct Section {
    heading: String,
    rows: Vec<Row>,
}

/// The cells of a table line, split at `|` not escaped as `\|`.
fn cells(line: &str) -> Vec<String> {
    let inner = line.trim().trim_start_matches('|').trim_end_matches('|');
    let mut out = vec![String::new()];
    let mut chars = inner.chars().peekable();
    while let Some(c) = chars.next() {
        match c {
            '\\' if chars.peek() == Some(&'|') => out.last_mut().expect("one").push(chars.next().expect("peeked")),
            '|' => out.push(String::new()),
            c => out.last_mut().expect("one").push(c),
        }
    }
    out.iter().map(|c| c.trim().to_string()).collect()
}

fn unquote(cell: &str) -> String {
    cell.trim_matches('`').to_string()
}

fn parse_doc(doc: &str) -> Result<Vec<Section>, Failed> {
    let mut sections: Vec<Section> = Vec::new();
    for line in doc.lines() {
        if let Some(h) = line.strip_prefix("## ") {
            sections.push(Section { heading: h.trim().to_string(), rows: Vec::new() });
            continue;
        }
        if !line.starts_with('|') {
            continue;
        }
        let c = cells(line);
        if c.first().is_some_and(|c| c == "where" || c.starts_with("---")) {
            continue;
        }
        let section = sections.last_mut().ok_or("a table before any section")?;
        check(c.len() == 4, format!("{}: a table row needs 4 cells: {line}", section.heading))?;
        let place = unquote(&c[0]);
        let (kinds, path) = match place.split_once(':') {
            Some((k, p)) if !k.is_empty() && p.starts_with('.') => (Some(k.split(',').map(str::to_string).collect()), p.to_string()),
            _ => (None, place.clone()),
        };
        check(path.starts_with('.'), format!("{}: where {place:?} is not a path", section.heading))?;
        let always = match c[2].as_str() {
            "always" => true,
            "opt" => false,
            p => return Err(format!("{}: presence {p:?} (always or opt): {line}", section.heading).into()),
        };
        section.rows.push(Row { place, kinds, path, field: unquote(&c[1]), always });
    }
    Ok(sections)
}

/// The objects at `path` in `v` (`.`, `.a`, `.a[]`, chained); nulls and
/// missing fields on the way give none.
fn objects<'a>(v: &'a Value, path: &str) -> Vec<&'a Value> {
    let mut here = vec![v];
    for step in path.trim_start_matches('.').split('.').filter(|s| !s.is_empty()) {
        let (name, each) = match step.strip_suffix("[]") {
            Some(n) => (n, true),
            None => (step, false),
        };
        here = here
            .into_iter()
            .filter_map(|o| o.get(name))
            .flat_map(|x| if each { x.as_array().map(|a| a.iter().collect()).unwrap_or_default() } else { vec![x] })
            .collect();
    }
    here.into_iter().filter(|o| o.is_object()).collect()
}

/// What a section's command printed: (kind, document) pairs.
type Outputs = Vec<(String, Value)>;

/// Checks `outputs` against the section's rows; returns the rows no object
/// reached (not exercised here).
fn check_section(section: &Section, outputs: &Outputs) -> Result<Vec<String>, Failed> {
    let mut problems = Vec::new();
    let mut unexercised = Vec::new();
    let mut documented: BTreeMap<&str, BTreeSet<&str>> = BTreeMap::new();
    for row in &section.rows {
        documented.entry(&row.place).or_default().insert(&row.field);
    }
    let reached = |row: &Row| -> Vec<&Value> {
        outputs
            .iter()
            .filter(|(kind, _)| row.kinds.as_ref().is_none_or(|k| k.contains(kind)))
            .flat_map(|(_, doc)| objects(doc, &row.path))
            .collect()
    };
    for row in &section.rows {
        let objs = reached(row);
        if objs.is_empty() {
            unexercised.push(format!("{} {}", row.place, row.field));
        }
        if row.always {
            if let Some(o) = objs.iter().find(|o| o.get(&row.field).is_none()) {
                problems.push(format!("{} lacks `{}`, which the page says is always there: {o}", row.place, row.field));
            }
        }
    }
    for (place, fields) in &documented {
        let row = section.rows.iter().find(|r| r.place == *place).expect("grouped from the rows");
        for o in reached(row) {
            let extra: Vec<_> = o.as_object().into_iter().flatten().map(|(k, _)| k.as_str()).filter(|k| !fields.contains(k)).collect();
            if !extra.is_empty() {
                problems.push(format!("{place} has {extra:?}, which its table does not name: {o}"));
                break;
            }
        }
    }
    check(problems.is_empty(), format!("{}:\n  {}", section.heading, problems.join("\n  ")))?;
    Ok(unexercised)
}

fn run(args: &[&str]) -> Result<String, Failed> {
    let out = Command::new(VOLRING).args(args).stdin(Stdio::null()).output()?;
    check(out.status.success(), format!("volring {args:?}: {}", String::from_utf8_lossy(&out.stderr)))?;
    Ok(String::from_utf8(out.stdout)?)
}

fn one(args: &[&str]) -> Result<Outputs, Failed> {
    Ok(vec![(String::new(), serde_json::from_str(&run(args)?)?)])
}

/// A child killed by PID when dropped.
struct Killed(Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// `volring mounts --watch` over a tmpfs this test attaches, remounts,
/// moves and detaches, each change awaited before the next; then, with
/// the reader stalled, a burst that should make the watcher coalesce
/// (a `resync` line), read afterwards.
fn watch_outputs(scratch: &Scratch) -> Result<Outputs, Failed> {
    use rustix::mount::{mount_move, mount_remount, MountFlags};
    let mut child =
        Killed(Command::new(VOLRING).args(["mounts", "--watch", "--json"]).stdout(Stdio::piped()).stderr(Stdio::null()).spawn()?);
    let stdout = child.0.stdout.take().ok_or("stdout")?;
    // A rendezvous channel: while nobody receives, the reader stops
    // reading and the pipe fills.
    let (tx, rx) = std::sync::mpsc::sync_channel::<String>(0);
    std::thread::spawn(move || {
        for line in std::io::BufReader::new(stdout).lines().map_while(Result::ok) {
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    let mut out = Outputs::new();
    let take = |out: &mut Outputs, want: &str| -> Result<(), Failed> {
        let deadline = Instant::now() + PATIENCE;
        while Instant::now() < deadline {
            let Ok(line) = rx.recv_timeout(Duration::from_millis(100)) else { continue };
            let v: Value = serde_json::from_str(&line).map_err(|e| format!("{e}: {line}"))?;
            let kind = v["event"].as_str().unwrap_or_default().to_string();
            out.push((kind.clone(), v));
            if kind == want {
                return Ok(());
            }
        }
        Err(format!("mounts --watch printed no {want:?} line in {PATIENCE:?}").into())
    };
    // Until the watcher reports the first mount (it needs a moment to
    // start): mount and unmount in turn, each held 500 ms.
    let probe = scratch.dir("probe");
    let deadline = Instant::now() + PATIENCE;
    let mut mounted = false;
    while !out.iter().any(|(k, _)| k == "attached") {
        check(Instant::now() < deadline, "mounts --watch printed nothing")?;
        if mounted {
            common::umount(&probe);
        } else {
            common::tmpfs_at(&probe);
        }
        mounted = !mounted;
        let held = Instant::now() + Duration::from_millis(500);
        while let Some(left) = held.checked_duration_since(Instant::now()) {
            let Ok(line) = rx.recv_timeout(left) else { break };
            let v: Value = serde_json::from_str(&line)?;
            out.push((v["event"].as_str().unwrap_or_default().to_string(), v));
        }
    }
    if mounted {
        common::umount(&probe);
    }
    let a = scratch.tmpfs("a");
    take(&mut out, "attached")?;
    mount_remount(&a, MountFlags::BIND | MountFlags::RDONLY, "")?;
    take(&mut out, "changed")?;
    let b = scratch.dir("b");
    mount_move(&a, &b)?;
    take(&mut out, "moved")?;
    common::umount(&b);
    take(&mut out, "detached")?;
    // Nobody reads now: 6,000 mounts stacked on one directory (kept, so
    // their net change is not empty) fill the pipe and then the watcher's
    // queue (4,096 deliveries), and the rest comes as one `resync`.
    let burst = scratch.dir("burst");
    for _ in 0..6000 {
        common::tmpfs_at(&burst);
    }
    while let Ok(line) = rx.recv_timeout(Duration::from_secs(2)) {
        let v: Value = serde_json::from_str(&line)?;
        out.push((v["event"].as_str().unwrap_or_default().to_string(), v));
        check(out.len() < 100_000, "mounts --watch never went quiet")?;
    }
    drop(child);
    // Each unmount takes the top one (the scratch directory's cleanup
    // would re-read the whole table for each).
    for _ in 0..6000 {
        common::umount(&burst);
    }
    Ok(out)
}

/// A `volring node` on a scratch state directory, ready to answer CSI.
fn agent(scratch: &Scratch) -> Result<(Killed, String), Failed> {
    let endpoint = format!("unix://{}", scratch.path().join("csi.sock").display());
    let child = Command::new(VOLRING)
        .args(["node", "--node-id", "json-docs", "--metrics-addr", "off", "--csi-endpoint", &endpoint])
        .arg("--state-dir")
        .arg(scratch.path().join("state"))
        .arg("--kubelet-root")
        .arg(scratch.dir("kubelet"))
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()?;
    let agent = Killed(child);
    let deadline = Instant::now() + PATIENCE;
    while !run(&["csi", "--endpoint", &endpoint, "probe"]).is_ok_and(|o| o.contains("true")) {
        check(Instant::now() < deadline, "the agent never answered a CSI probe")?;
        std::thread::sleep(Duration::from_millis(100));
    }
    Ok((agent, endpoint))
}

/// The kinds a section's rows name, in order.
fn kinds(section: &Section) -> Vec<String> {
    let mut seen = Vec::new();
    for k in section.rows.iter().filter_map(|r| r.kinds.as_ref()).flatten() {
        if !seen.contains(k) {
            seen.push(k.clone());
        }
    }
    seen
}

fn every_documented_output_matches_its_table() -> Result<(), Failed> {
    let doc = std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/json.md"))?;
    let sections = parse_doc(&doc)?;
    check(sections.len() >= 8, format!("docs/json.md has {} sections", sections.len()))?;
    let scratch = Scratch::new();
    let mut agent_and_endpoint = None;
    let mut notes = Vec::new();
    for section in &sections {
        check(!section.rows.is_empty(), format!("{}: no field table", section.heading))?;
        let command = section.heading.split('`').nth(1).unwrap_or_default();
        let outputs: Outputs = match command {
            "volring mounts --json" => one(&["mounts", "--json"])?,
            "volring mounts --watch" => watch_outputs(&scratch)?,
            "volring devices --json" => {
                // A device with a filesystem, so its rows are reached too.
                let lo = common::LoopDevice::new(16 << 20);
                lo.mkfs_with("ext4", &["-L", "json-docs"]);
                one(&["devices", "--json"])?
            }
            "volring stats --json" => one(&["stats", "--json", "--count", "1", "--interval", "0.2"])?,
            "volring status --json" => one(&["status", "--json", "--state-dir", &scratch.dir("status").to_string_lossy()])?,
            "volring get KIND -o json" | "volring csi RPC" => {
                if agent_and_endpoint.is_none() {
                    agent_and_endpoint = Some(agent(&scratch)?);
                }
                let endpoint = agent_and_endpoint.as_ref().map(|(_, e)| e.clone()).unwrap_or_default();
                let state = scratch.path().join("state").to_string_lossy().into_owned();
                let mut out = Outputs::new();
                for kind in kinds(section) {
                    let args: Vec<&str> = if command.contains("get") {
                        vec!["get", &kind, "-o", "json", "--state-dir", &state]
                    } else {
                        vec!["csi", "--endpoint", &endpoint, &kind]
                    };
                    // The agent publishes its objects to its store shortly
                    // after it starts: a list with items, waited for.
                    let deadline = Instant::now() + PATIENCE;
                    let v: Value = loop {
                        let v: Value = serde_json::from_str(&run(&args)?)?;
                        if !command.contains("get") || v["items"].as_array().is_some_and(|i| !i.is_empty()) {
                            break v;
                        }
                        check(Instant::now() < deadline, format!("volring {args:?} listed nothing"))?;
                        std::thread::sleep(Duration::from_millis(200));
                    };
                    out.push((kind, v));
                }
                out
            }
            "volring nbd attach" => {
                let status = Command::new(VOLRING).args(["nbd", "status", "--json"]).stdin(Stdio::null()).output()?;
                let said = String::from_utf8_lossy(&status.stderr);
                if !status.status.success() && said.contains("no nbd netlink family") {
                    notes.push(format!("{}: skipped, this kernel has no nbd module ({})", section.heading, said.trim()));
                    continue;
                }
                check(status.status.success(), format!("volring nbd status --json: {said}"))?;
                let v: Value = serde_json::from_slice(&status.stdout)?;
                vec![("devices".to_string(), v)]
            }
            other => return Err(format!("docs/json.md documents `{other}`, which this test does not know how to run").into()),
        };
        check(!outputs.is_empty(), format!("{}: the command printed nothing", section.heading))?;
        let unexercised = check_section(section, &outputs)?;
        check(unexercised.len() < section.rows.len(), format!("{}: no row reached any output", section.heading))?;
        if !unexercised.is_empty() {
            notes.push(format!("{}: not exercised here: {}", section.heading, unexercised.join("; ")));
        }
    }
    for n in notes {
        eprintln!("note: {n}");
    }
    Ok(())
}

/// The checker catches both kinds of drift: a field the page calls always
/// there that the output lacks, and a field the output has that the page
/// does not name.
fn the_checker_catches_drift() -> Result<(), Failed> {
    let doc = "## `x`\n| where | field | presence | meaning |\n|---|---|---|---|\n| `.` | `a` | always | \\| piped |\n\
               | `.` | `b` | opt | |\n| `.` | `list` | always | |\n| `k:.list[]` | `c` | always | |\n";
    let sections = parse_doc(doc)?;
    let s = &sections[0];
    check(s.rows.len() == 4 && s.rows[3].kinds.as_deref() == Some(&["k".to_string()][..]), format!("{:?}", s.rows))?;
    let ok = vec![("k".to_string(), serde_json::json!({"a": 1, "list": [{"c": 2}]}))];
    check(check_section(s, &ok).is_ok(), "a matching output passes")?;
    let missing = vec![("k".to_string(), serde_json::json!({"b": 1, "list": []}))];
    check(check_section(s, &missing).is_err_and(|e| e.message().is_some_and(|m| m.contains("lacks `a`"))), "a missing field fails")?;
    let extra = vec![("k".to_string(), serde_json::json!({"a": 1, "z": 0, "list": [{"c": 2}]}))];
    check(check_section(s, &extra).is_err_and(|e| e.message().is_some_and(|m| m.contains("\"z\""))), "an unnamed field fails")?;
    let other_kind = vec![("j".to_string(), serde_json::json!({"a": 1, "list": [{"d": 2}]}))];
    check(check_section(s, &other_kind).is_ok_and(|u| u == ["k:.list[] c"]), "rows of another kind are left alone")
}

fn main() {
    common::run_in_private_namespace(vec![
        Trial::test("json_docs::every_documented_output_matches_its_table", every_documented_output_matches_its_table),
        Trial::test("json_docs::the_checker_catches_drift", the_checker_catches_drift),
    ])
}
