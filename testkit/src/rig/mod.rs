//! The real test rig: network namespaces, a bridge, a real DHCP server and
//! (optionally) a real kube-apiserver, all torn down when the [`Rig`] drops.
//!
//! Layout of a rig with id `<id>`:
//!
//! ```text
//!  hna-<id>-lan                           hna-<id>-g1 (guest 1)
//!  ┌──────────────────────────────┐       ┌─────────────────────┐
//!  │ br0 10.77.0.1/24             │       │ lo up               │
//!  │  ├─ vg1 ─────────── veth ────┼───────┼─ eth0 (up, no addr) │
//!  │  └─ vg2 ─── …                │       │ 127.0.0.1:<port> ──►│ forwarded to the host's
//!  │ dnsmasq (DHCP only)          │       └─────────────────────┘ kube-apiserver
//!  │  └─ vh1 ─────────── veth ────┼─────── hna-<id>-h1 (LAN host, optional):
//!  └──────────────────────────────┘        eth0 10.77.0.200/24, no agent
//! ```
//!
//! LAN hosts ([`Rig::add_lan_host`]) are other machines on the LAN for TCP
//! clients and probers: static addresses from 10.77.0.200, outside the
//! DHCP range. With an API server, the controller's credentials
//! authenticate as the ServiceAccount of `packaging/kubernetes/`
//! ([`apiserver::CONTROLLER_USER`]), and [`manifests`] applies those
//! manifests.
//!
//! Prerequisites ([`RigOptions::prerequisites`]; `sudo tests/rig/prereqs.sh`
//! installs them): root, iproute2, dnsmasq (`/usr/sbin/dnsmasq`), and for
//! the API server `openssl`, `etcd` and `kube-apiserver`. When one is
//! missing, [`Rig::start`] fails naming it and its install command: callers
//! that may skip decide so beforehand with [`crate::prereq::missing`].
//!
//! Set `HNA_RIG_KEEP=1` to keep the rig directory (logs, certificates,
//! leases) after the rig is dropped.

pub mod apiserver;
pub mod faultproxy;
pub mod forward;
pub mod manifests;
pub mod process;

use std::ffi::OsStr;
use std::fs;
use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;

pub use apiserver::{ApiServer, Binaries};

pub use crate::find_program;
use crate::prereq::Prereq;
use forward::Forwarder;
use process::{ChildProc, pid_alive, run, run_args, tail};

/// The rig's DHCP server (where the prerequisite check looks for it).
pub use crate::locate::DNSMASQ;
/// The LAN subnet.
pub const SUBNET: &str = "10.77.0.0/24";
/// `br0`'s MAC (locally administered), fixed for the rig's life.
pub const LAN_MAC: &str = "02:4e:41:00:00:01";
/// Address of `br0` in the LAN namespace (the DHCP server).
pub const LAN_ADDR: &str = "10.77.0.1";
/// The DHCP range's lease time unless [`RigOptions::lease_time`] says.
pub const DEFAULT_LEASE_TIME: &str = "1h";
/// First address dnsmasq hands out.
pub const DHCP_FIRST: &str = "10.77.0.100";
/// Last address dnsmasq hands out.
pub const DHCP_LAST: &str = "10.77.0.199";
/// First static address of a LAN host ([`Rig::add_lan_host`]), above the
/// DHCP range; the n-th host gets `.200 + n`.
pub const LAN_HOST_FIRST: Ipv4Addr = Ipv4Addr::new(10, 77, 0, 200);
/// How many LAN hosts fit (10.77.0.200–10.77.0.254).
pub const MAX_LAN_HOSTS: usize = 55;

/// A namespace on the LAN that is not a guest: a static address on its
/// `eth0`, no agent, no API server forwarding. For TCP clients and probers
/// that must reach a Service address from another machine on the LAN.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LanHost {
    /// The label given to [`Rig::add_lan_host`], for messages.
    pub name: String,
    /// Its network namespace (`hna-<id>-h<n>`).
    pub ns: String,
    /// Its address on `eth0` (a /24 in [`SUBNET`]).
    pub addr: Ipv4Addr,
}

/// Runs `f` on a new thread that has entered network namespace `ns`, with
/// its own single-threaded runtime (setns changes only that thread).
pub fn in_netns<R: Send>(ns: &str, f: impl AsyncFnOnce() -> R + Send) -> Result<R> {
    use std::os::fd::AsFd;
    let path = format!("/run/netns/{ns}");
    std::thread::scope(|s| {
        s.spawn(|| -> Result<R> {
            let f_ns = fs::File::open(&path).with_context(|| format!("open {path}"))?;
            nix::sched::setns(f_ns.as_fd(), nix::sched::CloneFlags::CLONE_NEWNET)
                .context("setns")?;
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()?;
            Ok(rt.block_on(f()))
        })
        .join()
        .map_err(|_| anyhow::anyhow!("netns thread panicked"))?
    })
}

/// What to start.
#[derive(Debug, Clone)]
pub struct RigOptions {
    /// Number of guest namespaces (each with an `eth0` on the LAN bridge).
    pub guests: usize,
    /// Run dnsmasq as DHCP server on the LAN.
    pub dhcp: bool,
    /// Run etcd + kube-apiserver (reachable from the host and every guest).
    pub apiserver: bool,
    /// Node name per guest; empty means `guest-1` … `guest-N`. When not
    /// empty it must have exactly `guests` entries.
    pub node_names: Vec<String>,
    /// More node names that get credentials ([`ApiServer::node_kubeconfig`])
    /// but no guest: nodes a bench simulates.
    pub credential_only_nodes: Vec<String>,
    /// Extra dnsmasq arguments, appended after the rig's own.
    pub dnsmasq_args: Vec<String>,
    /// Lease time of the rig's DHCP range in dnsmasq syntax (dnsmasq's
    /// minimum is `2m`); `None` means [`DEFAULT_LEASE_TIME`].
    pub lease_time: Option<String>,
}

impl RigOptions {
    /// What a rig with these options needs from the machine.
    pub fn prerequisites(&self) -> Vec<Prereq> {
        let mut needs = vec![Prereq::Root, Prereq::Iproute2];
        if self.dhcp {
            needs.push(Prereq::Dnsmasq);
        }
        if self.apiserver {
            needs.push(Prereq::ApiServer);
        }
        needs
    }
}

impl Default for RigOptions {
    /// Two guests, DHCP on, no API server.
    fn default() -> Self {
        RigOptions {
            guests: 2,
            dhcp: true,
            apiserver: false,
            node_names: Vec::new(),
            credential_only_nodes: Vec::new(),
            dnsmasq_args: Vec::new(),
            lease_time: None,
        }
    }
}

/// A running rig. Dropping it tears everything down (also while unwinding
/// from a panic): forwarders, kube-apiserver, etcd, dnsmasq, any process
/// left in the rig's namespaces, the namespaces and the rig directory.
pub struct Rig {
    id: String,
    lan_ns: String,
    guests: Vec<String>,
    node_names: Vec<String>,
    lan_hosts: Vec<LanHost>,
    /// Every namespace created so far, deleted on teardown.
    namespaces: Vec<String>,
    dir: PathBuf,
    keep: bool,
    dnsmasq: Option<ChildProc>,
    /// Lease time of the DHCP range (`RigOptions::lease_time`).
    lease_time: String,
    apiserver: Option<ApiServer>,
    forwarders: Vec<Forwarder>,
    /// The namespace inode of each deleted guest, until it is recreated:
    /// what names its holders if the kernel cannot destroy it.
    deleted: Vec<(usize, u64)>,
    torn_down: bool,
}

/// Who keeps the network namespace with inode `ino` alive: every process
/// with a thread in it or a file descriptor on it (`/proc`, best effort).
fn netns_holders(ino: u64) -> Vec<String> {
    let want = format!("net:[{ino}]");
    let mut out = Vec::new();
    for entry in fs::read_dir("/proc").into_iter().flatten().flatten() {
        let pid = entry.file_name().to_string_lossy().into_owned();
        if !pid.bytes().all(|b| b.is_ascii_digit()) {
            continue;
        }
        let comm = fs::read_to_string(entry.path().join("comm")).unwrap_or_default();
        let comm = comm.trim();
        let threads = fs::read_dir(entry.path().join("task"))
            .into_iter()
            .flatten()
            .flatten();
        for t in threads {
            if fs::read_link(t.path().join("ns/net")).is_ok_and(|l| l.to_string_lossy() == want) {
                out.push(format!(
                    "pid {pid} ({comm}) thread {}",
                    t.file_name().to_string_lossy()
                ));
            }
        }
        let fds = fs::read_dir(entry.path().join("fd"))
            .into_iter()
            .flatten()
            .flatten();
        for fd in fds {
            if fs::read_link(fd.path()).is_ok_and(|l| l.to_string_lossy() == want) {
                out.push(format!(
                    "pid {pid} ({comm}) fd {}",
                    fd.file_name().to_string_lossy()
                ));
            }
        }
    }
    out
}

/// Builds a kube client from a kubeconfig file (e.g.
/// [`ApiServer::admin_kubeconfig`]). Needs a Tokio runtime.
pub async fn kube_client(kubeconfig: &Path) -> Result<kube::Client> {
    use kube::config::{KubeConfigOptions, Kubeconfig};
    let kc = Kubeconfig::read_from(kubeconfig)
        .with_context(|| format!("read {}", kubeconfig.display()))?;
    let mut config =
        kube::Config::from_custom_kubeconfig(kc, &KubeConfigOptions::default()).await?;
    config.connect_timeout = Some(Duration::from_secs(5));
    config.read_timeout = Some(Duration::from_secs(30));
    Ok(kube::Client::try_from(config)?)
}

/// A new id, unique across threads and processes: `<pid>-<counter>-<random>`.
/// The pid comes first so [`cleanup_stale`] can tell whether the owner lives.
fn new_id() -> String {
    static COUNTER: AtomicUsize = AtomicUsize::new(0);
    format!(
        "{}-{}-{}",
        std::process::id(),
        COUNTER.fetch_add(1, Ordering::Relaxed),
        process::random_hex(2)
    )
}

/// The owner pid encoded in a namespace (`hna-<pid>-…`) or rig directory
/// (`hna-rig-<pid>-…`) name.
fn owner_pid(name: &str) -> Option<u32> {
    let rest = name
        .strip_prefix("hna-rig-")
        .or_else(|| name.strip_prefix("hna-"))?;
    rest.split('-').next()?.parse().ok()
}

/// Removes what rigs of dead processes left behind (e.g. after a test binary
/// was SIGKILLed): `hna-<pid>-*` namespaces whose pid no longer exists (after
/// killing the processes inside them), and `hna-rig-<pid>-*` directories in
/// the temp dir (after killing dnsmasq/etcd/kube-apiserver processes that
/// still use them; directories kept with `HNA_RIG_KEEP=1` stay). Called by
/// [`Rig::start`]; errors are printed, not returned.
pub fn cleanup_stale() {
    // First thaw what a paused guest of a dead run left frozen
    // (`failover::PausedGuest`, cgroup `hna-<pid>-<namespace>`): a frozen
    // process does not die of SIGKILL until it is thawed.
    let freezer = Path::new("/sys/fs/cgroup/freezer");
    for entry in fs::read_dir(freezer).into_iter().flatten().flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        match owner_pid(&name) {
            Some(pid) if name.starts_with("hna-") && !pid_alive(pid) => {
                eprintln!("rig: thawing and removing stale freezer cgroup {name}");
                let path = entry.path();
                let _ = fs::write(path.join("freezer.state"), "THAWED");
                let procs = fs::read_to_string(path.join("cgroup.procs")).unwrap_or_default();
                for p in procs.split_whitespace() {
                    let _ = fs::write(freezer.join("cgroup.procs"), p);
                }
                if let Err(e) = fs::remove_dir(&path) {
                    eprintln!("rig: cannot remove {}: {e}", path.display());
                }
            }
            _ => {}
        }
    }
    for entry in fs::read_dir("/run/netns").into_iter().flatten().flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        if !name.starts_with("hna-") || name.starts_with("hna-rig-") {
            continue;
        }
        match owner_pid(&name) {
            Some(pid) if !pid_alive(pid) => {
                eprintln!("rig: removing stale namespace {name}");
                kill_netns_processes(&name);
                if let Err(e) = run_args("ip", ["netns", "del", &name]) {
                    eprintln!("rig: {e:#}");
                }
            }
            _ => {}
        }
    }
    for entry in fs::read_dir(std::env::temp_dir())
        .into_iter()
        .flatten()
        .flatten()
    {
        let name = entry.file_name().to_string_lossy().into_owned();
        if !name.starts_with("hna-rig-") {
            continue;
        }
        match owner_pid(&name) {
            Some(pid) if !pid_alive(pid) => {
                let path = entry.path();
                kill_processes_using(&path);
                if !path.join(".keep").exists() {
                    eprintln!("rig: removing stale directory {}", path.display());
                    let _ = fs::remove_dir_all(&path);
                }
            }
            _ => {}
        }
    }
}

/// SIGKILLs dnsmasq, etcd, kube-apiserver and controller processes whose
/// command line mentions `dir`.
fn kill_processes_using(dir: &Path) {
    let needle = dir.to_string_lossy().into_owned();
    for entry in fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|s| s.parse::<i32>().ok())
        else {
            continue;
        };
        let comm = fs::read_to_string(entry.path().join("comm")).unwrap_or_default();
        // The controller replicas run in the root namespace with a
        // kubeconfig in the rig's folder (`comm` is cut at 15 bytes).
        if !matches!(
            comm.trim(),
            "dnsmasq" | "etcd" | "kube-apiserver" | "harvester-node-"
        ) {
            continue;
        }
        let cmdline = fs::read(entry.path().join("cmdline")).unwrap_or_default();
        if String::from_utf8_lossy(&cmdline).contains(&needle) {
            eprintln!("rig: killing stale {} (pid {pid})", comm.trim());
            let _ = kill(Pid::from_raw(pid), Signal::SIGKILL);
        }
    }
}

/// SIGKILLs every process in namespace `ns` and waits (up to 3 s) until
/// none is left.
fn kill_netns_processes(ns: &str) {
    let deadline = Instant::now() + Duration::from_secs(3);
    loop {
        let pids: Vec<i32> = run_args("ip", ["netns", "pids", ns])
            .unwrap_or_default()
            .split_whitespace()
            .filter_map(|p| p.parse().ok())
            .filter(|&p| p != std::process::id() as i32)
            .collect();
        if pids.is_empty() || Instant::now() > deadline {
            if !pids.is_empty() {
                eprintln!("rig: processes {pids:?} in {ns} survived SIGKILL");
            }
            return;
        }
        for pid in pids {
            let _ = kill(Pid::from_raw(pid), Signal::SIGKILL);
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

impl Rig {
    /// Starts the rig. A missing prerequisite
    /// ([`RigOptions::prerequisites`]) is an error naming it and the command
    /// that installs it; so is any failure after that, and whatever was
    /// started so far is torn down.
    pub fn start(opts: RigOptions) -> Result<Rig> {
        crate::prereq::require(&opts.prerequisites())?;
        let node_names = if opts.node_names.is_empty() {
            (1..=opts.guests).map(|i| format!("guest-{i}")).collect()
        } else if opts.node_names.len() == opts.guests {
            opts.node_names.clone()
        } else {
            bail!(
                "RigOptions: {} node names for {} guests",
                opts.node_names.len(),
                opts.guests
            );
        };
        cleanup_stale();

        let id = new_id();
        let dir = std::env::temp_dir().join(format!("hna-rig-{id}"));
        fs::create_dir(&dir).with_context(|| format!("create {}", dir.display()))?;
        let keep = std::env::var("HNA_RIG_KEEP").as_deref() == Ok("1");
        if keep {
            let _ = fs::write(dir.join(".keep"), "");
        }
        // From here on an early return drops `rig`, which tears down.
        let mut rig = Rig {
            lan_ns: format!("hna-{id}-lan"),
            guests: (1..=opts.guests)
                .map(|i| format!("hna-{id}-g{i}"))
                .collect(),
            id,
            node_names,
            lan_hosts: Vec::new(),
            namespaces: Vec::new(),
            dir,
            keep,
            dnsmasq: None,
            lease_time: opts
                .lease_time
                .clone()
                .unwrap_or_else(|| DEFAULT_LEASE_TIME.into()),
            apiserver: None,
            forwarders: Vec::new(),
            deleted: Vec::new(),
            torn_down: false,
        };
        rig.setup_network().context("set up rig network")?;
        if opts.dhcp {
            rig.start_dnsmasq(&opts.dnsmasq_args)
                .context("start dnsmasq")?;
        }
        if opts.apiserver {
            let bins = Binaries::find().map_err(|m| anyhow::anyhow!("missing {m}"))?;
            let credentials: Vec<String> = rig
                .node_names
                .iter()
                .chain(&opts.credential_only_nodes)
                .cloned()
                .collect();
            let api = ApiServer::start(&rig.dir, &rig.id, &bins, &credentials)
                .context("start kube-apiserver")?;
            let port = api.port();
            rig.apiserver = Some(api);
            for ns in rig.guests.clone() {
                let fwd = Forwarder::start(&ns, port)
                    .with_context(|| format!("forward 127.0.0.1:{port} into {ns}"))?;
                rig.forwarders.push(fwd);
            }
        }
        Ok(rig)
    }

    fn add_netns(&mut self, ns: &str) -> Result<()> {
        run_args("ip", ["netns", "add", ns])?;
        self.namespaces.push(ns.to_string());
        run_args("ip", ["-n", ns, "link", "set", "lo", "up"])?;
        Ok(())
    }

    fn setup_network(&mut self) -> Result<()> {
        let lan = self.lan_ns.clone();
        self.add_netns(&lan)?;
        let ip = |args: &[&str]| run_args("ip", args).map(|_| ());
        ip(&[
            "-n",
            &lan,
            "link",
            "add",
            "br0",
            "type",
            "bridge",
            "stp_state",
            "0",
            "forward_delay",
            "0",
        ])?;
        // A MAC of its own, as a LAN's gateway has: a bridge without one
        // takes its lowest port's, so a guest leaving (its veth deleted)
        // could change it, and every guest's ARP entry for the gateway,
        // the DHCP server and the API server on the LAN would point at a
        // MAC nobody has until it went stale (a guest's API path hung for
        // 10 s and more).
        ip(&["-n", &lan, "link", "set", "br0", "address", LAN_MAC])?;
        ip(&[
            "-n",
            &lan,
            "addr",
            "add",
            &format!("{LAN_ADDR}/24"),
            "dev",
            "br0",
        ])?;
        ip(&["-n", &lan, "link", "set", "br0", "up"])?;
        for (i, g) in self.guests.clone().iter().enumerate() {
            self.add_netns(g)?;
            let peer = format!("vg{}", i + 1);
            self.attach_to_bridge(g, &peer)?;
        }
        Ok(())
    }

    /// Creates veth `eth0` in `ns` whose peer `peer` (in the LAN namespace)
    /// is a port of `br0`, both up. Both ends are created directly in their
    /// namespaces: nothing ever appears in (or can clash with) the root
    /// namespace.
    fn attach_to_bridge(&self, ns: &str, peer: &str) -> Result<()> {
        let lan = &self.lan_ns;
        let ip = |args: &[&str]| run_args("ip", args).map(|_| ());
        ip(&[
            "link", "add", peer, "netns", lan, "type", "veth", "peer", "name", "eth0", "netns", ns,
        ])?;
        ip(&["-n", lan, "link", "set", peer, "master", "br0"])?;
        ip(&["-n", lan, "link", "set", peer, "up"])?;
        ip(&["-n", ns, "link", "set", "eth0", "up"])?;
        Ok(())
    }

    /// Adds a host on the LAN that is neither a guest nor the DHCP server:
    /// namespace `hna-<id>-h<n>` with `lo` up and `eth0` (peer `vh<n>` on
    /// `br0`) holding the static address `10.77.0.(200+n-1)/24`, outside
    /// the DHCP range. No agent runs there and it has no route to the API
    /// server. `name` only labels it. Torn down with the rig.
    pub fn add_lan_host(&mut self, name: &str) -> Result<LanHost> {
        let n = self.lan_hosts.len() + 1;
        if n > MAX_LAN_HOSTS {
            bail!("rig: no address left for LAN host {name:?} ({MAX_LAN_HOSTS} at most)");
        }
        let addr = Ipv4Addr::from(u32::from(LAN_HOST_FIRST) + (n as u32 - 1));
        let ns = format!("hna-{}-h{n}", self.id);
        let mut setup = || -> Result<()> {
            self.add_netns(&ns)?;
            self.attach_to_bridge(&ns, &format!("vh{n}"))?;
            run_args(
                "ip",
                [
                    "-n",
                    &ns,
                    "addr",
                    "add",
                    &format!("{addr}/24"),
                    "dev",
                    "eth0",
                ],
            )?;
            Ok(())
        };
        setup().with_context(|| format!("add LAN host {name:?} ({ns}, {addr})"))?;
        let host = LanHost {
            name: name.to_string(),
            ns,
            addr,
        };
        self.lan_hosts.push(host.clone());
        Ok(host)
    }

    /// A hypervisor host's bridge, as the field has it: bridge `name` in
    /// the LAN namespace, joined to the LAN's switch (`br0`) by a veth
    /// pair (`<name>-up` on the host's bridge, `<name>-sw` on the
    /// switch's port). Both bridges learn, and forget a MAC after 300 s
    /// (set here on both, Linux's default), so a MAC that moved hosts
    /// reaches its new port only once it sends from there. VMs' taps go on
    /// the bridge ([`crate::vm::node::Host`]). `name`: at most 12
    /// characters.
    ///
    /// The host's bridge is only a switch: it has no address and answers
    /// no ARP (`arp_ignore=8`, IPv6 off). It shares the LAN namespace with
    /// the LAN's own addresses (gateway, API server paths), and Linux
    /// answers ARP for any address of its namespace on any interface: a
    /// VM asking for the gateway after a migration was answered first by
    /// its new host's bridge, sent the gateway's traffic into that bridge
    /// (never across the switch, which so never learned the VM's NIC on
    /// its new port) and got the answers on the old port: no new
    /// connection for as long as the switch remembered (2 of 4 runs here,
    /// and CI).
    pub fn add_host_bridge(&self, name: &str) -> Result<()> {
        if name.len() > 12 {
            bail!("host bridge name {name:?} is longer than 12 characters");
        }
        let ns = self.lan_ns().to_string();
        let ip = |args: &[&str]| run_args("ip", ["-n", ns.as_str()].iter().chain(args));
        let (up, sw) = (format!("{name}-up"), format!("{name}-sw"));
        let setup = || -> Result<()> {
            ip(&[
                "link",
                "add",
                name,
                "type",
                "bridge",
                "ageing_time",
                "30000",
            ])?;
            ip(&[
                "link",
                "set",
                "br0",
                "type",
                "bridge",
                "ageing_time",
                "30000",
            ])?;
            let (arp, v6) = (
                format!("net.ipv4.conf.{name}.arp_ignore=8"),
                format!("net.ipv6.conf.{name}.disable_ipv6=1"),
            );
            run_args(
                "ip",
                [
                    "netns",
                    "exec",
                    ns.as_str(),
                    "sysctl",
                    "-q",
                    "-w",
                    arp.as_str(),
                    v6.as_str(),
                ],
            )?;
            ip(&["link", "add", &up, "type", "veth", "peer", "name", &sw])?;
            ip(&["link", "set", &up, "master", name])?;
            ip(&["link", "set", &sw, "master", "br0"])?;
            for l in [name, up.as_str(), sw.as_str()] {
                ip(&["link", "set", l, "up"])?;
            }
            Ok(())
        };
        setup().with_context(|| format!("add host bridge {name} in {ns}"))
    }

    /// The hosts added with [`Rig::add_lan_host`], in order.
    pub fn lan_hosts(&self) -> &[LanHost] {
        &self.lan_hosts
    }

    fn start_dnsmasq(&mut self, extra: &[String]) -> Result<()> {
        let d = &self.dir;
        let mut cmd = self.netns_cmd(&self.lan_ns, DNSMASQ);
        cmd.args([
            "--keep-in-foreground".to_string(),
            "--conf-file=/dev/null".into(),
            "--port=0".into(),
            "--no-ping".into(),
            "--no-resolv".into(),
            "--no-hosts".into(),
            "--user=root".into(),
            "--group=root".into(),
            "--interface=br0".into(),
            "--bind-interfaces".into(),
            format!(
                "--dhcp-range={DHCP_FIRST},{DHCP_LAST},255.255.255.0,{}",
                self.lease_time
            ),
            "--dhcp-authoritative".into(),
            format!("--dhcp-leasefile={}", self.leases_path().display()),
            format!("--pid-file={}", d.join("dnsmasq.pid").display()),
            "--log-dhcp".into(),
            format!("--log-facility={}", d.join("dnsmasq.log").display()),
        ]);
        cmd.args(extra);
        let mut proc = ChildProc::spawn("dnsmasq", cmd, &d.join("dnsmasq.out"))?;
        let pid = proc.pid().expect("just spawned");
        let deadline = Instant::now() + Duration::from_secs(10);
        // Ready once the process (after `ip netns exec` exec'd it) has its
        // DHCP socket (UDP port 67 = 0x0043) bound.
        loop {
            if let Some(status) = proc.exited() {
                let log = tail(&d.join("dnsmasq.log"), 20);
                return Err(proc
                    .exit_error(status)
                    .context(format!("dnsmasq.log:\n{log}")));
            }
            let comm = fs::read_to_string(format!("/proc/{pid}/comm")).unwrap_or_default();
            let udp = fs::read_to_string(format!("/proc/{pid}/net/udp")).unwrap_or_default();
            if comm.trim() == "dnsmasq" && udp.lines().any(|l| l.contains(":0043 ")) {
                break;
            }
            if Instant::now() > deadline {
                bail!("dnsmasq did not bind port 67 within 10 s");
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        self.dnsmasq = Some(proc);
        Ok(())
    }

    /// Stops dnsmasq (a DHCP server outage); its lease file stays.
    pub fn stop_dhcp(&mut self) {
        if let Some(mut d) = self.dnsmasq.take() {
            d.stop();
        }
    }

    /// Starts dnsmasq again (after [`Rig::stop_dhcp`]) with the same lease
    /// file and these extra arguments.
    pub fn start_dhcp(&mut self, extra: &[String]) -> Result<()> {
        self.stop_dhcp();
        self.start_dnsmasq(extra)
    }

    /// Unique id of this rig (`<pid>-<counter>-<random>`).
    pub fn id(&self) -> &str {
        &self.id
    }

    /// Namespace holding bridge `br0` (10.77.0.1/24) and dnsmasq.
    pub fn lan_ns(&self) -> &str {
        &self.lan_ns
    }

    /// Number of guests.
    pub fn guest_count(&self) -> usize {
        self.guests.len()
    }

    /// Namespace of guest `i` (0-based): `lo` up and a veth `eth0` (up, no
    /// address) whose peer `vg<i+1>` is a port of `br0`. If the rig has an
    /// API server, `127.0.0.1:<port>` in here reaches it.
    pub fn guest_ns(&self, i: usize) -> &str {
        &self.guests[i]
    }

    /// All guest namespaces, in order.
    pub fn guest_namespaces(&self) -> &[String] {
        &self.guests
    }

    /// Node name of guest `i` (0-based).
    pub fn node_name(&self, i: usize) -> &str {
        &self.node_names[i]
    }

    /// All node names, in guest order.
    pub fn node_names(&self) -> &[String] {
        &self.node_names
    }

    /// `ip netns exec <ns> <program>`; add arguments with `.arg(..)`.
    pub fn netns_cmd(&self, ns: &str, program: impl AsRef<OsStr>) -> Command {
        let mut cmd = Command::new("ip");
        cmd.args(["netns", "exec", ns]).arg(program);
        cmd
    }

    /// `"10.77.0.0/24"`. DHCP hands out 10.77.0.100–10.77.0.199 with a 1 h
    /// lease (dnsmasq `--port=0 --no-ping --dhcp-authoritative`, which sends
    /// options 58/59).
    pub fn subnet(&self) -> &str {
        SUBNET
    }

    /// Path of dnsmasq's lease file.
    pub fn leases_path(&self) -> PathBuf {
        self.dir.join("dnsmasq.leases")
    }

    /// Contents of dnsmasq's lease file (empty before the first lease).
    pub fn dnsmasq_leases(&self) -> Result<String> {
        match fs::read_to_string(self.leases_path()) {
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(String::new()),
            r => Ok(r?),
        }
    }

    /// dnsmasq's log (`--log-dhcp`).
    pub fn dnsmasq_log(&self) -> PathBuf {
        self.dir.join("dnsmasq.log")
    }

    /// The API server, if the rig was started with `apiserver: true`.
    pub fn apiserver(&self) -> Option<&ApiServer> {
        self.apiserver.as_ref()
    }

    /// The API server, mutable (e.g. to stop it in a failure test).
    pub fn apiserver_mut(&mut self) -> Option<&mut ApiServer> {
        self.apiserver.as_mut()
    }

    /// Per-rig directory (logs, certificates, kubeconfigs, leases); removed
    /// on drop unless `HNA_RIG_KEEP=1`.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Pids of the child processes the rig runs (dnsmasq, kube-apiserver,
    /// etcd).
    pub fn pids(&self) -> Vec<u32> {
        let mut pids: Vec<u32> = self.dnsmasq.iter().filter_map(|p| p.pid()).collect();
        if let Some(api) = &self.apiserver {
            pids.extend(api.pids());
        }
        pids
    }

    /// Guest `i` dies with everything in it, as a VM that is switched off:
    /// every process in its namespace is killed, its API forwarder stops
    /// and the namespace is deleted, which destroys its links (its `eth0`,
    /// whose LAN peer goes too, and every macvlan on it). Returns once the
    /// namespace is unmounted; the kernel destroys it, links and all, a
    /// little later ([`Rig::recreate_guest`] waits for that).
    pub fn delete_guest(&mut self, i: usize) -> Result<()> {
        let ns = self.guests[i].clone();
        if let Some(f) = self.forwarders.iter_mut().find(|f| f.netns() == ns) {
            f.stop();
        }
        kill_netns_processes(&ns);
        // Its NIC leaves the bridge at once, as a switched-off VM's tap
        // does: deleting the LAN end deletes the pair (and the macvlans on
        // the guest's end). The namespace itself the kernel destroys later,
        // once nothing refers to it; until then, with its uplink still on
        // the bridge, its addresses would still answer.
        let _ = run_args(
            "ip",
            [
                "-n",
                self.lan_ns.as_str(),
                "link",
                "del",
                &format!("vg{}", i + 1),
            ],
        );
        if let Ok(meta) = fs::metadata(format!("/run/netns/{ns}")) {
            use std::os::unix::fs::MetadataExt;
            self.deleted.retain(|(g, _)| *g != i);
            self.deleted.push((i, meta.ino()));
        }
        run(Command::new("ip").args(["netns", "del", &ns]))?;
        self.namespaces.retain(|n| *n != ns);
        Ok(())
    }

    /// A new guest joins in the place of deleted guest `i`
    /// ([`Rig::delete_guest`]), as a fresh VM with the same node name: a
    /// new namespace of the same name, its `eth0` on the bridge through a
    /// new peer of the same name, the API server's port forwarded into it.
    pub fn recreate_guest(&mut self, i: usize) -> Result<()> {
        let ns = self.guests[i].clone();
        // `ip netns del` only unmounts the namespace: the kernel destroys
        // it, and with it the old uplink's LAN peer, later, on a work queue
        // (seconds under load). A new peer of that name must wait for it.
        let peer = format!("vg{}", i + 1);
        let deadline = Instant::now() + Duration::from_secs(30);
        while run_args("ip", ["-n", self.lan_ns.as_str(), "link", "show", &peer]).is_ok() {
            if Instant::now() > deadline {
                let holders = self
                    .deleted
                    .iter()
                    .find(|(g, _)| *g == i)
                    .map(|(_, ino)| netns_holders(*ino))
                    .unwrap_or_default();
                bail!(
                    "{peer}, the LAN peer of deleted guest {ns}'s uplink, is still in {} 30 s after the namespace was deleted; what holds the old namespace: {holders:?} (none listed: a socket or a kernel reference)",
                    self.lan_ns
                );
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        self.deleted.retain(|(g, _)| *g != i);
        self.add_netns(&ns)?;
        self.reattach_uplink(i)?;
        if let Some(api) = &self.apiserver {
            let port = api.port();
            self.forwarders.retain(|f| f.netns() != ns);
            let fwd = Forwarder::start(&ns, port)
                .with_context(|| format!("forward 127.0.0.1:{port} into {ns}"))?;
            self.forwarders.push(fwd);
        }
        Ok(())
    }

    /// Guest `i` loses its way to the API server and nothing else: its
    /// forwarder stops and every connection through it is cut, its LAN is
    /// untouched (a broken route to the control plane, a firewall change).
    /// [`Rig::restore_api`] undoes it.
    pub fn cut_api(&mut self, i: usize) {
        let ns = self.guests[i].clone();
        for f in self.forwarders.iter_mut().filter(|f| f.netns() == ns) {
            f.stop();
        }
        self.forwarders.retain(|f| f.netns() != ns);
    }

    /// Guest `i` reaches the API server again after [`Rig::cut_api`].
    pub fn restore_api(&mut self, i: usize) -> Result<()> {
        let ns = self.guests[i].clone();
        if let Some(api) = &self.apiserver {
            let port = api.port();
            let fwd = Forwarder::start(&ns, port)
                .with_context(|| format!("forward 127.0.0.1:{port} into {ns}"))?;
            self.forwarders.push(fwd);
        }
        Ok(())
    }

    /// Guest `i`'s `eth0` made again after it was deleted (`ip link del
    /// eth0` deletes its LAN peer too): a new veth pair with the same
    /// names, both ends up, the peer on the bridge. No address.
    pub fn reattach_uplink(&self, i: usize) -> Result<()> {
        self.attach_to_bridge(&self.guests[i], &format!("vg{}", i + 1))
    }

    /// Tears everything down (what drop does). Idempotent; never panics.
    pub fn teardown(&mut self) {
        if self.torn_down {
            return;
        }
        self.torn_down = true;
        for f in &mut self.forwarders {
            f.stop();
        }
        self.forwarders.clear();
        if let Some(mut api) = self.apiserver.take() {
            api.stop();
        }
        if let Some(mut d) = self.dnsmasq.take() {
            d.stop();
        }
        for ns in self.namespaces.drain(..).rev() {
            kill_netns_processes(&ns);
            if let Err(e) = run(Command::new("ip").args(["netns", "del", &ns])) {
                eprintln!("rig: {e:#}");
            }
        }
        if self.keep {
            eprintln!("rig: kept {} (HNA_RIG_KEEP=1)", self.dir.display());
        } else if let Err(e) = fs::remove_dir_all(&self.dir) {
            eprintln!("rig: cannot remove {}: {e}", self.dir.display());
        }
    }
}

impl Drop for Rig {
    fn drop(&mut self) {
        self.teardown();
    }
}
