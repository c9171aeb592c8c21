//! What one decision asks for: the writes in the order they must be made,
//! the Events to tell, and how the Services stand.

use std::borrow::Cow;
use std::collections::{BTreeMap, BTreeSet};

use hna_contract::ServiceKey;
use hna_contract::node_object::{Assignment, Spec};

use super::events::EventOut;
use super::world::Ingress;

/// One write, in the order of [`Plan::writes`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Write {
    /// Strategic merge patch appending [`FINALIZER`](hna_contract::FINALIZER).
    AddFinalizer(ServiceKey),
    /// A `LoadBalancerNode` with an empty spec, plus the node's Role and
    /// RoleBinding.
    CreateNodeObject(String),
    /// The node's Role and RoleBinding (applied, so also repaired).
    EnsureNodeAccess(String),
    /// The whole `spec.assignments` of a node object (merge patch).
    /// `services`: whose assignments changed; their later writes wait for
    /// this one. `before`: the assignments the decision found, in
    /// sorted order (by Service, then uid); what a held-back Service's entries stay at (see
    /// `Write::without`).
    SetSpec {
        node: String,
        spec: Spec,
        services: Vec<ServiceKey>,
        before: Vec<Assignment>,
    },
    /// The whole `spec.peers` of a node object (merge patch): the other
    /// nodes on its LAN.
    SetPeers {
        node: String,
        peers: Vec<hna_contract::membership::Peer>,
    },
    /// `status.loadBalancer.ingress` and our condition
    /// ([`SERVICE_CONDITION`](hna_contract::SERVICE_CONDITION)) in one
    /// strategic-merge patch of the status subresource (others' conditions
    /// stay); an empty `ingress` clears the address, `assigned: None`
    /// removes the condition.
    ServiceStatus {
        service: ServiceKey,
        ingress: Vec<Ingress>,
        assigned: Option<Assigned>,
    },
    /// Merge patch of annotations; `None` removes the key.
    ServiceAnnotations {
        service: ServiceKey,
        set: BTreeMap<String, Option<String>>,
    },
    /// Strategic merge patch `$deleteFromPrimitiveList` of [`FINALIZER`](hna_contract::FINALIZER)
    /// (other finalizers stay).
    RemoveFinalizer(ServiceKey),
    /// The node is gone: its object, Role and RoleBinding.
    DeleteNodeObject(String),
}

/// Our condition on a Service: the generation its address was published
/// for, and when (the pass's wall clock, seconds).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Assigned {
    pub(crate) generation: i64,
    pub(crate) at: i64,
}

impl Write {
    /// The Services whose later writes depend on this one succeeding.
    pub(crate) fn services(&self) -> Vec<&ServiceKey> {
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

    /// This write with nothing in it for the `held` Services (an earlier
    /// write of theirs failed or waits out a backoff), or `None` when
    /// nothing is left to write. A node's spec write carries the changes of
    /// every Service placed on or moved off the node in one pass: one
    /// Service whose finalizer a webhook refuses must not hold back the
    /// others' failover, so its entries stay as they were and the rest go.
    pub(crate) fn without(&self, held: &BTreeSet<ServiceKey>) -> Option<Cow<'_, Write>> {
        if !self.services().iter().any(|s| held.contains(*s)) {
            return Some(Cow::Borrowed(self));
        }
        let Write::SetSpec {
            node,
            spec,
            services,
            before,
        } = self
        else {
            return None;
        };
        let names: BTreeSet<String> = services
            .iter()
            .filter(|s| held.contains(*s))
            .map(ToString::to_string)
            .collect();
        let assignments = sorted(
            spec.assignments
                .iter()
                .filter(|a| !names.contains(&a.service))
                .chain(before.iter().filter(|a| names.contains(&a.service)))
                .cloned()
                .collect(),
        );
        if assignments == *before {
            return None;
        }
        Some(Cow::Owned(Write::SetSpec {
            node: node.clone(),
            spec: Spec {
                assignments,
                ..spec.clone()
            },
            services: services
                .iter()
                .filter(|s| !held.contains(*s))
                .cloned()
                .collect(),
            before: before.clone(),
        }))
    }

    /// A short name for metrics and logs.
    pub(crate) fn kind(&self) -> &'static str {
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

/// A node's assignments in the order its spec is written in: by Service,
/// then uid, so that equal sets compare equal.
pub(crate) fn sorted(mut assignments: Vec<Assignment>) -> Vec<Assignment> {
    assignments.sort_by(|a, b| a.service.cmp(&b.service).then(a.uid.cmp(&b.uid)));
    assignments
}

/// How the Services stand, for the `STATUS=` line and metrics.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Summary {
    /// Primaries whose status carries their holder's address.
    pub(crate) served: usize,
    /// Primaries waiting for a holder or a lease.
    pub(crate) pending: usize,
    /// Secondaries sharing their primary's address.
    pub(crate) shared: usize,
    /// Services being released (deleted, finalizer still ours).
    pub(crate) releasing: usize,
    /// Services refused or invalid (a Warning says why).
    pub(crate) refused: usize,
    pub(crate) nodes_eligible: usize,
    pub(crate) nodes_total: usize,
}

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Plan {
    pub writes: Vec<Write>,
    pub events: Vec<EventOut>,
    pub summary: Summary,
}
