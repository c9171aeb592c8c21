//! Leader election on a `coordination.k8s.io/v1` Lease, as a pure decision
//! (kube-rs has none built in). The I/O loop around it reads the Lease,
//! calls `Elector::decide` and writes what it says.
//!
//! Staleness is judged on this replica's own clock: a Lease held by another
//! replica counts as expired only when its record has not changed for a
//! whole lease duration *as observed here* (as client-go does), so clock
//! skew between replicas cannot make a live leader look dead.

use std::time::Duration;

use tokio::time::Instant;

/// Lease timings. `renew_deadline < lease_duration`: a leader that could
/// not renew for `renew_deadline` stops acting before any other replica
/// may take over (`lease_duration` after its last renewal was seen).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Timing {
    pub lease_duration: Duration,
    pub renew_deadline: Duration,
    pub retry_period: Duration,
}

/// Why a [`Timing`] cannot work.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum TimingError {
    #[error("retry period must be above zero and below the renew deadline")]
    RetryPeriod,
    #[error("renew deadline must be below the lease duration")]
    RenewDeadline,
}

impl Timing {
    pub fn validate(&self) -> Result<(), TimingError> {
        if self.retry_period.is_zero() || self.retry_period >= self.renew_deadline {
            return Err(TimingError::RetryPeriod);
        }
        if self.renew_deadline >= self.lease_duration {
            return Err(TimingError::RenewDeadline);
        }
        Ok(())
    }
}

/// The parts of a Lease's spec the decision reads. `renew_time` is opaque:
/// only whether it changed matters, never its value against our clock.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Record {
    pub(crate) holder: Option<String>,
    pub(crate) renew_time: Option<String>,
    pub(crate) transitions: i32,
}

/// What to do now.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Decision {
    /// No Lease yet: create it holding it.
    Create,
    /// Write the Lease with us as holder (`transitions` is the value to
    /// write). Taking over an expired Lease, or renewing our own.
    Hold { transitions: i32, takeover: bool },
    /// Someone else holds a live Lease: do not lead; look again later.
    Follow { holder: String },
}

/// One replica's view across rounds.
#[derive(Debug, Clone)]
pub(crate) struct Elector {
    identity: String,
    timing: Timing,
    /// The last record seen and when (our clock) it was first seen.
    observed: Option<(Record, Instant)>,
    /// When we last wrote the Lease successfully as holder.
    last_renewal: Option<Instant>,
}

impl Elector {
    pub(crate) fn new(identity: impl Into<String>, timing: Timing) -> Elector {
        Elector {
            identity: identity.into(),
            timing,
            observed: None,
            last_renewal: None,
        }
    }

    /// Decides from the Lease as just read (`None`: it does not exist).
    pub(crate) fn decide(&mut self, lease: Option<&Record>, now: Instant) -> Decision {
        let Some(record) = lease else {
            self.observed = None;
            return Decision::Create;
        };
        let changed = self.observed.as_ref().map(|(r, _)| r) != Some(record);
        if changed {
            self.observed = Some((record.clone(), now));
        }
        let seen_at = self.observed.as_ref().map(|(_, at)| *at).unwrap_or(now);
        match record.holder.as_deref() {
            Some(h) if h == self.identity => Decision::Hold {
                transitions: record.transitions,
                takeover: false,
            },
            Some(h) if !h.is_empty() && now < seen_at + self.timing.lease_duration => {
                Decision::Follow {
                    holder: h.to_string(),
                }
            }
            // Released (empty holder) or not renewed for a lease duration.
            _ => Decision::Hold {
                transitions: record.transitions.saturating_add(1),
                takeover: true,
            },
        }
    }

    /// After a successful write as holder.
    pub(crate) fn renewed(&mut self, now: Instant) {
        self.last_renewal = Some(now);
    }

    /// Whether this replica may act as leader now: it renewed within the
    /// renew deadline. A leader cut off from the API server stops acting
    /// before another replica can have taken over.
    #[cfg(test)]
    pub(crate) fn leading(&self, now: Instant) -> bool {
        self.last_renewal
            .is_some_and(|at| now < at + self.timing.renew_deadline)
    }

    /// Forget leadership (a write failed with a conflict: someone else won).
    pub(crate) fn lost(&mut self) {
        self.last_renewal = None;
    }

    /// How long to wait before the next round: the retry period for a
    /// leader (renewing) and a follower alike (so that a released Lease is
    /// taken at once).
    pub(crate) fn next_round(&self) -> Duration {
        self.timing.retry_period
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const T: Timing = Timing {
        lease_duration: Duration::from_secs(15),
        renew_deadline: Duration::from_secs(10),
        retry_period: Duration::from_secs(2),
    };

    fn held_by(holder: &str, renew: &str, transitions: i32) -> Record {
        Record {
            holder: Some(holder.into()),
            renew_time: Some(renew.into()),
            transitions,
        }
    }

    #[test]
    fn timings_must_nest() {
        assert!(T.validate().is_ok());
        let bad = Timing {
            renew_deadline: Duration::from_secs(15),
            ..T
        };
        assert!(bad.validate().is_err());
    }

    #[tokio::test(start_paused = true)]
    async fn a_missing_lease_is_created_and_our_own_is_renewed() {
        let mut e = Elector::new("a", T);
        let now = Instant::now();
        assert_eq!(e.decide(None, now), Decision::Create);
        assert_eq!(
            e.decide(Some(&held_by("a", "t0", 0)), now),
            Decision::Hold {
                transitions: 0,
                takeover: false
            }
        );
        assert!(!e.leading(now), "not before a successful write");
        e.renewed(now);
        assert!(e.leading(now + Duration::from_secs(9)));
        assert!(
            !e.leading(now + T.renew_deadline),
            "a leader that cannot renew stops acting at the deadline"
        );
    }

    /// A live leader's Lease is never taken, however its renew time reads
    /// against our clock; a silent one is taken a lease duration after its
    /// record was last seen to change.
    #[tokio::test(start_paused = true)]
    async fn takeover_waits_a_lease_duration_on_our_own_clock() {
        let mut b = Elector::new("b", T);
        let start = Instant::now();
        // Renew times from a skewed clock (far in the past): irrelevant.
        let mut now = start;
        for i in 0..20 {
            let record = held_by("a", &format!("1970-01-01T00:00:{i:02}Z"), 3);
            assert_eq!(
                b.decide(Some(&record), now),
                Decision::Follow { holder: "a".into() },
                "round {i}"
            );
            now += T.retry_period;
        }
        // "a" stops renewing: the record stays the same.
        let frozen = held_by("a", "1970-01-01T00:00:19Z", 3);
        let last_change = now - T.retry_period;
        while now < last_change + T.lease_duration {
            assert_eq!(
                b.decide(Some(&frozen), now),
                Decision::Follow { holder: "a".into() }
            );
            now += Duration::from_secs(1);
        }
        assert_eq!(
            b.decide(Some(&frozen), now),
            Decision::Hold {
                transitions: 4,
                takeover: true
            }
        );
    }

    /// `leaseTransitions` comes from the API: whatever is written there, a
    /// takeover never overflows it.
    #[tokio::test(start_paused = true)]
    async fn a_takeover_at_the_largest_transition_count_does_not_overflow() {
        let mut b = Elector::new("b", T);
        let released = Record {
            holder: None,
            renew_time: None,
            transitions: i32::MAX,
        };
        assert_eq!(
            b.decide(Some(&released), Instant::now()),
            Decision::Hold {
                transitions: i32::MAX,
                takeover: true
            }
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_released_lease_is_taken_at_once() {
        let mut b = Elector::new("b", T);
        let released = Record {
            holder: None,
            renew_time: None,
            transitions: 7,
        };
        assert_eq!(
            b.decide(Some(&released), Instant::now()),
            Decision::Hold {
                transitions: 8,
                takeover: true
            }
        );
    }

    /// A new replica that has never seen the Lease waits a full duration
    /// from its first look: it cannot know how old the record is.
    #[tokio::test(start_paused = true)]
    async fn a_newcomer_waits_a_full_duration() {
        let mut c = Elector::new("c", T);
        let first = Instant::now();
        let record = held_by("a", "t", 1);
        assert!(matches!(
            c.decide(Some(&record), first + Duration::from_secs(14)),
            Decision::Follow { .. }
        ));
        assert!(
            matches!(
                c.decide(Some(&record), first + Duration::from_secs(28)),
                Decision::Follow { .. }
            ),
            "14 s after its first look, 15 s are not over"
        );
        assert!(matches!(
            c.decide(Some(&record), first + Duration::from_secs(29)),
            Decision::Hold { takeover: true, .. }
        ));
    }

    #[tokio::test(start_paused = true)]
    async fn losing_a_write_race_ends_leadership() {
        let mut a = Elector::new("a", T);
        let now = Instant::now();
        a.renewed(now);
        assert!(a.leading(now));
        a.lost();
        assert!(!a.leading(now));
        assert_eq!(a.next_round(), T.retry_period);
    }
}
