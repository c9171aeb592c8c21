//! A hostile tenant, acting as one would with nothing but Services in its
//! own namespace (issue #22), on the rig's real API server with the shipped
//! manifests: it cannot take another namespace's address without that
//! namespace's consent, cannot learn whether another namespace's Service
//! exists, cannot clone another Service's MAC or address, and cannot make
//! the root agent build a macvlan on a host interface of its choosing.

use std::time::Duration;

use anyhow::{Context, Result, ensure};
use harvester_node_agent::contract::{self, harvester, kube_vip};
use hna_testkit::lb::{self, LISTEN_PORT, LbRig, annotation, wait_for};

use crate::harness::tests;

tests! {
    a_tenant_cannot_take_another_namespaces_address: Root, Iproute2, Dnsmasq, ApiServer, Socat;
    a_tenant_cannot_clone_another_services_mac_or_address: Root, Iproute2, Dnsmasq, ApiServer, Socat;
    a_tenant_cannot_put_an_address_on_a_host_interface: Root, Iproute2, Dnsmasq, ApiServer, Socat;
}

const ADDRESS_WITHIN: Duration = Duration::from_secs(60);
const WITHIN: Duration = Duration::from_secs(30);

fn options() -> lb::Options {
    lb::Options::new(
        crate::BIN,
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("packaging/kubernetes"),
    )
}

/// team-b's `web`, served, with kube-vip's record written.
fn team_b_web(lb: &LbRig) -> Result<k8s_openapi::api::core::v1::Service> {
    lb.create_namespace("team-a")?;
    lb.create_namespace("team-b")?;
    lb.create_service("team-b/web", &[(harvester::IPAM, "dhcp")], &[LISTEN_PORT])?;
    lb.wait_ingress("team-b/web", ADDRESS_WITHIN);
    wait_for(WITHIN, || {
        lb.service("team-b/web")
            .filter(|s| annotation(s, kube_vip::HWADDR).is_some())
    })
    .context("team-b/web: no kube-vip.io/hwaddr")
}

fn ingress_is_empty(lb: &LbRig, name: &str) -> bool {
    lb.service(name)
        .is_some_and(|s| lb::ingress_ip(&s).is_none())
}

fn a_tenant_cannot_take_another_namespaces_address() -> Result<()> {
    let lb = LbRig::start(options())?;
    let web = team_b_web(&lb)?;
    let ip = lb::ingress_ip(&web).unwrap();
    let ip_text = ip.to_string();

    // team-a names team-b's Service as its primary, as the Harvester cloud
    // provider writes a secondary; and probes a name that does not exist.
    lb.create_service(
        "team-a/thief",
        &[
            (harvester::PRIMARY_SERVICE, "team-b/web"),
            (kube_vip::LOADBALANCER_IPS, &ip_text),
        ],
        &[LISTEN_PORT + 1],
    )?;
    lb.create_service(
        "team-a/probe",
        &[(harvester::PRIMARY_SERVICE, "team-b/nothing")],
        &[LISTEN_PORT + 2],
    )?;
    let why = lb.wait_warning("team-a/thief", "PrimaryNotOurs", WITHIN);
    let why_probe = lb.wait_warning("team-a/probe", "PrimaryNotOurs", WITHIN);
    ensure!(
        why.replace("team-b/web", "X") == why_probe.replace("team-b/nothing", "X"),
        "the refusal tells an existing Service from a missing one:\n{why}\n{why_probe}"
    );
    ensure!(why.contains(contract::SHARE_WITH), "{why}");
    ensure!(
        ingress_is_empty(&lb, "team-a/thief"),
        "thief got an address"
    );
    let web_now = lb.service("team-b/web").unwrap();
    ensure!(
        web_now.metadata.annotations == web.metadata.annotations
            && lb::ingress_ip(&web_now) == Some(ip),
        "team-b/web changed"
    );
    let told = lb.events("team-b/web");
    ensure!(
        told.iter().all(|(_, _, m)| !m.contains("team-a")),
        "team-b is told about team-a: {told:?}"
    );
    ensure!(lb.carriers(ip).len() == 1);

    // team-b consents: team-a shares the address.
    lb.annotate("team-b/web", contract::SHARE_WITH, Some("team-a"))?;
    let shared = wait_for(WITHIN, || {
        (lb.ingress_ip("team-a/thief") == Some(ip)).then_some(())
    });
    ensure!(
        shared.is_some(),
        "no sharing after consent\n{}",
        lb.diagnostics()
    );

    // ... and withdraws it: team-a loses the address.
    lb.annotate("team-b/web", contract::SHARE_WITH, None)?;
    let withdrawn = wait_for(WITHIN, || {
        ingress_is_empty(&lb, "team-a/thief").then_some(())
    });
    ensure!(
        withdrawn.is_some(),
        "thief kept the address after consent was withdrawn"
    );

    // team-a naming it cannot hold its deletion.
    lb.delete_service("team-b/web")?;
    let gone = wait_for(WITHIN, || lb.service("team-b/web").is_none().then_some(()));
    ensure!(
        gone.is_some(),
        "team-b/web's deletion is held: {:?}",
        lb.events("team-b/web")
    );
    Ok(())
}

fn a_tenant_cannot_clone_another_services_mac_or_address() -> Result<()> {
    let lb = LbRig::start(options())?;
    let web = team_b_web(&lb)?;
    let ip = lb::ingress_ip(&web).unwrap();
    let mac = annotation(&web, kube_vip::HWADDR).unwrap().to_string();
    let ip_text = ip.to_string();

    lb.create_service(
        "team-a/copy-mac",
        &[(harvester::IPAM, "dhcp"), (kube_vip::HWADDR, &mac)],
        &[LISTEN_PORT],
    )?;
    lb.create_service(
        "team-a/copy-ip",
        &[
            (harvester::IPAM, "dhcp"),
            (kube_vip::REQUESTED_IP, &ip_text),
        ],
        &[LISTEN_PORT],
    )?;
    for name in ["team-a/copy-mac", "team-a/copy-ip"] {
        let why = lb.wait_warning(name, "AddressIdentityInUse", WITHIN);
        ensure!(!why.contains("team-b"), "{name}: {why}");
        let s = lb.service(name).unwrap();
        ensure!(
            lb::ingress_ip(&s).is_none() && s.metadata.finalizers.unwrap_or_default().is_empty(),
            "{name} was served"
        );
    }
    let links_with_mac = |mac: &str| -> usize {
        (0..3)
            .flat_map(|g| lb.hlb_links(g))
            .filter(|l| l.mac.eq_ignore_ascii_case(mac))
            .count()
    };
    ensure!(
        links_with_mac(&mac) == 1,
        "{mac} on {} links",
        links_with_mac(&mac)
    );
    ensure!(lb.carriers(ip).len() == 1);

    // Deleting the copies releases nothing of team-b's.
    let mark = lb.dnsmasq_log_len();
    for name in ["team-a/copy-mac", "team-a/copy-ip"] {
        lb.delete_service(name)?;
    }
    let gone = wait_for(WITHIN, || {
        (lb.service("team-a/copy-mac").is_none() && lb.service("team-a/copy-ip").is_none())
            .then_some(())
    });
    ensure!(gone.is_some(), "the copies are not deleted");
    let since = lb.dnsmasq_log_from(mark);
    ensure!(
        !since
            .lines()
            .any(|l| l.contains("DHCPRELEASE") && (l.contains(&mac) || l.contains(&ip_text))),
        "team-b's lease was released:\n{since}"
    );
    ensure!(links_with_mac(&mac) == 1 && lb.carriers(ip).len() == 1);
    ensure!(lb.ingress_ip("team-b/web") == Some(ip));
    Ok(())
}

/// The macvlans on `parent` in every guest, by guest: `ip -d link` reads
/// the kernel, whatever the agents report.
pub fn macvlans_on(lb: &LbRig, parent: &str) -> Vec<(usize, String)> {
    (0..lb.rig.guest_count())
        .flat_map(|g| {
            let out = std::process::Command::new("ip")
                .args(["-n", lb.rig.guest_ns(g), "-j", "-d", "link", "show"])
                .output()
                .expect("ip link");
            let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap_or_default();
            v.as_array()
                .into_iter()
                .flatten()
                .filter(|l| l["link"] == parent && l["linkinfo"]["info_kind"] == "macvlan")
                .filter_map(|l| l["ifname"].as_str().map(|n| (g, n.to_string())))
                .collect::<Vec<_>>()
        })
        .collect()
}

/// `net.ipv4.conf.<iface>.<key>` in guest `g`, read from the kernel.
pub fn ipv4_conf(lb: &LbRig, g: usize, iface: &str, key: &str) -> String {
    let out = lb
        .rig
        .netns_cmd(lb.rig.guest_ns(g), "cat")
        .arg(format!("/proc/sys/net/ipv4/conf/{iface}/{key}"))
        .output()
        .expect("cat");
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

/// Every guest gets a CNI bridge, as every node of a real cluster has one.
pub fn add_cni_bridges(lb: &LbRig) -> Result<()> {
    for g in 0..lb.rig.guest_count() {
        let ns = lb.rig.guest_ns(g);
        hna_testkit::rig::process::run_args(
            "ip",
            ["-n", ns, "link", "add", "cni0", "type", "bridge"],
        )?;
        hna_testkit::rig::process::run_args("ip", ["-n", ns, "link", "set", "cni0", "up"])?;
    }
    Ok(())
}

fn a_tenant_cannot_put_an_address_on_a_host_interface() -> Result<()> {
    let lb = LbRig::start(options())?;
    add_cni_bridges(&lb)?;
    let before: Vec<String> = (0..3)
        .map(|g| ipv4_conf(&lb, g, "cni0", "arp_ignore"))
        .collect();
    lb.create_namespace("team-a")?;
    lb.create_service(
        "team-a/bridged",
        &[
            (harvester::IPAM, "dhcp"),
            (kube_vip::SERVICE_INTERFACE, "cni0"),
        ],
        &[LISTEN_PORT],
    )?;
    let why = lb.wait_warning("team-a/bridged", "NetworkNotResolved", WITHIN);
    ensure!(
        why.contains("cni0") && why.contains(kube_vip::SERVICE_INTERFACE) && why.contains("eth0"),
        "the refusal does not say what is wrong and what to use instead: {why}"
    );
    // A Service created after it is served: the controller has decided
    // the bridged one long since.
    lb.create_service(
        "team-a/plain",
        &[(harvester::IPAM, "dhcp")],
        &[LISTEN_PORT + 1],
    )?;
    lb.wait_ingress("team-a/plain", ADDRESS_WITHIN);
    ensure!(
        ingress_is_empty(&lb, "team-a/bridged"),
        "the bridged Service got an address"
    );
    let s = lb.service("team-a/bridged").unwrap();
    ensure!(
        s.metadata.finalizers.unwrap_or_default().is_empty(),
        "the refused Service carries a finalizer"
    );
    let on_bridge = macvlans_on(&lb, "cni0");
    ensure!(on_bridge.is_empty(), "macvlans on cni0: {on_bridge:?}");
    let after: Vec<String> = (0..3)
        .map(|g| ipv4_conf(&lb, g, "cni0", "arp_ignore"))
        .collect();
    ensure!(
        before == after,
        "cni0's arp_ignore changed: {before:?} -> {after:?}"
    );
    Ok(())
}
