//! `packaging/kubernetes/` against a real API server (the rig's): the
//! manifests apply (dry run, then for real), the LoadBalancerNode schema
//! round-trips `hna_contract::node_object`'s types, and the RBAC holds: the
//! controller (authenticated as the manifests' ServiceAccount) can do what
//! the design needs, including granting each node its own object, and a
//! node can read its object and write its status but nothing else.

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, Result, bail, ensure};
use futures::{StreamExt, TryStreamExt};
use hna_contract::{self, node_object};
use hna_testkit::rig::apiserver::on_runtime;
use hna_testkit::rig::manifests::{self, Manifest, Mode};
use hna_testkit::rig::{self, ApiServer, Rig, RigOptions};
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{Node, Secret, Service};
use k8s_openapi::api::rbac::v1::{ClusterRole, Role, RoleBinding};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{
    Api, DeleteParams, DynamicObject, ListParams, Patch, PatchParams, PostParams, WatchEvent,
    WatchParams,
};
use serde_json::json;

use crate::harness::tests;

tests! {
    apply_and_schema_roundtrip: Root, Iproute2, ApiServer;
    the_real_kubectl_applies_and_explains_them: Root, Iproute2, ApiServer, Kubectl;
    rbac_controller_and_nodes: Root, Iproute2, ApiServer;
    the_controller_cannot_write_what_it_does_not_own: Root, Iproute2, ApiServer;
    the_controller_policy_follows_the_namespace_it_is_installed_in: Root, Iproute2, ApiServer, Kubectl;
}

const NS: &str = hna_contract::DEFAULT_NAMESPACE;
const CRD: &str = "loadbalancernodes.lb.harvester-node-agent.io";
const NODES: [&str; 2] = ["node-1", "node-2"];

fn manifests_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("packaging/kubernetes")
}

fn start_rig() -> Result<Rig> {
    Rig::start(RigOptions {
        guests: 2,
        dhcp: false,
        apiserver: true,
        node_names: NODES.map(String::from).to_vec(),
        ..Default::default()
    })
}

/// The manifests, exactly as written: every kind in them is served by
/// every supported server (the applier fails on one that is not).
fn manifests_for() -> Result<Vec<Manifest>> {
    let all = manifests::load_kustomization(&manifests_dir())?;
    let pdbs: Vec<_> = all
        .iter()
        .filter(|m| m.kind() == "PodDisruptionBudget")
        .map(|m| m.object.types.clone().map(|t| t.api_version))
        .collect();
    ensure!(
        pdbs == [Some("policy/v1".to_string())],
        "expected one policy/v1 PodDisruptionBudget, found {pdbs:?}"
    );
    Ok(all)
}

/// Runs the rig's kubectl; its stdout, or an error with its stderr.
fn kubectl(api: &ApiServer, args: &[&str]) -> Result<String> {
    let out = api.kubectl(args)?;
    ensure!(
        out.status.success(),
        "kubectl {}: {}",
        args.join(" "),
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// `kubectl apply -k packaging/kubernetes` as an operator types it
/// (client-side apply, kustomize built into kubectl), twice; then the
/// server-side variant the kustomization also names; and `kubectl explain`
/// of the CRD.
fn the_real_kubectl_applies_and_explains_them() -> Result<()> {
    let rig = start_rig()?;
    let api = rig.apiserver().expect("started with apiserver");
    let dir = manifests_dir();
    let dir = dir.to_str().context("non-UTF-8 path")?;
    let version = kubectl(api, &["version", "-o", "json"])?;
    let version: serde_json::Value = serde_json::from_str(&version)?;
    ensure!(
        version["clientVersion"]["gitVersion"] == version["serverVersion"]["gitVersion"],
        "kubectl and the server differ: {version}"
    );
    let first = kubectl(api, &["apply", "-k", dir])?;
    println!("$ kubectl apply -k packaging/kubernetes\n{first}");
    let all = manifests_for()?;
    for m in &all {
        let kind = m.kind().to_lowercase();
        ensure!(
            first.contains(&format!("/{} created", m.name())) && first.contains(&kind),
            "{} not created: {first}",
            m.describe()
        );
    }
    // Applying again changes nothing. kubectl says `configured` for some
    // kinds whatever happens (its patch for PodDisruptionBudget's selector
    // and the policy's rules is never empty), so the objects themselves
    // are what counts: everything but their status and what the server's
    // own controllers write beside kubectl (the CRD's Established
    // condition, the admission policy's type check), which lands when it
    // lands and bumps resourceVersion with it.
    let objects = |what: &str| -> Result<Vec<(String, serde_json::Value)>> {
        let list: serde_json::Value =
            serde_json::from_str(&kubectl(api, &["get", "-k", dir, "-o", "json"])?)?;
        let items = list["items"].as_array().context("no items")?;
        ensure!(items.len() == all.len(), "{what}: {} objects", items.len());
        Ok(items
            .iter()
            .map(|o| {
                (
                    format!("{}/{}", o["kind"], o["metadata"]["name"]),
                    as_applied(o),
                )
            })
            .collect())
    };
    let before = objects("after the first apply")?;
    kubectl(api, &["apply", "-k", dir])?;
    let after = objects("after the second apply")?;
    for ((name, was), (_, is)) in before.iter().zip(&after) {
        ensure!(
            was == is,
            "a second apply changed {name}:\nbefore {was}\nafter {is}"
        );
    }
    kubectl(
        api,
        &["apply", "--server-side", "--force-conflicts", "-k", dir],
    )?;

    // The API server publishes a new CRD's schema a moment after
    // accepting it.
    let explain = wait_for_ok(Duration::from_secs(60), || {
        let explain = kubectl(api, &["explain", "loadbalancernodes.status"])?;
        ensure!(
            explain.contains("heartbeat"),
            "schema not yet published: {explain}"
        );
        Ok(explain)
    })?;
    println!("$ kubectl explain loadbalancernodes.status\n{explain}");
    for field in [
        "heartbeat",
        "ready",
        "reason",
        "held",
        "addresses",
        "leases",
        "agentVersion",
    ] {
        ensure!(explain.contains(field), "explain lacks {field}: {explain}");
    }
    ensure!(
        explain.contains("Written by that agent only"),
        "status has no description: {explain}"
    );
    let explain = kubectl(api, &["explain", "loadbalancernodes.spec.assignments"])?;
    ensure!(
        explain.contains("release") && explain.contains("DHCPRELEASE"),
        "{explain}"
    );
    Ok(())
}

/// An object as `kubectl apply` left it: without its status, its
/// resourceVersion and the field records of managers other than kubectl.
fn as_applied(object: &serde_json::Value) -> serde_json::Value {
    let mut object = object.clone();
    if let Some(o) = object.as_object_mut() {
        o.remove("status");
    }
    if let Some(meta) = object["metadata"].as_object_mut() {
        meta.remove("resourceVersion");
        if let Some(fields) = meta.get_mut("managedFields").and_then(|f| f.as_array_mut()) {
            fields.retain(|f| {
                f["manager"]
                    .as_str()
                    .is_some_and(|m| m.starts_with("kubectl"))
            });
        }
    }
    object
}

/// Retries `f` until it succeeds or `deadline` passes; the last error then.
fn wait_for_ok<T>(deadline: Duration, mut f: impl FnMut() -> Result<T>) -> Result<T> {
    let end = std::time::Instant::now() + deadline;
    loop {
        match f() {
            Ok(v) => return Ok(v),
            Err(e) if std::time::Instant::now() >= end => {
                return Err(e.context(format!("still failing after {deadline:?}")));
            }
            Err(_) => std::thread::sleep(Duration::from_millis(250)),
        }
    }
}

/// `r` failed with HTTP status `code`.
fn expect_code<T: std::fmt::Debug>(
    r: std::result::Result<T, kube::Error>,
    code: u16,
    what: &str,
) -> Result<()> {
    match r {
        Err(kube::Error::Api(s)) if s.code == code => Ok(()),
        other => bail!("{what}: expected HTTP {code}, got {other:?}"),
    }
}

fn lbn_api(client: &kube::Client) -> Api<node_object::LoadBalancerNode> {
    Api::namespaced_with(client.clone(), NS, &node_object::api_resource())
}

fn full_spec() -> node_object::Spec {
    node_object::Spec {
        assignments: vec![
            node_object::Assignment {
                service: "default/web".into(),
                uid: "3f2a9c1e-0000-4000-8000-000000000001".into(),
                interface: "hlb-3f2a9c1e".into(),
                mac: "02:11:22:33:44:55".into(),
                client_id: "00686e612f33663261396331".into(),
                hostname: Some("web-lb".into()),
                requested_ip: Some("10.77.0.150".into()),
                uplink: Some("eth1".into()),
                release: true,
            },
            // Only the required fields: the optional ones stay absent.
            node_object::Assignment {
                service: "default/db".into(),
                uid: "8b1d0c2e-0000-4000-8000-000000000002".into(),
                interface: "hlb-8b1d0c2e".into(),
                mac: "02:aa:bb:cc:dd:ee".into(),
                client_id: "00686e612f3862".into(),
                ..Default::default()
            },
        ],
        peers: vec![hna_contract::membership::Peer {
            name: "node-b".into(),
            address: "10.77.0.12:7947".into(),
        }],
    }
}

fn full_status() -> node_object::Status {
    node_object::Status {
        heartbeat: Some("2026-11-22T17:00:00Z".into()),
        heartbeat_period_ms: Some(1000),
        restart_grace_ms: Some(15_000),
        observed_generation: Some(7),
        ready: true,
        reason: "Ready".into(),
        macvlan_ready: true,
        default_uplink: Some("eth0".into()),
        nic_macs: vec!["52:54:00:12:34:56".into()],
        gateway_mac: Some("0a:11:22:33:44:55".into()),
        dhcp_server_macs: Vec::new(),
        gateway_address: Some("10.77.0.1".into()),
        held: 1,
        addresses: "10.77.0.150 (default/web)".into(),
        leases: vec![
            node_object::LeaseReport {
                service: "default/web".into(),
                interface: "hlb-3f2a9c1e".into(),
                state: "BOUND".into(),
                address: Some("10.77.0.150".into()),
                server: Some("10.77.0.1".into()),
                expires: Some("2026-11-22T18:00:00Z".into()),
                mac: "02:11:22:33:44:55".into(),
                message: Some("renewed".into()),
            },
            node_object::LeaseReport {
                service: "default/db".into(),
                interface: "hlb-8b1d0c2e".into(),
                state: "FAILED".into(),
                mac: "02:aa:bb:cc:dd:ee".into(),
                message: Some("no macvlan on eth1".into()),
                ..Default::default()
            },
        ],
        agent_version: "0.1.0".into(),
        conditions: vec![node_object::Condition {
            type_: node_object::READY.into(),
            status: "True".into(),
            observed_generation: Some(7),
            last_transition_time: "2026-11-22T16:59:00Z".into(),
            reason: "Ready".into(),
            message: String::new(),
        }],
        lan: Some(hna_contract::membership::LanReport {
            address: "10.77.0.11:7947".into(),
            network: "10.77.0.0/24".into(),
            down: vec!["node-c".into()],
            hears: vec!["node-b".into()],
            alive: 1,
            unheard: true,
        }),
    }
}

fn new_lbn(node: &str, spec: node_object::Spec) -> node_object::LoadBalancerNode {
    let mut obj = node_object::LoadBalancerNode::new(node, &node_object::api_resource(), spec);
    obj.metadata.namespace = Some(NS.into());
    obj
}

/// `obj` with [`full_status`] (for the printer-column checks).
fn with_status_again(obj: &node_object::LoadBalancerNode) -> node_object::LoadBalancerNode {
    let mut obj = obj.clone();
    obj.status = Some(full_status());
    obj
}

/// A LoadBalancer Service `web` in `default` (as admin).
async fn create_service(admin: &kube::Client) -> Result<()> {
    let svc: Service = serde_json::from_value(json!({
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": { "name": "web", "namespace": "default",
                      "annotations": { "cloudprovider.harvesterhci.io/ipam": "dhcp" } },
        "spec": { "type": "LoadBalancer", "ports": [{ "port": 80, "protocol": "TCP" }] }
    }))?;
    Api::<Service>::namespaced(admin.clone(), "default")
        .create(&PostParams::default(), &svc)
        .await?;
    Ok(())
}

fn ingress_status() -> serde_json::Value {
    json!({ "status": { "loadBalancer": { "ingress": [
        { "ip": "10.77.0.150", "ports": [{ "port": 80, "protocol": "TCP" }] }
    ] } } })
}

fn apply_and_schema_roundtrip() -> Result<()> {
    let rig = start_rig()?;
    let api = rig.apiserver().expect("started with apiserver");
    let all = manifests_for()?;
    on_runtime(|| async {
        let admin = rig::kube_client(api.admin_kubeconfig()).await?;

        // Dry run. A server-side dry run of an object in a namespace that
        // does not exist yet is refused (NamespaceLifecycle), as with
        // `kubectl apply --dry-run=server`: the namespace goes first, for
        // real, then every object (the namespace too) is dry-run.
        ensure!(all[0].kind() == "Namespace" && all[0].name() == NS);
        manifests::apply(&admin, &all[..1], Mode::Apply).await?;
        let answers = manifests::apply(&admin, &all, Mode::DryRun).await?;
        ensure!(answers.len() == all.len());
        for (m, a) in all.iter().zip(&answers) {
            ensure!(
                a.metadata.name.as_deref() == Some(m.name()),
                "dry run of {} answered {:?}",
                m.describe(),
                a.metadata.name
            );
        }
        // ... and stored nothing.
        let crds: Api<CustomResourceDefinition> = Api::all(admin.clone());
        expect_code(crds.get(CRD).await, 404, "CRD after dry run")?;
        let roles: Api<ClusterRole> = Api::all(admin.clone());
        expect_code(
            roles.get("harvester-node-agent-controller").await,
            404,
            "ClusterRole after dry run",
        )?;

        // For real, in order; the CRD Established before the rest.
        manifests::apply(&admin, &all, Mode::Apply).await?;
        let crd = crds.get(CRD).await?;
        let established = crd
            .status
            .and_then(|s| s.conditions)
            .unwrap_or_default()
            .iter()
            .any(|c| c.type_ == "Established" && c.status == "True");
        ensure!(established, "CRD not Established after apply");
        for m in &all {
            let gvk = m.gvk()?;
            let (ar, caps) = kube::discovery::pinned_kind(&admin, &gvk).await?;
            let dyn_api: Api<DynamicObject> = match caps.scope {
                kube::discovery::Scope::Cluster => Api::all_with(admin.clone(), &ar),
                kube::discovery::Scope::Namespaced => Api::namespaced_with(
                    admin.clone(),
                    m.object.metadata.namespace.as_deref().unwrap_or(NS),
                    &ar,
                ),
            };
            dyn_api
                .get(m.name())
                .await
                .with_context(|| format!("{} after apply", m.describe()))?;
        }
        // Applying again changes nothing and fails nothing.
        manifests::apply(&admin, &all, Mode::Apply).await?;
        // A kind the server does not serve stops the apply, named; it is
        // never left out.
        let dir = tempfile::tempdir()?;
        let file = dir.path().join("widget.yaml");
        std::fs::write(
            &file,
            "apiVersion: example.com/v1\nkind: Widget\nmetadata:\n  name: w\n  namespace: default\n",
        )?;
        let widget = manifests::load_file(&file)?;
        match manifests::apply(&admin, &widget, Mode::Apply).await {
            Ok(_) => bail!("an unserved kind was applied without an error"),
            Err(e) => ensure!(
                format!("{e:#}").contains("does not serve example.com/v1 Widget"),
                "{e:#}"
            ),
        }

        // A full object round-trips through the schema: a field the schema
        // names differently from the Rust types would be pruned and come
        // back missing.
        let lbns = lbn_api(&admin);
        let created = lbns
            .create(&PostParams::default(), &new_lbn("node-1", full_spec()))
            .await?;
        ensure!(
            created.status.is_none(),
            "status set on create: {:?}",
            created.status
        );
        let mut with_status = created.clone();
        with_status.status = Some(full_status());
        lbns.replace_status("node-1", &PostParams::default(), &with_status)
            .await?;
        let back = lbns.get("node-1").await?;
        ensure!(
            back.spec == full_spec(),
            "spec came back as {:?}",
            back.spec
        );
        ensure!(
            back.status == Some(full_status()),
            "status came back as {:?}",
            back.status
        );
        // The raw JSON too: every key present, nothing renamed by serde on
        // the way in and out of the same type.
        let raw: Api<DynamicObject> =
            Api::namespaced_with(admin.clone(), NS, &node_object::api_resource());
        let raw = raw.get("node-1").await?;
        ensure!(
            raw.data["spec"] == serde_json::to_value(full_spec())?,
            "raw spec {}",
            raw.data["spec"]
        );
        ensure!(
            raw.data["status"] == serde_json::to_value(full_status())?,
            "raw status {}",
            raw.data["status"]
        );

        // Empty strings are values, not null: an agent that has nothing to
        // report yet writes the defaults (reason "", addresses "", a lease's
        // mac ""), and the server must take them as written.
        let mut empty = lbns.get("node-1").await?;
        let mut defaults = node_object::Status::default();
        defaults.leases.push(node_object::LeaseReport {
            service: "default/web".into(),
            interface: "hlb-3f2a9c1e".into(),
            state: "SELECTING".into(),
            ..Default::default()
        });
        empty.status = Some(defaults.clone());
        lbns.replace_status("node-1", &PostParams::default(), &empty)
            .await
            .map_err(|e| anyhow::anyhow!("status with empty strings: {e:?}"))?;
        let back = lbns.get("node-1").await?;
        ensure!(
            back.status == Some(defaults),
            "status came back as {:?}",
            back.status
        );
        lbns.replace_status("node-1", &PostParams::default(), &with_status_again(&back))
            .await?;

        // The schema refuses what the types could not read back: an
        // assignment without its required clientId.
        let bad: DynamicObject = serde_json::from_value(json!({
            "apiVersion": "lb.harvester-node-agent.io/v1alpha1",
            "kind": "LoadBalancerNode",
            "metadata": { "name": "bad", "namespace": NS },
            "spec": { "assignments": [
                { "service": "a/b", "uid": "u", "interface": "hlb-00000000", "mac": "02:00:00:00:00:01" }
            ] }
        }))?;
        let raw_api: Api<DynamicObject> =
            Api::namespaced_with(admin.clone(), NS, &node_object::api_resource());
        expect_code(
            raw_api.create(&PostParams::default(), &bad).await,
            422,
            "assignment without clientId",
        )?;

        // Printer columns, as the server renders them for `kubectl get lbn`.
        let collection = format!(
            "/apis/{}/{}/namespaces/{NS}/{}",
            node_object::GROUP,
            node_object::VERSION,
            node_object::PLURAL
        );
        let table = get_table(&admin, &collection, "node-1").await?;
        let columns: Vec<&str> = table["columnDefinitions"]
            .as_array()
            .context("no columnDefinitions")?
            .iter()
            .filter_map(|c| c["name"].as_str())
            .collect();
        ensure!(
            columns
                == [
                    "Name",
                    "Ready",
                    "Reason",
                    "Held",
                    "Addresses",
                    "Heartbeat",
                    "Age"
                ],
            "columns {columns:?}"
        );
        let cells = &table["rows"][0]["cells"];
        ensure!(
            cells[0] == "node-1"
                && cells[1] == true
                && cells[2] == "Ready"
                && cells[3] == 1
                && cells[4] == "10.77.0.150 (default/web)",
            "row {cells}"
        );
        // Date columns come back as ages; `<unknown>` would mean the path
        // found nothing or no RFC 3339 date there.
        for (i, column) in [(5, "Heartbeat"), (6, "Age")] {
            ensure!(
                cells[i]
                    .as_str()
                    .is_some_and(|age| !age.is_empty() && age != "<unknown>"),
                "{column} column {}",
                cells[i]
            );
        }

        // The controller writes ports into the Service's ingress: the
        // server keeps them on a status write.
        create_service(&admin).await?;
        let services: Api<Service> = Api::namespaced(admin.clone(), "default");
        services
            .patch_status(
                "web",
                &PatchParams::default(),
                &Patch::Merge(ingress_status()),
            )
            .await?;
        let svc = services.get("web").await?;
        let ingress = svc
            .status
            .and_then(|s| s.load_balancer)
            .and_then(|l| l.ingress)
            .unwrap_or_default();
        ensure!(
            ingress.len() == 1
                && ingress[0].ip.as_deref() == Some("10.77.0.150")
                && ingress[0]
                    .ports
                    .as_ref()
                    .is_some_and(|p| p.len() == 1 && p[0].port == 80),
            "ingress came back as {ingress:?}"
        );
        Ok(())
    })
}

/// GET `collection/name` as a server-side Table (what `kubectl get` shows).
async fn get_table(
    client: &kube::Client,
    collection: &str,
    name: &str,
) -> Result<serde_json::Value> {
    let mut req = kube::core::Request::new(collection).get(name, &Default::default())?;
    req.headers_mut().insert(
        "accept",
        "application/json;as=Table;v=v1;g=meta.k8s.io".parse()?,
    );
    Ok(serde_json::from_str(&client.request_text(req).await?)?)
}

/// The per-node Role and RoleBinding, as the controller creates them.
fn node_role(node: &str) -> Result<(Role, RoleBinding)> {
    let name = node_object::role_name(node);
    let role: Role = serde_json::from_value(json!({
        "metadata": { "name": name, "namespace": NS },
        "rules": [
            { "apiGroups": [node_object::GROUP], "resources": [node_object::PLURAL],
              "resourceNames": [node], "verbs": ["get", "list", "watch"] },
            { "apiGroups": [node_object::GROUP], "resources": [format!("{}/status", node_object::PLURAL)],
              "resourceNames": [node], "verbs": ["get", "update", "patch"] },
            { "apiGroups": [""], "resources": ["secrets"],
              "resourceNames": [hna_contract::membership::SECRET_NAME], "verbs": ["get", "list", "watch"] },
        ]
    }))?;
    let binding: RoleBinding = serde_json::from_value(json!({
        "metadata": { "name": name, "namespace": NS },
        "roleRef": { "apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name },
        "subjects": [{ "apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": node_object::node_user(node) }]
    }))?;
    Ok((role, binding))
}

fn rbac_controller_and_nodes() -> Result<()> {
    let rig = start_rig()?;
    let api = rig.apiserver().expect("started with apiserver");
    on_runtime(|| async {
        let admin = rig::kube_client(api.admin_kubeconfig()).await?;
        let ctrl = rig::kube_client(api.controller_kubeconfig()).await?;
        // Before the manifests the controller may do nothing.
        expect_code(
            lbn_api(&ctrl).list(&ListParams::default()).await,
            403,
            "controller before the manifests",
        )?;
        // The one-call form other tests use.
        manifests::apply_kustomization(&admin, &manifests_dir(), Mode::Apply).await?;
        create_service(&admin).await?;

        // In kube-system it reads the cloud provider's network map, by
        // name (404: not created here), and no other ConfigMap.
        let system_maps: Api<k8s_openapi::api::core::v1::ConfigMap> =
            Api::namespaced(ctrl.clone(), "kube-system");
        expect_code(
            system_maps.get("harvester-nad-mapping").await,
            404,
            "controller reads harvester-nad-mapping",
        )?;
        expect_code(
            system_maps.get("extension-apiserver-authentication").await,
            403,
            "controller reads another kube-system ConfigMap",
        )?;

        // The controller creates each node's object, Role and RoleBinding:
        // the escalation check passes because its own Role holds every
        // verb it grants.
        let lbns = lbn_api(&ctrl);
        let roles: Api<Role> = Api::namespaced(ctrl.clone(), NS);
        let bindings: Api<RoleBinding> = Api::namespaced(ctrl.clone(), NS);
        for node in NODES {
            lbns.create(&PostParams::default(), &new_lbn(node, full_spec()))
                .await
                .with_context(|| format!("controller creates LoadBalancerNode {node}"))?;
            let (role, binding) = node_role(node)?;
            roles
                .create(&PostParams::default(), &role)
                .await
                .with_context(|| format!("controller creates Role for {node}"))?;
            bindings
                .create(&PostParams::default(), &binding)
                .await
                .with_context(|| format!("controller creates RoleBinding for {node}"))?;
        }
        // ... but cannot grant what it does not hold (here: Secrets).
        let mut greedy = node_role("node-1")?.0;
        greedy.metadata.name = Some("greedy".into());
        greedy
            .rules
            .get_or_insert_default()
            .push(serde_json::from_value(
                json!({ "apiGroups": [""], "resources": ["secrets"], "verbs": ["get"] }),
            )?);
        expect_code(
            roles.create(&PostParams::default(), &greedy).await,
            403,
            "controller granting Secrets",
        )?;

        // What the controller's work needs.
        let ctrl_services: Api<Service> = Api::namespaced(ctrl.clone(), "default");
        ctrl_services.list(&ListParams::default()).await?;
        ctrl_services
            .patch_status(
                "web",
                &PatchParams::default(),
                &Patch::Merge(ingress_status()),
            )
            .await
            .context("controller patches Service status")?;
        ctrl_services
            .patch(
                "web",
                &PatchParams::default(),
                &Patch::Merge(json!({ "metadata": {
                    "finalizers": [hna_contract::FINALIZER],
                    "annotations": { "kube-vip.io/hwaddr": "02:11:22:33:44:55" }
                } })),
            )
            .await
            .context("controller patches Service metadata")?;
        // Status first, then the Service's metadata (as the controller
        // does): the ports stay.
        let ingress = Api::<Service>::namespaced(admin.clone(), "default")
            .get("web")
            .await?
            .status
            .and_then(|s| s.load_balancer)
            .and_then(|l| l.ingress)
            .unwrap_or_default();
        ensure!(
            ingress.len() == 1 && ingress[0].ports.as_ref().is_some_and(|p| p.len() == 1),
            "ingress after the metadata patch: {ingress:?}"
        );
        let core_event: k8s_openapi::api::core::v1::Event = serde_json::from_value(json!({
            "metadata": { "name": "web.hna-1", "namespace": "default" },
            "involvedObject": { "kind": "Service", "namespace": "default", "name": "web", "apiVersion": "v1" },
            "reason": "AddressAssigned", "message": "10.77.0.150 on node-1", "type": "Normal",
            "source": { "component": "harvester-node-agent-controller" }
        }))?;
        Api::<k8s_openapi::api::core::v1::Event>::namespaced(ctrl.clone(), "default")
            .create(&PostParams::default(), &core_event)
            .await
            .context("controller creates a core/v1 Event")?;
        let new_event: k8s_openapi::api::events::v1::Event = serde_json::from_value(json!({
            "metadata": { "name": "web.hna-2", "namespace": "default" },
            "eventTime": "2026-11-22T17:00:00.000000Z",
            "regarding": { "kind": "Service", "namespace": "default", "name": "web", "apiVersion": "v1" },
            "reason": "AddressAssigned", "note": "10.77.0.150 on node-1", "type": "Normal",
            "action": "Assign", "reportingController": "harvester-node-agent.io/controller",
            "reportingInstance": "controller-0"
        }))?;
        Api::<k8s_openapi::api::events::v1::Event>::namespaced(ctrl.clone(), "default")
            .create(&PostParams::default(), &new_event)
            .await
            .context("controller creates an events.k8s.io/v1 Event")?;
        let leases: Api<Lease> = Api::namespaced(ctrl.clone(), NS);
        let lease: Lease = serde_json::from_value(json!({
            "metadata": { "name": hna_contract::CONTROLLER_LEASE, "namespace": NS },
            "spec": { "holderIdentity": "controller-0", "leaseDurationSeconds": 15 }
        }))?;
        leases.create(&PostParams::default(), &lease).await?;
        leases
            .patch(
                hna_contract::CONTROLLER_LEASE,
                &PatchParams::default(),
                &Patch::Merge(json!({ "spec": { "holderIdentity": "controller-1" } })),
            )
            .await
            .context("controller renews its Lease")?;
        Api::<Node>::all(ctrl.clone())
            .list(&ListParams::default())
            .await
            .context("controller lists Nodes")?;
        Api::<k8s_openapi::api::core::v1::Endpoints>::all(ctrl.clone())
            .list(&ListParams::default())
            .await
            .context("controller lists Endpoints")?;

        // What an admin may do and the controller may not.
        let node: Node = serde_json::from_value(json!({ "metadata": { "name": "node-1" } }))?;
        Api::<Node>::all(admin.clone())
            .create(&PostParams::default(), &node)
            .await?;
        expect_code(
            Api::<Node>::all(ctrl.clone())
                .delete("node-1", &DeleteParams::default())
                .await,
            403,
            "controller deletes a Node",
        )?;
        expect_code(
            Api::<Secret>::namespaced(ctrl.clone(), NS)
                .list(&ListParams::default())
                .await,
            403,
            "controller lists Secrets",
        )?;
        // It creates the membership key, and no other Secret.
        let secrets = Api::<Secret>::namespaced(ctrl.clone(), NS);
        let key_secret = |name: &str| -> Result<Secret> {
            Ok(serde_json::from_value(json!({
                "metadata": { "name": name, "namespace": NS },
                "data": { hna_contract::membership::SECRET_KEY: "AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA=" },
            }))?)
        };
        secrets
            .create(
                &PostParams::default(),
                &key_secret(hna_contract::membership::SECRET_NAME)?,
            )
            .await
            .context("controller creates the membership key")?;
        expect_code(
            secrets
                .create(&PostParams::default(), &key_secret("something-else")?)
                .await,
            403,
            "controller creates another Secret",
        )?;
        expect_code(
            Api::<Lease>::namespaced(ctrl.clone(), "kube-system")
                .create(&PostParams::default(), &{
                    let mut l = lease.clone();
                    l.metadata.namespace = Some("kube-system".into());
                    l
                })
                .await,
            403,
            "controller creates a Lease outside its namespace",
        )?;
        expect_code(
            ctrl_services.delete("web", &DeleteParams::default()).await,
            403,
            "controller deletes a Service",
        )?;

        // node-1 with its kubelet-like credentials.
        let n1 = rig::kube_client(api.node_kubeconfig("node-1")).await?;
        let node_secrets = Api::<Secret>::namespaced(n1.clone(), NS);
        node_secrets
            .get(hna_contract::membership::SECRET_NAME)
            .await
            .context("node-1 reads the membership key")?;
        node_secrets
            .list(&ListParams::default().fields(&format!(
                "metadata.name={}",
                hna_contract::membership::SECRET_NAME
            )))
            .await
            .context("node-1 lists the membership key by name (its watch)")?;
        expect_code(
            node_secrets.list(&ListParams::default()).await,
            403,
            "node-1 lists every Secret",
        )?;
        let own = lbn_api(&n1);
        let obj = own.get("node-1").await.context("node-1 gets its object")?;
        ensure!(obj.spec == full_spec());
        let by_name = ListParams::default().fields("metadata.name=node-1");
        let listed = own
            .list(&by_name)
            .await
            .context("node-1 lists its object by metadata.name")?;
        ensure!(
            listed.items.len() == 1 && listed.items[0].metadata.name.as_deref() == Some("node-1"),
            "list by name: {:?}",
            listed
                .items
                .iter()
                .map(|o| &o.metadata.name)
                .collect::<Vec<_>>()
        );
        expect_code(
            own.list(&ListParams::default()).await,
            403,
            "node-1 lists all objects",
        )?;
        expect_code(
            own.list(&ListParams::default().fields("metadata.name=node-2"))
                .await,
            403,
            "node-1 lists node-2's object by name",
        )?;
        // Watch by name: opened, and an event arrives when the controller
        // changes the spec.
        let rv = listed
            .metadata
            .resource_version
            .clone()
            .context("list without resourceVersion")?;
        let watch = WatchParams::default().fields("metadata.name=node-1");
        let mut events = own
            .watch(&watch, &rv)
            .await
            .context("node-1 watches its object by metadata.name")?
            .boxed();
        expect_code(
            own.watch(&WatchParams::default(), &rv).await.map(|_| ()),
            403,
            "node-1 watches all objects",
        )?;
        lbns.patch(
            "node-1",
            &PatchParams::default(),
            &Patch::Merge(json!({ "spec": { "assignments": [] } })),
        )
        .await
        .context("controller empties node-1's assignments")?;
        let event = tokio::time::timeout(Duration::from_secs(20), events.try_next())
            .await
            .context("no watch event within 20 s")??;
        match event {
            Some(WatchEvent::Modified(o)) => ensure!(
                o.metadata.name.as_deref() == Some("node-1") && o.spec.assignments.is_empty(),
                "modified event {o:?}"
            ),
            other => bail!("node-1's watch: expected Modified, got {other:?}"),
        }

        // Its own status: patch and update.
        let status_patch = json!({ "status": { "heartbeat": "2026-11-22T17:00:05Z", "ready": true, "reason": "Ready" } });
        own.patch_status(
            "node-1",
            &PatchParams::default(),
            &Patch::Merge(&status_patch),
        )
        .await
        .context("node-1 patches its status")?;
        let mut current = own.get_status("node-1").await?;
        ensure!(
            current.status.as_ref().and_then(|s| s.heartbeat.as_deref())
                == Some("2026-11-22T17:00:05Z"),
            "status after patch: {:?}",
            current.status
        );
        current.status = Some(full_status());
        own.replace_status("node-1", &PostParams::default(), &current)
            .await
            .context("node-1 updates (PUT) its status")?;

        // Nothing else.
        expect_code(
            own.patch(
                "node-1",
                &PatchParams::default(),
                &Patch::Merge(json!({ "spec": { "assignments": [] } })),
            )
            .await,
            403,
            "node-1 patches its spec",
        )?;
        expect_code(own.get("node-2").await, 403, "node-1 gets node-2's object")?;
        expect_code(
            own.get_status("node-2").await,
            403,
            "node-1 gets node-2's status",
        )?;
        expect_code(
            own.patch_status(
                "node-2",
                &PatchParams::default(),
                &Patch::Merge(&status_patch),
            )
            .await,
            403,
            "node-1 patches node-2's status",
        )?;
        expect_code(
            own.create(
                &PostParams::default(),
                &new_lbn("node-1b", Default::default()),
            )
            .await,
            403,
            "node-1 creates a LoadBalancerNode",
        )?;
        expect_code(
            own.delete("node-1", &DeleteParams::default()).await,
            403,
            "node-1 deletes its object",
        )?;
        expect_code(
            Api::<Service>::namespaced(n1.clone(), "default")
                .patch_status(
                    "web",
                    &PatchParams::default(),
                    &Patch::Merge(ingress_status()),
                )
                .await,
            403,
            "node-1 patches a Service's status",
        )?;
        expect_code(
            Api::<Role>::namespaced(n1.clone(), NS)
                .get(&node_object::role_name("node-1"))
                .await,
            403,
            "node-1 reads its Role",
        )?;

        // node-2's Role works for node-2 (not only for node-1).
        let n2 = rig::kube_client(api.node_kubeconfig("node-2")).await?;
        lbn_api(&n2)
            .patch_status(
                "node-2",
                &PatchParams::default(),
                &Patch::Merge(&status_patch),
            )
            .await
            .context("node-2 patches its status")?;
        expect_code(
            lbn_api(&n2).get("node-1").await,
            403,
            "node-2 gets node-1's object",
        )?;
        // The spec the controller wrote is untouched by all of the above.
        let spec = lbns.get("node-2").await?.spec;
        ensure!(spec == full_spec(), "node-2's spec changed: {spec:?}");
        Ok(())
    })
}

/// `controller-policy.yaml`: with the controller's own credentials (as a
/// stolen token would be used), a Service write beyond its finalizer and
/// kube-vip's record, and a Role or RoleBinding beyond one node's access to
/// its own object, are refused at admission, although RBAC allows them.
fn the_controller_cannot_write_what_it_does_not_own() -> Result<()> {
    let rig = start_rig()?;
    let api = rig.apiserver().expect("started with apiserver");
    on_runtime(|| async {
        let admin = rig::kube_client(api.admin_kubeconfig()).await?;
        let ctrl = rig::kube_client(api.controller_kubeconfig()).await?;
        manifests::apply_kustomization(&admin, &manifests_dir(), Mode::Apply).await?;
        create_service(&admin).await?;
        let services: Api<Service> = Api::namespaced(ctrl.clone(), "default");
        let denied = |r: std::result::Result<Service, kube::Error>, what: &str| match r {
            Err(kube::Error::Api(s))
                if s.message.contains("harvester-node-agent-controller-writes") =>
            {
                Ok(())
            }
            other => Err(anyhow::anyhow!(
                "{what}: not refused by the policy: {other:?}"
            )),
        };
        let spec_change = json!({ "spec": { "externalTrafficPolicy": "Local" } });
        // The policy is enforced once the API server has loaded it: a dry
        // run of a refused write is the handshake.
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        loop {
            let r = services
                .patch(
                    "web",
                    &PatchParams::default().dry_run(),
                    &Patch::Merge(&spec_change),
                )
                .await;
            if denied(r, "").is_ok() {
                break;
            }
            ensure!(
                std::time::Instant::now() < deadline,
                "the controller policy was never enforced"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let before = Api::<Service>::namespaced(admin.clone(), "default")
            .get("web")
            .await?;
        for (what, patch) in [
            ("spec", spec_change.clone()),
            (
                "a label",
                json!({ "metadata": { "labels": { "team": "x" } } }),
            ),
            (
                "another annotation",
                json!({ "metadata": { "annotations": { "example.com/owner": "x" } } }),
            ),
            (
                "another finalizer",
                json!({ "metadata": { "finalizers": ["example.com/hold"] } }),
            ),
        ] {
            denied(
                services
                    .patch("web", &PatchParams::default(), &Patch::Merge(&patch))
                    .await,
                what,
            )?;
        }
        let after = Api::<Service>::namespaced(admin.clone(), "default")
            .get("web")
            .await?;
        ensure!(
            after.metadata.resource_version == before.metadata.resource_version,
            "the Service changed"
        );
        // What it owns it may still write.
        services
            .patch(
                "web",
                &PatchParams::default(),
                &Patch::Merge(json!({ "metadata": {
                    "finalizers": [hna_contract::FINALIZER],
                    "annotations": { "kube-vip.io/vipHost": "node-1" }
                } })),
            )
            .await
            .context("the controller's own record")?;

        let roles: Api<Role> = Api::namespaced(ctrl.clone(), NS);
        let bindings: Api<RoleBinding> = Api::namespaced(ctrl.clone(), NS);
        let refused = |r: std::result::Result<(), kube::Error>, what: &str| match r {
            Err(kube::Error::Api(s))
                if s.message.contains("harvester-node-agent-controller-writes") =>
            {
                Ok(())
            }
            other => Err(anyhow::anyhow!(
                "{what}: not refused by the policy: {other:?}"
            )),
        };
        // node-1's Role granting node-2's object; the same rules under
        // another name; and the controller's own Role bound to a stranger:
        // all within its RBAC (no escalation), all refused.
        let (mut wide, _) = node_role("node-1")?;
        for rule in wide
            .rules
            .iter_mut()
            .flatten()
            .filter(|r| r.api_groups == Some(vec![node_object::GROUP.to_string()]))
        {
            rule.resource_names = Some(vec!["node-1".into(), "node-2".into()]);
        }
        refused(
            roles.create(&PostParams::default(), &wide).await.map(drop),
            "a node Role naming another node's object",
        )?;
        let (mut renamed, _) = node_role("node-1")?;
        renamed.metadata.name = Some("anything".into());
        refused(
            roles
                .create(&PostParams::default(), &renamed)
                .await
                .map(drop),
            "a Role of another name",
        )?;
        let stranger: RoleBinding = serde_json::from_value(json!({
            "metadata": { "name": node_object::role_name("node-1"), "namespace": NS },
            "roleRef": { "apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                         "name": "harvester-node-agent-controller" },
            "subjects": [{ "apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": "mallory" }]
        }))?;
        refused(
            bindings
                .create(&PostParams::default(), &stranger)
                .await
                .map(drop),
            "its own Role bound to another user",
        )?;
        // A node's own access, as the controller grants it, passes.
        let (role, binding) = node_role("node-1")?;
        roles.create(&PostParams::default(), &role).await?;
        bindings.create(&PostParams::default(), &binding).await?;
        // Issue #29: owned by nothing, deleted only in the node's shape.
        let mut owned = role.clone();
        owned.metadata.name = Some(node_object::role_name("node-2"));
        owned.metadata.owner_references = Some(vec![serde_json::from_value(json!({
            "apiVersion": "v1", "kind": "Namespace", "name": "kube-system",
            "uid": "00000000-0000-0000-0000-000000000001",
        }))?]);
        refused(
            roles.create(&PostParams::default(), &owned).await.map(drop),
            "a node Role with an owner",
        )?;
        refused(
            roles
                .delete("harvester-node-agent-controller", &DeleteParams::default())
                .await
                .map(drop),
            "deleting a Role that is no node's",
        )?;
        refused(
            bindings
                .delete("harvester-node-agent-controller", &DeleteParams::default())
                .await
                .map(drop),
            "deleting a RoleBinding that is no node's",
        )?;
        bindings
            .delete(&node_object::role_name("node-1"), &DeleteParams::default())
            .await
            .context("deleting a node's RoleBinding")?;
        roles
            .delete(&node_object::role_name("node-1"), &DeleteParams::default())
            .await
            .context("deleting a node's Role")?;

        // Issue #29: the status only of Services it serves.
        let other: Service = serde_json::from_value(json!({
            "apiVersion": "v1", "kind": "Service",
            "metadata": { "name": "metallb-web", "namespace": "default" },
            "spec": { "type": "LoadBalancer", "loadBalancerClass": "metallb.io/metallb",
                      "ports": [{ "port": 80, "protocol": "TCP" }] }
        }))?;
        let pool: Service = serde_json::from_value(json!({
            "apiVersion": "v1", "kind": "Service",
            "metadata": { "name": "pool-web", "namespace": "default" },
            "spec": { "type": "LoadBalancer", "ports": [{ "port": 80, "protocol": "TCP" }] }
        }))?;
        let admin_services = Api::<Service>::namespaced(admin.clone(), "default");
        admin_services
            .create(&PostParams::default(), &other)
            .await?;
        admin_services.create(&PostParams::default(), &pool).await?;
        for name in ["metallb-web", "pool-web"] {
            denied(
                services
                    .patch_status(
                        name,
                        &PatchParams::default(),
                        &Patch::Merge(ingress_status()),
                    )
                    .await,
                &format!("the status of {name}"),
            )?;
            // Nor can it make one "held" first with its finalizer.
            denied(
                services
                    .patch(
                        name,
                        &PatchParams::default(),
                        &Patch::Merge(
                            json!({ "metadata": { "finalizers": [hna_contract::FINALIZER] } }),
                        ),
                    )
                    .await,
                &format!("its finalizer on {name}"),
            )?;
        }
        services
            .patch_status(
                "web",
                &PatchParams::default(),
                &Patch::Merge(ingress_status()),
            )
            .await
            .context("the status of a Service it serves")?;
        // Its own condition there, as the controller writes it; never
        // another component's.
        let condition = |type_: &str| {
            json!({ "status": { "conditions": [{
                "type": type_, "status": "True", "observedGeneration": 1,
                "lastTransitionTime": "2026-11-28T10:00:00Z",
                "reason": "AddressAssigned", "message": "10.77.0.150"
            }] } })
        };
        services
            .patch_status(
                "web",
                &PatchParams::default(),
                &Patch::Strategic(condition(hna_contract::SERVICE_CONDITION)),
            )
            .await
            .context("its own condition on a Service it serves")?;
        denied(
            services
                .patch_status(
                    "web",
                    &PatchParams::default(),
                    &Patch::Strategic(condition("cilium.io/IPAMRequestSatisfied")),
                )
                .await,
            "another component's condition on a Service it serves",
        )?;
        denied(
            services
                .patch_status(
                    "metallb-web",
                    &PatchParams::default(),
                    &Patch::Strategic(condition(hna_contract::SERVICE_CONDITION)),
                )
                .await,
            "its condition on another class's Service",
        )?;
        denied(
            services
                .patch(
                    "web",
                    &PatchParams::default(),
                    &Patch::Merge(json!({ "metadata": { "ownerReferences": [{
                        "apiVersion": "v1", "kind": "Namespace", "name": "kube-system",
                        "uid": "00000000-0000-0000-0000-000000000001" }] } })),
                )
                .await,
            "ownerReferences on a Service",
        )?;

        // Issue #29: a LoadBalancerNode's assignments name no MAC of
        // another host and no uplink that is not a card.
        let lbns = lbn_api(&admin);
        let mut status_of = new_lbn("node-2", node_object::Spec::default());
        lbns.create(&PostParams::default(), &status_of).await?;
        status_of = lbns.get("node-2").await?;
        status_of.status = Some(node_object::Status {
            nic_macs: vec!["52:54:00:00:00:02".into()],
            gateway_mac: Some("0a:11:22:33:44:55".into()),
            ..Default::default()
        });
        lbns.replace_status("node-2", &PostParams::default(), &status_of)
            .await?;
        let ctrl_lbns = lbn_api(&ctrl);
        let refused_spec = |r: std::result::Result<node_object::LoadBalancerNode, kube::Error>,
                            what: &str| match r {
            Err(kube::Error::Api(s))
                if s.message.contains("harvester-node-agent-controller-writes") =>
            {
                Ok(())
            }
            other => Err(anyhow::anyhow!(
                "{what}: not refused by the policy: {other:?}"
            )),
        };
        let assign = |mac: &str, uplink: Option<&str>| {
            let mut a = full_spec().assignments[0].clone();
            a.mac = mac.into();
            a.uplink = uplink.map(str::to_string);
            json!({ "spec": { "assignments": [a] } })
        };
        for (what, patch) in [
            (
                "the node's own card's MAC",
                assign("52:54:00:00:00:02", None),
            ),
            ("the gateway's MAC", assign("0a:11:22:33:44:55", None)),
            ("a multicast MAC", assign("01:00:5e:00:00:01", None)),
            ("an all-zero MAC", assign("00:00:00:00:00:00", None)),
            (
                "loopback as the uplink",
                assign("02:11:22:33:44:55", Some("lo")),
            ),
            (
                "a macvlan of ours as the uplink",
                assign("02:11:22:33:44:55", Some("hlb-aaaaaaaa")),
            ),
        ] {
            refused_spec(
                ctrl_lbns
                    .patch("node-2", &PatchParams::default(), &Patch::Merge(&patch))
                    .await,
                what,
            )?;
        }
        ctrl_lbns
            .patch(
                "node-2",
                &PatchParams::default(),
                &Patch::Merge(&assign("02:11:22:33:44:55", Some("eth1"))),
            )
            .await
            .context("an assignment as the controller writes one")?;
        Ok(())
    })
}

/// Issue #29: the controller's admission policy follows the namespace it
/// is installed in. The real kubectl applies the kustomize base through an
/// overlay with `namespace: lb-system`; with a token of the
/// ServiceAccount there (a TokenRequest), a Role outside a node's shape
/// and the status of a Service it does not serve are refused by the
/// policy, while a node's own Role in lb-system passes.
fn the_controller_policy_follows_the_namespace_it_is_installed_in() -> Result<()> {
    const HOME: &str = "lb-system";
    let rig = start_rig()?;
    let api = rig.apiserver().expect("started with apiserver");
    let overlay = tempfile::tempdir()?;
    std::fs::write(
        overlay.path().join("kustomization.yaml"),
        format!(
            "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\nnamespace: {HOME}\nresources:\n- {}\n",
            relative(overlay.path(), &manifests_dir())?.display()
        ),
    )?;
    let overlay_dir = overlay.path().to_str().context("utf-8 path")?;
    kubectl(api, &["apply", "--server-side", "-k", overlay_dir])?;
    on_runtime(|| async {
        let admin = rig::kube_client(api.admin_kubeconfig()).await?;
        create_service(&admin).await?;
        let pool: Service = serde_json::from_value(json!({
            "apiVersion": "v1", "kind": "Service",
            "metadata": { "name": "pool-web", "namespace": "default" },
            "spec": { "type": "LoadBalancer", "ports": [{ "port": 80, "protocol": "TCP" }] }
        }))?;
        Api::<Service>::namespaced(admin.clone(), "default")
            .create(&PostParams::default(), &pool)
            .await?;
        let sas: Api<k8s_openapi::api::core::v1::ServiceAccount> =
            Api::namespaced(admin.clone(), HOME);
        let request: k8s_openapi::api::authentication::v1::TokenRequest =
            serde_json::from_value(json!({ "spec": { "audiences": [] } }))?;
        let token = sas
            .create_token_request(
                "harvester-node-agent-controller",
                &PostParams::default(),
                &request,
            )
            .await
            .context("a token of the controller's ServiceAccount in lb-system")?
            .status
            .context("TokenRequest without status")?
            .token;
        let kubeconfig = overlay.path().join("controller.kubeconfig");
        std::fs::write(
            &kubeconfig,
            serde_json::to_vec(&json!({
                "apiVersion": "v1", "kind": "Config",
                "clusters": [{ "name": "rig", "cluster": {
                    "server": api.url(), "certificate-authority": api.ca_path() } }],
                "users": [{ "name": "ctrl", "user": { "token": token } }],
                "contexts": [{ "name": "ctrl", "context": { "cluster": "rig", "user": "ctrl" } }],
                "current-context": "ctrl",
            }))?,
        )?;
        let ctrl = rig::kube_client(&kubeconfig).await?;
        let policy_refused = |r: std::result::Result<(), kube::Error>| match r {
            Err(kube::Error::Api(s))
                if s.message.contains("harvester-node-agent-controller-writes") =>
            {
                Ok(())
            }
            other => Err(anyhow::anyhow!("not refused by the policy: {other:?}")),
        };
        let services: Api<Service> = Api::namespaced(ctrl.clone(), "default");
        // The policy is enforced once loaded: its refusal is the handshake.
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        loop {
            let r = services
                .patch_status(
                    "pool-web",
                    &PatchParams::default().dry_run(),
                    &Patch::Merge(ingress_status()),
                )
                .await
                .map(drop);
            if policy_refused(r).is_ok() {
                break;
            }
            ensure!(
                std::time::Instant::now() < deadline,
                "the controller policy never refused the lb-system controller's write"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        services
            .patch_status(
                "web",
                &PatchParams::default(),
                &Patch::Merge(ingress_status()),
            )
            .await
            .context("the status of a Service it serves")?;
        let roles: Api<Role> = Api::namespaced(ctrl.clone(), HOME);
        let (mut role, _) = node_role("node-1")?;
        role.metadata.namespace = Some(HOME.into());
        let mut renamed = role.clone();
        renamed.metadata.name = Some("anything".into());
        policy_refused(
            roles
                .create(&PostParams::default(), &renamed)
                .await
                .map(drop),
        )
        .context("a Role of another name in lb-system")?;
        roles
            .create(&PostParams::default(), &role)
            .await
            .context("a node's own Role in lb-system")?;
        Ok(())
    })
}

/// `to` as a path relative to `from` (both absolute).
fn relative(from: &Path, to: &Path) -> Result<PathBuf> {
    let from = from.canonicalize()?;
    let to = to.canonicalize()?;
    let common = from
        .components()
        .zip(to.components())
        .take_while(|(a, b)| a == b)
        .count();
    let mut out = PathBuf::new();
    for _ in from.components().skip(common) {
        out.push("..");
    }
    for c in to.components().skip(common) {
        out.push(c);
    }
    Ok(out)
}
