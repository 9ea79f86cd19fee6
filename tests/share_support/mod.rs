//! What the shared-volume tests share: a free port, libnfs's tools run
//! bounded, bounded retries, and a kubeconfig for the API stand-in.

#![allow(dead_code)]

use libtest_mimic::Failed;

/// A free TCP port on 127.0.0.1 (bound, read, released).
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()).map(|a| a.port()).expect("free port")
}

/// Runs one of libnfs's tools (nfs-cat, nfs-cp, nfs-ls), killed by PID after
/// 20 s; its stdout, or its stderr as the error.
pub fn libnfs(tool: &str, args: &[&str]) -> Result<Vec<u8>, String> {
    let mut child = std::process::Command::new(tool)
        .args(args)
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .map_err(|e| format!("{tool}: {e}"))?;
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    while child.try_wait().map_err(|e| e.to_string())?.is_none() {
        if std::time::Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            return Err(format!("{tool} {args:?} timed out"));
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    let out = child.wait_with_output().map_err(|e| e.to_string())?;
    if out.status.success() {
        Ok(out.stdout)
    } else {
        Err(format!("{tool} {args:?}: {}{}", String::from_utf8_lossy(&out.stderr), String::from_utf8_lossy(&out.stdout)))
    }
}

/// Retries `f` every 250 ms for at most `secs` seconds (a restarted server
/// answers NFS4ERR_GRACE until its grace period ends).
pub fn eventually<T>(secs: u64, mut f: impl FnMut() -> Result<T, String>) -> Result<T, String> {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(secs);
    loop {
        match f() {
            Ok(v) => return Ok(v),
            Err(e) if std::time::Instant::now() > deadline => return Err(e),
            Err(_) => std::thread::sleep(std::time::Duration::from_millis(250)),
        }
    }
}

pub fn url(port: u16, path: &str) -> String {
    format!("nfs://127.0.0.1{path}?version=4&nfsport={port}")
}

/// A kubeconfig naming the stand-in at `addr`, written under `dir`.
pub fn kubeconfig(dir: &std::path::Path, addr: std::net::SocketAddr) -> Result<String, Failed> {
    let path = dir.join("kubeconfig");
    std::fs::write(
        &path,
        format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: s\n  cluster:\n    server: http://{addr}\nusers:\n- name: u\n  user: {{}}\n\
             contexts:\n- name: c\n  context:\n    cluster: s\n    user: u\ncurrent-context: c\n"
        ),
    )?;
    Ok(path.display().to_string())
}
