//! What a Service's status may say: the address of its holder or of the
//! primary it shares, IPv4 only, and never an address a node could not
//! have been given for it.

use std::collections::{HashMap, HashSet};
use std::net::Ipv4Addr;

use hna_contract::{self, harvester};

use super::events::{EventType, Events, reason};
use super::plan::{Assigned, Write};
use super::world::{IP_MODE_VIP, Ingress, ServiceIn, World};

/// The addresses a load-balancer address must not be, indexed once per
/// pass: compared with every Service and node object for each Service
/// served, the pass was quadratic (4,000 Services took 0.6 s, issue #30).
#[derive(Debug, Default)]
pub(super) struct Taken<'a> {
    cluster_ips: HashSet<&'a str>,
    /// Each address a Service's status shows, with those showing it.
    shown_by: HashMap<&'a str, Vec<&'a ServiceIn>>,
    /// Each node's default gateway, with the node.
    gateways: HashMap<&'a str, &'a str>,
}

impl<'a> Taken<'a> {
    pub(super) fn of(world: &World<'a>) -> Taken<'a> {
        let mut t = Taken::default();
        for s in world.services {
            t.cluster_ips
                .extend(s.cluster_ips.iter().map(String::as_str));
            for i in &s.ingress {
                t.shown_by.entry(i.ip.as_str()).or_default().push(s);
            }
        }
        for n in world.node_objects {
            if let Some(g) = n.status.gateway_address.as_deref() {
                t.gateways.entry(g).or_insert(n.name.as_str());
            }
        }
        t
    }
}

/// Why `ip`, reported by a holder for `s`, cannot be its load-balancer
/// address: a node credential could otherwise publish any address (the API
/// server's, a Pod's, another Service's) into a Service's status.
pub(super) fn implausible(
    ip: &str,
    s: &ServiceIn,
    world: &World<'_>,
    taken: &Taken<'_>,
) -> Option<String> {
    let Ok(addr) = ip.parse::<Ipv4Addr>() else {
        return Some(format!("{ip:?} is not an IPv4 address"));
    };
    if addr.is_unspecified()
        || addr.is_loopback()
        || addr.is_multicast()
        || addr.is_broadcast()
        || addr.is_link_local()
    {
        return Some(format!("{ip} is not a unicast host address"));
    }
    if world.node_networks.addresses.contains(&addr) {
        return Some(format!("{ip} is a Node's own address"));
    }
    // Issue #29: published, it would make kube-proxy send in-cluster
    // traffic for the gateway to the Service.
    if let Some(node) = taken.gateways.get(ip) {
        return Some(format!("{ip} is the default gateway of node {node}"));
    }
    if let Some((net, len)) = world.node_networks.pod_cidr_of(addr) {
        return Some(format!("{ip} is in the Pod CIDR {net}/{len}"));
    }
    if taken.cluster_ips.contains(ip) {
        return Some(format!("{ip} is a Service's cluster IP"));
    }
    let mut others = taken.shown_by.get(ip).into_iter().flatten();
    if others.any(|other| other.uid != s.uid && !shares(other, s)) {
        return Some(format!("{ip} is another Service's load-balancer address"));
    }
    None
}

/// Whether `other` shows `s`'s address because it shares it (a secondary
/// naming `s`).
fn shares(other: &ServiceIn, s: &ServiceIn) -> bool {
    other
        .annotations
        .get(harvester::PRIMARY_SERVICE)
        .and_then(|p| hna_contract::parse_service_key(p))
        .is_some_and(|p| p == s.key)
}

/// The status write that gives `s` the address `ip` with its own ports
/// and our condition for its generation, unless its status says so
/// already. `now`: the pass's wall clock (the condition's time).
pub(super) fn status_write(s: &ServiceIn, ip: &str, ip_mode: bool, now: i64) -> Option<Write> {
    let want = vec![Ingress {
        ip: ip.to_string(),
        ip_mode: ip_mode.then(|| IP_MODE_VIP.to_string()),
        ports: s.ports.clone(),
    }];
    (s.ingress != want || s.assigned_for != Some(s.generation)).then(|| Write::ServiceStatus {
        service: s.key.clone(),
        ingress: want,
        assigned: Some(Assigned {
            generation: s.generation,
            at: now,
        }),
    })
}

/// What DHCP can give a Service of its `ipFamilies`: DHCP-mode addresses
/// are IPv4, so an IPv6-only Service is refused (`false`, a Warning) and a
/// dual-stack one gets its IPv4 address only (`true`, a Normal Event
/// saying so).
fn ip_families(s: &ServiceIn) -> (bool, Option<(EventType, &'static str, String)>) {
    let has = |f: &str| s.ip_families.iter().any(|x| x == f);
    let families = s.ip_families.join(", ");
    match (has("IPv4"), has("IPv6")) {
        (false, true) => (
            false,
            Some((
                EventType::Warning,
                reason::IPV4_REQUIRED,
                format!(
                    "DHCP-mode addresses are IPv4 and this Service asks for IPv6 only (ipFamilies: [{families}]): no address is requested; on a dual-stack cluster set spec.ipFamilyPolicy: PreferDualStack to add the IPv4 family, or recreate the Service with ipFamilies: [IPv4]"
                ),
            )),
        ),
        (true, true) => (
            true,
            Some((
                EventType::Normal,
                reason::IPV6_NOT_SERVED,
                format!(
                    "DHCP-mode addresses are IPv4: the IPv4 family is served and the IPv6 family gets no load-balancer address (ipFamilies: [{families}])"
                ),
            )),
        ),
        _ => (true, None),
    }
}

/// [`ip_families`] applied: its Event told, a refusal counted; whether
/// the Service is served.
pub(super) fn families_served(s: &ServiceIn, events: &mut Events, refused: &mut usize) -> bool {
    let (serve, said) = ip_families(s);
    if let Some((type_, why, message)) = said {
        events.tell(s, type_, why, message);
    }
    if !serve {
        *refused += 1;
    }
    serve
}

#[cfg(test)]
mod tests {
    use crate::reconcile::sim::{Sim, dhcp, events, key, port, secondary, uid};
    use crate::reconcile::{IP_MODE_VIP, Ingress, reason};
    use hna_contract::harvester;

    #[test]
    fn an_implausible_reported_address_is_not_published() {
        let mut sim = Sim::new(&["n1"]);
        sim.node_networks
            .add(&["10.77.0.10", "fd00::10"], &["10.42.0.0/24"]);
        let mut kubernetes = dhcp("kubernetes", &[443]);
        kubernetes.type_ = "ClusterIP".into();
        kubernetes.annotations.clear();
        kubernetes.cluster_ips = vec!["10.96.0.1".into()];
        let mut pool = dhcp("pool", &[80]);
        pool.annotations = [(harvester::IPAM.to_string(), "pool".to_string())].into();
        pool.ingress = vec![Ingress {
            ip: "10.77.0.9".into(),
            ip_mode: None,
            ports: vec![port(80)],
        }];
        sim.services.extend([kubernetes, pool]);
        // What a node with stolen credentials could report.
        let lies = [
            ("a", "10.96.0.1", "cluster IP"),
            ("b", "10.77.0.10", "Node's own address"),
            ("c", "10.42.0.7", "Pod CIDR 10.42.0.0/24"),
            ("d", "10.77.0.9", "another Service's"),
            ("e", "127.0.0.1", "not a unicast host address"),
            ("f", "10.77.0.1", "default gateway of node n1"),
        ];
        sim.objects[0].status.gateway_address = Some("10.77.0.1".into());
        for (name, lie, _) in lies {
            let s = dhcp(name, &[80]);
            sim.given.insert(s.uid.clone(), lie.into());
            sim.services.push(s);
        }
        let plans = sim.settle();
        for (name, lie, why) in lies {
            assert!(sim.svc(name).ingress.is_empty(), "{name} published {lie}");
            assert!(
                plans
                    .iter()
                    .flat_map(|p| &p.events)
                    .any(|e| e.service == key(name)
                        && e.reason == reason::ADDRESS_IMPLAUSIBLE
                        && e.message.contains(why)),
                "{name}: {plans:?}"
            );
        }
        assert_eq!(sim.svc("pool").ingress[0].ip, "10.77.0.9");
        // A plausible report is published.
        sim.given.insert(uid("a"), "10.77.0.150".into());
        sim.settle();
        assert_eq!(sim.svc("a").ingress[0].ip, "10.77.0.150");
    }

    #[test]
    fn ip_mode_is_written_only_where_the_server_knows_it() {
        let mut sim = Sim::new(&["n1"]);
        sim.ip_mode = false;
        sim.services.push(dhcp("web", &[80]));
        sim.settle();
        assert_eq!(sim.svc("web").ingress[0].ip_mode, None);
        // A server that learned the field (an upgrade): written once.
        sim.ip_mode = true;
        let plans = sim.settle();
        assert_eq!(
            sim.svc("web").ingress[0].ip_mode.as_deref(),
            Some(IP_MODE_VIP)
        );
        assert_eq!(plans.len(), 2, "one write, then settled: {plans:?}");
    }

    #[test]
    fn dhcp_serves_the_ipv4_family_and_refuses_ipv6_only() {
        let mut sim = Sim::new(&["n1"]);
        let mut v6 = dhcp("v6", &[80]);
        v6.ip_families = vec!["IPv6".into()];
        let mut dual = dhcp("dual", &[80]);
        dual.ip_families = vec!["IPv6".into(), "IPv4".into()];
        let mut v6_secondary = secondary("v6-secondary", "dual", &[81]);
        v6_secondary.ip_families = vec!["IPv6".into()];
        sim.services.extend([v6, dual, v6_secondary]);
        let plans = sim.settle();
        let said: Vec<(&str, String)> = events(&plans);
        let about = |name: &str, reason: &str| {
            plans.iter().flat_map(|p| &p.events).any(|e| {
                e.service == key(name)
                    && e.reason == reason
                    && e.message.contains("DHCP-mode addresses are IPv4")
            })
        };
        assert!(about("v6", reason::IPV4_REQUIRED), "{said:?}");
        assert!(about("v6-secondary", reason::IPV4_REQUIRED), "{said:?}");
        assert!(about("dual", reason::IPV6_NOT_SERVED), "{said:?}");
        let v6 = sim.svc("v6");
        assert!(v6.ingress.is_empty() && v6.finalizers.is_empty());
        assert!(sim.holders("v6").is_empty());
        assert!(sim.svc("v6-secondary").ingress.is_empty());
        let dual = sim.svc("dual");
        assert_eq!(dual.ingress.len(), 1);
        assert!(dual.ingress[0].ip.parse::<std::net::Ipv4Addr>().is_ok());
        assert_eq!(plans.last().unwrap().summary.refused, 2);
        // The IPv4 family added (ipFamilyPolicy: PreferDualStack): served.
        sim.svc_mut("v6").ip_families.push("IPv4".into());
        sim.settle();
        assert_eq!(sim.svc("v6").ingress.len(), 1);
    }
}
