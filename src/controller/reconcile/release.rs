//! Letting addresses go: a deleted Service's holders send DHCPRELEASE
//! before its record and our finalizer go, and the assignments of Services
//! that are gone are released where a holder still runs them.

use std::collections::{BTreeMap, BTreeSet};

use crate::contract::node_object::Assignment;
use crate::contract::{self, Selection, ServiceKey};

use super::annotations::removal_of_ours;
use super::events::{EventType, Events, describe_sharers, reason};
use super::pass::Pass;
use super::plan::Write;
use super::specs::Specs;
use super::world::{NodeIn, ServiceIn};

/// How long a deleted Service waits for its holder's DHCPRELEASE. A holder
/// that does not let go in that time (a wedged or hostile node) no longer
/// holds the deletion: its assignment is dropped and the Service goes.
pub const RELEASE_TIMEOUT_SECS: i64 = 30;

/// Whether `s` is being deleted and has waited [`RELEASE_TIMEOUT_SECS`].
pub fn release_overdue(s: &ServiceIn, now: i64) -> bool {
    s.deleting && s.deleting_since > 0 && now - s.deleting_since >= RELEASE_TIMEOUT_SECS
}

/// A Service being deleted: released, unless secondaries still share its
/// address, then cleared and let go.
pub(super) fn deleted<'a>(pass: &mut Pass<'a>, s: &'a ServiceIn) {
    if !s.has_our_finalizer() {
        return;
    }
    pass.summary.releasing += 1;
    // Only sharers the primary consented to hold its deletion: a
    // Service of another namespace naming it cannot.
    let secondaries: Vec<&ServiceKey> = pass
        .services
        .iter()
        .filter(|o| !o.deleting)
        .filter(|o| {
            matches!(&pass.selections[&o.key], Selection::Secondary { primary } if *primary == s.key)
        })
        .filter(|o| contract::shares_with(&s.key.namespace, &s.annotations, &o.key.namespace))
        .map(|o| &o.key)
        .collect();
    if !secondaries.is_empty() {
        pass.events.tell(
            s,
            EventType::Warning,
            reason::SECONDARIES_LIVE,
            format!(
                "not releasing the address while {} still share it; delete them first",
                describe_sharers(&s.key.namespace, &secondaries)
            ),
        );
        return;
    }
    let holders = pass.specs.holders_of(&s.uid);
    let mut waiting = release_holders(
        s,
        &holders,
        &pass.nodes.live,
        &mut pass.specs,
        &mut pass.events,
    );
    if waiting && release_overdue(s, pass.world.now) {
        for (node, _) in &holders {
            pass.specs.remove(node, &s.uid, &s.key);
            pass.events.tell(
                s,
                EventType::Warning,
                reason::RELEASED_WITHOUT_DHCPRELEASE,
                format!(
                    "released without DHCPRELEASE: holder {node} did not let go within {RELEASE_TIMEOUT_SECS} s"
                ),
            );
        }
        waiting = false;
    }
    if !waiting {
        clear_service(s, &mut pass.statuses, &mut pass.annotations);
        pass.remove_finalizers
            .push(Write::RemoveFinalizer(s.key.clone()));
        pass.events.tell(
            s,
            EventType::Normal,
            reason::RELEASED,
            match s.first_ip() {
                Some(ip) => format!("address {ip} released"),
                None => "released".into(),
            },
        );
    }
}

/// Asks every live holder of `s` that still runs its lease to send
/// DHCPRELEASE, and drops the assignments of holders that do not (down, or
/// done releasing). True while some holder is still releasing.
pub(super) fn release_holders(
    s: &ServiceIn,
    holders: &[(String, Assignment)],
    live: &BTreeMap<&str, &NodeIn>,
    specs: &mut Specs,
    events: &mut Events,
) -> bool {
    let service = s.key.to_string();
    let mut waiting = false;
    for (node, a) in holders {
        let holder = live.get(node.as_str());
        let listed = holder.is_some_and(|o| o.lists_lease(&service, &a.interface));
        if listed && holder.is_some_and(|o| o.eligible) {
            waiting = true;
            if !a.release {
                specs.put(
                    node,
                    Assignment {
                        release: true,
                        ..a.clone()
                    },
                    &s.key,
                );
                events.tell(
                    s,
                    EventType::Normal,
                    reason::RELEASING,
                    format!(
                        "{node} sends DHCPRELEASE for {}",
                        s.first_ip().unwrap_or("the address")
                    ),
                );
            }
        } else {
            if listed {
                events.tell(
                    s,
                    EventType::Warning,
                    reason::RELEASED_WITHOUT_DHCPRELEASE,
                    format!("released without DHCPRELEASE: holder {node} is down"),
                );
            }
            specs.remove(node, &s.uid, &s.key);
        }
    }
    waiting
}

/// Our record off a Service: status and the annotations we wrote.
fn clear_service(s: &ServiceIn, statuses: &mut Vec<Write>, annotations: &mut Vec<Write>) {
    if !s.ingress.is_empty() {
        statuses.push(Write::ServiceStatus {
            service: s.key.clone(),
            ingress: Vec::new(),
        });
    }
    annotations.extend(removal_of_ours(s));
}

/// Assignments of Services that are gone (their finalizer removed by
/// someone else): released where a live holder still runs the lease.
pub(super) fn orphans(pass: &mut Pass<'_>) {
    let uids: BTreeSet<&str> = pass.services.iter().map(|s| s.uid.as_str()).collect();
    let orphans: Vec<(String, Assignment)> = pass
        .specs
        .desired
        .iter()
        .flat_map(|(n, l)| l.iter().map(move |a| (n.clone(), a.clone())))
        .filter(|(_, a)| !uids.contains(a.uid.as_str()))
        .collect();
    for (node, a) in orphans {
        let key = contract::parse_service_key(&a.service).unwrap_or_else(|| ServiceKey {
            namespace: String::new(),
            name: a.service.clone(),
        });
        let running = pass
            .nodes
            .live
            .get(node.as_str())
            .is_some_and(|o| o.eligible && o.lists_lease(&a.service, &a.interface));
        if running {
            if !a.release {
                pass.specs
                    .put(&node, Assignment { release: true, ..a }, &key);
            }
        } else {
            pass.specs.remove(&node, &a.uid, &key);
        }
    }
}

#[cfg(test)]
mod tests {
    use crate::controller::reconcile::test_support::{Sim, dhcp, events, key, reasons};
    use crate::controller::reconcile::{OUR_ANNOTATIONS, RELEASE_TIMEOUT_SECS, Write, reason};

    #[test]
    fn delete_releases_first_then_clears_and_removes_the_finalizer() {
        let mut sim = Sim::new(&["n1"]);
        let mut web = dhcp("web", &[80]);
        web.finalizers
            .push("service.kubernetes.io/load-balancer-cleanup".into());
        sim.services.push(web);
        sim.settle();
        sim.svc_mut("web").deleting = true;
        let p = sim.plan();
        assert_eq!(p.writes.len(), 1, "{p:?}");
        let Write::SetSpec { spec, .. } = &p.writes[0] else {
            panic!("{p:?}")
        };
        assert!(spec.assignments[0].release, "release: true first");
        sim.apply(&p);
        // Until the holder reports the lease gone, nothing else happens.
        assert!(sim.plan().writes.is_empty());
        let plans = sim.settle();
        assert!(sim.holders("web").is_empty());
        let s = sim.svc("web");
        assert!(s.ingress.is_empty(), "status cleared");
        for k in OUR_ANNOTATIONS {
            assert!(!s.annotations.contains_key(k), "{k} cleared");
        }
        assert_eq!(
            s.finalizers,
            vec!["service.kubernetes.io/load-balancer-cleanup".to_string()],
            "only our finalizer removed"
        );
        assert_eq!(reasons(&plans), vec![reason::RELEASED]);
        assert!(sim.given.is_empty(), "DHCPRELEASE sent");
    }

    #[test]
    fn delete_with_a_dead_holder_finishes_with_a_warning() {
        let mut sim = Sim::new(&["n1"]);
        sim.services.push(dhcp("web", &[80]));
        sim.settle();
        sim.up.clear();
        sim.svc_mut("web").deleting = true;
        let plans = sim.settle();
        assert!(sim.services.is_empty(), "deleted");
        assert!(sim.holders("web").is_empty());
        assert_eq!(
            events(&plans)[0],
            (
                reason::RELEASED_WITHOUT_DHCPRELEASE,
                "released without DHCPRELEASE: holder n1 is down".to_string()
            )
        );
    }

    /// A holder that stays up but never lets go holds a deletion for
    /// [`RELEASE_TIMEOUT_SECS`] only.
    #[test]
    fn a_holder_that_never_releases_holds_a_deletion_for_a_bounded_time() {
        let mut sim = Sim::new(&["n1"]);
        sim.services.push(dhcp("web", &[80]));
        sim.settle();
        sim.svc_mut("web").deleting = true;
        sim.svc_mut("web").deleting_since = sim.now;
        let (node, _) = sim.holders("web")[0].clone();
        let p = sim.plan();
        sim.apply(&p);
        assert!(sim.holders("web")[0].1.release, "asked to release");
        // The agent stays eligible and keeps listing the lease: it ignores
        // `release` (its report is left as it was).
        sim.now += RELEASE_TIMEOUT_SECS - 1;
        let p = sim.plan();
        assert!(p.writes.is_empty(), "still waiting: {p:?}");
        sim.now += 1;
        sim.now += RELEASE_TIMEOUT_SECS;
        let p = sim.plan();
        assert!(
            p.events
                .iter()
                .any(|e| e.reason == reason::RELEASED_WITHOUT_DHCPRELEASE
                    && e.message.contains(&node)),
            "{p:?}"
        );
        assert!(
            p.writes.contains(&Write::RemoveFinalizer(key("web"))),
            "{p:?}"
        );
    }

    #[test]
    fn assignments_of_vanished_services_are_released() {
        let mut sim = Sim::new(&["n1"]);
        sim.services.push(dhcp("web", &[80]));
        sim.settle();
        // Someone removed our finalizer and the Service is gone.
        sim.services.clear();
        let p = sim.plan();
        let Write::SetSpec { spec, .. } = &p.writes[0] else {
            panic!("{p:?}")
        };
        assert!(spec.assignments[0].release);
        sim.settle();
        assert!(sim.holders("web").is_empty());
        assert!(sim.given.is_empty(), "released");
    }
}
