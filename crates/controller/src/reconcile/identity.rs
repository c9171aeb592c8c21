//! The address identity of a primary: the link name, MAC, client
//! identifier and requested address it asks for, each its own, and the
//! assignment that carries them to its holder.

use std::collections::{BTreeMap, BTreeSet};
use std::net::Ipv4Addr;

use hna_contract::node_object::Assignment;
use hna_contract::{AddressIdentity, ServiceKey, kube_vip};

use super::events::{EventType, reason};
use super::pass::{Need, Pass};
use super::plan::Write;
use super::specs::Specs;
use super::world::ServiceIn;

/// One identity, one Service (harvester#11122: the same MAC on two
/// nodes): a Service asking for a MAC, client identifier or address
/// another served Service has is refused, and what runs of it is kept.
pub(super) fn refuse_clashes(pass: &mut Pass<'_>) {
    let clashes = identity_clashes(&pass.needs, &pass.specs);
    pass.add_finalizers
        .retain(|w| !matches!(w, Write::AddFinalizer(k) if clashes.contains_key(k)));
    pass.needs.retain(|(s, _, _)| match clashes.get(&s.key) {
        Some(why) => {
            pass.summary.refused += 1;
            pass.events
                .tell(s, EventType::Warning, reason::IDENTITY_IN_USE, why.clone());
            false
        }
        None => true,
    });
}

/// The primaries among `needs` that ask for a link name, a MAC, a client
/// identifier or a requested address another of them has, each with the Event's message.
/// Who keeps it: a Service whose holder already runs that MAC, then the
/// older Service, then the first by name. The messages never name the
/// other Service: it may be another tenant's.
fn identity_clashes(needs: &[Need<'_>], specs: &Specs) -> BTreeMap<ServiceKey, String> {
    let mut order: Vec<(bool, i64, &ServiceKey, usize)> = needs
        .iter()
        .enumerate()
        .map(|(i, (s, id, _))| {
            let mac = hna_contract::mac::format(&id.mac);
            let holding = specs
                .holders_of(&s.uid)
                .iter()
                .any(|(_, a)| a.mac == mac && !a.release);
            (!holding, s.created, &s.key, i)
        })
        .collect();
    order.sort();
    let mut links = BTreeSet::new();
    let mut macs = BTreeSet::new();
    let mut clients = BTreeSet::new();
    let mut addresses = BTreeSet::new();
    let mut out = BTreeMap::new();
    for (_, _, key, i) in order {
        let id = &needs[i].1;
        let why = if links.contains(&id.interface) {
            // 32 bits of the UID name the link: two Services can meet.
            Some(format!(
                "the link name {} (from the first 8 hex digits of the UID) is already another Service's: delete and create this Service again to get another UID",
                id.interface
            ))
        } else if macs.contains(&id.mac) {
            Some(format!(
                "MAC {} is already used by another Service ({}): remove the annotation {} so that this Service gets a MAC of its own",
                hna_contract::mac::format(&id.mac),
                if needs[i].0.annotations.contains_key(kube_vip::HWADDR) {
                    "from kube-vip.io/hwaddr"
                } else {
                    "derived from the UID"
                },
                kube_vip::HWADDR
            ))
        } else if !id.client_id.is_empty() && clients.contains(&id.client_id) {
            Some(format!(
                "the DHCP client identifier from {} `{}` is already used by another Service: choose another hostname",
                kube_vip::LOADBALANCER_HOSTNAME,
                id.hostname.as_deref().unwrap_or_default()
            ))
        } else {
            id.requested_ip.filter(|ip| addresses.contains(ip)).map(|ip| {
                format!(
                    "{} {ip} is already asked for by another Service: remove the annotation to let the DHCP server choose",
                    kube_vip::REQUESTED_IP
                )
            })
        };
        match why {
            Some(why) => {
                out.insert(key.clone(), why);
            }
            None => {
                links.insert(id.interface.clone());
                macs.insert(id.mac);
                if !id.client_id.is_empty() {
                    clients.insert(id.client_id.clone());
                }
                if let Some(ip) = id.requested_ip {
                    addresses.insert(ip);
                }
            }
        }
    }
    out
}

/// The address a primary of ours stands for, from what the tenant cannot
/// write: the address its holder reports BOUND (the newest truth), else
/// the one its status publishes (ours alone writes it). Only when neither
/// exists does `kube-vip.io/requestedIP` count, which a Service's owner may
/// blank or change at will (issue #29): the takeover guard asks the LAN
/// for this address, so a blanked annotation must not let a new holder
/// bind beside an old one that still answers for it.
pub(super) fn known_address(
    pass: &Pass<'_>,
    s: &ServiceIn,
    id: &AddressIdentity,
) -> Option<Ipv4Addr> {
    let service = s.key.to_string();
    let reported = pass
        .specs
        .holders_of(&s.uid)
        .into_iter()
        .filter_map(|(node, _)| pass.nodes.live.get(node.as_str()).copied())
        .find_map(|n| n.bound_address(&service, &id.interface))
        .and_then(|ip| ip.parse().ok());
    reported
        .or_else(|| s.first_ip().and_then(|ip| ip.parse().ok()))
        .or(id.requested_ip)
}

/// The identity a primary asks under, or why it cannot be served (the
/// Warning's reason and message): unreadable annotations, or a MAC that is
/// another host's on the LAN.
pub(super) fn checked_identity(
    pass: &Pass<'_>,
    s: &ServiceIn,
) -> Result<AddressIdentity, (&'static str, String)> {
    let id = hna_contract::AddressIdentity::of(&s.uid, &s.annotations)
        .map_err(|e| (reason::INVALID, e.to_string()))?;
    match lan_mac_refusal(pass, &id) {
        Some(why) => Err((reason::MAC_REFUSED, why)),
        None => Ok(id),
    }
}

/// Why a Service may not use `id.mac`, if it may not: it is a MAC a node
/// reports as one of its network cards or as its default gateway's
/// (`status.nicMacs`, `status.gatewayMac`). A macvlan with it would make
/// the LAN's switches send that host's traffic to the Service's holder
/// (issue #29). Pinning a MAC with `kube-vip.io/hwaddr` stays a feature
/// (DHCP reservations by MAC); only MACs of other hosts are refused.
fn lan_mac_refusal(pass: &Pass<'_>, id: &AddressIdentity) -> Option<String> {
    let mac = hna_contract::mac::format(&id.mac);
    let whose = pass.nodes.lan_macs.get(&mac)?;
    Some(format!(
        "{}: MAC {mac} is {whose}: a Service's link with it would take that host's traffic from the LAN's switches; remove the annotation to get a MAC derived from the Service's UID, or choose one that no host on the VM network uses",
        kube_vip::HWADDR
    ))
}

/// Why a holder of the Service refuses `id.mac`, if one does: it saw the
/// MAC used by another host on its LAN (its neighbour table, which the
/// controller does not see) or by itself, and keeps what it serves under
/// the MAC it has (`node_object::MAC_REFUSED_BY_HOLDER`).
pub(super) fn holder_mac_refusal(
    pass: &Pass<'_>,
    s: &ServiceIn,
    id: &AddressIdentity,
) -> Option<String> {
    let service = s.key.to_string();
    let mac = hna_contract::mac::format(&id.mac);
    pass.specs
        .holders_of(&s.uid)
        .into_iter()
        .filter(|(_, a)| !a.release && a.mac == mac)
        .find_map(|(node, _)| {
            let n = pass.nodes.live.get(node.as_str())?;
            let why = n.status.leases.iter().find_map(|l| {
                (l.service == service && l.interface == id.interface)
                    .then_some(l.message.as_deref()?)?
                    .strip_prefix(hna_contract::node_object::MAC_REFUSED_BY_HOLDER)
            })?;
            Some(format!(
                "{}: node {node} refuses MAC {mac}: {why}. Remove the annotation to get a MAC derived from the Service's UID, or choose one that no host on the VM network uses",
                kube_vip::HWADDR
            ))
        })
}

/// What a Service's own holder should carry.
pub(super) fn assignment_of(
    s: &ServiceIn,
    id: &AddressIdentity,
    uplink: Option<String>,
) -> Assignment {
    Assignment {
        service: s.key.to_string(),
        uid: s.uid.clone(),
        interface: id.interface.clone(),
        mac: hna_contract::mac::format(&id.mac),
        client_id: id.client_id.iter().map(|b| format!("{b:02x}")).collect(),
        hostname: id.hostname.clone(),
        requested_ip: id.requested_ip.map(|ip| ip.to_string()),
        uplink,
        release: false,
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    use crate::reconcile::reason;
    use crate::reconcile::sim::{Sim, dhcp, in_namespace, key, uid};
    use hna_contract::kube_vip;

    /// Issue #29: a tenant names another Service's address in its own
    /// Service's `kube-vip.io/requestedIP`, the older of the two or the
    /// newer: neither address moves, the victim stays served, and the
    /// controller writes the record back.
    #[test]
    fn a_requested_ip_naming_another_services_address_takes_nothing() {
        for attacker_older in [true, false] {
            let mut sim = Sim::new(&["n1", "n2"]);
            let (a, v) = ("attacker", "victim");
            for (name, created) in [
                (a, if attacker_older { 1 } else { 2 }),
                (v, if attacker_older { 2 } else { 1 }),
            ] {
                let mut s = dhcp(name, &[80]);
                s.created = created;
                sim.services.push(s);
            }
            sim.settle();
            let ip = |sim: &Sim, n: &str| sim.svc(n).ingress[0].ip.clone();
            let (ip_a, ip_v) = (ip(&sim, a), ip(&sim, v));
            let holder_v = sim.holders(v);
            sim.svc_mut(a)
                .annotations
                .insert(kube_vip::REQUESTED_IP.into(), ip_v.clone());
            let plans = sim.settle();
            assert_eq!(
                (ip(&sim, a), ip(&sim, v)),
                (ip_a.clone(), ip_v.clone()),
                "attacker older: {attacker_older}: {:?}",
                crate::reconcile::sim::events(&plans)
            );
            assert_eq!(sim.holders(v), holder_v, "attacker older: {attacker_older}");
            assert_eq!(
                sim.svc(a).annotations.get(kube_vip::REQUESTED_IP),
                Some(&ip_a),
                "attacker older: {attacker_older}: the record written back"
            );
        }
    }

    /// Issue #29: the address a new holder asks for, and that its
    /// takeover guard asks the LAN about, is the one the Service holds,
    /// whatever its owner does to `kube-vip.io/requestedIP`: blanked or
    /// changed to another address in the same pass in which its holder dies.
    #[test]
    fn a_new_holder_asks_for_the_held_address_whatever_requested_ip_says() {
        for tampered in [None, Some("10.77.0.9")] {
            let mut sim = Sim::new(&["n1", "n2"]);
            sim.services.push(dhcp("web", &[80]));
            sim.settle();
            let (old, a) = sim.holders("web").remove(0);
            let held = a.requested_ip.clone().expect("written back");
            let annotations = &mut sim.svc_mut("web").annotations;
            match tampered {
                None => annotations.remove(kube_vip::REQUESTED_IP),
                Some(ip) => annotations.insert(kube_vip::REQUESTED_IP.into(), ip.into()),
            };
            // One pass: the new holder's assignment, and what it asks for.
            let asked_after_one_pass = |sim: &mut Sim| {
                let plan = sim.plan();
                sim.apply(&plan);
                let moved: Vec<_> = sim
                    .holders("web")
                    .into_iter()
                    .filter(|(n, a)| *n != old && !a.release)
                    .collect();
                assert_eq!(moved.len(), 1, "{tampered:?}: {:?}", sim.holders("web"));
                moved[0].1.requested_ip.clone()
            };
            sim.up.remove(&old);
            sim.agents();
            let mut sim2 = sim.clone();
            assert_eq!(
                asked_after_one_pass(&mut sim),
                Some(held.clone()),
                "{tampered:?}"
            );
            // Even with the status gone too (never written, or cleared),
            // the dead holder's last BOUND report still names it.
            sim2.svc_mut("web").ingress.clear();
            assert_eq!(asked_after_one_pass(&mut sim2), Some(held.clone()));
        }
    }

    /// Issue #29: a `kube-vip.io/hwaddr` naming a node's network card or
    /// the gateway is refused with an Event naming the annotation; a
    /// served Service whose MAC is changed to one keeps running as it was.
    #[test]
    fn a_mac_of_another_host_on_the_lan_is_refused_and_nothing_served_changes() {
        let mut sim = Sim::new(&["n1", "n2"]);
        for o in &mut sim.objects {
            let last = if o.name == "n1" { "01" } else { "02" };
            o.status.nic_macs = vec![format!("52:54:00:00:00:{last}")];
            o.status.gateway_mac = Some("0a:11:22:33:44:55".into());
        }
        let mut thief = dhcp("thief", &[80]);
        thief
            .annotations
            .insert(kube_vip::HWADDR.into(), "52:54:00:00:00:02".into());
        sim.services.push(thief);
        sim.services.push(dhcp("web", &[80]));
        let plans = sim.settle();
        let told = crate::reconcile::sim::events(&plans);
        let (_, why) = told
            .iter()
            .find(|(r, _)| *r == reason::MAC_REFUSED)
            .expect("refused with an Event");
        assert!(
            why.contains(kube_vip::HWADDR) && why.contains("node n2"),
            "{why}"
        );
        assert!(sim.holders("thief").is_empty());
        assert!(sim.svc("thief").ingress.is_empty() && sim.svc("thief").finalizers.is_empty());

        let before = sim.holders("web");
        assert_eq!(before.len(), 1);
        sim.svc_mut("web")
            .annotations
            .insert(kube_vip::HWADDR.into(), "0a:11:22:33:44:55".into());
        let plans = sim.settle();
        assert!(
            crate::reconcile::sim::events(&plans)
                .iter()
                .any(|(r, m)| *r == reason::MAC_REFUSED && m.contains("default gateway")),
            "{plans:?}"
        );
        assert_eq!(sim.holders("web"), before, "what runs is kept");
    }

    /// Issue #49: a `kube-vip.io/hwaddr` naming the DHCP server's MAC, as a
    /// node saw its replies come from it (the server is not the gateway),
    /// is refused with an Event that says whose it is.
    #[test]
    fn the_dhcp_servers_mac_is_refused() {
        let mut sim = Sim::new(&["n1", "n2"]);
        for o in &mut sim.objects {
            o.status.gateway_mac = Some("0a:11:22:33:44:55".into());
        }
        sim.objects[1].status.dhcp_server_macs = vec!["0a:11:22:33:44:99".into()];
        let mut thief = dhcp("thief", &[80]);
        thief
            .annotations
            .insert(kube_vip::HWADDR.into(), "0a:11:22:33:44:99".into());
        sim.services.push(thief);
        let plans = sim.settle();
        let told = crate::reconcile::sim::events(&plans);
        let (_, why) = told
            .iter()
            .find(|(r, _)| *r == reason::MAC_REFUSED)
            .expect("refused with an Event");
        assert!(
            why.contains("DHCP server") && why.contains("node n2"),
            "{why}"
        );
        assert!(sim.holders("thief").is_empty());
    }

    /// Issue #29: a MAC the controller cannot know to be taken (a LAN
    /// host's that is no node and not the gateway) is refused by the
    /// holder, which sees it in its ARP table and keeps serving under the
    /// MAC it has; the Service's owner is told with an Event naming the
    /// annotation.
    #[test]
    fn a_mac_a_holder_refuses_is_told_with_an_event_naming_the_annotation() {
        let mut sim = Sim::new(&["n1", "n2"]);
        sim.services.push(dhcp("web", &[80]));
        sim.settle();
        let (node, _) = sim.holders("web")[0].clone();
        sim.svc_mut("web")
            .annotations
            .insert(kube_vip::HWADDR.into(), "02:00:00:00:00:96".into());
        sim.settle();
        assert_eq!(sim.holders("web")[0].1.mac, "02:00:00:00:00:96");
        let o = sim.objects.iter_mut().find(|o| o.name == node).unwrap();
        let l = o
            .status
            .leases
            .iter_mut()
            .find(|l| l.service == "default/web")
            .unwrap();
        l.message = Some(format!(
            "{}MAC 02:00:00:00:00:96 is another host's on the LAN (this node's ARP table: 10.77.0.150 on eth0): no macvlan is made with it; the address stays on the MAC it has",
            hna_contract::node_object::MAC_REFUSED_BY_HOLDER
        ));
        let told = crate::reconcile::sim::events(&[sim.plan()]);
        assert!(
            told.iter().any(|(r, m)| *r == reason::MAC_REFUSED
                && m.contains(kube_vip::HWADDR)
                && m.contains(&format!("node {node}"))
                && m.contains("10.77.0.150")),
            "{told:?}"
        );
    }

    #[test]
    fn a_mac_client_or_address_in_use_is_refused_and_the_first_keeps_it() {
        let mut sim = Sim::new(&["n1", "n2"]);
        let mut web = dhcp("web", &[80]);
        web.created = 100;
        sim.services.push(web);
        sim.settle();
        let mac = sim.holders("web")[0].1.mac.clone();
        let ip = sim.svc("web").ingress[0].ip.clone();

        // A newer Service copies web's MAC (kube-vip's record), another
        // its address, and two newcomers one hostname.
        let mut copy_mac = in_namespace(dhcp("copy-mac", &[80]), "team-a");
        copy_mac.created = 200;
        copy_mac
            .annotations
            .insert(kube_vip::HWADDR.into(), mac.clone());
        let mut copy_ip = in_namespace(dhcp("copy-ip", &[80]), "team-a");
        copy_ip.created = 300;
        copy_ip
            .annotations
            .insert(kube_vip::REQUESTED_IP.into(), ip.clone());
        let mut host_a = dhcp("host-a", &[80]);
        host_a.created = 400;
        host_a.annotations.insert(
            kube_vip::LOADBALANCER_HOSTNAME.into(),
            "lb.example.com".into(),
        );
        let mut host_b = host_a.clone();
        host_b.key.name = "host-b".into();
        host_b.uid = uid("host-b");
        host_b.created = 500;
        sim.services.extend([copy_mac, copy_ip, host_a, host_b]);
        let plans = sim.settle();
        let refused: Vec<(String, String)> = plans
            .iter()
            .flat_map(|p| &p.events)
            .filter(|e| e.reason == reason::IDENTITY_IN_USE)
            .map(|e| (e.service.name.clone(), e.message.clone()))
            .collect();
        let names: BTreeSet<&str> = refused.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(
            names,
            ["copy-ip", "copy-mac", "host-b"].into(),
            "{refused:?}"
        );
        assert!(
            refused.iter().all(|(_, m)| !m.contains("web")),
            "{refused:?}"
        );
        for name in ["copy-mac", "copy-ip", "host-b"] {
            let s = sim.services.iter().find(|s| s.key.name == name).unwrap();
            assert!(s.ingress.is_empty() && s.finalizers.is_empty(), "{name}");
            assert!(sim.holders(name).is_empty(), "{name}");
        }
        assert_eq!(sim.holders("web")[0].1.mac, mac, "web keeps its MAC");
        assert_eq!(sim.svc("web").ingress[0].ip, ip);
        assert_eq!(sim.holders("host-a").len(), 1);

        // Two UIDs with the same first 8 hex digits: one link name.
        let mut twin = dhcp("twin", &[80]);
        twin.uid = format!("{}-ffff-4fff-8fff-ffffffffffff", &sim.svc("web").uid[..8]);
        twin.created = 600;
        sim.services.push(twin);
        let plans = sim.settle();
        assert!(
            plans
                .iter()
                .flat_map(|p| &p.events)
                .any(|e| e.service == key("twin")
                    && e.reason == reason::IDENTITY_IN_USE
                    && e.message.contains("link name")),
            "{plans:?}"
        );
        assert!(sim.holders("twin").is_empty());
        sim.services.retain(|s| s.key.name != "twin");

        // Deleting the copy releases nothing of web's.
        sim.services.retain(|s| s.key.name != "copy-mac");
        sim.settle();
        assert_eq!(sim.holders("web")[0].1.mac, mac);
        assert!(!sim.holders("web")[0].1.release);
    }
}
