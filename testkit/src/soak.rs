//! A seeded, randomized fault soak on the LoadBalancer rig (issue #20) and
//! an independent checker that reads only the outside world.
//!
//! The schedule: every 1–5 s (seeded) a fault begins on a guest that has
//! none running, or on the control plane; each ends after its own random
//! time, so faults overlap. The checker: every guest kernel's addresses
//! (`ip monitor address`), a LAN client asking who has each address every
//! 10 ms (one sender MAC per request), every Service's status, dnsmasq's
//! log; at the end, after a quiet period, what is left on the machines and
//! in the API.
//!
//! Violations: two answers to one ARP request or two guests holding one
//! address at once; a Service's address changing while it lives; an address
//! unanswered for longer than the bound of the faults around the gap
//! ([`Fault::bound`]); a DHCPRELEASE of a living Service's address; at the
//! end, a Service without an address, a link no assignment names, an
//! address on other than one guest, a missing or extra per-node Role.
//!
//! Faults not in this schedule yet: the uplink deleted and recreated, a
//! guest's namespace deleted and a new guest of that name joining, Services
//! deleted and recreated or switched class, a secondary re-pointed.

use std::collections::{BTreeMap, BTreeSet};
use std::net::Ipv4Addr;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use k8s_openapi::api::core::v1::Service;
use kube::Api;

use crate::addrwatch::AddressWatch;
use crate::arpprobe::ArpRecord;
use crate::failover::{self, PausedGuest, guest_namespaces};
use crate::lb::{self, LISTEN_PORT, LbRig};

/// What to run.
#[derive(Debug, Clone)]
pub struct SoakOptions {
    pub seed: u64,
    /// How long faults are injected (the quiet period comes after).
    pub duration: Duration,
    /// DHCP Services; every fifth is a shared-IP secondary of the one
    /// before it, every seventh has `externalTrafficPolicy: Local`.
    pub services: usize,
    pub guests: usize,
    /// After the last fault ended: then the end state is checked.
    pub quiet: Duration,
}

impl SoakOptions {
    pub fn new(seed: u64, duration: Duration) -> SoakOptions {
        SoakOptions {
            seed,
            duration,
            services: 20,
            guests: 4,
            quiet: Duration::from_secs(20),
        }
    }
}

/// The faults of the schedule.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Fault {
    AgentKilled,
    AgentFrozen,
    AgentRestarted,
    GuestPaused,
    CarrierLost,
    UplinkSetDown,
    LeaderKilled,
    ApiServerDown,
    DhcpServerRestarted,
}

impl Fault {
    const ON_A_GUEST: [Fault; 6] = [
        Fault::AgentKilled,
        Fault::AgentFrozen,
        Fault::AgentRestarted,
        Fault::GuestPaused,
        Fault::CarrierLost,
        Fault::UplinkSetDown,
    ];
    const ON_THE_CLUSTER: [Fault; 3] = [
        Fault::LeaderKilled,
        Fault::ApiServerDown,
        Fault::DhcpServerRestarted,
    ];

    pub fn label(self) -> &'static str {
        match self {
            Fault::AgentKilled => "agent SIGKILL, restarted 0-2 s later",
            Fault::AgentFrozen => "agent SIGSTOP 0.1-10 s",
            Fault::AgentRestarted => "agent restarted (SIGTERM)",
            Fault::GuestPaused => "guest paused 0.1-8 s",
            Fault::CarrierLost => "uplink carrier lost 0.5-5 s",
            Fault::UplinkSetDown => "uplink set down 0.5-5 s",
            Fault::LeaderKilled => "controller leader SIGKILL",
            Fault::ApiServerDown => "API server + etcd down 1-40 s",
            Fault::DhcpServerRestarted => "DHCP server down 0-5 s",
        }
    }

    /// How long its holder's addresses may go unanswered because of it:
    /// the controller's staleness bound (3 s), the address lifetime (2 s)
    /// and the takeover (guard, INIT-REBOOT), with a margin for this
    /// 2-core machine. Faults that move nothing: a second.
    pub fn bound(self) -> Duration {
        Duration::from_millis(match self {
            Fault::AgentKilled | Fault::AgentFrozen | Fault::GuestPaused => 6_000,
            Fault::CarrierLost | Fault::UplinkSetDown | Fault::AgentRestarted => 3_000,
            Fault::LeaderKilled | Fault::ApiServerDown | Fault::DhcpServerRestarted => 1_000,
        })
    }

    fn length(self, rng: &mut fastrand::Rng) -> Duration {
        let mut ms = |lo: u64, hi: u64| Duration::from_millis(rng.u64(lo..=hi));
        match self {
            Fault::AgentKilled => ms(0, 2_000),
            Fault::AgentFrozen => ms(100, 10_000),
            Fault::AgentRestarted => Duration::ZERO,
            Fault::GuestPaused => ms(100, 8_000),
            Fault::CarrierLost | Fault::UplinkSetDown => ms(500, 5_000),
            Fault::LeaderKilled => ms(500, 2_000),
            Fault::ApiServerDown => ms(1_000, 40_000),
            Fault::DhcpServerRestarted => ms(0, 5_000),
        }
    }
}

/// A fault as it happened.
#[derive(Debug, Clone)]
pub struct Injected {
    pub fault: Fault,
    /// The guest, for faults on a guest.
    pub guest: Option<usize>,
    pub began: Instant,
    pub ended: Option<Instant>,
}

/// Something the checker saw that must not happen.
#[derive(Debug, Clone)]
pub struct Violation {
    pub at: Instant,
    pub what: String,
}

#[derive(Debug)]
pub struct SoakReport {
    pub seed: u64,
    pub faults: Vec<Injected>,
    pub violations: Vec<Violation>,
    /// The longest unanswered stretch of any address, by the faults
    /// around it (the worst fault first), and with none around it.
    pub worst_unserved: BTreeMap<String, Duration>,
    /// VmRSS (KiB) of the agents and controllers at the start and the end.
    pub rss_start: Vec<(String, u64)>,
    pub rss_end: Vec<(String, u64)>,
    pub t0: Instant,
}

impl SoakReport {
    /// The last line of every soak run.
    pub fn summary(&self) -> String {
        format!(
            "soak: seed {}, {} faults, {} violations",
            self.seed,
            self.faults.len(),
            self.violations.len()
        )
    }

    /// The faults that overlapped `[from, to]` (or ended less than their
    /// bound before it).
    fn around(&self, from: Instant, to: Instant) -> Vec<&Injected> {
        self.faults
            .iter()
            .filter(|f| f.began <= to && f.ended.is_none_or(|e| e + f.fault.bound() >= from))
            .collect()
    }

    fn history(&self, at: Instant) -> String {
        let from = at.checked_sub(Duration::from_secs(15)).unwrap_or(self.t0);
        self.faults
            .iter()
            .filter(|f| f.began >= from && f.began <= at + Duration::from_secs(1))
            .map(|f| {
                format!(
                    "  +{:.1}s..{} {}{}",
                    (f.began - self.t0).as_secs_f64(),
                    f.ended
                        .map(|e| format!("+{:.1}s", (e - self.t0).as_secs_f64()))
                        .unwrap_or_else(|| "end".into()),
                    f.fault.label(),
                    f.guest
                        .map(|g| format!(" on guest {g}"))
                        .unwrap_or_default()
                )
            })
            .collect::<Vec<_>>()
            .join("\n")
    }

    fn violate(&mut self, at: Instant, what: String) {
        let what = format!(
            "seed {} +{:.2}s: {what}\n{}",
            self.seed,
            (at.saturating_duration_since(self.t0)).as_secs_f64(),
            self.history(at)
        );
        self.violations.push(Violation { at, what });
    }
}

fn rss_kib(pid: u32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))?
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

fn rss_all(lb: &LbRig, guests: usize) -> Vec<(String, u64)> {
    let mut out = Vec::new();
    for g in 0..guests {
        if let Some(kib) = lb.agent_pid(g).and_then(rss_kib) {
            out.push((format!("agent {}", lb.node_name(g)), kib));
        }
    }
    for c in 0..2 {
        if let Some(kib) = lb.controller_pid(c).and_then(rss_kib) {
            out.push((format!("controller {c}"), kib));
        }
    }
    out
}

/// A Service of the soak.
struct Svc {
    name: String,
    ip: Ipv4Addr,
    /// A secondary shares its primary's address and has no prober of its
    /// own.
    secondary: bool,
}

/// Every Service's first ingress address, or `None` where the API could
/// not be read (the API server is down): never panics.
fn statuses(lb: &LbRig, names: &[String]) -> Option<BTreeMap<String, Option<Ipv4Addr>>> {
    let api: Api<Service> = Api::namespaced(lb.admin(), "default");
    let list = lb
        .block_on(api.list(&kube::api::ListParams::default()))
        .ok()?;
    let mut out: BTreeMap<String, Option<Ipv4Addr>> =
        names.iter().map(|n| (n.clone(), None)).collect();
    for s in list.items {
        let name = s.metadata.name.clone().unwrap_or_default();
        if let Some(v) = out.get_mut(&name) {
            *v = lb::ingress_ip(&s);
        }
    }
    Some(out)
}

/// A fault under way and how to end it.
struct Active {
    index: usize,
    ends: Instant,
    paused: Option<PausedGuest>,
}

/// Runs the soak. Whatever happens, the rig (and everything it started)
/// goes when this returns: the `LbRig` is dropped, and a paused guest is
/// resumed first.
pub fn run(bin: &str, manifests: PathBuf, opts: &SoakOptions) -> Result<SoakReport> {
    println!(
        "soak: seed {} (replay with --seed {}), {:?} of faults on {} guests, {} Services",
        opts.seed, opts.seed, opts.duration, opts.guests, opts.services
    );
    let mut rng = fastrand::Rng::with_seed(opts.seed);
    let mut lo = lb::Options::new(bin, manifests);
    lo.guests = opts.guests;
    lo.endpoint_slices = true;
    let mut lb = LbRig::start(lo)?;

    // The Services: primaries, shared-IP secondaries, Local ones.
    let mut svcs: Vec<Svc> = Vec::new();
    let nodes: Vec<String> = (0..opts.guests).map(|g| lb.node_name(g)).collect();
    for i in 0..opts.services {
        let name = format!("soak-{i:02}");
        let port = LISTEN_PORT + 100 + i as u16;
        if i % 5 == 4 {
            let primary = svcs
                .last()
                .context("a secondary needs a primary")?
                .name
                .clone();
            lb.create_service(
                &name,
                &[
                    (crate::failover::IPAM, "dhcp"),
                    (
                        "cloudprovider.harvesterhci.io/primary-service",
                        &format!("default/{primary}"),
                    ),
                ],
                &[port],
            )?;
        } else if i % 7 == 6 {
            lb.create_service_with(
                &name,
                &[(crate::failover::IPAM, "dhcp")],
                &[port],
                serde_json::json!({"externalTrafficPolicy": "Local"}),
            )?;
            lb.set_endpoints(&name, &nodes)?;
        } else {
            lb.create_service(&name, &[(crate::failover::IPAM, "dhcp")], &[port])?;
        }
        svcs.push(Svc {
            name,
            ip: Ipv4Addr::UNSPECIFIED,
            secondary: i % 5 == 4,
        });
    }
    for s in &mut svcs {
        s.ip = lb.wait_ingress(&s.name, Duration::from_secs(120));
    }
    let names: Vec<String> = svcs.iter().map(|s| s.name.clone()).collect();
    let addresses: BTreeSet<Ipv4Addr> =
        svcs.iter().filter(|s| !s.secondary).map(|s| s.ip).collect();
    for ip in &addresses {
        let ok = lb::wait_for(Duration::from_secs(30), || {
            (lb.carriers(*ip).len() == 1).then_some(())
        });
        if ok.is_none() {
            bail!(
                "{ip} not on exactly one guest before the soak:\n{}",
                lb.diagnostics()
            );
        }
    }
    let watch = AddressWatch::start(&guest_namespaces(&lb))?;
    let mut probers = Vec::new();
    for ip in &addresses {
        probers.push((*ip, failover::arp_prober(&lb, *ip)?));
    }
    let dhcp_log_mark = lb.dnsmasq_log_len();
    let t0 = Instant::now();
    let mut report = SoakReport {
        seed: opts.seed,
        faults: Vec::new(),
        violations: Vec::new(),
        worst_unserved: BTreeMap::new(),
        rss_start: rss_all(&lb, opts.guests),
        rss_end: Vec::new(),
        t0,
    };

    let mut active: Vec<Active> = Vec::new();
    let mut next_fault = t0 + Duration::from_secs(1);
    let original: BTreeMap<String, Ipv4Addr> =
        svcs.iter().map(|s| (s.name.clone(), s.ip)).collect();
    let mut last_seen: BTreeMap<String, Option<Ipv4Addr>> =
        svcs.iter().map(|s| (s.name.clone(), Some(s.ip))).collect();
    let mut next_status = t0;
    let end = t0 + opts.duration;
    loop {
        let now = Instant::now();
        // End what is due.
        let mut k = 0;
        while k < active.len() {
            if active[k].ends <= now || now >= end {
                let a = active.remove(k);
                end_fault(&mut lb, &mut report, a)?;
            } else {
                k += 1;
            }
        }
        if now >= end && active.is_empty() {
            break;
        }
        if now >= next_fault && now < end {
            next_fault = now + Duration::from_millis(rng.u64(1_000..=5_000));
            let busy: BTreeSet<usize> = active
                .iter()
                .filter_map(|a| report.faults[a.index].guest)
                .collect();
            let busy_cluster: BTreeSet<Fault> = active
                .iter()
                .filter(|a| report.faults[a.index].guest.is_none())
                .map(|a| report.faults[a.index].fault)
                .collect();
            // A quarter of the faults on the cluster, the rest on a guest.
            let begun = if rng.u8(0..4) == 0 {
                let f = Fault::ON_THE_CLUSTER[rng.usize(..Fault::ON_THE_CLUSTER.len())];
                // One API outage or leader kill at a time.
                (!busy_cluster.contains(&f)).then_some((f, None))
            } else {
                let free: Vec<usize> = (0..opts.guests).filter(|g| !busy.contains(g)).collect();
                // Never all guests at once: someone must be able to hold.
                (free.len() > 1).then(|| {
                    let g = free[rng.usize(..free.len())];
                    (
                        Fault::ON_A_GUEST[rng.usize(..Fault::ON_A_GUEST.len())],
                        Some(g),
                    )
                })
            };
            if let Some((fault, guest)) = begun {
                let length = fault.length(&mut rng);
                let a = begin_fault(&mut lb, &mut report, fault, guest, length)?;
                active.push(a);
            }
        }
        if now >= next_status {
            next_status = now + Duration::from_millis(250);
            if let Some(st) = statuses(&lb, &names) {
                for (name, ip) in st {
                    let was = last_seen.insert(name.clone(), ip).flatten();
                    if ip != was && ip != Some(original[&name]) {
                        report.violate(
                            now,
                            format!(
                                "Service {name}'s status changed from {was:?} to {ip:?} while it lives (its address is {})",
                                original[&name]
                            ),
                        );
                    }
                }
            }
        }
        std::thread::sleep(Duration::from_millis(50));
    }

    // Quiet: then the end state.
    let quiet_from = Instant::now();
    std::thread::sleep(opts.quiet);
    let records: Vec<(Ipv4Addr, ArpRecord)> = probers
        .into_iter()
        .map(|(ip, p)| Ok((ip, p.finish()?)))
        .collect::<Result<_>>()?;
    for (ip, rec) in &records {
        check_arp(&mut report, *ip, rec);
        for (at, holders) in watch.overlaps(*ip) {
            report.violate(at, format!("{ip} held by guests {holders:?} at once"));
        }
    }
    let log = lb.dnsmasq_log_from(dhcp_log_mark);
    for line in log.lines().filter(|l| l.contains("DHCPRELEASE")) {
        if let Some(ip) = addresses.iter().find(|ip| line.contains(&ip.to_string())) {
            report.violate(
                Instant::now(),
                format!("DHCPRELEASE of living {ip}: {line}"),
            );
        }
    }
    check_end(&lb, &mut report, &svcs, &addresses, quiet_from)?;
    report.rss_end = rss_all(&lb, opts.guests);
    Ok(report)
}

fn begin_fault(
    lb: &mut LbRig,
    report: &mut SoakReport,
    fault: Fault,
    guest: Option<usize>,
    length: Duration,
) -> Result<Active> {
    use nix::sys::signal::Signal;
    let began = Instant::now();
    let mut paused = None;
    match (fault, guest) {
        (Fault::AgentKilled, Some(g)) if lb.agent_running(g) => lb.signal_agent(g, Signal::SIGKILL),
        (Fault::AgentFrozen, Some(g)) if lb.agent_running(g) => lb.signal_agent(g, Signal::SIGSTOP),
        (Fault::AgentRestarted, Some(g)) if lb.agent_running(g) => {
            let st = lb.stop_agent(g);
            if !st.success() {
                report.violate(began, format!("guest {g}'s agent stopped with {st}"));
            }
            lb.start_agent(g)?;
        }
        (Fault::GuestPaused, Some(g)) => paused = Some(PausedGuest::pause(lb, g)?),
        (Fault::CarrierLost, Some(g)) => failover::set_cable(lb, g, false)?,
        (Fault::UplinkSetDown, Some(g)) => failover::set_uplink(lb, g, false)?,
        (Fault::LeaderKilled, None) => {
            if let Some(c) = lb
                .leader()
                .and_then(|l| (0..2).find(|&c| LbRig::controller_identity(c) == l))
            {
                lb.kill_controller(c);
            }
        }
        (Fault::ApiServerDown, None) => lb.rig.apiserver_mut().context("API server")?.stop(),
        (Fault::DhcpServerRestarted, None) => lb.rig.stop_dhcp(),
        _ => {}
    }
    println!(
        "+{:.1}s {}{} for {:.1}s",
        (began - report.t0).as_secs_f64(),
        fault.label(),
        guest.map(|g| format!(" on guest {g}")).unwrap_or_default(),
        length.as_secs_f64()
    );
    report.faults.push(Injected {
        fault,
        guest,
        began,
        ended: None,
    });
    Ok(Active {
        index: report.faults.len() - 1,
        ends: began + length,
        paused,
    })
}

fn end_fault(lb: &mut LbRig, report: &mut SoakReport, mut a: Active) -> Result<()> {
    use nix::sys::signal::Signal;
    let f = report.faults[a.index].clone();
    match (f.fault, f.guest) {
        (Fault::AgentKilled, Some(g)) if !lb.agent_running(g) => lb.start_agent(g)?,
        (Fault::AgentFrozen, Some(g)) if lb.agent_running(g) => lb.signal_agent(g, Signal::SIGCONT),
        (Fault::GuestPaused, Some(_)) => {
            if let Some(p) = a.paused.as_mut() {
                p.resume()?;
            }
        }
        (Fault::CarrierLost, Some(g)) => failover::set_cable(lb, g, true)?,
        (Fault::UplinkSetDown, Some(g)) => failover::set_uplink(lb, g, true)?,
        (Fault::LeaderKilled, None) => {
            for c in 0..2 {
                if lb.controller_pid(c).is_none() {
                    lb.start_controller(c)?;
                }
            }
        }
        (Fault::ApiServerDown, None) => lb
            .rig
            .apiserver_mut()
            .context("API server")?
            .restart()
            .context("restarting the API server")?,
        (Fault::DhcpServerRestarted, None) => lb.rig.start_dhcp(&[])?,
        _ => {}
    }
    report.faults[a.index].ended = Some(Instant::now());
    Ok(())
}

/// What `f` allows: its kind's bound, and for an API outage its whole
/// length too: nothing moves while the API server is down (by design), so
/// a holder that fails during the outage stays unserved until it is back.
fn bound_of(f: &Injected) -> Duration {
    match (f.fault, f.ended) {
        (Fault::ApiServerDown, Some(e)) => f.fault.bound() + (e - f.began) + Duration::from_secs(3),
        _ => f.fault.bound(),
    }
}

/// ARP: no request answered twice; no unanswered stretch longer than the
/// faults around it allow.
fn check_arp(report: &mut SoakReport, ip: Ipv4Addr, rec: &ArpRecord) {
    for p in rec.probes.iter().filter(|p| p.replies.len() > 1) {
        let replies: Vec<String> = p
            .replies
            .iter()
            .map(|(at, mac)| {
                format!(
                    "{} after {:.1} ms",
                    mac.iter()
                        .map(|b| format!("{b:02x}"))
                        .collect::<Vec<_>>()
                        .join(":"),
                    (*at - p.sent).as_secs_f64() * 1e3
                )
            })
            .collect();
        report.violate(
            p.sent,
            format!(
                "an ARP request for {ip} answered twice: {}",
                replies.join(", ")
            ),
        );
    }
    let answered: Vec<Instant> = rec
        .probes
        .iter()
        .filter(|p| !p.replies.is_empty())
        .map(|p| p.sent)
        .collect();
    for w in answered.windows(2) {
        let (from, to) = (w[0], w[1]);
        let gap = to - from;
        if gap < Duration::from_millis(200) {
            continue;
        }
        let around = report.around(from, to);
        let bound = Duration::from_secs(1) + around.iter().map(|f| bound_of(f)).sum::<Duration>();
        let key = around
            .iter()
            .max_by_key(|f| bound_of(f))
            .map(|f| f.fault.label().to_string())
            .unwrap_or_else(|| "no fault".into());
        let worst = report.worst_unserved.entry(key).or_default();
        *worst = (*worst).max(gap);
        if gap > bound {
            report.violate(
                from,
                format!(
                    "{ip} unanswered for {:.2} s (bound {:.1} s for the faults around it)",
                    gap.as_secs_f64(),
                    bound.as_secs_f64()
                ),
            );
        }
    }
}

/// The end state, after the quiet period.
fn check_end(
    lb: &LbRig,
    report: &mut SoakReport,
    svcs: &[Svc],
    addresses: &BTreeSet<Ipv4Addr>,
    at: Instant,
) -> Result<()> {
    for s in svcs {
        if lb.ingress_ip(&s.name) != Some(s.ip) {
            report.violate(
                at,
                format!(
                    "at the end {} has {:?}, not {}",
                    s.name,
                    lb.ingress_ip(&s.name),
                    s.ip
                ),
            );
        }
    }
    for ip in addresses {
        let c = lb.carriers(*ip);
        if c.len() != 1 {
            report.violate(
                at,
                format!("at the end {ip} is on {} guests: {c:?}", c.len()),
            );
        }
    }
    // Every link is one the node's assignments name.
    for g in 0..lb.rig.guest_count() {
        let node = lb.node_name(g);
        let assigned: BTreeSet<String> = lb
            .node_object(&node)
            .and_then(|o| o["spec"]["assignments"].as_array().cloned())
            .unwrap_or_default()
            .iter()
            .filter_map(|a| a["interface"].as_str().map(str::to_string))
            .collect();
        for link in lb.hlb_links(g) {
            if !assigned.contains(&link.name) {
                report.violate(
                    at,
                    format!(
                        "at the end {node} has {} that no assignment of it names",
                        link.name
                    ),
                );
            }
        }
    }
    // One Role and one RoleBinding per node.
    let roles: Api<k8s_openapi::api::rbac::v1::Role> = Api::namespaced(lb.admin(), lb::NAMESPACE);
    let names: BTreeSet<String> = lb
        .block_on(roles.list(&kube::api::ListParams::default()))?
        .items
        .into_iter()
        .filter_map(|r| r.metadata.name)
        .filter(|n| n.starts_with("harvester-node-agent-node-"))
        .collect();
    let want: BTreeSet<String> = (0..lb.rig.guest_count())
        .map(|g| format!("harvester-node-agent-node-{}", lb.node_name(g)))
        .collect();
    if names != want {
        report.violate(
            at,
            format!("at the end the per-node Roles are {names:?}, not {want:?}"),
        );
    }
    Ok(())
}

/// The report as the README shows it.
pub fn print(report: &SoakReport) {
    let mut by_kind: BTreeMap<&str, usize> = BTreeMap::new();
    for f in &report.faults {
        *by_kind.entry(f.fault.label()).or_default() += 1;
    }
    println!("\nfaults injected, by kind:");
    for (k, n) in &by_kind {
        println!("  {n:>4}  {k}");
    }
    println!("worst unanswered stretch of an address, by the worst fault around it:");
    for (k, d) in &report.worst_unserved {
        println!("  {:>8.2} s  {k}", d.as_secs_f64());
    }
    println!("VmRSS at the start and the end (KiB):");
    for (who, kib) in &report.rss_start {
        let end = report
            .rss_end
            .iter()
            .find(|(w, _)| w == who)
            .map(|(_, k)| k.to_string())
            .unwrap_or_else(|| "-".into());
        println!("  {who:<24} {kib:>8} {end:>8}");
    }
    if !report.violations.is_empty() {
        println!("\nviolations:");
        for v in &report.violations {
            println!("- {}", v.what);
        }
    }
    println!("{}", report.summary());
}
