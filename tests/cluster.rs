//! The daemon inside a guest-VM namespace against the rig's real
//! kube-apiserver: ready before the node has joined, picks credentials up
//! when they appear, reports a dead API server, and recovers.

#[allow(dead_code)]
mod rig;

use std::os::unix::net::UnixDatagram;
use std::path::Path;
use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

use rig::{Rig, RigOptions};

const BIN: &str = env!("CARGO_BIN_EXE_harvester-node-agent");

struct Daemon(Child);
impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn status(socket: &Path) -> Option<serde_json::Value> {
    let out = std::process::Command::new(BIN)
        .args(["status", "--output", "json", "--socket"])
        .arg(socket)
        .output()
        .ok()?;
    out.status
        .success()
        .then(|| serde_json::from_slice(&out.stdout).ok())
        .flatten()
}

fn wait_cluster_state(socket: &Path, want: &str, within: Duration) -> serde_json::Value {
    let deadline = Instant::now() + within;
    let mut last = None;
    while Instant::now() < deadline {
        if let Some(st) = status(socket) {
            if st["cluster"]["state"] == want {
                return st;
            }
            last = Some(st);
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    panic!("cluster state never became {want}; last status: {last:?}");
}

fn notify_messages(sock: &UnixDatagram) -> Vec<String> {
    let mut buf = [0u8; 4096];
    let mut out = Vec::new();
    sock.set_nonblocking(true).unwrap();
    while let Ok(n) = sock.recv(&mut buf) {
        out.extend(
            String::from_utf8_lossy(&buf[..n])
                .lines()
                .map(str::to_string),
        );
    }
    out
}

#[test]
fn ready_before_join_then_picks_up_credentials_when_they_appear() {
    let Some(mut rig) = Rig::start(RigOptions {
        guests: 1,
        dhcp: false,
        apiserver: true,
        ..Default::default()
    })
    .unwrap() else {
        return;
    };
    let node = rig.node_name(0).to_string();
    let dir = rig.dir().join("agent");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("config.toml"), "credentials_retry = \"1s\"\n").unwrap();
    let socket = dir.join("agent.sock");
    let notify_path = dir.join("notify");
    let notify = UnixDatagram::bind(&notify_path).unwrap();
    // Where the kubelet's kubeconfig will appear once the node joins.
    let kubeconfig = dir.join("kubelet.kubeconfig");

    let _daemon = Daemon(
        rig.netns_cmd(rig.guest_ns(0), BIN)
            .arg("run")
            .arg("--config")
            .arg(dir.join("config.toml"))
            .args(["--node-name", &node, "--state-dir"])
            .arg(dir.join("state"))
            .arg("--socket")
            .arg(&socket)
            .env("HNA_KUBECONFIG_SEARCH", &kubeconfig)
            .env("HNA_LOG_TARGET", "stderr")
            .env("NOTIFY_SOCKET", &notify_path)
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );

    // Local work is done and the daemon is ready before there is a cluster.
    let st = wait_cluster_state(&socket, "WaitingForCredentials", Duration::from_secs(10));
    assert_eq!(st["node_name"], node.as_str());
    let msgs = notify_messages(&notify);
    assert!(msgs.contains(&"READY=1".to_string()), "{msgs:?}");
    assert!(
        msgs.iter()
            .any(|m| m.starts_with("STATUS=") && m.contains("waiting for kubeconfig")),
        "{msgs:?}"
    );

    // The node joins: the kubelet kubeconfig appears.
    let api = rig.apiserver().unwrap();
    std::fs::copy(api.node_kubeconfig(&node), &kubeconfig).unwrap();
    let st = wait_cluster_state(&socket, "Connected", Duration::from_secs(10));
    assert_eq!(st["cluster"]["server_version"], api.version());
    assert_eq!(st["cluster"]["kubeconfig"], kubeconfig.to_str().unwrap());
    std::thread::sleep(Duration::from_millis(300));
    let msgs = notify_messages(&notify);
    assert!(
        msgs.iter()
            .any(|m| m.starts_with("STATUS=") && m.contains("cluster connected")),
        "{msgs:?}"
    );

    // The API server dies: reported, the daemon stays up.
    rig.apiserver_mut().unwrap().stop();
    let st = wait_cluster_state(&socket, "Unreachable", Duration::from_secs(20));
    assert!(
        st["summary"].as_str().unwrap().contains("unreachable"),
        "{st}"
    );
}

#[test]
fn rejected_credentials_are_reported_and_a_fixed_file_is_picked_up() {
    let Some(rig) = Rig::start(RigOptions {
        guests: 1,
        dhcp: false,
        apiserver: true,
        ..Default::default()
    })
    .unwrap() else {
        return;
    };
    let node = rig.node_name(0).to_string();
    let api = rig.apiserver().unwrap();
    let dir = rig.dir().join("agent");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("config.toml"), "").unwrap();
    let kubeconfig = dir.join("kubeconfig");
    // Start with credentials the server rejects.
    let good = std::fs::read_to_string(api.node_kubeconfig(&node)).unwrap();
    std::fs::write(
        &kubeconfig,
        good.replace(api.node_token(&node), "not-a-valid-token"),
    )
    .unwrap();
    let socket = dir.join("agent.sock");
    let _daemon = Daemon(
        rig.netns_cmd(rig.guest_ns(0), BIN)
            .arg("run")
            .arg("--config")
            .arg(dir.join("config.toml"))
            .args([
                "--node-name",
                &node,
                "--credentials-retry",
                "1s",
                "--state-dir",
            ])
            .arg(dir.join("state"))
            .arg("--socket")
            .arg(&socket)
            .arg("--kubeconfig")
            .arg(&kubeconfig)
            .env("HNA_LOG_TARGET", "stderr")
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    let st = wait_cluster_state(&socket, "Unreachable", Duration::from_secs(10));
    assert!(
        st["cluster"]["error"].as_str().unwrap().contains("401")
            || st["cluster"]["error"]
                .as_str()
                .unwrap()
                .contains("Unauthorized"),
        "{st}"
    );
    // The operator (or the kubelet) writes a good file: the daemon connects.
    std::thread::sleep(Duration::from_millis(20));
    let tmp = dir.join("kubeconfig.new");
    std::fs::write(&tmp, good).unwrap();
    std::fs::rename(&tmp, &kubeconfig).unwrap();
    wait_cluster_state(&socket, "Connected", Duration::from_secs(10));
}
