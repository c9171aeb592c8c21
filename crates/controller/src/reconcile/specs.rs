//! The node objects' specs as one decision edits them, Service by Service,
//! so that each spec write names the Services whose later writes must wait
//! for it.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use hna_contract::ServiceKey;
use hna_contract::node_object::{Assignment, Spec};

use super::plan::{Write, sorted};
use super::world::NodeIn;

/// The desired specs, edited per Service, and which Services each edit
/// touched.
pub(super) struct Specs {
    current: BTreeMap<String, Vec<Assignment>>,
    pub(super) desired: BTreeMap<String, Vec<Assignment>>,
    /// The nodes whose desired spec has an assignment of a uid: looking a
    /// Service up is then not a walk over every node's assignments, which
    /// made a pass quadratic in the number of Services.
    nodes_of: HashMap<String, BTreeSet<String>>,
    touched: BTreeMap<String, BTreeSet<ServiceKey>>,
}

impl Specs {
    pub(super) fn new(live: &BTreeMap<&str, &NodeIn>) -> Specs {
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
    pub(super) fn holders_of(&self, uid: &str) -> Vec<(String, Assignment)> {
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

    pub(super) fn remove(&mut self, node: &str, uid: &str, service: &ServiceKey) {
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

    pub(super) fn put(&mut self, node: &str, a: Assignment, service: &ServiceKey) {
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

    pub(super) fn writes(self) -> Vec<Write> {
        let mut out = Vec::new();
        for (node, list) in self.desired {
            let list = sorted(list);
            let current = sorted(self.current.get(&node).cloned().unwrap_or_default());
            if list != current {
                out.push(Write::SetSpec {
                    services: self
                        .touched
                        .get(&node)
                        .map(|s| s.iter().cloned().collect())
                        .unwrap_or_default(),
                    node,
                    spec: Spec {
                        assignments: list,
                        peers: Vec::new(),
                    },
                    before: current,
                });
            }
        }
        out
    }
}
