//! The Harvester cloud provider (the guest cluster's cloud controller
//! manager), run in the rig as Harvester runs it for a guest cluster: its
//! `service` controller on the rig's API server (the guest cluster), with
//! the rights of its shipped ClusterRole, and its Harvester side on a second
//! API server that plays Harvester, with the rights `generate_addon.sh`
//! gives it (the `loadbalancers` of one namespace).
//!
//! It is built from the source snapshot in the project's shared peers folder
//! by `tests/rig/peers.sh` ([`CCM_COMMIT`]), cached outside the checkout;
//! nothing of its code is in this repository.
//!
//! What Harvester adds around it is stood in for here:
//! - the `loadbalancer.harvesterhci.io/v1beta1` `LoadBalancer` CRD, written
//!   from the fields of the snapshot's vendored API types (which carry no
//!   status subresource: the cloud provider writes `status.address` with a
//!   plain UPDATE of the object, which a status subresource would drop);
//! - Harvester's load-balancer controller, which allocates each object an
//!   address: `0.0.0.0` for `ipam: dhcp` (the guest asks its DHCP server),
//!   the next address of [`POOL`] for `ipam: pool`
//!   ([`HarvesterSide::allocations`] counts them).

use std::collections::BTreeMap;
use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::thread::JoinHandle;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use kube::api::{
    Api, ApiResource, DynamicObject, GroupVersionKind, ListParams, Patch, PatchParams,
};
use serde_json::{Value, json};

use crate::lb::LbRig;
use crate::rig::apiserver::{ApiServer, Binaries};
use crate::rig::manifests::{self, Manifest, Mode};
use crate::rig::process::{ChildProc, tail};

pub use crate::locate::peers::CCM_COMMIT;

/// The namespace of the Harvester cluster that holds the guest cluster's
/// objects (its cloud-config kubeconfig's namespace).
pub const HARVESTER_NAMESPACE: &str = "guest-clusters";
/// `--cluster-name`: the first part of every Harvester object's name.
pub const CLUSTER_NAME: &str = "hna-rig";
/// The addresses the stand-in for Harvester's pool allocates, in order;
/// outside the rig's DHCP range and MetalLB's pool.
pub const POOL: (Ipv4Addr, Ipv4Addr) =
    (Ipv4Addr::new(10, 77, 0, 240), Ipv4Addr::new(10, 77, 0, 249));

/// The guest Service annotation that says which IPAM mode Harvester uses.
pub const IPAM: &str = "cloudprovider.harvesterhci.io/ipam";
/// The label the cloud provider puts on each Harvester object: the guest
/// Service's namespace and name.
const LABEL_SERVICE_NAMESPACE: &str = "cloudprovider.harvesterhci.io/serviceNamespace";
const LABEL_SERVICE_NAME: &str = "cloudprovider.harvesterhci.io/serviceName";

/// `loadbalancer.harvesterhci.io/v1beta1`, `LoadBalancer`.
pub fn load_balancer_resource() -> ApiResource {
    ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk("loadbalancer.harvesterhci.io", "v1beta1", "LoadBalancer"),
        "loadbalancers",
    )
}

/// The CRD, from the fields of the snapshot's Go types
/// (`pkg/apis/loadbalancer.harvesterhci.io/v1beta1/loadbalancer.go` of
/// harvester-load-balancer, vendored): no status subresource.
fn load_balancer_crd() -> Value {
    let string = json!({"type": "string"});
    let int = json!({"type": "integer", "format": "int32"});
    json!({
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": "loadbalancers.loadbalancer.harvesterhci.io"},
        "spec": {
            "group": "loadbalancer.harvesterhci.io",
            "names": {
                "kind": "LoadBalancer", "listKind": "LoadBalancerList",
                "plural": "loadbalancers", "singular": "loadbalancer",
                "shortNames": ["lb", "lbs"],
            },
            "scope": "Namespaced",
            "versions": [{
                "name": "v1beta1", "served": true, "storage": true,
                "schema": {"openAPIV3Schema": {
                    "type": "object",
                    "properties": {
                        "apiVersion": string, "kind": string,
                        "metadata": {"type": "object"},
                        "spec": {"type": "object", "properties": {
                            "description": string,
                            "workloadType": {"type": "string", "enum": ["vm", "cluster"]},
                            "ipam": {"type": "string", "enum": ["pool", "dhcp"]},
                            "ipPool": string,
                            "listeners": {"type": "array", "items": {"type": "object", "properties": {
                                "name": string, "port": int, "protocol": string, "backendPort": int,
                            }}},
                            "backendServerSelector": {"type": "object", "additionalProperties": {
                                "type": "array", "items": string,
                            }},
                            "healthCheck": {"type": "object", "properties": {
                                "port": {"type": "integer"}, "successThreshold": {"type": "integer"},
                                "failureThreshold": {"type": "integer"}, "periodSeconds": {"type": "integer"},
                                "timeoutSeconds": {"type": "integer"},
                            }},
                        }},
                        "status": {"type": "object", "properties": {
                            "backendServers": {"type": "array", "items": string},
                            "allocatedAddress": {"type": "object", "properties": {
                                "ipPool": string, "ip": string, "mask": string, "gateway": string,
                            }},
                            "address": string,
                            "conditions": {"type": "array", "items": {"type": "object", "properties": {
                                "type": string, "status": string, "lastUpdateTime": string,
                                "lastTransitionTime": string, "reason": string, "message": string,
                            }}},
                        }},
                    },
                }},
                "subresources": {},
            }],
        },
    })
}

fn manifest(v: Value) -> Result<Manifest> {
    Ok(Manifest {
        source: PathBuf::from(file!()),
        object: serde_json::from_value(v)?,
    })
}

/// Applies `objects` on `api` (through its `admin`), then writes the
/// kubeconfig of ServiceAccount `account` (namespace, name) to `out`.
async fn grant(
    admin: &kube::Client,
    api: &ApiServer,
    objects: &[Value],
    account: (&str, &str),
    out: &Path,
) -> Result<()> {
    let objects: Vec<Manifest> = objects
        .iter()
        .cloned()
        .map(manifest)
        .collect::<Result<_>>()?;
    manifests::apply(admin, &objects, Mode::Apply).await?;
    // How `generate_addon.sh` hands the cloud provider its Harvester
    // credentials.
    api.service_account_kubeconfig(admin, account.0, account.1, out)
        .await
}

/// The second API server playing Harvester, the stand-in for its
/// load-balancer controller, and the cloud provider running against both.
/// Stopped when dropped (the cloud provider first).
pub struct HarvesterSide {
    ccm: ChildProc,
    allocator: Option<JoinHandle<()>>,
    stop: Arc<AtomicBool>,
    allocated: Arc<AtomicUsize>,
    runtime: tokio::runtime::Runtime,
    /// The Harvester cluster's admin.
    pub admin: kube::Client,
    pub api: ApiServer,
}

impl Drop for HarvesterSide {
    fn drop(&mut self) {
        self.ccm.stop_with(Duration::from_secs(1));
        self.stop.store(true, Ordering::SeqCst);
        if let Some(t) = self.allocator.take() {
            let _ = t.join();
        }
        self.api.stop();
    }
}

impl HarvesterSide {
    /// Starts Harvester's API server beside `lb`'s, sets up both sides'
    /// credentials and starts the cloud provider ([`CCM_COMMIT`], cached by
    /// `tests/rig/peers.sh`) with only its `service` controller (the rig
    /// runs no kubelets and no VMs for its node controllers to look up).
    pub fn start(lb: &LbRig) -> Result<HarvesterSide> {
        let bin = crate::locate::peers::harvester_ccm()
            .map_err(|e| anyhow::anyhow!("{e}: run {} first", crate::locate::peers::INSTALL))?;
        let dir = lb.rig.dir().join("harvester");
        std::fs::create_dir_all(&dir)?;
        let bins = Binaries::find().map_err(|e| anyhow::anyhow!(e))?;
        let api = ApiServer::start(&dir, &format!("{}-hv", lb.rig.id()), &bins, &[])
            .context("start the Harvester API server")?;
        // Its own: a client serves only while the runtime it was made in
        // runs (the rig's clients are driven by `lb.block_on`).
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        let admin = runtime.block_on(crate::rig::kube_client(api.admin_kubeconfig()))?;
        let guest = lb.rig.apiserver().context("the LB rig has an API server")?;

        // Harvester: the CRD, the namespace, and generate_addon.sh's Role
        // and its ServiceAccount.
        let harvester_objects = [
            load_balancer_crd(),
            json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": HARVESTER_NAMESPACE}}),
            json!({
                "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
                "metadata": {"name": "harvester-cloud-provider", "namespace": HARVESTER_NAMESPACE},
                "rules": [{"apiGroups": ["loadbalancer.harvesterhci.io"], "resources": ["loadbalancers"],
                           "verbs": ["get", "watch", "list", "update", "create", "delete"]}],
            }),
            json!({
                "apiVersion": "v1", "kind": "ServiceAccount",
                "metadata": {"name": CLUSTER_NAME, "namespace": HARVESTER_NAMESPACE},
            }),
            json!({
                "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
                "metadata": {"name": CLUSTER_NAME, "namespace": HARVESTER_NAMESPACE},
                "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "harvester-cloud-provider"},
                "subjects": [{"kind": "ServiceAccount", "name": CLUSTER_NAME, "namespace": HARVESTER_NAMESPACE}],
            }),
        ];
        // The guest: the cloud provider's ServiceAccount in kube-system and
        // the rights of its chart's ClusterRole that its `service`
        // controller uses.
        let guest_objects = [
            json!({
                "apiVersion": "v1", "kind": "ServiceAccount",
                "metadata": {"name": "harvester-cloud-provider", "namespace": "kube-system"},
            }),
            json!({
                "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole",
                "metadata": {"name": "harvester-cloud-provider"},
                "rules": [
                    {"apiGroups": [""], "resources": ["services", "nodes", "events"],
                     "verbs": ["get", "list", "watch", "create", "update", "patch"]},
                    {"apiGroups": [""], "resources": ["services/status", "nodes/status"],
                     "verbs": ["update", "patch"]},
                    {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"],
                     "verbs": ["get", "create", "update"]},
                ],
            }),
            json!({
                "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
                "metadata": {"name": "harvester-cloud-provider"},
                "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "harvester-cloud-provider"},
                "subjects": [{"kind": "ServiceAccount", "name": "harvester-cloud-provider", "namespace": "kube-system"}],
            }),
        ];
        let cloud_config = dir.join("cloud-config.kubeconfig");
        let guest_config = dir.join("guest.kubeconfig");
        runtime
            .block_on(grant(
                &admin,
                &api,
                &harvester_objects,
                (HARVESTER_NAMESPACE, CLUSTER_NAME),
                &cloud_config,
            ))
            .context("the Harvester side's objects and the cloud provider's credentials there")?;
        lb.block_on(grant(
            &lb.admin(),
            guest,
            &guest_objects,
            ("kube-system", "harvester-cloud-provider"),
            &guest_config,
        ))
        .context("the cloud provider's rights and credentials in the guest cluster")?;

        let stop = Arc::new(AtomicBool::new(false));
        let allocated = Arc::new(AtomicUsize::new(0));
        let allocator = {
            let (kubeconfig, stop, allocated) = (
                api.admin_kubeconfig().to_path_buf(),
                stop.clone(),
                allocated.clone(),
            );
            std::thread::spawn(move || {
                let Ok(rt) = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                else {
                    return;
                };
                rt.block_on(async {
                    match crate::rig::kube_client(&kubeconfig).await {
                        Ok(admin) => allocate(admin, stop, allocated).await,
                        Err(e) => eprintln!("harvester stand-in: no client: {e:#}"),
                    }
                })
            })
        };

        // Its own clients read the guest cluster from KUBECONFIG only, the
        // framework's from --kubeconfig: both name the guest.
        let mut cmd = Command::new(&bin);
        cmd.env("KUBECONFIG", &guest_config).args([
            format!("--kubeconfig={}", guest_config.display()),
            format!("--cloud-config={}", cloud_config.display()),
            "--controllers=service".into(),
            "--leader-elect=false".into(),
            "--secure-port=0".into(),
            "--disable-vmi-controller".into(),
            format!("--cluster-name={CLUSTER_NAME}"),
            "--v=2".into(),
        ]);
        let ccm = ChildProc::spawn("harvester-cloud-provider", cmd, &dir.join("ccm.log"))?;
        let mut side = HarvesterSide {
            ccm,
            allocator: Some(allocator),
            stop,
            allocated,
            runtime,
            admin,
            api,
        };
        // Up when its service controller has synced its caches.
        let started = crate::lb::wait_for(Duration::from_secs(60), || {
            let log = std::fs::read_to_string(side.ccm.log()).unwrap_or_default();
            log.contains("Caches are synced for service").then_some(())
        });
        if started.is_none() {
            side.check_running()?;
            bail!(
                "the Harvester cloud provider's service controller did not sync within 60 s:\n{}",
                side.log_tail(30)
            );
        }
        Ok(side)
    }

    /// An error with the log's tail if the cloud provider exited.
    pub fn check_running(&mut self) -> Result<()> {
        match self.ccm.exited() {
            Some(status) => Err(self.ccm.exit_error(status)),
            None => Ok(()),
        }
    }

    pub fn log_tail(&self, lines: usize) -> String {
        tail(self.ccm.log(), lines)
    }

    /// The Harvester `LoadBalancer` objects of guest Service `namespace/name`
    /// (the cloud provider labels each with them).
    pub fn load_balancers_of(&self, namespace: &str, name: &str) -> Vec<Value> {
        let selector = format!("{LABEL_SERVICE_NAMESPACE}={namespace},{LABEL_SERVICE_NAME}={name}");
        self.list(&ListParams::default().labels(&selector))
            .into_values()
            .collect()
    }

    /// Every Harvester `LoadBalancer` object, by name.
    pub fn load_balancers(&self) -> BTreeMap<String, Value> {
        self.list(&ListParams::default())
    }

    fn list(&self, params: &ListParams) -> BTreeMap<String, Value> {
        let api: Api<DynamicObject> = Api::namespaced_with(
            self.admin.clone(),
            HARVESTER_NAMESPACE,
            &load_balancer_resource(),
        );
        self.runtime
            .block_on(api.list(params))
            .map(|l| {
                l.items
                    .into_iter()
                    .filter_map(|o| Some((o.metadata.name.clone()?, serde_json::to_value(o).ok()?)))
                    .collect()
            })
            .unwrap_or_default()
    }

    /// How many addresses the stand-in for Harvester's controller has
    /// allocated so far.
    pub fn allocations(&self) -> usize {
        self.allocated.load(Ordering::SeqCst)
    }
}

/// The stand-in for Harvester's load-balancer controller: every object
/// without an allocated address gets one, `0.0.0.0` for DHCP, else the
/// next of [`POOL`]. Polls every 100 ms (the cloud provider itself polls
/// for the address once a second, ten times) until `stop`.
async fn allocate(admin: kube::Client, stop: Arc<AtomicBool>, allocated: Arc<AtomicUsize>) {
    let api: Api<DynamicObject> =
        Api::namespaced_with(admin, HARVESTER_NAMESPACE, &load_balancer_resource());
    let mut next = u32::from(POOL.0);
    while !stop.load(Ordering::SeqCst) {
        if let Ok(list) = api.list(&ListParams::default()).await {
            for o in list.items {
                let has = o.data["status"]["allocatedAddress"]["ip"]
                    .as_str()
                    .is_some_and(|ip| !ip.is_empty());
                let Some(name) = o.metadata.name.clone() else {
                    continue;
                };
                if has {
                    continue;
                }
                let ip = if o.data["spec"]["ipam"] == "dhcp" {
                    Ipv4Addr::UNSPECIFIED
                } else if next <= u32::from(POOL.1) {
                    next += 1;
                    Ipv4Addr::from(next - 1)
                } else {
                    continue;
                };
                let patch = json!({"status": {"allocatedAddress": {"ip": ip.to_string(), "mask": "255.255.255.0"}}});
                if api
                    .patch(&name, &PatchParams::default(), &Patch::Merge(&patch))
                    .await
                    .is_ok()
                {
                    allocated.fetch_add(1, Ordering::SeqCst);
                }
            }
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}
