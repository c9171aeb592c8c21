//! The relay task: three watches (VMI and host Node on Harvester, this Node
//! on the guest cluster) feed one loop that owns the state, decides with
//! [`super::plan`] and patches the guest Node.

use std::time::{Duration, SystemTime};

use k8s_openapi::api::core::v1::Node;
use kube::api::{ApiResource, DynamicObject, GroupVersionKind, Patch, PatchParams};
use kube::{Api, ResourceExt};
use serde_json::Value;
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;

use super::TopologyConfig;
use super::cloud_config::{self, Found, Harvester};
use super::plan::{self, Labels};
use super::state::{Reason, TopologyState};
use crate::cluster::watch_one::{Failure, FailureKind, Update, watch_one};

/// Server-side bound of one watch request on the guest cluster. The
/// daemon's guest client has a 30 s read timeout; a watch ended by it is
/// resumed from its resourceVersion anyway.
const GUEST_WATCH_TIMEOUT_SECS: u32 = 25;
/// How long one patch of the guest Node may take.
const PATCH_TIMEOUT: Duration = Duration::from_secs(10);

/// `kubevirt.io/v1` `VirtualMachineInstance`.
pub fn vmi_resource() -> ApiResource {
    ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk("kubevirt.io", "v1", "VirtualMachineInstance"),
        "virtualmachineinstances",
    )
}

/// What the relay needs of a VMI.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Vmi {
    annotations: Labels,
    node_name: Option<String>,
}

impl Vmi {
    fn from_object(obj: &DynamicObject) -> Self {
        Vmi {
            annotations: obj.annotations().clone(),
            node_name: obj
                .data
                .get("status")
                .and_then(|s| s.get("nodeName"))
                .and_then(Value::as_str)
                .filter(|s| !s.is_empty())
                .map(str::to_string),
        }
    }
}

/// The latest word on one watched object.
#[derive(Debug, Clone, PartialEq, Eq)]
enum View<T> {
    Pending,
    Present(T),
    Absent,
    Failed(Failure),
}

impl<T> View<T> {
    fn from_update<K>(u: Update<K>, f: impl FnOnce(&K) -> T) -> Self {
        match u {
            Update::Present(k) => View::Present(f(&k)),
            Update::Absent => View::Absent,
            Update::Failed(e) => View::Failed(e),
        }
    }
}

fn node_labels(n: &Node) -> Labels {
    n.labels().clone()
}

enum Event {
    Vmi(u64, Update<DynamicObject>),
    Host(u64, Update<Node>),
    Guest(u64, Update<Node>),
}

/// A spawned watch, aborted when dropped.
struct Task {
    id: u64,
    handle: JoinHandle<()>,
}

impl Drop for Task {
    fn drop(&mut self) {
        self.handle.abort();
    }
}

/// The cloud-config as last seen.
enum Cloud {
    Missing(Vec<std::path::PathBuf>),
    Invalid(std::path::PathBuf, String),
    Ready(Harvester),
}

struct Relay {
    cfg: TopologyConfig,
    node_name: String,
    next_id: u64,
    /// Path and content of the cloud-config the current client came from.
    seen: Option<Found>,
    cloud: Cloud,
    vmi_task: Option<Task>,
    vmi: View<Vmi>,
    host_task: Option<Task>,
    host_name: Option<String>,
    host: View<Labels>,
    /// The credentials may not read Harvester Nodes: use the annotations.
    host_forbidden: bool,
    guest_client: Option<kube::Client>,
    guest_task: Option<Task>,
    guest: View<Labels>,
    last_patch: Option<String>,
}

/// Relays until `shutdown` turns true (or its sender is dropped).
///
/// `guest_client` is the guest-cluster connection with the node's own
/// credentials (`None` until the node has joined); `out` receives every
/// change of state. Never returns an error: everything that goes wrong is
/// reported in the state and retried.
pub async fn run(
    cfg: TopologyConfig,
    mut guest_client: watch::Receiver<Option<kube::Client>>,
    node_name: String,
    out: watch::Sender<TopologyState>,
    mut shutdown: watch::Receiver<bool>,
) {
    if cfg.keys.is_empty() {
        publish(&out, cfg.initial_state());
        let _ = shutdown.wait_for(|s| *s).await;
        return;
    }
    let (tx, mut rx) = mpsc::channel::<Event>(64);
    let mut tick = tokio::time::interval(cfg.recheck);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut relay = Relay::new(cfg, node_name);
    let first = guest_client.borrow_and_update().clone();
    relay.set_guest(first, &tx);
    let mut guest_open = true;
    loop {
        if *shutdown.borrow() {
            return;
        }
        tokio::select! {
            changed = shutdown.changed() => if changed.is_err() { return },
            _ = tick.tick() => relay.recheck_cloud_config(&tx).await,
            changed = guest_client.changed(), if guest_open => match changed {
                Ok(()) => {
                    let c = guest_client.borrow_and_update().clone();
                    relay.set_guest(c, &tx);
                }
                Err(_) => guest_open = false,
            },
            Some(ev) = rx.recv() => relay.apply(ev, &tx),
        }
        // A patch may take up to PATCH_TIMEOUT: stay stoppable meanwhile.
        tokio::select! {
            state = relay.reconcile() => publish(&out, state),
            _ = shutdown.wait_for(|s| *s) => return,
        }
    }
}

fn publish(out: &watch::Sender<TopologyState>, state: TopologyState) {
    out.send_if_modified(|cur| {
        if *cur == state {
            return false;
        }
        if cur.reason != state.reason || cur.labels != state.labels {
            let level_warn = state.reason.status() != crate::health::Status::Ok;
            if level_warn {
                tracing::warn!(reason = state.reason.as_str(), message = %state.message, "topology");
            } else {
                tracing::info!(reason = state.reason.as_str(), topology = %state.short(), message = %state.message, "topology");
            }
        }
        *cur = state;
        true
    });
}

/// One-shot, read-only assessment for `check`: reads the cloud-config, the
/// VMI, the host Node (when allowed) and, with `guest`, this Node, each
/// within `timeout`; never patches. `OutOfSync` when the Node differs.
pub async fn probe(
    cfg: &TopologyConfig,
    guest: Option<kube::Client>,
    node_name: &str,
    timeout: Duration,
) -> TopologyState {
    if cfg.keys.is_empty() {
        return cfg.initial_state();
    }
    let mut r = Relay::new(cfg.clone(), node_name.to_string());
    let found = cloud_config::find(&cfg.cloud_config);
    r.cloud = load(&found).await;
    async fn get<K>(api: Api<K>, name: &str, timeout: Duration) -> Update<K>
    where
        K: kube::Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug,
    {
        match tokio::time::timeout(timeout, api.get_opt(name)).await {
            Ok(Ok(Some(o))) => Update::Present(o),
            Ok(Ok(None)) => Update::Absent,
            Ok(Err(e)) => Update::Failed(Failure::from_kube(&e)),
            Err(_) => Update::Failed(Failure {
                kind: FailureKind::Unreachable,
                message: format!("no answer within {}", humantime::format_duration(timeout)),
            }),
        }
    }
    if let Cloud::Ready(h) = &r.cloud {
        let api: Api<DynamicObject> =
            Api::namespaced_with(h.client.clone(), &h.namespace, &vmi_resource());
        r.vmi = View::from_update(get(api, &cfg.vm_name, timeout).await, Vmi::from_object);
        if let View::Present(Vmi {
            node_name: Some(host),
            ..
        }) = &r.vmi
        {
            let api: Api<Node> = Api::all(h.client.clone());
            r.host = View::from_update(get(api, host, timeout).await, node_labels);
            r.host_name = Some(host.clone());
            r.host_forbidden =
                matches!(&r.host, View::Failed(f) if f.kind == FailureKind::Forbidden);
        }
    }
    if let Some(c) = &guest {
        r.guest = View::from_update(
            get(Api::<Node>::all(c.clone()), node_name, timeout).await,
            node_labels,
        );
    }
    r.guest_client = guest;
    let (mut state, patch) = r.assess();
    if patch.is_some() {
        state.reason = Reason::OutOfSync;
        state.message = format!(
            "Node {node_name} does not carry Harvester's topology yet ({})",
            describe(&state.labels, &state.keys)
        );
    }
    state
}

async fn load(found: &Found) -> Cloud {
    match found {
        Found::Missing { searched } => Cloud::Missing(searched.clone()),
        Found::Unreadable { path, error } => Cloud::Invalid(path.clone(), error.clone()),
        Found::File { path, content } => match cloud_config::connect(path, content).await {
            Ok(h) => Cloud::Ready(h),
            Err(e) => Cloud::Invalid(path.clone(), e),
        },
    }
}

fn describe(labels: &Labels, keys: &[String]) -> String {
    keys.iter()
        .map(|k| match labels.get(k) {
            Some(v) => format!("{k}={v}"),
            None => format!("{k} unset"),
        })
        .collect::<Vec<_>>()
        .join(", ")
}

impl Relay {
    fn new(cfg: TopologyConfig, node_name: String) -> Self {
        Relay {
            cfg,
            node_name,
            next_id: 0,
            seen: None,
            cloud: Cloud::Missing(Vec::new()),
            vmi_task: None,
            vmi: View::Pending,
            host_task: None,
            host_name: None,
            host: View::Pending,
            host_forbidden: false,
            guest_client: None,
            guest_task: None,
            guest: View::Pending,
            last_patch: None,
        }
    }

    fn id(&mut self) -> u64 {
        self.next_id += 1;
        self.next_id
    }

    /// Looks at the cloud-config; on any change (appeared, gone, new
    /// content) starts over on the Harvester side.
    async fn recheck_cloud_config(&mut self, tx: &mpsc::Sender<Event>) {
        let found = cloud_config::find(&self.cfg.cloud_config);
        if self.seen.as_ref() == Some(&found) {
            return;
        }
        if let Found::File { path, .. } = &found {
            tracing::info!(path = %path.display(), "reading the Harvester cloud-provider kubeconfig");
        }
        self.cloud = load(&found).await;
        self.seen = Some(found);
        self.vmi_task = None;
        self.host_task = None;
        self.host_name = None;
        self.host = View::Pending;
        self.host_forbidden = false;
        self.vmi = View::Pending;
        let id = self.id();
        if let Cloud::Ready(h) = &self.cloud {
            let api: Api<DynamicObject> =
                Api::namespaced_with(h.client.clone(), &h.namespace, &vmi_resource());
            let handle = tokio::spawn(watch_one(
                api,
                self.cfg.vm_name.clone(),
                cloud_config::WATCH_TIMEOUT_SECS,
                tx.clone(),
                move |u| Event::Vmi(id, u),
            ));
            self.vmi_task = Some(Task { id, handle });
        }
    }

    fn set_guest(&mut self, client: Option<kube::Client>, tx: &mpsc::Sender<Event>) {
        self.guest_task = None;
        self.guest = View::Pending;
        if let Some(c) = &client {
            let id = self.id();
            let handle = tokio::spawn(watch_one(
                Api::<Node>::all(c.clone()),
                self.node_name.clone(),
                GUEST_WATCH_TIMEOUT_SECS,
                tx.clone(),
                move |u| Event::Guest(id, u),
            ));
            self.guest_task = Some(Task { id, handle });
        }
        self.guest_client = client;
    }

    fn current(task: &Option<Task>, id: u64) -> bool {
        task.as_ref().is_some_and(|t| t.id == id)
    }

    fn apply(&mut self, ev: Event, tx: &mpsc::Sender<Event>) {
        match ev {
            Event::Vmi(id, u) if Self::current(&self.vmi_task, id) => {
                self.vmi = View::from_update(u, Vmi::from_object);
                let host = match &self.vmi {
                    View::Present(v) => v.node_name.clone(),
                    // Keep following the last host while the VMI is
                    // unreadable; a gone VMI has no host.
                    View::Absent => None,
                    _ => return,
                };
                if host != self.host_name {
                    if let Some(old) = &self.host_name {
                        tracing::info!(from = %old, to = ?host, "VMI moved (live migration): re-syncing topology");
                    }
                    self.follow_host(host, tx);
                }
            }
            Event::Host(id, u) if Self::current(&self.host_task, id) => {
                self.host = View::from_update(u, node_labels);
                match &self.host {
                    View::Failed(f) if f.kind == FailureKind::Forbidden => {
                        tracing::info!(error = %f.message, "Harvester Nodes are not readable with the cloud-provider credentials; using the VMI's annotations");
                        self.host_forbidden = true;
                        // Permanent until the credentials change: stop asking.
                        self.host_task = None;
                    }
                    View::Present(_) => self.host_forbidden = false,
                    _ => {}
                }
            }
            Event::Guest(id, u) if Self::current(&self.guest_task, id) => {
                self.guest = View::from_update(u, node_labels);
            }
            _ => {} // from a watch that was replaced
        }
    }

    fn follow_host(&mut self, host: Option<String>, tx: &mpsc::Sender<Event>) {
        self.host_task = None;
        self.host = View::Pending;
        self.host_name = host.clone();
        let id = self.id();
        let (Some(name), Cloud::Ready(h)) = (host, &self.cloud) else {
            self.host = View::Absent;
            return;
        };
        let handle = tokio::spawn(watch_one(
            Api::<Node>::all(h.client.clone()),
            name,
            cloud_config::WATCH_TIMEOUT_SECS,
            tx.clone(),
            move |u| Event::Host(id, u),
        ));
        self.host_task = Some(Task { id, handle });
    }

    /// Decides, patches when needed, and returns the state to publish.
    async fn reconcile(&mut self) -> TopologyState {
        let (mut state, patch) = self.assess();
        let (Some(patch), Some(client)) = (patch, self.guest_client.clone()) else {
            return state;
        };
        let api: Api<Node> = Api::all(client);
        let result = tokio::time::timeout(
            PATCH_TIMEOUT,
            api.patch(
                &self.node_name,
                &PatchParams::default(),
                &Patch::Merge(&patch),
            ),
        )
        .await;
        match result {
            Ok(Ok(node)) => {
                let stamp = humantime::format_rfc3339_seconds(SystemTime::now()).to_string();
                tracing::info!(node = %self.node_name, patch = %patch, "relayed topology labels");
                self.guest = View::Present(node_labels(&node));
                self.last_patch = Some(stamp);
                state = self.assess().0;
            }
            Ok(Err(e)) => {
                let f = Failure::from_kube(&e);
                state.reason = match f.kind {
                    FailureKind::Forbidden => Reason::Forbidden,
                    FailureKind::Unreachable => Reason::Unreachable,
                };
                state.message = format!(
                    "guest cluster: patching the labels of Node {} failed: {}",
                    self.node_name, f.message
                );
            }
            Err(_) => {
                state.reason = Reason::Unreachable;
                state.message = format!(
                    "guest cluster: patching the labels of Node {} did not finish within {}",
                    self.node_name,
                    humantime::format_duration(PATCH_TIMEOUT)
                );
            }
        }
        state
    }

    /// The state and the patch the views call for (no I/O).
    fn assess(&self) -> (TopologyState, Option<Value>) {
        let keys = &self.cfg.keys;
        let mut st = TopologyState::new(Reason::Starting, "starting", keys);
        st.last_patch = self.last_patch.clone();
        let h = match &self.cloud {
            Cloud::Missing(searched) if self.seen.is_none() && searched.is_empty() => {
                return (st, None);
            }
            Cloud::Missing(searched) => {
                st.reason = Reason::NoCloudConfig;
                st.message = format!(
                    "no Harvester cloud-provider kubeconfig (looked for {})",
                    searched
                        .iter()
                        .map(|p| p.display().to_string())
                        .collect::<Vec<_>>()
                        .join(", ")
                );
                return (st, None);
            }
            Cloud::Invalid(path, e) => {
                st.reason = Reason::InvalidCloudConfig;
                st.message = format!("cloud-provider kubeconfig {}: {e}", path.display());
                st.cloud_config = Some(path.clone());
                return (st, None);
            }
            Cloud::Ready(h) => h,
        };
        st.cloud_config = Some(h.path.clone());
        let vmi_ref = format!("{}/{}", h.namespace, self.cfg.vm_name);
        st.vmi = Some(vmi_ref.clone());
        let fail = |st: &mut TopologyState, side: &str, what: &str, f: &Failure| {
            st.reason = match f.kind {
                FailureKind::Forbidden => Reason::Forbidden,
                FailureKind::Unreachable => Reason::Unreachable,
            };
            st.message = format!("{side}: {what}: {}", f.message);
        };
        let vmi = match &self.vmi {
            View::Pending => {
                st.message = format!("reading VirtualMachineInstance {vmi_ref} at {}", h.server);
                return (st, None);
            }
            View::Absent => {
                st.reason = Reason::VmiNotFound;
                st.message = format!(
                    "no VirtualMachineInstance {vmi_ref} on Harvester ({}); labels left as they are",
                    h.server
                );
                return (st, None);
            }
            View::Failed(f) => {
                let what = format!("reading VirtualMachineInstance {vmi_ref}");
                fail(&mut st, &format!("Harvester ({})", h.server), &what, f);
                return (st, None);
            }
            View::Present(v) => v,
        };
        st.host = vmi.node_name.clone();
        let host_labels = match &self.host {
            View::Present(l) if self.host_name.is_some() => Some(l),
            View::Pending if !self.host_forbidden && self.host_name.is_some() => {
                st.message = format!(
                    "reading Harvester Node {}",
                    self.host_name.as_deref().unwrap_or("")
                );
                return (st, None);
            }
            // A readable host that cannot be reached right now: hold
            // rather than fall back to possibly older annotations.
            View::Failed(f) if f.kind == FailureKind::Unreachable => {
                let what = format!(
                    "reading Harvester Node {}",
                    self.host_name.as_deref().unwrap_or("")
                );
                fail(&mut st, &format!("Harvester ({})", h.server), &what, f);
                return (st, None);
            }
            // Not readable (Forbidden), not found, or no host: annotations.
            _ => None,
        };
        let desired = plan::desired(&vmi.annotations, host_labels, keys);
        st.source = Some(desired.source);
        st.labels = desired.labels.clone();
        let origin = match (desired.source, &vmi.node_name) {
            (plan::Source::HostNode, Some(n)) => format!("Harvester Node {n}"),
            (_, Some(n)) => format!("the annotations of VMI {vmi_ref} (on {n})"),
            (_, None) => format!("the annotations of VMI {vmi_ref}"),
        };
        let invalid = if desired.invalid.is_empty() {
            String::new()
        } else {
            format!(
                "; not relayed (invalid label values): {}",
                desired
                    .invalid
                    .iter()
                    .map(|(k, v)| format!("{k}={v:?}"))
                    .collect::<Vec<_>>()
                    .join(", ")
            )
        };
        if self.guest_client.is_none() {
            st.reason = Reason::WaitingForGuestCluster;
            st.message = format!(
                "no guest-cluster connection yet; will relay {} from {origin}{invalid}",
                describe(&st.labels, keys)
            );
            return (st, None);
        }
        let guest = match &self.guest {
            View::Pending => {
                st.message = format!("reading Node {}", self.node_name);
                return (st, None);
            }
            View::Absent => {
                st.reason = Reason::NodeNotFound;
                st.message = format!(
                    "Node {} is not registered in the guest cluster yet",
                    self.node_name
                );
                return (st, None);
            }
            View::Failed(f) => {
                let what = format!("reading Node {}", self.node_name);
                fail(&mut st, "guest cluster", &what, f);
                return (st, None);
            }
            View::Present(l) => l,
        };
        let patch = plan::patch(&desired, guest, keys);
        st.reason = Reason::Relayed;
        st.message = if st.labels.is_empty() && desired.invalid.is_empty() {
            format!(
                "{origin} has no topology ({} unset); Node {} carries none",
                keys.join(", "),
                self.node_name
            )
        } else {
            format!(
                "Node {} carries {} from {origin}{invalid}",
                self.node_name,
                describe(&st.labels, keys)
            )
        };
        (st, patch)
    }
}
