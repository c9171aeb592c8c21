//! Which nodes are dead on their LAN, by their witnesses' agreement.
//!
//! Each node's agent watches the nodes it is a witness of (the ring in
//! `hna_contract::membership`) and lists those it found dead, after probes of
//! its own, in `status.lan.down`. A node is dead on the LAN when at least
//! two of its live witnesses list it (all of them when it has fewer than
//! two live ones): never on one voice, so one witness with a bad port or a
//! bad view cannot move anything. Not counted:
//!
//! - a witness whose heartbeat is not on time by its own stated period
//!   (two periods and a second, `Liveness::on_time`): a witness cut off
//!   from the API server after it accused cannot take the accusation back
//!   when the accused comes back, so its word stops counting within
//!   seconds, not at the 40 s staleness bound. An accusing agent beats
//!   every 2 s (`loadbalancer::status_writes::ACCUSING_PERIOD`) to stay on time;
//! - a witness the accused lists in turn, unless more witnesses accuse the
//!   accused than accuse it: two nodes that cannot hear each other do not
//!   tell which of them is cut off, but a node whose port went silent
//!   accuses everyone it watches and is accused by all its witnesses, so
//!   the count tells (equal counts: neither report counts);
//! - a witness that is itself dead on the LAN (found in a first round);
//! - a witness that fenced itself (its `Ready` condition's reason is
//!   `Fenced`: it hears too few of its peers and not its gateway): in a LAN
//!   split that the API server sees from both halves, the fenced half
//!   accuses the half that reaches the gateway, and on some ring layouts
//!   every node of it was judged dead (issue #49's model: 12 nodes, ring
//!   positions {0,1,2,6,7,8} | {3,4,5,9,10,11}).
//!
//! A node whose agent is restarting (`restartGraceMs`) is judged by its
//! heartbeat only, for that long: its membership is down on purpose.
//!
//! The other way round, a node is vouched for on the LAN when a live
//! witness with a fresh status hears it (`status.lan.hears`): the
//! controller does not move a node whose own status went stale (cut off
//! from the API server) while its LAN says it is there.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use tokio::time::Instant;

use hna_contract::membership::{LanReport, witnesses_all};

/// How long after its verdict a node dead on its LAN that said it hears
/// its LAN no more is waited for to report its addresses gone before they
/// move all the same ([`LetGo`]).
pub(crate) const LET_GO_WAIT: Duration = Duration::from_secs(5);
/// How long before its verdict a node's `status.lan.unheard` may have
/// turned up for it to count: its witnesses report it a lifetime and a
/// margin (1.25 s by default) after its LAN went quiet, and it says so
/// within a fraction of that. An older one is another silence's (a
/// witness that went away and came back before): the soak saw a node that
/// had lost its carrier, which no write could leave, waited for on such a
/// flag for 5 s.
pub(crate) const UNHEARD_LEAD: Duration = Duration::from_secs(5);

/// Which nodes dead on their LAN must let go of their addresses before
/// these go to other nodes (`reconcile::NodeIn::lets_go_first`).
///
/// A node's witnesses may not hear it while the API server does: its port
/// cut off from its peers' ports only (a switch's port isolation or VLAN
/// filter gone wrong), its gateway and its clients still reaching it. It
/// cannot tell that from its peers' death and serves on; the controller
/// moves its Services on its witnesses' word, and a new holder would bind
/// before it read that it lost them, its takeover guard deaf to it through
/// the cut: the gateway got two answers 35 times in the fault soak. A node
/// that said, within [`UNHEARD_LEAD`] before its verdict, that it hears
/// its LAN no more, and whose heartbeat is on time, wrote after its LAN
/// went quiet and still reads its assignments: its addresses go to their
/// next holders once it reports them gone, or [`LET_GO_WAIT`] after the
/// verdict (one that does not let go by then is not acting on its
/// assignments). A node whose uplink died could not say so, and is moved
/// from at once.
#[derive(Debug, Default)]
pub(crate) struct LetGo {
    dead_since: BTreeMap<String, Instant>,
    unheard_since: BTreeMap<String, Instant>,
}

impl LetGo {
    /// Takes in one pass's view: the nodes dead on the LAN, and those
    /// whose status says `unheard`, at `now`. Returns the nodes newly dead.
    pub(crate) fn observe(
        &mut self,
        dead: &BTreeSet<String>,
        unheard: &BTreeSet<String>,
        now: Instant,
    ) -> Vec<String> {
        let newly: Vec<String> = dead
            .iter()
            .filter(|n| !self.dead_since.contains_key(*n))
            .cloned()
            .collect();
        self.dead_since.retain(|n, _| dead.contains(n));
        for n in &newly {
            self.dead_since.insert(n.clone(), now);
        }
        self.unheard_since.retain(|n, _| unheard.contains(n));
        for n in unheard {
            self.unheard_since.entry(n.clone()).or_insert(now);
        }
        newly
    }

    /// Whether `node` is one to wait for now (its heartbeat `on_time`).
    pub(crate) fn lets_go_first(&self, node: &str, on_time: bool, now: Instant) -> bool {
        let (Some(dead), Some(unheard)) = (self.dead_since.get(node), self.unheard_since.get(node))
        else {
            return false;
        };
        on_time && now < *dead + LET_GO_WAIT && *unheard + UNHEARD_LEAD >= *dead
    }

    /// When the next wait ends.
    pub(crate) fn next_deadline(&self, now: Instant) -> Option<Instant> {
        self.dead_since
            .values()
            .map(|d| *d + LET_GO_WAIT)
            .filter(|at| *at > now)
            .min()
    }

    /// The nodes dead on the LAN as last observed.
    pub(crate) fn dead(&self) -> impl Iterator<Item = &str> {
        self.dead_since.keys().map(String::as_str)
    }
}

/// One node's membership report, as the decision needs it.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Reporter<'a> {
    pub(crate) name: &'a str,
    pub(crate) lan: &'a LanReport,
    /// Its status is fresh (not stale): what it hears counts.
    pub(crate) fresh: bool,
    /// Its heartbeat is on time by its stated period: what it accuses
    /// counts.
    pub(crate) on_time: bool,
    /// Restarting within its grace: not judged on the LAN.
    pub(crate) restarting: bool,
    /// Fenced (its own status says so): what it accuses does not count.
    pub(crate) fenced: bool,
}

/// What the LAN says of its nodes.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct LanVerdict {
    /// Dead on the LAN, by their witnesses' agreement.
    pub(crate) dead: BTreeSet<String>,
    /// Heard by a live witness with a fresh status.
    pub(crate) vouched: BTreeSet<String>,
}

/// What the LAN says of every node that reports on it.
pub(crate) fn judge(reporters: &[Reporter<'_>]) -> LanVerdict {
    let mut networks: BTreeMap<&str, Vec<&Reporter<'_>>> = BTreeMap::new();
    for r in reporters {
        networks.entry(r.lan.network.as_str()).or_default().push(r);
    }
    let mut dead = BTreeSet::new();
    let mut vouched = BTreeSet::new();
    for members in networks.values() {
        let by_name: BTreeMap<&str, &Reporter<'_>> = members.iter().map(|r| (r.name, *r)).collect();
        let names: Vec<&str> = by_name.keys().copied().collect();
        let witnesses: BTreeMap<&str, Vec<String>> = witnesses_all(names.iter().copied());
        let accused_in = |w: &str, node: &str| {
            by_name
                .get(w)
                .is_some_and(|r| r.on_time && !r.fenced && r.lan.down.iter().any(|d| d == node))
        };
        let heard_in = |w: &str, node: &str| {
            by_name
                .get(w)
                .is_some_and(|r| r.fresh && r.lan.hears.iter().any(|d| d == node))
        };
        // Every fresh witness's accusation, before any is weighed.
        let accused_by: BTreeMap<&str, usize> = witnesses
            .iter()
            .map(|(n, ws)| (*n, ws.iter().filter(|w| accused_in(w, n)).count()))
            .collect();
        let accuses = |w: &str, accused: &str| -> bool {
            let Some(ra) = by_name.get(accused) else {
                return false;
            };
            let mutual = ra.lan.down.iter().any(|d| d == w);
            accused_in(w, accused) && (!mutual || accused_by.get(w) < accused_by.get(accused))
        };
        let judge = |excluded: &BTreeSet<String>| -> BTreeSet<String> {
            let mut out = BTreeSet::new();
            for (node, ws) in &witnesses {
                if by_name[node].restarting {
                    continue;
                }
                let live: Vec<&String> = ws.iter().filter(|w| !excluded.contains(*w)).collect();
                let need = live.len().min(2);
                if need == 0 {
                    continue;
                }
                let voices = live.iter().filter(|w| accuses(w, node)).count();
                if voices >= need {
                    out.insert(node.to_string());
                }
            }
            out
        };
        let first = judge(&BTreeSet::new());
        let found = judge(&first);
        for (node, ws) in &witnesses {
            if ws.iter().any(|w| !found.contains(w) && heard_in(w, node)) {
                vouched.insert(node.to_string());
            }
        }
        dead.extend(found);
    }
    LanVerdict { dead, vouched }
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Net {
        reports: BTreeMap<String, LanReport>,
        stale: BTreeSet<String>,
        late: BTreeSet<String>,
        restarting: BTreeSet<String>,
        fenced: BTreeSet<String>,
    }

    impl Net {
        fn new(n: usize) -> Net {
            Net {
                reports: (0..n)
                    .map(|i| {
                        (
                            format!("n{i}"),
                            LanReport {
                                address: format!("10.0.0.{}:7947", 10 + i),
                                network: "10.0.0.0/24".into(),
                                down: Vec::new(),
                                hears: Vec::new(),
                                alive: 0,
                                unheard: false,
                            },
                        )
                    })
                    .collect(),
                stale: BTreeSet::new(),
                late: BTreeSet::new(),
                restarting: BTreeSet::new(),
                fenced: BTreeSet::new(),
            }
        }

        fn witnesses(&self, node: &str) -> Vec<String> {
            hna_contract::membership::witnesses_of(self.reports.keys().map(String::as_str), node)
        }

        fn accuse(&mut self, witness: &str, node: &str) {
            self.reports
                .get_mut(witness)
                .unwrap()
                .down
                .push(node.to_string());
        }

        fn dead(&self) -> BTreeSet<String> {
            self.verdict().dead
        }

        fn verdict(&self) -> LanVerdict {
            let r: Vec<Reporter<'_>> = self
                .reports
                .iter()
                .map(|(n, lan)| Reporter {
                    name: n,
                    lan,
                    fresh: !self.stale.contains(n),
                    on_time: !self.stale.contains(n) && !self.late.contains(n),
                    restarting: self.restarting.contains(n),
                    fenced: self.fenced.contains(n),
                })
                .collect();
            judge(&r)
        }
    }

    #[test]
    fn two_witnesses_agree_one_does_not_suffice() {
        let mut net = Net::new(6);
        let w = net.witnesses("n2");
        assert_eq!(w.len(), 3);
        net.accuse(&w[0], "n2");
        assert!(net.dead().is_empty(), "one voice moved it");
        net.accuse(&w[1], "n2");
        assert_eq!(net.dead(), BTreeSet::from(["n2".to_string()]));
    }

    #[test]
    fn a_node_that_is_no_witness_has_no_voice() {
        let mut net = Net::new(8);
        let w = net.witnesses("n3");
        let others: Vec<String> = net
            .reports
            .keys()
            .filter(|n| *n != "n3" && !w.contains(n))
            .cloned()
            .collect();
        for o in &others {
            net.accuse(o, "n3");
        }
        assert!(net.dead().is_empty());
    }

    #[test]
    fn stale_witnesses_and_mutual_accusations_do_not_count() {
        let mut net = Net::new(6);
        let w = net.witnesses("n1");
        net.accuse(&w[0], "n1");
        net.accuse(&w[1], "n1");
        net.stale.insert(w[1].clone());
        assert!(net.dead().is_empty(), "a stale report counted");
        net.stale.clear();
        net.reports.get_mut(&w[1]).unwrap().down.clear();
        // w[0] and n1 cannot hear each other, and nobody else says a word:
        // which of them is cut off does not show.
        net.accuse("n1", &w[0]);
        assert!(net.dead().is_empty(), "a mutual accusation counted");
        // A second witness of n1 agrees with w[0]: n1 is the one.
        net.accuse(&w[1], "n1");
        assert_eq!(net.dead(), BTreeSet::from(["n1".to_string()]));
    }

    /// The soak's stale accusation: two witnesses accused n1, then lost
    /// the API server; n1 came back and they cleared their lists, which
    /// could not land. Their statuses are still fresh (inside the
    /// staleness bound) and what they hear still counts, but their
    /// heartbeats are late by their own period, so their accusations no
    /// longer do.
    #[test]
    fn a_late_witness_accuses_nobody_but_still_vouches() {
        let mut net = Net::new(6);
        let w = net.witnesses("n1");
        net.accuse(&w[0], "n1");
        net.accuse(&w[1], "n1");
        assert_eq!(net.dead(), BTreeSet::from(["n1".to_string()]));
        net.late.insert(w[0].clone());
        assert!(net.dead().is_empty(), "a late accusation counted");
        net.reports.get_mut(&w[2]).unwrap().hears.push("n1".into());
        net.late.insert(w[2].clone());
        assert_eq!(
            net.verdict().vouched,
            BTreeSet::from(["n1".to_string()]),
            "a late but fresh witness's hearing"
        );
    }

    /// A node whose LAN port went silent hears nobody: it accuses every
    /// node it watches, and every witness of it accuses it. The count
    /// tells which one is cut off; nobody else is moved.
    #[test]
    fn a_node_that_hears_nobody_is_the_one_moved() {
        for n in [3, 4, 7] {
            let mut net = Net::new(n);
            let cut = "n1";
            let names: Vec<String> = net.reports.keys().cloned().collect();
            for other in names.iter().filter(|o| *o != cut) {
                if net.witnesses(other).contains(&cut.to_string()) {
                    net.accuse(cut, other);
                }
                if net.witnesses(cut).contains(other) {
                    net.accuse(other, cut);
                }
            }
            assert_eq!(net.dead(), BTreeSet::from([cut.to_string()]), "{n} nodes");
        }
    }

    /// Issue #49: a LAN split in two halves, the API server reachable
    /// from both, one half fenced (it does not reach the gateway). Every
    /// witness across the cut accuses the nodes it watches there. With the
    /// fenced half's voices counted, ring layouts like the model's (12
    /// nodes, positions {0,1,2,6,7,8} against the rest) judged nodes of
    /// the gateway's half dead; not counted, none is, whatever the layout.
    #[test]
    fn a_fenced_witness_has_no_voice_in_a_split() {
        let mut wrong_before = 0;
        for n in [4, 6, 12] {
            let probe = Net::new(n);
            // The ring's order, each node's first witness after it.
            let mut ring = vec!["n0".to_string()];
            while ring.len() < n {
                let next = probe.witnesses(ring.last().unwrap())[0].clone();
                ring.push(next);
            }
            let layouts: Vec<Vec<usize>> = if n == 12 {
                vec![
                    vec![0, 1, 2, 6, 7, 8],
                    vec![0, 1, 2, 3, 4, 5],
                    vec![0, 2, 4, 6, 8, 10],
                ]
            } else {
                vec![(0..n / 2).collect(), (0..n).step_by(2).collect()]
            };
            for layout in layouts {
                let mut net = Net::new(n);
                let gateway_side: BTreeSet<String> =
                    layout.iter().map(|i| ring[*i].clone()).collect();
                let names: Vec<String> = net.reports.keys().cloned().collect();
                for node in &names {
                    for w in net.witnesses(node) {
                        if gateway_side.contains(node) != gateway_side.contains(&w) {
                            net.accuse(&w, node);
                        }
                    }
                }
                let counted = net.dead();
                if !counted.is_disjoint(&gateway_side) {
                    wrong_before += 1;
                }
                net.fenced = names
                    .iter()
                    .filter(|x| !gateway_side.contains(*x))
                    .cloned()
                    .collect();
                let dead = net.dead();
                assert!(
                    dead.is_disjoint(&gateway_side),
                    "{n} nodes, gateway side at ring positions {layout:?}: {dead:?} judged dead (before: {counted:?})"
                );
            }
        }
        assert!(wrong_before > 0, "no layout shows what the rule is for");
    }

    #[test]
    fn a_node_a_live_witness_hears_is_vouched_for() {
        let mut net = Net::new(5);
        let w = net.witnesses("n3");
        assert!(net.verdict().vouched.is_empty());
        net.reports.get_mut(&w[0]).unwrap().hears.push("n3".into());
        assert_eq!(net.verdict().vouched, BTreeSet::from(["n3".to_string()]));
        // Not by a stale witness, nor by one that is no witness of it.
        net.stale.insert(w[0].clone());
        assert!(net.verdict().vouched.is_empty());
        net.stale.clear();
        net.reports.get_mut(&w[0]).unwrap().hears.clear();
        let stranger = net
            .reports
            .keys()
            .find(|n| *n != "n3" && !w.contains(n))
            .cloned();
        if let Some(s) = stranger {
            net.reports.get_mut(&s).unwrap().hears.push("n3".into());
            assert!(net.verdict().vouched.is_empty());
        }
    }

    #[test]
    fn a_two_node_lan_moves_on_its_only_witness_unless_both_accuse() {
        let mut net = Net::new(2);
        net.accuse("n0", "n1");
        assert_eq!(net.dead(), BTreeSet::from(["n1".to_string()]));
        net.accuse("n1", "n0");
        assert!(net.dead().is_empty());
    }

    #[test]
    fn a_dead_witness_leaves_the_verdict_to_the_live_ones() {
        let mut net = Net::new(7);
        // The victim and its first witness die together; the two other
        // witnesses of the victim agree, and the dead witness's own
        // witnesses agree on it.
        let victim = "n4";
        let w = net.witnesses(victim);
        let dead_witness = w[0].clone();
        for x in [w[1].clone(), w[2].clone()] {
            net.accuse(&x, victim);
        }
        let ww = net.witnesses(&dead_witness);
        for x in ww.iter().filter(|x| *x != victim).take(2) {
            net.accuse(x, &dead_witness);
        }
        let dead = net.dead();
        assert!(dead.contains(victim), "{dead:?}");
        assert!(dead.contains(&dead_witness), "{dead:?}");
    }

    #[test]
    fn a_restarting_node_is_not_judged_on_the_lan_and_networks_are_apart() {
        let mut net = Net::new(5);
        let w = net.witnesses("n0");
        net.accuse(&w[0], "n0");
        net.accuse(&w[1], "n0");
        net.restarting.insert("n0".into());
        assert!(net.dead().is_empty());
        net.restarting.clear();
        // On another network, the same reports are no witnesses' at all.
        net.reports.get_mut("n0").unwrap().network = "10.1.0.0/24".into();
        assert!(net.dead().is_empty());
    }

    mod let_go {
        use std::collections::BTreeSet;
        use std::time::Duration;

        use tokio::time::Instant;

        use super::super::{LET_GO_WAIT, LetGo, UNHEARD_LEAD};

        fn set(names: &[&str]) -> BTreeSet<String> {
            names.iter().map(|n| n.to_string()).collect()
        }

        /// Cut off from its peers only: it said so before its verdict,
        /// and is waited for until it lets go or the wait ends.
        #[test]
        fn a_node_that_said_it_hears_its_lan_no_more_is_waited_for_a_while() {
            let t0 = Instant::now();
            let mut l = LetGo::default();
            l.observe(&set(&[]), &set(&["n1"]), t0 + Duration::from_millis(300));
            let dead_at = t0 + Duration::from_millis(1500);
            assert_eq!(l.observe(&set(&["n1"]), &set(&["n1"]), dead_at), ["n1"]);
            assert!(l.lets_go_first("n1", true, dead_at));
            assert_eq!(l.next_deadline(dead_at), Some(dead_at + LET_GO_WAIT));
            assert!(!l.lets_go_first("n1", false, dead_at), "its heartbeat late");
            assert!(
                !l.lets_go_first("n1", true, dead_at + LET_GO_WAIT),
                "waited long enough"
            );
            assert!(!l.lets_go_first("n2", true, dead_at));
            // Its witnesses hear it again: nothing to wait for.
            l.observe(&set(&[]), &set(&["n1"]), dead_at + Duration::from_secs(1));
            assert!(!l.lets_go_first("n1", true, dead_at + Duration::from_secs(1)));
            assert_eq!(l.next_deadline(dead_at), None);
        }

        /// Its uplink died: it could not say so (no `unheard`), or what it
        /// said is another silence's, from long before.
        #[test]
        fn a_node_that_could_not_say_so_is_moved_from_at_once() {
            let t0 = Instant::now();
            let mut l = LetGo::default();
            l.observe(&set(&["n1"]), &set(&[]), t0);
            assert!(!l.lets_go_first("n1", true, t0));
            let mut stale = LetGo::default();
            stale.observe(&set(&[]), &set(&["n1"]), t0);
            let dead_at = t0 + UNHEARD_LEAD + Duration::from_millis(1);
            stale.observe(&set(&["n1"]), &set(&["n1"]), dead_at);
            assert!(!stale.lets_go_first("n1", true, dead_at));
        }
    }
}
