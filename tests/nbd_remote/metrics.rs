//! The export server on `/metrics`: the I/O another node does on this
//! node's volume through `--nbd-export-listen` shows in the agent's NBD
//! families as `server="export"`, labelled with the volume. On the old code
//! that server's catalog never reached the encoder: no `server="export"`
//! series at all, however much a client read and wrote.

use std::io::{Read, Write};

use super::{check, client_uri, create_nbd, free_port, run, until, Agent, Failed, T};

/// `/metrics` of the agent at `addr`, the body alone (HTTP/1.0: no chunks
/// to undo; a read waits at most 10 s).
fn scrape(addr: &str) -> std::io::Result<String> {
    let mut c = std::net::TcpStream::connect(addr)?;
    c.set_read_timeout(Some(std::time::Duration::from_secs(10)))?;
    c.write_all(b"GET /metrics HTTP/1.0\r\nHost: localhost\r\n\r\n")?;
    let mut reply = String::new();
    c.take(16 << 20).read_to_string(&mut reply)?;
    Ok(reply.split_once("\r\n\r\n").map_or(reply.clone(), |(_, body)| body.to_string()))
}

/// The value of the series `name{labels}` (exactly those labels), if shown.
fn value(body: &str, name: &str, labels: &str) -> Option<f64> {
    let prefix = format!("{name}{{{labels}}} ");
    body.lines().find_map(|l| l.strip_prefix(&prefix)?.parse().ok())
}

pub(super) fn export_server_reaches_metrics() -> Result<(), Failed> {
    let (listen, metrics) = (format!("127.0.0.1:{}", free_port()), format!("127.0.0.1:{}", free_port()));
    let a = Agent::start_with(&[("VOLRING_NBD_EXPORT_LISTEN", &listen), ("VOLRING_METRICS_ADDR", &metrics)]);
    let v = create_nbd(&a, "pvc-m", "nbd")?;
    // Another node's client (qemu-io with the volume's secret) writes, then
    // reads back, 64 KiB.
    let (ok, out, err) = run("qemu-io", &["-f", "raw", "-c", "write -P 0x3c 1M 64k", "-c", "read -P 0x3c 1M 64k", &client_uri(&v)], T);
    check(ok && out.contains("wrote 65536/65536") && out.contains("read 65536/65536"), format!("qemu-io: {out}{err}"))?;

    let vol = r#"export="pvc-m",server="export",volume="pvc-m""#;
    let at_least = |body: &str, name: &str, labels: &str, n: f64| value(body, name, labels).is_some_and(|v| v >= n);
    let mut body = String::new();
    // The export counters move with each request; the ring's series come
    // with its first tick (at most 250 ms).
    let shown = until("the export server's series on /metrics", || {
        body = scrape(&metrics).unwrap_or_default();
        at_least(&body, "volring_nbd_writes_total", vol, 1.0)
            && at_least(&body, "volring_nbd_reads_total", vol, 1.0)
            && value(&body, "volring_nbd_ring_nice", r#"ring="0",server="export""#).is_some()
    });
    let tail: String = body.lines().filter(|l| l.starts_with("volring_nbd")).collect::<Vec<_>>().join("\n");
    shown.map_err(|e| format!("{e:?}:\n{tail}"))?;
    check(at_least(&body, "volring_nbd_written_bytes_total", vol, 65536.0), format!("written bytes:\n{tail}"))?;
    check(at_least(&body, "volring_nbd_read_bytes_total", vol, 65536.0), format!("read bytes:\n{tail}"))?;
    check(at_least(&body, "volring_nbd_connections_accepted_total", vol, 1.0), format!("connections:\n{tail}"))?;
    let timed = r#"export="pvc-m",op="write",server="export",volume="pvc-m""#;
    check(at_least(&body, "volring_nbd_request_duration_seconds_count", timed, 1.0), format!("write latency:\n{tail}"))?;
    check(value(&body, "volring_nbd_ring_starved_windows_total", r#"ring="0",server="export""#).is_some(), format!("ring:\n{tail}"))?;
    // Nothing staged here: no attach server, and no `--nbd-listen`.
    check(!body.contains(r#"server="attach""#) && !body.contains(r#"server="listen""#), format!("other servers:\n{tail}"))?;
    // The volume's series go with it.
    a.delete("pvc-m")?;
    let gone = scrape(&metrics)?;
    check(!gone.contains(r#"volume="pvc-m""#), "the deleted volume's series stay")?;
    check(gone.contains("# TYPE volring_nbd_reads_total counter"), "the families stay declared")
}
