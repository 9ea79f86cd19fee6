//! `volring nbd attach | detach | status | watch`: `/dev/nbdN` through the
//! kernel's netlink interface, served by this process.

use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use volring_nbd::attach::{read_backend, LinkDeadListener, LocalAttachment, NbdControl};
use volring_nbd::{ExportSpec, Exports, NbdServer, ServerConfig};

#[derive(clap::Args)]
pub(crate) struct AttachArgs {
    /// The image to serve: NAME=PATH[,ro][,direct] (as `nbd serve --export`).
    #[arg(long)]
    pub export: String,
    /// The identifier the device carries (/sys/block/nbdN/backend); a
    /// reattach refuses a device with another one.
    #[arg(long)]
    pub backend_id: String,
    /// Device index; without it the kernel picks a free device.
    #[arg(long)]
    pub index: Option<u32>,
    /// Give the device at --index fresh sockets (NBD_CMD_RECONFIGURE)
    /// instead of connecting it: the previous server process is gone.
    #[arg(long, requires = "index")]
    pub reattach: bool,
    /// Connections (sockets) to the device.
    #[arg(long, default_value_t = 1)]
    pub connections: usize,
    /// Seconds before the kernel resends a request (NBD_ATTR_TIMEOUT).
    #[arg(long, default_value_t = 5)]
    pub timeout: u64,
    /// Seconds the kernel queues I/O while every connection is dead
    /// (NBD_ATTR_DEAD_CONN_TIMEOUT): how long a restart may take.
    #[arg(long, default_value_t = 120)]
    pub dead_conn_timeout: u64,
    /// Disconnect the device when this process is told to stop (SIGTERM,
    /// SIGINT); by default it is left waiting for a successor's --reattach.
    #[arg(long)]
    pub detach_on_exit: bool,
}

fn line(v: serde_json::Value) {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{v}");
    let _ = out.flush();
}

/// Attaches (or re-attaches) and serves until SIGTERM/SIGINT; a device
/// whose connections die meanwhile (LINK_DEAD) gets fresh sockets.
pub(crate) fn attach(a: AttachArgs, config: ServerConfig, rt: tokio::runtime::Runtime) -> anyhow::Result<()> {
    let spec: ExportSpec = a.export.parse()?;
    let server = Arc::new(NbdServer::start(config, Arc::new(Exports::default()))?);
    server.add_export(&spec)?;
    let mut control = NbdControl::open()?;
    // Joined before attaching, so no notice about this device is missed.
    let mut listener = LinkDeadListener::open()?;
    let started = Instant::now();
    let att = if a.reattach {
        let index = a.index.context("--reattach needs --index")?;
        LocalAttachment::reattach(&mut control, &server, index, &spec.name, &a.backend_id, a.connections)?
    } else {
        LocalAttachment::attach(&mut control, &server, &spec.name, &a.backend_id, a.connections, |s| {
            s.index = a.index;
            s.timeout = Duration::from_secs(a.timeout);
            s.dead_conn_timeout = Duration::from_secs(a.dead_conn_timeout);
        })?
    };
    // Scripts wait for this line: the device is usable from here on.
    line(serde_json::json!({
        "attached": format!("/dev/nbd{}", att.index),
        "index": att.index,
        "backend": att.backend_id,
        "connections": att.connections,
        "size": att.details.size,
        "reattached": a.reattach,
        "seconds": started.elapsed().as_secs_f64(),
        // Wall clock when the kernel took the sockets, to time a writer's resume against.
        "at": std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0.0, |d| d.as_secs_f64()),
    }));
    let stop = Arc::new(AtomicBool::new(false));
    let watcher = {
        let (stop, server) = (stop.clone(), server.clone());
        std::thread::Builder::new().name("nbd-link-dead".into()).spawn(move || {
            let mut att = att;
            while !stop.load(Ordering::Relaxed) {
                match listener.recv_timeout(Duration::from_millis(200)) {
                    Ok(Some(index)) if index == att.index => {
                        tracing::warn!(index, "connections died; reconnecting");
                        match att.refresh(&mut control, &server) {
                            Ok(()) => line(serde_json::json!({"reconnected": index})),
                            Err(e) => tracing::error!(index, error = %e, "reconnect failed"),
                        }
                    }
                    Ok(_) => {}
                    Err(e) => {
                        tracing::error!(error = %e, "LINK_DEAD listener failed");
                        std::thread::sleep(Duration::from_millis(200));
                    }
                }
            }
            (att, control)
        })?
    };
    rt.block_on(async {
        use tokio::signal::unix::{signal, SignalKind};
        let mut term = signal(SignalKind::terminate())?;
        tokio::select! {
            _ = tokio::signal::ctrl_c() => {}
            _ = term.recv() => {}
        }
        anyhow::Ok(())
    })?;
    stop.store(true, Ordering::Relaxed);
    let (att, mut control) = watcher.join().map_err(|_| anyhow::anyhow!("link-dead thread panicked"))?;
    if a.detach_on_exit {
        let index = att.index;
        att.detach(&mut control)?;
        line(serde_json::json!({"detached": index}));
    }
    if let Some(server) = Arc::into_inner(server) {
        server.stop();
    }
    Ok(())
}

/// Disconnects a device, after checking its backend when one is given.
pub(crate) fn detach(index: u32, backend_id: Option<&str>) -> anyhow::Result<()> {
    let mut control = NbdControl::open()?;
    control.disconnect(index, backend_id)?;
    line(serde_json::json!({"detached": index}));
    Ok(())
}

/// Every device the driver has (or one), with its backend and size.
pub(crate) fn status(index: Option<u32>, json: bool) -> anyhow::Result<()> {
    let mut control = NbdControl::open()?;
    let devices = control.status(index)?;
    let rows: Vec<_> = devices
        .iter()
        .map(|d| {
            let sectors =
                std::fs::read_to_string(format!("/sys/block/nbd{}/size", d.index)).ok().and_then(|s| s.trim().parse::<u64>().ok());
            serde_json::json!({
                "index": d.index,
                "device": format!("/dev/nbd{}", d.index),
                "connected": d.connected,
                "backend": read_backend(Path::new("/sys/block"), d.index),
                "size": sectors.map(|s| s * 512),
            })
        })
        .collect();
    if json {
        line(serde_json::json!({ "devices": rows }));
    } else {
        println!("{:<12} {:<10} {:>14} BACKEND", "DEVICE", "CONNECTED", "SIZE");
        for r in rows {
            println!(
                "{:<12} {:<10} {:>14} {}",
                r["device"].as_str().unwrap_or(""),
                r["connected"],
                r["size"].as_u64().map_or("-".into(), |s| s.to_string()),
                r["backend"].as_str().unwrap_or("-")
            );
        }
    }
    Ok(())
}

/// Prints each LINK_DEAD notice as a JSON line.
pub(crate) fn watch(count: Option<u64>, seconds: Option<f64>) -> anyhow::Result<()> {
    let mut l = LinkDeadListener::open()?;
    let deadline = seconds.map(|s| Instant::now() + Duration::from_secs_f64(s.max(0.0)));
    let mut seen = 0;
    while count.is_none_or(|c| seen < c) {
        let wait = match deadline {
            Some(d) => d.saturating_duration_since(Instant::now()),
            None => Duration::from_secs(3600),
        };
        if deadline.is_some() && wait.is_zero() {
            break;
        }
        if let Some(index) = l.recv_timeout(wait)? {
            seen += 1;
            line(serde_json::json!({"link_dead": index, "backend": read_backend(Path::new("/sys/block"), index)}));
        }
    }
    Ok(())
}
