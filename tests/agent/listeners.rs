//! What `volring node` must have to start: its own state directory and
//! socket, and listeners it can bind; a refusal is fatal and says why. The
//! metrics served (the NBD rings' own counters among them), and the ready
//! line.

use super::*;

pub(super) fn second_agent_on_the_same_state_dir_is_refused() -> Result<(), Failed> {
    let site = Site::new();
    let (mut first, _c) = site.start("state", "a.sock", &[])?;
    let mut second = Proc::spawn(&mut site.node("state", "b.sock", &[]));
    let state = site.path("state");
    let pid = first.pid().to_string();
    refused(&mut second, &["another volring agent holds", &state.display().to_string(), &pid])?;
    check(!site.path("b.sock").exists(), "the refused agent left a socket")?;
    check(site.rt.block_on(probe(&site.path("a.sock"))).is_some(), "the first agent still answers")?;
    let status = first.stop().ok_or("the first agent did not stop")?;
    check(status.success(), format!("the first agent exited with {status}"))?;
    check(!site.path("a.sock").exists(), "the first agent removes its own socket at exit")?;
    // Once the first has gone, the state directory is free again.
    let (mut third, _c) = site.start("state", "b.sock", &[])?;
    check(third.stop().is_some_and(|s| s.success()), "the third agent stops cleanly")
}

pub(super) fn second_agent_on_the_same_socket_is_refused_and_leaves_it() -> Result<(), Failed> {
    let site = Site::new();
    let (mut first, _c) = site.start("state-a", "csi.sock", &[])?;
    let mut second = Proc::spawn(&mut site.node("state-b", "csi.sock", &[]));
    let sock = site.path("csi.sock").display().to_string();
    refused(&mut second, &["cannot bind CSI socket", &sock, "in use"])?;
    check(site.path("csi.sock").exists(), "the refused agent removed the first agent's socket")?;
    check(site.rt.block_on(probe(&site.path("csi.sock"))).is_some(), "the first agent still answers")?;
    check(first.stop().is_some_and(|s| s.success()), "the first agent stops cleanly")
}

pub(super) fn a_file_at_the_socket_path_is_refused_and_kept() -> Result<(), Failed> {
    let site = Site::new();
    std::fs::write(site.path("csi.sock"), b"precious")?;
    let mut p = Proc::spawn(&mut site.node("state", "csi.sock", &[]));
    refused(&mut p, &["cannot bind CSI socket", "not a socket"])?;
    check(std::fs::read(site.path("csi.sock"))? == b"precious", "the file was changed")
}

pub(super) fn metrics_address_in_use_is_fatal() -> Result<(), Failed> {
    let site = Site::new();
    let taken = std::net::TcpListener::bind("127.0.0.1:0")?;
    let addr = taken.local_addr()?.to_string();
    let mut p = Proc::spawn(&mut site.node("state", "csi.sock", &["--metrics-addr", &addr]));
    refused(&mut p, &["cannot bind the metrics address", &addr])?;
    check(!site.path("csi.sock").exists(), "the failed agent left its CSI socket behind")
}

/// The agent binds the metrics listener at start and serves `/metrics` on
/// it: asked for port 0, it says which port it got and answers there.
pub(super) fn metrics_are_served_on_the_listener_bound_at_start() -> Result<(), Failed> {
    let site = Site::new();
    let (mut p, _c) = site.start("state", "csi.sock", &["--metrics-addr", "127.0.0.1:0"])?;
    let addr = metrics_addr(&p)?;
    check(addr.ip().is_loopback() && addr.port() != 0, format!("metrics served on {addr}"))?;
    let mut conn = std::net::TcpStream::connect(addr)?;
    conn.set_read_timeout(Some(patience()))?;
    std::io::Write::write_all(
        &mut conn,
        b"GET /metrics HTTP/1.1\r\nHost: localhost\r\nAccept: application/openmetrics-text;version=1.0.0,text/plain;q=0.3\r\nConnection: close\r\n\r\n",
    )?;
    let mut reply = String::new();
    conn.take(16 << 20).read_to_string(&mut reply)?;
    check(reply.starts_with("HTTP/1.1 200"), format!("reply: {reply:.200}"))?;
    check(reply.contains("application/openmetrics-text"), "not OpenMetrics")?;
    check(reply.contains("volring_devices "), format!("no device gauge in: {reply:.2000}"))?;
    // node_exporter's disk counters, and an info series per device.
    for family in [
        "volring_device_reads_merged_total{",
        "volring_device_writes_merged_total{",
        "volring_device_discard_time_seconds_total{",
        "volring_device_flush_time_seconds_total{",
        "volring_device_io_time_weighted_seconds_total{",
        "volring_device_info{device=",
    ] {
        check(reply.contains(family), format!("no {family} in: {reply:.2000}"))?;
    }
    // The reconciler's start pass ran before ready, and is counted.
    let passes = reply.lines().find_map(|l| l.strip_prefix("volring_reconcile_passes_total ")).and_then(|n| n.parse::<u64>().ok());
    check(passes.is_some_and(|n| n >= 1), format!("reconciler passes {passes:?} in: {reply:.4000}"))?;
    check(reply.lines().any(|l| l == "volring_volumes 0"), "no volume gauge")?;
    // CSI: every RPC has its OK series; the start's Probe was counted.
    let probes = reply
        .lines()
        .find_map(|l| l.strip_prefix("volring_csi_requests_total{rpc=\"Probe\",code=\"OK\"} "))
        .and_then(|n| n.parse::<u64>().ok());
    check(probes.is_some_and(|n| n >= 1), format!("Probe calls {probes:?}"))?;
    check(reply.contains("volring_csi_requests_total{rpc=\"NodeStageVolume\",code=\"OK\"} 0"), "NodeStageVolume series")?;
    check(reply.contains("volring_csi_request_duration_seconds_bucket{le=\"0.0001\",rpc=\"Probe\"}"), "CSI latency histogram")?;
    // The node store's commits, which every change to the machine waits on.
    let commits =
        reply.lines().find_map(|l| l.strip_prefix("volring_store_commit_duration_seconds_count ")).and_then(|n| n.parse::<u64>().ok());
    check(commits.is_some(), format!("store commit histogram: {reply:.4000}"))?;
    check(reply.contains("volring_store_commit_duration_seconds_bucket{le=\"0.001\"}"), "store commit buckets")?;
    for g in [
        "volring_csi_volumes_staged 0",
        "volring_csi_volumes_published 0",
        "volring_csi_pool_volumes 0",
        "volring_csi_pool_provisioned_bytes 0",
    ] {
        check(reply.lines().any(|l| l == g), format!("no {g:?}"))?;
    }
    // Without OpenMetrics in Accept: the classic text, which the standard
    // linter passes (OpenMetrics counter families lack the `_total` their
    // samples carry, so promtool found "no help text" on every counter).
    let classic = http_get(addr, "/metrics")?;
    check(classic.contains("text/plain; version=0.0.4"), format!("classic content type: {classic:.300}"))?;
    let body = classic.split_once("\r\n\r\n").map(|(_, b)| b).unwrap_or("");
    check(body.contains("# TYPE volring_reconcile_passes_total counter"), format!("classic counter family: {body:.2000}"))?;
    promtool_check(body)?;
    // The probes kubelet uses (deploy/base/daemonset.yaml).
    for (path, want) in [("/healthz", "ok"), ("/readyz", "ready")] {
        let reply = http_get(addr, path)?;
        check(reply.starts_with("HTTP/1.1 200") && reply.ends_with(&format!("{want}\n")), format!("{path}: {reply:.300}"))?;
    }
    check(p.stop().is_some_and(|s| s.success()), "the agent stops cleanly")
}

/// The address the agent says it serves `/metrics` on (waiting at most
/// `patience()` for the line).
fn metrics_addr(p: &Proc) -> Result<std::net::SocketAddr, Failed> {
    let deadline = Instant::now() + patience();
    loop {
        let said = p.stderr.find(&["serving /metrics"]).map(|i| without_colours(&p.stderr.all()[i]));
        if let Some(addr) = said.as_deref().and_then(|l| l.split("addr=").nth(1)).and_then(|a| a.split_whitespace().next()) {
            return Ok(addr.parse::<std::net::SocketAddr>().map_err(|e| format!("{addr:?}: {e}"))?);
        }
        check(Instant::now() < deadline, format!("no word of the metrics address in:\n{}", p.stderr.text()))?;
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// `promtool check metrics` on an exposition: it must exit 0 with nothing
/// to say. Skipped where promtool is missing, except in CI (`.ci/run`
/// installs Debian's prometheus package for it).
fn promtool_check(body: &str) -> Result<(), Failed> {
    let spawned = std::process::Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn();
    let mut child = match spawned {
        Ok(c) => c,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound && std::env::var_os("CI").is_none() => {
            eprintln!("promtool not found: the lint of /metrics is skipped (apt-get install prometheus)");
            return Ok(());
        }
        Err(e) => return Err(format!("promtool: {e}").into()),
    };
    let mut stdin = child.stdin.take().ok_or("promtool stdin")?;
    stdin.write_all(body.as_bytes())?;
    drop(stdin);
    let out = child.wait_with_output()?;
    let said = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    check(out.status.success() && said.trim().is_empty(), format!("promtool check metrics: {:?}\n{said}", out.status))
}

/// Logs to a pipe carry no colour codes; `--log-format json` gives one JSON
/// object per line; the one "ready" line says what the agent serves;
/// `--version` names the commit. (Before: ANSI codes in every piped line, no
/// JSON, no ready line, a bare version.)
pub(super) fn logs_ready_line_and_version() -> Result<(), Failed> {
    let site = Site::new();
    let (mut p, _c) = site.start("state", "csi.sock", &["--metrics-addr", "127.0.0.1:0"])?;
    let deadline = Instant::now() + patience();
    let ready = loop {
        if let Some(i) = p.stderr.find(&[" ready "]) {
            break p.stderr.all()[i].clone();
        }
        check(Instant::now() < deadline, format!("no ready line in:\n{}", p.stderr.text()))?;
        std::thread::sleep(Duration::from_millis(10));
    };
    check(!p.stderr.text().contains('\x1b'), format!("colour codes in piped logs:\n{}", p.stderr.text()))?;
    for want in ["mounts=", "devices=", "metrics=\"http://127.0.0.1:", "csi=\"unix://", "nbd=\"off\""] {
        check(ready.contains(want), format!("{want} missing from the ready line: {ready}"))?;
    }
    check(p.stop().is_some_and(|s| s.success()), "the agent stops cleanly")?;

    let (mut p, _c) = site.start("state", "csi.sock", &["--log-format", "json"])?;
    check(p.stop().is_some_and(|s| s.success()), "the JSON-logging agent stops cleanly")?;
    let lines = p.stderr.all();
    check(lines.len() >= 3, format!("too few log lines: {lines:?}"))?;
    for l in &lines {
        let v: serde_json::Value = serde_json::from_str(l).map_err(|e| format!("not JSON ({e}): {l}"))?;
        check(v["level"].is_string() && v["fields"]["message"].is_string(), format!("JSON log line without level or message: {l}"))?;
    }
    check(lines.iter().any(|l| l.contains("\"message\":\"ready\"")), "a JSON ready line")?;

    let out = Command::new(VOLRING).arg("--version").output()?;
    let version = String::from_utf8_lossy(&out.stdout).to_string();
    // Built from a git checkout (as here and in CI): the commit is named.
    let in_git = Command::new("git").args(["rev-parse", "HEAD"]).current_dir(env!("CARGO_MANIFEST_DIR")).output();
    if in_git.is_ok_and(|o| o.status.success()) {
        check(version.contains("(commit "), format!("--version without a commit: {version}"))?;
    }
    check(version.starts_with(&format!("volring {}", env!("CARGO_PKG_VERSION"))), format!("--version: {version}"))
}

/// An agent started without root fails with its cause and a hint that
/// root is what is missing (before: the bare EACCES).
pub(super) fn non_root_is_told_it_needs_root() -> Result<(), Failed> {
    let site = Site::new();
    let state = site.path("nobody-state");
    let out = Command::new("setpriv")
        .args(["--reuid=65534", "--regid=65534", "--clear-groups", VOLRING, "node", "--metrics-addr", "off", "--state-dir"])
        .arg(&state)
        .stdin(Stdio::null())
        .output()?;
    let err = String::from_utf8_lossy(&out.stderr);
    check(!out.status.success(), "a non-root agent fails")?;
    check(err.contains("Permission denied") && err.contains("hint: this needs root"), format!("stderr: {err}"))
}

pub(super) fn nbd_listener_in_use_is_fatal() -> Result<(), Failed> {
    let site = Site::new();
    let taken = std::net::TcpListener::bind("127.0.0.1:0")?;
    let addr = taken.local_addr()?.to_string();
    let mut p = Proc::spawn(&mut site.node("state", "csi.sock", &["--nbd-listen", &addr]));
    refused(&mut p, &["cannot start the NBD server", &addr])?;
    check(!site.path("csi.sock").exists(), "the failed agent left its CSI socket behind")
}

/// The NBD rings' own counters reach `/metrics`: after reads at queue
/// depth 1 from a real client (qemu-io, one command at a time), the one
/// ring that served them shows idle polls. (Before, no
/// `volring_nbd_ring_*` family existed; the counts were only in the ring's
/// debug log line.) The ring polls after any gap up to 10 ms unless it is
/// judged contended for its CPU (a loaded machine can do that for a second
/// at a time), so rounds of reads are repeated, a bounded number of times,
/// until a tick has published a poll. With offload off its reads are never
/// offloaded; whether it was ever starved depends on the machine, so only
/// the series is looked for.
pub(super) fn nbd_ring_counters_reach_metrics() -> Result<(), Failed> {
    let site = Site::new();
    let image = site.path("demo.img");
    std::fs::File::create(&image)?.set_len(1 << 20)?;
    let socket = site.path("nbd.sock");
    let (listen, export) = (format!("unix:{}", socket.display()), format!("demo={}", image.display()));
    let flags = ["--metrics-addr", "127.0.0.1:0", "--nbd-listen", &listen, "--nbd-export", &export, "--nbd-threads", "1"];
    let tuning = ["--nbd-idle-poll-us", "10000", "--nbd-offload-reads", "off"];
    let (mut p, _c) = site.start("state", "csi.sock", &[&flags[..], &tuning[..]].concat())?;
    let addr = metrics_addr(&p)?;
    let uri = format!("nbd+unix:///demo?socket={}", socket.display());
    let polls = |body: &str| -> u64 {
        let series = body.lines().filter_map(|l| l.strip_prefix("volring_nbd_ring_idle_polls_total{ring=\"0\","));
        // The listener's (`server="listen"`): no nbd volume here, no attach server.
        let series = series.filter(|l| l.contains("server=\"listen\""));
        series.filter_map(|l| l.rsplit(' ').next()?.parse::<u64>().ok()).sum()
    };
    let mut body = String::new();
    for _round in 0..60 {
        qemu_io_reads(&uri, 64)?;
        // Published at the ring's next tick (at most 250 ms away).
        for _ in 0..40 {
            body = http_get(addr, "/metrics")?;
            if polls(&body) > 0 {
                break;
            }
            std::thread::sleep(Duration::from_millis(25));
        }
        if polls(&body) > 0 {
            break;
        }
    }
    check(polls(&body) > 0, format!("no idle poll of ring 0 after reads at queue depth 1: {body:.6000}"))?;
    let starved = body.lines().any(|l| l.starts_with("volring_nbd_ring_starved_windows_total{ring=\"0\",server=\"listen\"} "));
    check(starved, format!("no starved windows series of ring 0 in: {body:.6000}"))?;
    let line = "volring_nbd_ring_offloading_reads{ring=\"0\",server=\"listen\"} 0";
    check(body.lines().any(|l| l == line), format!("no {line:?} in: {body:.6000}"))?;
    check(body.lines().any(|l| l == "volring_nbd_ring_nice{ring=\"0\",server=\"listen\"} 0"), "no nice gauge of ring 0")?;
    for pool in ["held", "lent"] {
        let series = format!("volring_nbd_ring_recv_buffers_{pool}{{ring=\"0\",server=\"listen\"}} ");
        check(body.lines().any(|l| l.starts_with(&series)), format!("no {series:?} in: {body:.6000}"))?;
    }
    check(!body.contains("ring=\"1\""), "one ring asked for, one ring shown")?;
    check(p.stop().is_some_and(|s| s.success()), "the agent stops cleanly")
}

/// `count` 4 KiB reads through qemu-io, one after another (queue depth 1);
/// qemu-io is killed if it runs past `patience()`.
fn qemu_io_reads(uri: &str, count: u64) -> Result<(), Failed> {
    let mut cmd = Command::new("qemu-io");
    cmd.args(["-f", "raw", "-r"]);
    for i in 0..count {
        cmd.arg("-c").arg(format!("read {} 4k", (i % 256) * 4096));
    }
    let mut child = cmd.arg(uri).stdin(Stdio::null()).stdout(Stdio::null()).stderr(Stdio::piped()).spawn()?;
    let deadline = Instant::now() + patience();
    let status = loop {
        if let Some(s) = child.try_wait()? {
            break s;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            return Err("qemu-io did not finish its reads".into());
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    let mut err = String::new();
    child.stderr.take().ok_or("qemu-io stderr")?.read_to_string(&mut err)?;
    check(status.success(), format!("qemu-io: {status}: {err}"))
}
