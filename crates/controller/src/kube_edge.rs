//! The API edge: Kubernetes objects to the reconcile core's plain data, the
//! core's requests to API calls, and the watch caches.

use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt as _;
use k8s_openapi::api::core::v1::{
    ConfigMap, Node, ObjectReference, Service, ServicePort, ServiceSpec, ServiceStatus,
};
use k8s_openapi::api::rbac::v1::{Role, RoleBinding};
use kube::api::{Api, ApiResource, DeleteParams, DynamicObject, Patch, PatchParams, PostParams};
use kube::runtime::events::{Event as KubeEvent, EventType as KubeEventType, Recorder, Reporter};
use kube::runtime::reflector::{self, Store};
use kube::runtime::{WatchStreamExt as _, watcher};
use tokio::sync::Notify;

use crate::endpoints::{self, EndpointCache, EndpointSetting};
use crate::networks::{self, NetworkMap};
use crate::reconcile::{EventOut, EventType, Ingress, NodeIn, Port, ServiceIn};
use crate::watches::{Changed, Generation, spawn_watch, watch_config};
use crate::writer::{
    EventError, FIELD_MANAGER, Kind, PatchKind, Request, Requests, SendError, Verb,
};
use hna_contract::node_object::{self, LoadBalancerNode};
use hna_contract::{self, ServiceKey};

/// How long one write may take.
const WRITE_TIMEOUT: Duration = Duration::from_secs(10);

/// `kubectl apply`'s copy of the whole object: never read.
const LAST_APPLIED: &str = "kubectl.kubernetes.io/last-applied-configuration";

pub(crate) fn service_in(s: &Service) -> Option<ServiceIn> {
    let meta = &s.metadata;
    let spec = s.spec.as_ref();
    Some(ServiceIn {
        key: ServiceKey {
            namespace: meta.namespace.clone()?,
            name: meta.name.clone()?,
        },
        uid: meta.uid.clone().unwrap_or_default(),
        type_: spec
            .and_then(|s| s.type_.clone())
            .unwrap_or_else(|| "ClusterIP".into()),
        load_balancer_class: spec.and_then(|s| s.load_balancer_class.clone()),
        ip_families: spec.and_then(|s| s.ip_families.clone()).unwrap_or_default(),
        cluster_ips: spec.and_then(|s| s.cluster_ips.clone()).unwrap_or_default(),
        // Filled in from the Endpoints by the caller (`world_from`).
        local_endpoints: (spec.and_then(|s| s.external_traffic_policy.as_deref()) == Some("Local"))
            .then(Default::default),
        annotations: meta
            .annotations
            .iter()
            .flatten()
            .filter(|(k, _)| k.as_str() != LAST_APPLIED)
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect(),
        ports: spec.map(ports_in).unwrap_or_default(),
        created: meta
            .creation_timestamp
            .as_ref()
            .map_or(0, |t| t.0.as_second()),
        generation: meta.generation.unwrap_or(0),
        assigned_for: s
            .status
            .as_ref()
            .and_then(|st| st.conditions.as_ref())
            .and_then(|c| {
                c.iter()
                    .find(|c| c.type_ == hna_contract::SERVICE_CONDITION)
            })
            .filter(|c| c.status == "True")
            .map(|c| c.observed_generation.unwrap_or(0)),
        ingress: s.status.as_ref().map(ingress_in).unwrap_or_default(),
        finalizers: meta.finalizers.clone().unwrap_or_default(),
        deleting: meta.deletion_timestamp.is_some(),
        deleting_since: meta
            .deletion_timestamp
            .as_ref()
            .map_or(0, |t| t.0.as_second()),
    })
}

/// A Service's ports as the decision reads them (TCP when unsaid).
fn ports_in(spec: &ServiceSpec) -> Vec<Port> {
    spec.ports
        .iter()
        .flatten()
        .map(|p| Port {
            port: p.port,
            protocol: p.protocol.clone().unwrap_or_else(|| "TCP".into()),
        })
        .collect()
}

/// A Service's published load-balancer ingress, the entries with an IP.
fn ingress_in(status: &ServiceStatus) -> Vec<Ingress> {
    let Some(list) = status
        .load_balancer
        .as_ref()
        .and_then(|lb| lb.ingress.as_ref())
    else {
        return Vec::new();
    };
    list.iter()
        .filter_map(|i| {
            Some(Ingress {
                ip: i.ip.clone()?,
                ip_mode: i.ip_mode.clone(),
                ports: i
                    .ports
                    .iter()
                    .flatten()
                    .map(|p| Port {
                        port: p.port,
                        protocol: p.protocol.clone(),
                    })
                    .collect(),
            })
        })
        .collect()
}

/// What of a Service the watch cache keeps: what [`service_in`] and the
/// deletion clock read, nothing else. Every Service of the cluster is
/// cached, most of them not ours; selectors, labels, node ports and
/// `kubectl apply`'s copy of the whole object are never read.
pub(crate) fn strip_service(s: &mut Service) {
    let m = &mut s.metadata;
    m.labels = None;
    m.owner_references = None;
    m.generate_name = None;
    if let Some(a) = &mut m.annotations {
        a.remove(LAST_APPLIED);
    }
    if let Some(spec) = &mut s.spec {
        *spec = ServiceSpec {
            type_: spec.type_.take(),
            load_balancer_class: spec.load_balancer_class.take(),
            ip_families: spec.ip_families.take(),
            cluster_ips: spec.cluster_ips.take(),
            external_traffic_policy: spec.external_traffic_policy.take(),
            ports: spec.ports.take().map(|ports| {
                ports
                    .into_iter()
                    .map(|p| ServicePort {
                        port: p.port,
                        protocol: p.protocol,
                        ..Default::default()
                    })
                    .collect()
            }),
            ..Default::default()
        };
    }
    // Ours is read (`ServiceIn::assigned_for`); the rest never is.
    if let Some(status) = &mut s.status {
        status.conditions = status
            .conditions
            .take()
            .map(|c| {
                c.into_iter()
                    .filter(|c| c.type_ == hna_contract::SERVICE_CONDITION)
                    .collect::<Vec<_>>()
            })
            .filter(|c| !c.is_empty());
    }
}

pub(crate) fn node_in(o: &LoadBalancerNode, eligible: bool) -> Option<NodeIn> {
    Some(NodeIn {
        name: o.metadata.name.clone()?,
        spec: o.spec.clone(),
        status: o.status.clone().unwrap_or_default(),
        eligible,
        keep_only: false,
        unproven: false,
        lets_go_first: false,
        generation: o.metadata.generation,
    })
}

/// Writes through the API server, Events through the Events API.
pub struct KubeApi {
    client: kube::Client,
    reporter: Reporter,
}

impl KubeApi {
    pub fn new(client: kube::Client, identity: &str) -> KubeApi {
        let reporter = Reporter {
            controller: FIELD_MANAGER.into(),
            instance: Some(identity.to_string()),
        };
        KubeApi { client, reporter }
    }

    /// Makes the LAN membership's key (the Secret
    /// `hna_contract::membership::SECRET_NAME`: 32 random bytes) unless it
    /// exists; `true` when this call made it. Never rewrites one: a new key
    /// would cut every node off the others until each has read it.
    pub(crate) async fn ensure_membership_key(&self, namespace: &str) -> Result<bool, kube::Error> {
        use hna_contract::membership::{SECRET_KEY, SECRET_NAME};
        use k8s_openapi::api::core::v1::Secret;
        use ring::rand::SecureRandom;
        let api: Api<Secret> = Api::namespaced(self.client.clone(), namespace);
        if api.get_opt(SECRET_NAME).await?.is_some() {
            return Ok(false);
        }
        let mut key = [0u8; 32];
        ring::rand::SystemRandom::new()
            .fill(&mut key)
            .map_err(|_| kube::Error::Service("the system's random source failed".into()))?;
        let secret = Secret {
            metadata: kube::api::ObjectMeta {
                name: Some(SECRET_NAME.into()),
                namespace: Some(namespace.into()),
                labels: Some(
                    [(
                        "app.kubernetes.io/managed-by".to_string(),
                        FIELD_MANAGER.to_string(),
                    )]
                    .into(),
                ),
                ..Default::default()
            },
            data: Some(
                [(
                    SECRET_KEY.to_string(),
                    k8s_openapi::ByteString(key.to_vec()),
                )]
                .into(),
            ),
            ..Default::default()
        };
        match api.create(&kube::api::PostParams::default(), &secret).await {
            Ok(_) => Ok(true),
            // Another replica was first.
            Err(kube::Error::Api(s)) if s.code == 409 => Ok(false),
            Err(e) => Err(e),
        }
    }

    /// Whether the API server keeps `status.loadBalancer.ingress[].ipMode`:
    /// Kubernetes 1.30 and later (the `LoadBalancerIPMode` gate, beta and
    /// on from 1.30, GA in 1.32). An older server drops the field, and
    /// writing it there would make every pass see a difference. `None`
    /// when `/version` cannot be read.
    pub(crate) async fn knows_ip_mode(&self) -> Option<bool> {
        let info = self.client.apiserver_version().await.ok()?;
        let minor: u32 = info
            .minor
            .trim_end_matches(|c: char| !c.is_ascii_digit())
            .parse()
            .ok()?;
        Some(info.major == "1" && minor >= 30)
    }

    fn api(&self, kind: Kind, namespace: &str) -> Api<DynamicObject> {
        let ar = match kind {
            Kind::Service => ApiResource::erase::<Service>(&()),
            Kind::Role => ApiResource::erase::<Role>(&()),
            Kind::RoleBinding => ApiResource::erase::<RoleBinding>(&()),
            Kind::LoadBalancerNode => node_object::api_resource(),
        };
        Api::namespaced_with(self.client.clone(), namespace, &ar)
    }

    async fn send_now(
        &self,
        r: &Request,
        precondition: Option<&str>,
    ) -> Result<Option<String>, kube::Error> {
        let api = self.api(r.kind, &r.namespace);
        match &r.verb {
            Verb::Create(body) => {
                let obj: DynamicObject =
                    serde_json::from_value(body.clone()).map_err(kube::Error::SerdeError)?;
                match api.create(&PostParams::default(), &obj).await {
                    Err(kube::Error::Api(e)) if e.code == 409 => Ok(None),
                    other => other.map(|o| o.metadata.resource_version),
                }
            }
            Verb::Patch(PatchKind::Merge, body)
                if r.kind == Kind::LoadBalancerNode && r.subresource.is_none() =>
            {
                // A node object's spec is guarded by its generation, which
                // only a spec write moves: its status, written by the node
                // with every change and heartbeat, moved the
                // resourceVersion under nine spec writes in ten at 500
                // nodes (the scale bench), each a 409 and a new pass.
                let Some(generation) = precondition.and_then(generation_of) else {
                    return api
                        .patch(&r.name, &PatchParams::default(), &Patch::Merge(body))
                        .await
                        .map(|o| o.metadata.generation.map(generation_token));
                };
                let ops: json_patch::Patch =
                    serde_json::from_value(generation_guarded(body, generation))
                        .map_err(kube::Error::SerdeError)?;
                api.patch(&r.name, &PatchParams::default(), &Patch::Json::<()>(ops))
                    .await
                    .map(|o| o.metadata.generation.map(generation_token))
            }
            Verb::Patch(kind, body) => {
                // A resourceVersion in a merge or strategic-merge patch is a
                // precondition: the server answers 409 if it changed.
                let mut body = body.clone();
                if let (Some(v), Some(obj)) = (precondition, body.as_object_mut()) {
                    let meta = obj
                        .entry("metadata")
                        .or_insert_with(|| serde_json::json!({}));
                    if let Some(meta) = meta.as_object_mut() {
                        meta.insert("resourceVersion".into(), v.into());
                    }
                }
                let (pp, patch) = match kind {
                    PatchKind::Merge => (PatchParams::default(), Patch::Merge(&body)),
                    PatchKind::Strategic => (PatchParams::default(), Patch::Strategic(&body)),
                    PatchKind::Apply => (
                        PatchParams::apply(FIELD_MANAGER).force(),
                        Patch::Apply(&body),
                    ),
                };
                match r.subresource {
                    Some(sub) => api
                        .patch_subresource(sub, &r.name, &pp, &patch)
                        .await
                        .map(|o| o.metadata.resource_version),
                    None => api
                        .patch(&r.name, &pp, &patch)
                        .await
                        .map(|o| o.metadata.resource_version),
                }
            }
            Verb::Delete => match api.delete(&r.name, &DeleteParams::default()).await {
                Err(kube::Error::Api(e)) if e.code == 404 => Ok(None),
                other => other.map(|_| None),
            },
        }
    }
}

/// A node object's version for the writer: `g<generation>` (see
/// `generation_guarded`).
pub fn generation_token(generation: i64) -> String {
    format!("g{generation}")
}

fn generation_of(token: &str) -> Option<i64> {
    token.strip_prefix('g')?.parse().ok()
}

/// A merge patch of `{"spec": {...}}` as a JSON patch whose first operation
/// tests `metadata.generation`: the write lands only on the spec it was
/// decided on, whatever the status did meanwhile. Each key of `spec` is
/// replaced whole (`add` replaces a member that is there), as the merge
/// patch of a list did.
pub(crate) fn generation_guarded(merge: &serde_json::Value, generation: i64) -> serde_json::Value {
    let mut ops = vec![serde_json::json!({
        "op": "test", "path": "/metadata/generation", "value": generation,
    })];
    if let Some(top) = merge.as_object() {
        for (section, fields) in top {
            for (k, v) in fields.as_object().into_iter().flatten() {
                ops.push(serde_json::json!({
                    "op": "add",
                    "path": format!("/{section}/{}", k.replace('~', "~0").replace('/', "~1")),
                    "value": v,
                }));
            }
        }
    }
    serde_json::Value::Array(ops)
}

/// The object changed since the write was decided: a 409 (resourceVersion
/// precondition), or the 422 the API server answers when a JSON patch's
/// `test` fails (reason `Invalid` with no field causes; a patch the schema
/// refuses names its fields).
fn is_conflict(e: &kube::Error) -> bool {
    match e {
        kube::Error::Api(a) if a.code == 409 => true,
        kube::Error::Api(a) if a.code == 422 => {
            a.reason == "Invalid" && a.details.as_ref().is_none_or(|d| d.causes.is_empty())
        }
        _ => false,
    }
}

impl Requests for KubeApi {
    async fn send(
        &self,
        r: &Request,
        precondition: Option<&str>,
    ) -> Result<Option<String>, SendError> {
        match tokio::time::timeout(WRITE_TIMEOUT, self.send_now(r, precondition)).await {
            Ok(result) => result.map_err(|e| SendError {
                conflict: is_conflict(&e),
                message: e.to_string(),
            }),
            Err(_) => Err(SendError::from(
                format!("timed out after {WRITE_TIMEOUT:?}").as_str(),
            )),
        }
    }

    async fn event(&self, e: &EventOut) -> Result<(), EventError> {
        let ev = KubeEvent {
            type_: match e.type_ {
                EventType::Normal => KubeEventType::Normal,
                EventType::Warning => KubeEventType::Warning,
            },
            reason: e.reason.to_string(),
            note: Some(e.message.chars().take(1000).collect()),
            action: e.reason.to_string(),
            secondary: None,
        };
        let regarding = ObjectReference {
            api_version: Some("v1".into()),
            kind: Some("Service".into()),
            namespace: Some(e.service.namespace.clone()),
            name: Some(e.service.name.clone()),
            uid: Some(e.uid.clone()),
            ..Default::default()
        };
        // A fresh recorder per Event: kube's recorder folds Events with the
        // same reason into one series and keeps the first message, and
        // ours differ in the message (deduplication is the writer's).
        let recorder = Recorder::new(self.client.clone(), self.reporter.clone());
        match tokio::time::timeout(WRITE_TIMEOUT, recorder.publish(&ev, &regarding)).await {
            Ok(result) => result.map_err(EventError::from),
            Err(_) => Err(EventError::TimedOut(WRITE_TIMEOUT)),
        }
    }
}

/// The watch caches the controller decides from.
#[derive(Clone)]
pub(crate) struct Caches {
    pub(crate) services: Store<Service>,
    pub(crate) services_generation: Generation,
    pub(crate) nodes: Store<Node>,
    pub(crate) nodes_generation: Generation,
    pub(crate) node_objects: Store<LoadBalancerNode>,
    /// Whether the node objects' cache is current (see
    /// [`Generation::current`]): service health does not age a view that
    /// stopped moving.
    pub(crate) node_objects_generation: Generation,
    /// The node agents' liveness, fed by the node objects' watch as each
    /// heartbeat arrives.
    pub(crate) alive: Arc<std::sync::Mutex<super::liveness::Liveness>>,
    /// For `externalTrafficPolicy: Local`: which nodes have a ready
    /// endpoint of a Service.
    pub(crate) endpoints: EndpointCache,
    /// Not part of [`Caches::ready`]: a cluster without the ConfigMap, or
    /// manifests without the right to read it, must not stop the rest.
    pub(crate) networks: Arc<std::sync::Mutex<NetworkMap>>,
}

impl Caches {
    /// Waits until every cache holds a complete first list: deciding from a
    /// partial view would take addresses from Services not yet seen.
    pub(crate) async fn ready(&self) -> bool {
        self.services.wait_until_ready().await.is_ok()
            && self.nodes.wait_until_ready().await.is_ok()
            && self.node_objects.wait_until_ready().await.is_ok()
            && self.endpoints.ready().await
    }
}

/// Starts the watches in `tasks`; `changed` is notified on every change,
/// `on_error` hears of watch errors (they are retried with backoff).
/// Every node object's heartbeat is given to `alive` the moment the watch
/// delivers it, so liveness is judged on when heartbeats arrive, not on
/// when a reconcile pass happens to run (a pass may wait behind slow or
/// failing writes).
pub(crate) fn watch_all(
    client: &kube::Client,
    namespace: &str,
    endpoint_setting: EndpointSetting,
    alive: super::liveness::Liveness,
    changed: Arc<Notify>,
    on_error: Arc<dyn Fn(String) + Send + Sync>,
    tasks: &mut tokio::task::JoinSet<()>,
) -> Caches {
    let (services, w) = reflector::store::<Service>();
    let services_generation = Generation::default();
    spawn_watch(
        tasks,
        "Services",
        w,
        Api::all(client.clone()),
        strip_service,
        Changed {
            generation: services_generation.clone(),
            wake: changed.clone(),
        },
        on_error.clone(),
    );
    let (nodes, w) = reflector::store::<Node>();
    let nodes_generation = Generation::default();
    spawn_watch(
        tasks,
        "Nodes",
        w,
        Api::all(client.clone()),
        // Only the names, addresses and Pod CIDRs are read.
        |n| {
            let pod_cidrs = n.spec.as_ref().and_then(|s| s.pod_cidrs.clone());
            let addresses = n.status.as_ref().and_then(|s| s.addresses.clone());
            n.spec = Some(k8s_openapi::api::core::v1::NodeSpec {
                pod_cidrs,
                ..Default::default()
            });
            n.status = Some(k8s_openapi::api::core::v1::NodeStatus {
                addresses,
                ..Default::default()
            });
            n.metadata.annotations = None;
            n.metadata.labels = None;
        },
        Changed {
            generation: nodes_generation.clone(),
            wake: changed.clone(),
        },
        on_error.clone(),
    );
    let endpoints = endpoints::watch(
        tasks,
        client,
        endpoint_setting,
        changed.clone(),
        on_error.clone(),
    );
    let alive = Arc::new(std::sync::Mutex::new(alive));
    let observer = alive.clone();
    let ar = node_object::api_resource();
    let w = reflector::store::Writer::<LoadBalancerNode>::new(ar.clone());
    let node_objects = w.as_reader();
    let node_objects_generation = Generation::default();
    spawn_watch(
        tasks,
        "LoadBalancerNodes",
        w,
        Api::namespaced_with(client.clone(), namespace, &ar),
        move |o: &mut LoadBalancerNode| {
            if let Some(name) = &o.metadata.name {
                let status = o.status.as_ref();
                let heartbeat = status.and_then(|s| s.heartbeat.as_deref());
                tracing::debug!(
                    node = %name,
                    heartbeat = ?heartbeat,
                    ready = ?status.map(|s| s.ready),
                    lan_down = ?status.and_then(|s| s.lan.as_ref()).map(|l| &l.down),
                    unheard = status.and_then(|s| s.lan.as_ref()).is_some_and(|l| l.unheard),
                    held = ?status.map(|s| s.held),
                    "node object seen"
                );
                let beat = super::liveness::Beat {
                    grace: status
                        .and_then(|s| s.restart_grace_ms)
                        .map(|ms| Duration::from_millis(ms.min(node_object::MAX_RESTART_GRACE_MS))),
                    period: status
                        .and_then(|s| s.heartbeat_period_ms)
                        .map(Duration::from_millis),
                };
                observer.lock().expect("liveness lock").observe_status(
                    name,
                    heartbeat,
                    beat,
                    tokio::time::Instant::now(),
                );
            }
        },
        Changed {
            generation: node_objects_generation.clone(),
            wake: changed.clone(),
        },
        on_error.clone(),
    );
    let networks = Arc::new(std::sync::Mutex::new(NetworkMap::Unknown));
    spawn_network_map_watch(tasks, client, networks.clone(), changed, on_error);
    Caches {
        services,
        services_generation,
        nodes,
        nodes_generation,
        node_objects,
        node_objects_generation,
        alive,
        endpoints,
        networks,
    }
}

/// Keeps `state` at what `kube-system/harvester-nad-mapping` says.
fn spawn_network_map_watch(
    tasks: &mut tokio::task::JoinSet<()>,
    client: &kube::Client,
    state: Arc<std::sync::Mutex<NetworkMap>>,
    changed: Arc<Notify>,
    on_error: Arc<dyn Fn(String) + Send + Sync>,
) {
    let api: Api<ConfigMap> = Api::namespaced(client.clone(), networks::CONFIG_MAP_NAMESPACE);
    // By name, so that the Role may name the one ConfigMap it grants.
    let config = watch_config().fields(&format!("metadata.name={}", networks::CONFIG_MAP_NAME));
    let stream =
        watcher(api, config).backoff(hna_edges::cluster::watch_one::ShortBackoff::default());
    let of = |cm: &ConfigMap| {
        NetworkMap::parse(
            cm.data
                .as_ref()
                .and_then(|d| d.get(networks::CONFIG_MAP_KEY))
                .map(String::as_str),
        )
    };
    tasks.spawn(async move {
        let mut stream = std::pin::pin!(stream);
        let mut listed_one = false;
        while let Some(event) = stream.next().await {
            let next = match event {
                Ok(watcher::Event::Init) => {
                    listed_one = false;
                    continue;
                }
                Ok(watcher::Event::InitApply(cm) | watcher::Event::Apply(cm)) => {
                    listed_one = true;
                    of(&cm)
                }
                Ok(watcher::Event::InitDone) if listed_one => continue,
                Ok(watcher::Event::InitDone | watcher::Event::Delete(_)) => NetworkMap::Missing,
                Err(e) => {
                    let what = format!(
                        "watching {}/{}: {e}",
                        networks::CONFIG_MAP_NAMESPACE,
                        networks::CONFIG_MAP_NAME
                    );
                    on_error(what.clone());
                    // The API's answer (403, ...) is worth a refusal; a
                    // connection error before the first list is waited out.
                    let refused = matches!(
                        &e,
                        watcher::Error::InitialListFailed(kube::Error::Api(_))
                            | watcher::Error::WatchStartFailed(kube::Error::Api(_))
                    );
                    let never_read = matches!(
                        *state.lock().expect("network map lock"),
                        NetworkMap::Unknown | NetworkMap::Unreadable(_)
                    );
                    if !refused || !never_read {
                        continue;
                    }
                    NetworkMap::Unreadable(what)
                }
            };
            let mut s = state.lock().expect("network map lock");
            if *s != next {
                *s = next;
                changed.notify_one();
            }
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The cache keeps what the decision reads: a Service stripped reads
    /// the same, for a Service with everything a cluster may set.
    #[test]
    fn a_stripped_service_is_the_same_to_the_decision() {
        let full: Service = serde_json::from_value(serde_json::json!({
            "metadata": {
                "name": "web", "namespace": "shop", "uid": "u-1", "resourceVersion": "42",
                "creationTimestamp": "2026-11-27T10:00:00Z",
                "deletionTimestamp": "2026-11-27T11:00:00Z",
                "labels": {"app": "web"},
                "annotations": {
                    "cloudprovider.harvesterhci.io/ipam": "dhcp",
                    "kube-vip.io/hwaddr": "02:00:00:00:00:01",
                    "kubectl.kubernetes.io/last-applied-configuration": "{\"a\": \"very long copy\"}"
                },
                "finalizers": ["harvester-node-agent.io/dhcp-release"],
                "ownerReferences": [{"apiVersion": "v1", "kind": "X", "name": "x", "uid": "o"}]
            },
            "spec": {
                "type": "LoadBalancer", "loadBalancerClass": "x/y",
                "selector": {"app": "web"}, "clusterIP": "10.96.0.9", "clusterIPs": ["10.96.0.9"],
                "ipFamilies": ["IPv4"], "ipFamilyPolicy": "SingleStack",
                "externalTrafficPolicy": "Local", "healthCheckNodePort": 30001,
                "sessionAffinity": "None",
                "ports": [{"name": "http", "port": 80, "protocol": "UDP", "targetPort": 8080, "nodePort": 31000}]
            },
            "status": {
                "loadBalancer": {"ingress": [{"ip": "10.77.0.5", "ipMode": "VIP", "ports": [{"port": 80, "protocol": "UDP"}]}]},
                "conditions": [
                    {"type": "X", "status": "True", "lastTransitionTime": "2026-11-27T10:00:00Z", "reason": "R", "message": "m"},
                    {"type": "harvester-node-agent.io/AddressAssigned", "status": "True", "observedGeneration": 3,
                     "lastTransitionTime": "2026-11-27T10:00:00Z", "reason": "AddressAssigned", "message": "ours"}
                ]
            }
        }))
        .unwrap();
        let mut stripped = full.clone();
        strip_service(&mut stripped);
        assert_eq!(service_in(&stripped), service_in(&full));
        assert_eq!(service_in(&full).unwrap().assigned_for, Some(3));
        assert_eq!(
            stripped.metadata.deletion_timestamp,
            full.metadata.deletion_timestamp
        );
        let kept = serde_json::to_string(&stripped).unwrap();
        for gone in [
            "last-applied",
            "selector",
            "nodePort",
            "ownerReferences",
            "\"type\":\"X\"",
        ] {
            assert!(!kept.contains(gone), "{gone} kept: {kept}");
        }
    }

    #[test]
    fn a_spec_merge_patch_becomes_a_generation_test_and_whole_fields() {
        let merge =
            serde_json::json!({"spec": {"assignments": [{"service": "a/b"}], "pe/ers": []}});
        assert_eq!(
            generation_guarded(&merge, 7),
            serde_json::json!([
                {"op": "test", "path": "/metadata/generation", "value": 7},
                {"op": "add", "path": "/spec/assignments", "value": [{"service": "a/b"}]},
                {"op": "add", "path": "/spec/pe~1ers", "value": []},
            ])
        );
        assert_eq!(generation_of(&generation_token(42)), Some(42));
        assert_eq!(
            generation_of("12345"),
            None,
            "a resourceVersion is no generation"
        );
    }

    #[test]
    fn a_failed_test_is_a_conflict_a_refused_field_is_not() {
        let status = |code: u16, reason: &str, causes: usize| {
            kube::Error::Api(
                serde_json::from_value::<kube::core::Status>(serde_json::json!({
                    "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                    "message": "m", "reason": reason, "code": code,
                    "details": {"causes": (0..causes).map(|_| serde_json::json!({"field": "spec.x"})).collect::<Vec<_>>()},
                }))
                .unwrap()
                .boxed(),
            )
        };
        assert!(is_conflict(&status(409, "Conflict", 0)));
        assert!(is_conflict(&status(422, "Invalid", 0)));
        assert!(!is_conflict(&status(422, "Invalid", 1)));
        assert!(!is_conflict(&status(500, "InternalError", 0)));
    }
}
