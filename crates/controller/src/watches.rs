//! Watch caches for the controller: a reflector-backed watch of one kind
//! that keeps only what the decision reads, and the generation that tells
//! when any object of a cache changed. Used by the API edge
//! ([`super::kube_edge`]) and the endpoint source ([`super::endpoints`]),
//! which import it and not each other.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use futures::StreamExt;
use kube::Api;
use kube::runtime::WatchStreamExt;
use kube::runtime::reflector;
use kube::runtime::watcher::{self, watcher};
use tokio::sync::Notify;

/// Counts the events a cache has taken in: it changes whenever one of its
/// objects may have. Read before the cache, it never misses a change (the
/// store takes an event in before the count moves). Compared on every
/// wake-up, where a sorted `(uid, resourceVersion)` list of 10,000 Services
/// cost milliseconds each time.
#[derive(Debug, Clone, Default)]
pub(crate) struct Generation {
    count: Arc<AtomicU64>,
    /// Set by an error of the watch, cleared once it is current again (a
    /// new list complete, or an event of a running watch).
    behind: Arc<AtomicBool>,
}

impl Generation {
    pub(crate) fn get(&self) -> u64 {
        self.count.load(Ordering::Acquire)
    }

    fn bump(&self) {
        self.count.fetch_add(1, Ordering::AcqRel);
    }

    /// Whether the cache is current: its watch has not failed since its
    /// last complete list. A failed watch leaves the cache as it was, and
    /// it stays so until a new list is complete (after an API server
    /// outage, for as long as the outage and the list take).
    pub(crate) fn current(&self) -> bool {
        !self.behind.load(Ordering::Acquire)
    }
}

/// Every watch ends server-side before the client's read timeout: a quiet
/// Service or Node watch is normal, not an error.
pub(crate) fn watch_config() -> watcher::Config {
    watcher::Config::default().timeout(hna_edges::cluster::credentials::WATCH_TIMEOUT_SECS)
}

/// How a watch tells that its cache changed: its generation moves, then
/// the reconcile loop wakes.
pub(crate) struct Changed {
    pub(crate) generation: Generation,
    pub(crate) wake: Arc<Notify>,
}

impl Changed {
    /// The cache changed by `event`; any event but the start of a
    /// relisting says the watch is no longer behind.
    fn arrived<K>(&self, event: &watcher::Event<K>) {
        match event {
            watcher::Event::Init | watcher::Event::InitApply(_) => {}
            _ => self.generation.behind.store(false, Ordering::Release),
        }
        self.generation.bump();
        self.wake.notify_one();
    }
}

pub(crate) fn spawn_watch<K>(
    tasks: &mut tokio::task::JoinSet<()>,
    what: &'static str,
    writer: reflector::store::Writer<K>,
    api: Api<K>,
    mut strip: impl FnMut(&mut K) + Send + 'static,
    changed: Changed,
    on_error: Arc<dyn Fn(String) + Send + Sync>,
) where
    K: kube::Resource
        + Clone
        + serde::de::DeserializeOwned
        + std::fmt::Debug
        + Send
        + Sync
        + 'static,
    K::DynamicType: Clone + Eq + std::hash::Hash + Send + Sync,
{
    // Cached objects keep only what the decision reads (managedFields alone
    // can be half of an object): bounded memory with thousands of them.
    let stream = reflector::reflector(
        writer,
        watcher(api, watch_config()).modify(move |o: &mut K| {
            o.meta_mut().managed_fields = None;
            strip(o);
        }),
    )
    .backoff(hna_edges::cluster::watch_one::ShortBackoff::default());
    tasks.spawn(async move {
        let mut stream = std::pin::pin!(stream);
        while let Some(item) = stream.next().await {
            match item {
                Ok(event) => changed.arrived(&event),
                // The cache is as it was: no pass to run for it.
                Err(e) => {
                    changed.generation.behind.store(true, Ordering::Release);
                    on_error(format!("watching {what}: {e}"));
                }
            }
        }
    });
}
