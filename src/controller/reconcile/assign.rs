//! Who holds each primary's address: a healthy holder is kept, else one
//! is placed (`controller::placement`), and the address its holder reports
//! is published in the status and in kube-vip's record.

use std::collections::BTreeMap;

use crate::contract::ServiceKey;
use crate::controller::placement::{self, ServiceNeed};

use super::annotations::record;
use super::events::{EventType, reason};
use super::identity::assignment_of;
use super::pass::Pass;
use super::status::{implausible, status_write};

/// Holders: keep a healthy one, else place.
pub(super) fn hold(pass: &mut Pass<'_>) {
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
        })
        .collect();
    let placement = placement::place(&service_needs, &pass.nodes.eligible, &current);
    for (s, id, uplink) in &pass.needs {
        let was = current.get(&s.key);
        let holder = match placement.get(&s.key).cloned().flatten() {
            Some(h) => {
                for (node, _) in pass.specs.holders_of(&s.uid) {
                    if node != h {
                        pass.specs.remove(&node, &s.uid, &s.key);
                    }
                }
                pass.specs
                    .put(&h, assignment_of(s, id, uplink.clone()), &s.key);
                match was {
                    None => pass.events.tell(
                        s,
                        EventType::Normal,
                        reason::HOLDER_CHOSEN,
                        format!("{h} holds the address"),
                    ),
                    Some(old) if *old != h => pass.events.tell(
                        s,
                        EventType::Normal,
                        reason::MOVED,
                        if s.local_endpoints.as_ref().is_some_and(|l| !l.contains(old)) {
                            format!(
                                "holder moved from {old} (no ready endpoint there; externalTrafficPolicy: Local) to {h}"
                            )
                        } else {
                            format!("holder moved from {old} (not eligible) to {h}")
                        },
                    ),
                    Some(_) => {}
                }
                Some(h)
            }
            None => {
                pass.events.tell(
                    s,
                    EventType::Warning,
                    reason::NO_ELIGIBLE_NODE,
                    match &s.local_endpoints {
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
                    },
                );
                was.cloned()
            }
        };
        let address = holder.as_deref().and_then(|h| {
            pass.nodes
                .live
                .get(h)
                .and_then(|o| o.bound_address(&s.key.to_string(), &id.interface))
                .map(|ip| (h, ip))
        });
        // An address no DHCP server of the VM network would give: not
        // published, and the Service waits.
        let address = match address {
            Some((holder, ip)) => match implausible(ip, s, &pass.world) {
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
            },
            None => None,
        };
        let Some((holder, ip)) = address else {
            pass.summary.pending += 1;
            if let Some(ip) = s.first_ip() {
                pass.primary_ip.insert(s.key.clone(), ip.to_string());
            }
            continue;
        };
        pass.summary.served += 1;
        pass.primary_ip.insert(s.key.clone(), ip.to_string());
        if let Some(w) = status_write(s, ip, pass.world.ip_mode) {
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
}
