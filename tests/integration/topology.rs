//! The topology relay against two real API servers: one plays Harvester
//! (a VirtualMachineInstance CRD, host Nodes with topology labels, the
//! cloud-provider service account with a kubeconfig made the way
//! `generate_addon.sh` makes it), the other is the guest cluster whose Nodes
//! the relay labels with the node's own credentials (Node authorizer and
//! NodeRestriction on).
//!
//! The service-account token: the token controller runs in the
//! controller-manager, which the rig does not run. The test mints the token
//! with the TokenRequest API (`serviceaccounts/<name>/token`, signed with the
//! rig's service-account key) and stores it, with `ca.crt` and `namespace`,
//! in a `kubernetes.io/service-account-token` Secret referenced from the
//! ServiceAccount — what the token controller would have done. The
//! kubeconfig is then built from that Secret as `generate_addon.sh` builds
//! it.

use std::collections::BTreeMap;
use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use hna_node::topology::{self, Reason, TopologyConfig, TopologyState};
use hna_testkit::rig::apiserver::{ApiServer, Binaries, base64};
use hna_testkit::rig::{self, Rig, RigOptions};
use k8s_openapi::api::authentication::v1::{TokenRequest, TokenRequestSpec};
use k8s_openapi::api::core::v1::{Namespace, Node, Secret, ServiceAccount};
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding, Role, RoleBinding};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{ApiResource, DynamicObject, GroupVersionKind, Patch, PatchParams, PostParams};
use kube::{Api, Client};
use serde_json::{Value, json};
use tokio::sync::watch;

use crate::harness::tests;

tests! {
    labels_follow_the_vmi_across_migration_host_relabel_and_removal: Root, Iproute2, ApiServer;
    problems_are_reported_and_the_relay_keeps_running: Root, Iproute2, ApiServer;
    the_daemon_relays_and_reports_topology: Root, Iproute2, ApiServer;
}

pub(crate) const NS: &str = "guest-vms";
pub(crate) const REGION: &str = "topology.kubernetes.io/region";
pub(crate) const ZONE: &str = "topology.kubernetes.io/zone";

/// The guest cluster (the rig's API server) and a second API server playing
/// Harvester, both torn down on drop (Harvester first).
struct Clusters {
    harvester: ApiServer,
    rig: Rig,
}

impl Drop for Clusters {
    fn drop(&mut self) {
        self.harvester.stop();
    }
}

fn start(nodes: &[&str]) -> Clusters {
    let rig = Rig::start(RigOptions {
        guests: nodes.len(),
        dhcp: false,
        apiserver: true,
        node_names: nodes.iter().map(|s| s.to_string()).collect(),
        ..Default::default()
    })
    .unwrap();
    let dir = rig.dir().join("harvester");
    std::fs::create_dir_all(&dir).unwrap();
    let bins = Binaries::find().unwrap();
    let harvester = ApiServer::start(&dir, &format!("{}-hv", rig.id()), &bins, &[])
        .context("start the Harvester API server")
        .unwrap();
    Clusters { harvester, rig }
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

fn vmi_resource() -> ApiResource {
    ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk("kubevirt.io", "v1", "VirtualMachineInstance"),
        "virtualmachineinstances",
    )
}

fn from_json<T: serde::de::DeserializeOwned>(v: Value) -> T {
    serde_json::from_value(v).unwrap()
}

/// Harvester's side: the VMI CRD, the namespace, host Nodes hv-1 (us-east-1
/// / us-east-1a), hv-2 (us-east-1 / us-east-1b), hv-3 (us-west-2 /
/// us-west-2a), and the RBAC `generate_addon.sh` creates (plus, for
/// `with_nodes`, a ClusterRole to read Nodes).
pub(crate) async fn setup_harvester(admin: &Client) -> Result<()> {
    let crds: Api<CustomResourceDefinition> = Api::all(admin.clone());
    crds.create(
        &PostParams::default(),
        &from_json(json!({
            "apiVersion": "apiextensions.k8s.io/v1",
            "kind": "CustomResourceDefinition",
            "metadata": {"name": "virtualmachineinstances.kubevirt.io"},
            "spec": {
                "group": "kubevirt.io",
                "names": {
                    "kind": "VirtualMachineInstance",
                    "plural": "virtualmachineinstances",
                    "singular": "virtualmachineinstance",
                    "shortNames": ["vmi", "vmis"],
                    "listKind": "VirtualMachineInstanceList",
                },
                "scope": "Namespaced",
                "versions": [{
                    "name": "v1",
                    "served": true,
                    "storage": true,
                    "schema": {"openAPIV3Schema": {
                        "type": "object",
                        "x-kubernetes-preserve-unknown-fields": true,
                    }},
                }],
            },
        })),
    )
    .await
    .context("create the VMI CRD")?;
    // Established, and served: a create must succeed.
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let crd = crds.get("virtualmachineinstances.kubevirt.io").await?;
        let established = crd
            .status
            .and_then(|s| s.conditions)
            .unwrap_or_default()
            .iter()
            .any(|c| c.type_ == "Established" && c.status == "True");
        if established {
            break;
        }
        anyhow::ensure!(Instant::now() < deadline, "CRD not established");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    Api::<Namespace>::all(admin.clone())
        .create(
            &PostParams::default(),
            &from_json(json!({"metadata": {"name": NS}})),
        )
        .await?;
    // A first custom-resource write, as a smoke test of the CRD.
    create_vmi(admin, "smoke", "hv-1", "r", "z")
        .await
        .context("create a VirtualMachineInstance")?;
    Api::<DynamicObject>::namespaced_with(admin.clone(), NS, &vmi_resource())
        .delete("smoke", &Default::default())
        .await?;
    let nodes: Api<Node> = Api::all(admin.clone());
    for (name, region, zone) in [
        ("hv-1", "us-east-1", "us-east-1a"),
        ("hv-2", "us-east-1", "us-east-1b"),
        ("hv-3", "us-west-2", "us-west-2a"),
    ] {
        nodes
            .create(
                &PostParams::default(),
                &from_json(json!({"metadata": {"name": name, "labels": {
                    REGION: region, ZONE: zone, "kubernetes.io/hostname": name,
                }}})),
            )
            .await?;
    }
    // generate_addon.sh's Role, verbatim in substance.
    Api::<Role>::namespaced(admin.clone(), NS)
        .create(
            &PostParams::default(),
            &from_json(json!({
                "metadata": {"name": "harvester-cloud-provider", "namespace": NS},
                "rules": [
                    {"apiGroups": ["loadbalancer.harvesterhci.io"], "resources": ["loadbalancers"],
                     "verbs": ["get", "watch", "list", "update", "create", "delete"]},
                    {"apiGroups": ["kubevirt.io"], "resources": ["virtualmachines", "virtualmachineinstances"],
                     "verbs": ["get", "watch", "list"]},
                ],
            })),
        )
        .await?;
    Api::<ClusterRole>::all(admin.clone())
        .create(
            &PostParams::default(),
            &from_json(json!({
                "metadata": {"name": "harvester-node-agent-nodes"},
                "rules": [{"apiGroups": [""], "resources": ["nodes"], "verbs": ["get", "list", "watch"]}],
            })),
        )
        .await?;
    Ok(())
}

/// A service account like `generate_addon.sh <name> guest-vms` makes:
/// RoleBinding to `harvester-cloud-provider` when `vmis`, ClusterRoleBinding
/// to read Nodes when `nodes`, a token Secret, and the kubeconfig written to
/// `out` built from that Secret.
pub(crate) async fn service_account(
    admin: &Client,
    harvester: &ApiServer,
    name: &str,
    vmis: bool,
    nodes: bool,
    out: &Path,
) -> Result<()> {
    service_account_via(admin, harvester, harvester.url(), name, vmis, nodes, out).await
}

/// [`service_account`], its kubeconfig naming `server` (the Harvester API
/// server as the guest reaches it: a VM node, through the LAN).
pub(crate) async fn service_account_via(
    admin: &Client,
    harvester: &ApiServer,
    server: &str,
    name: &str,
    vmis: bool,
    nodes: bool,
    out: &Path,
) -> Result<()> {
    let pp = PostParams::default();
    let sas: Api<ServiceAccount> = Api::namespaced(admin.clone(), NS);
    sas.create(
        &pp,
        &from_json(json!({"metadata": {"name": name, "namespace": NS}})),
    )
    .await?;
    if vmis {
        Api::<RoleBinding>::namespaced(admin.clone(), NS)
            .create(
                &pp,
                &from_json(json!({
                    "metadata": {"name": name, "namespace": NS},
                    "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "harvester-cloud-provider"},
                    "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": NS}],
                })),
            )
            .await?;
    }
    if nodes {
        Api::<ClusterRoleBinding>::all(admin.clone())
            .create(
                &pp,
                &from_json(json!({
                    "metadata": {"name": format!("{name}-nodes")},
                    "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "harvester-node-agent-nodes"},
                    "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": NS}],
                })),
            )
            .await?;
    }
    // What the token controller would do: a TokenRequest-minted token in
    // the service account's token Secret.
    let tr = sas
        .create_token_request(
            name,
            &pp,
            &TokenRequest {
                spec: TokenRequestSpec {
                    audiences: vec![],
                    expiration_seconds: Some(24 * 3600),
                    ..Default::default()
                },
                ..Default::default()
            },
        )
        .await
        .context("TokenRequest")?;
    let token = tr.status.context("TokenRequest status")?.token;
    let secret_name = format!("{name}-token");
    let mut data = BTreeMap::new();
    data.insert(
        "token".to_string(),
        k8s_openapi::ByteString(token.into_bytes()),
    );
    data.insert(
        "ca.crt".to_string(),
        k8s_openapi::ByteString(harvester.ca_pem().as_bytes().to_vec()),
    );
    data.insert("namespace".to_string(), k8s_openapi::ByteString(NS.into()));
    Api::<Secret>::namespaced(admin.clone(), NS)
        .create(
            &pp,
            &Secret {
                metadata: from_json(json!({
                    "name": secret_name,
                    "namespace": NS,
                    "annotations": {"kubernetes.io/service-account.name": name},
                })),
                type_: Some("kubernetes.io/service-account-token".into()),
                data: Some(data),
                ..Default::default()
            },
        )
        .await?;
    sas.patch(
        name,
        &PatchParams::default(),
        &Patch::Merge(json!({"secrets": [{"name": secret_name}]})),
    )
    .await?;

    // generate_addon.sh: SECRET_NAME from `.secrets[].name`, ca.crt and
    // token from the Secret, cluster name and endpoint from the admin's
    // current context, user and context `<sa>-<ns>-<cluster>` with the
    // namespace.
    let sa = sas.get(name).await?;
    let secret_name = sa.secrets.unwrap()[0].name.clone().context("secret name")?;
    let secret = Api::<Secret>::namespaced(admin.clone(), NS)
        .get(&secret_name)
        .await?;
    let data = secret.data.unwrap();
    let ca = &data["ca.crt"].0;
    let token = String::from_utf8(data["token"].0.clone())?;
    let cluster = "hna-rig";
    let user = format!("{name}-{NS}-{cluster}");
    let yaml = format!(
        "apiVersion: v1
clusters:
- cluster:
    certificate-authority-data: {ca}
    server: {server}
  name: {cluster}
contexts:
- context:
    cluster: {cluster}
    namespace: {NS}
    user: {user}
  name: {user}
current-context: {user}
kind: Config
preferences: {{}}
users:
- name: {user}
  user:
    token: {token}
",
        ca = base64(ca),
    );
    std::fs::write(out, yaml)?;
    Ok(())
}

pub(crate) async fn create_vmi(
    admin: &Client,
    name: &str,
    host: &str,
    region: &str,
    zone: &str,
) -> Result<()> {
    let api: Api<DynamicObject> = Api::namespaced_with(admin.clone(), NS, &vmi_resource());
    let obj: DynamicObject = from_json(json!({
        "apiVersion": "kubevirt.io/v1",
        "kind": "VirtualMachineInstance",
        "metadata": {"name": name, "namespace": NS, "annotations": {REGION: region, ZONE: zone}},
        "spec": {"domain": {"devices": {}}},
        "status": {"nodeName": host, "phase": "Running"},
    }));
    api.create(&PostParams::default(), &obj).await?;
    Ok(())
}

pub(crate) async fn patch_vmi(admin: &Client, name: &str, patch: Value) -> Result<()> {
    let api: Api<DynamicObject> = Api::namespaced_with(admin.clone(), NS, &vmi_resource());
    api.patch(name, &PatchParams::default(), &Patch::Merge(patch))
        .await?;
    Ok(())
}

async fn patch_node(client: &Client, name: &str, patch: Value) -> Result<()> {
    Api::<Node>::all(client.clone())
        .patch(name, &PatchParams::default(), &Patch::Merge(patch))
        .await?;
    Ok(())
}

/// Registers the guest Node with the node's own credentials, as a kubelet
/// does, with one unrelated label the relay must never touch.
async fn register_guest_node(rig: &Rig, node: &str) -> Result<Client> {
    let api = rig.apiserver().unwrap();
    let client = rig::kube_client(api.node_kubeconfig(node)).await?;
    Api::<Node>::all(client.clone())
        .create(
            &PostParams::default(),
            &from_json(json!({"metadata": {"name": node, "labels": {
                "kubernetes.io/hostname": node, "example.com/keep": "1",
            }}})),
        )
        .await?;
    Ok(client)
}

pub(crate) async fn guest_labels(admin: &Client, node: &str) -> BTreeMap<String, String> {
    Api::<Node>::all(admin.clone())
        .get(node)
        .await
        .unwrap()
        .metadata
        .labels
        .unwrap_or_default()
}

/// Waits until the guest Node's `region`/`zone` are `want` (`None` = no
/// such label) and returns how long that took.
pub(crate) async fn wait_topology(
    admin: &Client,
    node: &str,
    want: (Option<&str>, Option<&str>),
    within: Duration,
) -> Duration {
    let start = Instant::now();
    loop {
        let l = guest_labels(admin, node).await;
        let have = (
            l.get(REGION).map(String::as_str),
            l.get(ZONE).map(String::as_str),
        );
        if have == want {
            assert_eq!(
                l.get("example.com/keep").map(String::as_str),
                Some("1"),
                "{l:?}"
            );
            return start.elapsed();
        }
        assert!(
            start.elapsed() < within,
            "Node {node}: topology {have:?}, wanted {want:?} within {within:?}; labels {l:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

async fn wait_state(
    rx: &mut watch::Receiver<TopologyState>,
    within: Duration,
    pred: impl Fn(&TopologyState) -> bool,
) -> TopologyState {
    let r = tokio::time::timeout(within, rx.wait_for(&pred))
        .await
        .map(|r| r.map(|s| s.clone()));
    match r {
        Ok(Ok(s)) => s,
        _ => panic!(
            "state not reached within {within:?}; last: {:?}",
            *rx.borrow()
        ),
    }
}

/// A relay task driven from the test: the daemon's `run` with its channels.
struct Relay {
    state: watch::Receiver<TopologyState>,
    shutdown: watch::Sender<bool>,
    _guest: watch::Sender<Option<Client>>,
    task: tokio::task::JoinHandle<()>,
}

fn spawn_relay(cloud_config: &Path, vm: &str, node: &str, guest: Option<Client>) -> Relay {
    let cfg = TopologyConfig {
        cloud_config: vec![cloud_config.to_path_buf()],
        vm_name: vm.to_string(),
        keys: hna_contract::k8s_names::DEFAULT_TOPOLOGY_KEYS
            .iter()
            .map(|k| k.to_string())
            .collect(),
        recheck: Duration::from_millis(200),
    };
    let (state_tx, state) = watch::channel(cfg.initial_state());
    let (guest_tx, guest_rx) = watch::channel(guest);
    let (shutdown, shutdown_rx) = watch::channel(false);
    let task = tokio::spawn(topology::run(
        cfg,
        guest_rx,
        node.to_string(),
        state_tx,
        shutdown_rx,
    ));
    Relay {
        state,
        shutdown,
        _guest: guest_tx,
        task,
    }
}

impl Relay {
    async fn stop(self) {
        self.shutdown.send(true).unwrap();
        tokio::time::timeout(Duration::from_secs(5), self.task)
            .await
            .expect("relay stops on shutdown")
            .unwrap();
    }
}

fn labels_follow_the_vmi_across_migration_host_relabel_and_removal() {
    let c = start(&["guest-1", "guest-2"]);
    let started = Instant::now();
    let dir = c.rig.dir().join("topology");
    std::fs::create_dir_all(&dir).unwrap();
    runtime().block_on(async {
        let hv = rig::kube_client(c.harvester.admin_kubeconfig())
            .await
            .unwrap();
        let guest_admin = rig::kube_client(c.rig.apiserver().unwrap().admin_kubeconfig())
            .await
            .unwrap();
        setup_harvester(&hv).await.unwrap();
        // cp-nodes may read Harvester Nodes; cp-vmis has only
        // generate_addon.sh's Role (annotations are its source).
        let full = dir.join("cloud-config-nodes");
        let vmis_only = dir.join("cloud-config-vmis");
        service_account(&hv, &c.harvester, "cp-nodes", true, true, &full)
            .await
            .unwrap();
        service_account(&hv, &c.harvester, "cp-vmis", true, false, &vmis_only)
            .await
            .unwrap();
        create_vmi(&hv, "vm-1", "hv-1", "us-east-1", "us-east-1a")
            .await
            .unwrap();
        create_vmi(&hv, "vm-2", "hv-2", "us-east-1", "us-east-1b")
            .await
            .unwrap();
        let g1 = register_guest_node(&c.rig, "guest-1").await.unwrap();
        let g2 = register_guest_node(&c.rig, "guest-2").await.unwrap();

        let mut r1 = spawn_relay(&full, "vm-1", "guest-1", Some(g1));
        let mut r2 = spawn_relay(&vmis_only, "vm-2", "guest-2", Some(g2));

        // 1. Labels appear.
        let t = wait_topology(
            &guest_admin,
            "guest-1",
            (Some("us-east-1"), Some("us-east-1a")),
            Duration::from_secs(10),
        )
        .await;
        eprintln!("guest-1 labelled {t:?} after the relay started");
        wait_topology(
            &guest_admin,
            "guest-2",
            (Some("us-east-1"), Some("us-east-1b")),
            Duration::from_secs(10),
        )
        .await;
        let s1 = wait_state(&mut r1.state, Duration::from_secs(2), |s| {
            s.reason == Reason::Relayed
        })
        .await;
        assert_eq!(s1.short(), "us-east-1/us-east-1a");
        assert_eq!(s1.source, Some(topology::Source::HostNode));
        assert_eq!(s1.host.as_deref(), Some("hv-1"));
        assert_eq!(s1.vmi.as_deref(), Some("guest-vms/vm-1"));
        assert_eq!(s1.check().status, harvester_node_agent::check::Status::Ok);
        let s2 = wait_state(&mut r2.state, Duration::from_secs(2), |s| {
            s.reason == Reason::Relayed
        })
        .await;
        assert_eq!(s2.short(), "us-east-1/us-east-1b");
        assert_eq!(s2.source, Some(topology::Source::VmiAnnotations));

        // 2. Live migration to hv-3 (another region and zone): Harvester
        // changes status.nodeName and copies the new host's labels.
        let migrated = json!({
            "metadata": {"annotations": {REGION: "us-west-2", ZONE: "us-west-2a"}},
            "status": {"nodeName": "hv-3", "migrationState": {"completed": true}},
        });
        let t0 = Instant::now();
        patch_vmi(&hv, "vm-1", migrated.clone()).await.unwrap();
        patch_vmi(&hv, "vm-2", migrated).await.unwrap();
        wait_topology(
            &guest_admin,
            "guest-1",
            (Some("us-west-2"), Some("us-west-2a")),
            Duration::from_secs(2),
        )
        .await;
        wait_topology(
            &guest_admin,
            "guest-2",
            (Some("us-west-2"), Some("us-west-2a")),
            Duration::from_secs(2),
        )
        .await;
        eprintln!("migration relayed to both Nodes in {:?}", t0.elapsed());
        let s1 = wait_state(&mut r1.state, Duration::from_secs(2), |s| {
            s.host.as_deref() == Some("hv-3") && s.reason == Reason::Relayed
        })
        .await;
        assert_eq!(s1.short(), "us-west-2/us-west-2a");

        // 3. The host is relabelled. guest-1 (may read Nodes) follows at
        // once; guest-2 follows when Harvester updates the VMI annotation.
        let t0 = Instant::now();
        patch_node(
            &hv,
            "hv-3",
            json!({"metadata": {"labels": {ZONE: "us-west-2b"}}}),
        )
        .await
        .unwrap();
        wait_topology(
            &guest_admin,
            "guest-1",
            (Some("us-west-2"), Some("us-west-2b")),
            Duration::from_secs(2),
        )
        .await;
        eprintln!("host relabel relayed in {:?}", t0.elapsed());
        assert_eq!(
            guest_labels(&guest_admin, "guest-2")
                .await
                .get(ZONE)
                .map(String::as_str),
            Some("us-west-2a")
        );
        patch_vmi(
            &hv,
            "vm-2",
            json!({"metadata": {"annotations": {ZONE: "us-west-2b"}}}),
        )
        .await
        .unwrap();
        wait_topology(
            &guest_admin,
            "guest-2",
            (Some("us-west-2"), Some("us-west-2b")),
            Duration::from_secs(2),
        )
        .await;

        // 4. Removal: the zone disappears from the host (guest-1) and from
        // the VMI's annotations (guest-2); the region and other labels stay.
        let t0 = Instant::now();
        patch_node(&hv, "hv-3", json!({"metadata": {"labels": {ZONE: null}}}))
            .await
            .unwrap();
        patch_vmi(
            &hv,
            "vm-2",
            json!({"metadata": {"annotations": {ZONE: null}}}),
        )
        .await
        .unwrap();
        wait_topology(
            &guest_admin,
            "guest-1",
            (Some("us-west-2"), None),
            Duration::from_secs(2),
        )
        .await;
        wait_topology(
            &guest_admin,
            "guest-2",
            (Some("us-west-2"), None),
            Duration::from_secs(2),
        )
        .await;
        eprintln!("removal relayed in {:?}", t0.elapsed());
        let s1 = wait_state(&mut r1.state, Duration::from_secs(2), |s| {
            s.short() == "us-west-2/-"
        })
        .await;
        assert_eq!(s1.reason, Reason::Relayed);

        // 5. Someone edits the guest Node: the relay restores Harvester's
        // value (it watches its Node, too).
        patch_node(
            &guest_admin,
            "guest-1",
            json!({"metadata": {"labels": {REGION: "wrong"}}}),
        )
        .await
        .unwrap();
        wait_topology(
            &guest_admin,
            "guest-1",
            (Some("us-west-2"), None),
            Duration::from_secs(2),
        )
        .await;

        // 6. The VMI goes away: reported, labels left as they are.
        Api::<DynamicObject>::namespaced_with(hv.clone(), NS, &vmi_resource())
            .delete("vm-1", &Default::default())
            .await
            .unwrap();
        let s1 = wait_state(&mut r1.state, Duration::from_secs(2), |s| {
            s.reason == Reason::VmiNotFound
        })
        .await;
        assert!(s1.message.contains("guest-vms/vm-1"), "{}", s1.message);
        assert_eq!(
            guest_labels(&guest_admin, "guest-1")
                .await
                .get(REGION)
                .map(String::as_str),
            Some("us-west-2")
        );

        r1.stop().await;
        r2.stop().await;
    });
    eprintln!("test body took {:?}", started.elapsed());
}

fn problems_are_reported_and_the_relay_keeps_running() {
    let c = start(&["guest-1", "guest-2"]);
    let dir = c.rig.dir().join("topology");
    std::fs::create_dir_all(&dir).unwrap();
    runtime().block_on(async {
        let hv = rig::kube_client(c.harvester.admin_kubeconfig())
            .await
            .unwrap();
        let guest_admin = rig::kube_client(c.rig.apiserver().unwrap().admin_kubeconfig())
            .await
            .unwrap();
        setup_harvester(&hv).await.unwrap();
        create_vmi(&hv, "vm-1", "hv-1", "us-east-1", "us-east-1a")
            .await
            .unwrap();
        let g1 = register_guest_node(&c.rig, "guest-1").await.unwrap();
        register_guest_node(&c.rig, "guest-2").await.unwrap();
        let good = dir.join("good");
        service_account(&hv, &c.harvester, "cp", true, false, &good)
            .await
            .unwrap();
        let nothing = dir.join("no-rbac");
        service_account(&hv, &c.harvester, "cp-nothing", false, false, &nothing)
            .await
            .unwrap();

        // Credentials missing: a clear report, and the task keeps running.
        let missing = dir.join("etc-kubernetes").join("cloud-config");
        let mut r = spawn_relay(&missing, "vm-1", "guest-1", Some(g1.clone()));
        let s = wait_state(&mut r.state, Duration::from_secs(2), |s| {
            s.reason == Reason::NoCloudConfig
        })
        .await;
        assert!(
            s.message.contains(missing.to_str().unwrap()),
            "{}",
            s.message
        );
        let check = s.check();
        assert_eq!(check.name, "topology");
        assert_eq!(check.status, harvester_node_agent::check::Status::Warn);
        assert!(
            check.remediation.contains("generate_addon.sh"),
            "{}",
            check.remediation
        );
        tokio::time::sleep(Duration::from_millis(600)).await;
        assert!(!r.task.is_finished());
        assert_eq!(r.state.borrow().reason, Reason::NoCloudConfig);
        // An unusable file is reported as such.
        std::fs::create_dir_all(missing.parent().unwrap()).unwrap();
        std::fs::write(&missing, "this: [is not a kubeconfig").unwrap();
        wait_state(&mut r.state, Duration::from_secs(2), |s| {
            s.reason == Reason::InvalidCloudConfig
        })
        .await;
        // The file appears (written atomically, as cloud-init or an operator
        // would): picked up and relayed.
        let tmp = dir.join("cc.tmp");
        std::fs::copy(&good, &tmp).unwrap();
        std::fs::rename(&tmp, &missing).unwrap();
        wait_topology(
            &guest_admin,
            "guest-1",
            (Some("us-east-1"), Some("us-east-1a")),
            Duration::from_secs(3),
        )
        .await;
        let s = wait_state(&mut r.state, Duration::from_secs(2), |s| {
            s.reason == Reason::Relayed
        })
        .await;
        assert_eq!(s.cloud_config.as_deref(), Some(missing.as_path()));
        r.stop().await;

        // `check`'s one-shot probe: in sync, then out of sync.
        let cfg = |cc: &Path, vm: &str| TopologyConfig {
            cloud_config: vec![cc.to_path_buf()],
            vm_name: vm.into(),
            keys: hna_contract::k8s_names::DEFAULT_TOPOLOGY_KEYS
                .iter()
                .map(|k| k.to_string())
                .collect(),
            recheck: Duration::from_secs(1),
        };
        let p = topology::probe(
            &cfg(&good, "vm-1"),
            Some(g1.clone()),
            "guest-1",
            Duration::from_secs(5),
        )
        .await;
        assert_eq!(
            (p.reason, p.short().as_str()),
            (Reason::Relayed, "us-east-1/us-east-1a")
        );
        patch_node(
            &guest_admin,
            "guest-1",
            json!({"metadata": {"labels": {ZONE: "elsewhere"}}}),
        )
        .await
        .unwrap();
        let p = topology::probe(
            &cfg(&good, "vm-1"),
            Some(g1.clone()),
            "guest-1",
            Duration::from_secs(5),
        )
        .await;
        assert_eq!(p.reason, Reason::OutOfSync, "{p:?}");
        assert_eq!(
            guest_labels(&guest_admin, "guest-1")
                .await
                .get(ZONE)
                .map(String::as_str),
            Some("elsewhere"),
            "probe is read-only"
        );
        let p = topology::probe(
            &cfg(&missing.with_extension("gone"), "vm-1"),
            None,
            "guest-1",
            Duration::from_secs(5),
        )
        .await;
        assert_eq!(p.reason, Reason::NoCloudConfig);

        // No VMI of that name.
        let mut r = spawn_relay(&good, "vm-404", "guest-1", Some(g1.clone()));
        let s = wait_state(&mut r.state, Duration::from_secs(3), |s| {
            s.reason == Reason::VmiNotFound
        })
        .await;
        assert!(s.message.contains("guest-vms/vm-404"), "{}", s.message);
        r.stop().await;

        // Harvester refuses: a service account without generate_addon's Role.
        let mut r = spawn_relay(&nothing, "vm-1", "guest-1", Some(g1.clone()));
        let s = wait_state(&mut r.state, Duration::from_secs(3), |s| {
            s.reason == Reason::Forbidden
        })
        .await;
        assert!(s.message.starts_with("Harvester"), "{}", s.message);
        assert!(!r.task.is_finished());
        r.stop().await;

        // Only the agent's own Node: guest-1's credentials cannot label
        // guest-2 (NodeRestriction), which is reported.
        let mut r = spawn_relay(&good, "vm-1", "guest-2", Some(g1.clone()));
        let s = wait_state(&mut r.state, Duration::from_secs(3), |s| {
            s.reason == Reason::Forbidden
        })
        .await;
        assert!(s.message.starts_with("guest cluster"), "{}", s.message);
        let l = guest_labels(&guest_admin, "guest-2").await;
        assert!(!l.contains_key(ZONE) && !l.contains_key(REGION), "{l:?}");
        r.stop().await;

        // Before the node joins there is no guest client: waiting, with
        // what will be relayed.
        let mut r = spawn_relay(&good, "vm-1", "guest-1", None);
        let s = wait_state(&mut r.state, Duration::from_secs(3), |s| {
            s.reason == Reason::WaitingForGuestCluster
        })
        .await;
        assert_eq!(s.labels.get(ZONE).map(String::as_str), Some("us-east-1a"));
        // The node joins: the relay corrects the label edited above.
        r._guest.send(Some(g1.clone())).unwrap();
        wait_topology(
            &guest_admin,
            "guest-1",
            (Some("us-east-1"), Some("us-east-1a")),
            Duration::from_secs(3),
        )
        .await;
        r.stop().await;
    });
}

/// The daemon itself (`harvester-node-agent run`), not the task: labels
/// relayed, a migration followed, and the relay visible in `status`,
/// `STATUS=`'s summary and `check topology`.
fn the_daemon_relays_and_reports_topology() {
    let c = start(&["guest-1"]);
    let dir = c.rig.dir().join("daemon");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("config.toml"), "credentials_retry = \"1s\"\n").unwrap();
    let cloud_config = dir.join("cloud-config");
    let node_kubeconfig = c.rig.apiserver().unwrap().node_kubeconfig("guest-1");
    let bin = crate::BIN;
    let common = |cmd: &mut std::process::Command| {
        cmd.arg("--config")
            .arg(dir.join("config.toml"))
            .args([
                "--node-name",
                "guest-1",
                "--vm-name",
                "vm-1",
                "--kubeconfig",
            ])
            .arg(node_kubeconfig)
            .arg("--cloud-config")
            .arg(&cloud_config)
            .arg("--state-dir")
            .arg(dir.join("state"))
            .env("HNA_LOG_TARGET", "stderr");
        // The daemon and `check` probe macvlan on the uplink; as root they
        // would do it on this machine's own interface. Without CAP_NET_ADMIN
        // they cannot change the host's network (the probe fails with EPERM).
        // SAFETY: prctl is async-signal-safe; nothing else runs before exec.
        unsafe {
            std::os::unix::process::CommandExt::pre_exec(cmd, || {
                const CAP_NET_ADMIN: libc::c_ulong = 12;
                if libc::prctl(libc::PR_CAPBSET_DROP, CAP_NET_ADMIN, 0, 0, 0) != 0
                    && libc::geteuid() == 0
                {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
    };
    let socket = dir.join("agent.sock");
    let status = || -> Option<Value> {
        let out = std::process::Command::new(bin)
            .args(["status", "--output", "json", "--socket"])
            .arg(&socket)
            .output()
            .ok()?;
        serde_json::from_slice(&out.stdout).ok()
    };
    runtime().block_on(async {
        let hv = rig::kube_client(c.harvester.admin_kubeconfig())
            .await
            .unwrap();
        let guest_admin = rig::kube_client(c.rig.apiserver().unwrap().admin_kubeconfig())
            .await
            .unwrap();
        setup_harvester(&hv).await.unwrap();
        service_account(&hv, &c.harvester, "cp-nodes", true, true, &cloud_config)
            .await
            .unwrap();
        create_vmi(&hv, "vm-1", "hv-1", "us-east-1", "us-east-1a")
            .await
            .unwrap();
        register_guest_node(&c.rig, "guest-1").await.unwrap();

        let mut cmd = std::process::Command::new(bin);
        cmd.arg("run").arg("--socket").arg(&socket);
        common(&mut cmd);
        let mut daemon = cmd.stderr(std::process::Stdio::null()).spawn().unwrap();

        wait_topology(
            &guest_admin,
            "guest-1",
            (Some("us-east-1"), Some("us-east-1a")),
            Duration::from_secs(20),
        )
        .await;
        patch_vmi(
            &hv,
            "vm-1",
            json!({
                "metadata": {"annotations": {REGION: "us-west-2", ZONE: "us-west-2a"}},
                "status": {"nodeName": "hv-3", "migrationState": {"completed": true}},
            }),
        )
        .await
        .unwrap();
        let t = wait_topology(
            &guest_admin,
            "guest-1",
            (Some("us-west-2"), Some("us-west-2a")),
            Duration::from_secs(2),
        )
        .await;
        eprintln!("the daemon followed the migration in {t:?}");

        let deadline = Instant::now() + Duration::from_secs(10);
        let st = loop {
            let st = status();
            if st.as_ref().is_some_and(|s| {
                s["topology"]["reason"] == "Relayed"
                    && s["summary"]
                        .as_str()
                        .unwrap_or("")
                        .contains("topology us-west-2/us-west-2a")
            }) {
                break st.unwrap();
            }
            assert!(
                Instant::now() < deadline,
                "status never showed the relay: {st:?}"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        };
        assert_eq!(st["node_name"], "guest-1");

        let mut cmd = std::process::Command::new(bin);
        cmd.args(["check", "topology", "--output", "json"]);
        common(&mut cmd);
        let out = cmd.output().unwrap();
        let v: Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(v["checks"][0]["name"], "topology", "{v}");
        assert_eq!(v["checks"][0]["reason"], "Relayed", "{v}");
        assert_eq!(out.status.code(), Some(0));

        nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(daemon.id() as i32),
            nix::sys::signal::Signal::SIGTERM,
        )
        .unwrap();
        assert!(daemon.wait().unwrap().success());
    });
}
