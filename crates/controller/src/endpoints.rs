//! Which nodes have a ready endpoint of a Service, for
//! `externalTrafficPolicy: Local`: from EndpointSlices where the API has
//! them, from Endpoints where it does not (Kubernetes 1.20 and older).
//!
//! The choice is a pure function of the setting and of what the API's
//! discovery says it serves (`choose`); the cached objects are cut down to
//! what the decision reads (`strip_endpoints`, `strip_slice`); the
//! readers of both forms are plain functions over one object.

use std::collections::{BTreeSet, HashMap};
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::Endpoints;
use kube::api::{Api, ApiResource, DynamicObject};
use kube::runtime::reflector::{self, Store};
use serde::{Deserialize, Serialize};
use tokio::sync::Notify;

use hna_contract::ServiceKey;

/// `--endpoint-source`: where the operator wants endpoints read from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum EndpointSetting {
    /// EndpointSlices (`discovery.k8s.io/v1`) where the API serves them,
    /// else Endpoints.
    #[default]
    Auto,
    /// Endpoints, always.
    Endpoints,
    /// EndpointSlices, `discovery.k8s.io/v1` or else `v1beta1`
    /// (Kubernetes 1.17 to 1.20, where `auto` would read Endpoints).
    EndpointSlices,
}

/// `--endpoint-source` named none of `EndpointSetting::NAMES`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("`{0}` is not an endpoint source; use one of: {names}", names = EndpointSetting::NAMES.join(", "))]
pub struct UnknownEndpointSource(pub String);

impl EndpointSetting {
    pub(crate) const NAMES: &[&str] = &["auto", "endpoints", "endpointslices"];

    pub fn parse(v: &str) -> Result<EndpointSetting, UnknownEndpointSource> {
        match v {
            "auto" => Ok(EndpointSetting::Auto),
            "endpoints" => Ok(EndpointSetting::Endpoints),
            "endpointslices" => Ok(EndpointSetting::EndpointSlices),
            _ => Err(UnknownEndpointSource(v.to_string())),
        }
    }
}

/// The source in use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EndpointSource {
    /// EndpointSlices of this `discovery.k8s.io` version: what kube-proxy
    /// reads, and the only complete source for a Service with more than
    /// 1,000 endpoints.
    Slices(&'static str),
    Endpoints,
}

/// What the API's discovery said about `discovery.k8s.io`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) struct SlicesServed {
    pub(crate) v1: bool,
    pub(crate) v1beta1: bool,
}

/// The source for `setting` on an API that serves `served`, and a warning
/// when the setting cannot be met.
pub(crate) fn choose(
    setting: EndpointSetting,
    served: SlicesServed,
) -> (EndpointSource, Option<&'static str>) {
    match setting {
        EndpointSetting::Endpoints => (EndpointSource::Endpoints, None),
        EndpointSetting::Auto if served.v1 => (EndpointSource::Slices("v1"), None),
        EndpointSetting::Auto => (EndpointSource::Endpoints, None),
        EndpointSetting::EndpointSlices if served.v1 => (EndpointSource::Slices("v1"), None),
        EndpointSetting::EndpointSlices if served.v1beta1 => {
            (EndpointSource::Slices("v1beta1"), None)
        }
        EndpointSetting::EndpointSlices => (
            EndpointSource::Endpoints,
            Some(
                "--endpoint-source endpointslices, but the API serves no discovery.k8s.io EndpointSlices: reading Endpoints",
            ),
        ),
    }
}

/// Once the source is chosen, the one store that is fed.
#[derive(Clone)]
enum Chosen {
    Slices(Store<DynamicObject>),
    Endpoints(Store<Endpoints>),
}

/// The endpoints cache; which source it reads is known once the API's
/// discovery has answered.
#[derive(Clone)]
pub(crate) struct EndpointCache {
    chosen: tokio::sync::watch::Receiver<Option<Chosen>>,
    generation: super::watches::Generation,
}

impl EndpointCache {
    /// Waits for the source to be chosen and its first complete list.
    pub(crate) async fn ready(&self) -> bool {
        let mut chosen = self.chosen.clone();
        let Ok(store) = chosen.wait_for(Option::is_some).await.map(|c| c.clone()) else {
            return false;
        };
        match store {
            Some(Chosen::Slices(s)) => s.wait_until_ready().await.is_ok(),
            Some(Chosen::Endpoints(s)) => s.wait_until_ready().await.is_ok(),
            None => false,
        }
    }

    /// Changes whenever what [`EndpointCache::ready_nodes`] says may
    /// change.
    pub(crate) fn generation(&self) -> u64 {
        self.generation.get()
    }

    /// Every Service's nodes with a ready endpoint.
    pub(crate) fn ready_nodes(&self) -> HashMap<ServiceKey, BTreeSet<String>> {
        let mut by_service: HashMap<ServiceKey, BTreeSet<String>> = HashMap::new();
        match &*self.chosen.borrow() {
            // A Service's endpoints may be spread over several slices.
            Some(Chosen::Slices(store)) => {
                for slice in store.state() {
                    if let Some((key, nodes)) = slice_nodes(&slice) {
                        by_service.entry(key).or_default().extend(nodes);
                    }
                }
            }
            Some(Chosen::Endpoints(store)) => {
                for e in store.state() {
                    if let Some(key) = key_of(&e.metadata) {
                        by_service.insert(key, endpoint_nodes(&e));
                    }
                }
            }
            None => {}
        }
        by_service
    }
}

fn key_of(meta: &kube::api::ObjectMeta) -> Option<ServiceKey> {
    Some(ServiceKey {
        namespace: meta.namespace.clone()?,
        name: meta.name.clone()?,
    })
}

/// Asks the API's discovery what it serves (retrying with backoff while it
/// cannot answer), chooses, then watches the chosen source.
pub(crate) fn watch(
    tasks: &mut tokio::task::JoinSet<()>,
    client: &kube::Client,
    setting: EndpointSetting,
    changed: Arc<Notify>,
    on_error: Arc<dyn Fn(String) + Send + Sync>,
) -> EndpointCache {
    let (chosen_tx, chosen) = tokio::sync::watch::channel(None);
    let generation = super::watches::Generation::default();
    let counted = generation.clone();
    let client = client.clone();
    tasks.spawn(async move {
        let mut wait = Duration::from_millis(500);
        let served = loop {
            match slices_served(&client).await {
                Ok(served) => break served,
                Err(e) => {
                    on_error(format!(
                        "asking the API which EndpointSlice versions it serves: {e}"
                    ));
                    tokio::time::sleep(wait).await;
                    wait = (wait * 2).min(Duration::from_secs(30));
                }
            }
        };
        let (source, warning) = choose(setting, served);
        if let Some(w) = warning {
            tracing::warn!("{w}");
        }
        tracing::info!(
            ?source,
            "externalTrafficPolicy: Local reads ready endpoints from this source"
        );
        let mut inner = tokio::task::JoinSet::new();
        let store = match source {
            EndpointSource::Slices(version) => {
                let ar = slice_resource(version);
                let writer = reflector::store::Writer::<DynamicObject>::new(ar.clone());
                let store = writer.as_reader();
                super::watches::spawn_watch(
                    &mut inner,
                    "EndpointSlices",
                    writer,
                    Api::all_with(client, &ar),
                    strip_slice,
                    super::watches::Changed {
                        generation: counted,
                        wake: changed,
                    },
                    on_error,
                );
                Chosen::Slices(store)
            }
            EndpointSource::Endpoints => {
                let (store, writer) = reflector::store::<Endpoints>();
                super::watches::spawn_watch(
                    &mut inner,
                    "Endpoints",
                    writer,
                    Api::all(client),
                    strip_endpoints,
                    super::watches::Changed {
                        generation: counted,
                        wake: changed,
                    },
                    on_error,
                );
                Chosen::Endpoints(store)
            }
        };
        let _ = chosen_tx.send(Some(store));
        // Dropping `inner` would abort the watch.
        while inner.join_next().await.is_some() {}
    });
    EndpointCache { chosen, generation }
}

async fn slices_served(client: &kube::Client) -> Result<SlicesServed, kube::Error> {
    let mut served = SlicesServed::default();
    for (version, flag) in [("v1", &mut served.v1), ("v1beta1", &mut served.v1beta1)] {
        *flag = match client
            .list_api_group_resources(&format!("discovery.k8s.io/{version}"))
            .await
        {
            Ok(list) => list.resources.iter().any(|r| r.name == "endpointslices"),
            Err(kube::Error::Api(e)) if e.code == 404 => false,
            Err(e) => return Err(e),
        };
    }
    Ok(served)
}

fn slice_resource(version: &str) -> ApiResource {
    ApiResource {
        group: "discovery.k8s.io".into(),
        version: version.into(),
        api_version: format!("discovery.k8s.io/{version}"),
        kind: "EndpointSlice".into(),
        plural: "endpointslices".into(),
    }
}

/// An Endpoints object as the decision reads it: which nodes have a ready
/// endpoint (`subsets[].addresses[].nodeName`); the rest (addresses,
/// ports, not-ready addresses) is dropped from the cache.
fn strip_endpoints(e: &mut Endpoints) {
    e.metadata.annotations = None;
    e.metadata.labels = None;
    for s in e.subsets.iter_mut().flatten() {
        s.ports = None;
        s.not_ready_addresses = None;
        for a in s.addresses.iter_mut().flatten() {
            a.ip = String::new();
            a.hostname = None;
            a.target_ref = None;
        }
    }
}

/// The nodes with a ready endpoint in `e`.
pub(crate) fn endpoint_nodes(e: &Endpoints) -> BTreeSet<String> {
    e.subsets
        .iter()
        .flatten()
        .flat_map(|s| s.addresses.iter().flatten())
        .filter_map(|a| a.node_name.clone())
        .collect()
}

/// The label that names an EndpointSlice's Service.
const SERVICE_NAME_LABEL: &str = "kubernetes.io/service-name";
/// Where a `v1beta1` slice names an endpoint's node when it has no
/// `nodeName` (Kubernetes 1.17 to 1.20 fill only this).
const HOSTNAME_TOPOLOGY: &str = "kubernetes.io/hostname";

/// One endpoint of a slice, in either version, as far as it is read.
#[derive(Debug, Default, Deserialize, Serialize)]
#[serde(rename_all = "camelCase")]
struct SliceEndpoint {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    node_name: Option<String>,
    #[serde(default, skip_serializing)]
    topology: Option<std::collections::BTreeMap<String, String>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    conditions: Option<SliceConditions>,
}

#[derive(Debug, Default, Deserialize, Serialize)]
struct SliceConditions {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    ready: Option<bool>,
}

#[derive(Debug, Default, Deserialize, Serialize)]
struct SliceBody {
    #[serde(default)]
    endpoints: Vec<SliceEndpoint>,
}

impl SliceEndpoint {
    fn node(&self) -> Option<&String> {
        self.node_name
            .as_ref()
            .or_else(|| self.topology.as_ref()?.get(HOSTNAME_TOPOLOGY))
    }

    /// `conditions.ready` unset counts as ready, as the API says.
    fn ready(&self) -> bool {
        self.conditions.as_ref().and_then(|c| c.ready) != Some(false)
    }
}

/// An EndpointSlice as the decision reads it: its Service's name label and
/// each endpoint's node and readiness (the node taken from `topology` where
/// a `v1beta1` slice has no `nodeName`). A slice this cannot read keeps no
/// endpoints.
fn strip_slice(s: &mut DynamicObject) {
    s.metadata.annotations = None;
    if let Some(labels) = &mut s.metadata.labels {
        labels.retain(|k, _| k == SERVICE_NAME_LABEL);
    }
    let body: SliceBody = serde_json::from_value(s.data.take()).unwrap_or_default();
    let slim = SliceBody {
        endpoints: body
            .endpoints
            .into_iter()
            .map(|e| SliceEndpoint {
                node_name: e.node().cloned(),
                topology: None,
                conditions: e.conditions,
            })
            .collect(),
    };
    s.data = serde_json::to_value(slim).unwrap_or_default();
}

/// The Service an EndpointSlice belongs to and its nodes with a ready
/// endpoint.
pub(crate) fn slice_nodes(s: &DynamicObject) -> Option<(ServiceKey, BTreeSet<String>)> {
    let key = ServiceKey {
        namespace: s.metadata.namespace.clone()?,
        name: s.metadata.labels.as_ref()?.get(SERVICE_NAME_LABEL)?.clone(),
    };
    let body = SliceBody::deserialize(&s.data).unwrap_or_default();
    let nodes = body
        .endpoints
        .iter()
        .filter(|e| e.ready())
        .filter_map(|e| e.node().cloned())
        .collect();
    Some((key, nodes))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn slice(json: serde_json::Value) -> DynamicObject {
        serde_json::from_value(json).expect("an EndpointSlice")
    }

    fn names(list: &[&str]) -> BTreeSet<String> {
        list.iter().map(|s| s.to_string()).collect()
    }

    fn shop_web() -> ServiceKey {
        ServiceKey {
            namespace: "shop".into(),
            name: "web".into(),
        }
    }

    #[test]
    fn a_v1_slice_names_its_service_and_its_ready_nodes() {
        let s = slice(serde_json::json!({
            "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
            "metadata": {"name": "web-abcde", "namespace": "shop",
                         "labels": {"kubernetes.io/service-name": "web", "other": "x"}},
            "addressType": "IPv4",
            "endpoints": [
                {"addresses": ["10.0.0.1"], "nodeName": "ready", "conditions": {"ready": true}},
                {"addresses": ["10.0.0.2"], "nodeName": "unknown-counts-as-ready"},
                {"addresses": ["10.0.0.3"], "nodeName": "not-ready", "conditions": {"ready": false}},
                {"addresses": ["10.0.0.4"], "conditions": {"ready": true}},
            ],
        }));
        let (key, nodes) = slice_nodes(&s).expect("a Service");
        assert_eq!(key, shop_web());
        assert_eq!(nodes, names(&["ready", "unknown-counts-as-ready"]));
    }

    #[test]
    fn a_v1beta1_slice_names_its_nodes_by_topology_where_it_has_no_node_name() {
        let s = slice(serde_json::json!({
            "apiVersion": "discovery.k8s.io/v1beta1", "kind": "EndpointSlice",
            "metadata": {"name": "web-abcde", "namespace": "shop",
                         "labels": {"kubernetes.io/service-name": "web"}},
            "addressType": "IPv4",
            "endpoints": [
                {"addresses": ["10.0.0.1"], "topology": {"kubernetes.io/hostname": "a", "topology.kubernetes.io/zone": "z"}},
                {"addresses": ["10.0.0.2"], "nodeName": "b", "topology": {"kubernetes.io/hostname": "b-host"}},
                {"addresses": ["10.0.0.3"], "topology": {"kubernetes.io/hostname": "c"}, "conditions": {"ready": false}},
            ],
        }));
        assert_eq!(slice_nodes(&s), Some((shop_web(), names(&["a", "b"]))));
    }

    #[test]
    fn a_slice_without_the_service_label_belongs_to_no_service() {
        let s = slice(serde_json::json!({
            "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
            "metadata": {"name": "hand-made", "namespace": "shop"},
            "addressType": "IPv4",
            "endpoints": [{"addresses": ["10.0.0.1"], "nodeName": "a"}],
        }));
        assert_eq!(slice_nodes(&s), None);
    }

    #[test]
    fn stripping_a_slice_keeps_what_the_decision_reads() {
        for version in ["v1", "v1beta1"] {
            let mut s = slice(serde_json::json!({
                "apiVersion": format!("discovery.k8s.io/{version}"), "kind": "EndpointSlice",
                "metadata": {"name": "web-abcde", "namespace": "shop",
                             "annotations": {"a": "b"},
                             "labels": {"kubernetes.io/service-name": "web", "other": "x"}},
                "addressType": "IPv4",
                "ports": [{"port": 80}],
                "endpoints": [
                    {"addresses": ["10.0.0.1"], "nodeName": "a", "zone": "z",
                     "targetRef": {"kind": "Pod", "name": "p"}},
                    {"addresses": ["10.0.0.2"], "topology": {"kubernetes.io/hostname": "t"}},
                    {"addresses": ["10.0.0.3"], "nodeName": "b", "conditions": {"ready": false}},
                ],
            }));
            let before = slice_nodes(&s);
            assert_eq!(before, Some((shop_web(), names(&["a", "t"]))));
            strip_slice(&mut s);
            assert_eq!(slice_nodes(&s), before, "{version}");
            assert_eq!(s.metadata.labels.as_ref().map(|l| l.len()), Some(1));
            assert_eq!(
                s.data,
                serde_json::json!({"endpoints": [
                    {"nodeName": "a"}, {"nodeName": "t"},
                    {"nodeName": "b", "conditions": {"ready": false}},
                ]})
            );
        }
    }

    #[test]
    fn a_slice_of_an_unexpected_shape_has_no_endpoints_and_no_panic() {
        let mut s = slice(serde_json::json!({
            "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
            "metadata": {"name": "odd", "namespace": "shop",
                         "labels": {"kubernetes.io/service-name": "web"}},
            "endpoints": "not a list",
        }));
        assert_eq!(slice_nodes(&s), Some((shop_web(), BTreeSet::new())));
        strip_slice(&mut s);
        assert_eq!(slice_nodes(&s), Some((shop_web(), BTreeSet::new())));
    }

    #[test]
    fn endpoints_name_their_ready_nodes_only() {
        let mut e: Endpoints = serde_json::from_value(serde_json::json!({
            "metadata": {"name": "web", "namespace": "shop"},
            "subsets": [
                {"addresses": [{"ip": "10.0.0.1", "nodeName": "a"}, {"ip": "10.0.0.2"}],
                 "notReadyAddresses": [{"ip": "10.0.0.3", "nodeName": "c"}]},
                {"addresses": [{"ip": "10.0.0.4", "nodeName": "b"}]},
            ],
        }))
        .expect("Endpoints");
        assert_eq!(endpoint_nodes(&e), names(&["a", "b"]));
        strip_endpoints(&mut e);
        assert_eq!(endpoint_nodes(&e), names(&["a", "b"]));
    }

    #[test]
    fn the_source_follows_the_setting_and_what_the_api_serves() {
        use EndpointSetting::{Auto, EndpointSlices};
        use EndpointSource::Slices;
        let api = |v1, v1beta1| SlicesServed { v1, v1beta1 };
        let read_endpoints = EndpointSource::Endpoints;
        let cases = [
            (Auto, api(true, false), Slices("v1"), false),
            (Auto, api(true, true), Slices("v1"), false),
            // Kubernetes 1.17 to 1.20: Endpoints unless asked.
            (Auto, api(false, true), read_endpoints, false),
            (Auto, api(false, false), read_endpoints, false),
            (
                EndpointSetting::Endpoints,
                api(true, true),
                read_endpoints,
                false,
            ),
            (EndpointSlices, api(true, true), Slices("v1"), false),
            (EndpointSlices, api(false, true), Slices("v1beta1"), false),
            (EndpointSlices, api(false, false), read_endpoints, true),
        ];
        for (setting, served, source, warns) in cases {
            let (got, warning) = choose(setting, served);
            assert_eq!(got, source, "{setting:?} on {served:?}");
            assert_eq!(warning.is_some(), warns, "{setting:?} on {served:?}");
        }
    }

    #[test]
    fn the_setting_parses_its_documented_names_only() {
        for name in EndpointSetting::NAMES {
            assert!(EndpointSetting::parse(name).is_ok(), "{name}");
        }
        let err = EndpointSetting::parse("slices").unwrap_err().to_string();
        assert!(err.contains("auto, endpoints, endpointslices"), "{err}");
    }
}
