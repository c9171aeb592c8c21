//! Which node agents are alive, judged on the controller's own clock: an
//! agent's heartbeat is an opaque value that must keep changing. Its
//! content (the agent's time) is never compared with ours, so clock skew
//! between a node and the controller cannot make a live agent look dead or
//! a dead one look alive.
//!
//! A heartbeat seen for the first time counts as seen now: a controller that
//! has just started (or a replica that has just become leader) does not
//! judge a node it has not watched for a whole period, so it moves nothing.

use std::collections::BTreeMap;
use std::time::Duration;

use tokio::time::Instant;

#[derive(Debug, Clone)]
pub struct Liveness {
    stale_after: Duration,
    /// Per node: the last heartbeat value and when (our clock) it was first
    /// seen with that value.
    seen: BTreeMap<String, (String, Instant)>,
}

impl Liveness {
    pub fn new(stale_after: Duration) -> Liveness {
        Liveness {
            stale_after,
            seen: BTreeMap::new(),
        }
    }

    /// Records the heartbeat `node` reports now (`None`: it reports none).
    pub fn observe(&mut self, node: &str, heartbeat: Option<&str>, now: Instant) {
        let Some(hb) = heartbeat.filter(|h| !h.is_empty()) else {
            self.seen.remove(node);
            return;
        };
        match self.seen.get_mut(node) {
            Some((value, _)) if value == hb => {}
            Some(entry) => *entry = (hb.to_string(), now),
            None => {
                self.seen.insert(node.to_string(), (hb.to_string(), now));
            }
        }
    }

    /// Whether `node`'s heartbeat changed within the staleness bound.
    pub fn fresh(&self, node: &str, now: Instant) -> bool {
        self.seen
            .get(node)
            .is_some_and(|(_, at)| now.saturating_duration_since(*at) < self.stale_after)
    }

    /// Eligible to hold addresses: the agent says it is ready, and its
    /// heartbeat is fresh.
    pub fn eligible(&self, node: &str, ready: bool, now: Instant) -> bool {
        ready && self.fresh(node, now)
    }

    /// Forgets the nodes not in `keep` (their objects are gone).
    pub fn retain(&mut self, keep: impl Fn(&str) -> bool) {
        self.seen.retain(|n, _| keep(n));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const STALE: Duration = Duration::from_secs(20);

    #[tokio::test(start_paused = true)]
    async fn a_changing_heartbeat_is_fresh_a_frozen_one_goes_stale() {
        let mut l = Liveness::new(STALE);
        let start = Instant::now();
        // A heartbeat every 5 s whose content is far in the past: only
        // change counts, never its value against our clock.
        for i in 0..10u64 {
            let now = start + Duration::from_secs(5 * i);
            l.observe("n1", Some(&format!("1970-01-01T00:00:{i:02}Z")), now);
            assert!(l.eligible("n1", true, now), "beat {i}");
        }
        let last_change = start + Duration::from_secs(45);
        // The agent stops; its value stays.
        let frozen = "1970-01-01T00:00:09Z";
        let mut now = last_change;
        while now < last_change + STALE {
            l.observe("n1", Some(frozen), now);
            assert!(
                l.fresh("n1", now),
                "{:?} after the last change",
                now - last_change
            );
            now += Duration::from_secs(1);
        }
        l.observe("n1", Some(frozen), now);
        assert!(!l.fresh("n1", now), "stale {STALE:?} after the last change");
        // It comes back: fresh again at once.
        l.observe("n1", Some("1970-01-01T00:01:00Z"), now);
        assert!(l.fresh("n1", now));
    }

    #[tokio::test(start_paused = true)]
    async fn a_first_sight_counts_as_now_and_not_ready_is_never_eligible() {
        let mut l = Liveness::new(STALE);
        let now = Instant::now();
        // However old the value, a new observer gives it a full period.
        l.observe("n1", Some("2001-01-01T00:00:00Z"), now);
        assert!(l.eligible("n1", true, now + Duration::from_secs(19)));
        assert!(!l.eligible("n1", true, now + STALE));
        assert!(!l.eligible("n1", false, now), "not ready");
        assert!(!l.fresh("never-seen", now));
        l.observe("n2", None, now);
        assert!(!l.fresh("n2", now), "no heartbeat at all");
        l.observe("n3", Some("x"), now);
        l.retain(|n| n != "n3");
        assert!(!l.fresh("n3", now), "forgotten");
    }
}
