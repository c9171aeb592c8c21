//! What one decision asks for: the writes in the order they must be made,
//! the Events to tell, and how the Services stand.

use std::collections::BTreeMap;

use crate::contract::ServiceKey;
use crate::contract::node_object::Spec;

use super::events::EventOut;
use super::world::Ingress;

/// One write, in the order of [`Plan::writes`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Write {
    /// Strategic merge patch appending [`FINALIZER`](crate::contract::FINALIZER).
    AddFinalizer(ServiceKey),
    /// A `LoadBalancerNode` with an empty spec, plus the node's Role and
    /// RoleBinding.
    CreateNodeObject(String),
    /// The node's Role and RoleBinding (applied, so also repaired).
    EnsureNodeAccess(String),
    /// The whole `spec.assignments` of a node object (merge patch).
    /// `services`: whose assignments changed; their later writes wait for
    /// this one.
    SetSpec {
        node: String,
        spec: Spec,
        services: Vec<ServiceKey>,
    },
    /// The whole `spec.peers` of a node object (merge patch): the other
    /// nodes on its LAN.
    SetPeers {
        node: String,
        peers: Vec<crate::contract::membership::Peer>,
    },
    /// `status.loadBalancer.ingress` (status subresource, merge patch);
    /// empty clears it.
    ServiceStatus {
        service: ServiceKey,
        ingress: Vec<Ingress>,
    },
    /// Merge patch of annotations; `None` removes the key.
    ServiceAnnotations {
        service: ServiceKey,
        set: BTreeMap<String, Option<String>>,
    },
    /// Strategic merge patch `$deleteFromPrimitiveList` of [`FINALIZER`](crate::contract::FINALIZER)
    /// (other finalizers stay).
    RemoveFinalizer(ServiceKey),
    /// The node is gone: its object, Role and RoleBinding.
    DeleteNodeObject(String),
}

impl Write {
    /// The Services whose later writes depend on this one succeeding.
    pub fn services(&self) -> Vec<&ServiceKey> {
        match self {
            Write::AddFinalizer(s) | Write::RemoveFinalizer(s) => vec![s],
            Write::ServiceStatus { service, .. } | Write::ServiceAnnotations { service, .. } => {
                vec![service]
            }
            Write::SetSpec { services, .. } => services.iter().collect(),
            Write::CreateNodeObject(_)
            | Write::EnsureNodeAccess(_)
            | Write::SetPeers { .. }
            | Write::DeleteNodeObject(_) => Vec::new(),
        }
    }

    /// A short name for metrics and logs.
    pub fn kind(&self) -> &'static str {
        match self {
            Write::AddFinalizer(_) => "add_finalizer",
            Write::CreateNodeObject(_) => "create_node_object",
            Write::EnsureNodeAccess(_) => "node_access",
            Write::SetSpec { .. } => "node_spec",
            Write::SetPeers { .. } => "node_peers",
            Write::ServiceStatus { .. } => "service_status",
            Write::ServiceAnnotations { .. } => "service_annotations",
            Write::RemoveFinalizer(_) => "remove_finalizer",
            Write::DeleteNodeObject(_) => "delete_node_object",
        }
    }
}

/// How the Services stand, for the `STATUS=` line and metrics.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Summary {
    /// Primaries whose status carries their holder's address.
    pub served: usize,
    /// Primaries waiting for a holder or a lease.
    pub pending: usize,
    /// Secondaries sharing their primary's address.
    pub shared: usize,
    /// Services being released (deleted, finalizer still ours).
    pub releasing: usize,
    /// Services refused or invalid (a Warning says why).
    pub refused: usize,
    pub nodes_eligible: usize,
    pub nodes_total: usize,
}

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Plan {
    pub writes: Vec<Write>,
    pub events: Vec<EventOut>,
    pub summary: Summary,
}
