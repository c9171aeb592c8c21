//! A simulated cluster to run decisions in: Services as the cloud
//! provider leaves them, and the API server and node agents answering the
//! writes, as plain data. The unit tests of the decisions run in it, and
//! so does the pass benchmark (`cargo bench --bench reconcile`), which is
//! why it is public; nothing else uses it.

use std::collections::{BTreeMap, BTreeSet};

use crate::networks::NetworkMap;
#[cfg(test)]
use hna_contract::node_object::Assignment;
use hna_contract::node_object::LeaseReport;
use hna_contract::{self, ClassPolicy, FINALIZER, ServiceKey, harvester, kube_vip};

use super::{BOUND, NodeIn, NodeNetworks, Plan, Port, ServiceIn, World, Write, reconcile};

pub(crate) const NS: &str = "default";

pub(crate) fn key(name: &str) -> ServiceKey {
    ServiceKey {
        namespace: NS.into(),
        name: name.into(),
    }
}

pub(crate) fn uid(name: &str) -> String {
    let h = hna_contract::fnv1a(&[name.as_bytes()]);
    format!("{:08x}-0000-4000-8000-{:012x}", h as u32, h >> 16)
}

pub(crate) fn port(p: i32) -> Port {
    Port {
        port: p,
        protocol: "TCP".into(),
    }
}

/// A DHCP-mode LoadBalancer as the cloud provider leaves it.
pub fn dhcp(name: &str, ports: &[i32]) -> ServiceIn {
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
        generation: 1,
        assigned_for: None,
        finalizers: Vec::new(),
        deleting: false,
        deleting_since: 0,
        created: 0,
    }
}

#[cfg(test)]
pub(crate) fn secondary(name: &str, primary: &str, ports: &[i32]) -> ServiceIn {
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
pub struct Sim {
    pub services: Vec<ServiceIn>,
    pub(crate) nodes: Vec<String>,
    pub(crate) objects: Vec<NodeIn>,
    pub(crate) access: BTreeSet<String>,
    /// Nodes whose agents run (they are eligible and report leases).
    pub up: BTreeSet<String>,
    /// Addresses the DHCP server hands out, by client.
    /// The next address the DHCP server gives, counted up from 10.77.0.150.
    pub(crate) next_ip: u32,
    pub(crate) given: BTreeMap<String, String>,
    pub(crate) networks: NetworkMap,
    pub(crate) classes: ClassPolicy,
    pub(crate) ip_mode: bool,
    pub(crate) node_networks: NodeNetworks,
    pub(crate) now: i64,
    pub(crate) avoid: crate::service_health::Avoid,
}

impl Sim {
    pub fn new(nodes: &[&str]) -> Sim {
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
            avoid: Default::default(),
        };
        sim.settle();
        sim
    }

    pub fn plan(&self) -> Plan {
        reconcile(World {
            services: &self.services,
            nodes: &self.nodes,
            node_objects: &self.objects,
            access_ensured: &self.access,
            networks: &self.networks,
            classes: &self.classes,
            ip_mode: self.ip_mode,
            node_networks: &self.node_networks,
            avoid: &self.avoid,
            now: self.now,
        })
    }

    #[cfg(test)]
    pub(crate) fn svc(&self, name: &str) -> &ServiceIn {
        self.services.iter().find(|s| s.key == key(name)).unwrap()
    }

    #[cfg(test)]
    pub(crate) fn svc_mut(&mut self, name: &str) -> &mut ServiceIn {
        self.services
            .iter_mut()
            .find(|s| s.key == key(name))
            .unwrap()
    }

    #[cfg(test)]
    pub(crate) fn holders(&self, name: &str) -> Vec<(String, Assignment)> {
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

    pub(crate) fn apply(&mut self, plan: &Plan) {
        // By key: the benchmark applies tens of thousands of writes.
        let at: std::collections::HashMap<ServiceKey, usize> = self
            .services
            .iter()
            .enumerate()
            .map(|(i, s)| (s.key.clone(), i))
            .collect();
        for w in &plan.writes {
            match w {
                Write::AddFinalizer(k) => {
                    let s = &mut self.services[at[k]];
                    if !s.finalizers.iter().any(|f| f == FINALIZER) {
                        s.finalizers.push(FINALIZER.into());
                    }
                }
                Write::RemoveFinalizer(k) => {
                    let s = &mut self.services[at[k]];
                    s.finalizers.retain(|f| f != FINALIZER);
                }
                Write::ServiceStatus {
                    service,
                    ingress,
                    assigned,
                } => {
                    let s = &mut self.services[at[service]];
                    s.ingress = ingress.clone();
                    s.assigned_for = assigned.map(|a| a.generation);
                }
                Write::ServiceAnnotations { service, set } => {
                    let s = &mut self.services[at[service]];
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
                        .spec
                        .assignments = spec.assignments.clone();
                }
                Write::SetPeers { node, peers } => {
                    self.objects
                        .iter_mut()
                        .find(|o| o.name == *node)
                        .unwrap()
                        .spec
                        .peers = peers.clone();
                }
                Write::DeleteNodeObject(n) => self.objects.retain(|o| o.name != *n),
            }
        }
        // The API server deletes a deleted object once no finalizer is left.
        self.services
            .retain(|s| !(s.deleting && s.finalizers.is_empty()));
    }

    /// The agents act on their specs and report.
    pub fn agents(&mut self) {
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
                    let ip = a.requested_ip.clone().unwrap_or_else(|| {
                        std::net::Ipv4Addr::from(
                            u32::from(std::net::Ipv4Addr::new(10, 77, 0, 0)) + self.next_ip,
                        )
                        .to_string()
                    });
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
    pub fn settle(&mut self) -> Vec<Plan> {
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

#[cfg(test)]
pub(crate) fn events(plans: &[Plan]) -> Vec<(&'static str, String)> {
    plans
        .iter()
        .flat_map(|p| p.events.iter().map(|e| (e.reason, e.message.clone())))
        .collect()
}

#[cfg(test)]
pub(crate) fn reasons(plans: &[Plan]) -> Vec<&'static str> {
    events(plans).into_iter().map(|(r, _)| r).collect()
}

#[cfg(test)]
pub(crate) fn in_namespace(mut s: ServiceIn, namespace: &str) -> ServiceIn {
    s.key.namespace = namespace.into();
    s.uid = uid(&format!("{namespace}/{}", s.key.name));
    s
}

#[cfg(test)]
pub(crate) fn ns_key(namespace: &str, name: &str) -> ServiceKey {
    ServiceKey {
        namespace: namespace.into(),
        name: name.into(),
    }
}
