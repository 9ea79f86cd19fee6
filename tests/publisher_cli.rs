//! The publisher through the binary: `volring get` and `volring node`
//! pointed at the API stand-in (tests/kube_support) by a kubeconfig.

mod kube_support;
mod publisher_support;

use std::sync::Arc;
use std::time::Duration;

use axum::http::Method;
use kube_support::{Fault, Server};
use publisher_support::*;
use volring_kube::embedded_sink::EmbeddedSink;
use volring_kube::Updater;

/// A kubeconfig that points at the stand-in.
fn kubeconfig_for(server: &Server, dir: &std::path::Path) -> std::path::PathBuf {
    let path = dir.join("kubeconfig");
    let text = format!(
        "apiVersion: v1\nkind: Config\nclusters:\n- name: stand-in\n  cluster:\n    server: http://{}\nusers:\n- name: tester\n  user:\n    token: not-checked\ncontexts:\n- name: stand-in\n  context:\n    cluster: stand-in\n    user: tester\ncurrent-context: stand-in\n",
        server.addr
    );
    std::fs::write(&path, text).unwrap();
    path
}

/// Runs `volring` with `args` and a clean environment (`env` added);
/// returns (status, stdout, stderr).
async fn volring(args: &[&str], env: &[(&str, &std::ffi::OsStr)]) -> (std::process::ExitStatus, String, String) {
    let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_volring"));
    cmd.args(args).env_clear().env("PATH", "/usr/bin:/bin");
    for (k, v) in env {
        cmd.env(k, v);
    }
    let out = tokio::task::spawn_blocking(move || cmd.output().unwrap()).await.unwrap();
    (out.status, String::from_utf8(out.stdout).unwrap(), String::from_utf8(out.stderr).unwrap())
}

/// H2: `volring get` reads the cluster a kubeconfig names (and says so),
/// reads the node's store when there is none or `--local-store` asks.
#[tokio::test]
async fn volring_get_reads_the_cluster_a_kubeconfig_names() {
    let server = Server::start().await;
    for i in 0..3 {
        server.api.seed("blockdevices", kube_support::api_form(&bd("n1", i, 0)));
    }
    let dir = tempfile::tempdir().unwrap();
    let home = dir.path().join("home");
    std::fs::create_dir(&home).unwrap();
    let cfg = kubeconfig_for(&server, dir.path());
    let state = dir.path().join("state");
    std::fs::create_dir(&state).unwrap();
    let state_arg = format!("--state-dir={}", state.display());

    let (st, out, err) =
        volring(&["get", "bd", "-o", "json", &state_arg], &[("HOME", home.as_os_str()), ("KUBECONFIG", cfg.as_os_str())]).await;
    assert!(st.success(), "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    let mut names: Vec<&str> = v["items"].as_array().unwrap().iter().map(|i| i["metadata"]["name"].as_str().unwrap()).collect();
    names.sort();
    let mut want: Vec<String> = (0..3).map(|i| bd("n1", i, 0).key.name).collect();
    want.sort();
    assert_eq!(names, want);
    assert!(err.contains("from the cluster") && err.contains(&cfg.display().to_string()), "{err}");
    assert!(server.api.log().iter().any(|l| l.path.ends_with("/blockdevices")));
    assert!(
        server.api.log().iter().all(|l| l.user_agent.as_deref().is_some_and(|u| u.starts_with("volring/"))),
        "volring get names itself"
    );

    // ~/.kube/config counts too.
    std::fs::create_dir(home.join(".kube")).unwrap();
    std::fs::copy(&cfg, home.join(".kube/config")).unwrap();
    let (st, out, err) = volring(&["get", "bd", &state_arg], &[("HOME", home.as_os_str())]).await;
    assert!(st.success() && out.lines().count() == 4 && err.contains("from the cluster"), "{out}{err}");

    // --local-store: the node's store, even with a kubeconfig.
    server.api.clear_log();
    let store = Arc::new(volring_volumes::store::Store::open(&state.join(volring_volumes::store::FILE)).unwrap());
    Updater::start(Arc::new(EmbeddedSink::new(store.clone())), config("n9"), vec![bd("n9", 0, 0)]).shutdown(Duration::from_secs(10)).await;
    drop(store);
    let (st, out, err) = volring(&["get", "bd", "--local-store", "-o", "json", &state_arg], &[("HOME", home.as_os_str())]).await;
    assert!(st.success(), "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["items"].as_array().unwrap().len(), 1, "{out}");
    assert_eq!(v["items"][0]["spec"]["nodeName"], "n9");
    assert!(err.contains("from the node's store"), "{err}");
    assert!(server.api.log().is_empty(), "the cluster was not asked");

    // No kubeconfig, no service account: the store, as before.
    let empty = dir.path().join("empty-home");
    std::fs::create_dir(&empty).unwrap();
    let (st, out, err) = volring(&["get", "bd", &state_arg], &[("HOME", empty.as_os_str())]).await;
    assert!(st.success() && out.lines().count() == 2 && err.contains("from the node's store"), "{out}{err}");
    assert!(server.api.log().is_empty());
}

/// A child process killed (and reaped) when the test ends, passed or not.
struct Reaped(std::process::Child);

impl Drop for Reaped {
    fn drop(&mut self) {
        if self.0.try_wait().ok().flatten().is_none() {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
}

/// GET `path` from 127.0.0.1:`port`; the body when the answer is 200.
async fn http_get(port: u16, path: &str) -> Option<String> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut c = tokio::net::TcpStream::connect(("127.0.0.1", port)).await.ok()?;
    c.write_all(format!("GET {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n").as_bytes()).await.ok()?;
    let mut reply = String::new();
    tokio::time::timeout(Duration::from_secs(30), c.read_to_string(&mut reply)).await.ok()?.ok()?;
    let (head, body) = reply.split_once("\r\n\r\n")?;
    head.starts_with("HTTP/1.1 200").then(|| body.to_string())
}

/// The value of the sample `series` (name and labels as printed).
fn sample(scrape: &str, series: &str) -> Option<f64> {
    scrape.lines().find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.trim().parse().ok())
}

/// M7: the agent itself, pointed at the stand-in by nothing but a
/// kubeconfig (no --kube: a configured cluster is found): this machine's
/// devices become BlockDevices labelled with the node its `--node-id`
/// names (no NODE_NAME in its environment: the CSI node id and the
/// published node name are one name), its StorageNode
/// (refused once here, with a 422) shows as refused on /metrics, `volring
/// get -o json` reads them back from the cluster, and SIGTERM stops it
/// cleanly.
#[tokio::test]
async fn the_agent_publishes_to_the_cluster_its_kubeconfig_names() {
    let server = Server::start().await;
    server.api.inject(Fault {
        status: 422,
        retry_after: None,
        method: Some(Method::PATCH),
        path_contains: "storagenodes".into(),
        times: 1,
    });
    let dir = tempfile::tempdir().unwrap();
    let cfg = kubeconfig_for(&server, dir.path());
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let kubelet = dir.path().join("kubelet");
    std::fs::create_dir(&kubelet).unwrap();
    let mut agent = Reaped(
        std::process::Command::new(env!("CARGO_BIN_EXE_volring"))
            .args(["node", "--node-id", "e2e-node", "--publish-window", "0.2", "--metrics-addr", &format!("127.0.0.1:{port}")])
            .arg("--state-dir")
            .arg(dir.path().join("state"))
            .arg("--kubelet-root")
            .arg(&kubelet)
            .arg("--csi-endpoint")
            .arg(format!("unix://{}", dir.path().join("csi.sock").display()))
            .env_clear()
            .env("PATH", "/usr/bin:/bin")
            .env("HOME", dir.path())
            .env("KUBECONFIG", &cfg)
            .env("RUST_LOG", "volring=info")
            .stdout(std::process::Stdio::null())
            .stderr(std::fs::File::create(dir.path().join("agent.log")).unwrap())
            .spawn()
            .unwrap(),
    );
    let log = || std::fs::read_to_string(dir.path().join("agent.log")).unwrap_or_default();
    let mut scrape = String::new();
    for _ in 0..600 {
        assert!(agent.0.try_wait().unwrap().is_none(), "the agent exited:\n{}", log());
        if let Some(s) = http_get(port, "/metrics").await {
            // Each BlockDevice's main part and status are two writes: both
            // are waited for, else the status check below races the second.
            let names = bd_names_of(&server, "e2e-node");
            let active = names.iter().all(|n| server.api.object("blockdevices", n).is_some_and(|o| o["status"]["state"] == "Active"));
            if sample(&s, "volring_publish_refused_total") == Some(1.0) && !names.is_empty() && active {
                scrape = s;
                break;
            }
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(!scrape.is_empty(), "no BlockDevice of e2e-node and a refusal on /metrics:\n{}", log());
    let mine = bd_names_of(&server, "e2e-node");
    assert!(sample(&scrape, "volring_publish_writes_total{part=\"main\"}").is_some_and(|n| n >= mine.len() as f64), "{scrape}");
    assert!(log().contains("publishing to the cluster") && log().contains(&cfg.display().to_string()), "{}", log());
    // Every request names volring (issue 29).
    let unnamed: Vec<_> =
        server.api.log().into_iter().filter(|l| !l.user_agent.as_deref().is_some_and(|u| u.starts_with("volring/"))).collect();
    assert!(unnamed.is_empty(), "requests without volring's User-Agent: {unnamed:#?}");
    for name in &mine {
        let o = server.api.object("blockdevices", name).unwrap();
        assert_eq!(o["spec"]["nodeName"], "e2e-node");
        assert_eq!(o["status"]["state"], "Active");
    }

    // Deleted behind its back, a BlockDevice is written again (issue 29:
    // the agent watches its node's objects).
    let gone = mine[0].clone();
    let before = server.api.object("blockdevices", &gone).unwrap();
    server.api.delete("blockdevices", &gone);
    for _ in 0..600 {
        // Main part and status are two writes: both back.
        if server.api.object("blockdevices", &gone).is_some_and(|o| o["status"] == before["status"]) {
            break;
        }
        assert!(agent.0.try_wait().unwrap().is_none(), "the agent exited:\n{}", log());
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let back = server.api.object("blockdevices", &gone).unwrap_or_else(|| panic!("{gone} not written again:\n{}", log()));
    assert_eq!((&back["spec"], &back["status"]), (&before["spec"], &before["status"]));
    let (st, out, err) = volring(&["get", "bd", "-o", "json"], &[("HOME", dir.path().as_os_str()), ("KUBECONFIG", cfg.as_os_str())]).await;
    assert!(st.success(), "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    let mut listed: Vec<String> = v["items"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|i| i["spec"]["nodeName"] == "e2e-node")
        .map(|i| i["metadata"]["name"].as_str().unwrap().to_string())
        .collect();
    listed.sort();
    assert_eq!(listed, bd_names_of(&server, "e2e-node"));

    let pid = rustix::process::Pid::from_raw(agent.0.id() as i32).unwrap();
    rustix::process::kill_process(pid, rustix::process::Signal::TERM).unwrap();
    let mut status = None;
    for _ in 0..400 {
        status = agent.0.try_wait().unwrap();
        if status.is_some() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let Some(status) = status else {
        panic!("the agent did not stop within 20 s of SIGTERM:\n{}", log());
    };
    assert!(status.success(), "{status}:\n{}", log());
    assert!(log().contains("publisher stopped"), "{}", log());
}

/// Issue 28 item 7: with no cluster the node's own store is written at
/// once: `--publish-qps` paces an API server, and the store has none. At
/// 0.1 requests a second, 20 objects took more than three minutes to
/// appear; now they are all in the store, and `volring get` prints them,
/// well within the 60 s this waits.
#[tokio::test]
async fn the_nodes_store_is_written_without_the_api_pace() {
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("state");
    std::fs::create_dir(&state).unwrap();
    let store = Arc::new(volring_volumes::store::Store::open(&state.join(volring_volumes::store::FILE)).unwrap());
    let mut c = config("n1");
    (c.qps, c.burst) = (0.1, 1);
    let objs: Vec<_> = (0..20).map(|i| bd("n1", i, 0)).collect();
    let up = Updater::start(Arc::new(EmbeddedSink::new(store.clone())), c, objs);
    let mut stored = 0;
    for _ in 0..1200 {
        let query = volring_kube::show::Query { resource: "bd", output: Some("json"), kube: false, local_store: true, state_dir: &state };
        let listed: serde_json::Value = serde_json::from_str(&volring_kube::show::get(query, |_| {}).await.unwrap()).unwrap();
        stored = listed["items"].as_array().unwrap().len();
        if stored == 20 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(stored, 20, "objects in the node's store after 60 s at 0.1 qps");
    let state_arg = format!("--state-dir={}", state.display());
    let (st, out, err) = volring(&["get", "bd", "--local-store", "-o", "json", &state_arg], &[("HOME", dir.path().as_os_str())]).await;
    assert!(st.success(), "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["items"].as_array().unwrap().len(), 20, "{out}");
    up.shutdown(Duration::from_secs(10)).await;
}

/// Issue 28 item 7: while the agent still holds objects for the cluster
/// (here every write is answered 503, so they stay queued), `volring get`
/// says so beside what it prints; once the agent stops, it says nothing.
#[tokio::test]
async fn volring_get_says_when_the_agent_still_has_objects_queued() {
    let server = Server::start().await;
    server.api.inject(Fault {
        status: 503,
        retry_after: None,
        method: Some(Method::PATCH),
        path_contains: String::new(),
        times: 1_000_000,
    });
    let dir = tempfile::tempdir().unwrap();
    let cfg = kubeconfig_for(&server, dir.path());
    let kubelet = dir.path().join("kubelet");
    std::fs::create_dir(&kubelet).unwrap();
    let state = dir.path().join("state");
    let mut agent = Reaped(
        std::process::Command::new(env!("CARGO_BIN_EXE_volring"))
            .args(["node", "--node-id", "queued-node", "--publish-window", "0.2", "--metrics-addr", "127.0.0.1:0"])
            .arg("--state-dir")
            .arg(&state)
            .arg("--kubelet-root")
            .arg(&kubelet)
            .arg("--csi-endpoint")
            .arg(format!("unix://{}", dir.path().join("csi.sock").display()))
            .env_clear()
            .env("PATH", "/usr/bin:/bin")
            .env("HOME", dir.path())
            .env("KUBECONFIG", &cfg)
            .env("RUST_LOG", "volring=info")
            .stdout(std::process::Stdio::null())
            .stderr(std::fs::File::create(dir.path().join("agent.log")).unwrap())
            .spawn()
            .unwrap(),
    );
    let log = || std::fs::read_to_string(dir.path().join("agent.log")).unwrap_or_default();
    let state_arg = format!("--state-dir={}", state.display());
    let env = [("HOME", dir.path().as_os_str()), ("KUBECONFIG", cfg.as_os_str())];
    let mut said = String::new();
    for _ in 0..600 {
        assert!(agent.0.try_wait().unwrap().is_none(), "the agent exited:\n{}", log());
        if state.is_dir() {
            let (st, _, err) = volring(&["get", "bd", &state_arg], &env).await;
            assert!(st.success(), "{err}");
            if err.contains("queued") {
                said = err;
                break;
            }
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(said.contains("objects queued for the cluster: not shown yet"), "volring get said nothing of the queue:\n{said}\n{}", log());
    let pid = rustix::process::Pid::from_raw(agent.0.id() as i32).unwrap();
    rustix::process::kill_process(pid, rustix::process::Signal::TERM).unwrap();
    for _ in 0..600 {
        if agent.0.try_wait().unwrap().is_some() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(agent.0.try_wait().unwrap().is_some(), "the agent did not stop within 30 s of SIGTERM:\n{}", log());
    let (st, _, err) = volring(&["get", "bd", &state_arg], &env).await;
    assert!(st.success() && !err.contains("queued"), "{err}");
}
