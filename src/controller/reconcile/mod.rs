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

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::net::Ipv4Addr;

use crate::contract::node_object::{Assignment, Spec};
use crate::contract::{self, AddressIdentity, Selection, ServiceKey, harvester, kube_vip};
use crate::controller::networks::{self, NoUplink};
use crate::controller::placement::{self, ServiceNeed};

mod events;
mod plan;
mod world;

use events::describe_sharers;
pub use events::{EventOut, EventType, reason};
pub use plan::{Plan, Summary, Write};
pub use world::{BOUND, IP_MODE_VIP, Ingress, NodeIn, NodeNetworks, Port, ServiceIn, World};

/// The annotations the controller writes on a Service it serves (kube-vip's
/// record, so that moving back to kube-vip keeps the address).
pub const OUR_ANNOTATIONS: [&str; 3] =
    [kube_vip::HWADDR, kube_vip::REQUESTED_IP, kube_vip::VIP_HOST];

/// Why `ip`, reported by a holder for `s`, cannot be its load-balancer
/// address: a node credential could otherwise publish any address (the API
/// server's, a Pod's, another Service's) into a Service's status.
fn implausible(ip: &str, s: &ServiceIn, world: &World<'_>) -> Option<String> {
    let Ok(addr) = ip.parse::<Ipv4Addr>() else {
        return Some(format!("{ip:?} is not an IPv4 address"));
    };
    if addr.is_unspecified()
        || addr.is_loopback()
        || addr.is_multicast()
        || addr.is_broadcast()
        || addr.is_link_local()
    {
        return Some(format!("{ip} is not a unicast host address"));
    }
    if world.node_networks.addresses.contains(&addr) {
        return Some(format!("{ip} is a Node's own address"));
    }
    if let Some((net, len)) = world.node_networks.pod_cidr_of(addr) {
        return Some(format!("{ip} is in the Pod CIDR {net}/{len}"));
    }
    for other in world.services {
        if other.cluster_ips.iter().any(|c| c == ip) {
            return Some(format!("{ip} is a Service's cluster IP"));
        }
        if other.uid != s.uid && other.ingress.iter().any(|i| i.ip == ip) && !shares(other, s) {
            return Some(format!("{ip} is another Service's load-balancer address"));
        }
    }
    None
}

/// Whether `other` shows `s`'s address because it shares it (a secondary
/// naming `s`).
fn shares(other: &ServiceIn, s: &ServiceIn) -> bool {
    other
        .annotations
        .get(harvester::PRIMARY_SERVICE)
        .and_then(|p| contract::parse_service_key(p))
        .is_some_and(|p| p == s.key)
}

/// How long a deleted Service waits for its holder's DHCPRELEASE. A holder
/// that does not let go in that time (a wedged or hostile node) no longer
/// holds the deletion: its assignment is dropped and the Service goes.
pub const RELEASE_TIMEOUT_SECS: i64 = 30;

/// Whether `s` is being deleted and has waited [`RELEASE_TIMEOUT_SECS`].
pub fn release_overdue(s: &ServiceIn, now: i64) -> bool {
    s.deleting && s.deleting_since > 0 && now - s.deleting_since >= RELEASE_TIMEOUT_SECS
}

/// The status write that gives `s` the address `ip` with its own ports,
/// unless its status says so already.
fn status_write(s: &ServiceIn, ip: &str, ip_mode: bool) -> Option<Write> {
    let want = vec![Ingress {
        ip: ip.to_string(),
        ip_mode: ip_mode.then(|| IP_MODE_VIP.to_string()),
        ports: s.ports.clone(),
    }];
    (s.ingress != want).then(|| Write::ServiceStatus {
        service: s.key.clone(),
        ingress: want,
    })
}

/// What DHCP can give a Service of its `ipFamilies`: DHCP-mode addresses
/// are IPv4, so an IPv6-only Service is refused (`false`, a Warning) and a
/// dual-stack one gets its IPv4 address only (`true`, a Normal Event
/// saying so).
fn ip_families(s: &ServiceIn) -> (bool, Option<(EventType, &'static str, String)>) {
    let has = |f: &str| s.ip_families.iter().any(|x| x == f);
    let families = s.ip_families.join(", ");
    match (has("IPv4"), has("IPv6")) {
        (false, true) => (
            false,
            Some((
                EventType::Warning,
                reason::IPV4_REQUIRED,
                format!(
                    "DHCP-mode addresses are IPv4 and this Service asks for IPv6 only (ipFamilies: [{families}]): no address is requested; on a dual-stack cluster set spec.ipFamilyPolicy: PreferDualStack to add the IPv4 family, or recreate the Service with ipFamilies: [IPv4]"
                ),
            )),
        ),
        (true, true) => (
            true,
            Some((
                EventType::Normal,
                reason::IPV6_NOT_SERVED,
                format!(
                    "DHCP-mode addresses are IPv4: the IPv4 family is served and the IPv6 family gets no load-balancer address (ipFamilies: [{families}])"
                ),
            )),
        ),
        _ => (true, None),
    }
}

/// [`ip_families`] applied: its Event told, a refusal counted; whether
/// the Service is served.
fn families_served(
    s: &ServiceIn,
    event: &mut impl FnMut(&ServiceIn, EventType, &'static str, String),
    refused: &mut usize,
) -> bool {
    let (serve, said) = ip_families(s);
    if let Some((type_, why, message)) = said {
        event(s, type_, why, message);
    }
    if !serve {
        *refused += 1;
    }
    serve
}

/// The primaries among `needs` that ask for a link name, a MAC, a client
/// identifier or a requested address another of them has, each with the Event's message.
/// Who keeps it: a Service whose holder already runs that MAC, then the
/// older Service, then the first by name. The messages never name the
/// other Service: it may be another tenant's.
fn identity_clashes(
    needs: &[(&ServiceIn, AddressIdentity, Option<String>)],
    specs: &Specs,
) -> BTreeMap<ServiceKey, String> {
    let mut order: Vec<(bool, i64, &ServiceKey, usize)> = needs
        .iter()
        .enumerate()
        .map(|(i, (s, id, _))| {
            let mac = crate::mac::format(&id.mac);
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
                crate::mac::format(&id.mac),
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

/// What a Service's own holder should carry.
fn assignment_of(s: &ServiceIn, id: &AddressIdentity, uplink: Option<String>) -> Assignment {
    Assignment {
        service: s.key.to_string(),
        uid: s.uid.clone(),
        interface: id.interface.clone(),
        mac: crate::mac::format(&id.mac),
        client_id: id.client_id.iter().map(|b| format!("{b:02x}")).collect(),
        hostname: id.hostname.clone(),
        requested_ip: id.requested_ip.map(|ip| ip.to_string()),
        uplink,
        release: false,
    }
}

/// The desired specs, edited per Service, and which Services each edit
/// touched.
struct Specs {
    current: BTreeMap<String, Vec<Assignment>>,
    desired: BTreeMap<String, Vec<Assignment>>,
    /// The nodes whose desired spec has an assignment of a uid: looking a
    /// Service up is then not a walk over every node's assignments, which
    /// made a pass quadratic in the number of Services.
    nodes_of: HashMap<String, BTreeSet<String>>,
    touched: BTreeMap<String, BTreeSet<ServiceKey>>,
}

impl Specs {
    fn new(live: &BTreeMap<&str, &NodeIn>) -> Specs {
        let current: BTreeMap<String, Vec<Assignment>> = live
            .iter()
            .map(|(n, o)| (n.to_string(), o.spec.assignments.clone()))
            .collect();
        let mut nodes_of: HashMap<String, BTreeSet<String>> = HashMap::new();
        for (node, list) in &current {
            for a in list {
                nodes_of
                    .entry(a.uid.clone())
                    .or_default()
                    .insert(node.clone());
            }
        }
        Specs {
            desired: current.clone(),
            current,
            nodes_of,
            touched: BTreeMap::new(),
        }
    }

    /// `(node, assignment)` for every assignment of `uid`, in node order.
    fn holders_of(&self, uid: &str) -> Vec<(String, Assignment)> {
        let Some(nodes) = self.nodes_of.get(uid) else {
            return Vec::new();
        };
        nodes
            .iter()
            .filter_map(|n| {
                let list = self.desired.get(n)?;
                Some(
                    list.iter()
                        .filter(|a| a.uid == uid)
                        .map(move |a| (n.clone(), a.clone())),
                )
            })
            .flatten()
            .collect()
    }

    fn remove(&mut self, node: &str, uid: &str, service: &ServiceKey) {
        if let Some(list) = self.desired.get_mut(node) {
            list.retain(|a| a.uid != uid);
            if let Some(nodes) = self.nodes_of.get_mut(uid) {
                nodes.remove(node);
            }
            self.touched
                .entry(node.to_string())
                .or_default()
                .insert(service.clone());
        }
    }

    fn put(&mut self, node: &str, a: Assignment, service: &ServiceKey) {
        if let Some(list) = self.desired.get_mut(node) {
            self.nodes_of
                .entry(a.uid.clone())
                .or_default()
                .insert(node.to_string());
            match list.iter_mut().find(|x| x.uid == a.uid) {
                Some(x) => *x = a,
                None => list.push(a),
            }
            self.touched
                .entry(node.to_string())
                .or_default()
                .insert(service.clone());
        }
    }

    fn writes(self) -> Vec<Write> {
        let mut out = Vec::new();
        for (node, mut list) in self.desired {
            list.sort_by(|a, b| a.service.cmp(&b.service).then(a.uid.cmp(&b.uid)));
            let mut current = self.current.get(&node).cloned().unwrap_or_default();
            current.sort_by(|a, b| a.service.cmp(&b.service).then(a.uid.cmp(&b.uid)));
            if list != current {
                out.push(Write::SetSpec {
                    services: self
                        .touched
                        .get(&node)
                        .map(|s| s.iter().cloned().collect())
                        .unwrap_or_default(),
                    node,
                    spec: Spec { assignments: list },
                });
            }
        }
        out
    }
}

/// Everything to do now.
pub fn reconcile(world: World<'_>) -> Plan {
    let mut plan = Plan::default();
    let node_names: BTreeSet<&str> = world.nodes.iter().map(String::as_str).collect();
    let objects: BTreeMap<&str, &NodeIn> = world
        .node_objects
        .iter()
        .map(|o| (o.name.as_str(), o))
        .collect();

    let mut creates = Vec::new();
    let mut deletes = Vec::new();
    for n in &node_names {
        if !objects.contains_key(n) {
            creates.push(Write::CreateNodeObject(n.to_string()));
        }
    }
    for n in &node_names {
        if !world.access_ensured.contains(*n) {
            creates.push(Write::EnsureNodeAccess(n.to_string()));
        }
    }
    for n in objects.keys() {
        if !node_names.contains(n) {
            deletes.push(Write::DeleteNodeObject(n.to_string()));
        }
    }
    // Only the objects of existing Nodes may hold addresses.
    let live: BTreeMap<&str, &NodeIn> = objects
        .iter()
        .filter(|(n, _)| node_names.contains(*n))
        .map(|(n, o)| (*n, *o))
        .collect();
    let eligible: Vec<String> = live
        .values()
        .filter(|o| o.eligible)
        .map(|o| o.name.clone())
        .collect();
    plan.summary.nodes_total = node_names.len();
    plan.summary.nodes_eligible = eligible.len();

    let mut specs = Specs::new(&live);
    // The interfaces the nodes report as their uplink: with the network
    // map's, the only ones a Service may name.
    let uplinks: BTreeSet<String> = live
        .values()
        .filter_map(|o| o.status.default_uplink.clone())
        .collect();

    let mut services: Vec<&ServiceIn> = world.services.iter().collect();
    services.sort_by(|a, b| a.key.cmp(&b.key));
    let by_key: BTreeMap<&ServiceKey, &ServiceIn> = services.iter().map(|s| (&s.key, *s)).collect();
    let selections: BTreeMap<&ServiceKey, Selection> = services
        .iter()
        .map(|s| (&s.key, contract::select(&s.view(), world.classes)))
        .collect();

    let mut add_finalizers = Vec::new();
    let mut statuses = Vec::new();
    let mut annotations = Vec::new();
    let mut remove_finalizers = Vec::new();
    let mut event = |s: &ServiceIn, type_: EventType, reason: &'static str, message: String| {
        plan.events.push(EventOut {
            service: s.key.clone(),
            uid: s.uid.clone(),
            type_,
            reason,
            message,
        })
    };

    // Primaries to place, with their identities.
    let mut needs: Vec<(&ServiceIn, AddressIdentity, Option<String>)> = Vec::new();

    for s in &services {
        let selection = &selections[&s.key];
        let ours = s.has_our_finalizer();
        let holders = specs.holders_of(&s.uid);

        if s.deleting {
            if !ours {
                continue;
            }
            plan.summary.releasing += 1;
            // Only sharers the primary consented to hold its deletion: a
            // Service of another namespace naming it cannot.
            let secondaries: Vec<&ServiceKey> = services
                .iter()
                .filter(|o| !o.deleting)
                .filter(|o| {
                    matches!(&selections[&o.key], Selection::Secondary { primary } if *primary == s.key)
                })
                .filter(|o| contract::shares_with(&s.key.namespace, &s.annotations, &o.key.namespace))
                .map(|o| &o.key)
                .collect();
            if !secondaries.is_empty() {
                event(
                    s,
                    EventType::Warning,
                    reason::SECONDARIES_LIVE,
                    format!(
                        "not releasing the address while {} still share it; delete them first",
                        describe_sharers(&s.key.namespace, &secondaries)
                    ),
                );
                continue;
            }
            let mut waiting = release_holders(s, &holders, &live, &mut specs, &mut event);
            if waiting && release_overdue(s, world.now) {
                for (node, _) in &holders {
                    specs.remove(node, &s.uid, &s.key);
                    event(
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
                clear_service(s, &mut statuses, &mut annotations);
                remove_finalizers.push(Write::RemoveFinalizer(s.key.clone()));
                event(
                    s,
                    EventType::Normal,
                    reason::RELEASED,
                    match s.first_ip() {
                        Some(ip) => format!("address {ip} released"),
                        None => "released".into(),
                    },
                );
            }
            continue;
        }

        if matches!(selection, Selection::Primary) {
            // Refused, what runs is kept, as for any Service that cannot be
            // made sense of (the primary family is immutable, so an
            // IPv6-only Service was never served).
            if !families_served(s, &mut event, &mut plan.summary.refused) {
                continue;
            }
        }
        match selection {
            Selection::Primary if !ours => {
                // A status address we did not record: Harvester's pool gave it.
                let pool_address = s.first_ip().filter(|ip| {
                    s.annotations.get(kube_vip::REQUESTED_IP).map(|v| v.trim()) != Some(*ip)
                });
                if let Some(ip) = pool_address {
                    plan.summary.refused += 1;
                    event(
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
                            networks::uplink_of(&s.annotations, world.networks, &uplinks),
                        )
                    }) {
                        Err(e) => {
                            plan.summary.refused += 1;
                            event(s, EventType::Warning, reason::INVALID, e);
                        }
                        Ok((_, Err(NoUplink::Wait))) => plan.summary.pending += 1,
                        Ok((_, Err(NoUplink::Refused(why)))) => {
                            plan.summary.refused += 1;
                            event(s, EventType::Warning, reason::NETWORK_UNRESOLVED, why);
                        }
                        // The finalizer and the holder in one pass: the
                        // finalizer is written first, and a failure there
                        // holds back every later write naming the Service
                        // (the writer's rule), so nothing is ever assigned
                        // without it. Not waiting for its echo saves a
                        // round trip on the way to an address.
                        Ok((id, Ok(uplink))) => {
                            add_finalizers.push(Write::AddFinalizer(s.key.clone()));
                            needs.push((s, id, uplink));
                        }
                    }
                }
            }
            // What runs is kept while the Service cannot be made sense of.
            Selection::Primary => match contract::address_identity(&s.uid, &s.annotations) {
                Ok(id) => match networks::uplink_of(&s.annotations, world.networks, &uplinks) {
                    Ok(uplink) => needs.push((s, id, uplink)),
                    Err(NoUplink::Wait) => plan.summary.pending += 1,
                    Err(NoUplink::Refused(why)) => {
                        plan.summary.refused += 1;
                        event(s, EventType::Warning, reason::NETWORK_UNRESOLVED, why);
                    }
                },
                Err(e) => {
                    plan.summary.refused += 1;
                    event(s, EventType::Warning, reason::INVALID, e);
                }
            },
            Selection::Invalid(e) => {
                plan.summary.refused += 1;
                event(s, EventType::Warning, reason::INVALID, e.clone());
            }
            Selection::Secondary { .. } => {} // below, once primaries are decided
            Selection::PoolMode if ours => {
                plan.summary.refused += 1;
                event(
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
                    // Released, not just dropped: whoever serves the Service
                    // next (kube-vip with its option 50, or another class)
                    // finds the address free at the server.
                    if release_holders(s, &holders, &live, &mut specs, &mut event) {
                        continue;
                    }
                    // An address on a Service that is no LoadBalancer is
                    // false information; a LoadBalancer of another class
                    // keeps what its new implementation may reuse.
                    if s.type_ != "LoadBalancer" && !s.ingress.is_empty() {
                        statuses.push(Write::ServiceStatus {
                            service: s.key.clone(),
                            ingress: Vec::new(),
                        });
                    }
                    if ours {
                        remove_finalizers.push(Write::RemoveFinalizer(s.key.clone()));
                    }
                    event(
                        s,
                        EventType::Normal,
                        reason::HANDED_OVER,
                        format!("{why}: address released and handed over"),
                    );
                }
            }
            Selection::OptedOut => {
                if ours || !holders.is_empty() {
                    if release_holders(s, &holders, &live, &mut specs, &mut event) {
                        continue;
                    }
                    // Released at the DHCP server, the address may go to
                    // anyone: the status no longer claims it. kube-vip's
                    // record stays, so kube-vip asks for the same one.
                    if !s.ingress.is_empty() {
                        statuses.push(Write::ServiceStatus {
                            service: s.key.clone(),
                            ingress: Vec::new(),
                        });
                    }
                    if ours {
                        remove_finalizers.push(Write::RemoveFinalizer(s.key.clone()));
                    }
                    event(
                        s,
                        EventType::Normal,
                        reason::HANDED_OVER,
                        format!(
                            "{}: address released and handed over; status cleared, kube-vip.io annotations kept, so kube-vip asks for the same address",
                            contract::IGNORE
                        ),
                    );
                }
            }
        }
    }

    // One identity, one Service (harvester#11122: the same MAC on two
    // nodes): a Service asking for a MAC, client identifier or address
    // another served Service has is refused, and what runs of it is kept.
    let clashes = identity_clashes(&needs, &specs);
    add_finalizers.retain(|w| !matches!(w, Write::AddFinalizer(k) if clashes.contains_key(k)));
    needs.retain(|(s, _, _)| match clashes.get(&s.key) {
        Some(why) => {
            plan.summary.refused += 1;
            event(s, EventType::Warning, reason::IDENTITY_IN_USE, why.clone());
            false
        }
        None => true,
    });

    // Holders: keep a healthy one, else place.
    let current: BTreeMap<ServiceKey, String> = needs
        .iter()
        .filter_map(|(s, _, _)| {
            specs
                .holders_of(&s.uid)
                .into_iter()
                .find(|(_, a)| !a.release)
                .map(|(n, _)| (s.key.clone(), n))
        })
        .collect();
    let service_needs: Vec<ServiceNeed> = needs
        .iter()
        .map(|(s, _, _)| ServiceNeed {
            key: s.key.clone(),
            uid: s.uid.clone(),
            only: s.local_endpoints.clone(),
        })
        .collect();
    let placement = placement::place(&service_needs, &eligible, &current);
    // The address each primary of ours stands for (for its secondaries).
    let mut primary_ip: BTreeMap<ServiceKey, String> = BTreeMap::new();
    for (s, id, uplink) in &needs {
        let was = current.get(&s.key);
        let holder = match placement.get(&s.key).cloned().flatten() {
            Some(h) => {
                for (node, _) in specs.holders_of(&s.uid) {
                    if node != h {
                        specs.remove(&node, &s.uid, &s.key);
                    }
                }
                specs.put(&h, assignment_of(s, id, uplink.clone()), &s.key);
                match was {
                    None => event(
                        s,
                        EventType::Normal,
                        reason::HOLDER_CHOSEN,
                        format!("{h} holds the address"),
                    ),
                    Some(old) if *old != h => event(
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
                event(
                    s,
                    EventType::Warning,
                    reason::NO_ELIGIBLE_NODE,
                    match &s.local_endpoints {
                        Some(local) => format!(
                            "no node can hold the address now: externalTrafficPolicy: Local and no eligible node has a ready endpoint ({} with one, {} of {} eligible)",
                            local.len(),
                            eligible.len(),
                            node_names.len()
                        ),
                        None => format!(
                            "no node can hold the address now ({} of {} eligible)",
                            eligible.len(),
                            node_names.len()
                        ),
                    },
                );
                was.cloned()
            }
        };
        let address = holder.as_deref().and_then(|h| {
            live.get(h)
                .and_then(|o| o.bound_address(&s.key.to_string(), &id.interface))
                .map(|ip| (h, ip))
        });
        // An address no DHCP server of the VM network would give: not
        // published, and the Service waits.
        let address = match address {
            Some((holder, ip)) => match implausible(ip, s, &world) {
                Some(why) => {
                    event(
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
            plan.summary.pending += 1;
            if let Some(ip) = s.first_ip() {
                primary_ip.insert(s.key.clone(), ip.to_string());
            }
            continue;
        };
        plan.summary.served += 1;
        primary_ip.insert(s.key.clone(), ip.to_string());
        if let Some(w) = status_write(s, ip, world.ip_mode) {
            statuses.push(w);
            event(
                s,
                EventType::Normal,
                reason::ADDRESS_ASSIGNED,
                format!("{ip} held by {holder}"),
            );
        }
        let record = [
            (kube_vip::HWADDR, crate::mac::format(&id.mac)),
            (kube_vip::REQUESTED_IP, ip.to_string()),
            (kube_vip::VIP_HOST, holder.to_string()),
        ];
        let set: BTreeMap<String, Option<String>> = record
            .into_iter()
            .filter(|(k, v)| s.annotations.get(*k) != Some(v))
            .map(|(k, v)| (k.to_string(), Some(v)))
            .collect();
        if !set.is_empty() {
            annotations.push(Write::ServiceAnnotations {
                service: s.key.clone(),
                set,
            });
        }
    }

    // Secondaries share their primary's address, ports apart.
    let mut by_primary: BTreeMap<&ServiceKey, Vec<&ServiceIn>> = BTreeMap::new();
    for s in &services {
        if s.deleting {
            continue;
        }
        let Selection::Secondary { primary } = &selections[&s.key] else {
            continue;
        };
        if !families_served(s, &mut event, &mut plan.summary.refused) {
            continue;
        }
        // Across namespaces only with the primary's consent, and a refusal
        // that reads the same whether the primary exists or not: a tenant
        // learns nothing of another namespace's Services by naming them.
        let consented = |p: &&&ServiceIn| {
            contract::shares_with(&p.key.namespace, &p.annotations, &s.key.namespace)
        };
        let Some(p) = by_key.get(primary).filter(consented) else {
            plan.summary.refused += 1;
            event(
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
        match &selections[&p.key] {
            Selection::Secondary { .. } => {
                plan.summary.refused += 1;
                event(
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
                plan.summary.refused += 1;
                event(
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
    let mut sharing: BTreeSet<&ServiceKey> = BTreeSet::new();
    for (primary, mut secondaries) in by_primary {
        let Some(ip) = primary_ip.get(primary) else {
            continue; // no address yet: nothing to share
        };
        // Those already sharing keep their ports; the rest by name.
        secondaries.sort_by_key(|s| (s.first_ip() != Some(ip.as_str()), s.key.clone()));
        let mut used: BTreeMap<Port, &ServiceKey> = by_key[primary]
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
                plan.summary.refused += 1;
                event(
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
            plan.summary.shared += 1;
            sharing.insert(&s.key);
            if let Some(w) = status_write(s, ip, world.ip_mode) {
                statuses.push(w);
                event(
                    s,
                    EventType::Normal,
                    reason::ADDRESS_SHARED,
                    format!("shares {ip} with {primary}"),
                );
            }
        }
    }

    // A Service that shows an address we serve for another Service, without
    // sharing it (refused, or its primary-service annotation removed),
    // loses it: its status would send clients to ports nobody serves for
    // it. Only class-less ones and our class's: another class is never
    // touched, and Services of ours are handled above.
    let served_ips: BTreeSet<&str> = primary_ip.values().map(String::as_str).collect();
    for s in &services {
        let ours_to_clear = !s.deleting
            && !s.has_our_finalizer()
            && !sharing.contains(&s.key)
            && !matches!(selections[&s.key], Selection::Primary)
            && s.load_balancer_class
                .as_deref()
                .is_none_or(|c| c == world.classes.class)
            && s.first_ip().is_some_and(|ip| served_ips.contains(ip));
        if ours_to_clear {
            statuses.push(Write::ServiceStatus {
                service: s.key.clone(),
                ingress: Vec::new(),
            });
            event(
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

    // Assignments of Services that are gone (their finalizer removed by
    // someone else): release where a live holder still runs the lease.
    let uids: BTreeSet<&str> = services.iter().map(|s| s.uid.as_str()).collect();
    let orphans: Vec<(String, Assignment)> = specs
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
        let running = live
            .get(node.as_str())
            .is_some_and(|o| o.eligible && o.lists_lease(&a.service, &a.interface));
        if running {
            if !a.release {
                specs.put(&node, Assignment { release: true, ..a }, &key);
            }
        } else {
            specs.remove(&node, &a.uid, &key);
        }
    }

    plan.writes = add_finalizers;
    plan.writes.extend(creates);
    plan.writes.extend(specs.writes());
    plan.writes.extend(statuses);
    plan.writes.extend(annotations);
    plan.writes.extend(remove_finalizers);
    plan.writes.extend(deletes);
    plan
}

/// Asks every live holder of `s` that still runs its lease to send
/// DHCPRELEASE, and drops the assignments of holders that do not (down, or
/// done releasing). True while some holder is still releasing.
fn release_holders(
    s: &ServiceIn,
    holders: &[(String, Assignment)],
    live: &BTreeMap<&str, &NodeIn>,
    specs: &mut Specs,
    event: &mut impl FnMut(&ServiceIn, EventType, &'static str, String),
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
                event(
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
                event(
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
    let set: BTreeMap<String, Option<String>> = OUR_ANNOTATIONS
        .iter()
        .filter(|k| s.annotations.contains_key(**k))
        .map(|k| (k.to_string(), None))
        .collect();
    if !set.is_empty() {
        annotations.push(Write::ServiceAnnotations {
            service: s.key.clone(),
            set,
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::contract::node_object::LeaseReport;
    use crate::contract::{Annotations, ClassPolicy, FINALIZER};
    use crate::controller::networks::NetworkMap;

    const NS: &str = "default";

    fn key(name: &str) -> ServiceKey {
        ServiceKey {
            namespace: NS.into(),
            name: name.into(),
        }
    }

    fn uid(name: &str) -> String {
        let h = contract::fnv1a(&[name.as_bytes()]);
        format!("{:08x}-0000-4000-8000-{:012x}", h as u32, h >> 16)
    }

    fn port(p: i32) -> Port {
        Port {
            port: p,
            protocol: "TCP".into(),
        }
    }

    /// A DHCP-mode LoadBalancer as the cloud provider leaves it.
    fn dhcp(name: &str, ports: &[i32]) -> ServiceIn {
        ServiceIn {
            key: key(name),
            uid: uid(name),
            type_: "LoadBalancer".into(),
            load_balancer_class: None,
            ip_families: vec!["IPv4".into()],
            cluster_ips: Vec::new(),
            local_endpoints: None,
            annotations: [(harvester::IPAM.to_string(), "dhcp".to_string())].into(),
            ports: ports.iter().map(|p| port(*p)).collect(),
            ingress: Vec::new(),
            finalizers: Vec::new(),
            deleting: false,
            deleting_since: 0,
            created: 0,
        }
    }

    fn secondary(name: &str, primary: &str, ports: &[i32]) -> ServiceIn {
        let mut s = dhcp(name, ports);
        s.annotations = [(
            harvester::PRIMARY_SERVICE.to_string(),
            format!("{NS}/{primary}"),
        )]
        .into();
        s
    }

    /// The cluster, the API server and the node agents, as far as the
    /// controller's writes go.
    #[derive(Debug, Clone)]
    struct Sim {
        services: Vec<ServiceIn>,
        nodes: Vec<String>,
        objects: Vec<NodeIn>,
        access: BTreeSet<String>,
        /// Nodes whose agents run (they are eligible and report leases).
        up: BTreeSet<String>,
        /// Addresses the DHCP server hands out, by client.
        next_ip: u8,
        given: BTreeMap<String, String>,
        networks: NetworkMap,
        classes: ClassPolicy,
        ip_mode: bool,
        node_networks: NodeNetworks,
        now: i64,
    }

    impl Sim {
        fn new(nodes: &[&str]) -> Sim {
            let mut sim = Sim {
                services: Vec::new(),
                nodes: nodes.iter().map(|n| n.to_string()).collect(),
                objects: Vec::new(),
                access: BTreeSet::new(),
                up: nodes.iter().map(|n| n.to_string()).collect(),
                next_ip: 150,
                given: BTreeMap::new(),
                networks: NetworkMap::parse(Some(r#"{"default/net123":"enp2s0"}"#)),
                classes: ClassPolicy::default(),
                ip_mode: true,
                node_networks: NodeNetworks::default(),
                now: 1_000_000,
            };
            sim.settle();
            sim
        }

        fn plan(&self) -> Plan {
            reconcile(World {
                services: &self.services,
                nodes: &self.nodes,
                node_objects: &self.objects,
                access_ensured: &self.access,
                networks: &self.networks,
                classes: &self.classes,
                ip_mode: self.ip_mode,
                node_networks: &self.node_networks,
                now: self.now,
            })
        }

        fn svc(&self, name: &str) -> &ServiceIn {
            self.services.iter().find(|s| s.key == key(name)).unwrap()
        }

        fn svc_mut(&mut self, name: &str) -> &mut ServiceIn {
            self.services
                .iter_mut()
                .find(|s| s.key == key(name))
                .unwrap()
        }

        fn holders(&self, name: &str) -> Vec<(String, Assignment)> {
            self.objects
                .iter()
                .flat_map(|o| {
                    o.spec
                        .assignments
                        .iter()
                        .filter(|a| a.service == format!("{NS}/{name}"))
                        .map(|a| (o.name.clone(), a.clone()))
                })
                .collect()
        }

        fn apply(&mut self, plan: &Plan) {
            for w in &plan.writes {
                match w {
                    Write::AddFinalizer(k) => {
                        let s = self.services.iter_mut().find(|s| s.key == *k).unwrap();
                        if !s.finalizers.iter().any(|f| f == FINALIZER) {
                            s.finalizers.push(FINALIZER.into());
                        }
                    }
                    Write::RemoveFinalizer(k) => {
                        let s = self.services.iter_mut().find(|s| s.key == *k).unwrap();
                        s.finalizers.retain(|f| f != FINALIZER);
                    }
                    Write::ServiceStatus { service, ingress } => {
                        self.services
                            .iter_mut()
                            .find(|s| s.key == *service)
                            .unwrap()
                            .ingress = ingress.clone();
                    }
                    Write::ServiceAnnotations { service, set } => {
                        let s = self
                            .services
                            .iter_mut()
                            .find(|s| s.key == *service)
                            .unwrap();
                        for (k, v) in set {
                            for forbidden in
                                [kube_vip::LOADBALANCER_IPS, "cloudprovider.harvesterhci.io/"]
                            {
                                assert!(!k.starts_with(forbidden), "never ours to write: {k}");
                            }
                            match v {
                                Some(v) => s.annotations.insert(k.clone(), v.clone()),
                                None => s.annotations.remove(k),
                            };
                        }
                    }
                    Write::CreateNodeObject(n) => self.objects.push(NodeIn {
                        name: n.clone(),
                        ..Default::default()
                    }),
                    Write::EnsureNodeAccess(n) => {
                        self.access.insert(n.clone());
                    }
                    Write::SetSpec { node, spec, .. } => {
                        self.objects
                            .iter_mut()
                            .find(|o| o.name == *node)
                            .unwrap()
                            .spec = spec.clone();
                    }
                    Write::DeleteNodeObject(n) => self.objects.retain(|o| o.name != *n),
                }
            }
            // The API server deletes a deleted object once no finalizer is left.
            self.services
                .retain(|s| !(s.deleting && s.finalizers.is_empty()));
        }

        /// The agents act on their specs and report.
        fn agents(&mut self) {
            for o in &mut self.objects {
                o.eligible = self.up.contains(&o.name);
                if !o.eligible {
                    continue; // a dead agent reports nothing new
                }
                let mut leases = Vec::new();
                for a in &o.spec.assignments {
                    if a.release {
                        self.given.remove(&a.uid); // DHCPRELEASE
                        continue;
                    }
                    let ip = self.given.entry(a.uid.clone()).or_insert_with(|| {
                        let ip = a
                            .requested_ip
                            .clone()
                            .unwrap_or(format!("10.77.0.{}", self.next_ip));
                        self.next_ip += 1;
                        ip
                    });
                    leases.push(LeaseReport {
                        service: a.service.clone(),
                        interface: a.interface.clone(),
                        state: BOUND.into(),
                        address: Some(ip.clone()),
                        mac: a.mac.clone(),
                        ..Default::default()
                    });
                }
                o.status.leases = leases;
                o.status.ready = true;
            }
        }

        /// Reconcile and let the world answer until nothing is written;
        /// returns every plan on the way.
        fn settle(&mut self) -> Vec<Plan> {
            let mut plans = Vec::new();
            for _ in 0..10 {
                self.agents();
                let p = self.plan();
                if p.writes.is_empty() {
                    plans.push(p);
                    return plans;
                }
                self.apply(&p);
                plans.push(p);
            }
            panic!("no fixed point after 10 rounds: {:#?}", plans.last());
        }
    }

    fn events(plans: &[Plan]) -> Vec<(&'static str, String)> {
        plans
            .iter()
            .flat_map(|p| p.events.iter().map(|e| (e.reason, e.message.clone())))
            .collect()
    }

    fn reasons(plans: &[Plan]) -> Vec<&'static str> {
        events(plans).into_iter().map(|(r, _)| r).collect()
    }

    #[test]
    fn nodes_get_an_object_and_access_and_lose_them_with_the_node() {
        let mut sim = Sim::new(&[]);
        sim.nodes = vec!["n1".into(), "n2".into()];
        let p = sim.plan();
        assert_eq!(
            p.writes,
            vec![
                Write::CreateNodeObject("n1".into()),
                Write::CreateNodeObject("n2".into()),
                Write::EnsureNodeAccess("n1".into()),
                Write::EnsureNodeAccess("n2".into()),
            ]
        );
        sim.settle();
        assert_eq!(sim.objects.len(), 2);
        sim.nodes.retain(|n| n != "n2");
        assert_eq!(
            sim.plan().writes,
            vec![Write::DeleteNodeObject("n2".into())]
        );
    }

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
        let id = contract::address_identity(&uid("web"), &Annotations::new()).unwrap();
        assert_eq!(a.interface, id.interface);
        assert_eq!(a.mac, crate::mac::format(&id.mac));
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
            .insert(contract::IGNORE.into(), "true".into());
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
    fn handing_over_from_a_down_holder_drops_without_waiting() {
        let mut sim = Sim::new(&["n1"]);
        sim.services.push(dhcp("web", &[80]));
        sim.settle();
        sim.up.remove("n1");
        sim.svc_mut("web")
            .annotations
            .insert(contract::IGNORE.into(), "true".into());
        let plans = sim.settle();
        assert!(sim.holders("web").is_empty());
        assert!(sim.svc("web").finalizers.is_empty());
        assert_eq!(
            reasons(&plans),
            vec![reason::RELEASED_WITHOUT_DHCPRELEASE, reason::HANDED_OVER]
        );
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

    fn in_namespace(mut s: ServiceIn, namespace: &str) -> ServiceIn {
        s.key.namespace = namespace.into();
        s.uid = uid(&format!("{namespace}/{}", s.key.name));
        s
    }

    fn ns_key(namespace: &str, name: &str) -> ServiceKey {
        ServiceKey {
            namespace: namespace.into(),
            name: name.into(),
        }
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
        assert!(said("thief").1.contains(contract::SHARE_WITH));
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
            .insert(contract::SHARE_WITH.into(), "team-a".into());
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
            .remove(contract::SHARE_WITH);
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

    #[test]
    fn an_implausible_reported_address_is_not_published() {
        let mut sim = Sim::new(&["n1"]);
        sim.node_networks
            .add(&["10.77.0.10", "fd00::10"], &["10.42.0.0/24"]);
        let mut kubernetes = dhcp("kubernetes", &[443]);
        kubernetes.type_ = "ClusterIP".into();
        kubernetes.annotations.clear();
        kubernetes.cluster_ips = vec!["10.96.0.1".into()];
        let mut pool = dhcp("pool", &[80]);
        pool.annotations = [(harvester::IPAM.to_string(), "pool".to_string())].into();
        pool.ingress = vec![Ingress {
            ip: "10.77.0.9".into(),
            ip_mode: None,
            ports: vec![port(80)],
        }];
        sim.services.extend([kubernetes, pool]);
        // What a node with stolen credentials could report.
        let lies = [
            ("a", "10.96.0.1", "cluster IP"),
            ("b", "10.77.0.10", "Node's own address"),
            ("c", "10.42.0.7", "Pod CIDR 10.42.0.0/24"),
            ("d", "10.77.0.9", "another Service's"),
            ("e", "127.0.0.1", "not a unicast host address"),
        ];
        for (name, lie, _) in lies {
            let s = dhcp(name, &[80]);
            sim.given.insert(s.uid.clone(), lie.into());
            sim.services.push(s);
        }
        let plans = sim.settle();
        for (name, lie, why) in lies {
            assert!(sim.svc(name).ingress.is_empty(), "{name} published {lie}");
            assert!(
                plans
                    .iter()
                    .flat_map(|p| &p.events)
                    .any(|e| e.service == key(name)
                        && e.reason == reason::ADDRESS_IMPLAUSIBLE
                        && e.message.contains(why)),
                "{name}: {plans:?}"
            );
        }
        assert_eq!(sim.svc("pool").ingress[0].ip, "10.77.0.9");
        // A plausible report is published.
        sim.given.insert(uid("a"), "10.77.0.150".into());
        sim.settle();
        assert_eq!(sim.svc("a").ingress[0].ip, "10.77.0.150");
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

    #[test]
    fn a_named_class_serves_that_class_and_class_less_ones_only_when_asked() {
        let mut sim = Sim::new(&["n1"]);
        sim.classes = ClassPolicy {
            class: "example.com/dhcp".into(),
            classless: false,
        };
        let mut named = dhcp("named", &[80]);
        named.load_balancer_class = Some("example.com/dhcp".into());
        named.annotations.clear();
        sim.services.push(named);
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

    #[test]
    fn ip_mode_is_written_only_where_the_server_knows_it() {
        let mut sim = Sim::new(&["n1"]);
        sim.ip_mode = false;
        sim.services.push(dhcp("web", &[80]));
        sim.settle();
        assert_eq!(sim.svc("web").ingress[0].ip_mode, None);
        // A server that learned the field (an upgrade): written once.
        sim.ip_mode = true;
        let plans = sim.settle();
        assert_eq!(
            sim.svc("web").ingress[0].ip_mode.as_deref(),
            Some(IP_MODE_VIP)
        );
        assert_eq!(plans.len(), 2, "one write, then settled: {plans:?}");
    }

    #[test]
    fn dhcp_serves_the_ipv4_family_and_refuses_ipv6_only() {
        let mut sim = Sim::new(&["n1"]);
        let mut v6 = dhcp("v6", &[80]);
        v6.ip_families = vec!["IPv6".into()];
        let mut dual = dhcp("dual", &[80]);
        dual.ip_families = vec!["IPv6".into(), "IPv4".into()];
        let mut v6_secondary = secondary("v6-secondary", "dual", &[81]);
        v6_secondary.ip_families = vec!["IPv6".into()];
        sim.services.extend([v6, dual, v6_secondary]);
        let plans = sim.settle();
        let said: Vec<(&str, String)> = events(&plans);
        let about = |name: &str, reason: &str| {
            plans.iter().flat_map(|p| &p.events).any(|e| {
                e.service == key(name)
                    && e.reason == reason
                    && e.message.contains("DHCP-mode addresses are IPv4")
            })
        };
        assert!(about("v6", reason::IPV4_REQUIRED), "{said:?}");
        assert!(about("v6-secondary", reason::IPV4_REQUIRED), "{said:?}");
        assert!(about("dual", reason::IPV6_NOT_SERVED), "{said:?}");
        let v6 = sim.svc("v6");
        assert!(v6.ingress.is_empty() && v6.finalizers.is_empty());
        assert!(sim.holders("v6").is_empty());
        assert!(sim.svc("v6-secondary").ingress.is_empty());
        let dual = sim.svc("dual");
        assert_eq!(dual.ingress.len(), 1);
        assert!(dual.ingress[0].ip.parse::<std::net::Ipv4Addr>().is_ok());
        assert_eq!(plans.last().unwrap().summary.refused, 2);
        // The IPv4 family added (ipFamilyPolicy: PreferDualStack): served.
        sim.svc_mut("v6").ip_families.push("IPv4".into());
        sim.settle();
        assert_eq!(sim.svc("v6").ingress.len(), 1);
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

    #[test]
    fn a_deleted_nodes_services_move() {
        let mut sim = Sim::new(&["n1", "n2"]);
        sim.services.push(dhcp("web", &[80]));
        sim.settle();
        let (was, _) = sim.holders("web")[0].clone();
        sim.nodes.retain(|n| *n != was);
        sim.settle();
        let now = sim.holders("web");
        assert_eq!(now.len(), 1);
        assert_ne!(now[0].0, was);
        assert!(sim.objects.iter().all(|o| o.name != was));
    }
}
