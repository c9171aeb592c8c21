//! One status write, delivered through a flaky API server in time.
//!
//! The controller counts a node as dead when its heartbeat has not changed
//! for 3 s, three heartbeat periods. Written once per period, a heartbeat
//! whose write fails waits a whole period for the next one: three failed
//! writes in a row (a 429, a 503 and a 500, at a fifth of requests failing
//! a few times an hour per node), or a failed write followed by one held up
//! for 2 s, and the controller moves every Service off a healthy node.
//!
//! So a write is an [`attempt`](deliver) that is repeated: a failed attempt
//! is followed by another a moment later, and one that has not answered
//! for a while gets an identical one beside it (the first answer wins; a
//! merge patch of the same status twice is the same status). Failed answers
//! come at once, so the repeats cost milliseconds; a slow answer no longer
//! decides alone when the heartbeat lands.
//!
//! Except when the server says how long to wait: a 429 with `Retry-After`
//! (API Priority and Fairness shedding load) holds every further attempt of
//! the write back for that long, so a server in trouble is not hammered by
//! the very repeats that beat its random failures (issue #29).

use std::future::Future;
use std::time::Duration;

use futures::StreamExt;
use futures::stream::FuturesUnordered;
use tokio::time::Instant;

/// How one write is delivered.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Policy {
    /// No answer for this long from the latest attempt: another goes out
    /// beside it.
    pub(crate) hedge_after: Duration,
    /// After a failed attempt, the next goes out this much later.
    pub(crate) retry_after: Duration,
    pub(crate) max_in_flight: usize,
    /// Attempts in all (1: a single request, as after an outage began).
    pub(crate) max_attempts: usize,
    /// New attempts go out only this long after the first: then the next
    /// write is due anyway.
    pub(crate) window: Duration,
    /// The whole write ends after this long, answered or not.
    pub(crate) timeout: Duration,
}

impl Policy {
    /// For a status written every `period`.
    pub(crate) fn for_period(period: Duration, timeout: Duration) -> Policy {
        Policy {
            hedge_after: period / 4,
            retry_after: Duration::from_millis(50),
            max_in_flight: 4,
            max_attempts: 8,
            window: period,
            timeout,
        }
    }

    /// One attempt, no repeats.
    pub(crate) fn single(self) -> Policy {
        Policy {
            max_attempts: 1,
            ..self
        }
    }
}

/// A failed attempt.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Failed {
    pub(crate) message: String,
    /// The server asked for no attempt before this long (a 429's
    /// `Retry-After`).
    pub(crate) retry_after: Option<Duration>,
    /// The server answered (an HTTP error): it is there, and repeats within
    /// the window are what beat its random failures. False: no answer at
    /// all (unreachable, timed out), where repeats only add load.
    pub(crate) answered: bool,
}

impl From<String> for Failed {
    fn from(message: String) -> Failed {
        Failed {
            message,
            retry_after: None,
            answered: false,
        }
    }
}

impl From<&str> for Failed {
    fn from(message: &str) -> Failed {
        Failed::from(message.to_string())
    }
}

/// Runs `attempt` until one succeeds, as `policy` says. Either way, what is
/// left of a wait the server asked for comes back (the next write must not
/// go out before it either: a sibling attempt's success does not lift a
/// 429's `Retry-After`); the error is the last attempt's, or the timeout.
pub(crate) async fn deliver<F, Fut>(
    policy: &Policy,
    mut attempt: F,
) -> Result<Option<Duration>, Failed>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<(), Failed>>,
{
    let start = Instant::now();
    let deadline = start + policy.timeout;
    let window_end = start + policy.window;
    let mut in_flight = FuturesUnordered::new();
    in_flight.push(attempt());
    let mut launched = 1;
    let mut last_launch = start;
    let mut retry_at: Option<Instant> = None;
    let mut last_error: Option<String> = None;
    let mut last_answered = false;
    // Asked by the server: nothing goes out before then.
    let mut held_until: Option<Instant> = None;
    loop {
        let may_launch = launched < policy.max_attempts && in_flight.len() < policy.max_in_flight;
        let hedge_at = (!in_flight.is_empty()).then(|| last_launch + policy.hedge_after);
        let next_launch = [retry_at, hedge_at]
            .into_iter()
            .flatten()
            .min()
            .map(|at| held_until.map_or(at, |h| at.max(h)))
            .filter(|at| may_launch && *at < window_end);
        if in_flight.is_empty() && next_launch.is_none() {
            return Err(Failed {
                message: last_error.unwrap_or_else(|| "not written".into()),
                retry_after: held_until
                    .map(|h| h.saturating_duration_since(Instant::now()))
                    .filter(|d| !d.is_zero()),
                answered: last_answered,
            });
        }
        let hold = |held_until: Option<Instant>| {
            held_until
                .map(|h| h.saturating_duration_since(Instant::now()))
                .filter(|d| !d.is_zero())
        };
        tokio::select! {
            // Answers first: a 429 that has come holds a hedge due now.
            biased;
            Some(result) = in_flight.next(), if !in_flight.is_empty() => match result {
                Ok(()) => return Ok(hold(held_until)),
                Err(e) => {
                    if let Some(wait) = e.retry_after {
                        let until = Instant::now() + wait;
                        held_until = Some(held_until.map_or(until, |h| h.max(until)));
                    }
                    last_error = Some(e.message);
                    last_answered = e.answered;
                    retry_at = Some(Instant::now() + policy.retry_after);
                }
            },
            _ = hna_edges::duration::sleep_until(next_launch) => {
                in_flight.push(attempt());
                launched += 1;
                last_launch = Instant::now();
                retry_at = None;
            }
            // The server's wait goes on past the write's end: the next
            // write must not go out before it either (issue #29: a wait
            // longer than the timeout was forgotten here).
            _ = tokio::time::sleep_until(deadline) => {
                return Err(Failed {
                    message: match last_error {
                        Some(e) if in_flight.is_empty() => e,
                        _ => format!("no answer within {:?}", policy.timeout),
                    },
                    retry_after: hold(held_until),
                    answered: last_answered && in_flight.is_empty(),
                });
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::{Arc, Mutex};

    const POLICY: Policy = Policy {
        hedge_after: Duration::from_millis(250),
        retry_after: Duration::from_millis(50),
        max_in_flight: 4,
        max_attempts: 8,
        window: Duration::from_secs(1),
        timeout: Duration::from_secs(10),
    };

    type Attempt = std::pin::Pin<Box<dyn Future<Output = Result<(), Failed>>>>;

    /// Attempts answer as scripted (delay, success), in order; past the
    /// script, at once with success. Records when each went out.
    fn scripted(script: Vec<(u64, bool)>) -> (Arc<Mutex<Vec<Instant>>>, impl FnMut() -> Attempt) {
        scripted_answers(
            script
                .into_iter()
                .map(|(ms, ok)| (ms, if ok { Ok(()) } else { Err("500".into()) }))
                .collect(),
        )
    }

    /// [`scripted`] with each answer given whole.
    fn scripted_answers(
        script: Vec<(u64, Result<(), Failed>)>,
    ) -> (Arc<Mutex<Vec<Instant>>>, impl FnMut() -> Attempt) {
        let sent = Arc::new(Mutex::new(Vec::new()));
        let log = sent.clone();
        let mut script = script.into_iter();
        let attempt = move || {
            log.lock().unwrap().push(Instant::now());
            let (ms, answer) = script.next().unwrap_or((0, Ok(())));
            Box::pin(async move {
                tokio::time::sleep(Duration::from_millis(ms)).await;
                answer
            }) as Attempt
        };
        (sent, attempt)
    }

    fn too_many(retry_after: Duration) -> Result<(), Failed> {
        Err(Failed {
            message: "429".into(),
            retry_after: Some(retry_after),
            answered: true,
        })
    }

    /// A wait longer than the write's timeout outlives the write: the
    /// failure carries what is left of it, so the next write waits too.
    #[tokio::test(start_paused = true)]
    async fn a_wait_longer_than_the_timeout_comes_back_with_the_failure() {
        let policy = Policy {
            window: Duration::from_secs(30),
            ..POLICY
        };
        // Answered after 1 ms: 25 s from then.
        let (sent, attempt) = scripted_answers(vec![(1, too_many(Duration::from_secs(25)))]);
        let t0 = Instant::now();
        let e = deliver(&policy, attempt)
            .await
            .expect_err("held past the timeout");
        assert_eq!(sent.lock().unwrap().len(), 1);
        assert_eq!(t0.elapsed(), POLICY.timeout);
        let left = e.retry_after.expect("the wait left");
        assert!(
            left > Duration::from_secs(14) && left <= Duration::from_millis(15_001),
            "{left:?}"
        );
        assert_eq!(e.message, "429");
    }

    #[tokio::test(start_paused = true)]
    async fn failed_attempts_are_repeated_at_once() {
        let (sent, attempt) = scripted(vec![(1, false), (1, false), (1, false)]);
        let t0 = Instant::now();
        assert!(deliver(&POLICY, attempt).await.is_ok());
        assert_eq!(sent.lock().unwrap().len(), 4);
        assert!(
            t0.elapsed() < Duration::from_millis(200),
            "{:?}",
            t0.elapsed()
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_slow_attempt_gets_a_second_beside_it_and_the_first_answer_wins() {
        let (sent, attempt) = scripted(vec![(1_900, true), (5, true)]);
        let t0 = Instant::now();
        assert!(deliver(&POLICY, attempt).await.is_ok());
        let took = t0.elapsed();
        assert!(took < Duration::from_millis(300), "{took:?}");
        assert_eq!(sent.lock().unwrap().len(), 2);
    }

    /// An outage: every attempt fails. A bounded burst, then the error;
    /// a single attempt is just that.
    #[tokio::test(start_paused = true)]
    async fn every_attempt_failing_ends_in_the_last_error() {
        let (sent, attempt) = scripted(vec![(1, false); 20]);
        assert_eq!(deliver(&POLICY, attempt).await, Err("500".into()));
        assert_eq!(sent.lock().unwrap().len(), POLICY.max_attempts);
        let (sent, attempt) = scripted(vec![(1, false); 20]);
        assert_eq!(deliver(&POLICY.single(), attempt).await, Err("500".into()));
        assert_eq!(sent.lock().unwrap().len(), 1);
    }

    /// Nothing answers: at most `max_in_flight` at once, none after the
    /// window, and the whole write ends at the timeout.
    #[tokio::test(start_paused = true)]
    async fn hung_attempts_are_bounded_and_time_out() {
        let (sent, attempt) = scripted(vec![(60_000, true); 20]);
        let t0 = Instant::now();
        assert!(deliver(&POLICY, attempt).await.is_err());
        assert_eq!(t0.elapsed(), POLICY.timeout);
        let sent = sent.lock().unwrap();
        assert_eq!(sent.len(), POLICY.max_in_flight);
        assert!(sent.iter().all(|at| *at - t0 < POLICY.window));
    }

    /// A 429 with `Retry-After`: no further attempt (repeat or hedge)
    /// before it, even where that ends the write unwritten.
    #[tokio::test(start_paused = true)]
    async fn a_retry_after_holds_every_further_attempt_back() {
        let (sent, attempt) =
            scripted_answers(vec![(5, too_many(Duration::from_millis(600))), (5, Ok(()))]);
        let t0 = Instant::now();
        assert!(deliver(&POLICY, attempt).await.is_ok());
        let sent = sent.lock().unwrap().clone();
        assert_eq!(sent.len(), 2, "one repeat, after the wait");
        assert!(
            sent[1] - t0 >= Duration::from_millis(600),
            "{:?}",
            sent[1] - t0
        );
        // Asked to wait past the window: the write ends unwritten.
        let (_, attempt) = scripted_answers(vec![(0, too_many(Duration::from_secs(5)))]);
        let failed = deliver(&POLICY, attempt).await.unwrap_err();
        assert_eq!(failed.message, "429");
        assert!(
            failed
                .retry_after
                .is_some_and(|d| d > Duration::from_secs(3)),
            "the rest of the wait is handed on: {failed:?}"
        );
    }

    /// A slow first attempt, a hedge beside it answered 429 with
    /// `Retry-After`: no further hedge until the wait is over, and the
    /// slow one's success hands the rest of the wait on.
    #[tokio::test(start_paused = true)]
    async fn a_429_to_a_hedge_stops_the_hedges_beside_a_slow_attempt() {
        let (sent, attempt) =
            scripted_answers(vec![(900, Ok(())), (2, too_many(Duration::from_secs(1)))]);
        let t0 = Instant::now();
        let hold = deliver(&POLICY, attempt).await.unwrap();
        let sent = sent.lock().unwrap().clone();
        assert_eq!(
            sent.len(),
            2,
            "{:?}",
            sent.iter().map(|t| *t - t0).collect::<Vec<_>>()
        );
        assert!(
            hold.is_some_and(|h| h > Duration::from_millis(300)),
            "{hold:?}"
        );
    }
}
