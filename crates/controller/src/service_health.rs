//! Which node could not serve which Service, judged on the controller's
//! clock from what the agents report per lease.
//!
//! A node that is alive may still fail one Service: its lease `FAILED`
//! (the macvlan cannot be made there, the DHCP server does not answer on
//! that uplink) or `GUARDED` (another host answers for the address). Left
//! alone such a Service never moved, since placement keeps a holder that
//! is alive (issue #29). Here a lease that stays `FAILED` for
//! `failed_after`, or `GUARDED` for `guarded_after`, makes its node one to
//! avoid for that Service for `avoid_for`: placement moves the Service to
//! another node if there is one it does not avoid, and otherwise leaves it
//! where it is.
//!
//! `guarded_after` is longer than any wait the guard owes a former holder
//! of ours: one cut off from the API server lets go within its
//! `lb_fence_after` (120 s by default), one that was told to let go does so
//! at once. Past it, whoever answers is not a node that will let go, and
//! another node's view of the LAN is worth a try; when every node sees the
//! address answered, the Service's events say so on every move.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use tokio::time::Instant;

use hna_contract::node_object::{Spec, Status};

/// The lease states that count against a node for a Service.
const FAILED: &str = "FAILED";
const GUARDED: &str = "GUARDED";
/// Not a state an agent reports: the node's spec assigns the Service and
/// its status does not list it at all, so the node has not read its
/// assignment (cut off from the API server, its watch broken). Agents
/// list a new assignment within about a second.
///
/// A listing counts only from a status written after the agent read the
/// assignment: its `observedGeneration` at least the generation of the
/// node object that first carried it. A node cut off from the API server
/// keeps the status it last wrote, leases and all, and one that held the
/// Service before it was cut off still lists it. The fault soak saw a
/// Service given back to such a node after an API server outage wait
/// 21-24 s unserved, a 53-second-old status taken for a reading of the
/// new assignment. (An older agent reports no `observedGeneration`: any
/// listing counts. Assignments already there at the first look count as
/// given before it: a new leader does not know when they were.)
const UNREAD: &str = "UNREAD";
/// How long an assignment may go unlisted before its node is avoided for
/// it: a node cut off from the API server looks fresh for up to the
/// staleness bound (its heartbeat is a 10 s backstop), and a Service given
/// to it meanwhile would wait unserved (the fault soak: 24 s and 48 s).
pub(crate) const UNREAD_AFTER: Duration = Duration::from_secs(3);

/// The nodes to avoid per Service (`namespace/name`).
pub(crate) type Avoid = BTreeMap<String, BTreeSet<String>>;

/// One node object as [`ServiceHealth::observe`] reads it.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Report<'a> {
    pub(crate) node: &'a str,
    pub(crate) spec: &'a Spec,
    /// The object's `metadata.generation` (its spec's version).
    pub(crate) generation: Option<i64>,
    pub(crate) status: &'a Status,
}

/// Without a generation: the listing rule alone. For the tests, which
/// judge most cases by listing; the controller always builds a `Report`.
#[cfg(test)]
impl<'a> From<(&'a str, &'a Spec, &'a Status)> for Report<'a> {
    fn from((node, spec, status): (&'a str, &'a Spec, &'a Status)) -> Self {
        Report {
            node,
            spec,
            generation: None,
            status,
        }
    }
}

#[derive(Debug, Clone)]
pub(crate) struct ServiceHealth {
    failed_after: Duration,
    guarded_after: Duration,
    avoid_for: Duration,
    /// `(service, node)`: the unhealthy state reported and since when (our
    /// clock).
    since: BTreeMap<(String, String), (&'static str, Instant)>,
    /// `(service, node)`: avoided until then.
    avoided: BTreeMap<(String, String), Instant>,
    /// The assignments of the last look, `(service, node)`.
    assigned: BTreeSet<(String, String)>,
    /// `(service, node)`: assignments that appeared after the first look,
    /// with the generation of the node object that first carried them,
    /// until a status that read it lists them.
    given: BTreeMap<(String, String), i64>,
    /// Whether `observe` ran before.
    looked: bool,
}

impl ServiceHealth {
    pub(crate) fn new(
        failed_after: Duration,
        guarded_after: Duration,
        avoid_for: Duration,
    ) -> Self {
        ServiceHealth {
            failed_after,
            guarded_after,
            avoid_for,
            since: BTreeMap::new(),
            avoided: BTreeMap::new(),
            assigned: BTreeSet::new(),
            given: BTreeMap::new(),
            looked: false,
        }
    }

    /// Takes in what every node is assigned and reports now; returns the
    /// nodes to avoid per Service. While the reports are not `current`
    /// (the watch of the node objects failed and has not listed them again:
    /// an API server outage), nothing ages: a state is counted from when
    /// the view moves again. The fault soak saw Services moved off nodes
    /// that served them, on a view 16 s old whose unlisted assignments and
    /// guarded leases had aged through an outage.
    pub(crate) fn observe<'a, R: Into<Report<'a>>>(
        &mut self,
        reports: impl IntoIterator<Item = R>,
        now: Instant,
        current: bool,
    ) -> Avoid {
        if !current {
            for (_, at) in self.since.values_mut() {
                *at = now;
            }
        }
        let mut seen = BTreeSet::new();
        let mut assigned = BTreeSet::new();
        for Report {
            node,
            spec,
            generation,
            status,
        } in reports.into_iter().map(Into::into)
        {
            for a in spec.assignments.iter().filter(|a| !a.release) {
                let key = (a.service.clone(), node.to_string());
                assigned.insert(key.clone());
                if let Some(g) = generation
                    && self.looked
                    && !self.assigned.contains(&key)
                {
                    self.given.entry(key.clone()).or_insert(g);
                }
                let listed = status.leases.iter().any(|l| l.interface == a.interface);
                let read = listed
                    && self
                        .given
                        .get(&key)
                        .is_none_or(|given| status.observed_generation.is_none_or(|o| o >= *given));
                if read {
                    self.given.remove(&key);
                    continue;
                }
                let entry = self.since.entry(key.clone()).or_insert((UNREAD, now));
                if entry.0 != UNREAD {
                    *entry = (UNREAD, now);
                }
                if now.saturating_duration_since(entry.1) >= UNREAD_AFTER {
                    self.avoided.insert(key.clone(), now + self.avoid_for);
                }
                seen.insert(key);
            }
            for lease in &status.leases {
                let state = match lease.state.as_str() {
                    FAILED => FAILED,
                    GUARDED => GUARDED,
                    _ => continue,
                };
                let key = (lease.service.clone(), node.to_string());
                let entry = self.since.entry(key.clone()).or_insert((state, now));
                if entry.0 != state {
                    *entry = (state, now);
                }
                let bound = if state == FAILED {
                    self.failed_after
                } else {
                    self.guarded_after
                };
                if now.saturating_duration_since(entry.1) >= bound {
                    self.avoided.insert(key.clone(), now + self.avoid_for);
                }
                seen.insert(key);
            }
        }
        self.since.retain(|k, _| seen.contains(k));
        self.given.retain(|k, _| assigned.contains(k));
        self.assigned = assigned;
        self.looked = true;
        self.avoided.retain(|_, until| *until > now);
        let mut out = Avoid::new();
        for (service, node) in self.avoided.keys() {
            out.entry(service.clone()).or_default().insert(node.clone());
        }
        out
    }

    /// The next time the verdict changes by time alone: a report turning
    /// unhealthy, or an avoidance running out.
    pub(crate) fn next_deadline(&self) -> Option<Instant> {
        let turning = self.since.iter().map(|(k, (state, at))| {
            if self.avoided.contains_key(k) {
                return None;
            }
            Some(
                *at + match *state {
                    FAILED => self.failed_after,
                    UNREAD => UNREAD_AFTER,
                    _ => self.guarded_after,
                },
            )
        });
        turning
            .flatten()
            .chain(self.avoided.values().copied())
            .min()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use hna_contract::node_object::LeaseReport;

    fn status(leases: &[(&str, &str)]) -> Status {
        Status {
            leases: leases
                .iter()
                .map(|(service, state)| LeaseReport {
                    service: service.to_string(),
                    state: state.to_string(),
                    ..LeaseReport::default()
                })
                .collect(),
            ..Status::default()
        }
    }

    fn health() -> ServiceHealth {
        ServiceHealth::new(
            Duration::from_secs(30),
            Duration::from_secs(150),
            Duration::from_secs(600),
        )
    }

    #[test]
    fn a_lease_failed_for_its_bound_makes_its_node_avoided_for_a_while() {
        let mut h = health();
        let t0 = Instant::now();
        let failed = status(&[("default/web", "FAILED"), ("default/db", "BOUND")]);
        assert!(
            h.observe([("node-1", &Spec::default(), &failed)], t0, true)
                .is_empty()
        );
        assert_eq!(h.next_deadline(), Some(t0 + Duration::from_secs(30)));
        let later = t0 + Duration::from_secs(30);
        let avoid = h.observe([("node-1", &Spec::default(), &failed)], later, true);
        assert_eq!(avoid["default/web"], BTreeSet::from(["node-1".to_string()]));
        assert!(!avoid.contains_key("default/db"));
        // Moved away: node-1 no longer reports it, and stays avoided for
        // `avoid_for`, then not.
        let gone = status(&[("default/db", "BOUND")]);
        assert!(
            h.observe(
                [("node-1", &Spec::default(), &gone)],
                later + Duration::from_secs(599),
                true,
            )
            .contains_key("default/web")
        );
        assert_eq!(h.next_deadline(), Some(later + Duration::from_secs(600)));
        assert!(
            h.observe(
                [("node-1", &Spec::default(), &gone)],
                later + Duration::from_secs(600),
                true,
            )
            .is_empty()
        );
        assert_eq!(h.next_deadline(), None);
    }

    #[test]
    fn a_guard_gets_the_longer_bound_and_a_recovery_starts_the_count_again() {
        let mut h = health();
        let t0 = Instant::now();
        let guarded = status(&[("default/web", "GUARDED")]);
        let bound = status(&[("default/web", "BOUND")]);
        assert!(
            h.observe([("node-2", &Spec::default(), &guarded)], t0, true)
                .is_empty()
        );
        assert!(
            h.observe(
                [("node-2", &Spec::default(), &guarded)],
                t0 + Duration::from_secs(149),
                true,
            )
            .is_empty()
        );
        // It bound: the count ends; guarded again, it starts over.
        assert!(
            h.observe(
                [("node-2", &Spec::default(), &bound)],
                t0 + Duration::from_secs(149),
                true,
            )
            .is_empty()
        );
        let t1 = t0 + Duration::from_secs(150);
        assert!(
            h.observe([("node-2", &Spec::default(), &guarded)], t1, true)
                .is_empty()
        );
        assert!(
            h.observe(
                [("node-2", &Spec::default(), &guarded)],
                t1 + Duration::from_secs(100),
                true,
            )
            .is_empty()
        );
        assert!(
            !h.observe(
                [("node-2", &Spec::default(), &guarded)],
                t1 + Duration::from_secs(150),
                true,
            )
            .is_empty()
        );
    }

    /// A node's spec that assigns `default/web`.
    fn web_assigned() -> Spec {
        Spec {
            assignments: vec![hna_contract::node_object::Assignment {
                service: "default/web".into(),
                interface: "hlb-3f2a9c1e".into(),
                ..Default::default()
            }],
            ..Spec::default()
        }
    }

    /// An assignment its node does not list at all (it has not read it:
    /// cut off from the API server) makes the node avoided for that
    /// Service after `UNREAD_AFTER`, so the Service moves; listed in any
    /// state, it does not.
    #[test]
    fn an_assignment_the_node_never_lists_makes_it_avoided() {
        let mut h = health();
        let t0 = Instant::now();
        let spec = web_assigned();
        let silent = Status::default();
        assert!(h.observe([("node-3", &spec, &silent)], t0, true).is_empty());
        assert_eq!(h.next_deadline(), Some(t0 + UNREAD_AFTER));
        let avoid = h.observe([("node-3", &spec, &silent)], t0 + UNREAD_AFTER, true);
        assert_eq!(avoid["default/web"], BTreeSet::from(["node-3".to_string()]));
        let mut h = health();
        let listed = Status {
            leases: vec![LeaseReport {
                service: "default/web".into(),
                interface: "hlb-3f2a9c1e".into(),
                state: "STARTING".into(),
                ..LeaseReport::default()
            }],
            ..Status::default()
        };
        assert!(h.observe([("node-3", &spec, &listed)], t0, true).is_empty());
        assert!(
            h.observe(
                [("node-3", &spec, &listed)],
                t0 + Duration::from_secs(60),
                true
            )
            .is_empty()
        );
    }

    /// A status the agent wrote before it read the assignment, still
    /// listing the lease from an earlier hold (its node cut off from the
    /// API server since), is no reading of it: the node is avoided after
    /// `UNREAD_AFTER`. One written after the read (its
    /// `observedGeneration` caught up) is; so is any listing of an agent
    /// that reports no generation (older agents).
    #[test]
    fn a_listing_older_than_the_assignment_is_no_reading_of_it() {
        let listed = |observed: Option<i64>| Status {
            observed_generation: observed,
            leases: vec![LeaseReport {
                service: "default/web".into(),
                interface: "hlb-3f2a9c1e".into(),
                state: "BOUND".into(),
                ..LeaseReport::default()
            }],
            ..Status::default()
        };
        let (spec, none) = (web_assigned(), Spec::default());
        fn report<'a>(spec: &'a Spec, generation: i64, status: &'a Status) -> Report<'a> {
            Report {
                node: "node-3",
                spec,
                generation: Some(generation),
                status,
            }
        }
        let t0 = Instant::now();
        let given = t0 + Duration::from_secs(40);
        for (now, avoided) in [
            (listed(Some(1)), true),
            (listed(Some(2)), false),
            (listed(None), false),
        ] {
            let mut h = health();
            // Held at generation 1, moved away at 2 (its node cut off
            // since: its status still says 1), given back at 3.
            let old = listed(Some(1));
            assert!(h.observe([report(&none, 2, &old)], t0, true).is_empty());
            assert!(h.observe([report(&spec, 3, &old)], given, true).is_empty());
            assert_eq!(h.next_deadline(), Some(given + UNREAD_AFTER));
            let now = Status {
                observed_generation: now.observed_generation.map(|g| g + 1),
                ..now
            };
            let t1 = given + Duration::from_secs(1);
            assert!(h.observe([report(&spec, 3, &now)], t1, true).is_empty());
            let avoid = h.observe([report(&spec, 3, &now)], given + UNREAD_AFTER, true);
            assert_eq!(
                avoid.contains_key("default/web"),
                avoided,
                "observed generation {:?}",
                now.observed_generation
            );
        }
    }

    /// The node objects' watch failed (an API server outage): the view is
    /// frozen, and what it shows does not age. Once it is current again,
    /// a state counts from then.
    #[test]
    fn a_frozen_view_ages_nothing() {
        let mut h = health();
        let t0 = Instant::now();
        let spec = web_assigned();
        let unread = Status::default();
        let guarded = status(&[("default/db", "GUARDED")]);
        let reports = [
            ("node-3", &spec, &unread),
            ("node-2", &Spec::default(), &guarded),
        ];
        assert!(h.observe(reports, t0, true).is_empty());
        let outage_end = t0 + Duration::from_secs(200);
        let mut t = t0;
        while t <= outage_end {
            assert!(h.observe(reports, t, false).is_empty(), "{:?}", t - t0);
            t += Duration::from_secs(1);
        }
        assert!(h.observe(reports, outage_end, true).is_empty());
        let avoid = h.observe(reports, outage_end + UNREAD_AFTER, true);
        assert_eq!(
            avoid.keys().collect::<Vec<_>>(),
            ["default/web"],
            "unread counts from the end"
        );
        let avoid = h.observe(reports, outage_end + Duration::from_secs(150), true);
        assert!(
            avoid.contains_key("default/db"),
            "guarded counts from the end"
        );
    }
}
