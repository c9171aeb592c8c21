//! What a Service's status may say: the address of its holder or of the
//! primary it shares, IPv4 only, and never an address a node could not
//! have been given for it.

use std::net::Ipv4Addr;

use crate::contract::{self, harvester};

use super::events::{EventType, Events, reason};
use super::plan::Write;
use super::world::{IP_MODE_VIP, Ingress, ServiceIn, World};

/// Why `ip`, reported by a holder for `s`, cannot be its load-balancer
/// address: a node credential could otherwise publish any address (the API
/// server's, a Pod's, another Service's) into a Service's status.
pub(super) fn implausible(ip: &str, s: &ServiceIn, world: &World<'_>) -> Option<String> {
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
    if let Some((net, len)) = world.node_networks.pod_cidr_of(addr) {
        return Some(format!("{ip} is in the Pod CIDR {net}/{len}"));
    }
    for other in world.services {
        if other.cluster_ips.iter().any(|c| c == ip) {
            return Some(format!("{ip} is a Service's cluster IP"));
        }
        if other.uid != s.uid && other.ingress.iter().any(|i| i.ip == ip) && !shares(other, s) {
            return Some(format!("{ip} is another Service's load-balancer address"));
        }
    }
    None
}

/// Whether `other` shows `s`'s address because it shares it (a secondary
/// naming `s`).
fn shares(other: &ServiceIn, s: &ServiceIn) -> bool {
    other
        .annotations
        .get(harvester::PRIMARY_SERVICE)
        .and_then(|p| contract::parse_service_key(p))
        .is_some_and(|p| p == s.key)
}

/// The status write that gives `s` the address `ip` with its own ports,
/// unless its status says so already.
pub(super) fn status_write(s: &ServiceIn, ip: &str, ip_mode: bool) -> Option<Write> {
    let want = vec![Ingress {
        ip: ip.to_string(),
        ip_mode: ip_mode.then(|| IP_MODE_VIP.to_string()),
        ports: s.ports.clone(),
    }];
    (s.ingress != want).then(|| Write::ServiceStatus {
        service: s.key.clone(),
        ingress: want,
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
