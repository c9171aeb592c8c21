//! How long each Service has been waiting to be deleted, on this process's
//! own monotonic clock. `metadata.deletionTimestamp` is the API server's
//! wall clock; comparing it with ours would make a controller whose clock
//! runs ahead give up on a DHCPRELEASE at once, and one whose clock lags
//! wait far longer than the release bound (issue #29). A Service is timed
//! from when this process first saw it deleting: a new leader or a
//! restarted controller waits the whole bound again, never less.

use std::collections::HashMap;

use tokio::time::Instant;

use super::reconcile::ServiceIn;

#[derive(Debug, Default)]
pub(crate) struct Deletions {
    /// UID → when this process first saw the Service deleting.
    seen: HashMap<String, Instant>,
}

impl Deletions {
    /// How long, on our clock, the Service with `uid` has been deleting
    /// (timed from now when first asked).
    pub(crate) fn waited(&mut self, uid: &str, now: Instant) -> std::time::Duration {
        let first = *self.seen.entry(uid.to_string()).or_insert(now);
        now.saturating_duration_since(first)
    }

    /// Sets `s.deleting_since` to `wall` minus how long, on our clock, the
    /// Service has been deleting (the pure decision compares it with
    /// `wall`, so only our own clock's elapsed time counts).
    pub(crate) fn time(&mut self, s: &mut ServiceIn, now: Instant, wall: i64) {
        if s.deleting {
            s.deleting_since = wall - self.waited(&s.uid, now).as_secs() as i64;
        }
    }

    /// Forgets the Services not in `keep` (gone, or no longer deleting).
    pub(crate) fn retain(&mut self, keep: impl Fn(&str) -> bool) {
        self.seen.retain(|uid, _| keep(uid));
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::reconcile::release_overdue;

    fn deleting(server_stamp: i64) -> ServiceIn {
        ServiceIn {
            key: hna_contract::ServiceKey {
                namespace: "default".into(),
                name: "web".into(),
            },
            uid: "u-1".into(),
            type_: "LoadBalancer".into(),
            load_balancer_class: None,
            ip_families: vec![],
            cluster_ips: vec![],
            local_endpoints: None,
            annotations: Default::default(),
            ports: vec![],
            ingress: vec![],
            generation: 1,
            assigned_for: None,
            finalizers: vec![],
            deleting: true,
            deleting_since: server_stamp,
            created: 0,
        }
    }

    /// The API server stamped the deletion an hour "ago" by our wall clock
    /// (our clock runs ahead): still not overdue until 30 s of our own.
    #[tokio::test(start_paused = true)]
    async fn the_bound_runs_on_our_clock_whatever_the_servers_stamp() {
        let wall = 1_000_000;
        let mut d = Deletions::default();
        for server_stamp in [wall - 3600, wall + 3600] {
            let mut s = deleting(server_stamp);
            d.time(&mut s, Instant::now(), wall);
            assert!(
                !release_overdue(&s, wall),
                "stamp {server_stamp}: overdue at once"
            );
        }
        tokio::time::advance(Duration::from_secs(29)).await;
        let mut s = deleting(0);
        d.time(&mut s, Instant::now(), wall + 29);
        assert!(!release_overdue(&s, wall + 29));
        tokio::time::advance(Duration::from_secs(2)).await;
        let mut s = deleting(0);
        d.time(&mut s, Instant::now(), wall + 31);
        assert!(release_overdue(&s, wall + 31), "{}", s.deleting_since);
        d.retain(|_| false);
        let mut s = deleting(0);
        d.time(&mut s, Instant::now(), wall + 31);
        assert!(!release_overdue(&s, wall + 31), "forgotten: timed afresh");
    }
}
