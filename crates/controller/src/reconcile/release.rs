//! Letting addresses go: a deleted Service's holders send DHCPRELEASE
//! before its record and our finalizer go, and the assignments of Services
//! that are gone are released where a holder still runs them.

use std::collections::{BTreeMap, BTreeSet};

use hna_contract::node_object::Assignment;
use hna_contract::{self, Selection, ServiceKey};

use super::annotations::removal_of_ours;
use super::events::{EventType, Events, describe_sharers, reason};
use super::pass::Pass;
use super::plan::Write;
use super::specs::Specs;
use super::world::{NodeIn, ServiceIn};

/// How long a deleted Service waits for its holder's DHCPRELEASE. A holder
/// that does not let go in that time (a wedged or hostile node) no longer
/// holds the deletion: its assignment is dropped and the Service goes.
pub(crate) const RELEASE_TIMEOUT_SECS: i64 = 30;

/// Whether `s` is being deleted and has waited [`RELEASE_TIMEOUT_SECS`].
pub(crate) fn release_overdue(s: &ServiceIn, now: i64) -> bool {
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
        .filter(|o| hna_contract::shares_with(&s.key.namespace, &s.annotations, &o.key.namespace))
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
    let holders = with_lingering(s, pass.specs.holders_of(&s.uid), &pass.nodes.live);
    let mut waiting = release_holders(
        s,
        &holders,
        &pass.nodes.live,
        &mut pass.specs,
        &mut pass.events,
    );
    if waiting && release_overdue(s, pass.world.now) {
        // The assignment stays, marked for release (an orphan from now on:
        // `orphans` keeps it while the holder lists the lease), so a holder
        // that lets go late still sends the DHCPRELEASE.
        for (node, _) in &holders {
            pass.events.tell(
                s,
                EventType::Warning,
                reason::RELEASED_WITHOUT_DHCPRELEASE,
                format!(
                    "not waiting for {node}'s DHCPRELEASE any longer: it did not let go within {RELEASE_TIMEOUT_SECS} s (it stays asked to)"
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

/// `holders`, and the nodes that still list the lease of `s` in their
/// status though it is no longer assigned to them: it was moved away while
/// they were cut off from the API server, where they may run it still
/// (renewing it). They get the assignment back, to release it; without
/// that, one handed the lease over without a DHCPRELEASE when it came back
/// after the Service was gone (the fault soak, issue #29).
pub(super) fn with_lingering(
    s: &ServiceIn,
    mut holders: Vec<(String, Assignment)>,
    live: &BTreeMap<&str, &NodeIn>,
) -> Vec<(String, Assignment)> {
    let Some((_, a)) = holders.first().cloned() else {
        return holders;
    };
    let service = s.key.to_string();
    for (node, o) in live {
        if !holders.iter().any(|(n, _)| n == node) && o.lists_lease(&service, &a.interface) {
            holders.push((node.to_string(), a.clone()));
        }
    }
    holders
}

/// Asks every holder of `s` that still runs its lease to send DHCPRELEASE,
/// and drops the assignments of holders that do not (done releasing, or
/// never started). True while a live holder is still releasing.
///
/// A holder that is down but may still run the lease (its status lists it:
/// cut off from the API server with its LAN fine, or frozen) keeps the
/// assignment, marked for release, and the Service does not wait for it:
/// the holder sends DHCPRELEASE when it reads its spec again, and the
/// assignment goes once its status no longer lists the lease. Dropping it
/// instead made the holder hand the lease over without a DHCPRELEASE when
/// it came back, after renewing it meanwhile: the server kept the address
/// for nobody until the lease ran out (the fault soak, issue #29).
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
        if !listed {
            specs.remove(node, &s.uid, &s.key);
            continue;
        }
        let up = holder.is_some_and(|o| o.eligible);
        waiting |= up;
        if a.release {
            continue;
        }
        specs.put(
            node,
            Assignment {
                release: true,
                ..a.clone()
            },
            &s.key,
        );
        let ip = s.first_ip().unwrap_or("the address");
        if up {
            events.tell(
                s,
                EventType::Normal,
                reason::RELEASING,
                format!("{node} sends DHCPRELEASE for {ip}"),
            );
        } else {
            events.tell(
                s,
                EventType::Warning,
                reason::RELEASE_DEFERRED,
                format!("holder {node} is down: it sends DHCPRELEASE for {ip} when it is back; not waiting for it"),
            );
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
            assigned: None,
        });
    }
    annotations.extend(removal_of_ours(s));
}

/// Assignments of Services that are gone (their finalizer removed, by us
/// or by someone else): kept, marked for release, while their holder's
/// status lists the lease, up or down (see [`release_holders`]); dropped
/// once it does not, or once its Node is gone.
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
        let key = hna_contract::parse_service_key(&a.service).unwrap_or_else(|| ServiceKey {
            namespace: String::new(),
            name: a.service.clone(),
        });
        let listed = pass
            .nodes
            .live
            .get(node.as_str())
            .is_some_and(|o| o.lists_lease(&a.service, &a.interface));
        if listed {
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
    use crate::reconcile::sim::{Sim, dhcp, events, key, reasons};
    use crate::reconcile::{OUR_ANNOTATIONS, RELEASE_TIMEOUT_SECS, Write, reason};
    use hna_contract;

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

    /// Issue #29: a holder that is down when its Service is deleted (cut
    /// off from the API server, its LAN fine: it goes on renewing) keeps
    /// the assignment, marked for release; the deletion does not wait for
    /// it, and when it is back it sends the DHCPRELEASE and the assignment
    /// goes.
    #[test]
    fn a_holder_down_at_deletion_releases_when_it_is_back() {
        let mut sim = Sim::new(&["n1"]);
        sim.services.push(dhcp("web", &[80]));
        sim.settle();
        let uid = sim.svc("web").uid.clone();
        sim.up.clear();
        sim.svc_mut("web").deleting = true;
        let plans = sim.settle();
        assert!(sim.services.is_empty(), "deleted without waiting");
        let (why, message) = &events(&plans)[0];
        assert_eq!(*why, reason::RELEASE_DEFERRED);
        assert!(
            message.starts_with("holder n1 is down: it sends DHCPRELEASE for 10.77.0.")
                && message.ends_with(" when it is back; not waiting for it"),
            "{message}"
        );
        let kept = &sim.objects[0].spec.assignments;
        assert!(
            kept.len() == 1 && kept[0].uid == uid && kept[0].release,
            "kept, marked for release: {kept:?}"
        );
        assert!(sim.given.contains_key(&uid), "not released yet");
        // Nothing more is written while it stays down.
        assert!(sim.settle().iter().all(|p| p.writes.is_empty()));
        sim.up.insert("n1".into());
        sim.settle();
        assert!(!sim.given.contains_key(&uid), "DHCPRELEASE sent");
        assert!(sim.objects[0].spec.assignments.is_empty(), "then dropped");
    }

    /// The fault soak (issue #29): the holder is cut off from the API
    /// server, so the Service moves to another node, while the old holder
    /// still runs the lease (its status, stale, lists it). The Service is
    /// deleted: the old holder is asked to release too, and does when it is
    /// back.
    #[test]
    fn a_lease_still_run_where_it_moved_away_from_is_released_there_too() {
        let mut sim = Sim::new(&["n1", "n2"]);
        sim.services.push(dhcp("web", &[80]));
        sim.settle();
        let (old, _) = sim.holders("web")[0].clone();
        sim.up.remove(&old);
        sim.settle();
        let (new, _) = sim.holders("web")[0].clone();
        assert_ne!(new, old, "moved");
        sim.svc_mut("web").deleting = true;
        sim.settle();
        assert!(sim.services.is_empty(), "deleted without waiting");
        let owed = |sim: &Sim| {
            sim.objects
                .iter()
                .find(|o| o.name == old)
                .map(|o| o.spec.assignments.iter().any(|a| a.release))
                .unwrap_or(false)
        };
        assert!(
            owed(&sim),
            "{old} is asked to release what it may still run"
        );
        sim.up.insert(old.clone());
        sim.settle();
        assert!(!owed(&sim), "released, then dropped");
        assert!(sim.objects.iter().all(|o| o.spec.assignments.is_empty()));
    }

    /// A release the holder owes is forgotten when the Service is served
    /// again elsewhere: its DHCPRELEASE would free the new holder's lease
    /// (the same client identifier) at the server.
    #[test]
    fn a_release_owed_is_forgotten_when_the_service_is_served_again() {
        let mut sim = Sim::new(&["n1", "n2"]);
        sim.services.push(dhcp("web", &[80]));
        sim.settle();
        let (old, _) = sim.holders("web")[0].clone();
        sim.up.remove(&old);
        sim.svc_mut("web")
            .annotations
            .insert(hna_contract::IGNORE.into(), "true".into());
        sim.settle();
        assert!(sim.holders("web")[0].1.release, "owed by {old}");
        sim.svc_mut("web").annotations.remove(hna_contract::IGNORE);
        sim.settle();
        let holders = sim.holders("web");
        assert_eq!(holders.len(), 1, "{holders:?}");
        assert!(holders[0].0 != old && !holders[0].1.release, "{holders:?}");
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
        sim.apply(&p);
        // Still asked to release: when it lets go, late, the DHCPRELEASE
        // is sent and the assignment goes.
        assert!(
            sim.objects
                .iter()
                .any(|o| o.spec.assignments.iter().any(|a| a.release))
        );
        sim.settle();
        assert!(sim.given.is_empty(), "DHCPRELEASE sent, late");
        assert!(sim.objects.iter().all(|o| o.spec.assignments.is_empty()));
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
