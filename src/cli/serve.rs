//! `volring nbd serve`: the NBD server in the foreground, its exports
//! from flags and an exports file re-read on SIGHUP.

use std::io::Write;

use anyhow::Context;

/// Reads an exports file: one spec per line, blank lines and `#` comments skipped.
pub(crate) fn read_exports_file(path: &std::path::Path) -> anyhow::Result<Vec<volring_nbd::ExportSpec>> {
    let text = std::fs::read_to_string(path).with_context(|| format!("read {}", path.display()))?;
    let specs =
        text.lines().map(str::trim).filter(|l| !l.is_empty() && !l.starts_with('#')).map(|l| l.parse()).collect::<Result<Vec<_>, _>>()?;
    Ok(specs)
}

pub(crate) async fn nbd_serve(
    config: volring_nbd::ServerConfig,
    specs: Vec<volring_nbd::ExportSpec>,
    exports_file: Option<std::path::PathBuf>,
    stats_interval: f64,
) -> anyhow::Result<()> {
    use tokio::signal::unix::{signal, SignalKind};
    // The exports first: a missing image or exports file fails before
    // anything listens (or says it does).
    let exports = std::sync::Arc::new(volring_nbd::Exports::default());
    let from_file = match &exports_file {
        Some(p) => read_exports_file(p)?,
        None => Vec::new(),
    };
    for spec in specs.iter().chain(&from_file) {
        let e = exports.add(spec, None).with_context(|| format!("NBD export {}", spec.name))?;
        tracing::info!(export = %e.name, path = %e.path.display(), size = e.size, read_only = e.read_only, direct = e.direct_io(), "export added");
    }
    // A server with no listener serves only its own socketpairs: nothing
    // for `volring nbd serve`.
    if config.listen.is_empty() {
        return Err(volring_nbd::Error::Listen { addr: String::new(), why: "no address to listen on".into() }.into());
    }
    // Off the runtime: a bind may wait for a killed server's address.
    let server = std::sync::Arc::new(tokio::task::spawn_blocking(move || volring_nbd::NbdServer::start(config, exports)).await??);
    // Tests and scripts wait for this line: the server accepts from here on.
    // A closed stdout does not stop the server; it stops the printing.
    let listening = serde_json::json!({
        "listening": server.addresses(),
        "exports": server.exports().all().iter().map(|e| &e.name).collect::<Vec<_>>()
    });
    let mut printing = print_line(&listening);
    let mut term = signal(SignalKind::terminate())?;
    let mut hup = signal(SignalKind::hangup())?;
    let period = std::time::Duration::from_secs_f64(stats_interval.max(0.01));
    let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + period, period);
    // A reload runs on the blocking pool (removing an export waits for its
    // connections); signals that arrive meanwhile start one more after it.
    let mut reload: Option<tokio::task::JoinHandle<()>> = None;
    loop {
        tokio::select! {
            _ = tokio::signal::ctrl_c() => break,
            _ = term.recv() => break,
            _ = tick.tick(), if stats_interval > 0.0 && printing => printing = print_nbd_stats(&server),
            _ = hup.recv(), if reload.is_none() => {
                let Some(path) = exports_file.clone() else {
                    tracing::info!("SIGHUP: no --exports-file to re-read; ignored");
                    continue;
                };
                let (server, fixed) = (server.clone(), specs.clone());
                reload = Some(tokio::task::spawn_blocking(move || match read_exports_file(&path) {
                    Ok(wanted) => reconcile_exports(&server, &fixed, &wanted),
                    Err(e) => tracing::warn!(error = %e, "exports file not re-read"),
                }));
            }
            done = async { reload.as_mut().expect("guarded").await }, if reload.is_some() => {
                reload = None;
                if let Err(e) = done {
                    tracing::error!(error = %e, "exports reload did not finish");
                }
            }
        }
    }
    if let Some(r) = reload.take() {
        let _ = r.await;
    }
    if printing {
        print_nbd_stats(&server);
    }
    if let Some(server) = std::sync::Arc::into_inner(server) {
        tokio::task::spawn_blocking(move || server.stop()).await?;
    }
    Ok(())
}

/// Prints one JSON line; false when stdout is gone (then nothing more is
/// printed; a closed pipe is not worth a warning).
pub(crate) fn print_line(v: &serde_json::Value) -> bool {
    let mut out = std::io::stdout().lock();
    match writeln!(out, "{v}").and_then(|_| out.flush()) {
        Ok(()) => true,
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => false,
        Err(e) => {
            tracing::warn!(error = %e, "stdout not writable; no more lines are printed");
            false
        }
    }
}

/// Makes the served set match the command line plus the exports file.
pub(crate) fn reconcile_exports(server: &volring_nbd::NbdServer, fixed: &[volring_nbd::ExportSpec], wanted: &[volring_nbd::ExportSpec]) {
    let keep: std::collections::HashSet<&str> = fixed.iter().chain(wanted).map(|s| s.name.as_str()).collect();
    for e in server.exports().all() {
        if !keep.contains(e.name.as_str()) {
            let _ = server.remove_export(&e.name);
        }
    }
    for spec in wanted {
        if server.exports().get(&spec.name).is_none() {
            if let Err(e) = server.add_export(spec) {
                tracing::warn!(error = %e, "export not added");
            }
        }
    }
}

pub(crate) fn print_nbd_stats(server: &volring_nbd::NbdServer) -> bool {
    let snaps: Vec<_> = server.exports().all().iter().map(|e| e.snapshot()).collect();
    print_line(&serde_json::json!({ "exports": snaps }))
}
