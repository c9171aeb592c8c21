//! LoadBalancer addresses end to end (issue #9) on the rig: three guest
//! namespaces with agents on node credentials, two controller replicas with
//! the manifests' RBAC, dnsmasq on the LAN and a client namespace.

use std::time::Duration;

use anyhow::{Context, Result, ensure};
use hna_contract::{self, harvester, kube_vip, node_object};
use hna_testkit::lb::{self, LISTEN_PORT, LbRig, annotation, wait_for};
use nix::sys::signal::Signal;

use crate::harness::tests;

tests! {
    the_test_kit_names_what_the_contract_names;
    a_dhcp_service_gets_an_address_held_by_one_node_and_released_on_delete: Root, Iproute2, Dnsmasq, ApiServer, Socat;
    share_ip_and_every_refusal_changes_nothing_else: Root, Iproute2, Dnsmasq, ApiServer, Socat;
    kube_vips_record_keeps_the_address_and_the_mac: Root, Iproute2, Dnsmasq, ApiServer, Socat;
    going_back_to_kube_vip_keeps_the_address: Root, Iproute2, Dnsmasq, ApiServer, Socat;
    a_named_network_is_resolved_through_the_cloud_providers_map: Root, Iproute2, Dnsmasq, ApiServer, Socat;
    a_new_leader_changes_no_service: Root, Iproute2, Dnsmasq, ApiServer, Socat;
    a_new_link_never_answers_for_another_services_address: Root, Iproute2, Dnsmasq, ApiServer, Socat;
}

/// The rig with the checkout's binary and manifests.
fn options() -> lb::Options {
    lb::Options::new(
        crate::BIN,
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("packaging/kubernetes"),
    )
}

fn node_object(lb: &LbRig, node: &str) -> Result<node_object::LoadBalancerNode> {
    let v = lb
        .node_object(node)
        .with_context(|| format!("no LoadBalancerNode {node}"))?;
    Ok(serde_json::from_value(v)?)
}

fn the_test_kit_names_what_the_contract_names() {
    assert_eq!(lb::NAMESPACE, hna_contract::DEFAULT_NAMESPACE);
    assert_eq!(lb::CONTROLLER_LEASE, hna_contract::CONTROLLER_LEASE);
    assert_eq!(lb::INTERFACE_PREFIX, hna_contract::INTERFACE_PREFIX);
    assert_eq!(
        lb::CONTROLLER_REPORTER,
        hna_controller::writer::FIELD_MANAGER
    );
}

const ADDRESS_WITHIN: Duration = Duration::from_secs(60);
const WITHIN: Duration = Duration::from_secs(30);

/// Event reasons the controller uses for refusals, as an operator reads
/// them with `kubectl get events` (`controller::reconcile::reason`).
mod reason {
    pub const PORTS_OVERLAP: &str = "PortsOverlap";
    pub const PRIMARY_IS_SECONDARY: &str = "PrimaryIsSecondary";
    pub const IPAM_CHANGE: &str = "IPAMChangeRefused";
    pub const PRIMARY_IN_USE: &str = "SecondariesStillShareAddress";
}

fn a_dhcp_service_gets_an_address_held_by_one_node_and_released_on_delete() -> Result<()> {
    let mut lb = LbRig::start(options())?;
    let svc = lb.create_service("web", &[(harvester::IPAM, "dhcp")], &[LISTEN_PORT])?;
    let uid = svc.metadata.uid.clone().unwrap();
    let ip = lb.wait_ingress("web", ADDRESS_WITHIN);
    // Status first, then the annotations: wait for those too.
    let svc = wait_for(WITHIN, || {
        lb.service("web")
            .filter(|s| annotation(s, kube_vip::VIP_HOST).is_some())
    })
    .context("no kube-vip.io/vipHost after the address")?;

    // The status carries the ports; the annotations are kube-vip's record.
    let ingress = &svc
        .status
        .as_ref()
        .unwrap()
        .load_balancer
        .as_ref()
        .unwrap()
        .ingress
        .as_ref()
        .unwrap()[0];
    let ports = ingress.ports.as_ref().expect("ports in the ingress status");
    ensure!(
        ports.len() == 1 && ports[0].port == LISTEN_PORT as i32 && ports[0].protocol == "TCP",
        "{ports:?}"
    );
    let holder = annotation(&svc, kube_vip::VIP_HOST)
        .expect("vipHost")
        .to_string();
    let mac = annotation(&svc, kube_vip::HWADDR)
        .expect("hwaddr")
        .to_string();
    ensure!(annotation(&svc, kube_vip::REQUESTED_IP) == Some(ip.to_string().as_str()));
    ensure!(
        annotation(&svc, kube_vip::LOADBALANCER_IPS).is_none(),
        "never ours to write"
    );

    // Exactly one guest carries the address, on our link named after the
    // UID, with the MAC the annotations name; dnsmasq leased it to that MAC.
    let carriers = lb.carriers(ip);
    ensure!(carriers.len() == 1, "carriers of {ip}: {carriers:?}");
    let (node, link) = &carriers[0];
    ensure!(node == &holder, "{ip} is on {node}, vipHost says {holder}");
    ensure!(link.name == format!("hlb-{}", &uid[..8]), "{link:?}");
    ensure!(link.mac == mac, "link MAC {} vs hwaddr {mac}", link.mac);
    let leases = lb.rig.dnsmasq_leases()?;
    ensure!(
        leases
            .lines()
            .any(|l| l.contains(&ip.to_string()) && l.contains(&mac)),
        "dnsmasq leases:\n{leases}"
    );
    let obj = node_object(&lb, &holder)?;
    ensure!(
        obj.spec
            .assignments
            .iter()
            .any(|a| a.service == "default/web" && a.mac == mac),
        "{:?}",
        obj.spec
    );

    // A TCP client on the LAN reaches the listener on the holder.
    let reply = wait_for(WITHIN, || lb.tcp_from_client(ip, LISTEN_PORT).ok());
    ensure!(
        reply.as_deref() == Some(holder.as_str()),
        "reply {reply:?}, holder {holder}"
    );

    // kill -9 and restart: the same node keeps the same address, with no
    // RELEASE and no new DISCOVER.
    let i = lb.guest_of(&holder);
    let before = node_object(&lb, &holder)?.status.unwrap_or_default();
    let mark = lb.dnsmasq_log_len();
    lb.signal_agent(i, Signal::SIGKILL);
    ensure!(
        lb.carriers(ip).len() == 1,
        "the kernel keeps the link while the agent is gone"
    );
    lb.start_agent(i)?;
    // Handshake: the new agent has reported the lease again.
    let adopted = wait_for(WITHIN, || {
        let st = node_object(&lb, &holder).ok()?.status?;
        (st.heartbeat != before.heartbeat
            && st
                .leases
                .iter()
                .any(|l| l.service == "default/web" && l.state == "BOUND"))
        .then_some(st)
    });
    ensure!(
        adopted.is_some(),
        "the restarted agent never reported the lease; log:\n{}",
        lb.agent_log(i)
    );
    let carriers = lb.carriers(ip);
    ensure!(
        carriers.len() == 1 && carriers[0].0 == holder,
        "{carriers:?}"
    );
    ensure!(lb.ingress_ip("web") == Some(ip));
    let since = lb.dnsmasq_log_from(mark);
    for msg in ["DHCPDISCOVER", "DHCPRELEASE"] {
        ensure!(
            !since.lines().any(|l| l.contains(msg) && l.contains(&mac)),
            "{msg} after the restart:\n{since}"
        );
    }
    ensure!(lb.tcp_from_client(ip, LISTEN_PORT)? == holder);

    // Delete: DHCPRELEASE reaches the server, no link is left anywhere and
    // the Service goes (our finalizer is removed).
    let mark = lb.dnsmasq_log_len();
    lb.delete_service("web")?;
    let gone = wait_for(WITHIN, || lb.service("web").is_none().then_some(()));
    ensure!(
        gone.is_some(),
        "Service still there: {:#?}",
        lb.service("web").map(|s| s.metadata)
    );
    lb.ensure_released("web", ip, &mac, mark)?;
    Ok(())
}

fn share_ip_and_every_refusal_changes_nothing_else() -> Result<()> {
    // Without the shipped admission policy, which would refuse the IPAM
    // change below before the controller sees it: the controller must
    // refuse it on its own (current_api:: proves the policy).
    let lb = LbRig::start(lb::Options {
        admission_policy: false,
        ..options()
    })?;
    lb.create_service("web", &[(harvester::IPAM, "dhcp")], &[80])?;
    let ip = lb.wait_ingress("web", ADDRESS_WITHIN);
    let ip_text = ip.to_string();
    // As the cloud provider writes a secondary: its primary's address.
    let secondary = |name: &str, primary: &str, port: u16| {
        lb.create_service(
            name,
            &[
                (harvester::PRIMARY_SERVICE, primary),
                (kube_vip::LOADBALANCER_IPS, ip_text.as_str()),
            ],
            &[port],
        )
    };
    secondary("web-extra", "default/web", 81)?;
    ensure!(lb.wait_ingress("web-extra", WITHIN) == ip);
    ensure!(lb.carriers(ip).len() == 1, "a secondary adds no link");

    secondary("web-clash", "default/web", 80)?;
    lb.wait_warning("web-clash", reason::PORTS_OVERLAP, WITHIN);
    secondary("web-chain", "default/web-extra", 82)?;
    lb.wait_warning("web-chain", reason::PRIMARY_IS_SECONDARY, WITHIN);
    for refused in ["web-clash", "web-chain"] {
        ensure!(lb.ingress_ip(refused).is_none(), "{refused} got an address");
    }

    // IPAM change: refused, the running address kept.
    let before = lb.service("web").unwrap();
    lb.annotate("web", harvester::IPAM, Some("pool"))?;
    lb.wait_warning("web", reason::IPAM_CHANGE, WITHIN);
    let after = lb.service("web").unwrap();
    ensure!(after.status == before.status, "status changed");
    ensure!(lb.carriers(ip).len() == 1);
    lb.annotate("web", harvester::IPAM, Some("dhcp"))?;

    // A primary is not torn down under its secondaries.
    for s in ["web-clash", "web-chain"] {
        lb.delete_service(s)?;
    }
    let mark = lb.dnsmasq_log_len();
    lb.delete_service("web")?;
    lb.wait_warning("web", reason::PRIMARY_IN_USE, WITHIN);
    ensure!(lb.carriers(ip).len() == 1, "released under a secondary");
    ensure!(lb.ingress_ip("web-extra") == Some(ip));
    ensure!(!lb.dnsmasq_log_from(mark).contains("DHCPRELEASE"));
    lb.delete_service("web-extra")?;
    let gone = wait_for(WITHIN, || lb.service("web").is_none().then_some(()));
    ensure!(
        gone.is_some(),
        "the primary was not released after its secondary went"
    );
    ensure!(lb.dnsmasq_log_from(mark).contains("DHCPRELEASE"));
    Ok(())
}

fn kube_vips_record_keeps_the_address_and_the_mac() -> Result<()> {
    let lb = LbRig::start(options())?;
    // The lease kube-vip left on the server: its MAC, no client identifier
    // (kube-vip sends none without loadbalancerHostname), not released.
    let mac = "00:00:6c:4a:0b:01";
    let out = lb
        .rig
        .netns_cmd(lb.rig.guest_ns(2), crate::BIN)
        .args([
            "dhcp-probe",
            "--parent",
            "eth0",
            "--mac",
            mac,
            "--client-id",
            "none",
            "--release=false",
            "--output",
            "json",
        ])
        .output()?;
    ensure!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
    let report: serde_json::Value = serde_json::from_slice(&out.stdout)?;
    let want = report["address"].as_str().expect("an address").to_string();
    lb.create_service(
        "migrated",
        &[
            (kube_vip::LOADBALANCER_IPS, "0.0.0.0"),
            (kube_vip::HWADDR, mac),
            (kube_vip::REQUESTED_IP, want.as_str()),
        ],
        &[LISTEN_PORT],
    )?;
    let ip = lb.wait_ingress("migrated", ADDRESS_WITHIN);
    ensure!(ip.to_string() == want, "got {ip}, kube-vip had {want}");
    let carriers = lb.carriers(ip);
    ensure!(
        carriers.len() == 1 && carriers[0].1.mac == mac,
        "{carriers:?}"
    );
    let svc = wait_for(WITHIN, || {
        lb.service("migrated")
            .filter(|s| annotation(s, kube_vip::VIP_HOST).is_some())
    })
    .context("no kube-vip.io/vipHost after the address")?;
    // What kube-vip reads back: the same MAC text, the address, the holder.
    ensure!(annotation(&svc, kube_vip::HWADDR) == Some(mac));
    ensure!(annotation(&svc, kube_vip::REQUESTED_IP) == Some(want.as_str()));
    ensure!(annotation(&svc, kube_vip::VIP_HOST) == Some(carriers[0].0.as_str()));
    ensure!(annotation(&svc, kube_vip::LOADBALANCER_IPS) == Some("0.0.0.0"));
    let reply = wait_for(WITHIN, || lb.tcp_from_client(ip, LISTEN_PORT).ok());
    ensure!(
        reply.as_deref() == Some(carriers[0].0.as_str()),
        "{reply:?}"
    );
    Ok(())
}

/// A Service born under this agent (our client identifier, no hostname)
/// handed back with our opt-out: kube-vip, asking with the written-back MAC,
/// no client identifier and option 50, gets the same address.
fn going_back_to_kube_vip_keeps_the_address() -> Result<()> {
    let lb = LbRig::start(options())?;
    lb.create_service("web", &[(harvester::IPAM, "dhcp")], &[LISTEN_PORT])?;
    let ip = lb.wait_ingress("web", ADDRESS_WITHIN);
    let svc = wait_for(WITHIN, || {
        lb.service("web")
            .filter(|s| annotation(s, kube_vip::HWADDR).is_some())
    })
    .context("no kube-vip.io/hwaddr written back")?;
    let mac = annotation(&svc, kube_vip::HWADDR).unwrap().to_string();
    ensure!(annotation(&svc, kube_vip::REQUESTED_IP) == Some(ip.to_string().as_str()));
    let mark = lb.dnsmasq_log_len();

    lb.annotate("web", hna_contract::IGNORE, Some("true"))?;
    wait_for(WITHIN, || {
        lb.service("web").filter(|s| {
            !s.metadata
                .finalizers
                .iter()
                .flatten()
                .any(|f| f == hna_contract::FINALIZER)
        })
    })
    .with_context(|| format!("finalizer kept after the opt-out\n{}", lb.diagnostics()))?;
    ensure!(lb.carriers(ip).is_empty(), "{:?}", lb.carriers(ip));
    ensure!(
        lb.dnsmasq_log_from(mark).contains("DHCPRELEASE"),
        "no DHCPRELEASE on hand-back:\n{}",
        lb.dnsmasq_log_from(mark)
    );
    // The record kube-vip reads stays; the status no longer claims a
    // released address.
    let handed = wait_for(WITHIN, || {
        lb.service("web").filter(|s| lb::ingress_ip(s).is_none())
    })
    .context("the status still claims the released address")?;
    ensure!(annotation(&handed, kube_vip::HWADDR) == Some(mac.as_str()));
    ensure!(annotation(&handed, kube_vip::REQUESTED_IP) == Some(ip.to_string().as_str()));
    wait_for(WITHIN, || {
        lb.events("web")
            .iter()
            .any(|(_, r, _)| r == "HandedOver")
            .then_some(())
    })
    .with_context(|| format!("no HandedOver Event: {:?}", lb.events("web")))?;

    // kube-vip as it asks: that MAC, no option 61, option 50.
    let out = lb
        .rig
        .netns_cmd(lb.rig.guest_ns(1), crate::BIN)
        .args(["dhcp-probe", "--parent", "eth0", "--mac", &mac])
        .args(["--client-id", "none", "--requested-ip", &ip.to_string()])
        .args(["--output", "json"])
        .output()?;
    let report: serde_json::Value = serde_json::from_slice(&out.stdout)
        .with_context(|| String::from_utf8_lossy(&out.stderr).into_owned())?;
    ensure!(
        report["address"].as_str() == Some(ip.to_string().as_str()),
        "kube-vip would get {} instead of {ip}: {report}",
        report["address"]
    );
    Ok(())
}

/// `cloudprovider.harvesterhci.io/network` through the ConfigMap the
/// Harvester cloud provider keeps, read with the manifests' RBAC (a Role on
/// that one ConfigMap): refused while the map lacks the network, served on
/// the mapped uplink once it has it.
fn a_named_network_is_resolved_through_the_cloud_providers_map() -> Result<()> {
    use k8s_openapi::api::core::v1::ConfigMap;
    use kube::api::{Api, PostParams};
    let lb = LbRig::start(options())?;
    lb.create_service(
        "web",
        &[
            (harvester::IPAM, "dhcp"),
            (harvester::NETWORK, "default/lan"),
        ],
        &[LISTEN_PORT],
    )?;
    let why = lb.wait_warning("web", "NetworkNotResolved", WITHIN);
    ensure!(why.contains("does not exist"), "{why}");
    ensure!(lb.ingress_ip("web").is_none());

    let maps: Api<ConfigMap> = Api::namespaced(lb.admin(), "kube-system");
    let map: ConfigMap = serde_json::from_value(serde_json::json!({
        "metadata": {"name": "harvester-nad-mapping"},
        "data": {"interface-nad-mapping": r#"{"default/lan":"eth0","default/mgmt":"eth9"}"#},
    }))?;
    lb.block_on(maps.create(&PostParams::default(), &map))?;
    let ip = lb.wait_ingress("web", ADDRESS_WITHIN);
    let carriers = lb.carriers(ip);
    ensure!(carriers.len() == 1, "{carriers:?}");
    let holder = node_object(&lb, &carriers[0].0)?;
    let uplinks: Vec<Option<String>> = holder
        .spec
        .assignments
        .iter()
        .map(|a| a.uplink.clone())
        .collect();
    ensure!(uplinks == [Some("eth0".to_string())], "{uplinks:?}");
    let reply = wait_for(WITHIN, || lb.tcp_from_client(ip, LISTEN_PORT).ok());
    ensure!(
        reply.as_deref() == Some(carriers[0].0.as_str()),
        "{reply:?}"
    );

    lb.create_service(
        "lost",
        &[
            (harvester::IPAM, "dhcp"),
            (harvester::NETWORK, "default/other"),
        ],
        &[LISTEN_PORT],
    )?;
    let why = lb.wait_warning("lost", "NetworkNotResolved", WITHIN);
    ensure!(why.contains("default/lan, default/mgmt"), "{why}");
    ensure!(lb.ingress_ip("lost").is_none());
    Ok(())
}

fn a_new_leader_changes_no_service() -> Result<()> {
    let mut lb = LbRig::start(lb::Options {
        controller_args: [
            "--lease-duration",
            "4s",
            "--renew-deadline",
            "3s",
            "--retry-period",
            "500ms",
        ]
        .map(String::from)
        .to_vec(),
        ..options()
    })?;
    for name in ["a", "b", "c"] {
        lb.create_service(name, &[(harvester::IPAM, "dhcp")], &[LISTEN_PORT])?;
    }
    for name in ["a", "b", "c"] {
        lb.wait_ingress(name, ADDRESS_WITHIN);
    }
    // The status is written before kube-vip's record, so the address alone
    // does not mean the old leader is done with a Service: wait for the
    // record, its last write.
    for name in ["a", "b", "c"] {
        let recorded = wait_for(WITHIN, || {
            let s = lb.service(name)?;
            let a = s.metadata.annotations.unwrap_or_default();
            [kube_vip::HWADDR, kube_vip::REQUESTED_IP, kube_vip::VIP_HOST]
                .iter()
                .all(|k| a.contains_key(*k))
                .then_some(())
        });
        ensure!(recorded.is_some(), "Service {name} got no kube-vip record");
    }
    // The resourceVersion says whether anything changed; the rest says what.
    let versions = |lb: &LbRig| -> Vec<(Option<String>, String)> {
        ["a", "b", "c"]
            .iter()
            .map(|n| {
                let s = lb.service(n).unwrap();
                (
                    s.metadata.resource_version,
                    format!(
                        "{:?} {:?} {:?}",
                        s.metadata.annotations, s.metadata.finalizers, s.status
                    ),
                )
            })
            .collect()
    };
    let before = versions(&lb);
    let leader = wait_for(WITHIN, || lb.leader()).expect("a leader");
    let i = (0..2)
        .find(|&i| LbRig::controller_identity(i) == leader)
        .expect("a replica leads");
    lb.kill_controller(i);
    let other = LbRig::controller_identity(1 - i);
    let took_over = wait_for(WITHIN, || {
        (lb.leader().as_deref() == Some(other.as_str())).then_some(())
    });
    ensure!(
        took_over.is_some(),
        "{other} never took the Lease; log:\n{}",
        lb.controller_log(1 - i)
    );
    // Handshake: the new leader serves a new Service, so it has reconciled
    // the old ones too.
    lb.create_service("d", &[(harvester::IPAM, "dhcp")], &[LISTEN_PORT])?;
    lb.wait_ingress("d", ADDRESS_WITHIN);
    let after = versions(&lb);
    ensure!(
        after == before,
        "a Service changed under the new leader:\nbefore: {before:#?}\nafter: {after:#?}"
    );
    Ok(())
}

/// Found by the soak (issue #20): a node holding one Service's address
/// brings up links for more Services. A macvlan that came up with the
/// kernel's default ARP settings (`arp_ignore=0`) answered, for the few
/// milliseconds until the agent tuned it, for every address of the node
/// with its own MAC, beside the address's holder. One guest, so every new
/// link is beside the first address; a client asks every millisecond.
fn a_new_link_never_answers_for_another_services_address() -> Result<()> {
    let mut opts = options();
    opts.guests = 1;
    let lb = LbRig::start(opts)?;
    lb.create_service("first", &[(harvester::IPAM, "dhcp")], &[LISTEN_PORT])?;
    let ip = lb.wait_ingress("first", ADDRESS_WITHIN);
    let prober = hna_testkit::failover::arp_prober_every(&lb, ip, Duration::from_millis(1))?;
    let more: Vec<String> = (0..8).map(|i| format!("more-{i}")).collect();
    for name in &more {
        lb.create_service(name, &[(harvester::IPAM, "dhcp")], &[LISTEN_PORT])?;
    }
    for name in &more {
        lb.wait_ingress(name, ADDRESS_WITHIN);
    }
    let record = prober.finish()?;
    let twice: Vec<_> = record
        .probes
        .iter()
        .filter(|p| p.replies.len() > 1)
        .map(|p| {
            p.replies
                .iter()
                .map(|(_, mac)| hex_mac(mac))
                .collect::<Vec<_>>()
        })
        .collect();
    println!(
        "{} requests for {ip} while 8 links came up; {} answered twice",
        record.probes.len(),
        twice.len()
    );
    ensure!(
        twice.is_empty(),
        "requests for {ip} answered by two MACs while other links came up: {twice:?}"
    );
    Ok(())
}

fn hex_mac(mac: &[u8; 6]) -> String {
    mac.iter()
        .map(|b| format!("{b:02x}"))
        .collect::<Vec<_>>()
        .join(":")
}
