//! The relay task: three watches (VMI and host Node on Harvester, this Node
//! on the guest cluster) feed one loop that records what they say in
//! [`Seen`], decides with [`super::assess`] (pure) and patches the guest
//! Node. Only I/O lives here: clients, watches, the patch, the clock.

use std::time::{Duration, SystemTime};

use k8s_openapi::api::core::v1::Node;
use kube::api::{ApiResource, DynamicObject, GroupVersionKind, Patch, PatchParams};
use kube::{Api, ResourceExt};
use serde_json::Value;
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;

use super::TopologyConfig;
use super::assess::{
    self, Cloud, HostWatch, PatchError, Scope, Seen, View, Vmi, assess_for_check, patch_failed,
};
use super::cloud_config::{self, Found, Harvester};
use super::labels::Labels;
use super::state::TopologyState;
use hna_edges::cluster::watch_one::{Failure, FailureKind, Update, watch_one};

/// How long one patch of the guest Node may take.
const PATCH_TIMEOUT: Duration = Duration::from_secs(10);

/// `kubevirt.io/v1` `VirtualMachineInstance`.
pub(crate) fn vmi_resource() -> ApiResource {
    ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk("kubevirt.io", "v1", "VirtualMachineInstance"),
        "virtualmachineinstances",
    )
}

fn vmi_of(obj: &DynamicObject) -> Vmi {
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

fn view_of<K, T>(u: Update<K>, f: impl FnOnce(&K) -> T) -> View<T> {
    match u {
        Update::Present(k) => View::Present(f(&k)),
        Update::Absent => View::Absent,
        Update::Failed(e) => View::Failed(e),
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

/// The watches and clients behind [`Seen`].
struct Relay {
    cfg: TopologyConfig,
    node_name: String,
    next_id: u64,
    /// Path and content of the cloud-config the current client came from.
    found: Option<Found>,
    /// The client made from it, when it was usable.
    harvester: Option<kube::Client>,
    vmi_task: Option<Task>,
    host_task: Option<Task>,
    guest_client: Option<kube::Client>,
    guest_task: Option<Task>,
    seen: Seen,
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
    let mut seen = Seen::default();
    let (cloud, harvester) = load(&cloud_config::find(&cfg.cloud_config)).await;
    seen.cloud_changed(cloud);
    if let (Some(client), Cloud::Ready { namespace, .. }) = (harvester, &seen.cloud) {
        let api: Api<DynamicObject> =
            Api::namespaced_with(client.clone(), namespace, &vmi_resource());
        let vmi = view_of(get(api, &cfg.vm_name, timeout).await, vmi_of);
        if let Some(change) = seen.vmi_seen(vmi)
            && let Some(host) = change.watch
        {
            let host = view_of(
                get(Api::<Node>::all(client), &host, timeout).await,
                node_labels,
            );
            // One read: there is no watch to stop.
            let _ = seen.host_seen(host);
        }
    }
    seen.guest_connection(guest.is_some());
    if let Some(c) = guest {
        seen.guest_seen(view_of(
            get(Api::<Node>::all(c), node_name, timeout).await,
            node_labels,
        ));
    }
    let scope = Scope {
        keys: &cfg.keys,
        vm_name: &cfg.vm_name,
        node_name,
    };
    assess_for_check(scope, &seen)
}

/// The cloud-config's view and, when usable, its client.
async fn load(found: &Found) -> (Cloud, Option<kube::Client>) {
    match found {
        Found::Missing { searched } => (Cloud::Missing(searched.clone()), None),
        Found::Unreadable { path, error } => (Cloud::Invalid(path.clone(), error.clone()), None),
        Found::File { path, content } => match cloud_config::connect(path, content).await {
            Ok(Harvester {
                path,
                client,
                namespace,
                server,
            }) => (
                Cloud::Ready {
                    path,
                    namespace,
                    server,
                },
                Some(client),
            ),
            Err(e) => (Cloud::Invalid(path.clone(), e.to_string()), None),
        },
    }
}

impl Relay {
    fn new(cfg: TopologyConfig, node_name: String) -> Self {
        Relay {
            cfg,
            node_name,
            next_id: 0,
            found: None,
            harvester: None,
            vmi_task: None,
            host_task: None,
            guest_client: None,
            guest_task: None,
            seen: Seen::default(),
        }
    }

    fn id(&mut self) -> u64 {
        self.next_id += 1;
        self.next_id
    }

    fn scope(&self) -> Scope<'_> {
        Scope {
            keys: &self.cfg.keys,
            vm_name: &self.cfg.vm_name,
            node_name: &self.node_name,
        }
    }

    /// Looks at the cloud-config; on any change (appeared, gone, new
    /// content) starts over on the Harvester side.
    async fn recheck_cloud_config(&mut self, tx: &mpsc::Sender<Event>) {
        let found = cloud_config::find(&self.cfg.cloud_config);
        if self.found.as_ref() == Some(&found) {
            return;
        }
        if let Found::File { path, .. } = &found {
            tracing::info!(path = %path.display(), "reading the Harvester cloud-provider kubeconfig");
        }
        let (cloud, harvester) = load(&found).await;
        self.found = Some(found);
        self.vmi_task = None;
        self.host_task = None;
        self.seen.cloud_changed(cloud);
        self.harvester = harvester;
        if let (Some(client), Cloud::Ready { namespace, .. }) = (&self.harvester, &self.seen.cloud)
        {
            let api: Api<DynamicObject> =
                Api::namespaced_with(client.clone(), namespace, &vmi_resource());
            let id = self.id();
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
        self.seen.guest_connection(client.is_some());
        if let Some(c) = &client {
            let id = self.id();
            let handle = tokio::spawn(watch_one(
                Api::<Node>::all(c.clone()),
                self.node_name.clone(),
                hna_edges::cluster::credentials::WATCH_TIMEOUT_SECS,
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
                let Some(change) = self.seen.vmi_seen(view_of(u, vmi_of)) else {
                    return;
                };
                if let Some(old) = &change.from {
                    let host = &self.seen.host_name;
                    tracing::info!(from = %old, to = ?host, "VMI moved (live migration): re-syncing topology");
                }
                self.host_task = None;
                let id = self.id();
                if let (Some(name), Some(client)) = (change.watch, &self.harvester) {
                    let handle = tokio::spawn(watch_one(
                        Api::<Node>::all(client.clone()),
                        name,
                        cloud_config::WATCH_TIMEOUT_SECS,
                        tx.clone(),
                        move |u| Event::Host(id, u),
                    ));
                    self.host_task = Some(Task { id, handle });
                }
            }
            Event::Host(id, u) if Self::current(&self.host_task, id) => {
                match self.seen.host_seen(view_of(u, node_labels)) {
                    HostWatch::Continue => {}
                    HostWatch::Stop => {
                        if let View::Failed(f) = &self.seen.host {
                            tracing::info!(error = %f.message, "Harvester Nodes are not readable with the cloud-provider credentials; using the VMI's annotations");
                        }
                        self.host_task = None;
                    }
                }
            }
            Event::Guest(id, u) if Self::current(&self.guest_task, id) => {
                self.seen.guest_seen(view_of(u, node_labels));
            }
            _ => {} // from a watch that was replaced
        }
    }

    /// Decides, patches when needed, and returns the state to publish.
    async fn reconcile(&mut self) -> TopologyState {
        let (state, patch) = assess::assess(self.scope(), &self.seen);
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
        let error = match result {
            Ok(Ok(node)) => {
                tracing::info!(node = %self.node_name, patch = %patch, "relayed topology labels");
                self.seen.patched(node_labels(&node), SystemTime::now());
                return assess::assess(self.scope(), &self.seen).0;
            }
            Ok(Err(e)) => PatchError::Failed(Failure::from_kube(&e)),
            Err(_) => PatchError::TimedOut(PATCH_TIMEOUT),
        };
        patch_failed(state, &self.node_name, &error)
    }
}
