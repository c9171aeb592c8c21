//! Secondaries: a Service naming a primary shares its address, ports
//! apart, within its namespace or with the primary's consent; one that
//! shows an address we serve without sharing it loses it.

use std::collections::{BTreeMap, BTreeSet};

use crate::contract::{self, Selection, ServiceKey};

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
            if let Some(w) = status_write(s, ip, pass.world.ip_mode) {
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
            contract::shares_with(&p.key.namespace, &p.annotations, &s.key.namespace)
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
                        contract::SHARE_WITH,
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
            && s.load_balancer_class
                .as_deref()
                .is_none_or(|c| c == pass.world.classes.class)
            && s.first_ip().is_some_and(|ip| served_ips.contains(ip));
        if ours_to_clear {
            pass.statuses.push(Write::ServiceStatus {
                service: s.key.clone(),
                ingress: Vec::new(),
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
