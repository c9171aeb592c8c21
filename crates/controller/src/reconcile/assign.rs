//! Who holds each primary's address: a healthy holder is kept, else one
//! is placed (`crate::placement`), and the address its holder reports
//! is published in the status and in kube-vip's record.
//!
//! An address still held by a node that must let go first
//! (`NodeIn::lets_go_first`: dead on its LAN, in touch with the API server)
//! is taken from it and given to its new holder only once it reports it
//! gone: the new holder's takeover guard cannot hear it.

use std::collections::BTreeMap;

use crate::placement::{self, ServiceNeed};
use hna_contract::{AddressIdentity, ServiceKey};

use super::annotations::record;
use super::events::{EventType, reason};
use super::identity::assignment_of;
use super::pass::Pass;
use super::status::{implausible, status_write};
use super::world::ServiceIn;

/// Holders: keep a healthy one, else place.
pub(super) fn hold(pass: &mut Pass<'_>) {
    let (current, placement) = place(pass);
    // Taken out while the loop adds to the rest of the pass.
    let needs = std::mem::take(&mut pass.needs);
    for (s, id, uplink) in &needs {
        let was = current.get(&s.key);
        let holder = match placement.get(&s.key).cloned().flatten() {
            Some(h) => {
                if !give(pass, s, id, uplink, was, &h) {
                    pending(pass, s);
                    continue;
                }
                Some(h)
            }
            None => {
                tell_no_eligible_node(pass, s);
                was.cloned()
            }
        };
        match reported_address(pass, s, id, holder.as_deref()) {
            Some((holder, ip)) => publish(pass, s, id, holder, ip),
            None => pending(pass, s),
        }
    }
    pass.needs = needs;
}

/// Each primary's current holder (one that is not releasing it), and
/// where the placement puts it.
fn place(pass: &Pass<'_>) -> (BTreeMap<ServiceKey, String>, placement::Placement) {
    let current: BTreeMap<ServiceKey, String> = pass
        .needs
        .iter()
        .filter_map(|(s, _, _)| {
            pass.specs
                .holders_of(&s.uid)
                .into_iter()
                .find(|(_, a)| !a.release)
                .map(|(n, _)| (s.key.clone(), n))
        })
        .collect();
    let service_needs: Vec<ServiceNeed> = pass
        .needs
        .iter()
        .map(|(s, _, _)| ServiceNeed {
            key: s.key.clone(),
            uid: s.uid.clone(),
            only: s.local_endpoints.clone(),
            avoid: pass
                .world
                .avoid
                .get(&s.key.to_string())
                .cloned()
                .unwrap_or_default(),
        })
        .collect();
    let placement = placement::place_with(
        &service_needs,
        &pass.nodes.eligible,
        &pass.nodes.keep_only,
        &pass.nodes.unproven,
        &current,
    );
    (current, placement)
}

/// Gives `s`'s address to `h` (`was` held it before), taking it from its
/// other holders. False while a node that must let go first still holds
/// it: `h` gets it once that node reports it gone.
fn give(
    pass: &mut Pass<'_>,
    s: &ServiceIn,
    id: &AddressIdentity,
    uplink: &Option<String>,
    was: Option<&String>,
    h: &str,
) -> bool {
    for (node, _) in pass.specs.holders_of(&s.uid) {
        if node != h {
            pass.specs.remove(&node, &s.uid, &s.key);
        }
    }
    if let Some(old) = letting_go(pass, s, id, h) {
        if was.is_some_and(|w| w == old) {
            pass.events.tell(
                s,
                EventType::Normal,
                reason::MOVED,
                format!(
                    "holder moving from {old} (dead on its LAN by its witnesses' word, yet in touch with the API server): {h} gets the address once {old} reports it let go"
                ),
            );
        }
        return false;
    }
    pass.specs
        .put(h, assignment_of(s, id, uplink.clone()), &s.key);
    match was {
        None => pass.events.tell(
            s,
            EventType::Normal,
            reason::HOLDER_CHOSEN,
            format!("{h} holds the address"),
        ),
        Some(old) if *old != h => {
            let message = moved(pass, s, old, h);
            pass.events
                .tell(s, EventType::Normal, reason::MOVED, message);
        }
        Some(_) => {}
    }
    true
}

/// A node other than `h` that still holds `s`'s address and must let go
/// of it first.
fn letting_go<'a>(
    pass: &Pass<'a>,
    s: &ServiceIn,
    id: &AddressIdentity,
    h: &str,
) -> Option<&'a str> {
    pass.world
        .node_objects
        .iter()
        .find(|o| {
            o.name != h
                && o.lets_go_first
                && o.bound_address(&s.key.to_string(), &id.interface).is_some()
        })
        .map(|o| o.name.as_str())
}

/// The MOVED Event's message: why `old` no longer holds `s`'s address.
fn moved(pass: &Pass<'_>, s: &ServiceIn, old: &str, h: &str) -> String {
    if pass
        .world
        .avoid
        .get(&s.key.to_string())
        .is_some_and(|a| a.contains(old))
        && pass.nodes.eligible.iter().any(|n| n == old)
    {
        format!(
            "holder moved from {old} (it did not read the assignment within 3 s, or its lease stayed FAILED or GUARDED: it could not serve this Service) to {h}"
        )
    } else if s.local_endpoints.as_ref().is_some_and(|l| !l.contains(old)) {
        format!(
            "holder moved from {old} (no ready endpoint there; externalTrafficPolicy: Local) to {h}"
        )
    } else {
        format!("holder moved from {old} (not eligible) to {h}")
    }
}

fn tell_no_eligible_node(pass: &mut Pass<'_>, s: &ServiceIn) {
    let message = match &s.local_endpoints {
        Some(local) => format!(
            "no node can hold the address now: externalTrafficPolicy: Local and no eligible node has a ready endpoint ({} with one, {} of {} eligible)",
            local.len(),
            pass.nodes.eligible.len(),
            pass.nodes.names.len()
        ),
        None => format!(
            "no node can hold the address now ({} of {} eligible)",
            pass.nodes.eligible.len(),
            pass.nodes.names.len()
        ),
    };
    pass.events
        .tell(s, EventType::Warning, reason::NO_ELIGIBLE_NODE, message);
}

/// The address `holder` reports for `s`, if it is one to publish: an
/// address no DHCP server of the VM network would give is not published
/// (said in an Event), and the Service waits.
fn reported_address<'a, 'h>(
    pass: &mut Pass<'a>,
    s: &ServiceIn,
    id: &AddressIdentity,
    holder: Option<&'h str>,
) -> Option<(&'h str, &'a str)> {
    let holder = holder?;
    let ip = pass
        .nodes
        .live
        .get(holder)
        .copied()
        .and_then(|o| o.bound_address(&s.key.to_string(), &id.interface))?;
    match implausible(ip, s, &pass.world, &pass.taken) {
        Some(why) => {
            pass.events.tell(
                s,
                EventType::Warning,
                reason::ADDRESS_IMPLAUSIBLE,
                format!("{holder} reported {why}: not published"),
            );
            None
        }
        None => Some((holder, ip)),
    }
}

/// `s` served at `ip` by `holder`: its status and kube-vip's record.
fn publish(pass: &mut Pass<'_>, s: &ServiceIn, id: &AddressIdentity, holder: &str, ip: &str) {
    pass.summary.served += 1;
    pass.primary_ip.insert(s.key.clone(), ip.to_string());
    if let Some(w) = status_write(s, ip, pass.world.ip_mode, pass.world.now) {
        pass.statuses.push(w);
        pass.events.tell(
            s,
            EventType::Normal,
            reason::ADDRESS_ASSIGNED,
            format!("{ip} held by {holder}"),
        );
    }
    pass.annotations.extend(record(s, id, ip, holder));
}

/// `s` waits for its address; its secondaries go on standing for the one
/// its status publishes, if any.
fn pending(pass: &mut Pass<'_>, s: &ServiceIn) {
    pass.summary.pending += 1;
    if let Some(ip) = s.first_ip() {
        pass.primary_ip.insert(s.key.clone(), ip.to_string());
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use crate::reconcile::reason;
    use crate::reconcile::sim::{Sim, dhcp, reasons};
    use hna_contract::kube_vip;

    /// Service `web`, its holder (returned) found dead on its LAN since.
    fn web_held_by_a_node_dead_on_its_lan(lets_go_first: bool) -> (Sim, String) {
        let mut sim = Sim::new(&["n1", "n2", "n3"]);
        sim.services.push(dhcp("web", &[80]));
        sim.settle();
        let old = sim.holders("web")[0].0.clone();
        let cut = sim.objects.iter_mut().find(|o| o.name == old).unwrap();
        cut.eligible = false;
        cut.lets_go_first = lets_go_first;
        (sim, old)
    }

    /// A holder dead on its LAN but in touch with the API server keeps
    /// reading its assignments: its Service is taken from it at once but
    /// given to the next holder only once it reports the lease gone (the
    /// next holder's takeover guard could not hear it answer). The
    /// address stays published meanwhile.
    #[test]
    fn a_holder_dead_on_its_lan_but_writing_lets_go_before_another_is_given_the_address() {
        let (mut sim, old) = web_held_by_a_node_dead_on_its_lan(true);
        let ip = sim.svc("web").ingress[0].ip.clone();
        let p = sim.plan();
        sim.apply(&p);
        assert!(
            sim.holders("web").is_empty(),
            "taken from {old}, given to nobody yet: {:?}",
            sim.holders("web")
        );
        assert_eq!(sim.svc("web").ingress[0].ip, ip, "still published");
        let told: Vec<String> = p.events.iter().map(|e| e.message.clone()).collect();
        assert!(
            told.iter()
                .any(|m| m.contains(&format!("once {old} reports it let go"))),
            "{told:?}"
        );
        // Again, before it has read its spec: still nobody.
        let p = sim.plan();
        sim.apply(&p);
        assert!(sim.holders("web").is_empty());
        // It read and let go (its agent runs; only its LAN is cut).
        let cut = sim.objects.iter_mut().find(|o| o.name == old).unwrap();
        cut.status.leases.clear();
        moved_in_one_pass(&mut sim, &old);
    }

    /// One pass gives `web` to one node other than `old`.
    fn moved_in_one_pass(sim: &mut Sim, old: &str) {
        let p = sim.plan();
        sim.apply(&p);
        let now = sim.holders("web");
        assert_eq!(now.len(), 1, "{now:?}");
        assert_ne!(now[0].0, old);
    }

    /// Past its wait (`lets_go_first` no longer set), or not writing, a
    /// node dead on its LAN that still reports the lease does not hold its
    /// Service up.
    #[test]
    fn a_holder_dead_on_its_lan_past_its_wait_is_moved_from_at_once() {
        let (mut sim, old) = web_held_by_a_node_dead_on_its_lan(false);
        moved_in_one_pass(&mut sim, &old);
    }

    #[test]
    fn a_healthy_holder_is_kept_a_dead_ones_services_move_and_keep_their_address() {
        let mut sim = Sim::new(&["n1", "n2", "n3"]);
        for i in 0..6 {
            sim.services.push(dhcp(&format!("s{i}"), &[80]));
        }
        sim.settle();
        let before: BTreeMap<String, String> = (0..6)
            .map(|i| (format!("s{i}"), sim.holders(&format!("s{i}"))[0].0.clone()))
            .collect();
        let ips: Vec<String> = sim
            .services
            .iter()
            .map(|s| s.ingress[0].ip.clone())
            .collect();
        // A node that comes back or a new one changes nothing.
        sim.nodes.push("n4".into());
        sim.up.insert("n4".into());
        sim.settle();
        let dead = before["s0"].clone();
        sim.up.remove(&dead);
        let plans = sim.settle();
        for (name, was) in &before {
            let now = sim.holders(name);
            assert_eq!(now.len(), 1, "{name}: {now:?}");
            if *was == dead {
                assert_ne!(now[0].0, dead, "{name} moved");
                assert_eq!(sim.svc(name).annotations[kube_vip::VIP_HOST], now[0].0);
            } else {
                assert_eq!(now[0].0, *was, "{name} stays on its healthy holder");
            }
        }
        let ips_after: Vec<String> = sim
            .services
            .iter()
            .map(|s| s.ingress[0].ip.clone())
            .collect();
        assert_eq!(ips, ips_after, "the same address after the move");
        assert!(reasons(&plans).contains(&reason::MOVED));
        assert!(
            !reasons(&plans).contains(&reason::ADDRESS_ASSIGNED),
            "same address: no new status"
        );
    }

    #[test]
    fn without_an_eligible_node_nothing_moves_and_a_warning_says_so() {
        let mut sim = Sim::new(&["n1"]);
        sim.services.push(dhcp("web", &[80]));
        sim.settle();
        sim.up.clear();
        let p = sim.settle();
        assert_eq!(p.len(), 1, "no writes");
        assert_eq!(sim.holders("web")[0].0, "n1");
        assert_eq!(sim.svc("web").ingress[0].ip, "10.77.0.150", "status kept");
        assert_eq!(reasons(&p), vec![reason::NO_ELIGIBLE_NODE]);
    }
}
