//! The election's I/O: reads the controller's `coordination.k8s.io/v1`
//! Lease every retry period, lets the pure [`Elector`] decide, writes what
//! it says (a conflict means another replica won), and publishes whether
//! this replica may write ([`Leadership`]). On shutdown a leader clears
//! the holder so that another replica takes over at its next round rather
//! than a lease duration later.

use std::sync::Mutex;
use std::time::Duration;

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use kube::api::{Api, PostParams};
use tokio::sync::watch;
use tokio::time::Instant;

use crate::controller::election::{Decision, Elector, Record, Timing};

/// Whether this replica may write now, shared with every writer. Leading
/// ends by itself at the renew deadline: nothing needs to run for a
/// leader cut off from the API server to stop writing.
#[derive(Debug, Default)]
pub struct Leadership {
    state: Mutex<State>,
}

#[derive(Debug, Default, Clone)]
struct State {
    until: Option<Instant>,
    /// Counts the terms this replica has led; memos of a term are dropped
    /// when a new one starts.
    term: u64,
    holder: Option<String>,
}

impl Leadership {
    pub fn leading(&self) -> bool {
        self.leading_at(Instant::now())
    }

    pub fn leading_at(&self, now: Instant) -> bool {
        self.state
            .lock()
            .expect("leadership lock")
            .until
            .is_some_and(|u| now < u)
    }

    /// This replica's current (or last) term.
    pub fn term(&self) -> u64 {
        self.state.lock().expect("leadership lock").term
    }

    /// Who holds the Lease, as last read.
    pub fn holder(&self) -> Option<String> {
        self.state.lock().expect("leadership lock").holder.clone()
    }

    /// A successful renewal started at `at`: leading until the deadline.
    pub fn renewed(&self, at: Instant, renew_deadline: Duration, identity: &str) {
        let mut s = self.state.lock().expect("leadership lock");
        if s.until.is_none_or(|u| at >= u) {
            s.term += 1;
        }
        s.until = Some(at + renew_deadline);
        s.holder = Some(identity.to_string());
    }

    pub fn follow(&self, holder: Option<String>) {
        let mut s = self.state.lock().expect("leadership lock");
        s.until = None;
        s.holder = holder;
    }
}

fn record_of(lease: &Lease) -> Record {
    let spec = lease.spec.clone().unwrap_or_default();
    Record {
        holder: spec.holder_identity.filter(|h| !h.is_empty()),
        renew_time: spec.renew_time.map(|t| t.0.to_string()),
        transitions: spec.lease_transitions.unwrap_or(0),
    }
}

fn now_micro() -> MicroTime {
    MicroTime(k8s_openapi::jiff::Timestamp::now())
}

/// Runs the election until `shutdown`; then a leader releases the Lease.
pub async fn run(
    api: Api<Lease>,
    name: String,
    identity: String,
    timing: Timing,
    leadership: std::sync::Arc<Leadership>,
    mut shutdown: watch::Receiver<bool>,
) {
    let mut elector = Elector::new(identity.clone(), timing);
    let call = timing.retry_period.max(Duration::from_secs(1));
    let mut first = true;
    loop {
        if !first {
            tokio::select! {
                _ = tokio::time::sleep(elector.next_round()) => {}
                _ = shutdown.changed() => break,
            }
        }
        first = false;
        let started = Instant::now();
        let current = match tokio::time::timeout(call, api.get_opt(&name)).await {
            Ok(Ok(l)) => l,
            Ok(Err(e)) => {
                tracing::warn!(lease = %name, "cannot read the controller Lease: {e}");
                continue;
            }
            Err(_) => {
                tracing::warn!(lease = %name, "reading the controller Lease timed out");
                continue;
            }
        };
        let record = current.as_ref().map(record_of);
        let decision = elector.decide(record.as_ref(), started);
        let duration_secs = lease_duration_seconds(timing.lease_duration);
        let result = match decision {
            Decision::Follow { holder } => {
                if leadership.leading() {
                    tracing::warn!(%holder, "another replica holds the controller Lease: stopped leading");
                }
                elector.lost();
                leadership.follow(Some(holder));
                continue;
            }
            Decision::Create => {
                let lease = Lease {
                    metadata: ObjectMeta {
                        name: Some(name.clone()),
                        ..Default::default()
                    },
                    spec: Some(LeaseSpec {
                        holder_identity: Some(identity.clone()),
                        lease_duration_seconds: Some(duration_secs),
                        acquire_time: Some(now_micro()),
                        renew_time: Some(now_micro()),
                        lease_transitions: Some(0),
                        ..Default::default()
                    }),
                };
                tokio::time::timeout(call, api.create(&PostParams::default(), &lease)).await
            }
            Decision::Hold {
                transitions,
                takeover,
            } => {
                let mut lease = current
                    .clone()
                    .expect("Hold is decided on an existing Lease");
                let spec = lease.spec.get_or_insert_with(Default::default);
                spec.holder_identity = Some(identity.clone());
                spec.lease_duration_seconds = Some(duration_secs);
                spec.renew_time = Some(now_micro());
                spec.lease_transitions = Some(transitions);
                if takeover {
                    spec.acquire_time = Some(now_micro());
                }
                // resourceVersion is kept: a concurrent writer makes this a
                // conflict instead of two leaders.
                tokio::time::timeout(call, api.replace(&name, &PostParams::default(), &lease)).await
            }
        };
        match result {
            Ok(Ok(_)) => {
                if !leadership.leading_at(started) {
                    tracing::info!(%identity, "leading: holding the controller Lease");
                }
                elector.renewed(started);
                leadership.renewed(started, timing.renew_deadline, &identity);
            }
            Ok(Err(e)) => {
                tracing::info!(lease = %name, "did not get the controller Lease: {e}");
                elector.lost();
                leadership.follow(record.and_then(|r| r.holder));
            }
            Err(_) => tracing::warn!(lease = %name, "writing the controller Lease timed out"),
        }
    }
    release(&api, &name, &identity, &leadership).await;
}

/// Clears the holder if it is us (a graceful handover: the next replica
/// takes over at its next round).
async fn release(api: &Api<Lease>, name: &str, identity: &str, leadership: &Leadership) {
    let was_leading = leadership.leading();
    leadership.follow(None);
    if !was_leading {
        return;
    }
    let attempt = async {
        let mut lease = api.get(name).await?;
        let spec = lease.spec.get_or_insert_with(Default::default);
        if spec.holder_identity.as_deref() != Some(identity) {
            return Ok(());
        }
        spec.holder_identity = None;
        spec.lease_duration_seconds = Some(1);
        spec.renew_time = Some(now_micro());
        api.replace(name, &PostParams::default(), &lease)
            .await
            .map(|_| ())
    };
    match tokio::time::timeout(Duration::from_secs(5), attempt).await {
        Ok(Ok(())) => tracing::info!("released the controller Lease"),
        Ok(Err(e)) => tracing::warn!("could not release the controller Lease: {e}"),
        Err(_) => tracing::warn!("releasing the controller Lease timed out"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn leading_lapses_at_the_renew_deadline_and_terms_count() {
        let l = Leadership::default();
        let t0 = Instant::now();
        assert!(!l.leading_at(t0));
        l.renewed(t0, Duration::from_secs(10), "a");
        assert_eq!(l.term(), 1);
        assert!(l.leading_at(t0 + Duration::from_secs(9)));
        assert!(!l.leading_at(t0 + Duration::from_secs(10)));
        // Renewed in time: the same term.
        l.renewed(t0 + Duration::from_secs(2), Duration::from_secs(10), "a");
        assert_eq!(l.term(), 1);
        // Lapsed, then renewed: a new term (its memos start afresh).
        l.renewed(t0 + Duration::from_secs(30), Duration::from_secs(10), "a");
        assert_eq!(l.term(), 2);
        l.follow(Some("b".into()));
        assert!(!l.leading_at(t0 + Duration::from_secs(31)));
        assert_eq!(l.holder().as_deref(), Some("b"));
    }
}

/// `leaseDurationSeconds` for a lease duration: whole seconds, rounded up,
/// at least 1. Truncating would turn a sub-second duration into 0, which
/// other clients read as a Lease already expired.
fn lease_duration_seconds(d: std::time::Duration) -> i32 {
    let secs = d.as_secs() + u64::from(d.subsec_nanos() > 0);
    i32::try_from(secs.max(1)).unwrap_or(i32::MAX)
}

#[cfg(test)]
mod duration_tests {
    use super::lease_duration_seconds;
    use std::time::Duration;

    #[test]
    fn a_lease_duration_is_never_written_as_zero() {
        assert_eq!(lease_duration_seconds(Duration::from_millis(100)), 1);
        assert_eq!(lease_duration_seconds(Duration::from_millis(1500)), 2);
        assert_eq!(lease_duration_seconds(Duration::from_secs(3)), 3);
        assert_eq!(
            lease_duration_seconds(Duration::from_secs(u64::MAX)),
            i32::MAX
        );
    }
}
