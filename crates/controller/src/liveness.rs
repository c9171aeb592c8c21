//! Which node agents are alive, judged on the controller's own clock: an
//! agent's heartbeat is an opaque value that must keep changing. Its
//! content (the agent's time) is never compared with ours, so clock skew
//! between a node and the controller cannot make a live agent look dead or
//! a dead one look alive.
//!
//! A heartbeat seen for the first time counts as seen now: a controller that
//! has just started (or a replica that has just become leader) does not
//! judge a node it has not watched for a whole period, so it moves nothing.
//!
//! Silence is the watch's fault until shown otherwise: when no node's
//! heartbeat has changed for `quiet_after` (the API server or etcd is down,
//! or this replica's watch is cut), nobody is judged stale, and the first
//! change after such a gap gives every node a whole `stale_after` again. A
//! dead node is told apart from a dead watch by the other nodes' heartbeats
//! still arriving; so an API server outage of any length moves nothing.
//!
//! A restarting agent says so with its last heartbeat (`restartGraceMs`:
//! it left its addresses on their links for that long): its node is judged
//! stale only once that much has passed without a newer one.
//!
//! A second, tighter bound says whether a node's heartbeat is on time by
//! the period it states (`heartbeatPeriodMs`): two periods and
//! [`ON_TIME_SLACK`]. Staleness judges whether a node is there; being on
//! time judges whether it may be given a new Service and whether what it
//! reports of others is its present view: a node whose heartbeat is late
//! is probably cut off from the API server, would not read a new
//! assignment, and its accusations may be ones it has taken back since
//! (`lan_verdict`).

use std::collections::BTreeMap;
use std::time::Duration;

use tokio::time::Instant;

/// How late past two of its stated periods a heartbeat may come and still
/// be on time: a write's way through a loaded API server.
pub(crate) const ON_TIME_SLACK: Duration = Duration::from_secs(1);

/// One node's last heartbeat as seen.
#[derive(Debug, Clone)]
struct Seen {
    value: String,
    /// When (our clock) it was first seen with that value.
    at: Instant,
    /// How long it stays fresh.
    bound: Duration,
    /// How long it stays on time: two stated periods and the slack, at
    /// most `bound`.
    on_time: Duration,
    /// Its heartbeat changed while watched: first seen, or seen again
    /// after a quiet gap, does not count ([`Liveness::written`]).
    written: bool,
}

/// What a node's status says of its heartbeat, besides its value.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Beat {
    /// The restart grace it carries (`restartGraceMs`).
    pub(crate) grace: Option<Duration>,
    /// How often it says it writes (`heartbeatPeriodMs`).
    pub(crate) period: Option<Duration>,
}

#[derive(Debug, Clone)]
pub(crate) struct Liveness {
    stale_after: Duration,
    quiet_after: Duration,
    seen: BTreeMap<String, Seen>,
    /// When any node's heartbeat last changed (our clock).
    last_change: Option<Instant>,
    /// Per node that said it is restarting: until when its grace runs,
    /// whatever it has written since (its next run's first statuses come
    /// before its membership is heard again).
    restart_until: BTreeMap<String, Instant>,
}

impl Liveness {
    /// `quiet_after` is clamped to at most `stale_after`.
    pub(crate) fn new(stale_after: Duration, quiet_after: Duration) -> Liveness {
        Liveness {
            stale_after,
            quiet_after: quiet_after.min(stale_after),
            seen: BTreeMap::new(),
            last_change: None,
            restart_until: BTreeMap::new(),
        }
    }

    /// Records the heartbeat `node` reports now (`None`: it reports none).
    #[cfg(test)]
    pub(crate) fn observe(&mut self, node: &str, heartbeat: Option<&str>, now: Instant) {
        self.observe_status(node, heartbeat, Beat::default(), now)
    }

    /// [`observe`](Self::observe), with what else the node's status says of
    /// its heartbeat.
    pub(crate) fn observe_status(
        &mut self,
        node: &str,
        heartbeat: Option<&str>,
        beat: Beat,
        now: Instant,
    ) {
        let Some(hb) = heartbeat.filter(|h| !h.is_empty()) else {
            self.seen.remove(node);
            return;
        };
        let bound = beat
            .grace
            .map_or(self.stale_after, |g| g.max(self.stale_after));
        if let Some(g) = beat.grace {
            self.restart_until.insert(node.to_string(), now + g);
        }
        let on_time = beat.period.map_or(bound, |p| {
            p.saturating_mul(2).saturating_add(ON_TIME_SLACK).min(bound)
        });
        let fresh = Seen {
            value: hb.to_string(),
            at: now,
            bound,
            on_time,
            written: false,
        };
        let changed = match self.seen.get_mut(node) {
            Some(seen) if seen.value == hb => false,
            Some(entry) => {
                *entry = Seen {
                    written: true,
                    ..fresh
                };
                true
            }
            None => {
                self.seen.insert(node.to_string(), fresh);
                true
            }
        };
        if changed {
            if self.quiet(now) {
                // The first news after a gap: nobody's silence during it
                // counts against them, and nobody but its sender is known
                // to write since.
                for (name, seen) in self.seen.iter_mut() {
                    seen.at = now;
                    seen.written &= name == node;
                }
            }
            self.last_change = Some(now);
        }
    }

    /// No heartbeat has changed for `quiet_after`: the silence says more
    /// about the watch than about the nodes.
    fn quiet(&self, now: Instant) -> bool {
        self.last_change
            .is_none_or(|at| now.saturating_duration_since(at) >= self.quiet_after)
    }

    /// When `node`'s heartbeat last changed (first seen with its value),
    /// on this controller's clock.
    pub(crate) fn last_change(&self, node: &str) -> Option<Instant> {
        self.seen.get(node).map(|s| s.at)
    }

    /// Whether `node`'s heartbeat changed within the staleness bound (or
    /// the watch is too quiet to tell).
    pub(crate) fn fresh(&self, node: &str, now: Instant) -> bool {
        self.seen
            .get(node)
            .is_some_and(|s| now.saturating_duration_since(s.at) < s.bound || self.quiet(now))
    }

    /// Whether `node`'s heartbeat changed within two of its stated periods
    /// and [`ON_TIME_SLACK`] (or the watch is too quiet to tell): what it
    /// reports of other nodes is its present view. A node that states no
    /// period is on time while it is fresh.
    pub(crate) fn on_time(&self, node: &str, now: Instant) -> bool {
        self.seen
            .get(node)
            .is_some_and(|s| now.saturating_duration_since(s.at) < s.on_time || self.quiet(now))
    }

    /// Whether `node`'s heartbeat has changed since this controller began
    /// to watch it, and since the last quiet gap (an API server outage):
    /// it is known to write now, so to read. A controller that has just
    /// started counts every heartbeat as seen at its start, so a node cut
    /// off from the API server for long is fresh and on time to it for a
    /// while; the fault soak saw a new leader give such a node a Service it
    /// could not read. Placement prefers the nodes that have written.
    pub(crate) fn written(&self, node: &str) -> bool {
        self.seen.get(node).is_some_and(|s| s.written)
    }

    /// Whether `node`'s agent said it is restarting and that grace has not
    /// run out, whether or not its next run has written since: its LAN
    /// membership is down on purpose until the next run's is heard.
    pub(crate) fn restarting(&self, node: &str, now: Instant) -> bool {
        self.restart_until
            .get(node)
            .is_some_and(|until| now < *until)
    }

    /// Eligible to hold addresses: the agent says it is ready, and its
    /// heartbeat is fresh.
    #[cfg(test)]
    pub(crate) fn eligible(&self, node: &str, ready: bool, now: Instant) -> bool {
        ready && self.fresh(node, now)
    }

    /// Whether a heartbeat period (the node's `heartbeatPeriodMs`) is too
    /// slow for the staleness bound: less than two heartbeats fit in it, so
    /// one late write would make a live node look dead. `None` (an agent
    /// that does not say) is taken as fitting.
    pub(crate) fn too_slow(&self, period: Option<Duration>) -> bool {
        period.is_some_and(|p| p.saturating_mul(2) > self.stale_after)
    }

    pub(crate) fn stale_after(&self) -> Duration {
        self.stale_after
    }

    /// The next moment a node now fresh turns stale, or one now on time
    /// turns late, if nothing changes: when to decide again without news.
    pub(crate) fn next_deadline(&self, now: Instant) -> Option<Instant> {
        self.seen
            .values()
            .flat_map(|s| [s.at + s.on_time, s.at + s.bound])
            .filter(|d| *d > now)
            .min()
    }

    /// Forgets the nodes not in `keep` (their objects are gone).
    pub(crate) fn retain(&mut self, keep: impl Fn(&str) -> bool) {
        self.seen.retain(|n, _| keep(n));
        self.restart_until.retain(|n, _| keep(n));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_heartbeat_period_must_fit_twice_in_the_staleness_bound() {
        let l = Liveness::new(Duration::from_secs(3), Duration::from_secs(3));
        assert!(!l.too_slow(None));
        assert!(!l.too_slow(Some(Duration::from_secs(1))));
        assert!(!l.too_slow(Some(Duration::from_millis(1500))));
        assert!(l.too_slow(Some(Duration::from_millis(1501))));
        assert!(l.too_slow(Some(Duration::from_secs(10))));
    }

    const STALE: Duration = Duration::from_secs(3);
    const QUIET: Duration = Duration::from_millis(1500);
    const BEAT: Duration = Duration::from_secs(1);

    fn beat(l: &mut Liveness, node: &str, n: u64, now: Instant) {
        l.observe(node, Some(&format!("{node}-{n}")), now);
    }

    #[tokio::test(start_paused = true)]
    async fn a_changing_heartbeat_is_fresh_a_frozen_one_goes_stale() {
        let mut l = Liveness::new(STALE, QUIET);
        let start = Instant::now();
        // Values far in the past: only change counts, never the value
        // against our clock.
        for i in 0..10u64 {
            let now = start + BEAT * i as u32;
            l.observe("n1", Some(&format!("1970-01-01T00:00:{i:02}Z")), now);
            beat(&mut l, "n2", i, now);
            assert!(l.eligible("n1", true, now), "beat {i}");
        }
        let last_change = start + BEAT * 9;
        // n1 stops (its value stays); n2 goes on, so the watch is live.
        let frozen = "1970-01-01T00:00:09Z";
        let mut now = last_change;
        let mut i = 10;
        while now < last_change + STALE {
            l.observe("n1", Some(frozen), now);
            assert!(
                l.fresh("n1", now),
                "{:?} after the last change",
                now - last_change
            );
            now += Duration::from_millis(100);
            if now >= start + BEAT * i as u32 {
                beat(&mut l, "n2", i, now);
                i += 1;
            }
        }
        l.observe("n1", Some(frozen), now);
        assert!(!l.fresh("n1", now), "stale {STALE:?} after the last change");
        assert!(l.fresh("n2", now));
        // It comes back: fresh again at once.
        l.observe("n1", Some("1970-01-01T00:01:00Z"), now);
        assert!(l.fresh("n1", now));
    }

    #[tokio::test(start_paused = true)]
    async fn a_first_sight_counts_as_now_and_not_ready_is_never_eligible() {
        let mut l = Liveness::new(STALE, QUIET);
        let now = Instant::now();
        // However old the value, a new observer gives it a full period.
        l.observe("n1", Some("2001-01-01T00:00:00Z"), now);
        let mut t = now;
        let mut i = 0;
        while t < now + STALE {
            beat(&mut l, "n2", i, t);
            assert!(l.eligible("n1", true, t));
            i += 1;
            t = now + BEAT * i as u32;
        }
        beat(&mut l, "n2", i, t);
        assert!(!l.eligible("n1", true, now + STALE));
        assert!(!l.eligible("n1", false, now), "not ready");
        assert!(!l.fresh("never-seen", now));
        l.observe("n2", None, now);
        assert!(!l.fresh("n2", now), "no heartbeat at all");
        l.observe("n3", Some("x"), now);
        l.retain(|n| n != "n3");
        assert!(!l.fresh("n3", now), "forgotten");
    }

    /// Written: a node whose heartbeat this controller has seen change,
    /// not one only first seen (a controller that has just started), and
    /// after a quiet gap only those that wrote since.
    #[tokio::test(start_paused = true)]
    async fn a_node_is_known_to_write_once_its_heartbeat_changed_since_the_last_gap() {
        let mut l = Liveness::new(STALE, QUIET);
        let start = Instant::now();
        l.observe("n1", Some("a"), start);
        l.observe("n2", Some("a"), start);
        assert!(!l.written("n1") && !l.written("n2"), "only first seen");
        assert!(l.on_time("n1", start) && l.fresh("n1", start));
        beat(&mut l, "n1", 1, start + BEAT);
        assert!(l.written("n1") && !l.written("n2"));
        // A quiet gap (an outage): the first to write after it is known to
        // write, the other not until it does.
        let back = start + BEAT + QUIET + Duration::from_secs(1);
        beat(&mut l, "n2", 2, back);
        assert!(l.written("n2") && !l.written("n1"));
        beat(&mut l, "n1", 3, back + BEAT);
        assert!(l.written("n1"));
        assert!(!l.written("never-seen"));
    }

    /// The API server (or etcd, or this replica's watch) is gone for 30 s:
    /// no heartbeat changes. Nobody turns stale during it, and afterwards
    /// each node has a whole period to show up, however they trickle in;
    /// one that never does is stale a period after the first news.
    #[tokio::test(start_paused = true)]
    async fn a_silent_watch_makes_nobody_stale_and_restarts_the_clock() {
        let mut l = Liveness::new(STALE, QUIET);
        let start = Instant::now();
        let nodes = ["n1", "n2", "n3"];
        for i in 0..5u64 {
            for n in nodes {
                beat(&mut l, n, i, start + BEAT * i as u32);
            }
        }
        let outage = start + BEAT * 4;
        let back = outage + Duration::from_secs(30);
        let mut t = outage;
        while t < back {
            for n in nodes {
                l.observe(n, Some(&format!("{n}-4")), t);
                assert!(
                    l.eligible(n, true, t),
                    "{n} at {:?} into the outage",
                    t - outage
                );
            }
            assert_eq!(
                l.next_deadline(t).filter(|d| *d > back),
                None,
                "no wake-up needed"
            );
            t += Duration::from_millis(100);
        }
        // n1 at once, n2 2.5 s later, n3 never.
        beat(&mut l, "n1", 5, back);
        for n in nodes {
            assert!(l.fresh(n, back), "{n} right after the outage");
        }
        let mut t = back;
        let mut k = 6;
        while t < back + STALE {
            assert!(l.fresh("n3", t), "n3 {:?} after the first news", t - back);
            if t >= back + Duration::from_millis(2500) {
                beat(&mut l, "n2", k, t);
            }
            beat(&mut l, "n1", k, t);
            k += 1;
            t += Duration::from_millis(500);
        }
        beat(&mut l, "n1", k, t);
        assert!(l.fresh("n1", t) && l.fresh("n2", t));
        assert!(!l.fresh("n3", t), "n3 stale a period after the first news");
    }

    #[tokio::test(start_paused = true)]
    async fn the_next_deadline_is_the_first_fresh_node_to_turn_stale() {
        let mut l = Liveness::new(STALE, QUIET);
        let now = Instant::now();
        assert_eq!(l.next_deadline(now), None);
        beat(&mut l, "n1", 0, now);
        beat(&mut l, "n2", 0, now + BEAT);
        assert_eq!(l.next_deadline(now + BEAT), Some(now + STALE));
        assert_eq!(l.next_deadline(now + STALE), Some(now + BEAT + STALE));
        assert_eq!(l.next_deadline(now + BEAT + STALE), None);
    }

    /// A node that states a 2 s period is on time for 5 s after its
    /// heartbeat changed (two periods and the slack), fresh for the whole
    /// staleness bound; the moment it turns late is a deadline too.
    #[tokio::test(start_paused = true)]
    async fn a_heartbeat_is_on_time_for_two_stated_periods_and_fresh_for_the_bound() {
        let stale = Duration::from_secs(40);
        let mut l = Liveness::new(stale, Duration::from_secs(20));
        let t0 = Instant::now();
        let period = Some(Duration::from_secs(2));
        l.observe_status(
            "n1",
            Some("a"),
            Beat {
                grace: None,
                period,
            },
            t0,
        );
        beat(&mut l, "n2", 0, t0);
        let late = t0 + Duration::from_secs(5);
        assert_eq!(l.next_deadline(t0), Some(late));
        let mut t = t0;
        let mut i = 1;
        while t < t0 + stale {
            // n2 beats on: the watch is live.
            beat(&mut l, "n2", i, t);
            assert_eq!(l.on_time("n1", t), t < late, "{:?}", t - t0);
            assert!(l.fresh("n1", t), "{:?}", t - t0);
            i += 1;
            t += Duration::from_millis(500);
        }
        beat(&mut l, "n2", i, t);
        assert!(!l.fresh("n1", t) && !l.on_time("n1", t));
        // No stated period: on time while fresh.
        assert!(l.on_time("n2", t));
    }

    /// Issue #29: a heartbeat that carries a restart grace keeps its node
    /// fresh for that grace, not the staleness bound; the next heartbeat
    /// without one brings the bound back.
    #[tokio::test(start_paused = true)]
    async fn a_restart_grace_holds_the_judgement_until_it_runs_out() {
        let mut l = Liveness::new(STALE, QUIET);
        let t0 = Instant::now();
        let grace = Some(Duration::from_secs(15));
        l.observe_status(
            "n1",
            Some("a"),
            Beat {
                grace,
                period: None,
            },
            t0,
        );
        let mut t = t0;
        let mut i = 0;
        while t < t0 + Duration::from_secs(15) {
            // Another node beats on: the watch is live.
            beat(&mut l, "n2", i, t);
            assert!(l.fresh("n1", t), "{:?} into the grace", t - t0);
            i += 1;
            t = t0 + BEAT * i as u32;
        }
        beat(&mut l, "n2", i, t);
        assert!(!l.fresh("n1", t), "stale once the grace ran out");
        assert_eq!(l.next_deadline(t), Some(t + STALE), "n2's");
        // Back, without a grace: the usual bound again.
        l.observe("n1", Some("b"), t);
        for k in 1..=3u32 {
            beat(&mut l, "n2", i + u64::from(k), t + BEAT * k);
        }
        assert!(!l.fresh("n1", t + STALE));
    }

    #[test]
    fn a_restart_is_remembered_until_its_grace_ends_whatever_the_next_run_writes() {
        let mut l = Liveness::new(STALE, QUIET);
        let t0 = Instant::now();
        l.observe("n1", Some("a"), t0);
        assert!(!l.restarting("n1", t0));
        let grace = Some(Duration::from_secs(15));
        l.observe_status(
            "n1",
            Some("b"),
            Beat {
                grace,
                period: None,
            },
            t0,
        );
        // The next run writes at once, without a grace.
        l.observe("n1", Some("c"), t0 + Duration::from_secs(2));
        assert!(l.restarting("n1", t0 + Duration::from_secs(14)));
        assert!(!l.restarting("n1", t0 + Duration::from_secs(15)));
    }
}
