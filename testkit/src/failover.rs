//! Failover scenarios on the LoadBalancer rig, shared by the integration
//! tests (which assert on one run) and `benches/failover.rs` (which runs
//! each many times): serve a Service, do something to its holder, and time
//! until another guest holds the address, as the guests' kernels report
//! it ([`AddressWatch`]), while a client on the LAN asks who has the
//! address every 10 ms ([`ArpProber`]).

use std::net::Ipv4Addr;
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};

use crate::addrwatch::AddressWatch;
use crate::arpprobe::{ArpProber, ArpRecord};
use crate::lb::{LISTEN_PORT, LbRig, wait_for};

/// The Service annotation that asks for a DHCP address
/// (`contract::harvester::IPAM`).
pub const IPAM: &str = "cloudprovider.harvesterhci.io/ipam";

/// What happens to the holder.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// Its agent gets SIGTERM (`systemctl stop`, a drain).
    Graceful,
    /// Its uplink loses carrier (the LAN side of its veth goes down).
    CablePulled,
    /// Its uplink is set down by its owner (`ip link set eth0 down`, as a
    /// network service restart does): the carrier cannot be read and the
    /// default route goes with it.
    UplinkSetDown,
    /// Its uplink deleted from inside the guest ([`delete_uplink`]), as a
    /// network service that tears its interfaces down does. Not in
    /// [`Fault::ALL`] (the failover bench's rows).
    UplinkDeleted,
    /// Its LAN port silent ([`set_port`]): its link up, its API path fine,
    /// so only its peers on the LAN can tell. Not in [`Fault::ALL`].
    PortSilenced,
    /// Its VM is gone: the namespace deleted with everything in it.
    GuestDeleted,
    /// `GuestDeleted`, and the controller leader killed at the same moment.
    LeaderAndHolder,
}

impl Fault {
    pub const ALL: [Fault; 5] = [
        Fault::Graceful,
        Fault::CablePulled,
        Fault::UplinkSetDown,
        Fault::GuestDeleted,
        Fault::LeaderAndHolder,
    ];

    pub fn label(self) -> &'static str {
        match self {
            Fault::Graceful => "graceful stop (SIGTERM)",
            Fault::CablePulled => "uplink down (no carrier)",
            Fault::UplinkSetDown => "uplink set down by its owner",
            Fault::UplinkDeleted => "uplink deleted by its owner",
            Fault::PortSilenced => "LAN port silent, link and API path up",
            Fault::GuestDeleted => "holder's namespace deleted",
            Fault::LeaderAndHolder => "leader killed + namespace deleted",
        }
    }
}

/// One failover, as the kernels saw it.
pub struct Failover {
    pub ip: Ipv4Addr,
    pub from: usize,
    pub to: usize,
    /// From the fault to another guest holding the address.
    pub took: Duration,
    /// When the fault was done.
    pub t0: Instant,
    pub watch: AddressWatch,
    /// ARP every 10 ms from the client, from before the fault to half a
    /// second after the takeover.
    pub arp: ArpRecord,
}

impl Failover {
    /// Moments two guests held the address, and ARP requests two answered.
    pub fn overlaps(&self) -> usize {
        self.watch.overlaps(self.ip).len() + self.arp.doubly_answered().len()
    }

    pub fn story(&self) -> String {
        format!(
            "{}\nARP every {:?}: {} requests, at most {} answers to one, longest without an answer {:.0} ms",
            timeline(&self.watch, self.ip, self.t0),
            self.arp.every,
            self.arp.probes.len(),
            self.arp.most_answers(),
            self.arp.longest_silence().as_secs_f64() * 1e3
        )
    }
}

pub fn guest_namespaces(lb: &LbRig) -> Vec<String> {
    lb.rig.guest_namespaces().to_vec()
}

/// A DHCP Service served by exactly one guest: its address and that guest.
pub fn served(lb: &LbRig, name: &str) -> Result<(Ipv4Addr, usize)> {
    lb.create_service(name, &[(IPAM, "dhcp")], &[LISTEN_PORT])?;
    let ip = lb.wait_ingress(name, Duration::from_secs(60));
    let holder = wait_for(Duration::from_secs(30), || {
        let c = lb.carriers(ip);
        (c.len() == 1).then(|| lb.guest_of(&c[0].0))
    });
    match holder {
        Some(h) => Ok((ip, h)),
        None => bail!("{ip} never on exactly one guest"),
    }
}

/// Who held `ip` when, relative to `t0`, one change per line.
pub fn timeline(w: &AddressWatch, ip: Ipv4Addr, t0: Instant) -> String {
    w.holders(ip)
        .iter()
        .map(|(at, h)| format!("{}: held by guests {h:?}", offset_ms(*at, t0)))
        .collect::<Vec<_>>()
        .join("\n")
}

/// `at` relative to `t0`, signed: `+120ms`, `-40ms`.
pub fn offset_ms(at: Instant, t0: Instant) -> String {
    if at >= t0 {
        format!("+{:.0}ms", (at - t0).as_secs_f64() * 1e3)
    } else {
        format!("-{:.0}ms", (t0 - at).as_secs_f64() * 1e3)
    }
}

/// Guest `i`'s uplink as the LAN sees it (its veth peer in the LAN
/// namespace): down is a pulled cable for the guest.
pub fn set_cable(lb: &LbRig, i: usize, up: bool) -> Result<()> {
    let peer = format!("vg{}", i + 1);
    let st = Command::new("ip")
        .args(["-n", lb.rig.lan_ns(), "link", "set", &peer])
        .arg(if up { "up" } else { "down" })
        .status()?;
    ensure!(st.success(), "ip link set {peer}: {st}");
    Ok(())
}

/// Guest `i`'s LAN port on the rig's bridge silent (`false`: the bridge
/// port disabled, frames dropped both ways, no carrier change, so the guest
/// cannot tell; its API path untouched) or forwarding again (`true`), as a
/// switch port's filter or a broken segment behind a live link.
pub fn set_port(lb: &LbRig, i: usize, forwarding: bool) -> Result<()> {
    let port = format!("vg{}", i + 1);
    let state = if forwarding { "3" } else { "0" };
    let st = Command::new("bridge")
        .args([
            "-n",
            lb.rig.lan_ns(),
            "link",
            "set",
            "dev",
            &port,
            "state",
            state,
        ])
        .status()?;
    ensure!(
        st.success(),
        "bridge link set dev {port} state {state}: {st}"
    );
    Ok(())
}

/// The rig's LAN split in two: frames between the ports of guests `side`
/// and the other guests' ports are dropped on the bridge, both ways, with
/// no carrier change (`ebtables` on the bridge's FORWARD chain); the LAN
/// namespace's own hosts (DHCP server, gateway, observer) still reach both
/// halves, so a client there hears both if both answer. Healed by
/// [`LanSplit::heal`] or when dropped; splits may overlap (each removes
/// its own rules).
pub struct LanSplit {
    lan_ns: String,
    /// `(in, out)` ports of the rules it added.
    rules: Vec<(String, String)>,
    healed: bool,
}

impl LanSplit {
    pub fn split(lb: &LbRig, side: &[usize]) -> Result<LanSplit> {
        let lan_ns = lb.rig.lan_ns().to_string();
        let mut split = LanSplit {
            lan_ns: lan_ns.clone(),
            rules: Vec::new(),
            healed: false,
        };
        let port = |i: usize| format!("vg{}", i + 1);
        let (a, b): (Vec<usize>, Vec<usize>) =
            (0..lb.rig.guest_count()).partition(|i| side.contains(i));
        for x in &a {
            for y in &b {
                for (from, to) in [(port(*x), port(*y)), (port(*y), port(*x))] {
                    let st = Command::new("ip")
                        .args(["netns", "exec", &lan_ns, "ebtables", "-A", "FORWARD"])
                        .args(["-i", &from, "-o", &to, "-j", "DROP"])
                        .status()?;
                    ensure!(
                        st.success(),
                        "ebtables -A FORWARD -i {from} -o {to} -j DROP: {st}"
                    );
                    split.rules.push((from, to));
                }
            }
        }
        Ok(split)
    }

    pub fn heal(&mut self) -> Result<()> {
        if self.healed {
            return Ok(());
        }
        self.healed = true;
        for (from, to) in &self.rules {
            let st = Command::new("ip")
                .args(["netns", "exec", &self.lan_ns, "ebtables", "-D", "FORWARD"])
                .args(["-i", from, "-o", to, "-j", "DROP"])
                .status()?;
            ensure!(
                st.success(),
                "ebtables -D FORWARD -i {from} -o {to} -j DROP: {st}"
            );
        }
        Ok(())
    }
}

impl Drop for LanSplit {
    fn drop(&mut self) {
        let _ = self.heal();
    }
}

/// Guest `i` paused as a paused VM looks from inside and from the LAN:
/// every process of its namespace frozen (the cgroup freezer) and its LAN
/// port silent (the bridge port disabled: frames dropped both ways, no
/// carrier change). Its kernel keeps running, as the rig's kernel is
/// shared. Resumed, both at the same moment, by [`PausedGuest::resume`] or
/// when dropped.
pub struct PausedGuest {
    lan_ns: String,
    port: String,
    cgroup: std::path::PathBuf,
    resumed: bool,
}

impl PausedGuest {
    pub fn pause(lb: &LbRig, i: usize) -> Result<PausedGuest> {
        let ns = lb.rig.guest_ns(i).to_string();
        let cgroup = std::path::PathBuf::from(format!(
            "/sys/fs/cgroup/freezer/hna-{}-{ns}",
            std::process::id()
        ));
        std::fs::create_dir_all(&cgroup)
            .with_context(|| format!("create {} (cgroup v1 freezer)", cgroup.display()))?;
        let paused = PausedGuest {
            lan_ns: lb.rig.lan_ns().to_string(),
            port: format!("vg{}", i + 1),
            cgroup,
            resumed: false,
        };
        let pids = crate::rig::process::run_args("ip", ["netns", "pids", &ns])?;
        for pid in pids.split_whitespace() {
            // The test's own observers in the namespace (`ip monitor`, the
            // AddressWatch) are not part of the guest.
            let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
            let args: Vec<&[u8]> = cmdline.split(|b| *b == 0).collect();
            if args.first() == Some(&&b"ip"[..]) && args.contains(&&b"monitor"[..]) {
                continue;
            }
            // A process may have ended meanwhile.
            let _ = std::fs::write(paused.cgroup.join("cgroup.procs"), pid);
        }
        std::fs::write(paused.cgroup.join("freezer.state"), "FROZEN")?;
        let deadline = Instant::now() + Duration::from_secs(5);
        while std::fs::read_to_string(paused.cgroup.join("freezer.state"))?.trim() != "FROZEN" {
            ensure!(Instant::now() < deadline, "guest {i} not frozen within 5 s");
            std::thread::sleep(Duration::from_millis(5));
        }
        paused.port_state("0")?;
        Ok(paused)
    }

    fn port_state(&self, state: &str) -> Result<()> {
        let st = Command::new("bridge")
            .args([
                "-n",
                &self.lan_ns,
                "link",
                "set",
                "dev",
                &self.port,
                "state",
                state,
            ])
            .status()?;
        ensure!(
            st.success(),
            "bridge link set dev {} state {state}: {st}",
            self.port
        );
        Ok(())
    }

    /// Lets the LAN hear the guest again and thaws its processes.
    pub fn resume(&mut self) -> Result<()> {
        if self.resumed {
            return Ok(());
        }
        self.resumed = true;
        self.port_state("3")?;
        std::fs::write(self.cgroup.join("freezer.state"), "THAWED")?;
        // Back to the root group, so the group can go.
        let procs = std::fs::read_to_string(self.cgroup.join("cgroup.procs")).unwrap_or_default();
        for pid in procs.split_whitespace() {
            let _ = std::fs::write("/sys/fs/cgroup/freezer/cgroup.procs", pid);
        }
        let _ = std::fs::remove_dir(&self.cgroup);
        Ok(())
    }
}

impl Drop for PausedGuest {
    fn drop(&mut self) {
        let _ = self.resume();
    }
}

/// Guest `i`'s uplink set down or up from inside the guest, as its owner
/// does (`ip link set eth0 down`); up also puts back the default route the
/// kernel dropped with it, as the node's network service would.
pub fn set_uplink(lb: &LbRig, i: usize, up: bool) -> Result<()> {
    let ns = lb.rig.guest_ns(i);
    let st = Command::new("ip")
        .args(["-n", ns, "link", "set", "eth0"])
        .arg(if up { "up" } else { "down" })
        .status()?;
    ensure!(st.success(), "ip -n {ns} link set eth0: {st}");
    if up {
        lb.configure_uplink(i)?;
    }
    Ok(())
}

/// Guest `i`'s uplink deleted from inside the guest (`ip link del eth0`,
/// as a network service that tears its interfaces down does): its LAN peer
/// and every macvlan on it go with it.
pub fn delete_uplink(lb: &LbRig, i: usize) -> Result<()> {
    let ns = lb.rig.guest_ns(i);
    let st = Command::new("ip")
        .args(["-n", ns, "link", "del", "eth0"])
        .status()?;
    ensure!(st.success(), "ip -n {ns} link del eth0: {st}");
    Ok(())
}

/// Guest `i`'s uplink created again with the same name after
/// [`delete_uplink`], with the node's address and default route.
pub fn recreate_uplink(lb: &LbRig, i: usize) -> Result<()> {
    lb.rig.reattach_uplink(i)?;
    lb.configure_uplink(i)
}

/// Serves Service `name`, does `fault` to its holder and waits up to
/// `within` for another guest to hold the address.
pub fn fail_over(lb: &mut LbRig, name: &str, fault: Fault, within: Duration) -> Result<Failover> {
    fail_over_after(lb, name, fault, within, Duration::ZERO)
}

/// [`fail_over`], with the fault `delay` after the watches are up. A
/// benchmark spreads `delay` over a heartbeat period: otherwise the fault
/// comes at the same point of the holder's heartbeat cycle every run (its
/// lease's BOUND write sets the phase), and a distribution would show only
/// that one point.
pub fn fail_over_after(
    lb: &mut LbRig,
    name: &str,
    fault: Fault,
    within: Duration,
    delay: Duration,
) -> Result<Failover> {
    fail_over_prepared(lb, name, fault, within, |_| {
        std::thread::sleep(delay);
        Ok(())
    })
}

/// [`fail_over`], with `prepare` run once the Service is served and the
/// watches are up, just before the fault (a hostile webhook installed, a
/// delay).
pub fn fail_over_prepared(
    lb: &mut LbRig,
    name: &str,
    fault: Fault,
    within: Duration,
    prepare: impl FnOnce(&LbRig) -> Result<()>,
) -> Result<Failover> {
    let (ip, from) = served(lb, name)?;
    lb.wait_for_membership(Duration::from_secs(30))?;
    let leader = match fault {
        Fault::LeaderAndHolder => {
            let leader = wait_for(Duration::from_secs(30), || lb.leader());
            let Some(leader) = leader else {
                bail!("no controller leads");
            };
            (0..2).find(|&i| LbRig::controller_identity(i) == leader)
        }
        _ => None,
    };
    let watch = AddressWatch::start(&guest_namespaces(lb))?;
    let prober = arp_prober(lb, ip)?;
    prepare(lb)?;
    let t0 = Instant::now();
    match fault {
        Fault::Graceful => {
            let status = lb.stop_agent(from);
            ensure!(status.success(), "the agent's stop: {status}");
        }
        Fault::CablePulled => set_cable(lb, from, false)?,
        Fault::UplinkSetDown => set_uplink(lb, from, false)?,
        Fault::UplinkDeleted => delete_uplink(lb, from)?,
        Fault::PortSilenced => set_port(lb, from, false)?,
        Fault::GuestDeleted | Fault::LeaderAndHolder => {
            if let Some(c) = leader {
                lb.kill_controller(c);
            }
            lb.delete_guest(from)?;
            // Its monitor died with it: the addresses went no later than now.
            watch.gone(from, Instant::now());
        }
    }
    let taken = wait_for(within, || watch.taken_by_other(ip, from, t0));
    let Some((at, to)) = taken else {
        bail!(
            "{ip} not held by another guest within {within:?} of: {}\n{}",
            fault.label(),
            timeline(&watch, ip, t0)
        );
    };
    // Long enough after the takeover for the new holder's answers.
    let settled = at + Duration::from_millis(500);
    std::thread::sleep(settled.saturating_duration_since(Instant::now()));
    let arp = prober.finish()?;
    Ok(Failover {
        ip,
        from,
        to,
        took: at - t0,
        t0,
        watch,
        arp,
    })
}

/// Asks who has `ip` every 10 ms from the rig's ARP observer.
pub fn arp_prober(lb: &LbRig, ip: Ipv4Addr) -> Result<ArpProber> {
    arp_prober_every(lb, ip, Duration::from_millis(10))
}

/// Asks who has `ip` every `every` from the rig's ARP observer
/// ([`LbRig::observer`]).
pub fn arp_prober_every(lb: &LbRig, ip: Ipv4Addr, every: Duration) -> Result<ArpProber> {
    ArpProber::start(&lb.observer.ns, "eth0", lb.observer.addr, ip, every)
}

/// `n` DHCP Services named `{prefix}-NNN`, every one held by guest
/// `holder`: the other guests' agents are stopped while they are placed,
/// then started again and left to report ready. Returns their addresses,
/// in name order, once the holder's kernel has them all.
pub fn all_on_one(lb: &mut LbRig, holder: usize, prefix: &str, n: usize) -> Result<Vec<Ipv4Addr>> {
    let within = Duration::from_secs(60);
    let ready = |lb: &LbRig, i: usize| {
        lb.node_object(&lb.node_name(i))
            .is_some_and(|o| o["status"]["ready"] == true)
    };
    let guests: Vec<usize> = (0..lb.guests()).collect();
    ensure!(
        wait_for(within, || guests
            .iter()
            .all(|g| ready(lb, *g))
            .then_some(()))
        .is_some(),
        "the agents never reported ready"
    );
    let others: Vec<usize> = guests.iter().copied().filter(|g| *g != holder).collect();
    for g in &others {
        let stopped = lb.stop_agent(*g);
        ensure!(stopped.success(), "guest {g}'s agent's stop: {stopped:?}");
    }
    let names: Vec<String> = (0..n).map(|i| format!("{prefix}-{i:03}")).collect();
    for name in &names {
        lb.create_service(name, &[(IPAM, "dhcp")], &[LISTEN_PORT])?;
    }
    let mut ips = Vec::new();
    for name in &names {
        ips.push(lb.wait_ingress(name, Duration::from_secs(180)));
    }
    let on_holder = wait_for(Duration::from_secs(120), || {
        let held: std::collections::BTreeSet<String> = lb
            .hlb_links(holder)
            .into_iter()
            .flat_map(|l| l.addrs)
            .map(|a| a.trim_end_matches("/32").to_string())
            .collect();
        ips.iter()
            .all(|ip| held.contains(&ip.to_string()))
            .then_some(())
    });
    ensure!(
        on_holder.is_some(),
        "not all {n} addresses on guest {holder}"
    );
    for g in &others {
        lb.start_agent(*g)?;
    }
    ensure!(
        wait_for(within, || others
            .iter()
            .all(|g| ready(lb, *g))
            .then_some(()))
        .is_some(),
        "the other agents never reported ready again"
    );
    lb.wait_for_membership(within)?;
    Ok(ips)
}

/// Deletes guest `holder` (its VM gone) and waits, up to `within`, until
/// every one of `ips` is held by another guest as their kernels report it
/// (`watch` must have been started before). Returns how long that took.
pub fn delete_until_all_moved(
    lb: &mut LbRig,
    holder: usize,
    ips: &[Ipv4Addr],
    watch: &AddressWatch,
    within: Duration,
) -> Result<Duration> {
    let t0 = Instant::now();
    let wall = {
        let ms = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default()
            .as_millis()
            % 86_400_000;
        format!(
            "{:02}:{:02}:{:02}.{:03} UTC",
            ms / 3_600_000,
            ms / 60_000 % 60,
            ms / 1000 % 60,
            ms % 1000
        )
    };
    lb.delete_guest(holder)?;
    eprintln!(
        "guest {holder} deleted at {wall} in {:.0} ms",
        t0.elapsed().as_secs_f64() * 1e3
    );
    // Its LAN port goes first, its monitor with its namespace (seconds
    // later): its addresses went at the start.
    watch.gone(holder, t0);
    let moved = |ip: &Ipv4Addr| {
        watch
            .holders(*ip)
            .last()
            .is_some_and(|(_, h)| h.iter().any(|g| *g != holder))
    };
    // When each was first held by another guest, from the kernels' record
    // (not when this loop saw it: the deletion itself takes seconds).
    let taken_at = |ip: &Ipv4Addr| watch.taken_by_other(*ip, holder, t0).map(|(at, _)| at - t0);
    match wait_for(within, || ips.iter().all(moved).then_some(())) {
        Some(()) => Ok(ips.iter().filter_map(taken_at).max().unwrap_or_default()),
        None => {
            let left: Vec<&Ipv4Addr> = ips.iter().filter(|ip| !moved(ip)).collect();
            bail!(
                "{} of {} addresses not held by another guest {within:?} after guest {holder} was deleted; the first: {}",
                left.len(),
                ips.len(),
                left.first()
                    .map(|ip| timeline(watch, **ip, t0))
                    .unwrap_or_default()
            )
        }
    }
}
