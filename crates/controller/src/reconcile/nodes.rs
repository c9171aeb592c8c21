//! The nodes: each Kubernetes Node has a node object and the access its
//! agent needs for as long as it exists, and only the objects of existing
//! Nodes may hold addresses.

use std::collections::{BTreeMap, BTreeSet};

use super::plan::Write;
use super::world::{NodeIn, World};
use hna_contract::membership::{Peer, ring_peers};

pub(super) struct Nodes<'a> {
    /// The Kubernetes Nodes.
    pub(super) names: BTreeSet<&'a str>,
    /// The node objects of existing Nodes.
    pub(super) live: BTreeMap<&'a str, &'a NodeIn>,
    pub(super) eligible: Vec<String>,
    /// Eligible nodes that only keep what they hold (`NodeIn::keep_only`).
    pub(super) keep_only: BTreeSet<String>,
    /// Eligible nodes not yet seen writing (`NodeIn::unproven`).
    pub(super) unproven: BTreeSet<String>,
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
        let keep_only: BTreeSet<String> = live
            .values()
            .filter(|o| o.eligible && o.keep_only)
            .map(|o| o.name.clone())
            .collect();
        let unproven: BTreeSet<String> = live
            .values()
            .filter(|o| o.eligible && o.unproven)
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
            for mac in &o.status.dhcp_server_macs {
                lan_macs.insert(
                    mac.clone(),
                    format!(
                        "the DHCP server's (its replies to node {} came from it)",
                        o.name
                    ),
                );
            }
        }
        for o in objects.values() {
            for mac in &o.status.nic_macs {
                lan_macs.insert(mac.clone(), format!("a network card of node {}", o.name));
            }
        }
        let peers = peer_writes(&live);
        creates.extend(peers);
        Nodes {
            names,
            live,
            lan_macs,
            eligible,
            keep_only,
            unproven,
            uplinks,
            creates,
            deletes,
        }
    }
}

/// Each live node object's peers: the live nodes whose membership reports
/// the same LAN (`status.lan.network`) and that are near it on the ring
/// (`hna_contract::membership::ring_peers`), with where they listen. Written
/// only when they differ from the spec's.
fn peer_writes(live: &BTreeMap<&str, &NodeIn>) -> Vec<Write> {
    let mut networks: BTreeMap<&str, BTreeMap<&str, &str>> = BTreeMap::new();
    for o in live.values() {
        if let Some(lan) = &o.status.lan {
            networks
                .entry(lan.network.as_str())
                .or_default()
                .insert(o.name.as_str(), lan.address.as_str());
        }
    }
    let rings: BTreeMap<&str, BTreeMap<&str, Vec<&str>>> = networks
        .iter()
        .map(|(net, members)| (*net, ring_peers(members.keys().copied())))
        .collect();
    let mut out = Vec::new();
    for o in live.values() {
        let want: Vec<Peer> = match &o.status.lan {
            Some(lan) => rings[lan.network.as_str()][o.name.as_str()]
                .iter()
                .map(|p| Peer {
                    name: p.to_string(),
                    address: networks[lan.network.as_str()][p].to_string(),
                })
                .collect(),
            None => Vec::new(),
        };
        if want != o.spec.peers {
            out.push(Write::SetPeers {
                node: o.name.clone(),
                peers: want,
            });
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use crate::reconcile::Write;
    use crate::reconcile::sim::{Sim, dhcp};

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

    #[test]
    fn nodes_on_one_lan_are_each_others_peers_and_only_theirs() {
        use hna_contract::membership::{LanReport, Peer};
        let mut sim = Sim::new(&["n1", "n2", "n3"]);
        sim.settle();
        for (i, o) in sim.objects.iter_mut().enumerate() {
            o.status.lan = Some(LanReport {
                address: format!("10.0.{}.{}:7947", i / 2, 10 + i),
                network: format!("10.0.{}.0/24", i / 2),
                down: Vec::new(),
                hears: Vec::new(),
                alive: 0,
                unheard: false,
            });
        }
        let plans = sim.settle();
        let peer_writes = plans
            .iter()
            .flat_map(|p| &p.writes)
            .filter(|w| matches!(w, Write::SetPeers { .. }))
            .count();
        assert_eq!(
            peer_writes, 2,
            "n3 is alone: its (empty) peers are written by nobody"
        );
        let peers = |sim: &Sim, n: &str| {
            sim.objects
                .iter()
                .find(|o| o.name == n)
                .unwrap()
                .spec
                .peers
                .clone()
        };
        assert_eq!(
            peers(&sim, "n1"),
            vec![Peer {
                name: "n2".into(),
                address: "10.0.0.11:7947".into()
            }]
        );
        assert_eq!(peers(&sim, "n2").len(), 1);
        assert!(peers(&sim, "n3").is_empty(), "alone on its LAN");
        // Settled: nothing is written again.
        assert!(sim.plan().writes.is_empty());
        // A node that goes leaves its peers' specs.
        sim.nodes.retain(|n| n != "n2");
        sim.settle();
        assert!(peers(&sim, "n1").is_empty());
    }

    /// Issue #30: at 500 nodes every spec named every peer (22 KB, written
    /// again with each heartbeat) and a join rewrote all 500 specs.
    #[test]
    fn on_a_big_lan_a_node_has_its_ring_neighbours_as_peers_and_a_join_rewrites_only_theirs() {
        use hna_contract::membership::{LanReport, PEERS_EACH_SIDE};
        let lan = |i: usize| LanReport {
            address: format!("10.0.0.{}:7947", 10 + i),
            network: "10.0.0.0/24".into(),
            down: Vec::new(),
            hears: Vec::new(),
            alive: 0,
            unheard: false,
        };
        let names: Vec<String> = (0..41).map(|i| format!("n{i:02}")).collect();
        let refs: Vec<&str> = names.iter().map(String::as_str).collect();
        let mut sim = Sim::new(&refs[..40]);
        sim.settle();
        for (i, o) in sim.objects.iter_mut().enumerate() {
            o.status.lan = Some(lan(i));
        }
        sim.settle();
        assert!(
            sim.objects
                .iter()
                .all(|o| o.spec.peers.len() == 2 * PEERS_EACH_SIDE),
            "each node names its ring neighbours only"
        );
        sim.nodes.push(names[40].clone());
        sim.settle();
        let joined = sim
            .objects
            .iter_mut()
            .find(|o| o.name == names[40])
            .unwrap();
        joined.status.lan = Some(lan(40));
        let writes: Vec<String> = sim
            .settle()
            .iter()
            .flat_map(|p| &p.writes)
            .filter_map(|w| match w {
                Write::SetPeers { node, .. } => Some(node.clone()),
                _ => None,
            })
            .collect();
        assert_eq!(
            writes.len(),
            2 * PEERS_EACH_SIDE + 1,
            "the new node and its neighbours on each side: {writes:?}"
        );
    }
}
