//! Watches one named object: a list filtered by `metadata.name` (which
//! yields the object, or its absence, and a resourceVersion), then a watch
//! from there. Every change is sent as an [`Update`]; the watch is resumed
//! from the last resourceVersion when the server or the connection ends it,
//! and the object is listed again after `410 Gone`. Errors are sent too and
//! retried with a capped backoff. There is no periodic re-read.

use std::fmt::Debug;
use std::time::{Duration, Instant};

use futures::StreamExt;
use kube::api::{ListParams, WatchEvent, WatchParams};
use kube::{Api, Resource, ResourceExt};
use serde::de::DeserializeOwned;
use tokio::sync::mpsc;

/// What went wrong while reading, classified for reports.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FailureKind {
    /// 401 or 403: the credentials may not do this.
    Forbidden,
    /// Any other error: connection, TLS, timeout, server errors.
    Unreachable,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Failure {
    pub kind: FailureKind,
    pub message: String,
}

impl Failure {
    pub fn from_kube(e: &kube::Error) -> Self {
        let kind = match e {
            kube::Error::Api(s) if s.code == 401 || s.code == 403 => FailureKind::Forbidden,
            _ => FailureKind::Unreachable,
        };
        Failure {
            kind,
            message: e.to_string(),
        }
    }
}

/// One observation of the watched object.
#[derive(Debug, Clone)]
pub enum Update<K> {
    Present(K),
    Absent,
    Failed(Failure),
}

/// Watches are retried after 250 ms doubling to 2 s (each wait jittered
/// down by up to a quarter), never longer: after an
/// API-server outage (a restart, an upgrade) everything that watches is
/// back within 2 s of the server, not after kube-runtime's default backoff
/// (up to 30 s, and kept for 2 minutes), which the fault soak found leaving
/// the controller blind for 18 s after a 23 s outage. A failing server sees
/// at most one attempt per watch every 2 s.
pub(crate) const BACKOFF_MIN: Duration = Duration::from_millis(250);
pub(crate) const BACKOFF_MAX: Duration = Duration::from_secs(2);

/// `BACKOFF_MIN` doubling to `BACKOFF_MAX`, reset by any event: for
/// kube-runtime's watch streams (`WatchStreamExt::backoff`).
#[derive(Debug, Clone)]
pub struct ShortBackoff(Duration);

impl Default for ShortBackoff {
    fn default() -> Self {
        ShortBackoff(BACKOFF_MIN)
    }
}

impl Iterator for ShortBackoff {
    type Item = Duration;
    fn next(&mut self) -> Option<Duration> {
        let now = self.0;
        self.0 = (self.0 * 2).min(BACKOFF_MAX);
        Some(jittered(now))
    }
}

/// Somewhere in the last quarter below `d`: after an outage, the watches
/// of hundreds of nodes come back spread over half a second, not in
/// lockstep (issue #29), and never later than the bound.
fn jittered(d: Duration) -> Duration {
    d.mul_f64(0.75 + fastrand::f64() * 0.25)
}

impl kube::runtime::utils::Backoff for ShortBackoff {
    fn reset(&mut self) {
        self.0 = BACKOFF_MIN;
    }
}

/// Runs until `tx` is closed; every update goes through `wrap` (to tag it
/// for a shared channel). `timeout_secs` bounds each watch request on the
/// server side; keep it below the client's read timeout, if any.
pub async fn watch_one<K, E>(
    api: Api<K>,
    name: String,
    timeout_secs: u32,
    tx: mpsc::Sender<E>,
    wrap: impl Fn(Update<K>) -> E,
) where
    K: Resource + Clone + DeserializeOwned + Debug + Send + 'static,
{
    let mut watch = Watch {
        selector: format!("metadata.name={name}"),
        api,
        name,
        timeout_secs,
        tx,
        wrap,
        backoff: Backoff(BACKOFF_MIN),
    };
    while let Next::Relist = watch.list_and_watch().await {}
}

/// One object's watch, between its requests.
struct Watch<K, E, F> {
    api: Api<K>,
    name: String,
    selector: String,
    timeout_secs: u32,
    tx: mpsc::Sender<E>,
    wrap: F,
    backoff: Backoff,
}

/// What comes after a list and its watches.
enum Next {
    /// List afresh: an error, or a resourceVersion too old to resume from.
    Relist,
    /// Nobody listens any more.
    Stop,
}

impl<K, E, F> Watch<K, E, F>
where
    K: Resource + Clone + DeserializeOwned + Debug + Send + 'static,
    F: Fn(Update<K>) -> E,
{
    /// Lists the object, then watches from the list's resourceVersion,
    /// resuming each ended watch, until it must list again or stop.
    async fn list_and_watch(&mut self) -> Next {
        let list = match self
            .api
            .list(&ListParams::default().fields(&self.selector))
            .await
        {
            Ok(list) => list,
            Err(e) => return self.failed(&e).await,
        };
        let mut rv = list.metadata.resource_version.clone().unwrap_or_default();
        let first = match list.items.into_iter().next() {
            Some(obj) => Update::Present(obj),
            None => Update::Absent,
        };
        if self.tx.send((self.wrap)(first)).await.is_err() {
            return Next::Stop;
        }
        loop {
            if let Some(next) = self.watch_from(&mut rv).await {
                return next;
            }
        }
    }

    /// Sends the failure and waits out the backoff before the next list.
    async fn failed(&mut self, e: &kube::Error) -> Next {
        if !report(&self.tx, &self.wrap, &self.name, e).await {
            return Next::Stop;
        }
        self.backoff.wait().await;
        Next::Relist
    }

    /// One watch request from `rv`, which follows the events; `None` when
    /// the stream ended and the watch may resume from there.
    async fn watch_from(&mut self, rv: &mut String) -> Option<Next> {
        let wp = WatchParams::default()
            .fields(&self.selector)
            .timeout(self.timeout_secs);
        let stream = match self.api.watch(&wp, rv).await {
            Ok(s) => s,
            Err(e) => return Some(self.failed(&e).await),
        };
        let started = Instant::now();
        let mut stream = std::pin::pin!(stream);
        while let Some(event) = stream.next().await {
            let update = match event {
                Ok(WatchEvent::Added(obj)) | Ok(WatchEvent::Modified(obj)) => {
                    *rv = obj.resource_version().unwrap_or(std::mem::take(rv));
                    Update::Present(obj)
                }
                Ok(WatchEvent::Deleted(obj)) => {
                    *rv = obj.resource_version().unwrap_or(std::mem::take(rv));
                    Update::Absent
                }
                Ok(WatchEvent::Bookmark(b)) => {
                    *rv = b.metadata.resource_version;
                    continue;
                }
                Ok(WatchEvent::Error(s)) if s.code == 410 => {
                    // Our resourceVersion is too old: list afresh.
                    tracing::debug!(object = %self.name, "watch expired (410); listing again");
                    return Some(Next::Relist);
                }
                Ok(WatchEvent::Error(s)) => {
                    let e = kube::Error::Api(s);
                    if !report(&self.tx, &self.wrap, &self.name, &e).await {
                        return Some(Next::Stop);
                    }
                    self.backoff.wait().await;
                    return Some(Next::Relist);
                }
                Err(e) => {
                    // The stream broke (idle read timeout, connection
                    // reset): resume from the last resourceVersion.
                    tracing::debug!(object = %self.name, error = %e, "watch stream ended");
                    break;
                }
            };
            if self.tx.send((self.wrap)(update)).await.is_err() {
                return Some(Next::Stop);
            }
        }
        if started.elapsed() < Duration::from_secs(1) {
            // A watch that ends at once: do not spin.
            self.backoff.wait().await;
        } else {
            self.backoff.reset();
        }
        None
    }
}

struct Backoff(Duration);

impl Backoff {
    async fn wait(&mut self) {
        tokio::time::sleep(jittered(self.0)).await;
        self.0 = (self.0 * 2).min(BACKOFF_MAX);
    }
    fn reset(&mut self) {
        self.0 = BACKOFF_MIN;
    }
}

/// Sends the failure; `false` when nobody listens any more.
async fn report<K, E>(
    tx: &mpsc::Sender<E>,
    wrap: &impl Fn(Update<K>) -> E,
    name: &str,
    e: &kube::Error,
) -> bool {
    let failure = Failure::from_kube(e);
    tracing::debug!(object = %name, error = %failure.message, "watch failed; retrying");
    tx.send(wrap(Update::Failed(failure))).await.is_ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    use kube::runtime::utils::Backoff as _;

    #[test]
    fn watches_retry_within_two_seconds_and_start_over_after_an_event() {
        let mut b = ShortBackoff::default();
        let ms: Vec<u128> = b.by_ref().take(6).map(|d| d.as_millis()).collect();
        for (got, bound) in ms.iter().zip([250, 500, 1000, 2000, 2000, 2000]) {
            assert!(*got <= bound && *got >= bound * 3 / 4, "{ms:?}");
        }
        b.reset();
        assert!(b.next().unwrap() <= Duration::from_millis(250));
        // Spread, not in lockstep.
        let firsts: std::collections::BTreeSet<u128> = (0..50)
            .map(|_| ShortBackoff::default().next().unwrap().as_micros())
            .collect();
        assert!(firsts.len() > 10, "{firsts:?}");
    }
}
