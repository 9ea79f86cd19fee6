//! `volring devices`, `volring stats`, `completions` and `man` as a user
//! runs them, beside the tools they answer to: blkid for the columns,
//! /proc/swaps and swapon for swap, an unprivileged user (setpriv) for what
//! a non-root run may say, iostat under fio load for the stats columns.
//! Runs in a private mount namespace; every loop device is attached with
//! autoclear and detached on drop, swap is turned off on drop.

mod common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::Duration;

use common::{check, LoopDevice};
use libtest_mimic::{Failed, Trial};

fn volring(args: &[&str]) -> Result<Output, Failed> {
    Ok(Command::new(env!("CARGO_BIN_EXE_volring")).args(args).env("NODE_NAME", "clinode").output()?)
}

fn ok_stdout(out: &Output) -> Result<String, Failed> {
    check(out.status.success(), format!("exit {:?}: {}", out.status, String::from_utf8_lossy(&out.stderr)))?;
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// `blkid -p -o export` of a device.
fn blkid(path: &str) -> BTreeMap<String, String> {
    let out = Command::new("blkid").args(["-p", "-o", "export", path]).output().expect("blkid");
    String::from_utf8_lossy(&out.stdout).lines().filter_map(|l| l.split_once('=')).map(|(k, v)| (k.to_string(), v.to_string())).collect()
}

/// The table as header name → cell, for the row of `name` (tree prefixes
/// stripped). Cells are cut where their header starts: columns are
/// left-aligned and padded to the widest cell (in characters).
fn row(table: &str, name: &str) -> Result<BTreeMap<String, String>, Failed> {
    let mut lines = table.lines();
    let header: Vec<char> = lines.next().ok_or("empty table")?.chars().collect();
    let starts: Vec<usize> = (0..header.len()).filter(|&i| header[i] != ' ' && (i == 0 || header[i - 1] == ' ')).collect();
    let line = lines
        .find(|l| l.trim_start_matches(['├', '└', '─']).split_whitespace().next() == Some(name))
        .ok_or_else(|| format!("no row for {name} in\n{table}"))?;
    let chars: Vec<char> = line.chars().collect();
    let cut = |v: &[char], i: usize| -> String {
        let end = starts.get(i + 1).copied().unwrap_or(usize::MAX).min(v.len());
        v.get(starts[i].min(v.len())..end).map(|c| c.iter().collect::<String>().trim().to_string()).unwrap_or_default()
    };
    Ok((0..starts.len()).map(|i| (cut(&header, i), cut(&chars, i).trim_start_matches(['├', '└', '─']).to_string())).collect())
}

fn devices_json(args: &[&str]) -> Result<serde_json::Value, Failed> {
    let mut all = vec!["devices", "--json"];
    all.extend_from_slice(args);
    Ok(serde_json::from_str(&ok_stdout(&volring(&all)?)?)?)
}

fn device<'a>(v: &'a serde_json::Value, name: &str) -> Result<&'a serde_json::Value, Failed> {
    Ok(v["blockdevices"]
        .as_array()
        .ok_or("no blockdevices")?
        .iter()
        .find(|d| d["name"] == name)
        .ok_or_else(|| format!("{name} not listed"))?)
}

/// `blockdev --setro` until dropped.
struct ReadOnly(String);

impl ReadOnly {
    fn set(path: &str) -> Result<Self, Failed> {
        let guard = ReadOnly(path.to_string());
        check(Command::new("blockdev").args(["--setro", path]).status()?.success(), "blockdev --setro")?;
        Ok(guard)
    }
}

impl Drop for ReadOnly {
    fn drop(&mut self) {
        let _ = Command::new("blockdev").args(["--setrw", &self.0]).status();
    }
}

/// The default columns carry RM, RO, LABEL, UUID and PTTYPE, agreeing with
/// blkid; `-o` picks lsblk-named columns, `+` adds to the default.
fn columns_match_blkid() -> Result<(), Failed> {
    let fs = LoopDevice::new(64 << 20);
    fs.mkfs_with("ext4", &["-L", "colsfs"]);
    let gpt = LoopDevice::new(32 << 20);
    let mut sf = Command::new("sfdisk").args(["-q", "-X", "gpt", gpt.path()]).stdin(Stdio::piped()).spawn()?;
    std::io::Write::write_all(sf.stdin.as_mut().ok_or("stdin")?, b",8M\n")?;
    check(sf.wait()?.success(), "sfdisk failed")?;
    // The read-only flag outlives the loop device (the next one of that
    // number starts read-only): cleared on drop.
    let _ro = ReadOnly::set(fs.path())?;
    let table = ok_stdout(&volring(&["devices"])?)?;
    let header: Vec<&str> = table.lines().next().unwrap_or("").split_whitespace().collect();
    for col in ["NAME", "MAJ:MIN", "RM", "SIZE", "RO", "TYPE", "FSTYPE", "LABEL", "UUID", "PTTYPE", "MOUNTPOINTS", "ID"] {
        check(header.contains(&col), format!("no {col} column: {header:?}"))?;
    }
    let b = blkid(fs.path());
    let r = row(&table, fs.name())?;
    check(r["FSTYPE"] == "ext4" && r["LABEL"] == "colsfs", format!("{r:?}"))?;
    check(Some(&r["UUID"]) == b.get("UUID"), format!("UUID {:?}, blkid {:?}", r["UUID"], b.get("UUID")))?;
    check(r["RO"] == "1" && r["RM"] == "0", format!("{r:?}"))?;
    let g = row(&table, gpt.name())?;
    let bg = blkid(gpt.path());
    check(bg.get("PTTYPE").map(String::as_str) == Some("gpt"), format!("blkid {bg:?}"))?;
    check(g["PTTYPE"] == "gpt" && g["RO"] == "0", format!("{g:?}"))?;

    let picked = ok_stdout(&volring(&["devices", "-o", "name,uuid,ro,label"])?)?;
    check(
        picked.lines().next() == Some("NAME UUID RO LABEL")
            || picked.lines().next().is_some_and(|h| h.split_whitespace().eq(["NAME", "UUID", "RO", "LABEL"])),
        picked.clone(),
    )?;
    let p = row(&picked, fs.name())?;
    check(Some(&p["UUID"]) == b.get("UUID") && p["RO"] == "1" && p["LABEL"] == "colsfs", format!("{p:?}"))?;
    let plus = ok_stdout(&volring(&["devices", "--output", "+PTUUID,LOG-SEC"])?)?;
    let h: Vec<&str> = plus.lines().next().unwrap_or("").split_whitespace().collect();
    check(h.first() == Some(&"NAME") && h.ends_with(&["PTUUID", "LOG-SEC"]), format!("{h:?}"))?;
    check(Some(&row(&plus, gpt.name())?["PTUUID"]) == bg.get("PTUUID"), format!("PTUUID vs blkid {:?}\n{plus}", bg.get("PTUUID")))?;
    // Not probed is not empty, and gives no weaker id.
    let unprobed = ok_stdout(&volring(&["devices", "--no-probe", "-o", "NAME,FSTYPE,ID"])?)?;
    let u = row(&unprobed, fs.name())?;
    check(u["FSTYPE"] == "?" && u["ID"] == "?", format!("{u:?}\n{unprobed}"))?;
    check(unprobed.lines().any(|l| l.starts_with(&format!("# {}: ID unknown", fs.name()))), unprobed.clone())?;
    let bad = volring(&["devices", "-o", "NAME,NOPE"])?;
    let err = String::from_utf8_lossy(&bad.stderr);
    check(!bad.status.success() && err.contains("NOPE") && err.contains("MOUNTPOINTS"), err.to_string())?;
    Ok(())
}

/// Turns swap off on drop.
struct SwapOn(String);

impl Drop for SwapOn {
    fn drop(&mut self) {
        let _ = Command::new("swapoff").arg(&self.0).status();
    }
}

/// A swap signature alone is FSTYPE swap with no mount point; `[SWAP]`
/// only while the kernel uses it (/proc/swaps).
fn swap_signature_vs_active_swap() -> Result<(), Failed> {
    let lo = LoopDevice::new(32 << 20);
    lo.mkfs("swap");
    let cols = ["devices", "-o", "NAME,FSTYPE,MOUNTPOINTS"];
    let idle = ok_stdout(&volring(&cols)?)?;
    let line = idle.lines().find(|l| l.split_whitespace().next() == Some(lo.name())).ok_or_else(|| idle.clone())?;
    check(line.split_whitespace().collect::<Vec<_>>() == [lo.name(), "swap"], format!("inactive swap shown as {line:?}"))?;
    check(device(&devices_json(&[])?, lo.name())?["swap"] == "inactive", "json swap state")?;
    check(Command::new("swapon").arg(lo.path()).status()?.success(), "swapon")?;
    let _on = SwapOn(lo.path().to_string());
    let active = ok_stdout(&volring(&cols)?)?;
    let line = active.lines().find(|l| l.split_whitespace().next() == Some(lo.name())).ok_or_else(|| active.clone())?;
    check(line.split_whitespace().collect::<Vec<_>>() == [lo.name(), "swap", "[SWAP]"], format!("active swap shown as {line:?}"))?;
    check(device(&devices_json(&[])?, lo.name())?["swap"] == "active", "json swap state")?;
    Ok(())
}

/// The binary where an unprivileged user can run it (the build tree may be
/// under a directory only root can enter).
struct Runnable {
    _dir: tempfile::TempDir,
    bin: PathBuf,
}

fn runnable_copy() -> Result<Runnable, Failed> {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::Builder::new().prefix("volring-bin-").tempdir()?;
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755))?;
    let bin = dir.path().join("volring");
    std::fs::copy(env!("CARGO_BIN_EXE_volring"), &bin)?;
    std::fs::set_permissions(&bin, std::fs::Permissions::from_mode(0o755))?;
    Ok(Runnable { _dir: dir, bin })
}

fn as_nobody(bin: &Path, args: &[&str]) -> Result<String, Failed> {
    let out = Command::new("setpriv")
        .args(["--reuid=65534", "--regid=65534", "--clear-groups", "--"])
        .arg(bin)
        .args(args)
        .env("NODE_NAME", "clinode")
        .current_dir("/")
        .output()?;
    ok_stdout(&out)
}

/// Run as an ordinary user, no device gets an id other than root's: it is
/// root's or unknown (empty, `?` in the table), and the table says what
/// could not be read.
fn non_root_never_gets_another_id() -> Result<(), Failed> {
    let lo = LoopDevice::new(64 << 20);
    lo.mkfs_with("ext4", &["-L", "whoasks"]);
    let r = runnable_copy()?;
    let root = devices_json(&[])?;
    let nobody: serde_json::Value = serde_json::from_str(&as_nobody(&r.bin, &["devices", "--json"])?)?;
    let root_ids: BTreeMap<String, String> = root["blockdevices"]
        .as_array()
        .ok_or("root: no devices")?
        .iter()
        .map(|d| (d["name"].as_str().unwrap_or("").to_string(), d["id"].as_str().unwrap_or("").to_string()))
        .collect();
    let theirs = nobody["blockdevices"].as_array().ok_or("nobody: no devices")?;
    check(theirs.iter().any(|d| d["name"] == lo.name()), "nobody does not see the loop device")?;
    for d in theirs {
        let name = d["name"].as_str().unwrap_or("");
        let id = d["id"].as_str().unwrap_or("");
        let Some(want) = root_ids.get(name) else { continue };
        check(id.is_empty() || id == want, format!("{name}: id {id:?} as nobody, {want:?} as root"))?;
    }
    check(root_ids[lo.name()].starts_with("fsuuid-"), format!("root id {}", root_ids[lo.name()]))?;
    let mine = device(&nobody, lo.name())?;
    check(mine["id"] == "" && mine["probe_error"].is_string(), format!("nobody's loop device: {mine}"))?;
    let table = as_nobody(&r.bin, &["devices", "-o", "NAME,FSTYPE,ID"])?;
    let row = row(&table, lo.name())?;
    check(row["FSTYPE"] == "?" && row["ID"] == "?", format!("{row:?}\n{table}"))?;
    let note = format!("# {}: ", lo.name());
    check(table.lines().any(|l| l.starts_with(&note) && l.contains("ID unknown")), table.clone())?;
    check(table.lines().any(|l| l.starts_with(&note) && l.contains("FSTYPE") && l.contains("denied")), table.clone())?;
    Ok(())
}

/// The iostat -x JSON reports (`iostat -x -d -y -o JSON 1 N DEV`) of one device.
fn iostat_reports(v: &serde_json::Value, dev: &str) -> Vec<serde_json::Value> {
    let stats = v["sysstat"]["hosts"][0]["statistics"].as_array().cloned().unwrap_or_default();
    stats.iter().filter_map(|s| s["disk"].as_array()?.iter().find(|d| d["disk_device"] == dev).cloned()).collect()
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    if v.is_empty() {
        f64::NAN
    } else {
        v[v.len() / 2]
    }
}

/// Reads and writes completed on a block device, from its sysfs `stat`.
fn io_counts(name: &str) -> Result<(u64, u64), Failed> {
    let text = std::fs::read_to_string(format!("/sys/block/{name}/stat"))?;
    let f: Vec<u64> = text.split_whitespace().map(str::parse).collect::<Result<_, _>>()?;
    check(f.len() >= 5, format!("/sys/block/{name}/stat: {text:?}"))?;
    Ok((f[0], f[4]))
}

/// Under steady fio load on a loop device, `volring stats` and iostat -x,
/// sampling the same seconds, agree within sampling tolerance column by
/// column; the device is named with /dev/ and without.
fn stats_agree_with_iostat_under_fio() -> Result<(), Failed> {
    let lo = LoopDevice::new(256 << 20);
    let fio_args = [
        "--name=load".to_string(),
        format!("--filename={}", lo.path()),
        "--rw=randrw".into(),
        "--bs=4k".into(),
        "--direct=1".into(),
        "--ioengine=psync".into(),
        "--rate_iops=400,200".into(),
        "--time_based".into(),
        // Long enough to cover both samplers even when they start late on
        // a loaded host; fio is killed when the test is done with it.
        "--runtime=20".into(),
        "--output=/dev/null".into(),
    ];
    let before = io_counts(lo.name())?;
    let mut fio = Command::new("fio").args(&fio_args).stdout(Stdio::null()).spawn()?;
    let result = (|| -> Result<(), Failed> {
        // Sample only once fio's I/O is moving (0.1 s of its rates seen in
        // the kernel's counters), not after a fixed sleep a loaded host may
        // outlast.
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        loop {
            let now = io_counts(lo.name())?;
            if now.0 >= before.0 + 40 && now.1 >= before.1 + 20 {
                break;
            }
            check(std::time::Instant::now() < deadline, format!("fio's I/O never showed in 30 s: (reads, writes) {before:?} -> {now:?}"))?;
            std::thread::sleep(Duration::from_millis(20));
        }
        const N: &str = "6";
        let iostat = Command::new("iostat").args(["-x", "-d", "-y", "-o", "JSON", "1", N, lo.name()]).stdout(Stdio::piped()).spawn()?;
        let ours = Command::new(env!("CARGO_BIN_EXE_volring"))
            .args(["stats", lo.path(), "--interval", "1", "--count", N, "--json"])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()?;
        let (iostat, ours) = (iostat.wait_with_output()?, ours.wait_with_output()?);
        let theirs: serde_json::Value = serde_json::from_str(&ok_stdout(&iostat)?)?;
        let theirs = iostat_reports(&theirs, lo.name());
        let ours: Vec<serde_json::Value> = ok_stdout(&ours)?.lines().map(serde_json::from_str).collect::<Result<_, _>>()?;
        check(theirs.len() >= 4 && ours.len() >= 4, format!("{} iostat reports, {} volring samples", theirs.len(), ours.len()))?;
        let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH)?.as_secs_f64();
        let mut rates = Vec::new();
        for s in &ours {
            let devs = s["devices"].as_array().ok_or("no devices")?;
            check(devs.len() == 1 && devs[0]["name"] == lo.name(), format!("only the named device: {devs:?}"))?;
            let t = s["unix_time"].as_f64().ok_or("no unix_time")?;
            check((now - t).abs() < 60.0, format!("sample stamped {t}, now {now}"))?;
            rates.push(devs[0]["rates"].clone());
        }
        // (iostat key, volring key, relative tolerance, absolute tolerance)
        let cols = [
            ("r/s", "reads_per_sec", 0.15, 5.0),
            ("w/s", "writes_per_sec", 0.15, 5.0),
            ("rkB/s", "read_kib_per_sec", 0.15, 20.0),
            ("wkB/s", "write_kib_per_sec", 0.15, 20.0),
            ("rareq-sz", "read_req_kib", 0.05, 0.2),
            ("wareq-sz", "write_req_kib", 0.05, 0.2),
            ("rrqm/s", "reads_merged_per_sec", 0.5, 5.0),
            ("wrqm/s", "writes_merged_per_sec", 0.5, 5.0),
            ("d/s", "discards_per_sec", 0.0, 0.5),
            ("f/s", "flushes_per_sec", 0.5, 2.0),
            ("r_await", "read_await_ms", 0.5, 1.0),
            ("w_await", "write_await_ms", 0.5, 1.0),
            ("aqu-sz", "queue_size", 0.5, 0.3),
            ("util", "util_pct", 0.5, 15.0),
        ];
        let mut report = String::new();
        let mut bad = Vec::new();
        for (their_key, our_key, rel, abs) in cols {
            let t = median(theirs.iter().filter_map(|r| r[their_key].as_f64()).collect());
            let o = median(rates.iter().filter_map(|r| r[our_key].as_f64()).collect());
            report.push_str(&format!("{their_key}: iostat {t:.2}, volring {o:.2}\n"));
            // A NaN (a column missing) agrees with nothing.
            let agree = (t - o).abs() <= abs + rel * t.abs().max(o.abs());
            if !agree {
                bad.push(their_key);
            }
        }
        eprintln!("{report}");
        check(bad.is_empty(), format!("disagree on {bad:?}:\n{report}"))?;
        let r = median(rates.iter().filter_map(|r| r["reads_per_sec"].as_f64()).collect());
        check(r > 50.0, format!("fio's load not seen: {r} r/s"))?;

        // Without /dev/, as a table: the timestamp line, iostat's column
        // names, the device even if idle, nothing else.
        let table = ok_stdout(&volring(&["stats", lo.name(), "--interval", "0.2", "--count", "1"])?)?;
        let mut lines = table.lines();
        let stamp = lines.next().unwrap_or("").split_whitespace().next().unwrap_or("");
        let b = stamp.as_bytes();
        check(b.len() == 24 && b[4] == b'-' && b[10] == b'T' && b[19] == b'.' && b[23] == b'Z', format!("timestamp {stamp:?}"))?;
        let header: Vec<&str> = lines.next().unwrap_or("").split_whitespace().collect();
        let want = [
            "Device", "r/s", "rkB/s", "rrqm/s", "%rrqm", "r_await", "rareq-sz", "w/s", "wkB/s", "wrqm/s", "%wrqm", "w_await", "wareq-sz",
            "d/s", "dkB/s", "drqm/s", "%drqm", "d_await", "dareq-sz", "f/s", "f_await", "aqu-sz", "%util",
        ];
        check(header == want, format!("header {header:?}"))?;
        let rows: Vec<&str> = lines.filter(|l| !l.is_empty() && !l.starts_with('#')).collect();
        check(rows.len() == 1 && rows[0].starts_with(lo.name()), table.clone())?;
        let missing = volring(&["stats", "/dev/no-such-disk", "--count", "1"])?;
        check(
            !missing.status.success() && String::from_utf8_lossy(&missing.stderr).contains("no-such-disk"),
            String::from_utf8_lossy(&missing.stderr).to_string(),
        )?;
        Ok(())
    })();
    let _ = fio.kill();
    let _ = fio.wait();
    result
}

/// Devices named as lsblk takes them (`volring devices /dev/loopN`);
/// `--include /dev/loop1` is loop1 and never loop10..loop19 (a prefix does
/// not split a number); `-n` drops the header and `-b` prints sizes in
/// bytes. (Before: rc 2 for a device argument, loop10-19 listed under
/// --include /dev/loop1, no -n or -b.)
fn devices_named_exactly_like_lsblk() -> Result<(), Failed> {
    let dev = LoopDevice::new(3 << 20);
    let out = ok_stdout(&volring(&["devices", "-n", "-b", "-o", "NAME,SIZE", dev.path()])?)?;
    let words: Vec<&str> = out.split_whitespace().collect();
    check(words == [dev.name(), &(3u64 << 20).to_string()], format!("devices -n -b {}: {out:?}", dev.path()))?;
    let theirs = Command::new("lsblk").args(["-n", "-b", "-o", "NAME,SIZE", dev.path()]).output()?;
    let theirs: Vec<String> = String::from_utf8_lossy(&theirs.stdout).split_whitespace().map(String::from).collect();
    check(theirs == words, format!("lsblk says {theirs:?}, volring {words:?}"))?;
    let bad = volring(&["devices", "/dev/no-such-device"])?;
    check(!bad.status.success() && String::from_utf8_lossy(&bad.stderr).contains("no-such-device"), "an unknown device is named")?;
    for (include, want) in [("/dev/loop1", "loop1"), (dev.path(), dev.name())] {
        let v = devices_json(&["--empty", "--include", include])?;
        let names: Vec<&str> = v["blockdevices"].as_array().ok_or("no blockdevices")?.iter().filter_map(|d| d["name"].as_str()).collect();
        let others: Vec<&&str> = names.iter().filter(|n| **n != want && !n.starts_with(&format!("{want}p"))).collect();
        check(others.is_empty(), format!("--include {include} also listed {others:?}"))?;
    }
    Ok(())
}

/// `volring get` from a state directory that does not exist fails and
/// says so (before: rc 0 and nothing).
fn get_from_a_missing_state_dir_fails() -> Result<(), Failed> {
    for args in [
        &["get", "blockdevices", "--local-store", "--state-dir", "/nonexistent/volring"][..],
        &["status", "--state-dir", "/nonexistent/volring"],
    ] {
        let out = volring(args)?;
        let err = String::from_utf8_lossy(&out.stderr);
        check(!out.status.success(), format!("{args:?}: rc {:?}, stdout {:?}", out.status, String::from_utf8_lossy(&out.stdout)))?;
        check(err.contains("/nonexistent/volring") && err.contains("does not exist"), format!("{args:?}: stderr: {err}"))?;
    }
    Ok(())
}

/// Completion scripts and the man page come from the clap definition, so
/// they know every subcommand and flag.
fn completions_and_man_page() -> Result<(), Failed> {
    for shell in ["bash", "zsh", "fish"] {
        let script = ok_stdout(&volring(&["completions", shell])?)?;
        for word in ["devices", "stats", "csi", "completions", "output"] {
            check(script.contains(word), format!("{shell} completion lacks {word}"))?;
        }
    }
    let bash = ok_stdout(&volring(&["completions", "bash"])?)?;
    let mut sh = Command::new("bash").arg("-n").stdin(Stdio::piped()).stderr(Stdio::piped()).spawn()?;
    std::io::Write::write_all(sh.stdin.as_mut().ok_or("stdin")?, bash.as_bytes())?;
    let checked = sh.wait_with_output()?;
    check(checked.status.success(), String::from_utf8_lossy(&checked.stderr).to_string())?;
    let man = ok_stdout(&volring(&["man"])?)?;
    check(man.starts_with(".ie") || man.contains(".TH volring"), man.lines().take(5).collect::<Vec<_>>().join("\n"))?;
    for word in ["devices", "stats", "csi", "VOLRING DEVICES", "\\-\\-output", "VOLRING CSI PUBLISH", "\\-\\-readonly"] {
        check(man.contains(word), format!("man page lacks {word}"))?;
    }
    check(!volring(&["completions", "tcsh"])?.status.success(), "an unknown shell is refused")?;
    Ok(())
}

fn main() {
    let trials = vec![
        Trial::test("devices::columns_match_blkid", columns_match_blkid),
        Trial::test("devices::swap_signature_vs_active_swap", swap_signature_vs_active_swap),
        Trial::test("devices::non_root_never_gets_another_id", non_root_never_gets_another_id),
        Trial::test("stats::agree_with_iostat_under_fio", stats_agree_with_iostat_under_fio),
        Trial::test("cli::completions_and_man_page", completions_and_man_page),
        Trial::test("devices::named_exactly_like_lsblk", devices_named_exactly_like_lsblk),
        Trial::test("cli::get_from_a_missing_state_dir_fails", get_from_a_missing_state_dir_fails),
    ];
    common::run_in_private_namespace(trials)
}
