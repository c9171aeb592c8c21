//! The `LoadBalancerNode` status's writes, in a task of their own.
//!
//! The LoadBalancer loop says what the status is (`Draft`); this task
//! writes it when what it reports changed and at every heartbeat period
//! whatever else is going on. Written from the loop itself, the heartbeat
//! waited for each round: 200 Services moving onto one node kept the loop
//! busy for seconds, and the receiver of a failover looked dead in turn
//! (issue #29). Here a round takes as long as it takes, and the heartbeat
//! carries the last status the loop drafted.
//!
//! One writer: the drafts go out in order, one write (with its repeats, see
//! `super::delivery`) at a time, so a heartbeat of an older draft never
//! lands after a newer one.

use std::time::{Duration, SystemTime};

use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio::time::Instant;

use crate::membership::transport::Acknowledged;
use hna_contract::node_object::Status;

/// Writes the status subresource of this node's object.
pub trait StatusWriter: Send + Sync + 'static {
    fn write(
        &self,
        status: &Status,
    ) -> impl std::future::Future<Output = Result<(), super::delivery::Failed>> + Send;
}

/// One write at most this long.
const WRITE_TIMEOUT: Duration = Duration::from_secs(10);

/// While the status accuses a peer (lists it in `lan.down`), its
/// heartbeat goes out at least this often, and says so in
/// `heartbeatPeriodMs`: the controller counts an accusation only while
/// its writer's heartbeat is on time by its stated period (two periods and
/// a second). A witness cut off from the API server after it accused
/// cannot take the accusation back when the accused returns; this way its
/// word stops counting within 5 s instead of at the 40 s staleness bound
/// (the soak saw a live node moved on two such 11 s-old accusations).
pub(crate) const ACCUSING_PERIOD: Duration = Duration::from_secs(2);
/// For how long after its newest accusation a node beats at
/// [`ACCUSING_PERIOD`]: well past the controller's staleness bound (by
/// then a peer still dead has long had its Services moved). Then it beats
/// at its own period again, so a peer left dead for hours (a stopped VM)
/// costs its witnesses nothing more; the accusation still counts while the
/// witness beats on time, and one cut off after that stops counting
/// within two of its periods (21 s), not 5 s.
pub(crate) const ACCUSING_FAST_FOR: Duration = Duration::from_secs(300);

/// The heartbeat period while the status accuses `down` since `since`.
fn period_for(heartbeat: Duration, accusing_since: Option<Instant>, now: Instant) -> Duration {
    match accusing_since {
        Some(since) if now.saturating_duration_since(since) < ACCUSING_FAST_FOR => {
            heartbeat.min(ACCUSING_PERIOD)
        }
        _ => heartbeat,
    }
}

/// When the status's accusations began, for [`period_for`]: a new name
/// among them starts the count again, none ends it.
fn accusing_since(
    since: Option<Instant>,
    before: &[String],
    now_accused: &[String],
    now: Instant,
) -> Option<Instant> {
    if now_accused.is_empty() {
        None
    } else if since.is_none() || now_accused.iter().any(|n| !before.contains(n)) {
        Some(now)
    } else {
        since
    }
}

/// A status to write, without its heartbeat.
#[derive(Debug, Clone, Default, PartialEq)]
pub(crate) struct Draft {
    pub(crate) status: Status,
    /// Counts the drafts that must be written even when their settled view
    /// is unchanged (see [`StatusWrites::write_now`]).
    pub(crate) urgent: u64,
}

/// What the writes achieved, for the loop (fencing) and `status`.
#[derive(Debug, Clone)]
pub(crate) struct Written {
    /// When a write last succeeded (or the task started).
    pub(crate) last_ok: Instant,
    /// The last failed write's error, until one succeeds.
    pub(crate) error: Option<String>,
    /// The newest [`Draft::urgent`] whose write was attempted to the end.
    pub(crate) urgent_done: u64,
    /// This node's accusations (`lan.down`) the API server acknowledged:
    /// what the controller may have acted on. Told to each accused on the
    /// LAN, so that one that lapsed while nobody could read the API (a
    /// fence, a pause) knows whether its Services may have moved
    /// (`super::lan_word`). Only a write that succeeded counts: one sent
    /// into a hung API server that times out may still be applied when the
    /// server wakes; the accused, having taken its addresses back on its
    /// witnesses' word, then holds them when the controller moves them, and
    /// the new holder's takeover guard, which hears it answer, waits until
    /// the accused reads its assignments and lets go
    /// (docs/loadbalancer-design.md, "A bad day").
    pub(crate) acknowledged: Acknowledged,
}

/// The loop's handle on the task; dropping it stops the task.
pub struct StatusWrites {
    drafts: watch::Sender<Draft>,
    written: watch::Receiver<Written>,
    task: JoinHandle<()>,
}

impl Drop for StatusWrites {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl StatusWrites {
    /// Starts the task; nothing is written until the first draft.
    pub fn start<W: StatusWriter>(writer: W, heartbeat: Duration) -> StatusWrites {
        let (drafts, rx) = watch::channel(Draft::default());
        let (tx, written) = watch::channel(Written {
            last_ok: Instant::now(),
            error: None,
            urgent_done: 0,
            acknowledged: Acknowledged::default(),
        });
        let task = tokio::spawn(run(writer, heartbeat, rx, tx));
        StatusWrites {
            drafts,
            written,
            task,
        }
    }

    /// The status is now `status`: written within moments when what it
    /// reports changed, else with the next heartbeat.
    pub fn draft(&self, status: Status) {
        self.drafts.send_if_modified(|d| {
            let changed = d.status != status;
            d.status = status;
            changed
        });
    }

    /// Writes `status` now, and waits (at most `within`) until that write
    /// was tried to the end; `false` when it was not in time.
    pub(crate) async fn write_now(&self, status: Status, within: Duration) -> bool {
        let mut urgent = 0;
        self.drafts.send_modify(|d| {
            d.status = status;
            d.urgent += 1;
            urgent = d.urgent;
        });
        let mut written = self.written.clone();
        tokio::time::timeout(within, written.wait_for(|w| w.urgent_done >= urgent))
            .await
            .is_ok_and(|r| r.is_ok())
    }

    /// Writes the status now, changed or not, without waiting: a write
    /// that lands tells the loop that the API server still hears this
    /// node (see `fence`).
    pub(crate) fn touch(&self) {
        self.drafts.send_modify(|d| d.urgent += 1);
    }

    /// What the writes achieved so far.
    pub(crate) fn written(&self) -> Written {
        self.written.borrow().clone()
    }

    /// Changes when a write succeeds or fails.
    pub(crate) fn watch(&self) -> watch::Receiver<Written> {
        self.written.clone()
    }
}

async fn run<W: StatusWriter>(
    writer: W,
    heartbeat: Duration,
    mut drafts: watch::Receiver<Draft>,
    written: watch::Sender<Written>,
) {
    // Nothing before the loop's first draft.
    if drafts.changed().await.is_err() {
        return;
    }
    let mut last: Option<Status> = None;
    let mut last_beat: Option<SystemTime> = None;
    let mut urgent_done = 0;
    // When the last write began: the next beat is due a period later.
    let mut last_sent = Instant::now();
    let mut accused: Vec<String> = Vec::new();
    let mut since: Option<Instant> = None;
    // A 429's `Retry-After`: no write before then, but the last one.
    let mut not_before = Instant::now();
    // The last write failed without any answer (unreachable, timed out).
    let mut unanswered = false;
    loop {
        let draft = drafts.borrow_and_update().clone();
        let changed = last.as_ref().map(settled_view) != Some(settled_view(&draft.status));
        let urgent = draft.urgent > urgent_done;
        let now = Instant::now();
        let down = draft.status.lan.as_ref().map_or(&[][..], |l| &l.down[..]);
        since = accusing_since(since, &accused, down, now);
        accused = down.to_vec();
        let period = period_for(heartbeat, since, now);
        let beat_due = last_sent + period;
        // A 429's `Retry-After` holds back every write, the urgent ones too
        // (issue #29: the server's wait is the node's as a whole).
        if (urgent || changed || now >= beat_due) && now >= not_before {
            last_sent = Instant::now();
            let beat = next_beat(last_beat, SystemTime::now());
            last_beat = Some(beat);
            let mut status = draft.status.clone();
            status.heartbeat = Some(humantime::format_rfc3339_millis(beat).to_string());
            if period < heartbeat {
                status.heartbeat_period_ms = Some(period.as_millis() as u64);
            }
            // Repeated until it lands (a heartbeat that waits a period after
            // each failure goes stale on a flaky API server); after a write
            // that got no answer at all, a single attempt per period, so an
            // outage gets no burst. A server that answers, if with errors,
            // gets the repeats (with kube's own retry layer off, a single
            // try per period after any error left a healthy node's
            // heartbeat unwritten for 7 s on a flaky server).
            let policy = super::delivery::Policy::for_period(period, WRITE_TIMEOUT);
            let policy = if unanswered { policy.single() } else { policy };
            let result = super::delivery::deliver(&policy, || writer.write(&status)).await;
            urgent_done = draft.urgent;
            // Written again at the next heartbeat, not at once, when the
            // write failed: `last` is what was tried.
            last = Some(draft.status);
            let hold = match &result {
                Ok(hold) => *hold,
                Err(e) => e.retry_after,
            };
            unanswered = result.as_ref().is_err_and(|e| !e.answered);
            tracing::debug!(
                heartbeat = ?status.heartbeat,
                ready = status.ready,
                lan_down = ?status.lan.as_ref().map(|l| &l.down),
                unheard = status.lan.as_ref().is_some_and(|l| l.unheard),
                held = status.held,
                ok = result.is_ok(),
                "status write tried"
            );
            if let Some(wait) = hold {
                not_before = Instant::now() + wait;
            }
            written.send_modify(|w| {
                w.urgent_done = urgent_done;
                match result {
                    Ok(_) => {
                        w.last_ok = Instant::now();
                        w.error = None;
                        w.acknowledged
                            .record(status.lan.as_ref().map_or(&[][..], |l| &l.down[..]));
                    }
                    Err(e) => w.error = Some(e.message),
                }
            });
            continue;
        }
        // Something to write waits for the server's wait only; otherwise
        // the next heartbeat is due.
        let wake = if urgent || changed {
            not_before
        } else {
            beat_due.max(not_before)
        };
        tokio::select! {
            changed = drafts.changed() => if changed.is_err() {
                return;
            },
            _ = tokio::time::sleep_until(wake) => {}
        }
    }
}

/// The controller only asks whether the heartbeat changed: a clock stepped
/// back (or two writes within a millisecond) must not repeat one.
/// Whole milliseconds, as written.
fn next_beat(last: Option<SystemTime>, now: SystemTime) -> SystemTime {
    let ms = now
        .duration_since(SystemTime::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0);
    let now = SystemTime::UNIX_EPOCH + Duration::from_millis(ms);
    match last {
        Some(last) if now <= last => last + Duration::from_millis(1),
        _ => now,
    }
}

/// What a change-driven write compares: the status with the leases on
/// their way to an address (INIT, SELECTING, REQUESTING, CHECKING,
/// INIT-REBOOT) as one step, and without what a renewal changes (its
/// steps through RENEWING and REBINDING, which hold the address as BOUND
/// does, and the new expiry). Nobody acts on those: writing each step
/// would cost the controller a round trip before the write that matters
/// (BOUND), and a write per renewal would grow with the Services held
/// (issue #30). They are reported with the next heartbeat. A new lease is
/// a change, though: listing it tells the controller this node read its
/// assignment (`controller::service_health`'s unread rule).
fn settled_view(status: &Status) -> Status {
    const MOVING: [&str; 5] = ["INIT", "SELECTING", "REQUESTING", "CHECKING", "INIT-REBOOT"];
    const RENEWAL: [&str; 2] = ["RENEWING", "REBINDING"];
    let mut s = status.clone();
    for l in &mut s.leases {
        if MOVING.contains(&l.state.as_str()) {
            l.state = "STARTING".into();
            l.address = None;
            l.server = None;
            l.message = None;
        } else if RENEWAL.contains(&l.state.as_str()) {
            l.state = "BOUND".into();
        }
        l.expires = None;
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use hna_contract::node_object::LeaseReport;

    fn lease(state: &str) -> LeaseReport {
        LeaseReport {
            service: "default/web".into(),
            interface: "hlb-3f2a9c1e".into(),
            state: state.into(),
            ..LeaseReport::default()
        }
    }

    #[test]
    fn a_lease_on_its_way_is_one_step_but_its_appearance_is_a_change() {
        let none = Status::default();
        let with = |state: &str| Status {
            leases: vec![lease(state)],
            ..Status::default()
        };
        for moving in ["INIT", "SELECTING", "REQUESTING", "CHECKING", "INIT-REBOOT"] {
            assert_eq!(
                settled_view(&with(moving)),
                settled_view(&with("INIT")),
                "{moving}"
            );
            assert_ne!(settled_view(&with(moving)), settled_view(&none), "{moving}");
        }
        for settled in ["BOUND", "RENEWING", "REBINDING", "FAILED"] {
            assert_ne!(
                settled_view(&with(settled)),
                settled_view(&none),
                "{settled}"
            );
        }
    }

    #[test]
    fn a_renewal_alone_is_no_change() {
        let bound = |state: &str, expires: &str| Status {
            leases: vec![LeaseReport {
                state: state.into(),
                address: Some("10.77.0.50".into()),
                expires: Some(expires.into()),
                ..lease(state)
            }],
            ..Status::default()
        };
        let before = settled_view(&bound("BOUND", "2026-11-27T03:00:00Z"));
        for state in ["RENEWING", "REBINDING", "BOUND"] {
            assert_eq!(
                settled_view(&bound(state, "2026-11-27T04:00:00Z")),
                before,
                "{state}"
            );
        }
        assert_ne!(
            settled_view(&bound("FAILED", "2026-11-27T04:00:00Z")),
            before
        );
    }

    /// Answers 429 with `Retry-After: 20s` until 20 s have passed, and
    /// records when each attempt came.
    #[derive(Clone)]
    struct Shedding {
        start: Instant,
        calls: std::sync::Arc<std::sync::Mutex<Vec<Duration>>>,
    }

    impl StatusWriter for Shedding {
        async fn write(&self, _status: &Status) -> Result<(), super::super::delivery::Failed> {
            let at = self.start.elapsed();
            self.calls.lock().unwrap().push(at);
            if at < Duration::from_secs(20) {
                Err(super::super::delivery::Failed {
                    message: "429 Too Many Requests".into(),
                    retry_after: Some(Duration::from_secs(20) - at),
                    answered: true,
                })
            } else {
                Ok(())
            }
        }
    }

    /// Issue #29: once the server asked for a wait, no write goes out
    /// before it ends, an urgent one (a stop, a LAN silence's proof of
    /// contact) included; and a changed status goes out when it ends, not
    /// at the next heartbeat.
    #[tokio::test(start_paused = true)]
    async fn a_retry_after_holds_back_every_write_then_the_pending_one_goes() {
        let writer = Shedding {
            start: Instant::now(),
            calls: Default::default(),
        };
        let writes = StatusWrites::start(writer.clone(), Duration::from_secs(30));
        writes.draft(Status {
            reason: "first".into(),
            ..Status::default()
        });
        tokio::time::sleep(Duration::from_secs(1)).await;
        writes.touch();
        writes.draft(Status {
            reason: "changed".into(),
            ..Status::default()
        });
        let mut written = writes.watch();
        tokio::time::timeout(
            Duration::from_secs(25),
            written.wait_for(|w| w.error.is_none() && w.urgent_done >= 1),
        )
        .await
        .unwrap_or_else(|_| {
            panic!(
                "not written once the wait is over: {:?} {:?}",
                writer.calls.lock().unwrap(),
                writes.written()
            )
        })
        .unwrap();
        let calls = writer.calls.lock().unwrap().clone();
        assert_eq!(calls[0], Duration::ZERO, "{calls:?}");
        assert!(
            calls[1..].iter().all(|at| *at >= Duration::from_secs(20)),
            "an attempt within the server's wait: {calls:?}"
        );
        assert!(
            *calls.last().unwrap() < Duration::from_secs(21),
            "the pending write waited for more than the server asked: {calls:?}"
        );
    }

    /// When a write came, and the period it stated.
    type Stated = (Instant, Option<u64>);

    /// Records each write.
    #[derive(Clone, Default)]
    struct Recorder {
        writes: std::sync::Arc<std::sync::Mutex<Vec<Stated>>>,
    }

    impl StatusWriter for Recorder {
        async fn write(&self, status: &Status) -> Result<(), super::super::delivery::Failed> {
            self.writes
                .lock()
                .unwrap()
                .push((Instant::now(), status.heartbeat_period_ms));
            Ok(())
        }
    }

    fn accusing(down: &[&str]) -> Status {
        Status {
            heartbeat_period_ms: Some(10_000),
            lan: Some(hna_contract::membership::LanReport {
                down: down.iter().map(|d| d.to_string()).collect(),
                ..Default::default()
            }),
            ..Status::default()
        }
    }

    /// While it accuses a peer a node beats every 2 s and says so; once it
    /// accuses nobody, or after [`ACCUSING_FAST_FOR`], at its own period
    /// again.
    #[tokio::test(start_paused = true)]
    async fn an_accusing_node_beats_at_the_fast_period_for_a_while() {
        let rec = Recorder::default();
        let t0 = Instant::now();
        let writes = StatusWrites::start(rec.clone(), Duration::from_secs(10));
        writes.draft(accusing(&[]));
        tokio::time::sleep(Duration::from_secs(15)).await;
        writes.draft(accusing(&["n2"]));
        tokio::time::sleep(Duration::from_secs(9)).await;
        writes.draft(accusing(&[]));
        tokio::time::sleep(Duration::from_secs(25)).await;
        let at = |from: Duration, to: Duration| -> Vec<(Duration, Option<u64>)> {
            rec.writes
                .lock()
                .unwrap()
                .iter()
                .map(|(t, p)| (*t - t0, *p))
                .filter(|(t, _)| *t >= from && *t < to)
                .collect()
        };
        let s = Duration::from_secs;
        assert_eq!(
            at(s(0), s(15)),
            [(s(0), Some(10_000)), (s(10), Some(10_000))],
            "not accusing"
        );
        assert_eq!(
            at(s(15), s(24)),
            [15, 17, 19, 21, 23].map(|t| (s(t), Some(2_000))),
            "accusing"
        );
        assert_eq!(
            at(s(24), s(49)),
            [24, 34, 44].map(|t| (s(t), Some(10_000))),
            "accusation taken back"
        );

        // An accusation that stands: fast for ACCUSING_FAST_FOR, then slow.
        let t1 = Instant::now();
        writes.draft(accusing(&["n3"]));
        tokio::time::sleep(ACCUSING_FAST_FOR + s(30)).await;
        let fast_end = t1 - t0 + ACCUSING_FAST_FOR;
        let late = at(fast_end + s(1), fast_end + s(30));
        assert!(
            late.len() <= 3 && late.iter().all(|(_, p)| *p == Some(10_000)),
            "{late:?}"
        );
        let during = at(t1 - t0, fast_end);
        assert!(
            during.len() as u64 >= ACCUSING_FAST_FOR.as_secs() / 2
                && during.iter().all(|(_, p)| *p == Some(2_000)),
            "{} writes while accusing",
            during.len()
        );
    }

    #[test]
    fn a_new_name_among_the_accused_starts_the_count_again() {
        let t = Instant::now();
        let later = t + Duration::from_secs(100);
        let n = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        assert_eq!(accusing_since(None, &[], &[], t), None);
        assert_eq!(accusing_since(None, &[], &n(&["a"]), t), Some(t));
        assert_eq!(
            accusing_since(Some(t), &n(&["a"]), &n(&["a"]), later),
            Some(t)
        );
        assert_eq!(
            accusing_since(Some(t), &n(&["a"]), &n(&["a", "b"]), later),
            Some(later)
        );
        assert_eq!(
            accusing_since(Some(t), &n(&["a", "b"]), &n(&["b"]), later),
            Some(t)
        );
        assert_eq!(accusing_since(Some(t), &n(&["a"]), &[], later), None);
        assert_eq!(
            period_for(Duration::from_secs(10), Some(t), later),
            ACCUSING_PERIOD
        );
        assert_eq!(
            period_for(Duration::from_secs(10), Some(t), t + ACCUSING_FAST_FOR),
            Duration::from_secs(10)
        );
        assert_eq!(
            period_for(Duration::from_secs(1), Some(t), later),
            Duration::from_secs(1),
            "a faster period of its own stays"
        );
    }

    #[test]
    fn heartbeats_never_repeat_or_go_back() {
        let t = SystemTime::UNIX_EPOCH + Duration::from_millis(5_000);
        assert_eq!(next_beat(None, t), t);
        let back = SystemTime::UNIX_EPOCH + Duration::from_millis(4_000);
        assert_eq!(next_beat(Some(t), back), t + Duration::from_millis(1));
        assert_eq!(next_beat(Some(t), t), t + Duration::from_millis(1));
    }
}

#[cfg(test)]
mod acknowledged_tests {
    use super::*;

    /// Refuses every write while `refusing` is set (unanswered, as a hung or
    /// stopped API server looks).
    #[derive(Clone, Default)]
    struct Switch {
        refusing: std::sync::Arc<std::sync::atomic::AtomicBool>,
    }

    impl StatusWriter for Switch {
        async fn write(&self, _status: &Status) -> Result<(), super::super::delivery::Failed> {
            if self.refusing.load(std::sync::atomic::Ordering::SeqCst) {
                Err(super::super::delivery::Failed {
                    message: "connection refused".into(),
                    retry_after: None,
                    answered: false,
                })
            } else {
                Ok(())
            }
        }
    }

    fn accusing(down: &[&str], reason: &str) -> Status {
        Status {
            reason: reason.into(),
            lan: Some(hna_contract::membership::LanReport {
                down: down.iter().map(|s| s.to_string()).collect(),
                ..Default::default()
            }),
            ..Status::default()
        }
    }

    async fn settle(writes: &StatusWrites) -> Acknowledged {
        tokio::time::sleep(Duration::from_secs(3)).await;
        writes.written().acknowledged
    }

    /// An accusation counts once the API server acknowledged a write that
    /// made it; one that never landed (the server unreachable) does not,
    /// and a standing accusation written again is not a new one.
    #[tokio::test(start_paused = true)]
    async fn only_acknowledged_accusations_count_each_once() {
        let writer = Switch::default();
        let writes = StatusWrites::start(writer.clone(), Duration::from_secs(10));
        writes.draft(accusing(&[], "quiet"));
        assert_eq!(settle(&writes).await, Acknowledged::default());

        writes.draft(accusing(&["n2"], "n2 found dead"));
        let a = settle(&writes).await;
        assert_eq!(a.accusations.get("n2"), Some(&1));
        assert!(a.accusing.contains("n2"));
        writes.draft(accusing(&["n2", "n3"], "n3 too"));
        let a = settle(&writes).await;
        assert_eq!(a.accusations.get("n2"), Some(&1), "standing, not new");
        assert_eq!(a.accusations.get("n3"), Some(&1));

        writes.draft(accusing(&[], "cleared"));
        let a = settle(&writes).await;
        assert!(a.accusing.is_empty());

        // Unreachable: the accusation is tried, never acknowledged.
        writer
            .refusing
            .store(true, std::sync::atomic::Ordering::SeqCst);
        writes.draft(accusing(&["n2"], "n2 dead again"));
        let a = settle(&writes).await;
        assert_eq!(a.accusations.get("n2"), Some(&1), "{a:?}");
        assert!(a.accusing.is_empty());
        assert!(writes.written().error.is_some());

        // Reachable again while it still accuses: now it counts.
        writer
            .refusing
            .store(false, std::sync::atomic::Ordering::SeqCst);
        tokio::time::sleep(Duration::from_secs(15)).await;
        let a = writes.written().acknowledged;
        assert_eq!(a.accusations.get("n2"), Some(&2), "{a:?}");
        assert!(a.accusing.contains("n2"));
    }
}
