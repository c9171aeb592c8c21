//! The peers this project is measured beside, run in the rig as plain
//! processes (issue #19): kube-vip in DHCP mode, one `kube-vip manager` per
//! guest namespace, against the same LAN, DHCP server and API server as our
//! agents.
//!
//! They are built from the Go module proxy by `tests/rig/peers.sh` and
//! cached by version outside the checkout ([`PEERS_DIR`]); nothing of
//! their code is in this repository.
//!
//! [`SystemRig`] serves DHCP Services with one system (ours or kube-vip)
//! and [`fail_over`] measures a fault to the holder the same way for each:
//! the guests' kernels, ARP and TCP from the LAN (`benches/peers.rs`).

use std::fs;
use std::net::Ipv4Addr;
use std::path::PathBuf;
use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;

use crate::lb::LbRig;

pub mod harvester_ccm;
pub mod metallb;
pub use crate::locate::peers::{INSTALL, KUBE_VIP_VERSION, METALLB_VERSION, PEERS_DIR};
pub use metallb::MetalLb;

/// kube-vip's leader-election timings (seconds): per Service, the holder
/// renews a Lease; another instance takes over when it expires.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LeaseTimings {
    pub duration: u32,
    pub renew_deadline: u32,
    pub retry_period: u32,
}

impl LeaseTimings {
    /// kube-vip's defaults (`vip_leaseduration` 15, `vip_renewdeadline`
    /// 10, `vip_retryperiod` 2).
    pub const DEFAULT: LeaseTimings = LeaseTimings {
        duration: 15,
        renew_deadline: 10,
        retry_period: 2,
    };
    /// What kube-vip's own manifests and end-to-end tests run with (5, 3,
    /// 1), the tuning its users are pointed at.
    pub const TUNED: LeaseTimings = LeaseTimings {
        duration: 5,
        renew_deadline: 3,
        retry_period: 1,
    };
}

/// One `kube-vip manager` per guest, in DHCP mode (a Service asking for
/// `0.0.0.0`), ARP, with per-Service leader election, as the Harvester
/// cloud provider's chart runs it. Killed when dropped.
pub struct KubeVip {
    bin: PathBuf,
    timings: LeaseTimings,
    procs: Vec<Option<Child>>,
    logs: PathBuf,
}

impl KubeVip {
    pub fn new(lb: &LbRig, timings: LeaseTimings) -> Result<KubeVip> {
        let bin = crate::locate::peers::kube_vip()
            .map_err(|what| anyhow::anyhow!("{what}: build and cache it with `{INSTALL}`"))?;
        let logs = lb.rig.dir().join("kube-vip");
        fs::create_dir_all(&logs)?;
        Ok(KubeVip {
            bin,
            timings,
            procs: (0..lb.rig.guest_namespaces().len()).map(|_| None).collect(),
            logs,
        })
    }

    fn log_path(&self, i: usize) -> PathBuf {
        self.logs.join(format!("guest-{i}.log"))
    }

    /// The tail of guest `i`'s kube-vip log.
    pub fn log_tail(&self, i: usize, lines: usize) -> String {
        let text = fs::read_to_string(self.log_path(i)).unwrap_or_default();
        let all: Vec<&str> = text.lines().collect();
        all[all.len().saturating_sub(lines)..].join("\n")
    }

    /// Starts kube-vip in guest `i`, as node `lb.node_name(i)`, with the
    /// admin kubeconfig (the chart's ClusterRole is wider than any test
    /// needs) through the guest's uplink as our agent's, on `eth0`, metrics
    /// off.
    pub fn start(&mut self, lb: &LbRig, i: usize) -> Result<()> {
        if self.procs[i].is_some() {
            bail!("kube-vip already runs in guest {i}");
        }
        let log = fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.log_path(i))?;
        let t = self.timings;
        let child = lb
            .rig
            .netns_cmd(lb.rig.guest_ns(i), &self.bin)
            .args(["manager", "--prometheusHTTPServer="])
            .env("vip_arp", "true")
            .env("vip_interface", "eth0")
            .env("svc_enable", "true")
            .env("svc_election", "true")
            .env("vip_nodename", lb.node_name(i))
            .env("k8s_config_file", lb.guest_admin_kubeconfig(i)?)
            .env("vip_leaseduration", t.duration.to_string())
            .env("vip_renewdeadline", t.renew_deadline.to_string())
            .env("vip_retryperiod", t.retry_period.to_string())
            .env("vip_loglevel", "0")
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()
            .with_context(|| format!("starting {}", self.bin.display()))?;
        self.procs[i] = Some(child);
        Ok(())
    }

    /// An error with its log's tail for every instance that exited on its
    /// own (kube-vip exits on a bad setting or a lost API): what a test
    /// that timed out waiting on kube-vip says first.
    pub fn check_running(&mut self) -> Result<()> {
        let mut dead = Vec::new();
        for i in 0..self.procs.len() {
            if let Some(st) = reap_exited(&mut self.procs[i]) {
                dead.push(format!(
                    "kube-vip in guest {i} exited ({st}):\n{}",
                    self.log_tail(i, 30)
                ));
            }
        }
        if dead.is_empty() {
            Ok(())
        } else {
            bail!("{}", dead.join("\n"))
        }
    }

    /// Starts kube-vip in every guest.
    pub fn start_all(&mut self, lb: &LbRig) -> Result<()> {
        for i in 0..self.procs.len() {
            self.start(lb, i)?;
        }
        Ok(())
    }

    /// Guest `i`'s kube-vip's pid, while it runs (`ip netns exec` execs it).
    pub fn pid(&self, i: usize) -> Option<u32> {
        self.procs.get(i)?.as_ref().map(|c| c.id())
    }

    /// Sends `signal` and waits (up to 20 s) for it to exit; SIGKILL after
    /// that.
    pub fn stop(&mut self, i: usize, signal: Signal) {
        if let Some(child) = self.procs[i].take() {
            stop_child(child, signal, &format!("kube-vip in guest {i}"));
        }
    }

    /// Sends `signal` to guest `i`'s kube-vip and returns at once (a pod's
    /// SIGTERM: Kubernetes waits its grace period, 30 s by default, before
    /// SIGKILL; the process is reaped by [`KubeVip::stop`] or on drop).
    pub fn signal(&self, i: usize, signal: Signal) {
        if let Some(c) = &self.procs[i] {
            let _ = kill(Pid::from_raw(c.id() as i32), signal);
        }
    }

    /// Guest `i` was deleted with its kube-vip: nothing to stop there.
    pub fn forget(&mut self, i: usize) {
        if let Some(c) = self.procs[i].take() {
            kill_now(c);
        }
    }

    /// Stops every instance at once with SIGTERM, as a DaemonSet's pods are
    /// stopped when it is deleted, and waits (up to 20 s, then SIGKILL) for
    /// all of them. One at a time, the ones still running would take over
    /// the stopped ones' Services, each with its own MAC and lease.
    pub fn stop_all(&mut self) {
        for c in self.procs.iter().flatten() {
            let _ = kill(Pid::from_raw(c.id() as i32), Signal::SIGTERM);
        }
        let deadline = Instant::now() + Duration::from_secs(20);
        for i in 0..self.procs.len() {
            let Some(mut child) = self.procs[i].take() else {
                continue;
            };
            loop {
                if let Ok(Some(_)) = child.try_wait() {
                    break;
                }
                if Instant::now() > deadline {
                    eprintln!("kube-vip in guest {i} ignored SIGTERM for 20 s: SIGKILL");
                    kill_now(child);
                    break;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
        }
    }
}

impl Drop for KubeVip {
    fn drop(&mut self) {
        self.procs
            .iter_mut()
            .filter_map(Option::take)
            .for_each(kill_now);
    }
}

/// The exit status of the process in `slot` if it has exited, which then
/// leaves the slot empty.
fn reap_exited(slot: &mut Option<Child>) -> Option<std::process::ExitStatus> {
    let status = slot.as_mut()?.try_wait().ok().flatten()?;
    *slot = None;
    Some(status)
}

/// Kills a peer's process at once and reaps it.
fn kill_now(mut child: Child) {
    let _ = child.kill();
    let _ = child.wait();
}

/// Sends `signal` to a peer's process and waits (up to 20 s) for it to
/// exit; SIGKILL after that, saying so with `what`.
fn stop_child(mut child: Child, signal: Signal, what: &str) {
    let _ = kill(Pid::from_raw(child.id() as i32), signal);
    let deadline = Instant::now() + Duration::from_secs(20);
    while Instant::now() < deadline {
        if let Ok(Some(_)) = child.try_wait() {
            return;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    eprintln!("{what} ignored {signal} for 20 s: SIGKILL");
    kill_now(child);
}

/// A load balancer measured in the rig: ours, kube-vip with some lease
/// timings, or MetalLB.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum System {
    Ours,
    /// Ours with `lb_arp_probe = false`: no RFC 5227 probe of a new
    /// lease's address before it is used (neither peer probes).
    OursWithoutArpProbe,
    KubeVip(LeaseTimings),
    /// kube-vip with its default lease timings, and Services whose
    /// endpoints are none ready but that say
    /// `kube-vip.io/allow-reconcile-without-endpoints` (since v1.2 kube-vip
    /// serves a Service only once a ready endpoint exists, unless it says
    /// so).
    KubeVipWithoutEndpoints,
    /// MetalLB in layer-2 mode, its speakers' memberlist on: a static pool
    /// instead of DHCP ([`metallb`]).
    MetalLb,
}

impl System {
    pub fn label(self) -> String {
        match self {
            System::Ours => "harvester-node-agent".into(),
            System::OursWithoutArpProbe => "harvester-node-agent (lb_arp_probe = false)".into(),
            System::KubeVip(t) if t == LeaseTimings::DEFAULT => {
                format!(
                    "kube-vip {KUBE_VIP_VERSION} (default leases {}/{}/{} s)",
                    t.duration, t.renew_deadline, t.retry_period
                )
            }
            System::KubeVip(t) => format!(
                "kube-vip {KUBE_VIP_VERSION} (tuned leases {}/{}/{} s)",
                t.duration, t.renew_deadline, t.retry_period
            ),
            System::KubeVipWithoutEndpoints => format!(
                "kube-vip {KUBE_VIP_VERSION} (default leases, no ready endpoint, allow-reconcile-without-endpoints)"
            ),
            System::MetalLb => format!("MetalLB {METALLB_VERSION} (layer 2, static pool)"),
        }
    }

    /// Measured in the first fault row only: what makes it differ from
    /// another system acts before any fault (the ARP probe of a new
    /// lease; kube-vip's start without a ready endpoint).
    pub fn first_row_only(self) -> bool {
        matches!(
            self,
            System::OursWithoutArpProbe | System::KubeVipWithoutEndpoints
        )
    }

    /// Our agents and controller, however configured.
    pub fn is_ours(self) -> bool {
        matches!(self, System::Ours | System::OursWithoutArpProbe)
    }

    /// kube-vip's lease timings, if it is kube-vip.
    fn kube_vip(self) -> Option<LeaseTimings> {
        match self {
            System::KubeVip(t) => Some(t),
            System::KubeVipWithoutEndpoints => Some(LeaseTimings::DEFAULT),
            _ => None,
        }
    }
}

/// What is done to a Service's holder, the same way for every system.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HolderFault {
    /// Its node agent (ours, or kube-vip's pod) gets SIGTERM.
    Graceful,
    /// Its node agent gets SIGKILL (a crash, an OOM kill).
    Killed,
    /// Its uplink loses carrier.
    CablePulled,
    /// Its uplink is set down by its owner (`ip link set eth0 down`).
    UplinkSetDown,
    /// Its VM is gone: the namespace deleted with everything in it.
    GuestDeleted,
    /// `GuestDeleted`, and the controller leader killed at the same moment
    /// (ours; kube-vip has no controller: its per-Service leader is the
    /// holder itself, so this is `GuestDeleted` for it).
    LeaderAndHolder,
    /// Its node agent restarted (SIGTERM, then started again at once, as
    /// `systemctl restart` or a pod's rollout): the address should stay.
    Restarted,
}

impl HolderFault {
    pub const ALL: [HolderFault; 7] = [
        HolderFault::Restarted,
        HolderFault::Graceful,
        HolderFault::Killed,
        HolderFault::CablePulled,
        HolderFault::UplinkSetDown,
        HolderFault::GuestDeleted,
        HolderFault::LeaderAndHolder,
    ];

    pub fn label(self) -> &'static str {
        match self {
            HolderFault::Graceful => "holder's agent stopped (SIGTERM)",
            HolderFault::Killed => "holder's agent killed (SIGKILL)",
            HolderFault::CablePulled => "holder's uplink loses carrier",
            HolderFault::UplinkSetDown => "holder's uplink set down",
            HolderFault::GuestDeleted => "holder's namespace deleted",
            HolderFault::LeaderAndHolder => "leader killed + namespace deleted",
            HolderFault::Restarted => "holder's agent restarted",
        }
    }
}

/// The Service [`SystemRig::start`] serves before it returns.
pub const WARM_UP: &str = "warm-up";

/// The rig with one system serving DHCP Services.
///
/// Fields drop in order: the peers stop before the rig, so that its
/// kube-apiserver stops with no client connected (with clients it waits
/// out its grace period and is killed).
pub struct SystemRig {
    pub system: System,
    kube_vip: Option<KubeVip>,
    metallb: Option<MetalLb>,
    pub lb: LbRig,
}

impl SystemRig {
    pub fn start(system: System, bin: &str, manifests: PathBuf) -> Result<SystemRig> {
        SystemRig::start_on(system, bin, manifests, false)
    }

    /// [`SystemRig::start`] on a wide LAN ([`crate::lb::Options::wide_lan`]):
    /// DHCP and MetalLB's pool have addresses for hundreds of Services.
    pub fn start_wide(system: System, bin: &str, manifests: PathBuf) -> Result<SystemRig> {
        SystemRig::start_on(system, bin, manifests, true)
    }

    fn start_on(system: System, bin: &str, manifests: PathBuf, wide: bool) -> Result<SystemRig> {
        let mut opts = crate::lb::Options::new(bin, manifests);
        opts.endpoint_slices = true;
        opts.wide_lan = wide;
        opts.start_ours = system.is_ours();
        if system == System::OursWithoutArpProbe {
            opts.agent_config = "lb_arp_probe = false\n".into();
        }
        let lb = LbRig::start(opts)?;
        let kube_vip = match system.kube_vip() {
            Some(t) => {
                let mut kv = KubeVip::new(&lb, t)?;
                kv.start_all(&lb)?;
                Some(kv)
            }
            None => None,
        };
        let metallb = match system {
            System::MetalLb => {
                let mut m = MetalLb::install(&lb)?;
                m.start_all(&lb)?;
                Some(m)
            }
            _ => None,
        };
        let mut sr = SystemRig {
            system,
            lb,
            kube_vip,
            metallb,
        };
        // Ready before anything is timed: a first Service served (our
        // agents register and heartbeat, kube-vip's instances watch).
        sr.serve(WARM_UP)
            .with_context(|| format!("{}: the warm-up Service", system.label()))?;
        Ok(sr)
    }

    /// A DHCP Service as the Harvester cloud provider writes it, with ready
    /// endpoints on two nodes (kube-vip elects only once a slice names an
    /// endpoint; the third node's endpoint is not ready, so that no slice
    /// is empty: kube-vip reads each slice alone). With
    /// [`System::KubeVipWithoutEndpoints`], no endpoints and kube-vip's
    /// annotation that it may serve the Service without: no endpoint ready.
    pub fn create_service(&self, name: &str) -> Result<()> {
        let mut annotations = vec![
            (crate::failover::IPAM, "dhcp"),
            ("kube-vip.io/loadbalancerIPs", "0.0.0.0"),
        ];
        if self.system == System::KubeVipWithoutEndpoints {
            annotations.push(("kube-vip.io/allow-reconcile-without-endpoints", "true"));
            // Slices as the cluster's controller writes them for Pods not
            // ready yet: kube-vip acts on a slice's event, and with no
            // slice at all it never did.
            self.lb.set_endpoints(name, &[])?;
        } else {
            let nodes: Vec<String> = (0..2).map(|i| self.lb.node_name(i)).collect();
            self.lb.set_endpoints(name, &nodes)?;
        }
        self.lb
            .create_service(name, &annotations, &[crate::lb::LISTEN_PORT])?;
        Ok(())
    }

    /// The guests whose kernel holds `ip` (on any link: ours are `hlb-*`,
    /// kube-vip's `vip-*`); with MetalLB, which puts the address on no
    /// interface, the guests whose MAC answers ARP for it.
    pub fn holders(&self, ip: Ipv4Addr) -> Vec<usize> {
        if self.metallb.is_some() {
            return arp_answerers(&self.lb, ip).unwrap_or_default();
        }
        let mut guests: Vec<usize> = links_holding(&self.lb, ip)
            .into_iter()
            .map(|(g, _)| g)
            .collect();
        guests.dedup();
        guests
    }

    /// What to show when a system did not do what was waited for.
    fn diagnostics(&mut self) -> String {
        if let Some(m) = &mut self.metallb {
            let dead = m
                .check_running()
                .err()
                .map(|e| format!("{e:#}\n"))
                .unwrap_or_default();
            let mut tails = vec![format!(
                "--- MetalLB controller:\n{}",
                m.log_tail("controller", 15)
            )];
            tails.extend((0..self.lb.rig.guest_namespaces().len()).map(|i| {
                format!(
                    "--- MetalLB speaker {i}:\n{}",
                    m.log_tail(&format!("speaker-{i}"), 15)
                )
            }));
            return format!("{dead}{}", tails.join("\n"));
        }
        match &mut self.kube_vip {
            Some(kv) => {
                let dead = kv
                    .check_running()
                    .err()
                    .map(|e| format!("{e:#}\n"))
                    .unwrap_or_default();
                let tails: Vec<String> = (0..self.lb.rig.guest_namespaces().len())
                    .map(|i| format!("--- kube-vip guest {i}:\n{}", kv.log_tail(i, 15)))
                    .collect();
                format!("{dead}{}", tails.join("\n"))
            }
            None => self.lb.diagnostics(),
        }
    }

    /// Creates Service `name` and times it: to its address in the status,
    /// and to the first TCP answer from a LAN client at that address. Then
    /// waits until exactly one guest holds it; returns the address and
    /// that guest too.
    pub fn serve(&mut self, name: &str) -> Result<Served> {
        let t0 = Instant::now();
        self.create_service(name)?;
        let within = Duration::from_secs(90);
        let Some(ip) = crate::lb::wait_for(within, || self.lb.ingress_ip(name)) else {
            bail!(
                "{}: {name} got no address within {within:?}\n{}",
                self.system.label(),
                self.diagnostics()
            );
        };
        let to_status = t0.elapsed();
        if let Some(m) = &self.metallb {
            m.route_to_nodes(&self.lb, ip)?;
        }
        let client = self.lb.client_ns.clone();
        let Some(_) = crate::lb::wait_for(within, || {
            crate::tcpprobe::ask_from(&client, ip, crate::lb::LISTEN_PORT)
        }) else {
            bail!(
                "{}: {ip} answered no TCP within {within:?}",
                self.system.label()
            );
        };
        let to_tcp = t0.elapsed();
        let Some(holder) = crate::lb::wait_for(Duration::from_secs(30), || {
            let h = self.holders(ip);
            (h.len() == 1).then(|| h[0])
        }) else {
            bail!(
                "{}: {ip} never on exactly one guest: {:?}",
                self.system.label(),
                self.holders(ip)
            );
        };
        Ok(Served {
            ip,
            holder,
            to_status,
            to_tcp,
        })
    }

    /// Does `fault` to guest `g`, the holder.
    pub fn fault(&mut self, g: usize, fault: HolderFault) -> Result<()> {
        use HolderFault::*;
        if let Some(m) = self.metallb.as_mut() {
            match fault {
                Graceful => m.signal(g, Signal::SIGTERM),
                Killed => m.stop(g, Signal::SIGKILL),
                Restarted => {
                    m.stop(g, Signal::SIGTERM);
                    m.start_speaker(&self.lb, g)?;
                }
                CablePulled => crate::failover::set_cable(&self.lb, g, false)?,
                UplinkSetDown => crate::failover::set_uplink(&self.lb, g, false)?,
                GuestDeleted | LeaderAndHolder => {
                    if fault == LeaderAndHolder {
                        m.kill_controller();
                    }
                    m.forget(g);
                    self.lb.delete_guest(g)?;
                }
            }
            return Ok(());
        }
        match (fault, self.kube_vip.as_mut()) {
            (Graceful, None) => {
                let st = self.lb.stop_agent(g);
                anyhow::ensure!(st.success(), "the agent's stop: {st}");
            }
            (Graceful, Some(kv)) => kv.signal(g, Signal::SIGTERM),
            (Killed, None) => self.lb.signal_agent(g, Signal::SIGKILL),
            (Killed, Some(kv)) => kv.stop(g, Signal::SIGKILL),
            (Restarted, None) => {
                let st = self.lb.stop_agent(g);
                anyhow::ensure!(st.success(), "the agent's stop: {st}");
                self.lb.start_agent(g)?;
            }
            (Restarted, Some(kv)) => {
                kv.stop(g, Signal::SIGTERM);
                kv.start(&self.lb, g)?;
            }
            (CablePulled, _) => crate::failover::set_cable(&self.lb, g, false)?,
            (UplinkSetDown, _) => crate::failover::set_uplink(&self.lb, g, false)?,
            (GuestDeleted | LeaderAndHolder, kv) => {
                if fault == LeaderAndHolder && kv.is_none() {
                    let leader = crate::lb::wait_for(Duration::from_secs(30), || self.lb.leader())
                        .context("no controller leads")?;
                    if let Some(c) = (0..2).find(|&i| LbRig::controller_identity(i) == leader) {
                        self.lb.kill_controller(c);
                    }
                }
                if let Some(kv) = kv {
                    kv.forget(g);
                }
                self.lb.delete_guest(g)?;
            }
        }
        Ok(())
    }
}

/// A system at rest with many Services: what it costs the API server and
/// the nodes.
#[derive(Debug, Clone)]
pub struct Steady {
    pub services: usize,
    /// Writes (POST, PUT, PATCH, DELETE) the API server counted per second
    /// over the window, from everyone: the API server's own (its identity
    /// Lease) included, the bench's none.
    pub writes_per_s: f64,
    pub window: Duration,
    /// VmRSS of each node's process (our agent, kube-vip, MetalLB's
    /// speaker), KiB.
    pub node_rss_kib: Vec<u64>,
    /// VmRSS of each central process (our controllers, MetalLB's
    /// controller; kube-vip has none), KiB.
    pub central_rss_kib: Vec<u64>,
}

impl SystemRig {
    /// Serves `services` more Services, waits until every one has its
    /// address, lets the system settle for 10 s, and measures it over
    /// `window`.
    pub fn steady(&mut self, services: usize, window: Duration) -> Result<Steady> {
        let names: Vec<String> = (0..services).map(|i| format!("steady-{i}")).collect();
        for name in &names {
            self.create_service(name)?;
        }
        let within = Duration::from_secs(180);
        for name in &names {
            if crate::lb::wait_for(within, || self.lb.ingress_ip(name)).is_none() {
                bail!(
                    "{}: {name} got no address within {within:?}\n{}",
                    self.system.label(),
                    self.diagnostics()
                );
            }
        }
        // At rest: not the burst of the last Services' first writes.
        std::thread::sleep(Duration::from_secs(10));
        let before = self.api_writes()?;
        let t0 = Instant::now();
        std::thread::sleep(window);
        let writes = self.api_writes()? - before;
        let elapsed = t0.elapsed();
        let guests = self.lb.rig.guest_namespaces().len();
        let (node_pids, central_pids): (Vec<Option<u32>>, Vec<Option<u32>>) =
            match (&self.kube_vip, &self.metallb) {
                (Some(kv), _) => ((0..guests).map(|i| kv.pid(i)).collect(), vec![]),
                (_, Some(m)) => (
                    (0..guests).map(|i| m.speaker_pid(i)).collect(),
                    vec![m.controller_pid()],
                ),
                _ => (
                    (0..guests).map(|i| self.lb.agent_pid(i)).collect(),
                    (0..2).map(|i| self.lb.controller_pid(i)).collect(),
                ),
            };
        let rss = |pids: Vec<Option<u32>>| -> Result<Vec<u64>> {
            pids.into_iter()
                .map(|p| {
                    let pid = p.context("a process is not running")?;
                    vm_rss_kib(pid)
                })
                .collect()
        };
        Ok(Steady {
            services,
            writes_per_s: writes / elapsed.as_secs_f64(),
            window: elapsed,
            node_rss_kib: rss(node_pids)?,
            central_rss_kib: rss(central_pids)?,
        })
    }

    /// The API server's count of writes so far (`apiserver_request_total`
    /// of the writing verbs, from its `/metrics`).
    fn api_writes(&self) -> Result<f64> {
        let client = self.lb.admin();
        let req = kube::core::Request::new("/metrics")
            .list(&Default::default())
            .context("building the /metrics request")?;
        let text = self
            .lb
            .block_on(client.request_text(req))
            .context("reading the API server's /metrics")?;
        Ok(write_count(&text))
    }
}

/// The sum of `apiserver_request_total` over the writing verbs in a
/// Prometheus text exposition.
pub fn write_count(metrics: &str) -> f64 {
    let samples = crate::promtext::parse(metrics);
    crate::promtext::sum(
        &samples,
        "apiserver_request_total",
        crate::promtext::is_write,
    )
}

/// A process's VmRSS in KiB.
fn vm_rss_kib(pid: u32) -> Result<u64> {
    let status = fs::read_to_string(format!("/proc/{pid}/status"))
        .with_context(|| format!("reading /proc/{pid}/status"))?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .with_context(|| format!("no VmRSS in /proc/{pid}/status"))
}

/// A Service served, and how long that took from its creation.
#[derive(Debug, Clone, Copy)]
pub struct Served {
    pub ip: Ipv4Addr,
    pub holder: usize,
    pub to_status: Duration,
    pub to_tcp: Duration,
}

/// One failover as the LAN and the kernels saw it.
#[derive(Debug, Clone)]
pub struct Failover {
    /// From the fault to another guest's kernel holding the Service's
    /// address (the status's, which may change), `None` if none did in
    /// time. For a restart: to any guest holding it once the agent runs
    /// again.
    pub took: Option<Duration>,
    /// The address the Service had after it (a changed address strands
    /// every client that has the old one).
    pub ip_after: Option<Ipv4Addr>,
    /// The LAN client's longest stretch without an ARP answer for the
    /// original address.
    pub arp_silence: Duration,
    /// From the fault to the first TCP answer at the original address
    /// from another node.
    pub tcp_back: Option<Duration>,
    /// ARP requests two answered, and moments two kernels held the
    /// address.
    pub two_answerers: usize,
}

/// Serves Service `name` on `sr`, does `fault` to its holder, and measures
/// the failover for up to `within`.
pub fn fail_over(
    sr: &mut SystemRig,
    name: &str,
    fault: HolderFault,
    within: Duration,
) -> Result<(Served, Failover)> {
    let served = sr.serve(name)?;
    let (ip, from) = (served.ip, served.holder);
    // Ours: the fault comes to a running cluster, whose LAN membership has
    // found all its members (the peers' agents need no such wait: their
    // memberlist and leases are up once they serve).
    if sr.system.is_ours() {
        sr.lb.wait_for_membership(Duration::from_secs(30))?;
    }
    let watch = crate::addrwatch::AddressWatch::start(sr.lb.rig.guest_namespaces())?;
    let arp = crate::failover::arp_prober(&sr.lb, ip)?;
    let tcp = crate::tcpprobe::TcpProber::start(
        &sr.lb.client_ns,
        ip,
        crate::lb::LISTEN_PORT,
        Duration::from_millis(100),
    )?;
    let from_node = sr.lb.node_name(from);
    let t0 = Instant::now();
    sr.fault(from, fault)?;
    if matches!(
        fault,
        HolderFault::GuestDeleted | HolderFault::LeaderAndHolder
    ) {
        watch.gone(from, Instant::now());
    }
    // Seen held by another guest this many polls in a row: MetalLB's
    // answers from another node may stop again at once (see
    // `answered_for_good`); a kernel's address does not flap.
    let polls = if sr.metallb.is_some() { 3 } else { 1 };
    let mut seen = 0;
    let moved = crate::lb::wait_for(within, || {
        let now = sr.lb.ingress_ip(name)?;
        let others: Vec<usize> = sr
            .holders(now)
            .into_iter()
            .filter(|g| *g != from || fault == HolderFault::Restarted)
            .collect();
        seen = if others.is_empty() { 0 } else { seen + 1 };
        (seen >= polls).then(|| (t0.elapsed(), now))
    });
    // Long enough after for the new holder's answers, ARP and TCP.
    std::thread::sleep(Duration::from_millis(if moved.is_some() {
        1_000
    } else {
        0
    }));
    let arp = arp.finish()?;
    let tcp = tcp.finish()?;
    let tcp_back = tcp
        .tries
        .iter()
        .find(|t| {
            t.sent >= t0
                && t.answer
                    .as_deref()
                    .is_some_and(|n| n != from_node || fault == HolderFault::Restarted)
        })
        .map(|t| t.sent - t0);
    // MetalLB's holder is whose MAC answers ARP: read from the 10 ms
    // record, finer than the polling above; and every guest has its
    // addresses (on `lo`), so the kernels' record says nothing of who
    // answers.
    let metallb = sr.metallb.is_some();
    let took = match moved {
        Some(_) if metallb => {
            let not = (fault != HolderFault::Restarted).then_some(from);
            answered_for_good(&arp, t0, not, &guest_macs(&sr.lb))
        }
        _ => moved.map(|(d, _)| d),
    };
    let overlaps = if metallb { 0 } else { watch.overlaps(ip).len() };
    Ok((
        served,
        Failover {
            took,
            ip_after: moved.map(|(_, ip)| ip).or_else(|| sr.lb.ingress_ip(name)),
            arp_silence: arp.longest_silence().max(unanswered_tail(&arp)),
            tcp_back,
            two_answerers: arp.doubly_answered().len() + overlaps,
        },
    ))
}

/// From `t0` to the first ARP answer from a guest other than `not` after
/// which such guests answer every request to the end of the record (50 ms
/// unanswered at most). Not the first such answer: MetalLB's speakers were
/// seen to answer from another node for 100 ms right after the holder's
/// speaker died, then fall silent for 5 s until memberlist declared it
/// dead.
fn answered_for_good(
    arp: &crate::arpprobe::ArpRecord,
    t0: Instant,
    not: Option<usize>,
    macs: &[Option<[u8; 6]>],
) -> Option<Duration> {
    let other = |mac: &[u8; 6]| {
        macs.iter()
            .enumerate()
            .any(|(i, m)| Some(i) != not && m.as_ref() == Some(mac))
    };
    let mut since: Option<Instant> = None;
    let mut unanswered = 0;
    for p in arp.probes.iter().filter(|p| p.sent >= t0) {
        if p.replies.iter().any(|(_, mac)| other(mac)) {
            since.get_or_insert(p.sent);
            unanswered = 0;
        } else {
            unanswered += 1;
            if unanswered > 5 || !p.replies.is_empty() {
                since = None;
            }
        }
    }
    since.map(|s| s - t0)
}

/// Every (guest, link) whose kernel has `ip`, by guest: ours on an `hlb-*`
/// link, kube-vip's on a `vip-*` link or, for a Service address it did not
/// get from DHCP, on `eth0`.
pub fn links_holding(lb: &LbRig, ip: Ipv4Addr) -> Vec<(usize, String)> {
    let want = format!(" {ip}/");
    let mut found = Vec::new();
    for i in 0..lb.rig.guest_namespaces().len() {
        let Ok(out) = std::process::Command::new("ip")
            .args(["-n", lb.rig.guest_ns(i), "-o", "-4", "addr", "show"])
            .output()
        else {
            continue;
        };
        for line in String::from_utf8_lossy(&out.stdout).lines() {
            if line.contains(&want)
                && let Some(link) = line.split_whitespace().nth(1)
            {
                found.push((i, link.to_string()));
            }
        }
    }
    found
}

/// The guests whose `eth0` MAC answers ARP for `ip` from the rig's
/// observer, asked every 20 ms for 200 ms.
pub fn arp_answerers(lb: &LbRig, ip: Ipv4Addr) -> Result<Vec<usize>> {
    let prober = crate::failover::arp_prober_every(lb, ip, Duration::from_millis(20))?;
    std::thread::sleep(Duration::from_millis(200));
    let rec = prober.finish()?;
    let macs = guest_macs(lb);
    let mut answerers: Vec<usize> = rec
        .probes
        .iter()
        .flat_map(|p| p.replies.iter())
        .filter_map(|(_, mac)| macs.iter().position(|m| m.as_ref() == Some(mac)))
        .collect();
    answerers.sort_unstable();
    answerers.dedup();
    Ok(answerers)
}

/// Every guest's `eth0` MAC (`None` for a guest whose namespace is gone).
pub fn guest_macs(lb: &LbRig) -> Vec<Option<[u8; 6]>> {
    (0..lb.rig.guest_namespaces().len())
        .map(|i| {
            let out = std::process::Command::new("ip")
                .args(["-n", lb.rig.guest_ns(i), "-o", "link", "show", "eth0"])
                .output()
                .ok()?;
            let text = String::from_utf8_lossy(&out.stdout).into_owned();
            let mac = text
                .split("link/ether ")
                .nth(1)?
                .split_whitespace()
                .next()?;
            let bytes: Vec<u8> = mac
                .split(':')
                .map(|b| u8::from_str_radix(b, 16))
                .collect::<Result<_, _>>()
                .ok()?;
            bytes.try_into().ok()
        })
        .collect()
}

/// From the last answered ARP request to the last request sent: an address
/// that is never answered again (kube-vip serving a Service from a new
/// lease after a failover) is silent until the record ends.
fn unanswered_tail(rec: &crate::arpprobe::ArpRecord) -> Duration {
    let last_answered = rec.probes.iter().rev().find(|p| !p.replies.is_empty());
    match (last_answered, rec.probes.last()) {
        (Some(a), Some(last)) => last.sent - a.sent,
        _ => Duration::ZERO,
    }
}

#[cfg(test)]
mod tests {
    use super::write_count;

    #[test]
    fn write_count_sums_the_writing_verbs_only() {
        let text = "\
# HELP apiserver_request_total Counter
apiserver_request_total{code=\"200\",component=\"apiserver\",group=\"coordination.k8s.io\",resource=\"leases\",verb=\"PUT\",version=\"v1\"} 40
apiserver_request_total{code=\"201\",component=\"apiserver\",group=\"\",resource=\"events\",verb=\"POST\",version=\"v1\"} 2
apiserver_request_total{code=\"200\",component=\"apiserver\",group=\"\",resource=\"services\",verb=\"PATCH\",version=\"v1\"} 3.5e+01
apiserver_request_total{code=\"200\",component=\"apiserver\",group=\"\",resource=\"services\",verb=\"LIST\",version=\"v1\"} 900
apiserver_request_total{code=\"200\",component=\"apiserver\",group=\"\",resource=\"services\",verb=\"WATCH\",version=\"v1\"} 7
apiserver_request_duration_seconds_count{verb=\"PUT\"} 1000
";
        assert_eq!(write_count(text), 77.0);
    }
}
