//! The daemon binary as systemd and an operator see it: exit codes,
//! `check --output json`, the notify protocol and `status`. These need no
//! root and no rig.

use std::os::unix::net::UnixDatagram;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const BIN: &str = env!("CARGO_BIN_EXE_harvester-node-agent");

/// A hermetic command: no host config file, no host kubeconfigs.
fn agent(dir: &Path) -> Command {
    let mut cmd = Command::new(BIN);
    cmd.env_clear()
        .env("PATH", std::env::var_os("PATH").unwrap_or_default())
        .env("HNA_CONFIG", dir.join("absent-default.toml"))
        .env("HNA_KUBECONFIG_SEARCH", "")
        .env("HNA_LOG_TARGET", "stderr");
    // The daemon and `check` probe macvlan on the uplink; as root they
    // would do it on this machine's own interface. Without CAP_NET_ADMIN
    // they cannot change the host's network (the probe fails with EPERM).
    // SAFETY: prctl is async-signal-safe; nothing else runs before exec.
    unsafe {
        std::os::unix::process::CommandExt::pre_exec(&mut cmd, || {
            const CAP_NET_ADMIN: libc::c_ulong = 12;
            if libc::prctl(libc::PR_CAPBSET_DROP, CAP_NET_ADMIN, 0, 0, 0) != 0
                && libc::geteuid() == 0
            {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    cmd
}

/// `HNA_CONFIG` names a file explicitly, which must exist; tests that want
/// "no file" write an empty one.
fn empty_config(dir: &Path) -> PathBuf {
    let p = dir.join("absent-default.toml");
    std::fs::write(&p, "").unwrap();
    p
}

struct Daemon(Child);
impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn sigterm(child: &Child) {
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(child.id() as i32),
        nix::sys::signal::Signal::SIGTERM,
    )
    .unwrap();
}

fn wait_exit(child: &mut Child, within: Duration) -> std::process::ExitStatus {
    let deadline = Instant::now() + within;
    loop {
        if let Some(st) = child.try_wait().unwrap() {
            return st;
        }
        assert!(
            Instant::now() < deadline,
            "daemon did not exit within {within:?}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn invalid_config_exits_78_names_the_key_and_touches_nothing() {
    let tmp = tempfile::tempdir().unwrap();
    let state = tmp.path().join("state");
    let sock = tmp.path().join("run/agent.sock");
    for (text, key) in [
        ("colour = \"blue\"\n", "colour"),
        ("state_dir = 42\n", "state_dir"),
        ("credentials_retry = \"often\"\n", "credentials_retry"),
    ] {
        let file = tmp.path().join("bad.toml");
        std::fs::write(&file, text).unwrap();
        let out = agent(tmp.path())
            .args(["run", "--config"])
            .arg(&file)
            .arg("--state-dir")
            .arg(&state)
            .arg("--socket")
            .arg(&sock)
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(78), "{text}: {stderr}");
        assert!(stderr.contains(&format!("`{key}`")), "{stderr}");
        assert!(stderr.contains(file.to_str().unwrap()), "{stderr}");
        assert!(!state.exists(), "state dir created despite bad config");
        assert!(!sock.parent().unwrap().exists(), "socket dir created");
    }
    // A bad value from the environment is refused the same way.
    empty_config(tmp.path());
    let out = agent(tmp.path())
        .args(["run", "--state-dir"])
        .arg(&state)
        .env("HNA_LOG_TARGET", "syslog")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(78));
    assert!(String::from_utf8_lossy(&out.stderr).contains("HNA_LOG_TARGET"));
    assert!(!state.exists());
    // A named config file that does not exist is an error too.
    let out = agent(tmp.path())
        .args(["run", "--config", "/nonexistent/hna.toml"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(78));
}

#[test]
fn check_json_has_every_field_and_exit_code_follows_failures() {
    let tmp = tempfile::tempdir().unwrap();
    empty_config(tmp.path());
    let out = agent(tmp.path())
        .args(["check", "--output", "json", "--state-dir"])
        .arg(tmp.path().join("state"))
        .output()
        .unwrap();
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("valid JSON");
    let checks = v["checks"].as_array().expect("checks array");
    // Exit code 1 exactly when a check fails (on a container without
    // qemu-guest-agent, that one does).
    let any_fail = checks.iter().any(|c| c["status"] == "fail");
    assert_eq!(out.status.code(), Some(i32::from(any_fail)), "{v}");
    let names: Vec<&str> = checks.iter().map(|c| c["name"].as_str().unwrap()).collect();
    assert!(
        names.contains(&"config") && names.contains(&"kubeconfig") && names.contains(&"state-dir")
    );
    for c in checks {
        for field in ["name", "status", "reason", "message", "remediation"] {
            assert!(c[field].is_string(), "{field} in {c}");
        }
        assert!(["ok", "warn", "fail"].contains(&c["status"].as_str().unwrap()));
    }
    let kc = checks.iter().find(|c| c["name"] == "kubeconfig").unwrap();
    assert_eq!(kc["status"], "warn");
    assert_eq!(kc["reason"], "NotFound");
    // check is read-only.
    assert!(!tmp.path().join("state").exists());

    // A configured kubeconfig that is missing, and a file in the way of the
    // state dir, are failures: exit 1.
    std::fs::write(tmp.path().join("file"), "x").unwrap();
    let out = agent(tmp.path())
        .args([
            "check",
            "--output",
            "json",
            "--kubeconfig",
            "/nonexistent/kc",
            "--state-dir",
        ])
        .arg(tmp.path().join("file/state"))
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let reasons: Vec<&str> = v["checks"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|c| c["status"] == "fail")
        .map(|c| c["reason"].as_str().unwrap())
        .collect();
    assert!(
        reasons.starts_with(&["ConfiguredFileMissing", "NotADirectory"]),
        "{reasons:?}"
    );

    // A subset runs only the named checks; an unknown name is a usage error.
    let out = agent(tmp.path())
        .args([
            "check",
            "config",
            "state-dir",
            "--output",
            "json",
            "--state-dir",
        ])
        .arg(tmp.path().join("state"))
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(0));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let names: Vec<&str> = v["checks"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["name"].as_str().unwrap())
        .collect();
    assert_eq!(names, vec!["config", "state-dir"]);
    let out = agent(tmp.path())
        .args(["check", "macvlna"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("no check named `macvlna`"));

    // A broken config file is reported as a failed check, not a crash.
    let bad = tmp.path().join("bad.toml");
    std::fs::write(&bad, "nope = 1\n").unwrap();
    let out = agent(tmp.path())
        .args(["check", "--output", "json", "--config"])
        .arg(&bad)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["checks"][0]["reason"], "Invalid");
}

/// Collects notify messages until `pred` holds or `within` passes.
fn recv_until(
    sock: &UnixDatagram,
    got: &mut Vec<(Instant, String)>,
    within: Duration,
    pred: impl Fn(&[(Instant, String)]) -> bool,
) {
    let deadline = Instant::now() + within;
    let mut buf = [0u8; 4096];
    while !pred(got) {
        let left = deadline.saturating_duration_since(Instant::now());
        assert!(!left.is_zero(), "timed out; messages so far: {got:?}");
        sock.set_read_timeout(Some(left)).unwrap();
        if let Ok(n) = sock.recv(&mut buf) {
            let text = String::from_utf8_lossy(&buf[..n]).to_string();
            for line in text.lines() {
                got.push((Instant::now(), line.to_string()));
            }
        }
    }
}

#[test]
fn notify_protocol_ready_status_watchdog_stopping() {
    let tmp = tempfile::tempdir().unwrap();
    empty_config(tmp.path());
    let notify_path = tmp.path().join("notify.sock");
    let notify = UnixDatagram::bind(&notify_path).unwrap();
    let sock = tmp.path().join("agent.sock");
    let mut child = Daemon(
        agent(tmp.path())
            .args(["run", "--state-dir"])
            .arg(tmp.path().join("state"))
            .arg("--socket")
            .arg(&sock)
            .env("NOTIFY_SOCKET", &notify_path)
            // WatchdogSec=400ms: pings expected every 200 ms.
            .env("WATCHDOG_USEC", "400000")
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    let mut got = Vec::new();
    recv_until(&notify, &mut got, Duration::from_secs(10), |g| {
        g.iter().filter(|(_, m)| m == "WATCHDOG=1").count() >= 6
    });
    let pos = |what: &str| got.iter().position(|(_, m)| m.starts_with(what));
    let ready = pos("READY=1").expect("READY=1 sent");
    let status = pos("STATUS=").expect("STATUS= sent");
    let first_ping = pos("WATCHDOG=1").unwrap();
    assert!(ready < status && status < first_ping, "order: {got:?}");
    assert!(got[status].1.contains("waiting for kubeconfig"), "{got:?}");
    // READY only after the control socket answers requests.
    assert!(sock.exists());
    let pings: Vec<Instant> = got
        .iter()
        .filter(|(_, m)| m == "WATCHDOG=1")
        .map(|(t, _)| *t)
        .collect();
    let gaps: Vec<Duration> = pings.windows(2).map(|w| w[1] - w[0]).collect();
    let mean = gaps.iter().sum::<Duration>() / gaps.len() as u32;
    assert!(
        mean >= Duration::from_millis(120) && mean <= Duration::from_millis(300),
        "watchdog cadence {mean:?} is not half of WatchdogSec=400ms; gaps {gaps:?}"
    );

    sigterm(&child.0);
    recv_until(&notify, &mut got, Duration::from_secs(5), |g| {
        g.iter().any(|(_, m)| m == "STOPPING=1")
    });
    let st = wait_exit(&mut child.0, Duration::from_secs(10));
    assert!(st.success(), "{st:?}");
    assert!(!sock.exists(), "control socket left behind");
}

#[test]
fn status_answers_from_a_running_daemon_and_fails_clearly_without_one() {
    let tmp = tempfile::tempdir().unwrap();
    empty_config(tmp.path());
    let sock = tmp.path().join("agent.sock");

    let out = agent(tmp.path())
        .args(["status", "--socket"])
        .arg(&sock)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("no daemon answers"), "{stderr}");
    assert!(stderr.contains(sock.to_str().unwrap()), "{stderr}");

    let mut child = Daemon(
        agent(tmp.path())
            .args(["run", "--node-name", "guest-7", "--state-dir"])
            .arg(tmp.path().join("state"))
            .arg("--socket")
            .arg(&sock)
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    let deadline = Instant::now() + Duration::from_secs(10);
    let out = loop {
        let out = agent(tmp.path())
            .args(["status", "--output", "json", "--socket"])
            .arg(&sock)
            .output()
            .unwrap();
        if out.status.success() || Instant::now() > deadline {
            break out;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    assert!(out.status.success(), "{out:?}");
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["node_name"], "guest-7");
    assert_eq!(v["pid"], child.0.id());
    assert_eq!(v["cluster"]["state"], "WaitingForCredentials");
    assert_eq!(v["state_dir"]["ok"], true);
    assert!(v["macvlan"]["reason"].is_string(), "{v}");
    assert_eq!(v["node_conditions"]["state"], "NotConnected");
    assert_eq!(v["dhcp"]["leases"], serde_json::json!([]), "{v}");
    assert_eq!(
        v["dhcp"]["metrics_url"],
        serde_json::Value::Null,
        "off by default"
    );

    let human = agent(tmp.path())
        .args(["status", "--socket"])
        .arg(&sock)
        .output()
        .unwrap();
    let human = String::from_utf8_lossy(&human.stdout);
    assert!(human.contains("on node guest-7"), "{human}");
    assert!(human.contains("dhcp:      0 lease(s)"), "{human}");

    // A second daemon on the same socket refuses to steal it.
    let second = agent(tmp.path())
        .args(["run", "--state-dir"])
        .arg(tmp.path().join("state"))
        .arg("--socket")
        .arg(&sock)
        .output()
        .unwrap();
    assert_eq!(second.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&second.stderr).contains("already answering"));

    sigterm(&child.0);
    assert!(wait_exit(&mut child.0, Duration::from_secs(10)).success());
}

#[test]
fn restart_after_a_crash_reuses_the_stale_socket() {
    let tmp = tempfile::tempdir().unwrap();
    empty_config(tmp.path());
    let sock = tmp.path().join("agent.sock");
    let start = || {
        Daemon(
            agent(tmp.path())
                .args(["run", "--state-dir"])
                .arg(tmp.path().join("state"))
                .arg("--socket")
                .arg(&sock)
                .stderr(Stdio::null())
                .spawn()
                .unwrap(),
        )
    };
    let wait_sock = || {
        let deadline = Instant::now() + Duration::from_secs(10);
        while std::os::unix::net::UnixStream::connect(&sock).is_err() {
            assert!(Instant::now() < deadline, "socket never answered");
            std::thread::sleep(Duration::from_millis(20));
        }
    };
    let mut first = start();
    wait_sock();
    first.0.kill().unwrap(); // SIGKILL: the socket file stays behind
    first.0.wait().unwrap();
    assert!(sock.exists());
    let mut second = start();
    wait_sock();
    sigterm(&second.0);
    assert!(wait_exit(&mut second.0, Duration::from_secs(10)).success());
}

/// One HTTP/1.1 GET; the whole response.
fn http_get(addr: std::net::SocketAddr, path: &str) -> String {
    use std::io::{Read, Write};
    let mut c = std::net::TcpStream::connect(addr).unwrap();
    write!(c, "GET {path} HTTP/1.1\r\nHost: x\r\n\r\n").unwrap();
    let mut out = String::new();
    c.read_to_string(&mut out).unwrap();
    out
}

fn free_port() -> std::net::SocketAddr {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
}

#[test]
fn metrics_endpoint_serves_health_and_gauges_and_refuses_bad_addresses() {
    let tmp = tempfile::tempdir().unwrap();
    empty_config(tmp.path());
    let sock = tmp.path().join("agent.sock");
    let addr = free_port();
    let mut child = Daemon(
        agent(tmp.path())
            .args(["run", "--node-name", "guest-9", "--state-dir"])
            .arg(tmp.path().join("state"))
            .arg("--socket")
            .arg(&sock)
            .arg("--metrics-listen")
            .arg(addr.to_string())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    let deadline = Instant::now() + Duration::from_secs(10);
    while std::net::TcpStream::connect(addr).is_err() {
        assert!(Instant::now() < deadline, "metrics endpoint never listened");
        std::thread::sleep(Duration::from_millis(20));
    }
    let health = http_get(addr, "/healthz");
    assert!(
        health.starts_with("HTTP/1.1 200 OK") && health.ends_with("\r\n\r\nok\n"),
        "{health}"
    );
    let metrics = http_get(addr, "/metrics");
    assert!(metrics.starts_with("HTTP/1.1 200 OK"), "{metrics}");
    for line in [
        "hna_build_info{version=\"",
        "node=\"guest-9\"} 1\n",
        "# TYPE hna_macvlan_ready gauge\nhna_macvlan_ready{reason=\"",
        "hna_guest_agent_ready{reason=\"",
        "hna_cluster_connected 0\n",
        "hna_dhcp_leases 0\n",
        "# TYPE hna_dhcp_packets_sent_total counter\n",
    ] {
        assert!(metrics.contains(line), "{line} missing in\n{metrics}");
    }
    let out = agent(tmp.path())
        .args(["status", "--output", "json", "--socket"])
        .arg(&sock)
        .output()
        .unwrap();
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["dhcp"]["metrics_url"], format!("http://{addr}/metrics"));

    // The port is taken now: a second daemon stops before touching its
    // state directory, naming the key.
    let state2 = tmp.path().join("state2");
    let out = agent(tmp.path())
        .args(["run", "--state-dir"])
        .arg(&state2)
        .arg("--socket")
        .arg(tmp.path().join("agent2.sock"))
        .arg("--metrics-listen")
        .arg(addr.to_string())
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains(&format!("metrics_listen {addr}")),
        "{stderr}"
    );
    assert!(!state2.exists());

    // An address that is not one is a configuration error (exit 78).
    let out = agent(tmp.path())
        .args(["run", "--state-dir"])
        .arg(&state2)
        .env("HNA_METRICS_LISTEN", "localhost:9477")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(78));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("HNA_METRICS_LISTEN") && stderr.contains("`metrics_listen`"),
        "{stderr}"
    );

    sigterm(&child.0);
    assert!(wait_exit(&mut child.0, Duration::from_secs(10)).success());
}
