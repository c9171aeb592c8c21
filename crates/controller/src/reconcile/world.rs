//! What one decision reads: the Services, Nodes and node objects as plain
//! data, already judged for eligibility, so that the decision needs no
//! client and no clock of its own.

use std::collections::BTreeSet;
use std::net::Ipv4Addr;

use crate::networks::NetworkMap;
use hna_contract::node_object::{Spec, Status};
use hna_contract::{Annotations, ClassPolicy, FINALIZER, ServiceKey, ServiceView};

/// The DHCP state of a lease that holds its address.
pub const BOUND: &str = "BOUND";

/// One port of a Service (`spec.ports[]`, as the ingress lists it).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct Port {
    pub(crate) port: i32,
    pub(crate) protocol: String,
}

impl std::fmt::Display for Port {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.port, self.protocol)
    }
}

/// One entry of `status.loadBalancer.ingress`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Ingress {
    pub ip: String,
    /// `ipMode` ([`IP_MODE_VIP`] when written by us on a server that knows
    /// the field).
    pub ip_mode: Option<String>,
    pub ports: Vec<Port>,
}

/// `ipMode: VIP`: the address is delivered to the nodes with the
/// destination unchanged (it is held on a node's macvlan), so kube-proxy
/// may short-circuit traffic from inside the cluster to it.
pub const IP_MODE_VIP: &str = "VIP";

/// A Service as the decision needs it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServiceIn {
    pub(crate) key: ServiceKey,
    pub(crate) uid: String,
    /// `spec.type`.
    pub(crate) type_: String,
    pub(crate) load_balancer_class: Option<String>,
    /// `spec.ipFamilies` (empty: not set, IPv4 on an IPv4 cluster).
    pub(crate) ip_families: Vec<String>,
    /// `spec.clusterIPs`: never a load-balancer address.
    pub(crate) cluster_ips: Vec<String>,
    /// `externalTrafficPolicy: Local`: the nodes with a ready endpoint,
    /// the only ones that may hold the address. `None`: `Cluster`.
    pub(crate) local_endpoints: Option<BTreeSet<String>>,
    pub(crate) annotations: Annotations,
    pub(crate) ports: Vec<Port>,
    /// `status.loadBalancer.ingress` now.
    pub ingress: Vec<Ingress>,
    /// `metadata.generation` (0 unknown).
    pub(crate) generation: i64,
    /// The `observedGeneration` of our condition
    /// ([`SERVICE_CONDITION`](hna_contract::SERVICE_CONDITION)) while
    /// it is there and `True`.
    pub(crate) assigned_for: Option<i64>,
    pub(crate) finalizers: Vec<String>,
    /// `metadata.deletionTimestamp` is set.
    pub(crate) deleting: bool,
    /// `metadata.deletionTimestamp` in seconds (0 unknown).
    pub(crate) deleting_since: i64,
    /// `metadata.creationTimestamp` in seconds (0 unknown): between two
    /// Services asking for one identity, the older one has it.
    pub(crate) created: i64,
}

impl ServiceIn {
    pub(super) fn view(&self) -> ServiceView {
        ServiceView {
            type_: self.type_.clone(),
            load_balancer_class: self.load_balancer_class.clone(),
            annotations: self.annotations.clone(),
        }
    }

    pub(super) fn has_our_finalizer(&self) -> bool {
        self.finalizers.iter().any(|f| f == FINALIZER)
    }

    /// Without a `loadBalancerClass`, or with `class`: never a Service
    /// another implementation's class selects.
    pub(super) fn classless_or(&self, class: &str) -> bool {
        self.load_balancer_class
            .as_deref()
            .is_none_or(|c| c == class)
    }

    pub(super) fn first_ip(&self) -> Option<&str> {
        self.ingress.first().map(|i| i.ip.as_str())
    }
}

/// A `LoadBalancerNode` as the decision needs it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct NodeIn {
    pub(crate) name: String,
    pub(crate) spec: Spec,
    pub(crate) status: Status,
    /// Ready and heartbeating, judged on the controller's clock
    /// (`crate::liveness`).
    pub(crate) eligible: bool,
    /// Eligible only to keep what it holds: its heartbeat is late by its
    /// stated period, or stale while a witness still hears it on the LAN
    /// (cut off from the API server), so it serves on but cannot read a
    /// new assignment.
    pub(crate) keep_only: bool,
    /// Dead on its LAN by its witnesses' word, yet it said so itself and
    /// its heartbeat is on time (`crate::lan_verdict::LetGo`): it still reads its
    /// assignments, and may still answer where its witnesses cannot hear
    /// it (its gateway, the clients on its side of a broken switch), where
    /// a new holder's takeover guard cannot hear it either. An address it
    /// reports held goes to another node only once it reports it gone.
    pub(crate) lets_go_first: bool,
    /// Not yet seen writing by this controller (`Liveness::written`): it
    /// keeps what it holds, and is given a new Service only when no other
    /// node can take it.
    pub(crate) unproven: bool,
    /// The object's `metadata.generation`: the version of its spec, which
    /// the agent echoes in `status.observedGeneration` once it read it.
    pub(crate) generation: Option<i64>,
}

impl NodeIn {
    /// The address of the lease for `service` on `interface`, if it holds
    /// one: BOUND, or renewing or rebinding it (the address stays
    /// configured while the lease is extended).
    pub(crate) fn bound_address(&self, service: &str, interface: &str) -> Option<&str> {
        self.status
            .leases
            .iter()
            .find(|l| {
                l.service == service
                    && l.interface == interface
                    && matches!(l.state.as_str(), BOUND | "RENEWING" | "REBINDING")
            })
            .and_then(|l| l.address.as_deref())
    }

    /// Whether the agent still reports a lease (in any state) there.
    pub(super) fn lists_lease(&self, service: &str, interface: &str) -> bool {
        self.status
            .leases
            .iter()
            .any(|l| l.service == service && l.interface == interface)
    }
}

/// Everything one decision reads.
#[derive(Debug, Clone, Copy)]
pub struct World<'a> {
    pub(crate) services: &'a [ServiceIn],
    /// The names of the Kubernetes Nodes.
    pub(crate) nodes: &'a [String],
    pub(crate) node_objects: &'a [NodeIn],
    /// The nodes whose Role and RoleBinding this process has applied.
    pub(crate) access_ensured: &'a BTreeSet<String>,
    /// VM network → interface (`cloudprovider.harvesterhci.io/network`).
    pub(crate) networks: &'a NetworkMap,
    /// Which `loadBalancerClass` values are ours.
    pub(crate) classes: &'a ClassPolicy,
    /// The Nodes' own addresses and Pod CIDRs: never a load-balancer
    /// address.
    pub(crate) node_networks: &'a NodeNetworks,
    /// Now, in seconds on the controller's wall clock (for how long a
    /// deletion has waited).
    pub(crate) now: i64,
    /// The nodes that could not serve a Service lately, per Service
    /// (`namespace/name`), judged on the controller's clock
    /// (`crate::service_health`).
    pub(crate) avoid: &'a crate::service_health::Avoid,
    /// The API server knows `status.loadBalancer.ingress[].ipMode`
    /// (Kubernetes 1.30 and later): it is written as [`IP_MODE_VIP`].
    pub(crate) ip_mode: bool,
}

/// What the Nodes say of their own networks (`status.addresses`,
/// `spec.podCIDRs`), IPv4 only.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct NodeNetworks {
    pub(crate) addresses: BTreeSet<Ipv4Addr>,
    /// `(network, prefix length)`.
    pub(crate) pod_cidrs: Vec<(Ipv4Addr, u8)>,
}

impl NodeNetworks {
    /// Adds a Node's `status.addresses[].address` and `spec.podCIDRs`
    /// (IPv6 and malformed entries are skipped).
    pub(crate) fn add(&mut self, addresses: &[&str], pod_cidrs: &[&str]) {
        self.addresses
            .extend(addresses.iter().filter_map(|a| a.parse::<Ipv4Addr>().ok()));
        self.pod_cidrs.extend(pod_cidrs.iter().filter_map(|c| {
            let (net, len) = c.split_once('/')?;
            Some((
                net.parse().ok()?,
                len.parse().ok().filter(|l: &u8| *l <= 32)?,
            ))
        }));
    }

    pub(super) fn pod_cidr_of(&self, ip: Ipv4Addr) -> Option<(Ipv4Addr, u8)> {
        self.pod_cidrs.iter().copied().find(|(net, len)| {
            let mask = u32::MAX.checked_shl(32 - u32::from(*len)).unwrap_or(0);
            u32::from(ip) & mask == u32::from(*net) & mask
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use hna_contract::node_object::LeaseReport;

    /// A lease being renewed or rebound keeps its address on its link:
    /// the Service stays published (the agent writes neither step on its
    /// own; a backstop write may carry either).
    #[test]
    fn a_lease_renewing_or_rebinding_still_holds_its_address() {
        for (state, holds) in [
            ("BOUND", true),
            ("RENEWING", true),
            ("REBINDING", true),
            ("REQUESTING", false),
            ("FAILED", false),
            ("GUARDED", false),
        ] {
            let node = NodeIn {
                status: Status {
                    leases: vec![LeaseReport {
                        service: "default/web".into(),
                        interface: "hlb-3f2a9c1e".into(),
                        state: state.into(),
                        address: Some("10.77.0.150".into()),
                        ..LeaseReport::default()
                    }],
                    ..Status::default()
                },
                ..NodeIn::default()
            };
            assert_eq!(
                node.bound_address("default/web", "hlb-3f2a9c1e").is_some(),
                holds,
                "{state}"
            );
        }
    }
}
