//! A hostile tenant, acting as one would with nothing but Services in its
//! own namespace (issue #22), on the rig's real API server with the shipped
//! manifests: it cannot take another namespace's address without that
//! namespace's consent, cannot learn whether another namespace's Service
//! exists, cannot clone another Service's MAC or address, and cannot make
//! the root agent build a macvlan on a host interface of its choosing.

use std::time::Duration;

use anyhow::{Context, Result, ensure};
use hna_contract::{self, harvester, kube_vip};
use hna_testkit::lb::{self, LISTEN_PORT, LbRig, annotation, wait_for};

use crate::harness::tests;

tests! {
    a_tenant_cannot_take_another_namespaces_address: Root, Iproute2, Dnsmasq, ApiServer, Socat;
    a_tenant_cannot_clone_another_services_mac_or_address: Root, Iproute2, Dnsmasq, ApiServer, Socat;
    a_tenant_cannot_put_an_address_on_a_host_interface: Root, Iproute2, Dnsmasq, ApiServer, Socat;
    a_tenant_blanking_requested_ip_cannot_make_two_nodes_answer: Root, Iproute2, Dnsmasq, ApiServer, Socat;
    a_tenant_cannot_put_another_hosts_mac_on_the_lan: Root, Iproute2, Dnsmasq, ApiServer, Socat;
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
    ensure!(why.contains(hna_contract::SHARE_WITH), "{why}");
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
    lb.annotate("team-b/web", hna_contract::SHARE_WITH, Some("team-a"))?;
    let shared = wait_for(WITHIN, || {
        (lb.ingress_ip("team-a/thief") == Some(ip)).then_some(())
    });
    ensure!(
        shared.is_some(),
        "no sharing after consent\n{}",
        lb.diagnostics()
    );

    // ... and withdraws it: team-a loses the address.
    lb.annotate("team-b/web", hna_contract::SHARE_WITH, None)?;
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

/// team-a's tenant (its own token, [`LbRig::tenant`]) and its DHCP Service
/// `web`, served: the client and the address.
fn tenants_web(lb: &LbRig) -> Result<(kube::Client, std::net::Ipv4Addr)> {
    let tenant = lb.tenant("team-a")?;
    lb.create_service_as(
        &tenant,
        "team-a/web",
        &[(harvester::IPAM, "dhcp")],
        &[LISTEN_PORT],
    )?;
    Ok((tenant, lb.wait_ingress("team-a/web", ADDRESS_WITHIN)))
}

/// Issue #29: the takeover guard does not rest on an annotation the tenant
/// writes. With its own token (a ServiceAccount bound to `edit` in its
/// namespace only), a tenant blanks `kube-vip.io/requestedIP` of its
/// served Service while the holder is cut off from the API server but not
/// from the LAN (it keeps answering until it fences itself). The
/// controller moves the Service (the holder's heartbeat stops), and the new
/// holder asks the LAN about the held address first: while the old holder
/// answers, it waits. Read from every guest's kernel and from the LAN: at
/// no moment do two guests hold the address, no ARP request is answered
/// twice; when the old holder hears the API again it lets go, and the
/// address is served by one node.
fn a_tenant_blanking_requested_ip_cannot_make_two_nodes_answer() -> Result<()> {
    use hna_testkit::addrwatch::AddressWatch;
    use hna_testkit::failover::{arp_prober, guest_namespaces};

    // The move comes from the API path alone (with the LAN membership
    // on, the holder's witnesses vouch for it and nothing moves).
    let mut lb = LbRig::start(options().api_liveness())?;
    let (_, ip) = tenants_web(&lb)?;
    wait_for(WITHIN, || {
        lb.service("team-a/web")
            .filter(|s| annotation(s, kube_vip::REQUESTED_IP).is_some())
    })
    .context("team-a/web: no kube-vip.io/requestedIP written back")?;
    let holder = wait_for(WITHIN, || {
        let c = lb.carriers(ip);
        (c.len() == 1).then(|| lb.guest_of(&c[0].0))
    })
    .context("never on exactly one guest")?;
    let watch = AddressWatch::start(&guest_namespaces(&lb))?;
    let prober = arp_prober(&lb, ip)?;

    lb.cut_api(holder);
    // The controller writes the annotation back; the tenant blanks it
    // again and again, as a hostile one would, until the end.
    let blanking = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(true));
    let kubeconfig = lb.tenant_kubeconfig("team-a");
    let blanker = {
        let blanking = blanking.clone();
        std::thread::spawn(move || -> Result<u32> {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()?;
            let client = rt.block_on(hna_testkit::rig::kube_client(&kubeconfig))?;
            let api: kube::Api<k8s_openapi::api::core::v1::Service> =
                kube::Api::namespaced(client, "team-a");
            let blank =
                serde_json::json!({"metadata": {"annotations": {kube_vip::REQUESTED_IP: null}}});
            let mut n = 0;
            while blanking.load(std::sync::atomic::Ordering::SeqCst) {
                let has = rt
                    .block_on(api.get("web"))?
                    .metadata
                    .annotations
                    .is_some_and(|a| a.contains_key(kube_vip::REQUESTED_IP));
                if has {
                    rt.block_on(api.patch(
                        "web",
                        &kube::api::PatchParams::default(),
                        &kube::api::Patch::Merge(&blank),
                    ))?;
                    n += 1;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            Ok(n)
        })
    };
    // The controller gives it another holder once the old one's heartbeat
    // is stale (3 s); that node's takeover guard hears the old holder.
    let moved = wait_for(WITHIN, || {
        let guarded = (0..lb.rig.guest_count()).filter(|g| *g != holder).any(|g| {
            lb.node_object(&lb.node_name(g)).is_some_and(|o| {
                o["status"]["leases"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .any(|l| l["service"] == "team-a/web" && l["state"] == "GUARDED")
            })
        });
        guarded.then_some(())
    });
    ensure!(
        moved.is_some(),
        "no other node was assigned team-a/web and guarded:\n{}",
        lb.diagnostics()
    );
    std::thread::sleep(Duration::from_secs(3));
    ensure!(
        watch.overlaps(ip).is_empty(),
        "two guests held {ip} at once: {:?}",
        watch.overlaps(ip)
    );
    // The old holder hears the API again, reads that it no longer holds
    // the Service and lets go; the new holder's guard then finds silence.
    lb.restore_api(holder)?;
    let t0 = std::time::Instant::now();
    let taken = wait_for(Duration::from_secs(60), || {
        watch.taken_by_other(ip, holder, t0)
    });
    ensure!(
        taken.is_some(),
        "{ip} never moved to another guest after the old holder reached the API again:\n{}",
        lb.diagnostics()
    );
    std::thread::sleep(Duration::from_millis(500));
    blanking.store(false, std::sync::atomic::Ordering::SeqCst);
    let blanked = blanker.join().expect("the tenant's thread")?;
    ensure!(blanked >= 1, "the tenant never blanked requestedIP");
    let arp = prober.finish()?;
    ensure!(
        watch.overlaps(ip).is_empty() && arp.doubly_answered().is_empty(),
        "two answerers: kernels {:?}, ARP answered twice at {} moments",
        watch.overlaps(ip),
        arp.doubly_answered().len()
    );
    ensure!(
        lb.ingress_ip("team-a/web") == Some(ip),
        "the address changed"
    );
    Ok(())
}

/// The MAC of `dev` in namespace `ns`, read from the kernel.
fn kernel_mac(ns: &str, dev: &str) -> Result<String> {
    let out = std::process::Command::new("ip")
        .args(["-n", ns, "-j", "link", "show", dev])
        .output()?;
    let v: serde_json::Value = serde_json::from_slice(&out.stdout)?;
    v[0]["address"]
        .as_str()
        .map(str::to_ascii_lowercase)
        .with_context(|| format!("no MAC for {dev} in {ns}"))
}

/// Issue #29: with its own token, a tenant pins `kube-vip.io/hwaddr` to
/// the LAN gateway's MAC and to another node's network card, on new
/// Services and on one already served. Each is refused with a Warning
/// Event naming the annotation; no macvlan with either MAC exists on any
/// guest (read from the kernels); the served Service keeps its MAC and
/// address.
fn a_tenant_cannot_put_another_hosts_mac_on_the_lan() -> Result<()> {
    let mut lb = LbRig::start(options())?;
    // Nodes talk to their gateway (DNS, registries, the internet): its
    // entry is in their ARP tables, as on any real node.
    let gateway_addr: std::net::SocketAddr = format!("{}:9", hna_testkit::rig::LAN_ADDR).parse()?;
    for g in 0..lb.rig.guest_count() {
        // Any answer (here a refusal) means the gateway was resolved.
        hna_testkit::rig::forward::in_netns(lb.rig.guest_ns(g), || {
            let _ = std::net::TcpStream::connect_timeout(&gateway_addr, Duration::from_secs(2));
        })?;
    }
    let gateway = kernel_mac(lb.rig.lan_ns(), "br0")?;
    let other_nic = kernel_mac(lb.rig.guest_ns(1), "eth0")?;
    let reported = wait_for(WITHIN, || {
        let o = lb.node_object(&lb.node_name(0))?;
        let gw = o["status"]["gatewayMac"].as_str()?.to_string();
        let o1 = lb.node_object(&lb.node_name(1))?;
        let nics: Vec<String> = o1["status"]["nicMacs"]
            .as_array()?
            .iter()
            .filter_map(|m| m.as_str().map(str::to_string))
            .collect();
        Some((gw, nics))
    })
    .context("the agents never reported their gateway's and cards' MACs")?;
    ensure!(
        reported.0 == gateway && reported.1.contains(&other_nic),
        "reported {reported:?}, the kernels say gateway {gateway}, node 1's eth0 {other_nic}"
    );

    let (tenant, ip) = tenants_web(&lb)?;
    let web_mac = wait_for(WITHIN, || {
        lb.service("team-a/web")
            .and_then(|s| annotation(&s, kube_vip::HWADDR).map(str::to_string))
    })
    .context("team-a/web: no hwaddr written back")?;
    for (name, mac) in [("team-a/gw", &gateway), ("team-a/nic", &other_nic)] {
        lb.create_service_as(
            &tenant,
            name,
            &[(harvester::IPAM, "dhcp"), (kube_vip::HWADDR, mac)],
            &[LISTEN_PORT],
        )?;
    }
    lb.annotate_as(&tenant, "team-a/web", kube_vip::HWADDR, Some(&gateway))?;
    for name in ["team-a/gw", "team-a/nic", "team-a/web"] {
        let why = lb.wait_warning(name, "MACAddressRefused", WITHIN);
        ensure!(why.contains(kube_vip::HWADDR), "{name}: {why}");
    }
    for name in ["team-a/gw", "team-a/nic"] {
        ensure!(ingress_is_empty(&lb, name), "{name} was served");
    }
    // A while for anything wrong to show.
    std::thread::sleep(Duration::from_secs(3));
    for g in 0..lb.rig.guest_count() {
        for l in lb.hlb_links(g) {
            ensure!(
                !l.mac.eq_ignore_ascii_case(&gateway) && !l.mac.eq_ignore_ascii_case(&other_nic),
                "guest {g} has a link with another host's MAC: {l:?}"
            );
        }
    }
    let holders = lb.carriers(ip);
    ensure!(
        holders.len() == 1 && holders[0].1.mac.eq_ignore_ascii_case(&web_mac),
        "team-a/web is no longer served as it was: {holders:?}"
    );
    ensure!(lb.ingress_ip("team-a/web") == Some(ip));

    // A LAN host that is neither a node nor the gateway: only the holder
    // knows its MAC (from its ARP table, once they have talked). The
    // tenant moves web to that MAC: the holder refuses it and keeps
    // serving under the MAC it has; the controller says so on web.
    let holder = lb.guest_of(&holders[0].0);
    let neighbour = lb.rig.add_lan_host("neighbour")?;
    let neighbour_mac = kernel_mac(&neighbour.ns, "eth0")?;
    let to = std::net::SocketAddr::from((neighbour.addr, 9));
    hna_testkit::rig::forward::in_netns(lb.rig.guest_ns(holder), || {
        let _ = std::net::TcpStream::connect_timeout(&to, Duration::from_secs(2));
    })?;
    lb.annotate_as(
        &tenant,
        "team-a/web",
        kube_vip::HWADDR,
        Some(&neighbour_mac),
    )?;
    let told = wait_for(WITHIN, || {
        lb.our_events("team-a/web")
            .into_iter()
            .find_map(|(t, r, m)| {
                (t == "Warning"
                    && r == "MACAddressRefused"
                    && m.contains(&neighbour.addr.to_string()))
                .then_some(m)
            })
    });
    ensure!(
        told.as_deref()
            .is_some_and(|m| m.contains(kube_vip::HWADDR)),
        "no MACAddressRefused Warning naming the neighbour {} and the annotation: {:#?}",
        neighbour.addr,
        lb.events("team-a/web")
    );
    for g in 0..lb.rig.guest_count() {
        for l in lb.hlb_links(g) {
            ensure!(
                !l.mac.eq_ignore_ascii_case(&neighbour_mac),
                "guest {g} has a link with the neighbour's MAC: {l:?}"
            );
        }
    }
    let holders = lb.carriers(ip);
    ensure!(
        holders.len() == 1 && holders[0].1.mac.eq_ignore_ascii_case(&web_mac),
        "team-a/web is no longer served as it was after the neighbour's MAC: {holders:?}"
    );
    ensure!(
        lb.tcp_from_client(ip, LISTEN_PORT).is_ok(),
        "team-a/web does not answer TCP"
    );
    Ok(())
}
