//! The nodes: each Kubernetes Node has a node object and the access its
//! agent needs for as long as it exists, and only the objects of existing
//! Nodes may hold addresses.

use std::collections::{BTreeMap, BTreeSet};

use super::plan::Write;
use super::world::{NodeIn, World};

pub(super) struct Nodes<'a> {
    /// The Kubernetes Nodes.
    pub(super) names: BTreeSet<&'a str>,
    /// The node objects of existing Nodes.
    pub(super) live: BTreeMap<&'a str, &'a NodeIn>,
    pub(super) eligible: Vec<String>,
    /// The interfaces the nodes report as their uplink: with the network
    /// map's, the only ones a Service may name.
    pub(super) uplinks: BTreeSet<String>,
    /// The MACs of other hosts on the LAN, as the nodes report them (their
    /// network cards, their default gateway's), each with whose it is.
    pub(super) lan_macs: BTreeMap<String, String>,
    /// Node objects and access to create or repair.
    pub(super) creates: Vec<Write>,
    /// Node objects of Nodes that are gone.
    pub(super) deletes: Vec<Write>,
}

impl<'a> Nodes<'a> {
    pub(super) fn of(world: &World<'a>) -> Nodes<'a> {
        let names: BTreeSet<&str> = world.nodes.iter().map(String::as_str).collect();
        let objects: BTreeMap<&str, &NodeIn> = world
            .node_objects
            .iter()
            .map(|o| (o.name.as_str(), o))
            .collect();

        let mut creates = Vec::new();
        let mut deletes = Vec::new();
        for n in &names {
            if !objects.contains_key(n) {
                creates.push(Write::CreateNodeObject(n.to_string()));
            }
        }
        for n in &names {
            if !world.access_ensured.contains(*n) {
                creates.push(Write::EnsureNodeAccess(n.to_string()));
            }
        }
        for n in objects.keys() {
            if !names.contains(n) {
                deletes.push(Write::DeleteNodeObject(n.to_string()));
            }
        }
        // Only the objects of existing Nodes may hold addresses.
        let live: BTreeMap<&str, &NodeIn> = objects
            .iter()
            .filter(|(n, _)| names.contains(*n))
            .map(|(n, o)| (*n, *o))
            .collect();
        let eligible: Vec<String> = live
            .values()
            .filter(|o| o.eligible)
            .map(|o| o.name.clone())
            .collect();
        let uplinks: BTreeSet<String> = live
            .values()
            .filter_map(|o| o.status.default_uplink.clone())
            .collect();
        let mut lan_macs = BTreeMap::new();
        // Gateways first, so that a node's own card names the node.
        for o in objects.values() {
            if let Some(mac) = &o.status.gateway_mac {
                lan_macs.insert(
                    mac.clone(),
                    format!("the default gateway's (as node {} sees it)", o.name),
                );
            }
        }
        for o in objects.values() {
            for mac in &o.status.nic_macs {
                lan_macs.insert(mac.clone(), format!("a network card of node {}", o.name));
            }
        }
        Nodes {
            names,
            live,
            lan_macs,
            eligible,
            uplinks,
            creates,
            deletes,
        }
    }
}

#[cfg(test)]
mod tests {
    use crate::controller::reconcile::Write;
    use crate::controller::reconcile::test_support::{Sim, dhcp};

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
