//! A seeded, randomized fault soak on the LoadBalancer rig (issue #20) and
//! an independent checker that reads only the outside world.
//!
//! The schedule: every 1–5 s (seeded) a fault begins on a guest that has
//! none running, on the control plane, or on a Service; each ends after
//! its own random time, so faults overlap. The checker: every guest
//! kernel's addresses (`ip monitor address`), a LAN client asking who has
//! each stable address every 10 ms (one sender MAC per request), a TCP
//! client connecting to each stable address every 250 ms, every Service's
//! status, dnsmasq's log; at the end, after a quiet period, what is left on the
//! machines, in the lease files and in the API, and a TCP answer from every
//! address's holder.
//!
//! The faults include the adversary's (issue #29): one guest cut off from
//! the API server only, one whose LAN port goes silent while its link
//! stays up (its API path, through that port, goes with it), a webhook refusing every Service write, and the
//! Services' owner (with its own token) blanking `requestedIP`, pointing it
//! at another Service's address, or pointing `hwaddr` at another LAN
//! host's MAC.
//!
//! Violations: two answers to one ARP request or two guests holding one
//! address at once (also where one of them could not answer then); a
//! churned Service's address unanswered on the LAN, judged like a stable
//! one's while it is served; a Service's address changing while it lives (a
//! re-pointed secondary must follow its new primary); an address
//! unanswered (ARP) or serving no TCP connection for longer than the
//! largest bound among the faults around the gap that concern it
//! ([`Fault::bound`]; never their sum); a Service not served again in time after it is
//! recreated or switched back, or its old address still held; a
//! DHCPRELEASE of a living Service's address; at the end, a Service
//! without its address, a link no assignment names, an address on other
//! than one guest or not answering TCP from its holder, a lease (dnsmasq's
//! or a node's lease file) of an address no Service has, a missing or extra
//! per-node Role or RoleBinding.
//!
//! The schedule is drawn from the seed, but when a fault begins also
//! depends on how long the rig takes to do the previous ones, so two runs
//! of one seed inject the same kinds in the same order, not always the same
//! count.

use std::collections::{BTreeMap, BTreeSet};
use std::net::Ipv4Addr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::{Context, Result, bail};
use k8s_openapi::api::core::v1::Service;
use kube::Api;

use crate::addrwatch::AddressWatch;
use crate::arpprobe::ArpRecord;
use crate::failover::{self, PausedGuest, guest_namespaces};
use crate::lb::{self, LISTEN_PORT, LbRig};
use crate::tcpprobe::{TcpProber, TcpRecord};

/// What to run.
#[derive(Debug, Clone)]
pub struct SoakOptions {
    pub seed: u64,
    /// How long faults are injected (the quiet period comes after).
    pub duration: Duration,
    /// Stable DHCP Services (`soak-NN`): every fifth is a shared-IP
    /// secondary of the one before it, every seventh has
    /// `externalTrafficPolicy: Local`. Their addresses are probed by ARP
    /// and must never change.
    pub services: usize,
    /// Services whose life the schedule changes (`churn-N`): deleted and
    /// recreated, switched to another class and back. One more Service,
    /// `repoint`, is a secondary the schedule re-points between `soak-00`
    /// and `soak-01` (with at least two stable Services).
    pub churn: usize,
    pub guests: usize,
    /// After the last fault ended: then the end state is checked.
    pub quiet: Duration,
    /// The DHCP lease time (dnsmasq syntax; its minimum, 2 minutes, so
    /// that renewals fall inside the faults).
    pub lease_time: String,
}

impl SoakOptions {
    pub fn new(seed: u64, duration: Duration) -> SoakOptions {
        SoakOptions {
            seed,
            duration,
            services: 20,
            churn: 3,
            guests: 4,
            quiet: Duration::from_secs(20),
            lease_time: "2m".into(),
        }
    }
}

/// Set by [`stop_on_signals`]'s handler: the soak ends its faults, tears
/// the rig down and reports what it saw so far.
static INTERRUPTED: AtomicBool = AtomicBool::new(false);

extern "C" fn on_signal(_: libc::c_int) {
    INTERRUPTED.store(true, Ordering::SeqCst);
}

/// SIGINT and SIGTERM end the soak early and cleanly (every fault ended,
/// the rig torn down) instead of killing the process with the rig's
/// namespaces and processes left behind. A SIGKILLed soak's leftovers are
/// removed by the next rig's start ([`crate::rig::cleanup_stale`]).
pub fn stop_on_signals() -> Result<()> {
    use nix::sys::signal::{SaFlags, SigAction, SigHandler, SigSet, Signal, sigaction};
    let action = SigAction::new(
        SigHandler::Handler(on_signal),
        SaFlags::empty(),
        SigSet::empty(),
    );
    for sig in [Signal::SIGINT, Signal::SIGTERM] {
        // SAFETY: the handler only stores to an atomic.
        unsafe { sigaction(sig, &action) }.context("installing the soak's signal handler")?;
    }
    Ok(())
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
    UplinkRecreated,
    GuestReplaced,
    ApiCutOff,
    PortSilenced,
    PeersCutOff,
    LeaderKilled,
    ApiServerDown,
    DhcpServerRestarted,
    DhcpLeasesLost,
    DhcpDownPastRenewal,
    ServiceRecreated,
    ClassSwitched,
    SecondaryRepointed,
    WebhookDown,
    TenantRewrite,
}

impl Fault {
    const ON_A_GUEST: [Fault; 11] = [
        Fault::AgentKilled,
        Fault::AgentFrozen,
        Fault::AgentRestarted,
        Fault::GuestPaused,
        Fault::CarrierLost,
        Fault::UplinkSetDown,
        Fault::UplinkRecreated,
        Fault::GuestReplaced,
        Fault::ApiCutOff,
        Fault::PortSilenced,
        Fault::PeersCutOff,
    ];
    const ON_THE_CLUSTER: [Fault; 10] = [
        Fault::LeaderKilled,
        Fault::ApiServerDown,
        Fault::DhcpServerRestarted,
        Fault::DhcpLeasesLost,
        Fault::DhcpDownPastRenewal,
        Fault::ServiceRecreated,
        Fault::ClassSwitched,
        Fault::SecondaryRepointed,
        Fault::WebhookDown,
        Fault::TenantRewrite,
    ];

    pub fn label(self) -> &'static str {
        match self {
            Fault::AgentKilled => "agent SIGKILL, restarted 0-2 s later",
            Fault::AgentFrozen => "agent SIGSTOP 0.1-10 s",
            Fault::AgentRestarted => "agent restarted (SIGTERM)",
            Fault::GuestPaused => "guest paused 0.1-8 s",
            Fault::CarrierLost => "uplink carrier lost 0.5-5 s",
            Fault::UplinkSetDown => "uplink set down 0.5-5 s",
            Fault::UplinkRecreated => "uplink deleted, recreated 0.5-5 s later",
            Fault::GuestReplaced => "guest deleted, a new one of its name 1-5 s later",
            Fault::ApiCutOff => "guest cut off from the API server only 5-60 s",
            Fault::PortSilenced => {
                "guest's LAN port silent (its API path with it), carrier up 0.5-5 s"
            }
            Fault::PeersCutOff => {
                "guest's LAN port cut off from its peers' ports only (gateway, DHCP and API server still reach it) 0.5-5 s"
            }
            Fault::LeaderKilled => "controller leader SIGKILL",
            Fault::ApiServerDown => "API server + etcd down 1-40 s",
            Fault::DhcpServerRestarted => "DHCP server down 0-5 s",
            Fault::DhcpLeasesLost => "DHCP server down 0-5 s, its lease database lost",
            Fault::DhcpDownPastRenewal => "DHCP server down 20-50 s (past renewals)",
            Fault::ServiceRecreated => "Service deleted, recreated 3-8 s later",
            Fault::ClassSwitched => "Service switched to another class, back 3-8 s later",
            Fault::SecondaryRepointed => "secondary re-pointed, back 3-8 s later",
            Fault::WebhookDown => "a webhook refusing every Service write 10-60 s",
            Fault::TenantRewrite => {
                "the tenant blanks requestedIP, points it at another Service's address, or sets hwaddr to a LAN host's MAC, 3-8 s"
            }
        }
    }

    fn dhcp(self) -> bool {
        matches!(
            self,
            Fault::DhcpServerRestarted | Fault::DhcpLeasesLost | Fault::DhcpDownPastRenewal
        )
    }

    fn on_a_service(self) -> bool {
        matches!(
            self,
            Fault::ServiceRecreated
                | Fault::ClassSwitched
                | Fault::SecondaryRepointed
                | Fault::TenantRewrite
        )
    }

    /// How long its holder's addresses may go unanswered because of it:
    /// the witnesses' verdict on the LAN (the address lifetime, 1 s, and
    /// 250 ms), the controller's move and the takeover (guard,
    /// INIT-REBOOT), with a margin for this 2-core machine. Faults that
    /// move nothing: a second. (Outages of the API or DHCP server add their
    /// length; see docs/benchmarks.md, "Fault soak".)
    pub fn bound(self) -> Duration {
        Duration::from_millis(match self {
            Fault::AgentKilled | Fault::AgentFrozen | Fault::GuestPaused | Fault::GuestReplaced => {
                6_000
            }
            // The node cannot tell; its witnesses can, and the controller
            // moves it on their word (issue #30).
            Fault::CarrierLost
            | Fault::UplinkSetDown
            | Fault::UplinkRecreated
            | Fault::AgentRestarted
            | Fault::PortSilenced
            | Fault::PeersCutOff => 3_000,
            // Its witnesses hear it: nothing it holds moves, it serves on;
            // but for up to the staleness bound it looks like any live
            // node, and a Service given to it meanwhile (another fault's)
            // waits until the controller sees it unread (3 s) and moves it.
            Fault::ApiCutOff => 5_000,
            Fault::LeaderKilled
            | Fault::ApiServerDown
            | Fault::DhcpServerRestarted
            | Fault::DhcpLeasesLost
            | Fault::DhcpDownPastRenewal
            | Fault::ServiceRecreated
            | Fault::ClassSwitched
            | Fault::SecondaryRepointed
            | Fault::WebhookDown
            | Fault::TenantRewrite => 1_000,
        })
    }

    fn length(self, rng: &mut fastrand::Rng) -> Duration {
        let mut ms = |lo: u64, hi: u64| Duration::from_millis(rng.u64(lo..=hi));
        match self {
            Fault::AgentKilled => ms(0, 2_000),
            Fault::AgentFrozen => ms(100, 10_000),
            Fault::AgentRestarted => Duration::ZERO,
            Fault::GuestPaused => ms(100, 8_000),
            Fault::CarrierLost | Fault::UplinkSetDown | Fault::UplinkRecreated => ms(500, 5_000),
            Fault::GuestReplaced => ms(1_000, 5_000),
            Fault::ApiCutOff => ms(5_000, 60_000),
            Fault::PortSilenced | Fault::PeersCutOff => ms(500, 5_000),
            Fault::WebhookDown => ms(10_000, 60_000),
            Fault::TenantRewrite => ms(3_000, 8_000),
            Fault::LeaderKilled => ms(500, 2_000),
            Fault::ApiServerDown => ms(1_000, 40_000),
            Fault::DhcpServerRestarted | Fault::DhcpLeasesLost => ms(0, 5_000),
            Fault::DhcpDownPastRenewal => ms(20_000, 50_000),
            Fault::ServiceRecreated | Fault::ClassSwitched | Fault::SecondaryRepointed => {
                ms(3_000, 8_000)
            }
        }
    }
}

/// How soon a guest whose API path is back has read its assignments again
/// (its watch's reconnect and backoff).
const API_BACK_WITHIN: Duration = Duration::from_secs(5);

/// A fault as it happened.
#[derive(Debug, Clone)]
pub struct Injected {
    pub fault: Fault,
    /// The guest, for faults on a guest.
    pub guest: Option<usize>,
    /// The Service, for faults on a Service.
    pub service: Option<String>,
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
    /// The same for the TCP client's longest stretch without an answered
    /// connection.
    pub worst_unserved_tcp: BTreeMap<String, Duration>,
    /// VmRSS (KiB) of the agents and controllers at the start and the end.
    pub rss_start: Vec<(String, u64)>,
    pub rss_end: Vec<(String, u64)>,
    pub t0: Instant,
    /// Leases (dnsmasq's, nodes' lease files) of addresses no Service has
    /// that were not renewed after the Service let them go: a DHCPRELEASE
    /// that could not be delivered; they end with the lease time.
    pub leases_left_to_expire: usize,
    /// Ended early by SIGINT or SIGTERM ([`stop_on_signals`]): the end
    /// state was not checked.
    pub interrupted: bool,
}

impl SoakReport {
    /// The last line of every soak run.
    pub fn summary(&self) -> String {
        format!(
            "soak: seed {}, {} faults, {} violations{}",
            self.seed,
            self.faults.len(),
            self.violations.len(),
            if self.interrupted {
                " (interrupted: end state not checked)"
            } else {
                ""
            }
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

    /// What the control plane's faults around `[from, to]` add to a
    /// deadline: nothing is decided while the API server is down or no
    /// leader leads, and no address is had while the DHCP server is down.
    fn control_plane_allowance(&self, from: Instant, to: Instant) -> Duration {
        self.around(from, to)
            .iter()
            .filter(|f| f.guest.is_none() && f.service.is_none())
            .map(|f| bound_of(f))
            .sum()
    }

    /// What the guests' faults around `[from, to]` add to the deadline of a
    /// Service that has no address yet: any of them may have been on the
    /// holder chosen for it (whom the controller chose is not seen from
    /// outside until an address is held), and each such fault costs a
    /// takeover (30 minutes of seed 7: a Service moved five times in 16 s
    /// as its holders failed one after the other, all four guests at fault).
    fn guest_allowance(&self, from: Instant, to: Instant) -> Duration {
        self.around(from, to)
            .iter()
            .filter(|f| f.guest.is_some())
            .map(|f| bound_of(f))
            .sum()
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
                        .or_else(|| f.service.as_ref().map(|s| format!(" on {s}")))
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

/// A stable Service of the soak.
struct Svc {
    name: String,
    ip: Ipv4Addr,
    /// A secondary shares its primary's address and has no prober of its
    /// own.
    secondary: bool,
}

/// How long a Service may go without an address after it was created or
/// switched back to our class.
const SERVE_WITHIN: Duration = Duration::from_secs(20);
/// How long a re-pointed secondary may show its old primary's address.
const FOLLOW_WITHIN: Duration = Duration::from_secs(5);
/// A DHCP outage after another must not make a lease miss both its renewal
/// and its rebinding (which would end it, rightly): one at a time, a
/// minute apart.
const DHCP_COOLDOWN: Duration = Duration::from_secs(60);
/// The class a Service is switched to (no controller serves it).
const OTHER_CLASS: &str = "example.com/not-ours";

/// What the checker expects of a Service whose life the schedule changes.
#[derive(Debug, Clone)]
enum Life {
    /// Ours since `since`: an address within [`SERVE_WITHIN`], then that
    /// address while it lives.
    Served {
        since: Instant,
        ip: Option<Ipv4Addr>,
        late_reported: bool,
    },
    /// Deleted, or of another class: its address (if it had one) must
    /// leave every guest.
    Away { old: Option<Ipv4Addr> },
}

struct Churn {
    name: String,
    port: u16,
    life: Life,
    /// Every address it had (checked for two holders at the end).
    seen: BTreeSet<Ipv4Addr>,
    /// While it is served: who answers ARP and TCP for its address, asked
    /// from the LAN, judged like a stable Service's when it goes away or
    /// at the end (issue #29: not from its status, the controller's own
    /// output).
    probes: Option<LanProbes>,
}

/// A LAN client asking after one address.
struct LanProbes {
    ip: Ipv4Addr,
    arp: crate::arpprobe::ArpProber,
    tcp: TcpProber,
}

impl LanProbes {
    fn start(lb: &LbRig, ip: Ipv4Addr) -> Result<LanProbes> {
        Ok(LanProbes {
            ip,
            arp: failover::arp_prober(lb, ip)?,
            tcp: TcpProber::start(&lb.client_ns, ip, LISTEN_PORT, TCP_EVERY)?,
        })
    }

    /// Stops asking and judges the answers.
    fn judge(self, report: &mut SoakReport, watch: &AddressWatch) -> Result<()> {
        let arp = self.arp.finish()?;
        let tcp = self.tcp.finish()?;
        check_arp(report, watch, self.ip, &arp);
        check_tcp(report, watch, self.ip, &tcp);
        Ok(())
    }
}

/// The secondary the schedule re-points between the first two stable
/// Services.
struct Repoint {
    /// Index of its primary in the stable Services (0 or 1).
    primary: usize,
    since: Instant,
    reported: bool,
}
const REPOINT: &str = "repoint";
const PRIMARY_SERVICE: &str = "cloudprovider.harvesterhci.io/primary-service";

/// Every Service's first ingress address, or `None` where the API could
/// not be read (the API server is down): never panics.
fn statuses(lb: &LbRig) -> Option<BTreeMap<String, Option<Ipv4Addr>>> {
    let api: Api<Service> = Api::namespaced(lb.admin(), "default");
    let list = lb
        .block_on(api.list(&kube::api::ListParams::default()))
        .ok()?;
    Some(
        list.items
            .iter()
            .map(|s| {
                (
                    s.metadata.name.clone().unwrap_or_default(),
                    lb::ingress_ip(s),
                )
            })
            .collect(),
    )
}

fn merge_patch(lb: &LbRig, name: &str, patch: serde_json::Value) -> Result<()> {
    let api: Api<Service> = Api::namespaced(lb.admin(), "default");
    lb.block_on(api.patch(
        name,
        &kube::api::PatchParams::default(),
        &kube::api::Patch::Merge(&patch),
    ))
    .with_context(|| format!("patching Service {name} with {patch}"))?;
    Ok(())
}

/// Service `name` switched to LoadBalancer class `class` (`None`: none,
/// ours). The class of a LoadBalancer cannot change in place, so it goes
/// by way of ClusterIP, as a user must.
fn set_class(lb: &LbRig, name: &str, class: Option<&str>) -> Result<()> {
    leave_class(lb, name)?;
    enter_class(lb, name, class)
}

/// Service `name` made a ClusterIP: no load balancer's any more.
fn leave_class(lb: &LbRig, name: &str) -> Result<()> {
    merge_patch(
        lb,
        name,
        serde_json::json!({"spec": {"type": "ClusterIP", "loadBalancerClass": null}}),
    )
}

/// Service `name` made a LoadBalancer again, of `class`.
fn enter_class(lb: &LbRig, name: &str, class: Option<&str>) -> Result<()> {
    merge_patch(
        lb,
        name,
        serde_json::json!({"spec": {"type": "LoadBalancer", "loadBalancerClass": class}}),
    )
}

/// A fault under way and how to end it.
struct Active {
    index: usize,
    ends: Instant,
    /// When it was first due to end (an end that cannot be done yet, such
    /// as recreating a Service whose deletion is not finished, is retried).
    due: Instant,
    paused: Option<PausedGuest>,
    split: Option<failover::LanSplit>,
}

/// Everything the soak runs and watches.
struct Soak {
    lb: LbRig,
    watch: AddressWatch,
    report: SoakReport,
    stable: Vec<Svc>,
    churn: Vec<Churn>,
    repoint: Option<Repoint>,
    last_dhcp_end: Option<Instant>,
    /// When each address of a churned Service stopped being its (wall
    /// clock, as lease files and dnsmasq count).
    gone_at: BTreeMap<Ipv4Addr, SystemTime>,
    lease_secs: u64,
    /// The Services' owner, with its own token (`edit` in `default` only).
    tenant: kube::Client,
    /// Per Service the tenant rewrote: its `hwaddr` before, to put back.
    rewritten: BTreeMap<String, Option<String>>,
}

/// The webhook of [`Fault::WebhookDown`].
const FAILING_WEBHOOK: &str = "soak-policy-engine";
const HWADDR: &str = "kube-vip.io/hwaddr";
const REQUESTED_IP: &str = "kube-vip.io/requestedIP";

/// Runs the soak. Whatever happens, the rig (and everything it started)
/// goes when this returns: the `LbRig` is dropped, and a paused guest is
/// resumed first.
pub fn run(bin: &str, manifests: PathBuf, opts: &SoakOptions) -> Result<SoakReport> {
    println!(
        "soak: seed {} (replay with --seed {}), {:?} of faults on {} guests, {} + {} Services",
        opts.seed,
        opts.seed,
        opts.duration,
        opts.guests,
        opts.services,
        opts.churn + usize::from(opts.services >= 2)
    );
    let mut rng = fastrand::Rng::with_seed(opts.seed);
    let mut lo = lb::Options::new(bin, manifests);
    lo.guests = opts.guests;
    lo.endpoint_slices = true;
    lo.lease_time = Some(opts.lease_time.clone());
    // Outside systemd, a restart is told apart by configuration: the
    // `AgentRestarted` fault is a restart that keeps the addresses.
    lo.agent_config = "lb_keep_on_stop = \"always\"\n".into();
    // The API server behind the guests' uplinks, as a single-NIC guest
    // reaches it (the rig's default): an uplink or port fault cuts both.
    let lb = LbRig::start(lo)?;
    let tenant = lb.tenant("default")?;

    // The Services: primaries, shared-IP secondaries, Local ones.
    let mut stable: Vec<Svc> = Vec::new();
    let nodes: Vec<String> = (0..opts.guests).map(|g| lb.node_name(g)).collect();
    for i in 0..opts.services {
        let name = format!("soak-{i:02}");
        let port = LISTEN_PORT + 100 + i as u16;
        if i % 5 == 4 {
            let primary = stable
                .last()
                .context("a secondary needs a primary")?
                .name
                .clone();
            lb.create_service(
                &name,
                &[
                    (crate::failover::IPAM, "dhcp"),
                    (PRIMARY_SERVICE, &format!("default/{primary}")),
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
        stable.push(Svc {
            name,
            ip: Ipv4Addr::UNSPECIFIED,
            secondary: i % 5 == 4,
        });
    }
    let mut churn = Vec::new();
    for i in 0..opts.churn {
        let c = Churn {
            name: format!("churn-{i}"),
            port: LISTEN_PORT + 200 + i as u16,
            life: Life::Served {
                since: Instant::now(),
                ip: None,
                late_reported: false,
            },
            seen: BTreeSet::new(),
            probes: None,
        };
        lb.create_service(&c.name, &[(crate::failover::IPAM, "dhcp")], &[c.port])?;
        churn.push(c);
    }
    let repoint = (opts.services >= 2).then(|| Repoint {
        primary: 0,
        since: Instant::now(),
        reported: false,
    });
    if repoint.is_some() {
        lb.create_service(
            REPOINT,
            &[
                (crate::failover::IPAM, "dhcp"),
                (PRIMARY_SERVICE, "default/soak-00"),
            ],
            &[LISTEN_PORT + 90],
        )?;
    }
    for s in &mut stable {
        s.ip = lb.wait_ingress(&s.name, Duration::from_secs(120));
    }
    for c in &mut churn {
        let ip = lb.wait_ingress(&c.name, Duration::from_secs(120));
        c.probes = Some(LanProbes::start(&lb, ip)?);
        c.seen.insert(ip);
        c.life = Life::Served {
            since: Instant::now(),
            ip: Some(ip),
            late_reported: false,
        };
    }
    let addresses: BTreeSet<Ipv4Addr> = stable
        .iter()
        .filter(|s| !s.secondary)
        .map(|s| s.ip)
        .collect();
    for ip in addresses.iter().chain(churn.iter().flat_map(|c| &c.seen)) {
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
    let mut tcp_probers = Vec::new();
    for ip in &addresses {
        probers.push((*ip, failover::arp_prober(&lb, *ip)?));
        tcp_probers.push((
            *ip,
            TcpProber::start(&lb.client_ns, *ip, LISTEN_PORT, TCP_EVERY)?,
        ));
    }
    let dhcp_log_mark = lb.dnsmasq_log_len();
    let t0 = Instant::now();
    let report = SoakReport {
        seed: opts.seed,
        faults: Vec::new(),
        violations: Vec::new(),
        worst_unserved: BTreeMap::new(),
        worst_unserved_tcp: BTreeMap::new(),
        rss_start: rss_all(&lb, opts.guests),
        rss_end: Vec::new(),
        t0,
        leases_left_to_expire: 0,
        interrupted: false,
    };
    let mut soak = Soak {
        lb,
        watch,
        report,
        stable,
        churn,
        repoint,
        last_dhcp_end: None,
        gone_at: BTreeMap::new(),
        lease_secs: lease_secs(&opts.lease_time)?,
        tenant,
        rewritten: BTreeMap::new(),
    };

    let mut active: Vec<Active> = Vec::new();
    let mut next_fault = t0 + Duration::from_secs(1);
    let mut last_seen: BTreeMap<String, Option<Ipv4Addr>> = soak
        .stable
        .iter()
        .map(|s| (s.name.clone(), Some(s.ip)))
        .collect();
    let mut next_status = t0;
    let mut end = t0 + opts.duration;
    loop {
        let now = Instant::now();
        if INTERRUPTED.load(Ordering::SeqCst) && !soak.report.interrupted {
            println!("soak: interrupted; ending the faults under way");
            soak.report.interrupted = true;
            end = now;
        }
        // End what is due.
        let mut k = 0;
        while k < active.len() {
            if active[k].ends <= now || now >= end {
                let mut a = active.remove(k);
                if !soak.end_fault(&mut a)? {
                    // Not yet possible: try again soon (or give up).
                    if now - a.due > Duration::from_secs(90) {
                        let what = format!(
                            "{} could not be ended within 90 s",
                            soak.report.faults[a.index].fault.label()
                        );
                        soak.report.violate(now, what);
                        soak.report.faults[a.index].ended = Some(now);
                    } else {
                        a.ends = now + Duration::from_millis(500);
                        active.insert(k, a);
                        k += 1;
                    }
                }
            } else {
                k += 1;
            }
        }
        if now >= end && active.is_empty() {
            break;
        }
        if now >= next_fault && now < end {
            // The same draws every time, whatever is busy: a seed replays
            // the same sequence of candidate faults.
            next_fault = now + Duration::from_millis(rng.u64(1_000..=5_000));
            let on_cluster = rng.u8(0..3) == 0;
            let cluster_fault = Fault::ON_THE_CLUSTER[rng.usize(..Fault::ON_THE_CLUSTER.len())];
            let guest_fault = Fault::ON_A_GUEST[rng.usize(..Fault::ON_A_GUEST.len())];
            let pick = rng.usize(..1_000);
            let length_cluster = cluster_fault.length(&mut rng);
            let length_guest = guest_fault.length(&mut rng);
            let begun = if on_cluster {
                soak.cluster_target(&active, cluster_fault, pick, now)
                    .map(|target| (cluster_fault, target, length_cluster))
            } else {
                let busy: BTreeSet<usize> = active
                    .iter()
                    .filter_map(|a| soak.report.faults[a.index].guest)
                    .collect();
                let free: Vec<usize> = (0..opts.guests).filter(|g| !busy.contains(g)).collect();
                // Never more than two of the four at once: two must be left
                // to agree that a node is dead on the LAN (one voice never
                // moves a node; with three down, the one left waits for
                // their heartbeats to go stale, 40 s).
                (free.len() > 2).then(|| {
                    (
                        guest_fault,
                        Target::Guest(free[pick % free.len()]),
                        length_guest,
                    )
                })
            };
            if let Some((fault, target, length)) = begun
                && let Some(a) = soak.begin_fault(fault, target, length)?
            {
                active.push(a);
            }
        }
        if now >= next_status {
            next_status = now + Duration::from_millis(250);
            if let Some(st) = statuses(&soak.lb) {
                soak.check_statuses(now, &st, &mut last_seen);
            }
            soak.probe_served();
        }
        std::thread::sleep(Duration::from_millis(50));
    }

    // Quiet: then the end state.
    let quiet_from = Instant::now();
    if !soak.report.interrupted {
        std::thread::sleep(opts.quiet);
    }
    let records: Vec<(Ipv4Addr, ArpRecord)> = probers
        .into_iter()
        .map(|(ip, p)| Ok((ip, p.finish()?)))
        .collect::<Result<_>>()?;
    for (ip, rec) in &records {
        check_arp(&mut soak.report, &soak.watch, *ip, rec);
    }
    for (ip, p) in tcp_probers {
        let rec = p.finish()?;
        check_tcp(&mut soak.report, &soak.watch, ip, &rec);
    }
    let still: Vec<LanProbes> = soak
        .churn
        .iter_mut()
        .filter_map(|c| c.probes.take())
        .collect();
    for p in still {
        p.judge(&mut soak.report, &soak.watch)?;
    }
    let churned: BTreeSet<Ipv4Addr> = soak.churn.iter().flat_map(|c| c.seen.clone()).collect();
    for ip in addresses.iter().chain(&churned) {
        // Held by two guests at once is a violation even where one of them
        // could not answer then (its uplink cut, its port silent): it
        // answers the moment that ends (issue #29).
        for (at, holders) in soak.watch.overlaps(*ip) {
            if holders.len() > 1 {
                let record = kernel_record(
                    &soak.watch,
                    *ip,
                    at.checked_sub(Duration::from_secs(5)).unwrap_or(at),
                    at + Duration::from_secs(15),
                );
                soak.report.violate(
                    at,
                    format!("{ip} held by guests {holders:?} at once; {record}"),
                );
            }
        }
    }
    let log = soak.lb.dnsmasq_log_from(dhcp_log_mark);
    for line in log.lines().filter(|l| l.contains("DHCPRELEASE")) {
        if let Some(ip) = addresses.iter().find(|ip| line.contains(&ip.to_string())) {
            soak.report.violate(
                Instant::now(),
                format!("DHCPRELEASE of living {ip}: {line}"),
            );
        }
    }
    if !soak.report.interrupted {
        soak.check_end(quiet_from)?;
    }
    soak.report.rss_end = rss_all(&soak.lb, opts.guests);
    if !soak.report.violations.is_empty() {
        keep_logs(&soak.lb, opts.seed);
    }
    Ok(soak.report)
}

/// The agents', controllers' and dnsmasq's logs of a run that found
/// something, copied out of the rig's directory (which goes with the rig)
/// so that a violation can be traced afterwards.
fn keep_logs(lb: &LbRig, seed: u64) {
    let to = std::env::temp_dir().join(format!("hna-soak-{seed}-{}", std::process::id()));
    let copy = |from: &std::path::Path, name: &str| {
        let _ = std::fs::create_dir_all(&to);
        let _ = std::fs::copy(from, to.join(name));
    };
    let Ok(entries) = std::fs::read_dir(lb.rig.dir()) else {
        return;
    };
    for e in entries.flatten() {
        let path = e.path();
        let name = e.file_name().to_string_lossy().to_string();
        if name.ends_with(".log") {
            copy(&path, &name);
        } else if name.starts_with("agent-") {
            copy(&path.join("agent.log"), &format!("{name}.log"));
        }
    }
    println!("soak: the logs of this run are kept in {}", to.display());
}

fn unix_ms(t: SystemTime) -> u64 {
    t.duration_since(UNIX_EPOCH).unwrap_or_default().as_millis() as u64
}

/// Seconds of a dnsmasq lease time (`2m`, `1h`, `120`).
fn lease_secs(text: &str) -> Result<u64> {
    let (n, unit) = match text.char_indices().last() {
        Some((i, c)) if c.is_ascii_alphabetic() => (&text[..i], c),
        _ => (text, 's'),
    };
    let n: u64 = n.parse().with_context(|| format!("lease time {text:?}"))?;
    Ok(match unit {
        's' => n,
        'm' => n * 60,
        'h' => n * 3_600,
        'd' => n * 86_400,
        _ => bail!("lease time {text:?}: unknown unit {unit}"),
    })
}

/// What a fault acts on.
#[derive(Debug, Clone)]
enum Target {
    Guest(usize),
    Cluster,
    Service(String),
}

impl Soak {
    /// What cluster fault `f` may act on now, if anything: one API outage
    /// or leader kill at a time, one DHCP outage at a time and a minute
    /// apart, Service faults while the API server is up and on a Service
    /// no other fault has.
    fn cluster_target(
        &self,
        active: &[Active],
        f: Fault,
        pick: usize,
        now: Instant,
    ) -> Option<Target> {
        let running: Vec<&Injected> = active
            .iter()
            .map(|a| &self.report.faults[a.index])
            .collect();
        if f.dhcp() {
            let recent = self
                .last_dhcp_end
                .is_some_and(|e| now.duration_since(e) < DHCP_COOLDOWN);
            return (!recent && !running.iter().any(|r| r.fault.dhcp())).then_some(Target::Cluster);
        }
        if !f.on_a_service() {
            return (!running.iter().any(|r| r.fault == f)).then_some(Target::Cluster);
        }
        if running.iter().any(|r| r.fault == Fault::ApiServerDown) {
            return None;
        }
        let busy: BTreeSet<&str> = running
            .iter()
            .filter_map(|r| r.service.as_deref())
            .collect();
        match f {
            Fault::SecondaryRepointed => (self.repoint.is_some() && !busy.contains(REPOINT))
                .then(|| Target::Service(REPOINT.into())),
            Fault::TenantRewrite => {
                let free: Vec<&Svc> = self
                    .stable
                    .iter()
                    .filter(|s| !s.secondary && !busy.contains(s.name.as_str()))
                    .collect();
                (!free.is_empty()).then(|| Target::Service(free[pick % free.len()].name.clone()))
            }
            _ => {
                let free: Vec<&Churn> = self
                    .churn
                    .iter()
                    .filter(|c| !busy.contains(c.name.as_str()))
                    .collect();
                (!free.is_empty()).then(|| Target::Service(free[pick % free.len()].name.clone()))
            }
        }
    }

    /// Begins `fault`; `None` when it could not be begun (then nothing
    /// was done).
    fn begin_fault(
        &mut self,
        fault: Fault,
        target: Target,
        length: Duration,
    ) -> Result<Option<Active>> {
        use nix::sys::signal::Signal;
        let lb = &mut self.lb;
        let began = Instant::now();
        let mut paused = None;
        let mut split = None;
        let guest = match &target {
            Target::Guest(g) => Some(*g),
            _ => None,
        };
        let service = match &target {
            Target::Service(s) => Some(s.clone()),
            _ => None,
        };
        match (fault, &target) {
            (Fault::AgentKilled, Target::Guest(g)) if lb.agent_running(*g) => {
                lb.signal_agent(*g, Signal::SIGKILL)
            }
            (Fault::AgentFrozen, Target::Guest(g)) if lb.agent_running(*g) => {
                lb.signal_agent(*g, Signal::SIGSTOP)
            }
            (Fault::AgentRestarted, Target::Guest(g)) if lb.agent_running(*g) => {
                let st = lb.stop_agent(*g);
                if !st.success() {
                    self.report
                        .violate(began, format!("guest {g}'s agent stopped with {st}"));
                }
                lb.start_agent(*g)?;
            }
            (Fault::GuestPaused, Target::Guest(g)) => paused = Some(PausedGuest::pause(lb, *g)?),
            (Fault::CarrierLost, Target::Guest(g)) => failover::set_cable(lb, *g, false)?,
            (Fault::UplinkSetDown, Target::Guest(g)) => failover::set_uplink(lb, *g, false)?,
            (Fault::UplinkRecreated, Target::Guest(g)) => failover::delete_uplink(lb, *g)?,
            (Fault::GuestReplaced, Target::Guest(g)) => {
                lb.delete_guest(*g)?;
                self.watch.gone(*g, Instant::now());
            }
            (Fault::ApiCutOff, Target::Guest(g)) => lb.cut_api(*g),
            (Fault::PortSilenced, Target::Guest(g)) => failover::set_port(lb, *g, false)?,
            (Fault::PeersCutOff, Target::Guest(g)) => {
                split = Some(failover::LanSplit::split(lb, &[*g])?)
            }
            (Fault::WebhookDown, Target::Cluster) => {
                if let Err(e) = lb.install_failing_webhook(FAILING_WEBHOOK, "") {
                    println!("soak: {} not begun: {e:#}", fault.label());
                    let _ = lb.remove_webhook(FAILING_WEBHOOK, "");
                    return Ok(None);
                }
            }
            (Fault::TenantRewrite, Target::Service(name)) => {
                if let Err(e) = self.tenant_rewrite(name) {
                    println!("soak: {} not begun: {e:#}", fault.label());
                    return Ok(None);
                }
            }
            (Fault::LeaderKilled, Target::Cluster) => {
                if let Some(c) = lb
                    .leader()
                    .and_then(|l| (0..2).find(|&c| LbRig::controller_identity(c) == l))
                {
                    lb.kill_controller(c);
                }
            }
            (Fault::ApiServerDown, Target::Cluster) => {
                lb.rig.apiserver_mut().context("API server")?.stop()
            }
            (Fault::DhcpServerRestarted | Fault::DhcpDownPastRenewal, Target::Cluster) => {
                lb.rig.stop_dhcp()
            }
            (Fault::DhcpLeasesLost, Target::Cluster) => {
                lb.rig.stop_dhcp();
                std::fs::write(lb.rig.leases_path(), "")
                    .context("emptying dnsmasq's lease file")?;
            }
            (Fault::ServiceRecreated, Target::Service(name)) => {
                let old = self.churn_ip(name);
                if let Err(e) = self.lb.delete_service(name) {
                    println!("soak: {} not begun: {e:#}", fault.label());
                    return Ok(None);
                }
                self.set_life(name, Life::Away { old });
            }
            (Fault::ClassSwitched, Target::Service(name)) => {
                let old = self.churn_ip(name);
                // Not ours once it is a ClusterIP: refused (a webhook), the
                // fault did not begin.
                if let Err(e) = leave_class(&self.lb, name) {
                    println!("soak: {} not begun: {e:#}", fault.label());
                    return Ok(None);
                }
                if let Err(e) = enter_class(&self.lb, name, Some(OTHER_CLASS)) {
                    // Half switched is still not ours; the end switches it back.
                    println!("soak: {}: {e:#}", fault.label());
                }
                self.set_life(name, Life::Away { old });
            }
            (Fault::SecondaryRepointed, Target::Service(name)) => {
                let Some(r) = self.repoint.as_mut() else {
                    return Ok(None);
                };
                let to = 1 - r.primary;
                let target = format!("default/{}", self.stable[to].name);
                if let Err(e) = lb.annotate(name, PRIMARY_SERVICE, Some(&target)) {
                    println!("soak: {} not begun: {e:#}", fault.label());
                    return Ok(None);
                }
                *r = Repoint {
                    primary: to,
                    since: Instant::now(),
                    reported: false,
                };
            }
            _ => {}
        }
        println!(
            "+{:.1}s {}{} for {:.1}s",
            (began - self.report.t0).as_secs_f64(),
            fault.label(),
            match &target {
                Target::Guest(g) => format!(" on guest {g}"),
                Target::Service(s) => format!(" on {s}"),
                Target::Cluster => String::new(),
            },
            length.as_secs_f64()
        );
        self.report.faults.push(Injected {
            fault,
            guest,
            service,
            began,
            ended: None,
        });
        Ok(Some(Active {
            index: self.report.faults.len() - 1,
            ends: began + length,
            due: began + length,
            paused,
            split,
        }))
    }

    /// Ends a fault; `false` when that cannot be done yet (try again).
    fn end_fault(&mut self, a: &mut Active) -> Result<bool> {
        use nix::sys::signal::Signal;
        let f = self.report.faults[a.index].clone();
        let now = Instant::now();
        let lb = &mut self.lb;
        match (f.fault, f.guest, f.service.as_deref()) {
            (Fault::AgentKilled, Some(g), _) if !lb.agent_running(g) => lb.start_agent(g)?,
            (Fault::AgentFrozen, Some(g), _) if lb.agent_running(g) => {
                lb.signal_agent(g, Signal::SIGCONT)
            }
            (Fault::GuestPaused, Some(_), _) => {
                if let Some(p) = a.paused.as_mut() {
                    p.resume()?;
                }
            }
            (Fault::CarrierLost, Some(g), _) => failover::set_cable(lb, g, true)?,
            (Fault::UplinkSetDown, Some(g), _) => failover::set_uplink(lb, g, true)?,
            (Fault::UplinkRecreated, Some(g), _) => failover::recreate_uplink(lb, g)?,
            (Fault::GuestReplaced, Some(g), _) => {
                lb.replace_guest(g)?;
                let ns = lb.rig.guest_ns(g).to_string();
                self.watch.rewatch(g, &ns)?;
            }
            (Fault::ApiCutOff, Some(g), _) => lb.restore_api(g)?,
            (Fault::PortSilenced, Some(g), _) => failover::set_port(lb, g, true)?,
            (Fault::PeersCutOff, Some(_), _) => {
                if let Some(s) = a.split.as_mut() {
                    s.heal()?;
                }
            }
            (Fault::WebhookDown, None, _) if lb.remove_webhook(FAILING_WEBHOOK, "").is_err() => {
                return Ok(false);
            }
            (Fault::TenantRewrite, _, Some(name)) => {
                if let Some(hwaddr) = self.rewritten.get(name).cloned() {
                    let back = self
                        .lb
                        .annotate_as(&self.tenant, name, HWADDR, hwaddr.as_deref());
                    if back.is_err() {
                        return Ok(false);
                    }
                    self.rewritten.remove(name);
                }
            }
            (Fault::LeaderKilled, None, _) => {
                for c in 0..2 {
                    if lb.controller_pid(c).is_none() {
                        lb.start_controller(c)?;
                    }
                }
            }
            (Fault::ApiServerDown, None, _) => lb
                .rig
                .apiserver_mut()
                .context("API server")?
                .restart()
                .context("restarting the API server")?,
            (
                Fault::DhcpServerRestarted | Fault::DhcpLeasesLost | Fault::DhcpDownPastRenewal,
                None,
                _,
            ) => {
                lb.rig.start_dhcp(&[])?;
                self.last_dhcp_end = Some(now);
            }
            (Fault::ServiceRecreated, _, Some(name)) => {
                // Recreated once the old one is gone (its finalizer lifted
                // after its address was released).
                match lb.block_on(lb.services().get_opt(name)) {
                    Ok(None) => {}
                    Ok(Some(_)) | Err(_) => return Ok(false),
                }
                self.check_left(name, now);
                let port = self.churn_port(name);
                if self
                    .lb
                    .create_service(name, &[(crate::failover::IPAM, "dhcp")], &[port])
                    .is_err()
                {
                    return Ok(false);
                }
                self.serve_again(name);
            }
            (Fault::ClassSwitched, _, Some(name)) => {
                self.check_left(name, now);
                let back = set_class(&self.lb, name, None);
                if back.is_err() {
                    return Ok(false);
                }
                self.serve_again(name);
            }
            (Fault::SecondaryRepointed, _, Some(name)) => {
                let Some(r) = self.repoint.as_mut() else {
                    return Ok(true);
                };
                let to = 1 - r.primary;
                let target = format!("default/{}", self.stable[to].name);
                if lb.annotate(name, PRIMARY_SERVICE, Some(&target)).is_err() {
                    return Ok(false);
                }
                *r = Repoint {
                    primary: to,
                    since: Instant::now(),
                    reported: false,
                };
            }
            _ => {}
        }
        self.report.faults[a.index].ended = Some(Instant::now());
        Ok(true)
    }

    /// The tenant, with its own token, blanks `requestedIP` of Service
    /// `name`, points its `hwaddr` at the LAN gateway's or a node's own
    /// MAC, or points its `requestedIP` at another Service's address (each
    /// fourth fault, in turn). Nothing may change on the LAN.
    fn tenant_rewrite(&mut self, name: &str) -> Result<()> {
        let lb = &self.lb;
        let turn = self.report.faults.len() % 4;
        if turn == 0 {
            return lb.annotate_as(&self.tenant, name, REQUESTED_IP, None);
        }
        if turn == 3 {
            // Another Service's address, as if to take it: the controller
            // writes its own record back, and neither address moves.
            let other = self
                .stable
                .iter()
                .find(|s| s.name != name && !s.secondary)
                .context("no other Service")?
                .ip
                .to_string();
            return lb.annotate_as(&self.tenant, name, REQUESTED_IP, Some(&other));
        }
        let nodes: Vec<serde_json::Value> = (0..lb.rig.guest_count())
            .filter_map(|g| lb.node_object(&lb.node_name(g)))
            .collect();
        let mac = if turn == 1 {
            nodes
                .iter()
                .find_map(|o| o["status"]["gatewayMac"].as_str().map(str::to_string))
        } else {
            nodes
                .iter()
                .find_map(|o| o["status"]["nicMacs"][0].as_str().map(str::to_string))
        }
        .context("no node reports a LAN host's MAC")?;
        let before = lb
            .service(name)
            .and_then(|s| lb::annotation(&s, HWADDR).map(str::to_string));
        lb.annotate_as(&self.tenant, name, HWADDR, Some(&mac))?;
        self.rewritten.insert(name.to_string(), before);
        Ok(())
    }

    fn churn_ip(&self, name: &str) -> Option<Ipv4Addr> {
        match self.churn.iter().find(|c| c.name == name)?.life {
            Life::Served { ip, .. } => ip,
            Life::Away { old } => old,
        }
    }

    fn churn_port(&self, name: &str) -> u16 {
        self.churn
            .iter()
            .find(|c| c.name == name)
            .map(|c| c.port)
            .unwrap_or(LISTEN_PORT)
    }

    fn set_life(&mut self, name: &str, life: Life) {
        if let Life::Away { old: Some(old) } = life {
            self.gone_at.insert(old, SystemTime::now());
        }
        let away = matches!(life, Life::Away { .. });
        let Some(c) = self.churn.iter_mut().find(|c| c.name == name) else {
            return;
        };
        c.life = life;
        if away
            && let Some(p) = c.probes.take()
            && let Err(e) = p.judge(&mut self.report, &self.watch)
        {
            println!("soak: the LAN probes of {name}: {e:#}");
        }
    }

    /// Asks the LAN after each churned Service's address from when its
    /// status first shows one.
    fn probe_served(&mut self) {
        for c in &mut self.churn {
            if let (Life::Served { ip: Some(ip), .. }, None) = (&c.life, &c.probes) {
                match LanProbes::start(&self.lb, *ip) {
                    Ok(p) => c.probes = Some(p),
                    Err(e) => println!("soak: cannot ask the LAN after {ip}: {e:#}"),
                }
            }
        }
    }

    fn serve_again(&mut self, name: &str) {
        self.set_life(
            name,
            Life::Served {
                since: Instant::now(),
                ip: None,
                late_reported: false,
            },
        );
    }

    /// A Service that was deleted or switched away must have left: its
    /// old address on no guest (one whose API path came back less than
    /// [`API_BACK_WITHIN`] ago may not have read its assignments yet).
    fn check_left(&mut self, name: &str, now: Instant) {
        let Some(Life::Away { old: Some(old) }) = self
            .churn
            .iter()
            .find(|c| c.name == name)
            .map(|c| c.life.clone())
        else {
            return;
        };
        // A holder cut off from the API server cannot hear that the Service
        // went: it keeps the address until it hears again (or fences), by
        // design; a node cut off from the API but not the LAN keeps serving.
        let cut_off = |g: usize| {
            self.report.faults.iter().any(|f| {
                f.fault == Fault::ApiCutOff
                    && f.guest == Some(g)
                    && f.began <= now
                    && f.ended.is_none_or(|e| e + API_BACK_WITHIN >= now)
            })
        };
        let held: Vec<_> = self
            .lb
            .carriers(old)
            .into_iter()
            .filter(|(node, _)| !cut_off(self.lb.guest_of(node)))
            .collect();
        if !held.is_empty() {
            self.report.violate(
                now,
                format!("{name} gone from our class, but its address {old} is still on {held:?}"),
            );
        }
    }

    /// The Services' status against what each must show.
    fn check_statuses(
        &mut self,
        now: Instant,
        st: &BTreeMap<String, Option<Ipv4Addr>>,
        last_seen: &mut BTreeMap<String, Option<Ipv4Addr>>,
    ) {
        for s in &self.stable {
            let ip = st.get(&s.name).copied().flatten();
            let was = last_seen.insert(s.name.clone(), ip).flatten();
            if ip != was && ip != Some(s.ip) {
                self.report.violate(
                    now,
                    format!(
                        "Service {}'s status changed from {was:?} to {ip:?} while it lives (its address is {})",
                        s.name, s.ip
                    ),
                );
            }
        }
        if let Some(r) = self.repoint.as_mut() {
            let want = self.stable[r.primary].ip;
            let ip = st.get(REPOINT).copied().flatten();
            let within = FOLLOW_WITHIN + self.report.control_plane_allowance(r.since, now);
            if ip != Some(want) && now - r.since > within && !r.reported {
                r.reported = true;
                let what = format!(
                    "{REPOINT} shows {ip:?} {:.1} s after it was pointed at {} ({want})",
                    (now - r.since).as_secs_f64(),
                    self.stable[r.primary].name
                );
                self.report.violate(now, what);
            }
        }
        let mut found = Vec::new();
        let report = &self.report;
        for c in &mut self.churn {
            let Life::Served {
                since,
                ip,
                late_reported,
            } = &mut c.life
            else {
                continue;
            };
            let now_ip = st.get(&c.name).copied().flatten();
            match (*ip, now_ip) {
                (None, Some(new)) => {
                    *ip = Some(new);
                    c.seen.insert(new);
                }
                (None, None)
                    if now - *since
                        > SERVE_WITHIN
                            + report.control_plane_allowance(*since, now)
                            + report.guest_allowance(*since, now)
                        && !*late_reported =>
                {
                    *late_reported = true;
                    found.push(format!(
                        "{} has no address {:.1} s after it became ours again",
                        c.name,
                        (now - *since).as_secs_f64()
                    ));
                }
                (Some(had), now_ip) if now_ip != Some(had) => {
                    found.push(format!(
                        "{}'s status changed from {had} to {now_ip:?} while it lives",
                        c.name
                    ));
                    *ip = now_ip;
                    if let Some(n) = now_ip {
                        c.seen.insert(n);
                    }
                }
                _ => {}
            }
        }
        for what in found {
            self.report.violate(now, what);
        }
    }

    /// The end state, after the quiet period.
    fn check_end(&mut self, at: Instant) -> Result<()> {
        let quiet_wall = SystemTime::now() - at.elapsed();
        let lb = &self.lb;
        let report = &mut self.report;
        // Every Service has the address it must have.
        let mut want: BTreeMap<String, Ipv4Addr> =
            self.stable.iter().map(|s| (s.name.clone(), s.ip)).collect();
        if let Some(r) = &self.repoint {
            want.insert(REPOINT.into(), self.stable[r.primary].ip);
        }
        for (name, ip) in &want {
            if lb.ingress_ip(name) != Some(*ip) {
                report.violate(
                    at,
                    format!("at the end {name} has {:?}, not {ip}", lb.ingress_ip(name)),
                );
            }
        }
        let mut living: BTreeSet<Ipv4Addr> = self
            .stable
            .iter()
            .filter(|s| !s.secondary)
            .map(|s| s.ip)
            .collect();
        for c in &self.churn {
            match lb.ingress_ip(&c.name) {
                Some(ip) => {
                    living.insert(ip);
                }
                None => report.violate(at, format!("at the end {} has no address", c.name)),
            }
        }
        // Each on one guest, which answers TCP for it.
        for ip in &living {
            let c = lb.carriers(*ip);
            if c.len() != 1 {
                report.violate(
                    at,
                    format!("at the end {ip} is on {} guests: {c:?}", c.len()),
                );
                continue;
            }
            match lb.tcp_from_client(*ip, LISTEN_PORT) {
                Ok(node) if node == c[0].0 => {}
                Ok(node) => report.violate(
                    at,
                    format!("at the end {ip} is on {} but {node} answers TCP", c[0].0),
                ),
                Err(e) => {
                    let g = lb.guest_of(&c[0].0);
                    report.violate(
                        at,
                        format!(
                            "at the end {ip} answers no TCP: {e:#}\n{}",
                            lb.path_diagnostics(g, *ip, &c[0].1.mac)
                        ),
                    )
                }
            }
        }
        // A lease (acquired or last acknowledged at `at_ms`, Unix ms) of an
        // address no Service has: `None` for a living address, else whether
        // it leaked (renewed after its Service let the address go) or was
        // only never released (it ends with the lease time).
        let gone_at = &self.gone_at;
        let leaked = |ip: Ipv4Addr, at_ms: u64| -> Option<bool> {
            if living.contains(&ip) {
                return None;
            }
            let gone = gone_at.get(&ip).copied().unwrap_or(quiet_wall);
            Some(at_ms > unix_ms(gone) + 2_000)
        };
        // Every link is one the node's assignments name; every node lease
        // file is of a living address.
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
            for (file, ip, acquired_ms) in lb.agent_lease_files(g) {
                match leaked(ip, acquired_ms) {
                    Some(true) => report.violate(
                        at,
                        format!("at the end {node} keeps lease file {file} of {ip}, acquired after its Service let it go"),
                    ),
                    Some(false) => report.leases_left_to_expire += 1,
                    None => {}
                }
            }
        }
        // dnsmasq's leases of addresses no Service has: renewed after the
        // Service let the address go is a leak. One never released (its
        // holder was down, or the server, when the DHCPRELEASE was due:
        // nobody resends one) ends by itself within the lease time.
        let leases = lb.rig.dnsmasq_leases().unwrap_or_default();
        for line in leases.lines() {
            let words: Vec<&str> = line.split_whitespace().collect();
            let (Some(expiry), Some(ip)) = (
                words.first().and_then(|w| w.parse::<u64>().ok()),
                words.get(2).and_then(|w| w.parse::<Ipv4Addr>().ok()),
            ) else {
                continue;
            };
            let acked_ms = expiry.saturating_sub(self.lease_secs) * 1_000;
            match leaked(ip, acked_ms) {
                Some(true) => report.violate(
                    at,
                    format!("at the end dnsmasq leases {ip}, renewed after its Service let it go: {line}"),
                ),
                Some(false) => report.leases_left_to_expire += 1,
                None => {}
            }
        }
        // One Role and one RoleBinding per node.
        let want: BTreeSet<String> = (0..lb.rig.guest_count())
            .map(|g| format!("harvester-node-agent-node-{}", lb.node_name(g)))
            .collect();
        let roles: Api<k8s_openapi::api::rbac::v1::Role> =
            Api::namespaced(lb.admin(), lb::NAMESPACE);
        let bindings: Api<k8s_openapi::api::rbac::v1::RoleBinding> =
            Api::namespaced(lb.admin(), lb::NAMESPACE);
        let role_names: BTreeSet<String> = lb
            .block_on(roles.list(&kube::api::ListParams::default()))?
            .items
            .into_iter()
            .filter_map(|r| r.metadata.name)
            .filter(|n| n.starts_with("harvester-node-agent-node-"))
            .collect();
        let binding_names: BTreeSet<String> = lb
            .block_on(bindings.list(&kube::api::ListParams::default()))?
            .items
            .into_iter()
            .filter_map(|r| r.metadata.name)
            .filter(|n| n.starts_with("harvester-node-agent-node-"))
            .collect();
        for (kind, names) in [("Roles", role_names), ("RoleBindings", binding_names)] {
            if names != want {
                report.violate(
                    at,
                    format!("at the end the per-node {kind} are {names:?}, not {want:?}"),
                );
            }
        }
        Ok(())
    }
}

/// What `f` allows: its kind's bound, and for an outage of the API or the
/// DHCP server its length too: nothing moves while the API server is down
/// (by design), so a holder that fails during the outage stays unserved
/// until it is back; and a takeover during a DHCP outage waits for the
/// server (no address is claimed without its word), whose retransmissions
/// double (RFC 2131 §4.1), so up to twice the outage. A webhook refusing
/// every Service write allows nothing more: a failover writes no Service
/// before the new holder answers (issue #29), and a Service it keeps from
/// being served is not asked after until its status shows an address.
fn bound_of(f: &Injected) -> Duration {
    match (f.fault, f.ended) {
        (Fault::ApiServerDown, Some(e)) => f.fault.bound() + (e - f.began) + Duration::from_secs(3),
        (fault, Some(e)) if fault.dhcp() => {
            f.fault.bound() + 2 * (e - f.began) + Duration::from_secs(3)
        }
        _ => f.fault.bound(),
    }
}

/// ARP: no request answered twice; no unanswered stretch longer than the
/// faults around it allow.
fn check_arp(report: &mut SoakReport, watch: &AddressWatch, ip: Ipv4Addr, rec: &ArpRecord) {
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
    check_gaps(report, watch, ip, &answered, Probe::Arp);
}

/// TCP: no stretch without an answered connection longer than the faults
/// around it allow. A try is made every [`TCP_EVERY`], so the bound gets
/// two periods more than ARP's.
fn check_tcp(report: &mut SoakReport, watch: &AddressWatch, ip: Ipv4Addr, rec: &TcpRecord) {
    check_gaps(report, watch, ip, &rec.answered(), Probe::Tcp);
}

/// What a guest given an address it cannot read (cut off from the API
/// server) adds to the address's silence: the controller's unread rule
/// (`controller::service_health`, 3 s) and a margin.
const UNREAD_HOP: Duration = Duration::from_millis(3_500);

/// How often the TCP client connects to each address. Every connection
/// forks a listener on the holder, so not every 10 ms as ARP asks.
const TCP_EVERY: Duration = Duration::from_millis(250);

#[derive(Clone, Copy)]
enum Probe {
    Arp,
    Tcp,
}

/// The faults that may explain a gap in `ip`'s answers: the control
/// plane's, and those on a guest that held `ip` during the gap or in the
/// 10 s before it (a fault on another guest, or on another Service, does
/// not excuse this address's silence).
fn check_gaps(
    report: &mut SoakReport,
    watch: &AddressWatch,
    ip: Ipv4Addr,
    answered: &[Instant],
    probe: Probe,
) {
    let (shortest, slack) = match probe {
        Probe::Arp => (Duration::from_millis(200), Duration::from_secs(1)),
        Probe::Tcp => (2 * TCP_EVERY, Duration::from_secs(1) + 2 * TCP_EVERY),
    };
    for w in answered.windows(2) {
        let (from, to) = (w[0], w[1]);
        let gap = to - from;
        if gap <= shortest {
            continue;
        }
        let holders = watch.held_by_in(
            ip,
            from.checked_sub(Duration::from_secs(10)).unwrap_or(from),
            to,
        );
        let around: Vec<&Injected> = report
            .around(from, to)
            .into_iter()
            .filter(|f| f.service.is_none() && f.guest.is_none_or(|g| holders.contains(&g)))
            .collect();
        // A guest cut off from the API server that never held the address
        // may still have been given it (it looks live for up to the
        // staleness bound, 40 s) and not read it: each such guest costs
        // one move after the unread rule (3 s). The soak saw two in a row
        // (8.1 s for a deleted guest's Services), each cut off just before
        // it was chosen.
        let unread_hops = report
            .around(from, to)
            .into_iter()
            .filter(|f| {
                f.fault == Fault::ApiCutOff && f.guest.is_some_and(|g| !holders.contains(&g))
            })
            .count() as u32;
        // The largest bound among them, not their sum: denser faults
        // excuse no more (issue #29).
        let bound = slack
            + around.iter().map(|f| bound_of(f)).max().unwrap_or_default()
            + UNREAD_HOP * unread_hops;
        let key = around
            .iter()
            .max_by_key(|f| bound_of(f))
            .map(|f| f.fault.label().to_string())
            .unwrap_or_else(|| "no fault".into());
        let worst = match probe {
            Probe::Arp => &mut report.worst_unserved,
            Probe::Tcp => &mut report.worst_unserved_tcp,
        };
        let worst = worst.entry(key).or_default();
        *worst = (*worst).max(gap);
        if gap > bound {
            let (what, by) = match probe {
                Probe::Arp => ("unanswered", "ARP"),
                Probe::Tcp => ("served no TCP connection", "TCP"),
            };
            report.violate(
                from,
                format!(
                    "{ip} {what} for {:.2} s ({by}; bound {:.1} s for the faults around it; held by guests {holders:?} then; {})",
                    gap.as_secs_f64(),
                    bound.as_secs_f64(),
                    kernel_record(watch, ip, from, to)
                ),
            );
        }
    }
}

/// What the guests' kernels recorded of `ip` from a second before the
/// stretch `from..to` to its end, relative to `from`: tells a holder that
/// had no address (it lapsed, or was moved) from one that had it and did
/// not answer.
fn kernel_record(watch: &AddressWatch, ip: Ipv4Addr, from: Instant, to: Instant) -> String {
    let look_from = from.checked_sub(Duration::from_secs(1)).unwrap_or(from);
    let changes: Vec<String> = watch
        .holders(ip)
        .into_iter()
        .filter(|(at, _)| (look_from..=to).contains(at))
        .map(|(at, held)| format!("{} {held:?}", crate::failover::offset_ms(at, from)))
        .collect();
    if changes.is_empty() {
        "the kernels' record did not change".into()
    } else {
        format!("the kernels' record: {}", changes.join(", "))
    }
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
    println!(
        "worst stretch without an answered TCP connection (one every {} ms), by the worst fault around it:",
        TCP_EVERY.as_millis()
    );
    for (k, d) in &report.worst_unserved_tcp {
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
    println!(
        "leases of addresses no Service has, left to expire (a DHCPRELEASE that could not be delivered): {}",
        report.leases_left_to_expire
    );
    if !report.violations.is_empty() {
        println!("\nviolations:");
        for v in &report.violations {
            println!("- {}", v.what);
        }
    }
    println!("{}", report.summary());
}
