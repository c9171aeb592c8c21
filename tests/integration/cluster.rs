//! The daemon inside a guest-VM namespace against the rig's real
//! kube-apiserver: ready before the node has joined, picks credentials up
//! when they appear, reports a dead API server, and recovers.

use std::os::unix::net::UnixDatagram;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use hna_testkit::rig::{self, Rig, RigOptions};

use crate::BIN;
use crate::harness::tests;

tests! {
    ready_before_join_then_picks_up_credentials_when_they_appear: Root, Iproute2, ApiServer;
    rejected_credentials_are_reported_and_a_fixed_file_is_picked_up: Root, Iproute2, ApiServer;
    macvlan_condition_lands_on_the_agents_own_node_only: Root, Iproute2, ApiServer;
}

struct Daemon(Child);
impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// `status --output json` from the daemon on `socket`, if it answers.
pub(crate) fn status(socket: &Path) -> Option<serde_json::Value> {
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

/// Collects notify messages into `got` until one satisfies `want`; fails
/// naming `what` after `within`.
fn wait_notify(
    sock: &UnixDatagram,
    got: &mut Vec<String>,
    within: Duration,
    what: &str,
    want: impl Fn(&str) -> bool,
) {
    let deadline = Instant::now() + within;
    let mut buf = [0u8; 4096];
    while !got.iter().any(|m| want(m)) {
        let left = deadline.saturating_duration_since(Instant::now());
        assert!(
            !left.is_zero(),
            "no notify message {what} within {within:?}; got {got:?}"
        );
        sock.set_read_timeout(Some(left)).unwrap();
        if let Ok(n) = sock.recv(&mut buf) {
            got.extend(
                String::from_utf8_lossy(&buf[..n])
                    .lines()
                    .map(str::to_string),
            );
        }
    }
}

/// The daemon as the unit would run it, inside guest namespace 0 of `rig`,
/// with its files under `dir` (`dir/config.toml` must exist) and `args`
/// added to `run`.
fn start_agent(rig: &Rig, dir: &Path, node: &str, args: &[&std::ffi::OsStr]) -> Command {
    let mut cmd = rig.netns_cmd(rig.guest_ns(0), BIN);
    cmd.arg("run")
        .arg("--config")
        .arg(dir.join("config.toml"))
        .args(["--node-name", node, "--state-dir"])
        .arg(dir.join("state"))
        .arg("--socket")
        .arg(dir.join("agent.sock"))
        .args(args)
        .env("HNA_LOG_TARGET", "stderr")
        .stderr(Stdio::null());
    cmd
}

fn ready_before_join_then_picks_up_credentials_when_they_appear() {
    let mut rig = Rig::start(RigOptions {
        guests: 1,
        dhcp: false,
        apiserver: true,
        ..Default::default()
    })
    .unwrap();
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
        start_agent(&rig, &dir, &node, &[])
            .env("HNA_KUBECONFIG_SEARCH", &kubeconfig)
            .env("NOTIFY_SOCKET", &notify_path)
            .spawn()
            .unwrap(),
    );

    // Local work is done and the daemon is ready before there is a cluster.
    let st = wait_cluster_state(&socket, "WaitingForCredentials", Duration::from_secs(10));
    assert_eq!(st["node_name"], node.as_str());
    let mut msgs = Vec::new();
    wait_notify(&notify, &mut msgs, Duration::from_secs(5), "READY=1", |m| {
        m == "READY=1"
    });
    wait_notify(
        &notify,
        &mut msgs,
        Duration::from_secs(5),
        "STATUS= waiting for kubeconfig",
        |m| m.starts_with("STATUS=") && m.contains("waiting for kubeconfig"),
    );

    // The node joins: the kubelet kubeconfig appears.
    let api = rig.apiserver().unwrap();
    std::fs::copy(api.node_kubeconfig(&node), &kubeconfig).unwrap();
    let st = wait_cluster_state(&socket, "Connected", Duration::from_secs(10));
    assert_eq!(st["cluster"]["server_version"], api.version());
    assert_eq!(st["cluster"]["kubeconfig"], kubeconfig.to_str().unwrap());
    wait_notify(
        &notify,
        &mut msgs,
        Duration::from_secs(5),
        "STATUS= cluster connected",
        |m| m.starts_with("STATUS=") && m.contains("cluster connected"),
    );

    // The API server dies: reported, the daemon stays up.
    rig.apiserver_mut().unwrap().stop();
    let st = wait_cluster_state(&socket, "Unreachable", Duration::from_secs(20));
    assert!(
        st["summary"].as_str().unwrap().contains("unreachable"),
        "{st}"
    );
}

fn rejected_credentials_are_reported_and_a_fixed_file_is_picked_up() {
    let rig = Rig::start(RigOptions {
        guests: 1,
        dhcp: false,
        apiserver: true,
        ..Default::default()
    })
    .unwrap();
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
        start_agent(
            &rig,
            &dir,
            &node,
            &[
                "--credentials-retry".as_ref(),
                "1s".as_ref(),
                "--kubeconfig".as_ref(),
                kubeconfig.as_os_str(),
            ],
        )
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
    // The operator (or the kubelet) rewrites the file in place with good
    // credentials, and its modification time ends up where it was (as a
    // rewrite within the same second leaves it): only the content tells
    // the daemon that it changed. It connects.
    let mtime = std::fs::metadata(&kubeconfig).unwrap().modified().unwrap();
    std::fs::write(&kubeconfig, good).unwrap();
    std::fs::File::options()
        .write(true)
        .open(&kubeconfig)
        .unwrap()
        .set_times(std::fs::FileTimes::new().set_modified(mtime))
        .unwrap();
    assert_eq!(
        std::fs::metadata(&kubeconfig).unwrap().modified().unwrap(),
        mtime
    );
    wait_cluster_state(&socket, "Connected", Duration::from_secs(10));
}

/// Creates the Node object the way a kubelet registers itself.
fn register_node(api: &rig::ApiServer, name: &str) {
    let kubeconfig = api.admin_kubeconfig().to_path_buf();
    let name = name.to_string();
    rig::apiserver::on_runtime(|| async move {
        use k8s_openapi::api::core::v1::Node;
        let client = rig::kube_client(&kubeconfig).await.unwrap();
        let nodes: kube::Api<Node> = kube::Api::all(client);
        let node: Node = serde_json::from_value(serde_json::json!({
            "apiVersion": "v1", "kind": "Node", "metadata": {"name": name}
        }))
        .unwrap();
        nodes
            .create(&kube::api::PostParams::default(), &node)
            .await
            .unwrap();
    });
}

fn node_condition(api: &rig::ApiServer, node: &str, type_: &str) -> Option<serde_json::Value> {
    let kubeconfig = api.admin_kubeconfig().to_path_buf();
    let (node, type_) = (node.to_string(), type_.to_string());
    rig::apiserver::on_runtime(|| async move {
        use k8s_openapi::api::core::v1::Node;
        let client = rig::kube_client(&kubeconfig).await.unwrap();
        let n = kube::Api::<Node>::all(client).get(&node).await.unwrap();
        let v = serde_json::to_value(n).unwrap();
        v["status"]["conditions"]
            .as_array()
            .and_then(|cs| cs.iter().find(|c| c["type"] == type_.as_str()).cloned())
    })
}

fn macvlan_condition_lands_on_the_agents_own_node_only() {
    let rig = Rig::start(RigOptions {
        guests: 2,
        dhcp: false,
        apiserver: true,
        ..Default::default()
    })
    .unwrap();
    let api = rig.apiserver().unwrap();
    let (me, other) = (rig.node_name(0).to_string(), rig.node_name(1).to_string());
    // What the machine says the condition must be, learnt before the daemon
    // starts (it runs as root, so it loads a module that is on disk).
    let expected_macvlan = crate::facts::expected_macvlan(rig.guest_ns(1));
    register_node(api, &other);
    let dir = rig.dir().join("agent");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("config.toml"), "").unwrap();
    let socket = dir.join("agent.sock");
    let _daemon = Daemon(
        start_agent(
            &rig,
            &dir,
            &me,
            &[
                "--credentials-retry".as_ref(),
                "1s".as_ref(),
                "--kubeconfig".as_ref(),
                api.node_kubeconfig(&me).as_os_str(),
            ],
        )
        .spawn()
        .unwrap(),
    );
    // Before the kubelet registers the Node, the agent waits and says so.
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let st = status(&socket);
        if st
            .as_ref()
            .is_some_and(|s| s["node_conditions"]["state"] == "NodeNotRegistered")
        {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "never reported NodeNotRegistered: {st:?}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    register_node(api, &me);
    let deadline = Instant::now() + Duration::from_secs(15);
    let cond = loop {
        if let Some(c) = node_condition(api, &me, "MacvlanReady") {
            break c;
        }
        assert!(
            Instant::now() < deadline,
            "MacvlanReady never appeared on Node {me}"
        );
        std::thread::sleep(Duration::from_millis(200));
    };
    let (status, reasons) = expected_macvlan;
    assert_eq!(cond["status"], status, "{cond}");
    assert!(
        reasons.contains(&cond["reason"].as_str().unwrap_or_default()),
        "MacvlanReady reason {} is not one of {reasons:?}: {cond}",
        cond["reason"]
    );
    assert!(cond["lastHeartbeatTime"].is_string() && cond["lastTransitionTime"].is_string());
    // Only the agent's own Node was written.
    assert!(node_condition(api, &other, "MacvlanReady").is_none());
    // The guest-agent condition travels in the same patch.
    let ga = node_condition(api, &me, "GuestAgentReady").expect("GuestAgentReady on the Node");
    match crate::facts::expected_guest_agent() {
        Some((status, reason)) => {
            assert_eq!(
                (ga["status"].as_str(), ga["reason"].as_str()),
                (Some(status), Some(reason)),
                "{ga}"
            );
        }
        // A machine with the guest agent's port: only consistency can be
        // checked.
        None => assert_eq!(ga["status"] == "True", ga["reason"] == "Ready", "{ga}"),
    }

    // The credentials it uses cannot write another node's status.
    let kubeconfig = api.node_kubeconfig(&me).to_path_buf();
    let denied = rig::apiserver::on_runtime(|| async move {
        use k8s_openapi::api::core::v1::Node;
        let client = rig::kube_client(&kubeconfig).await.unwrap();
        let patch = serde_json::json!({"status": {"conditions": [{"type": "MacvlanReady", "status": "True"}]}});
        kube::Api::<Node>::all(client)
            .patch_status(
                &other,
                &kube::api::PatchParams::default(),
                &kube::api::Patch::Strategic(patch),
            )
            .await
    });
    match denied {
        Err(kube::Error::Api(s)) => assert_eq!(s.code, 403, "{s:?}"),
        other => panic!("node credentials patched another Node: {other:?}"),
    }
}
