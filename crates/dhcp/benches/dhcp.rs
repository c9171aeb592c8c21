//! DHCP acquisition speed and memory: the engine side by side with the peer
//! clients `udhcpc` (busybox), `dhclient` (ISC) and `dhcpcd`, all against
//! the same dnsmasq on the rig, each through its own macvlan, in one run.
//!
//! `sudo cargo bench -p hna-dhcp --bench dhcp` (needs the rig's prerequisites:
//! `sudo tests/rig/prereqs.sh`, which installs the peers too). Options after
//! `--`: `--runs N` single acquisitions per client (default 15),
//! `--batches N` batches per client (default 3), `--batch N` leases per
//! batch (default 100), `--skip-memory`, `--skip-timing`, `--only LABEL-PREFIX` (e.g.
//! `--only agent`: only the clients whose label starts so).
//!
//! What is timed:
//! - engine ("agent"): from `Engine::start` until the lease is BOUND
//!   (address on the macvlan, lease file written), in-process, as the
//!   daemon runs it; once with `start` creating the macvlan (what the
//!   daemon does), once on a macvlan made beforehand like the peers' (the
//!   engine reuses a link with its name and MAC);
//! - peers: from spawning the client on an existing macvlan until it exits
//!   having bound (one-shot modes: `dhclient -1`, which exits once bound and
//!   daemonised, `udhcpc -q`, `dhcpcd -1`); process start-up is counted;
//! - "100 at once": every client started together, until the last is
//!   BOUND; peers are 100 processes, the engine is 100 leases in one.
//!
//! Clients are compared in two groups, because an RFC 5227 ARP check of the
//! offered address dominates the time: without it (engine
//! `arp_probe = false`, `dhclient`, `udhcpc`, `dhcpcd` with `noarp`) and with
//! it (engine default, `udhcpc -a`, `dhcpcd` default). `dhcpcd` runs with
//! `nodelay` (no random start delay) in both. dnsmasq is restarted with an
//! empty lease file before every series so the pool never runs dry.
//!
//! Memory: resident and proportional set size (VmRSS, Pss of
//! `/proc/<pid>/smaps_rollup`, summed over every process a client runs)
//! holding 100 leases: the engine alone in one process (this bench, run with
//! `--hold-leases`; holding 1,
//! for the cost per lease), 100 `udhcpc` and 100 `dhclient` daemons, and one
//! `dhcpcd` manager for 100 interfaces.

// The benches' shared helpers, beside the root package's other benches.
#[path = "../../../benches/common/mod.rs"]
mod common;

use std::collections::BTreeSet;
use std::fs::File;
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use common::{Killed, kib_field, ms, percentile};
use hna_dhcp::driver::LeaseStatus;
use hna_dhcp::engine::{Engine, LeaseConfig};
use hna_dhcp::io::ProbeConfig;
use hna_dhcp::{Identity, StopMode, Timing};
use hna_testkit::rig::{Rig, RigOptions, find_program, in_netns};

/// Room for 253 clients: the rig's range plus the rest of the /24.
const WIDE_RANGES: &[&str] = &[
    "--dhcp-range=10.77.0.2,10.77.0.99,255.255.255.0,1h",
    "--dhcp-range=10.77.0.200,10.77.0.254,255.255.255.0,1h",
];

#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Debug)]
enum Client {
    /// The engine creating its macvlan (what the daemon does).
    Engine,
    /// The engine on a macvlan that already exists (it reuses a link of
    /// its name and MAC), timed like the peers.
    EngineOnLink,
    Dhclient,
    Udhcpc,
    Dhcpcd,
}

impl Client {
    fn label(self, arp: bool) -> String {
        let base = match self {
            Client::Engine => "agent, makes macvlan",
            Client::EngineOnLink => "agent, macvlan exists",
            Client::Dhclient => "dhclient",
            Client::Udhcpc => "udhcpc",
            Client::Dhcpcd => "dhcpcd",
        };
        match (self, arp) {
            (Client::Udhcpc, true) => "udhcpc -a".into(),
            _ => base.into(),
        }
    }
}

struct Bench {
    rig: Rig,
    ns: String,
    ns_fd: OwnedFd,
    dir: tempfile::TempDir,
    /// Interface and MAC counter, so no name, MAC or client lease file is
    /// ever reused (which would turn a discovery into an INIT-REBOOT).
    next: u32,
    dhcpcd_noarp: PathBuf,
    dhcpcd_arp: PathBuf,
}

impl Bench {
    fn fresh_server(&mut self) -> Result<()> {
        self.rig.stop_dhcp();
        let _ = std::fs::remove_file(self.rig.leases_path());
        let extra: Vec<String> = WIDE_RANGES.iter().map(|s| s.to_string()).collect();
        self.rig.start_dhcp(&extra)
    }

    /// A new interface name and MAC.
    fn identity(&mut self) -> (String, [u8; 6]) {
        let k = self.next;
        self.next += 1;
        (
            format!("bm{k:06x}"),
            [0, 0, 0x6c, 0xbe, (k >> 8) as u8, k as u8],
        )
    }

    fn ip(&self, args: &[&str]) -> Result<()> {
        let out = Command::new("ip")
            .arg("-n")
            .arg(&self.ns)
            .args(args)
            .output()?;
        ensure!(
            out.status.success(),
            "ip {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        Ok(())
    }

    /// Creates macvlans in one `ip -batch`, so setting up 100 is quick.
    fn add_macvlans(&self, links: &[(String, [u8; 6])]) -> Result<()> {
        let mut batch = String::new();
        for (name, mac) in links {
            batch.push_str(&format!(
                "link add {name} link eth0 address {} type macvlan mode bridge\nlink set {name} up\n",
                fmt_mac(mac)
            ));
        }
        self.ip_batch(&batch)
    }

    fn del_macvlans(&self, names: &[String]) -> Result<()> {
        let batch: String = names.iter().map(|n| format!("link del {n}\n")).collect();
        self.ip_batch(&batch)
    }

    fn ip_batch(&self, batch: &str) -> Result<()> {
        let path = self.dir.path().join("ip.batch");
        std::fs::write(&path, batch)?;
        self.ip(&["-batch", path.to_str().expect("utf-8 path")])
    }

    /// The command for `client` on `iface`, entering the guest namespace
    /// itself (no `ip netns exec` in the measured time).
    fn peer_cmd(&self, client: Client, arp: bool, iface: &str, oneshot: bool) -> Command {
        let d = self.dir.path();
        let mut cmd = match client {
            Client::Dhclient => {
                let mut c = Command::new("dhclient");
                c.arg(if oneshot { "-1" } else { "-d" });
                c.args(["-4", "-sf", "/bin/true", "-pf"])
                    .arg(d.join(format!("{iface}.pid")))
                    .arg("-lf")
                    .arg(d.join(format!("{iface}.leases")))
                    .arg(iface);
                c
            }
            Client::Udhcpc => {
                let mut c = Command::new("busybox");
                c.args([
                    "udhcpc",
                    "-f",
                    "-i",
                    iface,
                    "-s",
                    "/bin/true",
                    "-t",
                    "10",
                    "-T",
                    "1",
                ]);
                if oneshot {
                    c.args(["-q", "-n"]);
                }
                if arp {
                    c.arg("-a");
                }
                c
            }
            Client::Dhcpcd => {
                let mut c = Command::new("dhcpcd");
                if oneshot {
                    c.arg("-1");
                }
                c.args(["-4", "-B", "-t", "30", "-c", "/bin/true", "-f"])
                    .arg(if arp {
                        &self.dhcpcd_arp
                    } else {
                        &self.dhcpcd_noarp
                    })
                    .arg(iface);
                c
            }
            Client::Engine | Client::EngineOnLink => {
                unreachable!("the engine runs in-process")
            }
        };
        enter_netns(&mut cmd, &self.ns_fd);
        cmd.stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        cmd
    }

    /// Removes what a one-shot peer leaves: dhclient's daemon, dhcpcd's
    /// lease file.
    fn after_peer(&self, client: Client, iface: &str) {
        if client == Client::Dhclient
            && let Ok(pid) = std::fs::read_to_string(self.dir.path().join(format!("{iface}.pid")))
            && let Ok(pid) = pid.trim().parse::<i32>()
        {
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(pid),
                nix::sys::signal::Signal::SIGKILL,
            );
        }
        if client == Client::Dhcpcd {
            let _ = std::fs::remove_file(format!("/var/lib/dhcpcd/{iface}.lease"));
        }
    }

    /// `n` peers at once on fresh macvlans; the time until the last exits
    /// bound.
    fn peers_at_once(&mut self, client: Client, arp: bool, n: usize) -> Result<Duration> {
        let links: Vec<_> = (0..n).map(|_| self.identity()).collect();
        self.add_macvlans(&links)?;
        let t0 = Instant::now();
        let mut children: Vec<(String, Child)> = Vec::with_capacity(n);
        for (name, _) in &links {
            let child = self
                .peer_cmd(client, arp, name, true)
                .spawn()
                .with_context(|| format!("spawn {client:?}"))?;
            children.push((name.clone(), child));
        }
        let mut failed = Vec::new();
        for (name, c) in &mut children {
            let st = c.wait()?;
            if !st.success() {
                failed.push(format!("{name}: {st}"));
            }
        }
        let took = t0.elapsed();
        for (name, _) in &links {
            self.after_peer(client, name);
        }
        let names: Vec<String> = links.into_iter().map(|(n, _)| n).collect();
        self.del_macvlans(&names)?;
        ensure!(failed.is_empty(), "{client:?} got no lease: {failed:?}");
        Ok(took)
    }

    /// `n` engine leases at once in one process; the time until the last
    /// is BOUND.
    fn engine_at_once(&mut self, arp: bool, n: usize, link_exists: bool) -> Result<Duration> {
        let ids: Vec<_> = (0..n)
            .map(|_| {
                let (name, mac) = self.identity();
                // The daemon's naming: `vip-<8 hex>`.
                (format!("vip-be{}", &name[2..]), mac)
            })
            .collect();
        if link_exists {
            self.add_macvlans(&ids)?;
        }
        let store = self.dir.path().join("engine-state");
        let ns = self.ns.clone();
        in_netns(&ns, async || -> Result<Duration> {
            let store = hna_dhcp::store::Store::open(&store)?;
            let engine = Engine::new(Some(store))?;
            let t0 = Instant::now();
            let starts = ids.iter().map(|(name, mac)| {
                engine.start(LeaseConfig {
                    interface: name.clone(),
                    parent: "eth0".into(),
                    identity: Identity::new(*mac),
                    requested_ip: None,
                    timing: Timing {
                        arp_probe: arp,
                        ..Timing::default()
                    },
                    probe: ProbeConfig::default(),
                    guarded_at: None,
                    witness: None,
                    presence: hna_dhcp::Presence::Off,
                })
            });
            let mut rxs = Vec::with_capacity(n);
            for r in futures::future::join_all(starts).await {
                rxs.push(r?);
            }
            for rx in &mut rxs {
                let bound = tokio::time::timeout(
                    Duration::from_secs(60),
                    rx.wait_for(|s: &LeaseStatus| s.state.holds_address()),
                )
                .await
                .is_ok();
                if !bound {
                    bail!("a lease was not BOUND within 60 s: {:#?}", *rx.borrow());
                }
            }
            let took = t0.elapsed();
            let errors = engine.stop_all(StopMode::Handover).await;
            ensure!(errors.is_empty(), "{errors:?}");
            Ok(took)
        })?
    }

    fn at_once(&mut self, client: Client, arp: bool, n: usize) -> Result<Duration> {
        match client {
            Client::Engine => self.engine_at_once(arp, n, false),
            Client::EngineOnLink => self.engine_at_once(arp, n, true),
            _ => self.peers_at_once(client, arp, n),
        }
    }
}

/// Makes the child enter the guest namespace itself (no `ip netns exec`
/// in the measured time).
fn enter_netns(cmd: &mut Command, ns: &OwnedFd) {
    let fd = ns.as_raw_fd();
    // SAFETY: setns is async-signal-safe; the fd stays open in the parent
    // for the child's whole start-up.
    unsafe {
        cmd.pre_exec(move || {
            if libc::setns(fd, libc::CLONE_NEWNET) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
}

fn fmt_mac(mac: &[u8; 6]) -> String {
    mac.iter()
        .map(|b| format!("{b:02x}"))
        .collect::<Vec<_>>()
        .join(":")
}

/// Every process in the tree under `root` (by parent pid).
fn process_tree(roots: &[u32]) -> Vec<u32> {
    let mut parent_of = Vec::new();
    if let Ok(rd) = std::fs::read_dir("/proc") {
        for e in rd.flatten() {
            let Some(pid) = e.file_name().to_str().and_then(|s| s.parse::<u32>().ok()) else {
                continue;
            };
            let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
                continue;
            };
            // The field after the command (which may hold spaces) is the
            // state, then the parent pid.
            let Some(after) = stat.rsplit_once(')').map(|(_, a)| a) else {
                continue;
            };
            if let Some(ppid) = after.split_whitespace().nth(1).and_then(|p| p.parse().ok()) {
                parent_of.push((pid, ppid));
            }
        }
    }
    let mut tree: BTreeSet<u32> = roots.iter().copied().collect();
    loop {
        let before = tree.len();
        for (pid, ppid) in &parent_of {
            if tree.contains(ppid) {
                tree.insert(*pid);
            }
        }
        if tree.len() == before {
            break;
        }
    }
    tree.into_iter().collect()
}

/// (VmRSS, Pss) in KiB summed over `pids`.
fn memory_kib(pids: &[u32]) -> (u64, u64) {
    let field = |text: &str, key: &str| kib_field(text, key).unwrap_or(0);
    let mut rss = 0;
    let mut pss = 0;
    for pid in pids {
        if let Ok(s) = std::fs::read_to_string(format!("/proc/{pid}/status")) {
            rss += field(&s, "VmRSS:");
        }
        if let Ok(s) = std::fs::read_to_string(format!("/proc/{pid}/smaps_rollup")) {
            pss += field(&s, "Pss:");
        }
    }
    (rss, pss)
}

fn dnsmasq_lease_count(rig: &Rig, mac_prefix: &str) -> usize {
    rig.dnsmasq_leases()
        .unwrap_or_default()
        .lines()
        .filter(|l| l.contains(mac_prefix))
        .count()
}

fn wait_until(within: Duration, what: &str, mut f: impl FnMut() -> Result<bool>) -> Result<()> {
    let deadline = Instant::now() + within;
    while !f()? {
        if Instant::now() > deadline {
            bail!("{what} not reached within {within:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    Ok(())
}

/// Memory of the engine alone holding `count` leases (no ARP probe), once all
/// are BOUND.
fn engine_memory(b: &mut Bench, count: u32, set: u8) -> Result<(u64, u64)> {
    b.fresh_server()?;
    let d = b.dir.path().join(format!("hold-{set}"));
    std::fs::create_dir_all(&d)?;
    let status = d.join("status.json");
    // This bench itself, holding the leases with the engine and nothing
    // else in the process (see `hold`).
    let mut cmd = Command::new(std::env::current_exe()?);
    cmd.args([HOLD, "eth0"])
        .arg(count.to_string())
        .arg(set.to_string())
        .arg(&d)
        .arg(&status)
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    enter_netns(&mut cmd, &b.ns_fd);
    let mut hold = Killed(cmd.spawn()?);
    wait_until(Duration::from_secs(60), "the held leases BOUND", || {
        let leases: Vec<LeaseStatus> = std::fs::read(&status)
            .ok()
            .and_then(|b| serde_json::from_slice(&b).ok())
            .unwrap_or_default();
        Ok(leases.len() == count as usize && leases.iter().all(|l| l.state.holds_address()))
    })?;
    // Let allocator and tasks settle.
    std::thread::sleep(Duration::from_secs(2));
    let pid = hold.0.id();
    let mem = memory_kib(&process_tree(&[pid]));
    // SIGTERM: hand over (macvlans deleted, nothing released).
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(pid as i32),
        nix::sys::signal::Signal::SIGTERM,
    )?;
    hold.0.wait()?;
    Ok(mem)
}

/// Memory of `n` peer daemons (or one dhcpcd manager) once they hold their
/// leases, and how many got one within 3 minutes (the peers can take
/// minutes when the server NAKs many of them at once).
fn peer_memory(b: &mut Bench, client: Client, n: usize) -> Result<(u64, u64, usize)> {
    b.fresh_server()?;
    let links: Vec<_> = (0..n).map(|_| b.identity()).collect();
    b.add_macvlans(&links)?;
    let mut procs: Vec<Killed> = Vec::new();
    if client == Client::Dhcpcd {
        let mut cmd = b.peer_cmd(client, false, &links[0].0, false);
        for (name, _) in &links[1..] {
            cmd.arg(name);
        }
        procs.push(Killed(cmd.spawn()?));
    } else {
        for (name, _) in &links {
            procs.push(Killed(b.peer_cmd(client, false, name, false).spawn()?));
        }
    }
    let rig = &b.rig;
    let _ = wait_until(Duration::from_secs(180), "peers bound", || {
        Ok(dnsmasq_lease_count(rig, "00:00:6c:be") >= n)
    });
    std::thread::sleep(Duration::from_secs(2));
    let bound = dnsmasq_lease_count(rig, "00:00:6c:be");
    let roots: Vec<u32> = procs.iter().map(|c| c.0.id()).collect();
    let (rss, pss) = memory_kib(&process_tree(&roots));
    drop(procs);
    for (name, _) in &links {
        b.after_peer(client, name);
    }
    let names: Vec<String> = links.into_iter().map(|(n, _)| n).collect();
    b.del_macvlans(&names)?;
    Ok((rss, pss, bound))
}

/// The first argument that makes this binary hold leases instead of
/// benchmarking: `--hold-leases PARENT COUNT SET STATE_DIR STATUS_FILE`.
const HOLD: &str = "--hold-leases";

/// Holds `count` leases on `parent` (no ARP check) with the engine, writing
/// their status to `status_file` every 100 ms, until SIGTERM: the engine's
/// memory with nothing else in the process.
fn hold(mut args: impl Iterator<Item = String>) -> Result<()> {
    let mut next = |what: &str| args.next().with_context(|| format!("{HOLD}: {what}"));
    let parent = next("PARENT")?;
    let count: u32 = next("COUNT")?.parse()?;
    let set: u8 = next("SET")?.parse()?;
    let state_dir = PathBuf::from(next("STATE_DIR")?);
    let status_file = PathBuf::from(next("STATUS_FILE")?);
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?
        .block_on(async move {
            let store = hna_dhcp::store::Store::open(&state_dir)?;
            let engine = Engine::new(Some(store))?;
            for i in 0..count {
                let mac = [0, 0, 0x6c, set, (i >> 8) as u8, i as u8];
                engine
                    .start(LeaseConfig {
                        interface: format!("vip-{set:02x}{i:06x}"),
                        parent: parent.clone(),
                        identity: Identity::new(mac),
                        requested_ip: None,
                        timing: Timing {
                            arp_probe: false,
                            ..Timing::default()
                        },
                        probe: ProbeConfig::default(),
                        guarded_at: None,
                        witness: None,
                        presence: hna_dhcp::Presence::Off,
                    })
                    .await?;
            }
            let mut term =
                tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
            let mut tick = tokio::time::interval(Duration::from_millis(100));
            loop {
                tokio::select! {
                    _ = tick.tick() => {
                        let body = serde_json::to_vec(&engine.snapshot())?;
                        std::fs::write(&status_file, body)?;
                    }
                    _ = term.recv() => break,
                }
            }
            for e in engine.stop_all(StopMode::Handover).await {
                eprintln!("{e}");
            }
            Ok(())
        })
}

fn main() -> Result<()> {
    if std::env::args().nth(1).as_deref() == Some(HOLD) {
        return hold(std::env::args().skip(2));
    }
    let mut runs = 15usize;
    let mut batches = 3usize;
    let mut batch = 100usize;
    let mut memory = true;
    let mut timing = true;
    let mut only: Option<String> = None;
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--runs" => runs = args.next().context("--runs N")?.parse()?,
            "--batches" => batches = args.next().context("--batches N")?.parse()?,
            "--batch" => batch = args.next().context("--batch N")?.parse()?,
            "--skip-memory" => memory = false,
            "--skip-timing" => timing = false,
            "--only" => only = Some(args.next().context("--only LABEL-PREFIX")?),
            // cargo bench passes --bench; nothing else is expected.
            _ => {}
        }
    }
    ensure!(
        runs > 0 && batches > 0,
        "--runs and --batches must be at least 1"
    );
    ensure!(
        batch <= 240,
        "--batch: the rig's /24 has room for 240 clients"
    );
    for p in ["dhclient", "busybox", "dhcpcd"] {
        find_program(p).with_context(|| {
            format!("{p} not found: install the peers with `sudo tests/rig/prereqs.sh`")
        })?;
    }
    let rig = Rig::start(RigOptions {
        guests: 1,
        dhcp: true,
        dnsmasq_args: WIDE_RANGES.iter().map(|s| s.to_string()).collect(),
        ..Default::default()
    })?;
    let ns = rig.guest_ns(0).to_string();
    let ns_fd: OwnedFd = File::open(format!("/run/netns/{ns}"))?.into();
    let dir = tempfile::tempdir()?;
    let dhcpcd_noarp = dir.path().join("dhcpcd-noarp.conf");
    let dhcpcd_arp = dir.path().join("dhcpcd-arp.conf");
    std::fs::write(&dhcpcd_noarp, "nodelay\nnoarp\nnoipv4ll\n")?;
    std::fs::write(&dhcpcd_arp, "nodelay\nnoipv4ll\n")?;
    let mut b = Bench {
        rig,
        ns,
        ns_fd,
        dir,
        next: 1,
        dhcpcd_noarp,
        dhcpcd_arp,
    };

    let variants = [
        (Client::Engine, false),
        (Client::EngineOnLink, false),
        (Client::Dhclient, false),
        (Client::Udhcpc, false),
        (Client::Dhcpcd, false),
        (Client::Engine, true),
        (Client::EngineOnLink, true),
        (Client::Udhcpc, true),
        (Client::Dhcpcd, true),
    ];
    let mut rows = Vec::new();
    for (client, arp) in variants.into_iter().filter(|(c, a)| {
        timing
            && only
                .as_ref()
                .is_none_or(|o| c.label(*a).starts_with(o.as_str()))
    }) {
        eprintln!(
            "{} (ARP check {}): {runs} single, {batches}x{batch} at once",
            client.label(arp),
            if arp { "on" } else { "off" }
        );
        let mut single = Vec::with_capacity(runs);
        b.fresh_server()?;
        for _ in 0..runs {
            single.push(b.at_once(client, arp, 1)?);
        }
        let mut many = Vec::with_capacity(batches);
        for _ in 0..batches {
            b.fresh_server()?;
            many.push(b.at_once(client, arp, batch)?);
        }
        rows.push((client, arp, single, many));
    }

    println!(
        "\nDHCP start to BOUND against dnsmasq on the rig (harvester-node-agent {}, release build)",
        env!("CARGO_PKG_VERSION")
    );
    let arps: &[bool] = if rows.is_empty() { &[] } else { &[false, true] };
    for &arp in arps {
        println!(
            "\n{}:",
            if arp {
                "with an ARP check of the offered address (RFC 5227)"
            } else {
                "without an ARP check"
            }
        );
        println!(
            "  {:<22} {:>14} {:>10} {:>10}   {:>22} {:>10}",
            "client",
            "1 lease median",
            "p90",
            "min",
            format!("{batch} at once (median)"),
            "worst"
        );
        for (client, a, single, many) in rows.iter_mut().filter(|r| r.1 == arp) {
            single.sort();
            many.sort();
            let min = *single.iter().min().expect("runs > 0");
            let worst = *many.iter().max().expect("batches > 0");
            println!(
                "  {:<22} {:>11.1} ms {:>7.1} ms {:>7.1} ms   {:>19.1} ms {:>7.1} ms",
                client.label(*a),
                ms(percentile(single, 0.5)),
                ms(percentile(single, 0.9)),
                ms(min),
                ms(percentile(many, 0.5)),
                ms(worst),
            );
        }
    }

    if memory {
        eprintln!("memory: holding {batch} leases");
        let (one_rss, one_pss) = engine_memory(&mut b, 1, 0xe1)?;
        let (rss, pss) = engine_memory(&mut b, batch as u32, 0xe2)?;
        let mut peers = Vec::new();
        for c in [Client::Udhcpc, Client::Dhclient, Client::Dhcpcd] {
            peers.push((c, peer_memory(&mut b, c, batch)?));
        }
        println!("\nmemory holding {batch} leases (KiB, summed over every process of the client):");
        println!("  {:<48} {:>9} {:>9}", "client", "VmRSS", "Pss");
        println!(
            "  {:<48} {:>9} {:>9}",
            "hna-dhcp engine alone, 1 lease", one_rss, one_pss
        );
        println!(
            "  {:<48} {:>9} {:>9}",
            format!("hna-dhcp engine alone, {batch} leases"),
            rss,
            pss
        );
        for (c, (r, p, bound)) in peers {
            let what = match c {
                Client::Udhcpc => format!("udhcpc, {batch} processes"),
                Client::Dhclient => format!("dhclient, {batch} processes"),
                _ => format!("dhcpcd, one manager for {batch} interfaces"),
            };
            let note = if bound < batch {
                format!("   (only {bound} bound after 3 min)")
            } else {
                String::new()
            };
            println!("  {what:<48} {r:>9} {p:>9}{note}");
        }
        println!(
            "  engine cost per lease: {:.1} KiB RSS, {:.1} KiB Pss",
            (rss as f64 - one_rss as f64) / (batch as f64 - 1.0),
            (pss as f64 - one_pss as f64) / (batch as f64 - 1.0)
        );
    }
    drop(b);
    Ok(())
}
