//! One decision in the making: what its steps read, and what they add to,
//! the writes kept apart by kind so that they can be put in their order
//! at the end.

use std::collections::BTreeMap;

use hna_contract::{self, AddressIdentity, Selection, ServiceKey};

use super::events::Events;
use super::nodes::Nodes;
use super::plan::{Summary, Write};
use super::specs::Specs;
use super::status::Taken;
use super::world::{ServiceIn, World};

/// A primary to place, with its identity and its uplink.
pub(super) type Need<'a> = (&'a ServiceIn, AddressIdentity, Option<String>);

pub(super) struct Pass<'a> {
    pub(super) world: World<'a>,
    /// What a load-balancer address must not be.
    pub(super) taken: Taken<'a>,
    pub(super) nodes: Nodes<'a>,
    /// By key: the order in which Services are decided, and so the order
    /// of their Events.
    pub(super) services: Vec<&'a ServiceIn>,
    pub(super) by_key: BTreeMap<&'a ServiceKey, &'a ServiceIn>,
    pub(super) selections: BTreeMap<&'a ServiceKey, Selection>,
    pub(super) specs: Specs,
    pub(super) add_finalizers: Vec<Write>,
    pub(super) statuses: Vec<Write>,
    pub(super) annotations: Vec<Write>,
    pub(super) remove_finalizers: Vec<Write>,
    pub(super) events: Events,
    pub(super) summary: Summary,
    /// Primaries to place, with their identities.
    pub(super) needs: Vec<Need<'a>>,
    /// The address each primary of ours stands for (for its secondaries).
    pub(super) primary_ip: BTreeMap<ServiceKey, String>,
}

impl<'a> Pass<'a> {
    pub(super) fn new(world: World<'a>) -> Pass<'a> {
        let nodes = Nodes::of(&world);
        let specs = Specs::new(&nodes.live);
        let summary = Summary {
            nodes_total: nodes.names.len(),
            nodes_eligible: nodes.eligible.len(),
            ..Summary::default()
        };
        let mut services: Vec<&ServiceIn> = world.services.iter().collect();
        services.sort_by(|a, b| a.key.cmp(&b.key));
        let by_key: BTreeMap<&ServiceKey, &ServiceIn> =
            services.iter().map(|s| (&s.key, *s)).collect();
        let selections: BTreeMap<&ServiceKey, Selection> = services
            .iter()
            .map(|s| (&s.key, hna_contract::select(&s.view(), world.classes)))
            .collect();
        Pass {
            taken: Taken::of(&world),
            world,
            nodes,
            services,
            by_key,
            selections,
            specs,
            add_finalizers: Vec::new(),
            statuses: Vec::new(),
            annotations: Vec::new(),
            remove_finalizers: Vec::new(),
            events: Events::default(),
            summary,
            needs: Vec::new(),
            primary_ip: BTreeMap::new(),
        }
    }
}
