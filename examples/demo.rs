//! The README's demo (`sudo tests/demo.sh`): a DHCP LAN, two guest-VM network
//! namespaces and a real kube-apiserver; the node agent runs in each guest
//! namespace and the controller beside them; the demo prints what each did.
//!
//! `--hold` keeps everything running until Ctrl-C. Everything is torn down
//! at the end, also on error.

use std::os::unix::net::UnixDatagram;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use hna_testkit::rig::{self, Rig, RigOptions};

/// A daemon the demo started; stopped with SIGTERM when dropped.
struct Daemon {
    name: String,
    child: Child,
    notify: UnixDatagram,
    messages: Vec<String>,
    log: PathBuf,
    socket: Option<PathBuf>,
    spawned: Instant,
}

impl Daemon {
    fn spawn(name: &str, mut cmd: Command, dir: &Path, socket: Option<PathBuf>) -> Result<Daemon> {
        let notify_path = dir.join(format!("{name}.notify"));
        let _ = std::fs::remove_file(&notify_path);
        let notify = UnixDatagram::bind(&notify_path)?;
        let log = dir.join(format!("{name}.log"));
        let spawned = Instant::now();
        let child = cmd
            .env("NOTIFY_SOCKET", &notify_path)
            .env("HNA_LOG_TARGET", "stderr")
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log)?)
            .spawn()
            .with_context(|| format!("starting {name}"))?;
        Ok(Daemon {
            name: name.into(),
            child,
            notify,
            messages: Vec::new(),
            log,
            socket,
            spawned,
        })
    }

    /// Waits for a notify message starting with `prefix` (and containing
    /// `needle`), returning it.
    fn wait_for(&mut self, prefix: &str, needle: &str, within: Duration) -> Result<String> {
        let deadline = Instant::now() + within;
        let mut buf = [0u8; 4096];
        loop {
            if let Some(m) = self
                .messages
                .iter()
                .find(|m| m.starts_with(prefix) && m.contains(needle))
            {
                return Ok(m.clone());
            }
            let exited = self.child.try_wait()?;
            self.notify.set_nonblocking(true)?;
            let mut drained = false;
            while let Ok(n) = self.notify.recv(&mut buf) {
                let text = String::from_utf8_lossy(&buf[..n]);
                self.messages.extend(text.lines().map(str::to_string));
                drained = true;
            }
            self.notify.set_nonblocking(false)?;
            if drained {
                continue;
            }
            if let Some(st) = exited {
                bail!(
                    "{} exited ({st}) before sending {prefix}; its log:\n{}",
                    self.name,
                    std::fs::read_to_string(&self.log).unwrap_or_default()
                );
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                bail!(
                    "{} sent no {prefix}{needle} within {within:?}; got {:?}",
                    self.name,
                    self.messages
                );
            }
            self.notify
                .set_read_timeout(Some(left.min(Duration::from_millis(200))))?;
            if let Ok(n) = self.notify.recv(&mut buf) {
                let text = String::from_utf8_lossy(&buf[..n]);
                self.messages.extend(text.lines().map(str::to_string));
            }
        }
    }

    fn stop(&mut self) -> Result<String> {
        nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(self.child.id() as i32),
            nix::sys::signal::Signal::SIGTERM,
        )?;
        let deadline = Instant::now() + Duration::from_secs(15);
        loop {
            if let Some(st) = self.child.try_wait()? {
                return Ok(st.to_string());
            }
            if Instant::now() > deadline {
                self.child.kill()?;
                return Ok("killed after 15 s".into());
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.stop();
        }
    }
}

fn status_json(agent: &Path, socket: &Path) -> Result<serde_json::Value> {
    let out = Command::new(agent)
        .args(["status", "--output", "json", "--socket"])
        .arg(socket)
        .output()?;
    if !out.status.success() {
        bail!("{}", String::from_utf8_lossy(&out.stderr).trim());
    }
    Ok(serde_json::from_slice(&out.stdout)?)
}

fn main() -> Result<()> {
    let mut agent = PathBuf::from("target/release/harvester-node-agent");
    let mut hold = false;
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--agent" => agent = args.next().context("--agent needs a path")?.into(),
            "--hold" => hold = true,
            "-h" | "--help" => {
                println!("usage: demo [--agent PATH] [--hold]");
                return Ok(());
            }
            other => bail!("unknown argument {other}; usage: demo [--agent PATH] [--hold]"),
        }
    }
    let agent = std::fs::canonicalize(&agent)
        .with_context(|| format!("agent binary {} (build it first)", agent.display()))?;

    println!("== harvester-node-agent demo ==");
    let t0 = Instant::now();
    let rig = Rig::start(RigOptions {
        guests: 2,
        dhcp: true,
        apiserver: true,
        ..RigOptions::default()
    })?;
    let api = rig.apiserver().expect("apiserver requested");
    println!(
        "rig {} up in {:.1}s (all traffic stays in its namespaces and on loopback):",
        rig.id(),
        t0.elapsed().as_secs_f64()
    );
    println!(
        "  LAN        namespace {} : bridge br0 10.77.0.1/24, dnsmasq serving {}-{}",
        rig.lan_ns(),
        rig::DHCP_FIRST,
        rig::DHCP_LAST
    );
    for i in 0..2 {
        println!(
            "  guest VM   namespace {} : eth0 on br0, node {}",
            rig.guest_ns(i),
            rig.node_name(i)
        );
    }
    println!(
        "  API server {} : kube-apiserver {} + etcd, Node,RBAC authorization, NodeRestriction",
        api.url(),
        api.version()
    );

    let empty_config = rig.dir().join("demo-empty.toml");
    std::fs::write(&empty_config, "# demo: every setting comes from flags\n")?;

    let mut daemons = Vec::new();
    for i in 0..2 {
        let node = rig.node_name(i).to_string();
        let dir = rig.dir().join(&node);
        std::fs::create_dir_all(&dir)?;
        let socket = dir.join("agent.sock");
        let mut cmd = rig.netns_cmd(rig.guest_ns(i), &agent);
        cmd.args(["run", "--node-name", &node, "--credentials-retry", "1s"])
            .arg("--config")
            .arg(&empty_config)
            .arg("--state-dir")
            .arg(dir.join("state"))
            .arg("--socket")
            .arg(&socket)
            .arg("--kubeconfig")
            .arg(api.node_kubeconfig(&node))
            .env("WATCHDOG_USEC", "10000000");
        daemons.push(Daemon::spawn(
            &format!("agent-{node}"),
            cmd,
            rig.dir(),
            Some(socket),
        )?);
    }
    let mut cmd = Command::new(&agent);
    cmd.args(["controller", "--credentials-retry", "1s"])
        .arg("--kubeconfig")
        .arg(api.controller_kubeconfig());
    daemons.push(Daemon::spawn("controller", cmd, rig.dir(), None)?);

    println!("\nstarted (systemd notify messages as the service manager would see them):");
    for d in &mut daemons {
        d.wait_for("READY=1", "", Duration::from_secs(20))?;
        let ready_ms = d.spawned.elapsed().as_millis();
        let status = d.wait_for("STATUS=", "connected", Duration::from_secs(30))?;
        println!(
            "  {:<16} READY=1 (within {ready_ms} ms of start), {}",
            d.name, status
        );
    }
    for d in &mut daemons {
        if d.socket.is_some() {
            d.wait_for("WATCHDOG=1", "", Duration::from_secs(10))?;
        }
    }
    println!("  agents ping WATCHDOG=1 every 5 s (WatchdogSec=10s in this demo)");

    println!("\n`harvester-node-agent status` answering from each guest:");
    for d in &daemons {
        let Some(socket) = &d.socket else { continue };
        let st = status_json(&agent, socket)?;
        println!(
            "  {:<16} pid {} node {}: cluster {} {} via {}",
            d.name,
            st["pid"],
            st["node_name"].as_str().unwrap_or("?"),
            st["cluster"]["state"].as_str().unwrap_or("?"),
            st["cluster"]["server_version"].as_str().unwrap_or(""),
            st["cluster"]["server"].as_str().unwrap_or(""),
        );
    }
    println!(
        "\nAPI server {} is reachable from both guest namespaces with per-node credentials (system:node:<name>).",
        api.url()
    );

    println!(
        "\n`harvester-node-agent dhcp-probe` in {}: the VM network's DHCP checked before any Service exists",
        rig.node_name(0)
    );
    let out = rig
        .netns_cmd(rig.guest_ns(0), &agent)
        .args(["dhcp-probe", "--parent", "eth0"])
        .output()?;
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        println!("  {line}");
    }
    if !out.status.success() {
        bail!(
            "dhcp-probe failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }

    if hold {
        println!(
            "\nholding; rig dir {} ; Ctrl-C to stop",
            rig.dir().display()
        );
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?
            .block_on(tokio::signal::ctrl_c())?;
    }

    println!("\nstopping (SIGTERM):");
    for d in &mut daemons {
        let exit = d.stop()?;
        d.wait_for("STOPPING=1", "", Duration::from_secs(1))?;
        println!("  {:<16} STOPPING=1, {exit}", d.name);
    }
    drop(daemons);
    drop(rig);
    println!("rig torn down: namespaces, dnsmasq, etcd, kube-apiserver gone.");
    Ok(())
}
