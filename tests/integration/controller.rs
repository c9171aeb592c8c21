//! The controller binary against the rig's real kube-apiserver (Node
//! and RBAC authorization, NodeRestriction): it creates a LoadBalancerNode
//! and a Role for each Node, gives a DHCP Service a holder, writes the
//! Service's status and kube-vip's annotations once the holder reports the
//! lease BOUND, and on delete waits for the release before letting the
//! Service go. The node agents are played by the test with the nodes' own
//! credentials, so the per-node Roles the controller creates are proven
//! too: a node writes its own object's status, and nothing else.

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use hna_contract::{self, node_object};
use hna_testkit::rig::{self, Rig, RigOptions};
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{Namespace, Node, Service};
use k8s_openapi::api::events::v1::Event;
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{DeleteParams, DynamicObject, Patch, PatchParams, PostParams};
use kube::{Api, Client};
use serde_json::{Value, json};

use crate::BIN;
use crate::harness::tests;

tests! {
    a_dhcp_service_gets_its_holders_address_and_is_released_on_delete: Root, Iproute2, ApiServer;
    a_write_decided_on_an_old_version_is_refused: Root, Iproute2, ApiServer;
    a_nodes_status_does_not_refuse_a_spec_write_but_a_newer_spec_does: Root, Iproute2, ApiServer;
}

const NS: &str = hna_contract::DEFAULT_NAMESPACE;

struct Controller(Child);
impl Drop for Controller {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn from_json<T: serde::de::DeserializeOwned>(v: Value) -> T {
    serde_json::from_value(v).expect("test object")
}

/// Polls `probe` until it returns `Some`, failing after `within` with the
/// last thing it saw.
async fn wait_for<T, F, Fut>(what: &str, within: Duration, mut probe: F) -> Result<T>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<Option<T>>>,
{
    let deadline = Instant::now() + within;
    let mut last = String::from("nothing yet");
    loop {
        match probe().await {
            Ok(Some(v)) => return Ok(v),
            Ok(None) => {}
            Err(e) => last = format!("{e:#}"),
        }
        if Instant::now() > deadline {
            bail!("{what}: not within {within:?} (last error: {last})");
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// GET /metrics.
async fn get_metrics(addr: &str) -> Result<String> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut c = tokio::net::TcpStream::connect(addr).await?;
    c.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
        .await?;
    let mut out = String::new();
    c.read_to_string(&mut out).await?;
    Ok(out)
}

/// A minimal stand-in for the manifests' CRD: the controller only needs
/// the resource, the status subresource and the fields kept.
async fn install_crd(admin: &Client) -> Result<()> {
    let crds: Api<CustomResourceDefinition> = Api::all(admin.clone());
    let name = format!("{}.{}", node_object::PLURAL, node_object::GROUP);
    crds.create(
        &PostParams::default(),
        &from_json(json!({
            "apiVersion": "apiextensions.k8s.io/v1",
            "kind": "CustomResourceDefinition",
            "metadata": {"name": name},
            "spec": {
                "group": node_object::GROUP,
                "names": {"kind": node_object::KIND, "plural": node_object::PLURAL, "singular": "loadbalancernode"},
                "scope": "Namespaced",
                "versions": [{
                    "name": node_object::VERSION, "served": true, "storage": true,
                    "subresources": {"status": {}},
                    "schema": {"openAPIV3Schema": {"type": "object", "x-kubernetes-preserve-unknown-fields": true}},
                }],
            },
        })),
    )
    .await
    .context("create CRD")?;
    wait_for("CRD established", Duration::from_secs(30), || async {
        let crd = crds.get(&name).await?;
        let established = crd
            .status
            .and_then(|s| s.conditions)
            .unwrap_or_default()
            .iter()
            .any(|c| c.type_ == "Established" && c.status == "True");
        Ok(established.then_some(()))
    })
    .await
}

fn start_controller(kubeconfig: &Path, log: &Path, metrics: &str) -> Result<Controller> {
    let child = Command::new(BIN)
        .args(["controller", "--kubeconfig"])
        .arg(kubeconfig)
        .args(["--metrics-listen", metrics])
        .args([
            "--namespace",
            NS,
            "--identity",
            "controller-test-1",
            "--credentials-retry",
            "1s",
            "--lease-duration",
            "3s",
            "--renew-deadline",
            "2s",
            "--retry-period",
            "500ms",
            "--node-stale-after",
            "5s",
            "--service-failed-after",
            "2s",
            "--log-target",
            "stderr",
            "--log-level",
            "debug,kube=info,hyper=info,tower=info,rustls=info",
        ])
        .env_remove("NOTIFY_SOCKET")
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(log)?)
        .spawn()
        .context("start controller")?;
    Ok(Controller(child))
}

/// The agent of `node`, as far as the controller sees it: a status written
/// with the node's own credentials.
#[derive(Clone)]
struct FakeAgent {
    api: Api<DynamicObject>,
    node: String,
    beats: std::sync::Arc<std::sync::atomic::AtomicU64>,
}

impl FakeAgent {
    async fn new(rig_api: &rig::ApiServer, node: &str) -> Result<FakeAgent> {
        let client = rig::kube_client(rig_api.node_kubeconfig(node)).await?;
        Ok(FakeAgent {
            api: Api::namespaced_with(client, NS, &node_object::api_resource()),
            node: node.to_string(),
            beats: Default::default(),
        })
    }

    /// Writes a fresh heartbeat with `leases`.
    async fn report(&self, leases: Value) -> Result<()> {
        let beat = self.beats.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        let heartbeat = format!("2026-01-01T00:{:02}:{:02}Z", beat / 60 % 60, beat % 60);
        self.api
            .patch_status(
                &self.node,
                &PatchParams::default(),
                &Patch::Merge(json!({"status": {
                    "heartbeat": heartbeat, "ready": true, "reason": "Ready",
                    "macvlanReady": true, "leases": leases,
                }})),
            )
            .await
            .with_context(|| format!("{} writes its own status", self.node))?;
        Ok(())
    }
}

/// Every agent beats; the one at `holder` reports `leases`, the others none.
async fn report_all(agents: &[FakeAgent], holder: usize, leases: &Value) -> Result<()> {
    for (i, a) in agents.iter().enumerate() {
        a.report(if i == holder {
            leases.clone()
        } else {
            json!([])
        })
        .await?;
    }
    Ok(())
}

fn a_dhcp_service_gets_its_holders_address_and_is_released_on_delete() -> Result<()> {
    let rig = Rig::start(RigOptions {
        guests: 2,
        dhcp: false,
        apiserver: true,
        ..Default::default()
    })?;
    let api = rig.apiserver().expect("rig with API server");
    let nodes: Vec<String> = rig.node_names().to_vec();
    let log = rig.dir().join("controller.log");
    let result = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?
        .block_on(scenario(api, &nodes, &log));
    if result.is_err() {
        eprintln!(
            "controller log:\n{}",
            std::fs::read_to_string(&log).unwrap_or_default()
        );
    }
    result
}

async fn scenario(api: &rig::ApiServer, nodes: &[String], log: &Path) -> Result<()> {
    let admin = rig::kube_client(api.admin_kubeconfig()).await?;
    Api::<Namespace>::all(admin.clone())
        .create(
            &PostParams::default(),
            &from_json(json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NS}})),
        )
        .await?;
    install_crd(&admin).await?;
    let node_api: Api<Node> = Api::all(admin.clone());
    for n in nodes {
        node_api
            .create(
                &PostParams::default(),
                &from_json(json!({"apiVersion": "v1", "kind": "Node", "metadata": {"name": n}})),
            )
            .await?;
    }
    let metrics = format!("127.0.0.1:{}", rig::apiserver::free_port()?);
    let mut controller = start_controller(api.admin_kubeconfig(), log, &metrics)?;
    let lbns: Api<DynamicObject> =
        Api::namespaced_with(admin.clone(), NS, &node_object::api_resource());

    // One object per Node, and a Role that lets the node write its status.
    for n in nodes {
        wait_for(
            &format!("LoadBalancerNode {n}"),
            Duration::from_secs(30),
            || async { Ok(lbns.get_opt(n).await?) },
        )
        .await?;
    }
    let mut agents = Vec::new();
    for n in nodes {
        let agent = FakeAgent::new(api, n).await?;
        wait_for(
            &format!("{n} may write its status"),
            Duration::from_secs(30),
            || {
                let a = agent.clone();
                async move { Ok(a.report(json!([])).await.ok()) }
            },
        )
        .await?;
        agents.push(agent);
    }
    // A node may not write another node's object, nor its own spec.
    let other = &agents[1];
    let denied = other
        .api
        .patch_status(
            &nodes[0],
            &PatchParams::default(),
            &Patch::Merge(json!({"status": {"ready": false}})),
        )
        .await;
    assert!(
        matches!(&denied, Err(kube::Error::Api(e)) if e.code == 403),
        "{denied:?}"
    );
    let denied = other
        .api
        .patch(
            &nodes[1],
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"assignments": []}})),
        )
        .await;
    assert!(
        matches!(&denied, Err(kube::Error::Api(e)) if e.code == 403),
        "{denied:?}"
    );

    // A DHCP Service as the cloud provider leaves it.
    let services: Api<Service> = Api::namespaced(admin.clone(), "default");
    services
        .create(
            &PostParams::default(),
            &from_json(json!({
                "apiVersion": "v1", "kind": "Service",
                "metadata": {"name": "web", "annotations": {"cloudprovider.harvesterhci.io/ipam": "dhcp"}},
                "spec": {"type": "LoadBalancer", "selector": {"app": "web"},
                         "ports": [{"port": 80, "protocol": "TCP", "targetPort": 8080}]},
            })),
        )
        .await?;
    let find_assignment = |lbns: Api<DynamicObject>| async move {
        for o in lbns.list(&Default::default()).await? {
            if let Some(a) = o.data["spec"]["assignments"]
                .as_array()
                .and_then(|l| l.iter().find(|a| a["service"] == "default/web"))
            {
                return Ok(Some((
                    o.metadata.name.clone().unwrap_or_default(),
                    a.clone(),
                )));
            }
        }
        Ok(None)
    };
    // Keep the agents beating while waiting.
    let (holder, assignment) = wait_for("an assignment", Duration::from_secs(30), || {
        let lbns = lbns.clone();
        let agents = agents.clone();
        async move {
            for a in agents.iter() {
                a.report(json!([])).await?;
            }
            find_assignment(lbns).await
        }
    })
    .await?;
    let svc = services.get("web").await?;
    let uid = svc.metadata.uid.clone().unwrap();
    assert!(
        svc.metadata
            .finalizers
            .unwrap_or_default()
            .contains(&hna_contract::FINALIZER.to_string()),
        "finalizer before the assignment"
    );
    let id = hna_contract::AddressIdentity::of(&uid, &Default::default()).unwrap();
    assert_eq!(assignment["interface"], id.interface.as_str());
    assert_eq!(
        assignment["mac"],
        hna_contract::mac::format(&id.mac).as_str()
    );
    assert_eq!(assignment["uid"], uid.as_str());
    assert!(
        svc.status
            .and_then(|s| s.load_balancer)
            .and_then(|l| l.ingress)
            .is_none(),
        "no status before a lease"
    );

    // The holder reports the lease BOUND.
    let ip = "10.77.0.150";
    let bound = json!([{
        "service": "default/web", "interface": id.interface, "state": "BOUND",
        "address": ip, "server": "10.77.0.1", "mac": assignment["mac"],
    }]);
    let holder_idx = nodes.iter().position(|n| *n == holder).unwrap();
    let svc = wait_for(
        "the Service's status and annotations",
        Duration::from_secs(30),
        || {
            let agents = agents.clone();
            let services = services.clone();
            let bound = bound.clone();
            async move {
                for (i, a) in agents.iter().enumerate() {
                    a.report(if i == holder_idx {
                        bound.clone()
                    } else {
                        json!([])
                    })
                    .await?;
                }
                let s = services.get("web").await?;
                let done = s
                    .metadata
                    .annotations
                    .as_ref()
                    .is_some_and(|a| a.contains_key(hna_contract::kube_vip::VIP_HOST));
                Ok(done.then_some(s))
            }
        },
    )
    .await?;
    let status = serde_json::to_value(&svc.status)?;
    assert_eq!(status["loadBalancer"]["ingress"][0]["ip"], ip, "{status}");
    let ann = svc.metadata.annotations.unwrap();
    assert_eq!(ann[hna_contract::kube_vip::REQUESTED_IP], ip);
    assert_eq!(ann[hna_contract::kube_vip::VIP_HOST], holder);
    assert_eq!(
        ann[hna_contract::kube_vip::HWADDR],
        assignment["mac"].as_str().unwrap()
    );
    assert!(
        !ann.contains_key(hna_contract::kube_vip::LOADBALANCER_IPS),
        "never ours to write"
    );

    // Settled: the agents keep beating, the controller writes nothing more
    // (its own output gives it nothing to do).
    let writes = |m: &str| -> u64 {
        m.lines()
            .filter(|l| l.starts_with("hna_controller_writes_total{"))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<u64>().ok())
            .sum()
    };
    let beat_for = |d: Duration| {
        let agents = agents.clone();
        let bound = bound.clone();
        async move {
            let until = Instant::now() + d;
            while Instant::now() < until {
                for (j, a) in agents.iter().enumerate() {
                    a.report(if j == holder_idx {
                        bound.clone()
                    } else {
                        json!([])
                    })
                    .await?;
                }
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
            anyhow::Ok(())
        }
    };
    beat_for(Duration::from_secs(2)).await?;
    let first = writes(&get_metrics(&metrics).await?);
    beat_for(Duration::from_secs(3)).await?;
    let second = writes(&get_metrics(&metrics).await?);
    assert!(first > 0, "the metrics count the writes made");
    assert_eq!(first, second, "writes while nothing changed");

    let events: Api<Event> = Api::namespaced(admin.clone(), "default");
    let reasons: Vec<String> = events
        .list(&Default::default())
        .await?
        .items
        .into_iter()
        .filter(|e| e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some("web"))
        .filter_map(|e| e.reason)
        .collect();
    for r in ["HolderChosen", "AddressAssigned"] {
        assert!(reasons.iter().any(|x| x == r), "{r} in {reasons:?}");
    }

    // Issue #29: the holder stays alive but cannot serve the Service (its
    // lease FAILED): after --service-failed-after the Service moves to the
    // other node, and its events say why.
    let failed = json!([{
        "service": "default/web", "interface": id.interface, "state": "FAILED",
        "mac": assignment["mac"], "message": "injected: no DHCP answer on this uplink",
    }]);
    let other_idx = 1 - holder_idx;
    let other_node = nodes[other_idx].clone();
    wait_for(
        "the Service moved off the node that could not serve it",
        Duration::from_secs(30),
        || {
            let agents = agents.clone();
            let lbns = lbns.clone();
            let failed = failed.clone();
            let other_node = other_node.clone();
            async move {
                report_all(&agents, holder_idx, &failed).await?;
                Ok(find_assignment(lbns)
                    .await?
                    .filter(|(n, _)| *n == other_node)
                    .map(|_| ()))
            }
        },
    )
    .await?;
    let moved: Vec<String> = events
        .list(&Default::default())
        .await?
        .items
        .into_iter()
        .filter(|e| e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some("web"))
        .filter(|e| e.reason.as_deref() == Some("HolderMoved"))
        .filter_map(|e| e.note)
        .collect();
    assert!(
        moved
            .iter()
            .any(|m| m.contains("FAILED") && m.contains(&holder)),
        "{moved:?}"
    );
    let (holder, holder_idx) = (other_node, other_idx);
    // The new holder binds and reports; the Service's record follows it.
    wait_for(
        "the Service's record naming the new holder",
        Duration::from_secs(30),
        || {
            let agents = agents.clone();
            let services = services.clone();
            let bound = bound.clone();
            let holder = holder.clone();
            async move {
                report_all(&agents, holder_idx, &bound).await?;
                let s = services.get("web").await?;
                let on_it = s
                    .metadata
                    .annotations
                    .as_ref()
                    .and_then(|a| a.get(hna_contract::kube_vip::VIP_HOST))
                    .is_some_and(|h| *h == holder);
                Ok(on_it.then_some(()))
            }
        },
    )
    .await?;
    // The move is in the failover histogram (one, from the old holder's
    // loss to the new one's BOUND, within the wait above), and the
    // controller's API requests in theirs.
    let m = get_metrics(&metrics).await?;
    let sample = |prefix: &str| -> Option<f64> {
        m.lines()
            .find(|l| l.starts_with(prefix))
            .and_then(|l| l.rsplit(' ').next()?.parse().ok())
    };
    assert_eq!(
        sample("hna_controller_failover_duration_seconds_count "),
        Some(1.0),
        "{m}"
    );
    let took = sample("hna_controller_failover_duration_seconds_sum ").unwrap();
    assert!(took > 0.0 && took < 30.0 + 10.0, "{took}");
    assert!(
        sample("hna_api_request_duration_seconds_count{verb=\"PATCH\",code=\"2xx\"} ")
            .is_some_and(|n| n >= 1.0),
        "{m}"
    );
    assert!(
        sample("hna_api_request_duration_seconds_count{verb=\"WATCH\",code=\"2xx\"} ")
            .is_some_and(|n| n >= 3.0),
        "{m}"
    );
    assert!(m.contains("\nprocess_cpu_seconds_total "), "{m}");
    // The served Service carries our condition, for its generation.
    let s = services.get("web").await?;
    let ours = s
        .status
        .as_ref()
        .and_then(|st| st.conditions.as_ref())
        .and_then(|c| {
            c.iter()
                .find(|c| c.type_ == hna_contract::SERVICE_CONDITION)
        })
        .cloned();
    let ours = ours.context("no condition of ours on the served Service")?;
    assert_eq!(
        (ours.status.as_str(), ours.reason.as_str()),
        ("True", "AddressAssigned")
    );
    assert_eq!(ours.observed_generation, s.metadata.generation);

    // Delete: release first, the Service goes once the lease is gone.
    services.delete("web", &DeleteParams::default()).await?;
    wait_for(
        "release: true on the holder",
        Duration::from_secs(30),
        || {
            let agents = agents.clone();
            let lbns = lbns.clone();
            let bound = bound.clone();
            let holder = holder.clone();
            async move {
                for (i, a) in agents.iter().enumerate() {
                    a.report(if i == holder_idx {
                        bound.clone()
                    } else {
                        json!([])
                    })
                    .await?;
                }
                let o = lbns.get(&holder).await?;
                let release = o.data["spec"]["assignments"]
                    .as_array()
                    .and_then(|l| l.iter().find(|a| a["service"] == "default/web"))
                    .is_some_and(|a| a["release"] == true);
                Ok(release.then_some(()))
            }
        },
    )
    .await?;
    assert!(
        services.get_opt("web").await?.is_some(),
        "kept until released"
    );
    wait_for(
        "the Service gone after the release",
        Duration::from_secs(30),
        || {
            let agents = agents.clone();
            let services = services.clone();
            async move {
                for a in agents.iter() {
                    a.report(json!([])).await?;
                }
                Ok(services.get_opt("web").await?.is_none().then_some(()))
            }
        },
    )
    .await?;
    let o = lbns.get(&holder).await?;
    assert_eq!(
        o.data["spec"]["assignments"],
        json!([]),
        "assignment dropped"
    );

    // A graceful stop hands the Lease over: the holder is cleared.
    let pid = nix::unistd::Pid::from_raw(controller.0.id() as i32);
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM)?;
    let leases: Api<Lease> = Api::namespaced(admin.clone(), NS);
    wait_for(
        "the Lease released on SIGTERM",
        Duration::from_secs(15),
        || async {
            let l = leases.get(hna_contract::CONTROLLER_LEASE).await?;
            let holder = l.spec.and_then(|s| s.holder_identity);
            Ok(holder.is_none().then_some(()))
        },
    )
    .await?;
    let exited = wait_for("the controller exits", Duration::from_secs(15), || {
        let status = controller.0.try_wait();
        async move { Ok(status?) }
    })
    .await?;
    assert!(exited.success(), "{exited:?}");
    let _restarted = start_controller(
        api.admin_kubeconfig(),
        &log.with_extension("2.log"),
        &metrics,
    )?;

    // A Node that goes takes its object and Role with it.
    node_api.delete(&nodes[1], &DeleteParams::default()).await?;
    wait_for(
        "the deleted node's object gone",
        Duration::from_secs(30),
        || async { Ok(lbns.get_opt(&nodes[1]).await?.is_none().then_some(())) },
    )
    .await?;
    Ok(())
}

/// Carries out `plan` as the leader would, as if it had been decided on
/// `version` of every object it writes.
async fn execute_decided_on(
    edge: &hna_controller::kube_edge::KubeApi,
    namespace: &str,
    plan: hna_controller::reconcile::Plan,
    version: Option<String>,
) -> hna_controller::writer::Outcome {
    let mut memory = hna_controller::writer::Memory::default();
    hna_controller::writer::execute(namespace, &plan, edge, &|| true, &mut memory, &move |_| {
        version.clone()
    })
    .await
}

/// Issue #22: the controller's writes carry the resourceVersion their plan
/// was decided on. A write a deposed leader sent, landing after the new
/// leader's, is one decided on an older version: the real API server
/// refuses it as a conflict and the status stays the new leader's.
fn a_write_decided_on_an_old_version_is_refused() -> Result<()> {
    use hna_contract::ServiceKey;
    use hna_controller::kube_edge::KubeApi;
    use hna_controller::reconcile::{Ingress, Plan, Write};

    let rig = Rig::start(RigOptions {
        guests: 1,
        dhcp: false,
        apiserver: true,
        ..Default::default()
    })?;
    let api = rig.apiserver().expect("rig with API server");
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?
        .block_on(async {
            let admin = rig::kube_client(api.admin_kubeconfig()).await?;
            let services: Api<Service> = Api::namespaced(admin.clone(), "default");
            let created = services
                .create(
                    &PostParams::default(),
                    &from_json(json!({
                        "apiVersion": "v1", "kind": "Service",
                        "metadata": {"name": "web"},
                        "spec": {"type": "LoadBalancer", "ports": [{"port": 80}]}
                    })),
                )
                .await?;
            let decided_on = created.metadata.resource_version.clone().context("rv")?;
            let status = |ip: &str| Plan {
                writes: vec![Write::ServiceStatus {
                    service: ServiceKey {
                        namespace: "default".into(),
                        name: "web".into(),
                    },
                    ingress: vec![Ingress {
                        ip: ip.into(),
                        ip_mode: None,
                        ports: vec![],
                    }],
                    assigned: None,
                }],
                ..Plan::default()
            };
            let edge = KubeApi::new(admin.clone(), "test");
            let write = |plan: Plan, version: String| {
                execute_decided_on(&edge, "default", plan, Some(version))
            };
            // The new leader writes first, on the current version...
            let newer = write(status("10.77.0.160"), decided_on.clone()).await;
            anyhow::ensure!(newer.errors.is_empty() && newer.conflicts == 0, "{newer:?}");
            // ...then the deposed leader's write, decided on the same
            // (now old) version, arrives.
            let late = write(status("10.77.0.150"), decided_on).await;
            anyhow::ensure!(
                late.conflicts == 1,
                "the late write was not refused: {late:?}"
            );
            let now = services.get_status("web").await?;
            let ip = now
                .status
                .and_then(|s| s.load_balancer)
                .and_then(|l| l.ingress)
                .and_then(|i| i.first().and_then(|i| i.ip.clone()));
            anyhow::ensure!(
                ip.as_deref() == Some("10.77.0.160"),
                "the late write landed: ingress {ip:?}"
            );
            Ok(())
        })
}

/// Issue #30 (the scale bench): a node object's spec write is guarded by
/// the object's generation, not its resourceVersion. The node's own status
/// writes (its heartbeat, its leases) move the resourceVersion and, guarded
/// by it, nine spec writes in ten were refused at 500 nodes. On the real
/// API server: a spec write decided before a status write lands; one
/// decided before another spec write (a deposed leader's, late) is refused
/// as a conflict and the newer spec stays.
fn a_nodes_status_does_not_refuse_a_spec_write_but_a_newer_spec_does() -> Result<()> {
    use hna_contract::node_object::{Assignment, Spec};
    use hna_controller::kube_edge::{KubeApi, generation_token};
    use hna_controller::reconcile::{Plan, Write};

    let rig = Rig::start(RigOptions {
        guests: 1,
        dhcp: false,
        apiserver: true,
        ..Default::default()
    })?;
    let api = rig.apiserver().expect("rig with API server");
    let manifests = rig::manifests::load_kustomization(
        &Path::new(env!("CARGO_MANIFEST_DIR")).join("packaging/kubernetes"),
    )?;
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?
        .block_on(async {
            let admin = rig::kube_client(api.admin_kubeconfig()).await?;
            rig::manifests::apply(&admin, &manifests, rig::manifests::Mode::Apply).await?;
            let edge = KubeApi::new(admin.clone(), "test");
            let run =
                |plan: Plan, version: Option<String>| execute_decided_on(&edge, NS, plan, version);
            let spec = |service: &str| Plan {
                writes: vec![Write::SetSpec {
                    node: "guest-1".into(),
                    spec: Spec {
                        assignments: vec![Assignment {
                            service: service.into(),
                            uid: "3f2a9c1e-77b0-4d2e-9a51-0c8d2b6e4f11".into(),
                            interface: "hlb-3f2a9c1e".into(),
                            mac: "02:11:22:33:44:55".into(),
                            ..Assignment::default()
                        }],
                        ..Spec::default()
                    },
                    services: vec![],
                    before: vec![],
                }],
                ..Plan::default()
            };
            let created = run(
                Plan {
                    writes: vec![Write::CreateNodeObject("guest-1".into())],
                    ..Plan::default()
                },
                None,
            )
            .await;
            anyhow::ensure!(created.errors.is_empty(), "{created:?}");
            let lbns: Api<DynamicObject> =
                Api::namespaced_with(admin.clone(), NS, &node_object::api_resource());
            let decided_on = lbns
                .get("guest-1")
                .await?
                .metadata
                .generation
                .context("generation")?;
            // The node writes its status (as it does with every change).
            lbns.patch_status(
                "guest-1",
                &PatchParams::default(),
                &Patch::Merge(json!({"status": {"ready": true, "reason": "Ready"}})),
            )
            .await?;
            let first = run(spec("default/web"), Some(generation_token(decided_on))).await;
            anyhow::ensure!(
                first.errors.is_empty() && first.conflicts == 0,
                "a status write refused the spec write: {first:?}"
            );
            // A write decided on the spec before that one, arriving late.
            let late = run(spec("default/old"), Some(generation_token(decided_on))).await;
            anyhow::ensure!(
                late.conflicts == 1,
                "the late write was not refused: {late:?}"
            );
            let now = lbns.get("guest-1").await?;
            let service = now.data["spec"]["assignments"][0]["service"].clone();
            anyhow::ensure!(
                service == json!("default/web"),
                "the late write landed: {service}"
            );
            Ok(())
        })
}
