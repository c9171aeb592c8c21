//! Which Services are ours: a DHCP-mode primary of our class is taken on
//! with a finalizer; one that is no longer ours (another class, no longer
//! a LoadBalancer) or that opts out is released and handed over; a change
//! of IPAM mode is refused, and what cannot be made sense of is left
//! running as it is.

use crate::networks::{self, NoUplink};
use hna_contract::node_object::Assignment;
use hna_contract::{self, Selection, harvester, kube_vip};

use super::events::{EventType, reason};
use super::identity::{checked_identity, holder_mac_refusal, known_address};
use super::pass::Pass;
use super::plan::Write;
use super::release::{release_holders, with_lingering};
use super::status::families_served;
use super::world::ServiceIn;

/// A Service not being deleted: a primary to place, a refusal, a handover,
/// or nothing (a secondary waits for the primaries).
pub(super) fn admit<'a>(pass: &mut Pass<'a>, s: &'a ServiceIn) {
    let selection = &pass.selections[&s.key];
    let ours = s.has_our_finalizer();
    let holders = pass.specs.holders_of(&s.uid);

    if matches!(selection, Selection::Primary) {
        // Refused, what runs is kept, as for any Service that cannot be
        // made sense of (the primary family is immutable, so an
        // IPv6-only Service was never served).
        if !families_served(s, &mut pass.events, &mut pass.summary.refused) {
            return;
        }
    }
    match selection {
        Selection::Primary if !ours => take_on(pass, s),
        // What runs is kept while the Service cannot be made sense of.
        Selection::Primary => match checked_identity(pass, s) {
            Ok(mut id) => {
                if let Some(why) = holder_mac_refusal(pass, s, &id) {
                    pass.events
                        .tell(s, EventType::Warning, reason::MAC_REFUSED, why);
                }
                id.requested_ip = known_address(pass, s, &id);
                match networks::uplink_of(&s.annotations, pass.world.networks, &pass.nodes.uplinks)
                {
                    Ok(uplink) => pass.needs.push((s, id, uplink)),
                    Err(NoUplink::Wait) => pass.summary.pending += 1,
                    Err(NoUplink::Refused(why)) => {
                        pass.summary.refused += 1;
                        pass.events
                            .tell(s, EventType::Warning, reason::NETWORK_UNRESOLVED, why);
                    }
                }
            }
            Err((why, message)) => {
                pass.summary.refused += 1;
                pass.events.tell(s, EventType::Warning, why, message);
            }
        },
        Selection::Invalid(e) => {
            pass.summary.refused += 1;
            pass.events
                .tell(s, EventType::Warning, reason::INVALID, e.clone());
        }
        Selection::Secondary { .. } => {} // in `sharing`, once primaries are decided
        Selection::PoolMode if ours => {
            pass.summary.refused += 1;
            pass.events.tell(
                s,
                EventType::Warning,
                reason::IPAM_CHANGE_REFUSED,
                format!(
                    "{} changed to pool mode: not supported; keeping the DHCP address{}",
                    harvester::IPAM,
                    s.first_ip().map(|ip| format!(" {ip}")).unwrap_or_default()
                ),
            );
        }
        // Handed over already; only DHCPRELEASEs owed by holders that
        // were down are left (see `release_holders`).
        Selection::NotOurs(_) | Selection::PoolMode | Selection::OptedOut
            if !ours && !holders.is_empty() && holders.iter().all(|(_, a)| a.release) =>
        {
            release_holders(
                s,
                &holders,
                &pass.nodes.live,
                &mut pass.specs,
                &mut pass.events,
            );
        }
        Selection::NotOurs(_) | Selection::PoolMode => {
            let why = match selection {
                Selection::NotOurs(why) => why,
                _ => "pool mode",
            };
            if ours || holders.iter().any(|(_, a)| !a.release) {
                // Released at the DHCP server, the address may go to
                // anyone, our next Service too, which could then never be
                // published beside a status that still claims it: the
                // status is cleared (kube-vip's record stays, so its next
                // server asks for the same address). A pool-mode status
                // is Harvester's to keep.
                let clear_status = !matches!(selection, Selection::PoolMode);
                let message = format!(
                    "{why}: address released and handed over{}",
                    if clear_status {
                        "; status cleared, kube-vip.io annotations kept, so its next server asks for the same address"
                    } else {
                        ""
                    }
                );
                hand_over(pass, s, &holders, clear_status, message);
            }
        }
        Selection::OptedOut => {
            if ours || holders.iter().any(|(_, a)| !a.release) {
                // Released at the DHCP server, the address may go to
                // anyone: the status no longer claims it. kube-vip's
                // record stays, so kube-vip asks for the same one.
                let message = format!(
                    "{}: address released and handed over; status cleared, kube-vip.io annotations kept, so kube-vip asks for the same address",
                    hna_contract::IGNORE
                );
                hand_over(pass, s, &holders, true, message);
            }
        }
    }
}

/// A new primary: taken on, unless its address came from Harvester's pool
/// or it cannot be made sense of.
fn take_on<'a>(pass: &mut Pass<'a>, s: &'a ServiceIn) {
    // A status address we did not record: Harvester's pool gave it.
    let pool_address = s
        .first_ip()
        .filter(|ip| s.annotations.get(kube_vip::REQUESTED_IP).map(|v| v.trim()) != Some(*ip));
    if let Some(ip) = pool_address {
        pass.summary.refused += 1;
        pass.events.tell(
            s,
            EventType::Warning,
            reason::IPAM_CHANGE_REFUSED,
            format!(
                "{ip} was allocated by Harvester's pool: changing the IPAM mode from pool to dhcp is not supported; recreate the Service to use DHCP"
            ),
        );
    } else {
        let identity = checked_identity(pass, s);
        match identity.map(|id| {
            (
                id,
                networks::uplink_of(&s.annotations, pass.world.networks, &pass.nodes.uplinks),
            )
        }) {
            Err((why, message)) => {
                pass.summary.refused += 1;
                pass.events.tell(s, EventType::Warning, why, message);
            }
            Ok((_, Err(NoUplink::Wait))) => pass.summary.pending += 1,
            Ok((_, Err(NoUplink::Refused(why)))) => {
                pass.summary.refused += 1;
                pass.events
                    .tell(s, EventType::Warning, reason::NETWORK_UNRESOLVED, why);
            }
            // The finalizer and the holder in one pass: the
            // finalizer is written first, and a failure there
            // holds back every later write for the Service (the
            // writer's rule; a node's spec goes without its
            // entries, so others moved there in the same pass
            // are not held back), so nothing is ever assigned
            // without it. Not waiting for its echo saves a
            // round trip on the way to an address.
            Ok((id, Ok(uplink))) => {
                pass.add_finalizers.push(Write::AddFinalizer(s.key.clone()));
                pass.needs.push((s, id, uplink));
            }
        }
    }
}

/// Released, not just dropped: whoever serves the Service next (kube-vip
/// with its option 50, or another class) finds the address free at the
/// server. Then our finalizer goes, and the status with it where
/// `clear_status`.
fn hand_over(
    pass: &mut Pass<'_>,
    s: &ServiceIn,
    holders: &[(String, Assignment)],
    clear_status: bool,
    message: String,
) {
    let holders = with_lingering(s, holders.to_vec(), &pass.nodes.live);
    if release_holders(
        s,
        &holders,
        &pass.nodes.live,
        &mut pass.specs,
        &mut pass.events,
    ) {
        return;
    }
    if clear_status && !s.ingress.is_empty() {
        pass.statuses.push(Write::ServiceStatus {
            service: s.key.clone(),
            ingress: Vec::new(),
            assigned: None,
        });
        clear_secondaries(pass, s);
    }
    if s.has_our_finalizer() {
        pass.remove_finalizers
            .push(Write::RemoveFinalizer(s.key.clone()));
    }
    pass.events
        .tell(s, EventType::Normal, reason::HANDED_OVER, message);
}

/// The Services that share `primary`'s address (its secondaries, opted
/// out with it or not) lose it with the primary's status: released, the
/// address may go to anyone, and whoever serves them next writes it
/// again. Another class's are never touched.
fn clear_secondaries(pass: &mut Pass<'_>, primary: &ServiceIn) {
    let Some(ip) = primary.first_ip() else {
        return;
    };
    let secondaries: Vec<&ServiceIn> = pass
        .services
        .iter()
        .copied()
        .filter(|t| {
            !t.deleting
                && t.key != primary.key
                && t.classless_or(&pass.world.classes.class)
                && t.annotations
                    .get(harvester::PRIMARY_SERVICE)
                    .and_then(|v| hna_contract::parse_service_key(v))
                    .is_some_and(|k| k == primary.key)
                && t.first_ip() == Some(ip)
        })
        .collect();
    for t in secondaries {
        pass.statuses.push(Write::ServiceStatus {
            service: t.key.clone(),
            ingress: Vec::new(),
            assigned: None,
        });
        pass.events.tell(
            t,
            EventType::Normal,
            reason::SHARING_ENDED,
            format!(
                "{ip} handed over with its primary {}/{}: status cleared",
                primary.key.namespace, primary.key.name
            ),
        );
    }
}

#[cfg(test)]
mod tests {
    use crate::networks::NetworkMap;
    use crate::reconcile::sim::{Sim, dhcp, events, key, port, reasons, secondary};
    use crate::reconcile::{Ingress, reason};
    use hna_contract::{self, ClassPolicy, harvester, kube_vip};

    #[test]
    fn ipam_mode_changes_are_refused_and_change_nothing() {
        let mut sim = Sim::new(&["n1"]);
        sim.services.push(dhcp("web", &[80]));
        sim.settle();
        let before = sim.clone();
        // dhcp -> pool: the running address stays.
        sim.svc_mut("web")
            .annotations
            .insert(harvester::IPAM.into(), "pool".into());
        let p = sim.plan();
        assert!(p.writes.is_empty(), "{p:?}");
        assert_eq!(
            reasons(std::slice::from_ref(&p)),
            vec![reason::IPAM_CHANGE_REFUSED]
        );
        assert_eq!(sim.holders("web"), before.holders("web"));

        // pool -> dhcp: an address from Harvester's pool, never recorded by us.
        let mut old = dhcp("old", &[80]);
        old.ingress = vec![Ingress {
            ip: "10.0.0.9".into(),
            ip_mode: None,
            ports: vec![port(80)],
        }];
        sim.services.push(old);
        sim.svc_mut("web")
            .annotations
            .insert(harvester::IPAM.into(), "dhcp".into());
        let p = sim.plan();
        assert!(p.writes.is_empty(), "{p:?}");
        assert!(
            p.events
                .iter()
                .any(|e| e.service == key("old") && e.reason == reason::IPAM_CHANGE_REFUSED),
            "{p:?}"
        );

        // But a Service kube-vip served (status == its requestedIP) moves to us.
        let mut migrated = dhcp("migrated", &[80]);
        migrated.ingress = vec![Ingress {
            ip: "10.77.0.200".into(),
            ip_mode: None,
            ports: vec![port(80)],
        }];
        migrated
            .annotations
            .insert(kube_vip::REQUESTED_IP.into(), "10.77.0.200".into());
        migrated
            .annotations
            .insert(kube_vip::HWADDR.into(), "00:00:6c:ab:cd:ef".into());
        sim.services.push(migrated);
        sim.settle();
        let (_, a) = &sim.holders("migrated")[0];
        assert_eq!(a.requested_ip.as_deref(), Some("10.77.0.200"));
        assert_eq!(a.mac, "00:00:6c:ab:cd:ef", "kube-vip's MAC kept");
        assert_eq!(sim.svc("migrated").ingress[0].ip, "10.77.0.200");
    }

    #[test]
    fn opting_out_releases_and_keeps_the_record_leaving_lb_clears_status() {
        let mut sim = Sim::new(&["n1"]);
        sim.services.push(dhcp("web", &[80]));
        sim.services.push(dhcp("gone", &[80]));
        sim.settle();
        sim.svc_mut("web")
            .annotations
            .insert(hna_contract::IGNORE.into(), "true".into());
        sim.svc_mut("gone").type_ = "ClusterIP".into();
        let plans = sim.settle();
        for name in ["web", "gone"] {
            assert!(sim.holders(name).is_empty(), "{name}: assignment removed");
            assert!(
                sim.svc(name).finalizers.is_empty(),
                "{name}: finalizer removed"
            );
        }
        assert!(
            sim.given.is_empty(),
            "handover releases, so the next implementation finds the address free"
        );
        let web = sim.svc("web");
        assert!(web.ingress.is_empty(), "a released address is not claimed");
        assert!(
            web.annotations.contains_key(kube_vip::REQUESTED_IP)
                && web.annotations.contains_key(kube_vip::HWADDR),
            "opt-out keeps kube-vip's record"
        );
        assert!(
            sim.svc("gone").ingress.is_empty(),
            "not a LoadBalancer: no ingress"
        );
        assert_eq!(
            reasons(&plans),
            vec![
                reason::RELEASING,
                reason::RELEASING,
                reason::HANDED_OVER,
                reason::HANDED_OVER
            ]
        );
    }

    #[test]
    fn a_primary_handed_over_takes_its_secondaries_status_with_it() {
        let mut sim = Sim::new(&["n1"]);
        sim.services.push(dhcp("web", &[80]));
        sim.services.push(secondary("web-extra", "web", &[81]));
        sim.services.push(secondary("web-opted-out", "web", &[82]));
        sim.settle();
        let ip = sim.svc("web").ingress[0].ip.clone();
        for name in ["web-extra", "web-opted-out"] {
            assert_eq!(sim.svc(name).ingress[0].ip, ip, "{name} shares");
        }
        // The migration back to kube-vip: every Service opted out, or only
        // the primary.
        for name in ["web", "web-opted-out"] {
            sim.svc_mut(name)
                .annotations
                .insert(hna_contract::IGNORE.into(), "true".into());
        }
        let plans = sim.settle();
        for name in ["web", "web-extra", "web-opted-out"] {
            assert!(
                sim.svc(name).ingress.is_empty(),
                "{name}: a released address is not claimed"
            );
        }
        let told = events(&plans);
        assert_eq!(
            told.iter()
                .filter(|(r, m)| *r == reason::SHARING_ENDED && m.contains(&ip))
                .count(),
            2,
            "{told:?}"
        );
    }

    #[test]
    fn handing_over_from_a_down_holder_does_not_wait_for_it() {
        let mut sim = Sim::new(&["n1"]);
        sim.services.push(dhcp("web", &[80]));
        sim.settle();
        sim.up.remove("n1");
        sim.svc_mut("web")
            .annotations
            .insert(hna_contract::IGNORE.into(), "true".into());
        let plans = sim.settle();
        assert!(sim.svc("web").finalizers.is_empty());
        assert_eq!(
            reasons(&plans),
            vec![reason::RELEASE_DEFERRED, reason::HANDED_OVER]
        );
        // It still owes the DHCPRELEASE, and sends it when it is back.
        assert!(sim.holders("web")[0].1.release);
        sim.up.insert("n1".into());
        sim.settle();
        assert!(sim.holders("web").is_empty());
        assert!(sim.given.is_empty(), "DHCPRELEASE sent");
    }

    #[test]
    fn a_named_network_chooses_the_uplink_through_the_cloud_providers_map() {
        let mut sim = Sim::new(&["n1"]);
        let mut web = dhcp("web", &[80]);
        web.annotations
            .insert(harvester::NETWORK.into(), "default/net123".into());
        sim.services.push(web);
        let mut lost = dhcp("lost", &[80]);
        lost.annotations
            .insert(harvester::NETWORK.into(), "default/nowhere".into());
        sim.services.push(lost);
        let plans = sim.settle();
        assert_eq!(sim.holders("web")[0].1.uplink.as_deref(), Some("enp2s0"));
        // Refused: no finalizer, no holder, a Warning that says the fix.
        assert!(sim.holders("lost").is_empty());
        assert!(sim.svc("lost").finalizers.is_empty());
        let told = events(&plans);
        assert!(
            told.iter().any(|(r, m)| *r == reason::NETWORK_UNRESOLVED
                && m.contains("default/nowhere")
                && m.contains(kube_vip::SERVICE_INTERFACE)),
            "{told:?}"
        );

        // The map gone or not yet read: what runs stays as it is.
        let before = sim.holders("web");
        for map in [NetworkMap::Unknown, NetworkMap::Missing] {
            sim.networks = map;
            let p = sim.plan();
            assert!(p.writes.is_empty(), "{p:?}");
            sim.settle();
            assert_eq!(sim.holders("web"), before);
        }
        // Before the map is read, a new Service naming a network waits
        // without a refusal.
        sim.networks = NetworkMap::Unknown;
        let mut new = dhcp("new", &[80]);
        new.annotations
            .insert(harvester::NETWORK.into(), "default/net123".into());
        sim.services.push(new);
        let p = sim.plan();
        assert!(p.writes.is_empty() && p.events.is_empty(), "{p:?}");
        assert!(p.summary.pending >= 1);
    }

    #[test]
    fn invalid_annotations_leave_the_running_state_alone() {
        let mut sim = Sim::new(&["n1", "n2"]);
        sim.services.push(dhcp("web", &[80]));
        sim.settle();
        let before = sim.holders("web");
        sim.svc_mut("web")
            .annotations
            .insert(kube_vip::HWADDR.into(), "not-a-mac".into());
        sim.up.remove(&before[0].0); // even its holder dying moves nothing
        let plans = sim.settle();
        assert_eq!(plans.len(), 1, "{plans:?}");
        assert_eq!(sim.holders("web"), before);
        assert_eq!(reasons(&plans), vec![reason::INVALID]);
        let mut bad = secondary("bad", "web", &[81]);
        bad.annotations
            .insert(harvester::PRIMARY_SERVICE.into(), "no-slash".into());
        sim.services.push(bad);
        let p = sim.plan();
        assert!(p.writes.is_empty());
        assert!(
            p.events
                .iter()
                .any(|e| e.service == key("bad") && e.reason == reason::INVALID)
        );
    }

    #[test]
    fn another_class_is_never_written_nor_told_about() {
        let mut sim = Sim::new(&["n1"]);
        let mut other = dhcp("other", &[80]);
        other.load_balancer_class = Some("example.com/other".into());
        other
            .annotations
            .insert(kube_vip::LOADBALANCER_IPS.into(), "0.0.0.0".into());
        sim.services.push(other.clone());
        let plans = sim.settle();
        assert!(plans.iter().all(|p| p.writes.is_empty()), "{plans:?}");
        assert!(events(&plans).is_empty(), "{plans:?}");
        assert_eq!(sim.svc("other"), &other);
        assert!(sim.holders("other").is_empty());
    }

    const NAMED_CLASS: &str = "example.com/dhcp";

    fn serve_only_the_named_class(sim: &mut Sim) {
        sim.classes = ClassPolicy {
            class: NAMED_CLASS.into(),
            classless: false,
        };
    }

    /// A Service of [`NAMED_CLASS`], with no annotation.
    fn of_the_named_class(name: &str) -> super::ServiceIn {
        let mut s = dhcp(name, &[80]);
        s.load_balancer_class = Some(NAMED_CLASS.into());
        s.annotations.clear();
        s
    }

    #[test]
    fn a_named_class_serves_that_class_and_class_less_ones_only_when_asked() {
        let mut sim = Sim::new(&["n1"]);
        serve_only_the_named_class(&mut sim);
        sim.services.push(of_the_named_class("named"));
        sim.services.push(dhcp("classless", &[80]));
        sim.settle();
        assert_eq!(sim.holders("named").len(), 1);
        assert!(!sim.svc("named").ingress.is_empty());
        assert!(sim.holders("classless").is_empty());
        assert!(sim.svc("classless").finalizers.is_empty());
        sim.classes.classless = true;
        sim.settle();
        assert_eq!(sim.holders("classless").len(), 1);
    }

    /// Found by the rig under load: the address a class-less Service was
    /// handed over with went to the next Service from the DHCP server,
    /// which was then never published beside the status still claiming it.
    #[test]
    fn an_address_handed_over_to_another_class_can_serve_the_next_service() {
        let mut sim = Sim::new(&["n1"]);
        sim.services.push(dhcp("classless", &[80]));
        sim.settle();
        let released = sim.svc("classless").first_ip().unwrap().to_string();
        serve_only_the_named_class(&mut sim);
        sim.services.push(of_the_named_class("named"));
        // The DHCP server gives the released address again.
        sim.next_ip -= 1;
        let plans = sim.settle();
        assert_eq!(
            sim.svc("named").first_ip(),
            Some(released.as_str()),
            "{plans:?}"
        );
        assert!(sim.holders("classless").is_empty());
        assert!(sim.svc("classless").ingress.is_empty(), "{plans:?}");
        assert_eq!(
            sim.svc("classless").annotations.get(kube_vip::REQUESTED_IP),
            Some(&released),
            "kube-vip's record is kept"
        );
        assert!(reasons(&plans).contains(&reason::HANDED_OVER));
    }
}
