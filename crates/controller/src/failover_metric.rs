//! Timing failovers for `hna_controller_failover_duration_seconds`: how
//! long a Service went without a serving holder after its holder was lost,
//! counted from what the controller last heard of the old holder to the
//! new one reporting the address BOUND. Plain data in, durations out.

use std::collections::BTreeMap;
use std::time::Duration;

use tokio::time::Instant;

use super::reconcile::NodeIn;

/// Per Service (`namespace/name`), the eligible node that reports its
/// address BOUND, or `None` when a node is assigned it but none eligible
/// serves it.
pub(crate) fn serving(objects: &[NodeIn]) -> BTreeMap<String, Option<String>> {
    let mut out: BTreeMap<String, Option<String>> = BTreeMap::new();
    for o in objects {
        for a in o.spec.assignments.iter().filter(|a| !a.release) {
            let here = o.eligible && o.bound_address(&a.service, &a.interface).is_some();
            let entry = out.entry(a.service.clone()).or_default();
            if here {
                *entry = Some(o.name.clone());
            }
        }
    }
    out
}

#[derive(Debug, Default)]
pub(crate) struct FailoverClock {
    /// The node last seen serving each Service.
    held_by: BTreeMap<String, String>,
    /// Services whose holder was lost: since when (its last heartbeat
    /// change, else when the loss was seen).
    lost_at: BTreeMap<String, Instant>,
}

impl FailoverClock {
    /// Takes one pass's [`serving`] map; returns the failovers that ended
    /// in it. `last_heard`: when a node's heartbeat last changed.
    pub(crate) fn observe(
        &mut self,
        serving: &BTreeMap<String, Option<String>>,
        last_heard: impl Fn(&str) -> Option<Instant>,
        now: Instant,
    ) -> Vec<Duration> {
        let mut ended = Vec::new();
        for (service, holder) in serving {
            match holder {
                Some(node) => {
                    let lost = self.lost_at.remove(service);
                    let was = self.held_by.insert(service.clone(), node.clone());
                    // The same node serving again is a recovery, not a
                    // failover.
                    if let (Some(at), Some(was)) = (lost, was)
                        && was != *node
                    {
                        ended.push(now.saturating_duration_since(at));
                    }
                }
                None => {
                    if let Some(old) = self.held_by.get(service) {
                        self.lost_at
                            .entry(service.clone())
                            .or_insert_with(|| last_heard(old).unwrap_or(now).min(now));
                    }
                }
            }
        }
        // Services no longer assigned anywhere (deleted, handed over).
        self.held_by.retain(|s, _| serving.contains_key(s));
        self.lost_at.retain(|s, _| serving.contains_key(s));
        ended
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn map(entries: &[(&str, Option<&str>)]) -> BTreeMap<String, Option<String>> {
        entries
            .iter()
            .map(|(s, n)| (s.to_string(), n.map(str::to_string)))
            .collect()
    }

    #[tokio::test(start_paused = true)]
    async fn a_failover_counts_from_the_old_holders_last_heartbeat() {
        let mut clock = FailoverClock::default();
        let t0 = Instant::now();
        assert!(
            clock
                .observe(&map(&[("d/web", Some("a"))]), |_| None, t0)
                .is_empty()
        );
        // `a` dies: its last heartbeat changed at t0 + 1 s; the controller
        // sees it 10 s later, and `b` reports BOUND 3 s after that.
        let heard = t0 + Duration::from_secs(1);
        let last = |n: &str| (n == "a").then_some(heard);
        let t1 = t0 + Duration::from_secs(11);
        assert!(clock.observe(&map(&[("d/web", None)]), last, t1).is_empty());
        let t2 = t1 + Duration::from_secs(3);
        assert_eq!(
            clock.observe(&map(&[("d/web", Some("b"))]), last, t2),
            vec![Duration::from_secs(13)]
        );
        // Counted once.
        assert!(
            clock
                .observe(&map(&[("d/web", Some("b"))]), last, t2)
                .is_empty()
        );
    }

    #[tokio::test(start_paused = true)]
    async fn the_same_holder_back_or_a_first_holder_is_no_failover() {
        let mut clock = FailoverClock::default();
        let t = Instant::now();
        assert!(
            clock
                .observe(&map(&[("d/web", None)]), |_| None, t)
                .is_empty()
        );
        assert!(
            clock
                .observe(&map(&[("d/web", Some("a"))]), |_| None, t)
                .is_empty()
        );
        assert!(
            clock
                .observe(&map(&[("d/web", None)]), |_| None, t)
                .is_empty()
        );
        assert!(
            clock
                .observe(&map(&[("d/web", Some("a"))]), |_| None, t)
                .is_empty()
        );
        // Deleted while lost: forgotten.
        assert!(
            clock
                .observe(&map(&[("d/web", None)]), |_| None, t)
                .is_empty()
        );
        assert!(clock.observe(&map(&[]), |_| None, t).is_empty());
        assert!(
            clock
                .observe(&map(&[("d/web", Some("b"))]), |_| None, t)
                .is_empty()
        );
    }
}
