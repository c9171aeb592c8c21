//! Secondaries: a Service naming a primary shares its address, ports
//! apart, within its namespace or with the primary's consent; one that
//! shows an address we serve without sharing it loses it.

use std::collections::{BTreeMap, BTreeSet};

use hna_contract::{self, Selection, ServiceKey};

use super::events::{EventType, reason};
use super::pass::Pass;
use super::plan::Write;
use super::status::{families_served, status_write};
use super::world::{Port, ServiceIn};

/// Secondaries share their primary's address, ports apart. The Services
/// that do.
pub(super) fn secondaries<'a>(pass: &mut Pass<'a>) -> BTreeSet<&'a ServiceKey> {
    let mut sharing: BTreeSet<&'a ServiceKey> = BTreeSet::new();
    for (primary, mut secondaries) in sharers(pass) {
        let Some(ip) = pass.primary_ip.get(primary) else {
            continue; // no address yet: nothing to share
        };
        // Those already sharing keep their ports; the rest by name.
        secondaries.sort_by_key(|s| (s.first_ip() != Some(ip.as_str()), s.key.clone()));
        let mut used: BTreeMap<Port, &ServiceKey> = pass.by_key[primary]
            .ports
            .iter()
            .map(|p| (p.clone(), primary))
            .collect();
        for s in secondaries {
            let clash: Vec<String> = s
                .ports
                .iter()
                .filter_map(|p| {
                    used.get(p).map(|who| {
                        // Names of the secondary's own namespace only.
                        if who.namespace == s.key.namespace {
                            format!("{p} (used by {who})")
                        } else {
                            format!("{p} (used by a Service in another namespace)")
                        }
                    })
                })
                .collect();
            if !clash.is_empty() {
                pass.summary.refused += 1;
                pass.events.tell(
                    s,
                    EventType::Warning,
                    reason::PORTS_OVERLAP,
                    format!("cannot share {ip}: port {}", clash.join(", ")),
                );
                continue;
            }
            for p in &s.ports {
                used.insert(p.clone(), &s.key);
            }
            pass.summary.shared += 1;
            sharing.insert(&s.key);
            if let Some(w) = status_write(s, ip, pass.world.ip_mode, pass.world.now) {
                pass.statuses.push(w);
                pass.events.tell(
                    s,
                    EventType::Normal,
                    reason::ADDRESS_SHARED,
                    format!("shares {ip} with {primary}"),
                );
            }
        }
    }
    sharing
}

/// The secondaries that may share each primary's address; the others are
/// refused.
fn sharers<'a>(pass: &mut Pass<'a>) -> BTreeMap<&'a ServiceKey, Vec<&'a ServiceIn>> {
    let mut by_primary: BTreeMap<&'a ServiceKey, Vec<&'a ServiceIn>> = BTreeMap::new();
    for &s in &pass.services {
        if s.deleting {
            continue;
        }
        let Selection::Secondary { primary } = &pass.selections[&s.key] else {
            continue;
        };
        if !families_served(s, &mut pass.events, &mut pass.summary.refused) {
            continue;
        }
        // Across namespaces only with the primary's consent, and a refusal
        // that reads the same whether the primary exists or not: a tenant
        // learns nothing of another namespace's Services by naming them.
        let consented = |p: &&&ServiceIn| {
            hna_contract::shares_with(&p.key.namespace, &p.annotations, &s.key.namespace)
        };
        let Some(p) = pass.by_key.get(primary).filter(consented) else {
            pass.summary.refused += 1;
            pass.events.tell(
                s,
                EventType::Warning,
                reason::PRIMARY_NOT_OURS,
                if primary.namespace == s.key.namespace {
                    format!("primary {primary} does not exist")
                } else {
                    format!(
                        "primary {primary} does not exist or does not share its address with namespace {ns}: sharing across namespaces needs the annotation {} on the primary, naming {ns}, set by the primary's owner",
                        hna_contract::SHARE_WITH,
                        ns = s.key.namespace
                    )
                },
            );
            continue;
        };
        match &pass.selections[&p.key] {
            Selection::Secondary { .. } => {
                pass.summary.refused += 1;
                pass.events.tell(
                    s,
                    EventType::Warning,
                    reason::PRIMARY_IS_SECONDARY,
                    format!("primary {primary} is itself a secondary; name its primary instead"),
                );
            }
            // A deleting primary keeps its address while secondaries share it.
            Selection::Primary if p.has_our_finalizer() => {
                by_primary.entry(&p.key).or_default().push(s);
            }
            _ => {
                pass.summary.refused += 1;
                pass.events.tell(
                    s,
                    EventType::Warning,
                    reason::PRIMARY_NOT_OURS,
                    format!(
                        "primary {primary} is not a DHCP Service served by harvester-node-agent"
                    ),
                );
            }
        }
    }
    by_primary
}

/// A Service that shows an address we serve for another Service, without
/// sharing it (refused, or its primary-service annotation removed),
/// loses it: its status would send clients to ports nobody serves for
/// it. Only class-less ones and our class's: another class is never
/// touched, and Services of ours are the other steps' to decide.
pub(super) fn clear_unshared(pass: &mut Pass<'_>, sharing: &BTreeSet<&ServiceKey>) {
    let served_ips: BTreeSet<&str> = pass.primary_ip.values().map(String::as_str).collect();
    for s in &pass.services {
        let ours_to_clear = !s.deleting
            && !s.has_our_finalizer()
            && !sharing.contains(&s.key)
            && !matches!(pass.selections[&s.key], Selection::Primary)
            && s.classless_or(&pass.world.classes.class)
            && s.first_ip().is_some_and(|ip| served_ips.contains(ip));
        if ours_to_clear {
            pass.statuses.push(Write::ServiceStatus {
                service: s.key.clone(),
                ingress: Vec::new(),
                assigned: None,
            });
            pass.events.tell(
                s,
                EventType::Normal,
                reason::SHARING_ENDED,
                format!(
                    "{} no longer shared with this Service: status cleared",
                    s.first_ip().unwrap_or_default()
                ),
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use crate::reconcile::sim::{
        Sim, dhcp, events, in_namespace, key, ns_key, port, reasons, secondary, uid,
    };
    use crate::reconcile::{IP_MODE_VIP, Ingress, reason};
    use hna_contract::{self, harvester};

    #[test]
    fn secondaries_share_the_primarys_address_unless_refused() {
        let mut sim = Sim::new(&["n1", "n2"]);
        sim.services.push(dhcp("web", &[80]));
        sim.services.push(secondary("api", "web", &[8080]));
        sim.services.push(secondary("clash", "web", &[80]));
        sim.services.push(secondary("chain", "api", &[9000]));
        let mut pool = dhcp("pool", &[80]);
        pool.annotations = [(harvester::IPAM.to_string(), "pool".to_string())].into();
        pool.ingress = vec![Ingress {
            ip: "10.0.0.9".into(),
            ip_mode: None,
            ports: vec![port(80)],
        }];
        sim.services.push(pool);
        sim.services.push(secondary("onpool", "pool", &[81]));
        let plans = sim.settle();
        let ip = sim.svc("web").ingress[0].ip.clone();
        assert_eq!(
            sim.svc("api").ingress,
            vec![Ingress {
                ip: ip.clone(),
                ip_mode: Some(IP_MODE_VIP.into()),
                ports: vec![port(8080)]
            }]
        );
        assert!(sim.holders("api").is_empty(), "no assignment of its own");
        assert!(sim.svc("api").finalizers.is_empty());
        for refused in ["clash", "chain", "onpool"] {
            assert!(sim.svc(refused).ingress.is_empty(), "{refused} untouched");
        }
        let ev = events(&plans);
        for r in [
            reason::PORTS_OVERLAP,
            reason::PRIMARY_IS_SECONDARY,
            reason::PRIMARY_NOT_OURS,
        ] {
            assert!(ev.iter().any(|(x, _)| *x == r), "{r} in {ev:?}");
        }
        assert!(
            ev.iter()
                .any(|(r, m)| *r == reason::PORTS_OVERLAP
                    && m.contains("80/TCP (used by default/web)")),
            "{ev:?}"
        );
        assert_eq!(sim.plan().summary.shared, 1);
        assert_eq!(
            sim.svc("pool").ingress[0].ip,
            "10.0.0.9",
            "pool Service untouched"
        );

        // The primary is deleted while a secondary still shares: refused.
        sim.svc_mut("web").deleting = true;
        let plans = sim.settle();
        assert_eq!(plans.len(), 1, "no writes");
        assert!(reasons(&plans).contains(&reason::SECONDARIES_LIVE));
        assert!(
            !plans[0]
                .events
                .iter()
                .any(|e| e.service == key("api") && e.reason == reason::PRIMARY_NOT_OURS),
            "still its primary: {plans:?}"
        );
        assert_eq!(sim.svc("api").ingress[0].ip, ip, "still shared");
        assert_eq!(sim.svc("web").ingress[0].ip, ip);
        // The secondaries go: now it is released.
        sim.services
            .retain(|s| !matches!(s.key.name.as_str(), "api" | "clash" | "chain"));
        sim.settle();
        assert!(sim.services.iter().all(|s| s.key.name != "web"));
    }

    #[test]
    fn sharing_across_namespaces_needs_consent_and_reveals_nothing() {
        let mut sim = Sim::new(&["n1"]);
        sim.services
            .push(in_namespace(dhcp("web", &[80]), "team-b"));
        let mut thief = in_namespace(secondary("thief", "web", &[8080]), "team-a");
        thief
            .annotations
            .insert(harvester::PRIMARY_SERVICE.into(), "team-b/web".into());
        let mut probe = thief.clone();
        probe.key.name = "probe".into();
        probe.uid = uid("team-a/probe");
        probe
            .annotations
            .insert(harvester::PRIMARY_SERVICE.into(), "team-b/nothing".into());
        sim.services.push(thief.clone());
        sim.services.push(probe);
        let plans = sim.settle();
        let web = sim
            .services
            .iter()
            .find(|s| s.key == ns_key("team-b", "web"))
            .unwrap();
        let ip = web.ingress[0].ip.clone();
        let thief_now = sim
            .services
            .iter()
            .find(|s| s.key == ns_key("team-a", "thief"))
            .unwrap();
        assert!(thief_now.ingress.is_empty(), "no address without consent");
        // One message whether the primary exists or not.
        let said = |name: &str| {
            plans
                .iter()
                .flat_map(|p| &p.events)
                .find(|e| e.service == ns_key("team-a", name))
                .map(|e| (e.reason, e.message.replace("team-b/nothing", "team-b/web")))
                .unwrap()
        };
        assert_eq!(said("thief"), said("probe"));
        assert!(said("thief").1.contains(hna_contract::SHARE_WITH));
        // Nothing is said on the primary, nothing of team-a reaches it.
        assert!(
            plans
                .iter()
                .flat_map(|p| &p.events)
                .filter(|e| e.service.namespace == "team-b")
                .all(|e| !e.message.contains("team-a")),
            "{plans:?}"
        );

        // The primary's owner consents: shared.
        sim.services
            .iter_mut()
            .find(|s| s.key == ns_key("team-b", "web"))
            .unwrap()
            .annotations
            .insert(hna_contract::SHARE_WITH.into(), "team-a".into());
        sim.settle();
        let thief_now = sim
            .services
            .iter()
            .find(|s| s.key == ns_key("team-a", "thief"))
            .unwrap();
        assert_eq!(thief_now.ingress[0].ip, ip);

        // A same-namespace clash names the other Service only when it is of
        // the secondary's namespace.
        let mut clash = in_namespace(secondary("clash", "web", &[8080]), "team-b");
        clash
            .annotations
            .insert(harvester::PRIMARY_SERVICE.into(), "team-b/web".into());
        sim.services.push(clash);
        let plans = sim.settle();
        let clash_said = plans
            .iter()
            .flat_map(|p| &p.events)
            .find(|e| e.service == ns_key("team-b", "clash"))
            .unwrap();
        assert!(
            clash_said
                .message
                .contains("used by a Service in another namespace")
                && !clash_said.message.contains("team-a"),
            "{clash_said:?}"
        );

        // Consent withdrawn: the secondary loses the address, and a
        // secondary of another namespace cannot hold the primary's deletion.
        sim.services
            .iter_mut()
            .find(|s| s.key == ns_key("team-b", "web"))
            .unwrap()
            .annotations
            .remove(hna_contract::SHARE_WITH);
        let plans = sim.settle();
        let thief_now = sim
            .services
            .iter()
            .find(|s| s.key == ns_key("team-a", "thief"))
            .unwrap();
        assert!(thief_now.ingress.is_empty(), "{plans:?}");
        assert!(reasons(&plans).contains(&reason::SHARING_ENDED));
        sim.services.retain(|s| s.key.name != "clash");
        sim.services
            .iter_mut()
            .find(|s| s.key == ns_key("team-b", "web"))
            .unwrap()
            .deleting = true;
        sim.settle();
        assert!(
            sim.services
                .iter()
                .all(|s| s.key != ns_key("team-b", "web")),
            "released although team-a still names it"
        );
    }

    #[test]
    fn a_secondary_whose_annotation_is_removed_loses_the_address() {
        let mut sim = Sim::new(&["n1"]);
        sim.services.push(dhcp("web", &[80]));
        sim.services.push(secondary("api", "web", &[8080]));
        sim.settle();
        assert!(!sim.svc("api").ingress.is_empty());
        sim.svc_mut("api").annotations.clear();
        let plans = sim.settle();
        assert!(sim.svc("api").ingress.is_empty(), "{plans:?}");
        assert!(!sim.svc("web").ingress.is_empty(), "the primary keeps it");
    }
}
