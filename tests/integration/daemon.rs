//! The daemon binary as systemd and an operator see it: exit codes,
//! `check --output json`, the notify protocol and `status`. These need no
//! root and no rig.

use std::os::unix::net::UnixDatagram;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::BIN;
use crate::harness::tests;

tests! {
    invalid_config_exits_78_names_the_key_and_touches_nothing;
    check_json_has_every_field_and_exit_code_follows_failures;
    notify_protocol_ready_status_watchdog_stopping;
    status_answers_from_a_running_daemon_and_fails_clearly_without_one;
    restart_after_a_crash_reuses_the_stale_socket;
    metrics_endpoint_serves_health_and_gauges_and_refuses_bad_addresses;
    check_api_server_is_a_check_of_its_own;
    status_finds_the_daemon_through_its_configuration_file;
    check_with_a_broken_file_on_a_mixed_case_hostname_still_checks: Root;
}

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

/// `status --output json ARGS` once it answers (a daemon just spawned
/// binds its socket within moments), within 10 s.
fn status_once_up(dir: &Path, args: &[&std::ffi::OsStr]) -> serde_json::Value {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let out = agent(dir)
            .args(["status", "--output", "json"])
            .args(args)
            .output()
            .unwrap();
        if out.status.success() {
            return serde_json::from_slice(&out.stdout).unwrap();
        }
        assert!(Instant::now() < deadline, "no answer within 10 s: {out:?}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// The names of a `check --output json` report's entries, in order.
fn check_names(report: &serde_json::Value) -> Vec<&str> {
    report["checks"]
        .as_array()
        .expect("checks array")
        .iter()
        .map(|c| c["name"].as_str().expect("name"))
        .collect()
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
    let names: Vec<&str> = checks.iter().map(|c| c["name"].as_str().unwrap()).collect();
    for name in [
        "config",
        "kubeconfig",
        "state-dir",
        "macvlan",
        "qemu-guest-agent",
    ] {
        assert!(names.contains(&name), "no {name} check in {names:?}");
    }
    for c in checks {
        for field in ["name", "status", "reason", "message", "remediation"] {
            assert!(c[field].is_string(), "{field} in {c}");
        }
        assert!(["ok", "warn", "fail"].contains(&c["status"].as_str().unwrap()));
    }
    // The qemu-guest-agent check cannot pass on a machine without the guest
    // agent's virtio port (every test machine but a Harvester VM): it fails,
    // so the exit code is 1.
    if !crate::facts::guest_agent_port_exists() {
        let ga = checks
            .iter()
            .find(|c| c["name"] == "qemu-guest-agent")
            .unwrap();
        assert_eq!(ga["status"], "fail", "{ga}");
        assert_eq!(out.status.code(), Some(1), "{v}");
    }
    let kc = checks.iter().find(|c| c["name"] == "kubeconfig").unwrap();
    assert_eq!(kc["status"], "warn");
    assert_eq!(kc["reason"], "NotFound");
    let sd = checks.iter().find(|c| c["name"] == "state-dir").unwrap();
    assert_eq!(sd["reason"], "WillBeCreated", "{sd}");
    // check is read-only.
    assert!(!tmp.path().join("state").exists());

    // The checks this test controls: an empty config, no kubeconfig (a
    // warning, not a failure) and a state dir that will be created. No
    // failure, so exit 0.
    let out = agent(tmp.path())
        .args([
            "check",
            "config",
            "kubeconfig",
            "state-dir",
            "--output",
            "json",
            "--state-dir",
        ])
        .arg(tmp.path().join("state"))
        .output()
        .unwrap();
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let statuses: Vec<(&str, &str)> = v["checks"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| (c["name"].as_str().unwrap(), c["status"].as_str().unwrap()))
        .collect();
    assert_eq!(
        statuses,
        [
            ("config", "ok"),
            ("kubeconfig", "warn"),
            ("state-dir", "ok")
        ],
        "{v}"
    );
    assert_eq!(out.status.code(), Some(0), "a warning failed the run: {v}");

    // A configured kubeconfig that is missing, and a file in the way of the
    // state dir: exactly these two fail, so exit 1.
    std::fs::write(tmp.path().join("file"), "x").unwrap();
    let out = agent(tmp.path())
        .args([
            "check",
            "config",
            "kubeconfig",
            "state-dir",
            "--output",
            "json",
            "--kubeconfig",
            "/nonexistent/kc",
            "--state-dir",
        ])
        .arg(tmp.path().join("file/state"))
        .output()
        .unwrap();
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(out.status.code(), Some(1), "{v}");
    let failed: Vec<(&str, &str)> = v["checks"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|c| c["status"] == "fail")
        .map(|c| (c["name"].as_str().unwrap(), c["reason"].as_str().unwrap()))
        .collect();
    assert_eq!(
        failed,
        [
            ("kubeconfig", "ConfiguredFileMissing"),
            ("state-dir", "NotADirectory")
        ],
        "{v}"
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
    let names = check_names(&v);
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
    assert_eq!(
        (
            v["checks"][0]["name"].as_str(),
            v["checks"][0]["status"].as_str()
        ),
        (Some("config"), Some("fail")),
        "{v}"
    );
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

/// Asks the control socket for the status once, with no retry: connects,
/// sends `status`, reads the JSON answer (5 s at most).
fn ask_status_once(sock: &Path) -> Result<serde_json::Value, String> {
    use std::io::{Read, Write};
    let mut c = std::os::unix::net::UnixStream::connect(sock)
        .map_err(|e| format!("connect {}: {e}", sock.display()))?;
    c.set_read_timeout(Some(Duration::from_secs(5)))
        .map_err(|e| e.to_string())?;
    c.write_all(b"status\n").map_err(|e| format!("send: {e}"))?;
    let mut answer = Vec::new();
    c.read_to_end(&mut answer)
        .map_err(|e| format!("read the answer: {e}"))?;
    serde_json::from_slice(&answer).map_err(|e| {
        format!(
            "not JSON ({e}): {:?}",
            String::from_utf8_lossy(&answer).into_owned()
        )
    })
}

/// The median of durations.
fn median(mut d: Vec<Duration>) -> Duration {
    d.sort();
    d[d.len() / 2]
}

fn notify_protocol_ready_status_watchdog_stopping() {
    let tmp = tempfile::tempdir().unwrap();
    empty_config(tmp.path());
    let notify_path = tmp.path().join("notify.sock");
    let notify = UnixDatagram::bind(&notify_path).unwrap();
    let sock = tmp.path().join("agent.sock");
    // WatchdogSec=1s: pings expected every 500 ms.
    let period = Duration::from_secs(1);
    let mut child = Daemon(
        agent(tmp.path())
            .args(["run", "--state-dir"])
            .arg(tmp.path().join("state"))
            .arg("--socket")
            .arg(&sock)
            .env("NOTIFY_SOCKET", &notify_path)
            .env("WATCHDOG_USEC", period.as_micros().to_string())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    let mut got = Vec::new();
    // READY=1 promises that the control socket answers: the moment it
    // arrives, ask once, without retrying.
    recv_until(&notify, &mut got, Duration::from_secs(10), |g| {
        g.iter().any(|(_, m)| m == "READY=1")
    });
    let answer = ask_status_once(&sock)
        .unwrap_or_else(|e| panic!("READY=1 sent but the control socket does not answer: {e}"));
    assert_eq!(answer["pid"], child.0.id(), "{answer}");

    let ready_at = got.iter().find(|(_, m)| m == "READY=1").unwrap().0;
    recv_until(&notify, &mut got, Duration::from_secs(15), |g| {
        g.iter().filter(|(_, m)| m == "WATCHDOG=1").count() >= 8
    });
    let pos = |what: &str| got.iter().position(|(_, m)| m.starts_with(what));
    let ready = pos("READY=1").expect("READY=1 sent");
    let status = pos("STATUS=").expect("STATUS= sent");
    let first_ping = pos("WATCHDOG=1").unwrap();
    assert!(ready < status && status < first_ping, "order: {got:?}");
    assert!(got[status].1.contains("waiting for kubeconfig"), "{got:?}");
    // The cadence is half of WatchdogSec. A loaded machine delays single
    // pings (and delivers some late ones in a bunch), so no single gap is
    // judged: the median gap must be within a quarter period of the half
    // period (a daemon pinging once per period, or with the period misread,
    // is far off), and load cannot make pings more frequent, so there are no
    // more than one per quarter period.
    let pings: Vec<Instant> = got
        .iter()
        .filter(|(_, m)| m == "WATCHDOG=1")
        .map(|(t, _)| *t)
        .collect();
    let gaps: Vec<Duration> = pings.windows(2).map(|w| w[1] - w[0]).collect();
    let typical = median(gaps.clone());
    assert!(
        typical >= period / 4 && typical <= period * 3 / 4,
        "watchdog cadence {typical:?} is not half of WatchdogSec={period:?}; gaps {gaps:?}"
    );
    let elapsed = *pings.last().unwrap() - ready_at;
    let at_most = (elapsed.as_secs_f64() / (period / 4).as_secs_f64()).floor() as usize + 1;
    assert!(
        pings.len() <= at_most,
        "{} pings in {elapsed:?}: more than one per {:?}; gaps {gaps:?}",
        pings.len(),
        period / 4
    );

    sigterm(&child.0);
    recv_until(&notify, &mut got, Duration::from_secs(5), |g| {
        g.iter().any(|(_, m)| m == "STOPPING=1")
    });
    let st = wait_exit(&mut child.0, Duration::from_secs(10));
    assert!(st.success(), "{st:?}");
    assert!(!sock.exists(), "control socket left behind");
}

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
    let v = status_once_up(tmp.path(), &["--socket".as_ref(), sock.as_os_str()]);
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
        "# TYPE hna_dhcp_packets_sent counter\n",
        "# TYPE hna_lb_takeover_guard_wait_seconds histogram\n",
        "\nprocess_resident_memory_bytes ",
        "\nprocess_open_fds ",
        "Content-Type: application/openmetrics-text; version=1.0.0; charset=utf-8\r\n",
    ] {
        assert!(metrics.contains(line), "{line} missing in\n{metrics}");
    }
    assert!(metrics.ends_with("# EOF\n"), "{metrics}");
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

/// `check api-server` was refused as an unknown check (exit 2) although the
/// README lists it. Named alone it runs with the kubeconfig check it needs;
/// with a configured kubeconfig that does not exist (this test made sure it
/// does not), both fail and the exit code is 1.
fn check_api_server_is_a_check_of_its_own() {
    let tmp = tempfile::tempdir().unwrap();
    empty_config(tmp.path());
    let missing = tmp.path().join("no-such.kubeconfig");
    let out = agent(tmp.path())
        .args(["check", "api-server", "--output", "json"])
        .env("HNA_KUBECONFIG", &missing)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let names = check_names(&v);
    assert_eq!(names, ["kubeconfig", "api-server"], "{v}");
    assert_eq!(v["checks"][0]["reason"], "ConfiguredFileMissing");
    assert_eq!(v["checks"][1]["reason"], "NoCredentials");
    assert_eq!(v["checks"][1]["status"], "fail");

    let out = agent(tmp.path())
        .args(["check", "api-servers"])
        .output()
        .unwrap();
    assert_eq!(
        out.status.code(),
        Some(2),
        "a misspelt name is still refused"
    );
    assert!(String::from_utf8_lossy(&out.stderr).contains("api-server"));
}

/// `status` ignored the configuration file's `socket`. A daemon started
/// with only `--config` listens where the file says; `status --config`
/// finds it there, and plain `status` (the default socket) does not.
fn status_finds_the_daemon_through_its_configuration_file() {
    let tmp = tempfile::tempdir().unwrap();
    empty_config(tmp.path());
    let sock = tmp.path().join("from-file.sock");
    let config = tmp.path().join("config.toml");
    std::fs::write(
        &config,
        format!(
            "socket = \"{}\"\nstate_dir = \"{}\"\nnode_name = \"guest-9\"\n",
            sock.display(),
            tmp.path().join("state").display()
        ),
    )
    .unwrap();
    let _daemon = Daemon(
        agent(tmp.path())
            .arg("run")
            .arg("--config")
            .arg(&config)
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    let v = status_once_up(tmp.path(), &["--config".as_ref(), config.as_os_str()]);
    assert_eq!(v["node_name"], "guest-9");

    // The same through HNA_CONFIG, as `run` reads it.
    let out = agent(tmp.path())
        .args(["status", "--output", "json"])
        .env("HNA_CONFIG", &config)
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");

    // Without the file, `status` asks the default socket, where no daemon
    // of this test listens.
    let out = agent(tmp.path()).arg("status").output().unwrap();
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("/run/harvester-node-agent/agent.sock"),
        "{out:?}"
    );
}

/// With a broken configuration file, `check` still checks what the flags
/// and defaults describe. It used to take the node name from the raw
/// hostname, so on a host named `Guest-One` (an invalid Node name) those
/// checks silently disappeared. The hostname is set in a private UTS
/// namespace (root only).
fn check_with_a_broken_file_on_a_mixed_case_hostname_still_checks() {
    let tmp = tempfile::tempdir().unwrap();
    empty_config(tmp.path());
    let broken = tmp.path().join("broken.toml");
    std::fs::write(&broken, "this is = not toml [").unwrap();
    let mut cmd = agent(tmp.path());
    cmd.args([
        "check",
        "config",
        "state-dir",
        "--output",
        "json",
        "--config",
    ])
    .arg(&broken)
    .env("HNA_STATE_DIR", tmp.path().join("state"));
    // SAFETY: unshare and sethostname are plain syscalls; nothing else runs
    // before exec.
    unsafe {
        std::os::unix::process::CommandExt::pre_exec(&mut cmd, || {
            nix::sched::unshare(nix::sched::CloneFlags::CLONE_NEWUTS)?;
            nix::unistd::sethostname("Guest-One")?;
            Ok(())
        });
    }
    let out = cmd.output().unwrap();
    assert_eq!(out.status.code(), Some(1), "the broken file fails: {out:?}");
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let names = check_names(&v);
    assert_eq!(names, ["config", "state-dir"], "{v}");
    assert_eq!(v["checks"][0]["status"], "fail");
    assert_ne!(v["checks"][1]["status"], "fail", "{v}");
}
