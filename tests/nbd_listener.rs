//! The NBD server's unix socket path: claimed by a lock for the server's
//! life, a stale socket replaced, anything else left alone, and at
//! shutdown only the server's own socket removed. A server started right
//! after its predecessor was SIGKILLed gets both its addresses back.

mod common;

use std::io::{BufRead, BufReader, Read};
use std::os::unix::fs::MetadataExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use common::check;
use libtest_mimic::{Failed, Trial};
use volring_nbd::{Error, Exports, Listen, NbdServer, ServerConfig};

fn start(path: &Path) -> Result<NbdServer, Error> {
    let config = ServerConfig { listen: vec![Listen::Unix(path.to_path_buf())], threads: 1, ..Default::default() };
    NbdServer::start(config, Arc::new(Exports::default()))
}

fn inode(path: &Path) -> Option<u64> {
    std::fs::symlink_metadata(path).ok().map(|m| m.ino())
}

/// Whether an NBD server greets a client at `path`.
fn greets(path: &Path) -> bool {
    let Ok(mut s) = UnixStream::connect(path) else { return false };
    let _ = s.set_read_timeout(Some(Duration::from_secs(10)));
    let mut greeting = [0u8; 18];
    s.read_exact(&mut greeting).is_ok() && &greeting[..8] == b"NBDMAGIC"
}

fn is_socket_error(r: &Result<NbdServer, Error>) -> bool {
    matches!(r, Err(Error::Socket { .. }))
}

fn stale_socket_is_replaced_and_nothing_else_is_touched() -> Result<(), Failed> {
    let dir = tempfile::Builder::new().prefix("volring-listener-").tempdir()?;
    let path = dir.path().join("nbd.sock");

    // A socket file nobody listens on (its server died): taken over.
    drop(UnixListener::bind(&path)?);
    check(UnixStream::connect(&path).is_err(), "the stale socket refuses connections")?;
    let server = start(&path).map_err(|e| format!("a stale socket blocked the server: {e}"))?;
    check(greets(&path), "the new server answers at the stale socket's path")?;
    server.stop();
    check(inode(&path).is_none(), "shutdown removed the server's own socket")?;

    // A regular file at the path is refused and kept.
    std::fs::write(&path, b"not a socket")?;
    let r = start(&path);
    check(is_socket_error(&r), format!("a regular file at the path: {:?}", r.as_ref().err()))?;
    check(std::fs::read(&path)? == b"not a socket", "the regular file was left as it was")?;
    std::fs::remove_file(&path)?;

    // Someone replaced the server's socket while it ran: shutdown leaves
    // the replacement (and its listener) alone.
    let server = start(&path)?;
    std::fs::remove_file(&path)?;
    let foreign = UnixListener::bind(&path)?;
    let foreign_inode = inode(&path);
    server.stop();
    check(inode(&path).is_some() && inode(&path) == foreign_inode, "shutdown removed a socket that was not its own")?;
    check(UnixStream::connect(&path).is_ok(), "the replacement still takes connections")?;
    drop(foreign);
    Ok(())
}

fn second_server_on_the_same_path_fails() -> Result<(), Failed> {
    let dir = tempfile::Builder::new().prefix("volring-listener-").tempdir()?;
    let path = dir.path().join("nbd.sock");
    let first = start(&path)?;
    let first_inode = inode(&path);

    let second = start(&path);
    check(is_socket_error(&second), format!("a second server on a live path: {:?}", second.as_ref().err()))?;
    drop(second);
    check(inode(&path) == first_inode, "the first server's socket file is untouched")?;
    check(greets(&path), "the first server still answers")?;

    // Even with the first server's socket file deleted under it, the path
    // stays claimed: a second server would leave the first unreachable.
    std::fs::remove_file(&path)?;
    let third = start(&path);
    check(is_socket_error(&third), format!("a second server while the first holds the path: {:?}", third.as_ref().err()))?;
    drop(third);

    // Once the first is gone, the path is free.
    first.stop();
    let fourth = start(&path).map_err(|e| format!("the path stayed claimed after its server stopped: {e}"))?;
    check(greets(&path), "the next server answers")?;
    fourth.stop();
    Ok(())
}

/// A socket in a directory that does not exist yet: the directory is made,
/// as the CSI socket's is (the README's `unix:/run/volring/nbd.sock` failed
/// on a fresh machine). A bad address names itself as a listen address.
fn missing_socket_directory_is_made_and_bad_addresses_are_named() -> Result<(), Failed> {
    let dir = tempfile::Builder::new().prefix("volring-listener-").tempdir()?;
    let path = dir.path().join("run/volring/nbd.sock");
    let server = start(&path).map_err(|e| format!("start in a new directory: {e}"))?;
    check(greets(&path), "the server greets at the new path")?;
    server.stop();
    let bad = "not-an-address".parse::<Listen>().map(|_| ()).map_err(|e| e.to_string());
    check(bad.as_ref().is_err_and(|e| e.contains("listen address") && !e.contains("export")), format!("{bad:?}"))
}

/// Starts `volring nbd serve` on `tcp` and `unix`; the child once it says
/// it listens, or why it did not (its stderr).
fn serve(tcp: &str, unix: &Path) -> Result<Child, String> {
    let mut child = Command::new(env!("CARGO_BIN_EXE_volring"))
        .args(["nbd", "serve", "--nbd-threads", "1", "--tcp", tcp, "--unix"])
        .arg(unix)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| format!("spawn: {e}"))?;
    let mut line = String::new();
    let _ = BufReader::new(child.stdout.take().expect("stdout")).read_line(&mut line);
    if line.contains("listening") {
        return Ok(child);
    }
    let _ = child.kill();
    let status = child.wait().map_err(|e| e.to_string())?;
    let mut why = String::new();
    let _ = child.stderr.take().expect("stderr").read_to_string(&mut why);
    Err(format!("{status}: {why}"))
}

/// A crashed server's successor, started at once, takes over its TCP port
/// and unix socket. The kernel closes a SIGKILLed process's io_uring —
/// and the listening sockets its accepts were armed on — after the process
/// is reaped; the successor used to find them still listening and exit
/// (EADDRINUSE, or "another server is listening there").
fn a_killed_servers_addresses_are_taken_over_at_once() -> Result<(), Failed> {
    let dir = tempfile::Builder::new().prefix("volring-listener-").tempdir()?;
    let path = dir.path().join("nbd.sock");
    let port = std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
    let tcp = format!("127.0.0.1:{port}");
    for round in 0..20 {
        let mut child = serve(&tcp, &path).map_err(|e| format!("start {round} after a SIGKILL: {e}"))?;
        // A connected client too: its receive is in flight when the server dies.
        let client = std::net::TcpStream::connect(&tcp);
        check(greets(&path), format!("round {round}: the server greets on its socket"))?;
        child.kill()?;
        child.wait()?;
        drop(client);
    }
    Ok(())
}

fn main() {
    let args = libtest_mimic::Arguments::from_args();
    let trials = vec![
        Trial::test(
            "nbd_listener::stale_socket_is_replaced_and_nothing_else_is_touched",
            stale_socket_is_replaced_and_nothing_else_is_touched,
        ),
        Trial::test("nbd_listener::second_server_on_the_same_path_fails", second_server_on_the_same_path_fails),
        Trial::test(
            "nbd_listener::missing_socket_directory_is_made_and_bad_addresses_are_named",
            missing_socket_directory_is_made_and_bad_addresses_are_named,
        ),
        Trial::test("nbd_listener::a_killed_servers_addresses_are_taken_over_at_once", a_killed_servers_addresses_are_taken_over_at_once),
    ];
    libtest_mimic::run(&args, trials).exit()
}
