//! Which node holds which Service's address, as a pure function: stable
//! (nothing moves while its holder stays eligible and, for
//! `externalTrafficPolicy: Local`, has a ready endpoint), spread (a Service that
//! needs a holder goes to the eligible node holding the fewest), and
//! deterministic (ties are broken by a hash of the node name, so every
//! controller replica decides alike). A Service that needs a holder costs
//! O(log N) (the nodes are kept ordered by load), one limited to the nodes
//! with its endpoints O(those nodes): a pass placing 10,000 Services on
//! 500 nodes does not compare each with every node (issue #30).

use std::collections::{BTreeMap, BTreeSet};

use hna_contract::ServiceKey;

/// A Service that needs a holder.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ServiceNeed {
    pub(crate) key: ServiceKey,
    pub(crate) uid: String,
    /// Only these nodes may hold it (`externalTrafficPolicy: Local`: those
    /// with a ready endpoint); `None`: any eligible node.
    pub(crate) only: Option<BTreeSet<String>>,
    /// Nodes that could not serve it lately (`crate::service_health`):
    /// left for another node while there is one, never chosen before one.
    pub(crate) avoid: BTreeSet<String>,
}

/// Services to holders (`None`: no eligible node).
pub(crate) type Placement = BTreeMap<ServiceKey, Option<String>>;

/// `eligible`: the nodes that may hold addresses now (agent alive,
/// macvlan ready); of those, `keep_only` keep what they hold and are given
/// nothing new (cut off from the API server, they would not read it).
/// `current`: the holders recorded so far.
#[cfg(test)]
pub(crate) fn place(
    services: &[ServiceNeed],
    eligible: &[String],
    keep_only: &BTreeSet<String>,
    current: &BTreeMap<ServiceKey, String>,
) -> Placement {
    place_with(services, eligible, keep_only, &BTreeSet::new(), current)
}

/// [`place`], where the nodes in `unproven` (not yet seen writing by this
/// controller: `NodeIn::unproven`) are given a new Service only when no
/// other node can take it, as if they held more than any other.
pub(crate) fn place_with(
    services: &[ServiceNeed],
    eligible: &[String],
    keep_only: &BTreeSet<String>,
    unproven: &BTreeSet<String>,
    current: &BTreeMap<ServiceKey, String>,
) -> Placement {
    let mut load: BTreeMap<&str, usize> = eligible.iter().map(|n| (n.as_str(), 0)).collect();
    let mut out = Placement::new();
    let mut homeless = Vec::new();
    let allowed = |s: &ServiceNeed, node: &str| s.only.as_ref().is_none_or(|o| o.contains(node));
    let elsewhere = |s: &ServiceNeed, holder: &str| {
        eligible
            .iter()
            .any(|n| n != holder && allowed(s, n) && !s.avoid.contains(n) && !keep_only.contains(n))
    };
    for s in services {
        match current.get(&s.key) {
            Some(holder)
                if load.contains_key(holder.as_str())
                    && allowed(s, holder)
                    && !(s.avoid.contains(holder) && elsewhere(s, holder)) =>
            {
                *load.get_mut(holder.as_str()).expect("eligible") += 1;
                out.insert(s.key.clone(), Some(holder.clone()));
            }
            _ => homeless.push(s),
        }
    }
    homeless.sort_by(|a, b| a.key.cmp(&b.key));
    // The nodes new Services may go to, those seen writing first, then
    // least loaded first.
    let tier = |node: &str| unproven.contains(node);
    let mut by_load: BTreeSet<(bool, usize, u64, &str)> = load
        .iter()
        .filter(|(node, _)| !keep_only.contains(**node))
        .map(|(node, n)| (tier(node), *n, tie_break(node), *node))
        .collect();
    for s in homeless {
        let choice: Option<&str> = match &s.only {
            // Few nodes, as a rule: looked at one by one.
            Some(only) => only
                .iter()
                .filter_map(|n| load.get_key_value(n.as_str()))
                .filter(|(node, _)| !keep_only.contains(**node))
                .min_by_key(|(node, n)| {
                    (s.avoid.contains(**node), tier(node), **n, tie_break(node))
                })
                .map(|(node, _)| *node),
            // The least loaded node it does not avoid, else the least
            // loaded one.
            None => {
                let mut avoided = None;
                let mut chosen = None;
                for (_, _, _, node) in &by_load {
                    if !s.avoid.contains(*node) {
                        chosen = Some(*node);
                        break;
                    }
                    avoided = avoided.or(Some(*node));
                }
                chosen.or(avoided)
            }
        };
        if let Some(node) = choice {
            let n = load.get_mut(node).expect("eligible");
            let tie = tie_break(node);
            if by_load.remove(&(tier(node), *n, tie, node)) {
                by_load.insert((tier(node), *n + 1, tie, node));
            }
            *n += 1;
        }
        out.insert(s.key.clone(), choice.map(str::to_string));
    }
    out
}

fn tie_break(node: &str) -> u64 {
    hna_contract::fnv1a(&[node.as_bytes()])
}

#[cfg(test)]
mod tests {
    use super::*;

    fn svc(i: usize) -> ServiceNeed {
        ServiceNeed {
            key: ServiceKey {
                namespace: "default".into(),
                name: format!("svc-{i:02}"),
            },
            uid: format!("{i:08x}-0000-4000-8000-000000000000"),
            only: None,
            avoid: BTreeSet::new(),
        }
    }

    /// `externalTrafficPolicy: Local`: only a node with a ready endpoint
    /// holds it; it stays while its holder keeps one, follows the endpoint
    /// when it moves, and has no holder when no eligible node has one.
    #[test]
    fn a_local_service_goes_only_where_its_endpoints_are() {
        let eligible = nodes(&["n1", "n2", "n3"]);
        let mut s = svc(1);
        s.only = Some(["n3".to_string()].into());
        let p = place(
            std::slice::from_ref(&s),
            &eligible,
            &BTreeSet::new(),
            &BTreeMap::new(),
        );
        assert_eq!(p[&s.key].as_deref(), Some("n3"));
        // Stays while n3 keeps an endpoint, even with more elsewhere.
        s.only = Some(["n2".to_string(), "n3".to_string()].into());
        let current: BTreeMap<ServiceKey, String> = [(s.key.clone(), "n3".to_string())].into();
        let p = place(
            std::slice::from_ref(&s),
            &eligible,
            &BTreeSet::new(),
            &current,
        );
        assert_eq!(p[&s.key].as_deref(), Some("n3"));
        // The endpoint moves to n1: so does the holder.
        s.only = Some(["n1".to_string()].into());
        let p = place(
            std::slice::from_ref(&s),
            &eligible,
            &BTreeSet::new(),
            &current,
        );
        assert_eq!(p[&s.key].as_deref(), Some("n1"));
        // Its only endpoint is on a node that is not eligible: no holder.
        s.only = Some(["n9".to_string()].into());
        let p = place(
            std::slice::from_ref(&s),
            &eligible,
            &BTreeSet::new(),
            &current,
        );
        assert_eq!(p[&s.key], None);
        // No endpoint at all: no holder either.
        s.only = Some(BTreeSet::new());
        assert_eq!(
            place(
                std::slice::from_ref(&s),
                &eligible,
                &BTreeSet::new(),
                &current
            )[&s.key],
            None
        );
    }

    fn nodes(names: &[&str]) -> Vec<String> {
        names.iter().map(|n| n.to_string()).collect()
    }

    fn holders(p: &Placement) -> BTreeMap<ServiceKey, String> {
        p.iter()
            .filter_map(|(k, v)| v.clone().map(|v| (k.clone(), v)))
            .collect()
    }

    fn counts(p: &Placement) -> BTreeMap<String, usize> {
        let mut c = BTreeMap::new();
        for n in p.values().flatten() {
            *c.entry(n.clone()).or_default() += 1;
        }
        c
    }

    #[test]
    fn spread_then_stable_then_only_the_dead_nodes_services_move() {
        let services: Vec<ServiceNeed> = (0..10).map(svc).collect();
        let all = nodes(&["n1", "n2", "n3"]);
        let first = place(&services, &all, &BTreeSet::new(), &BTreeMap::new());
        let mut c: Vec<usize> = counts(&first).into_values().collect();
        c.sort();
        assert_eq!(c, vec![3, 3, 4], "{first:?}");

        // Nothing fails: nothing moves, also when the order of input changes.
        let mut reversed = services.clone();
        reversed.reverse();
        assert_eq!(
            place(&reversed, &all, &BTreeSet::new(), &holders(&first)),
            first
        );

        // n2 dies: its Services move, the others stay where they were.
        let survivors = nodes(&["n1", "n3"]);
        let after = place(&services, &survivors, &BTreeSet::new(), &holders(&first));
        for (k, was) in holders(&first) {
            let now = after[&k].clone().unwrap();
            if was == "n2" {
                assert_ne!(now, "n2");
            } else {
                assert_eq!(now, was, "{k} moved although its holder lives");
            }
        }
        assert_eq!(counts(&after).values().sum::<usize>(), 10);
    }

    #[test]
    fn deterministic_and_explicit_without_nodes() {
        let services: Vec<ServiceNeed> = (0..5).map(svc).collect();
        let all = nodes(&["a", "b"]);
        assert_eq!(
            place(&services, &all, &BTreeSet::new(), &BTreeMap::new()),
            place(&services, &all, &BTreeSet::new(), &BTreeMap::new())
        );
        let none = place(&services, &[], &BTreeSet::new(), &BTreeMap::new());
        assert!(none.values().all(Option::is_none));
        assert_eq!(none.len(), 5);
    }

    #[test]
    fn a_recovered_node_gets_new_services_not_old_ones_back() {
        let services: Vec<ServiceNeed> = (0..4).map(svc).collect();
        let on_one = place(
            &services,
            &nodes(&["n1"]),
            &BTreeSet::new(),
            &BTreeMap::new(),
        );
        let back = place(
            &services,
            &nodes(&["n1", "n2"]),
            &BTreeSet::new(),
            &holders(&on_one),
        );
        assert_eq!(back, on_one, "no flapping back");
        let mut more = services.clone();
        more.push(svc(9));
        let next = place(
            &more,
            &nodes(&["n1", "n2"]),
            &BTreeSet::new(),
            &holders(&back),
        );
        assert_eq!(next[&svc(9).key].as_deref(), Some("n2"));
    }

    /// Issue #29: a Service its live holder could not serve moves to a
    /// node it does not avoid, never to an avoided one while another can
    /// take it, and stays where it is when every node is avoided.
    #[test]
    fn a_service_leaves_a_holder_that_could_not_serve_it_when_another_can() {
        let all = nodes(&["n1", "n2", "n3"]);
        let mut s = svc(1);
        let current: BTreeMap<ServiceKey, String> = [(s.key.clone(), "n1".to_string())].into();
        s.avoid = ["n1".to_string(), "n2".to_string()].into();
        let p = place(std::slice::from_ref(&s), &all, &BTreeSet::new(), &current);
        assert_eq!(p[&s.key].as_deref(), Some("n3"));
        // A homeless Service never goes to an avoided node first.
        let p = place(
            std::slice::from_ref(&s),
            &all,
            &BTreeSet::new(),
            &BTreeMap::new(),
        );
        assert_eq!(p[&s.key].as_deref(), Some("n3"));
        // Every node avoided: it stays.
        s.avoid = all.iter().cloned().collect();
        let p = place(std::slice::from_ref(&s), &all, &BTreeSet::new(), &current);
        assert_eq!(p[&s.key].as_deref(), Some("n1"));
        // `externalTrafficPolicy: Local` with its endpoint on n1 alone: it
        // stays on n1, avoided or not.
        s.avoid = ["n1".to_string()].into();
        s.only = Some(["n1".to_string()].into());
        let p = place(std::slice::from_ref(&s), &all, &BTreeSet::new(), &current);
        assert_eq!(p[&s.key].as_deref(), Some("n1"));
    }

    /// A node cut off from the API server keeps what it holds and is
    /// given nothing new: it would not read it.
    #[test]
    fn a_node_not_yet_seen_writing_gets_a_new_service_only_when_no_other_can() {
        let all = ["n1".to_string(), "n2".to_string(), "n3".to_string()];
        let unproven: BTreeSet<String> = ["n1".to_string()].into();
        let services: Vec<ServiceNeed> = (0..6).map(svc).collect();
        // n1 holds nothing, yet gets nothing while n2 and n3 can.
        let p = place_with(
            &services,
            &all,
            &BTreeSet::new(),
            &unproven,
            &BTreeMap::new(),
        );
        assert!(p.values().all(|h| h.as_deref() != Some("n1")), "{p:?}");
        // It keeps what it holds.
        let current: BTreeMap<ServiceKey, String> = [(svc(0).key, "n1".to_string())].into();
        let p = place_with(&services, &all, &BTreeSet::new(), &unproven, &current);
        assert_eq!(p[&svc(0).key].as_deref(), Some("n1"));
        // Alone (or the only one a Local Service may use), it gets it.
        let p = place_with(
            &services,
            &all[..1],
            &BTreeSet::new(),
            &unproven,
            &BTreeMap::new(),
        );
        assert!(p.values().all(|h| h.as_deref() == Some("n1")), "{p:?}");
        let mut local = svc(7);
        local.only = Some(["n1".to_string()].into());
        let p = place_with(
            &[local.clone()],
            &all,
            &BTreeSet::new(),
            &unproven,
            &BTreeMap::new(),
        );
        assert_eq!(p[&local.key].as_deref(), Some("n1"));
    }

    #[test]
    fn a_keep_only_node_keeps_its_own_and_gets_nothing_new() {
        let all = nodes(&["n1", "n2", "n3"]);
        let services: Vec<ServiceNeed> = (0..9).map(svc).collect();
        let first = place(&services, &all, &BTreeSet::new(), &BTreeMap::new());
        let cut: BTreeSet<String> = ["n2".to_string()].into();
        let more: Vec<ServiceNeed> = (0..15).map(svc).collect();
        let next = place(&more, &all, &cut, &holders(&first));
        for s in &services {
            assert_eq!(next[&s.key], first[&s.key], "{} moved", s.key);
        }
        for s in &more[9..] {
            assert_ne!(next[&s.key].as_deref(), Some("n2"), "{} given to n2", s.key);
            assert!(next[&s.key].is_some());
        }
    }
}
