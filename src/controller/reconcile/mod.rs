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

pub use annotations::OUR_ANNOTATIONS;
pub use events::{EventOut, EventType, reason};
pub use plan::{Plan, Summary, Write};
pub use release::{RELEASE_TIMEOUT_SECS, release_overdue};
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

#[cfg(test)]
mod tests {
    use std::collections::{BTreeMap, BTreeSet};

    use super::*;
    use crate::contract::node_object::{Assignment, LeaseReport};
    use crate::contract::{
        self, Annotations, ClassPolicy, FINALIZER, ServiceKey, harvester, kube_vip,
    };
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
