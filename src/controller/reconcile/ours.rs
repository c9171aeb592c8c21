//! Which Services are ours: a DHCP-mode primary of our class is taken on
//! with a finalizer; one that is no longer ours (another class, no longer
//! a LoadBalancer) or that opts out is released and handed over; a change
//! of IPAM mode is refused, and what cannot be made sense of is left
//! running as it is.

use crate::contract::node_object::Assignment;
use crate::contract::{self, Selection, harvester, kube_vip};
use crate::controller::networks::{self, NoUplink};

use super::events::{EventType, reason};
use super::pass::Pass;
use super::plan::Write;
use super::release::release_holders;
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
        Selection::Primary => match contract::address_identity(&s.uid, &s.annotations) {
            Ok(id) => {
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
            Err(e) => {
                pass.summary.refused += 1;
                pass.events.tell(s, EventType::Warning, reason::INVALID, e);
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
        Selection::NotOurs(_) | Selection::PoolMode => {
            let why = match selection {
                Selection::NotOurs(why) => why,
                _ => "pool mode",
            };
            if ours || !holders.is_empty() {
                // An address on a Service that is no LoadBalancer is
                // false information; a LoadBalancer of another class
                // keeps what its new implementation may reuse.
                let clear_status = s.type_ != "LoadBalancer";
                let message = format!("{why}: address released and handed over");
                hand_over(pass, s, &holders, clear_status, message);
            }
        }
        Selection::OptedOut => {
            if ours || !holders.is_empty() {
                // Released at the DHCP server, the address may go to
                // anyone: the status no longer claims it. kube-vip's
                // record stays, so kube-vip asks for the same one.
                let message = format!(
                    "{}: address released and handed over; status cleared, kube-vip.io annotations kept, so kube-vip asks for the same address",
                    contract::IGNORE
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
        let identity = contract::address_identity(&s.uid, &s.annotations);
        match identity.map(|id| {
            (
                id,
                networks::uplink_of(&s.annotations, pass.world.networks, &pass.nodes.uplinks),
            )
        }) {
            Err(e) => {
                pass.summary.refused += 1;
                pass.events.tell(s, EventType::Warning, reason::INVALID, e);
            }
            Ok((_, Err(NoUplink::Wait))) => pass.summary.pending += 1,
            Ok((_, Err(NoUplink::Refused(why)))) => {
                pass.summary.refused += 1;
                pass.events
                    .tell(s, EventType::Warning, reason::NETWORK_UNRESOLVED, why);
            }
            // The finalizer and the holder in one pass: the
            // finalizer is written first, and a failure there
            // holds back every later write naming the Service
            // (the writer's rule), so nothing is ever assigned
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
    if release_holders(
        s,
        holders,
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
        });
    }
    if s.has_our_finalizer() {
        pass.remove_finalizers
            .push(Write::RemoveFinalizer(s.key.clone()));
    }
    pass.events
        .tell(s, EventType::Normal, reason::HANDED_OVER, message);
}
