//! Start-up time and idle memory of the daemon, side by side with busybox
//! `udhcpc` holding a lease (the size of a minimal network daemon).
//!
//! `sudo cargo bench --bench startup` (needs the rig's prerequisites:
//! `sudo tests/rig/prereqs.sh`). Options after `--`:
//! `--starts N` (default 30), `--idle SECONDS` (default 60).
//!
//! Measures, in one run:
//! - start to `READY=1`: wall time from spawn to the READY=1 datagram on a
//!   notify socket, N sequential starts, local only (no credentials);
//! - VmRSS after the idle period of: the daemon with no cluster, the daemon
//!   in a guest namespace connected to the rig's kube-apiserver, and
//!   `udhcpc` holding a lease on a macvlan in another guest namespace.

mod common;

use hna_testkit::rig;

use std::os::unix::net::UnixDatagram;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use common::{Killed, ms, percentile, rss_kib};

const BIN: &str = env!("CARGO_BIN_EXE_harvester-node-agent");

fn agent_cmd(mut cmd: Command, dir: &Path, name: &str) -> Command {
    let _ = std::fs::write(dir.join("empty.toml"), "");
    cmd.arg("run")
        .arg("--config")
        .arg(dir.join("empty.toml"))
        .arg("--state-dir")
        .arg(dir.join(format!("{name}-state")))
        .arg("--socket")
        .arg(dir.join(format!("{name}.sock")))
        .arg("--kubeconfig-search")
        .arg("")
        .env("HNA_LOG_TARGET", "stderr")
        .env("HNA_LOG_LEVEL", "warn")
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    cmd
}

fn wait_ready(sock: &UnixDatagram, within: Duration) -> Result<()> {
    let deadline = Instant::now() + within;
    let mut buf = [0u8; 4096];
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            bail!("no READY=1 within {within:?}");
        }
        sock.set_read_timeout(Some(left))?;
        if let Ok(n) = sock.recv(&mut buf)
            && String::from_utf8_lossy(&buf[..n])
                .lines()
                .any(|l| l == "READY=1")
        {
            return Ok(());
        }
    }
}

fn sigterm_and_wait(child: &mut Child) -> Result<()> {
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(child.id() as i32),
        nix::sys::signal::Signal::SIGTERM,
    )?;
    child.wait()?;
    Ok(())
}

fn main() -> Result<()> {
    let mut starts = 30usize;
    let mut idle = 60u64;
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--starts" => starts = args.next().context("--starts N")?.parse()?,
            "--idle" => idle = args.next().context("--idle SECONDS")?.parse()?,
            // cargo bench passes --bench; nothing else is expected.
            _ => {}
        }
    }
    let dir = tempfile::tempdir()?;

    // 1. Start to READY=1.
    let mut times = Vec::with_capacity(starts);
    for i in 0..starts {
        let notify_path = dir.path().join(format!("notify-{i}"));
        let notify = UnixDatagram::bind(&notify_path)?;
        let mut cmd = agent_cmd(Command::new(BIN), dir.path(), &format!("start{i}"));
        cmd.env("NOTIFY_SOCKET", &notify_path);
        let t = Instant::now();
        let mut child = cmd.spawn()?;
        wait_ready(&notify, Duration::from_secs(10))?;
        times.push(t.elapsed());
        sigterm_and_wait(&mut child)?;
    }
    times.sort();

    // 2. Idle RSS after `idle` seconds, all three side by side.
    let rig = rig::Rig::start(rig::RigOptions {
        guests: 2,
        dhcp: true,
        apiserver: true,
        ..Default::default()
    })?;
    let api = rig.apiserver().expect("apiserver");

    let alone = Killed(agent_cmd(Command::new(BIN), dir.path(), "alone").spawn()?);

    let mut connected_cmd = agent_cmd(rig.netns_cmd(rig.guest_ns(0), BIN), dir.path(), "connected");
    connected_cmd
        .arg("--node-name")
        .arg(rig.node_name(0))
        .arg("--kubeconfig")
        .arg(api.node_kubeconfig(rig.node_name(0)));
    let connected = Killed(connected_cmd.spawn()?);
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let out = Command::new(BIN)
            .args(["status", "--output", "json", "--socket"])
            .arg(dir.path().join("connected.sock"))
            .output()?;
        let state = serde_json::from_slice::<serde_json::Value>(&out.stdout)
            .map(|v| v["cluster"]["state"].as_str().unwrap_or("").to_string())
            .unwrap_or_default();
        if state == "Connected" {
            break;
        }
        if Instant::now() > deadline {
            bail!("the daemon in the guest namespace never connected to the API server ({state})");
        }
        std::thread::sleep(Duration::from_millis(100));
    }

    let g2 = rig.guest_ns(1).to_string();
    let ip = |args: &[&str]| -> Result<()> {
        let st = rig.netns_cmd(&g2, "ip").args(args).status()?;
        if !st.success() {
            bail!("ip {args:?} failed");
        }
        Ok(())
    };
    ip(&[
        "link", "add", "mv0", "link", "eth0", "type", "macvlan", "mode", "bridge",
    ])?;
    ip(&["link", "set", "mv0", "up"])?;
    let udhcpc_start = Instant::now();
    let mut udhcpc = Killed(
        rig.netns_cmd(&g2, "busybox")
            .args([
                "udhcpc",
                "-f",
                "-i",
                "mv0",
                "-s",
                "/bin/true",
                "-t",
                "10",
                "-T",
                "1",
            ])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()?,
    );
    // udhcpc prints "lease of A obtained" on stderr or stdout depending on
    // build; poll the server's lease file instead.
    let deadline = Instant::now() + Duration::from_secs(20);
    let udhcpc_lease = loop {
        if rig.dnsmasq_leases()?.lines().count() > 0 {
            break udhcpc_start.elapsed();
        }
        if Instant::now() > deadline {
            bail!("udhcpc got no lease in 20 s");
        }
        if let Some(st) = udhcpc.0.try_wait()? {
            bail!("udhcpc exited: {st}");
        }
        std::thread::sleep(Duration::from_millis(5));
    };

    eprintln!("idling {idle} s ...");
    std::thread::sleep(Duration::from_secs(idle));
    let rss_alone = rss_kib(alone.0.id())?;
    let rss_connected = rss_kib(connected.0.id())?;
    let rss_udhcpc = rss_kib(udhcpc.0.id())?;

    println!(
        "\nharvester-node-agent {} (release build)",
        env!("CARGO_PKG_VERSION")
    );
    println!(
        "start to READY=1 over {starts} starts: median {:.1} ms, p90 {:.1} ms, min {:.1} ms, max {:.1} ms",
        ms(percentile(&times, 0.5)),
        ms(percentile(&times, 0.9)),
        ms(times[0]),
        ms(*times.last().unwrap())
    );
    println!(
        "udhcpc (busybox) DISCOVER to lease in the dnsmasq file: {:.1} ms (reference)",
        ms(udhcpc_lease)
    );
    println!("idle VmRSS after {idle} s:");
    println!("  harvester-node-agent, no cluster          {rss_alone:>7} KiB");
    println!("  harvester-node-agent, connected to API    {rss_connected:>7} KiB");
    println!("  busybox udhcpc holding a lease            {rss_udhcpc:>7} KiB");
    drop(udhcpc);
    drop(connected);
    drop(alone);
    drop(rig);
    Ok(())
}
