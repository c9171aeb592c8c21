//! The controller's decisions as one pure function: Services, Nodes and the
//! per-node objects in (plain data, already judged for eligibility), the
//! writes and Events that bring the cluster to what they imply out.
//!
//! Idempotent: applied to its own outcome it asks for no write. What runs
//! is never changed because of something the controller cannot make sense
//! of (an invalid annotation, a refused IPAM change): such Services are
//! left exactly as they are, with a Warning Event saying why.
//!
//! Order matters and is the order of [`Plan::writes`]: finalizers are added
//! before anything is assigned (a Service is never given an address it
//! could be deleted without releasing); node objects exist before their
//! specs are written; a Service's status is written before its annotations
//! (the Harvester cloud provider copies the address only on the resync an
//! annotation change triggers); finalizers are removed last.
//!
//! The steps run in the order their decisions need one another: every
//! Service is judged (`ours`, `release`) before identities are compared
//! across the primaries (`identity`); primaries have their holders and
//! addresses (`assign`) before a secondary can share one (`sharing`); and
//! the assignments of Services that are gone are released last
//! (`release`). Each step adds to one `Pass`, which keeps the writes apart
//! by kind until they are put in their order.

mod annotations;
mod assign;
mod events;
mod identity;
mod nodes;
mod ours;
mod pass;
mod plan;
mod release;
mod sharing;
mod specs;
mod status;
mod world;

#[cfg(test)]
pub(crate) use annotations::OUR_ANNOTATIONS;
#[cfg(test)]
pub(crate) use events::reason;
pub(crate) use events::{EventOut, EventType};
pub use plan::{Assigned, Plan, Summary, Write};
pub(crate) use release::RELEASE_TIMEOUT_SECS;
#[cfg(test)]
pub(crate) use release::release_overdue;
pub use world::{BOUND, IP_MODE_VIP, Ingress, NodeIn, NodeNetworks, Port, ServiceIn, World};

use pass::Pass;

/// Everything to do now.
pub fn reconcile(world: World<'_>) -> Plan {
    let mut pass = Pass::new(world);
    for s in pass.services.clone() {
        if s.deleting {
            release::deleted(&mut pass, s);
        } else {
            ours::admit(&mut pass, s);
        }
    }
    identity::refuse_clashes(&mut pass);
    assign::hold(&mut pass);
    let shared = sharing::secondaries(&mut pass);
    sharing::clear_unshared(&mut pass, &shared);
    release::orphans(&mut pass);

    let Pass {
        nodes,
        specs,
        add_finalizers,
        statuses,
        annotations,
        remove_finalizers,
        events,
        summary,
        ..
    } = pass;
    let mut writes = add_finalizers;
    writes.extend(nodes.creates);
    writes.extend(specs.writes());
    writes.extend(statuses);
    writes.extend(annotations);
    writes.extend(remove_finalizers);
    writes.extend(nodes.deletes);
    Plan {
        writes,
        events: events.into_vec(),
        summary,
    }
}

pub mod sim;

#[cfg(test)]
mod tests {
    use super::sim::{Sim, dhcp, key, port, reasons, uid};
    use super::{IP_MODE_VIP, Ingress, Write, reason};
    use hna_contract::{self, Annotations, kube_vip};

    #[test]
    fn a_primary_gets_finalizer_then_holder_then_status_then_annotations() {
        let mut sim = Sim::new(&["n1", "n2", "n3"]);
        sim.services.push(dhcp("web", &[80, 443]));
        let first = sim.plan();
        assert_eq!(
            first.writes.first(),
            Some(&Write::AddFinalizer(key("web"))),
            "the finalizer before anything is assigned"
        );
        assert!(
            first.writes.iter().any(
                |w| matches!(w, Write::SetSpec { services, .. } if services.contains(&key("web")))
            ),
            "the holder in the same pass: {:?}",
            first.writes
        );
        let plans = sim.settle();
        let holders = sim.holders("web");
        assert_eq!(holders.len(), 1, "one holder");
        let (holder, a) = &holders[0];
        let id = hna_contract::AddressIdentity::of(&uid("web"), &Annotations::new()).unwrap();
        assert_eq!(a.interface, id.interface);
        assert_eq!(a.mac, hna_contract::mac::format(&id.mac));
        assert_eq!(a.client_id, hex(&id.client_id));
        assert!(!a.release);
        let ip = "10.77.0.150";
        assert_eq!(
            a.requested_ip.as_deref(),
            Some(ip),
            "written back, so a later holder INIT-REBOOTs to it"
        );
        let s = sim.svc("web");
        assert_eq!(
            s.ingress,
            vec![Ingress {
                ip: ip.into(),
                ip_mode: Some(IP_MODE_VIP.into()),
                ports: vec![port(80), port(443)]
            }]
        );
        assert_eq!(s.annotations[kube_vip::REQUESTED_IP], ip);
        assert_eq!(s.annotations[kube_vip::VIP_HOST], *holder);
        assert_eq!(s.annotations[kube_vip::HWADDR], a.mac);
        // Status strictly before the annotations, in the same plan.
        let p = plans
            .iter()
            .find(|p| {
                p.writes
                    .iter()
                    .any(|w| matches!(w, Write::ServiceStatus { .. }))
            })
            .unwrap();
        let pos = |f: &dyn Fn(&Write) -> bool| p.writes.iter().position(f).unwrap();
        assert!(
            pos(&|w| matches!(w, Write::ServiceStatus { .. }))
                < pos(&|w| matches!(w, Write::ServiceAnnotations { .. }))
        );
        assert_eq!(
            reasons(&plans),
            vec![reason::HOLDER_CHOSEN, reason::ADDRESS_ASSIGNED]
        );
        // Idempotent: over its own outcome, nothing to write and no Event.
        let again = sim.plan();
        assert!(
            again.writes.is_empty() && again.events.is_empty(),
            "{again:?}"
        );
        assert_eq!(again.summary.served, 1);
    }

    fn hex(b: &[u8]) -> String {
        b.iter().map(|b| format!("{b:02x}")).collect()
    }
}
