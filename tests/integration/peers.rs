//! The migration from the real kube-vip and back (issue #19): kube-vip
//! v1.2.2, built from the Go module proxy (`tests/rig/peers.sh`), runs as
//! `kube-vip manager` in every guest, in DHCP mode with per-Service
//! election, as the Harvester cloud provider's chart runs it; then our
//! agents and controller take its Services over the way
//! docs/loadbalancer.md, "Migrating from kube-vip, and back", tells an
//! operator to, and hand them back the same way.

use std::collections::BTreeMap;
use std::net::Ipv4Addr;
use std::time::{Duration, Instant};

use anyhow::{Result, bail, ensure};
use hna_contract::{self, harvester, kube_vip};
use hna_testkit::arpprobe::ArpProber;
use hna_testkit::failover;
use hna_testkit::lb::{self, LISTEN_PORT, LbRig, annotation, wait_for};
use hna_testkit::peers::harvester_ccm::HarvesterSide;
use hna_testkit::peers::{
    HolderFault, KubeVip, LeaseTimings, System, SystemRig, fail_over, links_holding, metallb,
};

use crate::harness::tests;

tests! {
    kube_vip_to_us_and_back_keeps_every_address_and_mac: Root, Iproute2, Dnsmasq, ApiServer, Socat, KubeVip, HarvesterCcm;
    metallb_serves_from_its_pool_and_moves_off_a_killed_speaker: Root, Iproute2, Dnsmasq, ApiServer, Socat, MetalLb;
}

const SERVICES: [&str; 3] = ["kv-a", "kv-b", "kv-c"];
/// A Service sharing `kv-a`'s address, as the Harvester cloud provider
/// writes a secondary: its primary named, the primary's address asked
/// for, no IPAM annotation, a port of its own.
const SECONDARY: (&str, &str) = ("kv-a-extra", "default/kv-a");
const WITHIN: Duration = Duration::from_secs(60);

/// What kube-vip wrote on a Service: the address and the MAC it asked with.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Held {
    ip: Ipv4Addr,
    mac: String,
}

/// Waits until Harvester's object of every Service in `held` carries its
/// address (the cloud provider copies it from the guest's status).
fn harvester_knows(hv: &HarvesterSide, held: &BTreeMap<&str, Held>, when: &str) -> Result<()> {
    for (name, h) in held {
        let known = wait_for(WITHIN, || {
            let objects = hv.load_balancers_of("default", name);
            (objects.len() == 1 && objects[0]["status"]["address"] == h.ip.to_string())
                .then_some(())
        });
        ensure!(
            known.is_some(),
            "{when}: Harvester's object for {name} does not say {}: {:#?}\ncloud provider log:\n{}",
            h.ip,
            hv.load_balancers_of("default", name),
            hv.log_tail(20)
        );
    }
    Ok(())
}

fn kube_vips_record(lb: &LbRig, name: &str) -> Option<Held> {
    let svc = lb.service(name)?;
    let ip: Ipv4Addr = annotation(&svc, kube_vip::REQUESTED_IP)?.parse().ok()?;
    let mac = annotation(&svc, kube_vip::HWADDR)?.to_lowercase();
    (lb.ingress_ip(name) == Some(ip)).then_some(Held { ip, mac })
}

/// kube-vip's links (`vip-<first 8 of the UID>`) in guest `i`.
fn kube_vip_links(lb: &LbRig, i: usize) -> Result<Vec<String>> {
    let out = std::process::Command::new("ip")
        .args(["-n", lb.rig.guest_ns(i), "-j", "link", "show"])
        .output()?;
    let v: serde_json::Value = serde_json::from_slice(&out.stdout)?;
    Ok(v.as_array()
        .into_iter()
        .flatten()
        .filter_map(|l| l["ifname"].as_str())
        .filter(|n| n.starts_with("vip-"))
        .map(str::to_string)
        .collect())
}

/// The guests that have `ip` on their uplink (where kube-vip puts a
/// Service address it did not get from DHCP).
fn on_uplink(lb: &LbRig, ip: Ipv4Addr) -> Vec<usize> {
    links_holding(lb, ip)
        .into_iter()
        .filter(|(_, link)| link == "eth0")
        .map(|(i, _)| i)
        .collect()
}

/// An ARP prober from the client on each address (each must answer now).
fn probers(lb: &LbRig, held: &BTreeMap<&str, Held>) -> Result<Vec<(Ipv4Addr, ArpProber)>> {
    held.values()
        .map(|h| Ok((h.ip, failover::arp_prober(lb, h.ip)?)))
        .collect()
}

fn kube_vip_to_us_and_back_keeps_every_address_and_mac() -> Result<()> {
    let mut opts = lb::Options::new(
        crate::BIN,
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("packaging/kubernetes"),
    );
    opts.endpoint_slices = true;
    opts.start_ours = false;
    let mut lb = LbRig::start(opts)?;
    // The real cloud provider writes what kube-vip and we read from each
    // Service (`loadbalancerIPs`), and copies the address back to Harvester.
    let mut hv = HarvesterSide::start(&lb)?;
    let mut kv = KubeVip::new(&lb, LeaseTimings::TUNED)?;
    kv.start_all(&lb)?;

    // Services as a Harvester user writes them for DHCP, each
    // opted out of ours from the start (step 1 of the migration), with
    // endpoints: kube-vip elects a holder only once a slice names one, and
    // it reads each EndpointSlice event alone, so an empty slice (the rig
    // writes a second one with the not-ready endpoints of the other nodes)
    // stops the Service's election even while the other slice has ready
    // endpoints. Two nodes ready, the third's endpoint not ready: no slice
    // is empty.
    let nodes: Vec<String> = (0..2).map(|i| lb.node_name(i)).collect();
    for name in SERVICES {
        lb.create_service(
            name,
            &[(harvester::IPAM, "dhcp"), (hna_contract::IGNORE, "true")],
            &[LISTEN_PORT],
        )?;
        lb.set_endpoints(name, &nodes)?;
    }
    let mut held: BTreeMap<&str, Held> = BTreeMap::new();
    for name in SERVICES {
        let h = match wait_for(WITHIN, || kube_vips_record(&lb, name)) {
            Some(h) => h,
            None => {
                kv.check_running()?;
                hv.check_running()?;
                bail!(
                    "kube-vip wrote no address and MAC on {name} within {WITHIN:?}: {:?}\nkube-vip logs:\n{}\ncloud provider log:\n{}",
                    lb.service(name).map(|s| s.metadata.annotations),
                    (0..3)
                        .map(|i| kv.log_tail(i, 15))
                        .collect::<Vec<_>>()
                        .join("\n---\n"),
                    hv.log_tail(20)
                );
            }
        };
        held.insert(name, h);
    }
    println!("kube-vip holds: {held:?}");

    // The secondary, once kube-vip serves its primary (the cloud provider
    // waits for the primary's address too).
    harvester_knows(&hv, &held, "kube-vip serving")?;
    let shared = held[SECONDARY.1.trim_start_matches("default/")].ip;
    // Its primary named: the cloud provider writes the primary's address.
    lb.create_service(
        SECONDARY.0,
        &[
            (harvester::PRIMARY_SERVICE, SECONDARY.1),
            (hna_contract::IGNORE, "true"),
        ],
        &[LISTEN_PORT + 1],
    )?;
    lb.set_endpoints(SECONDARY.0, &nodes)?;
    if wait_for(WITHIN, || {
        (lb.ingress_ip(SECONDARY.0) == Some(shared)).then_some(())
    })
    .is_none()
    {
        kv.check_running()?;
        bail!(
            "kube-vip did not serve the secondary {} on {shared} within {WITHIN:?}: status {:?}\nkube-vip logs:\n{}",
            SECONDARY.0,
            lb.ingress_ip(SECONDARY.0),
            (0..3)
                .map(|i| kv.log_tail(i, 15))
                .collect::<Vec<_>>()
                .join("\n---\n")
        );
    }
    println!(
        "kube-vip serves the secondary on {shared}; (guest, link) holding it: {:?}",
        links_holding(&lb, shared)
    );
    let answering = probers(&lb, &held)?;

    // Step 2: kube-vip's Service handling off (its pods stop), its links
    // left behind deleted.
    let mark = lb.dnsmasq_log_len();
    let stopped_at = Instant::now();
    kv.stop_all();
    let mut left = Vec::new();
    for i in 0..3 {
        for link in kube_vip_links(&lb, i)? {
            left.push(format!("{}: {link}", lb.node_name(i)));
            lb.rig
                .netns_cmd(lb.rig.guest_ns(i), "ip")
                .args(["link", "del", &link])
                .status()?;
        }
    }
    // And what it put on an uplink (a secondary's address), which would
    // go on answering ARP with that node's own MAC.
    for h in held.values() {
        for i in on_uplink(&lb, h.ip) {
            left.push(format!("{}: {} on eth0", lb.node_name(i), h.ip));
            lb.rig
                .netns_cmd(lb.rig.guest_ns(i), "ip")
                .args(["addr", "del", &format!("{}/32", h.ip), "dev", "eth0"])
                .status()?;
        }
    }
    println!("kube-vip left behind after SIGTERM: {left:?}");
    // What kube-vip served last is what must be kept (were its instances
    // stopped one by one, the others would have taken the Services over
    // with their own MACs and leases meanwhile).
    for name in SERVICES {
        let last = kube_vips_record(&lb, name).ok_or_else(|| {
            anyhow::anyhow!("{name} lost kube-vip's record when kube-vip stopped")
        })?;
        if last != held[name] {
            println!(
                "{name}: kube-vip moved it while stopping: {:?} -> {last:?}",
                held[name]
            );
            held.insert(name, last);
        }
    }

    // Step 3: ours started, the opt-out removed.
    let ours_from = Instant::now();
    lb.start_ours()?;
    for name in SERVICES.into_iter().chain([SECONDARY.0]) {
        lb.annotate(name, hna_contract::IGNORE, None)?;
    }
    for (name, h) in &held {
        let carried = wait_for(WITHIN, || {
            let c = lb.carriers(h.ip);
            (c.len() == 1 && c[0].1.mac == h.mac && lb.ingress_ip(name) == Some(h.ip)).then_some(c)
        });
        ensure!(
            carried.is_some(),
            "{name} did not come back on {} with MAC {} within {WITHIN:?}: carriers {:?}, status {:?}\n{}",
            h.ip,
            h.mac,
            lb.carriers(h.ip),
            lb.ingress_ip(name),
            lb.diagnostics()
        );
        let reply = wait_for(WITHIN, || lb.tcp_from_client(h.ip, LISTEN_PORT).ok());
        ensure!(
            reply.is_some(),
            "{} answers no TCP after the migration",
            h.ip
        );
    }
    let secondary = wait_for(WITHIN, || {
        (lb.ingress_ip(SECONDARY.0) == Some(shared)).then_some(())
    });
    ensure!(
        secondary.is_some() && lb.carriers(shared).len() == 1,
        "the secondary {} does not share {shared} after the migration: status {:?}, carriers {:?}",
        SECONDARY.0,
        lb.ingress_ip(SECONDARY.0),
        lb.carriers(shared)
    );
    let taken_over = stopped_at.elapsed();
    let ours_took = ours_from.elapsed();
    let log = lb.dnsmasq_log_from(mark);
    for h in held.values() {
        let discovers: Vec<&str> = log
            .lines()
            .filter(|l| l.contains("DHCPDISCOVER") && l.to_lowercase().contains(&h.mac))
            .collect();
        ensure!(
            discovers.is_empty(),
            "a DHCPDISCOVER with {}'s MAC {} reached the server during the migration: {discovers:?}",
            h.ip,
            h.mac
        );
    }
    let mut outage = Duration::ZERO;
    for (ip, p) in answering {
        let rec = p.finish()?;
        let (theirs, ours): (Vec<Instant>, Vec<Instant>) = rec
            .doubly_answered()
            .into_iter()
            .partition(|at| *at < ours_from);
        if !theirs.is_empty() {
            println!(
                "{ip}: {} ARP requests answered twice while kube-vip stopped (before ours started)",
                theirs.len()
            );
        }
        ensure!(
            ours.is_empty(),
            "{ip} answered twice after ours started, {:?} after",
            ours.iter().map(|t| *t - ours_from).collect::<Vec<_>>()
        );
        outage = outage.max(rec.longest_silence());
    }
    harvester_knows(&hv, &held, "ours serving")?;
    println!(
        "kube-vip -> ours: every address and MAC kept, no DHCPDISCOVER; longest ARP outage {:.2} s (kube-vip's SIGTERM to every Service held by us: {:.2} s, of which ours started to every Service held: {:.2} s)",
        outage.as_secs_f64(),
        taken_over.as_secs_f64(),
        ours_took.as_secs_f64()
    );

    // Back: opted out, handed over (released, links gone), ours stopped,
    // kube-vip started again.
    for name in SERVICES.into_iter().chain([SECONDARY.0]) {
        lb.annotate(name, hna_contract::IGNORE, Some("true"))?;
    }
    ensure!(
        wait_for(WITHIN, || lb
            .ingress_ip(SECONDARY.0)
            .is_none()
            .then_some(()))
        .is_some(),
        "the secondary {} kept our status after it was opted out",
        SECONDARY.0
    );
    for (name, h) in &held {
        let handed = wait_for(WITHIN, || {
            (lb.carriers(h.ip).is_empty() && lb.ingress_ip(name).is_none()).then_some(())
        });
        ensure!(
            handed.is_some(),
            "{name} was not handed over within {WITHIN:?}: carriers {:?}",
            lb.carriers(h.ip)
        );
    }
    lb.stop_ours();
    kv.start_all(&lb)?;
    for (name, h) in &held {
        let back = wait_for(WITHIN, || kube_vips_record(&lb, name));
        if back.is_none() {
            kv.check_running()?;
        }
        ensure!(
            back.as_ref() == Some(h),
            "kube-vip did not get {name}'s address back: had {h:?}, now {back:?}"
        );
        let reply = wait_for(WITHIN, || lb.tcp_from_client(h.ip, LISTEN_PORT).ok());
        ensure!(
            reply.is_some(),
            "{} answers no TCP from kube-vip's holder",
            h.ip
        );
    }
    let secondary = wait_for(WITHIN, || lb.ingress_ip(SECONDARY.0));
    ensure!(
        secondary == Some(shared),
        "kube-vip did not serve the secondary {} on {shared} again: {secondary:?}",
        SECONDARY.0
    );
    harvester_knows(&hv, &held, "kube-vip serving again")?;
    hv.check_running()?;
    println!(
        "ours -> kube-vip: every address kept, the secondary's too; (guest, link) holding {shared}: {:?}",
        links_holding(&lb, shared)
    );
    Ok(())
}

/// MetalLB v0.16.1 as the benchmark runs it beside us
/// (`hna_testkit::peers::metallb`): its controller gives a Service an
/// address from the pool, exactly one guest's MAC answers ARP for it and
/// that guest answers TCP there; after that guest's speaker is killed,
/// another guest's MAC answers for the same address. Whoever answers is
/// read from ARP on the LAN, not from MetalLB's own reports.
fn metallb_serves_from_its_pool_and_moves_off_a_killed_speaker() -> Result<()> {
    let manifests = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("packaging/kubernetes");
    let mut sr = SystemRig::start(System::MetalLb, crate::BIN, manifests)?;
    let (first, last): (Ipv4Addr, Ipv4Addr) = (metallb::POOL.0.parse()?, metallb::POOL.1.parse()?);
    let (served, f) = fail_over(&mut sr, "ml-a", HolderFault::Killed, WITHIN)?;
    println!(
        "MetalLB: {} from its pool in {:.0} ms, TCP {:.0} ms; speaker of guest {} killed: another guest answered ARP after {:?}, TCP after {:?}, longest ARP silence {:.2} s, address after {:?}, {} ARP requests answered twice",
        served.ip,
        served.to_status.as_secs_f64() * 1e3,
        served.to_tcp.as_secs_f64() * 1e3,
        served.holder,
        f.took,
        f.tcp_back,
        f.arp_silence.as_secs_f64(),
        f.ip_after,
        f.two_answerers
    );
    ensure!(
        (first..=last).contains(&served.ip),
        "{} is not from MetalLB's pool {first}-{last}",
        served.ip
    );
    ensure!(
        f.took.is_some(),
        "no other guest answered ARP for {} within {WITHIN:?} of the speaker's death",
        served.ip
    );
    ensure!(
        f.ip_after == Some(served.ip),
        "MetalLB changed the address: {} -> {:?}",
        served.ip,
        f.ip_after
    );
    ensure!(
        f.tcp_back.is_some(),
        "no other node answered TCP at {} within {WITHIN:?}",
        served.ip
    );
    let now = sr.holders(served.ip);
    ensure!(
        now.len() == 1 && now[0] != served.holder,
        "after the failover ARP is answered by guests {now:?} (the killed speaker's was {})",
        served.holder
    );
    Ok(())
}
