//! Which nodes may hold LoadBalancer addresses, and how: the answer to
//! "why did an address move?" on the controller's side.
//!
//! A node's object is judged on three sources, each on the controller's
//! own clock: its heartbeat (`liveness`: fresh, on time by its stated
//! period, too slow for the staleness bound, restarting), its LAN's
//! verdict (`lan_verdict`: dead by two witnesses, or vouched for by one
//! that hears it), and its own word (`ready`, `Fenced`, `lan.unheard`).
//! [`judge`] is the decision, pure, over [`NodeFacts`]; [`objects_from`]
//! gathers the facts from the watch caches and hands the reconcile its
//! `NodeIn`s.

use std::collections::{BTreeSet, HashMap};
use std::time::Duration;

use tokio::time::Instant;

use super::{kube_edge, lan_verdict, liveness, reconcile};
use hna_contract::node_object::Status;

/// What is known of one node, for [`judge`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct NodeFacts {
    /// Its status says `ready`.
    pub(crate) ready: bool,
    /// Its heartbeat period is too slow for the staleness bound (two must
    /// fit in it).
    pub(crate) too_slow: bool,
    /// Its heartbeat is fresh on our clock.
    pub(crate) fresh: bool,
    /// A live witness with a fresh status hears it on the LAN.
    pub(crate) vouched: bool,
    /// Dead on its LAN by its witnesses' agreement.
    pub(crate) lan_dead: bool,
    /// Its heartbeat is on time by its own stated period.
    pub(crate) on_time: bool,
    /// This controller has seen it write since it began to lead (or since
    /// the watch's last quiet gap).
    pub(crate) written: bool,
    /// Dead on its LAN, it said it hears its LAN no more: its addresses go
    /// to others only once it reports them gone (`lan_verdict::LetGo`).
    pub(crate) lets_go_first: bool,
}

/// The decision on one node.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Eligibility {
    /// It may hold addresses.
    pub(crate) eligible: bool,
    /// It keeps what it holds and is given nothing new.
    pub(crate) keep_only: bool,
    /// A last resort for a new Service: not seen writing yet.
    pub(crate) unproven: bool,
    pub(crate) lets_go_first: bool,
}

/// Eligible when it is ready, its heartbeat period fits the staleness
/// bound, it is not dead on its LAN, and it is heard: its heartbeat fresh,
/// or a witness vouching for it (a node cut off from the API server only
/// serves on, and nothing moves). Late by its own stated period (two
/// heartbeats missed), it is probably cut off from the API server: it
/// keeps what it holds and is given nothing new, which it could not read.
/// Not only once stale (40 s), which a leader that has just started counts
/// from its own start: the soak saw one give a Service to a node cut off
/// 43 s before, 22 s after it began to lead.
pub(crate) fn judge(f: &NodeFacts) -> Eligibility {
    let heard = f.fresh || f.vouched;
    let eligible = f.ready && !f.too_slow && !f.lan_dead && heard;
    Eligibility {
        eligible,
        keep_only: eligible && !f.on_time,
        unproven: !f.written,
        lets_go_first: f.lets_go_first,
    }
}

/// Whether a node's own status says it fenced itself: its accusations do
/// not count (`lan_verdict`).
pub(crate) fn fenced(status: &Status) -> bool {
    status.conditions.iter().any(|c| {
        c.type_ == hna_contract::node_object::READY && c.reason == hna_contract::node_object::FENCED
    })
}

/// The node objects as the decision reads them (each judged on our clock
/// by `alive`, which the watch gives their heartbeats as they arrive),
/// sorted by name, and the resourceVersion of each.
pub(crate) fn objects_from(
    caches: &kube_edge::Caches,
    alive: &mut liveness::Liveness,
    slow_warned: &mut BTreeSet<String>,
    let_go: &mut lan_verdict::LetGo,
    now: Instant,
) -> (Vec<reconcile::NodeIn>, HashMap<String, String>) {
    let mut versions = HashMap::new();
    let mut objects = Vec::new();
    let mut names = BTreeSet::new();
    let state = caches.node_objects.state();
    let reporters: Vec<lan_verdict::Reporter<'_>> = state
        .iter()
        .filter_map(|o| {
            let name = o.metadata.name.as_deref()?;
            let status = o.status.as_ref()?;
            Some(lan_verdict::Reporter {
                name,
                lan: status.lan.as_ref()?,
                fresh: alive.fresh(name, now),
                on_time: alive.on_time(name, now),
                restarting: alive.restarting(name, now),
                fenced: fenced(status),
            })
        })
        .collect();
    let lan = lan_verdict::judge(&reporters);
    let lan_dead = &lan.dead;
    let was_dead: BTreeSet<String> = let_go.dead().map(str::to_string).collect();
    let unheard: BTreeSet<String> = state
        .iter()
        .filter(|o| {
            o.status
                .as_ref()
                .and_then(|s| s.lan.as_ref())
                .is_some_and(|l| l.unheard)
        })
        .filter_map(|o| o.metadata.name.clone())
        .collect();
    for n in let_go.observe(lan_dead, &unheard, now) {
        let witnesses: Vec<&str> = reporters
            .iter()
            .filter(|r| r.lan.down.contains(&n))
            .map(|r| r.name)
            .collect();
        let lets_go_first = let_go.lets_go_first(&n, alive.on_time(&n, now), now);
        tracing::warn!(node = %n, reported_by = ?witnesses, said_unheard = unheard.contains(&n), on_time = alive.on_time(&n, now), lets_go_first, "dead on its LAN by its witnesses' agreement: its Services move");
    }
    for n in was_dead.difference(lan_dead) {
        tracing::info!(node = %n, "no longer dead on its LAN");
    }
    for o in state.iter() {
        let Some(name) = o.metadata.name.clone() else {
            continue;
        };
        // Its heartbeat was given to `alive` when the watch delivered it.
        let status = o.status.as_ref();
        let period = status
            .and_then(|s| s.heartbeat_period_ms)
            .map(Duration::from_millis);
        let too_slow = alive.too_slow(period);
        if too_slow && slow_warned.insert(name.clone()) {
            tracing::warn!(
                node = %name,
                heartbeat = ?period,
                node_stale_after = ?alive.stale_after(),
                "this node's agent writes its heartbeat too seldom for --node-stale-after (two must fit in it): it gets no addresses; lower `lb_heartbeat` in its configuration"
            );
        } else if !too_slow {
            slow_warned.remove(&name);
        }
        let facts = NodeFacts {
            ready: status.is_some_and(|s| s.ready),
            too_slow,
            fresh: alive.fresh(&name, now),
            vouched: lan.vouched.contains(&name),
            lan_dead: lan_dead.contains(&name),
            on_time: alive.on_time(&name, now),
            written: alive.written(&name),
            lets_go_first: let_go.lets_go_first(&name, alive.on_time(&name, now), now),
        };
        let judged = judge(&facts);
        // Its spec's version: the status moves the resourceVersion with
        // every write of the node's (`kube_edge::generation_guarded`).
        if let Some(g) = o.metadata.generation {
            versions.insert(format!("node/{name}"), kube_edge::generation_token(g));
        }
        if let Some(mut n) = kube_edge::node_in(o, judged.eligible) {
            n.keep_only = judged.keep_only;
            n.unproven = judged.unproven;
            n.lets_go_first = judged.lets_go_first;
            // Neither the heartbeat nor a renewal's new expiry moves a
            // decision: without them, a write that carries nothing else
            // wakes no pass (issue #30).
            n.status.heartbeat = None;
            for l in &mut n.status.leases {
                l.expires = None;
            }
            objects.push(n);
        }
        names.insert(name);
    }
    alive.retain(|n| names.contains(n));
    objects.sort_by(|a, b| a.name.cmp(&b.name));
    (objects, versions)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A healthy node: ready, fresh, on time, seen writing.
    fn healthy() -> NodeFacts {
        NodeFacts {
            ready: true,
            fresh: true,
            on_time: true,
            written: true,
            ..NodeFacts::default()
        }
    }

    #[test]
    fn each_fact_as_the_table_says() {
        type Edit = fn(&mut NodeFacts);
        let cases: [(&str, Edit, Eligibility); 9] = [
            (
                "healthy",
                |_| {},
                Eligibility {
                    eligible: true,
                    ..Default::default()
                },
            ),
            ("not ready", |f| f.ready = false, Eligibility::default()),
            (
                "heartbeat too slow for the bound",
                |f| f.too_slow = true,
                Eligibility::default(),
            ),
            (
                "dead on its LAN, though fresh",
                |f| f.lan_dead = true,
                Eligibility::default(),
            ),
            (
                "stale, no witness hears it",
                |f| {
                    f.fresh = false;
                    f.on_time = false;
                },
                Eligibility::default(),
            ),
            (
                "stale but vouched for: cut off from the API server only, it keeps what it holds",
                |f| {
                    f.fresh = false;
                    f.on_time = false;
                    f.vouched = true;
                },
                Eligibility {
                    eligible: true,
                    keep_only: true,
                    ..Default::default()
                },
            ),
            (
                "fresh but late by its own period: given nothing new",
                |f| f.on_time = false,
                Eligibility {
                    eligible: true,
                    keep_only: true,
                    ..Default::default()
                },
            ),
            (
                "not seen writing since this leader began: a last resort",
                |f| f.written = false,
                Eligibility {
                    eligible: true,
                    unproven: true,
                    ..Default::default()
                },
            ),
            (
                "dead on its LAN, said it hears it no more: lets go first",
                |f| {
                    f.lan_dead = true;
                    f.lets_go_first = true;
                },
                Eligibility {
                    lets_go_first: true,
                    ..Default::default()
                },
            ),
        ];
        for (name, edit, want) in cases {
            let mut f = healthy();
            edit(&mut f);
            assert_eq!(judge(&f), want, "{name}");
        }
    }

    #[test]
    fn a_status_is_fenced_only_by_its_ready_conditions_reason() {
        use hna_contract::node_object::{Condition, FENCED, READY};
        let with = |type_: &str, reason: &str| Status {
            conditions: vec![Condition {
                type_: type_.into(),
                status: "False".into(),
                reason: reason.into(),
                ..Condition::default()
            }],
            ..Status::default()
        };
        assert!(fenced(&with(READY, FENCED)));
        assert!(!fenced(&with(READY, "NotReady")));
        assert!(!fenced(&with("Other", FENCED)));
        assert!(!fenced(&Status::default()));
    }
}
