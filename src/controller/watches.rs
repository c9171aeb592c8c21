//! Watch caches for the controller: a reflector-backed watch of one kind
//! that keeps only what the decision reads, and the fingerprint that tells
//! when any object of a cache changed. Used by the API edge
//! ([`super::kube_edge`]) and the endpoint source ([`super::endpoints`]),
//! which import it and not each other.

use std::sync::Arc;

use futures::StreamExt;
use kube::Api;
use kube::runtime::WatchStreamExt;
use kube::runtime::reflector;
use kube::runtime::watcher::{self, watcher};
use tokio::sync::Notify;

/// `(uid, resourceVersion)` of each object, sorted (a store's order is
/// not stable): it changes whenever one of the objects does.
pub fn fingerprint<'a>(
    metas: impl Iterator<Item = &'a kube::api::ObjectMeta>,
) -> Vec<(String, String)> {
    let mut out: Vec<(String, String)> = metas
        .map(|m| {
            (
                m.uid.clone().unwrap_or_default(),
                m.resource_version.clone().unwrap_or_default(),
            )
        })
        .collect();
    out.sort_unstable();
    out
}

/// Every watch ends server-side before the client's read timeout: a quiet
/// Service or Node watch is normal, not an error.
pub fn watch_config() -> watcher::Config {
    watcher::Config::default().timeout(crate::cluster::credentials::WATCH_TIMEOUT_SECS)
}

pub fn spawn_watch<K>(
    tasks: &mut tokio::task::JoinSet<()>,
    what: &'static str,
    writer: reflector::store::Writer<K>,
    api: Api<K>,
    mut strip: impl FnMut(&mut K) + Send + 'static,
    changed: Arc<Notify>,
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
    .backoff(crate::cluster::watch_one::ShortBackoff::default());
    tasks.spawn(async move {
        let mut stream = std::pin::pin!(stream);
        while let Some(item) = stream.next().await {
            match item {
                Ok(_) => changed.notify_one(),
                Err(e) => on_error(format!("watching {what}: {e}")),
            }
        }
    });
}
